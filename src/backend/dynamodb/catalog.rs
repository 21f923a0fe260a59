//! The DynamoDB catalog: a table per database, named `{data-store table}.db.{encoded name}`
//! (docs/databases.md says why).
//!
//! Every item of a database (documents, tombstones, chunks, feed and id index entries, local
//! documents, the layout marker) lives in its table, so DeleteTable removes the database whole.
//! A database table has the document model's two indexes but not the user/namespace GSI: only
//! the data-store table answers the facade's listings.
//!
//! Which database a table holds is its layout marker's: `create` writes the marker last, with a
//! creation id drawn for that database, and `delete` marks it dropped before DeleteTable. Every
//! request's `open` is one consistent GetItem of the marker (a data-plane read, one read unit),
//! never DescribeTable, a control-plane call AWS throttles per account; DescribeTable is left to
//! creation, deletion waits, the layout check (once per handle), health and counts.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use aws_sdk_dynamodb::types::{AttributeValue, TableStatus};
use aws_sdk_dynamodb::Client;
use futures::StreamExt;
use tokio::sync::Mutex;

use super::backend::DynamoDbBackend;
use super::codec;
use super::config::{check_table_name, DynamoConfig};
use super::error::map_sdk;
use super::layout;
use crate::backend::catalog::{Catalog, DbName};
use crate::backend::DocumentBackend;
use crate::error::{Error, ErrorKind, Result};

/// Between the data-store table's name and a database's encoded name. An encoded name never
/// holds `.db` (it would stand for the byte 0xdb, which no database name has), so a table name
/// splits into data-store table and database in one way only, and one data store's databases
/// are never read as another's (`t` with database `a--x` against `t--a` with `x` would collide
/// under a plain `--`).
const SEPARATOR: &str = ".db.";

/// How long `create` waits for the table to become ACTIVE. DynamoDB usually needs a few
/// seconds; past this the table exists without its layout marker, so it is no database yet, and
/// `create` answers `Unavailable` (PUT /{db} answers 503; a later create takes the table over).
pub const ACTIVE_WAIT: Duration = Duration::from_secs(60);

/// Tries of CreateTable that meet a table of the same name being deleted.
const CREATE_ROUNDS: usize = 3;
/// How often a table being deleted is looked at.
const POLL: Duration = Duration::from_millis(250);

/// ListTables' largest page.
const LIST_PAGE: i32 = 100;
/// Marker reads of one listing in flight at once.
const MARKER_READ_CONCURRENCY: usize = 8;

pub struct DynamoCatalog {
    client: Client,
    /// The data-store table's configuration; a database's is this one with its own table name.
    base: DynamoConfig,
    /// Backends opened so far with their database's creation id, reused while the marker holds
    /// that id (each keeps whether its layout was seen current, which saves a read per open). A
    /// database deleted and created again by another process has a new creation id, so it gets a
    /// new handle: nothing the old one remembered applies to it.
    open: Mutex<HashMap<DbName, OpenTable>>,
}

/// A database's creation id and the backend opened over its table.
type OpenTable = (String, Arc<DynamoDbBackend>);

/// What a table's layout marker says of the database of its name.
#[derive(Debug, PartialEq)]
enum Marker {
    /// No such table, or one still being created (DynamoDB answers reads of it not found).
    NoTable,
    /// A table without its marker: a creation not acknowledged yet, or one cut short.
    Missing,
    /// The database was deleted; its table is being deleted, or was left by a deletion cut short.
    Dropped,
    /// A database, with its creation id (`None`: a marker written before creation ids existed).
    Live(Option<String>),
}

/// Whether an SDK error is DynamoDB's ResourceNotFoundException (no such table).
fn table_missing<E, R>(err: &aws_sdk_dynamodb::error::SdkError<E, R>) -> bool
where
    E: aws_sdk_dynamodb::error::ProvideErrorMetadata,
{
    err.as_service_error().and_then(|e| e.code()) == Some("ResourceNotFoundException")
}

/// Whether an SDK error is a failed condition of a conditional write.
fn condition_failed<E, R>(err: &aws_sdk_dynamodb::error::SdkError<E, R>) -> bool
where
    E: aws_sdk_dynamodb::error::ProvideErrorMetadata,
{
    err.as_service_error().and_then(|e| e.code()) == Some("ConditionalCheckFailedException")
}

