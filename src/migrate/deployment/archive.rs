//! Whole databases in one portable file: `export --all-databases` writes every selected database
//! of a [`Side`] (each document's every leaf with its ancestry, attachments inline, design
//! documents, `_security`, `_revs_limit`) as NDJSON, and `import --all-databases` writes such a
//! file into a [`Side`] through its replicated write, resumably. The format is in
//! docs/migration.md ("Whole databases in a file").
//!
//! **The file.** A header line (`format`, `version`, an `export_id`), then per database a line
//! with its name and settings, one line per leaf as `_bulk_get?revs=true&attachments=true` shows
//! it, and an end line with the database's counts and the SHA-256 of its leaf lines; a last line
//! with the file's totals. Control lines never carry `_id`, leaf lines always do, so a document
//! body with a field called `database` or `end` is still a leaf. A name ending in `.gz` is
//! gzip-compressed (level 1: base64 and JSON shrink well, and fast compression keeps up with
//! the source).
//!
//! **Export** writes to a temporary file beside `--out`, renamed only after the last line is
//! written and synced: a killed export leaves no file that looks complete.
//!
//! **Import** first reads the whole file and checks its structure (every end line present, the
//! counts and digests equal): a truncated or altered file is refused before anything is written.
//! Then it creates each database, sets its settings and writes its leaves in pages (asking the
//! target first which leaves it lacks, as the move does; `pages_at_once` pages of a database at
//! once, recorded in file order); after each page the byte offset past it is saved in a
//! checkpoint, so after `kill -9` the same command goes on from there. A leaf
//! written twice is merged as already known, so a re-run from any point is safe.
//!
//! **Memory** is bounded by pages: import holds at most `pages_at_once` pages being written, one
//! waiting and one being read, each at most `batch_size` leaves and [`PAGE_BYTES`] of lines (a
//! page holds at least one line), and refuses a line longer than `max_line_bytes` naming the
//! limit; export holds two pages of the source's leaves.

use std::collections::{BTreeMap, HashSet, VecDeque};
use std::fs::File;
use std::io::{BufRead, BufReader, BufWriter, Read, Write};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde::de::IgnoredAny;
use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};
use sha2::{Digest, Sha256};

use super::side::Side;
use super::{Selection, LOCAL_DOCUMENTS};
use crate::backend::catalog::DbName;
use crate::error::{Error, ErrorKind, Result};
use crate::migrate::checkpoint::{io_error, load_json, remove, save_json};
use crate::migrate::follow::{StopFlag, StopSignal};
use crate::migrate::progress::ProgressMode;

/// The `format` of the header line.
pub const FORMAT: &str = "agentstore-databases";
/// The `version` of the header line; a file of another version is refused.
pub const VERSION: u64 = 1;
/// The longest line read or written by default (`--max-line-bytes`), unless the attachment
/// limit asks for more ([`default_max_line_bytes`]).
pub const DEFAULT_MAX_LINE_BYTES: u64 = 256 * 1024 * 1024;
/// Line bytes an import page holds at most (and at least one line).
pub const PAGE_BYTES: usize = 32 * 1024 * 1024;
/// Bumped when the import checkpoint's meaning changes.
const CHECKPOINT_FORMAT: u32 = 1;
/// How often progress is printed.
const PROGRESS_INTERVAL: Duration = Duration::from_secs(2);
/// Room for a leaf line's JSON beside its body and attachments' base64.
const LINE_OVERHEAD: u64 = 1024 * 1024;

/// The line limit when `--max-line-bytes` is not given: [`DEFAULT_MAX_LINE_BYTES`], or more when
/// `couchdb_max_attachment_bytes` is set so high that a leaf of the largest body with one
/// attachment of the largest size (4/3 of it as base64) would not fit.
pub fn default_max_line_bytes(max_document_bytes: usize, max_attachment_bytes: Option<u64>) -> u64 {
    match max_attachment_bytes {
        Some(attachment) => {
            let base64 = attachment.div_ceil(3).saturating_mul(4);
            DEFAULT_MAX_LINE_BYTES.max((max_document_bytes as u64).saturating_add(base64).saturating_add(LINE_OVERHEAD))
        }
        None => DEFAULT_MAX_LINE_BYTES,
    }
}

/// The first line.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Header {
    pub format: String,
    pub version: u64,
    /// Random, per export: an import checkpoint belongs to one file.
    pub export_id: String,
    pub exported_at: String,
    pub source: String,
    pub local_documents: String,
}

/// The line that starts a database.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct DatabaseLine {
    pub database: String,
    pub security: Value,
    pub revs_limit: Option<u64>,
}

/// The line that ends a database.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct DatabaseEnd {
    pub end_database: String,
    /// Changed documents the feed listed (a document changed during the export is listed again).
    pub documents: u64,
    pub leaves: u64,
    pub attachments: u64,
    pub attachment_bytes: u64,
    /// SHA-256 (hex) of the database's leaf lines, each with its `\n`.
    pub sha256: String,
}

/// The last line.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct FileEnd {
    pub end: String,
    pub databases: u64,
    pub leaves: u64,
}

/// What kind a line is, read without building its values.
#[derive(Deserialize)]
struct Probe {
    #[serde(rename = "_id")]
    id: Option<IgnoredAny>,
    format: Option<IgnoredAny>,
    database: Option<IgnoredAny>,
    end_database: Option<IgnoredAny>,
    end: Option<IgnoredAny>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    Leaf,
    Header,
    Database,
    DatabaseEnd,
    FileEnd,
}

/// A line parsed at the depth stored documents are read at: a leaf line wraps a document of the
/// deepest depth a database keeps in a few levels, past serde_json's default of 127.
fn parse_line<T: serde::de::DeserializeOwned>(line: &[u8]) -> serde_json::Result<T> {
    crate::model::depth::parse_stored(line)
}

fn kind_of(line: &[u8], at: &Place) -> Result<Kind> {
    let probe: Probe = parse_line(line).map_err(|e| at.error(format!("is not a JSON object: {e}")))?;
    Ok(if probe.id.is_some() {
        Kind::Leaf
    } else if probe.format.is_some() {
        Kind::Header
    } else if probe.database.is_some() {
        Kind::Database
    } else if probe.end_database.is_some() {
        Kind::DatabaseEnd
    } else if probe.end.is_some() {
        Kind::FileEnd
    } else {
        return Err(at.error("is neither a leaf (`_id`) nor a header, database, end_database or end line".into()));
    })
}

fn parse<T: serde::de::DeserializeOwned>(line: &[u8], at: &Place, what: &str) -> Result<T> {
    parse_line(line).map_err(|e| at.error(format!("is not a valid {what} line: {e}")))
}

/// A line's place in the file, for messages.
struct Place<'a> {
    path: &'a Path,
    line: u64,
}

impl Place<'_> {
    fn error(&self, problem: String) -> Error {
        Error::new(ErrorKind::InvalidInput, format!("{} line {}: {problem}", self.path.display(), self.line))
    }
}

fn is_gzip(path: &Path) -> bool {
    path.extension().is_some_and(|ext| ext.eq_ignore_ascii_case("gz"))
}

