//! One worker thread of the JavaScript engine: its QuickJS runtime with the engine's bounds, the
//! realms of the design documents it has compiled (least recently used dropped first), and the
//! calls themselves. Everything here runs on the worker's own thread; the runtime never leaves
//! it.

use std::borrow::Cow;
use std::cell::Cell;
use std::panic::AssertUnwindSafe;
use std::rc::Rc;
use std::sync::mpsc::Receiver;
use std::sync::{Arc, Mutex};
use std::time::Instant;

use rquickjs::context::intrinsic::{Date, Eval, Json, MapSet, RegExp, RegExpCompiler};
use rquickjs::context::EvalOptions;
use rquickjs::{Context, Ctx, Function, Object, Persistent, Runtime};
use serde_json::value::RawValue;
use serde_json::Value;

use super::log::LogBudget;
use super::{DesignCode, DocText, Job, JsError, JsLimits, MapOutcome, ReduceLimit, Validation, ViewRows};
use crate::model::depth::{parse_stored, text_depth, MAX_DOCUMENT_DEPTH};

/// The JavaScript side of a realm (see the file's opening comment).
const PRELUDE: &str = include_str!("prelude.js");

/// CouchDB's `reduce_limit_threshold` and `reduce_limit_ratio` defaults: reductions up to this
/// many bytes of JSON are never refused, longer ones when more than 1/ratio of the input.
const REDUCE_LIMIT_THRESHOLD: usize = 5000;
const REDUCE_LIMIT_RATIO: f64 = 2.0;

/// The intrinsics CouchDB's QuickJS gives a function's sandbox (besides the base objects):
/// eval, JSON, RegExp, Map/Set and Date. No Promise, Proxy, typed arrays or WeakRef.
type Intrinsics = (Date, Eval, Json, RegExpCompiler, RegExp, MapSet);

/// Serves jobs from the shared queue until every engine handle is gone.
pub(super) fn run(limits: JsLimits, log: Arc<LogBudget>, queue: &Mutex<Receiver<Job>>) {
    let mut worker = match Worker::new(limits, log) {
        Ok(worker) => worker,
        Err(e) => {
            tracing::error!(error = %e, "a JavaScript worker could not start its runtime");
            return;
        }
    };
    loop {
        // One worker waits on the queue at a time; the others wait for the lock.
        let job = match queue.lock() {
            Ok(receiver) => receiver.recv(),
            Err(poisoned) => poisoned.into_inner().recv(),
        };
        let Ok(job) = job else { return };
        if std::panic::catch_unwind(AssertUnwindSafe(|| job(&mut worker))).is_err() {
            tracing::error!("a JavaScript call panicked; its worker's runtime is replaced");
            worker.broken.set(true);
        }
        if worker.broken.get() {
            if let Err(e) = worker.rebuild() {
                tracing::error!(error = %e, "a JavaScript worker could not replace its runtime");
                return;
            }
        }
    }
}

/// The deadline of the call running now, read by the interrupt handler.
#[derive(Default)]
struct Deadline {
    at: Cell<Option<Instant>>,
    fired: Cell<bool>,
}

/// One compiled design document: its own context (globals, prototypes) and the host object
/// `prelude.js` returned for it.
struct Realm {
    // Dropped before `context`: a persistent value must go while its context lives.
    host: Persistent<Object<'static>>,
    context: Context,
    key: [u8; 32],
    last_use: u64,
}

pub(super) struct Worker {
    // Dropped before `runtime` (field order), for the same reason.
    realms: Vec<Realm>,
    runtime: Runtime,
    limits: JsLimits,
    /// Where `log()` lines go, within the engine's log budgets.
    log: Arc<LogBudget>,
    deadline: Rc<Deadline>,
    uses: u64,
    /// Set when a call ran out of time or memory (or panicked): the runtime is replaced
    /// before the next job.
    broken: Cell<bool>,
}

/// A function's path in the design document, as CouchDB names it in errors.
fn path_name(path: &[&str]) -> String {
    path.join(".")
}

impl Worker {
    fn new(limits: JsLimits, log: Arc<LogBudget>) -> Result<Self, JsError> {
        let deadline = Rc::new(Deadline::default());
        let runtime = new_runtime(&limits, &deadline)?;
        Ok(Worker { realms: Vec::new(), runtime, limits, log, deadline, uses: 0, broken: Cell::new(false) })
    }

