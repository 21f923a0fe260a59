//! The databases a backend holds besides the data-store database: CouchDB's database names, how
//! each backend keeps one database apart from the others, and creating, listing, opening and
//! dropping them.
//!
//! Every database is its own [`DocumentBackend`] opened on a namespace of the configured backend
//! (docs/databases.md says which namespace per backend and why): the embedded store keeps a file
//! per database beside the data-store file, DynamoDB a table per database, Firestore a collection
//! per database, and the CouchDB backend the database of the same name on its server. What a
//! database holds (revision trees, CouchDB's document rules) is [`crate::database`]'s business;
//! this module only finds, makes and removes the place.

use std::collections::HashMap;
use std::fmt;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use async_trait::async_trait;
use tokio::sync::Mutex;

use super::embedded::{EmbeddedBackend, EmbeddedOptions};
use super::{BackendUrl, DocumentBackend};
use crate::error::{Error, ErrorKind, Result};

/// The longest database name kept. CouchDB 3.4.3's name rule has no length; its file system
/// refuses a name one of whose `/`-separated segments passes 255 bytes with the shard's
/// `.{timestamp}.couch` (238 for the last), answered 400 `database_name_too_long`. Here a name is
/// one file or table name on every backend, so the whole name is held to 238 bytes (the same
/// answer past it), which [`DbName::encoded_within`] fits into a file name whatever it holds.
pub const MAX_DB_NAME_LEN: usize = 238;

/// The names starting with `_` CouchDB's rule admits that this server keeps: `_users` (the
/// logins of `crate::database::users`), `_replicator` (the replications of `crate::replicator`)
/// and `_global_changes` (the events `_db_updates` reads, `crate::database::global_changes`).
pub const SYSTEM_DATABASES: [&str; 3] = ["_users", "_replicator", "_global_changes"];

/// A database name that passed CouchDB's rule (or is one of [`SYSTEM_DATABASES`]): a lowercase letter, then lowercase letters,
/// digits and `_$()+-/`, at most [`MAX_DB_NAME_LEN`] bytes.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct DbName(String);

