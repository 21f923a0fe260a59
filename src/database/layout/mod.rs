//! Tree layouts: how a document's revision tree is laid out over a backend's records, behind
//! one interface ([`TreeLayout`]), and the one crash-repair rule the engine applies over every
//! layout ([`must_save`], [`read_repairing`]).
//!
//! "Layout" because that is all that differs between the databases here: CouchDB's rules on the
//! tree (`crate::backend::rev_tree`) and the engine's write cycle are the same; where the leaves
//! of the tree are kept, and in how many backend writes a save is made, is the layout's.
//!
//! - [`record`]: the engine's layout, every database but the data-store one: the whole tree in
//!   the document's record, a deleted document's tree in the local document `tree:{id}`.
//! - [`data_store`]: the data-store database's layout: the record is the seed's document
//!   holding the winning revision (what the REST API and the facade read), the other leaves in
//!   the local document `:leaves:{id}`.
//! - [`native`]: the data-store database on a backend that keeps revision trees itself (the
//!   CouchDB backend): the tree is the backend's own document, each new leaf written through the
//!   backend's own calls (an edit checked by the backend against its parent, a replicated leaf
//!   as sent), so the backend, not this server, decides between concurrent editors.
//!
//! The engine (`crate::database::engine`) serves both: a database holds a [`Layout`], either
//! layout behind one enum that is itself a [`TreeLayout`] (its token a [`LayoutToken`]), so the
//! engine and its handlers stay one, non-generic type whichever layout a database has. What else
//! depends on the layout is here too: the names of the local documents a database keeps
//! ([`LocalNames`]; on the data-store database [`reserved_local_name`] is the one list of names
//! no client may write, both faces check it), whether it keeps inner bodies, and how its trees
//! are listed and scanned.
//!
//! Three traits, none with a default method (a wrapper that forwards a layout forwards each
//! method or does not compile): [`RepairableLayout`], what the crash-repair rule below needs
//! (read, save, tell an unfinished save), which the engine's repairing reads wrap; [`TreeLayout`]
//! on top, what the engine needs besides (erase, listings, [`TreeLayout::kept_bodies`]); and
//! [`KeptBodies`], the place for inner revisions' bodies and the attachments their bodies
//! reference, which a layout without one (both data-store layouts) answers `None` for, once.
//!
//! ## The crash-repair rule
//! A save that writes two places writes the side place first (the local document: the engine's
//! `tree:{id}`, the data store's `:leaves:{id}`), in a form that says the save is not finished,
//! and the record last: the record is what the change feed, `_all_docs` and the REST API read.
//! A state read that shows an unfinished save ([`RepairableLayout::unfinished`]: the data-store
//! layout's mark, the engine layout's side tree without the record after it) is finished by the
//! engine by saving the tree read over itself, which each layout makes do the steps the crash
//! cut:
//! - on the document's next write, even one that changes nothing (a replicated revision the
//!   tree already holds): [`must_save`];
//! - on the next read that loads the side place where a replicator decides what to send
//!   ([`read_repairing`], [`read_many_repairing`]: the data-store layout's tree reads; the
//!   record layout's `_revs_diff`, `_missing_revs`, `_bulk_get` and `open_revs`), so that a
//!   replicator's `_revs_diff` of the leaf it sent before the crash, which finds it, repairs the
//!   document instead of leaving it out of the feed for good. Such a read answers even when the
//!   repair fails ([`finished`]).
//!
//! docs/design/crash-points.md lists each layout's multi-step writes, the crash point after
//! each step and this repair.

pub mod data_store;
pub mod native;
pub mod record;
use std::collections::HashSet;
use std::sync::Arc;

use async_trait::async_trait;
use futures::future::BoxFuture;

use crate::backend::rev_tree::{RevTree, WinnerText};
use crate::backend::{DocumentBackend, StoredDocument, StoredText};
use crate::error::{Error, ErrorKind, Result};

/// A document's tree as a layout read it, with what the next save must match (`token`, opaque
/// to the engine: the revisions of the places the layout read).
#[derive(Debug, Clone)]
pub struct LaidOut<T> {
    pub tree: RevTree,
    pub token: T,
}

impl<T> LaidOut<T> {
    /// Whether the winning leaf is deleted (or there is none).
    pub fn deleted(&self) -> bool {
        self.tree.winner().is_none_or(|leaf| leaf.deleted)
    }

    /// The winning revision.
    pub fn winner_rev(&self) -> Option<String> {
        self.tree.winner().map(|leaf| leaf.path.leaf_rev())
    }
}

/// One document's state as a layout read it, `None` when nothing is stored for the id.
pub type MaybeLaidOut<T> = Option<LaidOut<T>>;

/// A document's live winner as its record stores it: the revision and the body as the stored
/// JSON text of an object. What a read answers as is where nothing in the answer changes: the
/// document is `_id`, `_rev`, then the body's members in their stored order and text
/// ([`AnswerableWinner::write_document`]), the bytes the parsed tree's answer
/// (`crate::database::document::leaf_json` written by serde_json) would have, because the
/// record's text was written by serde_json from a parsed body in the first place.
#[derive(Debug, Clone, PartialEq)]
pub struct AnswerableWinner {
    pub rev: crate::backend::Revision,
    pub json: String,
}

