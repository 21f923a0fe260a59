//! `agentstore upgrade`: brings a store written by an earlier release to this release's layout,
//! in place, page by page ([`DocumentBackend::upgrade_page`]), then records it
//! ([`DocumentBackend::finish_upgrade`]).
//!
//! Resumable: after every page the token of the next one goes to a checkpoint file, written
//! atomically like a migration's; a rerun resumes from it. The backend's steps are idempotent and
//! safe to repeat from any earlier token, so a run killed between a page and its checkpoint only
//! repeats that page. A store that is already current is left alone.
//!
//! ## The data-store database's design documents
//! The previous release kept them as local documents `:design:{name}` (one branch each, outside
//! the change feed and migrations); this one keeps them as the engine keeps every database's
//! design documents: records `_design/{name}` of the data-store layout.
//! [`move_data_store_design_documents`] (`crate::store`) moves each, every run of `upgrade` (whatever the rest of
//! the layout says, since a release that wrote them may have run after an earlier upgrade), and
//! the facade runs it too when it opens the store (`crate::store::DataStore::open`), so a server
//! started on this release without `upgrade` serves them (an operator replacing the binary
//! expects the design documents to stay; the move costs one listing of local documents when
//! there is none to move; a failure there is logged, not fatal: the data is served, the move
//! waits for the next open or `upgrade`). Each move is
//! crash-safe and idempotent: the leaf is written first as a replicated revision with its whole
//! path (so `_rev` and `_revisions` stay what clients hold; a revision the record has already is
//! a no-op), the local document removed last, on the revision read (a copy another process moved
//! or changed meanwhile is left for the next run). A move ends the data-store database's view
//! incarnation, so index groups built over the previous release's source are built again, not
//! read as this release's.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use clap::Args;
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use crate::backend::{DocumentBackend, LayoutState};
use crate::error::{Error, ErrorKind, Result};
use crate::migrate::checkpoint;
use crate::migrate::progress::{Progress, ProgressMode, Snapshot};
use crate::store::move_data_store_design_documents;

/// Largest `--batch`.
const MAX_BATCH: usize = 10_000;
/// Bumped when the checkpoint's meaning changes; an unknown format is refused.
const FORMAT: u32 = 1;
/// For tests only: milliseconds to pause after each page, so a test can kill a run part-way
/// through a small store.
const PAGE_DELAY_ENV: &str = "AGENTSTORE_UPGRADE_PAGE_DELAY_MS";

/// `agentstore upgrade`.
#[derive(Debug, Clone, Args)]
pub struct UpgradeArgs {
    /// Checkpoint file [default: ./.agentstore-upgrade-<hash of the backend>.json]
    #[arg(long, value_name = "FILE")]
    pub checkpoint: Option<PathBuf>,
    /// Documents examined per step
    #[arg(long, value_name = "N", default_value_t = 500)]
    pub batch: usize,
    /// Progress display on stderr
    #[arg(long, value_enum, default_value_t = ProgressMode::Auto)]
    pub progress: ProgressMode,
}

/// Where an upgrade stands, saved after every page.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
struct UpgradeCheckpoint {
    format: u32,
    /// The store being upgraded (its description); a checkpoint of another store is refused.
    backend: String,
    /// Where the next page starts; `None` before the first.
    next: Option<String>,
    examined: u64,
    upgraded: u64,
    /// Runs so far, the current one included.
    runs: u32,
    started_at: String,
    updated_at: String,
}

/// What `upgrade` prints on stdout.
#[derive(Debug, Serialize)]
struct UpgradeReport {
    backend: String,
    /// `upgraded`, or `already_current` when there was nothing to do.
    status: &'static str,
    /// Documents examined and rewritten, over every run of this upgrade.
    examined: u64,
    upgraded: u64,
    runs: u32,
    resumed: bool,
    checkpoint: String,
    elapsed_secs: f64,
}

/// The default checkpoint file: `.agentstore-upgrade-<12 hex digits>.json` in the working
/// directory, the digits a hash of the store's description, so rerunning finds it.
fn default_checkpoint_path(backend: &str) -> PathBuf {
    let digest = hex::encode(Sha256::digest(backend.as_bytes()));
    PathBuf::from(format!(".agentstore-upgrade-{}.json", &digest[..12]))
}

fn load(path: &Path, backend: &str) -> Result<Option<UpgradeCheckpoint>> {
    let Some(saved) = checkpoint::load_json::<UpgradeCheckpoint>(path, "an upgrade checkpoint")? else {
        return Ok(None);
    };
    if saved.format != FORMAT {
        return Err(Error::invalid(
            "checkpoint",
            format!("{} has format {}; this version reads format {FORMAT}", path.display(), saved.format),
        ));
    }
    if saved.backend != backend {
        return Err(Error::invalid(
            "checkpoint",
            format!(
                "{} belongs to the upgrade of {}, not {backend}; use another --checkpoint file",
                path.display(),
                saved.backend
            ),
        ));
    }
    Ok(Some(saved))
}

/// The words of the progress display: `read` counts documents examined, `landed` rewritten.
fn upgrade_detail(snapshot: &Snapshot) -> String {
    format!("{} upgraded", snapshot.landed)
}

fn page_delay() -> Option<Duration> {
    std::env::var(PAGE_DELAY_ENV).ok()?.parse().ok().map(Duration::from_millis)
}