impl DbName {
    /// Checks `name` against CouchDB's rule; the error is CouchDB's `illegal_database_name` text.
    pub fn parse(name: &str) -> Result<Self> {
        let mut bytes = name.bytes();
        let well_formed = SYSTEM_DATABASES.contains(&name)
            || matches!(bytes.next(), Some(b'a'..=b'z')) && bytes.all(is_name_byte) && name.len() <= MAX_DB_NAME_LEN;
        if well_formed {
            Ok(DbName(name.to_owned()))
        } else {
            Err(Error::new(
                ErrorKind::InvalidInput,
                format!(
                    "Name: '{name}'. Only lowercase characters (a-z), digits (0-9), and any of the characters _, $, (, ), \
                     +, -, and / are allowed. Must begin with a letter."
                ),
            ))
        }
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// The name as a backend namespace: letters, digits, `_` and `-` as they are, every other
    /// character `.` and two hex digits. Backends' names (file names, DynamoDB table names,
    /// Firestore collection ids) all take `[A-Za-z0-9_.-]`, and `.` never occurs in a CouchDB
    /// name, so the encoding is one-to-one and [`DbName::decode`] reverses it.
    pub fn encoded(&self) -> String {
        let mut out = String::with_capacity(self.0.len());
        for b in self.0.bytes() {
            match b {
                b'a'..=b'z' | b'0'..=b'9' | b'_' | b'-' => out.push(b as char),
                other => out.push_str(&format!(".{other:02x}")),
            }
        }
        out
    }

    /// The name as a namespace of at most `room` bytes where one must fit (a file name, a
    /// DynamoDB table name): [`DbName::encoded`] when it fits, else one character per character,
    /// `$()+/` written as the capitals of [`COMPACT`] (at most [`MAX_DB_NAME_LEN`] bytes). The
    /// escaped form never holds a capital, so the two never meet, and a name gets the compact
    /// form only where its escaped one did not fit, so names stored before keep theirs.
    pub fn encoded_within(&self, room: usize) -> String {
        let escaped = self.encoded();
        if escaped.len() <= room {
            return escaped;
        }
        self.0
            .chars()
            .map(|c| COMPACT.iter().find(|(plain, _)| *plain == c).map_or(c, |(_, capital)| *capital))
            .collect()
    }

    /// The name an [`DbName::encoded`] text stands for; `None` for text no name encodes to.
    pub fn decode(encoded: &str) -> Option<Self> {
        DbName::decode_within(encoded, usize::MAX)
    }

    /// The name an [`DbName::encoded_within`]`(room)` text stands for; `None` for text no name
    /// encodes to within that room.
    pub fn decode_within(encoded: &str, room: usize) -> Option<Self> {
        let parsed = DbName::decode_either(encoded)?;
        (parsed.encoded_within(room) == encoded).then_some(parsed)
    }

    /// The name of an escaped or a compact text, not yet checked to be that name's text.
    fn decode_either(encoded: &str) -> Option<Self> {
        if encoded.bytes().any(|b| b.is_ascii_uppercase()) {
            let name: String = encoded
                .chars()
                .map(|c| COMPACT.iter().find(|(_, capital)| *capital == c).map_or(c, |(plain, _)| *plain))
                .collect();
            return DbName::parse(&name).ok();
        }
        let mut out = Vec::with_capacity(encoded.len());
        let mut bytes = encoded.bytes();
        while let Some(b) = bytes.next() {
            if b == b'.' {
                let high = bytes.next()?;
                let low = bytes.next()?;
                let text = [high, low];
                let hex = std::str::from_utf8(&text).ok()?;
                out.push(u8::from_str_radix(hex, 16).ok()?);
            } else {
                out.push(b);
            }
        }
        DbName::parse(&String::from_utf8(out).ok()?).ok()
    }

    /// Whether `name` breaks CouchDB's rule by its length alone (CouchDB's 400
    /// `database_name_too_long`, not `illegal_database_name`).
    pub fn only_too_long(name: &str) -> bool {
        name.len() > MAX_DB_NAME_LEN
            && name.get(..MAX_DB_NAME_LEN).is_some_and(|head| DbName::parse(head).is_ok())
            && name.bytes().all(is_name_byte)
    }
}

/// Whether `b` may follow a name's first letter (CouchDB's rule).
fn is_name_byte(b: u8) -> bool {
    matches!(b, b'a'..=b'z' | b'0'..=b'9' | b'_' | b'$' | b'(' | b')' | b'+' | b'-' | b'/')
}

/// The characters of a name [`DbName::encoded_within`] writes as capitals, and those capitals.
const COMPACT: [(char, char); 5] = [('$', 'D'), ('(', 'L'), (')', 'R'), ('+', 'P'), ('/', 'S')];

/// The longest file name the embedded catalog writes (`NAME_MAX` of Linux, macOS and Windows).
const MAX_FILE_NAME: usize = 255;

impl fmt::Display for DbName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// Where one backend keeps its databases: creating, listing, opening and dropping them. The
/// data-store database is not among them (it is the configured backend itself).
#[async_trait]
pub trait Catalog: Send + Sync + 'static {
    /// Where the databases live, for logs and reports.
    fn describe(&self) -> String;

    /// Makes the database's namespace and opens it; `ErrorKind::Conflict` when it exists.
    async fn create(&self, name: &DbName) -> Result<Arc<dyn DocumentBackend>>;

    /// The database, opened; `None` when it does not exist. Asked before every request on an
    /// open database (`crate::database::Databases`), so it looks at the backend each time (another
    /// process may have deleted or re-created the database), and it hands back the same handle
    /// while the database is the same one: a different handle tells that it was created again,
    /// and the server lets go of the one it held.
    async fn open(&self, name: &DbName) -> Result<Option<Arc<dyn DocumentBackend>>>;

    /// Removes the database and everything of it from the backend (documents, tombstones, feed,
    /// local documents); `false` when it did not exist. A handle opened before keeps failing
    /// cleanly afterwards; it never writes into a re-created database of the same name.
    async fn delete(&self, name: &DbName) -> Result<bool>;