/// A new creation id: the creating clock's milliseconds and 64 random bits.
fn new_creation_id() -> String {
    format!("{}-{}", layout::now_millis(), crate::backend::random_token())
}

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

    /// The table's status; `None` when it does not exist.
    async fn status(&self, table: &str) -> Result<Option<TableStatus>> {
        match self.client.describe_table().table_name(table).send().await {
            Ok(output) => Ok(output.table.and_then(|t| t.table_status)),
            Err(e) if table_missing(&e) => Ok(None),
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

    /// The table's layout marker, read consistently: what it says of the database.
    async fn marker(&self, table: &str) -> Result<Marker> {
        let read = self
            .client
            .get_item()
            .table_name(table)
            .key(codec::ID, AttributeValue::S(layout::MARKER_ID.into()))
            .consistent_read(true)
            .projection_expression("#id, #creation, #dropped")
            .expression_attribute_names("#id", codec::ID)
            .expression_attribute_names("#creation", layout::CREATION)
            .expression_attribute_names("#dropped", layout::DROPPED)
            .send()
            .await;
        let item = match read {
            Ok(output) => output.item,
            Err(e) if table_missing(&e) => return Ok(Marker::NoTable),
            Err(e) => return Err(map_sdk(e, &format!("read the layout marker of table {table:?}"))),
        };
        Ok(match item {
            None => Marker::Missing,
            Some(item) if item.contains_key(layout::DROPPED) => Marker::Dropped,
            Some(item) => Marker::Live(codec::string_attribute(&item, layout::CREATION).map(str::to_owned)),
        })
    }

    /// The creation id of the database in `table`; `None` when no database is there. A marker of
    /// a release before creation ids is given one here, once: the conditional write lets one
    /// instance's id win, and every instance reads the winner back, so all agree on it (a
    /// fallback to DescribeTable's `TableId` instead would keep the control-plane call on every
    /// request for such tables for good).
    async fn creation_of(&self, table: &str) -> Result<Option<String>> {
        match self.marker(table).await? {
            Marker::Live(Some(creation)) => return Ok(Some(creation)),
            Marker::Live(None) => {}
            Marker::NoTable | Marker::Missing | Marker::Dropped => return Ok(None),
        }
        self.write_creation(table, &new_creation_id()).await?;
        match self.marker(table).await? {
            Marker::Live(Some(creation)) => Ok(Some(creation)),
            Marker::Live(None) => Err(Error::new(
                ErrorKind::Internal,
                format!("DynamoDB table {table:?}: the layout marker kept no creation id after it was given one"),
            )),
            Marker::NoTable | Marker::Missing | Marker::Dropped => Ok(None),
        }
    }

    /// Gives an existing marker without a creation id this one (a lost race leaves the other's).
    async fn write_creation(&self, table: &str, creation: &str) -> Result<()> {
        let doing = format!("give the layout marker of table {table:?} a creation id");
        self.set_marker_field_once(table, layout::CREATION, AttributeValue::S(creation.to_owned()), &doing).await?;
        Ok(())
    }

    /// Sets `field` of the layout marker in `table` to `value` if the marker is there and the
    /// field is not: `true` when this call set it, `false` when there was no marker (or no
    /// table) or the field was set already. Conditional, so of two writers at once one sets it.
    async fn set_marker_field_once(
        &self,
        table: &str,
        field: &str,
        value: AttributeValue,
        doing: &str,
    ) -> Result<bool> {
        let written = self
            .client
            .update_item()
            .table_name(table)
            .key(codec::ID, AttributeValue::S(layout::MARKER_ID.into()))
            .update_expression("SET #field = :value")
            .condition_expression("attribute_exists(#id) AND attribute_not_exists(#field)")
            .expression_attribute_names("#id", codec::ID)
            .expression_attribute_names("#field", field)
            .expression_attribute_values(":value", value)
            .send()
            .await;
        match written {
            Ok(_) => Ok(true),
            Err(e) if condition_failed(&e) || table_missing(&e) => Ok(false),
            Err(e) => Err(map_sdk(e, doing)),
        }
    }

    /// Writes the marker of a new database in `backend`'s table, with `creation`, unless a marker
    /// is there: whether the database is this creation's (a resent write that had landed is).
    async fn claim(&self, backend: &DynamoDbBackend, creation: &str) -> Result<bool> {
        let table = backend.table();
        let item = DynamoDbBackend::new_database_marker(creation);
        let written = self
            .client
            .put_item()
            .table_name(table)
            .set_item(Some(item))
            .condition_expression("attribute_not_exists(#id)")
            .expression_attribute_names("#id", codec::ID)
            .send()
            .await;
        match written {
            Ok(_) => Ok(true),
            Err(e) if condition_failed(&e) => Ok(self.marker(table).await? == Marker::Live(Some(creation.to_owned()))),
            Err(e) => Err(map_sdk(e, &format!("write the layout marker of table {table:?}"))),
        }
    }

    /// Marks the database in `table` dropped: `true` when this call did, `false` when there was
    /// no database (no table, no marker, or one marked already). Conditional, so of two
    /// deletions at once one finds it.
    async fn mark_dropped(&self, table: &str) -> Result<bool> {
        let doing = format!("mark the database of table {table:?} dropped");
        self.set_marker_field_once(table, layout::DROPPED, AttributeValue::Bool(true), &doing).await
    }

    /// DeleteTable of a dropped database's table. A table already going (or gone) is fine; one
    /// DynamoDB cannot delete now (being updated) stays, marked, until its name is created again
    /// (`create` deletes it first) or the DELETE is sent again.
    async fn delete_table(&self, table: &str) -> Result<()> {
        match self.client.delete_table().table_name(table).send().await {
            Ok(_) => Ok(()),
            Err(e) if table_missing(&e) => Ok(()),
            Err(e) if e.as_service_error().is_some_and(|s| s.is_resource_in_use_exception()) => {
                tracing::warn!(
                    table,
                    "the table of a dropped database is busy; it is deleted when its name is created again"
                );
                Ok(())
            }
            Err(e) => Err(map_sdk(e, &format!("delete table {table:?}"))),
        }
    }

    /// Makes the table of a new database: CreateTable, or, when a table of that name is there,
    /// what it holds decides. `Conflict` (CouchDB's 412) when it holds a database.
    async fn make_table(&self, backend: &DynamoDbBackend) -> Result<()> {
        let table = backend.table();
        for _ in 0..CREATE_ROUNDS {
            if backend.create_table().await? {
                return Ok(());
            }
            match self.marker(table).await? {
                Marker::Live(_) => break,
                // Being made by another creation, or left by one cut short: the marker's
                // conditional write decides whose database it is (`claim`).
                Marker::Missing => return Ok(()),
                // Left by a deletion: deleted first (CreateTable answers ResourceInUse for a table
                // that exists, whatever its state).
                Marker::Dropped => {
                    self.delete_table(table).await?;
                    self.wait_until_gone(table).await?;
                }
                Marker::NoTable => match self.status(table).await? {
                    Some(TableStatus::Deleting) => self.wait_until_gone(table).await?,
                    // Gone since CreateTable answered.
                    None => {}
                    Some(_) => return Ok(()),
                },
            }
        }
        Err(Error::conflict("The database could not be created, the file already exists."))
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
        self.make_table(&backend).await?;
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
        let creation = new_creation_id();
        if !self.claim(&backend, &creation).await? {
            return Err(Error::conflict("The database could not be created, the file already exists."));
        }
        self.open.lock().await.insert(name.clone(), (creation, Arc::clone(&backend)));
        Ok(backend)
    }

    async fn open(&self, name: &DbName) -> Result<Option<Arc<dyn DocumentBackend>>> {
        // Names no table can have exist nowhere.
        let Ok(table) = self.table_of(name) else { return Ok(None) };
        // Asked every time: another process may have dropped (or re-created) it.
        let Some(creation) = self.creation_of(&table).await? else {
            self.open.lock().await.remove(name);
            return Ok(None);
        };
        let mut open = self.open.lock().await;
        if let Some((kept, backend)) = open.get(name) {
            if *kept == creation {
                return Ok(Some(Arc::clone(backend) as Arc<dyn DocumentBackend>));
            }
        }
        let backend = Arc::new(DynamoDbBackend::new(self.client.clone(), &self.config_of(table)));
        open.insert(name.clone(), (creation, Arc::clone(&backend)));
        Ok(Some(backend))
    }

    async fn delete(&self, name: &DbName) -> Result<bool> {
        let Ok(table) = self.table_of(name) else { return Ok(false) };
        self.open.lock().await.remove(name);
        // Marked first: every instance's next open reads the database gone, even while
        // DynamoDB still serves reads of the table being deleted.
        if self.mark_dropped(&table).await? {
            self.delete_table(&table).await?;
            return Ok(true);
        }
        // A deletion cut short after its mark is finished (CouchDB's 404 all the same).
        if self.marker(&table).await? == Marker::Dropped {
            self.delete_table(&table).await?;
        }
        Ok(false)
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
        // A table is a database while its marker says so (not one being created, dropped or
        // being deleted): one consistent GetItem per table, a few at a time.
        // A plain loop, not an iterator adapter: a closure here trips rustc's higher-ranked
        // `Send` check on the futures.
        let tables: Vec<String> = names.iter().map(|name| table_name(&self.base.table, name)).collect();
        let mut lookups = Vec::with_capacity(names.len());
        for table in &tables {
            lookups.push(self.marker(table));
        }
        let markers: Vec<Result<Marker>> =
            futures::stream::iter(lookups).buffered(MARKER_READ_CONCURRENCY).collect().await;
        let mut live = Vec::with_capacity(names.len());
        for (name, marker) in names.into_iter().zip(markers) {
            if matches!(marker?, Marker::Live(_)) {
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
