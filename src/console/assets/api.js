// The console's one way to the server: the CouchDB API on this same origin, with the session
// cookie `POST /_session` set (fetch sends it: same origin). No other endpoint is used.

/** A refused or failed call: the HTTP status and CouchDB's `{error, reason}`. */
export class ApiError extends Error {
  constructor(status, body, path) {
    const what = body && typeof body === 'object' ? `${body.error || 'error'}: ${body.reason || ''}` : String(body);
    super(`${status} ${what}`.trim());
    this.status = status;
    this.body = body;
    this.path = path;
  }
}

/** A path segment, encoded (database names may hold `/`, `+`, `$`, `(`…). */
export const enc = (segment) => encodeURIComponent(segment);

/** `/{db}`. */
export const dbPath = (db) => `/${enc(db)}`;

/** `/{db}/{id}`: a design document's `_design/` stays a path segment, as CouchDB expects. */
export function docPath(db, id) {
  if (id.startsWith('_design/')) return `${dbPath(db)}/_design/${enc(id.slice(8))}`;
  if (id.startsWith('_local/')) return `${dbPath(db)}/_local/${enc(id.slice(7))}`;
  return `${dbPath(db)}/${enc(id)}`;
}

/** A query string from an object; values that are not strings are sent as JSON (CouchDB's keys). */
export function query(params) {
  const parts = [];
  for (const [name, value] of Object.entries(params || {})) {
    if (value === undefined || value === null || value === '') continue;
    const text = typeof value === 'string' ? value : JSON.stringify(value);
    parts.push(`${enc(name)}=${enc(text)}`);
  }
  return parts.length ? `?${parts.join('&')}` : '';
}

/**
 * One call. `body` is sent as JSON unless it is a Blob/File (sent as is, with `contentType`).
 * Answers the parsed JSON body; throws {@link ApiError} on any status but 2xx.
 */
export async function call(method, path, { body, params, contentType, raw } = {}) {
  const headers = { Accept: 'application/json' };
  let payload;
  if (body instanceof Blob) {
    payload = body;
    headers['Content-Type'] = contentType || body.type || 'application/octet-stream';
  } else if (body !== undefined) {
    payload = JSON.stringify(body);
    headers['Content-Type'] = 'application/json';
  }
  const url = path + query(params);
  const response = await fetch(url, { method, headers, body: payload, credentials: 'same-origin' });
  if (raw) {
    if (!response.ok) throw new ApiError(response.status, await parsed(response), url);
    return response;
  }
  const answer = await parsed(response);
  if (!response.ok) throw new ApiError(response.status, answer, url);
  return answer;
}

async function parsed(response) {
  const text = await response.text();
  if (!text) return null;
  try {
    return JSON.parse(text);
  } catch {
    return text;
  }
}

export const get = (path, params) => call('GET', path, { params });
export const put = (path, body, params) => call('PUT', path, { body, params });
export const post = (path, body, params) => call('POST', path, { body, params });
export const del = (path, params) => call('DELETE', path, { params });

/** `GET /_session`'s `userCtx`. */
export async function session() {
  const answer = await get('/_session');
  return answer.userCtx || { name: null, roles: [] };
}

export const isAdmin = (user) => Array.isArray(user.roles) && user.roles.includes('_admin');
