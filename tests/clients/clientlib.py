"""What every Python client script shares: the endpoint from the environment, data-store
documents, and steps that stop the script with a clear message on the first failure.

Environment (set by tests/suites/couchdb_clients.rs; the same as for the Node scripts, see common.js):
COUCH_URL (server root with the admin's credentials), COUCH_DB, COUCH_USER_ID (the data-store
userId this script writes, distinct per script), COUCH_TARGET (`agentstore` or `pouchdb-server`).
"""

import base64
import contextlib
import datetime
import json
import os
import sys
import traceback
import urllib.error
import urllib.parse
import urllib.request


def env(name, default=None):
    value = os.environ.get(name, default)
    if not value:
        fail(f"environment variable {name} is not set")
    return value


def fail(message):
    """Ends the script: the message is what the harness shows as the trial's failure."""
    sys.stderr.write(f"FAILED: {message}\n")
    sys.exit(1)


def doc_id(user_id, namespace, key):
    """The data-store composite id: userId, namespace and the key in base64url with `=` padding."""
    return f"{user_id}:{namespace}:{base64.urlsafe_b64encode(key.encode()).decode()}"


def data_doc(user_id, namespace, key, value, **extra):
    """A data-store document for `key`, with `value` and the timestamps the schema asks for."""
    now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    doc = {
        "_id": doc_id(user_id, namespace, key),
        "userId": user_id,
        "namespace": namespace,
        "key": key,
        "value": value,
        "createdAt": now,
        "updatedAt": now,
    }
    doc.update(extra)
    return doc


def check(condition, message):
    if not condition:
        raise AssertionError(message)


def check_eq(actual, expected, what):
    if actual != expected:
        raise AssertionError(f"{what}: expected {expected!r}, got {actual!r}")


@contextlib.contextmanager
def step(name):
    """One named step; an exception in it ends the script naming the step."""
    try:
        yield
    except SystemExit:
        raise
    except BaseException as error:  # noqa: BLE001 - the whole point is to report anything
        fail(f"{name}: {type(error).__name__}: {error}\n{traceback.format_exc(limit=-3)}")
    print(f"ok: {name}", flush=True)


_reported = set()


@contextlib.contextmanager
def couch_only(what):
    """A check of CouchDB behaviour that pouchdb-server does not have: against our endpoint (and
    any CouchDB) a failure fails the script; against pouchdb-server it is printed as a known
    difference."""
    try:
        yield
    except Exception as error:  # noqa: BLE001 - a client raises its own error types
        if os.environ.get("COUCH_TARGET") != "pouchdb-server":
            raise
        if what not in _reported:
            _reported.add(what)
            print(f"pouchdb-server differs from CouchDB: {what}: {type(error).__name__}: {str(error)[:240]}", flush=True)


def expect_error(exception_types, what, call):
    """Runs `call`, which must raise one of `exception_types`; returns the exception."""
    try:
        result = call()
    except exception_types as error:
        return error
    raise AssertionError(f"{what}: expected {exception_types}, got success: {result!r}")


def check_new_changes_only(rows, first_rows, new_ids, what):
    """Checks the rows of a `_changes` answer read from the `last_seq` of an earlier one, whose rows
    were `first_rows`: each of `new_ids` is there, and any other row is a change the earlier answer
    listed, at the same revision (a feed may deliver a change again, never leave one out; see
    newChangesOnly in common.js)."""
    before = {row["id"]: row["changes"][0]["rev"] for row in first_rows}
    for doc_id in new_ids:
        check(any(row["id"] == doc_id for row in rows), f"{what}: {doc_id} is missing from {rows}")
    for row in rows:
        if row["id"] not in new_ids:
            check(before.get(row["id"]) == row["changes"][0]["rev"], f"{what}: neither new nor a repeat: {row}")


def split_credentials(url):
    """(url without credentials, user, password) of a URL with credentials."""
    parts = urllib.parse.urlsplit(url)
    bare = parts._replace(netloc=parts.hostname + (f":{parts.port}" if parts.port else ""))
    return (
        urllib.parse.urlunsplit(bare).rstrip("/"),
        urllib.parse.unquote(parts.username or ""),
        urllib.parse.unquote(parts.password or ""),
    )


def http(method, url, body=None, headers=None):
    """A plain HTTP request with the URL's credentials as Basic; returns (status, headers, JSON)."""
    bare, user, password = split_credentials(url)
    request = urllib.request.Request(bare, method=method, headers=dict(headers or {}))
    if user:
        token = base64.b64encode(f"{user}:{password}".encode()).decode()
        request.add_header("Authorization", f"Basic {token}")
    if body is not None:
        request.data = json.dumps(body).encode()
        request.add_header("Content-Type", "application/json")
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, response.headers, json.loads(response.read() or b"null")
    except urllib.error.HTTPError as error:
        return error.code, error.headers, json.loads(error.read() or b"null")


def mine(rows, prefix, key="id"):
    """The rows of a listing whose document id starts with `prefix`."""
    return [row for row in rows if row[key].startswith(prefix)]


def done(client):
    print(f"{client}: all steps passed", flush=True)