    fn rebuild(&mut self) -> Result<(), JsError> {
        self.realms.clear();
        self.deadline = Rc::new(Deadline::default());
        self.runtime = new_runtime(&self.limits, &self.deadline)?;
        self.broken.set(false);
        Ok(())
    }

    /// The realm of `ddoc`, created (and the least recently used one dropped) when missing.
    fn realm(&mut self, ddoc: &DesignCode) -> Result<usize, JsError> {
        self.uses += 1;
        if let Some(index) = self.realms.iter().position(|realm| realm.key == ddoc.key) {
            self.realms[index].last_use = self.uses;
            return Ok(index);
        }
        if self.realms.len() >= self.limits.cached_design_docs.max(1) {
            if let Some(oldest) = (0..self.realms.len()).min_by_key(|&i| self.realms[i].last_use) {
                self.realms.swap_remove(oldest);
            }
        }
        let context = Context::custom::<Intrinsics>(&self.runtime).map_err(|_| self.fail_memory())?;
        let ddoc_json = ddoc.doc.to_string();
        let (database, ddoc_id) = (ddoc.database.clone(), ddoc.id.clone());
        let budget = Arc::clone(&self.log);
        let line_bytes = budget.line_bytes();
        self.arm();
        let host = context.with(|ctx| {
            let made = (|| -> rquickjs::Result<_> {
                // `log()` hands over at most `couchdb_js_log_line_bytes` UTF-16 units of its message, with
                // the whole length when it cut it.
                let log = Function::new(ctx.clone(), move |message: String, length: Option<f64>| {
                    budget.line(&database, &ddoc_id, &message, length.map(|units| units as usize));
                })?;
                let factory: Function = ctx.eval_with_options(PRELUDE, sloppy("prelude.js"))?;
                let host: Object = factory.call((ddoc_json, log, line_bytes as f64))?;
                Ok(Persistent::save(&ctx, host))
            })();
            made.map_err(|e| self.classify(&ctx, e, "the design document"))
        });
        self.disarm();
        let host = host?;
        self.realms.push(Realm { host, context, key: ddoc.key, last_use: self.uses });
        Ok(self.realms.len() - 1)
    }

    /// Compiles the function at `path` into the realm unless it is there already.
    fn compile(&self, realm: usize, ddoc: &DesignCode, path: &[&str]) -> Result<(), JsError> {
        let name = path_name(path);
        let mut value = Some(&*ddoc.doc);
        for segment in path {
            value = value.and_then(|v| v.get(*segment));
        }
        let source = match value {
            None | Some(Value::Null) => return Err(JsError::Missing { function: name }),
            Some(Value::String(source)) => source.clone(),
            Some(_) => {
                return Err(JsError::Compile {
                    function: name,
                    message: "the function's source is not a string".into(),
                })
            }
        };
        let realm = &self.realms[realm];
        self.arm();
        let compiled = realm.context.with(|ctx| {
            let host = realm.host.clone().restore(&ctx).map_err(|e| JsError::Internal(e.to_string()))?;
            let attempt = (|| -> rquickjs::Result<Option<bool>> {
                let has: Function = host.get("has")?;
                if has.call::<_, bool>((name.as_str(),))? {
                    return Ok(None);
                }
                let value: rquickjs::Value =
                    ctx.eval_with_options(couch_function_source(&source).into_owned(), sloppy(&name))?;
                if !value.is_function() {
                    return Ok(Some(false));
                }
                let define: Function = host.get("define")?;
                define.call::<_, ()>((name.as_str(), value))?;
                Ok(Some(true))
            })();
            match attempt {
                Ok(None) | Ok(Some(true)) => Ok(()),
                // CouchDB's messages (its `Couch.compileFunction`), the source quoted after them.
                Ok(Some(false)) => Err(JsError::Compile {
                    function: name.clone(),
                    message: format!("Expression does not eval to a function. ({source})"),
                }),
                Err(e) => match self.classify(&ctx, e, &name) {
                    JsError::Thrown { error, message } => Err(JsError::Compile {
                        function: name.clone(),
                        message: format!("{error}: {message} ({source})"),
                    }),
                    other => Err(other),
                },
            }
        });
        self.disarm();
        compiled
    }

