//! The JavaScript engine for design documents: map and reduce functions, `validate_doc_update`
//! and `_changes` filters, run as CouchDB 3.4 runs them, in QuickJS.
//!
//! The engine is a fixed pool of OS threads ([`JsLimits::workers`]), each owning one QuickJS
//! runtime, fed by one bounded queue ([`JsLimits::queue`]; a full queue answers
//! [`JsError::Busy`] at once). Async callers hand a job to the queue and await its answer on a
//! oneshot channel, so no tokio worker ever blocks on JavaScript. Each worker keeps the design
//! documents it compiled (by content, a bounded number), each in a realm (QuickJS context) of
//! its own, so one database's functions cannot change the globals or prototypes another's see.
//!
//! Bounds, per call (per document for map and filter calls, as CouchDB's `os_process_timeout`
//! bounds each `map_doc` prompt): [`JsLimits::call_timeout`] through QuickJS's interrupt handler,
//! [`JsLimits::memory_bytes`] per runtime and [`JsLimits::stack_bytes`]. A call that runs out of
//! time or memory ends with [`JsError::Timeout`] / [`JsError::OutOfMemory`] and its runtime is
//! thrown away and rebuilt before the worker's next job, as CouchDB kills its couchjs process.
//!
//! Why QuickJS through `rquickjs`: CouchDB 3.4 ships QuickJS itself (next to SpiderMonkey), so
//! the language level and quirks match; `rquickjs` is the maintained binding (0.14, September
//! 2026) and bundles QuickJS-NG's C sources without QuickJS's libc module, so functions have no
//! file, network, timer, `std` or `os` API to begin with. The alternatives: boa (pure Rust but
//! slower and not CouchDB's engine), deno_core/V8 (a large C++ build and far heavier isolates),
//! the `quick-js` crate (unmaintained since 2021), and couchjs subprocesses (CouchDB's own
//! design: JSON lines over a pipe for every document, an OS process per worker).
//!
//! - [`worker`]: one worker thread: its runtime, realms, compilation and calls.
//! - [`doc_text`]: [`DocText`], a document as a map call receives it: its JSON text.
//! - [`log`]: the bounds on what functions write to the server's log (`log()`, map throws).
//! - `prelude.js`: the JavaScript side of a realm: CouchDB's API (`emit`, `sum`, `log`,
//!   `toJSON`, `isArray`, `require`) and the loops the worker calls.

mod doc_text;
pub use doc_text::DocText;
mod log;
pub use log::LogLimits;
mod worker;

#[cfg(test)]
mod tests;

use std::fmt;
use std::sync::mpsc::{self, SyncSender, TrySendError};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use serde_json::Value;
use sha2::{Digest, Sha256};
use tokio::sync::oneshot;

use worker::Worker;

/// The bounds of the engine. CouchDB's defaults where it has one.
#[derive(Debug, Clone)]
pub struct JsLimits {
    /// How long one call may run: CouchDB's `os_process_timeout` (5 s). Map and filter calls
    /// are bounded per document.
    pub call_timeout: Duration,
    /// Memory of one worker's runtime (every design document it holds): CouchDB's QuickJS
    /// default, 64 MiB.
    pub memory_bytes: usize,
    /// Native stack a call may use before it fails with [`JsError::StackOverflow`]
    /// (at most 16 MiB: rquickjs treats more as unlimited). The worker thread's stack is this
    /// plus a margin.
    pub stack_bytes: usize,
    /// Worker threads, each with its own runtime.
    pub workers: usize,
    /// Calls waiting for a worker before new ones are refused with [`JsError::Busy`] (0: a
    /// call is taken only when a worker is idle).
    pub queue: usize,
    /// Design documents each worker keeps compiled.
    pub cached_design_docs: usize,
    /// What a JavaScript reduce whose output does not shrink gets (CouchDB's
    /// `query_server_config/reduce_limit`, on by default).
    pub reduce_limit: ReduceLimit,
    /// Longest map answer of one document (its rows as JSON text) that is read: a longer one
    /// is not parsed, and the document gets no rows in any view (each view's outcome is
    /// [`ViewRows::Threw`] with the reason), so one document's rows never cost more memory than
    /// this (the views' `couchdb_view_max_doc_bytes` with room for the JSON around the rows).
    pub map_answer_bytes: usize,
    /// Bytes of map answers one [`JsEngine::map`] call gathers before it returns the documents
    /// mapped so far (at least one): a batch of documents emitting large rows is held a part at
    /// a time (the views' `couchdb_view_batch_bytes`).
    pub map_call_bytes: usize,
    /// What design functions may write to the server's log (`couchdb_js_log_*`).
    pub log: LogLimits,
}

