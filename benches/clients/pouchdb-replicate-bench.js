// The replication workload of `databases_bench` (benches/databases_bench.rs): a local in-memory
// PouchDB holding BENCH_DOCS documents, BENCH_CONFLICTS of them with a conflict (two leaves on a
// common parent, written with bulkDocs new_edits:false), is pushed with PouchDB.replicate() into
// the database COUCH_DB on COUCH_URL, and then pulled back into a fresh local in-memory PouchDB.
// Both replications are timed; after each one every conflicted document and a sample of the others
// must read the same (`conflicts: true`: winner, body, `_conflicts`) on both ends, and both ends
// must hold every document, or the script fails. The last line of stdout is the result as JSON:
// the seconds of each replication, the documents each wrote, and each conflicted document with the
// winner and `_conflicts` the local PouchDB gives it (for the bench's GET phase to check against).
//
// Environment: COUCH_URL (server root, credentials in it), COUCH_DB (an existing, empty
// database), BENCH_DOCS (default 10000), BENCH_CONFLICTS (default 1000).
'use strict';

const crypto = require('node:crypto');
const { assert, env, fail, step } = require('../../tests/clients/common');
const { PouchDB, remoteDb } = require('../../tests/clients/pouchdb-setup');

/** Documents per bulkDocs call while building the local database. */
const BATCH = 500;
/** Unconflicted documents compared after each replication (besides every conflicted one). */
const SAMPLE = 200;

function count(name, fallback) {
  const value = Number(env(name, String(fallback)));
  if (!Number.isInteger(value) || value < 0) fail(`${name} must be a whole number, not ${process.env[name]}`);
  return value;
}

/** A revision id as CouchDB makes them (32 hex digits), fixed by what it names. */
function revId(...parts) {
  return crypto.createHash('md5').update(parts.join('/')).digest('hex');
}

function replicate(from, to) {
  return new Promise((resolve, reject) => {
    PouchDB.replicate(from, to).on('complete', resolve).on('error', reject).on('denied', reject);
  });
}

/**
 * The revisions of document `i`: one leaf, or (conflicted) a parent with two children. Each
 * revision is `{ _id, _rev, _revisions, ...body }` for bulkDocs with new_edits:false.
 */
function revisions(i, conflicted) {
  const id = `doc-${String(i).padStart(6, '0')}`;
  const body = (side) => ({
    n: i,
    side,
    text: `document ${i}, ünïcødé ✓`,
    nested: { list: [i, i * 2, null, true], flag: i % 2 === 0 },
  });
  const root = revId(id, 'root');
  if (!conflicted) {
    return [{ _id: id, _rev: `1-${root}`, _revisions: { start: 1, ids: [root] }, ...body('only') }];
  }
  return ['left', 'right'].map((side) => {
    const leaf = revId(id, side);
    return { _id: id, _rev: `2-${leaf}`, _revisions: { start: 2, ids: [leaf, root] }, ...body(side) };
  });
}

/** `id` with `conflicts: true`, `_conflicts` sorted. */
async function read(db, id) {
  const doc = await db.get(id, { conflicts: true });
  if (doc._conflicts) doc._conflicts.sort();
  return doc;
}

/** Fails unless `a` and `b` hold `docs` documents and read the same for each id of `ids`. */
async function sameOnBothEnds(a, b, ids, docs, what) {
  for (const [db, side] of [[a, 'source'], [b, 'target']]) {
    const info = await db.info();
    assert.equal(info.doc_count, docs, `${what}: the ${side} holds ${info.doc_count} documents, not ${docs}`);
  }
  for (const id of ids) {
    const [mine, theirs] = await Promise.all([read(a, id), read(b, id)]);
    assert.deepEqual(theirs, mine, `${what}: ${id} differs`);
  }
}

async function main() {
  const docs = count('BENCH_DOCS', 10000);
  const conflicts = count('BENCH_CONFLICTS', 1000);
  if (conflicts > docs) fail(`BENCH_CONFLICTS (${conflicts}) is more than BENCH_DOCS (${docs})`);
  // Conflicted documents spread evenly over the id range.
  const every = conflicts === 0 ? Infinity : docs / conflicts;
  const isConflicted = (i) => conflicts > 0 && Math.floor(i / every) !== Math.floor((i + 1) / every);
  const remote = remoteDb();
  const local = new PouchDB(`bench-source-${process.pid}`, { adapter: 'memory' });
  const fresh = new PouchDB(`bench-pulled-${process.pid}`, { adapter: 'memory' });

  const conflictedIds = [];
  const sampleIds = [];
  await step(`build a local database of ${docs} documents, ${conflicts} with a conflict`, async () => {
    for (let start = 0; start < docs; start += BATCH) {
      const batch = [];
      for (let i = start; i < Math.min(start + BATCH, docs); i += 1) {
        const conflicted = isConflicted(i);
        batch.push(...revisions(i, conflicted));
        if (conflicted) conflictedIds.push(revisions(i, true)[0]._id);
        else if (i % Math.max(1, Math.floor(docs / SAMPLE)) === 0) sampleIds.push(revisions(i, false)[0]._id);
      }
      const failed = await local.bulkDocs(batch, { new_edits: false });
      assert.deepEqual(failed.filter((r) => r.error), [], 'bulkDocs new_edits:false');
    }
    assert.equal(conflictedIds.length, conflicts);
    for (const id of conflictedIds) {
      const doc = await read(local, id);
      assert.equal(doc._conflicts && doc._conflicts.length, 1, `${id} has no conflict locally`);
    }
  });

  const ids = [...conflictedIds, ...sampleIds];
  let push;
  let pushSeconds;
  await step('push: PouchDB.replicate(local, endpoint)', async () => {
    const began = process.hrtime.bigint();
    push = await replicate(local, remote);
    pushSeconds = Number(process.hrtime.bigint() - began) / 1e9;
    assert.deepEqual(push.errors, [], 'push errors');
  });
  await step('after the push both ends read the same, conflicts included', () =>
    sameOnBothEnds(local, remote, ids, docs, 'after the push'));

  let pull;
  let pullSeconds;
  await step('pull: PouchDB.replicate(endpoint, a fresh local database)', async () => {
    const began = process.hrtime.bigint();
    pull = await replicate(remote, fresh);
    pullSeconds = Number(process.hrtime.bigint() - began) / 1e9;
    assert.deepEqual(pull.errors, [], 'pull errors');
  });
  await step('after the pull both ends read the same, conflicts included', () =>
    sameOnBothEnds(remote, fresh, ids, docs, 'after the pull'));

  const conflicted = [];
  for (const id of conflictedIds) {
    const doc = await read(local, id);
    conflicted.push({ id, rev: doc._rev, conflicts: doc._conflicts });
  }
  process.stdout.write(`${JSON.stringify({
    docs,
    conflicts,
    push_seconds: pushSeconds,
    push_docs_written: push.docs_written,
    pull_seconds: pullSeconds,
    pull_docs_written: pull.docs_written,
    compared: ids.length,
    conflicted,
  })}\n`);
}

main().catch((error) => fail(error && error.stack ? error.stack : String(error)));
