"""python-couchdb (the `CouchDB` package) managing databases of its own on the endpoint:
server.create (and again: PreconditionFailed), `name in server`, documents of any shape with a
conflict written by update(new_edits=False), read back with conflicts=True, then del server[name]
(no longer there; deleting again is ResourceNotFound).
"""

import os
import time

import couchdb
from couchdb.http import PreconditionFailed, ResourceNotFound

from clientlib import check, check_eq, done, env, expect_error, step


def main():
    server = couchdb.Server(env("COUCH_URL"))
    name = f"py-dbs-{os.getpid()}-{int(time.time() * 1000)}"

    with step(f"create {name}; creating it again is PreconditionFailed"):
        db = server.create(name)
        expect_error(PreconditionFailed, "create twice", lambda: server.create(name))
        check(name in server, "HEAD /name answers 200")

    with step("documents of any shape and a replicated conflict"):
        first_id, first_rev = db.save({"_id": "doc", "nested": {"list": [1.5, "x", None]}})
        db.update([{"_id": "doc", "_rev": "1-ffffffffffffffffffffffffffffffff", "side": "replicated"}], new_edits=False)
        doc = db.get("doc", conflicts=True)
        check_eq(doc.rev, "1-ffffffffffffffffffffffffffffffff", "the higher revision id wins")
        check_eq(doc.get("_conflicts"), [first_rev], "_conflicts")
        check_eq(db.info()["doc_count"], 1, "doc_count")

    with step("delete: gone, and deleting again is ResourceNotFound"):
        del server[name]
        check(name not in server, "HEAD /name answers 404")
        check(name not in list(server), "_all_dbs no longer lists it")
        expect_error(ResourceNotFound, "delete twice", lambda: server.delete(name))

    done("python-couchdb databases")


if __name__ == "__main__":
    main()
