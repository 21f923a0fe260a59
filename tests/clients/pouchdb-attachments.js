// PouchDB with attachments on a database of its own on the endpoint: a local in-memory PouchDB
// holding documents with binary, text, empty and 1 MiB attachments (one name with a slash and
// unicode) replicates to the endpoint and from it into a second local database; every byte
// reads back the same at each hop (compared by SHA-256), and an attachment put through the
// endpoint's own attachment API comes back intact; then the database is deleted.
'use strict';

const crypto = require('node:crypto');
const { assert, env, step } = require('./common');
const { PouchDB, remoteDb } = require('./pouchdb-setup');

const sha256 = (bytes) => crypto.createHash('sha256').update(bytes).digest('hex');

function replicate(from, to) {
  return new Promise((resolve, reject) => {
    PouchDB.replicate(from, to).on('complete', resolve).on('error', reject).on('denied', reject);
  });
}

/** name → { content_type, bytes } of every attachment the test writes, per document. */
function fixtures() {
  const binary = Buffer.from(Array.from({ length: 70000 }, (_, i) => (i * 7 + 3) % 256));
  const big = crypto.createHash('sha512');
  const mebibyte = Buffer.alloc(1 << 20);
  for (let offset = 0; offset < mebibyte.length; offset += 64) {
    big.update(String(offset));
    big.copy().digest().copy(mebibyte, offset);
  }
  return {
    'att-binary': { 'data.bin': { content_type: 'application/octet-stream', bytes: binary } },
    'att-text': {
      'note.txt': { content_type: 'text/plain', bytes: Buffer.from('hello, attachments\n') },
      'dir/ünïcode name.txt': { content_type: 'text/plain', bytes: Buffer.from('slash and unicode') },
      'empty.txt': { content_type: 'text/plain', bytes: Buffer.alloc(0) },
    },
    'att-big': { 'one-mib.bin': { content_type: 'application/octet-stream', bytes: mebibyte } },
  };
}

async function sameBytes(db, expected, where) {
  for (const [id, attachments] of Object.entries(expected)) {
    const doc = await db.get(id);
    assert.deepEqual(Object.keys(doc._attachments).sort(), Object.keys(attachments).sort(), `${where}: ${id}`);
    for (const [name, { content_type: type, bytes }] of Object.entries(attachments)) {
      const got = await db.getAttachment(id, name);
      assert.equal(sha256(got), sha256(bytes), `${where}: ${id}/${name} differs (${got.length} vs ${bytes.length} bytes)`);
      assert.equal(doc._attachments[name].content_type, type, `${where}: ${id}/${name} content type`);
      assert.equal(doc._attachments[name].length, bytes.length, `${where}: ${id}/${name} length`);
    }
  }
}

async function main() {
  const server = env('COUCH_URL');
  const name = `pouchdb-attachments-${process.pid}-${Date.now()}`;
  const remote = remoteDb(server, name);
  const source = new PouchDB(`local-att-source-${process.pid}`, { adapter: 'memory' });
  const copy = new PouchDB(`local-att-copy-${process.pid}`, { adapter: 'memory' });
  const expected = fixtures();

  await step('write documents with attachments locally', async () => {
    const docs = Object.entries(expected).map(([id, attachments]) => ({
      _id: id,
      kind: 'with attachments',
      _attachments: Object.fromEntries(
        Object.entries(attachments).map(([att, { content_type: type, bytes }]) => [
          att,
          { content_type: type, data: bytes.toString('base64') },
        ]),
      ),
    }));
    const results = await source.bulkDocs(docs);
    assert.ok(results.every((r) => r.ok), JSON.stringify(results));
  });

  await step('replicate to the endpoint: every byte there', async () => {
    const result = await replicate(source, remote);
    assert.equal(result.doc_write_failures, 0, JSON.stringify(result));
    await sameBytes(remote, expected, 'on the endpoint');
  });

  await step('replicate from the endpoint into a second local database: every byte there', async () => {
    const result = await replicate(remote, copy);
    assert.equal(result.doc_write_failures, 0, JSON.stringify(result));
    await sameBytes(copy, expected, 'in the copy');
  });

  await step('putAttachment / getAttachment / removeAttachment through the endpoint', async () => {
    const doc = await remote.get('att-text');
    const bytes = Buffer.from(Array.from({ length: 300000 }, (_, i) => (i * 31) % 251));
    const put = await remote.putAttachment('att-text', 'added.bin', doc._rev, bytes, 'application/octet-stream');
    const got = await remote.getAttachment('att-text', 'added.bin');
    assert.equal(sha256(got), sha256(bytes), 'the added attachment differs');
    const removed = await remote.removeAttachment('att-text', 'added.bin', put.rev);
    assert.ok(removed.ok);
    const after = await remote.get('att-text');
    assert.equal(after._attachments['added.bin'], undefined);
    assert.equal(sha256(await remote.getAttachment('att-text', 'note.txt')), sha256(expected['att-text']['note.txt'].bytes));
  });

  await step('delete the database', async () => {
    await remote.destroy();
  });
}

main().then(
  () => process.stdout.write('pouchdb attachments: all steps passed\n'),
  (error) => {
    process.stderr.write(`FAILED: ${error.stack || error}\n`);
    process.exit(1);
  },
);