    /// Every database's name, in CouchDB's order (byte order of the names).
    async fn list(&self) -> Result<Vec<DbName>>;

    /// Lets go of the catalog's own handle of a database nobody uses any more (the server keeps
    /// a bounded number open), so its resources are freed; the next `open` opens it again.
    async fn forget(&self, name: &DbName) {
        let _ = name;
    }
}

/// The catalog of the backend `url` names.
pub async fn open_catalog(url: &BackendUrl) -> Result<Arc<dyn Catalog>> {
    match url {
        BackendUrl::Embedded { path, options } => Ok(Arc::new(EmbeddedCatalog::new(path, *options))),
        BackendUrl::CouchDb(config) => Ok(Arc::new(super::couchdb::CouchCatalog::new(config)?)),
        BackendUrl::DynamoDb(config) => Ok(Arc::new(super::dynamodb::DynamoCatalog::new(config).await?)),
        BackendUrl::Firestore(config) => Ok(Arc::new(super::firestore::FirestoreCatalog::new(config).await?)),
    }
}

/// The embedded store's databases: one redb file per database in a directory beside the
/// data-store file (`agentstore.redb` → `agentstore.redb.databases/{encoded name}.redb`). A file
/// per database rather than tables in one file: dropping a database is deleting its file (nothing
/// left behind, no compaction), writers to different databases commit in parallel, and every
/// database is an ordinary embedded store the existing code opens unchanged.
pub struct EmbeddedCatalog {
    directory: PathBuf,
    options: EmbeddedOptions,
    /// Databases opened so far: a redb file may be opened once per process.
    open: Mutex<HashMap<DbName, Arc<EmbeddedBackend>>>,
}

/// The page cache of each database file: small, since a server may hold thousands of databases
/// (the data-store file keeps its own, larger, setting).
const DATABASE_CACHE_BYTES: usize = 4 << 20;

impl EmbeddedCatalog {
    pub fn new(data_store_file: &Path, options: EmbeddedOptions) -> Self {
        let mut directory = data_store_file.as_os_str().to_owned();
        directory.push(".databases");
        let options = EmbeddedOptions { cache_bytes: options.cache_bytes.min(DATABASE_CACHE_BYTES), ..options };
        EmbeddedCatalog { directory: PathBuf::from(directory), options, open: Mutex::new(HashMap::new()) }
    }

    fn file(&self, name: &DbName) -> PathBuf {
        self.directory.join(format!("{}{FILE_SUFFIX}", name.encoded_within(MAX_FILE_NAME - FILE_SUFFIX.len())))
    }

    /// Makes a database's file whole or not at all: redb writes a new file's header in steps, so
    /// a process killed while creating `file` in place would leave a file that exists and never
    /// opens ("not a redb database"), and the database could be neither opened nor created again.
    /// The file is made under a temporary name in the same directory (one per database name, so
    /// a retry after such a crash starts over from nothing), closed, and renamed into place; the
    /// directory is synced so that an acknowledged creation survives a power cut.
    async fn create_file(&self, name: &DbName, file: &Path) -> Result<EmbeddedBackend> {
        use sha2::Digest;
        let digest = sha2::Sha256::digest(name.as_str().as_bytes());
        let creating = self.directory.join(format!("{CREATING_PREFIX}{}", hex::encode(&digest[..16])));
        let unavailable = |what: &str, err: std::io::Error| {
            Error::new(ErrorKind::Unavailable, format!("cannot {what} {}", creating.display())).with_source(err)
        };
        match tokio::fs::remove_file(&creating).await {
            Err(err) if err.kind() != std::io::ErrorKind::NotFound => return Err(unavailable("remove", err)),
            _ => {}
        }
        drop(EmbeddedBackend::open_with(&creating, self.options).await?);
        tokio::fs::rename(&creating, file).await.map_err(|err| unavailable("rename", err))?;
        let directory = self.directory.clone();
        tokio::task::spawn_blocking(move || std::fs::File::open(&directory).and_then(|dir| dir.sync_all()))
            .await
            .map_err(|err| Error::new(ErrorKind::Internal, format!("syncing the databases' directory: {err}")))?
            .map_err(|err| unavailable("sync the directory of", err))?;
        self.reopen(file).await
    }

