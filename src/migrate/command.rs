//! The `migrate`, `verify`, `export` and `import` subcommands: their flags, and how they open the
//! two sides (checking both before anything is written) and print the JSON report.

use std::path::{Path, PathBuf};

use clap::Args;
use serde::Serialize;

use super::census;
use super::deployment::{MoveOptions, Selection, Side as DbSide};
use super::progress::ProgressMode;
use super::sink::ConflictPolicy;
use super::transform::AccessTracking;
use super::verify::{verify, VerifyOptions};
use super::{Endpoint, Filter, Job, JobKind, Options};
use crate::backend::{self, BackendUrl};
use crate::config::Settings;
use crate::error::{Error, ErrorKind, Result};

/// Largest `--batch-size`: bulk requests stay well under every backend's request limits (the
/// DynamoDB adapter splits them into its own 25-item calls).
const MAX_BATCH_SIZE: usize = 10_000;
/// Largest `--concurrency`.
const MAX_CONCURRENCY: usize = 64;

/// Flags shared by `migrate`, `export` and `import`.
#[derive(Debug, Clone, Args)]
pub struct PipelineArgs {
    /// Copy only this user's documents (repeatable)
    #[arg(long = "user", value_name = "USER")]
    pub users: Vec<String>,
    /// Copy only documents in this namespace (repeatable; combines with --user)
    #[arg(long = "namespace", value_name = "NAMESPACE")]
    pub namespaces: Vec<String>,
    /// Documents per source page and per bulk write
    #[arg(long, value_name = "N", default_value_t = super::DEFAULT_BATCH_SIZE)]
    pub batch_size: usize,
    /// Batches written at once (reads continue meanwhile)
    #[arg(long, value_name = "N", default_value_t = super::DEFAULT_CONCURRENCY)]
    pub concurrency: usize,
    /// Keep accessCount and the last-access fields, or reset them (accessCount 0, no last access)
    #[arg(long, value_enum, default_value_t = AccessTracking::Keep)]
    pub access_tracking: AccessTracking,
    /// Checkpoint file [default: ./.agentstore-<command>-<hash of source, target, filters>.json]
    #[arg(long, value_name = "FILE")]
    pub checkpoint: Option<PathBuf>,
    /// Ignore an existing checkpoint and start over
    #[arg(long)]
    pub restart: bool,
    /// Read and check everything, report what would be written, write nothing
    #[arg(long)]
    pub dry_run: bool,
    /// Progress display on stderr
    #[arg(long, value_enum, default_value_t = ProgressMode::Auto)]
    pub progress: ProgressMode,
    /// Also write the JSON report to this file
    #[arg(long, value_name = "FILE")]
    pub report: Option<PathBuf>,
    /// Documents named per kind of issue in the report
    #[arg(long, value_name = "N", default_value_t = 20)]
    pub max_issues: usize,
}