impl AnswerableWinner {
    /// The text `json` of a record when it can be answered as is: UTF-8 (what a parse would
    /// check; a record that is not goes the parsed way and fails there as before), an object,
    /// none of whose member names (at any depth, and conservatively no string) starts with
    /// `_`. Those are what a document's answer treats apart (`_attachments` shown as stubs,
    /// `_id`/`_rev` never twice), so such a body is answered from its parsed tree instead; none
    /// of the data-store documents' own members is one.
    pub fn answerable(rev: crate::backend::Revision, json: Vec<u8>) -> Option<AnswerableWinner> {
        let object = json.first() == Some(&b'{') && json.last() == Some(&b'}');
        if !object || memchr::memmem::find(&json, b"\"_").is_some() {
            return None;
        }
        String::from_utf8(json).ok().map(|json| AnswerableWinner { rev, json })
    }

    /// Appends the document as a read answers it: `{"_id":…,"_rev":…` and then the body's
    /// members as stored.
    pub fn write_document(&self, id: &str, out: &mut String) {
        out.reserve(self.json.len() + id.len() + self.rev.as_str().len() + 20);
        // `json` is an object (`answerable`): its members are what lies between its braces.
        let members = &self.json[1..self.json.len() - 1];
        crate::database::document::open_document_text(id, self.rev.as_str(), members, out);
        out.push('}');
    }
}

/// `text` as a JSON string, escaped as serde_json escapes it.
pub fn write_json_string(text: &str, out: &mut String) {
    // A str is always a valid JSON string: writing it cannot fail.
    out.push_str(&serde_json::to_string(text).unwrap_or_default());
}

/// A document as a plain read of its winner serves it ([`Layout::read_served`]).
#[derive(Debug, Clone)]
pub enum Served<T> {
    /// A live record with no other leaf beside it (so no save of it left unfinished), whose
    /// text is answered as is.
    Alone(AnswerableWinner),
    /// Any other document: its state as [`Layout::read_as_served`] reads it.
    State(LaidOut<T>),
}

/// What the crash-repair rule needs of a layout ([`must_save`], [`read_repairing`],
/// [`read_many_repairing`], [`finished`]): read a document's tree, tell a save a crash cut
/// short, and save a tree (the tree read saved over itself finishes such a save). Kept apart
/// from the engine's [`TreeLayout`] so that what wraps a layout for a repair (the engine's
/// repairing reads) implements these four methods, every one of them, and nothing else.
#[async_trait]
pub trait RepairableLayout: Send + Sync {
    /// What a save must match, read with the tree.
    type Token: Clone + Send + Sync + std::fmt::Debug + 'static;

    /// One document's state; `None` when nothing is stored for the id.
    async fn read(&self, id: &str) -> Result<Option<LaidOut<Self::Token>>>;

    /// Many documents' states, one per id, in order.
    async fn read_many(&self, ids: &[String]) -> Result<Vec<Option<LaidOut<Self::Token>>>>;

    /// Saves `tree` over `before` (`None`: nothing was stored) with the backend's preconditions:
    /// [`ErrorKind::Conflict`] when another writer got in first (the engine reads again and
    /// retries). Saving the tree read over itself finishes a save a crash cut short.
    async fn save(&self, id: &str, before: Option<&LaidOut<Self::Token>>, tree: &RevTree) -> Result<()>;

    /// Whether `state` is what a save cut short by a crash leaves.
    async fn unfinished(&self, id: &str, state: &LaidOut<Self::Token>) -> Result<bool>;
}

/// What a tree layout does for the engine, on top of what the crash-repair rule needs.
#[async_trait]
pub trait TreeLayout: RepairableLayout {
    /// Erases every trace of one id (its last leaf purged), of no other id.
    async fn erase(&self, id: &str, state: &LaidOut<Self::Token>) -> Result<()>;

    /// The states of documents the backend's id order listed (`DocumentBackend::all_docs`, one
    /// page), in order: every listed record's, also one whose winner is deleted (a deletion cut
    /// before its tombstone, which the engine finishes and leaves out of the listing).
    async fn listed(&self, documents: Vec<StoredDocument>) -> Result<Vec<(String, LaidOut<Self::Token>)>>;

    /// The layout's place for bodies beyond the leaves' (inner revisions' bodies until
    /// `_compact`, and the attachment bytes any kept body references); `None` where it keeps
    /// none (the data-store layouts: every save drops inner bodies, the database's bounds are 0,
    /// and no attachment is taken).
    fn kept_bodies(&self) -> Option<&dyn KeptBodies<Token = Self::Token>>;
}

/// What a layout that keeps bodies beyond the leaves' does ([`TreeLayout::kept_bodies`]).
#[async_trait]
pub trait KeptBodies: Send + Sync {
    /// The token of the layout's states.
    type Token: Clone + Send + Sync + std::fmt::Debug + 'static;

