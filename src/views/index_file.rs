//! Which view index file this process takes: the first free slot of its directory, claimed at
//! startup and held for the process's life.
//!
//! redb locks an open file, so two `serve` processes on one host over one backend cannot share an
//! index file. Each claims a slot `views-{digest}-{k}.redb` (k below
//! `couchdb_view_index_slots`) by opening it: a slot another process holds is skipped, so each gets
//! a file of its own, and a restarted process takes a free one back with its rows still there.
//! A process that finds no free slot, or cannot open one, stops at startup with the path and the
//! setting named, rather than answering its first view query with a 500 (docs/views.md).

use std::path::{Path, PathBuf};

use super::index_store::IndexStore;
use crate::error::{Error, ErrorKind, Result};

/// The files a process may take as its view index, in the order it tries them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct IndexSlots {
    /// Slot files, first tried first.
    pub files: Vec<PathBuf>,
    /// The previous release's single file (`views-{digest}.redb`), renamed to the first slot when
    /// that slot does not exist yet, so an upgrade keeps its index.
    pub legacy: Option<PathBuf>,
    /// The setting that chose where the slots are, named when none can be taken.
    pub setting: &'static str,
}

impl IndexSlots {
    /// `count` slots `{stem}-{k}.redb` in `dir`, the previous release's `{stem}.redb` their first.
    pub fn in_directory(dir: &Path, stem: &str, count: usize, setting: &'static str) -> Self {
        IndexSlots {
            files: (0..count.max(1)).map(|k| dir.join(format!("{stem}-{k}.redb"))).collect(),
            legacy: Some(dir.join(format!("{stem}.redb"))),
            setting,
        }
    }

    /// The one file `path` (beside an embedded store, whose own lock admits one process).
    pub fn single(path: PathBuf, setting: &'static str) -> Self {
        IndexSlots { files: vec![path], legacy: None, setting }
    }
}

/// The index file this process claimed: open, and so locked, until it is dropped.
pub struct ClaimedIndex {
    pub path: PathBuf,
    pub store: IndexStore,
}

/// Claims the first free slot of `slots`, logging which one.
pub fn claim(slots: &IndexSlots) -> Result<ClaimedIndex> {
    adopt_legacy_file(slots);
    for path in &slots.files {
        let opened = IndexStore::try_open(path).map_err(|err| {
            Error::new(err.kind(), format!("{err} (the view index file; {} chooses its directory)", slots.setting))
        })?;
        match opened {
            Some(store) => {
                tracing::info!(path = %path.display(), "view index file claimed");
                return Ok(ClaimedIndex { path: path.clone(), store });
            }
            None => tracing::debug!(path = %path.display(), "view index slot held by another process"),
        }
    }
    Err(every_slot_taken(slots))
}

/// Renames the previous release's file to the first slot when that slot is not there yet. A
/// concurrent process may have moved it first; the rename then fails and the slot is used as is.
fn adopt_legacy_file(slots: &IndexSlots) {
    let (Some(legacy), Some(first)) = (&slots.legacy, slots.files.first()) else {
        return;
    };
    if legacy.exists() && !first.exists() {
        match std::fs::rename(legacy, first) {
            Ok(()) => tracing::info!(from = %legacy.display(), to = %first.display(), "view index file renamed"),
            Err(err) => tracing::debug!(from = %legacy.display(), %err, "view index file not renamed"),
        }
    }
}

fn every_slot_taken(slots: &IndexSlots) -> Error {
    let first = slots.files.first().map(|p| p.display().to_string()).unwrap_or_default();
    let last = slots.files.last().map(|p| p.display().to_string()).unwrap_or_default();
    let advice = if slots.files.len() == 1 {
        format!("give each serving process its own {}", slots.setting)
    } else {
        format!("raise couchdb_view_index_slots, or give this process its own {}", slots.setting)
    };
    Error::new(
        ErrorKind::Misconfigured,
        format!(
            "every view index slot is held by another process ({} file(s), {first} to {last}): {advice}",
            slots.files.len()
        ),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slots_are_numbered_and_the_old_name_is_their_first() {
        let slots = IndexSlots::in_directory(Path::new("/state"), "views-ab", 3, "couchdb_view_index_dir");
        let names: Vec<_> = slots.files.iter().map(|p| p.display().to_string()).collect();
        assert_eq!(names, ["/state/views-ab-0.redb", "/state/views-ab-1.redb", "/state/views-ab-2.redb"]);
        assert_eq!(slots.legacy.as_deref(), Some(Path::new("/state/views-ab.redb")));
        assert_eq!(IndexSlots::in_directory(Path::new("/s"), "v", 0, "x").files.len(), 1, "never no slot");
    }

    #[test]
    fn each_claim_takes_the_first_free_slot_and_a_released_one_is_taken_again() {
        let dir = tempfile::tempdir().expect("temp dir");
        let slots = IndexSlots::in_directory(dir.path(), "views-t", 2, "couchdb_view_index_dir");
        let first = claim(&slots).expect("slot 0");
        let second = claim(&slots).expect("slot 1");
        assert_eq!((first.path.clone(), second.path.clone()), (slots.files[0].clone(), slots.files[1].clone()));
        let refused = claim(&slots).err().expect("no third slot").to_string();
        assert!(refused.contains("couchdb_view_index_slots") && refused.contains("views-t-0.redb"), "{refused}");
        drop(first);
        assert_eq!(claim(&slots).expect("slot 0 again").path, slots.files[0]);
    }

    #[test]
    fn the_file_beside_an_embedded_store_is_one_slot() {
        let dir = tempfile::tempdir().expect("temp dir");
        let slots = IndexSlots::single(dir.path().join("store.redb.views.redb"), "couchdb_view_index_dir");
        let held = claim(&slots).expect("the one slot");
        let refused = claim(&slots).err().expect("no second slot").to_string();
        assert!(refused.contains("couchdb_view_index_dir") && refused.contains("store.redb.views.redb"), "{refused}");
        drop(held);
    }

    #[test]
    fn a_file_that_cannot_be_made_names_its_path_and_the_setting() {
        let dir = tempfile::tempdir().expect("temp dir");
        let not_a_directory = dir.path().join("file");
        std::fs::write(&not_a_directory, b"x").expect("a plain file");
        let slots = IndexSlots::in_directory(&not_a_directory, "views-t", 2, "couchdb_view_index_dir");
        let refused = claim(&slots).err().expect("no directory there").to_string();
        assert!(refused.contains("couchdb_view_index_dir") && refused.contains("file"), "{refused}");
    }

    #[test]
    fn the_previous_release_file_becomes_slot_zero() {
        let dir = tempfile::tempdir().expect("temp dir");
        let slots = IndexSlots::in_directory(dir.path(), "views-t", 2, "couchdb_view_index_dir");
        drop(IndexStore::open(dir.path().join("views-t.redb").as_path()).expect("old file"));
        let claimed = claim(&slots).expect("slot 0");
        assert_eq!(claimed.path, slots.files[0]);
        assert!(!dir.path().join("views-t.redb").exists(), "renamed, not copied");
    }
}