/// The file's lines, each at most `max` bytes, with the offset (in the uncompressed text) after
/// each.
struct LineReader {
    inner: Box<dyn BufRead + Send>,
    path: PathBuf,
    max: u64,
    /// Bytes of text consumed.
    offset: u64,
    /// Lines read.
    line: u64,
    /// Whether the last line read ended at the end of the file without its `\n`.
    unterminated: bool,
}

impl LineReader {
    fn open(path: &Path, max: u64) -> Result<Self> {
        let file = File::open(path).map_err(|e| io_error(path, "open", e))?;
        let inner: Box<dyn BufRead + Send> = if is_gzip(path) {
            Box::new(BufReader::with_capacity(1 << 20, flate2::read::MultiGzDecoder::new(BufReader::new(file))))
        } else {
            Box::new(BufReader::with_capacity(1 << 20, file))
        };
        Ok(LineReader { inner, path: path.to_path_buf(), max, offset: 0, line: 0, unterminated: false })
    }

    fn read_error(&self, err: std::io::Error) -> Error {
        Error::new(
            ErrorKind::InvalidInput,
            format!("{} cannot be read after line {} (truncated or corrupt?): {err}", self.path.display(), self.line),
        )
        .with_source(err)
    }

    /// Skips to `offset` (a position after a line), which is line number `line`.
    fn skip_to(&mut self, offset: u64, line: u64) -> Result<()> {
        let skipped =
            std::io::copy(&mut (&mut self.inner).take(offset), &mut std::io::sink()).map_err(|e| self.read_error(e))?;
        if skipped != offset {
            return Err(Error::invalid(
                "checkpoint",
                format!("names offset {offset} of {}, which is shorter; it was changed since", self.path.display()),
            ));
        }
        self.offset = offset;
        self.line = line;
        Ok(())
    }

    /// The next line (without its `\n`) into `buf`; `false` at the end of the file.
    fn next(&mut self, buf: &mut Vec<u8>) -> Result<bool> {
        buf.clear();
        loop {
            let available = match self.inner.fill_buf() {
                Ok(available) => available,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                Err(e) => return Err(self.read_error(e)),
            };
            if available.is_empty() {
                if buf.is_empty() {
                    return Ok(false);
                }
                self.line += 1;
                self.unterminated = true;
                return Ok(true);
            }
            let (take, done) = match available.iter().position(|b| *b == b'\n') {
                Some(at) => (at, true),
                None => (available.len(), false),
            };
            if (buf.len() + take) as u64 > self.max {
                return Err(Error::new(
                    ErrorKind::TooLarge,
                    format!(
                        "{} line {} is longer than the line limit of {} bytes (--max-line-bytes; a leaf's line holds \
                         its attachments as base64)",
                        self.path.display(),
                        self.line + 1,
                        self.max
                    ),
                ));
            }
            buf.extend_from_slice(&available[..take]);
            let consumed = take + usize::from(done);
            self.inner.consume(consumed);
            self.offset += consumed as u64;
            if done {
                self.line += 1;
                return Ok(true);
            }
        }
    }
}

/// What the check of a whole file found.
#[derive(Debug, Clone)]
pub struct FileSummary {
    pub header: Header,
    /// Every database in the file, in order, with its leaves.
    pub databases: Vec<(String, u64)>,
    pub leaves: u64,
}

/// Reads the whole file and checks its structure: the header first, every database ended by its
/// end line with equal counts and digest, the file's end line last with equal totals, nothing
/// after it. A truncated or altered file is an error naming the line.
pub fn check_file(path: &Path, max_line_bytes: u64) -> Result<FileSummary> {
    let mut reader = LineReader::open(path, max_line_bytes)?;
    let mut line = Vec::new();
    let truncated = |reader: &LineReader, what: &str| {
        Error::new(
            ErrorKind::InvalidInput,
            format!(
                "{} ends after line {} {what}: the file is truncated (or not a whole export)",
                path.display(),
                reader.line
            ),
        )
    };
    if !reader.next(&mut line)? {
        return Err(Error::invalid("in", format!("{} is empty", path.display())));
    }
    let at = Place { path, line: reader.line };
    if kind_of(&line, &at)? != Kind::Header {
        return Err(at.error(format!("is not the header of an {FORMAT} export")));
    }
    let header: Header = parse(&line, &at, "header")?;
    if header.format != FORMAT {
        return Err(at.error(format!("names format {:?}, not {FORMAT:?}", header.format)));
    }
    if header.version != VERSION {
        return Err(at.error(format!("is version {}; this build reads version {VERSION}", header.version)));
    }
    let mut databases: Vec<(String, u64)> = Vec::new();
    let mut names = HashSet::new();
    let mut current: Option<(String, u64, Sha256)> = None;
    let mut leaves = 0u64;
    loop {
        if !reader.next(&mut line)? {
            return Err(match &current {
                Some((name, _, _)) => truncated(&reader, &format!("inside database {name:?} (no end_database line)")),
                None => truncated(&reader, "without its end line"),
            });
        }
        let at = Place { path, line: reader.line };
        let kind = kind_of(&line, &at).map_err(|err| match reader.unterminated {
            true => {
                at.error(format!("is cut short (the file ends inside it): the file is truncated; {}", err.message()))
            }
            false => err,
        })?;
        match kind {
            Kind::Leaf => {
                let Some((_, count, hasher)) = current.as_mut() else {
                    return Err(at.error("is a leaf outside any database".into()));
                };
                *count += 1;
                hasher.update(&line);
                hasher.update(b"\n");
            }
            Kind::Database => {
                if let Some((name, _, _)) = &current {
                    return Err(at.error(format!("starts a database inside {name:?}, which has no end_database line")));
                }
                let start: DatabaseLine = parse(&line, &at, "database")?;
                DbName::parse(&start.database)
                    .map_err(|e| at.error(format!("names an invalid database: {}", e.message())))?;
                if !names.insert(start.database.clone()) {
                    return Err(at.error(format!("names database {:?} a second time", start.database)));
                }
                current = Some((start.database, 0, Sha256::new()));
            }
            Kind::DatabaseEnd => {
                let end: DatabaseEnd = parse(&line, &at, "end_database")?;
                let Some((name, count, hasher)) = current.take() else {
                    return Err(at.error("ends a database that was not started".into()));
                };
                if end.end_database != name {
                    return Err(at.error(format!("ends database {:?} inside {name:?}", end.end_database)));
                }
                if end.leaves != count {
                    return Err(at.error(format!(
                        "says database {name:?} has {} leaves; the file holds {count}: lines are missing",
                        end.leaves
                    )));
                }
                if end.sha256 != hex::encode(hasher.finalize()) {
                    return Err(
                        at.error(format!("database {name:?}: its lines' SHA-256 differs: the file was altered"))
                    );
                }
                leaves += count;
                databases.push((name, count));
            }
            Kind::FileEnd => {
                if let Some((name, _, _)) = &current {
                    return Err(at.error(format!("ends the file inside database {name:?}")));
                }
                let end: FileEnd = parse(&line, &at, "end")?;
                if end.end != FORMAT || end.databases != databases.len() as u64 || end.leaves != leaves {
                    return Err(at.error(format!(
                        "says {} databases and {} leaves; the file holds {} and {leaves}: lines are missing",
                        end.databases,
                        end.leaves,
                        databases.len()
                    )));
                }
                if reader.next(&mut line)? {
                    return Err(Place { path, line: reader.line }.error("follows the end line".into()));
                }
                return Ok(FileSummary { header, databases, leaves });
            }
            Kind::Header => return Err(at.error("is a second header".into())),
        }
    }
}

