//! Several CouchDB faces over one backend answer as one CouchDB (issue 36): a database deleted
//! and created again through one is missing, then new, on the other at once (the open-database
//! cache asks the backend); a purge and a re-creation through one reach the other's views and
//! Mango indexes; a `last_seq` of one continues on the other, and the other's `longpoll` and
//! `continuous` feeds wake up for a write made through the first within the polling bound; a
//! `_local` checkpoint written through one is read on the other at once.
//!
//! Not on the embedded store's databases: a database's redb file is opened by one process, so
//! several instances over an embedded store are not a deployment (the data-store database's trials
//! still run there, both faces over one backend handle).

use super::*;

/// CouchDB's answer for a database that does not exist (CouchDB 3.4.3, checked with curl: GET of
/// the database and of a document in it alike).
fn missing_database() -> Value {
    json!({"error": "not_found", "reason": "Database does not exist."})
}

/// One server's address and client, the trial's own endpoint or one beside it.
#[derive(Clone, Copy)]
pub(super) struct Face<'a> {
    pub(super) name: &'static str,
    root: &'a str,
    client: &'a reqwest::Client,
}

impl<'a> Face<'a> {
    pub(super) fn of_endpoint(e: &'a Endpoint) -> Self {
        Face { name: "A", root: &e.root, client: &e.client }
    }

    pub(super) fn of_beside(b: &'a Beside, name: &'static str) -> Self {
        Face { name, root: &b.root, client: &b.client }
    }

    pub(super) fn request(&self, method: Method, path: &str) -> reqwest::RequestBuilder {
        self.client.request(method, format!("{}{path}", self.root)).header("Accept", "application/json")
    }

    pub(super) async fn call(&self, method: Method, path: &str, body: Option<Value>) -> Result<Answer, Failed> {
        let mut request = self.request(method, path);
        if let Some(body) = body {
            request = request.json(&body);
        }
        Answer::read(request.send().await?).await
    }

    pub(super) async fn get(&self, path: &str) -> Result<Answer, Failed> {
        self.call(Method::GET, path, None).await
    }

    pub(super) async fn put(&self, path: &str, body: Value) -> Result<Answer, Failed> {
        self.call(Method::PUT, path, Some(body)).await
    }

    pub(super) async fn post(&self, path: &str, body: Value) -> Result<Answer, Failed> {
        self.call(Method::POST, path, Some(body)).await
    }

    /// `what` on this face, for messages.
    pub(super) fn says(&self, what: &str) -> String {
        format!("{what} on {}", self.name)
    }
}

/// Whether the trial's backend keeps databases several instances can share (all but the embedded
/// store, whose database files one process opens).
fn databases_shared(e: &Endpoint) -> bool {
    if e.backend == "embedded" {
        println!("the embedded store's database files are opened by one process: no second instance shares them");
        return false;
    }
    true
}

/// The ids of a listing's rows (`_all_docs`, `_changes`, a view).
pub(super) fn row_ids(body: &Value, list: &str) -> Vec<String> {
    body[list].as_array().into_iter().flatten().filter_map(|row| row["id"].as_str().map(str::to_owned)).collect()
}

/// A holds a database open; B deletes it: A answers 404 for it and its documents at once. B
/// creates it again and writes: A never shows the old database's documents, shows the new one's,
/// and A's write lands in the new database (read back through B).
pub(super) async fn deleted_and_created_again_on_another_instance(e: Endpoint) -> TestResult {
    if !databases_shared(&e) {
        return Ok(());
    }
    let beside = e.beside_configured().await?;
    let (a, b) = (Face::of_endpoint(&e), Face::of_beside(&beside, "B"));
    let db = fresh_db_named(&e, "instances", "recreated").await?;
    a.put(&format!("/{db}/old"), json!({"v": "old"})).await?.expect(201, &a.says("PUT old"))?;
    a.get(&format!("/{db}/old")).await?.expect(200, &a.says("GET old"))?;
    a.get(&format!("/{db}")).await?.expect(200, &a.says("GET the database"))?;
    b.call(Method::DELETE, &format!("/{db}"), None).await?.expect(200, &b.says("DELETE the database"))?;
    for path in [format!("/{db}"), format!("/{db}/old"), format!("/{db}/_all_docs")] {
        let answer = a.get(&path).await?.expect(404, &a.says(&format!("GET {path} after B deleted it")))?;
        check(answer.body == missing_database(), || format!("GET {path} on A: {}", answer.body))?;
    }
    b.call(Method::PUT, &format!("/{db}"), None).await?.expect(201, &b.says("PUT the database again"))?;
    b.put(&format!("/{db}/new"), json!({"v": "new"})).await?.expect(201, &b.says("PUT new"))?;
    let old = a.get(&format!("/{db}/old")).await?.expect(404, &a.says("GET old in the new database"))?;
    check(old.body["reason"] == json!("missing"), || format!("old on A: {}", old.body))?;
    a.get(&format!("/{db}/new")).await?.expect(200, &a.says("GET new"))?;
    a.put(&format!("/{db}/from-a"), json!({"v": "a"})).await?.expect(201, &a.says("PUT from-a"))?;
    b.get(&format!("/{db}/from-a")).await?.expect(200, &b.says("GET from-a"))?;
    for face in [a, b] {
        let listed = face.get(&format!("/{db}/_all_docs")).await?.expect(200, &face.says("_all_docs"))?;
        let ids = row_ids(&listed.body, "rows");
        check(ids == ["from-a", "new"], || format!("{}: {ids:?}", face.says("_all_docs")))?;
        let info = face.get(&format!("/{db}")).await?.expect(200, &face.says("GET the database"))?;
        check(info.body["doc_count"] == json!(2), || format!("{}: {}", face.says("the database's info"), info.body))?;
    }
    Ok(())
}