/// CouchDB's `reduce_limit`: a JavaScript reduce whose JSON output is over 5000 bytes and more
/// than half the size of its input is refused (`true`), logged (`log`) or let through (`false`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReduceLimit {
    /// The call fails with [`JsError::Thrown`], error `reduce_overflow_error`.
    Refuse,
    /// A warning is logged and the reduction returned.
    Log,
    Off,
}

/// The most stack rquickjs passes on to QuickJS (above it, it sets no limit at all).
const MAX_STACK_BYTES: usize = 16 << 20;

impl Default for JsLimits {
    fn default() -> Self {
        let cores = std::thread::available_parallelism().map_or(2, |n| n.get());
        JsLimits {
            call_timeout: Duration::from_secs(5),
            memory_bytes: 64 << 20,
            stack_bytes: 4 << 20,
            workers: cores,
            queue: 64 * cores,
            cached_design_docs: 32,
            reduce_limit: ReduceLimit::Refuse,
            map_answer_bytes: usize::MAX,
            map_call_bytes: usize::MAX,
            log: LogLimits::default(),
        }
    }
}

/// A design document of one database as the engine runs it. Compiled code is cached by a
/// digest of the database, id, revision and body: never by id and revision alone (two databases
/// may hold the same id and revision with different bodies, and one must never run the other's
/// functions), and never by content alone (identical design documents of two databases must not
/// share a realm, or one database's functions would see globals the other's set).
#[derive(Debug, Clone)]
pub struct DesignCode {
    /// The database the design document is in: its realm is its own, and its `log()` lines
    /// count against this database's log budget.
    pub database: String,
    pub id: String,
    pub rev: String,
    pub doc: Arc<Value>,
    key: [u8; 32],
}

impl DesignCode {
    /// Digests the body (serializing it once): build one per design document revision and
    /// reuse it for every call.
    pub fn new(database: impl Into<String>, id: impl Into<String>, rev: impl Into<String>, doc: Arc<Value>) -> Self {
        let database = database.into();
        let id = id.into();
        let rev = rev.into();
        let mut hasher = Sha256::new();
        // Lengths first: no database name and id can run together into another pair's bytes.
        hasher.update((database.len() as u64).to_le_bytes());
        hasher.update(database.as_bytes());
        hasher.update((id.len() as u64).to_le_bytes());
        hasher.update(id.as_bytes());
        hasher.update([0]);
        hasher.update(rev.as_bytes());
        hasher.update([0]);
        hasher.update(doc.to_string().as_bytes());
        DesignCode { database, id, rev, doc, key: hasher.finalize().into() }
    }
}

/// One view's answer for one document.
#[derive(Debug, Clone, PartialEq)]
pub enum ViewRows {
    /// The rows it emitted, `(key, value)`, in emit order.
    Emitted(Vec<(Value, Value)>),
    /// What it threw, as text: CouchDB indexes nothing for the document in that view and logs
    /// the message (the engine has logged it already).
    Threw(String),
}

/// One document through the map functions of a [`JsEngine::map`] call.
#[derive(Debug, Clone, PartialEq)]
pub struct MapOutcome {
    /// One entry per requested view, in the order of the call's `views`.
    pub views: Vec<ViewRows>,
}

/// What `validate_doc_update` decided.
#[derive(Debug, Clone, PartialEq)]
pub enum Validation {
    Allowed,
    /// `throw({forbidden: message})`: CouchDB answers 403 `forbidden` with the message.
    Forbidden(Value),
    /// `throw({unauthorized: message})`: 401 `unauthorized`.
    Unauthorized(Value),
    /// A string, or an object with one other member, thrown: CouchDB answers 500
    /// `unknown_error` with the string or that member's value as the reason.
    UnknownError(Value),
}

