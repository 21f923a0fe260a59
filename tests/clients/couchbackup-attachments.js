// @cloudant/couchbackup round trip of a database with attachments: on a database of its own on
// the endpoint, documents with a binary attachment, an empty one, one with a unicode name and a
// slash, several per document, one put through the standalone attachment API, and one replaced
// by a later revision (so two `revpos`) are backed up with `couchbackup --attachments` (mode
// from the first argument: `full`, its default, or `shallow`) and restored with
// `couchrestore --attachments` into a new database on the second, empty endpoint. The backup
// must hold every attachment's bytes (base64, checked against the source's bytes and digest);
// the restored database must hold exactly the source's live documents, each with the same
// revision and body, and every attachment the same content type, length, digest, `revpos` and
// bytes (read with the standalone `GET`, compared byte for byte and by MD5 against the digest).
//
// A backup without `--attachments` is also taken and checked to hold stubs only (no bytes):
// couchbackup documents that such a backup cannot be restored; that is all it promises.
//
// couchbackup 2.11 calls `--attachments` experimental and unsupported, "for Apache CouchDB
// only" (its README): it reads the bytes inline (`_bulk_get?attachments=true` in full mode,
// `_all_docs?include_docs=true&attachments=true` in shallow mode), base64 in the backup file,
// and writes them back inline with `_bulk_docs` `new_edits: false`.
//
// Shallow mode needs `attachments: true` in the body of `POST /{db}/_all_docs` (where the
// Cloudant SDK puts it, and CouchDB reads it); until the endpoint reads it there, only `full` is
// registered in tests/suites/couchdb_clients.rs.
//
//   node couchbackup-attachments.js full|shallow
'use strict';

const crypto = require('node:crypto');
const { execFileSync } = require('node:child_process');
const fs = require('node:fs');
const os = require('node:os');
const path = require('node:path');
const zlib = require('node:zlib');
const { assert, env, http, redact, step } = require('./common');

const BIN = path.join(__dirname, '..', '..', 'node_modules', '.bin');

const md5Digest = (bytes) => `md5-${crypto.createHash('md5').update(bytes).digest('base64')}`;

// Apache CouchDB 3.4.3 keeps an attachment of a compressible type (`text/*`, JSON, …: its
// `[attachments] compressible_types`) as a gzip stream at `compression_level` 8, and a stub's
// digest is that stream's MD5 (checked against a real CouchDB: Node's zlib writes the same
// stream); pouchdb-server and agentstore's own backends digest the bytes themselves.
const gzippedDigest = (bytes) => md5Digest(zlib.gzipSync(bytes, { level: 8 }));
const digestsOf = (bytes) => [md5Digest(bytes), gzippedDigest(bytes)];

function dbUrl(server, db) {
  return `${server.replace(/\/$/, '')}/${encodeURIComponent(db)}`;
}

/** A path below a document: each segment of the attachment name percent-encoded. */
function attUrl(server, db, id, name) {
  return `${dbUrl(server, db)}/${encodeURIComponent(id)}/${name.split('/').map(encodeURIComponent).join('/')}`;
}

/** Runs a couchbackup tool; its log goes to our stderr so a failure shows why. */
function runTool(tool, args, options = {}) {
  try {
    return execFileSync(path.join(BIN, tool), args, { stdio: ['pipe', 'pipe', 'inherit'], timeout: 120000, ...options });
  } catch (error) {
    throw new Error(`${tool} ${args.filter((a) => !a.includes('@')).join(' ')} exited with ${error.status}`);
  }
}

/** Every byte value, then more: 70,000 bytes no text encoding survives unchanged. */
function binaryBytes(length, step) {
  return Buffer.from(Array.from({ length }, (_, i) => (i * step + (i >> 8)) % 256));
}

/**
 * The documents written inline (id -> name -> {content_type, bytes}); `att-standalone` and the
 * second revision of `att-updated` go through the standalone attachment API in `seed`.
 */