/// Runs `agentstore upgrade` on `backend` and prints its report.
pub async fn run(backend: Arc<dyn DocumentBackend>, args: UpgradeArgs) -> Result<()> {
    if !(1..=MAX_BATCH).contains(&args.batch) {
        return Err(Error::invalid("batch", format!("must be 1 to {MAX_BATCH}")));
    }
    let started = Instant::now();
    let name = backend.describe();
    let path = args.checkpoint.clone().unwrap_or_else(|| default_checkpoint_path(&name));
    let saved = load(&path, &name)?;
    let moved = move_data_store_design_documents(&backend).await?;
    if moved > 0 {
        eprintln!("agentstore upgrade: moved {moved} design document(s) of the data-store database into records");
    }
    if backend.layout().await? == LayoutState::Current {
        // Finished earlier (perhaps killed after `finish_upgrade`, before removing its file).
        checkpoint::remove(&path)?;
        eprintln!("agentstore upgrade: {name} already has this release's layout; nothing to do");
        return emit(&UpgradeReport {
            backend: name,
            status: "already_current",
            examined: saved.as_ref().map_or(0, |s| s.examined),
            upgraded: saved.as_ref().map_or(0, |s| s.upgraded),
            runs: saved.as_ref().map_or(0, |s| s.runs),
            resumed: saved.is_some(),
            checkpoint: path.display().to_string(),
            elapsed_secs: started.elapsed().as_secs_f64(),
        });
    }
    let resumed = saved.is_some();
    let mut state = match saved {
        Some(mut saved) => {
            saved.runs += 1;
            saved
        }
        None => {
            let now = crate::model::timestamp::now();
            UpgradeCheckpoint {
                format: FORMAT,
                backend: name.clone(),
                next: None,
                examined: 0,
                upgraded: 0,
                runs: 1,
                started_at: now.clone(),
                updated_at: now,
            }
        }
    };
    let total = match args.progress {
        ProgressMode::None => None,
        _ => backend.approximate_count().await.ok().flatten(),
    };
    let mut progress = Progress::with_detail(args.progress, "upgrade", state.examined, total, upgrade_detail);
    let how = if resumed { "resuming from" } else { "checkpoint" };
    progress.say(&format!("agentstore upgrade: {how} {}", path.display()));
    checkpoint::save_json(&path, &state)?;
    upgrade_pages(backend.as_ref(), &args, &path, &mut state, &mut progress).await?;
    backend.finish_upgrade().await?;
    if let LayoutState::NeedsUpgrade(why) = backend.layout().await? {
        return Err(Error::new(
            ErrorKind::Internal,
            format!("{name} still needs an upgrade after every page was upgraded ({why})"),
        ));
    }
    progress.finish(snapshot(&state));
    checkpoint::remove(&path)?;
    emit(&UpgradeReport {
        backend: name,
        status: "upgraded",
        examined: state.examined,
        upgraded: state.upgraded,
        runs: state.runs,
        resumed,
        checkpoint: path.display().to_string(),
        elapsed_secs: started.elapsed().as_secs_f64(),
    })
}

/// Upgrades page after page from the checkpoint's position to the end, saving the position after
/// each.
async fn upgrade_pages(
    backend: &dyn DocumentBackend,
    args: &UpgradeArgs,
    path: &Path,
    state: &mut UpgradeCheckpoint,
    progress: &mut Progress,
) -> Result<()> {
    let delay = page_delay();
    loop {
        let page = backend.upgrade_page(state.next.as_deref(), args.batch).await?;
        state.examined += page.examined;
        state.upgraded += page.upgraded;
        state.next = page.next;
        state.updated_at = crate::model::timestamp::now();
        checkpoint::save_json(path, state)?;
        progress.update(snapshot(state));
        if state.next.is_none() {
            return Ok(());
        }
        if let Some(delay) = delay {
            tokio::time::sleep(delay).await;
        }
    }
}

fn snapshot(state: &UpgradeCheckpoint) -> Snapshot {
    Snapshot { read: state.examined, landed: state.upgraded, skipped: 0 }
}

fn emit(report: &UpgradeReport) -> Result<()> {
    let text = serde_json::to_string_pretty(report)
        .map_err(|e| Error::new(ErrorKind::Internal, "encode the report").with_source(e))?;
    println!("{text}");
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn checkpoints_of_another_store_or_format_are_refused() {
        let dir = tempfile::tempdir().expect("temp dir");
        let path = dir.path().join("up.json");
        assert_eq!(load(&path, "embedded:a").expect("no file"), None);
        let state = UpgradeCheckpoint {
            format: FORMAT,
            backend: "embedded:a".into(),
            next: Some("k".into()),
            examined: 3,
            upgraded: 2,
            runs: 1,
            started_at: "2024-01-01T00:00:00Z".into(),
            updated_at: "2024-01-01T00:00:00Z".into(),
        };
        checkpoint::save_json(&path, &state).expect("save");
        assert_eq!(load(&path, "embedded:a").expect("load"), Some(state.clone()));
        let err = load(&path, "embedded:b").expect_err("another store");
        assert!(err.to_string().contains("embedded:a"), "{err}");
        checkpoint::save_json(&path, &UpgradeCheckpoint { format: 9, ..state }).expect("save");
        assert!(load(&path, "embedded:a").expect_err("format").to_string().contains("format 9"));
        assert_ne!(default_checkpoint_path("embedded:a"), default_checkpoint_path("embedded:b"));
    }
}
