//! Design functions planted by a database admin to attack the server (issue 34): thrown values
//! whose description never ends (a `name` getter, a `toJSON` that loops) stopped at the time
//! bound while other databases keep being written; identical design documents of two databases
//! kept apart; view functions that do not compile refused on every write path, as CouchDB
//! refuses them; and a `_changes` filter past the time bound answered with CouchDB's error,
//! before the feed starts or as its last line after.
//!
//! Expected answers are CouchDB 3.4.3's (its source: `couch_mrview:validate`,
//! `couch_query_servers:try_compile`, `couch_os_process`), with the status this server gives a
//! function past a bound (400, docs/bounds.md). Not on the CouchDB backend: pouchdb-server runs
//! its own JavaScript there.

use super::*;

/// Two JavaScript workers, each call bounded at 0.5 s.
pub(super) const TWO_WORKERS_CONFIG: &str = "couchdb_js_timeout_ms = 500\ncouchdb_js_workers = 2\n";
/// One JavaScript worker: every call meets the same runtime.
pub(super) const ONE_WORKER_CONFIG: &str = "couchdb_js_timeout_ms = 500\ncouchdb_js_workers = 1\n";

/// How long any one request may take here: a bound that only a hung worker exceeds.
const PROMPT: Duration = Duration::from_secs(15);

async fn fresh_db(e: &Endpoint, tag: &str) -> Result<String, Failed> {
    fresh_db_named(e, "jsattack", tag).await
}

fn skipped(e: &Endpoint, name: &str) -> bool {
    if e.backend == "couchdb" {
        println!("{name}: skipped on the CouchDB backend (pouchdb-server runs its own JavaScript)");
    }
    e.backend == "couchdb"
}

/// A request that must be answered within [`PROMPT`].
async fn prompt(e: &Endpoint, method: Method, path: &str, body: Option<Value>) -> Result<Answer, Failed> {
    match tokio::time::timeout(PROMPT, e.call(method.clone(), path, body)).await {
        Ok(answer) => answer,
        Err(_) => Err(format!("{method} {path}: no answer within {PROMPT:?}").into()),
    }
}

/// The answer to a function stopped at `couchdb_js_timeout_ms`.
fn timed_out(answer: &Answer, what: &str) -> TestResult {
    check(answer.status == StatusCode::BAD_REQUEST && answer.body["error"] == json!("os_process_error"), || {
        format!("{what}: {} {}", answer.status, answer.body)
    })?;
    check(answer.body["reason"].as_str().is_some_and(|r| r.contains("couchdb_js_timeout_ms")), || {
        format!("{what}: the reason names the bound: {}", answer.body)
    })
}

/// Thrown values whose description never ends: a `name` getter that loops (an Error-like
/// object, described by name and message) and a `toJSON` that loops (written as JSON).
const ENDLESS_GETTER: &str = "{ get name() { while (true) {} }, message: 'm', stack: '' }";
const ENDLESS_TOJSON: &str = "{ toJSON: function () { while (true) {} } }";

