// The service: who answers (`GET /`), whether its backend answers (`GET /_up`), the bounds in
// force (`GET /_node/_local/_config`, admins only), request and backend-call rates and latencies
// over the last minutes (sampled from `GET /_node/_local/_prometheus`, admins only: the same
// counters as the REST listener's `/metrics`), and `GET /_active_tasks`, read again with each
// sample; a server admin starts a whole-deployment run here (`POST /_agentstore/runs`) and
// cancels one the service started (`DELETE /_agentstore/runs/{id}`).
import { get, post, del, call, enc } from '../api.js';
import { h, fill, table, field, errorText, message, attempt } from '../ui.js';

/** Seconds between two samples of the counters, and samples kept (ten minutes). */
const SAMPLE_SECONDS = 5;
const SAMPLES_KEPT = 120;

/** Samples survive moving between pages (not a reload): the chart keeps its minutes. */
const samples = [];
let sampler = null;

export async function render(main, { stale }) {
  const [welcome, up, tasks, config] = await Promise.all([
    get('/').catch((err) => err),
    call('GET', '/_up', { raw: true }).then((r) => r.json()).catch((err) => err),
    get('/_active_tasks').catch((err) => err),
    get('/_node/_local/_config').catch((err) => err),
  ]);
  const chart = h('div', { id: 'metrics-chart' }, h('p', { class: 'muted' }, 'Sampling…'));
  const tasksBox = h('div', { id: 'tasks-box' });
  const showTasks = (answer) => fill(tasksBox, answer instanceof Error ? message('error', errorText(answer)) : taskTable(answer, refreshTasks));
  const refreshTasks = async () => { if (!stale()) showTasks(await get('/_active_tasks').catch((err) => err)); };
  showTasks(tasks);
  fill(main, h('h1', {}, 'Service'),
    h('section', {}, h('h2', {}, 'Server and backend'), facts(welcome, up, config)),
    h('section', {}, h('h2', {}, 'Requests and backend calls'),
      h('p', { class: 'muted' }, `Sampled every ${SAMPLE_SECONDS} s while this page is open: per second, and the mean latency in each interval.`), chart),
    h('section', {}, h('h2', {}, 'Bounds in force'), bounds(config)),
    h('section', { id: 'active-tasks' }, h('h2', {}, 'Active tasks and migrations'),
      h('p', { class: 'muted' }, 'migrate, import and verify runs into this server’s backend, from the command line or started here, report here while they run and for an hour after; read again every few seconds.'),
      tasksBox),
    tasks instanceof Error ? null : runForm(refreshTasks));
  const draw = () => { if (!stale() && document.body.contains(chart)) drawChart(chart); };
  await sample();
  draw();
  if (sampler) clearInterval(sampler);
  sampler = setInterval(async () => {
    if (stale() || !document.body.contains(chart)) { clearInterval(sampler); sampler = null; return; }
    await sample();
    draw();
    await refreshTasks();
  }, SAMPLE_SECONDS * 1000);
}

/** The form starting a whole-deployment run in the service (server admins: it is shown when `_active_tasks` answered). */
function runForm(refreshTasks) {
  const command = h('select', { id: 'run-command' }, h('option', { value: 'migrate' }, 'migrate (copy every database)'), h('option', { value: 'verify' }, 'verify (compare every database)'));
  const source = h('input', { id: 'run-source', required: true, autocomplete: 'off', placeholder: 'http://user:password@host:5984/ or a backend URL' });
  const target = h('input', { id: 'run-target', required: true, autocomplete: 'off', placeholder: 'dynamodb://table?region=… or a server URL' });
  const dbs = h('input', { id: 'run-dbs', autocomplete: 'off', placeholder: 'all (or names and patterns, comma separated)' });
  const exclude = h('input', { id: 'run-exclude', autocomplete: 'off', placeholder: 'none' });
  const follow = h('input', { id: 'run-follow', type: 'checkbox' });
  const list = (input) => input.value.split(',').map((s) => s.trim()).filter(Boolean);
  const form = h('form', { class: 'stack', id: 'run-form', onsubmit: async (event) => {
    event.preventDefault();
    const body = { command: command.value, source: source.value.trim(), target: target.value.trim() };
    if (list(dbs).length) body.db = list(dbs);
    if (list(exclude).length) body.exclude = list(exclude);
    if (command.value === 'migrate' && follow.checked) body.follow = true;
    const answer = await attempt(() => post('/_agentstore/runs', body));
    if (answer && answer.id) {
      // The URLs may hold passwords: not left on the page once used.
      source.value = '';
      target.value = '';
      fill(document.getElementById('status'), message('ok', `Started ${body.command} run ${answer.id}; its progress is in the table above.`));
      await refreshTasks();
    }
  } },
  field('Command', command), field('Source', source), field('Target', target),
  field('Databases', dbs), field('Leave out', exclude),
  h('label', { class: 'check' }, follow, ' Follow the source’s changes until cancelled (migrate)'),
  h('button', { type: 'submit' }, 'Start the run'));
  return h('section', { id: 'start-run' }, h('h2', {}, 'Start a whole-deployment run'),
    h('p', { class: 'muted' }, 'Runs in this service with the code of agentstore migrate/verify --all-databases, one at a time for the deployment. The URLs are used, never shown again: tasks name the sides without their passwords.'),
    form);
}

