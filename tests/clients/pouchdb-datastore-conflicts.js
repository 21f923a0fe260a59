// PouchDB syncing the data-store database with a local in-memory PouchDB (only this script's
// documents, by id): data-store documents edited on both sides become conflicts kept on both
// ends and read the same with `conflicts: true`; each losing leaf keeps its own body and shows
// in `_changes?style=all_docs`; deleting the losing leaves on the endpoint resolves them on both
// ends after the next sync.
'use strict';

const { assert, dataDoc, env, step } = require('./common');
const { PouchDB, remoteDb } = require('./pouchdb-setup');

const NAMESPACE = 'conflicts';
const DOCS = 8;

function sync(a, b, ids) {
  return new Promise((resolve, reject) => {
    PouchDB.sync(a, b, { doc_ids: ids }).on('complete', resolve).on('error', reject).on('denied', reject);
  });
}

/** Each id read with `conflicts: true`, conflicts sorted. */
async function read(db, ids) {
  const docs = {};
  for (const id of ids) {
    const doc = await db.get(id, { conflicts: true });
    if (doc._conflicts) doc._conflicts.sort();
    docs[id] = doc;
  }
  return docs;
}

async function sameOnBothEnds(local, remote, ids, what) {
  const [mine, theirs] = await Promise.all([read(local, ids), read(remote, ids)]);
  for (const id of ids) assert.deepEqual(mine[id], theirs[id], `${what}: ${id} differs`);
  return theirs;
}

async function main() {
  const userId = env('COUCH_USER_ID');
  const remote = remoteDb();
  const local = new PouchDB(`local-datastore-conflicts-${process.pid}`, { adapter: 'memory' });
  const docs = Array.from({ length: DOCS }, (_, i) => dataDoc(userId, NAMESPACE, `key-${i}`, { n: i }));
  const ids = docs.map((doc) => doc._id);

  await step(`write ${DOCS} data-store documents on the endpoint, sync both ways`, async () => {
    const results = await remote.bulkDocs(docs);
    assert.ok(results.every((r) => r.ok), JSON.stringify(results));
    const result = await sync(local, remote, ids);
    assert.deepEqual(result.pull.errors, []);
    await sameOnBothEnds(local, remote, ids, 'after the first sync');
  });

  await step('edit every document on both sides, sync: the conflicts are kept on both ends', async () => {
    for (const id of ids) {
      const [mine, theirs] = await Promise.all([local.get(id), remote.get(id)]);
      await local.put({ ...mine, value: { side: 'local' } });
      await remote.put({ ...theirs, value: { side: 'remote' } });
    }
    await sync(local, remote, ids);
    const read = await sameOnBothEnds(local, remote, ids, 'after the conflicting edits');
    for (const id of ids) {
      const doc = read[id];
      assert.equal((doc._conflicts || []).length, 1, `${id} keeps its conflict: ${JSON.stringify(doc)}`);
      const loser = await remote.get(id, { rev: doc._conflicts[0] });
      assert.notDeepEqual(loser.value, doc.value, 'the losing leaf keeps its own value');
      const leaves = await remote.get(id, { open_revs: 'all' });
      assert.equal(leaves.length, 2, JSON.stringify(leaves));
    }
    const changes = await remote.changes({ style: 'all_docs', doc_ids: ids });
    for (const id of ids) {
      const row = changes.results.find((r) => r.id === id);
      assert.equal(row && row.changes.length, 2, `every leaf of ${id} in the feed: ${JSON.stringify(row)}`);
    }
  });

  await step('delete the losing leaves on the endpoint, sync: no conflict left on either end', async () => {
    for (const id of ids) {
      const doc = await remote.get(id, { conflicts: true });
      for (const rev of doc._conflicts) await remote.remove(id, rev);
      assert.equal((await remote.get(id, { conflicts: true }))._conflicts, undefined);
    }
    await sync(local, remote, ids);
    const read = await sameOnBothEnds(local, remote, ids, 'after the resolution');
    assert.ok(Object.values(read).every((doc) => !doc._conflicts), 'no conflicts on either end');
  });

  await step('clean up: delete the documents', async () => {
    const current = await read(remote, ids);
    const results = await remote.bulkDocs(ids.map((id) => ({ ...current[id], _deleted: true })));
    assert.ok(results.every((r) => r.ok), JSON.stringify(results));
  });
}

main().then(
  () => process.stdout.write('pouchdb data-store conflicts: all steps passed\n'),
  (error) => {
    process.stderr.write(`FAILED: ${error.stack || error}\n`);
    process.exit(1);
  },
);
