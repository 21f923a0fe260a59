//! The Firestore catalog: a marker document per database in one catalog collection
//! (`{collection}_databases/{encoded name}`), and the database's collections under that marker
//! (docs/databases.md says why).
//!
//! The marker holds the database's name, an instance id drawn at creation, and whether it is
//! being dropped. The database's collections are `db_documents` (with their chunk
//! subcollections), `db_documents_local`, `db_documents_meta` and `db_documents_attachments`, under
//! `{marker}/instances/{instance}`: the adapter's sibling collections (`{collection}_local`,
//! `{collection}_meta`) stay inside the database; a re-created database (a new instance) never
//! sees an old one's documents, even one a handle of another process wrote after the drop; and
//! the collection id is the same in every database, so the composite indexes deployed for it
//! (`firestore.indexes.json`, scoped to a collection id) serve them all. A drop first marks the marker
//! `dropping` (from then on the database neither opens nor lists), then deletes every document of
//! the database, then the marker; a drop cut short is finished by the next drop or create.

use std::collections::HashMap;
use std::sync::Arc;

use async_trait::async_trait;
use reqwest::Method;
use serde_json::{json, Value};
use tokio::sync::Mutex;

use super::backend::FirestoreBackend;
use super::codec;
use super::config::FirestoreConfig;
use super::core::{fields_of, select, Call, FirestoreClient};
use crate::backend::catalog::{Catalog, DbName};
use crate::backend::{DocumentBackend, LayoutState};
use crate::error::{Error, ErrorKind, Result};

/// The collection id of every database's documents.
pub const DATA_COLLECTION: &str = "db_documents";

/// The marker's fields.
const NAME: &str = "name";
const INSTANCE: &str = "instance";
const DROPPING: &str = "dropping";

/// Documents deleted per commit (Firestore's limit of writes in one commit), and markers read per
/// listing page.
const PAGE: usize = 500;
/// Rounds of a drop or create that meet a concurrent change of the same marker.
const ROUNDS: usize = 4;

/// A database's marker as read.
struct Marker {
    /// The resource name and update time, for preconditions.
    name: String,
    update_time: String,
    instance: String,
    dropping: bool,
}

pub struct FirestoreCatalog {
    /// A client of the catalog collection (at the root of the Firestore database).
    client: FirestoreClient,
    base: FirestoreConfig,
    /// Backends opened so far with their instance, reused while the marker names that instance.
    open: Mutex<HashMap<DbName, (String, Arc<FirestoreBackend>)>>,
}

impl FirestoreCatalog {
    pub async fn new(base: &FirestoreConfig) -> Result<Self> {
        let catalog =
            FirestoreConfig { collection: format!("{}_databases", base.collection), parent: None, ..base.clone() };
        let client = FirestoreClient::connect(&catalog).await?;
        Ok(FirestoreCatalog { client, base: base.clone(), open: Mutex::new(HashMap::new()) })
    }

    /// The marker document's path below the root: the parent of the database's collections.
    fn marker_path(&self, name: &DbName) -> String {
        format!("{}/{}", self.client.collection(), name.encoded())
    }

    /// The document the collections of one instance of the database live under.
    fn instance_path(&self, name: &DbName, instance: &str) -> String {
        format!("{}/instances/{instance}", self.marker_path(name))
    }

    fn backend_of(&self, name: &DbName, instance: &str) -> FirestoreBackend {
        let parent = self.instance_path(name, instance);
        let client = self.client.below(&parent, DATA_COLLECTION);
        let config = FirestoreConfig { collection: DATA_COLLECTION.into(), parent: Some(parent), ..self.base.clone() };
        FirestoreBackend::with_client(client, &config)
    }

    async fn read_marker(&self, name: &DbName) -> Result<Option<Marker>> {
        let document = self.client.root_document_name(&self.marker_path(name));
        let body = json!({ "documents": [document] });
        let reply = self
            .client
            .call(Method::POST, &self.client.method_url("batchGet"), Some(&body), Call::Read, "read a database marker")
            .await?;
        let Some(found) = reply.as_array().into_iter().flatten().find_map(|entry| entry.get("found")) else {
            return Ok(None);
        };
        Ok(Some(marker_of(found)))
    }

    async fn commit(&self, writes: Vec<Value>, doing: &str) -> Result<Value> {
        let body = json!({ "writes": writes });
        self.client.call(Method::POST, &self.client.method_url("commit"), Some(&body), Call::Write, doing).await
    }