// ----------------------------------------------------------------------------------------------
// Export

/// How an export runs.
#[derive(Debug, Clone)]
pub struct ExportOptions {
    pub selection: Selection,
    /// Changes per feed page.
    pub batch_size: usize,
    pub out: PathBuf,
    /// Replace an existing non-empty `out` (`--restart`).
    pub replace: bool,
    pub max_line_bytes: u64,
    pub progress: ProgressMode,
}

/// How an export or import ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum ArchiveStatus {
    Complete,
    /// SIGINT/SIGTERM: an export wrote no file; an import resumes with the same command.
    Interrupted,
}

/// One database of an export.
#[derive(Debug, Clone, Serialize)]
pub struct ExportedDb {
    pub name: String,
    pub security: Value,
    pub revs_limit: Option<u64>,
    pub documents: u64,
    pub leaves: u64,
    pub attachments: u64,
    pub attachment_bytes: u64,
}

/// The report of an export.
#[derive(Debug, Clone, Serialize)]
pub struct ExportReport {
    pub command: &'static str,
    pub mode: &'static str,
    pub from: String,
    pub to: String,
    pub status: ArchiveStatus,
    pub export_id: String,
    pub gzip: bool,
    pub elapsed_seconds: f64,
    pub databases: Vec<ExportedDb>,
    pub documents: u64,
    pub leaves: u64,
    pub attachments: u64,
    pub attachment_bytes: u64,
    /// The file's size as written (compressed, for `.gz`).
    pub file_bytes: u64,
    pub docs_per_second: f64,
    pub max_line_bytes: u64,
    pub local_documents: &'static str,
    pub peak_rss_bytes: Option<u64>,
}

impl ExportReport {
    /// 8 interrupted, else 0.
    pub fn exit_code(&self) -> u8 {
        match self.status {
            ArchiveStatus::Interrupted => crate::migrate::EXIT_INTERRUPTED,
            ArchiveStatus::Complete => 0,
        }
    }
}

/// The text written, counted, and hashed per database.
struct ArchiveWriter {
    out: ExportSink<File>,
    hasher: Sha256,
}

/// Where an export's bytes go: a buffered file, or a gzip stream into one. It is finished
/// explicitly ([`ExportSink::finish`]): dropping a gzip encoder writes its trailer and dropping a
/// buffer writes its tail, each ignoring a failure, which would leave a truncated file renamed
/// as a finished export.
enum ExportSink<W: Write> {
    Plain(BufWriter<W>),
    Gzip(flate2::write::GzEncoder<BufWriter<W>>),
}

impl<W: Write> ExportSink<W> {
    fn new(inner: W, gzip: bool) -> Self {
        let buffered = BufWriter::with_capacity(1 << 20, inner);
        if gzip {
            ExportSink::Gzip(flate2::write::GzEncoder::new(buffered, flate2::Compression::fast()))
        } else {
            ExportSink::Plain(buffered)
        }
    }

    /// Writes the last bytes (the gzip trailer, the buffer's tail) and answers whether they were
    /// written.
    fn finish(self) -> std::io::Result<W> {
        let buffered = match self {
            ExportSink::Plain(buffered) => buffered,
            ExportSink::Gzip(encoder) => encoder.finish()?,
        };
        let mut inner = buffered.into_inner().map_err(std::io::IntoInnerError::into_error)?;
        inner.flush()?;
        Ok(inner)
    }
}

impl<W: Write> Write for ExportSink<W> {
    fn write(&mut self, bytes: &[u8]) -> std::io::Result<usize> {
        match self {
            ExportSink::Plain(out) => out.write(bytes),
            ExportSink::Gzip(out) => out.write(bytes),
        }
    }

    fn flush(&mut self) -> std::io::Result<()> {
        match self {
            ExportSink::Plain(out) => out.flush(),
            ExportSink::Gzip(out) => out.flush(),
        }
    }
}

impl ArchiveWriter {
    fn line<T: Serialize>(&mut self, value: &T, hash: bool) -> std::io::Result<usize> {
        let mut text = serde_json::to_vec(value).map_err(std::io::Error::other)?;
        text.push(b'\n');
        if hash {
            self.hasher.update(&text);
        }
        self.out.write_all(&text)?;
        Ok(text.len())
    }
}

/// A page of the source: its documents and their leaves with attachments inline.
struct SourcePage {
    docs: u64,
    last_seq: Value,
    at_end: bool,
    leaves: Vec<Map<String, Value>>,
}

async fn read_page(source: Side, db: String, since: Value, batch: usize) -> Result<SourcePage> {
    let page = source.changes(&db, &since, batch).await?;
    let wanted: Vec<(String, Vec<String>)> = page.docs.iter().map(|d| (d.id.clone(), d.leaves.clone())).collect();
    let leaves = if wanted.is_empty() { Vec::new() } else { source.read_leaves(&db, &wanted, true).await? };
    Ok(SourcePage { docs: page.docs.len() as u64, last_seq: page.last_seq, at_end: page.at_end, leaves })
}

/// The bytes of an inline attachment (3/4 of its base64, less padding).
fn inline_bytes(attachment: &Value) -> u64 {
    let Some(data) = attachment.get("data").and_then(Value::as_str) else { return 0 };
    let padding = data.bytes().rev().take_while(|b| *b == b'=').count() as u64;
    (data.len() as u64 / 4 * 3).saturating_sub(padding)
}

/// Writes one page's leaves; refuses a line past the limit, naming the leaf.
fn write_leaves_to(
    writer: &mut ArchiveWriter,
    db: &str,
    leaves: &[Map<String, Value>],
    max_line_bytes: u64,
    counts: &mut ExportedDb,
) -> Result<()> {
    for leaf in leaves {
        let mut text =
            serde_json::to_vec(leaf).map_err(|e| Error::new(ErrorKind::Internal, "encode a leaf").with_source(e))?;
        if text.len() as u64 > max_line_bytes {
            let field = |name: &str| leaf.get(name).and_then(Value::as_str).unwrap_or_default().to_owned();
            return Err(Error::new(
                ErrorKind::TooLarge,
                format!(
                    "database {db:?}, document {:?} revision {}: its line is {} bytes, past the line limit of \
                     {max_line_bytes} bytes (--max-line-bytes; give the same to import)",
                    field("_id"),
                    field("_rev"),
                    text.len()
                ),
            ));
        }
        text.push(b'\n');
        writer.hasher.update(&text);
        writer.out.write_all(&text).map_err(|e| Error::new(ErrorKind::Internal, "write the export").with_source(e))?;
        counts.leaves += 1;
        if let Some(Value::Object(attachments)) = leaf.get("_attachments") {
            counts.attachments += attachments.len() as u64;
            counts.attachment_bytes += attachments.values().map(inline_bytes).sum::<u64>();
        }
    }
    Ok(())
}

