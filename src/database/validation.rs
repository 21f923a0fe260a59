//! CouchDB's `validate_doc_update`, a rule of the database (as in CouchDB's `couch_db`, not its
//! HTTP layer): every write to a document of a database (single, bulk, replicated, attachments,
//! multipart; on the data-store database after its own rules, [`super::write_guard::ChainedGuards`]) is checked against
//! each design document's validation function, run in the JavaScript engine, before it is applied
//! ([`super::write_guard`] asks; [`DesignValidation`] answers).
//!
//! Who writes is data the caller hands in: [`as_writer`] runs a piece of work as a [`Writer`]
//! (the CouchDB API runs each database request in it, with the request's login), and the guard
//! reads it as the functions' `userCtx` (`name`, `roles` with `_admin` for a server admin, `db`).
//! The check fails closed: a write made where no caller said who writes (a task spawned off a
//! request, a caller outside HTTP) is checked as an anonymous login's ([`Writer::anonymous`]),
//! never let through unchecked. Only the CouchDB API's databases carry this guard;
//! `migrate --all-databases` opens its own without one on purpose (it copies stored revisions as
//! they are, as a file copy would, not a client's writes).
//!
//! The validation functions of a database are read from its design documents and kept for
//! [`KEPT_FOR`]: a design document written through this process replaces them at once; one
//! written through another process sharing the store is seen here within that time.
//!
//! A design document itself is checked as CouchDB checks it on every write, replicated ones
//! included (`couch_mrview:validate`): each view's map function, and its reduce function unless
//! built in, must compile ([`design_compile_error`]), so a view never silently answers nothing.
//! The data-store database's design documents are checked the same way, through its write guard
//! (on the CouchDB backend that database's design documents are CouchDB's, which checks them).
//!
//! A function's failure is the crate's error with a [`FunctionFailure`] as its source, which the
//! HTTP layer answers as CouchDB does (`crate::couchdb_api::error`).

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use async_trait::async_trait;
use serde_json::Value;

use super::data_store_rules::Confinement;
use super::write_guard::{ProposedWrite, WriteGuard};
use super::Database;
use crate::backend::IdRange;
use crate::error::{Error, ErrorKind, Result};
use crate::js::{DesignCode, JsEngine, JsError, Validation};

/// How long a database's validation functions are kept before they are read again.
pub const KEPT_FOR: Duration = Duration::from_secs(2);
/// Databases whose functions are kept at once; past it the table is emptied (forgetting only
/// costs a read).
const MAX_KEPT: usize = 1024;

/// Who makes a write: the login a validation function sees as its `userCtx`, and what the
/// data-store database's rules let it write ([`super::data_store_rules`]).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Writer {
    /// The login's name; `None` for an anonymous one.
    pub name: Option<String>,
    /// Its roles, `_admin` first for a server admin.
    pub roles: Vec<String>,
    /// What it may write on the data-store database: `None` for a login without a data-store
    /// user, and wherever no caller said who writes (the data-store rules then refuse every write).
    pub data_store: Option<Confinement>,
}

impl Writer {
    /// A login with no name and no roles, the least a validation function can be asked to admit:
    /// who writes where no caller said so.
    pub fn anonymous() -> Self {
        Writer::default()
    }

    /// The `userCtx` the functions of database `db` are given.
    fn user_ctx(&self, db: &str) -> Value {
        serde_json::json!({ "name": self.name, "roles": self.roles, "db": db })
    }
}

tokio::task_local! {
    static WRITER: Writer;
}

/// Runs `work` with every write it makes (in this task) made by `writer`.
pub async fn as_writer<F: std::future::Future>(writer: Writer, work: F) -> F::Output {
    WRITER.scope(writer, work).await
}

/// Who makes the write under way: the caller's [`as_writer`], or [`Writer::anonymous`] outside one.
pub fn current_writer() -> Writer {
    WRITER.try_with(Writer::clone).unwrap_or_else(|_| {
        tracing::debug!("a write outside a request is validated as an anonymous login's");
        Writer::anonymous()
    })
}

/// A design function's failure, kept as the source of the crate's error so that the HTTP layer
/// answers it as CouchDB does.
#[derive(Debug, Clone)]
pub enum FunctionFailure {
    /// The call failed as a whole: time, memory, compilation, a throw that ends it, every worker
    /// busy, the engine itself.
    Call(JsError),
    /// A view function of a design document being written does not compile: CouchDB's 400
    /// `compilation_error` with this reason ("Compilation of the map function in the 'NAME'
    /// view failed: …").
    ViewCompilation(String),
}

