//! `_find`: every request carries a limit, listings follow bookmarks and stop after the short page
//! or at the empty page that echoes the bookmark, and a bad bookmark or refused find is invalid
//! input.

use super::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn find_always_sends_a_limit() {
    let server = MockServer::start().await;
    let (backend, store) = open_store(&server, page_size(100)).await;
    // What real CouchDB does: without a limit it stops at 25 (026)…
    let capped = transcript(26);
    capped
        .mock()
        .and(BodyLacks("limit"))
        .respond_with(capped.response_with_body(&with_ids_and_revs(&capped.response_body, "user_123", "notes")))
        .named("026 without limit")
        .mount(&server)
        .await;
    // …and with one it answers every match up to the limit: the 31 notes of 027–029.
    let mut all = Vec::new();
    for number in [27, 28, 29] {
        let page = with_ids_and_revs(&transcript(number).response_body, "user_123", "notes");
        all.extend(page["docs"].as_array().unwrap().iter().cloned());
    }
    let first = transcript(27);
    let everything = json!({ "docs": all, "bookmark": bookmark_of(&transcript(29)) });
    first
        .mock()
        .and(BodyHas("limit"))
        .respond_with(first.response_with_body(&everything))
        .named("all notes with a limit")
        .mount(&server)
        .await;

    let expected: Vec<String> = [27, 28, 29].into_iter().flat_map(|n| keys_of(&transcript(n))).collect();
    assert_eq!(expected.len(), 31);
    assert_eq!(store.list_keys("user_123", "notes").await.unwrap(), expected);
    assert_eq!(store.list_namespaces("user_123").await.unwrap(), vec!["notes".to_owned()]);
    assert_eq!(store.get_all("user_123", "notes").await.unwrap().len(), 31);
    for limit in [0, 1, 7] {
        backend.query(&notes_query(), limit, None).await.unwrap();
    }

    let requests = received(&server).await;
    let limits: Vec<Value> = find_bodies(&requests).iter().map(|b| b["limit"].clone()).collect();
    // list_keys and list_namespaces use the page size, get_all at most 100, query its own (≥ 1).
    assert_eq!(limits, vec![json!(100), json!(100), json!(100), json!(1), json!(1), json!(7)]);
    assert_every_find_has_a_limit(&requests);
    assert_all_authorized(&requests);
}

