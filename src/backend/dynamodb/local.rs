//! Local documents (`_local/{name}`, replication checkpoints) on DynamoDB: items with that id, the
//! body as JSON text in `_json`, revision `0-N`, no `userId`, `namespace` or `_seq` (so neither
//! the user index nor the feed ever sees them; scans skip them by their id), and a `_shard` of the
//! local shards ([`super::layout::LOCAL_SHARD_BASE`]), which puts them in the id index apart from
//! the documents: `local_docs` lists them from there ([`super::ids`]).

use std::collections::HashMap;

use aws_sdk_dynamodb::types::AttributeValue;
use serde_json::{Map, Value};

use super::backend::DynamoDbBackend;
use super::codec;
use super::error::{map_sdk, map_sdk_write};
use super::layout::{local_shard_of, LOCAL_BODY, SHARD};
use crate::backend::revision::next_local_revision;
use crate::backend::{Precondition, Revision, StoredDocument, LOCAL_PREFIX};
use crate::error::{Error, ErrorKind, Result};

/// Rounds of an unconditional local write that loses races before it gives up.
const CONFLICT_ROUNDS: usize = 8;

fn local_id(name: &str) -> Result<String> {
    if name.is_empty() {
        return Err(Error::invalid("local document name", "must not be empty"));
    }
    Ok(format!("{LOCAL_PREFIX}{name}"))
}

/// The local document an item `id` holds.
fn local_of(id: String, item: &HashMap<String, AttributeValue>) -> Result<StoredDocument> {
    let rev = codec::string_attribute(item, codec::REV).unwrap_or_default().to_owned();
    let body = match codec::string_attribute(item, LOCAL_BODY)
        .map(|text| crate::model::depth::parse_stored::<Map<String, Value>>(text.as_bytes()))
    {
        Some(Ok(body)) => body,
        _ => return Err(Error::new(ErrorKind::Corrupt, format!("DynamoDB local document {id:?} has no JSON body"))),
    };
    Ok(StoredDocument { id, rev: Revision(rev), body })
}

impl DynamoDbBackend {
    pub(super) async fn read_local(&self, name: &str) -> Result<Option<StoredDocument>> {
        let id = local_id(name)?;
        let output = self.consistent_get(&id).send().await.map_err(|e| map_sdk(e, "read a local document"))?;
        let Some(item) = output.item else { return Ok(None) };
        local_of(id, &item).map(Some)
    }

    /// The local documents `names` (distinct, at most a BatchGetItem's keys) in one strongly
    /// consistent BatchGetItem, each under the name asked for.
    pub(super) async fn read_local_keys(&self, names: Vec<String>) -> Result<Vec<(String, StoredDocument)>> {
        let ids = names.iter().map(|name| local_id(name)).collect::<Result<Vec<_>>>()?;
        let mut found = Vec::with_capacity(ids.len());
        for item in self.batch_get_with_retries(&ids).await? {
            let Some(id) = codec::string_attribute(&item, codec::ID) else { continue };
            let Some(name) = id.strip_prefix(LOCAL_PREFIX) else { continue };
            found.push((name.to_owned(), local_of(id.to_owned(), &item)?));
        }
        Ok(found)
    }

    pub(super) async fn write_local(
        &self,
        name: &str,
        body: &Map<String, Value>,
        precondition: Precondition,
    ) -> Result<Revision> {
        let id = local_id(name)?;
        let json =
            serde_json::to_string(body).map_err(|e| Error::new(ErrorKind::Internal, "encode body").with_source(e))?;
        for _ in 0..CONFLICT_ROUNDS {
            let current = self.read_local(name).await?.map(|doc| doc.rev);
            let rev = next_local_revision(&id, &precondition, current.as_ref())?;
            let item = HashMap::from([
                (codec::ID.to_owned(), AttributeValue::S(id.clone())),
                (codec::REV.to_owned(), AttributeValue::S(rev.0.clone())),
                (LOCAL_BODY.to_owned(), AttributeValue::S(json.clone())),
                (SHARD.to_owned(), AttributeValue::N(local_shard_of(&id).to_string())),
            ]);
            let request = self.client().put_item().table_name(self.table()).set_item(Some(item));
            let request = match &current {
                None => request
                    .condition_expression("attribute_not_exists(#id)")
                    .expression_attribute_names("#id", codec::ID),
                Some(found) => request
                    .condition_expression("#rev = :rev")
                    .expression_attribute_names("#rev", codec::REV)
                    .expression_attribute_values(":rev", AttributeValue::S(found.0.clone())),
            };
            match request.send().await {
                Ok(_) => return Ok(rev),
                Err(err) => {
                    let err = map_sdk_write(err, &format!("write local document {id:?}"));
                    if !err.is_conflict() || precondition != Precondition::None {
                        return Err(err);
                    }
                }
            }
        }
        Err(Error::conflict(format!("local document {id:?} kept changing under an unconditional write")))
    }

    pub(super) async fn remove_local(&self, name: &str, rev: &Revision) -> Result<()> {
        let id = local_id(name)?;
        let result = self
            .client()
            .delete_item()
            .table_name(self.table())
            .set_key(Some(Self::key(&id)))
            .condition_expression("#rev = :rev")
            .expression_attribute_names("#rev", codec::REV)
            .expression_attribute_values(":rev", AttributeValue::S(rev.0.clone()))
            .send()
            .await;
        match result {
            Ok(_) => Ok(()),
            Err(err) => {
                let err = map_sdk_write(err, &format!("delete local document {id:?}"));
                if !err.is_conflict() {
                    return Err(err);
                }
                match self.read_local(name).await? {
                    Some(_) => Err(err),
                    None => Err(Error::not_found(format!("local document {id:?} does not exist"))),
                }
            }
        }
    }
}
