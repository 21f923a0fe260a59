// The console's entry: who is logged in, the sections' links, and the page each address
// (`#/…`) shows. Pages are modules under pages/, each a `render(main, route)` function.
import { session, isAdmin, del } from './api.js';
import { h, fill, status, errorText } from './ui.js';
import * as login from './pages/login.js';
import * as databases from './pages/databases.js';
import * as documents from './pages/documents.js';
import * as document_ from './pages/document.js';
import * as mango from './pages/mango.js';
import * as views from './pages/views.js';
import * as service from './pages/service.js';
import * as replication from './pages/replication.js';
import * as dataStore from './pages/data_store.js';

/** Who the page acts for (`GET /_session`'s userCtx), read at start and after log in/out. */
export const state = { user: { name: null, roles: [] } };

const SECTIONS = [
  ['databases', 'Databases', '#/databases'],
  ['data-store', 'Data store', '#/data-store'],
  ['replication', 'Replication', '#/replication'],
  ['service', 'Service', '#/service'],
];

/** The address, split: `#/db/NAME/doc/ID` → ['db', NAME, 'doc', ID] (each part decoded). */
function parseHash() {
  const hash = location.hash.replace(/^#\/?/, '');
  const [path, search] = hash.split('?');
  const parts = path ? path.split('/').map((p) => decodeURIComponent(p)) : [];
  return { parts, params: new URLSearchParams(search || '') };
}

/** Which page an address shows. */
function pageFor(parts) {
  const [first, db, sub] = parts;
  if (first === 'login') return [login, 'login'];
  if (first === 'db' && db !== undefined) {
    if (sub === undefined) return [documents, 'databases'];
    if (sub === 'changes') return [documents, 'databases'];
    if (sub === 'doc' || sub === 'new') return [document_, 'databases'];
    if (sub === 'views') return [views, 'databases'];
    if (sub === 'mango') return [mango, 'databases'];
    if (sub === 'settings') return [databases, 'databases'];
  }
  if (first === 'service') return [service, 'service'];
  if (first === 'replication') return [replication, 'replication'];
  if (first === 'data-store') return [dataStore, 'data-store'];
  return [databases, 'databases'];
}

function renderChrome(section) {
  const loggedIn = state.user.name !== null || isAdmin(state.user);
  fill(document.getElementById('nav'), loggedIn
    ? SECTIONS.map(([key, label, href]) => h('a', { href, 'aria-current': key === section ? 'page' : null }, label))
    : null);
  const who = document.getElementById('who');
  if (!loggedIn) {
    fill(who, h('a', { href: '#/login' }, 'Log in'));
    return;
  }
  const name = state.user.name === null ? 'anonymous (no logins configured: everyone is admin)' : state.user.name;
  const roles = state.user.roles.length ? ` (${state.user.roles.join(', ')})` : '';
  fill(who,
    h('span', { id: 'who-name' }, `${name}${roles}`),
    state.user.name === null ? null : h('button', { type: 'button', id: 'logout', onclick: logout }, 'Log out'));
}

async function logout() {
  try {
    await del('/_session');
  } catch (err) {
    status('error', errorText(err));
  }
  await refreshSession();
  location.hash = '#/login';
}

/** Reads `GET /_session` again (after logging in or out). */
export async function refreshSession() {
  try {
    state.user = await session();
  } catch (err) {
    state.user = { name: null, roles: [] };
    status('error', `Cannot read the session: ${errorText(err)}`);
  }
}

let rendering = 0;

async function route() {
  const ticket = ++rendering;
  const { parts, params } = parseHash();
  const loggedIn = state.user.name !== null || isAdmin(state.user);
  let [page, section] = pageFor(parts);
  if (!loggedIn && page !== login) [page, section] = [login, 'login'];
  renderChrome(section);
  status(null, '');
  const main = document.getElementById('main');
  fill(main, h('p', { class: 'muted' }, 'Loading…'));
  try {
    await page.render(main, { parts, params, state, stale: () => ticket !== rendering });
  } catch (err) {
    if (ticket === rendering) fill(main, h('h1', {}, 'Cannot show this page'), h('p', { class: 'message error', role: 'alert' }, errorText(err)));
  }
  document.title = `${(main.querySelector('h1') || {}).textContent || 'agentstore'} · agentstore console`;
  main.dataset.ready = String(ticket);
}

/** Shows the page of the current address again (after a change it made). */
export function rerender() {
  return route();
}

window.addEventListener('hashchange', () => {
  route().then(() => document.getElementById('main').focus());
});

(async () => {
  await refreshSession();
  await route();
})();