    /// One page of the ids whose stored trees keep inner bodies (what `_compact` rewrites),
    /// after `cursor`; `limit` bounds the backend page read, not the ids answered.
    async fn inner_bodies_page(&self, cursor: Option<ScanCursor>, limit: usize) -> Result<ScanPage>;

    /// Rewrites a document's tree without its inner bodies (`tree`, read as `state`): an
    /// ordinary save, or less where the layout can (the engine's rewrites a deleted document's
    /// side tree in place, its tombstone left as it is).
    async fn save_without_inner_bodies(&self, id: &str, state: &LaidOut<Self::Token>, tree: &RevTree) -> Result<()>;

    /// Every SHA-256 of attachment bytes a kept body (a leaf's or an inner revision's) of any
    /// stored tree references: what the collector keeps.
    async fn attachment_references(&self) -> Result<HashSet<String>>;
}

/// Where a scan over a layout's stored trees is: in the records' id order, or in its side
/// places' (the backend's page tokens).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ScanCursor {
    Records(String),
    SidePlaces(Option<String>),
}

/// One page of a scan ([`KeptBodies::inner_bodies_page`]): `next` is `None` at its end.
#[derive(Debug, Clone, Default)]
pub struct ScanPage {
    pub ids: Vec<String>,
    pub next: Option<ScanCursor>,
}

/// The layout of one database ([`crate::database::Database`]): the engine serves both, so its
/// handlers stay one, non-generic (`Arc<Database>`), whichever layout a database has. An enum
/// rather than a type parameter of `Database` for that reason: every handler, Mango, the views'
/// source and the write guard take the one `Database` type, and a dispatch per backend call
/// costs nothing beside the call.
pub enum Layout {
    /// Every database but the data-store one ([`record`]).
    Record(record::RecordLayout),
    /// The data-store database ([`data_store`]).
    DataStore(data_store::DataStoreLayout),
    /// The data-store database on a backend keeping trees itself ([`native`]).
    Native(native::NativeLayout),
}

/// What a save of a [`Layout`] must match: the token of its layout.
#[derive(Debug, Clone)]
pub enum LayoutToken {
    Record(record::RecordToken),
    DataStore(data_store::SideToken),
    Native(native::NativeToken),
}

impl LayoutToken {
    /// The engine layout's token, `None` for another layout's.
    pub fn record(&self) -> Option<&record::RecordToken> {
        match self {
            LayoutToken::Record(token) => Some(token),
            LayoutToken::DataStore(_) | LayoutToken::Native(_) => None,
        }
    }
}

/// The names of the local documents a database keeps for itself and for its clients, which
/// depend on its layout: the engine's databases own their namespace, the data-store database
/// shares the backend's top level with the facade and its clients' local documents as they were
/// named before the engine served it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LocalNames {
    /// The start of a client's local document `_local/{name}` (`{prefix}{name}`).
    pub client_prefix: &'static str,
    /// The database's settings (`_revs_limit`, `_security`).
    pub settings: &'static str,
    /// The database's incarnation for view indexes (`crate::views::source`).
    pub views_incarnation: &'static str,
    /// The count of feed entries purges took out (`crate::database::seq`), which keeps a feed's
    /// rank from going back.
    pub erased: &'static str,
}

/// The engine's own local documents on its databases: every name but a client's `doc:…`.
const RECORD_LOCAL_NAMES: LocalNames = LocalNames {
    client_prefix: "doc:",
    settings: "db:settings",
    views_incarnation: "views-incarnation",
    erased: "db:erased",
};

/// The start of the data-store database's design documents' local documents.
pub const DESIGN_SIDE_PREFIX: &str = ":design:";
/// The start of the data-store database's views' local documents.
pub const VIEWS_SIDE_PREFIX: &str = ":views:";
/// The start of the engine's own local documents on the data-store database (its settings, its
/// purge count).
pub const ENGINE_SIDE_PREFIX: &str = ":db:";

/// The data-store database's: a client's `_local/x` is the backend's local document `x` (a
/// per-user login's `{user}:x`), as the data-store face has always named it; the engine's own
/// start with `:`, which no per-user name can (user ids are never empty), under prefixes
/// [`reserved_local_name`] refuses to an admin. (`db:erased` would be a per-user login `db`'s
/// `_local/erased`: the purge count is `:db:erased`.)
const DATA_STORE_LOCAL_NAMES: LocalNames = LocalNames {
    client_prefix: "",
    settings: ":db:settings",
    views_incarnation: ":views:incarnation",
    erased: ":db:erased",
};

/// The starts of the data-store database's local-document names it keeps for itself: every
/// document's other leaves, design documents, views, the engine's settings.
pub const RESERVED_LOCAL_PREFIXES: [&str; 4] =
    [data_store::SIDE_PREFIX, DESIGN_SIDE_PREFIX, VIEWS_SIDE_PREFIX, ENGINE_SIDE_PREFIX];

