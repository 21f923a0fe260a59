// The data-store database: a user's namespaces and keys as the REST API lists them
// (`GET /v1/users/{user}/namespaces`, `…/namespaces/{namespace}/keys`, on the REST listener, with
// a bearer token the user types: the REST face answers the console's origin when it is in its
// `cors_origins`), and one key's document with its history: its revisions, read through the
// CouchDB API on the data-store database (`GET /{db}/{user}:{namespace}:{base64url(key)}?revs_info=true`),
// which, unlike the REST API's `GET`, does not count an access. The users are listed from the
// data-store database's `_all_docs` (ids start with the user id and `:`), one call per user,
// each starting past the last one's documents: the REST API has no listing of users.
import { get, docPath, dbPath } from '../api.js';
import { h, fill, table, field, status, errorText, message, pretty } from '../ui.js';

const STORE = 'agentstore-console-rest';
/** Users listed per page (one `_all_docs` call each). */
const USERS_PER_PAGE = 20;

/** The REST listener's address, its token and the data-store database's name, kept for this tab. */
function settings() {
  try {
    return JSON.parse(sessionStorage.getItem(STORE)) || {};
  } catch {
    return {};
  }
}

/** `{user}:{namespace}:{key as URL-safe base64 with padding}`: the data store's document id. */
export function documentId(user, namespace, key) {
  const bytes = new TextEncoder().encode(key);
  let binary = '';
  for (const b of bytes) binary += String.fromCharCode(b);
  return `${user}:${namespace}:${btoa(binary).replace(/\+/g, '-').replace(/\//g, '_')}`;
}

async function rest(path) {
  const { url, token } = settings();
  if (!url) throw new Error('Give the REST listener’s address first.');
  const headers = { Accept: 'application/json' };
  if (token) headers.Authorization = `Bearer ${token}`;
  let response;
  try {
    response = await fetch(`${url.replace(/\/$/, '')}${path}`, { headers, mode: 'cors', credentials: 'omit' });
  } catch (err) {
    throw new Error(`The REST listener at ${url} did not answer this page (${err.message}): is it running, and is this console’s origin (${location.origin}) in its cors_origins?`);
  }
  const body = await response.json().catch(() => null);
  if (!response.ok) throw new Error(`${response.status} ${body && body.error ? `${body.error}: ${body.message || body.reason || ''}` : ''}`);
  return body;
}

export async function render(main, { params }) {
  const current = settings();
  const url = h('input', { id: 'rest-url', value: current.url || '', placeholder: 'http://127.0.0.1:8080', required: true });
  const token = h('input', { id: 'rest-token', type: 'password', value: current.token || '', placeholder: 'none when the REST API has no tokens' });
  const database = h('input', { id: 'data-store-db', value: current.db || 'agent_data_store' });
  const save = (event) => {
    event.preventDefault();
    sessionStorage.setItem(STORE, JSON.stringify({ url: url.value.trim(), token: token.value, db: database.value.trim() }));
    status('ok', 'Kept for this tab.');
  };
  const user = h('input', { id: 'data-store-user', required: true, value: params.get('user') || '' });
  const look = (event) => { event.preventDefault(); location.hash = `#/data-store?user=${encodeURIComponent(user.value.trim())}`; };
  const body = h('div', { id: 'data-store-body', 'aria-live': 'polite' });
  const userList = h('div', { id: 'user-list' }, h('p', { class: 'muted' }, 'Listing users…'));
  fill(main, h('h1', {}, 'Data store'),
    h('section', {}, h('h2', {}, 'Where the REST API answers'),
      h('form', { id: 'rest-form', onsubmit: save }, field('REST listener', url), field('Bearer token', token), field('Data-store database', database),
        h('button', { type: 'submit' }, 'Keep'))),
    h('section', {}, h('h2', {}, 'Users'), userList,
      h('form', { id: 'user-form', onsubmit: look }, field('User id', user), h('button', { type: 'submit' }, 'Show namespaces'))),
    body);
  const after = params.get('after') || '';
  try {
    const page = await usersAfter(current.db || 'agent_data_store', after, USERS_PER_PAGE);
    fill(userList, table(['User'], page.users.map((u) => [link({ user: u }, u)]),
      after ? `Users after ${after}` : 'Users, in id order'),
    page.more ? h('p', {}, link({ after: page.users[page.users.length - 1] }, 'Next users')) : null);
  } catch (err) {
    fill(userList, message('error', `Users cannot be listed (${errorText(err)}); type a user id below.`));
  }
  const who = params.get('user');
  if (!who) return;
  try {
    const namespace = params.get('namespace');
    const key = params.get('key');
    if (key !== null && namespace !== null) fill(body, await keyHistory(who, namespace, key));
    else if (namespace !== null) fill(body, await keys(who, namespace));
    else fill(body, await namespaces(who));
  } catch (err) {
    fill(body, message('error', errorText(err)));
  }
}

