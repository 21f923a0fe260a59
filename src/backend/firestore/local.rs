//! Local documents: the `{collection}_local` collection, revision `0-N`; listed in `_id` order by
//! a query on that collection (Firestore's automatic single-field index on `_id`, no composite
//! index to deploy).

use serde_json::{json, Map, Value};

use super::backend::FirestoreBackend;
use super::codec;
use super::core::{fields_of, text, MAX_PAGE};
use super::ids::id_range_query;
use super::layout::{self};
use crate::backend::revision::next_local_revision;
use crate::backend::{IdRange, Page, Precondition, Revision, StoredDocument, LOCAL_PREFIX};
use crate::error::{Error, ErrorKind, Result};

/// Tries of a local-document write with no precondition that keeps meeting other writers.
pub(super) const LOCAL_TRIES: usize = 5;

/// Local document `name`'s id and its encoding, refused when it would not fit in one Firestore
/// document (a local document is never chunked).
fn encode_local(name: &str, body: &Map<String, Value>) -> Result<(String, codec::Encoded)> {
    let id = format!("{LOCAL_PREFIX}{name}");
    let encoded = codec::encode(&id, body)?;
    if !encoded.extra_chunks.is_empty() {
        return Err(Error::new(ErrorKind::TooLarge, format!("local document {id:?} is over one Firestore document")));
    }
    Ok((id, encoded))
}

impl FirestoreBackend {
    pub(super) fn local_name(&self, name: &str) -> String {
        self.client.name_in(&self.client.local_collection(), &codec::document_id(name))
    }

    /// The local document and its `updateTime`.
    pub(super) async fn read_local(&self, name: &str) -> Result<Option<(StoredDocument, String)>> {
        let doing = format!("read local document {name:?}");
        let reply = self.batch_get_fields(&[self.local_name(name)], None, &doing).await?;
        let Some(document) = reply.as_array().into_iter().flatten().find_map(|entry| entry.get("found")) else {
            return Ok(None);
        };
        let id = format!("{LOCAL_PREFIX}{name}");
        let fields = fields_of(document);
        let rev = text(document, &format!("/fields/{}/stringValue", layout::REV)).to_owned();
        let body = codec::decode(&id, fields, &[])?;
        Ok(Some((StoredDocument { id, rev: Revision(rev), body }, text(document, "/updateTime").to_owned())))
    }

    /// The local documents `names` (distinct) in one `:batchGet`, each under the name asked
    /// for.
    pub(super) async fn read_local_names(&self, names: Vec<String>) -> Result<Vec<(String, StoredDocument)>> {
        let resources: Vec<String> = names.iter().map(|name| self.local_name(name)).collect();
        let asked: std::collections::HashMap<&str, &str> =
            resources.iter().map(String::as_str).zip(names.iter().map(String::as_str)).collect();
        let reply = self.batch_get_fields(&resources, None, "read local documents in a batch").await?;
        let mut found = Vec::with_capacity(names.len());
        for document in reply.as_array().into_iter().flatten().filter_map(|entry| entry.get("found")) {
            let Some(&name) = asked.get(text(document, "/name")) else { continue };
            let id = format!("{LOCAL_PREFIX}{name}");
            let rev = text(document, &format!("/fields/{}/stringValue", layout::REV)).to_owned();
            let body = codec::decode(&id, fields_of(document), &[])?;
            found.push((name.to_owned(), StoredDocument { id, rev: Revision(rev), body }));
        }
        Ok(found)
    }

    /// One page of local documents whose names lie in `range`, in name order: one query over the
    /// local collection's `_id` (`_local/{name}`, so `_id` order is name order), from the page
    /// token (the last `_id` returned). Its cost is the page's reads.
    pub(super) async fn list_local(
        &self,
        range: &IdRange,
        limit: usize,
        page_token: Option<&str>,
    ) -> Result<Page<StoredDocument>> {
        let limit = limit.clamp(1, MAX_PAGE);
        let ids = range.under_prefix(LOCAL_PREFIX);
        if ids.holds_nothing() {
            return Ok(Page { items: Vec::new(), next: None });
        }
        let query = id_range_query(&self.client.local_collection(), &ids, Vec::new(), limit, page_token);
        let doing = "list local documents";
        let answer = self.run_raw_query(&query, None, doing).await?;
        let mut items = Vec::with_capacity(answer.documents.len());
        for document in &answer.documents {
            let fields = fields_of(document);
            let Some(id) = codec::stored_id(fields).filter(|id| id.starts_with(LOCAL_PREFIX)) else {
                return Err(Error::new(
                    ErrorKind::Corrupt,
                    format!("local document {:?} has no `_local/` id", text(document, "/name")),
                ));
            };
            let rev = text(document, &format!("/fields/{}/stringValue", layout::REV)).to_owned();
            let body = codec::decode(id, fields, &[])?;
            items.push(StoredDocument { id: id.to_owned(), rev: Revision(rev), body });
        }
        let next = match items.last() {
            Some(last) if answer.documents.len() >= limit => Some(last.id.clone()),
            _ => None,
        };
        Ok(Page { items, next })
    }