    /// Opens an existing database file. A database the server closed moments ago (it keeps a
    /// bounded number open) may still be held by its last commit finishing on the blocking
    /// pool, and redb opens a file once per process: such an open is tried again briefly.
    async fn reopen(&self, file: &Path) -> Result<EmbeddedBackend> {
        let mut tries = 0;
        loop {
            match EmbeddedBackend::open_with(file, self.options).await {
                Err(err) if err.kind() == ErrorKind::Misconfigured && tries < REOPEN_TRIES => {
                    tries += 1;
                    tokio::time::sleep(std::time::Duration::from_millis(10)).await;
                }
                answer => return answer,
            }
        }
    }
}

/// What a database's file name ends with.
const FILE_SUFFIX: &str = ".redb";

/// How the name of a database file being created starts (never ends with [`FILE_SUFFIX`], so
/// listings never show it).
const CREATING_PREFIX: &str = ".creating-";

/// Tries of [`EmbeddedCatalog::reopen`] (10 ms apart) while a closed handle lets go of its file.
const REOPEN_TRIES: usize = 50;

#[async_trait]
impl Catalog for EmbeddedCatalog {
    fn describe(&self) -> String {
        format!("embedded databases in {}", self.directory.display())
    }

    async fn create(&self, name: &DbName) -> Result<Arc<dyn DocumentBackend>> {
        let mut open = self.open.lock().await;
        let file = self.file(name);
        if open.contains_key(name) || tokio::fs::try_exists(&file).await.unwrap_or(false) {
            return Err(Error::conflict("The database could not be created, the file already exists."));
        }
        let backend = Arc::new(self.create_file(name, &file).await?);
        open.insert(name.clone(), Arc::clone(&backend));
        Ok(backend)
    }

    async fn open(&self, name: &DbName) -> Result<Option<Arc<dyn DocumentBackend>>> {
        let mut open = self.open.lock().await;
        if let Some(backend) = open.get(name) {
            return Ok(Some(Arc::clone(backend) as Arc<dyn DocumentBackend>));
        }
        let file = self.file(name);
        if !tokio::fs::try_exists(&file).await.unwrap_or(false) {
            return Ok(None);
        }
        let backend = Arc::new(self.reopen(&file).await?);
        open.insert(name.clone(), Arc::clone(&backend));
        Ok(Some(backend))
    }

    async fn delete(&self, name: &DbName) -> Result<bool> {
        let mut open = self.open.lock().await;
        // A handle still held by a request in flight writes into the unlinked file, which no
        // reader sees; `crate::database` refuses every call on a dropped database's handle.
        let handle = open.remove(name);
        let file = self.file(name);
        match tokio::fs::remove_file(&file).await {
            Ok(()) => Ok(true),
            Err(err) if err.kind() == std::io::ErrorKind::NotFound => Ok(handle.is_some()),
            Err(err) => {
                Err(Error::new(ErrorKind::Unavailable, format!("cannot delete {}", file.display())).with_source(err))
            }
        }
    }

    async fn forget(&self, name: &DbName) {
        self.open.lock().await.remove(name);
    }

