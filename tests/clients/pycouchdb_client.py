"""pycouchdb driving an ordinary workflow against the endpoint: database(name) (HEAD /db), save
(PUT with the id), get, update with _rev, a stale update (Conflict), delete (HEAD for the ETag,
then DELETE), save_bulk (all_or_nothing), all() paging, mango_pages (bookmark) and changes_list.
"""

import pycouchdb
from pycouchdb import exceptions

from clientlib import check, check_eq, couch_only, data_doc, done, env, expect_error, mine, step, check_new_changes_only

NAMESPACE = "py:pycouchdb"
BULK = 21
PAGE = 6


def main():
    user_id = env("COUCH_USER_ID")
    prefix = f"{user_id}:{NAMESPACE}:"
    server = pycouchdb.Server(env("COUCH_URL"), authmethod="basic")

    with step("database(name)"):
        db = server.database(env("COUCH_DB"))

    first = data_doc(user_id, NAMESPACE, "report", {"score": 95, "items": ["a", "b"]}, metadata={"v": "1.0"})
    with step("save (PUT /db/id) and get"):
        saved = db.save(first)
        check(saved["_rev"].startswith("1-"), saved)
        fetched = db.get(first["_id"])
        check_eq(fetched["_rev"], saved["_rev"], "rev")
        check_eq(fetched["value"], first["value"], "value")
        check_eq(fetched["metadata"], first["metadata"], "metadata")

    with step("update with _rev, then a stale update raises Conflict"):
        updated = db.save({**fetched, "value": {"score": 96}})
        check(updated["_rev"].startswith("2-"), updated)
        expect_error(exceptions.Conflict, "stale save", lambda: db.save({**fetched, "value": "lost"}))
        check_eq(db.get(first["_id"])["value"], {"score": 96}, "value after the stale save")

    with step("delete by id (rev from the HEAD ETag), then get raises NotFound"):
        with couch_only("HEAD ETag is the quoted revision (pycouchdb deletes with it)"):
            db.delete(first["_id"])
            expect_error(exceptions.NotFound, "get after delete", lambda: db.get(first["_id"]))
        if first["_id"] in db:
            db.delete(db.get(first["_id"]))

    docs = [data_doc(user_id, NAMESPACE, f"bulk {i:02}", {"i": i}) for i in range(BULK)]
    expected_ids = sorted(d["_id"] for d in docs)
    with step(f"save_bulk of {BULK} (all_or_nothing), then delete_bulk of 3"):
        saved_docs = db.save_bulk(docs)
        check(all(d["_rev"].startswith("1-") for d in saved_docs), saved_docs)
        db.delete_bulk(saved_docs[-3:])
        expected_ids = sorted(d["_id"] for d in saved_docs[:-3])

    with step(f"all() in pages of {PAGE}"):
        seen, startkey = [], prefix
        while True:
            rows = db.all(startkey=startkey, endkey=prefix + "\ufff0", limit=PAGE + 1, as_list=True)
            seen.extend(row["id"] for row in rows[:PAGE])
            for row in rows[:PAGE]:
                check_eq(row["doc"]["userId"], user_id, row["id"])
            if len(rows) <= PAGE:
                break
            startkey = rows[PAGE]["id"]
        check_eq(seen, expected_ids, "ids listed")
        by_keys = db.all(keys=[expected_ids[1], expected_ids[0]], as_list=True)
        check_eq([row["id"] for row in by_keys], [expected_ids[1], expected_ids[0]], "keys order")

    with step("find, and mango_pages paged by bookmark"):
        found = list(db.find({"userId": user_id, "namespace": NAMESPACE, "value.i": {"$lt": 5}}, limit=100))
        check_eq(sorted(d["_id"] for d in found), sorted(d["_id"] for d in docs if d["value"]["i"] < 5), "found")
        with couch_only("_find answers a bookmark (mango_pages stops after the first page without one)"):
            paged = [d["_id"] for page in db.mango_pages({"userId": user_id, "namespace": NAMESPACE}, PAGE) for d in page]
            check_eq(sorted(paged), expected_ids, "ids paged")

    with step("changes_list since 0, then since its last_seq"):
        last_seq, results = db.changes_list(since=0)
        rows = {row["id"]: row for row in mine(results, prefix)}
        check_eq(sorted(rows), sorted([*expected_ids, *(d["_id"] for d in saved_docs[-3:]), first["_id"]]), "ids")
        check(rows[first["_id"]].get("deleted") is True, rows[first["_id"]])
        later = db.save(data_doc(user_id, NAMESPACE, "later", None))
        _, next_results = db.changes_list(since=last_seq)
        check_new_changes_only(mine(next_results, prefix), mine(results, prefix), [later["_id"]], "changes since last_seq")

    done("pycouchdb")


if __name__ == "__main__":
    main()
