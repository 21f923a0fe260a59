//! A check every write to a document runs before it is applied: CouchDB's
//! `validate_doc_update`, whose functions live in the database's design documents and run in
//! the JavaScript engine ([`super::validation`] is that guard, which the CouchDB API installs on
//! its databases; the engine only asks it).
//!
//! The guard sees each proposed document as CouchDB passes it to the functions: the new body with
//! `_id`, the `_rev` it was written against (a replicated revision's own), `_deleted` for a
//! deletion, attachments as stubs; and the current winner (`null` when there is none or it is
//! deleted). Local documents are not checked, as in CouchDB. Design documents are not given to
//! the validation functions (they need a database admin instead); their own functions are
//! checked instead ([`WriteGuard::check_design`]: CouchDB compiles a design document's view
//! functions on every write of it, replicated ones included).
//!
//! A database may need more than one guard (the data-store database: its own rules,
//! [`super::data_store_rules::DataStoreRules`], and `validate_doc_update`): [`ChainedGuards`] asks
//! them in turn, and a write's verdict is the first refusal.

use std::borrow::Cow;
use std::sync::Arc;

use async_trait::async_trait;
use futures::future::BoxFuture;
use serde_json::{Map, Value};

use super::doc_attachments::{shown_stub, ATTACHMENTS};
use super::engine::{Database, DocState, Write};
use crate::error::{Error, Result};

/// One write as the validation functions see it.
#[derive(Debug, Clone)]
pub struct ProposedWrite {
    pub new_doc: Value,
    pub old_doc: Option<Value>,
}

/// Decides whether writes may happen.
#[async_trait]
pub trait WriteGuard: Send + Sync {
    /// Whether writes to `db` are checked at all now (any validation function, and a writer to
    /// check): when not, no proposed document is built (a bulk write's bodies are not copied).
    async fn applies(&self, db: &Database) -> Result<bool>;

    /// For each proposed write, `None` to let it happen or the error refusing it
    /// (`ErrorKind::Forbidden` / `ErrorKind::LoginRequired`).
    async fn check(&self, db: &Database, writes: &[ProposedWrite]) -> Result<Vec<Option<Error>>>;

    /// [`WriteGuard::check`] of `writes` to the document `id` over its state as read, as the
    /// engine asks it. The default builds the proposed documents ([`proposed`]: a copy of every
    /// body, with its special members) and checks them; a guard that needs only the bodies
    /// checks the writes themselves and spares the copy (the data-store rules: it was a tenth of
    /// a data-store `_bulk_docs`, issue 38). [`ChainedGuards`] builds the copy once, for the
    /// first guard that needs it.
    async fn check_writes(
        &self,
        db: &Database,
        id: &str,
        state: Option<&DocState>,
        writes: &[Write],
    ) -> Result<Vec<Option<Error>>> {
        self.check(db, &proposed(id, state, writes)).await
    }

    /// Whether [`WriteGuard::check_writes`] checks the writes themselves, building no proposed
    /// document: [`ChainedGuards`] then does not build them for it.
    fn checks_writes_themselves(&self) -> bool {
        false
    }

    /// For each proposed write of a design document, `None` to let it happen or the error
    /// refusing it (a view function that does not compile). Runs for every writer, as CouchDB
    /// checks every write of a design document; the default lets every write happen.
    async fn check_design(&self, _db: &Database, writes: &[ProposedWrite]) -> Result<Vec<Option<Error>>> {
        Ok(writes.iter().map(|_| None).collect())
    }

    /// A design document of `db` changed through this process: its functions may have.
    fn design_changed(&self, db: &Database);
}

/// Guards asked in turn: a write is refused by the first guard that refuses it, and the guards
/// after it are not asked about it (a validation function does not run for a write already
/// refused).
pub struct ChainedGuards {
    guards: Vec<Arc<dyn WriteGuard>>,
}

impl ChainedGuards {
    /// The guards, in the order they are asked.
    pub fn new(guards: Vec<Arc<dyn WriteGuard>>) -> Self {
        ChainedGuards { guards }
    }

    /// The verdicts of every guard (through `ask`) on `writes`, the first refusal of each write
    /// kept; each guard is asked only about the writes no guard before it refused. The writes
    /// are copied only for a guard after a refusal: the copy of every proposed document for
    /// every guard was a sixteenth of a data-store `_bulk_docs` (issue 38).
    async fn first_refusals<'a, F>(&'a self, writes: &'a [ProposedWrite], ask: F) -> Result<Vec<Option<Error>>>
    where
        F: Fn(&'a dyn WriteGuard, Cow<'a, [ProposedWrite]>) -> BoxFuture<'a, Result<Vec<Option<Error>>>>,
    {
        self.first_refusals_from(writes, writes.iter().map(|_| None).collect(), ask).await
    }

