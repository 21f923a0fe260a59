#!/usr/bin/env bash
# The seed's own curl commands (shared/seeds/data-store-schema.current.txt, "Indexes"): recreate
# the idx-user-namespace Mango index with POST /{db}/_index, then list the indexes with GET
# /{db}/_index, as the seed writes them (credentials in the URL). Each answer is checked with
# python3: status, Content-Type, and the body's fields as CouchDB 3.4.3 answers them. Then a
# _find by userId and namespace, which that index serves, finds a document written with curl.
set -euo pipefail

: "${COUCH_URL:?COUCH_URL is not set}" "${COUCH_DB:?COUCH_DB is not set}" "${COUCH_USER_ID:?COUCH_USER_ID is not set}"
db_url="${COUCH_URL%/}/${COUCH_DB}"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT

fail() {
  echo "FAILED: $*" >&2
  exit 1
}

# request NAME METHOD URL [BODY]: the answer's headers in $work/NAME.headers, body in $work/NAME.json.
request() {
  local name="$1" method="$2" url="$3"
  local args=(-sS -X "$method" "$url" -D "$work/$name.headers" -o "$work/$name.json")
  if [ $# -ge 4 ]; then args+=(-H "Content-Type: application/json" -d "$4"); fi
  curl "${args[@]}" || fail "$name: curl $method failed"
}

# check NAME STATUS PYTHON-EXPRESSION: the answer has STATUS, Content-Type application/json (pouchdb-
# server answers text/plain: printed as a known difference there), and PYTHON-EXPRESSION (over the
# parsed body `b`) is true.
check() {
  local name="$1" status="$2" expression="$3"
  python3 - "$work/$name.headers" "$work/$name.json" "$status" "$expression" "$name" <<'EOF' || exit 1
import json, os, sys
headers_file, body_file, status, expression, name = sys.argv[1:]
lines = open(headers_file).read().splitlines()
got_status = lines[0].split()[1]
headers = {k.strip().lower(): v.strip() for k, v in (l.split(":", 1) for l in lines[1:] if ":" in l)}
body = open(body_file).read()
problems = []
if got_status != status:
    problems.append(f"status {got_status}, expected {status}")
if not headers.get("content-type", "").startswith("application/json"):
    if os.environ.get("COUCH_TARGET") == "pouchdb-server":
        print(f"pouchdb-server differs from CouchDB: {name}: Content-Type {headers.get('content-type')!r}")
    else:
        problems.append(f"Content-Type {headers.get('content-type')!r}, expected application/json")
try:
    b = json.loads(body)
    if not eval(expression, {}, {"b": b}):
        problems.append(f"expected {expression}")
except ValueError as error:
    problems.append(f"body is not JSON ({error})")
except (KeyError, IndexError, TypeError) as error:
    problems.append(f"expected {expression} ({type(error).__name__}: {error})")
if problems:
    sys.stderr.write(f"FAILED: {name}: {'; '.join(problems)}; body: {body[:600]}\n")
    sys.exit(1)
print(f"ok: {name}")
EOF
}

index='{
    "index": { "fields": ["userId", "namespace"] },
    "name": "idx-user-namespace",
    "type": "json"
  }'

request index-create POST "$db_url/_index" "$index"
check index-create 200 "b['name'] == 'idx-user-namespace' and b['result'] in ('created', 'exists') and b['id'].startswith('_design/')"

request index-create-again POST "$db_url/_index" "$index"
check index-create-again 200 "b['result'] == 'exists' and b['name'] == 'idx-user-namespace'"

request index-list GET "$db_url/_index"
check index-list 200 "b['total_rows'] == len(b['indexes']) and b['indexes'][0]['name'] == '_all_docs' and \
  [i['def']['fields'] for i in b['indexes'] if i['name'] == 'idx-user-namespace'] == [[{'userId': 'asc'}, {'namespace': 'asc'}]]"

# A document written with curl, found through the index's fields.
key_b64="$(printf '%s' 'src/main.py' | base64 | tr '+/' '-_')"
doc_id="${COUCH_USER_ID}:files:my-repo:${key_b64}"
request put PUT "$db_url/$(python3 -c 'import sys, urllib.parse; print(urllib.parse.quote(sys.argv[1], safe=""))' "$doc_id")" \
  "{\"userId\": \"${COUCH_USER_ID}\", \"namespace\": \"files:my-repo\", \"key\": \"src/main.py\", \"value\": {\"lines\": 2},
    \"createdAt\": \"2026-02-05T09:00:00Z\", \"updatedAt\": \"2026-02-05T09:00:00Z\"}"
check put 201 "b['ok'] is True and b['id'] == '$doc_id'"

request find POST "$db_url/_find" "{\"selector\": {\"userId\": \"${COUCH_USER_ID}\", \"namespace\": \"files:my-repo\"}, \"fields\": [\"key\"]}"
check find 200 "b['docs'] == [{'key': 'src/main.py'}]"

echo "seed curl commands: all steps passed"