/// Why a call failed as a whole.
#[derive(Debug, Clone, PartialEq)]
pub enum JsError {
    /// The call ran longer than [`JsLimits::call_timeout`]; its runtime was replaced.
    Timeout { limit: Duration },
    /// The call's runtime reached [`JsLimits::memory_bytes`]; the runtime was replaced.
    OutOfMemory { limit: usize },
    /// The call recursed past [`JsLimits::stack_bytes`] (CouchDB's QuickJS makes this an
    /// InternalError, which ends the call as a whole, not one document).
    StackOverflow,
    /// A function's source does not compile or does not evaluate to a function; `function`
    /// is its path in the design document (`views.NAME.map`, `filters.NAME`, …).
    Compile { function: String, message: String },
    /// The design document has no such function (CouchDB's 404 `not_found`).
    Missing { function: String },
    /// A function threw what ends the call: any throw from a filter, an Error object from
    /// `validate_doc_update`, `throw "fatal_error"` from a map function. `error` is the
    /// error's name or CouchDB's error kind, `message` its text. A reduce that does not shrink
    /// (see [`ReduceLimit`]) is `reduce_overflow_error`.
    Thrown { error: String, message: String },
    /// Every worker is busy and the queue is full.
    Busy,
    /// The engine could not run the call (a worker failed, a value did not cross as JSON).
    Internal(String),
}

impl fmt::Display for JsError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            JsError::Timeout { limit } => {
                write!(f, "the function ran longer than {} ms", limit.as_millis())
            }
            JsError::OutOfMemory { limit } => {
                write!(f, "the function used more than {limit} bytes of memory")
            }
            JsError::StackOverflow => f.write_str("the function recursed too deeply"),
            JsError::Compile { function, message } => {
                write!(f, "{function} does not compile: {message}")
            }
            JsError::Missing { function } => write!(f, "missing function {function}"),
            JsError::Thrown { error, message } => write!(f, "{error}: {message}"),
            JsError::Busy => f.write_str("every JavaScript worker is busy"),
            JsError::Internal(message) => write!(f, "JavaScript engine: {message}"),
        }
    }
}

impl std::error::Error for JsError {}

type Job = Box<dyn FnOnce(&mut Worker) + Send>;

/// The engine: a handle on the worker pool. Cheap to clone; the workers stop when the last
/// clone is dropped.
#[derive(Clone)]
pub struct JsEngine {
    inner: Arc<EngineInner>,
}

struct EngineInner {
    jobs: SyncSender<Job>,
    limits: JsLimits,
    log: Arc<log::LogBudget>,
}

impl JsEngine {
    pub fn new(limits: JsLimits) -> Result<Self, JsError> {
        if limits.workers == 0 {
            return Err(JsError::Internal("the engine needs at least one worker".into()));
        }
        if limits.stack_bytes == 0 || limits.stack_bytes > MAX_STACK_BYTES {
            return Err(JsError::Internal(format!("the stack limit must be between 1 and {MAX_STACK_BYTES} bytes")));
        }
        let (jobs, queue) = mpsc::sync_channel::<Job>(limits.queue);
        let queue = Arc::new(Mutex::new(queue));
        let log = Arc::new(log::LogBudget::new(limits.log));
        for index in 0..limits.workers {
            let queue = Arc::clone(&queue);
            let log = Arc::clone(&log);
            let worker_limits = limits.clone();
            // The thread's stack holds QuickJS's limit plus Rust's own frames around it.
            std::thread::Builder::new()
                .name(format!("js-worker-{index}"))
                .stack_size(limits.stack_bytes + (2 << 20))
                .spawn(move || worker::run(worker_limits, log, &queue))
                .map_err(|e| JsError::Internal(format!("starting a worker thread: {e}")))?;
        }
        Ok(JsEngine { inner: Arc::new(EngineInner { jobs, limits, log }) })
    }

    pub fn limits(&self) -> &JsLimits {
        &self.inner.limits
    }

    /// Bytes of `log()` lines (and map throws) written to the server's log so far, within the
    /// log budgets (`log.rs`).
    pub fn logged_bytes(&self) -> u64 {
        self.inner.log.written_bytes()
    }

    /// Queues `job` for a worker and awaits its answer; refuses at once when the queue is full.
    async fn run<T, F>(&self, job: F) -> Result<T, JsError>
    where
        T: Send + 'static,
        F: FnOnce(&mut Worker) -> Result<T, JsError> + Send + 'static,
    {
        let (answer, answered) = oneshot::channel();
        let job: Job = Box::new(move |worker| {
            // The caller may have gone away; its answer is then dropped.
            let _ = answer.send(job(worker));
        });
        match self.inner.jobs.try_send(job) {
            Ok(()) => {}
            Err(TrySendError::Full(_)) => return Err(JsError::Busy),
            Err(TrySendError::Disconnected(_)) => return Err(JsError::Internal("every worker has stopped".into())),
        }
        answered.await.map_err(|_| JsError::Internal("the worker failed during the call".into()))?
    }

