// Per-user isolation on the endpoint (not on pouchdb-server, which has no per-user logins):
// the admin writes documents for two data-store users; a per-user login then sees only its own
// userId's documents in `_all_docs`, `_find`, `_changes` and `_bulk_get`, can write its own, and
// gets 403 for a write of the other user's document. Run once per auth method:
//
//   node isolation.js basic     # HTTP Basic on every request
//   node isolation.js session   # POST /_session (form and JSON), then only the AuthSession cookie
//
// Environment: COUCH_URL (admin) and COUCH_DB as for every script; COUCH_URL_ALICE and
// COUCH_URL_BOB, the server root with a per-user login's credentials; COUCH_ALICE_USER_ID and
// COUCH_BOB_USER_ID, the data-store userIds those logins are configured with.
'use strict';

const { assert, dataDoc, env, http, step } = require('./common');

const SEEDED = 6;

/** `url`'s credentials, and the URL without them. */
function splitLogin(url) {
  const parsed = new URL(url);
  const login = { name: decodeURIComponent(parsed.username), password: decodeURIComponent(parsed.password) };
  parsed.username = '';
  parsed.password = '';
  return { login, bare: parsed.toString().replace(/\/$/, '') };
}

/** Logs in with POST /_session (`form` or `json` body) and returns the AuthSession cookie. */
async function sessionCookie(bare, login, encoding) {
  const body =
    encoding === 'form'
      ? new URLSearchParams({ name: login.name, password: login.password }).toString()
      : JSON.stringify({ username: login.name, password: login.password });
  const type = encoding === 'form' ? 'application/x-www-form-urlencoded' : 'application/json';
  const answer = await http('POST', `${bare}/_session`, { body, json: false, headers: { 'content-type': type } });
  assert.equal(answer.status, 200, `POST /_session (${encoding}): ${JSON.stringify(answer.body)}`);
  assert.equal(answer.body.ok, true);
  assert.equal(answer.body.name, login.name);
  const setCookie = answer.headers.get('set-cookie') || '';
  for (const attribute of ['AuthSession=', 'Expires=', 'Max-Age=', 'Path=/', 'HttpOnly']) {
    assert.ok(setCookie.includes(attribute), `Set-Cookie lacks ${attribute}: ${setCookie}`);
  }
  return setCookie.split(';')[0];
}

/** A request as the per-user login: Basic credentials, or only the session cookie. */
function asUser(bare, db, auth) {
  return (method, path, body) => http(method, `${bare}/${encodeURIComponent(db)}${path}`, { body, headers: auth });
}