/// `agentstore migrate`.
#[derive(Debug, Clone, Args)]
pub struct MigrateArgs {
    /// Source backend URL
    #[arg(long, value_name = "URL")]
    pub from: String,
    /// Target backend URL
    #[arg(long, value_name = "URL")]
    pub to: String,
    /// What to do with a document that exists at the target with different content
    #[arg(long, value_enum, default_value_t = ConflictPolicy::Fail)]
    pub on_conflict: ConflictPolicy,
    /// Skip the read-back that ends the migration (every document it is responsible for, compared
    /// by canonical hash at the target)
    #[arg(long)]
    pub no_verify: bool,
    /// After the copy, apply the source's changes made since it began, and keep following them
    /// until SIGINT/SIGTERM (see docs/migration.md#live-migration)
    #[arg(long)]
    pub follow: bool,
    /// Follow until every change committed before this run started is applied, then stop and
    /// read back (the cutover: stop the writers first). Implies --follow
    #[arg(long)]
    pub until_caught_up: bool,
    /// Move every database but the data-store one instead of data-store documents: revision
    /// trees, attachments, design documents, `_security`, `_revs_limit` (see
    /// docs/migration.md#moving-a-whole-deployment); --from and --to may then also be http(s)://
    /// CouchDB-protocol server URLs, and --checkpoint names a directory
    #[arg(long)]
    pub all_databases: bool,
    /// Only the databases of this name or pattern (`*`, `?`; repeatable; implies --all-databases;
    /// `_users`/`_replicator`, taken by default, only when named exactly)
    #[arg(long = "db", value_name = "PATTERN")]
    pub dbs: Vec<String>,
    /// Leave out the databases of this name or pattern (repeatable; with --all-databases;
    /// `--exclude _users` keeps the logins where they are)
    #[arg(long = "exclude", value_name = "PATTERN")]
    pub excludes: Vec<String>,
    /// With --all-databases: delete at the target a database this move copied that is gone
    /// from the source (without it, such a database is only reported)
    #[arg(long)]
    pub delete_missing: bool,
    /// With --all-databases: databases copied at once
    #[arg(long, value_name = "N", default_value_t = super::deployment::DEFAULT_DATABASES_AT_ONCE)]
    pub databases_at_once: usize,
    /// With --all-databases: pages of one database written at once (1 to 16; the next one is
    /// read meanwhile)
    #[arg(long, value_name = "N", default_value_t = super::deployment::DEFAULT_PAGES_AT_ONCE)]
    pub pages_at_once: usize,
    #[command(flatten)]
    pub pipeline: PipelineArgs,
}

/// `agentstore export`.
#[derive(Debug, Clone, Args)]
pub struct ExportArgs {
    /// Source backend URL
    #[arg(long, value_name = "URL")]
    pub from: String,
    /// NDJSON file to write (refused if it exists and is not empty, unless --restart)
    #[arg(long, value_name = "FILE")]
    pub out: PathBuf,
    #[command(flatten)]
    pub databases: DatabaseFileArgs,
    #[command(flatten)]
    pub pipeline: PipelineArgs,
}

/// `agentstore import`.
#[derive(Debug, Clone, Args)]
pub struct ImportArgs {
    /// Target backend URL
    #[arg(long, value_name = "URL")]
    pub to: String,
    /// NDJSON file to read, one document per line
    #[arg(long = "in", value_name = "FILE")]
    pub input: PathBuf,
    /// What to do with a document that exists at the target with different content
    #[arg(long, value_enum, default_value_t = ConflictPolicy::Fail)]
    pub on_conflict: ConflictPolicy,
    #[command(flatten)]
    pub databases: DatabaseFileArgs,
    #[command(flatten)]
    pub pipeline: PipelineArgs,
}

/// The flags of `export`/`import` of whole databases
/// (docs/migration.md#whole-databases-in-a-file-exportimport---all-databases).
#[derive(Debug, Clone, Args)]
pub struct DatabaseFileArgs {
    /// Whole databases (every database but the data-store one) instead of data-store documents:
    /// revision trees, attachments, design documents, `_security`, `_revs_limit`; --from (export)
    /// and --to (import) may then also be http(s):// CouchDB-protocol server URLs, a FILE ending
    /// in .gz is gzip-compressed, and import's --checkpoint names its checkpoint file
    #[arg(long)]
    pub all_databases: bool,
    /// Only the databases of this name or pattern (`*`, `?`; repeatable; implies --all-databases;
    /// `_users`/`_replicator`, taken by default, only when named exactly)
    #[arg(long = "db", value_name = "PATTERN")]
    pub dbs: Vec<String>,
    /// Leave out the databases of this name or pattern (repeatable; with --all-databases;
    /// `--exclude _users` keeps the logins where they are)
    #[arg(long = "exclude", value_name = "PATTERN")]
    pub excludes: Vec<String>,
    /// With --all-databases: the longest line written or read (a leaf's line holds its attachments
    /// as base64) [default: 256 MiB, or more to fit one attachment of couchdb_max_attachment_bytes]
    #[arg(long, value_name = "BYTES")]
    pub max_line_bytes: Option<u64>,
}

impl DatabaseFileArgs {
    fn chosen(&self) -> bool {
        self.all_databases || !self.dbs.is_empty()
    }

