//! The node endpoints (issue 37) on every backend, against what CouchDB 3.4.3 answered
//! (`fixtures/couchdb-3.4.3/084`–`109`): every statistic shown is one CouchDB has, under the same
//! path and of the same type and shape, and counts what happens; every Prometheus metric is one of
//! CouchDB's; settings are strings under CouchDB's sections, secrets hidden, writes refused;
//! `_versions`, `_system`, `_membership`, `/_node/_local` with CouchDB's fields; who may read what
//! (a `_metrics` role reads statistics, not settings) and the errors exactly.
//!
//! Compared exactly: every error answer, `_stats` of a path naming nothing (`null`),
//! `_config/couchdb/js_engine` (`"quickjs"` on both), a missing section (`{}`), `_versions`'
//! `javascript_engine`, `_up`. Compared by fields and types: the rest (counts, times, names and
//! uuids differ). Not as CouchDB: a `PUT` of a setting CouchDB changes (101) is refused here.

use super::logins::as_login;
use super::*;

/// The logins of [`super::logins::logins_config`] and `scraper`, a configured login with the
/// `_metrics` role (no admin, no data-store user).
pub(super) fn config() -> Result<String, Failed> {
    let hash = agentstore::couchdb_api::auth::hash_password(super::logins::PASSWORD)?;
    Ok(format!(
        "{}[[couchdb_users]]\nname = \"scraper\"\npassword_hash = \"{hash}\"\nroles = [\"_metrics\"]\n",
        super::logins::logins_config()?
    ))
}

/// A `_users` user with the `_metrics` role, for this trial (the CouchDB backend's server is
/// shared by runs): its name and password.
async fn metrics_user(e: &Endpoint) -> Result<(String, String), Failed> {
    let mut random = [0u8; 4];
    getrandom::fill(&mut random).map_err(|err| err.to_string())?;
    let name = format!("u37m-{}", hex::encode(random));
    let password = "metrics37".to_owned();
    let doc = json!({ "name": name, "type": "user", "roles": ["_metrics"], "password": password });
    as_login(e, "admin", Method::PUT, &format!("/_users/org.couchdb.user:{name}"), Some(doc))
        .await?
        .expect(201, "PUT a _metrics user")?;
    Ok((name, password))
}

async fn as_user(e: &Endpoint, user: &(String, String), path: &str) -> Result<Answer, Failed> {
    let request = e.client.get(e.url(path)).header("Accept", "application/json").basic_auth(&user.0, Some(&user.1));
    Answer::read(request.send().await?).await
}

async fn admin_get(e: &Endpoint, path: &str) -> Result<Answer, Failed> {
    as_login(e, "admin", Method::GET, path, None).await
}

fn fields(value: &Value) -> std::collections::BTreeSet<String> {
    value.as_object().map(|m| m.keys().cloned().collect()).unwrap_or_default()
}

/// Every statistic of a `_stats` tree: its path and the statistic (`{"value", "type", "desc"}`).
fn statistics(tree: &Value) -> Vec<(String, Value)> {
    fn walk(node: &Value, path: &str, out: &mut Vec<(String, Value)>) {
        let Some(object) = node.as_object() else { return };
        if object.contains_key("type") && object.contains_key("value") {
            out.push((path.to_owned(), node.clone()));
            return;
        }
        for (key, child) in object {
            let path = if path.is_empty() { key.clone() } else { format!("{path}.{key}") };
            walk(child, &path, out);
        }
    }
    let mut out = Vec::new();
    walk(tree, "", &mut out);
    out
}

/// A statistic of ours is CouchDB's of the same path: the same type, fields, and value shape.
fn same_statistic(path: &str, ours: &Value, couchdb: &Value) -> TestResult {
    check(fields(ours) == fields(couchdb) && ours["type"] == couchdb["type"] && ours["desc"].is_string(), || {
        format!("{path}: {ours} where CouchDB has {couchdb}")
    })?;
    match couchdb["type"].as_str() {
        Some("histogram") => {
            let (value, recorded) = (&ours["value"], &couchdb["value"]);
            check(fields(value) == fields(recorded), || format!("{path}: {value} where CouchDB has {recorded}"))?;
            let percentiles = |v: &Value| -> Vec<Value> {
                v["percentile"].as_array().into_iter().flatten().map(|pair| pair[0].clone()).collect()
            };
            check(percentiles(value) == percentiles(recorded) && value["histogram"] == recorded["histogram"], || {
                format!("{path}: percentiles {value} where CouchDB has {recorded}")
            })
        }
        _ => check(ours["value"].is_u64(), || format!("{path}: value {} is no count", ours["value"])),
    }
}

