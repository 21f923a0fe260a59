//! The DynamoDB catalog: a table per database, named `{data-store table}.db.{encoded name}`
//! (docs/databases.md says why).
//!
//! Every item of a database (documents, tombstones, chunks, feed and id index entries, local
//! documents, the layout marker) lives in its table, so DeleteTable removes the database whole.
//! A database table has the document model's two indexes but not the user/namespace GSI: only
//! the data-store table answers the facade's listings.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use aws_sdk_dynamodb::types::TableStatus;
use aws_sdk_dynamodb::Client;
use futures::StreamExt;
use tokio::sync::Mutex;

use super::backend::DynamoDbBackend;
use super::config::{check_table_name, DynamoConfig};
use super::error::map_sdk;
use crate::backend::catalog::{Catalog, DbName};
use crate::backend::{DocumentBackend, LayoutState};
use crate::error::{Error, ErrorKind, Result};

/// Between the data-store table's name and a database's encoded name. An encoded name never
/// holds `.db` (it would stand for the byte 0xdb, which no database name has), so a table name
/// splits into data-store table and database in one way only, and one data store's databases
/// are never read as another's (`t` with database `a--x` against `t--a` with `x` would collide
/// under a plain `--`).
const SEPARATOR: &str = ".db.";

/// How long `create` (and `open` of a table still being created) waits for the table to become
/// ACTIVE. DynamoDB usually needs a few seconds; past this the database exists but is not
/// usable yet, and `create` answers `Unavailable` (PUT /{db} answers 503 and a later open finds
/// it once it is ACTIVE).
pub const ACTIVE_WAIT: Duration = Duration::from_secs(60);

/// Tries of CreateTable that meet a table of the same name being deleted.
const CREATE_ROUNDS: usize = 3;
/// How often a table being deleted is looked at.
const POLL: Duration = Duration::from_millis(250);

/// ListTables' largest page.
const LIST_PAGE: i32 = 100;
/// DescribeTable calls of one listing in flight at once.
const STATUS_CONCURRENCY: usize = 8;

pub struct DynamoCatalog {
    client: Client,
    /// The data-store table's configuration; a database's is this one with its own table name.
    base: DynamoConfig,
    /// Backends opened so far with their table's id, reused while a table of that id exists
    /// (each keeps whether its layout was seen current, which saves a read per open). A table
    /// deleted and created again by another process has a new id, so its database gets a new
    /// handle: nothing the old one remembered applies to it.
    open: Mutex<HashMap<DbName, OpenTable>>,
}

/// A database table's id (DynamoDB's `TableId`) and the backend opened over it.
type OpenTable = (Option<String>, Arc<DynamoDbBackend>);

impl DynamoCatalog {
    /// One SDK client for every database table (a `DynamoDbBackend` per table then costs no
    /// connection, credentials or configuration of its own: the SDK client is shared).
    pub async fn new(base: &DynamoConfig) -> Result<Self> {
        let client = DynamoDbBackend::connect(base).await?;
        Ok(DynamoCatalog::with_client(client, base))
    }

    /// The catalog of the data-store table `base` names, over an SDK client already made (what
    /// a running service uses: `DocumentBackend::catalog`).
    pub fn with_client(client: Client, base: &DynamoConfig) -> Self {
        DynamoCatalog { client, base: base.clone(), open: Mutex::new(HashMap::new()) }
    }

    fn prefix(&self) -> String {
        format!("{}{SEPARATOR}", self.base.table)
    }

    fn table_of(&self, name: &DbName) -> Result<String> {
        table_of(&self.base.table, name)
    }

    fn config_of(&self, table: String) -> DynamoConfig {
        DynamoConfig { table, create: false, user_index: false, ..self.base.clone() }
    }

    async fn status_of_table(&self, table: String) -> Result<Option<TableStatus>> {
        self.status(&table).await
    }

    /// The table's status; `None` when it does not exist.
    async fn status(&self, table: &str) -> Result<Option<TableStatus>> {
        Ok(self.described(table).await?.and_then(|(status, _)| status))
    }

    /// The table's status and id (DynamoDB's `TableId`, drawn at each creation); `None` when it
    /// does not exist.
    async fn described(&self, table: &str) -> Result<Option<(Option<TableStatus>, Option<String>)>> {
        match self.client.describe_table().table_name(table).send().await {
            Ok(output) => Ok(output.table.map(|t| (t.table_status, t.table_id))),
            Err(e) if e.as_service_error().is_some_and(|s| s.is_resource_not_found_exception()) => Ok(None),
            Err(e) => Err(map_sdk(e, &format!("describe table {table:?}"))),
        }
    }