const when = (seconds) => (seconds ? new Date(seconds * 1000).toISOString().replace('.000Z', 'Z') : '');

function eta(seconds) {
  if (seconds === null || seconds === undefined) return '';
  const m = Math.floor(seconds / 60);
  return m ? `${m} min ${seconds % 60} s` : `${seconds} s`;
}

/** A whole-deployment run's databases: done of selected, and those at work (`name done/of`). */
function databases(t) {
  if (t.databases_total === undefined) return '';
  const now = (t.databases_now || []).map((d) => `${d.name} ${d.done}/${d.of}`).join(', ');
  return `${t.databases_done} of ${t.databases_total}${now ? `; now ${now}` : ''}`;
}

/** What a task ended with beyond its state: its error, or what a comparison found. */
function outcome(t) {
  if (t.error) return t.error;
  if (t.passed === true) return t.command === 'verify' ? 'identical' : 'verified';
  if (t.passed === false) return 'differences found';
  return '';
}

function taskTable(tasks, refreshTasks) {
  return table(['Task', 'State', 'From → to', { label: 'Read', num: true }, { label: 'Progress', num: true },
    'Databases', { label: 'Rate (docs/s)', num: true }, 'ETA', 'Started', 'Updated', 'Outcome', ''], tasks.map((t) => [
    t.type === 'agentstore_migration'
      ? h('span', { 'data-run-id': t.run_id }, `${t.command}${t.origin === 'service' ? ' (service)' : ''}`)
      : t.type,
    h('span', { class: `task-state ${t.state || ''}` }, t.phase === 'following' && t.state === 'running' ? 'running (following changes)' : (t.state || '')),
    t.source ? `${t.source} → ${t.target}` : (t.database || ''),
    t.total_changes ? `${t.changes_done} of ~${t.total_changes}` : String(t.changes_done ?? ''),
    t.progress === null || t.progress === undefined ? '' : `${t.progress}%`,
    databases(t), t.rate ?? '', eta(t.eta_secs), when(t.started_on), when(t.updated_on), outcome(t),
    t.origin === 'service' && t.state === 'running'
      ? h('button', { type: 'button', class: 'danger', 'data-run': t.run_id, onclick: async () => {
        if (!window.confirm(`Cancel run ${t.run_id}?`)) return;
        await attempt(() => del(`/_agentstore/runs/${enc(t.run_id)}`), `Asked run ${t.run_id} to stop.`);
        await refreshTasks();
      } }, 'Cancel')
      : '',
  ]));
}

function facts(welcome, up, config) {
  if (welcome instanceof Error) return message('error', errorText(welcome));
  const vendor = welcome.vendor || {};
  return h('dl', { class: 'facts', id: 'service-facts' },
    h('dt', {}, 'Server'), h('dd', {}, `${vendor.name || 'CouchDB'} ${vendor.version || ''}`),
    h('dt', {}, 'CouchDB API version'), h('dd', {}, welcome.version),
    h('dt', {}, 'Backend'), h('dd', { id: 'service-backend' }, config instanceof Error ? 'shown to server admins' : config.backend.describe),
    h('dt', {}, 'Data-store database'), h('dd', {}, config instanceof Error ? '' : config.backend.database),
    h('dt', {}, 'Health (/_up)'), h('dd', { id: 'service-health' }, up instanceof Error ? `not ready: ${errorText(up)}` : up.status),
    h('dt', {}, 'Server uuid'), h('dd', {}, welcome.uuid));
}

function bounds(config) {
  if (config instanceof Error) return message('error', `The bounds are shown to server admins (${errorText(config)}).`);
  const rows = [];
  for (const [section, values] of Object.entries(config)) {
    if (section === 'backend') continue;
    for (const [name, value] of Object.entries(values)) rows.push([section, h('code', {}, name), h('code', {}, String(value))]);
  }
  return table(['Section', 'Setting', 'Value'], rows, 'Every number the server was started with; docs/bounds.md says what each bounds.');
}