    /// Refuses the flags that go only with whole databases.
    fn refuse_without(&self) -> Result<()> {
        if !self.excludes.is_empty() || self.max_line_bytes.is_some() {
            return Err(Error::invalid("exclude", "--exclude and --max-line-bytes go with --all-databases or --db"));
        }
        Ok(())
    }

    fn selection(&self) -> Selection {
        Selection { include: self.dbs.clone(), exclude: self.excludes.clone() }
    }

    fn max_line_bytes(&self, settings: &Settings) -> Result<u64> {
        match self.max_line_bytes {
            Some(0) => Err(Error::invalid("max-line-bytes", "must be at least 1")),
            Some(bytes) => Ok(bytes),
            None => Ok(super::deployment::archive::default_max_line_bytes(
                settings.couchdb_max_document_bytes,
                settings.couchdb_max_attachment_bytes,
            )),
        }
    }
}

/// `agentstore verify`.
#[derive(Debug, Clone, Args)]
pub struct VerifyArgs {
    /// Source backend URL
    #[arg(long, value_name = "URL")]
    pub from: String,
    /// Target backend URL
    #[arg(long, value_name = "URL")]
    pub to: String,
    /// Compare only this user's documents (repeatable)
    #[arg(long = "user", value_name = "USER")]
    pub users: Vec<String>,
    /// Compare only documents in this namespace (repeatable)
    #[arg(long = "namespace", value_name = "NAMESPACE")]
    pub namespaces: Vec<String>,
    /// The access-tracking option the migration ran with
    #[arg(long, value_enum, default_value_t = AccessTracking::Keep)]
    pub access_tracking: AccessTracking,
    /// Compare source documents as stored, without the migration's repairs and normalisation
    #[arg(long)]
    pub raw: bool,
    /// Documents per page
    #[arg(long, value_name = "N", default_value_t = super::DEFAULT_BATCH_SIZE)]
    pub batch_size: usize,
    /// Pages looked up at once
    #[arg(long, value_name = "N", default_value_t = super::DEFAULT_CONCURRENCY)]
    pub concurrency: usize,
    /// Ids listed per kind of difference
    #[arg(long, value_name = "N", default_value_t = 20)]
    pub max_ids: usize,
    /// Progress display on stderr
    #[arg(long, value_enum, default_value_t = ProgressMode::Auto)]
    pub progress: ProgressMode,
    /// Also write the JSON report to this file
    #[arg(long, value_name = "FILE")]
    pub report: Option<PathBuf>,
    /// Move every database but the data-store one instead of data-store documents: revision
    /// trees, attachments, design documents, `_security`, `_revs_limit` (see
    /// docs/migration.md#moving-a-whole-deployment); --from and --to may then also be http(s)://
    /// CouchDB-protocol server URLs, and --checkpoint names a directory
    #[arg(long)]
    pub all_databases: bool,
    /// Only the databases of this name or pattern (`*`, `?`; repeatable; implies --all-databases;
    /// `_users`/`_replicator`, taken by default, only when named exactly)
    #[arg(long = "db", value_name = "PATTERN")]
    pub dbs: Vec<String>,
    /// Leave out the databases of this name or pattern (repeatable; with --all-databases;
    /// `--exclude _users` keeps the logins where they are)
    #[arg(long = "exclude", value_name = "PATTERN")]
    pub excludes: Vec<String>,
}

fn check_sizes(batch_size: usize, concurrency: usize) -> Result<()> {
    if !(1..=MAX_BATCH_SIZE).contains(&batch_size) {
        return Err(Error::invalid("batch-size", format!("must be 1 to {MAX_BATCH_SIZE}")));
    }
    if !(1..=MAX_CONCURRENCY).contains(&concurrency) {
        return Err(Error::invalid("concurrency", format!("must be 1 to {MAX_CONCURRENCY}")));
    }
    Ok(())
}

fn check_filter(settings: &Settings, users: &[String], namespaces: &[String]) -> Result<Filter> {
    let limits = settings.store_options().limits;
    for user in users {
        limits.check_user_id(user)?;
    }
    for namespace in namespaces {
        limits.check_namespace(namespace)?;
    }
    Ok(Filter { users: users.to_vec(), namespaces: namespaces.to_vec() })
}

