"""The console at /_utils in a real browser (Debian's chromium through chromium-driver, headless).

Run by tests/suites/console/ against an `agentstore serve` it started; can be run by hand:

    target/console-venv/bin/python tests/console/walkthrough.py \
        --couchdb http://127.0.0.1:5984 --rest http://127.0.0.1:8080 --admin admin --password pw \
        [--screenshots docs/console]

Each step is done in the page, as a person would (typing, clicking, the keyboard for the login),
then checked twice: in the page (what it shows) and through the API (what the server holds), so a
page that shows success without doing it fails. Screenshots of every page go to --screenshots.
Exits 0 when every step passed; otherwise prints the step that failed and exits 1.
"""

import argparse
import base64
import json
import os
import signal
import sys
import tempfile
import time
import urllib.error
import urllib.request

from selenium import webdriver
from selenium.common.exceptions import StaleElementReferenceException, TimeoutException
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By
from selenium.webdriver.common.keys import Keys
from selenium.webdriver.support import expected_conditions as EC
from selenium.webdriver.support.ui import WebDriverWait

DB = "console_walk"
# How long the page has to react to a click or a key.
WAIT_SECONDS = 20
# How long the server may take over work the page shows as pending: creating a database is a
# table creation on DynamoDB and Firestore, which a loaded test server (dynalite shared by a whole
# suite) or a real cloud can take tens of seconds over.
SERVER_WORK_SECONDS = 90
CHROMIUM_FLAGS = [
    # What this machine's headless chromium needs (the machine notes): no sandbox as root, no
    # GPU, and none of the background connections a closed network refuses.
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--disable-dev-shm-usage",
    "--window-size=1280,900",
]


class Api:
    """The server as any client sees it: the CouchDB API with Basic auth, and the REST API."""

    def __init__(self, couchdb, rest, admin, password):
        self.couchdb = couchdb.rstrip("/")
        self.rest = rest.rstrip("/")
        self.auth = "Basic " + base64.b64encode(f"{admin}:{password}".encode()).decode()

    def call(self, method, path, body=None, base=None, raw=False, headers=None):
        data = None
        sent = {"Authorization": self.auth, "Accept": "application/json"}
        if body is not None:
            data = json.dumps(body).encode()
            sent["Content-Type"] = "application/json"
        sent.update(headers or {})
        request = urllib.request.Request((base or self.couchdb) + path, data=data, method=method, headers=sent)
        try:
            with urllib.request.urlopen(request, timeout=30) as response:
                payload = response.read()
                return response.status, payload if raw else (json.loads(payload) if payload else None)
        except urllib.error.HTTPError as err:
            payload = err.read()
            try:
                return err.code, json.loads(payload)
            except ValueError:
                return err.code, payload

    def ok(self, method, path, body=None, **kw):
        status, answer = self.call(method, path, body, **kw)
        if status // 100 != 2:
            raise AssertionError(f"{method} {path} answered {status}: {answer!r}")
        return answer