/// Whether a backend local-document name on the data-store database is one this server keeps
/// for itself, never a client's: the one list both the data-store face and the engine check
/// (an admin's `_local/{name}` is stored as `name`, so a name for which this holds is refused).
pub fn reserved_local_name(name: &str) -> bool {
    RESERVED_LOCAL_PREFIXES.iter().any(|prefix| name.starts_with(prefix))
}

impl Layout {
    /// The engine's layout over `backend`.
    pub fn record(backend: Arc<dyn DocumentBackend>) -> Self {
        Layout::Record(record::RecordLayout::new(backend))
    }

    /// The data-store database's layout over `backend`.
    pub fn data_store(backend: Arc<dyn DocumentBackend>) -> Self {
        Layout::DataStore(data_store::DataStoreLayout::new(backend))
    }

    /// The data-store database's layout over a backend keeping trees itself.
    pub fn native(backend: Arc<dyn DocumentBackend>) -> Self {
        Layout::Native(native::NativeLayout::new(backend))
    }

    /// Whether this is one of the data-store database's layouts.
    pub fn is_data_store(&self) -> bool {
        matches!(self, Layout::DataStore(_) | Layout::Native(_))
    }

    /// The local-document names of a database of this layout.
    pub fn local_names(&self) -> LocalNames {
        match self {
            Layout::Record(_) => RECORD_LOCAL_NAMES,
            Layout::DataStore(_) | Layout::Native(_) => DATA_STORE_LOCAL_NAMES,
        }
    }

    /// Saves `tree` over `before` ([`RepairableLayout::save`]) where `edited` are the revisions this
    /// save's ordinary edits computed; answers the revision each was stored as where the
    /// backend assigns it (the [`native`] layout), nothing where it is stored as computed.
    pub async fn save_edited(
        &self,
        id: &str,
        before: Option<&LaidOut<LayoutToken>>,
        tree: &RevTree,
        edited: &[String],
    ) -> Result<Vec<native::StoredAs>> {
        match self {
            Layout::Native(layout) => {
                let token = before.map(native_state).transpose()?;
                layout.save_edited(id, token.as_ref(), tree, edited).await
            }
            _ => self.save(id, before, tree).await.map(|()| Vec::new()),
        }
    }

    /// Whether an ordinary edit is written as the backend's own edit (the [`native`] layout:
    /// CouchDB keeps the tree): the backend checks it against the document as it is then (a
    /// creation without `_rev` is refused over a live document, and made a new revision of a
    /// deleted one) and stems it by its own `_revs_limit`, so the tree the engine edits in memory
    /// is never stored as such and stemming it changes nothing.
    pub fn edits_are_the_backends(&self) -> bool {
        matches!(self, Layout::Native(_))
    }

    /// Whether a creation of `id` (an edit naming no parent, not a deletion) may be saved
    /// without reading the document first, the save itself failing unless nothing was ever
    /// stored under the id: always on the [`native`] layout (the backend's own edit); on the
    /// engine's layout where the backend checks [`crate::backend::Precondition::NeverWritten`]
    /// in the write and no local tree is under the id ([`record`]), and on the data-store
    /// layout where no side document is ([`data_store`]): one read where a whole read is two,
    /// the one that finds what a save cut short left (which reads back and must stay). Over
    /// anything stored the save is a conflict and the engine reads and applies as for any write
    /// (issue 38).
    pub async fn creates_unread(&self, id: &str) -> Result<bool> {
        match self {
            Layout::Native(_) => Ok(true),
            Layout::Record(layout) => layout.creates_unread(id).await,
            Layout::DataStore(layout) => layout.creates_unread(id).await,
        }
    }

    /// Whether a listing's states hold whole trees (else only the winner: a `conflicts=true`
    /// listing reads the listed documents' trees again).
    pub fn lists_whole_trees(&self) -> bool {
        !matches!(self, Layout::Native(_))
    }

    /// One document's state as the engine serves a read of it: where the layout repairs on
    /// reads (the data-store layout, whose tree reads always have: a replicator's `_revs_diff`
    /// of a leaf a crash left out of the feed repairs it), an unfinished save finished first
    /// ([`read_repairing`]); else as read (the engine's layout repairs on the next write).
    pub async fn read_as_served(&self, id: &str) -> Result<Option<LaidOut<LayoutToken>>> {
        match self {
            Layout::Record(_) | Layout::Native(_) => self.read(id).await,
            Layout::DataStore(_) => read_repairing(self, id).await,
        }
    }

    /// One document as a plain read of its winner (no query option) serves it: on the
    /// data-store layout, a live record with no other leaves as its stored text
    /// ([`data_store::DataStoreView::read_served`]: issue 38, a data-store `GET` parsed the
    /// body, built the answer and wrote it again); else, and on the other layouts, the state
    /// [`Self::read_as_served`] reads. `None` when nothing is stored for the id.
    pub async fn read_served(&self, id: &str) -> Result<Option<Served<LayoutToken>>> {
        match self {
            Layout::DataStore(layout) => Ok(layout.read_served(id).await?.map(|served| match served {
                Served::Alone(text) => Served::Alone(text),
                Served::State(state) => Served::State(tokened(state, LayoutToken::DataStore)),
            })),
            Layout::Record(_) | Layout::Native(_) => Ok(self.read_as_served(id).await?.map(Served::State)),
        }
    }

