// Replications: the `_replicator` database's documents, and what the scheduler says of them and
// of its jobs (`GET /_scheduler/docs`, `GET /_scheduler/jobs`, CouchDB 3.4.3's shapes), read
// again every few seconds while the page is open: each replication's state, documents written,
// changes still pending, its rate over the last interval and the time left at that rate, and its
// error. A replication document added (`POST /_replicator`) or deleted (`DELETE` with its
// revision).
import { get, post, del, docPath } from '../api.js';
import { h, fill, table, field, status, attempt, errorText, message } from '../ui.js';
import { rerender } from '../app.js';

/** Seconds between two readings of the scheduler. */
const REFRESH_SECONDS = 5;

/** The last reading of each replication (`docs_written` and when), for its rate: kept across readings. */
const lastSeen = new Map();
let refresher = null;

export async function render(main, { stale }) {
  const [docs, schedulerDocs, jobs] = await readAll();
  const docsBox = h('div', { id: 'replicator-docs' });
  const schedulerBox = h('div', { id: 'scheduler-docs' });
  const jobsBox = h('div', { id: 'scheduler-jobs' });
  const show = ([docs, schedulerDocs, jobs]) => {
    fill(docsBox, replicatorDocs(docs));
    fill(schedulerBox, schedulerDocs instanceof Error ? message('error', errorText(schedulerDocs)) : progressTable(schedulerDocs.docs));
    fill(jobsBox, jobs instanceof Error ? message('error', errorText(jobs)) : jobsTable(jobs.jobs));
  };
  show([docs, schedulerDocs, jobs]);
  fill(main, h('h1', {}, 'Replication'),
    h('section', {}, h('h2', {}, 'Replication documents (_replicator)'), docsBox, newReplication()),
    h('section', {}, h('h2', {}, 'Replications and their progress'),
      h('p', { class: 'muted' }, `What the scheduler says of each document, read again every ${REFRESH_SECONDS} s while this page is open; the rate is over the last interval, the time left is the pending changes at that rate.`),
      schedulerBox),
    h('section', {}, h('h2', {}, 'Scheduler: jobs'), jobsBox));
  if (refresher) clearInterval(refresher);
  refresher = setInterval(async () => {
    if (stale() || !document.body.contains(schedulerBox)) { clearInterval(refresher); refresher = null; return; }
    const readings = await readAll();
    if (!stale()) show(readings);
  }, REFRESH_SECONDS * 1000);
}

function readAll() {
  return Promise.all([
    get('/_replicator/_all_docs', { include_docs: 'true' }).catch((err) => err),
    get('/_scheduler/docs').catch((err) => err),
    get('/_scheduler/jobs').catch((err) => err),
  ]);
}

/** Documents written per second since the last reading of `doc` (null on its first). */
function rateOf(doc, written) {
  const now = Date.now();
  const before = lastSeen.get(doc);
  lastSeen.set(doc, { written, at: now });
  if (!before || now <= before.at || written < before.written) return null;
  return (written - before.written) / ((now - before.at) / 1000);
}

function duration(seconds) {
  if (!Number.isFinite(seconds)) return '';
  if (seconds < 60) return `${Math.ceil(seconds)} s`;
  if (seconds < 3600) return `${Math.ceil(seconds / 60)} min`;
  return `${(seconds / 3600).toFixed(1)} h`;
}

function progressTable(docs) {
  const rows = docs.map((d) => {
    const info = d.info || {};
    const written = typeof info.docs_written === 'number' ? info.docs_written : null;
    const pending = typeof info.changes_pending === 'number' ? info.changes_pending : null;
    const rate = written === null ? null : rateOf(d.doc_id, written);
    const left = rate && pending ? duration(pending / rate) : pending === 0 ? 'done' : '';
    const error = info.error || d.last_error || '';
    return [
      d.doc_id, h('span', { class: `state state-${d.state || 'none'}` }, d.state || ''), d.source || '', d.target || '',
      written ?? '', pending ?? '', rate === null ? '' : rate.toFixed(1), left,
      d.error_count ?? '', error ? h('code', {}, typeof error === 'string' ? error : JSON.stringify(error)) : '',
    ];
  });
  return table(['Document', 'State', 'Source', 'Target', { label: 'Docs written', num: true }, { label: 'Pending', num: true },
    { label: 'Docs/s', num: true }, 'Time left', { label: 'Errors', num: true }, 'Last error'], rows);
}

function jobsTable(jobs) {
  return table(['Job', 'Document', 'Source', 'Target', 'Started', 'Last event'], jobs.map((j) => [
    h('code', {}, j.id), j.doc_id || '', j.source || '', j.target || '', j.start_time || '',
    j.history && j.history[0] ? `${j.history[0].type} at ${j.history[0].timestamp}` : '']));
}

function replicatorDocs(docs) {
  if (docs instanceof Error) {
    return message(docs.status === 404 ? 'ok' : 'error', docs.status === 404
      ? 'There is no _replicator database yet: adding a replication below creates its document there once the database exists (an admin creates it on the Databases page).'
      : errorText(docs));
  }
  const rows = docs.rows.filter((r) => !r.id.startsWith('_design/')).map((row) => [
    row.id, row.doc.source && (row.doc.source.url || row.doc.source), row.doc.target && (row.doc.target.url || row.doc.target),
    row.doc.continuous ? 'yes' : 'no', row.doc._replication_state || '',
    h('button', { type: 'button', class: 'danger', onclick: () => remove(row.id, row.value.rev) }, 'Delete'),
  ]);
  return table(['ID', 'Source', 'Target', 'Continuous', 'State', 'Actions'], rows);
}

function newReplication() {
  const source = h('input', { id: 'replication-source', required: true, placeholder: 'a database name, or http://host:5984/db' });
  const target = h('input', { id: 'replication-target', required: true, placeholder: 'a database name, or http://host:5984/db' });
  const continuous = h('input', { id: 'replication-continuous', type: 'checkbox' });
  const createTarget = h('input', { id: 'replication-create-target', type: 'checkbox' });
  const create = async (event) => {
    event.preventDefault();
    const body = { source: source.value, target: target.value, continuous: continuous.checked };
    if (createTarget.checked) body.create_target = true;
    const done = await attempt(() => post('/_replicator', body));
    if (done) { await rerender(); status('ok', `Replication document ${done.id} added.`); }
  };
  return h('form', { id: 'replication-form', onsubmit: create }, field('Source', source), field('Target', target),
    h('label', { class: 'check' }, continuous, 'Continuous'),
    h('label', { class: 'check' }, createTarget, 'Create the target'),
    h('button', { type: 'submit' }, 'Add replication'));
}

async function remove(id, rev) {
  if (!window.confirm(`Delete the replication document ${id}?`)) return;
  const done = await attempt(() => del(docPath('_replicator', id), { rev }));
  if (done) { await rerender(); status('ok', `Replication document ${id} deleted.`); }
}