/// Finding 1: thrown objects whose `name` getter or `toJSON` loops, planted in a map function,
/// `validate_doc_update` and a filter and triggered more times than there are workers, are
/// stopped at the time bound with CouchDB's error, and writes to another database (whose own
/// validation function needs a worker) answer promptly meanwhile and after.
pub(super) async fn js_endless_thrown_values(e: Endpoint) -> TestResult {
    if skipped(&e, "js_endless_thrown_values") {
        return Ok(());
    }
    let planted = fresh_db(&e, "planted").await?;
    let other = fresh_db(&e, "other").await?;
    e.put(&format!("/{planted}/doc"), json!({"n": 1})).await?.expect(201, "PUT doc")?;
    let ddoc = json!({
        "views": {
            // An InternalError ends a map call; the engine describes it.
            "getter": {"map": format!("function(doc) {{ var e = {ENDLESS_GETTER}; throw e; }}")},
            "tojson": {"map": format!("function(doc) {{ var e = {ENDLESS_TOJSON}; e.name = 'InternalError'; throw e; }}")}
        },
        "filters": {
            "getter": format!("function(doc, req) {{ throw {ENDLESS_GETTER}; }}"),
            "tojson": format!("function(doc, req) {{ throw {ENDLESS_TOJSON}; }}")
        },
        "validate_doc_update": format!("function(newDoc) {{ if (newDoc.kind === 'getter') throw {ENDLESS_GETTER}; if (newDoc.kind === 'tojson') throw {ENDLESS_TOJSON}; }}")
    });
    e.put(&format!("/{planted}/_design/trap"), ddoc).await?.expect(201, "PUT the planted design document")?;
    e.put(
        &format!("/{other}/_design/rules"),
        json!({"validate_doc_update": "function(newDoc) { if (newDoc.bad) throw({forbidden: 'bad'}); }"}),
    )
    .await?
    .expect(201, "PUT the other database's validation")?;

    // Each trap twice at once (two workers), while the other database is written.
    let mut triggers = Vec::new();
    for _ in 0..2 {
        for kind in ["getter", "tojson"] {
            triggers.push((format!("view {kind}"), Method::GET, format!("/{planted}/_design/trap/_view/{kind}"), None));
            triggers.push((
                format!("filter {kind}"),
                Method::GET,
                format!("/{planted}/_changes?filter=trap/{kind}"),
                None,
            ));
            triggers.push((
                format!("validate_doc_update {kind}"),
                Method::POST,
                format!("/{planted}"),
                Some(json!({"kind": kind})),
            ));
        }
    }
    let attacks = futures::future::join_all(
        triggers.iter().map(|(_, method, path, body)| prompt(&e, method.clone(), path, body.clone())),
    );
    let writes = async {
        let mut answers = Vec::new();
        for n in 0..10 {
            answers.push(prompt(&e, Method::PUT, &format!("/{other}/w{n}"), Some(json!({"n": n}))).await);
        }
        answers
    };
    let (attacked, written) = tokio::join!(attacks, writes);
    for ((what, ..), answer) in triggers.iter().zip(attacked) {
        // The view's first trigger builds the index and meets the trap; the others may too.
        timed_out(&answer?, what)?;
    }
    for answer in written {
        answer?.expect(201, "a write to another database meanwhile")?;
    }
    prompt(&e, Method::PUT, &format!("/{other}/after"), Some(json!({"n": 0}))).await?.expect(201, "a write after")?;
    let refused = prompt(&e, Method::PUT, &format!("/{other}/bad"), Some(json!({"bad": true}))).await?;
    check(refused.status == StatusCode::FORBIDDEN, || format!("the other validation still runs: {}", refused.body))
}

/// Finding 2: identical design documents (same id, revision and body) in two databases do not
/// share JavaScript globals: what carol's functions record is not listed by alice's view.
pub(super) async fn js_databases_kept_apart(e: Endpoint) -> TestResult {
    if skipped(&e, "js_databases_kept_apart") {
        return Ok(());
    }
    let carol = fresh_db(&e, "carol").await?;
    let alice = fresh_db(&e, "alice").await?;
    // Written as a replicator would, so both databases hold the very same revision.
    let ddoc = json!({
        "_id": "_design/shared",
        "_rev": "1-0123456789abcdef0123456789abcdef",
        "views": {"seen": {"map": "function(doc) { if (doc.secret) { globalThis.seen = (globalThis.seen || []).concat([doc.secret]); } emit(doc._id, globalThis.seen || []); }"}},
        "filters": {"leaks": "function(doc, req) { if (doc.secret) { globalThis.leaked = true; } return !!globalThis.leaked; }"}
    });
    for db in [&carol, &alice] {
        e.post(&format!("/{db}/_bulk_docs"), json!({"new_edits": false, "docs": [ddoc.clone()]}))
            .await?
            .expect(201, "the shared design document")?;
    }
    for n in 0..3 {
        e.put(&format!("/{carol}/s{n}"), json!({"secret": format!("secret{n}")})).await?.expect(201, "carol's doc")?;
    }
    e.put(&format!("/{alice}/a"), json!({"n": 1})).await?.expect(201, "alice's doc")?;
    let carols = e.get(&format!("/{carol}/_design/shared/_view/seen")).await?.expect(200, "carol's view")?;
    check(carols.body.to_string().contains("secret2"), || format!("carol's view sees her own: {}", carols.body))?;
    e.get(&format!("/{carol}/_changes?filter=shared/leaks")).await?.expect(200, "carol's filter")?;
    let alices = e.get(&format!("/{alice}/_design/shared/_view/seen")).await?.expect(200, "alice's view")?;
    check(!alices.body.to_string().contains("secret"), || {
        format!("alice's view lists carol's secrets: {}", alices.body)
    })?;
    let feed = e.get(&format!("/{alice}/_changes?filter=shared/leaks")).await?.expect(200, "alice's filter")?;
    check(feed.body["results"] == json!([]), || format!("alice's filter sees carol's global: {}", feed.body))
}