    /// Whether [`Self::listed_served`] answers (the data-store layout alone).
    pub fn lists_served(&self) -> bool {
        matches!(self, Layout::DataStore(_))
    }

    /// A listing's page of live records (their stored text) as a listing with documents serves
    /// them, on the data-store layout: each record with no other leaves as its text, the others
    /// read as [`TreeLayout::listed`] reads them; `None` for the other layouts.
    pub async fn listed_served(
        &self,
        documents: Vec<StoredText>,
    ) -> Option<Result<Vec<(String, Served<LayoutToken>)>>> {
        let Layout::DataStore(layout) = self else { return None };
        let listed = layout.listed_served(documents).await.map(|listed| {
            listed
                .into_iter()
                .map(|(id, served)| {
                    let served = match served {
                        Served::Alone(text) => Served::Alone(text),
                        Served::State(state) => Served::State(tokened(state, LayoutToken::DataStore)),
                    };
                    (id, served)
                })
                .collect()
        });
        Some(listed)
    }

    /// The states of `ids` with every live record's tree read without its bodies, where the
    /// layout can read them so (the engine's: [`record::RecordLayout::read_many_outlines`]);
    /// `None` for the other layouts. For readers that show revisions only; never saved.
    pub async fn read_many_outlines(&self, ids: &[String]) -> Option<Result<Vec<Option<LaidOut<LayoutToken>>>>> {
        let Layout::Record(layout) = self else { return None };
        let states = layout.read_many_outlines(ids).await;
        Some(states.map(|states| states.into_iter().map(|s| s.map(|s| tokened(s, LayoutToken::Record))).collect()))
    }

    /// The winner of each live record of `ids` with its body as stored text, where the layout
    /// keeps whole trees in records over a backend that keeps their text (the engine's:
    /// [`record::RecordLayout::winner_texts`]); `Ok(None)` for the other layouts and backends.
    pub async fn winner_texts(&self, ids: &[String]) -> Result<Option<Vec<Option<WinnerText>>>> {
        let Layout::Record(layout) = self else { return Ok(None) };
        layout.winner_texts(ids).await
    }

    /// [`TreeLayout::listed`] from the records' stored text, for the engine's layout (whose
    /// records hold whole trees); `None` for the other layouts, which list from documents.
    pub fn listed_text(&self, documents: Vec<StoredText>) -> Option<Result<Vec<ListedState>>> {
        let Layout::Record(_) = self else { return None };
        let listed = record::RecordLayout::listed_text(documents);
        Some(listed.map(|listed| listed.into_iter().map(|(id, s)| (id, tokened(s, LayoutToken::Record))).collect()))
    }

    /// The engine's layout, `None` for another: what the engine's batched bulk path needs.
    /// The data-store layout, `None` for another.
    pub fn as_data_store(&self) -> Option<&data_store::DataStoreLayout> {
        match self {
            Layout::DataStore(layout) => Some(layout),
            Layout::Record(_) | Layout::Native(_) => None,
        }
    }

    /// On the data-store layout, the one record write that saving `tree` over `before` is, when
    /// that is all it is ([`data_store::record_write_of`]); `None` on the other layouts.
    pub fn record_write_of<'t>(
        &self,
        id: &'t str,
        before: Option<&LaidOut<LayoutToken>>,
        tree: &'t RevTree,
    ) -> Option<data_store::RecordWrite<'t>> {
        if !matches!(self, Layout::DataStore(_)) {
            return None;
        }
        let token = match before {
            Some(state) => Some(side_token(&state.token).ok()?),
            None => None,
        };
        data_store::record_write_of(id, token, tree)
    }

    /// Whether [`Layout::record_write_of`] is `Some`, decided without writing the write's head.
    pub fn is_record_write(&self, before: Option<&LaidOut<LayoutToken>>, tree: &RevTree) -> bool {
        if !matches!(self, Layout::DataStore(_)) {
            return false;
        }
        match before {
            Some(state) => side_token(&state.token).is_ok_and(|token| data_store::is_record_write(Some(token), tree)),
            None => data_store::is_record_write(None, tree),
        }
    }

    pub fn as_record(&self) -> Option<&record::RecordLayout> {
        match self {
            Layout::Record(layout) => Some(layout),
            Layout::DataStore(_) | Layout::Native(_) => None,
        }
    }
}

/// A state read by one layout handed to another: a bug, never a client's doing.
fn wrong_token() -> Error {
    Error::new(ErrorKind::Internal, "a document state read by one tree layout was handed to another")
}

fn record_token(token: &LayoutToken) -> Result<&record::RecordToken> {
    token.record().ok_or_else(wrong_token)
}

