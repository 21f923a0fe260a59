// nano managing databases of its own on the endpoint: create (and create again: 412), list,
// info, documents of any shape with a conflict written by `new_edits: false`, read back with
// `conflicts: true`, nano's attachment API (bytes read back exactly), illegal names refused, then
// destroy (404 afterwards, no longer listed).
'use strict';

const nano = require('nano');
const { assert, env, step } = require('./common');

async function main() {
  const server = nano(env('COUCH_URL'));
  const name = `nano-dbs-${process.pid}-${Date.now()}`;

  await step(`create ${name}; creating it again is 412 file_exists`, async () => {
    assert.equal((await server.db.create(name)).ok, true);
    await assert.rejects(server.db.create(name), (err) => err.statusCode === 412 && err.error === 'file_exists');
  });

  await step('an illegal name is 400 illegal_database_name', async () => {
    await assert.rejects(server.db.create('Not-Legal'), (err) => err.statusCode === 400 && err.error === 'illegal_database_name');
  });

  await step('listed by _all_dbs, info reads its counts', async () => {
    assert.ok((await server.db.list()).includes(name));
    const info = await server.db.get(name);
    assert.equal(info.db_name, name);
    assert.equal(info.doc_count, 0);
  });

  const db = server.use(name);
  await step('documents of any shape, and a conflict from a replicated revision', async () => {
    const first = await db.insert({ _id: 'any', list: [1, 'two', { three: null }], 'ümlaut key': true });
    await db.bulk({ docs: [{ _id: 'any', _rev: '1-ffffffffffffffffffffffffffffffff', side: 'replicated' }], new_edits: false });
    const doc = await db.get('any', { conflicts: true });
    assert.equal(doc._rev, '1-ffffffffffffffffffffffffffffffff', 'the higher revision id wins');
    assert.deepEqual(doc._conflicts, [first.rev]);
    const loser = await db.get('any', { rev: first.rev });
    assert.deepEqual(loser.list, [1, 'two', { three: null }]);
    assert.equal((await server.db.get(name)).doc_count, 1);
  });

  await step("nano's attachment API: insert, get byte for byte, a document with one inline, destroy", async () => {
    const bytes = Buffer.from(Array.from({ length: 100000 }, (_, i) => (i * 13) % 256));
    // CouchDB answers a client that does not ask for JSON with `text/plain` (nano asks for none
    // here), so nano may hand back the JSON text.
    const parsed = (answer) => (typeof answer === 'string' ? JSON.parse(answer) : answer);
    const added = parsed(await db.attachment.insert('with-file', 'file.bin', bytes, 'application/octet-stream'));
    assert.ok(added.ok, JSON.stringify(added));
    const got = await db.attachment.get('with-file', 'file.bin');
    assert.ok(Buffer.compare(got, bytes) === 0, `read back ${got.length} bytes, not the ${bytes.length} written`);
    const doc = await db.get('with-file');
    assert.equal(doc._attachments['file.bin'].length, bytes.length);
    assert.equal(doc._attachments['file.bin'].stub, true);
    const gone = parsed(await db.attachment.destroy('with-file', 'file.bin', { rev: doc._rev }));
    assert.ok(gone.ok);
    await assert.rejects(db.attachment.get('with-file', 'file.bin'), (err) => err.statusCode === 404);
  });

  await step('destroy: gone from _all_dbs, and reading it is 404', async () => {
    assert.equal((await server.db.destroy(name)).ok, true);
    assert.ok(!(await server.db.list()).includes(name));
    await assert.rejects(server.db.get(name), (err) => err.statusCode === 404);
    await assert.rejects(server.db.destroy(name), (err) => err.statusCode === 404);
  });
}

main().then(
  () => process.stdout.write('nano databases: all steps passed\n'),
  (error) => {
    process.stderr.write(`FAILED: ${error.stack || error}\n`);
    process.exit(1);
  },
);