    /// Runs the named views' map functions over a batch of documents: per document, per view
    /// (in `views` order), the rows it emitted or the message it threw. Past
    /// [`JsLimits::map_call_bytes`] of answers it answers the first documents only (at least
    /// one); the caller maps the rest in another call.
    pub async fn map_texts(
        &self,
        ddoc: &DesignCode,
        views: &[String],
        docs: Vec<Arc<DocText>>,
    ) -> Result<Vec<MapOutcome>, JsError> {
        let ddoc = ddoc.clone();
        let views = views.to_vec();
        self.run(move |worker| worker.map(&ddoc, &views, &docs)).await
    }

    /// [`JsEngine::map_texts`] of documents given as values (each written as JSON first).
    pub async fn map(
        &self,
        ddoc: &DesignCode,
        views: &[String],
        docs: Vec<Arc<Value>>,
    ) -> Result<Vec<MapOutcome>, JsError> {
        let texts = docs.iter().map(|doc| Arc::new(DocText::from_value(Value::clone(doc)))).collect();
        self.map_texts(ddoc, views, texts).await
    }

    /// A view's JavaScript reduce over `(key, value)` rows, keys being `[key, docid]`.
    pub async fn reduce(
        &self,
        ddoc: &DesignCode,
        view: &str,
        keys_and_values: Vec<(Value, Value)>,
    ) -> Result<Value, JsError> {
        let ddoc = ddoc.clone();
        let view = view.to_owned();
        let input =
            Value::Array(keys_and_values.into_iter().map(|(key, value)| Value::Array(vec![key, value])).collect());
        self.run(move |worker| worker.reduce(&ddoc, &view, &input, false)).await
    }

    /// A view's JavaScript reduce over earlier reductions (`rereduce` true, keys null).
    pub async fn rereduce(&self, ddoc: &DesignCode, view: &str, values: Vec<Value>) -> Result<Value, JsError> {
        let ddoc = ddoc.clone();
        let view = view.to_owned();
        let input = Value::Array(values);
        self.run(move |worker| worker.reduce(&ddoc, &view, &input, true)).await
    }

    /// The design document's `validate_doc_update(newDoc, oldDoc, userCtx, secObj)`.
    pub async fn validate(
        &self,
        ddoc: &DesignCode,
        new_doc: &Value,
        old_doc: Option<&Value>,
        user_ctx: &Value,
        sec_obj: &Value,
    ) -> Result<Validation, JsError> {
        let ddoc = ddoc.clone();
        let args = Value::Array(vec![
            new_doc.clone(),
            old_doc.cloned().unwrap_or(Value::Null),
            user_ctx.clone(),
            sec_obj.clone(),
        ]);
        self.run(move |worker| worker.validate(&ddoc, &args)).await
    }

    /// The design document's `filters.NAME(doc, req)` over a batch of documents.
    pub async fn filter(
        &self,
        ddoc: &DesignCode,
        filter: &str,
        docs: Vec<Arc<Value>>,
        req: &Value,
    ) -> Result<Vec<bool>, JsError> {
        let ddoc = ddoc.clone();
        let filter = filter.to_owned();
        let req = req.clone();
        self.run(move |worker| worker.filter(&ddoc, &filter, &docs, &req)).await
    }

    /// Compiles the function at `path` of the design document (`["views", NAME, "map"]`), as
    /// CouchDB compiles a design document's view functions when it is written.
    pub async fn compile(&self, ddoc: &DesignCode, path: Vec<String>) -> Result<(), JsError> {
        let ddoc = ddoc.clone();
        self.run(move |worker| worker.compile_path(&ddoc, &path)).await
    }

    /// `_changes?filter=_view&view=DDOC/NAME`: whether the view's map function emits anything
    /// for each document.
    pub async fn filter_view(
        &self,
        ddoc: &DesignCode,
        view: &str,
        docs: Vec<Arc<Value>>,
    ) -> Result<Vec<bool>, JsError> {
        let ddoc = ddoc.clone();
        let view = view.to_owned();
        self.run(move |worker| worker.filter_view(&ddoc, &view, &docs)).await
    }
}