function inlineFixtures() {
  return {
    'att-binary': {
      'data.bin': { content_type: 'application/octet-stream', bytes: binaryBytes(70000, 7) },
    },
    'att-several': {
      'note.txt': { content_type: 'text/plain', bytes: Buffer.from('hello, attachments\n') },
      'dir/ünïcode ☃ name.txt': { content_type: 'text/plain;charset=utf-8', bytes: Buffer.from('slash, unicode: ☃ ü\n') },
      'empty.txt': { content_type: 'text/plain', bytes: Buffer.alloc(0) },
      'data.json': { content_type: 'application/json', bytes: Buffer.from(JSON.stringify({ a: [1, 2, 3] })) },
      'image.png': { content_type: 'image/png', bytes: binaryBytes(4096, 13) },
    },
    'att-updated': {
      'version.txt': { content_type: 'text/plain', bytes: Buffer.from('version 1\n') },
      'kept.bin': { content_type: 'application/octet-stream', bytes: binaryBytes(1000, 3) },
    },
  };
}

const inline = (attachments) =>
  Object.fromEntries(
    Object.entries(attachments).map(([name, { content_type: type, bytes }]) => [name, { content_type: type, data: bytes.toString('base64') }]),
  );

async function putAttachment(server, db, id, name, rev, type, bytes) {
  const url = `${attUrl(server, db, id, name)}${rev ? `?rev=${encodeURIComponent(rev)}` : ''}`;
  const { status, body } = await http('PUT', url, { body: bytes, json: false, headers: { 'content-type': type } });
  assert.equal(status, 201, `PUT ${id}/${name}: ${status} ${JSON.stringify(body)}`);
  return body.rev;
}

async function seed(server, db) {
  const docs = Object.entries(inlineFixtures()).map(([id, attachments]) => ({ _id: id, kind: 'with attachments', _attachments: inline(attachments) }));
  docs.push({ _id: 'plain', kind: 'no attachments' });
  docs.push({ _id: 'att-deleted', _attachments: inline({ 'gone.txt': { content_type: 'text/plain', bytes: Buffer.from('deleted with its document') } }) });
  const { status, body } = await http('POST', `${dbUrl(server, db)}/_bulk_docs`, { body: { docs } });
  assert.equal(status, 201, JSON.stringify(body));
  assert.ok(body.every((row) => row.ok), JSON.stringify(body));
  const revs = Object.fromEntries(body.map((row) => [row.id, row.rev]));

  // A new document made by a standalone PUT (no rev), then a second attachment on it.
  const first = await putAttachment(server, db, 'att-standalone', 'upload.bin', null, 'application/octet-stream', binaryBytes(300000, 31));
  await putAttachment(server, db, 'att-standalone', 'second.txt', first, 'text/plain', Buffer.from('added later\n'));

  // `version.txt` replaced at revision 2 (revpos 2), `kept.bin` carried as a stub (revpos 1);
  // then the body changes at revision 3 with both carried.
  const second = await putAttachment(server, db, 'att-updated', 'version.txt', revs['att-updated'], 'text/plain', Buffer.from('version 2, replaced\n'));
  const current = await http('GET', `${dbUrl(server, db)}/att-updated`);
  assert.equal(current.status, 200, JSON.stringify(current.body));
  assert.equal(current.body._rev, second);
  const third = await http('PUT', `${dbUrl(server, db)}/att-updated`, { body: { ...current.body, kind: 'updated twice' } });
  assert.equal(third.status, 201, JSON.stringify(third.body));

  const deleted = await http('DELETE', `${dbUrl(server, db)}/att-deleted?rev=${revs['att-deleted']}`);
  assert.equal(deleted.status, 200, JSON.stringify(deleted.body));
}

/**
 * Every live document of `db` with its attachments' bytes: id -> {doc (stubs), bytes: name -> Buffer}.
 * The bytes are read with the standalone GET, and each must match its stub's length and digest.
 */
