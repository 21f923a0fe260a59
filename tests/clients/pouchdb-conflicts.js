// PouchDB with a database of its own on the endpoint: creates it, syncs documents of any shape
// both ways with a local in-memory PouchDB, edits the same documents on both sides so that both
// sides hold conflicts, syncs again and checks that every document reads the same on both ends
// with `conflicts: true` (winner, body and `_conflicts`); then resolves the conflicts by deleting
// the losing leaves on one side, syncs, checks both ends again, and deletes the database
// (`_all_dbs` no longer lists it; reading it is 404).
'use strict';

const { assert, env, step } = require('./common');
const { PouchDB, remoteDb } = require('./pouchdb-setup');

const DOCS = 40;
const CONFLICTED = 10;

function sync(a, b) {
  return new Promise((resolve, reject) => {
    PouchDB.sync(a, b).on('complete', resolve).on('error', reject).on('denied', reject);
  });
}

/** Every document with `conflicts: true`, deleted ones left out, keyed by id. */
async function everything(db) {
  const all = await db.allDocs({ include_docs: true, conflicts: true });
  const docs = {};
  for (const row of all.rows) {
    const doc = await db.get(row.id, { conflicts: true });
    if (doc._conflicts) doc._conflicts.sort();
    docs[row.id] = doc;
  }
  return docs;
}

async function sameOnBothEnds(local, remote, what) {
  const [mine, theirs] = await Promise.all([everything(local), everything(remote)]);
  assert.deepEqual(Object.keys(mine).sort(), Object.keys(theirs).sort(), `${what}: different ids`);
  for (const id of Object.keys(mine)) {
    assert.deepEqual(mine[id], theirs[id], `${what}: ${id} differs`);
  }
  return mine;
}

async function main() {
  const server = env('COUCH_URL');
  const name = `pouchdb-conflicts-${process.pid}-${Date.now()}`;
  const remote = remoteDb(server, name);
  const local = new PouchDB(`local-conflicts-${process.pid}`, { adapter: 'memory' });

  await step(`create ${name} on the endpoint and write ${DOCS} documents of any shape`, async () => {
    const info = await remote.info();
    assert.equal(info.db_name, name);
    assert.equal(info.doc_count, 0);
    const docs = Array.from({ length: DOCS }, (_, i) => ({
      _id: `doc-${String(i).padStart(3, '0')}`,
      n: i,
      nested: { list: [i, `é${i}`, null, true], empty: {} },
      ...(i % 3 === 0 ? { tags: ['a', 'b'] } : { flag: false }),
    }));
    const results = await remote.bulkDocs(docs);
    assert.ok(results.every((r) => r.ok), JSON.stringify(results));
    assert.equal((await remote.info()).doc_count, DOCS);
  });

  await step('sync both ways: both ends hold the same documents', async () => {
    const result = await sync(local, remote);
    assert.deepEqual(result.pull.errors, []);
    await sameOnBothEnds(local, remote, 'after the first sync');
  });

  await step(`edit ${CONFLICTED} documents on both sides, sync: conflicts on both ends, read the same`, async () => {
    for (let i = 0; i < CONFLICTED; i += 1) {
      const id = `doc-${String(i).padStart(3, '0')}`;
      const [mine, theirs] = await Promise.all([local.get(id), remote.get(id)]);
      await local.put({ ...mine, side: 'local' });
      await remote.put({ ...theirs, side: 'remote' });
    }
    await sync(local, remote);
    const docs = await sameOnBothEnds(local, remote, 'after the conflicting edits');
    const conflicted = Object.values(docs).filter((doc) => doc._conflicts);
    assert.equal(conflicted.length, CONFLICTED, `conflicts kept on both ends: ${JSON.stringify(conflicted)}`);
    for (const doc of conflicted) {
      assert.equal(doc._conflicts.length, 1, JSON.stringify(doc));
      const loser = await remote.get(doc._id, { rev: doc._conflicts[0] });
      assert.notEqual(loser.side, doc.side, 'the losing leaf keeps its own body');
    }
    const leaves = await remote.get('doc-000', { open_revs: 'all' });
    assert.equal(leaves.length, 2, JSON.stringify(leaves));
  });

  await step('resolve by deleting the losing leaves on the endpoint, sync: no conflicts left', async () => {
    for (let i = 0; i < CONFLICTED; i += 1) {
      const id = `doc-${String(i).padStart(3, '0')}`;
      const doc = await remote.get(id, { conflicts: true });
      for (const rev of doc._conflicts) await remote.remove(id, rev);
    }
    await sync(local, remote);
    const docs = await sameOnBothEnds(local, remote, 'after the resolution');
    assert.ok(Object.values(docs).every((doc) => !doc._conflicts), 'no conflicts on either end');
    const changes = await remote.changes({ style: 'all_docs' });
    assert.ok(changes.results.length >= DOCS, JSON.stringify(changes.results.length));
  });

  await step('delete the database: no longer listed, reading it is 404', async () => {
    await remote.destroy();
    const root = new URL(server);
    const credentials = `${decodeURIComponent(root.username)}:${decodeURIComponent(root.password)}`;
    const headers = { Authorization: `Basic ${Buffer.from(credentials).toString('base64')}` };
    root.username = '';
    root.password = '';
    const names = await (await fetch(new URL('/_all_dbs', root), { headers })).json();
    assert.ok(Array.isArray(names) && !names.includes(name), JSON.stringify(names));
    // Read without PouchDB, whose HTTP adapter would create the database again.
    const gone = await fetch(new URL(`/${encodeURIComponent(name)}/doc-000`, root), { headers });
    assert.equal(gone.status, 404);
  });
}

main().then(
  () => process.stdout.write('pouchdb conflicts: all steps passed\n'),
  (error) => {
    process.stderr.write(`FAILED: ${error.stack || error}\n`);
    process.exit(1);
  },
);