    async fn list(&self) -> Result<Vec<DbName>> {
        let mut names = Vec::new();
        let mut entries = match tokio::fs::read_dir(&self.directory).await {
            Ok(entries) => entries,
            Err(err) if err.kind() == std::io::ErrorKind::NotFound => return Ok(names),
            Err(err) => {
                return Err(Error::new(ErrorKind::Unavailable, format!("cannot list {}", self.directory.display()))
                    .with_source(err))
            }
        };
        while let Some(entry) = entries.next_entry().await.map_err(|err| {
            Error::new(ErrorKind::Unavailable, format!("cannot list {}", self.directory.display())).with_source(err)
        })? {
            let file_name = entry.file_name();
            let Some(stem) = file_name.to_str().and_then(|n| n.strip_suffix(FILE_SUFFIX)) else { continue };
            if let Some(name) = DbName::decode_within(stem, MAX_FILE_NAME - FILE_SUFFIX.len()) {
                names.push(name);
            }
        }
        names.sort();
        Ok(names)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_follow_couchdb_rule() {
        for good in [
            "a",
            "abc",
            "a1_$()+-/",
            "db/with/slashes",
            &"a".repeat(MAX_DB_NAME_LEN),
            "_users",
            "_replicator",
            "_global_changes",
        ] {
            assert!(DbName::parse(good).is_ok(), "{good}");
        }
        for bad in ["", "A", "1a", "_dbs", "_userss", "_", "a b", "aé", "a.b", &"a".repeat(MAX_DB_NAME_LEN + 1)] {
            assert!(DbName::parse(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn encoding_is_one_to_one_and_reversible() {
        let name = DbName::parse("a$b(c)d+e-f/g_h").unwrap();
        let encoded = name.encoded();
        assert_eq!(encoded, "a.24b.28c.29d.2be-f.2fg_h");
        assert!(encoded.bytes().all(|b| b.is_ascii_alphanumeric() || b"_.-".contains(&b)));
        assert_eq!(DbName::decode(&encoded), Some(name));
        // Text no name encodes to: upper-case hex, a bare dot, a name breaking the rule.
        for bad in ["a.2F", "a.", "a.2", "A", "a.2e"] {
            assert_eq!(DbName::decode(bad), None, "{bad}");
        }
    }

    /// A name whose escaped form does not fit takes one character per character, and decodes
    /// back; a name whose escaped form fits keeps it, and its compact text decodes to nothing.
    #[test]
    fn long_escaped_names_are_written_compactly() {
        let long = DbName::parse(&format!("a{}", "/$()+".repeat(47))).unwrap();
        let compact = long.encoded_within(250);
        assert_eq!(compact.len(), long.as_str().len());
        assert!(compact.starts_with("aSDLRP"), "{compact}");
        assert!(compact.bytes().all(|b| b.is_ascii_alphanumeric()), "{compact}");
        assert_eq!(DbName::decode_within(&compact, 250), Some(long.clone()));
        assert_eq!(DbName::decode_within(&long.encoded(), 250), None, "a long name is never written escaped");
        let short = DbName::parse("a/b").unwrap();
        assert_eq!(short.encoded_within(250), "a.2fb");
        assert_eq!(DbName::decode_within("aSb", 250), None, "a short name is never written compactly");
        assert!(DbName::only_too_long(&"a/".repeat(120)));
        assert!(!DbName::only_too_long("A"));
        assert!(!DbName::only_too_long(&format!("{}é", "a".repeat(300))));
    }

    /// What a process killed while creating a database leaves (the file under its temporary
    /// name, half written) neither shows as a database nor stops the creation done again.
    #[tokio::test]
    async fn a_creation_cut_short_is_started_over() {
        let dir = tempfile::tempdir().expect("temp dir");
        let catalog = EmbeddedCatalog::new(&dir.path().join("store.redb"), EmbeddedOptions::default());
        let name = DbName::parse("cut").expect("name");
        catalog.create(&DbName::parse("other").expect("name")).await.expect("create another");
        let leftovers: Vec<_> = std::fs::read_dir(&catalog.directory).expect("list").collect();
        assert_eq!(leftovers.len(), 1, "only the database's own file is left once created");
        use sha2::Digest;
        let digest = sha2::Sha256::digest(b"cut");
        let creating = catalog.directory.join(format!("{CREATING_PREFIX}{}", hex::encode(&digest[..16])));
        std::fs::write(&creating, b"half a redb header").expect("write a half-made file");
        assert!(catalog.open(&name).await.expect("open").is_none(), "a half-made database is not there");
        assert_eq!(catalog.list().await.expect("list").len(), 1, "nor listed");
        catalog.create(&name).await.expect("created again over what the crash left");
        catalog.forget(&name).await;
        assert!(catalog.open(&name).await.expect("open").is_some(), "and it opens");
        assert!(!creating.exists(), "the temporary file became the database's");
    }
}