    /// Every document of a database being dropped, then its marker (only if it is still the one
    /// read: a concurrent drop or create may have finished it first).
    async fn finish_drop(&self, name: &DbName, marker: &Marker) -> Result<()> {
        let parent = self.instance_path(name, &marker.instance);
        for collection in [
            format!("{DATA_COLLECTION}_local"),
            format!("{DATA_COLLECTION}_meta"),
            format!("{DATA_COLLECTION}_attachments"),
            DATA_COLLECTION.into(),
        ] {
            self.delete_all(&parent, &collection).await?;
        }
        let delete = json!({ "delete": marker.name, "currentDocument": { "updateTime": marker.update_time } });
        match self.commit(vec![delete], "delete a database marker").await {
            Ok(_) => Ok(()),
            Err(err) if matches!(err.kind(), ErrorKind::Conflict | ErrorKind::NotFound) => Ok(()),
            Err(err) => Err(err),
        }
    }

    /// Deletes every document of the collection `collection_id` under `parent` with its chunk
    /// documents, a page at a time (one read and one delete per document, one delete per chunk).
    async fn delete_all(&self, parent: &str, collection_id: &str) -> Result<()> {
        let scope = self.client.below(parent, collection_id);
        let query = json!({ "structuredQuery": {
            "select": select(&["__name__", codec::CHUNKS]),
            "from": [{ "collectionId": collection_id }],
            "limit": PAGE,
        } });
        loop {
            let reply = scope
                .call(Method::POST, &scope.query_url("runQuery"), Some(&query), Call::Read, "list a dropped database")
                .await?;
            let mut writes = Vec::new();
            for document in reply.as_array().into_iter().flatten().filter_map(|r| r.get("document")) {
                let Some(name) = document.get("name").and_then(Value::as_str) else { continue };
                let chunks = codec::chunk_count(fields_of(document));
                writes.extend(
                    (1..=chunks).map(|n| json!({ "delete": format!("{name}/{}/{n}", codec::CHUNK_COLLECTION) })),
                );
                writes.push(json!({ "delete": name }));
            }
            if writes.is_empty() {
                return Ok(());
            }
            for group in writes.chunks(PAGE) {
                self.commit(group.to_vec(), "delete a dropped database's documents").await?;
            }
        }
    }

    /// Writes a new marker (instance drawn now); `Conflict` when one exists.
    async fn write_marker(&self, name: &DbName) -> Result<String> {
        let mut random = [0u8; 16];
        getrandom::fill(&mut random)
            .map_err(|e| Error::new(ErrorKind::Internal, format!("no randomness for an instance id: {e}")))?;
        let instance = hex::encode(random);
        let write = json!({
            "update": {
                "name": self.client.root_document_name(&self.marker_path(name)),
                "fields": {
                    NAME: { "stringValue": name.as_str() },
                    INSTANCE: { "stringValue": instance },
                    DROPPING: { "booleanValue": false },
                },
            },
            "currentDocument": { "exists": false },
        });
        self.commit(vec![write], "create a database marker").await?;
        Ok(instance)
    }
}

fn marker_of(document: &Value) -> Marker {
    let fields = fields_of(document);
    Marker {
        name: document.get("name").and_then(Value::as_str).unwrap_or("").to_owned(),
        update_time: document.get("updateTime").and_then(Value::as_str).unwrap_or("").to_owned(),
        instance: fields
            .get(INSTANCE)
            .and_then(|v| v.get("stringValue"))
            .and_then(Value::as_str)
            .unwrap_or("")
            .to_owned(),
        dropping: fields.get(DROPPING).and_then(|v| v.get("booleanValue")).and_then(Value::as_bool).unwrap_or(false),
    }
}

/// Makes sure a database opened has its layout marker. `create` writes the database's marker,
/// then its layout marker: a create cut between the two (a crash, a failed call) leaves a
/// database that lists and takes writes, but whose feed and `_all_docs` would then refuse it as
/// a store of an earlier release (documents, no layout marker). Every instance of a catalog
/// database was made by this layout, so the marker is written at the first open, as DynamoDB's
/// catalog does (docs/design/crash-points.md, "Creating and deleting a database").
async fn ready(backend: &FirestoreBackend) -> Result<()> {
    if let LayoutState::NeedsUpgrade(_) = backend.layout_state().await? {
        backend.record_layout().await?;
    }
    Ok(())
}

#[async_trait]
impl Catalog for FirestoreCatalog {
    fn describe(&self) -> String {
        format!("Firestore databases under {}/* ({})", self.client.collection(), self.base.redacted())
    }