/// Runs `work` on the blocking pool with the writer, and gives it back.
async fn with_writer<T: Send + 'static>(
    writer: ArchiveWriter,
    work: impl FnOnce(&mut ArchiveWriter) -> Result<T> + Send + 'static,
) -> Result<(ArchiveWriter, T)> {
    tokio::task::spawn_blocking(move || {
        let mut writer = writer;
        let result = work(&mut writer);
        result.map(|value| (writer, value))
    })
    .await
    .map_err(|e| Error::new(ErrorKind::Internal, "the export writer task failed").with_source(e))?
}

/// Writes an export's last bytes ([`ExportSink::finish`]) and makes the file durable, off the
/// async threads.
async fn finish_export_file(writer: ArchiveWriter, partial: PathBuf) -> Result<()> {
    tokio::task::spawn_blocking(move || {
        let file = writer.out.finish().map_err(|e| io_error(&partial, "finish writing", e))?;
        file.sync_all().map_err(|e| io_error(&partial, "fsync", e))
    })
    .await
    .map_err(|e| Error::new(ErrorKind::Internal, "the export writer task failed").with_source(e))?
}

/// Progress of an export or import.
struct Board {
    verb: &'static str,
    unit: &'static str,
    started: Instant,
    done: AtomicU64,
    expected: AtomicU64,
    databases_done: AtomicU64,
    databases: AtomicU64,
    current: Mutex<String>,
}

impl Board {
    fn new(verb: &'static str, unit: &'static str) -> Arc<Self> {
        Arc::new(Board {
            verb,
            unit,
            started: Instant::now(),
            done: AtomicU64::new(0),
            expected: AtomicU64::new(0),
            databases_done: AtomicU64::new(0),
            databases: AtomicU64::new(0),
            current: Mutex::new(String::new()),
        })
    }

    fn line(&self) -> String {
        let done = self.done.load(Ordering::Relaxed);
        let expected = self.expected.load(Ordering::Relaxed).max(done);
        let rate = done as f64 / self.started.elapsed().as_secs_f64().max(0.001);
        let eta = if rate > 0.0 && expected > done {
            format!("{:.0}s", (expected - done) as f64 / rate)
        } else {
            "-".to_owned()
        };
        let current = self.current.lock().map(|c| c.clone()).unwrap_or_default();
        format!(
            "{}: databases {}/{} done; {} {done}/{expected}; {rate:.0} {}/s; ETA {eta}; database: {}",
            self.verb,
            self.databases_done.load(Ordering::Relaxed),
            self.databases.load(Ordering::Relaxed),
            self.unit,
            self.unit,
            if current.is_empty() { "-" } else { &current }
        )
    }

    fn set_current(&self, name: &str) {
        if let Ok(mut current) = self.current.lock() {
            *current = name.to_owned();
        }
    }

    /// Prints a line every [`PROGRESS_INTERVAL`] until the handle is dropped.
    fn tick(self: &Arc<Self>, mode: ProgressMode) -> Option<Ticker> {
        if mode == ProgressMode::None {
            return None;
        }
        let board = Arc::clone(self);
        Some(Ticker(tokio::spawn(async move {
            loop {
                tokio::time::sleep(PROGRESS_INTERVAL).await;
                eprintln!("{}", board.line());
            }
        })))
    }
}

struct Ticker(tokio::task::JoinHandle<()>);