/// The reason CouchDB gives a view function that does not compile.
fn compilation_error(answer: &Value, kind: &str, view: &str, what: &str) -> TestResult {
    let prefix = format!("Compilation of the {kind} function in the '{view}' view failed: ");
    check(
        answer["error"] == json!("compilation_error")
            && answer["reason"].as_str().is_some_and(|reason| reason.starts_with(&prefix)),
        || format!("{what}: {answer}"),
    )
}

/// Finding 4: a design document whose view functions do not compile is refused with CouchDB's
/// 400 `compilation_error` on every write path (PUT, `_bulk_docs`, `new_edits=false`, the
/// data-store database), and is not stored; built-in reduces, non-view functions and design
/// documents of other languages are not compiled, as in CouchDB.
pub(super) async fn design_documents_must_compile(e: Endpoint) -> TestResult {
    if skipped(&e, "design_documents_must_compile") {
        return Ok(());
    }
    let db = fresh_db(&e, "compile").await?;
    let syntax = json!({"views": {"v": {"map": "function(doc) { emit(doc._id, ; }"}}});
    let refused = e.put(&format!("/{db}/_design/syntax"), syntax.clone()).await?.expect(400, "PUT a syntax error")?;
    compilation_error(&refused.body, "map", "v", "PUT")?;
    // CouchDB 3.4.3 (its QuickJS engine) answered exactly this.
    let couchdb = "Compilation of the map function in the 'v' view failed: SyntaxError: unexpected token in \
                   expression: ';' (function(doc) { emit(doc._id, ; })";
    check(refused.body["reason"] == json!(couchdb), || format!("CouchDB's reason: {}", refused.body))?;
    e.get(&format!("/{db}/_design/syntax")).await?.expect(404, "the refused design document was not stored")?;

    let number = e.put(&format!("/{db}/_design/number"), json!({"views": {"n": {"map": "42"}}})).await?;
    let number = number.expect(400, "a map that is not a function")?;
    compilation_error(&number.body, "map", "n", "not a function")?;
    check(
        number.body["reason"].as_str().is_some_and(|r| r.ends_with("Expression does not eval to a function. (42)")),
        || format!("CouchDB's text for a source that is not a function: {}", number.body),
    )?;
    let reduce =
        json!({"views": {"r": {"map": "function(doc) { emit(1, 1); }", "reduce": "function(k, v) { return ; ) }"}}});
    let reduce =
        e.put(&format!("/{db}/_design/reduce"), reduce).await?.expect(400, "a reduce that does not compile")?;
    compilation_error(&reduce.body, "reduce", "r", "reduce")?;

    let bulk = e
        .post(&format!("/{db}/_bulk_docs"), json!({"docs": [{"_id": "_design/bulk", "views": syntax["views"]}]}))
        .await?;
    let bulk = bulk.expect(201, "_bulk_docs")?;
    compilation_error(&bulk.body[0], "map", "v", "_bulk_docs row")?;
    e.get(&format!("/{db}/_design/bulk")).await?.expect(404, "the refused bulk row was not stored")?;

    let replicated = json!({"new_edits": false, "docs": [
        {"_id": "_design/replicated", "_rev": "1-0123456789abcdef0123456789abcdef", "views": syntax["views"]}
    ]});
    let replicated = e.post(&format!("/{db}/_bulk_docs"), replicated).await?.expect(201, "replicated _bulk_docs")?;
    check(replicated.body.to_string().contains("compilation_error"), || {
        format!("a replicated design document is compiled too: {}", replicated.body)
    })?;
    e.get(&format!("/{db}/_design/replicated")).await?.expect(404, "the refused replicated revision")?;

    // What CouchDB does not compile on write, and what compiles.
    let fine = json!({
        "views": {"v": {"map": "function(doc) { emit(doc._id, 1); }", "reduce": "_sum"}, "lib": {"x": "exports.y = 1;"}},
        "filters": {"f": "not compiled on write"},
        "validate_doc_update": "function(newDoc) {}"
    });
    e.put(&format!("/{db}/_design/fine"), fine).await?.expect(201, "a design document that compiles")?;
    let other_language = json!({"language": "erlang", "views": {"v": {"map": "fun({Doc}) -> ok end."}}});
    e.put(&format!("/{db}/_design/erlang"), other_language).await?.expect(201, "another language is not compiled")?;
    let copy = e
        .client
        .request(Method::from_bytes(b"COPY").map_err(|err| err.to_string())?, e.url(&format!("/{db}/_design/fine")))
        .header("Destination", "_design/copied")
        .send()
        .await?;
    check(copy.status() == StatusCode::CREATED, || {
        format!("COPY of a design document that compiles: {}", copy.status())
    })?;

    // The data-store database's design documents, kept by this server on these backends.
    let data = e.put(&format!("/{DB}/_design/syntax"), syntax).await?.expect(400, "the data-store database")?;
    compilation_error(&data.body, "map", "v", "the data-store database")
}

