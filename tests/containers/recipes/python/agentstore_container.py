"""Run agentstore in a throwaway container for integration tests (testcontainers-python).

Copy `start_agentstore` (or the `agentstore` context manager) into your test helpers:

    with agentstore(tokens={"alice": "alice-token"}) as base_url:
        ...  # talk HTTP to base_url, e.g. http://localhost:32768

The image is taken from the `image` argument, else from $AGENTSTORE_IMAGE, else
"agentstore:latest" (what `docker build -t agentstore .` in the repository produces).

Run as a script, the file checks itself against a real container and exits non-zero on any
failure:

    TESTCONTAINERS_RYUK_DISABLED=true AGENTSTORE_IMAGE=agentstore:latest \
        python agentstore_container.py
"""

import hashlib
import json
import os
import sys
import urllib.error
import urllib.request
from contextlib import contextmanager

from testcontainers.core.container import DockerContainer
from testcontainers.core.wait_strategies import HttpWaitStrategy

DEFAULT_IMAGE = "agentstore:latest"
SERVICE_PORT = 8080  # the port agentstore listens on inside the container


def tokens_setting(tokens):
    """AGENTSTORE_TOKENS for plain tokens: {"alice": "tok1", "*": "admin"} -> "alice:<sha256>,*:<sha256>".

    The service keeps only SHA-256 hashes; "*" is the admin scope.
    """
    return ",".join(
        f"{user}:{hashlib.sha256(token.encode()).hexdigest()}" for user, token in tokens.items()
    )


def start_agentstore(image=None, tokens=None, startup_timeout=60):
    """Start agentstore (embedded store) and wait until GET /readyz answers 200.

    tokens: {user_or_"*": plain_token}; without tokens the service runs unauthenticated.
    Returns (container, base_url). The caller must call container.stop() (it removes the container
    and its volume); on a failed start the container is removed here.
    """
    image = image or os.environ.get("AGENTSTORE_IMAGE") or DEFAULT_IMAGE
    container = DockerContainer(image).with_exposed_ports(SERVICE_PORT)
    if tokens:
        container.with_env("AGENTSTORE_TOKENS", tokens_setting(tokens))
    else:
        # Without tokens the service refuses to listen on a non-loopback address unless told to.
        container.with_env("AGENTSTORE_ALLOW_UNAUTHENTICATED", "true")
    container.waiting_for(
        HttpWaitStrategy(SERVICE_PORT, "/readyz").with_startup_timeout(startup_timeout)
    )
    try:
        container.start()
        host = container.get_container_host_ip()
        port = container.get_exposed_port(SERVICE_PORT)
    except BaseException:
        container.stop()
        raise
    return container, f"http://{host}:{port}"


@contextmanager
def agentstore(image=None, tokens=None, startup_timeout=60):
    """`with agentstore(...) as base_url:` starts the container and always removes it afterwards."""
    container, base_url = start_agentstore(image, tokens, startup_timeout)
    try:
        yield base_url
    finally:
        container.stop()


def call(method, url, body=None, token=None):
    """One JSON request with the standard library; returns (status, parsed JSON body or None)."""
    headers = {"Accept": "application/json"}
    data = None
    if body is not None:
        data = json.dumps(body).encode()
        headers["Content-Type"] = "application/json"
    if token is not None:
        headers["Authorization"] = f"Bearer {token}"
    request = urllib.request.Request(url, data=data, headers=headers, method=method)
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            status, raw = response.status, response.read()
    except urllib.error.HTTPError as error:
        status, raw = error.code, error.read()
    return status, (json.loads(raw) if raw else None)


# ---- the project's own checks (python agentstore_container.py) ----------------------------------

# Strings, unicode, nesting, an integer past 2**64, a fraction, null and booleans next to numbers.
SAMPLE_VALUE = {
    "text": "h\u00e9llo \u2713",
    "list": [1, 2.5, -3, None, True, False, "1"],
    "nested": {"big": 12345678901234567890, "empty": {}},
}


def canonical(value):
    """JSON text that tells true from 1 and 1.0 from 1, unlike == on Python values."""
    return json.dumps(value, sort_keys=True, ensure_ascii=False)


def expect(condition, message):
    if not condition:
        raise AssertionError(message)


def doc_url(base_url, user, key):
    return f"{base_url}/v1/users/{user}/namespaces/recipe/keys/{key}"


def check_default_start(image):
    with agentstore(image) as base_url:
        url = doc_url(base_url, "alice", "round-trip")
        status, body = call("PUT", url, {"value": SAMPLE_VALUE, "metadata": {"source": "recipe"}})
        expect(status == 200, f"PUT answered {status}: {body}")
        status, body = call("GET", url)
        expect(status == 200, f"GET answered {status}: {body}")
        expect(
            canonical(body["value"]) == canonical(SAMPLE_VALUE),
            f"value did not round-trip: sent {canonical(SAMPLE_VALUE)}, got {canonical(body['value'])}",
        )
        expect((body.get("metadata") or {}).get("source") == "recipe", f"metadata lost: {body}")
        return base_url


def check_tokens(image):
    tokens = {"alice": "alice-token", "*": "admin-token"}
    with agentstore(image, tokens=tokens) as base_url:
        url = doc_url(base_url, "alice", "with-token")
        status, body = call("PUT", url, {"value": 1})
        expect(status == 401, f"PUT without a token answered {status}, not 401: {body}")
        status, body = call("GET", url, token="not-a-configured-token")
        expect(status == 401, f"GET with a wrong token answered {status}, not 401: {body}")
        status, body = call("PUT", url, {"value": {"n": 1}}, token=tokens["alice"])
        expect(status == 200, f"PUT with alice's token answered {status}: {body}")
        status, body = call("GET", url, token=tokens["alice"])
        expect(status == 200 and body["value"] == {"n": 1}, f"GET with alice's token: {status} {body}")
        status, body = call("GET", url, token=tokens["*"])
        expect(status == 200 and body["value"] == {"n": 1}, f"GET with the admin token: {status} {body}")
        return base_url


def loopback_problem():
    """Why the checks would not talk to loopback, or None.

    On a machine that is itself a container, testcontainers may pick a container-network address
    (ConnectionMode gateway_ip/bridge_ip). The checks only ever talk to localhost; where the engine
    publishes ports on this machine's loopback, set TESTCONTAINERS_CONNECTION_MODE=docker_host.
    """
    from testcontainers.core.config import ConnectionMode
    from testcontainers.core.docker_client import DockerClient

    client = DockerClient()
    mode, host = client.get_connection_mode(), client.host()
    client.client.close()
    if mode is ConnectionMode.docker_host and host in ("localhost", "127.0.0.1", "::1"):
        return None
    return (
        f"testcontainers would connect through {mode.value} (docker host {host}), not loopback; "
        "set TESTCONTAINERS_CONNECTION_MODE=docker_host where the engine publishes ports on localhost"
    )


def main():
    image = os.environ.get("AGENTSTORE_IMAGE") or DEFAULT_IMAGE
    problem = loopback_problem()
    if problem:
        print(f"python recipe: {problem}")
        return 1
    failures = 0
    for name, check in (("default start", check_default_start), ("bearer tokens", check_tokens)):
        try:
            base_url = check(image)
        except Exception as error:  # report every check, then fail
            failures += 1
            print(f"python recipe: {name} ... FAILED: {type(error).__name__}: {error}")
            for note in getattr(error, "__notes__", []):  # e.g. the container's log on a timeout
                print(f"  {note.strip()}")
        else:
            print(f"python recipe: {name} ... ok (image {image}, {base_url})")
        sys.stdout.flush()
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