impl Drop for Ticker {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// The temporary file an export writes before renaming it to `out`.
fn partial_path(out: &Path) -> PathBuf {
    let name = out.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_else(|| "export".into());
    out.with_file_name(format!(".{name}.partial"))
}

fn random_id() -> Result<String> {
    let mut bytes = [0u8; 16];
    getrandom::fill(&mut bytes).map_err(|e| Error::new(ErrorKind::Internal, format!("no random export id: {e}")))?;
    Ok(hex::encode(bytes))
}

/// Exports the selected databases of `source` to `options.out`.
pub async fn export(source: Side, options: ExportOptions, stop: StopSignal) -> Result<ExportReport> {
    let started = Instant::now();
    let out = &options.out;
    let existing = std::fs::metadata(out).map(|m| m.len()).unwrap_or(0);
    if existing > 0 && !options.replace {
        return Err(Error::invalid(
            "out",
            format!("{} exists and is not empty; remove it, or pass --restart to replace it", out.display()),
        ));
    }
    let stop = StopFlag::new(stop);
    let names: Vec<String> = source.list().await?.into_iter().filter(|name| options.selection.admits(name)).collect();
    let board = Board::new("export", "documents");
    board.databases.store(names.len() as u64, Ordering::Relaxed);
    for name in &names {
        board.expected.fetch_add(source.estimate(name).await?.unwrap_or(0), Ordering::Relaxed);
    }
    let _ticker = board.tick(options.progress);
    let partial = partial_path(out);
    let file = File::create(&partial).map_err(|e| io_error(&partial, "create", e))?;
    let gzip = is_gzip(out);
    let mut writer = ArchiveWriter { out: ExportSink::new(file, gzip), hasher: Sha256::new() };
    let header = Header {
        format: FORMAT.into(),
        version: VERSION,
        export_id: random_id()?,
        exported_at: chrono::Utc::now().to_rfc3339_opts(chrono::SecondsFormat::Millis, true),
        source: source.name(),
        local_documents: LOCAL_DOCUMENTS.into(),
    };
    let write_error = |e: std::io::Error| io_error(&partial, "write", e);
    writer.line(&header, false).map_err(write_error)?;
    let outcome = export_databases(&source, &options, &names, &stop, &board, writer).await;
    let (writer, databases) = match outcome {
        Ok(Some(done)) => done,
        stopped_or_failed => {
            // Nothing that looks like an export is left behind.
            let _ = std::fs::remove_file(&partial);
            stopped_or_failed?;
            return Ok(export_report(
                &source,
                &options,
                &header,
                gzip,
                started,
                Vec::new(),
                ArchiveStatus::Interrupted,
            ));
        }
    };
    let leaves: u64 = databases.iter().map(|d| d.leaves).sum();
    let end = FileEnd { end: FORMAT.into(), databases: databases.len() as u64, leaves };
    // The last line, then the gzip trailer and the buffer's tail, each failure failing the
    // export; then the bytes are made durable and the file takes its name.
    let finishing = partial.clone();
    let finish = with_writer(writer, move |writer| {
        writer.line(&end, false).map_err(|e| io_error(&finishing, "write", e))?;
        Ok(())
    })
    .await;
    let finish = match finish {
        Ok((writer, ())) => finish_export_file(writer, partial.clone()).await,
        Err(err) => Err(err),
    };
    if let Err(err) = finish {
        let _ = std::fs::remove_file(&partial);
        return Err(err);
    }
    std::fs::rename(&partial, out).map_err(|e| io_error(out, "rename the finished export to", e))?;
    if let Some(dir) = out.parent().filter(|d| !d.as_os_str().is_empty()) {
        if cfg!(unix) {
            File::open(dir).and_then(|d| d.sync_all()).map_err(|e| io_error(dir, "fsync directory", e))?;
        }
    }
    board.set_current("");
    if options.progress != ProgressMode::None {
        eprintln!("{}", board.line());
    }
    Ok(export_report(&source, &options, &header, gzip, started, databases, ArchiveStatus::Complete))
}

fn export_report(
    source: &Side,
    options: &ExportOptions,
    header: &Header,
    gzip: bool,
    started: Instant,
    databases: Vec<ExportedDb>,
    status: ArchiveStatus,
) -> ExportReport {
    let elapsed = started.elapsed().as_secs_f64();
    let sum = |f: fn(&ExportedDb) -> u64| databases.iter().map(f).sum::<u64>();
    let documents = sum(|d| d.documents);
    let file_bytes = match status {
        ArchiveStatus::Complete => std::fs::metadata(&options.out).map(|m| m.len()).unwrap_or(0),
        ArchiveStatus::Interrupted => 0,
    };
    ExportReport {
        command: "export",
        mode: "databases",
        from: source.name(),
        to: format!("file:{}", std::path::absolute(&options.out).unwrap_or_else(|_| options.out.clone()).display()),
        status,
        export_id: header.export_id.clone(),
        gzip,
        elapsed_seconds: (elapsed * 1000.0).round() / 1000.0,
        documents,
        leaves: sum(|d| d.leaves),
        attachments: sum(|d| d.attachments),
        attachment_bytes: sum(|d| d.attachment_bytes),
        databases,
        file_bytes,
        docs_per_second: (documents as f64 / elapsed.max(0.001)).round(),
        max_line_bytes: options.max_line_bytes,
        local_documents: LOCAL_DOCUMENTS,
        peak_rss_bytes: crate::migrate::report::peak_rss_bytes(),
    }
}

/// Every database's lines; `None` when stopped first.
async fn export_databases(
    source: &Side,
    options: &ExportOptions,
    names: &[String],
    stop: &StopFlag,
    board: &Board,
    mut writer: ArchiveWriter,
) -> Result<Option<(ArchiveWriter, Vec<ExportedDb>)>> {
    let mut databases = Vec::with_capacity(names.len());
    for name in names {
        board.set_current(name);
        let settings = source.settings(name).await?;
        let start = DatabaseLine {
            database: name.clone(),
            security: settings.security.clone(),
            revs_limit: settings.revs_limit,
        };
        writer.hasher = Sha256::new();
        writer.line(&start, false).map_err(|e| Error::new(ErrorKind::Internal, "write the export").with_source(e))?;
        let mut counts = ExportedDb {
            name: name.clone(),
            security: settings.security,
            revs_limit: settings.revs_limit,
            documents: 0,
            leaves: 0,
            attachments: 0,
            attachment_bytes: 0,
        };
        let batch = options.batch_size.max(1);
        let mut page = read_page(source.clone(), name.clone(), Value::Null, batch).await?;
        loop {
            if stop.is_raised() {
                return Ok(None);
            }
            // The next page is read while this one is written.
            let next = (!page.at_end)
                .then(|| tokio::spawn(read_page(source.clone(), name.clone(), page.last_seq.clone(), batch)));
            let (db, max, leaves, docs) = (name.clone(), options.max_line_bytes, page.leaves, page.docs);
            let (back, (counted, written)) = with_writer(writer, move |writer| {
                let mut counts = counts;
                write_leaves_to(writer, &db, &leaves, max, &mut counts)?;
                counts.documents += docs;
                Ok((counts, docs))
            })
            .await?;
            (writer, counts) = (back, counted);
            board.done.fetch_add(written, Ordering::Relaxed);
            match next {
                None => break,
                Some(next) => {
                    page = next
                        .await
                        .map_err(|e| Error::new(ErrorKind::Internal, "a source read task failed").with_source(e))??
                }
            }
        }
        let end = DatabaseEnd {
            end_database: name.clone(),
            documents: counts.documents,
            leaves: counts.leaves,
            attachments: counts.attachments,
            attachment_bytes: counts.attachment_bytes,
            sha256: hex::encode(std::mem::take(&mut writer.hasher).finalize()),
        };
        writer.line(&end, false).map_err(|e| Error::new(ErrorKind::Internal, "write the export").with_source(e))?;
        board.databases_done.fetch_add(1, Ordering::Relaxed);
        databases.push(counts);
    }
    Ok(Some((writer, databases)))
}

// ----------------------------------------------------------------------------------------------
// Import

/// How an import runs.
#[derive(Debug, Clone)]
pub struct ImportOptions {
    pub selection: Selection,
    /// Leaves per page written.
    pub batch_size: usize,
    pub input: PathBuf,
    /// The checkpoint file; default [`default_checkpoint`].
    pub checkpoint: Option<PathBuf>,
    pub restart: bool,
    pub max_line_bytes: u64,
    /// Pages written at once (`--concurrency`): pages of one database overlap, databases do not.
    pub pages_at_once: usize,
    pub progress: ProgressMode,
    /// Refused leaves named per database.
    pub max_issues: usize,
}

/// What an import did for one database, over every run of it.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ImportCounts {
    /// Leaf lines read from the file.
    pub leaves_read: u64,
    /// Of those, leaves the target lacked and was sent.
    pub leaves_written: u64,
    /// Leaves the target already had (a re-run, or a target that had them).
    pub already_present: u64,
    /// Attachments of the leaves written, and their bytes.
    pub attachments: u64,
    pub attachment_bytes: u64,
    /// Leaves the target refused.
    pub failed: u64,
}

impl ImportCounts {
    fn add(&mut self, other: &ImportCounts) {
        self.leaves_read += other.leaves_read;
        self.leaves_written += other.leaves_written;
        self.already_present += other.already_present;
        self.attachments += other.attachments;
        self.attachment_bytes += other.attachment_bytes;
        self.failed += other.failed;
    }
}

/// One database of an import.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct ImportedDb {
    pub name: String,
    /// Whether a run of this import created it at the target.
    pub created: bool,
    pub security: Value,
    pub revs_limit: Option<u64>,
    pub counts: ImportCounts,
    /// The first leaves the target refused.
    pub failures: Vec<Value>,
}

/// Where an import stands: saved after every page.
#[derive(Debug, Clone, Serialize, Deserialize)]
struct ImportCheckpoint {
    format: u32,
    export_id: String,
    to: String,
    /// The offset (in the file's text) after the last line handled, and its line number.
    offset: u64,
    line: u64,
    /// The database being imported at `offset`.
    current: Option<ImportedDb>,
    /// Whether `current` is selected (else its lines are only read).
    current_selected: bool,
    done: Vec<ImportedDb>,
    skipped: Vec<String>,
}

/// The report of an import.
#[derive(Debug, Clone, Serialize)]
pub struct ImportReport {
    pub command: &'static str,
    pub mode: &'static str,
    pub from: String,
    pub to: String,
    pub status: ArchiveStatus,
    pub export_id: String,
    pub exported_at: String,
    /// The side the file was exported from.
    pub exported_from: String,
    pub checkpoint: String,
    /// Whether this run went on from a checkpoint.
    pub resumed: bool,
    pub elapsed_seconds: f64,
    pub databases: Vec<ImportedDb>,
    /// Databases in the file the selection left out.
    pub skipped_databases: Vec<String>,
    pub totals: ImportCounts,
    /// Leaf lines this run read per second.
    pub leaves_per_second: f64,
    pub max_line_bytes: u64,
    pub local_documents: &'static str,
    pub peak_rss_bytes: Option<u64>,
}

impl ImportReport {
    /// 8 interrupted, 7 leaves were refused, else 0.
    pub fn exit_code(&self) -> u8 {
        if self.status == ArchiveStatus::Interrupted {
            crate::migrate::EXIT_INTERRUPTED
        } else if self.totals.failed > 0 {
            crate::migrate::EXIT_INCOMPLETE
        } else {
            0
        }
    }
}