async function snapshot(server, db) {
  const { status, body } = await http('GET', `${dbUrl(server, db)}/_all_docs?include_docs=true`);
  assert.equal(status, 200, `_all_docs of ${redact(server)}/${db}: ${status} ${JSON.stringify(body)}`);
  const docs = {};
  for (const { id, doc } of body.rows) {
    const bytes = {};
    for (const [name, stub] of Object.entries(doc._attachments || {})) {
      assert.equal(stub.stub, true, `${id}/${name} is a stub in _all_docs`);
      const response = await fetchBytes(attUrl(server, db, id, name));
      assert.equal(response.status, 200, `GET ${id}/${name}: ${response.status}`);
      assert.equal(response.bytes.length, stub.length, `GET ${id}/${name}: length`);
      assert.ok(digestsOf(response.bytes).includes(stub.digest), `GET ${id}/${name}: the bytes' MD5 is not the stub's digest`);
      bytes[name] = response.bytes;
    }
    docs[id] = { doc, bytes };
  }
  return docs;
}

/** A GET whose body is kept as bytes. */
async function fetchBytes(url) {
  const parsed = new URL(url);
  const headers = {};
  if (parsed.username) {
    const login = `${decodeURIComponent(parsed.username)}:${decodeURIComponent(parsed.password)}`;
    headers.authorization = `Basic ${Buffer.from(login).toString('base64')}`;
  }
  parsed.username = '';
  parsed.password = '';
  const response = await fetch(parsed, { headers });
  return { status: response.status, bytes: Buffer.from(await response.arrayBuffer()) };
}

/** The backup file's header object and its documents. */
function readBackup(file) {
  const lines = fs.readFileSync(file, 'utf8').split('\n').filter((line) => line.trim() !== '');
  const parsed = lines.map((line) => JSON.parse(line));
  const header = parsed.find((entry) => !Array.isArray(entry));
  return { header, docs: parsed.filter(Array.isArray).flat() };
}

