// Small DOM helpers the pages share: elements, tables, forms, messages. No framework.

/** An element: `h('a', {href: '#/x'}, 'text', child…)`; `on…` props become listeners. */
export function h(tag, props, ...children) {
  const el = document.createElement(tag);
  for (const [name, value] of Object.entries(props || {})) {
    if (value === undefined || value === null || value === false) continue;
    if (name.startsWith('on') && typeof value === 'function') el.addEventListener(name.slice(2), value);
    else if (name === 'class') el.className = value;
    else if (name === 'text') el.textContent = value;
    else if (name in el && typeof value !== 'string') el[name] = value;
    else el.setAttribute(name, value === true ? '' : value);
  }
  append(el, children);
  return el;
}

function append(el, children) {
  for (const child of children.flat(Infinity)) {
    if (child === undefined || child === null || child === false) continue;
    el.append(child instanceof Node ? child : document.createTextNode(String(child)));
  }
}

/** Replaces what `el` holds. */
export function fill(el, ...children) {
  el.replaceChildren();
  append(el, children);
  return el;
}

/** A table in a horizontally scrolling box; `columns` are `{label, num}` or strings. */
export function table(columns, rows, caption) {
  const head = columns.map((c) => (typeof c === 'string' ? { label: c } : c));
  return h('div', { class: 'table-wrap' },
    h('table', {},
      caption ? h('caption', { class: 'muted' }, caption) : null,
      h('thead', {}, h('tr', {}, head.map((c) => h('th', { scope: 'col', class: c.num ? 'num' : null }, c.label)))),
      h('tbody', {}, rows.length
        ? rows.map((row) => h('tr', {}, row.map((cell, i) => h('td', { class: head[i] && head[i].num ? 'num' : null }, cell))))
        : h('tr', {}, h('td', { colspan: String(head.length), class: 'muted' }, 'Nothing here.')))));
}

/** A labelled input. */
export function field(label, input) {
  return h('label', {}, label, input);
}

/** A message box; `kind` is `error`, `ok` or `pending` (work the server is still doing). */
export function message(kind, text) {
  return h('div', { class: `message ${kind}`, role: kind === 'error' ? 'alert' : 'status' }, text);
}

/** Shows `text` in the page's status line (announced to screen readers). */
export function status(kind, text) {
  fill(document.getElementById('status'), text ? message(kind, text) : null);
}

/** An error as the page shows it: the status and CouchDB's reason. */
export function errorText(err) {
  if (err && err.status === 409) return `Conflict (409): ${err.body && err.body.reason ? err.body.reason : 'the document changed since it was opened'}. Reload it to see the current revision.`;
  return err && err.message ? err.message : String(err);
}

/**
 * Runs `action`, showing its error in the status line; answers its result or undefined. `pending`,
 * when given, is shown while the server works (creating a DynamoDB table can take a minute).
 */
export async function attempt(action, done, pending) {
  if (pending) status('pending', pending);
  try {
    const result = await action();
    if (done) status('ok', done);
    return result;
  } catch (err) {
    status('error', errorText(err));
    return undefined;
  }
}

/** Bytes as KiB/MiB. */
export function bytes(n) {
  if (typeof n !== 'number') return '';
  if (n < 1024) return `${n} B`;
  const units = ['KiB', 'MiB', 'GiB', 'TiB'];
  let value = n;
  let unit = -1;
  do { value /= 1024; unit += 1; } while (value >= 1024 && unit < units.length - 1);
  return `${value.toFixed(1)} ${units[unit]}`;
}

/** Pretty JSON. */
export const pretty = (value) => JSON.stringify(value, null, 2);

/** Parses JSON typed by the user, or throws an error that says where. */
export function parseJson(text, what) {
  try {
    return JSON.parse(text);
  } catch (err) {
    throw new Error(`${what} is not valid JSON: ${err.message}`);
  }
}

/** The tabs of a database's pages. */
export function dbTabs(db, current) {
  const base = `#/db/${encodeURIComponent(db)}`;
  const tabs = [
    ['docs', 'Documents', base],
    ['changes', 'Changes', `${base}/changes`],
    ['views', 'Design documents & views', `${base}/views`],
    ['mango', 'Mango', `${base}/mango`],
    ['settings', 'Permissions & settings', `${base}/settings`],
  ];
  return h('ul', { class: 'tabs', 'aria-label': 'Database pages' },
    tabs.map(([key, label, href]) => h('li', {}, h('a', { href, 'aria-current': key === current ? 'page' : null }, label))));
}

/** A heading naming the database, with its tabs. */
export function dbHeader(db, current) {
  return [h('h1', {}, h('a', { href: '#/databases' }, 'Databases'), ' / ', db), dbTabs(db, current)];
}