    async fn create(&self, name: &DbName) -> Result<Arc<dyn DocumentBackend>> {
        for _ in 0..ROUNDS {
            match self.write_marker(name).await {
                Ok(instance) => {
                    let backend = Arc::new(self.backend_of(name, &instance));
                    // A new, empty database has this release's layout: recorded now, so no later
                    // open has to look.
                    backend.record_layout().await?;
                    self.open.lock().await.insert(name.clone(), (instance, Arc::clone(&backend)));
                    return Ok(backend);
                }
                Err(err) if err.kind() == ErrorKind::Conflict => match self.read_marker(name).await? {
                    // The name is free once a drop cut short is finished.
                    Some(marker) if marker.dropping => self.finish_drop(name, &marker).await?,
                    Some(_) => {
                        return Err(Error::conflict("The database could not be created, the file already exists."))
                    }
                    // Dropped meanwhile: try again.
                    None => {}
                },
                Err(err) => return Err(err),
            }
        }
        Err(Error::new(ErrorKind::Unavailable, format!("database {name} is being created and dropped concurrently")))
    }

    async fn open(&self, name: &DbName) -> Result<Option<Arc<dyn DocumentBackend>>> {
        // Read every time: another process may have dropped or re-created it.
        let marker = match self.read_marker(name).await? {
            Some(marker) if !marker.dropping => marker,
            _ => {
                self.open.lock().await.remove(name);
                return Ok(None);
            }
        };
        let mut open = self.open.lock().await;
        if let Some((instance, backend)) = open.get(name) {
            if *instance == marker.instance {
                return Ok(Some(Arc::clone(backend) as Arc<dyn DocumentBackend>));
            }
        }
        let backend = Arc::new(self.backend_of(name, &marker.instance));
        ready(&backend).await?;
        open.insert(name.clone(), (marker.instance, Arc::clone(&backend)));
        Ok(Some(backend))
    }

    async fn delete(&self, name: &DbName) -> Result<bool> {
        self.open.lock().await.remove(name);
        for _ in 0..ROUNDS {
            let Some(marker) = self.read_marker(name).await? else { return Ok(false) };
            if marker.dropping {
                // Another drop was cut short (or is running): finish it; this one found nothing.
                self.finish_drop(name, &marker).await?;
                return Ok(false);
            }
            let mark = json!({
                "update": { "name": marker.name, "fields": { DROPPING: { "booleanValue": true } } },
                "updateMask": { "fieldPaths": [DROPPING] },
                "currentDocument": { "updateTime": marker.update_time },
            });
            let reply = match self.commit(vec![mark], "mark a database dropped").await {
                Ok(reply) => reply,
                // Changed since it was read (dropped, re-created): look again.
                Err(err) if err.kind() == ErrorKind::Conflict => continue,
                Err(err) => return Err(err),
            };
            let update_time = reply.pointer("/writeResults/0/updateTime").and_then(Value::as_str).unwrap_or("");
            let marked = Marker { update_time: update_time.to_owned(), dropping: true, ..marker };
            self.finish_drop(name, &marked).await?;
            return Ok(true);
        }
        Err(Error::new(ErrorKind::Unavailable, format!("database {name} is being created and dropped concurrently")))
    }

    async fn list(&self) -> Result<Vec<DbName>> {
        let mut names = Vec::new();
        let mut after: Option<String> = None;
        loop {
            let mut query = json!({
                "select": { "fields": [{ "fieldPath": DROPPING }] },
                "from": [{ "collectionId": self.client.collection() }],
                "orderBy": [{ "field": { "fieldPath": "__name__" }, "direction": "ASCENDING" }],
                "limit": PAGE,
            });
            if let Some(last) = &after {
                query["startAt"] = json!({ "values": [{ "referenceValue": last }], "before": false });
            }
            let body = json!({ "structuredQuery": query });
            let reply = self
                .client
                .call(Method::POST, &self.client.query_url("runQuery"), Some(&body), Call::Read, "list the databases")
                .await?;
            let documents: Vec<&Value> =
                reply.as_array().into_iter().flatten().filter_map(|r| r.get("document")).collect();
            for document in &documents {
                let marker = marker_of(document);
                let encoded = self.client.document_id_of(&marker.name).unwrap_or("");
                if !marker.dropping {
                    names.extend(DbName::decode(encoded));
                }
            }
            match documents.last() {
                Some(last) if documents.len() >= PAGE => {
                    after = last.get("name").and_then(Value::as_str).map(str::to_owned);
                }
                _ => break,
            }
        }
        names.sort();
        Ok(names)
    }
}