async function main() {
  const mode = process.argv[2] || 'full';
  assert.ok(['full', 'shallow'].includes(mode), `mode must be full or shallow, not ${mode}`);
  const [server, emptyServer] = [env('COUCH_URL'), env('COUCH_URL_EMPTY')];
  const db = `couchbackup-attachments-${mode}-${process.pid}-${Date.now()}`;
  // On the CouchDB backend both endpoints keep their databases on the same CouchDB server, under
  // their own names: the restore target needs a name of its own.
  const restoredDb = `${db}-restored`;
  const dir = fs.mkdtempSync(path.join(os.tmpdir(), 'couchbackup-attachments-'));
  const [withBytes, withoutBytes] = [path.join(dir, 'with-attachments.txt'), path.join(dir, 'stubs-only.txt')];
  // couchbackup logs in with POST /_session JSON {"username","password"}, which the endpoint reads.
  const url = server.replace(/\/$/, '');

  await step(`create ${db} with attachments (binary, empty, unicode and slash name, several per document, standalone, replaced)`, async () => {
    const created = await http('PUT', dbUrl(server, db));
    assert.equal(created.status, 201, JSON.stringify(created.body));
    await seed(server, db);
  });
  const source = await step('read every document and attachment of the source', () => snapshot(server, db));
  assert.deepEqual(Object.keys(source).sort(), ['att-binary', 'att-several', 'att-standalone', 'att-updated', 'plain']);
  const updated = source['att-updated'].doc._attachments;
  assert.deepEqual([updated['version.txt'].revpos, updated['kept.bin'].revpos], [2, 1], 'revpos of the replaced and the carried attachment');
  assert.equal(source['att-updated'].bytes['version.txt'].toString(), 'version 2, replaced\n');

  await step(`couchbackup --mode ${mode} --attachments: the backup holds every attachment's bytes`, async () => {
    runTool('couchbackup', ['--url', url, '--db', db, '--mode', mode, '--attachments', '--output', withBytes, '--quiet']);
    const { header, docs } = readBackup(withBytes);
    assert.equal(header.attachments, true, `the backup's header: ${JSON.stringify(header)}`);
    const live = Object.fromEntries(docs.filter((d) => !d._deleted).map((d) => [d._id, d]));
    assert.deepEqual(Object.keys(live).sort(), Object.keys(source).sort(), 'the backup holds the live documents');
    for (const [id, { doc, bytes }] of Object.entries(source)) {
      assert.equal(live[id]._rev, doc._rev, `revision of ${id} in the backup`);
      if (mode === 'full') assert.equal(live[id]._revisions.start, Number(doc._rev.split('-')[0]), `_revisions of ${id}`);
      assert.deepEqual(Object.keys(live[id]._attachments || {}).sort(), Object.keys(bytes).sort(), `attachments of ${id} in the backup`);
      for (const [name, expected] of Object.entries(bytes)) {
        const backed = live[id]._attachments[name];
        assert.equal(typeof backed.data, 'string', `${id}/${name} has no data in the backup: ${JSON.stringify(backed)}`);
        assert.ok(Buffer.from(backed.data, 'base64').equals(expected), `${id}/${name}: the backup's bytes differ`);
        assert.equal(backed.digest, doc._attachments[name].digest, `${id}/${name}: digest in the backup`);
        assert.equal(backed.revpos, doc._attachments[name].revpos, `${id}/${name}: revpos in the backup`);
      }
    }
  });

  await step(`couchbackup --mode ${mode} without --attachments: stubs only, no bytes`, async () => {
    runTool('couchbackup', ['--url', url, '--db', db, '--mode', mode, '--output', withoutBytes, '--quiet']);
    const { header, docs } = readBackup(withoutBytes);
    assert.notEqual(header.attachments, true, `the backup's header: ${JSON.stringify(header)}`);
    const stubs = docs.filter((d) => !d._deleted).flatMap((d) => Object.entries(d._attachments || {}).map(([name, att]) => ({ id: d._id, name, att })));
    assert.equal(stubs.length, Object.values(source).reduce((n, { bytes }) => n + Object.keys(bytes).length, 0));
    for (const { id, name, att } of stubs) {
      assert.ok(att.stub === true && att.data === undefined, `${id}/${name} without --attachments: ${JSON.stringify(att)}`);
    }
  });

  await step(`couchrestore --attachments into a new database on ${redact(emptyServer)}`, async () => {
    const created = await http('PUT', dbUrl(emptyServer, restoredDb));
    assert.equal(created.status, 201, JSON.stringify(created.body));
    runTool('couchrestore', ['--url', emptyServer.replace(/\/$/, ''), '--db', restoredDb, '--attachments', '--quiet'], { input: fs.readFileSync(withBytes) });
  });

  await step('the restored documents and every attachment equal the source, byte for byte', async () => {
    const restored = await snapshot(emptyServer, restoredDb);
    assert.deepEqual(Object.keys(restored).sort(), Object.keys(source).sort(), 'the restored database holds the live documents');
    for (const [id, { doc, bytes }] of Object.entries(source)) {
      const got = restored[id];
      assert.deepEqual(got.doc, doc, `document ${id} (revision, body, attachment stubs with digest, length, revpos, content type)`);
      for (const [name, expected] of Object.entries(bytes)) {
        assert.ok(got.bytes[name].equals(expected), `${id}/${name}: restored ${got.bytes[name].length} bytes differ from the source's ${expected.length}`);
      }
    }
  });

  await step('delete both databases', async () => {
    for (const [target, name] of [[server, db], [emptyServer, restoredDb]]) {
      const { status, body } = await http('DELETE', dbUrl(target, name));
      assert.equal(status, 200, JSON.stringify(body));
    }
    fs.rmSync(dir, { recursive: true, force: true });
  });
}

main().then(
  () => process.stdout.write(`couchbackup --attachments (${process.argv[2] || 'full'}): all steps passed\n`),
  (error) => {
    process.stderr.write(`FAILED: ${error.stack || error}\n`);
    process.exit(1);
  },
);
