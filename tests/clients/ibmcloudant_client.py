"""IBM's Cloudant SDK for Python (ibmcloudant, request bodies gzip-compressed) driving an ordinary
workflow against the endpoint with Basic auth: database information, put_document, get_document,
an update with `rev`, a stale update (409), head_document (ETag), delete_document, post_bulk_docs,
the SDK's pagers (`_all_docs` by key, `_find` by bookmark), post_changes and the changes
follower; then the same reads through a `_session` cookie (CouchDbSessionAuthenticator).
"""

import os

from ibm_cloud_sdk_core import ApiException
from ibm_cloud_sdk_core.authenticators import BasicAuthenticator
from ibmcloudant import CouchDbSessionAuthenticator
from ibmcloudant.cloudant_v1 import BulkDocs, CloudantV1, Document
from ibmcloudant.features.changes_follower import ChangesFollower
from ibmcloudant.features.pagination import Pagination, PagerType

from clientlib import check, check_eq, couch_only, data_doc, done, env, expect_error, mine, split_credentials, step

NAMESPACE = "py:ibmcloudant"
BULK = 25
PAGE = 7


def client(authenticator):
    url, _, _ = split_credentials(env("COUCH_URL"))
    service = CloudantV1(authenticator=authenticator)
    service.set_service_url(url)
    return service


def main():
    user_id = env("COUCH_USER_ID")
    db = env("COUCH_DB")
    prefix = f"{user_id}:{NAMESPACE}:"
    _, user, password = split_credentials(env("COUCH_URL"))
    service = client(BasicAuthenticator(user, password))

    with step("get_database_information"):
        info = service.get_database_information(db=db).get_result()
        check_eq(info["db_name"], db, "db_name")
        check(isinstance(info["doc_count"], int), info)

    first = data_doc(user_id, NAMESPACE, "a/b:c", "text", metadata={"tags": ["x"]})
    with step("put_document, get_document"):
        created = service.put_document(db=db, doc_id=first["_id"], document=first).get_result()
        check(created["ok"] and created["rev"].startswith("1-"), created)
        doc = service.get_document(db=db, doc_id=first["_id"]).get_result()
        check_eq(doc["_rev"], created["rev"], "rev")
        check_eq(doc["metadata"], first["metadata"], "metadata")

    with step("update with rev, a stale update is 409, head_document's ETag"):
        updated = service.put_document(db=db, doc_id=first["_id"], document={**doc, "value": "new"}).get_result()
        check(updated["rev"].startswith("2-"), updated)
        error = expect_error(ApiException, "stale put", lambda: service.put_document(db=db, doc_id=first["_id"], document={**doc, "value": "lost"}))
        check_eq(error.code, 409, f"status of the stale put ({error.message})")
        head = service.head_document(db=db, doc_id=first["_id"])
        check_eq(head.get_status_code(), 200, "HEAD status")
        with couch_only("HEAD ETag is the quoted revision"):
            check_eq(head.get_headers().get("ETag"), f'"{updated["rev"]}"', "ETag")

    with step("delete_document with rev, then get_document is 404"):
        deleted = service.delete_document(db=db, doc_id=first["_id"], rev=updated["rev"]).get_result()
        check(deleted["rev"].startswith("3-"), deleted)
        error = expect_error(ApiException, "get after delete", lambda: service.get_document(db=db, doc_id=first["_id"]))
        check_eq(error.code, 404, "status")

    # The documents deleted above, which _changes lists as deleted.
    deleted_ids = [first["_id"]]
    if os.environ.get("COUCH_TARGET") == "agentstore":
        with step("post_document without _id: the endpoint derives the composite id"):
            fields = data_doc(user_id, NAMESPACE, "derived", 7)
            answer = service.post_document(db=db, document={k: v for k, v in fields.items() if k != "_id"}).get_result()
            check_eq(answer["id"], fields["_id"], "derived id")
            service.delete_document(db=db, doc_id=answer["id"], rev=answer["rev"])
            deleted_ids.append(answer["id"])

    docs = [data_doc(user_id, NAMESPACE, f"row-{i:03}", {"i": i, "even": i % 2 == 0}) for i in range(BULK)]
    expected_ids = sorted(d["_id"] for d in docs)
    with step(f"post_bulk_docs of {BULK}"):
        results = service.post_bulk_docs(db=db, bulk_docs=BulkDocs(docs=[Document.from_dict(d) for d in docs])).get_result()
        check_eq([(r["id"], r.get("ok")) for r in results], [(d["_id"], True) for d in docs], "results")

    with step(f"the _all_docs pager, pages of {PAGE}"):
        pagination = Pagination.new_pagination(
            service, PagerType.POST_ALL_DOCS, db=db, start_key=prefix, end_key=prefix + "\ufff0", limit=PAGE, include_docs=True
        )
        pages = list(pagination.pages())
        check_eq([len(page) for page in pages][:-1], [PAGE] * (len(pages) - 1), "page sizes")
        check_eq([row.id for page in pages for row in page], expected_ids, "ids listed")
        check(all(row.doc.userId == user_id for page in pages for row in page), "docs included")

    with step(f"post_find, and the _find pager by bookmark (pages of {PAGE})"):
        even = service.post_find(db=db, selector={"userId": user_id, "namespace": NAMESPACE, "value.even": True}, limit=100).get_result()
        check_eq(sorted(d["_id"] for d in even["docs"]), sorted(d["_id"] for d in docs if d["value"]["even"]), "even")
        with couch_only("_find answers a bookmark (the SDK's pager needs it)"):
            pagination = Pagination.new_pagination(service, PagerType.POST_FIND, db=db, selector={"userId": user_id, "namespace": NAMESPACE}, limit=PAGE)
            # The pager yields the SDK's `Document` models: the id is the attribute `_id`, and the
            # data-store fields are dynamic attributes of the same names.
            paged = list(pagination.rows())
            check(all(isinstance(doc, Document) for doc in paged), f"the pager yields Documents: {paged[:1]!r}")
            check_eq(sorted(doc._id for doc in paged), expected_ids, "ids paged")
            check(all(doc.userId == user_id and doc.namespace == NAMESPACE for doc in paged), "fields of the paged docs")

    with step("post_changes since 0, and the changes follower (one-off)"):
        feed = service.post_changes(db=db, since="0").get_result()
        rows = {row["id"]: row for row in mine(feed["results"], prefix)}
        check_eq(sorted(rows), sorted([*expected_ids, *deleted_ids]), "ids")
        check(all(rows[gone].get("deleted") is True for gone in deleted_ids), [rows[gone] for gone in deleted_ids])
        with couch_only("_changes answers `pending` (the follower's one-off mode stops at pending == 0)"):
            check("pending" in feed, f"no pending in {sorted(feed)}")
            followed = {change.id for change in ChangesFollower(service, db=db).start_one_off() if change.id.startswith(prefix)}
            check_eq(sorted(followed), sorted(rows), "ids followed")

    with step("the same reads through a _session cookie (CouchDbSessionAuthenticator)"):
        with couch_only("POST /_session takes JSON {username, password} and sets a cookie with Expires"):
            session = client(CouchDbSessionAuthenticator(user, password))
            doc = session.get_document(db=db, doc_id=expected_ids[0]).get_result()
            check_eq(doc["_id"], expected_ids[0], "id")
            found = session.post_find(db=db, selector={"userId": user_id, "namespace": NAMESPACE}, limit=100).get_result()
            check_eq(len(found["docs"]), BULK, "found through the session")

    done("ibmcloudant")


if __name__ == "__main__":
    main()
