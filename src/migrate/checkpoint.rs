//! The checkpoint file: where a migration stands, written atomically after every batch that is
//! completely written, so a run killed at any moment can be started again and continue.
//!
//! Writing: the JSON goes to a temporary file in the same directory, which is fsync'd and renamed
//! over the checkpoint, and then the directory is fsync'd. A reader therefore sees the old
//! checkpoint or the new one, never a torn one, even after a power cut.

use std::fs::File;
use std::io::Write;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use super::follow::FollowState;
use super::report::Ledger;
use super::source::Position;
use super::transform::AccessTracking;
use crate::error::{Error, ErrorKind, Result};

/// Bumped when the file's meaning changes; an unknown format is refused, not guessed at.
pub const FORMAT: u32 = 1;

/// What makes two runs the same migration. A checkpoint is only resumed by a run with an equal
/// identity. (Batch size, concurrency and the conflict policy may change between runs: they do
/// not change what a finished migration produces for documents already handled.)
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Identity {
    /// `migrate`, `export` or `import`.
    pub command: String,
    /// The source, as a redacted URL or `file:PATH`.
    pub from: String,
    /// The target, likewise.
    pub to: String,
    pub users: Vec<String>,
    pub namespaces: Vec<String>,
    pub access_tracking: AccessTracking,
}

impl Identity {
    /// The default checkpoint file for this migration, in the working directory:
    /// `.agentstore-<command>-<12 hex digits>.json`, the digits a hash of command, source,
    /// target and filters, so running the same command again finds it.
    pub fn default_path(&self) -> PathBuf {
        let mut hasher = Sha256::new();
        for part in [&self.command, &self.from, &self.to] {
            hasher.update(part.as_bytes());
            hasher.update([0]);
        }
        for list in [&self.users, &self.namespaces] {
            for item in list {
                hasher.update(item.as_bytes());
                hasher.update([0]);
            }
            hasher.update([1]);
        }
        let digest = hex::encode(hasher.finalize());
        PathBuf::from(format!(".agentstore-{}-{}.json", self.command, &digest[..12]))
    }
}

/// The checkpoint file's content.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Checkpoint {
    pub format: u32,
    pub identity: Identity,
    /// Where the source continues: everything before it is handled and written.
    pub position: Position,
    /// For an NDJSON target: its length after the last completed batch (it is truncated to this
    /// on resume, dropping lines a killed run wrote after the checkpoint).
    pub output_bytes: Option<u64>,
    pub ledger: Ledger,
    /// With `--follow`: the follow phase's position and counts, recorded before the copy began.
    /// `finished` then means the copy is finished; following goes on from here.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub follow: Option<FollowState>,
    pub finished: bool,
    /// Runs so far, the current one included.
    pub runs: u32,
    /// Wall-clock seconds of all runs up to the last save.
    pub elapsed_secs: f64,
    pub started_at: String,
    pub updated_at: String,
}

impl Checkpoint {
    pub fn new(identity: Identity) -> Self {
        let now = crate::model::timestamp::now();
        Checkpoint {
            format: FORMAT,
            identity,
            position: Position::Start,
            output_bytes: None,
            ledger: Ledger::default(),
            follow: None,
            finished: false,
            runs: 1,
            elapsed_secs: 0.0,
            started_at: now.clone(),
            updated_at: now,
        }
    }

    /// Refuses to resume a different migration from this file.
    pub fn check_identity(&self, path: &Path, wanted: &Identity) -> Result<()> {
        if &self.identity == wanted {
            return Ok(());
        }
        let saved = serde_json::to_string(&self.identity).unwrap_or_default();
        let asked = serde_json::to_string(wanted).unwrap_or_default();
        Err(Error::invalid(
            "checkpoint",
            format!(
                "{} belongs to another migration ({saved}); this run is {asked}. Use the same parameters to \
                 resume it, --restart to start over, or another --checkpoint file",
                path.display()
            ),
        ))
    }
}

/// Reads the checkpoint, or `None` when there is no file.
pub fn load(path: &Path) -> Result<Option<Checkpoint>> {
    let Some(checkpoint) = load_json::<Checkpoint>(path, "a checkpoint file")? else { return Ok(None) };
    if checkpoint.format != FORMAT {
        return Err(Error::invalid(
            "checkpoint",
            format!("{} has format {}; this version reads format {FORMAT}", path.display(), checkpoint.format),
        ));
    }
    Ok(Some(checkpoint))
}

/// Reads a checkpoint file of any command (`what` says what it should be, for the error), or
/// `None` when there is no file.
pub fn load_json<T: serde::de::DeserializeOwned>(path: &Path, what: &str) -> Result<Option<T>> {
    let text = match std::fs::read_to_string(path) {
        Ok(text) => text,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(io_error(path, "read the checkpoint", e)),
    };
    let value = serde_json::from_str(&text)
        .map_err(|e| Error::invalid("checkpoint", format!("{} is not {what}: {e}", path.display())).with_source(e))?;
    Ok(Some(value))
}