    pub(super) fn compile_path(&mut self, ddoc: &DesignCode, path: &[String]) -> Result<(), JsError> {
        let realm = self.realm(ddoc)?;
        let path: Vec<&str> = path.iter().map(String::as_str).collect();
        self.compile(realm, ddoc, &path)
    }

    pub(super) fn map(
        &mut self,
        ddoc: &DesignCode,
        views: &[String],
        docs: &[Arc<DocText>],
    ) -> Result<Vec<MapOutcome>, JsError> {
        let realm = self.realm(ddoc)?;
        let paths: Vec<String> = views.iter().map(|v| format!("views.{v}.map")).collect();
        for view in views {
            self.compile(realm, ddoc, &["views", view, "map"])?;
        }
        let realm = &self.realms[realm];
        realm.context.with(|ctx| {
            let host = self.host(&ctx, realm)?;
            self.arm();
            let chosen =
                host.get::<_, Function>("useViews").and_then(|use_views| use_views.call::<_, ()>((paths.clone(),)));
            self.disarm();
            chosen.map_err(|e| self.classify(&ctx, e, "map"))?;
            let map_doc: Function = host.get("mapDoc").map_err(|e| self.classify(&ctx, e, "map"))?;
            let mut outcomes = Vec::with_capacity(docs.len());
            let mut answered_bytes = 0usize;
            for doc in docs {
                self.arm();
                let answer = map_doc.call::<_, rquickjs::String>((doc.text(),)).and_then(|text| text.to_string());
                self.disarm();
                let answer = answer.map_err(|e| self.classify(&ctx, e, "map"))?;
                answered_bytes = answered_bytes.saturating_add(answer.len());
                outcomes.push(self.map_outcome(&answer, views.len(), ddoc, doc)?);
                if answered_bytes >= self.limits.map_call_bytes {
                    break;
                }
            }
            Ok(outcomes)
        })
    }

    /// One document's map answer read, unless it is longer than [`JsLimits::map_answer_bytes`]:
    /// then it is not parsed, and the document gets no rows (logged, as CouchDB logs a document
    /// it leaves out of an index).
    fn map_outcome(&self, answer: &str, views: usize, ddoc: &DesignCode, doc: &DocText) -> Result<MapOutcome, JsError> {
        if answer.len() <= self.limits.map_answer_bytes {
            return parse_map_answer(answer, views, ddoc, &self.log);
        }
        let reason = format!(
            "its rows take {} bytes of JSON, past the {} a document may emit (couchdb_view_max_doc_bytes)",
            answer.len(),
            self.limits.map_answer_bytes
        );
        let doc_id = doc.value().get("_id").and_then(Value::as_str).unwrap_or_default();
        // Through the design functions' log budget: a view whose every document emits too much
        // must not flood the log either.
        let line = format!("view rows of the document {doc_id:?} are left out of the index: {reason}");
        self.log.line(&ddoc.database, &ddoc.id, &line, None);
        Ok(MapOutcome { views: vec![ViewRows::Threw(reason); views] })
    }

    pub(super) fn reduce(
        &mut self,
        ddoc: &DesignCode,
        view: &str,
        input: &Value,
        rereduce: bool,
    ) -> Result<Value, JsError> {
        let realm = self.realm(ddoc)?;
        let name = format!("views.{view}.reduce");
        self.compile(realm, ddoc, &["views", view, "reduce"])?;
        let input = input.to_string();
        let input_bytes = input.len();
        let answer = self.call_host(realm, "reduce", &name, |host| {
            let reduce: Function = host.get("reduce")?;
            reduce.call::<_, rquickjs::String>((name.as_str(), input, rereduce))?.to_string()
        });
        let answer = answer?;
        self.check_reduce_growth(&ddoc.id, &name, input_bytes, answer.len())?;
        // `[result]`: the result may be undefined, which JSON writes as null inside an array.
        match parse_js_json(&answer) {
            Ok(Value::Array(mut items)) if items.len() == 1 => Ok(items.remove(0)),
            _ => Err(JsError::Internal(format!("a reduce answered what is not a one-element array: {answer}"))),
        }
    }