    /// [`WriteGuard::check`] of the chain over `writes`, the writes `verdicts` already refuses
    /// (guards before this chain did) not asked again.
    async fn first_refusals_after(
        &self,
        db: &Database,
        writes: &[ProposedWrite],
        verdicts: Vec<Option<Error>>,
    ) -> Result<Vec<Option<Error>>> {
        self.first_refusals_from(writes, verdicts, |guard, asked| {
            Box::pin(async move {
                if !guard.applies(db).await? {
                    return Ok(asked.iter().map(|_| None).collect());
                }
                guard.check(db, &asked).await
            })
        })
        .await
    }

    /// [`ChainedGuards::first_refusals`] from `verdicts` already reached.
    async fn first_refusals_from<'a, F>(
        &'a self,
        writes: &'a [ProposedWrite],
        mut verdicts: Vec<Option<Error>>,
        ask: F,
    ) -> Result<Vec<Option<Error>>>
    where
        F: Fn(&'a dyn WriteGuard, Cow<'a, [ProposedWrite]>) -> BoxFuture<'a, Result<Vec<Option<Error>>>>,
    {
        for guard in &self.guards {
            let open: Vec<usize> = (0..writes.len()).filter(|&at| verdicts[at].is_none()).collect();
            if open.is_empty() {
                break;
            }
            let asked = if open.len() == writes.len() {
                Cow::Borrowed(writes)
            } else {
                Cow::Owned(open.iter().map(|&at| writes[at].clone()).collect())
            };
            let answers = ask(guard.as_ref(), asked).await?;
            for (at, answer) in open.into_iter().zip(answers) {
                verdicts[at] = answer;
            }
        }
        Ok(verdicts)
    }
}

#[async_trait]
impl WriteGuard for ChainedGuards {
    async fn applies(&self, db: &Database) -> Result<bool> {
        for guard in &self.guards {
            if guard.applies(db).await? {
                return Ok(true);
            }
        }
        Ok(false)
    }

    async fn check(&self, db: &Database, writes: &[ProposedWrite]) -> Result<Vec<Option<Error>>> {
        self.first_refusals_after(db, writes, writes.iter().map(|_| None).collect()).await
    }

    /// Each guard asked in turn about the writes no guard before it refused, as
    /// [`ChainedGuards::check`] asks them; the proposed documents are built only once a guard
    /// that applies needs them, and then checked through [`ChainedGuards::check`] by the guards
    /// from that one on.
    async fn check_writes(
        &self,
        db: &Database,
        id: &str,
        state: Option<&DocState>,
        writes: &[Write],
    ) -> Result<Vec<Option<Error>>> {
        let mut verdicts: Vec<Option<Error>> = writes.iter().map(|_| None).collect();
        for (at, guard) in self.guards.iter().enumerate() {
            if !guard.checks_writes_themselves() {
                let rest = ChainedGuards { guards: self.guards[at..].to_vec() };
                // Built only for a guard that applies: on a database without validation
                // functions the copies were 6% of a data-store create's instructions over
                // CouchDB, and 5% of a data-store `_bulk_docs` (issue 38, session 19).
                if !rest.applies(db).await? {
                    break;
                }
                let proposed = proposed(id, state, writes);
                return rest.first_refusals_after(db, &proposed, verdicts).await;
            }
            let open: Vec<usize> = (0..writes.len()).filter(|&at| verdicts[at].is_none()).collect();
            if open.is_empty() {
                break;
            }
            if !guard.applies(db).await? {
                continue;
            }
            let asked: Cow<'_, [Write]> = if open.len() == writes.len() {
                Cow::Borrowed(writes)
            } else {
                Cow::Owned(open.iter().map(|&at| writes[at].clone()).collect())
            };
            let answers = guard.check_writes(db, id, state, &asked).await?;
            for (at, answer) in open.into_iter().zip(answers) {
                verdicts[at] = answer;
            }
        }
        Ok(verdicts)
    }

    async fn check_design(&self, db: &Database, writes: &[ProposedWrite]) -> Result<Vec<Option<Error>>> {
        self.first_refusals(writes, |guard, asked| Box::pin(async move { guard.check_design(db, &asked).await })).await
    }

    fn design_changed(&self, db: &Database) {
        for guard in &self.guards {
            guard.design_changed(db);
        }
    }
}

