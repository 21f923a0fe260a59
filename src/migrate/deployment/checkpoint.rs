//! The checkpoints of a deployment move: a directory with one file per database (where its
//! source feed is handled up to, and its counts) and one naming the move (source and target), so
//! a run killed at any moment is started again with the same command and each database goes on
//! from its own position. Files are written atomically ([`super::super::checkpoint::save_json`]).

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};
use serde_json::Value;
use sha2::{Digest, Sha256};

use crate::backend::catalog::DbName;
use crate::error::{Error, ErrorKind, Result};
use crate::migrate::checkpoint::{io_error, load_json, save_json};

/// Bumped when the files' meaning changes; an unknown format is refused.
pub const FORMAT: u32 = 1;
const MOVE_FILE: &str = "move.json";

/// What makes two runs the same move.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct MoveIdentity {
    pub format: u32,
    pub from: String,
    pub to: String,
}

/// Where one database stands.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct DbCheckpoint {
    /// The source feed position every change before which is written (`null`: the start).
    pub since: Value,
    /// Whether one pass reached the end of the source feed (the copy is done; what follows is
    /// following).
    pub copied: bool,
    /// Whether the target database and its settings were made.
    pub prepared: bool,
    pub counts: Counts,
}

/// What was done for one database, over every run.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Counts {
    /// Changed documents read from the source feed.
    pub docs_seen: u64,
    /// Leaves the target lacked and was sent.
    pub leaves_written: u64,
    /// Of those, leaves with attachments, and the attachments' bytes.
    pub attachments: u64,
    pub attachment_bytes: u64,
    /// Leaves the target refused (named in the report).
    pub failed: u64,
}

impl Counts {
    pub fn add(&mut self, other: &Counts) {
        self.docs_seen += other.docs_seen;
        self.leaves_written += other.leaves_written;
        self.attachments += other.attachments;
        self.attachment_bytes += other.attachment_bytes;
        self.failed += other.failed;
    }
}

/// The checkpoint directory of one move.
#[derive(Debug, Clone)]
pub struct Checkpoints {
    dir: PathBuf,
}

impl Checkpoints {
    /// The default directory: `.agentstore-databases-<12 hex digits of source and target>` in
    /// the working directory, so the same command finds it again.
    pub fn default_dir(from: &str, to: &str) -> PathBuf {
        let mut hasher = Sha256::new();
        hasher.update(from.as_bytes());
        hasher.update([0]);
        hasher.update(to.as_bytes());
        PathBuf::from(format!(".agentstore-databases-{}", &hex::encode(hasher.finalize())[..12]))
    }

    /// Opens (or with `restart`, empties) the directory and checks it belongs to this move.
    pub fn open(dir: &Path, identity: &MoveIdentity, restart: bool) -> Result<Self> {
        if restart && dir.exists() {
            std::fs::remove_dir_all(dir).map_err(|e| io_error(dir, "remove the checkpoint directory", e))?;
        }
        std::fs::create_dir_all(dir).map_err(|e| io_error(dir, "create the checkpoint directory", e))?;
        let file = dir.join(MOVE_FILE);
        match load_json::<MoveIdentity>(&file, "checkpoint")? {
            Some(found) if found == *identity => {}
            Some(found) => {
                return Err(Error::new(
                    ErrorKind::InvalidInput,
                    format!(
                        "{} belongs to another move ({} → {}, format {}); use --restart or another --checkpoint",
                        dir.display(),
                        found.from,
                        found.to,
                        found.format
                    ),
                ))
            }
            None => save_json(&file, identity)?,
        }
        Ok(Checkpoints { dir: dir.to_path_buf() })
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    fn file(&self, db: &str) -> Result<PathBuf> {
        Ok(self.dir.join(format!("db-{}.json", DbName::parse(db)?.encoded())))
    }

    pub fn load(&self, db: &str) -> Result<DbCheckpoint> {
        Ok(load_json(&self.file(db)?, "checkpoint")?.unwrap_or_default())
    }

    pub fn save(&self, db: &str, checkpoint: &DbCheckpoint) -> Result<()> {
        save_json(&self.file(db)?, checkpoint)
    }

    pub fn remove(&self, db: &str) -> Result<()> {
        crate::migrate::checkpoint::remove(&self.file(db)?)
    }

    /// The databases that have a checkpoint (copied before, by this move).
    pub fn known(&self) -> Result<Vec<String>> {
        let entries = std::fs::read_dir(&self.dir).map_err(|e| io_error(&self.dir, "list the checkpoints", e))?;
        let mut names = Vec::new();
        for entry in entries.flatten() {
            let file = entry.file_name();
            let Some(encoded) = file.to_str().and_then(|f| f.strip_prefix("db-")).and_then(|f| f.strip_suffix(".json"))
            else {
                continue;
            };
            if let Some(name) = DbName::decode(encoded) {
                names.push(name.as_str().to_owned());
            }
        }
        names.sort();
        Ok(names)
    }
}