fn side_token(token: &LayoutToken) -> Result<&data_store::SideToken> {
    match token {
        LayoutToken::DataStore(token) => Ok(token),
        _ => Err(wrong_token()),
    }
}

fn native_state(state: &LaidOut<LayoutToken>) -> Result<native::NativeState> {
    match state.token {
        LayoutToken::Native(_) => Ok(LaidOut { tree: state.tree.clone(), token: native::NativeToken }),
        _ => Err(wrong_token()),
    }
}

/// A listed document's id and state.
pub type ListedState = (String, LaidOut<LayoutToken>);

fn tokened<T>(state: LaidOut<T>, wrap: fn(T) -> LayoutToken) -> LaidOut<LayoutToken> {
    LaidOut { tree: state.tree, token: wrap(state.token) }
}

#[async_trait]
impl RepairableLayout for Layout {
    type Token = LayoutToken;

    async fn read(&self, id: &str) -> Result<Option<LaidOut<LayoutToken>>> {
        Ok(match self {
            Layout::Record(layout) => layout.read(id).await?.map(|s| tokened(s, LayoutToken::Record)),
            Layout::DataStore(layout) => layout.read(id).await?.map(|s| tokened(s, LayoutToken::DataStore)),
            Layout::Native(layout) => layout.read(id).await?.map(|s| tokened(s, LayoutToken::Native)),
        })
    }

    async fn read_many(&self, ids: &[String]) -> Result<Vec<Option<LaidOut<LayoutToken>>>> {
        Ok(match self {
            Layout::Record(layout) => {
                layout.read_many(ids).await?.into_iter().map(|s| s.map(|s| tokened(s, LayoutToken::Record))).collect()
            }
            Layout::DataStore(layout) => layout
                .read_many(ids)
                .await?
                .into_iter()
                .map(|s| s.map(|s| tokened(s, LayoutToken::DataStore)))
                .collect(),
            Layout::Native(layout) => {
                layout.read_many(ids).await?.into_iter().map(|s| s.map(|s| tokened(s, LayoutToken::Native))).collect()
            }
        })
    }

    async fn save(&self, id: &str, before: Option<&LaidOut<LayoutToken>>, tree: &RevTree) -> Result<()> {
        match self {
            Layout::Record(layout) => {
                let token = before.map(|state| record_token(&state.token)).transpose()?;
                layout.save_over(id, token, tree).await
            }
            Layout::DataStore(layout) => {
                let token = before.map(|state| side_token(&state.token)).transpose()?;
                layout.save_over(id, token, tree).await
            }
            Layout::Native(layout) => {
                let state = before.map(native_state).transpose()?;
                layout.save(id, state.as_ref(), tree).await
            }
        }
    }

    async fn unfinished(&self, id: &str, state: &LaidOut<LayoutToken>) -> Result<bool> {
        match self {
            Layout::Record(layout) => layout.unfinished_of(id, record_token(&state.token)?, state.deleted()).await,
            Layout::DataStore(_) => Ok(side_token(&state.token)?.marked()),
            Layout::Native(layout) => layout.unfinished(id, &native_state(state)?).await,
        }
    }
}

#[async_trait]
impl TreeLayout for Layout {
    async fn erase(&self, id: &str, state: &LaidOut<LayoutToken>) -> Result<()> {
        match self {
            Layout::Record(layout) => layout.erase_of(id, record_token(&state.token)?).await,
            Layout::DataStore(layout) => layout.erase_of(id, side_token(&state.token)?).await,
            Layout::Native(layout) => layout.erase(id, &native_state(state)?).await,
        }
    }

    async fn listed(&self, documents: Vec<StoredDocument>) -> Result<Vec<(String, LaidOut<LayoutToken>)>> {
        Ok(match self {
            Layout::Record(layout) => layout
                .listed(documents)
                .await?
                .into_iter()
                .map(|(id, s)| (id, tokened(s, LayoutToken::Record)))
                .collect(),
            Layout::DataStore(layout) => layout
                .listed(documents)
                .await?
                .into_iter()
                .map(|(id, s)| (id, tokened(s, LayoutToken::DataStore)))
                .collect(),
            Layout::Native(layout) => layout
                .listed(documents)
                .await?
                .into_iter()
                .map(|(id, s)| (id, tokened(s, LayoutToken::Native)))
                .collect(),
        })
    }

    /// Where the database's own layout keeps them: this enum, which forwards to it with its
    /// own token.
    fn kept_bodies(&self) -> Option<&dyn KeptBodies<Token = LayoutToken>> {
        match self {
            Layout::Record(layout) => layout.kept_bodies().is_some(),
            Layout::DataStore(layout) => layout.kept_bodies().is_some(),
            Layout::Native(layout) => layout.kept_bodies().is_some(),
        }
        .then_some(self as &dyn KeptBodies<Token = LayoutToken>)
    }
}

/// Reached through [`TreeLayout::kept_bodies`], which answers it only where the database's own
/// layout keeps such bodies: each call goes to that layout's.
#[async_trait]
impl KeptBodies for Layout {
    type Token = LayoutToken;

