// Mango: a query (selector, fields, sort, limit) run with `POST /{db}/_find` a page at a time
// (the `bookmark` of each answer asks for the next), the index `POST /{db}/_explain` chooses, and
// the indexes listed (`GET /{db}/_index`), created (`POST`) and deleted (`DELETE …/json/{name}`).
import { get, post, del, dbPath, enc } from '../api.js';
import { h, fill, table, field, status, attempt, pretty, parseJson, errorText, message, dbHeader } from '../ui.js';
import { rerender } from '../app.js';

const EXAMPLE = { selector: { _id: { $gt: null } }, limit: 25 };

export async function render(main, { parts }) {
  const db = parts[1];
  const indexes = await get(`${dbPath(db)}/_index`);
  const query = h('textarea', { id: 'mango-query', spellcheck: false, 'aria-label': 'The query as JSON: selector, fields, sort, limit' }, pretty(EXAMPLE));
  const explained = h('div', { id: 'mango-explain', 'aria-live': 'polite' });
  const results = h('div', { id: 'mango-results', 'aria-live': 'polite' });
  let bookmark = null;
  let pageNumber = 0;

  const parsedQuery = () => parseJson(query.value, 'The query');
  const explain = async () => {
    let body;
    try { body = parsedQuery(); } catch (err) { fill(explained, message('error', err.message)); return; }
    try {
      const answer = await post(`${dbPath(db)}/_explain`, body);
      const index = answer.index || {};
      fill(explained, h('section', {}, h('h2', {}, 'Chosen index'),
        h('p', { id: 'mango-chosen-index' }, `${index.type || '?'} index ${index.name || ''}${index.ddoc ? ` in ${index.ddoc}` : ''}`),
        h('details', {}, h('summary', {}, 'The whole _explain answer'), h('pre', {}, pretty(answer)))));
    } catch (err) {
      fill(explained, message('error', errorText(err)));
    }
  };
  const run = async (fromBookmark) => {
    let body;
    try { body = parsedQuery(); } catch (err) { fill(results, message('error', err.message)); return; }
    if (fromBookmark && bookmark) body.bookmark = bookmark;
    pageNumber = fromBookmark ? pageNumber + 1 : 1;
    try {
      const answer = await post(`${dbPath(db)}/_find`, body);
      bookmark = answer.bookmark || null;
      const limit = body.limit ?? 25;
      fill(results, h('section', {}, h('h2', {}, `Results, page ${pageNumber}`),
        answer.warning ? message('error', `Warning: ${answer.warning}`) : null,
        h('p', { id: 'mango-count' }, `${answer.docs.length} documents.`),
        table(['ID', 'Document'], answer.docs.map((doc) => [
          doc._id ? h('a', { href: `#/db/${encodeURIComponent(db)}/doc/${encodeURIComponent(doc._id)}` }, doc._id) : '',
          h('code', {}, JSON.stringify(doc)),
        ])),
        h('div', { class: 'actions' }, answer.docs.length >= limit && bookmark
          ? h('button', { type: 'button', id: 'mango-next', onclick: () => run(true) }, 'Next page (bookmark)')
          : h('span', { class: 'muted' }, 'No more pages.'))));
    } catch (err) {
      fill(results, message('error', errorText(err)));
    }
  };

  fill(main, dbHeader(db, 'mango'),
    h('section', {}, h('h2', {}, 'Query'),
      h('form', { class: 'stack', id: 'mango-form', onsubmit: (e) => { e.preventDefault(); run(false); } }, query,
        h('div', { class: 'actions' },
          h('button', { type: 'submit', id: 'mango-run' }, 'Run'),
          h('button', { type: 'button', class: 'secondary', id: 'mango-explain-button', onclick: explain }, 'Explain')))),
    explained, results, indexSection(db, indexes));
}

function indexSection(db, indexes) {
  const fields = h('input', { id: 'index-fields', required: true, placeholder: 'type, created' });
  const name = h('input', { id: 'index-name', placeholder: 'optional' });
  const create = async (event) => {
    event.preventDefault();
    const body = { index: { fields: fields.value.split(',').map((f) => f.trim()).filter(Boolean) }, type: 'json' };
    if (name.value.trim()) body.name = name.value.trim();
    const done = await attempt(() => post(`${dbPath(db)}/_index`, body));
    if (done) { await rerender(); status('ok', `Index ${done.name} ${done.result}.`); }
  };
  const remove = async (index) => {
    if (!window.confirm(`Delete the index ${index.name}?`)) return;
    const ddoc = index.ddoc.replace(/^_design\//, '');
    const done = await attempt(() => del(`${dbPath(db)}/_index/${enc(ddoc)}/json/${enc(index.name)}`));
    if (done) { await rerender(); status('ok', `Index ${index.name} deleted.`); }
  };
  return h('section', {}, h('h2', {}, `Indexes (${indexes.total_rows})`),
    table(['Name', 'Design document', 'Type', 'Fields', 'Actions'], indexes.indexes.map((index) => [
      index.name, index.ddoc || '', index.type,
      h('code', {}, JSON.stringify((index.def && index.def.fields) || [])),
      index.type === 'special' ? '' : h('button', { type: 'button', class: 'danger', 'data-delete-index': index.name, onclick: () => remove(index) }, 'Delete'),
    ])),
    h('h2', {}, 'Create a JSON index'),
    h('form', { id: 'index-form', onsubmit: create }, field('Fields (comma separated)', fields), field('Name', name), h('button', { type: 'submit', id: 'index-create' }, 'Create index')));
}
