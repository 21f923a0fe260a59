//! Two CouchDB faces over one backend answer as one server: a session cookie from one is valid
//! on the other, and a feed position sealed for a per-user login by one reads on the other, also
//! after the shared secret is rotated.

use super::logins::PASSWORD;
use super::*;

/// Alice logs in on A; B knows her cookie (`GET /_session`, a database read) and continues her
/// feed from the `last_seq` A sealed for her.
pub(super) async fn sessions_valid_on_every_instance(endpoint: Endpoint) -> TestResult {
    let a = &endpoint;
    let e_is_couchdb = endpoint.backend == "couchdb";
    let b = a.beside_configured().await?;
    let admin_writes = |docs: Vec<Value>| async move {
        let sent = a.client.post(a.url(&format!("/{DB}/_bulk_docs"))).basic_auth("admin", Some(PASSWORD));
        Answer::read(sent.json(&json!({ "docs": docs })).send().await?).await?.expect(201, "admin writes on A")
    };
    admin_writes((0..3).map(|i| doc("alice", "ns", &format!("k{i}"), json!(i))).collect()).await?;
    let login = a.client.post(a.url("/_session")).json(&json!({"name": "alice", "password": PASSWORD})).send().await?;
    let set_cookie = login.headers().get("set-cookie").and_then(|v| v.to_str().ok()).unwrap_or_default().to_owned();
    Answer::read(login).await?.expect(200, "POST /_session on A")?;
    let cookie = set_cookie.split(';').next().unwrap_or_default().to_owned();
    let on_b = |path: &str| b.client.get(format!("{}{path}", b.root)).header("Cookie", cookie.clone());
    let who = Answer::read(on_b("/_session").send().await?).await?.expect(200, "GET /_session on B")?;
    check(who.body["userCtx"]["name"] == json!("alice"), || format!("B sees A's cookie as {}", who.body))?;
    Answer::read(on_b(&format!("/{DB}/_all_docs")).send().await?).await?.expect(200, "alice reads on B")?;
    // The position A shows alice is sealed; B unseals it, so her feed goes on from there.
    let on_a = a.client.get(a.url(&format!("/{DB}/_changes"))).header("Cookie", cookie.clone());
    let feed = Answer::read(on_a.send().await?).await?.expect(200, "alice's _changes on A")?;
    let since = feed.body["last_seq"].as_str().unwrap_or_default().to_owned();
    let after = doc("alice", "ns", "k3", json!(3));
    admin_writes(vec![after.clone()]).await?;
    let query = percent_encoding::utf8_percent_encode(&since, percent_encoding::NON_ALPHANUMERIC);
    let rest = Answer::read(on_b(&format!("/{DB}/_changes?since={query}")).send().await?)
        .await?
        .expect(200, "alice's _changes on B since A's last_seq")?;
    let ids: Vec<&str> =
        rest.body["results"].as_array().into_iter().flatten().filter_map(|row| row["id"].as_str()).collect();
    check(ids == [after["_id"].as_str().unwrap_or_default()], || format!("B's feed since A's position: {ids:?}"))?;
    // The secret's local document is the server's own: never served or listed, even to an admin.
    let as_admin = |path: String| a.client.get(a.url(&path)).basic_auth("admin", Some(PASSWORD));
    let direct = Answer::read(as_admin(format!("/{DB}/_local/%3Adb%3Asession-secret")).send().await?).await?;
    let listed = Answer::read(as_admin(format!("/{DB}/_local_docs")).send().await?).await?;
    // pouchdb-server, CI's stand-in for CouchDB, has no `_local_docs` (501 through the backend).
    let listed = match (e_is_couchdb, listed.status) {
        (true, StatusCode::NOT_IMPLEMENTED) => listed,
        _ => listed.expect(200, "_local_docs")?,
    };
    check(direct.status != StatusCode::OK && !listed.body.to_string().contains("session-secret"), || {
        format!("the secret's document: {} {}; _local_docs: {}", direct.status, direct.body, listed.body)
    })?;
    // After `agentstore rotate-session-secret`, an instance started since signs with the new
    // secret and still accepts the cookie and the position signed under the previous one.
    agentstore::couchdb_api::shared_secret::rotate(a._ctx.backend.as_ref()).await?;
    let c = a.beside_configured().await?;
    let on_c = |path: &str| c.client.get(format!("{}{path}", c.root)).header("Cookie", cookie.clone());
    let who = Answer::read(on_c("/_session").send().await?).await?.expect(200, "GET /_session on C")?;
    check(who.body["userCtx"]["name"] == json!("alice"), || format!("C sees A's cookie as {}", who.body))?;
    let rest = Answer::read(on_c(&format!("/{DB}/_changes?since={query}")).send().await?)
        .await?
        .expect(200, "alice's _changes on C since A's last_seq")?;
    let rows = rest.body["results"].as_array().map_or(0, Vec::len);
    check(rows == 1, || format!("C's feed since A's position: {}", rest.body))
}