    /// Waits (at most [`ACTIVE_WAIT`]) until a table being deleted is gone.
    async fn wait_until_gone(&self, table: &str) -> Result<()> {
        let deadline = std::time::Instant::now() + ACTIVE_WAIT;
        while self.status(table).await?.is_some() {
            if std::time::Instant::now() > deadline {
                return Err(Error::new(
                    ErrorKind::Unavailable,
                    format!("DynamoDB table {table:?} of a dropped database is still being deleted; try again later"),
                ));
            }
            tokio::time::sleep(POLL).await;
        }
        Ok(())
    }

    /// Waits for a table to become ACTIVE and makes sure it carries the layout marker (every
    /// database table is made by this release, so a missing marker only means its creator
    /// stopped before writing it).
    /// Whether the table is there and ACTIVE now (a failed look-up counts as not).
    async fn is_active(&self, table: &str) -> bool {
        matches!(self.described(table).await, Ok(Some((Some(TableStatus::Active), _))))
    }

    async fn ready(&self, backend: &DynamoDbBackend) -> Result<()> {
        backend.wait_until_active_within(ACTIVE_WAIT).await?;
        if let LayoutState::NeedsUpgrade(_) = backend.layout_state().await? {
            backend.write_marker().await?;
        }
        Ok(())
    }
}

/// The table of database `name` beside the data-store table `data_store`; `InvalidInput` when it
/// would be longer than DynamoDB allows.
/// The table of database `name`, whether or not DynamoDB takes it: the name escaped, or written
/// compactly where the escaped form would pass DynamoDB's 255 characters.
fn table_name(data_store: &str, name: &DbName) -> String {
    let prefix = format!("{data_store}{SEPARATOR}");
    let room = MAX_TABLE_NAME.saturating_sub(prefix.len());
    format!("{prefix}{}", name.encoded_within(room))
}

/// DynamoDB's longest table name.
const MAX_TABLE_NAME: usize = 255;

fn table_of(data_store: &str, name: &DbName) -> Result<String> {
    let table = table_name(data_store, name);
    check_table_name(&table).map_err(|_| {
        Error::invalid(
            "database name",
            format!(
                "\"{name}\" makes the DynamoDB table name {table:?} ({} characters); DynamoDB allows at most 255 (the \
                 data-store table's name, {SEPARATOR:?}, and the name)",
                table.len()
            ),
        )
    })?;
    Ok(table)
}

#[async_trait]
impl Catalog for DynamoCatalog {
    fn describe(&self) -> String {
        format!("DynamoDB tables {}* ({})", self.prefix(), self.base.redacted())
    }

    async fn create(&self, name: &DbName) -> Result<Arc<dyn DocumentBackend>> {
        let table = self.table_of(name)?;
        let backend = Arc::new(DynamoDbBackend::new(self.client.clone(), &self.config_of(table.clone())));
        // CreateTable answers ResourceInUse for a table that exists, whatever its state; one still
        // being deleted (a drop just now) is no database, so its deletion is waited out.
        let mut created = backend.create_table().await?;
        for _ in 0..CREATE_ROUNDS {
            if created {
                break;
            }
            match self.status(&table).await? {
                Some(TableStatus::Deleting) => self.wait_until_gone(&table).await?,
                // Gone since CreateTable answered.
                None => {}
                Some(_) => break,
            }
            created = backend.create_table().await?;
        }
        if !created {
            return Err(Error::conflict("The database could not be created, the file already exists."));
        }
        backend.wait_until_active_within(ACTIVE_WAIT).await.map_err(|err| {
            Error::new(
                ErrorKind::Unavailable,
                format!(
                    "database {name} was created as DynamoDB table {table:?}, which did not become ACTIVE within {} \
                     s; it will be usable once it is",
                    ACTIVE_WAIT.as_secs()
                ),
            )
            .with_source(err)
        })?;
        backend.write_marker().await?;
        let id = self.described(&table).await?.and_then(|(_, id)| id);
        self.open.lock().await.insert(name.clone(), (id, Arc::clone(&backend)));
        Ok(backend)
    }

    async fn open(&self, name: &DbName) -> Result<Option<Arc<dyn DocumentBackend>>> {
        // Names no table can have exist nowhere.
        let Ok(table) = self.table_of(name) else { return Ok(None) };
        // Asked every time: another process may have dropped (or re-created) it.
        let id = match self.described(&table).await? {
            None | Some((Some(TableStatus::Deleting), _)) => {
                self.open.lock().await.remove(name);
                return Ok(None);
            }
            Some((_, id)) => id,
        };
        if let Some((kept_id, backend)) = self.open.lock().await.get(name) {
            if *kept_id == id {
                return Ok(Some(Arc::clone(backend) as Arc<dyn DocumentBackend>));
            }
        }
        let backend = Arc::new(DynamoDbBackend::new(self.client.clone(), &self.config_of(table.clone())));
        if let Err(err) = self.ready(&backend).await {
            // Deleted (through another instance or request) between DescribeTable and these
            // reads: the database is missing, CouchDB's 404, not a misconfigured server's 500.
            if err.kind() == ErrorKind::Misconfigured && !self.is_active(&table).await {
                return Ok(None);
            }
            return Err(err);
        }
        self.open.lock().await.insert(name.clone(), (id, Arc::clone(&backend)));
        Ok(Some(backend))
    }

