// nano (apache/couchdb-nano) driving an ordinary workflow against the endpoint: create, read,
// update with _rev, a stale update (409), delete, bulk, `_all_docs` paging, `_find` paging by
// bookmark and `_changes`, each answer checked here.
'use strict';

const nano = require('nano');
const { assert, couchOnly, dataDoc, findAllByBookmark, docId, env, expectStatus, newChangesOnly, step } = require('./common');

const NAMESPACE = 'files:nano';
const BULK = 23;
const PAGE = 5;

async function main() {
  const userId = env('COUCH_USER_ID');
  const db = nano(env('COUCH_URL')).use(env('COUCH_DB'));
  const prefix = `${userId}:${NAMESPACE}:`;

  const first = dataDoc(userId, NAMESPACE, 'src/main.py', { lines: 2, language: 'python' }, { metadata: { source: 'nano' } });
  const created = await step('insert (POST /db with _id)', async () => {
    const answer = await db.insert(first);
    assert.equal(answer.ok, true);
    assert.equal(answer.id, first._id);
    assert.match(answer.rev, /^1-[^-]+$/);
    return answer;
  });

  await step('get and head', async () => {
    const doc = await db.get(first._id);
    assert.equal(doc._rev, created.rev);
    assert.deepEqual(doc.value, first.value);
    assert.deepEqual(doc.metadata, first.metadata);
    const headers = await db.head(first._id);
    await couchOnly('HEAD ETag is the quoted revision', () => assert.equal(headers.etag, `"${created.rev}"`));
  });

  const updated = await step('update with _rev (PUT /db/id)', async () => {
    const answer = await db.insert({ ...first, _rev: created.rev, value: { lines: 3 } }, first._id);
    assert.match(answer.rev, /^2-/);
    assert.deepEqual((await db.get(first._id)).value, { lines: 3 });
    return answer;
  });

  await step('update with a stale _rev is 409 conflict', async () => {
    const error = await expectStatus(409, 'stale update', () => db.insert({ ...first, _rev: created.rev, value: 'lost' }));
    assert.equal(error.error, 'conflict');
    assert.deepEqual((await db.get(first._id)).value, { lines: 3 });
  });

  await step('create of an existing id without _rev is 409 conflict', () =>
    expectStatus(409, 'second create', () => db.insert(first)));

  await step('destroy with rev, then get is 404', async () => {
    const answer = await db.destroy(first._id, updated.rev);
    assert.equal(answer.ok, true);
    assert.match(answer.rev, /^3-/);
    const error = await expectStatus(404, 'get after delete', () => db.get(first._id));
    assert.equal(error.error, 'not_found');
  });

  const keys = Array.from({ length: BULK }, (_, i) => `bulk/${String(i).padStart(3, '0')}?&=`);
  const bulkDocs = keys.map((key, i) => dataDoc(userId, NAMESPACE, key, { n: i, tags: ['a', i] }));
  const expectedIds = bulkDocs.map((d) => d._id).sort();
  const bulkRevs = await step(`bulk of ${BULK} (_bulk_docs)`, async () => {
    const answer = await db.bulk({ docs: bulkDocs });
    assert.equal(answer.length, BULK);
    answer.forEach((row, i) => {
      assert.equal(row.id, bulkDocs[i]._id, `row ${i}`);
      assert.equal(row.ok, true, `row ${i}: ${JSON.stringify(row)}`);
    });
    return Object.fromEntries(answer.map((row) => [row.id, row.rev]));
  });

  await step(`_all_docs in pages of ${PAGE}`, async () => {
    const seen = [];
    let startkey = prefix;
    for (;;) {
      const page = await db.list({ startkey, endkey: `${prefix}\ufff0`, limit: PAGE + 1 });
      assert.equal(typeof page.total_rows, 'number');
      const rows = page.rows.slice(0, PAGE);
      seen.push(...rows.map((row) => row.id));
      rows.forEach((row) => assert.equal(row.value.rev, bulkRevs[row.id], `rev of ${row.id}`));
      if (page.rows.length <= PAGE) break;
      startkey = page.rows[PAGE].id;
    }
    assert.deepEqual(seen, expectedIds);
  });

  await step('_all_docs with keys and include_docs (fetch)', async () => {
    const wanted = [expectedIds[3], expectedIds[0], first._id];
    const answer = await db.fetch({ keys: wanted });
    assert.deepEqual(answer.rows.map((row) => row.key), wanted);
    assert.deepEqual(answer.rows[0].doc.value, bulkDocs.find((d) => d._id === wanted[0]).value);
    assert.equal(answer.rows[2].value.deleted, true, 'a deleted document is listed as deleted');
    assert.equal(answer.rows[2].doc, null);
  });

  await step(`_find by userId and namespace, paged by bookmark (limit ${PAGE})`, async () => {
    const seen = await findAllByBookmark((query) => db.find(query), { userId, namespace: NAMESPACE }, PAGE, BULK);
    assert.deepEqual(seen.sort(), expectedIds);
  });

  await step('_find with an operator, fields and sort', async () => {
    // CouchDB sorts on `_id` only with an `_id` condition (otherwise `no_usable_index`).
    const answer = await db.find({
      selector: { userId, namespace: NAMESPACE, 'value.n': { $gte: 20 }, _id: { $gt: null } },
      fields: ['_id', 'value'],
      sort: [{ _id: 'asc' }],
    });
    assert.deepEqual(answer.docs, bulkDocs.filter((d) => d.value.n >= 20).map((d) => ({ _id: d._id, value: d.value })));
  });

  await step('_changes lists the writes (the deleted document as deleted)', async () => {
    const feed = await db.changes({ since: 0 });
    assert.ok('last_seq' in feed, 'last_seq');
    const mine = feed.results.filter((row) => row.id.startsWith(prefix));
    const byId = Object.fromEntries(mine.map((row) => [row.id, row]));
    assert.deepEqual(Object.keys(byId).sort(), [...expectedIds, first._id].sort());
    assert.equal(byId[first._id].deleted, true);
    assert.equal(byId[expectedIds[0]].changes[0].rev, bulkRevs[expectedIds[0]]);

    const later = dataDoc(userId, NAMESPACE, 'after-since', 'new');
    await db.insert(later);
    const next = await db.changes({ since: feed.last_seq });
    newChangesOnly(next.results.filter((row) => row.id.startsWith(prefix)), mine, [later._id], 'since last_seq');
  });

  // CouchDB accepts any id; the endpoint refuses one that is not the composite of the document's
  // fields (400 or 403). pouchdb-server stores it, so this runs against the endpoint only.
  if (process.env.COUCH_TARGET === 'agentstore') {
    await step('an id that is not the composite of its fields is refused', async () => {
      const wrong = { ...dataDoc(userId, NAMESPACE, 'x', 1), _id: docId(userId, NAMESPACE, 'y') };
      const error = await expectStatus(undefined, 'mismatched id', () => db.insert(wrong));
      assert.ok([400, 403].includes(error.statusCode), `expected 400 or 403, got ${error.statusCode}`);
    });
  }
}

main().then(
  () => process.stdout.write('nano: all steps passed\n'),
  (error) => {
    process.stderr.write(`FAILED: ${error.stack || error}\n`);
    process.exit(1);
  },
);
