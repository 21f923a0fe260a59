// Replications: the `_replicator` database's documents, and what the scheduler says of them and
// of its jobs (`GET /_scheduler/docs`, `GET /_scheduler/jobs`, CouchDB 3.4.3's shapes); a
// replication document added (`POST /_replicator`) or deleted (`DELETE` with its revision).
import { get, post, del, docPath } from '../api.js';
import { h, fill, table, field, status, attempt, errorText, message } from '../ui.js';
import { rerender } from '../app.js';

export async function render(main) {
  const [docs, schedulerDocs, jobs] = await Promise.all([
    get('/_replicator/_all_docs', { include_docs: 'true' }).catch((err) => err),
    get('/_scheduler/docs').catch((err) => err),
    get('/_scheduler/jobs').catch((err) => err),
  ]);
  fill(main, h('h1', {}, 'Replication'),
    h('section', {}, h('h2', {}, 'Replication documents (_replicator)'), replicatorDocs(docs), newReplication()),
    h('section', {}, h('h2', {}, 'Scheduler: documents'), schedulerDocs instanceof Error ? message('error', errorText(schedulerDocs))
      : table(['Document', 'State', 'Source', 'Target', 'Error count', 'Info'], schedulerDocs.docs.map((d) => [
        d.doc_id, d.state || '', d.source || '', d.target || '', d.error_count ?? '', d.info ? h('code', {}, JSON.stringify(d.info)) : '']))),
    h('section', {}, h('h2', {}, 'Scheduler: jobs'), jobs instanceof Error ? message('error', errorText(jobs))
      : table(['Job', 'Document', 'Source', 'Target', 'Started', 'Last event'], jobs.jobs.map((j) => [
        h('code', {}, j.id), j.doc_id || '', j.source || '', j.target || '', j.start_time || '',
        j.history && j.history[0] ? `${j.history[0].type} at ${j.history[0].timestamp}` : '']))));
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
  const source = h('input', { id: 'replication-source', required: true, placeholder: 'http://host:5984/db' });
  const target = h('input', { id: 'replication-target', required: true, placeholder: 'http://host:5984/db' });
  const continuous = h('input', { id: 'replication-continuous', type: 'checkbox' });
  const create = async (event) => {
    event.preventDefault();
    const done = await attempt(() => post('/_replicator', { source: source.value, target: target.value, continuous: continuous.checked }));
    if (done) { await rerender(); status('ok', `Replication document ${done.id} added.`); }
  };
  return h('form', { id: 'replication-form', onsubmit: create }, field('Source', source), field('Target', target),
    h('label', { class: 'check' }, continuous, 'Continuous'), h('button', { type: 'submit' }, 'Add replication'));
}

async function remove(id, rev) {
  if (!window.confirm(`Delete the replication document ${id}?`)) return;
  const done = await attempt(() => del(docPath('_replicator', id), { rev }));
  if (done) { await rerender(); status('ok', `Replication document ${id} deleted.`); }
}
