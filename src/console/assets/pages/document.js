// One document: its JSON, edited and saved with the revision it was read at (`PUT /{db}/{id}`
// with `_rev`: a 409 is shown, never overwritten); deleted with its revision; its conflicts
// (`?conflicts=true`), each conflicting revision readable (`?rev=`) and a winner picked by
// deleting every other leaf; its attachments uploaded (`PUT /{db}/{id}/{name}?rev=`),
// downloaded (a link to the attachment) and deleted (`DELETE …?rev=`).
import { call, get, put, del, dbPath, docPath, enc } from '../api.js';
import { h, fill, table, field, status, attempt, bytes, pretty, parseJson, errorText, message, dbHeader } from '../ui.js';
import { rerender } from '../app.js';

export async function render(main, { parts }) {
  const db = parts[1];
  if (parts[2] === 'new') return renderNew(main, db);
  const id = parts.slice(3).join('/');
  const doc = await get(docPath(db, id), { conflicts: 'true' });
  fill(main, dbHeader(db, 'docs'), h('h2', {}, 'Document ', h('code', { id: 'doc-id' }, id)),
    editor(db, id, doc), conflicts(db, id, doc), attachments(db, id, doc));
}

function renderNew(main, db) {
  const text = h('textarea', { id: 'doc-json', 'aria-label': 'The new document as JSON', spellcheck: false },
    pretty({ _id: '' }));
  const save = async (event) => {
    event.preventDefault();
    let body;
    try { body = parseJson(text.value, 'The document'); } catch (err) { status('error', err.message); return; }
    const answer = await attempt(() => (body._id ? put(docPath(db, body._id), body) : call('POST', dbPath(db), { body })));
    if (answer) location.hash = `#/db/${encodeURIComponent(db)}/doc/${encodeURIComponent(answer.id)}`;
  };
  fill(main, dbHeader(db, 'docs'), h('h2', {}, 'New document'),
    h('section', {}, h('p', { class: 'muted' }, 'Leave _id empty for a server-made id; an _id starting with _design/ makes a design document.'),
      h('form', { class: 'stack', id: 'doc-form', onsubmit: save }, text, h('div', { class: 'actions' }, h('button', { type: 'submit', id: 'doc-save' }, 'Create')))));
  text.focus();
}

function editor(db, id, doc) {
  // What is edited: the body with `_id` and `_rev`; the server's own fields stay out.
  const { _conflicts, _attachments, ...body } = doc;
  const text = h('textarea', { id: 'doc-json', 'aria-label': 'The document as JSON', spellcheck: false }, pretty(body));
  const outcome = h('div', { id: 'doc-outcome', 'aria-live': 'polite' });
  const save = async (event) => {
    event.preventDefault();
    let edited;
    try { edited = parseJson(text.value, 'The document'); } catch (err) { fill(outcome, message('error', err.message)); return; }
    if (_attachments && edited._attachments === undefined) edited._attachments = _attachments;
    try {
      const answer = await put(docPath(db, id), edited);
      await rerender();
      status('ok', `Saved: revision ${answer.rev}.`);
    } catch (err) {
      fill(outcome, message('error', errorText(err)));
    }
  };
  const remove = async () => {
    if (!confirmed(`Delete ${id} (revision ${doc._rev})?`)) return;
    const done = await attempt(() => del(docPath(db, id), { rev: doc._rev }));
    if (done) { location.hash = `#/db/${encodeURIComponent(db)}`; status('ok', `Deleted ${id}.`); }
  };
  return h('section', {},
    h('p', {}, 'Revision ', h('code', { id: 'doc-rev' }, doc._rev), '. Saving sends this revision: if the document changed since, the server answers 409 and nothing is overwritten.'),
    h('form', { class: 'stack', id: 'doc-form', onsubmit: save }, text,
      h('div', { class: 'actions' },
        h('button', { type: 'submit', id: 'doc-save' }, 'Save'),
        h('button', { type: 'button', class: 'secondary', onclick: () => rerender() }, 'Reload'),
        h('button', { type: 'button', class: 'danger', id: 'doc-delete', onclick: remove }, 'Delete document'))),
    outcome);
}