    async fn delete(&self, name: &DbName) -> Result<bool> {
        let Ok(table) = self.table_of(name) else { return Ok(false) };
        self.open.lock().await.remove(name);
        match self.client.delete_table().table_name(&table).send().await {
            Ok(_) => Ok(true),
            Err(e) if e.as_service_error().is_some_and(|s| s.is_resource_not_found_exception()) => Ok(false),
            // A table already being deleted is a database deleted (a second DELETE is CouchDB's
            // 404); one being created cannot be deleted yet.
            Err(e)
                if e.as_service_error().is_some_and(|s| s.is_resource_in_use_exception())
                    && matches!(self.status(&table).await, Ok(None | Some(TableStatus::Deleting))) =>
            {
                Ok(false)
            }
            Err(e) if e.as_service_error().is_some_and(|s| s.is_resource_in_use_exception()) => Err(Error::new(
                ErrorKind::Unavailable,
                format!("DynamoDB table {table:?} is being created or deleted; try again in a few seconds"),
            )
            .with_source(e)),
            Err(e) => Err(map_sdk(e, &format!("delete table {table:?}"))),
        }
    }

    async fn list(&self) -> Result<Vec<DbName>> {
        let prefix = self.prefix();
        let mut names = Vec::new();
        // Every page is read: DynamoDB does not promise the order of ListTables.
        let mut start: Option<String> = None;
        loop {
            let mut request = self.client.list_tables().limit(LIST_PAGE);
            if let Some(start) = &start {
                request = request.exclusive_start_table_name(start);
            }
            let output = request.send().await.map_err(|e| map_sdk(e, "list tables"))?;
            let room = MAX_TABLE_NAME.saturating_sub(prefix.len());
            names.extend(
                output.table_names().iter().filter_map(|t| DbName::decode_within(t.strip_prefix(&prefix)?, room)),
            );
            match output.last_evaluated_table_name {
                Some(last) => start = Some(last),
                None => break,
            }
        }
        names.sort();
        // A dropped table is listed while DynamoDB deletes it; it is no database any more. One
        // DescribeTable per database, a few at a time.
        // A plain loop, not an iterator adapter: a closure here trips rustc's higher-ranked
        // `Send` check on the futures.
        let mut lookups = Vec::with_capacity(names.len());
        for name in &names {
            lookups.push(self.status_of_table(table_name(&self.base.table, name)));
        }
        let statuses: Vec<Result<Option<TableStatus>>> =
            futures::stream::iter(lookups).buffered(STATUS_CONCURRENCY).collect().await;
        let mut live = Vec::with_capacity(names.len());
        for (name, status) in names.into_iter().zip(statuses) {
            if !matches!(status?, None | Some(TableStatus::Deleting)) {
                live.push(name);
            }
        }
        Ok(live)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn name(text: &str) -> DbName {
        DbName::parse(text).unwrap()
    }

    #[test]
    fn tables_are_named_from_the_data_store_table_and_the_encoded_name() {
        assert_eq!(table_of("agent_data_store", &name("a/b")).unwrap(), "agent_data_store.db.a.2fb");
        // 16 + 4 + 235 = 255 fits; one more does not. A name whose `/`s would take 3 each
        // escaped is written compactly (one character each) and fits as long as a plain one.
        assert!(table_of("agent_data_store", &name(&"a".repeat(235))).is_ok());
        assert!(table_of("agent_data_store", &name(&format!("a{}", "/".repeat(234)))).is_ok());
        for too_long in ["a".repeat(236), format!("a{}", "/".repeat(235))] {
            let err = table_of("agent_data_store", &name(&too_long)).unwrap_err();
            assert_eq!(err.kind(), ErrorKind::InvalidInput, "{too_long}");
        }
    }

    #[test]
    fn one_data_store_never_reads_another_ones_tables_as_its_own() {
        // Data store `t--a`'s database `x` against data store `t`'s database `a--x`, which a
        // plain `--` would name alike; and a data store whose own name holds the separator.
        for (other_store, db) in [("t--a", "x"), ("t.db.a", "x"), ("t", "a--x")] {
            let table = table_of(other_store, &name(db)).unwrap();
            let as_seen_by_t = table.strip_prefix("t.db.").and_then(DbName::decode);
            match (other_store, as_seen_by_t) {
                ("t", Some(found)) => assert_eq!(found.as_str(), db),
                (_, None) => {}
                (_, Some(found)) => panic!("data store t would list {found} of data store {other_store}"),
            }
        }
    }
}
