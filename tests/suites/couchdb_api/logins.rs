//! Per-user logins (Basic and session cookie) see and write only their own documents; no or wrong
//! credentials are CouchDB's 401s.

use super::*;

pub(super) const PASSWORD: &str = "correct horse";

/// A request as `login` (Basic, [`PASSWORD`]) with an optional JSON body, answered.
pub(super) async fn as_login(
    e: &Endpoint,
    login: &str,
    method: Method,
    path: &str,
    body: Option<Value>,
) -> Result<Answer, Failed> {
    let mut request =
        e.client.request(method, e.url(path)).header("Accept", "application/json").basic_auth(login, Some(PASSWORD));
    if let Some(body) = body {
        request = request.json(&body);
    }
    Answer::read(request.send().await?).await
}

/// An admin login and two per-user logins, all with [`PASSWORD`].
pub(super) fn logins_config() -> Result<String, Failed> {
    let hash = agentstore::couchdb_api::auth::hash_password(PASSWORD)?;
    Ok(format!(
        "[[couchdb_users]]\nname = \"admin\"\npassword_hash = \"{hash}\"\nadmin = true\n\
         [[couchdb_users]]\nname = \"alice\"\npassword_hash = \"{hash}\"\nuser = \"alice\"\n\
         [[couchdb_users]]\nname = \"bob\"\npassword_hash = \"{hash}\"\nuser = \"bob\"\n"
    ))
}

/// Per-user logins through Basic and through a session cookie see and write only their own
/// documents; no or wrong credentials are CouchDB's 401s.
pub(super) async fn per_user_logins(e: Endpoint) -> TestResult {
    same_error(&e.get(&format!("/{DB}")).await?, "007-auth-none")?;
    let wrong = e.client.get(e.url(&format!("/{DB}"))).basic_auth("alice", Some("nope")).send().await?;
    same_error(&Answer::read(wrong).await?, "008-auth-wrong-password")?;
    let as_user =
        |user: &str, method: Method, path: &str| e.client.request(method, e.url(path)).basic_auth(user, Some(PASSWORD));
    let docs: Vec<Value> =
        ["alice", "bob"].iter().flat_map(|u| (0..3).map(move |i| doc(u, "ns", &format!("k{i}"), json!(i)))).collect();
    let seeded =
        as_user("admin", Method::POST, &format!("/{DB}/_bulk_docs")).json(&json!({ "docs": docs })).send().await?;
    Answer::read(seeded).await?.expect(201, "admin seeds")?;
    let listed = Answer::read(as_user("alice", Method::GET, &format!("/{DB}/_all_docs")).send().await?)
        .await?
        .expect(200, "alice _all_docs")?;
    let ids: Vec<String> = listed.body["rows"]
        .as_array()
        .map(|r| r.iter().filter_map(|row| row["id"].as_str().map(str::to_owned)).collect())
        .unwrap_or_default();
    check(ids.len() == 3 && ids.iter().all(|id| id.starts_with("alice:")), || format!("alice lists {ids:?}"))?;
    let feed = Answer::read(as_user("alice", Method::GET, &format!("/{DB}/_changes")).send().await?)
        .await?
        .expect(200, "alice _changes")?;
    check(
        feed.body["results"]
            .as_array()
            .is_some_and(|r| r.iter().all(|row| row["id"].as_str().is_some_and(|id| id.starts_with("alice:")))),
        || format!("alice's feed: {}", feed.body),
    )?;
    let bobs = docs[3]["_id"].as_str().unwrap_or_default().to_owned();
    Answer::read(as_user("alice", Method::GET, &path_of(&bobs)).send().await?)
        .await?
        .expect(403, "alice reads bob's")?;
    let mut takeover = docs[3].clone();
    takeover["value"] = json!("mine");
    Answer::read(as_user("alice", Method::PUT, &path_of(&bobs)).json(&takeover).send().await?)
        .await?
        .expect(403, "alice writes bob's")?;
    for path in [format!("/{DB}/_design/data_store"), format!("/{DB}/_design/data_store/_view/by_user")] {
        Answer::read(as_user("alice", Method::GET, &path).send().await?)
            .await?
            .expect(403, "alice reads a design path")?;
    }
    let bulk = Answer::read(
        as_user("alice", Method::POST, &format!("/{DB}/_bulk_docs")).json(&json!({"docs": [takeover]})).send().await?,
    )
    .await?
    .expect(201, "alice bulk-writes bob's")?;
    check(bulk.body[0]["error"] == "forbidden", || format!("per-document forbidden: {}", bulk.body))?;
    let own = doc("alice", "ns", "new", json!("ok"));
    Answer::read(
        as_user("alice", Method::PUT, &path_of(own["_id"].as_str().unwrap_or_default())).json(&own).send().await?,
    )
    .await?
    .expect(201, "alice writes her own")?;
    // Bob logs in for a session cookie, as couchbackup and the Cloudant SDKs do.
    let login =
        e.client.post(e.url("/_session")).json(&json!({"username": "bob", "password": PASSWORD})).send().await?;
    let cookie = login.headers().get("set-cookie").and_then(|v| v.to_str().ok()).unwrap_or_default().to_owned();
    Answer::read(login).await?.expect(200, "POST /_session")?;
    check(cookie.starts_with("AuthSession=") && cookie.contains("Expires=") && cookie.contains("HttpOnly"), || {
        format!("Set-Cookie: {cookie}")
    })?;
    let session = cookie.split(';').next().unwrap_or_default().to_owned();
    let with_cookie = |path: &str| e.client.get(e.url(path)).header("Cookie", session.clone());
    let who = Answer::read(with_cookie("/_session").send().await?).await?.expect(200, "GET /_session")?;
    check(who.body["userCtx"]["name"] == "bob", || format!("/_session: {}", who.body))?;
    let bob_lists = Answer::read(with_cookie(&format!("/{DB}/_all_docs?include_docs=true")).send().await?)
        .await?
        .expect(200, "bob _all_docs")?;
    check(
        bob_lists.body["rows"]
            .as_array()
            .is_some_and(|r| r.len() == 3 && r.iter().all(|row| row["doc"]["userId"] == "bob")),
        || format!("bob lists {}", bob_lists.body),
    )?;
    let bob_gets = Answer::read(
        e.client
            .post(e.url(&format!("/{DB}/_bulk_get")))
            .header("Cookie", session.clone())
            .json(&json!({"docs": [{"id": docs[0]["_id"]}]}))
            .send()
            .await?,
    )
    .await?
    .expect(200, "bob _bulk_get alice's")?;
    check(bob_gets.body["results"][0]["docs"][0]["error"]["error"] == "forbidden", || format!("{}", bob_gets.body))
}