    /// CouchDB's `reduce_limit`: a reduction longer than [`REDUCE_LIMIT_THRESHOLD`] bytes of
    /// JSON that is more than half as long as its input does not shrink, and so would grow
    /// without bound up the tree.
    fn check_reduce_growth(
        &self,
        ddoc_id: &str,
        name: &str,
        input_bytes: usize,
        output_bytes: usize,
    ) -> Result<(), JsError> {
        let grows =
            output_bytes > REDUCE_LIMIT_THRESHOLD && output_bytes as f64 * REDUCE_LIMIT_RATIO > input_bytes as f64;
        if !grows || self.limits.reduce_limit == ReduceLimit::Off {
            return Ok(());
        }
        let message = format!(
            "the reduce function does not shrink its input: {input_bytes} bytes in, {output_bytes} bytes out ({ddoc_id} {name})"
        );
        if self.limits.reduce_limit == ReduceLimit::Log {
            tracing::warn!(target: "agentstore::js", design_doc = ddoc_id, "{message}");
            return Ok(());
        }
        Err(JsError::Thrown { error: "reduce_overflow_error".into(), message })
    }

    pub(super) fn validate(&mut self, ddoc: &DesignCode, args: &Value) -> Result<Validation, JsError> {
        let realm = self.realm(ddoc)?;
        self.compile(realm, ddoc, &["validate_doc_update"])?;
        let args = args.to_string();
        let answer = self.call_host(realm, "validate", "validate_doc_update", |host| {
            let validate: Function = host.get("validate")?;
            validate.call::<_, rquickjs::String>((args,))?.to_string()
        })?;
        let answer: Value =
            parse_js_json(&answer).map_err(|e| JsError::Internal(format!("a validation answer is not JSON: {e}")))?;
        let Some(rejected) = answer.get("rejected") else {
            return Ok(Validation::Allowed);
        };
        Ok(match rejected {
            Value::Object(members) if members.len() == 1 => {
                let (kind, message) =
                    members.iter().next().map_or_else(|| (String::new(), Value::Null), |(k, v)| (k.clone(), v.clone()));
                match kind.as_str() {
                    "forbidden" => Validation::Forbidden(message),
                    "unauthorized" => Validation::Unauthorized(message),
                    _ => Validation::UnknownError(message),
                }
            }
            Value::String(_) => Validation::UnknownError(rejected.clone()),
            // CouchDB's query server cannot match anything else and answers a 500.
            other => return Err(JsError::Thrown { error: "unknown_error".into(), message: other.to_string() }),
        })
    }

    pub(super) fn filter(
        &mut self,
        ddoc: &DesignCode,
        filter: &str,
        docs: &[Arc<Value>],
        req: &Value,
    ) -> Result<Vec<bool>, JsError> {
        let realm = self.realm(ddoc)?;
        let name = format!("filters.{filter}");
        self.compile(realm, ddoc, &["filters", filter])?;
        let req = req.to_string();
        self.call_host(realm, "setFilterRequest", &name, |host| {
            let set: Function = host.get("setFilterRequest")?;
            set.call::<_, ()>((req,))
        })?;
        self.filter_docs(realm, "filterDoc", &name, docs)
    }

    pub(super) fn filter_view(
        &mut self,
        ddoc: &DesignCode,
        view: &str,
        docs: &[Arc<Value>],
    ) -> Result<Vec<bool>, JsError> {
        let realm = self.realm(ddoc)?;
        let name = format!("views.{view}.map");
        self.compile(realm, ddoc, &["views", view, "map"])?;
        self.filter_docs(realm, "filterViewDoc", &name, docs)
    }

    /// One call per document, each with its own deadline, as CouchDB bounds each document.
    fn filter_docs(
        &mut self,
        realm: usize,
        method: &str,
        name: &str,
        docs: &[Arc<Value>],
    ) -> Result<Vec<bool>, JsError> {
        let realm_ref = &self.realms[realm];
        realm_ref.context.with(|ctx| {
            let host = self.host(&ctx, realm_ref)?;
            let fun: Function = host.get(method).map_err(|e| self.classify(&ctx, e, name))?;
            let mut passed = Vec::with_capacity(docs.len());
            for doc in docs {
                let doc_json = doc.to_string();
                self.arm();
                let answer = fun.call::<_, bool>((name, doc_json));
                self.disarm();
                passed.push(answer.map_err(|e| self.classify(&ctx, e, name))?);
            }
            Ok(passed)
        })
    }

