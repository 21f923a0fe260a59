//! Unit tests of the JavaScript engine: CouchDB's API as functions see it, the bounds, the
//! pool, and a printed (not asserted) throughput of a trivial map.

use std::sync::Arc;
use std::time::{Duration, Instant};

use serde_json::{json, Value};

use super::log::{
    bounded_line, DEFAULT_DATABASE_LOG_BYTES_PER_MINUTE as DATABASE_LOG_BYTES_PER_MINUTE,
    DEFAULT_LOG_LINE_BYTES as LOG_LINE_BYTES,
};
use super::worker::{couch_function_source, replace_lone_surrogates};
use super::*;

fn limits() -> JsLimits {
    JsLimits {
        call_timeout: Duration::from_secs(5),
        memory_bytes: 32 << 20,
        stack_bytes: 1 << 20,
        workers: 1,
        queue: 16,
        cached_design_docs: 4,
        reduce_limit: ReduceLimit::Refuse,
        map_answer_bytes: usize::MAX,
        map_call_bytes: usize::MAX,
        log: LogLimits::default(),
    }
}

fn engine() -> JsEngine {
    JsEngine::new(limits()).expect("engine starts")
}

fn design(doc: Value) -> DesignCode {
    let id = doc["_id"].as_str().unwrap_or("_design/test").to_owned();
    DesignCode::new("db", id, "1-a", Arc::new(doc))
}

fn docs(values: Vec<Value>) -> Vec<Arc<Value>> {
    values.into_iter().map(Arc::new).collect()
}

fn views(names: &[&str]) -> Vec<String> {
    names.iter().map(|n| (*n).to_owned()).collect()
}

fn rows(pairs: Vec<(Value, Value)>) -> ViewRows {
    ViewRows::Emitted(pairs)
}

/// The rows of one view for one document, or a panic naming what came instead.
fn emitted(outcome: &MapOutcome, view: usize) -> &Vec<(Value, Value)> {
    match &outcome.views[view] {
        ViewRows::Emitted(rows) => rows,
        other => panic!("view {view} did not emit: {other:?}"),
    }
}

#[tokio::test]
async fn map_emits_rows_in_order_one_list_per_view() {
    let ddoc = design(json!({
        "_id": "_design/app",
        "views": {
            "by_tag": {"map": "  // tags, one row each\n function (doc) {\n  for (var i = 0; i < doc.tags.length; i++) emit(doc.tags[i], i);\n};\n"},
            "by_id": {"map": "/* ids */ function(doc) { emit(doc._id, null); emit([doc._id, 2], {n: doc.n}); }"},
            "none": {"map": "function(doc) { if (doc.never) emit(1, 1); }"}
        }
    }));
    let out = engine()
        .map(
            &ddoc,
            &views(&["by_id", "by_tag", "none"]),
            docs(vec![json!({"_id": "a", "n": 1, "tags": ["z", "y", "x"]}), json!({"_id": "b", "n": 2.5, "tags": []})]),
        )
        .await
        .expect("map runs");
    assert_eq!(out.len(), 2);
    assert_eq!(
        out[0].views,
        vec![
            rows(vec![(json!("a"), Value::Null), (json!(["a", 2]), json!({"n": 1}))]),
            rows(vec![(json!("z"), json!(0)), (json!("y"), json!(1)), (json!("x"), json!(2))]),
            rows(vec![]),
        ]
    );
    assert_eq!(
        out[1].views,
        vec![rows(vec![(json!("b"), Value::Null), (json!(["b", 2]), json!({"n": 2.5}))]), rows(vec![]), rows(vec![]),]
    );
}