fn count(tree: &Value, path: &str) -> u64 {
    path.split('.').fold(tree, |node, key| &node[key])["value"].as_u64().unwrap_or(u64::MAX)
}

pub(super) async fn node_endpoints_as_couchdb(e: Endpoint) -> TestResult {
    let node = admin_get(&e, "/_node/_local").await?.expect(200, "GET /_node/_local")?;
    check(fields(&node.body) == fields(&couchdb_body("084-node-local")), || format!("/_node/_local: {}", node.body))?;
    let name = node.body["name"].as_str().unwrap_or_default().to_owned();
    statistics_as_couchdb(&e, &name).await?;
    prometheus_as_couchdb(&e).await?;
    settings_as_couchdb(&e).await?;
    let versions = admin_get(&e, "/_node/_local/_versions").await?.expect(200, "_versions")?;
    let recorded = couchdb_body("104-node-versions");
    check(fields(&versions.body).is_subset(&fields(&recorded)), || format!("_versions: {}", versions.body))?;
    check(versions.body["javascript_engine"] == recorded["javascript_engine"], || {
        format!("_versions: {}", versions.body)
    })?;
    let system = admin_get(&e, "/_node/_local/_system").await?.expect(200, "_system")?;
    check(fields(&system.body).is_subset(&fields(&couchdb_body("105-node-system"))), || {
        format!("_system: {}", system.body)
    })?;
    check(system.body["uptime"].is_u64(), || format!("_system: {}", system.body))?;
    let membership = admin_get(&e, "/_membership").await?.expect(200, "_membership")?;
    check(fields(&membership.body) == fields(&couchdb_body("106-membership")), || format!("{}", membership.body))?;
    check(membership.body["all_nodes"] == json!([name]) && membership.body["cluster_nodes"] == json!([name]), || {
        format!("_membership {} for the node {name}", membership.body)
    })?;
    let up = e.get("/_up").await?.expect(200, "_up without credentials")?;
    check(up.body == couchdb_body("108-up-no-credentials"), || format!("_up: {}", up.body))
}

