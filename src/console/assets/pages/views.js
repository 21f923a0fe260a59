// Design documents and their views: listed from `GET /{db}/_design_docs?include_docs=true`;
// a view run with its query options (`GET /{db}/_design/{ddoc}/_view/{view}`); a view added to a
// design document (`PUT /{db}/_design/{ddoc}` with the revision read).
import { get, put, dbPath, docPath, enc } from '../api.js';
import { h, fill, table, field, status, attempt, pretty, parseJson, errorText, message, dbHeader } from '../ui.js';
import { rerender } from '../app.js';

/** The query options offered, as CouchDB names them; JSON ones are sent as typed. */
const JSON_OPTIONS = ['key', 'startkey', 'endkey', 'keys'];
const NUMBER_OPTIONS = ['limit', 'skip', 'group_level'];
const BOOLEAN_OPTIONS = ['descending', 'include_docs', 'reduce', 'group', 'inclusive_end', 'update_seq'];

export async function render(main, { parts, params }) {
  const db = parts[1];
  const designs = await get(`${dbPath(db)}/_design_docs`, { include_docs: 'true' });
  const views = [];
  for (const row of designs.rows) {
    for (const name of Object.keys((row.doc && row.doc.views) || {})) views.push({ ddoc: row.id.slice(8), name, view: row.doc.views[name] });
  }
  const results = h('div', { id: 'view-results', 'aria-live': 'polite' });
  const chosen = params.get('view');
  fill(main, dbHeader(db, 'views'),
    h('section', {}, h('h2', {}, 'Design documents'),
      table(['Design document', 'Views', 'Language'], designs.rows.map((row) => [
        h('a', { href: `#/db/${encodeURIComponent(db)}/doc/${encodeURIComponent(row.id)}` }, row.id),
        Object.keys((row.doc && row.doc.views) || {}).join(', '),
        (row.doc && row.doc.language) || 'javascript',
      ]))),
    views.length ? runForm(db, views, chosen, results) : h('section', {}, h('p', { class: 'muted' }, 'No views yet: add one below.')),
    results,
    newViewForm(db));
}

function runForm(db, views, chosen, results) {
  const select = h('select', { id: 'view-select' }, views.map((v) => {
    const value = `${v.ddoc}/${v.name}`;
    return h('option', { value, selected: value === chosen }, `${v.ddoc} / ${v.name}${v.view.reduce ? ' (reduce)' : ''}`);
  }));
  const inputs = {};
  for (const name of JSON_OPTIONS) inputs[name] = h('input', { id: `view-${name}`, placeholder: 'JSON' });
  for (const name of NUMBER_OPTIONS) inputs[name] = h('input', { id: `view-${name}`, type: 'number', min: '0' });
  const booleans = {};
  for (const name of BOOLEAN_OPTIONS) {
    booleans[name] = h('select', { id: `view-${name}` }, h('option', { value: '' }, 'default'), h('option', { value: 'true' }, 'true'), h('option', { value: 'false' }, 'false'));
  }
  inputs.limit.value = '20';
  const run = async (event) => {
    event.preventDefault();
    const [ddoc, view] = select.value.split('/');
    const params = {};
    try {
      for (const name of JSON_OPTIONS) if (inputs[name].value.trim()) params[name] = JSON.stringify(parseJson(inputs[name].value, name));
      for (const name of NUMBER_OPTIONS) if (inputs[name].value !== '') params[name] = inputs[name].value;
      for (const name of BOOLEAN_OPTIONS) if (booleans[name].value) params[name] = booleans[name].value;
    } catch (err) {
      fill(results, message('error', err.message));
      return;
    }
    try {
      const answer = await get(`${dbPath(db)}/_design/${enc(ddoc)}/_view/${enc(view)}`, params);
      const head = answer.total_rows !== undefined ? `${answer.rows.length} rows of ${answer.total_rows} (offset ${answer.offset}).` : `${answer.rows.length} rows.`;
      fill(results, h('section', {}, h('h2', {}, `Rows of ${ddoc}/${view}`), h('p', { id: 'view-summary' }, head),
        table(['Key', 'Value', 'ID', 'Document'], answer.rows.map((row) => [
          h('code', {}, JSON.stringify(row.key)), h('code', {}, JSON.stringify(row.value)),
          row.id ? h('a', { href: `#/db/${encodeURIComponent(db)}/doc/${encodeURIComponent(row.id)}` }, row.id) : '',
          row.doc ? h('code', {}, JSON.stringify(row.doc)) : '',
        ]))));
    } catch (err) {
      fill(results, message('error', errorText(err)));
    }
  };
  return h('section', {}, h('h2', {}, 'Run a view'),
    h('form', { id: 'view-form', onsubmit: run }, field('View', select),
      JSON_OPTIONS.map((n) => field(n, inputs[n])), NUMBER_OPTIONS.map((n) => field(n, inputs[n])),
      BOOLEAN_OPTIONS.map((n) => field(n, booleans[n])),
      h('button', { type: 'submit', id: 'view-run' }, 'Run')));
}

function newViewForm(db) {
  const ddoc = h('input', { id: 'new-view-ddoc', required: true, placeholder: 'e.g. stats' });
  const name = h('input', { id: 'new-view-name', required: true, placeholder: 'e.g. by_type' });
  const map = h('textarea', { id: 'new-view-map', class: 'short', spellcheck: false }, 'function (doc) {\n  emit(doc._id, 1);\n}');
  const reduce = h('input', { id: 'new-view-reduce', placeholder: '_count, _sum, _stats, or empty' });
  const save = async (event) => {
    event.preventDefault();
    const id = `_design/${ddoc.value.trim()}`;
    let design;
    try {
      design = await get(docPath(db, id));
    } catch (err) {
      if (err.status !== 404) { status('error', errorText(err)); return; }
      design = { _id: id, language: 'javascript' };
    }
    design.views = { ...(design.views || {}), [name.value.trim()]: reduce.value.trim() ? { map: map.value, reduce: reduce.value.trim() } : { map: map.value } };
    const done = await attempt(() => put(docPath(db, id), design));
    if (done) {
      location.hash = `#/db/${encodeURIComponent(db)}/views?view=${encodeURIComponent(`${ddoc.value.trim()}/${name.value.trim()}`)}`;
      await rerender();
      status('ok', `View ${ddoc.value.trim()}/${name.value.trim()} saved (revision ${done.rev}).`);
    }
  };
  return h('section', {}, h('h2', {}, 'Add a view'),
    h('form', { class: 'stack', id: 'new-view-form', onsubmit: save },
      field('Design document (without _design/)', ddoc), field('View name', name), field('Map function', map), field('Reduce (optional)', reduce),
      h('div', { class: 'actions' }, h('button', { type: 'submit', id: 'new-view-save' }, 'Save view'))),
    h('p', { class: 'muted' }, 'Saved with the design document’s current revision; the design document keeps its other views.'));
}