impl std::fmt::Display for FunctionFailure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            FunctionFailure::Call(err) => write!(f, "{err}"),
            FunctionFailure::ViewCompilation(reason) => f.write_str(reason),
        }
    }
}

impl std::error::Error for FunctionFailure {}

impl FunctionFailure {
    /// The crate's error for this failure of `what`: invalid input (CouchDB answers these 4xx)
    /// unless the engine itself failed.
    fn into_error(self, what: &str) -> Error {
        let kind = match &self {
            FunctionFailure::Call(JsError::Internal(_)) => ErrorKind::Internal,
            _ => ErrorKind::InvalidInput,
        };
        Error::new(kind, format!("{what}: {self}")).with_source(self)
    }
}

/// Each database's validation functions and when they were read, by database name.
type KeptFunctions = HashMap<String, (Instant, Arc<Vec<DesignCode>>)>;

/// The guard: validation functions run in the engine.
pub struct DesignValidation {
    engine: JsEngine,
    kept: Mutex<KeptFunctions>,
}

impl DesignValidation {
    pub fn new(engine: JsEngine) -> Self {
        DesignValidation { engine, kept: Mutex::new(HashMap::new()) }
    }

    /// The database's validation functions, each with its design document.
    async fn functions(&self, db: &Database) -> Result<Arc<Vec<DesignCode>>> {
        if let Some((read_at, functions)) = self.lock().get(db.name()) {
            if read_at.elapsed() < KEPT_FOR {
                return Ok(Arc::clone(functions));
            }
        }
        let range = IdRange::design_documents();
        let mut functions = Vec::new();
        let mut token: Option<String> = None;
        loop {
            let page = db.all_docs(&range, 100, token.as_deref()).await?;
            for (id, state) in &page.items {
                let Some(winner) = state.tree.winner() else { continue };
                if !winner.body.get("validate_doc_update").is_some_and(Value::is_string) {
                    continue;
                }
                let doc = super::document::leaf_json(id, &state.tree, winner, Default::default());
                functions.push(DesignCode::new(db.name(), id.clone(), winner.path.leaf_rev(), Arc::new(doc)));
            }
            match page.next {
                Some(next) => token = Some(next),
                None => break,
            }
        }
        let functions = Arc::new(functions);
        let mut kept = self.lock();
        if kept.len() >= MAX_KEPT {
            kept.clear();
        }
        kept.insert(db.name().to_owned(), (Instant::now(), Arc::clone(&functions)));
        Ok(functions)
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, KeptFunctions> {
        self.kept.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }
}

/// The view functions CouchDB compiles when a design document is written
/// (`couch_mrview:validate`), for a design document in JavaScript (other languages are not
/// compiled, as CouchDB lets a design document of a language it does not know be saved): each
/// view with a `map` string, its map function, then its reduce function unless it is a
/// built-in (`_sum`, …). `(function type, view name, path)`, in view name order.
fn compiled_on_write(doc: &Value) -> Vec<(&'static str, String, Vec<String>)> {
    if !matches!(doc.get("language"), None | Some(Value::Null)) && doc["language"] != "javascript" {
        return Vec::new();
    }
    let Some(views) = doc.get("views").and_then(Value::as_object) else { return Vec::new() };
    let mut functions = Vec::new();
    for (name, view) in views {
        if !view.get("map").is_some_and(Value::is_string) {
            continue;
        }
        let path = |function: &str| vec!["views".to_owned(), name.clone(), function.to_owned()];
        functions.push(("map", name.clone(), path("map")));
        if view.get("reduce").and_then(Value::as_str).is_some_and(|reduce| !reduce.starts_with('_')) {
            functions.push(("reduce", name.clone(), path("reduce")));
        }
    }
    functions
}

/// Why the design document `doc` (with its `_id`) of `database` may not be written: the first
/// view function that does not compile ([`FunctionFailure::ViewCompilation`]), or a bound the
/// compilation ran past.
pub async fn design_compile_error(engine: &JsEngine, database: &str, doc: &Value) -> Option<FunctionFailure> {
    let functions = compiled_on_write(doc);
    if functions.is_empty() {
        return None;
    }
    let id = doc["_id"].as_str().unwrap_or_default();
    // Compiled in a realm of its own (no revision is the stored one's), so nothing it runs
    // while compiling is seen by the stored design document's calls.
    let code = DesignCode::new(database, id, "", Arc::new(doc.clone()));
    for (kind, view, path) in functions {
        match engine.compile(&code, path).await {
            Ok(()) => {}
            Err(JsError::Compile { message, .. }) => {
                return Some(FunctionFailure::ViewCompilation(format!(
                    "Compilation of the {kind} function in the '{view}' view failed: {message}"
                )))
            }
            Err(other) => return Some(FunctionFailure::Call(other)),
        }
    }
    None
}

fn message(value: &Value) -> String {
    value.as_str().map(str::to_owned).unwrap_or_else(|| value.to_string())
}

#[async_trait]
impl WriteGuard for DesignValidation {
    async fn applies(&self, db: &Database) -> Result<bool> {
        Ok(!self.functions(db).await?.is_empty())
    }

