//! Several servers over one backend sharing one view index directory (issue 36): each claims an
//! index file of its own at startup, so each answers views; one more than the slots stops at
//! startup naming the setting, never a 500 at its first view query.

use super::*;

/// A server over `e`'s backend with the settings in `config` (TOML), serving until dropped (the
/// harness's [`Endpoint::serve_beside`]).
async fn serve_beside(e: &Endpoint, config: &std::path::Path) -> Result<Beside, Failed> {
    let settings = Settings::load(Some(config), &Overrides::default()).map_err(|e| Failed::from(e.to_string()))?;
    e.serve_beside(settings, None).await
}

/// The API over `e`'s backend built with `config`: its own facade and views, as another process's.
async fn build_beside(e: &Endpoint, config: &std::path::Path) -> Result<Result<CouchApp, String>, Failed> {
    let settings = Settings::load(Some(config), &Overrides::default()).map_err(|e| Failed::from(e.to_string()))?;
    let store = Arc::new(DataStore::open(Arc::clone(&e._ctx.backend), settings.store_options()).await?);
    Ok(CouchApp::build(store, &settings).await.map_err(|err| err.to_string()))
}

async fn view_rows(server: &Beside, path: &str) -> Result<Answer, Failed> {
    Answer::read(server.client.get(format!("{}{path}", server.root)).header("Accept", "application/json").send().await?)
        .await
}

/// Two servers with one `couchdb_view_index_dir` both answer a view; a third, past
/// `couchdb_view_index_slots = 2`, is refused when it is built.
pub(super) async fn servers_sharing_an_index_directory(e: Endpoint) -> TestResult {
    let dir = tempfile::tempdir()?;
    let config = dir.path().join("agentstore.toml");
    let views = dir.path().join("views").display().to_string();
    std::fs::write(&config, format!("couchdb_view_index_dir = {views:?}\ncouchdb_view_index_slots = 2\n"))?;
    let first = serve_beside(&e, &config).await?;
    let second = serve_beside(&e, &config).await?;
    if e.backend != "embedded" {
        both_answer_a_view(&e, &first, &second).await?;
    }
    if e.backend == "couchdb" {
        // CouchDB keeps its own views: no index file is claimed, so no slot runs out.
        return Ok(());
    }
    let third = build_beside(&e, &config).await?;
    match third {
        Ok(_) => Err(Failed::from("a third server was built with both index slots held")),
        Err(reason) => check(reason.contains("couchdb_view_index_slots") && reason.contains(&views), || {
            format!("the refusal names neither the setting nor the directory: {reason}")
        }),
    }
}

/// A view written through `e` read through `first` and `second`. Not on the embedded store: its
/// database files are locked by the process that opened them, so two servers never share one
/// (both servers' claims and the third's refusal are still checked there).
async fn both_answer_a_view(e: &Endpoint, first: &Beside, second: &Beside) -> TestResult {
    let db = fresh_db_named(e, "slots", "two").await?;
    e.put(&format!("/{db}/_design/d"), json!({ "views": { "v": { "map": "function (doc) { emit(doc.n, null); }" } } }))
        .await?
        .expect(201, "design document")?;
    e.put(&format!("/{db}/a"), json!({ "n": 1 })).await?.expect(201, "document")?;
    for (which, server) in [("first", &first), ("second", &second)] {
        let answer = view_rows(server, &format!("/{db}/_design/d/_view/v")).await?.expect(200, which)?;
        check(answer.body["rows"] == json!([{ "id": "a", "key": 1, "value": null }]), || {
            format!("{which} server's view: {}", answer.body)
        })?;
    }
    Ok(())
}
