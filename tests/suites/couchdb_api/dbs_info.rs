//! `GET /_dbs_info` (issue 35 review): CouchDB 3.4.3 answers it (checked with curl, and in its
//! `chttpd_misc.erl`) with `_all_dbs`' parameters (`startkey`/`endkey`, `limit`, `skip`,
//! `descending`) and, for each database selected, the row `POST /_dbs_info` answers for it
//! (`{"key", "info"}`). Here at most `couchdb_max_dbs_info_keys` databases at once: a larger
//! selection is 400 naming the setting (CouchDB has no bound).

use super::*;

/// The trial's bound on the databases one `_dbs_info` answers.
pub(super) const DBS_INFO_CONFIG: &str = "couchdb_max_dbs_info_keys = 3\n";

/// The keys of `GET /_dbs_info?{query}`'s rows, each checked to hold an info in CouchDB's shape.
async fn keys_of(e: &Endpoint, query: &str) -> Result<Vec<String>, Failed> {
    let answer = e.get(&format!("/_dbs_info?{query}")).await?.expect(200, query)?;
    let rows = answer.body.as_array().cloned().unwrap_or_default();
    let mut keys = Vec::new();
    for row in rows {
        let key = row["key"].as_str().unwrap_or_default().to_owned();
        same_fields(&row["info"], &couchdb_body("005-db-info"), &format!("GET /_dbs_info row {key}"), &[])?;
        check(row["info"]["db_name"] == key.as_str(), || format!("row {key}'s db_name: {}", row["info"]))?;
        keys.push(key);
    }
    Ok(keys)
}

pub(super) async fn get_dbs_info_as_couchdb(e: Endpoint) -> TestResult {
    let mut random = [0u8; 6];
    getrandom::fill(&mut random).map_err(|err| err.to_string())?;
    let prefix = format!("dbs-info-{}", hex::encode(random));
    let names: Vec<String> = ["a", "b", "c", "d"].iter().map(|tag| format!("{prefix}-{tag}")).collect();
    for name in &names {
        e.call(Method::PUT, &format!("/{name}"), None).await?.expect(201, "PUT database")?;
    }
    let (start, end) = (format!("%22{prefix}%22"), format!("%22{prefix}-%EF%BF%BF%22"));
    let range = format!("startkey={start}&endkey={end}");

    let page = keys_of(&e, &format!("{range}&limit=3")).await?;
    check(page == names[..3], || format!("the first three: {page:?}"))?;
    let page = keys_of(&e, &format!("{range}&skip=3")).await?;
    check(page == names[3..], || format!("skip=3: {page:?}"))?;
    let page = keys_of(&e, &format!("startkey={end}&endkey={start}&descending=true&limit=2")).await?;
    check(page == [names[3].clone(), names[2].clone()], || format!("descending: {page:?}"))?;
    let posted = e.post("/_dbs_info", json!({ "keys": [names[0]] })).await?.expect(200, "POST")?;
    let got = e.get(&format!("/_dbs_info?startkey=%22{}%22&limit=1", names[0])).await?.expect(200, "one")?;
    check(got.body[0]["key"] == posted.body[0]["key"] && got.body[0]["info"]["db_name"] == names[0].as_str(), || {
        format!("GET's row {} where POST's is {}", got.body, posted.body)
    })?;
    let data_store = keys_of(&e, &format!("startkey=%22{DB}%22&endkey=%22{DB}%22")).await?;
    check(data_store == [DB], || format!("the data-store database: {data_store:?}"))?;

    let refused = e.get(&format!("/_dbs_info?{range}")).await?.expect(400, "four databases")?;
    let reason = refused.body["reason"].as_str().unwrap_or_default();
    check(refused.body["error"] == "bad_request" && reason.contains("couchdb_max_dbs_info_keys"), || {
        format!("past the bound: {}", refused.body)
    })?;
    for name in &names {
        e.delete(&format!("/{name}")).await?.expect(200, "DELETE database")?;
    }
    let gone = keys_of(&e, &range).await?;
    check(gone.is_empty(), || format!("deleted databases listed: {gone:?}"))
}