    async fn check(&self, db: &Database, writes: &[ProposedWrite]) -> Result<Vec<Option<Error>>> {
        let mut verdicts: Vec<Option<Error>> = writes.iter().map(|_| None).collect();
        let writer = current_writer();
        let functions = self.functions(db).await?;
        if functions.is_empty() {
            return Ok(verdicts);
        }
        let user_ctx = writer.user_ctx(db.name());
        let security = db.settings().await?.security;
        for (write, verdict) in writes.iter().zip(verdicts.iter_mut()) {
            for code in functions.iter() {
                let answer = self
                    .engine
                    .validate(code, &write.new_doc, write.old_doc.as_ref(), &user_ctx, &security)
                    .await
                    .map_err(|err| {
                        FunctionFailure::Call(err).into_error(&format!("validate_doc_update of {}", code.id))
                    })?;
                let refusal = match answer {
                    Validation::Allowed => continue,
                    Validation::Forbidden(reason) => Error::new(ErrorKind::Forbidden, message(&reason)),
                    Validation::Unauthorized(reason) => Error::new(ErrorKind::LoginRequired, message(&reason)),
                    // CouchDB answers these 500 `unknown_error`; the function refused the write,
                    // so here it is a refusal (403) with its message.
                    Validation::UnknownError(reason) => Error::new(ErrorKind::Forbidden, message(&reason)),
                };
                *verdict = Some(refusal);
                break;
            }
        }
        Ok(verdicts)
    }

    async fn check_design(&self, db: &Database, writes: &[ProposedWrite]) -> Result<Vec<Option<Error>>> {
        let mut verdicts = Vec::with_capacity(writes.len());
        for write in writes {
            let refusal = design_compile_error(&self.engine, db.name(), &write.new_doc).await;
            verdicts.push(refusal.map(|failure| failure.into_error("the design document")));
        }
        Ok(verdicts)
    }

    fn design_changed(&self, db: &Database) {
        self.lock().remove(db.name());
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::embedded::EmbeddedBackend;
    use crate::database::Write;
    use serde_json::json;

    fn edit(body: Value) -> Write {
        Write::Edit { parent: None, deleted: false, body: body.as_object().cloned().unwrap_or_default() }
    }

    /// A database whose validation function refuses a writer without a name.
    async fn guarded(dir: &tempfile::TempDir) -> Arc<Database> {
        let backend = Arc::new(EmbeddedBackend::open(&dir.path().join("v.redb")).await.unwrap());
        let engine = JsEngine::new(crate::js::JsLimits::default()).unwrap();
        let guard: Arc<dyn WriteGuard> = Arc::new(DesignValidation::new(engine));
        let db = Arc::new(Database::new("v".into(), backend).with_write_guard(Some(guard)));
        let validate = "function (newDoc, oldDoc, userCtx) { if (!userCtx.name) throw({forbidden: 'who writes?'}); }";
        db.write("_design/v", &edit(json!({ "validate_doc_update": validate }))).await.unwrap();
        db
    }

    /// A write where no request says who writes (made outside one, or from a task spawned off
    /// one, which does not inherit it) is validated as an anonymous login's, never let through.
    #[tokio::test]
    async fn a_write_without_a_request_is_validated() {
        let dir = tempfile::tempdir().unwrap();
        let db = guarded(&dir).await;
        let outside = db.write("outside", &edit(json!({ "n": 1 }))).await.unwrap_err();
        assert_eq!((outside.kind(), outside.message()), (ErrorKind::Forbidden, "who writes?"));

        let alice = Writer { name: Some("alice".into()), ..Writer::anonymous() };
        let spawned = as_writer(alice.clone(), async {
            let db = Arc::clone(&db);
            tokio::spawn(async move { db.write("spawned", &edit(json!({ "n": 2 }))).await }).await.unwrap()
        })
        .await
        .unwrap_err();
        assert_eq!(spawned.kind(), ErrorKind::Forbidden);

        as_writer(alice, db.write("named", &edit(json!({ "n": 3 })))).await.unwrap();
        assert!(db.read("outside").await.unwrap().is_none());
        assert!(db.read("spawned").await.unwrap().is_none());
        assert!(db.read("named").await.unwrap().is_some());
    }
}