/// The default checkpoint: `.agentstore-import-databases-<12 hex digits of the file and the
/// target>.json` in the working directory, so the same command finds it again.
pub fn default_checkpoint(input: &Path, to: &str) -> PathBuf {
    let mut hasher = Sha256::new();
    hasher.update(std::path::absolute(input).unwrap_or_else(|_| input.to_path_buf()).to_string_lossy().as_bytes());
    hasher.update([0]);
    hasher.update(to.as_bytes());
    PathBuf::from(format!(".agentstore-import-databases-{}.json", &hex::encode(hasher.finalize())[..12]))
}

/// What the reader hands the writer.
enum Item {
    Database(DatabaseLine),
    /// Leaves of the current database, and the offset and line number after the last.
    Page {
        leaves: Vec<Map<String, Value>>,
        offset: u64,
        line: u64,
    },
    DatabaseEnd {
        offset: u64,
        line: u64,
    },
    FileEnd,
}

/// Reads the file from `offset` (the file was checked whole before), sending pages of at most
/// `batch` leaves and [`PAGE_BYTES`]. Leaves of databases the selection leaves out are not parsed.
fn read_items(
    path: &Path,
    max_line_bytes: u64,
    (offset, line): (u64, u64),
    mut selected: bool,
    selection: &Selection,
    batch: usize,
    items: &tokio::sync::mpsc::Sender<Result<Item>>,
) -> Result<()> {
    let mut reader = LineReader::open(path, max_line_bytes)?;
    let mut text = Vec::new();
    if offset == 0 {
        // The header, checked already.
        reader.next(&mut text)?;
    } else {
        reader.skip_to(offset, line)?;
    }
    let mut page: Vec<Map<String, Value>> = Vec::new();
    let mut page_bytes = 0usize;
    let send = |item: Item| items.blocking_send(Ok(item)).is_ok();
    loop {
        if !reader.next(&mut text)? {
            return Err(Error::new(
                ErrorKind::InvalidInput,
                format!("{} changed while it was imported", path.display()),
            ));
        }
        let at = Place { path, line: reader.line };
        let kind = kind_of(&text, &at)?;
        if kind != Kind::Leaf && !page.is_empty() {
            // Ended by this line's start: the offset before it.
            let (end_offset, end_line) = (reader.offset - text.len() as u64 - 1, reader.line - 1);
            if !send(Item::Page { leaves: std::mem::take(&mut page), offset: end_offset, line: end_line }) {
                return Ok(());
            }
            page_bytes = 0;
        }
        let item = match kind {
            Kind::Leaf => {
                if !selected {
                    continue;
                }
                let leaf: Map<String, Value> = parse(&text, &at, "leaf")?;
                if !leaf.get("_id").is_some_and(Value::is_string) || !leaf.get("_rev").is_some_and(Value::is_string) {
                    return Err(at.error("is a leaf without a string _id and _rev".into()));
                }
                page.push(leaf);
                page_bytes += text.len();
                if page.len() >= batch || page_bytes >= PAGE_BYTES {
                    page_bytes = 0;
                    Item::Page { leaves: std::mem::take(&mut page), offset: reader.offset, line: reader.line }
                } else {
                    continue;
                }
            }
            Kind::Database => {
                let start: DatabaseLine = parse(&text, &at, "database")?;
                selected = selection.admits(&start.database);
                Item::Database(start)
            }
            Kind::DatabaseEnd => Item::DatabaseEnd { offset: reader.offset, line: reader.line },
            Kind::FileEnd => Item::FileEnd,
            Kind::Header => return Err(at.error("is a second header".into())),
        };
        let end = matches!(item, Item::FileEnd);
        if !send(item) || end {
            return Ok(());
        }
    }
}

/// Imports the file into `target`.
pub async fn import(target: Side, options: ImportOptions, stop: StopSignal) -> Result<ImportReport> {
    let started = Instant::now();
    let input = options.input.clone();
    let max = options.max_line_bytes;
    let summary = tokio::task::spawn_blocking(move || check_file(&input, max))
        .await
        .map_err(|e| Error::new(ErrorKind::Internal, "the file check task failed").with_source(e))?
        .map_err(|err| {
            Error::new(err.kind(), format!("{}; nothing was imported (the whole file is checked first)", err.message()))
                .with_source(err)
        })?;
    let checkpoint_path =
        options.checkpoint.clone().unwrap_or_else(|| default_checkpoint(&options.input, &target.name()));
    let fresh = ImportCheckpoint {
        format: CHECKPOINT_FORMAT,
        export_id: summary.header.export_id.clone(),
        to: target.name(),
        offset: 0,
        line: 1,
        current: None,
        current_selected: false,
        done: Vec::new(),
        skipped: Vec::new(),
    };
    let mut state = match load_json::<ImportCheckpoint>(&checkpoint_path, "an import checkpoint")? {
        Some(_) if options.restart => fresh,
        Some(found) if found.format == fresh.format && found.export_id == fresh.export_id && found.to == fresh.to => {
            found
        }
        Some(found) => {
            return Err(Error::new(
                ErrorKind::InvalidInput,
                format!(
                    "{} belongs to another import (export {} into {}); use --restart or another --checkpoint",
                    checkpoint_path.display(),
                    found.export_id,
                    found.to
                ),
            ))
        }
        None => fresh,
    };
    let resumed = state.offset > 0;
    let stop = StopFlag::new(stop);
    let board = Board::new("import", "leaves");
    let selected: Vec<&(String, u64)> =
        summary.databases.iter().filter(|(name, _)| options.selection.admits(name)).collect();
    board.databases.store(selected.len() as u64, Ordering::Relaxed);
    board.expected.store(selected.iter().map(|(_, n)| n).sum(), Ordering::Relaxed);
    let already: u64 = state.done.iter().map(|d| d.counts.leaves_read).sum::<u64>()
        + state.current.as_ref().map_or(0, |c| c.counts.leaves_read);
    board.expected.fetch_sub(already.min(board.expected.load(Ordering::Relaxed)), Ordering::Relaxed);
    board.databases_done.store(state.done.len() as u64, Ordering::Relaxed);
    let _ticker = board.tick(options.progress);

    let (sender, mut items) = tokio::sync::mpsc::channel::<Result<Item>>(1);
    let reader = {
        let (path, selection) = (options.input.clone(), options.selection.clone());
        let (position, selected, batch) =
            ((state.offset, state.line), state.current_selected, options.batch_size.max(1));
        tokio::task::spawn_blocking(move || {
            if let Err(err) = read_items(&path, max, position, selected, &selection, batch, &sender) {
                let _ = sender.blocking_send(Err(err));
            }
        })
    };
    let mut status = ArchiveStatus::Interrupted;
    let mut pages = Pages {
        in_flight: VecDeque::new(),
        this_run: ImportCounts::default(),
        checkpoint: checkpoint_path.clone(),
        max_issues: options.max_issues,
    };
    let pages_at_once = options.pages_at_once.max(1);
    while let Some(item) = items.recv().await {
        match item? {
            Item::Database(start) => {
                pages.settle_all(&mut state, &board).await?;
                let selected = options.selection.admits(&start.database);
                let mut db = ImportedDb {
                    name: start.database.clone(),
                    security: start.security.clone(),
                    revs_limit: start.revs_limit,
                    ..ImportedDb::default()
                };
                if selected {
                    board.set_current(&start.database);
                    db.created = target.ensure(&start.database).await?;
                    let settings = super::side::Settings { security: start.security, revs_limit: start.revs_limit };
                    target.put_settings(&start.database, &settings).await?;
                }
                state.current = Some(db);
                state.current_selected = selected;
            }
            Item::Page { leaves, offset, line } => {
                if pages.in_flight.len() >= pages_at_once {
                    pages.settle_one(&mut state, &board).await?;
                }
                let Some(db) = state.current.as_ref() else {
                    return Err(Error::new(ErrorKind::Internal, "a page of leaves outside a database"));
                };
                let (target, name) = (target.clone(), db.name.clone());
                let write = tokio::spawn(async move { import_page(&target, &name, leaves).await });
                pages.in_flight.push_back((write, offset, line));
                if stop.is_raised() {
                    break;
                }
            }
            Item::DatabaseEnd { offset, line } => {
                pages.settle_all(&mut state, &board).await?;
                if let Some(db) = state.current.take() {
                    if state.current_selected {
                        state.done.push(db);
                        board.databases_done.fetch_add(1, Ordering::Relaxed);
                    } else {
                        state.skipped.push(db.name);
                    }
                }
                state.current_selected = false;
                (state.offset, state.line) = (offset, line);
                save_json(&checkpoint_path, &state)?;
                if stop.is_raised() {
                    break;
                }
            }
            Item::FileEnd => {
                status = ArchiveStatus::Complete;
                break;
            }
        }
    }
    // Pages being written are finished and recorded, stopped or not.
    pages.settle_all(&mut state, &board).await?;
    let this_run = pages.this_run;
    drop(items);
    let _ = reader.await;
    if status == ArchiveStatus::Complete {
        // A finished import leaves no checkpoint: running it again reads the file from the start
        // and finds every leaf present.
        remove(&checkpoint_path)?;
    }
    board.set_current("");
    if options.progress != ProgressMode::None {
        eprintln!("{}", board.line());
    }
    let mut totals = ImportCounts::default();
    let mut databases = state.done;
    if let Some(current) = state.current.filter(|_| state.current_selected) {
        databases.push(current);
    }
    for db in &databases {
        totals.add(&db.counts);
    }
    let elapsed = started.elapsed().as_secs_f64();
    Ok(ImportReport {
        command: "import",
        mode: "databases",
        from: format!(
            "file:{}",
            std::path::absolute(&options.input).unwrap_or_else(|_| options.input.clone()).display()
        ),
        to: target.name(),
        status,
        export_id: summary.header.export_id,
        exported_at: summary.header.exported_at,
        exported_from: summary.header.source,
        checkpoint: checkpoint_path.display().to_string(),
        resumed,
        elapsed_seconds: (elapsed * 1000.0).round() / 1000.0,
        databases,
        skipped_databases: state.skipped,
        totals,
        leaves_per_second: (this_run.leaves_read as f64 / elapsed.max(0.001)).round(),
        max_line_bytes: options.max_line_bytes,
        local_documents: LOCAL_DOCUMENTS,
        peak_rss_bytes: crate::migrate::report::peak_rss_bytes(),
    })
}