    async fn inner_bodies_page(&self, cursor: Option<ScanCursor>, limit: usize) -> Result<ScanPage> {
        match self {
            Layout::Record(layout) => kept(layout)?.inner_bodies_page(cursor, limit).await,
            Layout::DataStore(layout) => kept(layout)?.inner_bodies_page(cursor, limit).await,
            Layout::Native(layout) => kept(layout)?.inner_bodies_page(cursor, limit).await,
        }
    }

    async fn save_without_inner_bodies(&self, id: &str, state: &LaidOut<LayoutToken>, tree: &RevTree) -> Result<()> {
        match self {
            Layout::Record(layout) => {
                let state = LaidOut { tree: state.tree.clone(), token: record_token(&state.token)?.clone() };
                kept(layout)?.save_without_inner_bodies(id, &state, tree).await
            }
            Layout::DataStore(layout) => {
                let state = LaidOut { tree: state.tree.clone(), token: side_token(&state.token)?.clone() };
                kept(layout)?.save_without_inner_bodies(id, &state, tree).await
            }
            Layout::Native(layout) => kept(layout)?.save_without_inner_bodies(id, &native_state(state)?, tree).await,
        }
    }

    async fn attachment_references(&self) -> Result<HashSet<String>> {
        match self {
            Layout::Record(layout) => kept(layout)?.attachment_references().await,
            Layout::DataStore(layout) => kept(layout)?.attachment_references().await,
            Layout::Native(layout) => kept(layout)?.attachment_references().await,
        }
    }
}

/// A layout's place for kept bodies, where [`Layout::kept_bodies`] said there is one.
fn kept<L: TreeLayout>(layout: &L) -> Result<&dyn KeptBodies<Token = L::Token>> {
    layout
        .kept_bodies()
        .ok_or_else(|| Error::new(ErrorKind::Internal, "kept bodies were asked of a tree layout that keeps none"))
}

/// How many times a read that found an unfinished save tries to finish it against other writers
/// before answering the tree as read.
pub const FINISH_ATTEMPTS: usize = 16;

/// The rule on writes: a write saves when it changed the tree, and also when it changed nothing
/// but the state it read is an unfinished save (else a document a crash left out of the feed
/// stays out for good: every later replicated write of its leaves changes nothing).
///
/// Boxed with its lifetimes named (as the trait's methods are): an `async fn` generic over the
/// layout and its token's references trips rustc's higher-ranked `Send` check in the handlers
/// that await it.
pub fn must_save<'a, L: RepairableLayout + ?Sized>(
    layout: &'a L,
    id: &'a str,
    state: Option<&'a LaidOut<L::Token>>,
    changed: bool,
) -> BoxFuture<'a, Result<bool>> {
    Box::pin(async move {
        if changed {
            return Ok(true);
        }
        match state {
            Some(state) => layout.unfinished(id, state).await,
            None => Ok(false),
        }
    })
}

/// The rule on reads: the document's state, an unfinished save finished first (the tree read
/// over itself, against other writers). The read answers even when finishing fails: the tree
/// read holds every leaf already (the side place is written first), only the record lags.
/// Boxed as [`must_save`] is.
pub fn read_repairing<'a, L: RepairableLayout + ?Sized>(
    layout: &'a L,
    id: &'a str,
) -> BoxFuture<'a, Result<Option<LaidOut<L::Token>>>> {
    Box::pin(async move {
        let state = layout.read(id).await?;
        Ok(finished(layout, id, state).await)
    })
}

/// Unfinished saves finished at once among many documents' reads.
const FINISHING_AT_ONCE: usize = 16;

/// The rule on reads of many documents ([`read_repairing`] for each, in one batched read): one
/// state per id, in order, each unfinished save among them finished first.
pub fn read_many_repairing<'a, L: RepairableLayout + ?Sized>(
    layout: &'a L,
    ids: &'a [String],
) -> BoxFuture<'a, Result<Vec<MaybeLaidOut<L::Token>>>> {
    Box::pin(async move {
        let states = layout.read_many(ids).await?;
        let mut answered = Vec::with_capacity(states.len());
        let mut states = ids.iter().zip(states).peekable();
        while states.peek().is_some() {
            let finishing: Vec<_> =
                states.by_ref().take(FINISHING_AT_ONCE).map(|(id, state)| finished(layout, id, state)).collect();
            answered.extend(futures::future::join_all(finishing).await);
        }
        Ok(answered)
    })
}

/// `state`, as read, with the save it shows unfinished finished: the tree read saved over
/// itself, then read again, at most [`FINISH_ATTEMPTS`] times against other writers. Whatever
/// fails on the way answers the last state read (the leaves are all there; only the record
/// lags), so a read never fails for a repair it could not make.
pub fn finished<'a, L: RepairableLayout + ?Sized>(
    layout: &'a L,
    id: &'a str,
    state: Option<LaidOut<L::Token>>,
) -> BoxFuture<'a, Option<LaidOut<L::Token>>> {
    Box::pin(finished_unboxed(layout, id, state))
}

