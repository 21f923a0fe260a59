//! The data-store database's routes that a second router answered on the CouchDB backend before
//! issue 35 §2 (its design documents, views, `_design_docs`, Mango, `PUT/DELETE /{db}`), now the
//! databases' handlers' on every backend: a per-user login's `_find` and `_design_docs` see its
//! own documents only, design paths stay an admin's, and creating or deleting the database is a
//! server admin's as in CouchDB 3.4.3 (401 `unauthorized` for anyone else, checked against it
//! with a member of `_users`), the database itself never created or deleted through the API.

use super::logins::as_login;
use super::*;

/// The `_id`s of a `_find` answer's `docs`, or of a listing's `rows`.
fn ids_in(answer: &Answer, list: &str) -> Vec<String> {
    let ids = answer.body[list].as_array().into_iter().flatten();
    ids.filter_map(|item| item.get("_id").or_else(|| item.get("id"))?.as_str().map(str::to_owned)).collect()
}

/// A per-user login's `_find` reads its own documents only, whatever the selector names
/// (`userId` of another user included); its `_design_docs` lists none; the design document and
/// its view are an admin's (403 for the login), answered to the admin by either path spelling.
pub(super) async fn per_user_find_and_design_docs(e: Endpoint) -> TestResult {
    let docs: Vec<Value> =
        ["alice", "bob"].iter().flat_map(|u| (0..3).map(move |i| doc(u, "ns", &format!("k{i}"), json!(i)))).collect();
    as_login(&e, "admin", Method::POST, &format!("/{DB}/_bulk_docs"), Some(json!({ "docs": docs })))
        .await?
        .expect(201, "admin seeds")?;
    let find = format!("/{DB}/_find");
    for (login, selector) in [
        ("alice", json!({})),
        ("alice", json!({ "userId": "bob" })),
        ("alice", json!({ "value": { "$gte": 0 } })),
        ("bob", json!({ "namespace": "ns" })),
    ] {
        let found = as_login(&e, login, Method::POST, &find, Some(json!({ "selector": selector.clone() })))
            .await?
            .expect(200, "_find")?;
        let ids = ids_in(&found, "docs");
        let wanted = if selector.get("userId").is_some_and(|user| user != login) { 0 } else { 3 };
        check(ids.len() == wanted && ids.iter().all(|id| id.starts_with(&format!("{login}:"))), || {
            format!("{login}'s _find of {selector}: {}", found.body)
        })?;
    }
    let everyone = as_login(&e, "admin", Method::POST, &find, Some(json!({ "selector": { "namespace": "ns" } })))
        .await?
        .expect(200, "admin _find")?;
    check(ids_in(&everyone, "docs").len() == 6, || format!("admin's _find: {}", everyone.body))?;

    let ddoc = json!({ "views": { "by_key": { "map": "function (doc) { if (doc.key) emit(doc.key, 1); }" } } });
    as_login(&e, "admin", Method::PUT, &format!("/{DB}/_design/routes"), Some(ddoc)).await?.expect(201, "ddoc")?;
    let listed = as_login(&e, "admin", Method::GET, &format!("/{DB}/_design_docs"), None)
        .await?
        .expect(200, "admin _design_docs")?;
    check(ids_in(&listed, "rows").contains(&"_design/routes".to_owned()), || {
        format!("admin's _design_docs: {}", listed.body)
    })?;
    let confined = as_login(&e, "alice", Method::GET, &format!("/{DB}/_design_docs"), None)
        .await?
        .expect(200, "alice _design_docs")?;
    check(ids_in(&confined, "rows").is_empty(), || format!("alice's _design_docs: {}", confined.body))?;
    for path in [format!("/{DB}/_design/routes"), format!("/{DB}/_design%2Froutes")] {
        let read = as_login(&e, "admin", Method::GET, &path, None).await?.expect(200, "admin reads the ddoc")?;
        check(read.body["_id"] == "_design/routes", || format!("GET {path}: {}", read.body))?;
        let refused = as_login(&e, "alice", Method::GET, &path, None).await?;
        check(refused.status == StatusCode::FORBIDDEN, || format!("alice's GET {path}: {}", refused.status))?;
    }
    let view = format!("/{DB}/_design/routes/_view/by_key?key=%22k1%22");
    let rows = as_login(&e, "admin", Method::GET, &view, None).await?.expect(200, "admin's view")?;
    check(rows.body["rows"].as_array().is_some_and(|rows| rows.len() == 2), || format!("by_key k1: {}", rows.body))?;
    let refused = as_login(&e, "alice", Method::GET, &view, None).await?;
    check(refused.status == StatusCode::FORBIDDEN, || format!("alice's view: {} {}", refused.status, refused.body))
}

/// `PUT` and `DELETE /{db}` of the data-store database: a per-user login gets CouchDB 3.4.3's
/// answer to a login that is no server admin (401 `unauthorized`, "You are not a server admin.");
/// the admin gets 412 `file_exists` (it exists) and 403 (never deleted through the API).
pub(super) async fn per_user_create_and_delete_database(e: Endpoint) -> TestResult {
    for path in [format!("/{DB}"), format!("/{DB}/")] {
        for method in [Method::PUT, Method::DELETE] {
            let refused = as_login(&e, "alice", method.clone(), &path, None).await?;
            check(
                refused.status == StatusCode::UNAUTHORIZED
                    && refused.body == json!({ "error": "unauthorized", "reason": "You are not a server admin." }),
                || format!("{method} {path} by alice: {} {}", refused.status, refused.body),
            )?;
        }
        let created = as_login(&e, "admin", Method::PUT, &path, None).await?;
        same_error(&created, "004-db-create-again")?;
        let deleted = as_login(&e, "admin", Method::DELETE, &path, None).await?;
        check(deleted.status == StatusCode::FORBIDDEN && deleted.body["error"] == "forbidden", || {
            format!("DELETE {path} by the admin: {} {}", deleted.status, deleted.body)
        })?;
    }
    // Still there, for both.
    as_login(&e, "admin", Method::GET, &format!("/{DB}"), None).await?.expect(200, "admin GET /{db}")?;
    as_login(&e, "alice", Method::GET, &format!("/{DB}"), None).await?.expect(200, "alice GET /{db}")?;
    Ok(())
}
