// Run agentstore in a throwaway container for integration tests (npm testcontainers, Node 20+).
//
// Copy `startAgentstore` into your test helpers:
//
//   const { container, baseUrl } = await startAgentstore({ tokens: { alice: "alice-token" } });
//   try { /* fetch(`${baseUrl}/v1/users/alice/...`) */ } finally { await container.stop(); }
//
// The image is taken from `image`, else from $AGENTSTORE_IMAGE, else "agentstore:latest" (what
// `docker build -t agentstore .` in the repository produces).
//
// Run as a script, the file checks itself against a real container and exits non-zero on any
// failure:
//
//   TESTCONTAINERS_RYUK_DISABLED=true AGENTSTORE_IMAGE=agentstore:latest \
//     node agentstore-container.mjs

import { createHash } from "node:crypto";
import { pathToFileURL } from "node:url";
import { GenericContainer, Wait, getContainerRuntimeClient } from "testcontainers";

export const DEFAULT_IMAGE = "agentstore:latest";
const SERVICE_PORT = 8080; // the port agentstore listens on inside the container

// AGENTSTORE_TOKENS for plain tokens: { alice: "tok1", "*": "admin" } -> "alice:<sha256>,*:<sha256>".
// The service keeps only SHA-256 hashes; "*" is the admin scope.
export function tokensSetting(tokens) {
  return Object.entries(tokens)
    .map(([user, token]) => `${user}:${createHash("sha256").update(token).digest("hex")}`)
    .join(",");
}

// Start agentstore (embedded store) and wait until GET /readyz answers 200.
// tokens: { userOrStar: plainToken }; without tokens the service runs unauthenticated.
// Resolves to { container, baseUrl }; the caller must `await container.stop()` (it removes the
// container and its volume). A container that fails to become ready is removed by testcontainers.
export async function startAgentstore({ image, tokens, startupTimeoutMs = 60_000 } = {}) {
  const environment = tokens
    ? { AGENTSTORE_TOKENS: tokensSetting(tokens) }
    : // Without tokens the service refuses to listen on a non-loopback address unless told to.
      { AGENTSTORE_ALLOW_UNAUTHENTICATED: "true" };
  const container = await new GenericContainer(image || process.env.AGENTSTORE_IMAGE || DEFAULT_IMAGE)
    .withExposedPorts(SERVICE_PORT)
    .withEnvironment(environment)
    .withWaitStrategy(Wait.forHttp("/readyz", SERVICE_PORT, { abortOnContainerExit: true }).forStatusCode(200))
    .withStartupTimeout(startupTimeoutMs)
    .start();
  return { container, baseUrl: `http://${container.getHost()}:${container.getMappedPort(SERVICE_PORT)}` };
}

// One JSON request with Node's global fetch; resolves to { status, body } (body parsed, or null).
export async function call(method, url, { body, token } = {}) {
  const headers = { accept: "application/json" };
  if (body !== undefined) headers["content-type"] = "application/json";
  if (token !== undefined) headers.authorization = `Bearer ${token}`;
  const response = await fetch(url, {
    method,
    headers,
    body: body === undefined ? undefined : JSON.stringify(body),
    signal: AbortSignal.timeout(10_000),
  });
  const text = await response.text();
  return { status: response.status, body: text ? JSON.parse(text) : null };
}

// ---- the project's own checks (node agentstore-container.mjs) ------------------------------------

// Strings, unicode, nesting, a fraction, null and booleans next to numbers. (JSON.parse turns
// integers past 2**53 into doubles, so the Node check keeps to numbers it can read exactly.)
const SAMPLE_VALUE = {
  text: "h\u00e9llo \u2713",
  list: [1, 2.5, -3, null, true, false, "1"],
  nested: { big: 9007199254740991, empty: {} },
};

// JSON text with keys sorted at every level, so that two values compare by content.
function canonical(value) {
  if (Array.isArray(value)) return `[${value.map(canonical).join(",")}]`;
  if (value !== null && typeof value === "object") {
    const keys = Object.keys(value).sort();
    return `{${keys.map((key) => `${JSON.stringify(key)}:${canonical(value[key])}`).join(",")}}`;
  }
  return JSON.stringify(value);
}