/// Reads a streamed answer to its end (within [`PROMPT`]) into `text` as it comes; whether it
/// ended cleanly (not cut).
async fn read_stream(response: reqwest::Response, text: Arc<std::sync::Mutex<String>>) -> Result<bool, Failed> {
    let mut response = response;
    let read = async {
        loop {
            match response.chunk().await {
                Ok(Some(chunk)) => {
                    text.lock().map_err(|_| "poisoned")?.push_str(&String::from_utf8_lossy(&chunk));
                }
                Ok(None) => return Ok::<_, Failed>(true),
                Err(_) => return Ok(false),
            }
        }
    };
    tokio::time::timeout(PROMPT, read).await.map_err(|_| "the feed did not end")?
}

/// Waits until `text` holds `wanted` (within [`PROMPT`]).
async fn wait_for(text: &std::sync::Mutex<String>, wanted: &str) -> TestResult {
    let started = std::time::Instant::now();
    loop {
        let seen = text.lock().map_err(|_| "poisoned")?.clone();
        if seen.contains(wanted) {
            return Ok(());
        }
        if started.elapsed() > PROMPT {
            return Err(format!("{wanted} never came: {seen}").into());
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Finding 5: a `_changes` filter past the time bound is answered with CouchDB's error instead
/// of a cut connection: with its status before the feed starts, and as the feed's last line
/// (with `last_seq` before the failing page) once it has.
pub(super) async fn changes_filter_past_its_time_bound(e: Endpoint) -> TestResult {
    if skipped(&e, "changes_filter_past_its_time_bound") {
        return Ok(());
    }
    let db = fresh_db(&e, "filter").await?;
    let filters = json!({"filters": {"spin": "function(doc, req) { if (doc.spin) { while (true) {} } return true; }"}});
    e.put(&format!("/{db}/_design/f"), filters).await?.expect(201, "PUT the filter")?;
    e.put(&format!("/{db}/calm"), json!({"n": 1})).await?.expect(201, "PUT calm")?;
    e.put(&format!("/{db}/spinner"), json!({"spin": true})).await?.expect(201, "PUT spinner")?;
    for feed in ["normal", "longpoll", "continuous"] {
        let answer = prompt(&e, Method::GET, &format!("/{db}/_changes?feed={feed}&filter=f/spin"), None).await?;
        timed_out(&answer, &format!("feed={feed}, a page that times out before the answer starts"))?;
    }

    // Once the feed has begun: a continuous feed from the end, a calm change, then a spinning one.
    let last = e.get(&format!("/{db}/_changes")).await?.expect(200, "the feed")?.body["last_seq"].clone();
    let last = last.as_str().map_or_else(|| last.to_string(), str::to_owned);
    let url = e.url(&format!("/{db}/_changes?feed=continuous&filter=f/spin&since={last}"));
    let response = e.client.get(url).send().await?;
    check(response.status() == StatusCode::OK, || format!("a feed from the end: {}", response.status()))?;
    let text = Arc::new(std::sync::Mutex::new(String::new()));
    let reader = tokio::spawn(read_stream(response, Arc::clone(&text)));
    e.put(&format!("/{db}/calm2"), json!({"n": 2})).await?.expect(201, "PUT calm2")?;
    // The spinning change on a later page than the calm one (a feed's page may hold both).
    wait_for(&text, "calm2").await?;
    e.put(&format!("/{db}/spinner2"), json!({"spin": true})).await?.expect(201, "PUT spinner2")?;
    let clean = reader.await.map_err(|err| err.to_string())??;
    let text = text.lock().map_err(|_| "poisoned")?.clone();
    check(clean, || format!("the feed was cut instead of ending: {text}"))?;
    let lines: Vec<Value> =
        text.lines().filter(|l| !l.trim().is_empty()).filter_map(|l| serde_json::from_str(l).ok()).collect();
    check(lines.iter().any(|line| line["id"] == json!("calm2")), || format!("the calm change came first: {text}"))?;
    let last_line = lines.last().cloned().unwrap_or(Value::Null);
    check(last_line["error"] == json!("os_process_error"), || format!("the feed ends with CouchDB's error: {text}"))?;
    check(last_line["reason"].as_str().is_some_and(|r| r.contains("couchdb_js_timeout_ms")), || {
        format!("the last line names the bound: {text}")
    })
}
