// The data-store database: a user's namespaces and keys as the REST API lists them
// (`GET /v1/users/{user}/namespaces`, `…/namespaces/{namespace}/keys`, on the REST listener, with
// a bearer token the user types: the REST face answers the console's origin when it is in its
// `cors_origins`), and one key's document with its history: its revisions, read through the
// CouchDB API on the data-store database (`GET /{db}/{user}:{namespace}:{base64url(key)}?revs_info=true`),
// which, unlike the REST API's `GET`, does not count an access.
import { get, docPath } from '../api.js';
import { h, fill, table, field, status, errorText, message, pretty } from '../ui.js';

const STORE = 'agentstore-console-rest';

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
  fill(main, h('h1', {}, 'Data store'),
    h('section', {}, h('h2', {}, 'Where the REST API answers'),
      h('form', { id: 'rest-form', onsubmit: save }, field('REST listener', url), field('Bearer token', token), field('Data-store database', database),
        h('button', { type: 'submit' }, 'Keep'))),
    h('section', {}, h('form', { id: 'user-form', onsubmit: look }, field('User id', user), h('button', { type: 'submit' }, 'Show namespaces'))),
    body);
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