/// A page being written: its counts and the leaves the target refused.
type PageWrite = tokio::task::JoinHandle<Result<(ImportCounts, Vec<Value>)>>;

/// Pages being written, oldest first, each with the file position after it; recorded in order,
/// so the checkpoint's offset never passes a page not yet written.
struct Pages {
    in_flight: VecDeque<(PageWrite, u64, u64)>,
    this_run: ImportCounts,
    checkpoint: PathBuf,
    max_issues: usize,
}

impl Pages {
    /// Waits for the oldest page and records it in the checkpoint.
    async fn settle_one(&mut self, state: &mut ImportCheckpoint, board: &Board) -> Result<()> {
        let Some((write, offset, line)) = self.in_flight.pop_front() else { return Ok(()) };
        let (counts, failures) =
            write.await.map_err(|e| Error::new(ErrorKind::Internal, "a page writer task failed").with_source(e))??;
        let Some(db) = state.current.as_mut() else {
            return Err(Error::new(ErrorKind::Internal, "a page of leaves outside a database"));
        };
        self.this_run.add(&counts);
        db.counts.add(&counts);
        let room = self.max_issues.saturating_sub(db.failures.len());
        db.failures.extend(failures.into_iter().take(room));
        board.done.fetch_add(counts.leaves_read, Ordering::Relaxed);
        (state.offset, state.line) = (offset, line);
        save_json(&self.checkpoint, state)
    }

    async fn settle_all(&mut self, state: &mut ImportCheckpoint, board: &Board) -> Result<()> {
        while !self.in_flight.is_empty() {
            self.settle_one(state, board).await?;
        }
        Ok(())
    }
}