/// Mounts 027–030 as CouchDB answered them: each page for the bookmark its request carried.
async fn mount_recorded_pages(server: &MockServer, numbers: &[u32]) {
    for &number in numbers {
        let t = transcript(number);
        // Our fields differ from the recorded ones (we also ask for _id and _rev): match the rest.
        let partial = without(&t.request_body, "fields");
        let mut mock = t.mock_with_partial_body(partial);
        if t.request_body.get("bookmark").is_none() {
            mock = mock.and(BodyLacks("bookmark"));
        }
        let body = with_ids_and_revs(&t.response_body, "user_123", "notes");
        mock.respond_with(t.response_with_body(&body)).named(t.file.clone()).mount(server).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn list_keys_follows_bookmarks_and_stops_after_the_short_page() {
    let server = MockServer::start().await;
    let (_backend, store) = open_store(&server, page_size(12)).await;
    mount_recorded_pages(&server, &[27, 28, 29, 30]).await;

    let keys = store.list_keys("user_123", "notes").await.unwrap();
    // 027–029 hold 12 + 12 + 7 keys: note-000 … note-029 and note-new (created by 025).
    let expected: Vec<String> = [27, 28, 29].into_iter().flat_map(|n| keys_of(&transcript(n))).collect();
    assert_eq!(keys.len(), 31, "{keys:?}");
    assert_eq!(keys.iter().collect::<BTreeSet<_>>().len(), keys.len(), "a key came back twice: {keys:?}");
    assert_eq!(keys, expected);

    let requests = received(&server).await;
    let finds = find_bodies(&requests);
    assert_eq!(finds.len(), 3, "page 3 (029) had 7 < 12 docs, so no request for page 4: {finds:#?}");
    assert!(finds[0].get("bookmark").is_none(), "{}", finds[0]);
    assert_eq!(finds[1]["bookmark"], json!(bookmark_of(&transcript(27))));
    assert_eq!(finds[2]["bookmark"], json!(bookmark_of(&transcript(28))));
    for find in &finds {
        assert_eq!(find["limit"], json!(12));
        assert_eq!(find["selector"], json!({"userId": "user_123", "namespace": "notes"}));
        assert_eq!(find["use_index"], json!([INDEX_DDOC, INDEX_NAME]));
    }
    assert_all_authorized(&requests);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn list_keys_stops_at_the_empty_page_that_echoes_the_bookmark() {
    let server = MockServer::start().await;
    let (backend, store) = open_store(&server, page_size(12)).await;
    // Two full pages (027, 028), then — as 030 does after 029 — an empty page that echoes the
    // bookmark it was sent. Taking that bookmark as a next page would ask for the same page again.
    mount_recorded_pages(&server, &[27, 28]).await;
    let echo = transcript(30);
    let second = bookmark_of(&transcript(28));
    echo.mock_with_partial_body(json!({ "selector": echo.request_body["selector"], "bookmark": second }))
        .respond_with(echo.response_with_body(&json!({ "docs": [], "bookmark": second })))
        .named("empty page echoing 028's bookmark")
        .mount(&server)
        .await;

    let keys = store.list_keys("user_123", "notes").await.unwrap();
    let expected: Vec<String> = [27, 28].into_iter().flat_map(|n| keys_of(&transcript(n))).collect();
    assert_eq!(keys, expected);
    let finds = find_bodies(&received(&server).await);
    assert_eq!(finds.len(), 3, "{finds:#?}");
    assert_eq!(finds[2]["bookmark"], json!(second));

    // 030 itself, replayed verbatim at the backend level: no items, no next page.
    mount_recorded_pages(&server, &[30]).await;
    let page = backend.query(&notes_query(), 12, Some(&page_token(&bookmark_of(&transcript(29))))).await.unwrap();
    assert!(page.items.is_empty());
    assert_eq!(page.next, None);
    let requests = received(&server).await;
    assert_eq!(find_bodies(&requests).len(), 4);
    assert_all_authorized(&requests);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_bookmark_and_refused_finds_are_invalid_input() {
    let server = MockServer::start().await;
    let backend = open_backend(&server).await;
    let bad = transcript(35);
    bad.mock_with_body().respond_with(bad.response()).named(bad.file.clone()).mount(&server).await;
    let err = backend.query(&notes_query(), 12, Some(&page_token("not-a-bookmark"))).await.unwrap_err();
    assert_eq!(err.kind(), ErrorKind::InvalidInput, "{err}");
    assert!(err.to_string().contains("invalid_bookmark"), "{err}");
    let requests = received(&server).await;
    assert_eq!(find_bodies(&requests).len(), 1, "a 400 is not retried");
    assert_every_find_has_a_limit(&requests);

    // A token this backend never produced is refused before anything is sent.
    let err = backend.query(&notes_query(), 12, Some("not json")).await.unwrap_err();
    assert_eq!(err.kind(), ErrorKind::InvalidInput, "{err}");
    assert_eq!(find_bodies(&received(&server).await).len(), 1);
    assert_all_authorized(&received(&server).await);

    // 036–038: the adapter never sends such bodies, so their responses are replayed for any
    // _find; what matters is that a 400 maps to InvalidInput with CouchDB's reason, unretried.
    for (number, error) in [(36, "invalid_operator"), (37, "missing_required_key"), (38, "no_usable_index")] {
        let server = MockServer::start().await;
        let backend = open_backend(&server).await;
        let t = transcript(number);
        t.mock().respond_with(t.response()).named(t.file.clone()).mount(&server).await;
        let err = backend.query(&notes_query(), 12, None).await.unwrap_err();
        assert_eq!(err.kind(), ErrorKind::InvalidInput, "{number:03}: {err}");
        assert!(err.to_string().contains(error), "{number:03}: {err}");
        let requests = received(&server).await;
        assert_eq!(find_bodies(&requests).len(), 1, "{number:03}");
        assert_all_authorized(&requests);
    }
}
