// Databases: `GET /_all_dbs` with `POST /_dbs_info` for counts and sizes, create (`PUT /{db}`),
// delete with confirmation (`DELETE /{db}`); and one database's settings: `_security` members
// and admins, `_revs_limit`.
import { get, put, post, del, dbPath } from '../api.js';
import { h, fill, table, field, status, attempt, bytes, errorText, message, dbHeader } from '../ui.js';
import { rerender } from '../app.js';

/** Names per `POST /_dbs_info`: below the server's bound (`couchdb_max_dbs_info_keys`, 100 by default). */
const INFO_BATCH = 50;

export async function render(main, route) {
  if (route.parts[0] === 'db') return renderSettings(main, route.parts[1]);
  return renderList(main);
}

async function renderList(main) {
  const createName = h('input', { id: 'new-db-name', name: 'db', required: true, pattern: '[a-z][a-z0-9_\\$\\(\\)\\+\\/\\-]*', title: 'a lowercase letter, then lowercase letters, digits and _$()+-/' });
  const createForm = h('form', { id: 'create-db', onsubmit: create }, field('New database', createName), h('button', { type: 'submit' }, 'Create'));
  const openName = h('input', { id: 'open-db-name', name: 'open', required: true });
  const openForm = h('form', { id: 'open-db', onsubmit: (e) => { e.preventDefault(); location.hash = `#/db/${encodeURIComponent(openName.value)}`; } },
    field('Open a database by name', openName), h('button', { type: 'submit', class: 'secondary' }, 'Open'));
  const listing = h('div', {}, h('p', { class: 'muted' }, 'Loading…'));
  fill(main, h('h1', {}, 'Databases'), h('section', {}, createForm, openForm), h('section', {}, listing));

  let names;
  try {
    names = await get('/_all_dbs');
  } catch (err) {
    // A login that is not a server admin: CouchDB 3.4.3 lists databases to admins only.
    fill(listing, message('error', `The list of databases is not shown to this login (${errorText(err)}). Open a database by name above.`));
    return;
  }
  const infos = new Map();
  for (let i = 0; i < names.length; i += INFO_BATCH) {
    const batch = await post('/_dbs_info', { keys: names.slice(i, i + INFO_BATCH) });
    for (const entry of batch) infos.set(entry.key, entry.info || { error: entry.error });
  }
  const rows = names.map((name) => {
    const info = infos.get(name) || {};
    const sizes = info.sizes || {};
    return [
      h('a', { href: `#/db/${encodeURIComponent(name)}`, class: 'db-link' }, name),
      info.doc_count ?? '', info.doc_del_count ?? '', bytes(sizes.active), bytes(sizes.external), bytes(sizes.file),
      deleteControl(name),
    ];
  });
  fill(listing, table(['Name', { label: 'Documents', num: true }, { label: 'Deleted', num: true }, { label: 'Active size', num: true },
    { label: 'Data size', num: true }, { label: 'File size', num: true }, 'Actions'], rows, `${names.length} databases`));

  async function create(event) {
    event.preventDefault();
    const name = createName.value.trim();
    const done = await attempt(() => put(dbPath(name)), `Database ${name} created.`,
      `Creating database ${name}… (on DynamoDB or Firestore this can take up to a minute)`);
    if (done) { await rerender(); status('ok', `Database ${name} created.`); }
  }
}

/** Delete, behind a confirmation that asks for the name again. */
function deleteControl(name) {
  const box = h('div', { class: 'actions' });
  const ask = h('button', { type: 'button', class: 'danger', 'data-delete': name, onclick: confirmStep }, 'Delete…');
  box.append(ask);
  return box;

  function confirmStep() {
    const typed = h('input', { 'aria-label': `Type ${name} to delete it`, placeholder: name, 'data-confirm-name': name });
    const confirmButton = h('button', { type: 'submit', class: 'danger', 'data-confirm-delete': name }, 'Delete for good');
    const form = h('form', { onsubmit: remove },
      h('span', {}, `Type ${name} to delete it and every document in it:`), typed, confirmButton,
      h('button', { type: 'button', class: 'secondary', onclick: () => fill(box, ask) }, 'Cancel'));
    fill(box, form);
    typed.focus();

    async function remove(event) {
      event.preventDefault();
      if (typed.value !== name) { status('error', `The name typed is not ${name}: nothing deleted.`); return; }
      const done = await attempt(() => del(dbPath(name)), undefined, `Deleting database ${name}…`);
      if (done) { await rerender(); status('ok', `Database ${name} deleted.`); }
    }
  }
}

async function renderSettings(main, db) {
  const [security, revsLimit] = await Promise.all([
    get(`${dbPath(db)}/_security`).catch((err) => err),
    get(`${dbPath(db)}/_revs_limit`).catch((err) => err),
  ]);
  const list = (values) => (values || []).join(', ');
  const split = (text) => text.split(',').map((s) => s.trim()).filter(Boolean);
  const sections = [];
  if (security instanceof Error) {
    sections.push(h('section', {}, h('h2', {}, 'Permissions'), message('error', errorText(security))));
  } else {
    const sec = security || {};
    const inputs = {
      adminNames: h('input', { id: 'admins-names', value: list(sec.admins && sec.admins.names) }),
      adminRoles: h('input', { id: 'admins-roles', value: list(sec.admins && sec.admins.roles) }),
      memberNames: h('input', { id: 'members-names', value: list(sec.members && sec.members.names) }),
      memberRoles: h('input', { id: 'members-roles', value: list(sec.members && sec.members.roles) }),
    };
    const save = async (event) => {
      event.preventDefault();
      const body = {
        ...sec,
        admins: { names: split(inputs.adminNames.value), roles: split(inputs.adminRoles.value) },
        members: { names: split(inputs.memberNames.value), roles: split(inputs.memberRoles.value) },
      };
      await attempt(() => put(`${dbPath(db)}/_security`, body), 'Permissions saved.');
    };
    sections.push(h('section', {}, h('h2', {}, 'Permissions (_security)'),
      h('p', { class: 'muted' }, 'Names and roles, comma separated. No members: anyone logged in may read and write.'),
      h('form', { id: 'security-form', onsubmit: save },
        field('Admin names', inputs.adminNames), field('Admin roles', inputs.adminRoles),
        field('Member names', inputs.memberNames), field('Member roles', inputs.memberRoles),
        h('button', { type: 'submit' }, 'Save permissions'))));
  }
  if (revsLimit instanceof Error) {
    sections.push(h('section', {}, h('h2', {}, 'Revisions kept'), message('error', errorText(revsLimit))));
  } else {
    const limit = h('input', { id: 'revs-limit', type: 'number', min: '1', value: String(revsLimit) });
    const save = async (event) => {
      event.preventDefault();
      await attempt(() => put(`${dbPath(db)}/_revs_limit`, Number(limit.value)), `Revisions kept: ${limit.value}.`);
    };
    sections.push(h('section', {}, h('h2', {}, 'Revisions kept (_revs_limit)'),
      h('form', { id: 'revs-limit-form', onsubmit: save }, field('Revisions per document', limit), h('button', { type: 'submit' }, 'Save'))));
  }
  fill(main, dbHeader(db, 'settings'), sections);
}