async fn statistics_as_couchdb(e: &Endpoint, name: &str) -> TestResult {
    let recorded = couchdb_body("085-node-stats");
    let couchdb: std::collections::BTreeMap<String, Value> = statistics(&recorded).into_iter().collect();
    let before = admin_get(e, "/_node/_local/_stats").await?.expect(200, "_stats")?;
    let ours = statistics(&before.body);
    for (path, statistic) in &ours {
        let Some(theirs) = couchdb.get(path) else {
            return Err(format!("_stats shows {path}, which CouchDB 3.4.3 does not have").into());
        };
        same_statistic(path, statistic, theirs)?;
    }
    for path in [
        "couchdb.request_time",
        "couchdb.httpd.requests",
        "couchdb.httpd_request_methods.GET",
        "couchdb.httpd_status_codes.200",
        "couchdb.database_reads",
        "couchdb.database_writes",
        "couchdb.open_databases",
    ] {
        check(ours.iter().any(|(p, _)| p == path), || format!("_stats lacks {path}"))?;
    }
    // The counts follow what happens: a document written, read, and requests answered.
    let mut random = [0u8; 6];
    getrandom::fill(&mut random).map_err(|err| err.to_string())?;
    let db = format!("nodestats-{}", hex::encode(random));
    as_login(e, "admin", Method::PUT, &format!("/{db}"), None).await?.expect(201, "PUT a database")?;
    as_login(e, "admin", Method::PUT, &format!("/{db}/d"), Some(json!({"a": 1})))
        .await?
        .expect(201, "PUT a document")?;
    admin_get(e, &format!("/{db}/d")).await?.expect(200, "GET the document")?;
    admin_get(e, &format!("/{db}/nothing-here")).await?;
    let after = admin_get(e, "/_node/_local/_stats").await?.expect(200, "_stats again")?;
    let grew = |path: &str, by: u64| count(&after.body, path) >= count(&before.body, path).saturating_add(by);
    check(grew("couchdb.httpd.requests", 5) && grew("couchdb.httpd_request_methods.GET", 3), || {
        format!("requests before {} after {}", before.body["couchdb"]["httpd"], after.body["couchdb"]["httpd"])
    })?;
    check(grew("couchdb.httpd_status_codes.201", 2) && grew("couchdb.httpd_status_codes.404", 1), || {
        format!("statuses after {}", after.body["couchdb"]["httpd_status_codes"])
    })?;
    // On the CouchDB backend documents are CouchDB's own (passed through): their reads are its.
    check(grew("couchdb.database_writes", 1) && (e.backend == "couchdb" || grew("couchdb.database_reads", 1)), || {
        format!("reads/writes before {} after {}", before.body["couchdb"], after.body["couchdb"])
    })?;
    let time = &after.body["couchdb"]["request_time"]["value"];
    check(time["n"].as_u64().is_some_and(|n| n >= 5) && time["max"].as_f64() >= time["min"].as_f64(), || {
        format!("request_time {time}")
    })?;
    as_login(e, "admin", Method::DELETE, &format!("/{db}"), None).await?.expect(200, "DELETE the database")?;

    // Paths into the tree (086, 087, 089), and one naming nothing (088).
    let histogram = admin_get(e, "/_node/_local/_stats/couchdb/request_time").await?.expect(200, "a histogram")?;
    same_statistic("request_time", &histogram.body, &couchdb_body("086-node-stats-histogram"))?;
    let counter =
        admin_get(e, "/_node/_local/_stats/couchdb/httpd_request_methods/GET").await?.expect(200, "a counter")?;
    same_statistic("GET", &counter.body, &couchdb_body("087-node-stats-counter"))?;
    let nothing = admin_get(e, "/_node/_local/_stats/no/such/metric").await?.expect(200, "a path naming nothing")?;
    check(nothing.body == couchdb_body("088-node-stats-missing"), || format!("no/such/metric: {}", nothing.body))?;
    let by_name = admin_get(e, &format!("/_node/{name}/_stats/couchdb/open_databases"))
        .await?
        .expect(200, "by the node's name")?;
    same_statistic("open_databases", &by_name.body, &couchdb_body("089-node-stats-by-name"))?;
    same_error(&admin_get(e, "/_node/e37-no-such-node@nowhere/_stats").await?, "109-node-no-such-node")?;

    // Who reads them: not a user without the `_metrics` role (092); GET only (093).
    same_error(&as_login(e, "alice", Method::GET, "/_node/_local/_stats", None).await?, "092-node-stats-non-admin")?;
    same_error(
        &as_login(e, "admin", Method::POST, "/_node/_local/_stats", Some(json!({}))).await?,
        "093-node-stats-post",
    )?;
    // A `_metrics` role reads them (091, 107), not the settings (103): a configured login's, and
    // a `_users` user's (pouchdb-server, the CouchDB backend's server in CI, refuses such a user
    // in its `_users`: a role starting with `_`).
    let scraper = ("scraper".to_owned(), super::logins::PASSWORD.to_owned());
    let mut readers = vec![scraper];
    if on_pouchdb_server(e) {
        println!("pouchdb-server keeps no _users user with the _metrics role: the configured one reads");
    } else {
        readers.push(metrics_user(e).await?);
    }
    for reader in &readers {
        let writes =
            as_user(e, reader, "/_node/_local/_stats/couchdb/database_writes").await?.expect(200, &reader.0)?;
        same_statistic("database_writes", &writes.body, &couchdb_body("091-node-stats-metrics-role"))?;
        as_user(e, reader, "/_node/_local/_system").await?.expect(200, "_system as a _metrics login")?;
        let scraped = e.client.get(e.url("/_node/_local/_prometheus")).basic_auth(&reader.0, Some(&reader.1));
        let status = scraped.send().await?.status();
        check(status.as_u16() == 200, || format!("_prometheus as {}: {status}", reader.0))?;
        same_error(&as_user(e, reader, "/_node/_local/_config").await?, "103-node-config-non-admin")?;
        same_error(&as_user(e, reader, "/_db_updates").await?, "081-db-updates-non-admin")?;
    }
    Ok(())
}

/// The metric names of a Prometheus text (sample lines; `_sum`/`_count` are their summary's).
fn metric_names(text: &str) -> std::collections::BTreeSet<String> {
    text.lines()
        .filter(|line| !line.starts_with('#') && !line.trim().is_empty())
        .filter_map(|line| line.split(['{', ' ']).next())
        .map(str::to_owned)
        .collect()
}