function expect(condition, message) {
  if (!condition) throw new Error(message);
}

const docUrl = (baseUrl, user, key) => `${baseUrl}/v1/users/${user}/namespaces/recipe/keys/${key}`;

async function withAgentstore(options, check) {
  const { container, baseUrl } = await startAgentstore(options);
  try {
    await check(baseUrl);
    return baseUrl;
  } finally {
    await container.stop();
  }
}

async function checkDefaultStart(image) {
  return withAgentstore({ image }, async (baseUrl) => {
    const url = docUrl(baseUrl, "alice", "round-trip");
    let r = await call("PUT", url, { body: { value: SAMPLE_VALUE, metadata: { source: "recipe" } } });
    expect(r.status === 200, `PUT answered ${r.status}: ${JSON.stringify(r.body)}`);
    r = await call("GET", url);
    expect(r.status === 200, `GET answered ${r.status}: ${JSON.stringify(r.body)}`);
    expect(
      canonical(r.body.value) === canonical(SAMPLE_VALUE),
      `value did not round-trip: sent ${canonical(SAMPLE_VALUE)}, got ${canonical(r.body.value)}`,
    );
    expect(r.body.metadata?.source === "recipe", `metadata lost: ${JSON.stringify(r.body)}`);
  });
}

async function checkTokens(image) {
  const tokens = { alice: "alice-token", "*": "admin-token" };
  return withAgentstore({ image, tokens }, async (baseUrl) => {
    const url = docUrl(baseUrl, "alice", "with-token");
    let r = await call("PUT", url, { body: { value: 1 } });
    expect(r.status === 401, `PUT without a token answered ${r.status}, not 401: ${JSON.stringify(r.body)}`);
    r = await call("GET", url, { token: "not-a-configured-token" });
    expect(r.status === 401, `GET with a wrong token answered ${r.status}, not 401: ${JSON.stringify(r.body)}`);
    r = await call("PUT", url, { body: { value: { n: 1 } }, token: tokens.alice });
    expect(r.status === 200, `PUT with alice's token answered ${r.status}: ${JSON.stringify(r.body)}`);
    r = await call("GET", url, { token: tokens.alice });
    expect(r.status === 200 && r.body.value?.n === 1, `GET with alice's token: ${r.status} ${JSON.stringify(r.body)}`);
    r = await call("GET", url, { token: tokens["*"] });
    expect(r.status === 200 && r.body.value?.n === 1, `GET with the admin token: ${r.status} ${JSON.stringify(r.body)}`);
  });
}

// On a machine that is itself a container (it has /.dockerenv), testcontainers takes the Docker
// bridge's gateway as the host. The checks only ever talk to localhost; where the engine publishes
// ports on this machine's loopback, set TESTCONTAINERS_HOST_OVERRIDE=localhost.
async function loopbackProblem() {
  const { host } = (await getContainerRuntimeClient()).info.containerRuntime;
  if (["localhost", "127.0.0.1", "::1"].includes(host)) return null;
  return `testcontainers would connect to ${host}, not loopback; set TESTCONTAINERS_HOST_OVERRIDE=localhost where the engine publishes ports on localhost`;
}

async function main() {
  const image = process.env.AGENTSTORE_IMAGE || DEFAULT_IMAGE;
  const problem = await loopbackProblem();
  if (problem) {
    console.log(`node recipe: ${problem}`);
    return 1;
  }
  let failures = 0;
  for (const [name, check] of [
    ["default start", checkDefaultStart],
    ["bearer tokens", checkTokens],
  ]) {
    try {
      const baseUrl = await check(image);
      console.log(`node recipe: ${name} ... ok (image ${image}, ${baseUrl})`);
    } catch (error) {
      failures += 1;
      console.log(`node recipe: ${name} ... FAILED: ${error?.stack ?? error}`);
    }
  }
  return failures ? 1 : 0;
}

if (import.meta.url === pathToFileURL(process.argv[1]).href) {
  process.exitCode = await main();
}