impl PipelineArgs {
    fn options(&self, settings: &Settings, on_conflict: ConflictPolicy) -> Result<Options> {
        check_sizes(self.batch_size, self.concurrency)?;
        Ok(Options {
            batch_size: self.batch_size,
            concurrency: self.concurrency,
            on_conflict,
            access_tracking: self.access_tracking,
            filter: check_filter(settings, &self.users, &self.namespaces)?,
            dry_run: self.dry_run,
            checkpoint: self.checkpoint.clone(),
            restart: self.restart,
            progress: self.progress,
            max_issues: self.max_issues,
            verify: true,
            follow: super::FollowMode::Off,
        })
    }
}

/// Which side of a migration an endpoint is.
#[derive(Clone, Copy)]
enum Side {
    Source,
    Target,
}

impl Side {
    fn as_str(self) -> &'static str {
        match self {
            Side::Source => "source",
            Side::Target => "target",
        }
    }
}

/// Opens one side and checks it answers. A source (and either side of `verify`) must already
/// exist: opening a missing embedded file would create an empty store.
async fn open_backend(side: Side, text: &str, settings: &Settings, must_exist: bool) -> Result<(Endpoint, BackendUrl)> {
    let name = side.as_str();
    let context = |err: Error| Error::new(err.kind(), format!("{name} {text:?}")).with_source(err);
    let url = settings.resolve_backend_url(text).map_err(context)?;
    let context = |err: Error| Error::new(err.kind(), format!("{name} {url}")).with_source(err);
    if let BackendUrl::Embedded { path, .. } = &url {
        if must_exist && !path.exists() {
            return Err(Error::new(ErrorKind::InvalidInput, format!("{name} {url}: the file does not exist")));
        }
    }
    let backend = backend::open(&url).await.map_err(context)?;
    backend.health().await.map_err(context)?;
    let name = url.to_string();
    Ok((Endpoint::Backend { backend, name }, url))
}

fn refuse_same(from: &Endpoint, to: &Endpoint) -> Result<()> {
    if from.name() == to.name() {
        return Err(Error::invalid("to", format!("source and target are the same ({})", from.name())));
    }
    Ok(())
}

fn input_file(path: &Path) -> Result<Endpoint> {
    if !path.is_file() {
        return Err(Error::invalid("in", format!("{} is not a readable file", path.display())));
    }
    Ok(Endpoint::File(path.to_path_buf()))
}

/// Prints the report on stdout and, when asked, writes it to a file.
fn emit<T: Serialize>(report: &T, file: Option<&Path>) -> Result<()> {
    let text = serde_json::to_string_pretty(report)
        .map_err(|e| Error::new(ErrorKind::Internal, "encode the report").with_source(e))?;
    if let Some(file) = file {
        std::fs::write(file, format!("{text}\n"))
            .map_err(|e| Error::invalid("report", format!("cannot write {}: {e}", file.display())))?;
    }
    println!("{text}");
    Ok(())
}

/// Runs the job; a backend source is asked for what its scan leaves out.
async fn run_job(job: Job, report_file: Option<&Path>, stop: super::follow::StopSignal) -> Result<u8> {
    let left_behind = census::design_documents(&job.source).await?;
    let mut report = super::run_until(job, stop).await?;
    report.design_documents_left_behind = left_behind;
    emit(&report, report_file)?;
    Ok(report.exit_code())
}

/// `migrate`; returns the exit status.
pub async fn migrate(args: MigrateArgs, settings: &Settings) -> Result<u8> {
    // Handlers first, so a signal while the two sides are opened is a clean stop too.
    let stop = Box::pin(crate::server::shutdown_signal());
    if args.all_databases || !args.dbs.is_empty() {
        return migrate_databases(args, settings, stop).await;
    }
    if !args.excludes.is_empty() || args.delete_missing {
        return Err(Error::invalid("exclude", "--exclude and --delete-missing go with --all-databases or --db"));
    }
    let mut options = args.pipeline.options(settings, args.on_conflict)?;
    options.verify = !args.no_verify;
    options.follow = match (args.follow, args.until_caught_up) {
        (_, true) => super::FollowMode::UntilCaughtUp,
        (true, false) => super::FollowMode::Forever,
        (false, false) => super::FollowMode::Off,
    };
    let (source, _) = open_backend(Side::Source, &args.from, settings, true).await?;
    let (target, _) = open_backend(Side::Target, &args.to, settings, false).await?;
    refuse_same(&source, &target)?;
    let job = Job { kind: JobKind::Migrate, source, target, options };
    run_job(job, args.pipeline.report.as_deref(), stop).await
}