/// The proposed documents of `writes` to `id` over the document as read.
pub fn proposed(id: &str, state: Option<&DocState>, writes: &[Write]) -> Vec<ProposedWrite> {
    let old_doc = state.and_then(|state| {
        let winner = state.tree.winner().filter(|leaf| !leaf.deleted)?;
        Some(super::document::leaf_json(id, &state.tree, winner, super::document::DocOptions::default()))
    });
    writes
        .iter()
        .map(|write| {
            let (rev, deleted, body) = match write {
                Write::Edit { parent, deleted, body } => (parent.clone(), *deleted, body),
                Write::Replicated { path, deleted, body } => (Some(path.leaf_rev()), *deleted, body),
            };
            ProposedWrite { new_doc: shown(id, rev, deleted, body), old_doc: old_doc.clone() }
        })
        .collect()
}

fn shown(id: &str, rev: Option<String>, deleted: bool, body: &Map<String, Value>) -> Value {
    let mut doc = Map::with_capacity(body.len() + 3);
    doc.insert("_id".into(), Value::from(id));
    if let Some(rev) = rev {
        doc.insert("_rev".into(), Value::from(rev));
    }
    for (name, value) in body {
        let value = match (name.as_str(), value) {
            (ATTACHMENTS, Value::Object(attachments)) => Value::Object(
                attachments.iter().map(|(name, attachment)| (name.clone(), shown_stub(attachment))).collect(),
            ),
            _ => value.clone(),
        };
        doc.insert(name.clone(), value);
    }
    if deleted {
        doc.insert("_deleted".into(), Value::Bool(true));
    }
    Value::Object(doc)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::ErrorKind;
    use std::sync::Mutex;

    /// Refuses the writes whose `n` is in `refused`, and remembers the `n`s it was asked about.
    struct Refusing {
        name: &'static str,
        refused: Vec<i64>,
        asked: Mutex<Vec<i64>>,
    }

    impl Refusing {
        fn new(name: &'static str, refused: Vec<i64>) -> Arc<Self> {
            Arc::new(Refusing { name, refused, asked: Mutex::default() })
        }

        fn asked(&self) -> Vec<i64> {
            self.asked.lock().map(|asked| asked.clone()).unwrap_or_default()
        }

        fn verdicts(&self, writes: &[ProposedWrite]) -> Vec<Option<Error>> {
            writes
                .iter()
                .map(|write| {
                    let n = write.new_doc["n"].as_i64().unwrap_or_default();
                    if let Ok(mut asked) = self.asked.lock() {
                        asked.push(n);
                    }
                    self.refused.contains(&n).then(|| Error::new(ErrorKind::Forbidden, self.name))
                })
                .collect()
        }
    }

    #[async_trait]
    impl WriteGuard for Refusing {
        async fn applies(&self, _db: &Database) -> Result<bool> {
            Ok(true)
        }
        async fn check(&self, _db: &Database, writes: &[ProposedWrite]) -> Result<Vec<Option<Error>>> {
            Ok(self.verdicts(writes))
        }
        async fn check_design(&self, _db: &Database, writes: &[ProposedWrite]) -> Result<Vec<Option<Error>>> {
            Ok(self.verdicts(writes))
        }
        fn design_changed(&self, _db: &Database) {}
    }

    fn writes(ns: &[i64]) -> Vec<ProposedWrite> {
        ns.iter().map(|n| ProposedWrite { new_doc: serde_json::json!({ "n": n }), old_doc: None }).collect()
    }

    #[tokio::test]
    async fn a_chain_gives_each_write_its_first_refusal_and_asks_no_further() {
        let dir = tempfile::tempdir().unwrap();
        let backend =
            Arc::new(crate::backend::embedded::EmbeddedBackend::open(&dir.path().join("g.redb")).await.unwrap());
        let db = Database::new("g".into(), backend);
        let (first, second) = (Refusing::new("first", vec![1]), Refusing::new("second", vec![1, 2]));
        let chain = ChainedGuards::new(vec![first.clone(), second.clone()]);
        for design in [false, true] {
            let verdicts = if design {
                chain.check_design(&db, &writes(&[0, 1, 2])).await.unwrap()
            } else {
                chain.check(&db, &writes(&[0, 1, 2])).await.unwrap()
            };
            let shown: Vec<Option<String>> =
                verdicts.iter().map(|v| v.as_ref().map(|e| e.message().to_owned())).collect();
            assert_eq!(shown, vec![None, Some("first".into()), Some("second".into())], "design: {design}");
        }
        assert_eq!(first.asked(), vec![0, 1, 2, 0, 1, 2]);
        assert_eq!(second.asked(), vec![0, 2, 0, 2], "a write the first guard refused is not asked again");
        assert!(chain.applies(&db).await.unwrap());
        assert!(!ChainedGuards::new(Vec::new()).applies(&db).await.unwrap());
    }
}