    /// Runs `call` against the realm's host object under the call deadline.
    fn call_host<T>(
        &mut self,
        realm: usize,
        what: &str,
        name: &str,
        call: impl for<'js> FnOnce(&Object<'js>) -> rquickjs::Result<T>,
    ) -> Result<T, JsError> {
        let realm_ref = &self.realms[realm];
        realm_ref.context.with(|ctx| {
            let host = self.host(&ctx, realm_ref)?;
            self.arm();
            let answer = call(&host);
            self.disarm();
            answer.map_err(|e| {
                let error = self.classify(&ctx, e, name);
                tracing::debug!(call = what, function = name, error = %error, "JavaScript call failed");
                error
            })
        })
    }

    fn host<'js>(&self, ctx: &Ctx<'js>, realm: &Realm) -> Result<Object<'js>, JsError> {
        realm.host.clone().restore(ctx).map_err(|e| JsError::Internal(e.to_string()))
    }

    fn arm(&self) {
        self.deadline.fired.set(false);
        self.deadline.at.set(Some(Instant::now() + self.limits.call_timeout));
    }

    fn disarm(&self) {
        self.deadline.at.set(None);
    }

    /// Out of memory: the runtime is replaced after this job.
    fn fail_memory(&self) -> JsError {
        self.broken.set(true);
        JsError::OutOfMemory { limit: self.limits.memory_bytes }
    }

    /// Runs `work`, which may run a function's code, under a deadline of its own (the call's
    /// one is restored after); `None` when that deadline passed, and then the runtime is
    /// replaced after this job.
    fn bounded<T>(&self, ctx: &Ctx<'_>, work: impl FnOnce() -> T) -> Option<T> {
        let outer = self.deadline.at.get();
        self.arm();
        let done = work();
        let fired = self.deadline.fired.get();
        self.deadline.at.set(outer);
        if fired {
            // The interrupt's exception is uncatchable and may still be pending: clear it.
            let _ = ctx.catch();
            self.broken.set(true);
            return None;
        }
        Some(done)
    }

    fn timed_out(&self) -> JsError {
        self.broken.set(true);
        JsError::Timeout { limit: self.limits.call_timeout }
    }

    /// What a failed call means. Reads (and so clears) the pending exception. Describing a
    /// thrown value runs its code (a `name` or `message` getter, a `toJSON`): that runs under
    /// the call timeout too, or a thrown object whose getter never returns would hold the
    /// worker for ever.
    fn classify(&self, ctx: &Ctx<'_>, error: rquickjs::Error, name: &str) -> JsError {
        if self.deadline.fired.get() {
            // The interrupt's exception is uncatchable and still pending: clear it.
            let _ = ctx.catch();
            return self.timed_out();
        }
        match error {
            rquickjs::Error::Exception => {
                let thrown = ctx.catch();
                let described = self.bounded(ctx, || {
                    let described = describe_thrown(ctx, &thrown);
                    // A getter that threw leaves its exception pending: clear it.
                    let _ = ctx.catch();
                    described
                });
                let Some((error, message)) = described else {
                    return self.timed_out();
                };
                if error == "InternalError" && message.contains("out of memory") {
                    return self.fail_memory();
                }
                if (error == "RangeError" || error == "InternalError")
                    && (message == "Maximum call stack size exceeded" || message == "stack overflow")
                {
                    return JsError::StackOverflow;
                }
                JsError::Thrown { error, message }
            }
            rquickjs::Error::Allocation => self.fail_memory(),
            other => JsError::Internal(format!("{name}: {other}")),
        }
    }
}

fn sloppy(filename: &str) -> EvalOptions {
    let mut options = EvalOptions::default();
    options.global = true;
    options.strict = false;
    options.backtrace_barrier = true;
    options.filename = Some(filename.to_owned());
    options
}

