// PouchDB's HTTP adapter driving an ordinary workflow against the endpoint: the adapter's own
// setup (GET /db), put, get, update with _rev, a stale update (409), remove, bulkDocs, allDocs
// paging, pouchdb-find paging by bookmark, and changes.
'use strict';

const { assert, dataDoc, findAllByBookmark, env, expectStatus, newChangesOnly, step } = require('./common');
const { PouchDB, remoteDb } = require('./pouchdb-setup');

const NAMESPACE = 'pouch';
const BULK = 17;
const PAGE = 4;

async function main() {
  const userId = env('COUCH_USER_ID');
  const db = remoteDb();
  const prefix = `${userId}:${NAMESPACE}:`;

  await step('info (GET /db)', async () => {
    const info = await db.info();
    assert.equal(info.db_name, env('COUCH_DB'));
    assert.equal(typeof info.doc_count, 'number');
    assert.ok('update_seq' in info, 'update_seq');
  });

  const first = dataDoc(userId, NAMESPACE, 'greeting', 'Hello, World!', { createdByAgent: 'pouchdb' });
  const created = await step('put', async () => {
    const answer = await db.put(first);
    assert.equal(answer.id, first._id);
    assert.match(answer.rev, /^1-/);
    return answer;
  });

  await step('get, with revs', async () => {
    const doc = await db.get(first._id, { revs: true });
    assert.equal(doc._rev, created.rev);
    assert.equal(doc.value, first.value);
    assert.equal(doc.createdByAgent, 'pouchdb');
    assert.equal(doc._revisions.start, 1);
    assert.deepEqual(doc._revisions.ids, [created.rev.split('-')[1]]);
  });

  const updated = await step('put with _rev', async () => {
    const answer = await db.put({ ...first, _rev: created.rev, value: 'Hello again' });
    assert.match(answer.rev, /^2-/);
    assert.equal((await db.get(first._id)).value, 'Hello again');
    return answer;
  });

  await step('put with a stale _rev is 409 conflict', async () => {
    const error = await expectStatus(409, 'stale put', () => db.put({ ...first, _rev: created.rev, value: 'lost' }));
    assert.equal(error.name, 'conflict');
  });

  await step('remove, then get is 404 deleted', async () => {
    const answer = await db.remove(first._id, updated.rev);
    assert.match(answer.rev, /^3-/);
    const error = await expectStatus(404, 'get after remove', () => db.get(first._id));
    assert.equal(error.name, 'not_found');
  });

  const bulkDocs = Array.from({ length: BULK }, (_, i) => dataDoc(userId, NAMESPACE, `item ${i}`, { i }));
  const expectedIds = bulkDocs.map((d) => d._id).sort();
  await step(`bulkDocs of ${BULK}, then an update of all of them`, async () => {
    const answer = await db.bulkDocs(bulkDocs);
    assert.deepEqual(answer.map((r) => [r.id, r.ok]), bulkDocs.map((d) => [d._id, true]));
    const second = await db.bulkDocs(bulkDocs.map((d, i) => ({ ...d, _rev: answer[i].rev, value: { i, again: true } })));
    assert.ok(second.every((r) => r.ok && r.rev.startsWith('2-')), JSON.stringify(second));
    const stale = await db.bulkDocs([{ ...bulkDocs[0], _rev: answer[0].rev }]);
    assert.equal(stale[0].error, 'conflict', `a stale revision in bulkDocs: ${JSON.stringify(stale)}`);
  });

  await step(`allDocs in pages of ${PAGE} (skip 1 after the last key)`, async () => {
    const seen = [];
    let page = await db.allDocs({ startkey: prefix, endkey: `${prefix}\ufff0`, limit: PAGE, include_docs: true });
    while (page.rows.length > 0) {
      page.rows.forEach((row) => assert.equal(row.doc.value.again, true, row.id));
      seen.push(...page.rows.map((row) => row.id));
      const last = page.rows[page.rows.length - 1].id;
      page = await db.allDocs({ startkey: last, endkey: `${prefix}\ufff0`, skip: 1, limit: PAGE, include_docs: true });
    }
    assert.deepEqual(seen, expectedIds);
  });

  await step('allDocs descending with keys', async () => {
    const answer = await db.allDocs({ startkey: `${prefix}\ufff0`, endkey: prefix, descending: true, limit: 3 });
    assert.deepEqual(answer.rows.map((r) => r.id), [...expectedIds].reverse().slice(0, 3));
    const byKeys = await db.allDocs({ keys: [expectedIds[2], first._id] });
    assert.equal(byKeys.rows[0].id, expectedIds[2]);
    assert.equal(byKeys.rows[1].value.deleted, true);
  });

  await step('find (pouchdb-find), paged by bookmark', async () => {
    const seen = await findAllByBookmark((query) => db.find(query), { userId, namespace: NAMESPACE }, PAGE, BULK);
    assert.deepEqual(seen.sort(), expectedIds);
  });

  await step('getIndexes lists idx-user-namespace', async () => {
    // The endpoint always has it; on another server the seed's service creates it at startup.
    if (process.env.COUCH_TARGET !== 'agentstore') {
      await db.createIndex({ index: { fields: ['userId', 'namespace'] }, name: 'idx-user-namespace', type: 'json' });
    }
    const { indexes } = await db.getIndexes();
    assert.ok(indexes.some((i) => i.name === '_all_docs'), JSON.stringify(indexes));
    const seed = indexes.find((i) => i.name === 'idx-user-namespace');
    assert.ok(seed, JSON.stringify(indexes));
    assert.deepEqual(seed.def.fields, [{ userId: 'asc' }, { namespace: 'asc' }]);
  });

  await step('changes since 0, then since its last_seq', async () => {
    const feed = await db.changes({ since: 0, style: 'all_docs' });
    const mine = feed.results.filter((row) => row.id.startsWith(prefix));
    assert.deepEqual(mine.map((row) => row.id).sort(), [...expectedIds, first._id].sort());
    assert.equal(mine.find((row) => row.id === first._id).deleted, true);
    const later = dataDoc(userId, NAMESPACE, 'later', 1);
    await db.put(later);
    const next = await db.changes({ since: feed.last_seq, include_docs: true });
    const nextMine = next.results.filter((row) => row.id.startsWith(prefix));
    newChangesOnly(nextMine, mine, [later._id], 'since last_seq');
    assert.equal(nextMine.find((row) => row.id === later._id).doc.value, 1);
  });
}

main().then(
  () => process.stdout.write(`pouchdb (${PouchDB.version}): all steps passed\n`),
  (error) => {
    process.stderr.write(`FAILED: ${error.stack || error}\n`);
    process.exit(1);
  },
);
