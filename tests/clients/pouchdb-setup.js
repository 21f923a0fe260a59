// PouchDB assembled from its modules (the `pouchdb` package would pull in a native LevelDB
// build): the HTTP adapter for the endpoint, the memory adapter for a local database,
// replication and pouchdb-find.
'use strict';

const PouchDB = require('pouchdb-core')
  .plugin(require('pouchdb-adapter-http'))
  .plugin(require('pouchdb-adapter-memory'))
  .plugin(require('pouchdb-replication'))
  .plugin(require('pouchdb-find'));
const { env } = require('./common');

/** The endpoint's database through the HTTP adapter, credentials from COUCH_URL. */
function remoteDb(serverUrl = env('COUCH_URL'), db = env('COUCH_DB')) {
  const url = new URL(serverUrl);
  const auth = { username: decodeURIComponent(url.username), password: decodeURIComponent(url.password) };
  url.username = '';
  url.password = '';
  return new PouchDB(`${url.toString().replace(/\/$/, '')}/${encodeURIComponent(db)}`, { auth });
}

module.exports = { PouchDB, remoteDb };
