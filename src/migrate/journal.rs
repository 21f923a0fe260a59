//! What a following migration has put at the target, so it can tell its own writes from changes
//! made at the target by someone else.
//!
//! A live migration (`migrate --follow`) must overwrite the target's copy of a document each time
//! the source changes it, but must not overwrite a change made at the target independently (that is
//! a conflict for `--on-conflict`). The target's revisions are its own and say nothing about who
//! wrote them, so the migration keeps, per document id, the fingerprints of the states it wrote
//! there: a target document whose content has one of them is the migration's. Fingerprints are the
//! first 16 bytes of the [canonical content hash](super::canonical), or [`ABSENT`] for "deleted".
//!
//! Crash safety comes from the order: the fingerprint of a state is recorded (committed, fsync'd)
//! **before** the write that puts it at the target. After `kill -9` between the two, the target
//! holds either the old state or the new one, and both are recorded. Earlier fingerprints are kept
//! too, up to the last [`MAX_KEPT`]: a write a killed run had already sent can still land after
//! the next run has read the target (a request on its way to a remote store).
//!
//! The journal is a redb file beside the checkpoint (`<checkpoint>.journal`), about 100 bytes per
//! document; `--restart` deletes it with the checkpoint. redb because the crate already stores the
//! embedded backend with it: transactional, crash-safe, and bounded in memory by its page cache.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use redb::{Database, ReadableDatabase, TableDefinition};

use super::canonical::ContentHash;
use crate::error::{Error, ErrorKind, Result};

const OWNED: TableDefinition<&str, &[u8]> = TableDefinition::new("owned");

/// The part of a content hash kept: 128 bits, far beyond any chance of two states colliding.
pub type Fingerprint = [u8; 16];

/// The fingerprint of "no document" (a delete this migration made, or is about to make).
pub const ABSENT: Fingerprint = [0; 16];

/// Most fingerprints kept per document: the latest states written or about to be written (more
/// than two only when runs were killed with writes on their way, which may still land later).
pub const MAX_KEPT: usize = 6;

/// The redb page cache: lookups are by id in batches, so a small cache does.
const CACHE_BYTES: usize = 16 * 1024 * 1024;

pub fn fingerprint(hash: &ContentHash) -> Fingerprint {
    let mut print = [0; 16];
    print.copy_from_slice(&hash[..16]);
    print
}

/// The journal file of a checkpoint.
pub fn path_for(checkpoint: &Path) -> PathBuf {
    let mut name = checkpoint.as_os_str().to_owned();
    name.push(".journal");
    PathBuf::from(name)
}

/// Deletes a journal (for `--restart`); a missing file is fine.
pub fn remove(path: &Path) -> Result<()> {
    super::checkpoint::remove(path)
}

/// An open journal.
#[derive(Clone)]
pub struct Journal {
    db: Arc<Database>,
    path: PathBuf,
}

/// One document's new entry: the fingerprints to keep, most recent last.
pub type Entry = (String, Vec<Fingerprint>);

impl Journal {
    pub fn open(path: &Path) -> Result<Self> {
        let db = Database::builder().set_cache_size(CACHE_BYTES).create(path).map_err(|e| failure(path, "open", e))?;
        let txn = db.begin_write().map_err(|e| failure(path, "open", e))?;
        txn.open_table(OWNED).map_err(|e| failure(path, "open", e))?;
        txn.commit().map_err(|e| failure(path, "open", e))?;
        Ok(Journal { db: Arc::new(db), path: path.to_path_buf() })
    }

    /// The recorded fingerprints of each id (`None`: this migration never wrote it).
    pub async fn lookup(&self, ids: Vec<String>) -> Result<Vec<Option<Vec<Fingerprint>>>> {
        let journal = self.clone();
        run_blocking(move || {
            let txn = journal.db.begin_read().map_err(|e| failure(&journal.path, "read", e))?;
            let table = txn.open_table(OWNED).map_err(|e| failure(&journal.path, "read", e))?;
            ids.iter()
                .map(|id| {
                    let found = table.get(id.as_str()).map_err(|e| failure(&journal.path, "read", e))?;
                    Ok(found.map(|bytes| decode(bytes.value())))
                })
                .collect()
        })
        .await
    }

    /// Replaces the entries of these ids, durably, in one transaction.
    pub async fn record(&self, entries: Vec<Entry>) -> Result<()> {
        if entries.is_empty() {
            return Ok(());
        }
        let journal = self.clone();
        run_blocking(move || {
            let fail = |e: redb::Error| failure(&journal.path, "write", e);
            let txn = journal.db.begin_write().map_err(|e| fail(e.into()))?;
            {
                let mut table = txn.open_table(OWNED).map_err(|e| fail(e.into()))?;
                for (id, prints) in &entries {
                    let kept = &prints[prints.len().saturating_sub(MAX_KEPT)..];
                    table.insert(id.as_str(), kept.concat().as_slice()).map_err(|e| fail(e.into()))?;
                }
            }
            txn.commit().map_err(|e| fail(e.into()))
        })
        .await
    }
}

fn decode(bytes: &[u8]) -> Vec<Fingerprint> {
    bytes
        .chunks_exact(16)
        .map(|chunk| {
            let mut print = [0; 16];
            print.copy_from_slice(chunk);
            print
        })
        .collect()
}

async fn run_blocking<T: Send + 'static>(work: impl FnOnce() -> Result<T> + Send + 'static) -> Result<T> {
    tokio::task::spawn_blocking(work)
        .await
        .map_err(|e| Error::new(ErrorKind::Internal, "the migration journal's task failed").with_source(e))?
}

fn failure(path: &Path, what: &str, err: impl Into<redb::Error>) -> Error {
    let err: redb::Error = err.into();
    let kind = match &err {
        redb::Error::DatabaseAlreadyOpen => ErrorKind::InvalidInput,
        _ => ErrorKind::Internal,
    };
    let hint = if kind == ErrorKind::InvalidInput { " (another run of this migration is using it)" } else { "" };
    Error::new(kind, format!("cannot {what} the migration journal {}{hint}", path.display())).with_source(err)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn records_survive_reopening_and_keep_the_latest() {
        let dir = tempfile::tempdir().expect("temp dir");
        let path = path_for(&dir.path().join("cp.json"));
        let journal = Journal::open(&path).expect("open");
        let prints: Vec<Fingerprint> = (1..=6u8).map(|n| [n; 16]).collect();
        journal.record(vec![("a".into(), prints.clone()), ("b".into(), vec![ABSENT])]).await.expect("record");
        drop(journal);
        let journal = Journal::open(&path).expect("reopen");
        let found = journal.lookup(vec!["a".into(), "b".into(), "c".into()]).await.expect("lookup");
        assert_eq!(found, vec![Some(prints.clone()), Some(vec![ABSENT]), None]);
        let more: Vec<Fingerprint> = (1..=8u8).map(|n| [n; 16]).collect();
        journal.record(vec![("a".into(), more.clone())]).await.expect("record");
        assert_eq!(journal.lookup(vec!["a".into()]).await.expect("lookup")[0], Some(more[2..].to_vec()));
    }
}
