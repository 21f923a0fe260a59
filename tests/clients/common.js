// What every Node client script shares: the endpoint from the environment, data-store documents,
// and checks that stop the script with a clear message on the first failure.
//
// Environment (set by tests/suites/couchdb_clients.rs):
//   COUCH_URL        server root with the admin's credentials, e.g. http://admin:pw@127.0.0.1:5984
//   COUCH_DB         the database
//   COUCH_USER_ID    the data-store userId this script writes (distinct per script, so scripts
//                    can share one endpoint)
//   COUCH_URL_EMPTY  a second endpoint whose database COUCH_DB_EMPTY (default COUCH_DB) is empty,
//                    for scripts that restore or replicate into one
//   COUCH_TARGET     `agentstore` or `pouchdb-server`: steps that only our endpoint passes (it
//                    refuses documents that are not data-store documents) run against it alone
'use strict';

const assert = require('node:assert/strict');

function env(name, fallback) {
  const value = process.env[name] ?? fallback;
  if (value === undefined || value === '') {
    fail(`environment variable ${name} is not set`);
  }
  return value;
}

/** Ends the script: the message is what the harness shows as the trial's failure. */
function fail(message) {
  process.stderr.write(`FAILED: ${message}\n`);
  process.exit(1);
}

/** The data-store composite id: userId, namespace and the key in base64url with `=` padding. */
function docId(userId, namespace, key) {
  const raw = Buffer.from(key, 'utf8').toString('base64url');
  return `${userId}:${namespace}:${raw}${'='.repeat((4 - (raw.length % 4)) % 4)}`;
}

/** A data-store document for `key`, with `value` and the timestamps the schema asks for. */
function dataDoc(userId, namespace, key, value, extra = {}) {
  const now = new Date().toISOString();
  return {
    _id: docId(userId, namespace, key),
    userId,
    namespace,
    key,
    value,
    createdAt: now,
    updatedAt: now,
    ...extra,
  };
}

/**
 * Checks the rows of a `_changes` answer read from the `last_seq` of an earlier one, whose rows
 * were `firstRows`: each of `newIds` is there, and any other row is a change the earlier answer
 * listed, at the same revision. A feed may deliver a change again (CouchDB's may; the endpoint's,
 * over a backend with a settle window, once more when the change settles, see
 * docs/document-model.md); it never leaves one out, and a write is in the next read at once.
 */
function newChangesOnly(rows, firstRows, newIds, what) {
  const before = new Map(firstRows.map((row) => [row.id, row.changes[0].rev]));
  for (const id of newIds) {
    assert.ok(rows.some((row) => row.id === id), `${what}: ${id} is missing from ${JSON.stringify(rows)}`);
  }
  for (const row of rows.filter((r) => !newIds.includes(r.id))) {
    assert.equal(row.changes[0].rev, before.get(row.id), `${what}: neither new nor a repeat: ${JSON.stringify(row)}`);
  }
}

/** `url` without its credentials, for messages. */
function redact(url) {
  return url.replace(/\/\/[^@/]*@/, '//');
}

/** Runs one named step; a thrown error or failed assertion ends the script naming the step. */
async function step(name, body) {
  try {
    const result = await body();
    process.stdout.write(`ok: ${name}\n`);
    return result;
  } catch (error) {
    const detail = error && error.stack ? error.stack : String(error);
    const status = error && (error.statusCode ?? error.status);
    fail(`${name}: ${status ? `HTTP ${status}: ` : ''}${detail}`);
  }
  return undefined;
}

/**
 * A check of CouchDB behaviour that pouchdb-server does not have: against our endpoint (and any
 * CouchDB) a failure fails the script; against pouchdb-server it is printed as a known difference.
 */
const reportedDifferences = new Set();
async function couchOnly(what, check) {
  try {
    await check();
  } catch (error) {
    if (process.env.COUCH_TARGET !== 'pouchdb-server') throw error;
    if (reportedDifferences.has(what)) return;
    reportedDifferences.add(what);
    process.stdout.write(`pouchdb-server differs from CouchDB: ${what}: ${error.message.replace(/\s+/g, ' ').slice(0, 240)}\n`);
  }
}

/**
 * The ids of every document `_find` returns for `selector`, page by page (`limit` each) following
 * `bookmark`, through the client's own `find(query)`. pouchdb-server has no bookmarks: there it
 * pages by `skip` instead (printed as a difference). Fails if paging goes past `maxPages`.
 */
async function findAllByBookmark(find, selector, limit, maxPages) {
  const seen = [];
  let bookmark;
  for (let pages = 0; ; pages += 1) {
    assert.ok(pages <= maxPages, 'bookmark paging does not end');
    const paging = bookmark === undefined ? { skip: seen.length } : { bookmark };
    const page = await find({ selector, limit, ...paging });
    await couchOnly('_find answers a bookmark', () => assert.equal(typeof page.bookmark, 'string'));
    seen.push(...page.docs.map((doc) => doc._id));
    if (page.docs.length < limit) return seen;
    bookmark = page.bookmark;
  }
}

/** Expects `body` to be rejected with HTTP `status` (any 4xx when `status` is undefined). */
async function expectStatus(status, what, body) {
  let result;
  try {
    result = await body();
  } catch (error) {
    const got = error.statusCode ?? error.status;
    if (status === undefined) {
      assert.ok(got >= 400 && got < 500, `${what}: expected a 4xx, got ${got}: ${error.message}`);
    } else {
      assert.equal(got, status, `${what}: expected HTTP ${status}, got ${got}: ${error.message}`);
    }
    return error;
  }
  assert.fail(`${what}: expected HTTP ${status}, got success: ${JSON.stringify(result)}`);
  return undefined;
}

/** A plain HTTP request; resolves to {status, headers, body (parsed JSON or text)}. */
async function http(method, url, { body, headers = {}, json = true } = {}) {
  const parsed = new URL(url);
  const auth = parsed.username
    ? { authorization: `Basic ${Buffer.from(`${decodeURIComponent(parsed.username)}:${decodeURIComponent(parsed.password)}`).toString('base64')}` }
    : {};
  parsed.username = '';
  parsed.password = '';
  const response = await fetch(parsed, {
    method,
    headers: { ...auth, ...(body !== undefined && json ? { 'content-type': 'application/json' } : {}), ...headers },
    body: body === undefined ? undefined : json ? JSON.stringify(body) : body,
  });
  const text = await response.text();
  let parsedBody = text;
  try {
    parsedBody = text ? JSON.parse(text) : null;
  } catch (_) {
    // not JSON: left as text for the caller's message
  }
  return { status: response.status, headers: response.headers, body: parsedBody };
}

/** Every document whose id starts with `prefix`, read with `_all_docs` (id -> doc). */
async function docsWithPrefix(serverUrl, db, prefix) {
  const url = `${serverUrl.replace(/\/$/, '')}/${encodeURIComponent(db)}/_all_docs`;
  const { status, body } = await http('POST', url, {
    body: { startkey: prefix, endkey: `${prefix}\ufff0`, include_docs: true },
  });
  assert.equal(status, 200, `_all_docs of ${redact(serverUrl)}/${db}: HTTP ${status} ${JSON.stringify(body)}`);
  return Object.fromEntries(body.rows.map((row) => [row.id, row.doc]));
}

module.exports = { assert, couchOnly, dataDoc, docId, docsWithPrefix, env, expectStatus, fail, findAllByBookmark, http, newChangesOnly, redact, step };