/// `export`; returns the exit status.
pub async fn export(args: ExportArgs, settings: &Settings) -> Result<u8> {
    if args.databases.chosen() {
        return export_databases(args, settings).await;
    }
    args.databases.refuse_without()?;
    let options = args.pipeline.options(settings, ConflictPolicy::Fail)?;
    let (source, _) = open_backend(Side::Source, &args.from, settings, true).await?;
    let target = Endpoint::File(args.out.clone());
    let job = Job { kind: JobKind::Export, source, target, options };
    run_job(job, args.pipeline.report.as_deref(), Box::pin(crate::server::shutdown_signal())).await
}

/// `import`; returns the exit status.
pub async fn import(args: ImportArgs, settings: &Settings) -> Result<u8> {
    if args.databases.chosen() {
        return import_databases(args, settings).await;
    }
    args.databases.refuse_without()?;
    let options = args.pipeline.options(settings, args.on_conflict)?;
    let source = input_file(&args.input)?;
    let (target, _) = open_backend(Side::Target, &args.to, settings, false).await?;
    let job = Job { kind: JobKind::Import, source, target, options };
    run_job(job, args.pipeline.report.as_deref(), Box::pin(crate::server::shutdown_signal())).await
}

/// `verify`; returns the exit status (0 identical, [`super::EXIT_DIFFERENT`] otherwise).
pub async fn verify_command(args: VerifyArgs, settings: &Settings) -> Result<u8> {
    if args.all_databases || !args.dbs.is_empty() {
        return verify_databases(args, settings).await;
    }
    check_sizes(args.batch_size, args.concurrency)?;
    let filter = check_filter(settings, &args.users, &args.namespaces)?;
    let (source, _) = open_backend(Side::Source, &args.from, settings, true).await?;
    let (target, _) = open_backend(Side::Target, &args.to, settings, true).await?;
    refuse_same(&source, &target)?;
    let options = VerifyOptions {
        batch_size: args.batch_size,
        concurrency: args.concurrency,
        access_tracking: args.access_tracking,
        filter,
        raw: args.raw,
        max_ids: args.max_ids,
        progress: args.progress,
        record: true,
    };
    let report = verify(&source, &target, &options).await?;
    emit(&report, args.report.as_deref())?;
    Ok(report.exit_code())
}

/// Opens the two sides of a deployment move and checks both answer (a missing embedded source is
/// refused: opening it would create an empty store).
async fn open_sides(from: &str, to: &str, settings: &Settings) -> Result<(DbSide, DbSide)> {
    let open = |side: &'static str, text: &str| -> Result<DbSide> {
        let context =
            |err: Error| Error::new(err.kind(), format!("{side} {text:?}: {}", err.message())).with_source(err);
        DbSide::parse(text, settings).map_err(context)
    };
    let (source, target) = (open("source", from)?, open("target", to)?);
    if let Ok(BackendUrl::Embedded { path, .. }) = settings.resolve_backend_url(from) {
        if !path.exists() && !path.with_extension("redb.databases").exists() {
            return Err(Error::invalid("from", format!("source {}: the file does not exist", path.display())));
        }
    }
    for (side, named) in [(&source, "source"), (&target, "target")] {
        side.check().await.map_err(|err| {
            Error::new(err.kind(), format!("{named} {}: {}", side.name(), err.message())).with_source(err)
        })?;
    }
    if source.name() == target.name() {
        return Err(Error::invalid("to", format!("source and target are the same ({})", source.name())));
    }
    Ok((source, target))
}