/**
 * Up to `count` user ids after `after` (all when empty), in id order: the data store's document
 * ids are `{user}:{namespace}:{key}` and a user id holds no `:`, so one `_all_docs?limit=1` call
 * finds the next user and the next call starts at `{user};` (`;` follows `:`), past all its
 * documents. Design documents (`_design/…`) are stepped over.
 */
export async function usersAfter(db, after, count) {
  const users = [];
  let startkey = after ? `${after};` : undefined;
  while (users.length < count) {
    const page = await get(`${dbPath(db)}/_all_docs`, { limit: '1', startkey: startkey === undefined ? undefined : JSON.stringify(startkey) });
    const row = (page.rows || [])[0];
    if (!row) return { users, more: false };
    const colon = row.id.indexOf(':');
    if (row.id.startsWith('_design/')) startkey = '_design0';
    else if (colon < 0) startkey = `${row.id}\u0000`;
    else {
      users.push(row.id.slice(0, colon));
      startkey = `${row.id.slice(0, colon)};`;
    }
  }
  return { users, more: true };
}

const link = (params, text) => h('a', { href: `#/data-store?${new URLSearchParams(params)}` }, text);

async function namespaces(user) {
  const names = await rest(`/v1/users/${encodeURIComponent(user)}/namespaces`);
  return h('section', {}, h('h2', {}, `Namespaces of ${user}`),
    table(['Namespace'], names.map((ns) => [link({ user, namespace: ns }, ns)])));
}

async function keys(user, namespace) {
  const list = await rest(`/v1/users/${encodeURIComponent(user)}/namespaces/${encodeURIComponent(namespace)}/keys`);
  return h('section', {}, h('h2', {}, link({ user }, user), ` / ${namespace}: ${list.length} keys`),
    table(['Key'], list.map((key) => [link({ user, namespace, key }, key)])));
}

async function keyHistory(user, namespace, key) {
  const db = settings().db || 'agent_data_store';
  const id = documentId(user, namespace, key);
  const doc = await get(docPath(db, id), { revs_info: 'true' });
  const shown = h('pre', { id: 'revision-body' });
  const open = async (rev) => {
    try { fill(shown, pretty(await get(docPath(db, id), { rev }))); } catch (err) { fill(shown, errorText(err)); }
  };
  const revisions = (doc._revs_info || []).map((info) => [
    h('code', {}, info.rev), info.status,
    info.status === 'available' ? h('button', { type: 'button', class: 'secondary', onclick: () => open(info.rev) }, 'Show') : '',
  ]);
  const { _revs_info, ...current } = doc;
  return h('section', {}, h('h2', {}, link({ user }, user), ' / ', link({ user, namespace }, namespace), ` / ${key}`),
    h('p', {}, 'Document ', h('code', {}, id), ' in ', h('a', { href: `#/db/${encodeURIComponent(db)}/doc/${encodeURIComponent(id)}` }, db), '.'),
    h('pre', { id: 'key-document' }, pretty(current)),
    h('h2', {}, 'History (revisions, newest first)'),
    h('p', { class: 'muted' }, 'A revision older than the current one is kept only until compaction or the database’s _revs_limit; then it is “missing”.'),
    table(['Revision', 'Status', ''], revisions), shown);
}