async function main() {
  const mode = process.argv[2];
  assert.ok(['basic', 'session'].includes(mode), `mode must be basic or session, not ${mode}`);
  const [admin, db] = [env('COUCH_URL'), env('COUCH_DB')];
  const alice = { ...splitLogin(env('COUCH_URL_ALICE')), userId: env('COUCH_ALICE_USER_ID') };
  const bobUserId = env('COUCH_BOB_USER_ID');
  const namespace = `isolation-${mode}`;
  const adminDb = (method, path, body) => http(method, `${admin.replace(/\/$/, '')}/${encodeURIComponent(db)}${path}`, { body });

  const seeded = {};
  await step(`the admin writes ${SEEDED} documents for each of two users`, async () => {
    for (const userId of [alice.userId, bobUserId]) {
      const docs = Array.from({ length: SEEDED }, (_, i) => dataDoc(userId, namespace, `k${i}`, { owner: userId }));
      const answer = await adminDb('POST', '/_bulk_docs', { docs });
      assert.equal(answer.status, 201, JSON.stringify(answer.body));
      assert.ok(answer.body.every((row) => row.ok), JSON.stringify(answer.body));
      seeded[userId] = docs.map((d) => d._id);
    }
  });

  let auth;
  if (mode === 'basic') {
    auth = { authorization: `Basic ${Buffer.from(`${alice.login.name}:${alice.login.password}`).toString('base64')}` };
  } else {
    auth = await step('POST /_session (form and JSON) sets an AuthSession cookie with Expires, Max-Age, Path, HttpOnly', async () => {
      await sessionCookie(alice.bare, alice.login, 'json');
      return { cookie: await sessionCookie(alice.bare, alice.login, 'form') };
    });
    await step('GET /_session with the cookie names the user', async () => {
      const answer = await http('GET', `${alice.bare}/_session`, { headers: auth });
      assert.equal(answer.status, 200);
      assert.equal(answer.body.userCtx.name, alice.login.name, JSON.stringify(answer.body));
    });
  }
  const user = asUser(alice.bare, db, auth);
  const ownPrefix = `${alice.userId}:`;
  const onlyOwn = (ids, what) => {
    const foreign = ids.filter((id) => !id.startsWith(ownPrefix));
    assert.deepEqual(foreign, [], `${what} shows other users' documents`);
  };

  await step('_all_docs lists only the login\'s own documents', async () => {
    const answer = await user('GET', '/_all_docs');
    assert.equal(answer.status, 200, JSON.stringify(answer.body));
    const ids = answer.body.rows.map((row) => row.id);
    onlyOwn(ids, '_all_docs');
    assert.ok(seeded[alice.userId].every((id) => ids.includes(id)), 'its own documents are listed');
  });

  await step('_find returns only its own documents, even when asked for the other user\'s', async () => {
    const all = await user('POST', '/_find', { selector: { namespace }, limit: 1000 });
    assert.equal(all.status, 200, JSON.stringify(all.body));
    onlyOwn(all.body.docs.map((doc) => doc._id), '_find');
    assert.deepEqual(all.body.docs.map((doc) => doc._id).sort(), [...seeded[alice.userId]].sort());
    const theirs = await user('POST', '/_find', { selector: { userId: bobUserId } });
    assert.equal(theirs.status, 200, JSON.stringify(theirs.body));
    assert.deepEqual(theirs.body.docs, []);
  });

  await step('_changes lists only its own documents', async () => {
    const answer = await user('GET', '/_changes?since=0');
    assert.equal(answer.status, 200, JSON.stringify(answer.body));
    const ids = answer.body.results.map((row) => row.id);
    onlyOwn(ids, '_changes');
    assert.ok(seeded[alice.userId].every((id) => ids.includes(id)), 'its own changes are listed');
  });

  await step('the other user\'s document cannot be read, directly or by _bulk_get', async () => {
    const direct = await user('GET', `/${encodeURIComponent(seeded[bobUserId][0])}`);
    assert.ok([403, 404].includes(direct.status), `GET: ${direct.status} ${JSON.stringify(direct.body)}`);
    const bulk = await user('POST', '/_bulk_get', { docs: [{ id: seeded[bobUserId][0] }, { id: seeded[alice.userId][0] }] });
    assert.equal(bulk.status, 200, JSON.stringify(bulk.body));
    assert.ok(bulk.body.results[0].docs.every((d) => d.error && !d.ok), JSON.stringify(bulk.body.results[0]));
    assert.equal(bulk.body.results[1].docs[0].ok._id, seeded[alice.userId][0]);
  });

  await step('it writes its own documents; a write for the other user is 403 and changes nothing', async () => {
    const own = dataDoc(alice.userId, namespace, 'written-by-alice', 1);
    const created = await user('PUT', `/${encodeURIComponent(own._id)}`, own);
    assert.equal(created.status, 201, JSON.stringify(created.body));
    const foreign = dataDoc(bobUserId, namespace, 'written-by-alice', 1);
    const put = await user('PUT', `/${encodeURIComponent(foreign._id)}`, foreign);
    assert.equal(put.status, 403, `PUT: ${JSON.stringify(put.body)}`);
    assert.equal(put.body.error, 'forbidden');
    const post = await user('POST', '', foreign);
    assert.equal(post.status, 403, `POST /db: ${JSON.stringify(post.body)}`);
    const bulk = await user('POST', '/_bulk_docs', { docs: [foreign] });
    const refused = bulk.status === 403 || (bulk.status === 201 && bulk.body[0].error === 'forbidden');
    assert.ok(refused, `_bulk_docs: ${bulk.status} ${JSON.stringify(bulk.body)}`);
    const check = await adminDb('GET', `/${encodeURIComponent(foreign._id)}`);
    assert.equal(check.status, 404, 'the refused document was not written');
  });

  await step('the other user\'s existing document cannot be updated or deleted', async () => {
    const target = (await adminDb('GET', `/${encodeURIComponent(seeded[bobUserId][1])}`)).body;
    const update = await user('PUT', `/${encodeURIComponent(target._id)}`, { ...target, value: 'hijacked' });
    assert.equal(update.status, 403, JSON.stringify(update.body));
    const remove = await user('DELETE', `/${encodeURIComponent(target._id)}?rev=${target._rev}`);
    assert.ok([403, 404].includes(remove.status), `DELETE: ${remove.status} ${JSON.stringify(remove.body)}`);
    const after = (await adminDb('GET', `/${encodeURIComponent(target._id)}`)).body;
    assert.deepEqual(after, target, 'the document is unchanged');
  });

  await step('a wrong password is 401', async () => {
    const wrong = mode === 'basic'
      ? await http('GET', `${alice.bare}/${encodeURIComponent(db)}/_all_docs`, { headers: { authorization: `Basic ${Buffer.from(`${alice.login.name}:wrong`).toString('base64')}` } })
      : await http('POST', `${alice.bare}/_session`, { body: { name: alice.login.name, password: 'wrong' } });
    assert.equal(wrong.status, 401, JSON.stringify(wrong.body));
    assert.equal(wrong.body.error, 'unauthorized');
  });

  if (mode === 'session') {
    await step('DELETE /_session ends the cookie\'s use', async () => {
      const out = await http('DELETE', `${alice.bare}/_session`, { headers: auth });
      assert.equal(out.status, 200, JSON.stringify(out.body));
      const cleared = out.headers.get('set-cookie') || '';
      assert.ok(cleared.startsWith('AuthSession=;') || cleared.startsWith('AuthSession=""'), `Set-Cookie: ${cleared}`);
    });
  }
}

main().then(
  () => process.stdout.write(`isolation (${process.argv[2]}): all steps passed\n`),
  (error) => {
    process.stderr.write(`FAILED: ${error.stack || error}\n`);
    process.exit(1);
  },
);