class Walk:
    def __init__(self, args):
        self.args = args
        self.api = Api(args.couchdb, args.rest, args.admin, args.password)
        self.downloads = tempfile.mkdtemp(prefix="console-downloads-")
        options = webdriver.ChromeOptions()
        options.binary_location = args.chromium
        for flag in CHROMIUM_FLAGS:
            options.add_argument(flag)
        options.add_argument(f"--user-data-dir={tempfile.mkdtemp(prefix='console-chromium-')}")
        options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
        self.driver = webdriver.Chrome(options=options, service=Service(executable_path=args.chromedriver))
        self.driver.execute_cdp_cmd("Browser.setDownloadBehavior", {"behavior": "allow", "downloadPath": self.downloads})
        self.wait = WebDriverWait(self.driver, WAIT_SECONDS)
        self.step_name = "start"

    # ---- helpers ----

    def step(self, name):
        self.step_name = name
        print(f"console walkthrough: {name}", flush=True)

    def url(self, hash_path=""):
        return f"{self.api.couchdb}/_utils/{hash_path}"

    def go(self, hash_path):
        """Shows the page of an address, fresh: the same address again is a reload."""
        target = self.url(hash_path)
        self.driver.execute_script("document.getElementById('main')?.removeAttribute('data-ready')")
        if self.driver.current_url == target:
            self.driver.refresh()
        else:
            self.driver.get(target)
        self.ready()

    def ready(self):
        self.wait.until(lambda d: d.find_element(By.ID, "main").get_attribute("data-ready"))

    def find(self, css):
        return self.wait.until(EC.presence_of_element_located((By.CSS_SELECTOR, css)))

    def click(self, css):
        element = self.wait.until(EC.element_to_be_clickable((By.CSS_SELECTOR, css)))
        element.click()
        return element

    def type_into(self, css, text):
        element = self.find(css)
        element.clear()
        element.send_keys(text)
        return element

    def set_value(self, css, text):
        """Replaces a textarea's text (send_keys would type JSON one key at a time, slowly)."""
        element = self.find(css)
        self.driver.execute_script(
            "arguments[0].value = arguments[1]; arguments[0].dispatchEvent(new Event('input'));", element, text
        )
        return element

    def text_appears(self, css, text, seconds=WAIT_SECONDS):
        try:
            WebDriverWait(self.driver, seconds).until(EC.text_to_be_present_in_element((By.CSS_SELECTOR, css), text))
        except TimeoutException:
            shown = [e.text for e in self.driver.find_elements(By.CSS_SELECTOR, css)]
            raise AssertionError(f"{css} never showed {text!r}; it shows {shown!r}") from None

    def status_says(self, text, seconds=WAIT_SECONDS):
        self.text_appears("#status", text, seconds)

    def server_work_says(self, text):
        """Server work the page started: the page reacts at once (it shows the work pending, or
        already done when the server was quick), and the server has SERVER_WORK_SECONDS to end it."""
        try:
            self.wait.until(lambda d: d.find_element(By.ID, "status").text.strip())
        except TimeoutException:
            raise AssertionError(f"the page did not react to the click within {WAIT_SECONDS} s: #status stays empty") from None
        self.status_says(text, SERVER_WORK_SECONDS)

    def accept_confirm(self):
        self.wait.until(EC.alert_is_present()).accept()

    def shot(self, name):
        if not self.args.screenshots:
            return
        os.makedirs(self.args.screenshots, exist_ok=True)
        # The whole page's height, so a screenshot shows the page and not only its first screen.
        height = self.driver.execute_script("return Math.min(document.documentElement.scrollHeight, 2400)")
        width = self.driver.get_window_size()["width"]
        self.driver.set_window_size(width, max(900, height + 120))
        self.driver.save_screenshot(os.path.join(self.args.screenshots, f"{name}.png"))
        self.driver.set_window_size(width, 900)

    def browser_errors(self):
        """What the page logged as errors, leaving out the statuses the walk asks for on purpose
        (a 409, a 404): a refused script, a CSP violation or an exception is a failure."""
        errors = []
        for entry in self.driver.get_log("browser"):
            if entry["level"] != "SEVERE":
                continue
            if "Failed to load resource: the server responded with a status of" in entry["message"]:
                continue
            errors.append(entry["message"])
        return errors

    def backend_calls(self):
        """The backend calls counted so far, read through the API the service page reads."""
        _, text = self.api.call("GET", "/_node/_local/_prometheus", raw=True)
        total = 0.0
        for line in text.decode().splitlines():
            if line.startswith("agentstore_backend_call_duration_seconds_count"):
                total += float(line.rsplit(" ", 1)[1])
        return total

    def migration_runs(self, wanted):
        """The migration runs `_active_tasks` lists that `wanted` accepts, waiting up to
        WAIT_SECONDS for one."""
        deadline = time.time() + WAIT_SECONDS
        while True:
            tasks = self.api.ok("GET", "/_active_tasks")
            runs = [t for t in tasks if t.get("type") == "agentstore_migration" and wanted(t)]
            if runs or time.time() > deadline:
                assert runs, f"no such migration run in _active_tasks: {tasks}"
                return runs
            time.sleep(0.5)

    def task_row(self, run):
        """The cells of the service page's row of `run` (found by its start and target)."""
        for row in self.driver.find_elements(By.CSS_SELECTOR, "#active-tasks tbody tr"):
            cells = [c.text for c in row.find_elements(By.TAG_NAME, "td")]
            if run["source"] in cells[2]:
                return cells
        raise AssertionError(f"the service page shows no row for {run['source']}")

    def run_of(self, run_id, wanted):
        """The `_active_tasks` entry of the run `run_id` once `wanted` accepts it."""
        return self.migration_runs(lambda r: r.get("run_id") == run_id and wanted(r))[0]

    def service_row(self, run_id, wanted):
        """The service page's row of the run `run_id` once `wanted` accepts its cells (the page
        reads the tasks again every 5 s, replacing the table)."""
        def row(driver):
            for tr in driver.find_elements(By.CSS_SELECTOR, "#active-tasks tbody tr"):
                if tr.find_elements(By.CSS_SELECTOR, f"[data-run-id='{run_id}']"):
                    cells = [c.text for c in tr.find_elements(By.TAG_NAME, "td")]
                    return cells if wanted(cells) else False
            return False
        wait = WebDriverWait(self.driver, WAIT_SECONDS, ignored_exceptions=[StaleElementReferenceException])
        try:
            return wait.until(row)
        except TimeoutException:
            shown = [r.text for r in self.driver.find_elements(By.CSS_SELECTOR, "#active-tasks tbody tr")]
            raise AssertionError(f"the service page never showed run {run_id} as wanted; it shows {shown}") from None

    def whole_deployment_runs(self):
        """Runs the service starts (`POST /_agentstore/runs`): a move from the page, followed
        until cancelled from the page, then a comparison started through the API; both watched
        on the page; a second start while one goes is refused, and a login that is not an
        admin may start none."""
        self.step("start a whole-deployment move from the page and watch its progress")
        target = "embedded:" + os.path.join(tempfile.mkdtemp(prefix="console-moved-"), "moved.redb")
        host = self.api.couchdb.split("://", 1)[1]
        source = f"http://{self.args.admin}:{self.args.password}@{host}/"
        self.go("#/service")
        self.type_into("#run-source", source)
        self.type_into("#run-target", target)
        self.type_into("#run-dbs", DB)
        self.click("#run-follow")
        self.click("#run-form button[type=submit]")
        self.status_says("Started migrate run")
        run_id = self.find("#status").text.split("run ", 1)[1].split(";", 1)[0]
        # The API says it runs, following, with its one database copied; the page says the same.
        moving = self.run_of(run_id, lambda r: r["state"] == "running" and r.get("phase") == "following")
        assert moving["origin"] == "service" and moving["command"] == "migrate", moving
        assert moving["databases_total"] == 1 and moving["databases_done"] == 1, moving
        assert self.args.password not in json.dumps(moving), f"the password is shown: {moving}"
        self.service_row(run_id, lambda c: c[0] == "migrate (service)" and c[1] == "running (following changes)"
                         and c[5].startswith("1 of 1") and self.args.password not in " ".join(c))
        status, answer = self.api.call("POST", "/_agentstore/runs", {"command": "verify", "source": source, "target": target})
        assert status == 409 and answer.get("id") == run_id, (status, answer)
        assert self.args.password not in json.dumps(answer), answer
        assert self.find("#run-source").get_attribute("value") == "", "the source URL stays on the page"
        if self.args.screenshots:
            # The run's row and the form that started it, as a person sees them.
            self.driver.execute_script("document.getElementById('active-tasks').scrollIntoView()")
            self.driver.save_screenshot(os.path.join(self.args.screenshots, "service-run.png"))

        self.step("cancel the move from the page")
        self.click(f"button[data-run='{run_id}']")
        self.accept_confirm()
        self.status_says(f"Asked run {run_id} to stop")
        self.run_of(run_id, lambda r: r["state"] == "interrupted")
        self.service_row(run_id, lambda c: c[1] == "interrupted")

        self.step("a comparison started through the API is watched on the page")
        reader = Api(self.args.couchdb, self.args.rest, self.args.reader, self.args.reader_password)
        status, answer = reader.call("POST", "/_agentstore/runs", {"command": "verify", "source": source, "target": target})
        assert status in (401, 403), f"a login that is not an admin started a run: {status} {answer}"
        answer = self.api.ok("POST", "/_agentstore/runs", {"command": "verify", "source": source, "target": target, "db": [DB]})
        verify_id = answer["id"]
        compared = self.run_of(verify_id, lambda r: r["state"] == "finished")
        assert compared["passed"] is True and compared["command"] == "verify", compared
        assert compared["databases_done"] == 1 and compared["changes_done"] > 0, compared
        self.go("#/service")
        self.service_row(verify_id, lambda c: c[0] == "verify (service)" and c[1] == "finished" and c[10] == "identical")

    # ---- the steps ----

    def run(self):
        self.step("the console is served at /_utils and asks for a login")
        self.driver.get(f"{self.api.couchdb}/_utils")
        self.find("#login-form")
        assert self.driver.current_url.startswith(self.url()), f"/_utils did not lead to /_utils/: {self.driver.current_url}"
        self.shot("login")

        self.step("a wrong password is refused in the page")
        self.type_into("#login-name", self.args.admin)
        self.type_into("#login-password", "not-the-password")
        self.click("#login-submit")
        self.text_appears("#main", "incorrect (401)")

        self.step("log in with the keyboard only")
        name = self.find("#login-name")
        name.clear()
        name.send_keys(self.args.admin, Keys.TAB)
        active = self.driver.switch_to.active_element
        assert active.get_attribute("id") == "login-password", "Tab from the name does not reach the password"
        active.clear()
        # The login page's own render marked the page ready: unmark it, so `ready()` below waits
        # for the page the login leads to.
        self.driver.execute_script("document.getElementById('main').removeAttribute('data-ready')")
        active.send_keys(self.args.password, Keys.ENTER)
        self.text_appears("#who-name", self.args.admin)
        assert self.driver.get_cookie("AuthSession"), "no AuthSession cookie after logging in"
        self.ready()

        self.step("create a database")
        self.api.call("DELETE", f"/{DB}")
        self.type_into("#new-db-name", DB)
        self.click("#create-db button[type=submit]")
        self.server_work_says(f"Database {DB} created")
        self.text_appears("table", DB)
        info = self.api.ok("GET", f"/{DB}")
        assert info["db_name"] == DB and info["doc_count"] == 0, info
        self.shot("databases")

        self.step("add a document")
        self.go(f"#/db/{DB}/new")
        self.set_value("#doc-json", json.dumps({"_id": "note-1", "type": "note", "n": 1}))
        self.click("#doc-save")
        self.text_appears("#doc-id", "note-1")
        rev1 = self.find("#doc-rev").text
        stored = self.api.ok("GET", f"/{DB}/note-1")
        assert stored["n"] == 1 and stored["_rev"] == rev1 and rev1.startswith("1-"), (stored, rev1)

        self.step("edit the document")
        self.set_value("#doc-json", json.dumps({"_id": "note-1", "_rev": rev1, "type": "note", "n": 2}))
        self.click("#doc-save")
        self.text_appears("#doc-rev", "2-")
        self.status_says("Saved")
        stored = self.api.ok("GET", f"/{DB}/note-1")
        assert stored["n"] == 2 and stored["_rev"].startswith("2-"), stored

        self.step("a save over a revision changed since is refused (409) and shown, nothing overwritten")
        rev2 = stored["_rev"]
        behind = self.api.ok("PUT", f"/{DB}/note-1", {"_rev": rev2, "type": "note", "n": 3, "by": "another client"})
        self.set_value("#doc-json", json.dumps({"_id": "note-1", "_rev": rev2, "type": "note", "n": 99}))
        self.click("#doc-save")
        self.text_appears("#doc-outcome", "Conflict (409)")
        stored = self.api.ok("GET", f"/{DB}/note-1")
        assert stored["n"] == 3 and stored["_rev"] == behind["rev"], stored
        self.go(f"#/db/{DB}/doc/note-1")

        self.step("upload an attachment")
        content = b"console attachment \x00\x01\x02 bytes\n" * 50
        path = os.path.join(tempfile.mkdtemp(prefix="console-upload-"), "notes.bin")
        with open(path, "wb") as f:
            f.write(content)
        self.find("#attachment-file").send_keys(path)
        self.click("#attachment-upload")
        self.status_says("Attached notes.bin")
        self.text_appears("#attachments", "notes.bin")
        status, served = self.api.call("GET", f"/{DB}/note-1/notes.bin", raw=True)
        assert status == 200 and served == content, (status, len(served))
        self.shot("document")

        self.step("download the attachment from the page")
        self.click("a[data-attachment='notes.bin']")
        downloaded = os.path.join(self.downloads, "notes.bin")
        deadline = time.time() + WAIT_SECONDS
        while not (os.path.exists(downloaded) and os.path.getsize(downloaded) == len(content)) and time.time() < deadline:
            time.sleep(0.2)
        with open(downloaded, "rb") as f:
            assert f.read() == content, "the downloaded attachment differs from the uploaded one"

        self.step("delete the attachment")
        self.click("button[data-delete-attachment='notes.bin']")
        self.accept_confirm()
        self.status_says("Deleted the attachment notes.bin")
        stored = self.api.ok("GET", f"/{DB}/note-1")
        assert "_attachments" not in stored, stored

        self.step("resolve a conflict by keeping the losing revision")
        first = self.api.ok("PUT", f"/{DB}/conflicted", {"side": "a"})
        other = "1-" + "b" * 32
        self.api.ok("POST", f"/{DB}/_bulk_docs", {"new_edits": False, "docs": [{"_id": "conflicted", "_rev": other, "side": "b"}]})
        leaves = self.api.ok("GET", f"/{DB}/conflicted?conflicts=true")
        assert len(leaves.get("_conflicts", [])) == 1, leaves
        loser = leaves["_conflicts"][0]
        self.go(f"#/db/{DB}/doc/conflicted")
        self.text_appears("#conflicts h2", "Conflicts (1)")
        self.shot("conflicts")
        self.click(f"button[data-keep='{loser}']")
        self.accept_confirm()
        self.status_says(f"Kept {loser}")
        self.text_appears("#conflicts", "None")
        after = self.api.ok("GET", f"/{DB}/conflicted?conflicts=true")
        assert after["_rev"] == loser and "_conflicts" not in after, (after, first, loser)

        self.step("add a view and run it with query options")
        self.api.ok("POST", f"/{DB}/_bulk_docs", {"docs": [{"_id": f"task-{i}", "type": "task", "n": i} for i in range(5)]})
        self.go(f"#/db/{DB}/views")
        self.type_into("#new-view-ddoc", "stats")
        self.type_into("#new-view-name", "by_type")
        self.set_value("#new-view-map", "function (doc) { if (doc.type) { emit(doc.type, doc.n || 0); } }")
        self.type_into("#new-view-reduce", "_count")
        self.click("#new-view-save")
        self.status_says("View stats/by_type saved")
        self.find("#view-form")
        self.find("#view-reduce option[value='false']").click()
        self.type_into("#view-key", '"task"')
        self.click("#view-run")
        self.text_appears("#view-summary", "5 rows")
        rows = self.api.ok("GET", f"/{DB}/_design/stats/_view/by_type?reduce=false&key=%22task%22")["rows"]
        assert len(rows) == 5, rows
        shown_ids = [e.text for e in self.driver.find_elements(By.CSS_SELECTOR, "#view-results tbody td:nth-child(3)")]
        assert shown_ids == [r["id"] for r in rows], (shown_ids, rows)
        self.find("#view-reduce option[value='true']").click()
        self.find("#view-group option[value='true']").click()
        self.type_into("#view-key", "")
        # The rows shown so far go, so what is read next is the new answer.
        self.driver.execute_script("document.getElementById('view-results').replaceChildren()")
        self.click("#view-run")
        grouped = self.api.ok("GET", f"/{DB}/_design/stats/_view/by_type?group=true")["rows"]
        self.text_appears("#view-summary", f"{len(grouped)} rows")
        values = [e.text for e in self.driver.find_elements(By.CSS_SELECTOR, "#view-results tbody td:nth-child(2)")]
        assert values == [json.dumps(r["value"]) for r in grouped], (values, grouped)
        self.shot("views")

        self.step("create a Mango index, see _explain choose it, run a query a page at a time")
        self.go(f"#/db/{DB}/mango")
        self.type_into("#index-fields", "type, n")
        self.type_into("#index-name", "by-type-n")
        self.click("#index-create")
        self.status_says("Index by-type-n")
        indexes = self.api.ok("GET", f"/{DB}/_index")["indexes"]
        assert any(i["name"] == "by-type-n" for i in indexes), indexes
        query = {"selector": {"type": "task", "n": {"$gte": 0}}, "sort": [{"type": "asc"}, {"n": "asc"}], "limit": 2}
        self.set_value("#mango-query", json.dumps(query))
        self.click("#mango-explain-button")
        self.text_appears("#mango-chosen-index", "by-type-n")
        self.click("#mango-run")
        self.text_appears("#mango-results h2", "page 1")
        page1 = [e.text for e in self.driver.find_elements(By.CSS_SELECTOR, "#mango-results tbody td:first-child")]
        self.click("#mango-next")
        self.text_appears("#mango-results h2", "page 2")
        page2 = [e.text for e in self.driver.find_elements(By.CSS_SELECTOR, "#mango-results tbody td:first-child")]
        found = self.api.ok("POST", f"/{DB}/_find", {**query, "limit": 4})["docs"]
        assert page1 + page2 == [d["_id"] for d in found], (page1, page2, found)
        self.shot("mango")

        self.step("set _security members and _revs_limit")
        self.go(f"#/db/{DB}/settings")
        self.type_into("#members-names", "alice, bob")
        self.type_into("#admins-roles", "ops")
        self.click("#security-form button[type=submit]")
        self.status_says("Permissions saved")
        security = self.api.ok("GET", f"/{DB}/_security")
        assert security["members"]["names"] == ["alice", "bob"] and security["admins"]["roles"] == ["ops"], security
        self.type_into("#revs-limit", "321")
        self.click("#revs-limit-form button[type=submit]")
        self.status_says("Revisions kept: 321")
        assert self.api.ok("GET", f"/{DB}/_revs_limit") == 321
        self.shot("settings")

        self.step("page through _all_docs and _changes")
        self.api.ok("POST", f"/{DB}/_bulk_docs", {"docs": [{"_id": f"zz-filler-{i}"} for i in range(6)]})
        self.go(f"#/db/{DB}?limit=10")
        ids = [e.text for e in self.driver.find_elements(By.CSS_SELECTOR, "a.doc-link")]
        listed = [r["id"] for r in self.api.ok("GET", f"/{DB}/_all_docs?limit=10")["rows"]]
        assert ids == listed, (ids, listed)
        self.driver.execute_script("document.getElementById('main').removeAttribute('data-ready')")
        self.click("#next-page")
        self.ready()
        more = [e.text for e in self.driver.find_elements(By.CSS_SELECTOR, "a.doc-link")]
        rest_ids = [r["id"] for r in self.api.ok("GET", f"/{DB}/_all_docs?skip=10")["rows"]]
        assert more == rest_ids and len(more) > 0, (more, rest_ids)
        self.shot("documents")
        self.go(f"#/db/{DB}/changes?limit=10")
        self.find("#next-changes")
        self.shot("changes")

        self.step("the service page: backend, health, bounds, the chart")
        before = self.backend_calls()
        self.go("#/service")
        self.text_appears("#service-health", "ok")
        self.text_appears("#service-backend", self.args.backend)
        self.text_appears("#main", "couchdb_max_document_bytes")
        # Traffic while the page samples: its chart must show it, and the counters it reads
        # (through the API) must have moved by at least as much.
        for i in range(3):
            for _ in range(20):
                self.api.ok("GET", "/v1/users/walker/namespaces", base=self.api.rest)
            self.api.ok("GET", f"/{DB}/note-1")
            time.sleep(1.5)
        self.wait.until(lambda d: "Last 5 s:" in d.find_element(By.ID, "metrics-chart").text
                        and " 0.0 backend calls/s" not in d.find_element(By.ID, "metrics-chart").text)
        assert self.backend_calls() - before >= 60, "the backend call counter did not move"
        if self.args.migrated is not None:
            self.step("a migration run from the command line into this backend is on the service page")
            finished = self.migration_runs(lambda r: r["state"] == "finished")
            assert len(finished) == 1, finished
            run = finished[0]
            assert run["changes_done"] == self.args.migrated and run["landed"] == self.args.migrated, run
            assert run["command"] == "migrate", run
            cells = self.task_row(run)
            assert cells[0] == "migrate" and cells[1] == "finished", cells
            assert cells[3].split(" ")[0] == str(self.args.migrated) and run["target"] in cells[2], (cells, run)
        if self.args.following:
            self.step("a migrate --follow is seen running, then interrupted after SIGTERM")
            running = self.migration_runs(lambda r: r["state"] == "running" and r.get("phase") == "following")
            assert len(running) == 1, running
            run = running[0]
            self.go("#/service")
            assert self.task_row(run)[1] == "running (following changes)", self.task_row(run)
            if self.args.migration_screenshot:
                self.driver.execute_script("document.getElementById('active-tasks').scrollIntoView()")
                self.driver.save_screenshot(self.args.migration_screenshot)
            os.kill(run["pid"], signal.SIGTERM)
            stopped = self.migration_runs(lambda r: r["pid"] == run["pid"] and r["state"] == "interrupted")
            self.go("#/service")
            assert self.task_row(stopped[0])[1] == "interrupted", self.task_row(stopped[0])
        self.whole_deployment_runs()
        self.shot("service")

        self.step("the replication page: a replication added and followed to `completed`")
        copy = f"{DB}_copy"
        self.go("#/replication")
        self.text_appears("#main h1", "Replication")
        self.type_into("#replication-source", DB)
        self.type_into("#replication-target", copy)
        self.click("#replication-create-target")
        self.click("#replication-form button[type=submit]")
        self.status_says("Replication document")
        rows = self.api.ok("GET", "/_replicator/_all_docs?include_docs=true")["rows"]
        added = [r for r in rows if r["doc"].get("target") == copy]
        assert len(added) == 1, rows
        replication_id = added[0]["id"]
        # The page reads the scheduler again every 5 s: it shows the run's end by itself (the
        # replication creates its target database first: server work).
        self.text_appears("#scheduler-docs", "completed", SERVER_WORK_SECONDS)
        row = [c.text for c in self.driver.find_elements(By.CSS_SELECTOR, "#scheduler-docs tbody tr td")]
        assert replication_id in row and "completed" in row and "done" in row, row
        stored = self.api.ok("GET", f"/_replicator/{replication_id}")
        assert stored["_replication_state"] == "completed", stored
        source_info, copy_info = self.api.ok("GET", f"/{DB}"), self.api.ok("GET", f"/{copy}")
        assert (copy_info["doc_count"], copy_info["doc_del_count"]) == (source_info["doc_count"], source_info["doc_del_count"]), (source_info, copy_info)
        written = int(row[row.index("completed") + 3])
        assert written == stored["_replication_stats"]["docs_written"], (row, stored)
        self.shot("replication")
        self.api.ok("DELETE", f"/_replicator/{replication_id}?rev={stored['_rev']}")
        self.api.ok("DELETE", f"/{copy}")

        self.step("the data-store page: namespaces and keys from the REST API, a key's history")
        for value in ("first", "second"):
            self.api.ok("PUT", "/v1/users/walker/namespaces/notes/keys/greeting", {"value": value}, base=self.api.rest)
        self.go("#/data-store")
        self.type_into("#rest-url", self.api.rest)
        self.click("#rest-form button[type=submit]")
        self.step("pick a user from the data-store page's list")
        # The users the page lists are those the data-store database's ids name, as the API lists them.
        rows = self.api.ok("GET", "/agent_data_store/_all_docs")["rows"]
        users = sorted({r["id"].split(":", 1)[0] for r in rows if not r["id"].startswith("_")})
        self.go("#/data-store")
        self.wait.until(lambda d: d.find_elements(By.CSS_SELECTOR, "#user-list tbody a"))
        listed = [a.text for a in self.driver.find_elements(By.CSS_SELECTOR, "#user-list tbody a")]
        assert listed == users[:20], (listed, users)
        self.click("#user-list a[href$='user=walker']")
        self.text_appears("#data-store-body", "notes")
        self.click("#data-store-body a")
        self.text_appears("#data-store-body", "greeting")
        self.click("#data-store-body tbody a")
        self.text_appears("#key-document", '"second"')
        revisions = self.driver.find_elements(By.CSS_SELECTOR, "#data-store-body tbody tr")
        assert len(revisions) == 2, [r.text for r in revisions]
        self.shot("data-store")

        self.step("readable on a narrow window")
        self.driver.set_window_size(400, 900)
        self.go(f"#/db/{DB}/doc/note-1")
        overflow = self.driver.execute_script("return document.documentElement.scrollWidth - window.innerWidth")
        assert overflow <= 0, f"the page is {overflow}px wider than a 400px window"
        self.shot("narrow")
        self.driver.set_window_size(1280, 900)

        self.step("delete the database, confirming its name")
        self.go("#/databases")
        self.click(f"button[data-delete='{DB}']")
        self.type_into(f"input[data-confirm-name='{DB}']", DB)
        self.click(f"button[data-confirm-delete='{DB}']")
        self.server_work_says(f"Database {DB} deleted")
        status, _ = self.api.call("GET", f"/{DB}")
        assert status == 404, f"GET /{DB} after deleting it answered {status}"

        self.step("log out")
        self.click("#logout")
        self.find("#login-form")
        status_code = self.driver.execute_script(
            "return fetch('/_session').then(r => r.json()).then(j => j.userCtx.name)"
        )
        assert status_code is None, f"still logged in as {status_code!r} after logging out"

        self.step("a login that is not an admin sees what CouchDB shows it")
        self.type_into("#login-name", self.args.reader)
        self.type_into("#login-password", self.args.reader_password)
        self.click("#login-submit")
        self.text_appears("#who-name", self.args.reader)
        self.ready()
        self.text_appears("#main", "not shown to this login")
        reader = Api(self.args.couchdb, self.args.rest, self.args.reader, self.args.reader_password)
        status, _ = reader.call("GET", "/_all_dbs")
        assert status in (401, 403), f"GET /_all_dbs as {self.args.reader} answered {status}"
        self.go("#/service")
        self.text_appears("#main", "shown to server admins")
        for path in ("/_node/_local/_config", "/_node/_local/_prometheus", "/_active_tasks"):
            status, _ = reader.call("GET", path)
            assert status == 401, f"GET {path} as {self.args.reader} answered {status}"
        self.go("#/db/agent_data_store")
        shown = [e.text for e in self.driver.find_elements(By.CSS_SELECTOR, "a.doc-link")]
        listed = [r["id"] for r in reader.ok("GET", "/agent_data_store/_all_docs?limit=20")["rows"]]
        assert shown == listed and all(i.startswith("walker:") for i in shown) and shown, (shown, listed)
        self.shot("reader")
        self.click("#logout")
        self.find("#login-form")

        errors = self.browser_errors()
        assert not errors, f"the page logged errors: {errors}"


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--couchdb", required=True)
    parser.add_argument("--rest", required=True)
    parser.add_argument("--admin", required=True)
    parser.add_argument("--password", required=True)
    parser.add_argument("--reader", required=True, help="a login that is not a server admin")
    parser.add_argument("--reader-password", required=True)
    parser.add_argument("--backend", required=True, help="the backend's name the service page must show")
    parser.add_argument("--migrated", type=int, help="documents a finished `migrate` moved into this backend before")
    parser.add_argument("--following", action="store_true", help="a `migrate --follow` into this backend runs")
    parser.add_argument("--migration-screenshot", help="where to save the service page showing the migration")
    parser.add_argument("--screenshots")
    parser.add_argument("--chromium", default=os.environ.get("AGENTSTORE_TEST_CHROMIUM", "/usr/bin/chromium"))
    parser.add_argument("--chromedriver", default=os.environ.get("AGENTSTORE_TEST_CHROMEDRIVER", "/usr/bin/chromedriver"))
    args = parser.parse_args()
    for program in (args.chromium, args.chromedriver):
        if not os.access(program, os.X_OK):
            print(f"console walkthrough: FAILED: {program} is missing (apt-get install chromium chromium-driver)", file=sys.stderr)
            return 1
    walk = Walk(args)
    try:
        walk.run()
    except Exception as err:  # every failure is reported with the step it happened in
        print(f"console walkthrough: FAILED at '{walk.step_name}': {type(err).__name__}: {err}", file=sys.stderr)
        try:
            failed = os.path.join(tempfile.gettempdir(), f"console-failed-{os.getpid()}.png")
            walk.driver.save_screenshot(failed)
            print(f"console walkthrough: the page at the failure: {failed}", file=sys.stderr)
            print(f"console walkthrough: browser log: {walk.driver.get_log('browser')}", file=sys.stderr)
        except Exception:
            pass
        return 1
    finally:
        walk.driver.quit()
    print("console walkthrough: every step passed", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