async fn finished_unboxed<L: RepairableLayout + ?Sized>(
    layout: &L,
    id: &str,
    mut state: Option<LaidOut<L::Token>>,
) -> Option<LaidOut<L::Token>> {
    let unanswered = |err: crate::error::Error| {
        tracing::warn!(id, error = %err, "finishing a save a crash cut short failed; answering the tree as read");
    };
    for _ in 0..FINISH_ATTEMPTS {
        let read = state.as_ref()?;
        match layout.unfinished(id, read).await {
            Ok(false) => return state,
            Ok(true) => {}
            Err(err) => {
                unanswered(err);
                return state;
            }
        }
        match layout.save(id, Some(read), &read.tree).await {
            Ok(()) => {}
            Err(err) if err.kind() == ErrorKind::Conflict => {}
            Err(err) => {
                unanswered(err);
                return state;
            }
        }
        match layout.read(id).await {
            Ok(again) => state = again,
            Err(err) => {
                unanswered(err);
                return state;
            }
        }
    }
    state
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The data-store database's own local names (and the engine's settings on it) are
    /// reserved; no per-user login's name (`{user}:…`, the user never empty) can be one.
    #[test]
    fn the_data_store_databases_own_local_names_are_reserved() {
        let own = DATA_STORE_LOCAL_NAMES;
        for reserved in [":leaves:u:n:k", ":design:d", own.views_incarnation, own.settings, own.erased] {
            assert!(reserved_local_name(reserved), "{reserved}");
        }
        for client in ["checkpoint", "u:checkpoint", "u::leaves:x", "db:settings", "db:erased", "design:x"] {
            assert!(!reserved_local_name(client), "{client}");
        }
        assert_eq!(own.client_prefix, "", "a client's `_local/x` is the backend's `x`, as before");
    }

    /// Every literal value of the round-trip corpus (`fixtures/values/roundtrip.json`): deep,
    /// unicode, escapes, numbers past a double, big objects.
    fn corpus_values() -> Vec<serde_json::Value> {
        let text = include_str!("../../../fixtures/values/roundtrip.json");
        let file: serde_json::Value = serde_json::from_str(text).expect("the corpus is JSON");
        let cases = file["cases"].as_array().expect("the corpus has cases");
        cases.iter().filter_map(|case| case.get("value").cloned()).collect()
    }

    /// A record's text answered as is ([`AnswerableWinner::write_document`]) is, byte for byte, the
    /// answer built from the parsed tree (`leaf_json` written by serde_json, what a read answered
    /// before), for every value of the corpus in a data-store body, ids needing escapes, and
    /// the empty body; a body the text cannot be answered for holds a member starting with `_`.
    #[test]
    fn a_winner_answered_from_its_text_is_the_trees_answer() {
        use crate::backend::rev_tree::RevTree;
        use crate::database::document::{leaf_json, DocOptions};
        use serde_json::{json, Map, Value};

        let values = corpus_values();
        assert!(values.len() >= 20, "read {} values of the corpus", values.len());
        let mut bodies: Vec<Map<String, Value>> = vec![Map::new()];
        for value in values {
            let body = json!({
                "userId": "u", "namespace": "n\u{e9}\"x", "key": "k/\\", "value": value,
                "metadata": {"seq": 1.50, "big": 123456789012345678901234567890u128.to_string()}, "accessCount": 1,
            });
            bodies.extend(body.as_object().cloned());
            bodies.extend(json!({ "value": value, "_attachments": {}, "n": -0 }).as_object().cloned());
        }
        let (mut answered, mut parsed) = (0, 0);
        for id in ["u:n:a2V5", "u:n\u{e9}:\"quoted\"\\", "u:\u{1}\u{7f}\u{2028}:k", "_design/d"] {
            for body in &bodies {
                let mut tree = RevTree::default();
                tree.edit(None, "0123456789abcdef0123456789abcdef", false, body.clone(), usize::MAX)
                    .expect("a creation");
                let leaf = tree.winner().expect("a winner");
                let from_tree =
                    serde_json::to_string(&leaf_json(id, &tree, leaf, DocOptions::default())).expect("writes");
                // What the embedded store keeps (`codec::encode_json`).
                let stored = serde_json::to_vec(body).expect("encodes");
                match AnswerableWinner::answerable(crate::backend::Revision(leaf.rev()), stored.clone()) {
                    Some(winner) => {
                        let mut from_text = String::new();
                        winner.write_document(id, &mut from_text);
                        assert_eq!(from_text, from_tree, "id {id:?}");
                        answered += 1;
                    }
                    None => {
                        assert!(
                            memchr::memmem::find(&stored, b"\"_").is_some(),
                            "{}",
                            String::from_utf8_lossy(&stored)
                        );
                        parsed += 1;
                    }
                }
            }
        }
        assert!(answered > 80 && parsed > 80, "{answered} answered from text, {parsed} from the tree");
    }
}