#[tokio::test]
async fn a_throw_skips_only_that_document_in_that_view() {
    let ddoc = design(json!({
        "views": {
            "fragile": {"map": "function(doc) { emit(doc.inner.value, 1); }"},
            "sturdy": {"map": "function(doc) { emit(doc._id, 1); }"},
            "objects": {"map": "function(doc) { if (doc._id == 'b') throw {not: 'an error'}; emit(1, 1); }"}
        }
    }));
    let out = engine()
        .map(
            &ddoc,
            &views(&["fragile", "sturdy", "objects"]),
            docs(vec![
                json!({"_id": "a", "inner": {"value": "v"}}),
                json!({"_id": "b"}),
                json!({"_id": "c", "inner": {"value": "w"}}),
            ]),
        )
        .await
        .expect("map runs");
    assert_eq!(emitted(&out[0], 0), &vec![(json!("v"), json!(1))]);
    match &out[1].views[0] {
        ViewRows::Threw(message) => {
            assert!(message.contains("TypeError"), "{message}");
            assert!(message.contains("doc._id b"), "{message}");
        }
        other => panic!("expected a throw, got {other:?}"),
    }
    assert_eq!(emitted(&out[1], 1), &vec![(json!("b"), json!(1))]);
    match &out[1].views[2] {
        ViewRows::Threw(message) => assert!(message.contains(r#"{"not":"an error"}"#), "{message}"),
        other => panic!("expected a throw, got {other:?}"),
    }
    assert_eq!(emitted(&out[2], 0), &vec![(json!("w"), json!(1))]);
}

#[tokio::test]
async fn fatal_error_ends_the_map_call() {
    let ddoc = design(json!({"views": {"v": {"map": "function(doc) { throw 'fatal_error'; }"}}}));
    let err =
        engine().map(&ddoc, &views(&["v"]), docs(vec![json!({"_id": "a"})])).await.expect_err("fatal_error aborts");
    assert_eq!(
        err,
        JsError::Thrown { error: "map_runtime_error".into(), message: "function raised 'fatal_error'".into() }
    );
}

#[tokio::test]
async fn require_reads_views_lib_nested_relative_and_cached() {
    let ddoc = design(json!({
        "views": {
            "lib": {
                "counter": "globalThis.loads = (globalThis.loads || 0) + 1; exports.loads = function() { return globalThis.loads; };",
                "math": {
                    "double": "var base = require('./base'); exports.double = function(x) { return base.times(x, 2); };",
                    "base": "exports.times = function(a, b) { return a * b; };",
                    "up": "module.exports = require('../counter');"
                },
                "broken": "throw new Error('bad module');"
            },
            "uses": {"map": "function(doc) { var m = require('views/lib/math/double'); var c = require('views/lib/counter'); var u = require('views/lib/math/up'); emit(m.double(doc.n), [c.loads(), u === c]); }"},
            "missing": {"map": "function(doc) { require('views/lib/nothing'); emit(1, 1); }"},
            "outside": {"map": "function(doc) { require('validate_doc_update'); emit(1, 1); }"},
            "broken": {"map": "function(doc) { require('views/lib/broken'); emit(1, 1); }"}
        },
        "validate_doc_update": "function() {}"
    }));
    let out = engine()
        .map(
            &ddoc,
            &views(&["uses", "missing", "outside", "broken"]),
            docs(vec![json!({"_id": "a", "n": 3}), json!({"_id": "b", "n": 5})]),
        )
        .await
        .expect("map runs");
    // The counter module ran once for both documents, and '../counter' is the same module.
    assert_eq!(emitted(&out[0], 0), &vec![(json!(6), json!([1, true]))]);
    assert_eq!(emitted(&out[1], 0), &vec![(json!(10), json!([1, true]))]);
    for outcome in &out {
        for view in [1, 2] {
            match &outcome.views[view] {
                ViewRows::Threw(message) => {
                    assert!(message.contains("invalid_require_path"), "{message}")
                }
                other => panic!("expected a require error, got {other:?}"),
            }
        }
        match &outcome.views[3] {
            ViewRows::Threw(message) => {
                assert!(message.contains("compilation_error"), "{message}");
                assert!(message.contains("bad module"), "{message}");
            }
            other => panic!("expected a module error, got {other:?}"),
        }
    }
}

#[tokio::test]
async fn ddoc_functions_require_from_the_whole_design_document() {
    let ddoc = design(json!({
        "helpers": {"rules": "exports.allowed = function(doc) { return doc.kind === 'ok'; };"},
        "filters": {"by_rule": "function(doc, req) { return require('helpers/rules').allowed(doc); }"}
    }));
    let passed = engine()
        .filter(&ddoc, "by_rule", docs(vec![json!({"kind": "ok"}), json!({"kind": "no"})]), &json!({}))
        .await
        .expect("filter runs");
    assert_eq!(passed, vec![true, false]);
}

#[tokio::test]
async fn compile_errors_name_the_function() {
    let ddoc = design(json!({
        "views": {
            "syntax": {"map": "function(doc) { emit(doc._id, ; }"},
            "number": {"map": "42"},
            "named": {"map": "function byId(doc) { emit(doc._id, null); }"},
            "object": {"map": {"not": "a string"}},
            "ok": {"map": "function(doc) { emit(1, 1); }"}
        }
    }));
    let engine = engine();
    let one = docs(vec![json!({"_id": "a"})]);
    for view in ["syntax", "number", "named", "object"] {
        match engine.map(&ddoc, &views(&[view]), one.clone()).await {
            Err(JsError::Compile { function, .. }) => {
                assert_eq!(function, format!("views.{view}.map"))
            }
            other => panic!("{view}: expected a compile error, got {other:?}"),
        }
    }
    match engine.map(&ddoc, &views(&["absent"]), one.clone()).await {
        Err(JsError::Missing { function }) => assert_eq!(function, "views.absent.map"),
        other => panic!("expected a missing function, got {other:?}"),
    }
    // The realm is still good after the failures.
    let out = engine.map(&ddoc, &views(&["ok"]), one).await.expect("map");
    assert_eq!(emitted(&out[0], 0), &vec![(json!(1), json!(1))]);
}

#[test]
fn sources_compile_as_couchdb_reads_them() {
    assert_eq!(couch_function_source("function(doc){}"), "0,function(doc){}");
    assert_eq!(couch_function_source(" // c\n/* d */ function (doc) {};"), " // c\n/* d */ 0,function (doc) {};");
    assert_eq!(couch_function_source("function f(doc){}"), "function f(doc){}");
    assert_eq!(couch_function_source("functional(1)"), "functional(1)");
    assert_eq!(couch_function_source("(function(doc){})"), "(function(doc){})");
}

#[tokio::test]
async fn strings_cross_as_utf8_and_lone_surrogates_become_replacement_characters() {
    let ddoc = design(json!({"views": {"v": {"map": "function(doc) {
        emit(doc.value.split('').reverse().join(''), doc.word.toLowerCase());
        emit(doc.word.length, doc.word.substring(1, 3));
    }"}}}));
    let out = engine()
        .map(&ddoc, &views(&["v"]), docs(vec![json!({"_id": "a", "value": "\u{1F4A5}", "word": "ÄÜö"})]))
        .await
        .expect("map runs");
    assert_eq!(emitted(&out[0], 0), &vec![(json!("\u{FFFD}\u{FFFD}"), json!("äüö")), (json!(3), json!("Üö"))]);
}

#[test]
fn log_lines_are_bounded_on_a_character_boundary() {
    assert_eq!(bounded_line("short", 4096), ("short", false));
    let long = "é".repeat(5000);
    let (kept, cut) = bounded_line(&long, 4096);
    assert!(cut);
    assert_eq!(kept.len(), 4096);
    assert!(long.starts_with(kept));
}

#[test]
fn lone_surrogate_escapes_are_replaced_and_pairs_kept() {
    assert_eq!(replace_lone_surrogates(r#"["\ud83d\udca5"]"#), r#"["\ud83d\udca5"]"#);
    assert_eq!(replace_lone_surrogates(r#"["\udca5\ud83d"]"#), r#"["\ufffd\ufffd"]"#);
    assert_eq!(replace_lone_surrogates(r#"["\\ud83d", "\ud83dx"]"#), r#"["\\ud83d", "\ufffdx"]"#);
}

#[tokio::test]
async fn helpers_sum_tojson_isarray_log_and_frozen_documents() {
    let ddoc = design(json!({
        "views": {"v": {"map": "function(doc) {
            log('plain line'); log({an: 'object'}); log(new Error('boom'));
            emit('sum', sum(doc.values));
            emit('toJSON', toJSON({a: [1, 'b']}));
            emit('isArray', [isArray(doc.values), isArray(doc), isArray('x')]);
            try { undefined_function(); } catch (e) { emit('error', e); }
            doc.values = 'changed';
            emit('frozen', doc.values);
        }"}}
    }));
    let out = engine()
        .map(&ddoc, &views(&["v"]), docs(vec![json!({"_id": "a", "values": [1, 2, 3.5]})]))
        .await
        .expect("map runs");
    let got = emitted(&out[0], 0);
    assert_eq!(got[0], (json!("sum"), json!(6.5)));
    assert_eq!(got[1], (json!("toJSON"), json!(r#"{"a":[1,"b"]}"#)));
    assert_eq!(got[2], (json!("isArray"), json!([true, false, false])));
    assert_eq!(got[3].0, json!("error"));
    assert_eq!(got[3].1["error"], json!("ReferenceError"));
    assert!(got[3].1["message"].is_string());
    assert_eq!(got[4], (json!("frozen"), json!([1, 2, 3.5])));
}

#[tokio::test]
async fn no_file_system_network_timers_or_libc_modules() {
    let ddoc = design(json!({
        "views": {
            "globals": {"map": "function(doc) {
                var names = ['std', 'os', 'require_fs', 'setTimeout', 'setInterval', 'fetch', 'XMLHttpRequest',
                             'print', 'readline', 'scriptArgs', 'process', 'Deno', 'evalcx', 'gc', 'Proxy', 'Promise'];
                var out = {};
                for (var i = 0; i < names.length; i++) out[names[i]] = typeof globalThis[names[i]];
                emit('globals', out);
                emit('present', [typeof JSON, typeof Math, typeof Date, typeof RegExp, typeof Map, typeof eval, String(2n ** 70n)]);
            }"},
            "fs": {"map": "function(doc) { emit('fs', typeof require('fs')); }"}
        }
    }));
    let out = engine().map(&ddoc, &views(&["globals", "fs"]), docs(vec![json!({"_id": "a"})])).await.expect("map runs");
    let got = emitted(&out[0], 0);
    let globals = got[0].1.as_object().expect("an object");
    for (name, kind) in globals {
        assert_eq!(kind, "undefined", "{name} is reachable");
    }
    assert_eq!(
        got[1].1,
        json!(["object", "object", "function", "function", "function", "function", "1180591620717411303424"])
    );
    match &out[0].views[1] {
        ViewRows::Threw(message) => assert!(message.contains("invalid_require_path"), "{message}"),
        other => panic!("require('fs') answered {other:?}"),
    }
}

#[tokio::test]
async fn design_documents_do_not_see_each_others_globals() {
    let tamper = design(json!({
        "_id": "_design/tamper",
        "views": {"v": {"map": "function(doc) { Array.prototype.push = function() { return 0; }; globalThis.secret = 1; JSON.stringify = function() { return '[]'; }; emit(1, 1); }"}}
    }));
    let victim = design(json!({
        "_id": "_design/victim",
        "views": {"v": {"map": "function(doc) { var a = []; a.push(1); emit(typeof secret, a.length); }"}}
    }));
    let engine = engine();
    let one = docs(vec![json!({"_id": "a"})]);
    engine.map(&tamper, &views(&["v"]), one.clone()).await.expect("tamper runs");
    let out = engine.map(&victim, &views(&["v"]), one).await.expect("victim runs");
    assert_eq!(emitted(&out[0], 0), &vec![(json!("undefined"), json!(1))]);
}

#[tokio::test]
async fn compiled_code_is_keyed_by_content_not_only_id_and_rev() {
    let first = DesignCode::new(
        "db",
        "_design/same",
        "1-a",
        Arc::new(json!({"views": {"v": {"map": "function(doc) { emit('first', 1); }"}}})),
    );
    let second = DesignCode::new(
        "db",
        "_design/same",
        "1-a",
        Arc::new(json!({"views": {"v": {"map": "function(doc) { emit('second', 1); }"}}})),
    );
    let engine = engine();
    let one = docs(vec![json!({"_id": "a"})]);
    let a = engine.map(&first, &views(&["v"]), one.clone()).await.expect("map");
    let b = engine.map(&second, &views(&["v"]), one).await.expect("map");
    assert_eq!(emitted(&a[0], 0)[0].0, json!("first"));
    assert_eq!(emitted(&b[0], 0)[0].0, json!("second"));
}

#[tokio::test]
async fn identical_design_documents_of_two_databases_do_not_share_globals() {
    let ddoc = json!({"_id": "_design/same", "views": {"v": {"map":
        "function(doc) { if (doc.secret) { globalThis.seen = (globalThis.seen || []).concat([doc.secret]); } emit(doc._id, globalThis.seen || null); }"
    }}});
    let alice = DesignCode::new("alice", "_design/same", "1-a", Arc::new(ddoc.clone()));
    let carol = DesignCode::new("carol", "_design/same", "1-a", Arc::new(ddoc));
    let engine = engine();
    engine.map(&carol, &views(&["v"]), docs(vec![json!({"_id": "c", "secret": "secret0"})])).await.expect("carol maps");
    let out = engine.map(&alice, &views(&["v"]), docs(vec![json!({"_id": "a"})])).await.expect("alice maps");
    assert_eq!(emitted(&out[0], 0), &vec![(json!("a"), Value::Null)], "alice sees none of carol's globals");
    let again = engine.map(&carol, &views(&["v"]), docs(vec![json!({"_id": "d"})])).await.expect("carol maps");
    assert_eq!(emitted(&again[0], 0), &vec![(json!("d"), json!(["secret0"]))], "carol keeps her own");
}

/// Thrown values whose description never ends: a `name` or `message` getter, or a `toJSON`,
/// that loops. Describing them is part of the call and bounded by its timeout.
const ENDLESS_THROWS: [&str; 3] = [
    "{ get name() { while (true) {} }, message: 'm', stack: '' }",
    "{ name: 'E', get message() { while (true) {} }, stack: '' }",
    "{ toJSON: function() { while (true) {} } }",
];

#[tokio::test]
async fn a_thrown_value_whose_description_never_ends_is_stopped_at_the_time_bound() {
    let limit = Duration::from_millis(300);
    let engine = JsEngine::new(JsLimits { call_timeout: limit, ..limits() }).expect("engine");
    let one = docs(vec![json!({"_id": "a"})]);
    let user_ctx = json!({"name": null, "roles": []});
    // Without the bound the worker never answers: the test fails at this wait instead of hanging.
    let wait = limit * 40;
    for thrown in ENDLESS_THROWS {
        let ddoc = design(json!({
            "views": {
                // An InternalError ends a map call (as CouchDB's fatal errors do) and is described
                // by the engine.
                "fatal": {"map": format!("function(doc) {{ var e = {thrown}; e.name = 'InternalError'; throw e; }}")},
                "ok": {"map": "function(doc) { emit(doc._id, 1); }"}
            },
            "validate_doc_update": format!("function(n, o, u, s) {{ throw {thrown}; }}"),
            "filters": {"f": format!("function(doc, req) {{ throw {thrown}; }}")}
        }));
        let (new_doc, empty, fatal) = (json!({"_id": "x"}), json!({}), views(&["fatal"]));
        let validated = tokio::time::timeout(wait, engine.validate(&ddoc, &new_doc, None, &user_ctx, &empty));
        let validated = validated.await.map(|outcome| outcome.map(|_| ()));
        let filtered = tokio::time::timeout(wait, engine.filter(&ddoc, "f", one.clone(), &empty));
        let filtered = filtered.await.map(|outcome| outcome.map(|_| ()));
        let mapped = tokio::time::timeout(wait, engine.map(&ddoc, &fatal, one.clone()));
        let mapped = mapped.await.map(|outcome| outcome.map(|_| ()));
        for (what, outcome) in [("validate", validated), ("filter", filtered), ("map", mapped)] {
            assert!(matches!(outcome, Ok(Err(JsError::Timeout { .. }))), "{what} of {thrown}: {outcome:?}");
        }
        let ok = views(&["ok"]);
        let out = tokio::time::timeout(wait, engine.map(&ddoc, &ok, one.clone()))
            .await
            .expect("the worker answers")
            .expect("the next call runs");
        assert_eq!(emitted(&out[0], 0), &vec![(json!("a"), json!(1))]);
    }
}

#[tokio::test]
async fn log_lines_are_cut_and_each_database_is_held_to_its_log_budget() {
    let engine = engine();
    // A map function logging `lines` lines of 16 KiB each for its document.
    let logging = |database: &str, lines: usize| {
        let map = format!(
            "function(doc) {{ var line = 'x'.repeat(16384); for (var i = 0; i < {lines}; i++) log(line); emit(doc._id, 1); }}"
        );
        DesignCode::new(database, "_design/loud", "1-a", Arc::new(json!({"views": {"v": {"map": map}}})))
    };
    // Each call logs 64 MiB, far past the budget of its database.
    let loud = |database: &str| logging(database, 4096);
    let one = docs(vec![json!({"_id": "a"})]);
    engine.map(&loud("first"), &views(&["v"]), one.clone()).await.expect("the map runs");
    let first = engine.logged_bytes();
    // Lines are cut to 4 KiB, and the database's lines stop at its budget (plus refill while
    // the call ran, on a slow machine at most a few seconds of it).
    assert!(first <= DATABASE_LOG_BYTES_PER_MINUTE + DATABASE_LOG_BYTES_PER_MINUTE / 4, "{first} bytes logged");
    assert!(first >= DATABASE_LOG_BYTES_PER_MINUTE / 2, "{first} bytes logged");
    // Another database has a budget of its own.
    engine.map(&loud("second"), &views(&["v"]), one.clone()).await.expect("the map runs");
    let second = engine.logged_bytes() - first;
    assert!(second >= DATABASE_LOG_BYTES_PER_MINUTE / 2, "{second} bytes logged");
    // A few long lines, well within every budget: each is written cut to LOG_LINE_BYTES (the
    // budgets above would hold uncut lines too).
    engine.map(&logging("few", 4), &views(&["v"]), one).await.expect("the map runs");
    let few = engine.logged_bytes() - first - second;
    assert_eq!(few, 4 * LOG_LINE_BYTES as u64, "4 lines of 16 KiB logged as {few} bytes");
}

/// The log bounds are the engine's `JsLimits::log` (the settings `couchdb_js_log_*`,
/// `config::tests::the_js_log_settings_reach_the_engine_s_limits`): an engine with small ones
/// cuts a line at its line bound and holds each database, and all of them together, to their
/// budgets; the map is answered whatever its functions log.
#[tokio::test]
async fn the_log_bounds_are_taken_from_the_settings() {
    let log = LogLimits { line_bytes: 64, database_bytes_per_minute: 1000, server_bytes_per_minute: 1500 };
    let limits = JsLimits { workers: 1, queue: 64, log, ..JsLimits::default() };
    let engine = JsEngine::new(limits).expect("engine");
    let logs = |database: &str, lines: usize| {
        let source =
            format!("function(doc) {{ for (var i = 0; i < {lines}; i++) log('x'.repeat(1000)); emit(doc._id, 1); }}");
        DesignCode::new(database, "_design/logs", "1-a", Arc::new(json!({"views": {"v": {"map": source}}})))
    };
    let one = docs(vec![json!({"_id": "a"})]);
    // One line of 1,000 characters: cut to the setting's 64 bytes.
    let out = engine.map(&logs("first", 1), &views(&["v"]), one.clone()).await.expect("the map runs");
    assert_eq!(emitted(&out[0], 0), &vec![(json!("a"), json!(1))]);
    assert_eq!(engine.logged_bytes(), 64, "one line cut at couchdb_js_log_line_bytes");
    // 100 more lines (6,400 bytes): the database stops at its 1,000 bytes a minute (plus the
    // refill of the seconds a loaded machine takes, about 17 bytes a second); the map is answered.
    let out = engine.map(&logs("first", 100), &views(&["v"]), one.clone()).await.expect("the map runs");
    assert_eq!(emitted(&out[0], 0), &vec![(json!("a"), json!(1))]);
    let first = engine.logged_bytes();
    assert!((900..=1200).contains(&first), "{first} bytes logged by one database");
    // Another database has a budget of its own, but the server's 1,500 bytes bound both.
    engine.map(&logs("second", 100), &views(&["v"]), one).await.expect("the map runs");
    let both = engine.logged_bytes();
    assert!(both > first && both <= 1700, "{both} bytes logged by two databases");
}

#[tokio::test]
async fn an_infinite_loop_is_stopped_and_the_engine_keeps_serving() {
    let limit = Duration::from_millis(300);
    let engine = JsEngine::new(JsLimits { call_timeout: limit, ..limits() }).expect("engine");
    let ddoc = design(json!({"views": {
        "spin": {"map": "function(doc) { while (true) {} }"},
        "catches": {"map": "function(doc) { try { while (true) {} } catch (e) { emit('caught', 1); } }"},
        "ok": {"map": "function(doc) { emit(doc._id, 1); }"}
    }}));
    let one = docs(vec![json!({"_id": "a"})]);
    for view in ["spin", "catches"] {
        let started = Instant::now();
        let err = engine.map(&ddoc, &views(&[view]), one.clone()).await.expect_err("the loop is stopped");
        assert_eq!(err, JsError::Timeout { limit });
        // Stopped near the limit, not at some later point (a bound on correctness, generous
        // for a loaded machine).
        assert!(started.elapsed() < limit * 20, "{:?}", started.elapsed());
    }
    let out = engine.map(&ddoc, &views(&["ok"]), one).await.expect("the next call runs");
    assert_eq!(emitted(&out[0], 0), &vec![(json!("a"), json!(1))]);
}

#[tokio::test]
async fn a_memory_bomb_is_stopped_and_the_engine_keeps_serving() {
    let engine = JsEngine::new(JsLimits { memory_bytes: 16 << 20, call_timeout: Duration::from_secs(60), ..limits() })
        .expect("engine");
    let ddoc = design(json!({"views": {
        "bomb": {"map": "function(doc) { var all = []; while (true) all.push('x'.repeat(4096) + all.length); }"},
        "string": {"map": "function(doc) { var s = 'r'; while (s.length < (64 << 20)) s = s + s; emit(1, JSON.stringify([s, s, s, s]).length); }"},
        "ok": {"map": "function(doc) { emit(doc._id, 1); }"}
    }}));
    let one = docs(vec![json!({"_id": "a"})]);
    for view in ["bomb", "string"] {
        let err = engine.map(&ddoc, &views(&[view]), one.clone()).await.expect_err("the bomb is stopped");
        assert_eq!(err, JsError::OutOfMemory { limit: 16 << 20 }, "{view}");
    }
    let out = engine.map(&ddoc, &views(&["ok"]), one).await.expect("the next call runs");
    assert_eq!(emitted(&out[0], 0), &vec![(json!("a"), json!(1))]);
}

#[tokio::test]
async fn deep_recursion_is_stopped() {
    let ddoc = design(json!({"views": {
        "deep": {"map": "function(doc) { function down(n) { return down(n + 1) + 1; } emit(down(0), 1); }"},
        "shallow": {"map": "function(doc) { function down(n) { return n == 0 ? 0 : down(n - 1) + 1; } emit(down(200), 1); }"}
    }}));
    let engine = engine();
    let one = docs(vec![json!({"_id": "a"})]);
    let err = engine.map(&ddoc, &views(&["deep"]), one.clone()).await.expect_err("the recursion is stopped");
    assert_eq!(err, JsError::StackOverflow);
    let out = engine.map(&ddoc, &views(&["shallow"]), one).await.expect("the next call runs");
    assert_eq!(emitted(&out[0], 0), &vec![(json!(200), json!(1))]);
}

#[tokio::test]
async fn validate_doc_update_allows_forbids_and_refuses() {
    let ddoc = design(json!({
        "_id": "_design/rules",
        "owner_field": "author",
        "validate_doc_update": "function(newDoc, oldDoc, userCtx, secObj) {
            if (!userCtx.name) throw({unauthorized: 'log in first'});
            if (secObj.members.names.indexOf(userCtx.name) < 0) throw({forbidden: 'not a member of ' + userCtx.db});
            if (oldDoc && oldDoc[this.owner_field] !== userCtx.name) throw({forbidden: 'not yours'});
            if (newDoc.shout) throw('a plain string');
            if (newDoc.other) throw({other_kind: 'other'});
            if (newDoc.error) throw new TypeError('an error object');
        }"
    }));
    let engine = engine();
    let sec = json!({"members": {"names": ["ann"], "roles": []}, "admins": {}});
    let ann = json!({"name": "ann", "roles": [], "db": "things"});
    let bob = json!({"name": "bob", "roles": [], "db": "things"});
    let nobody = json!({"name": null, "roles": [], "db": "things"});
    let doc = json!({"_id": "d", "author": "ann"});
    let check = |user: Value, new_doc: Value, old: Option<Value>| {
        let engine = engine.clone();
        let ddoc = ddoc.clone();
        let sec = sec.clone();
        async move { engine.validate(&ddoc, &new_doc, old.as_ref(), &user, &sec).await }
    };
    assert_eq!(check(ann.clone(), doc.clone(), None).await, Ok(Validation::Allowed));
    assert_eq!(check(ann.clone(), doc.clone(), Some(doc.clone())).await, Ok(Validation::Allowed));
    assert_eq!(check(nobody, doc.clone(), None).await, Ok(Validation::Unauthorized(json!("log in first"))));
    assert_eq!(check(bob.clone(), doc.clone(), None).await, Ok(Validation::Forbidden(json!("not a member of things"))));
    let theirs = json!({"_id": "d", "author": "carol"});
    assert_eq!(check(ann.clone(), doc.clone(), Some(theirs)).await, Ok(Validation::Forbidden(json!("not yours"))));
    assert_eq!(
        check(ann.clone(), json!({"shout": true}), None).await,
        Ok(Validation::UnknownError(json!("a plain string")))
    );
    assert_eq!(check(ann.clone(), json!({"other": true}), None).await, Ok(Validation::UnknownError(json!("other"))));
    assert_eq!(
        check(ann, json!({"error": true}), None).await,
        Err(JsError::Thrown { error: "TypeError".into(), message: "an error object".into() })
    );
}

#[tokio::test]
async fn filters_see_the_request_and_view_filters_see_emits() {
    let ddoc = design(json!({
        "filters": {
            "by_type": "function(doc, req) { return doc.type == req.query.type; }",
            "truthy": "function(doc, req) { return doc.n; }",
            "throws": "function(doc, req) { return doc.missing.field; }"
        },
        "views": {"typed": {"map": "function(doc) { if (doc.type) emit(doc.type, null); }"}}
    }));
    let engine = engine();
    let batch = docs(vec![
        json!({"_id": "a", "type": "post", "n": 0}),
        json!({"_id": "b", "type": "comment", "n": 2}),
        json!({"_id": "c"}),
    ]);
    let req = json!({"query": {"type": "post"}, "userCtx": {"name": null, "roles": []}});
    assert_eq!(engine.filter(&ddoc, "by_type", batch.clone(), &req).await.expect("filter"), vec![true, false, false]);
    assert_eq!(engine.filter(&ddoc, "truthy", batch.clone(), &req).await.expect("filter"), vec![false, true, false]);
    assert!(matches!(
        engine.filter(&ddoc, "throws", batch.clone(), &req).await,
        Err(JsError::Thrown { ref error, .. }) if error == "TypeError"
    ));
    assert_eq!(engine.filter_view(&ddoc, "typed", batch).await.expect("view filter"), vec![true, true, false]);
}

#[tokio::test]
async fn reduce_and_rereduce() {
    let ddoc = design(json!({"views": {
        "stats": {
            "map": "function(doc) { emit(doc.k, doc.v); }",
            "reduce": "function(keys, values, rereduce) {
                if (rereduce) return {n: sum(values.map(function(r) { return r.n; })), total: sum(values.map(function(r) { return r.total; })), keys: null};
                return {n: values.length, total: sum(values), keys: keys};
            }"
        },
        "broken": {"map": "function(doc) {}", "reduce": "function(keys, values) { return values.nope.length; }"}
    }}));
    let engine = engine();
    let reduced = engine
        .reduce(&ddoc, "stats", vec![(json!(["x", "doc1"]), json!(2)), (json!(["y", "doc2"]), json!(3.5))])
        .await
        .expect("reduce");
    assert_eq!(reduced, json!({"n": 2, "total": 5.5, "keys": [["x", "doc1"], ["y", "doc2"]]}));
    let rereduced = engine
        .rereduce(
            &ddoc,
            "stats",
            vec![json!({"n": 2, "total": 5.5, "keys": null}), json!({"n": 1, "total": 1, "keys": null})],
        )
        .await
        .expect("rereduce");
    assert_eq!(rereduced, json!({"n": 3, "total": 6.5, "keys": null}));
    // CouchDB logs a reduce that throws and reduces to null.
    assert_eq!(engine.reduce(&ddoc, "broken", vec![(json!(["k", "d"]), json!(1))]).await, Ok(Value::Null));
}

#[tokio::test]
async fn a_reduce_that_does_not_shrink_is_refused_as_couchdb_refuses_it() {
    let ddoc = design(json!({"views": {"all": {
        "map": "function(doc) {}",
        "reduce": "function(keys, values, rereduce) { return values; }"
    }}}));
    let rows: Vec<(Value, Value)> =
        (0..400).map(|i| (json!([i, format!("doc{i}")]), json!(format!("value number {i:08}")))).collect();
    let small: Vec<(Value, Value)> = rows[..10].to_vec();
    let refused = engine().reduce(&ddoc, "all", rows.clone()).await;
    assert!(
        matches!(refused, Err(JsError::Thrown { ref error, .. }) if error == "reduce_overflow_error"),
        "{refused:?}"
    );
    // Under the threshold, the same function answers.
    let answered = engine().reduce(&ddoc, "all", small).await.expect("small reduce");
    assert_eq!(answered.as_array().map(Vec::len), Some(10));
    for limit in [ReduceLimit::Log, ReduceLimit::Off] {
        let lenient = JsEngine::new(JsLimits { reduce_limit: limit, ..limits() }).expect("engine");
        let answered = lenient.reduce(&ddoc, "all", rows.clone()).await.expect("let through");
        assert_eq!(answered.as_array().map(Vec::len), Some(400));
    }
}

#[tokio::test]
async fn a_full_queue_answers_busy_at_once() {
    let engine = JsEngine::new(JsLimits { workers: 1, queue: 1, ..limits() }).expect("engine");
    let (started_tx, started_rx) = std::sync::mpsc::channel::<()>();
    let (release_tx, release_rx) = std::sync::mpsc::channel::<()>();
    let release_rx = std::sync::Mutex::new(release_rx);
    // The worker takes this job and holds it until released.
    let holding = tokio::spawn({
        let engine = engine.clone();
        async move {
            engine
                .run(move |_worker| {
                    let _ = started_tx.send(());
                    let _ = release_rx.lock().map(|rx| rx.recv());
                    Ok(())
                })
                .await
        }
    });
    tokio::task::spawn_blocking(move || started_rx.recv()).await.expect("join").expect("the worker started the job");
    // This job waits in the queue (capacity 1), which is then full…
    let (filler_tx, filler_rx) = tokio::sync::oneshot::channel::<u32>();
    let filler: Job = Box::new(move |_worker| {
        let _ = filler_tx.send(7);
    });
    assert!(engine.inner.jobs.try_send(filler).is_ok(), "the queue has room");
    // …so the next call is refused without waiting.
    assert_eq!(engine.run(|_worker| Ok(0)).await, Err(JsError::Busy));
    let _ = release_tx.send(());
    assert_eq!(holding.await.expect("join"), Ok(()));
    assert_eq!(filler_rx.await, Ok(7));
    // And the engine serves again.
    assert_eq!(engine.run(|_worker| Ok(1)).await, Ok(1));
}

/// Throughput of a trivial map over 100,000 small documents, printed for the record
/// (`cargo test --lib js::tests::throughput -- --nocapture`); nothing is asserted about speed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn throughput_of_a_trivial_map_printed() {
    const DOCS: usize = 100_000;
    const BATCH: usize = 1_000;
    let workers = std::thread::available_parallelism().map_or(2, |n| n.get());
    let engine = JsEngine::new(JsLimits { workers, ..limits() }).expect("engine");
    let ddoc = design(
        json!({"views": {"by_user": {"map": "function(doc) { if (doc.userId) emit([doc.userId, doc.namespace], null); }"}}}),
    );
    let all: Vec<Arc<Value>> = (0..DOCS)
        .map(|i| {
            Arc::new(json!({
                "_id": format!("doc-{i:06}"),
                "_rev": "1-abc",
                "userId": format!("user-{}", i % 97),
                "namespace": "notes",
                "value": {"title": "a note", "n": i}
            }))
        })
        .collect();
    let view = views(&["by_user"]);
    let started = Instant::now();
    let mut pending = Vec::new();
    for chunk in all.chunks(BATCH) {
        let engine = engine.clone();
        let ddoc = ddoc.clone();
        let view = view.clone();
        let chunk = chunk.to_vec();
        pending.push(tokio::spawn(async move {
            loop {
                match engine.map(&ddoc, &view, chunk.clone()).await {
                    Err(JsError::Busy) => tokio::time::sleep(Duration::from_millis(1)).await,
                    other => return other,
                }
            }
        }));
    }
    let mut rows = 0;
    for task in pending {
        let out = task.await.expect("join").expect("map");
        rows += out.iter().map(|o| emitted(o, 0).len()).sum::<usize>();
    }
    let elapsed = started.elapsed();
    assert_eq!(rows, DOCS);
    println!(
        "js map: {DOCS} docs in {:.2} s = {:.0} docs/s ({workers} workers, batches of {BATCH})",
        elapsed.as_secs_f64(),
        DOCS as f64 / elapsed.as_secs_f64()
    );
}

/// A map answer longer than `map_answer_bytes` is not read: the document gets no rows, with the
/// reason naming the views' setting; past `map_call_bytes` (here after the first two) a call answers the first documents.
#[tokio::test]
async fn map_answers_are_bounded_per_document_and_per_call() {
    let ddoc = design(json!({"_id": "_design/big", "views": {
        "v": {"map": "function(doc) { emit(doc._id, new Array(doc.size + 1).join('x')); }"}}}));
    let bounded = JsEngine::new(JsLimits { map_answer_bytes: 500, map_call_bytes: 700, ..limits() }).expect("engine");
    let input = docs(vec![
        json!({"_id": "small", "size": 100}),
        json!({"_id": "large", "size": 600}),
        json!({"_id": "next", "size": 100}),
        json!({"_id": "last", "size": 100}),
    ]);
    let outcomes = bounded.map(&ddoc, &views(&["v"]), input).await.expect("map");
    assert_eq!(outcomes.len(), 2, "the call stops once its answers pass 700 bytes");
    assert_eq!(emitted(&outcomes[0], 0).len(), 1);
    match &outcomes[1].views[0] {
        ViewRows::Threw(reason) => assert!(reason.contains("couchdb_view_max_doc_bytes"), "{reason}"),
        other => panic!("a 600-byte row was read: {other:?}"),
    }
}

/// Each document of one engine call has the whole time bound of its own: four documents that
/// each take 40% of `call_timeout` (160% together) are all mapped. A document that never ends is
/// still stopped, in the middle of a batch.
#[tokio::test]
async fn each_document_of_a_batch_has_its_own_deadline() {
    let limit = Duration::from_millis(1000);
    let engine = JsEngine::new(JsLimits { call_timeout: limit, ..limits() }).expect("engine");
    let ddoc = design(json!({"views": {
        "slow": {"map": "function(doc) { var end = Date.now() + 400; while (Date.now() < end) {} emit(doc._id, 1); }"},
        "stuck": {"map": "function(doc) { if (doc._id == 'c') { while (true) {} } emit(doc._id, 1); }"}
    }}));
    let four = docs((0..4).map(|i| json!({"_id": format!("d{i}")})).collect());
    let out = engine.map(&ddoc, &views(&["slow"]), four).await.expect("every document is within its own bound");
    assert_eq!(out.len(), 4);
    for (i, outcome) in out.iter().enumerate() {
        assert_eq!(emitted(outcome, 0), &vec![(json!(format!("d{i}")), json!(1))]);
    }
    let started = Instant::now();
    let batch = docs(["a", "b", "c", "d"].iter().map(|id| json!({"_id": id})).collect());
    let err = engine.map(&ddoc, &views(&["stuck"]), batch).await.expect_err("the third document is stopped");
    assert_eq!(err, JsError::Timeout { limit });
    assert!(started.elapsed() < limit * 20, "{:?}", started.elapsed());
}

/// In a batch, a document whose map function throws gets no rows in that view and its error is
/// logged as a call of its own would log it; the documents before and after it keep their rows.
#[tokio::test]
async fn a_throw_in_a_batch_is_logged_and_leaves_the_other_documents_rows() {
    let engine = engine();
    let ddoc = design(json!({"views": {
        "v": {"map": "function(doc) { if (doc.bad) throw new Error('bad ' + doc._id); emit(doc.n, doc._id); }"}
    }}));
    let input =
        docs(vec![json!({"_id": "a", "n": 1}), json!({"_id": "b", "n": 2, "bad": true}), json!({"_id": "c", "n": 3})]);
    let before = engine.logged_bytes();
    let out = engine.map(&ddoc, &views(&["v"]), input).await.expect("map");
    assert_eq!(out.len(), 3);
    assert_eq!(emitted(&out[0], 0), &vec![(json!(1), json!("a"))]);
    assert_eq!(emitted(&out[2], 0), &vec![(json!(3), json!("c"))]);
    let expected = "function raised exception Error: bad b with doc._id b";
    assert_eq!(out[1].views[0], ViewRows::Threw(expected.into()));
    assert_eq!(engine.logged_bytes() - before, expected.len() as u64, "the throw is logged once");
}