/** A yes/no the user answers (the browser's own dialog: keyboard reachable, announced). */
function confirmed(question) {
  return window.confirm(question);
}

function conflicts(db, id, doc) {
  const losers = doc._conflicts || [];
  if (!losers.length) return h('section', { id: 'conflicts' }, h('h2', {}, 'Conflicts'), h('p', { class: 'muted' }, 'None: this document has one leaf revision.'));
  const leaves = [doc._rev, ...losers];
  const shown = h('pre', { id: 'conflict-body', 'aria-live': 'polite' });
  const rows = leaves.map((rev, index) => [
    h('code', {}, rev),
    index === 0 ? 'current winner' : 'conflict',
    h('div', { class: 'actions' },
      h('button', { type: 'button', class: 'secondary', onclick: () => show(rev) }, 'Show'),
      h('button', { type: 'button', 'data-keep': rev, onclick: () => keep(rev) }, 'Keep this one')),
  ]);
  return h('section', { id: 'conflicts' }, h('h2', {}, `Conflicts (${losers.length})`),
    h('p', {}, 'The document has several leaf revisions. Keeping one deletes every other leaf, so the one kept wins.'),
    table(['Revision', 'State', 'Actions'], rows), shown);

  async function show(rev) {
    const body = await attempt(() => get(docPath(db, id), { rev }));
    if (body) fill(shown, pretty(body));
  }

  async function keep(rev) {
    const others = leaves.filter((r) => r !== rev);
    if (!confirmed(`Keep ${rev} and delete ${others.length} other revision(s)?`)) return;
    for (const other of others) {
      const done = await attempt(() => del(docPath(db, id), { rev: other }));
      if (!done) return;
    }
    await rerender();
    status('ok', `Kept ${rev}; ${others.length} other leaf revision(s) deleted.`);
  }
}

function attachments(db, id, doc) {
  const stubs = doc._attachments || {};
  const names = Object.keys(stubs);
  const file = h('input', { type: 'file', id: 'attachment-file', required: true });
  const name = h('input', { id: 'attachment-name', placeholder: 'the file’s name' });
  const upload = async (event) => {
    event.preventDefault();
    const chosen = file.files[0];
    if (!chosen) { status('error', 'Choose a file first.'); return; }
    const as = name.value.trim() || chosen.name;
    const done = await attempt(() => call('PUT', `${docPath(db, id)}/${enc(as)}`, { body: chosen, params: { rev: doc._rev }, contentType: chosen.type || 'application/octet-stream' }));
    if (done) { await rerender(); status('ok', `Attached ${as}.`); }
  };
  const rows = names.map((attachment) => {
    const stub = stubs[attachment];
    return [
      h('a', { href: `${docPath(db, id)}/${enc(attachment)}`, download: attachment, 'data-attachment': attachment }, attachment),
      stub.content_type || '', bytes(stub.length), h('code', {}, stub.digest || ''),
      h('button', { type: 'button', class: 'danger', 'data-delete-attachment': attachment, onclick: () => removeAttachment(attachment) }, 'Delete'),
    ];
  });
  return h('section', { id: 'attachments' }, h('h2', {}, `Attachments (${names.length})`),
    table(['Name (download)', 'Type', { label: 'Size', num: true }, 'Digest', 'Actions'], rows),
    h('h2', {}, 'Upload an attachment'),
    h('form', { id: 'attachment-form', onsubmit: upload }, field('File', file), field('Name (optional)', name), h('button', { type: 'submit', id: 'attachment-upload' }, 'Upload')));

  async function removeAttachment(attachment) {
    if (!confirmed(`Delete the attachment ${attachment}?`)) return;
    const done = await attempt(() => del(`${docPath(db, id)}/${enc(attachment)}`, { rev: doc._rev }));
    if (done) { await rerender(); status('ok', `Deleted the attachment ${attachment}.`); }
  }
}
