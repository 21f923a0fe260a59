"""python-couchdb (the `CouchDB` package) driving an ordinary workflow against the endpoint:
server[db] (HEAD /db), save (PUT with the id), db[id] (GETs cached by ETag, revalidated with
If-None-Match), update with _rev, a stale save (ResourceConflict), del db[id] (HEAD for the ETag,
then DELETE), update() (bulk), iterview('_all_docs') paging, find and _find paged by bookmark,
and changes.
"""

import couchdb
from couchdb.http import ResourceConflict, ResourceNotFound

from clientlib import check, check_eq, couch_only, data_doc, done, env, expect_error, mine, step, check_new_changes_only

NAMESPACE = "py:python-couchdb"
BULK = 19
PAGE = 4


def main():
    user_id = env("COUCH_USER_ID")
    prefix = f"{user_id}:{NAMESPACE}:"
    server = couchdb.Server(env("COUCH_URL"))

    with step("server version and server[db]"):
        parts = server.version_info()
        check(all(isinstance(p, int) for p in parts), parts)
        db = server[env("COUCH_DB")]
        check(isinstance(len(db), int), "len(db) reads doc_count")

    first = data_doc(user_id, NAMESPACE, "cfg", {"nested": {"deeply": {"data": [1, 2, 3]}}})
    with step("save (PUT /db/id), then db[id] twice (the second revalidated by ETag)"):
        doc_id, rev = db.save(dict(first))
        check_eq(doc_id, first["_id"], "id")
        check(rev.startswith("1-"), rev)
        check_eq(db[doc_id]["value"], first["value"], "value")
        check_eq(db[doc_id].rev, rev, "rev read again")

    with step("update with _rev (the cached GET sees the new revision), then a stale save conflicts"):
        _, rev2 = db.save({**first, "_rev": rev, "value": "second"})
        check(rev2.startswith("2-"), rev2)
        check_eq(db[doc_id]["value"], "second", "value after the update")
        expect_error(ResourceConflict, "stale save", lambda: db.save({**first, "_rev": rev, "value": "lost"}))

    with step("del db[id] (rev from the HEAD ETag), then db[id] raises ResourceNotFound"):
        with couch_only("HEAD ETag is the quoted revision (python-couchdb deletes with it)"):
            del db[doc_id]
            expect_error(ResourceNotFound, "get after delete", lambda: db[doc_id])
        if doc_id in db:
            db.delete(db[doc_id])

    docs = [data_doc(user_id, NAMESPACE, f"entry/{i}", i * 1.5) for i in range(BULK)]
    expected_ids = sorted(d["_id"] for d in docs)
    with step(f"update() of {BULK} (bulk), then a bulk with one stale revision"):
        results = db.update([dict(d) for d in docs])
        check(all(ok for ok, _, _ in results), results)
        revs = {doc_id: rev for _, doc_id, rev in results}
        stale = db.update([{**docs[0], "_rev": revs[docs[0]["_id"]]}, {**docs[0], "_rev": revs[docs[0]["_id"]]}])
        check_eq(stale[0][0], True, "the first update")
        check(isinstance(stale[1][2], ResourceConflict), stale)

    with step(f"iterview('_all_docs') in batches of {PAGE}"):
        rows = list(db.iterview("_all_docs", PAGE, startkey=prefix, endkey=prefix + "\ufff0", include_docs=True))
        check_eq([row.id for row in rows], expected_ids, "ids listed")
        check_eq(rows[3].doc["value"], next(d["value"] for d in docs if d["_id"] == rows[3].id), "a listed doc")

    with step("find, and _find paged by bookmark"):
        selector = {"userId": user_id, "namespace": NAMESPACE, "value": {"$gte": 3}}
        found = sorted(doc.id for doc in db.find({"selector": selector, "limit": 100}))
        check_eq(found, sorted(d["_id"] for d in docs if d["value"] >= 3), "found")
        with couch_only("_find answers a bookmark"):
            seen, bookmark = [], None
            for _ in range(BULK + 1):
                body = {"selector": {"userId": user_id, "namespace": NAMESPACE}, "limit": PAGE}
                if bookmark:
                    body["bookmark"] = bookmark
                _, _, page = db.resource.post_json("_find", body)
                check("bookmark" in page, f"no bookmark in {sorted(page)}")
                seen.extend(doc["_id"] for doc in page["docs"])
                if len(page["docs"]) < PAGE:
                    break
                bookmark = page["bookmark"]
            check_eq(sorted(seen), expected_ids, "ids paged")

    with step("changes since 0, then since its last_seq"):
        feed = db.changes(since=0)
        rows = {row["id"]: row for row in mine(feed["results"], prefix)}
        check_eq(sorted(rows), sorted([*expected_ids, doc_id]), "ids")
        check(rows[doc_id].get("deleted") is True, rows[doc_id])
        later, _ = db.save(data_doc(user_id, NAMESPACE, "later", [1]))
        following = db.changes(since=feed["last_seq"])
        check_new_changes_only(mine(following["results"], prefix), mine(feed["results"], prefix), [later], "changes since last_seq")

    done("python-couchdb")


if __name__ == "__main__":
    main()