    pub(super) async fn write_local(
        &self,
        name: &str,
        body: &Map<String, Value>,
        precondition: Precondition,
    ) -> Result<Revision> {
        let (id, encoded) = encode_local(name, body)?;
        for _ in 0..LOCAL_TRIES {
            // A create needs no read: the precondition `exists: false` is the check.
            let current = match precondition {
                Precondition::MustNotExist | Precondition::NeverWritten => None,
                _ => self.read_local(name).await?,
            };
            let rev = next_local_revision(&id, &precondition, current.as_ref().map(|(doc, _)| &doc.rev))?;
            let previous_update_time = current.map(|(_, update_time)| update_time);
            let write = self.local_write(name, encoded.fields.clone(), &rev, previous_update_time.as_deref());
            match self.commit(vec![write], &format!("write local document {id:?}")).await {
                Ok(_) => return Ok(rev),
                Err(e) if matches!(e.kind(), ErrorKind::Conflict | ErrorKind::NotFound) => {
                    if precondition != Precondition::None {
                        return Err(Error::conflict(format!("local document {id:?} changed")).with_source(e));
                    }
                }
                Err(e) => return Err(e),
            }
        }
        Err(Error::new(ErrorKind::Unavailable, format!("local document {id:?} kept changing; try again")))
    }

    /// The write of local document `name` with `fields` (encoded) at revision `rev`: over the
    /// version of `previous_update_time`, or (none) only if no such document exists.
    fn local_write(
        &self,
        name: &str,
        mut fields: Map<String, Value>,
        rev: &Revision,
        previous_update_time: Option<&str>,
    ) -> Value {
        fields.insert(layout::REV.into(), json!({ "stringValue": rev.0 }));
        let mut write = json!({ "update": { "name": self.local_name(name), "fields": fields } });
        write["currentDocument"] = match previous_update_time {
            Some(update_time) => json!({ "updateTime": update_time }),
            None => json!({ "exists": false }),
        };
        write
    }

    /// The write creating local document `name` with `body`, only if none exists (its first
    /// revision), for a commit of several writes ([`FirestoreBackend::write_local`] with
    /// [`Precondition::MustNotExist`], without its commit).
    pub(super) fn local_create_write(&self, name: &str, body: &Map<String, Value>) -> Result<Value> {
        let (id, encoded) = encode_local(name, body)?;
        let rev = next_local_revision(&id, &Precondition::MustNotExist, None)?;
        Ok(self.local_write(name, encoded.fields, &rev, None))
    }

    pub(super) async fn remove_local(&self, name: &str, rev: &Revision) -> Result<()> {
        let id = format!("{LOCAL_PREFIX}{name}");
        let Some((doc, update_time)) = self.read_local(name).await? else {
            return Err(Error::not_found(format!("local document {id:?} does not exist")));
        };
        if &doc.rev != rev {
            return Err(Error::conflict(format!("local document {id:?} is not at revision {rev}")));
        }
        let write = json!({ "delete": self.local_name(name), "currentDocument": { "updateTime": update_time } });
        match self.commit(vec![write], &format!("delete local document {id:?}")).await {
            Ok(_) => Ok(()),
            Err(e) if matches!(e.kind(), ErrorKind::Conflict | ErrorKind::NotFound) => {
                match self.read_local(name).await? {
                    None => Err(Error::not_found(format!("local document {id:?} does not exist"))),
                    Some(_) => Err(Error::conflict(format!("local document {id:?} changed")).with_source(e)),
                }
            }
            Err(e) => Err(e),
        }
    }
}