/** Sums of the counters that matter, from Prometheus' text format. */
function summarize(text) {
  const sums = { requests: 0, requestSeconds: 0, calls: 0, callSeconds: 0 };
  for (const line of text.split('\n')) {
    if (!line || line.startsWith('#')) continue;
    const space = line.lastIndexOf(' ');
    const name = line.slice(0, line.indexOf('{') >= 0 ? line.indexOf('{') : space);
    const value = Number(line.slice(space + 1));
    if (!Number.isFinite(value)) continue;
    if (name === 'agentstore_http_requests_total') sums.requests += value;
    else if (name === 'agentstore_http_request_duration_seconds_sum') sums.requestSeconds += value;
    else if (name === 'agentstore_backend_call_duration_seconds_count') sums.calls += value;
    else if (name === 'agentstore_backend_call_duration_seconds_sum') sums.callSeconds += value;
  }
  return sums;
}

async function sample() {
  try {
    const response = await call('GET', '/_node/_local/_prometheus', { raw: true });
    samples.push({ at: Date.now(), ...summarize(await response.text()) });
    if (samples.length > SAMPLES_KEPT) samples.shift();
  } catch (err) {
    samples.error = errorText(err);
  }
}

/** Per-interval rates and mean latencies between consecutive samples. */
function intervals() {
  const out = [];
  for (let i = 1; i < samples.length; i += 1) {
    const [a, b] = [samples[i - 1], samples[i]];
    const seconds = (b.at - a.at) / 1000;
    if (seconds <= 0) continue;
    const requests = b.requests - a.requests;
    const calls = b.calls - a.calls;
    out.push({
      at: b.at,
      requestRate: requests / seconds,
      requestMs: requests > 0 ? ((b.requestSeconds - a.requestSeconds) / requests) * 1000 : 0,
      callRate: calls / seconds,
      callMs: calls > 0 ? ((b.callSeconds - a.callSeconds) / calls) * 1000 : 0,
    });
  }
  return out;
}

function drawChart(box) {
  if (samples.error && !samples.length) { fill(box, message('error', `No metrics: ${samples.error}`)); return; }
  const points = intervals();
  if (!points.length) { fill(box, h('p', { class: 'muted' }, `First sample taken; the chart starts ${SAMPLE_SECONDS} s from now.`)); return; }
  const last = points[points.length - 1];
  fill(box,
    svgChart(points, 'callRate', 'callMs', 'Backend calls'),
    svgChart(points, 'requestRate', 'requestMs', 'REST requests'),
    h('p', { id: 'metrics-latest' }, `Last ${SAMPLE_SECONDS} s: ${last.callRate.toFixed(1)} backend calls/s (mean ${last.callMs.toFixed(2)} ms), `
      + `${last.requestRate.toFixed(1)} REST requests/s (mean ${last.requestMs.toFixed(2)} ms).`));
}

const SVG = 'http://www.w3.org/2000/svg';

function svgChart(points, rateKey, msKey, title) {
  const width = 600;
  const height = 120;
  const maxRate = Math.max(1, ...points.map((p) => p[rateKey]));
  const maxMs = Math.max(1, ...points.map((p) => p[msKey]));
  const x = (i) => (points.length === 1 ? width : (i / (points.length - 1)) * width);
  const line = (key, max, cls) => {
    const el = document.createElementNS(SVG, 'polyline');
    el.setAttribute('class', cls);
    el.setAttribute('points', points.map((p, i) => `${x(i).toFixed(1)},${(height - (p[key] / max) * (height - 10)).toFixed(1)}`).join(' '));
    return el;
  };
  const svg = document.createElementNS(SVG, 'svg');
  svg.setAttribute('viewBox', `0 0 ${width} ${height}`);
  svg.setAttribute('class', 'chart');
  svg.setAttribute('role', 'img');
  svg.setAttribute('aria-label', `${title}: up to ${maxRate.toFixed(1)} per second, latency up to ${maxMs.toFixed(1)} ms`);
  svg.append(line(rateKey, maxRate, 'rate'), line(msKey, maxMs, 'latency'));
  return h('figure', {}, h('figcaption', {}, title), svg,
    h('div', { class: 'legend' }, h('span', { class: 'rate' }, `per second (top ${maxRate.toFixed(1)})`), h('span', { class: 'latency' }, `mean ms (top ${maxMs.toFixed(1)})`)));
}