/// Writes the leaves of one page the target lacks; the page's counts and the leaves refused.
async fn import_page(target: &Side, db: &str, leaves: Vec<Map<String, Value>>) -> Result<(ImportCounts, Vec<Value>)> {
    let mut counts = ImportCounts { leaves_read: leaves.len() as u64, ..ImportCounts::default() };
    let text =
        |leaf: &Map<String, Value>, field: &str| leaf.get(field).and_then(Value::as_str).unwrap_or_default().to_owned();
    let mut wanted: BTreeMap<String, Vec<String>> = BTreeMap::new();
    for leaf in &leaves {
        wanted.entry(text(leaf, "_id")).or_default().push(text(leaf, "_rev"));
    }
    let wanted: Vec<(String, Vec<String>)> = wanted.into_iter().collect();
    let missing: HashSet<(String, String)> = target
        .missing(db, &wanted)
        .await?
        .into_iter()
        .flat_map(|(id, revs)| revs.into_iter().map(move |rev| (id.clone(), rev)))
        .collect();
    let mut sending = Vec::with_capacity(missing.len());
    let mut sent = HashSet::with_capacity(missing.len());
    for leaf in leaves {
        let key = (text(&leaf, "_id"), text(&leaf, "_rev"));
        // A leaf listed twice (its document changed during the export) is sent once.
        if missing.contains(&key) && sent.insert(key) {
            if let Some(Value::Object(attachments)) = leaf.get("_attachments") {
                counts.attachments += attachments.len() as u64;
                counts.attachment_bytes += attachments.values().map(inline_bytes).sum::<u64>();
            }
            sending.push(leaf);
        } else {
            counts.already_present += 1;
        }
    }
    counts.leaves_written = sending.len() as u64;
    let mut failures = Vec::new();
    if !sending.is_empty() {
        failures = target.write_leaves(db, sending).await?;
        counts.failed = failures.len() as u64;
    }
    Ok((counts, failures))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A file that takes `room` bytes, then fails every write and flush (a full disk).
    struct FillingUp {
        room: usize,
        taken: Vec<u8>,
    }

    impl Write for FillingUp {
        fn write(&mut self, bytes: &[u8]) -> std::io::Result<usize> {
            if self.taken.len() + bytes.len() > self.room {
                return Err(std::io::Error::new(std::io::ErrorKind::StorageFull, "no space left"));
            }
            self.taken.extend_from_slice(bytes);
            Ok(bytes.len())
        }

        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    /// Writing the gzip trailer (or a plain file's buffered tail) can fail after every line was
    /// accepted: finishing the export says so, where dropping the writer would not.
    #[test]
    fn an_export_whose_last_bytes_fail_is_an_error() {
        for gzip in [true, false] {
            let mut sink = ExportSink::new(FillingUp { room: 0, taken: Vec::new() }, gzip);
            sink.write_all(b"{\"format\":\"x\"}\n").expect("kept in the buffer");
            let finished = sink.finish();
            assert!(finished.is_err(), "gzip {gzip}: finishing into a full file succeeded");
        }
        let mut sink = ExportSink::new(FillingUp { room: 1 << 10, taken: Vec::new() }, true);
        sink.write_all(b"line\n").expect("written");
        let file = sink.finish().expect("finished with room to spare");
        let mut text = String::new();
        flate2::read::GzDecoder::new(&file.taken[..]).read_to_string(&mut text).expect("a whole gzip stream");
        assert_eq!(text, "line\n");
    }

    fn write(path: &Path, lines: &[String]) {
        let text: String = lines.iter().map(|l| format!("{l}\n")).collect();
        std::fs::write(path, text).expect("write the test file");
    }

    fn sample() -> Vec<String> {
        sample_with(r#"{"_id":"a","_rev":"1-x","_revisions":{"start":1,"ids":["x"]},"database":"not a control line"}"#)
    }

    fn sample_with(leaf1: &str) -> Vec<String> {
        let leaf2 = r#"{"_id":"b","_rev":"1-y","_revisions":{"start":1,"ids":["y"]},"end":true}"#;
        let mut hasher = Sha256::new();
        for leaf in [leaf1, leaf2] {
            hasher.update(leaf.as_bytes());
            hasher.update(b"\n");
        }
        let header = Header {
            format: FORMAT.into(),
            version: VERSION,
            export_id: "e1".into(),
            exported_at: "2026-01-01T00:00:00Z".into(),
            source: "test".into(),
            local_documents: LOCAL_DOCUMENTS.into(),
        };
        let end = DatabaseEnd {
            end_database: "db1".into(),
            documents: 2,
            leaves: 2,
            attachments: 0,
            attachment_bytes: 0,
            sha256: hex::encode(hasher.finalize()),
        };
        vec![
            serde_json::to_string(&header).expect("header"),
            r#"{"database":"db1","security":{},"revs_limit":1000}"#.into(),
            leaf1.into(),
            leaf2.into(),
            serde_json::to_string(&end).expect("end"),
            r#"{"end":"agentstore-databases","databases":1,"leaves":2}"#.into(),
        ]
    }

    #[test]
    fn a_whole_file_passes_and_leaves_with_control_field_names_are_leaves() {
        let dir = tempfile::tempdir().expect("temp dir");
        let path = dir.path().join("x.ndjson");
        write(&path, &sample());
        let summary = check_file(&path, DEFAULT_MAX_LINE_BYTES).expect("a whole file");
        assert_eq!(summary.databases, vec![("db1".to_owned(), 2)]);
        assert_eq!(summary.leaves, 2);
    }

    #[test]
    fn truncated_altered_or_overlong_files_are_refused() {
        let dir = tempfile::tempdir().expect("temp dir");
        let path = dir.path().join("x.ndjson");
        let lines = sample();
        for cut in 1..lines.len() {
            write(&path, &lines[..cut]);
            let err = check_file(&path, DEFAULT_MAX_LINE_BYTES).expect_err("a truncated file");
            assert_eq!(err.kind(), ErrorKind::InvalidInput, "cut at {cut}: {err}");
        }
        // Cut inside the last line.
        let text: String = lines.iter().map(|l| format!("{l}\n")).collect();
        std::fs::write(&path, &text[..text.len() - 10]).expect("write");
        assert!(check_file(&path, DEFAULT_MAX_LINE_BYTES).is_err());
        // A leaf dropped and the count kept.
        let mut dropped = lines.clone();
        dropped.remove(3);
        write(&path, &dropped);
        let err = check_file(&path, DEFAULT_MAX_LINE_BYTES).expect_err("a missing leaf");
        assert!(err.message().contains("lines are missing"), "{err}");
        // A leaf altered.
        let mut altered = lines.clone();
        altered[2] = altered[2].replace("not a control line", "changed");
        write(&path, &altered);
        let err = check_file(&path, DEFAULT_MAX_LINE_BYTES).expect_err("an altered leaf");
        assert!(err.message().contains("SHA-256"), "{err}");
        // A line past the limit names it.
        write(&path, &lines);
        let err = check_file(&path, 100).expect_err("a long line");
        assert_eq!(err.kind(), ErrorKind::TooLarge);
        assert!(err.message().contains("line limit of 100 bytes"), "{err}");
    }

    #[test]
    fn a_leaf_as_deep_as_a_database_keeps_is_read() {
        // A document nested as deep as databases accept (its own object is level 1), which
        // serde_json's default limit of 127 would refuse once the line's levels are around it.
        let depth = crate::model::depth::MAX_DOCUMENT_DEPTH;
        let nested = format!("{}{}", "[".repeat(depth - 1), "]".repeat(depth - 1));
        let leaf = format!(r#"{{"_id":"a","_rev":"1-x","_revisions":{{"start":1,"ids":["x"]}},"deep":{nested}}}"#);
        let dir = tempfile::tempdir().expect("temp dir");
        let path = dir.path().join("x.ndjson");
        write(&path, &sample_with(&leaf));
        assert_eq!(check_file(&path, DEFAULT_MAX_LINE_BYTES).expect("a deep leaf").leaves, 2);
    }

    #[test]
    fn gzip_files_read_the_same() {
        let dir = tempfile::tempdir().expect("temp dir");
        let path = dir.path().join("x.ndjson.gz");
        let text: String = sample().iter().map(|l| format!("{l}\n")).collect();
        let mut encoder = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
        encoder.write_all(text.as_bytes()).expect("compress");
        let compressed = encoder.finish().expect("compress");
        std::fs::write(&path, &compressed).expect("write");
        assert_eq!(check_file(&path, DEFAULT_MAX_LINE_BYTES).expect("whole").leaves, 2);
        std::fs::write(&path, &compressed[..compressed.len() / 2]).expect("write");
        assert_eq!(check_file(&path, DEFAULT_MAX_LINE_BYTES).expect_err("cut").kind(), ErrorKind::InvalidInput);
    }

    #[test]
    fn the_line_limit_grows_with_the_attachment_limit() {
        assert_eq!(default_max_line_bytes(8_000_000, None), DEFAULT_MAX_LINE_BYTES);
        assert_eq!(default_max_line_bytes(8_000_000, Some(1_000_000)), DEFAULT_MAX_LINE_BYTES);
        let big = 600 * 1024 * 1024;
        assert_eq!(default_max_line_bytes(8_000_000, Some(big)), 8_000_000 + big / 3 * 4 + LINE_OVERHEAD);
        assert_eq!(inline_bytes(&serde_json::json!({"data": "YWJj"})), 3);
        assert_eq!(inline_bytes(&serde_json::json!({"data": "YQ=="})), 1);
    }
}
