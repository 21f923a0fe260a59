// A PouchDB live pull (`live: true, retry: true`) from the endpoint into a local in-memory PouchDB,
// running for as long as the test writes through a load balancer and kills one of its instances
// (tests/suites/balancer/kill_nine.rs). When the test closes this script's stdin it sends what
// every document must end at, as JSON `{id: rev}`; the script waits until the local database
// holds each at that revision, prints a summary and exits 0, or exits 1 naming what is missing.
//
// Environment: COUCH_URL (the balancer, with the admin's credentials), COUCH_DB.
// The retry back-off is PouchDB's `back_off_function` set as an application would for a
// replication that must resume quickly: 500 ms, doubling to at most 2 s.
'use strict';

const { env } = require('./common');
const { PouchDB, remoteDb } = require('./pouchdb-setup');

/** How long the local database may take to reach the expected revisions once they are known. */
const CATCH_UP_MS = 30000;

function readStdin() {
  return new Promise((resolve, reject) => {
    const chunks = [];
    process.stdin.on('data', (chunk) => chunks.push(chunk));
    process.stdin.on('end', () => resolve(Buffer.concat(chunks).toString('utf8')));
    process.stdin.on('error', reject);
  });
}

/** The ids of `expected` the local database does not hold at the expected revision. */
async function missing(local, expected) {
  const ids = Object.keys(expected);
  const rows = (await local.allDocs({ keys: ids })).rows;
  return rows.filter((row) => !row.value || row.value.rev !== expected[row.key]).map((row) => row.key);
}

async function main() {
  const local = new PouchDB(`live-${process.pid}`, { adapter: 'memory' });
  let pausedWithError = 0;
  let lastError = null;
  const replication = PouchDB.replicate(remoteDb(env('COUCH_URL'), env('COUCH_DB')), local, {
    live: true,
    retry: true,
    back_off_function: (delay) => (delay === 0 ? 500 : Math.min(delay * 2, 2000)),
  });
  replication.on('paused', (error) => {
    if (error) {
      pausedWithError += 1;
      lastError = String(error.message || error);
    }
  });
  const failed = new Promise((resolve) => {
    replication.on('error', (error) => resolve(`the live replication stopped: ${error.stack || error}`));
    replication.on('denied', (error) => resolve(`a document was denied: ${JSON.stringify(error)}`));
  });
  const expected = JSON.parse(await readStdin());
  const deadline = Date.now() + CATCH_UP_MS;
  let left = await missing(local, expected);
  while (left.length > 0 && Date.now() < deadline) {
    const outcome = await Promise.race([failed, new Promise((resolve) => setTimeout(() => resolve(null), 200))]);
    if (outcome) throw new Error(outcome);
    left = await missing(local, expected);
  }
  replication.cancel();
  if (left.length > 0) {
    throw new Error(`${left.length} of ${Object.keys(expected).length} documents not at their final revision ` +
      `after ${CATCH_UP_MS} ms (first: ${left.slice(0, 5).join(', ')}); last error: ${lastError}`);
  }
  process.stdout.write(`live sync: ${Object.keys(expected).length} documents at their final revision, ` +
    `${pausedWithError} pauses on an error (last: ${lastError})\n`);
}

main().then(
  () => process.exit(0),
  (error) => {
    process.stderr.write(`FAILED: ${error.stack || error}\n`);
    process.exit(1);
  },
);