async fn prometheus_as_couchdb(e: &Endpoint) -> TestResult {
    let sent = e.client.get(e.url("/_node/_local/_prometheus")).basic_auth("admin", Some(super::logins::PASSWORD));
    let response = sent.send().await?;
    let content_type =
        response.headers().get("content-type").and_then(|v| v.to_str().ok()).unwrap_or_default().to_owned();
    check(response.status().as_u16() == 200 && content_type.starts_with("text/plain; version=0.0.4"), || {
        format!("_prometheus: {} {content_type}", response.status())
    })?;
    let text = response.text().await?;
    let recorded = fixture("094-node-prometheus")["response"]["body"].as_str().unwrap_or_default().to_owned();
    let (ours, couchdb) = (metric_names(&text), metric_names(&recorded));
    let foreign: Vec<&String> = ours.difference(&couchdb).collect();
    check(foreign.is_empty() && ours.len() >= 8, || {
        format!("metrics CouchDB 3.4.3 does not have: {foreign:?} ({ours:?})")
    })?;
    // Every family is typed, on a line of its own (0.0.4; CouchDB 3.4.3 runs HELP and TYPE together).
    for name in ours.iter().filter(|n| !n.ends_with("_sum") && !n.ends_with("_count")) {
        check(text.lines().any(|line| line.starts_with(&format!("# TYPE {name} "))), || {
            format!("{name} has no TYPE line")
        })?;
    }
    Ok(())
}

async fn settings_as_couchdb(e: &Endpoint) -> TestResult {
    let all = admin_get(e, "/_node/_local/_config").await?.expect(200, "_config")?;
    let sections = all.body.as_object().cloned().unwrap_or_default();
    check(sections.contains_key("couchdb") && sections.contains_key("chttpd"), || format!("_config: {}", all.body))?;
    for (section, keys) in &sections {
        let keys = keys.as_object().cloned().unwrap_or_default();
        check(keys.values().all(Value::is_string), || format!("_config/{section}: {keys:?}"))?;
    }
    // The admin's password hash is never shown (CouchDB shows its own hashes there: 095).
    let configured = std::fs::read_to_string(e._config_dir.path().join("agentstore.toml"))?;
    for value in sections.get("admins").and_then(Value::as_object).into_iter().flat_map(|keys| keys.values()) {
        let shown = value.as_str().unwrap_or_default();
        check(shown.len() < 16 && !configured.contains(shown), || format!("_config/admins shows {shown:?}"))?;
    }
    let section = admin_get(e, "/_node/_local/_config/couchdb").await?.expect(200, "_config/couchdb")?;
    check(section.body == all.body["couchdb"], || format!("_config/couchdb: {}", section.body))?;
    let key =
        admin_get(e, "/_node/_local/_config/couchdb/js_engine").await?.expect(200, "_config/couchdb/js_engine")?;
    check(key.body == couchdb_body("097-node-config-key"), || format!("js_engine: {}", key.body))?;
    same_error(&admin_get(e, "/_node/_local/_config/couchdb/no_such_key").await?, "098-node-config-missing-key")?;
    let empty = admin_get(e, "/_node/_local/_config/no_such_section").await?.expect(200, "a missing section")?;
    check(empty.body == couchdb_body("099-node-config-missing-section"), || {
        format!("missing section: {}", empty.body)
    })?;
    // Writes: CouchDB refuses a section it never lets HTTP change (100) and takes others (101);
    // every setting is refused here the way it refuses that section.
    let refused = fixture("100-node-config-put-blacklisted")["response"].clone();
    for path in ["/_node/_local/_config/query_servers/e37", "/_node/_local/_config/couchdb/max_document_size"] {
        let answer = as_login(e, "admin", Method::PUT, path, Some(json!("8000000"))).await?;
        check(answer.status.as_u16() == 403 && answer.body["error"] == refused["body"]["error"], || {
            format!("PUT {path}: {} {} where CouchDB refuses with {refused}", answer.status, answer.body)
        })?;
    }
    let unchanged =
        admin_get(e, "/_node/_local/_config/couchdb/max_document_size").await?.expect(200, "after the PUT")?;
    check(unchanged.body == all.body["couchdb"]["max_document_size"], || {
        format!("max_document_size: {}", unchanged.body)
    })?;
    let delete = as_login(e, "admin", Method::DELETE, "/_node/_local/_config/couchdb/no_such_key", None).await?;
    same_error(&delete, "102-node-config-delete-missing")
}
