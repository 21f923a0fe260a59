// @cloudant/couchbackup round trip: seed documents on the endpoint (some updated several times,
// some deleted), back the database up with `couchbackup` (mode from the first argument: `full`,
// its default, or `shallow`), check the backup holds them, restore it with `couchrestore` into the
// empty database of the second endpoint, check it holds exactly the backup's live documents, and
// compare every document of this script's userId there with the source, revision included.
// Full mode reads `_changes` right after the seeding: a write is in the feed at once. The
// restored database is compared through `_all_docs`, never by `doc_count`: DynamoDB's is an
// estimate (docs/couchdb-clients.md).
//
//   node couchbackup.js full|shallow
'use strict';

const { execFileSync } = require('node:child_process');
const fs = require('node:fs');
const os = require('node:os');
const path = require('node:path');
const { assert, dataDoc, docsWithPrefix, env, http, redact, step } = require('./common');

const SEEDED = 60;
const BIN = path.join(__dirname, '..', '..', 'node_modules', '.bin');

function dbUrl(server, db) {
  return `${server.replace(/\/$/, '')}/${encodeURIComponent(db)}`;
}

/** Runs a couchbackup tool; its log goes to our stderr so a failure shows why. */
function runTool(tool, args, options = {}) {
  try {
    return execFileSync(path.join(BIN, tool), args, { stdio: ['pipe', 'pipe', 'inherit'], timeout: 120000, ...options });
  } catch (error) {
    throw new Error(`${tool} ${args.filter((a) => !a.includes('@')).join(' ')} exited with ${error.status}`);
  }
}

async function seed(server, db, userId, namespace) {
  const docs = Array.from({ length: SEEDED }, (_, i) =>
    dataDoc(userId, namespace, `backup/${i}`, { i, nested: { list: [i, `${i}`] } }, { accessCount: i }));
  const { status, body } = await http('POST', `${dbUrl(server, db)}/_bulk_docs`, { body: { docs } });
  assert.equal(status, 201, JSON.stringify(body));
  const revs = body.map((row) => row.rev);
  const updates = docs.slice(0, 10).map((doc, i) => ({ ...doc, _rev: revs[i], value: { i, updated: true } }));
  const deletes = docs.slice(10, 15).map((doc, i) => ({ ...doc, _rev: revs[10 + i], _deleted: true }));
  const second = await http('POST', `${dbUrl(server, db)}/_bulk_docs`, { body: { docs: [...updates, ...deletes] } });
  assert.equal(second.status, 201, JSON.stringify(second.body));
  assert.ok(second.body.every((row) => row.ok), JSON.stringify(second.body));
}

/**
 * The URL couchbackup and couchrestore get. They log in with `POST /_session` JSON
 * `{"username","password"}`, which pouchdb-server refuses (it reads only `name`); it lets
 * anonymous requests at databases without a security object, so there they go without.
 */
function toolUrl(server) {
  if (process.env.COUCH_TARGET !== 'pouchdb-server') return server;
  process.stdout.write('pouchdb-server differs from CouchDB: POST /_session ignores "username" (couchbackup logs in with it): the tools run without credentials\n');
  const url = new URL(server);
  url.username = '';
  url.password = '';
  return url.toString().replace(/\/$/, '');
}

async function main() {
  const mode = process.argv[2] || 'full';
  assert.ok(['full', 'shallow'].includes(mode), `mode must be full or shallow, not ${mode}`);
  const [server, db, userId] = [env('COUCH_URL'), env('COUCH_DB'), env('COUCH_USER_ID')];
  const [emptyServer, emptyDb] = [env('COUCH_URL_EMPTY'), env('COUCH_DB_EMPTY', db)];
  const namespace = `backup-${mode}`;
  const prefix = `${userId}:${namespace}:`;
  const file = path.join(fs.mkdtempSync(path.join(os.tmpdir(), 'couchbackup-')), 'backup.txt');

  await step(`seed ${SEEDED} documents (10 updated, 5 deleted)`, () => seed(server, db, userId, namespace));
  const source = await docsWithPrefix(server, db, prefix);
  assert.equal(Object.keys(source).length, SEEDED - 5);

  const backedUp = await step(`couchbackup --mode ${mode}`, async () => {
    // Full mode lists the database from `_changes`; shallow mode pages `_all_docs`.
    runTool('couchbackup', ['--url', toolUrl(server), '--db', db, '--mode', mode, '--output', file, '--quiet']);
    const batches = fs.readFileSync(file, 'utf8').split('\n').filter((line) => line.trim() !== '');
    // The first line is a header object ({name, version, mode}); then one JSON array per batch.
    const docs = batches.map((line) => JSON.parse(line)).filter(Array.isArray).flat();
    const mine = Object.fromEntries(docs.filter((d) => d._id.startsWith(prefix) && !d._deleted).map((d) => [d._id, d]));
    assert.deepEqual(Object.keys(mine).sort(), Object.keys(source).sort(), 'the backup holds the live documents');
    for (const [id, doc] of Object.entries(mine)) {
      assert.equal(doc._rev, source[id]._rev, `revision of ${id} in the backup`);
      if (mode === 'full') assert.equal(doc._revisions.start, Number(doc._rev.split('-')[0]), `_revisions of ${id}`);
    }
    // Other scripts write the shared database meanwhile: what counts is what the backup holds.
    return [...new Set(docs.filter((d) => !d._deleted).map((d) => d._id))].sort();
  });

  await step(`couchrestore into the empty ${redact(emptyServer)}/${emptyDb}`, async () => {
    const created = await http('PUT', dbUrl(emptyServer, emptyDb));
    assert.ok([201, 412].includes(created.status), `PUT /${emptyDb}: ${created.status} ${JSON.stringify(created.body)}`);
    const before = await docsWithPrefix(emptyServer, emptyDb, '');
    assert.deepEqual(Object.keys(before), [], 'the restore target is not empty');
    runTool('couchrestore', ['--url', toolUrl(emptyServer), '--db', emptyDb, '--quiet'], { input: fs.readFileSync(file) });
    const after = await docsWithPrefix(emptyServer, emptyDb, '');
    assert.deepEqual(Object.keys(after).sort(), backedUp, 'the restored database holds exactly the live documents of the backup');
  });

  await step('the restored documents equal the source, revisions included', async () => {
    const restored = await docsWithPrefix(emptyServer, emptyDb, prefix);
    assert.deepEqual(Object.keys(restored).sort(), Object.keys(source).sort());
    for (const id of Object.keys(source)) assert.deepEqual(restored[id], source[id], `document ${id}`);
  });
}

main().then(
  () => process.stdout.write(`couchbackup (${process.argv[2] || 'full'}): all steps passed\n`),
  (error) => {
    process.stderr.write(`FAILED: ${error.stack || error}\n`);
    process.exit(1);
  },
);