/// Replaces the checkpoint atomically and durably.
pub fn save(path: &Path, checkpoint: &Checkpoint) -> Result<()> {
    save_json(path, checkpoint)
}

/// Replaces the file at `path` with `value` as JSON, atomically and durably (see the module
/// documentation); any command's checkpoint file is written this way.
pub fn save_json<T: Serialize>(path: &Path, value: &T) -> Result<()> {
    let text = serde_json::to_vec_pretty(value)
        .map_err(|e| Error::new(ErrorKind::Internal, "encode the checkpoint").with_source(e))?;
    let dir = match path.parent() {
        Some(dir) if !dir.as_os_str().is_empty() => dir.to_path_buf(),
        _ => PathBuf::from("."),
    };
    let file_name = path.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_else(|| "checkpoint".into());
    let temporary = dir.join(format!(".{file_name}.tmp"));
    let mut file = File::create(&temporary).map_err(|e| io_error(&temporary, "create", e))?;
    file.write_all(&text).map_err(|e| io_error(&temporary, "write", e))?;
    file.sync_all().map_err(|e| io_error(&temporary, "fsync", e))?;
    drop(file);
    std::fs::rename(&temporary, path).map_err(|e| io_error(path, "replace", e))?;
    sync_directory(&dir)
}

/// Makes a rename in `dir` durable. Directories cannot be opened for fsync on Windows; there the
/// rename's durability is the file system's.
fn sync_directory(dir: &Path) -> Result<()> {
    if cfg!(unix) {
        File::open(dir).and_then(|d| d.sync_all()).map_err(|e| io_error(dir, "fsync directory", e))?;
    }
    Ok(())
}

/// Deletes the checkpoint (for `--restart`); a missing file is fine.
pub fn remove(path: &Path) -> Result<()> {
    match std::fs::remove_file(path) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => Err(io_error(path, "remove the checkpoint", e)),
        _ => Ok(()),
    }
}

pub(crate) fn io_error(path: &Path, what: &str, err: std::io::Error) -> Error {
    let kind = match err.kind() {
        std::io::ErrorKind::NotFound | std::io::ErrorKind::PermissionDenied => ErrorKind::InvalidInput,
        _ => ErrorKind::Internal,
    };
    Error::new(kind, format!("cannot {what} {}", path.display())).with_source(err)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn identity() -> Identity {
        Identity {
            command: "migrate".into(),
            from: "embedded:a.redb".into(),
            to: "embedded:b.redb".into(),
            users: vec!["u1".into()],
            namespaces: vec![],
            access_tracking: AccessTracking::Keep,
        }
    }

    #[test]
    fn saves_and_loads_atomically() {
        let dir = tempfile::tempdir().expect("temp dir");
        let path = dir.path().join("cp.json");
        assert_eq!(load(&path).expect("load"), None);
        let mut checkpoint = Checkpoint::new(identity());
        checkpoint.position = Position::Scan { token: "u1:ns:YQ==".into() };
        checkpoint.ledger.counts.written = 7;
        save(&path, &checkpoint).expect("save");
        assert_eq!(load(&path).expect("load"), Some(checkpoint.clone()));
        let leftovers: Vec<_> = std::fs::read_dir(dir.path()).expect("list").collect();
        assert_eq!(leftovers.len(), 1, "no temporary file is left behind");
        checkpoint.check_identity(&path, &identity()).expect("same identity");
        let mut other = identity();
        other.access_tracking = AccessTracking::Reset;
        let err = checkpoint.check_identity(&path, &other).expect_err("other identity");
        assert!(err.to_string().contains("--restart"), "{err}");
    }

    #[test]
    fn default_path_depends_on_what_is_migrated() {
        let a = identity().default_path();
        assert!(a.to_string_lossy().starts_with(".agentstore-migrate-"));
        let mut other = identity();
        other.users = vec![];
        other.namespaces = vec!["u1".into()];
        assert_ne!(a, other.default_path());
        let mut reset = identity();
        reset.access_tracking = AccessTracking::Reset;
        assert_eq!(a, reset.default_path(), "options do not move the file; they are checked against it");
    }

    #[test]
    fn refuses_garbage_and_unknown_formats() {
        let dir = tempfile::tempdir().expect("temp dir");
        let path = dir.path().join("cp.json");
        std::fs::write(&path, "{").expect("write");
        assert_eq!(load(&path).expect_err("garbage").kind(), ErrorKind::InvalidInput);
        let mut checkpoint = Checkpoint::new(identity());
        checkpoint.format = 99;
        std::fs::write(&path, serde_json::to_string(&checkpoint).expect("encode")).expect("write");
        assert!(load(&path).expect_err("format").to_string().contains("format 99"));
    }
}
