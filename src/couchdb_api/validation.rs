//! CouchDB's `validate_doc_update` on the databases besides the data-store one: every write to a
//! document (single, bulk, replicated, attachments, multipart) is checked against each design
//! document's validation function, run in the JavaScript engine, before it is applied
//! ([`crate::database::write_guard`] asks; this module answers).
//!
//! Who writes travels with the request: the database router runs each request inside
//! [`as_writer`], and the guard reads that `userCtx` (`name`, `roles` with `_admin` for a server
//! admin, `db`). Writes made outside a request (none today) are not checked.
//!
//! The validation functions of a database are read from its design documents and kept for
//! [`KEPT_FOR`]: a design document written through this process replaces them at once; one
//! written through another process sharing the store is seen here within that time.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use async_trait::async_trait;
use serde_json::Value;

use crate::backend::IdRange;
use crate::database::write_guard::{ProposedWrite, WriteGuard};
use crate::database::Database;
use crate::error::{Error, ErrorKind, Result};
use crate::js::{DesignCode, JsEngine, Validation};

/// How long a database's validation functions are kept before they are read again.
pub const KEPT_FOR: Duration = Duration::from_secs(2);
/// Databases whose functions are kept at once; past it the table is emptied (forgetting only
/// costs a read).
const MAX_KEPT: usize = 1024;

tokio::task_local! {
    static WRITER: Value;
}

/// Runs `work` as a request of the login `user_ctx` (`{"name", "roles"}`).
pub async fn as_writer<F: std::future::Future>(user_ctx: Value, work: F) -> F::Output {
    WRITER.scope(user_ctx, work).await
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
                let doc = crate::database::document::leaf_json(id, &state.tree, winner, Default::default());
                functions.push(DesignCode::new(id.clone(), winner.path.leaf_rev(), Arc::new(doc)));
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

fn message(value: &Value) -> String {
    value.as_str().map(str::to_owned).unwrap_or_else(|| value.to_string())
}

#[async_trait]
impl WriteGuard for DesignValidation {
    async fn applies(&self, db: &Database) -> Result<bool> {
        if WRITER.try_with(|_| ()).is_err() {
            return Ok(false);
        }
        Ok(!self.functions(db).await?.is_empty())
    }

    async fn check(&self, db: &Database, writes: &[ProposedWrite]) -> Result<Vec<Option<Error>>> {
        let mut verdicts: Vec<Option<Error>> = writes.iter().map(|_| None).collect();
        let Ok(mut user_ctx) = WRITER.try_with(Value::clone) else { return Ok(verdicts) };
        let functions = self.functions(db).await?;
        if functions.is_empty() {
            return Ok(verdicts);
        }
        user_ctx["db"] = Value::from(db.name());
        let security = db.settings().await?.security;
        for (write, verdict) in writes.iter().zip(verdicts.iter_mut()) {
            for code in functions.iter() {
                let answer = self
                    .engine
                    .validate(code, &write.new_doc, write.old_doc.as_ref(), &user_ctx, &security)
                    .await
                    .map_err(|err| {
                        Error::new(ErrorKind::InvalidInput, format!("validate_doc_update of {}: {err}", code.id))
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

    fn design_changed(&self, db: &Database) {
        self.lock().remove(db.name());
    }
}