fn new_runtime(limits: &JsLimits, deadline: &Rc<Deadline>) -> Result<Runtime, JsError> {
    let runtime = Runtime::new().map_err(|e| JsError::Internal(format!("creating a QuickJS runtime: {e}")))?;
    runtime.set_memory_limit(limits.memory_bytes);
    runtime.set_max_stack_size(limits.stack_bytes);
    let deadline = Rc::clone(deadline);
    runtime.set_interrupt_handler(Some(Box::new(move || match deadline.at.get() {
        Some(at) if Instant::now() >= at => {
            deadline.fired.set(true);
            true
        }
        _ => false,
    })));
    Ok(runtime)
}

/// A thrown value's error name and message: `name`/`message` of an Error, CouchDB's
/// `["error", kind, message]` arrays, or the value itself as JSON.
fn describe_thrown<'js>(ctx: &Ctx<'js>, thrown: &rquickjs::Value<'js>) -> (String, String) {
    if let Some(object) = thrown.as_object() {
        if thrown.is_error() || object.contains_key("stack").unwrap_or(false) {
            let name = object.get::<_, Option<String>>("name").ok().flatten().unwrap_or_else(|| "Error".into());
            let message = object.get::<_, Option<String>>("message").ok().flatten().unwrap_or_default();
            return (name, message);
        }
    }
    let json = ctx.json_stringify(thrown.clone()).ok().flatten().and_then(|text| text.to_string().ok());
    if let Some(Value::Array(items)) = json.as_deref().and_then(|t| parse_js_json(t).ok()) {
        if let [Value::String(level), Value::String(kind), reason] = items.as_slice() {
            if level == "error" || level == "fatal" {
                let reason = match reason {
                    Value::String(text) => text.clone(),
                    other => other.to_string(),
                };
                return (kind.clone(), reason);
            }
        }
    }
    let text = json.unwrap_or_else(|| {
        thrown.as_string().and_then(|s| s.to_string().ok()).unwrap_or_else(|| "a value that is not JSON".into())
    });
    ("unnamed_error".into(), text)
}

/// JSON written by the engine's `JSON.stringify`, read back. JavaScript strings may hold lone
/// UTF-16 surrogates (a string reversed by code unit), which `JSON.stringify` writes as `\udXXX`
/// escapes and serde_json rightly refuses; like couchjs, which replaces them when it encodes
/// UTF-8, each becomes U+FFFD.
fn parse_js_json(text: &str) -> serde_json::Result<Value> {
    parse_stored(replace_lone_surrogates(text).as_bytes())
}

pub(super) fn replace_lone_surrogates(text: &str) -> Cow<'_, str> {
    fn surrogate_at(bytes: &[u8], at: usize) -> Option<u16> {
        if bytes.get(at) != Some(&b'\\') || bytes.get(at + 1) != Some(&b'u') {
            return None;
        }
        let hex = std::str::from_utf8(bytes.get(at + 2..at + 6)?).ok()?;
        let unit = u16::from_str_radix(hex, 16).ok()?;
        (0xD800..=0xDFFF).contains(&unit).then_some(unit)
    }
    if !text.contains("\\ud") && !text.contains("\\uD") {
        return Cow::Borrowed(text);
    }
    let bytes = text.as_bytes();
    let mut out = String::with_capacity(text.len());
    let mut copied = 0;
    let mut at = 0;
    while at < bytes.len() {
        if bytes[at] != b'\\' {
            at += 1;
            continue;
        }
        match surrogate_at(bytes, at) {
            // A high surrogate followed by a low one: a valid pair, kept.
            Some(0xD800..=0xDBFF) if surrogate_at(bytes, at + 6).is_some_and(|low| low >= 0xDC00) => {
                at += 12;
            }
            Some(_) => {
                out.push_str(&text[copied..at]);
                out.push_str("\\ufffd");
                at += 6;
                copied = at;
            }
            // Any other escape, `\\` included: skip the escaped character.
            None => at += 2,
        }
    }
    out.push_str(&text[copied..]);
    Cow::Owned(out)
}