/// The progress record of a whole-deployment run from the command line, kept in the data-store
/// backend of its target `to` (docs/console.md, "Migrations' progress"), where a service over
/// that backend lists it in `_active_tasks`: `None` when the target is a CouchDB-protocol server
/// named by an `http(s)://` URL (no service of ours runs over it), an embedded store whose
/// data-store file does not exist (opening it would create it), or a backend that cannot be
/// opened now (logged: the run goes on without a record, as a failed record write does).
async fn deployment_record(
    command: &str,
    to: &str,
    settings: &Settings,
    source: &DbSide,
    target: &DbSide,
) -> Option<super::run_record::RunRecord> {
    if to.starts_with("http://") || to.starts_with("https://") {
        return None;
    }
    let url = settings.resolve_backend_url(to).ok()?;
    if let BackendUrl::Embedded { path, .. } = &url {
        if !path.exists() {
            return None;
        }
    }
    match backend::open(&url).await {
        Ok(backend) => Some(super::run_record::RunRecord::new(backend, command, &source.name(), &target.name())),
        Err(err) => {
            tracing::warn!(error = %err, "cannot open the target's data-store backend for the run's progress record");
            None
        }
    }
}

/// Opens one side of a deployment export or import and checks it answers (a missing embedded
/// source is refused: opening it would create an empty store).
async fn open_side(named: &'static str, text: &str, settings: &Settings, must_exist: bool) -> Result<DbSide> {
    let side = DbSide::parse(text, settings)
        .map_err(|err| Error::new(err.kind(), format!("{named} {text:?}: {}", err.message())).with_source(err))?;
    if must_exist {
        if let Ok(BackendUrl::Embedded { path, .. }) = settings.resolve_backend_url(text) {
            if !path.exists() && !path.with_extension("redb.databases").exists() {
                return Err(Error::invalid("from", format!("{named} {}: the file does not exist", path.display())));
            }
        }
    }
    side.check().await.map_err(|err| {
        Error::new(err.kind(), format!("{named} {}: {}", side.name(), err.message())).with_source(err)
    })?;
    Ok(side)
}

/// Refuses the data-store flags that mean nothing for whole databases.
fn refuse_data_store_flags(pipeline: &PipelineArgs) -> Result<()> {
    check_sizes(pipeline.batch_size, pipeline.concurrency)?;
    if !pipeline.users.is_empty() || !pipeline.namespaces.is_empty() {
        return Err(Error::invalid("user", "--user and --namespace select data-store documents, not databases"));
    }
    if pipeline.dry_run {
        return Err(Error::invalid("dry-run", "--dry-run is not supported with --all-databases"));
    }
    Ok(())
}

/// `export --all-databases` / `--db`; returns the exit status.
async fn export_databases(args: ExportArgs, settings: &Settings) -> Result<u8> {
    let stop = Box::pin(crate::server::shutdown_signal());
    let pipeline = &args.pipeline;
    refuse_data_store_flags(pipeline)?;
    if pipeline.checkpoint.is_some() {
        return Err(Error::invalid("checkpoint", "an export of whole databases has no checkpoint: it starts over"));
    }
    let source = open_side("source", &args.from, settings, true).await?;
    let options = super::deployment::archive::ExportOptions {
        selection: args.databases.selection(),
        batch_size: pipeline.batch_size,
        out: args.out.clone(),
        replace: pipeline.restart,
        max_line_bytes: args.databases.max_line_bytes(settings)?,
        progress: match pipeline.progress {
            ProgressMode::None => ProgressMode::None,
            _ => ProgressMode::Log,
        },
    };
    let report = super::deployment::archive::export(source, options, stop).await?;
    emit(&report, pipeline.report.as_deref())?;
    Ok(report.exit_code())
}

