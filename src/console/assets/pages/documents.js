// A database's documents, a page at a time: `GET /{db}/_all_docs` (keyed paging: the next
// page starts after the last id shown) and `GET /{db}/_changes` (`since` the last `seq`).
import { get, dbPath } from '../api.js';
import { h, fill, table, field, dbHeader } from '../ui.js';

const PAGE_SIZES = ['10', '20', '50', '100'];

export async function render(main, { parts, params }) {
  const db = parts[1];
  if (parts[2] === 'changes') return renderChanges(main, db, params);
  return renderAllDocs(main, db, params);
}

function pageSizeOf(params) {
  const size = params.get('limit') || '20';
  return PAGE_SIZES.includes(size) ? Number(size) : 20;
}

async function renderAllDocs(main, db, params) {
  const limit = pageSizeOf(params);
  const start = params.get('start');
  const [info, page] = await Promise.all([
    get(dbPath(db)),
    // One more than shown: whether there is a next page.
    get(`${dbPath(db)}/_all_docs`, { limit: String(limit + 1), startkey: start === null ? undefined : start }),
  ]);
  const rows = page.rows.slice(0, limit);
  const next = page.rows.length > limit ? page.rows[limit].id : null;
  const base = `#/db/${encodeURIComponent(db)}`;
  const size = h('select', { id: 'page-size', onchange: () => { location.hash = `${base}?limit=${size.value}`; } },
    PAGE_SIZES.map((s) => h('option', { value: s, selected: s === String(limit) }, s)));
  fill(main, dbHeader(db, 'docs'),
    h('section', {},
      h('p', {}, `${info.doc_count} documents, ${info.doc_del_count} deleted. Update sequence `, h('code', {}, String(info.update_seq).slice(0, 24))),
      h('div', { class: 'actions' },
        h('a', { href: `${base}/new`, id: 'new-doc' }, 'New document'),
        field('Per page', size)),
      table(['ID', 'Revision'], rows.map((row) => [
        h('a', { href: `${base}/doc/${encodeURIComponent(row.id)}`, class: 'doc-link' }, row.id),
        h('code', {}, row.value.rev),
      ])),
      h('nav', { class: 'actions', 'aria-label': 'Pages' },
        start !== null ? h('a', { href: `${base}?limit=${limit}`, id: 'first-page' }, 'First page') : null,
        next !== null ? h('a', { href: `${base}?limit=${limit}&start=${encodeURIComponent(JSON.stringify(next))}`, id: 'next-page' }, 'Next page') : null)));
}

async function renderChanges(main, db, params) {
  const limit = pageSizeOf(params);
  const since = params.get('since') || '0';
  const feed = await get(`${dbPath(db)}/_changes`, { since, limit: String(limit), style: 'all_docs' });
  const base = `#/db/${encodeURIComponent(db)}`;
  fill(main, dbHeader(db, 'changes'),
    h('section', {},
      h('p', { class: 'muted' }, `Changes since ${since === '0' ? 'the start' : 'the position shown before'}, ${limit} at a time.`),
      table(['Sequence', 'ID', 'Leaf revisions', 'Deleted'], feed.results.map((change) => [
        h('code', {}, String(change.seq).slice(0, 16)),
        h('a', { href: `${base}/doc/${encodeURIComponent(change.id)}` }, change.id),
        change.changes.map((c) => h('div', {}, h('code', {}, c.rev))),
        change.deleted ? 'yes' : '',
      ])),
      h('nav', { class: 'actions', 'aria-label': 'Pages' },
        since !== '0' ? h('a', { href: `${base}/changes?limit=${limit}` }, 'From the start') : null,
        feed.results.length === limit
          ? h('a', { href: `${base}/changes?limit=${limit}&since=${encodeURIComponent(feed.last_seq)}`, id: 'next-changes' }, 'Next changes')
          : h('span', { class: 'muted' }, `End of the feed (last sequence ${String(feed.last_seq).slice(0, 16)}).`))));
}