/// `mapDoc`'s answer: per view, an array of `[key, value]` rows or the text of what it threw.
fn parse_map_answer(answer: &str, views: usize, ddoc: &DesignCode, log: &LogBudget) -> Result<MapOutcome, JsError> {
    let bad = |why: &str| JsError::Internal(format!("a map answer {why}: {answer}"));
    // Each view's answer is kept as text first (at any depth), so rows nested too deep fail
    // their own view only, as a throw would.
    let Ok(per_view) = serde_json::from_str::<Vec<Box<RawValue>>>(answer) else {
        return Err(bad("is not a JSON array"));
    };
    if per_view.len() != views {
        return Err(bad("has the wrong number of views"));
    }
    let mut outcome = MapOutcome { views: Vec::with_capacity(views) };
    for entry in per_view {
        let entry = match emitted_within_depth(entry.get()) {
            Ok(entry) => entry,
            Err(message) => Value::String(message),
        };
        match entry {
            Value::Array(rows) => {
                let mut emitted = Vec::with_capacity(rows.len());
                for row in rows {
                    let Value::Array(pair) = row else {
                        return Err(bad("has a row that is not a pair"));
                    };
                    let mut pair = pair.into_iter();
                    let key = pair.next().unwrap_or(Value::Null);
                    let value = pair.next().unwrap_or(Value::Null);
                    emitted.push((key, value));
                }
                outcome.views.push(ViewRows::Emitted(emitted));
            }
            Value::String(message) => {
                log.line(&ddoc.database, &ddoc.id, &message, None);
                outcome.views.push(ViewRows::Threw(message));
            }
            _ => return Err(bad("has an entry that is neither rows nor a message")),
        }
    }
    Ok(outcome)
}

/// One view's answer to a map call parsed, when every key and value it emitted is nested no
/// deeper than a document may be ([`MAX_DOCUMENT_DEPTH`], the bound the index's rows are read
/// back within); else the message of the error it counts as.
fn emitted_within_depth(view_answer: &str) -> Result<Value, String> {
    // Rows are `[[key, value], …]`: two levels around each key and value.
    let depth = text_depth(view_answer.as_bytes()).saturating_sub(2);
    if depth > MAX_DOCUMENT_DEPTH {
        return Err(format!(
            "emitted a key or value nested {depth} levels deep; at most {MAX_DOCUMENT_DEPTH} are allowed (JSON nesting depth)"
        ));
    }
    parse_js_json(view_answer).map_err(|err| format!("answered what is not JSON: {err}"))
}

/// The source as CouchDB's QuickJS compiles it: its parser takes a statement that starts with
/// `function (` as an expression (SpiderMonkey 1.8.5's leniency), so the usual anonymous
/// `function(doc) {…}` evaluates to the function, with comments, whitespace and a trailing `;`
/// around it. Stock QuickJS reads such a statement as a declaration without a name (a syntax
/// error); prefixing `0,` makes it the same expression, on the same line. A named declaration
/// (`function name(doc) {…}`) is left alone: it evaluates to nothing, as in CouchDB, and the
/// caller reports that it does not evaluate to a function.
pub(super) fn couch_function_source(source: &str) -> Cow<'_, str> {
    let start = skip_blank(source, 0);
    let Some(rest) = source[start..].strip_prefix("function") else {
        return Cow::Borrowed(source);
    };
    if rest.chars().next().is_some_and(|c| c.is_alphanumeric() || c == '_' || c == '$') {
        return Cow::Borrowed(source);
    }
    let after = skip_blank(source, start + "function".len());
    if !source[after..].starts_with('(') {
        return Cow::Borrowed(source);
    }
    let mut patched = String::with_capacity(source.len() + 2);
    patched.push_str(&source[..start]);
    patched.push_str("0,");
    patched.push_str(&source[start..]);
    Cow::Owned(patched)
}

/// The byte offset of the first character at or after `from` that is not whitespace or part of
/// a comment.
fn skip_blank(source: &str, mut from: usize) -> usize {
    loop {
        let rest = &source[from..];
        let trimmed = rest.trim_start_matches(|c: char| c.is_whitespace() || c == '\u{feff}');
        from += rest.len() - trimmed.len();
        if let Some(comment) = trimmed.strip_prefix("//") {
            from += 2 + comment.find(['\n', '\r']).unwrap_or(comment.len());
        } else if let Some(comment) = trimmed.strip_prefix("/*") {
            match comment.find("*/") {
                Some(end) => from += 2 + end + 2,
                None => return source.len(),
            }
        } else {
            return from;
        }
    }
}