/// `import --all-databases` / `--db`; returns the exit status.
async fn import_databases(args: ImportArgs, settings: &Settings) -> Result<u8> {
    let stop = Box::pin(crate::server::shutdown_signal());
    let pipeline = &args.pipeline;
    refuse_data_store_flags(pipeline)?;
    if !args.input.is_file() {
        return Err(Error::invalid("in", format!("{} is not a readable file", args.input.display())));
    }
    let target = open_side("target", &args.to, settings, false).await?;
    let options = super::deployment::archive::ImportOptions {
        selection: args.databases.selection(),
        batch_size: pipeline.batch_size,
        input: args.input.clone(),
        checkpoint: pipeline.checkpoint.clone(),
        restart: pipeline.restart,
        max_line_bytes: args.databases.max_line_bytes(settings)?,
        pages_at_once: pipeline.concurrency,
        progress: match pipeline.progress {
            ProgressMode::None => ProgressMode::None,
            _ => ProgressMode::Log,
        },
        max_issues: pipeline.max_issues,
    };
    let report = super::deployment::archive::import(target, options, stop).await?;
    emit(&report, pipeline.report.as_deref())?;
    Ok(report.exit_code())
}

/// `migrate --all-databases` / `--db`; returns the exit status.
async fn migrate_databases(args: MigrateArgs, settings: &Settings, stop: super::follow::StopSignal) -> Result<u8> {
    let pipeline = &args.pipeline;
    check_sizes(pipeline.batch_size, pipeline.concurrency)?;
    if !pipeline.users.is_empty() || !pipeline.namespaces.is_empty() {
        return Err(Error::invalid("user", "--user and --namespace select data-store documents, not databases"));
    }
    if pipeline.dry_run {
        return Err(Error::invalid("dry-run", "--dry-run is not supported with --all-databases"));
    }
    if !(1..=MAX_CONCURRENCY).contains(&args.databases_at_once) {
        return Err(Error::invalid("databases-at-once", format!("must be 1 to {MAX_CONCURRENCY}")));
    }
    let max_pages = super::deployment::MAX_PAGES_AT_ONCE;
    if !(1..=max_pages).contains(&args.pages_at_once) {
        return Err(Error::invalid("pages-at-once", format!("must be 1 to {max_pages}")));
    }
    let (source, target) = open_sides(&args.from, &args.to, settings).await?;
    let options = MoveOptions {
        selection: Selection { include: args.dbs.clone(), exclude: args.excludes.clone() },
        batch_size: pipeline.batch_size,
        databases_at_once: args.databases_at_once,
        pages_at_once: args.pages_at_once,
        checkpoint: pipeline.checkpoint.clone(),
        restart: pipeline.restart,
        follow: match (args.follow, args.until_caught_up) {
            (_, true) => super::FollowMode::UntilCaughtUp,
            (true, false) => super::FollowMode::Forever,
            (false, false) => super::FollowMode::Off,
        },
        delete_missing: args.delete_missing,
        verify: !args.no_verify,
        progress: match pipeline.progress {
            ProgressMode::None => ProgressMode::None,
            _ => ProgressMode::Log,
        },
        max_issues: pipeline.max_issues,
    };
    let record = deployment_record("migrate", &args.to, settings, &source, &target).await;
    let report = super::deployment::run_recorded(source, target, options, stop, record).await?;
    emit(&report, pipeline.report.as_deref())?;
    Ok(report.exit_code())
}

/// `verify --all-databases` / `--db`; returns the exit status.
async fn verify_databases(args: VerifyArgs, settings: &Settings) -> Result<u8> {
    check_sizes(args.batch_size, args.concurrency)?;
    let (source, target) = open_sides(&args.from, &args.to, settings).await?;
    let selection = Selection { include: args.dbs.clone(), exclude: args.excludes.clone() };
    let names: Vec<String> = source.list().await?.into_iter().filter(|name| selection.admits(name)).collect();
    let record = deployment_record("verify", &args.to, settings, &source, &target).await;
    let run = super::deployment::verify::VerifyRun {
        batch: args.batch_size,
        max_ids: args.max_ids,
        progress: match args.progress {
            ProgressMode::None => ProgressMode::None,
            _ => ProgressMode::Log,
        },
        record,
        // SIGINT/SIGTERM end the process, as before: no partial report to print.
        stop: None,
    };
    let report = super::deployment::verify::verify_recorded(&source, &target, &names, run).await?;
    emit(&report, args.report.as_deref())?;
    Ok(if report.passed { 0 } else { super::EXIT_DIFFERENT })
}
