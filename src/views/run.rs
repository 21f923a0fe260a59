//! Answering a checked query ([`super::query::Plan`]) from a group's rows.
//!
//! Rows are handed over through a bounded channel, so an answer of any size streams with
//! [`CHANNEL_ROWS`] rows in flight: the caller writes them out as they come (a map answer) or
//! folds them into groups (a reduce answer, where only the current group's rows are held, reduced
//! every [`REDUCE_CHUNK`] rows and rereduced at the group's end). A map answer, written to a
//! client as it reads, is read a page ([`PAGE_ROWS`]) at a time, each page on the blocking pool
//! in its own read transaction: a client that stops reading holds neither a thread nor a
//! transaction. A reduce answer is folded whole before anything is written, so its scan never
//! waits on a client.

use std::ops::{Bound, ControlFlow};
use std::sync::Arc;

use async_trait::async_trait;
use serde_json::{json, Value};
use tokio::sync::mpsc;

use super::builtin_reduce::{Builtin, Reducer};
use super::design::{DesignViews, ReduceFn};
use super::index_store::{BlockSummary, IndexRow, IndexStore, Piece, RowRange};
use super::query::{group_key, Grouping};
use super::reduce_cache::{OffsetKey, ReduceKey};
use super::sort_key;
use super::ViewError;

/// Rows in flight between the index scan and the answer.
pub const CHANNEL_ROWS: usize = 256;
/// Rows of a map answer read from the index at a time, each page in its own read transaction.
pub const PAGE_ROWS: usize = CHANNEL_ROWS;
/// Rows of one group reduced at a time before rereducing.
pub const REDUCE_CHUNK: usize = 1000;

/// Runs JavaScript reduce functions.
#[async_trait]
pub trait JsReducer: Send + Sync {
    async fn reduce(&self, design: &DesignViews, view: &str, rows: Vec<(Value, Value)>) -> Result<Value, ViewError>;
    async fn rereduce(&self, design: &DesignViews, view: &str, values: Vec<Value>) -> Result<Value, ViewError>;
}

/// Where a map answer starts, and its rows as they are read.
pub struct MapRows {
    /// Rows of the view before the first one answered (CouchDB's `offset`).
    pub offset: u64,
    pub rows: mpsc::Receiver<Result<IndexRow, ViewError>>,
}

/// Streams the rows of view `view` (group `number`) in `ranges`, after skipping `skip` and up to
/// `limit` in all.
pub async fn map_rows(
    store: Arc<IndexStore>,
    number: u64,
    view: usize,
    ranges: Vec<RowRange>,
    descending: bool,
    skip: u64,
    limit: Option<u64>,
) -> Result<MapRows, ViewError> {
    let mut ranges: std::collections::VecDeque<RowRange> = ranges.into();
    // The offset and the first page in one trip to the blocking pool: a short answer (a `key`
    // with a `limit`) needs no other.
    let first_page_rows = page_rows(skip, limit.unwrap_or(u64::MAX));
    let (before, first) = {
        let store = Arc::clone(&store);
        let first_range = ranges.pop_front();
        tokio::task::spawn_blocking(move || -> crate::error::Result<_> {
            let Some(range) = first_range else {
                return Ok((0, None));
            };
            let before = rows_before(&store, number, view, &range, descending)?;
            let page = store.page(number, view, &range, descending, first_page_rows)?;
            Ok((before, Some(page)))
        })
        .await
        .map_err(task_failed)?
        .map_err(ViewError::Storage)?
    };
    let (sender, receiver) = mpsc::channel(CHANNEL_ROWS);
    let read = RowsRead { number, view, first, ranges, descending, skip, limit };
    tokio::spawn(send_rows(store, read, sender));
    Ok(MapRows { offset: before + skip, rows: receiver })
}

/// Rows to read in the next page when `to_skip` rows are still to be skipped and at most `left`
/// sent: no more than the answer can use, at most [`PAGE_ROWS`].
fn page_rows(to_skip: u64, left: u64) -> usize {
    to_skip.saturating_add(left).min(PAGE_ROWS as u64).max(1) as usize
}

/// What [`send_rows`] reads: view `view` of group `number`, the first range's first page read
/// already (`first`), then the rest of it and `ranges`, `skip` rows skipped and at most `limit`
/// sent.
struct RowsRead {
    number: u64,
    view: usize,
    first: Option<super::index_store::RowPage>,
    ranges: std::collections::VecDeque<RowRange>,
    descending: bool,
    skip: u64,
    limit: Option<u64>,
}

/// Reads the rows of `ranges` a page ([`PAGE_ROWS`] at most, no more than the answer can still
/// use) at a time on the blocking pool and sends them from async code: while the client does not
/// read, the channel fills and this task waits holding neither a thread nor a read transaction.
/// It ends when the receiver is dropped.
async fn send_rows(store: Arc<IndexStore>, read: RowsRead, sender: mpsc::Sender<Result<IndexRow, ViewError>>) {
    let RowsRead { number, view, first, mut ranges, descending, skip, limit } = read;
    let mut place = Place { to_skip: skip, left: limit.unwrap_or(u64::MAX) };
    let mut unread = None;
    if let Some(page) = first {
        if !place.send(page.rows, &sender).await {
            return;
        }
        unread = page.rest;
    }
    while let Some(range) = unread.take().or_else(|| ranges.pop_front()) {
        if place.left == 0 || sender.is_closed() {
            return;
        }
        let reading = Arc::clone(&store);
        let rows = page_rows(place.to_skip, place.left);
        let page = tokio::task::spawn_blocking(move || reading.page(number, view, &range, descending, rows))
            .await
            .map_err(task_failed)
            .and_then(|page| page.map_err(ViewError::Storage));
        let page = match page {
            Ok(page) => page,
            Err(err) => {
                let _ = sender.send(Err(err)).await;
                return;
            }
        };
        if !place.send(page.rows, &sender).await {
            return;
        }
        unread = page.rest;
    }
}

/// Where a map answer stands: rows still to skip, rows it may still send.
struct Place {
    to_skip: u64,
    left: u64,
}

impl Place {
    /// Skips and sends `rows`; `false` once nothing more is to be sent (the limit reached, or the
    /// receiver gone).
    async fn send(&mut self, rows: Vec<IndexRow>, sender: &mpsc::Sender<Result<IndexRow, ViewError>>) -> bool {
        for row in rows {
            if self.to_skip > 0 {
                self.to_skip -= 1;
                continue;
            }
            if self.left == 0 || sender.send(Ok(row)).await.is_err() {
                return false;
            }
            self.left -= 1;
        }
        self.left > 0
    }
}

/// How many rows of the view come before `range` in the scan's direction: kept from an earlier
/// query while the group's rows are unchanged ([`super::reduce_cache`]), else counted
/// ([`counted_rows_before`]) and kept.
fn rows_before(
    store: &IndexStore,
    number: u64,
    view: usize,
    range: &RowRange,
    descending: bool,
) -> crate::error::Result<u64> {
    let bound = if descending { &range.high } else { &range.low };
    if matches!(bound, Bound::Unbounded) {
        return Ok(0);
    }
    let key = OffsetKey { number, view, descending, bound: bound.clone() };
    // Taken before the index is read: a count read before a write is never kept after it.
    let ticket = store.reductions().ticket(number);
    if let Some(offset) = store.reductions().offset(&key) {
        return Ok(offset);
    }
    let offset = counted_rows_before(store, number, view, range, descending)?;
    store.reductions().put_offset(key, ticket, offset);
    Ok(offset)
}

/// [`rows_before`] counted from the index's block counts ([`IndexStore::count_below`]): a sum
/// over blocks plus a scan within one block, not a count of every row before the range.
fn counted_rows_before(
    store: &IndexStore,
    number: u64,
    view: usize,
    range: &RowRange,
    descending: bool,
) -> crate::error::Result<u64> {
    if descending {
        match &range.high {
            Bound::Unbounded => Ok(0),
            Bound::Included(bytes) => store.count_above(number, view, &Bound::Excluded(bytes.clone())),
            Bound::Excluded(bytes) => store.count_above(number, view, &Bound::Included(bytes.clone())),
        }
    } else {
        match &range.low {
            Bound::Unbounded => Ok(0),
            Bound::Included(bytes) => store.count_below(number, view, &Bound::Excluded(bytes.clone())),
            Bound::Excluded(bytes) => store.count_below(number, view, &Bound::Included(bytes.clone())),
        }
    }
}

/// The reduce function of a view, ready to run.
pub enum ReduceRunner<'a> {
    Builtin(Builtin),
    JavaScript { engine: &'a dyn JsReducer, design: &'a DesignViews, view: &'a str },
}

impl<'a> ReduceRunner<'a> {
    pub fn of(reduce: &ReduceFn, engine: &'a dyn JsReducer, design: &'a DesignViews, view: &'a str) -> Self {
        match reduce {
            ReduceFn::Builtin(builtin) => ReduceRunner::Builtin(*builtin),
            ReduceFn::JavaScript(_) => ReduceRunner::JavaScript { engine, design, view },
        }
    }

    async fn reduce(&self, rows: Vec<(Value, Value)>) -> Result<Value, ViewError> {
        match self {
            ReduceRunner::Builtin(builtin) => builtin.reduce(&rows).map_err(ViewError::Reduce),
            ReduceRunner::JavaScript { engine, design, view } => engine.reduce(design, view, rows).await,
        }
    }

    async fn rereduce(&self, values: Vec<Value>) -> Result<Value, ViewError> {
        match self {
            ReduceRunner::Builtin(builtin) => builtin.rereduce(&values).map_err(ViewError::Reduce),
            ReduceRunner::JavaScript { engine, design, view } => engine.rereduce(design, view, values).await,
        }
    }

    fn finish(&self, value: Value) -> Value {
        match self {
            ReduceRunner::Builtin(builtin) => builtin.finish(value),
            ReduceRunner::JavaScript { .. } => value,
        }
    }

    /// The built-in whose partials the index keeps per block, if this is one.
    fn with_block_partials(&self) -> Option<Builtin> {
        match self {
            ReduceRunner::Builtin(builtin @ (Builtin::Count | Builtin::Sum | Builtin::Stats)) => Some(*builtin),
            _ => None,
        }
    }
}

/// A block's partial reduction for `builtin`, when the index has it.
fn block_partial(builtin: Builtin, summary: &BlockSummary) -> Option<Value> {
    match builtin {
        Builtin::Count => Some(json!(summary.count)),
        Builtin::Sum => summary.sum.clone(),
        Builtin::Stats => summary.stats.clone(),
        Builtin::ApproxCountDistinct => None,
    }
}

/// What the reduce fold takes: a row, or a block's partial reduction with its first row's key
/// (every row of the block in one group).
enum Folded {
    Row(IndexRow),
    Partial { key: Value, partial: Value },
}

/// One group being folded.
struct OpenGroup {
    key: Value,
    sort_key: Vec<u8>,
    rows: Vec<(Value, Value)>,
    partials: Vec<Value>,
}

impl OpenGroup {
    fn new(key: Value) -> Self {
        OpenGroup { sort_key: sort_key::encode(&key), key, rows: Vec::new(), partials: Vec::new() }
    }

    async fn take(&mut self, row: IndexRow, reducer: &ReduceRunner<'_>) -> Result<(), ViewError> {
        self.rows.push((json!([row.key, row.id]), row.value));
        if self.rows.len() >= REDUCE_CHUNK {
            let rows = std::mem::take(&mut self.rows);
            self.partials.push(reducer.reduce(rows).await?);
        }
        Ok(())
    }

    /// Takes a block's partial reduction, after the rows before it (kept in order).
    async fn take_partial(&mut self, partial: Value, reducer: &ReduceRunner<'_>) -> Result<(), ViewError> {
        if !self.rows.is_empty() {
            let rows = std::mem::take(&mut self.rows);
            self.partials.push(reducer.reduce(rows).await?);
        }
        self.partials.push(partial);
        if self.partials.len() >= REDUCE_CHUNK {
            let partials = std::mem::take(&mut self.partials);
            self.partials.push(reducer.rereduce(partials).await?);
        }
        Ok(())
    }

    async fn close(mut self, reducer: &ReduceRunner<'_>) -> Result<(Value, Value), ViewError> {
        let value = if self.partials.is_empty() {
            reducer.reduce(std::mem::take(&mut self.rows)).await?
        } else {
            if !self.rows.is_empty() {
                let last = reducer.reduce(std::mem::take(&mut self.rows)).await?;
                self.partials.push(last);
            }
            reducer.rereduce(self.partials).await?
        };
        Ok((self.key, reducer.finish(value)))
    }
}

/// The reduce answer's rows: `(key, value)` per group, after `skip`, at most `limit`: the answer
/// kept for the same query while the group's rows are unchanged ([`super::reduce_cache`]), else
/// computed ([`computed_reduce_rows`]) and kept.
#[allow(clippy::too_many_arguments)]
pub async fn reduce_rows(
    store: Arc<IndexStore>,
    number: u64,
    view: usize,
    ranges: Vec<RowRange>,
    descending: bool,
    grouping: Grouping,
    reducer: &ReduceRunner<'_>,
    skip: u64,
    limit: Option<u64>,
) -> Result<Vec<(Value, Value)>, ViewError> {
    let builtin = match reducer {
        ReduceRunner::Builtin(builtin) => Some(*builtin),
        ReduceRunner::JavaScript { .. } => None,
    };
    let key = ReduceKey { number, view, builtin, ranges, descending, grouping, skip, limit };
    // Taken before the index is read: an answer read before a write is never kept after it.
    let ticket = store.reductions().ticket(number);
    if let Some(rows) = store.reductions().get(&key) {
        return Ok(rows);
    }
    let rows = computed_reduce_rows(Arc::clone(&store), &key, reducer).await?;
    store.reductions().put(key, ticket, &rows);
    Ok(rows)
}

/// The reduce answer's rows computed from the index.
///
/// `_count`, `_sum` and `_stats` take the partial reductions the index keeps per block for every
/// block wholly within the range and within one group, and read only the other rows. Should that
/// meet a refusal (a value `_sum` or `_stats` cannot take), the answer is computed again from the
/// rows alone, so the refusal is the one a plain scan meets first. JavaScript reduces and
/// `_approx_count_distinct` always read the rows: the index keeps no partials for them (a
/// JavaScript partial would have to be computed by the engine whenever a block changes, for
/// views whose reduce may never be queried).
async fn computed_reduce_rows(
    store: Arc<IndexStore>,
    query: &ReduceKey,
    reducer: &ReduceRunner<'_>,
) -> Result<Vec<(Value, Value)>, ViewError> {
    let ReduceKey { number, view, ref ranges, descending, grouping, skip, limit, .. } = *query;
    if let Some(builtin) = reducer.with_block_partials() {
        let with_blocks = fold_groups(
            Arc::clone(&store),
            number,
            view,
            ranges.clone(),
            descending,
            grouping,
            Some(builtin),
            reducer,
            skip,
            limit,
        )
        .await;
        match with_blocks {
            Err(ViewError::Reduce(_)) => {}
            answered => return answered,
        }
    }
    fold_groups(store, number, view, ranges.clone(), descending, grouping, None, reducer, skip, limit).await
}

/// [`reduce_rows`] from the rows alone (`blocks` is `None`), or with blocks' partials for that
/// built-in.
#[allow(clippy::too_many_arguments)]
async fn fold_groups(
    store: Arc<IndexStore>,
    number: u64,
    view: usize,
    ranges: Vec<RowRange>,
    descending: bool,
    grouping: Grouping,
    blocks: Option<Builtin>,
    reducer: &ReduceRunner<'_>,
    skip: u64,
    limit: Option<u64>,
) -> Result<Vec<(Value, Value)>, ViewError> {
    let limit = limit.unwrap_or(u64::MAX);
    if limit == 0 {
        return Ok(Vec::new());
    }
    // Each row with the number of its range: with `keys`, every key is its own group even when
    // a key repeats (CouchDB folds each key of `keys` apart).
    let (sender, mut receiver) = mpsc::channel::<Result<(usize, Folded), ViewError>>(CHANNEL_ROWS);
    let scan = tokio::task::spawn_blocking(move || {
        for (number_of_range, range) in ranges.iter().enumerate() {
            let send = |folded: Folded| {
                if sender.blocking_send(Ok((number_of_range, folded))).is_err() {
                    ControlFlow::Break(())
                } else {
                    ControlFlow::Continue(())
                }
            };
            let scanned = match blocks {
                None => store.scan(number, view, range, descending, |row| send(Folded::Row(row))),
                Some(builtin) => store.scan_pieces(
                    number,
                    view,
                    range,
                    descending,
                    grouping != Grouping::All,
                    |summary, first, last| {
                        block_partial(builtin, summary).is_some()
                            && (grouping == Grouping::All
                                || same_group_key(&group_key(first, grouping), &group_key(last, grouping)))
                    },
                    |piece| match piece {
                        Piece::Row(row) => send(Folded::Row(row)),
                        // The group's key as a plain scan shows it: its first row's in the scan's
                        // order.
                        Piece::Block { summary, first_key, last_key } => match block_partial(builtin, &summary) {
                            Some(partial) => {
                                let key = if descending { last_key } else { first_key };
                                send(Folded::Partial { key, partial })
                            }
                            None => ControlFlow::Break(()),
                        },
                    },
                ),
            };
            if let Err(err) = scanned {
                let _ = sender.blocking_send(Err(ViewError::Storage(err)));
                return;
            }
        }
    });
    let mut answer = Vec::new();
    let mut to_skip = skip;
    let mut open: Option<(usize, OpenGroup)> = None;
    let mut emit = |group: (Value, Value), answer: &mut Vec<(Value, Value)>| {
        if to_skip > 0 {
            to_skip -= 1;
        } else if (answer.len() as u64) < limit {
            answer.push(group);
        }
    };
    while let Some(item) = receiver.recv().await {
        let (range, folded) = item?;
        let row_key = match &folded {
            Folded::Row(row) => &row.key,
            Folded::Partial { key, .. } => key,
        };
        let key = group_key(row_key, grouping);
        // Equal JSON is the same group without collating; only a key that differs is encoded.
        let same = open.as_ref().is_some_and(|(open_range, group)| {
            *open_range == range && (group.key == key || group.sort_key == sort_key::encode(&key))
        });
        if !same {
            if let Some((_, done)) = open.take() {
                emit(done.close(reducer).await?, &mut answer);
                if answer.len() as u64 >= limit {
                    break;
                }
            }
            open = Some((range, OpenGroup::new(key)));
        }
        if let Some((_, group)) = open.as_mut() {
            match folded {
                Folded::Row(row) => group.take(row, reducer).await?,
                Folded::Partial { partial, .. } => group.take_partial(partial, reducer).await?,
            }
        }
    }
    drop(receiver);
    if let Some((_, done)) = open.take() {
        if (answer.len() as u64) < limit {
            emit(done.close(reducer).await?, &mut answer);
        }
    }
    scan.await.map_err(task_failed)?;
    Ok(answer)
}

/// Whether two group keys collate equal: at once when their JSON is equal, else by their sort
/// keys (keys that differ in JSON may still collate equal, `1` and `1.0` say).
fn same_group_key(a: &Value, b: &Value) -> bool {
    a == b || sort_key::encode(a) == sort_key::encode(b)
}

fn task_failed(err: tokio::task::JoinError) -> ViewError {
    ViewError::Storage(crate::error::Error::new(crate::error::ErrorKind::Internal, format!("view scan task: {err}")))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::views::index_store::MappedDoc;
    use crate::views::query::{Plan, ViewQuery};

    struct NoJs;

    #[async_trait]
    impl JsReducer for NoJs {
        async fn reduce(&self, _: &DesignViews, _: &str, _: Vec<(Value, Value)>) -> Result<Value, ViewError> {
            Err(ViewError::Function { error: "none".into(), reason: "no engine in this test".into() })
        }
        async fn rereduce(&self, _: &DesignViews, _: &str, _: Vec<Value>) -> Result<Value, ViewError> {
            Err(ViewError::Function { error: "none".into(), reason: "no engine in this test".into() })
        }
    }

    /// A store with one group of one view: documents `d0..d{n}` emitting `[i % 3, i]` → `i`.
    fn store_with(n: usize) -> (tempfile::TempDir, Arc<IndexStore>, u64) {
        let dir = tempfile::tempdir().unwrap();
        let store = Arc::new(IndexStore::open(&dir.path().join("v.redb")).unwrap());
        let group = store.group("g", 1).unwrap();
        let docs: Vec<MappedDoc> = (0..n)
            .map(|i| MappedDoc { id: format!("d{i:03}"), rows: vec![vec![(json!([i % 3, i]), json!(i))]] })
            .collect();
        store.apply("g", &docs, "s").unwrap();
        (dir, store, group.number)
    }

    async fn query_map(store: &Arc<IndexStore>, number: u64, pairs: &[(&str, &str)]) -> (u64, Vec<String>) {
        let query = ViewQuery::parse(pairs.iter().copied()).unwrap();
        let Plan::Map { ranges } = query.plan(false).unwrap() else { panic!("not a map plan") };
        let mut answer =
            map_rows(Arc::clone(store), number, 0, ranges, query.descending, query.skip, query.limit).await.unwrap();
        let mut ids = Vec::new();
        while let Some(row) = answer.rows.recv().await {
            ids.push(row.unwrap().id);
        }
        (answer.offset, ids)
    }

    #[tokio::test]
    async fn map_queries_select_skip_limit_and_reverse() {
        let (_dir, store, number) = store_with(9);
        let (offset, ids) = query_map(&store, number, &[("startkey", "[1]"), ("endkey", "[1, {}]")]).await;
        assert_eq!((offset, ids), (3, vec!["d001".into(), "d004".into(), "d007".into()]));
        let (_, ids) =
            query_map(&store, number, &[("startkey", "[2, {}]"), ("endkey", "[2]"), ("descending", "true")]).await;
        assert_eq!(ids, ["d008", "d005", "d002"]);
        let (offset, ids) = query_map(&store, number, &[("skip", "2"), ("limit", "3")]).await;
        assert_eq!((offset, ids), (2, vec!["d006".into(), "d001".into(), "d004".into()]));
        let (_, ids) = query_map(&store, number, &[("keys", "[[2, 5], [0, 0], [9]]")]).await;
        assert_eq!(ids, ["d005", "d000"]);
        let (_, ids) =
            query_map(&store, number, &[("startkey", "[0]"), ("endkey", "[1, 1]"), ("inclusive_end", "false")]).await;
        assert_eq!(ids, ["d000", "d003", "d006"]);
        let (_, ids) =
            query_map(&store, number, &[("key", "[1, 4]"), ("startkey_docid", "d004"), ("endkey_docid", "d004")]).await;
        assert_eq!(ids, ["d004"]);
    }

    #[tokio::test]
    async fn reduces_group_by_level_and_exact_keys() {
        let (_dir, store, number) = store_with(9);
        let design =
            DesignViews::parse(&json!({"_id": "_design/d", "views": {"v": {"map": "f", "reduce": "_sum"}}})).unwrap();
        let reducer = ReduceRunner::of(&ReduceFn::Builtin(Builtin::Sum), &NoJs, &design, "v");
        let run = |grouping, skip, limit| {
            reduce_rows(Arc::clone(&store), number, 0, vec![RowRange::all()], false, grouping, &reducer, skip, limit)
        };
        assert_eq!(run(Grouping::All, 0, None).await.unwrap(), vec![(json!(null), json!(36))]);
        assert_eq!(
            run(Grouping::Level(1), 0, None).await.unwrap(),
            vec![(json!([0]), json!(9)), (json!([1]), json!(12)), (json!([2]), json!(15))]
        );
        assert_eq!(run(Grouping::Level(1), 1, Some(1)).await.unwrap(), vec![(json!([1]), json!(12))]);
        assert_eq!(
            run(Grouping::Exact, 0, Some(2)).await.unwrap(),
            vec![(json!([0, 0]), json!(0)), (json!([0, 3]), json!(3))]
        );
        let counted = ReduceRunner::Builtin(Builtin::Count);
        let total =
            reduce_rows(Arc::clone(&store), number, 0, vec![RowRange::all()], true, Grouping::All, &counted, 0, None);
        assert_eq!(total.await.unwrap(), vec![(json!(null), json!(9))]);
    }

    /// A reduce answer is kept while the group is unchanged, and computed again after a write of
    /// its rows: without `apply_within`'s invalidation the second answer below is the first one.
    #[tokio::test]
    async fn a_kept_reduce_answer_ends_with_the_next_write_of_its_group() {
        let (_dir, store, number) = store_with(9);
        let reducer = ReduceRunner::Builtin(Builtin::Sum);
        let run = || {
            reduce_rows(
                Arc::clone(&store),
                number,
                0,
                vec![RowRange::all()],
                false,
                Grouping::Level(1),
                &reducer,
                0,
                None,
            )
        };
        let first = vec![(json!([0]), json!(9)), (json!([1]), json!(12)), (json!([2]), json!(15))];
        assert_eq!(run().await.unwrap(), first);
        assert_eq!(run().await.unwrap(), first);
        assert_eq!(store.reductions().hits(), 1, "the repeated query is answered from the cache");
        let added = MappedDoc { id: "d100".into(), rows: vec![vec![(json!([0, 100]), json!(100))]] };
        store.apply("g", &[added], "s2").unwrap();
        assert_eq!(
            run().await.unwrap(),
            vec![(json!([0]), json!(109)), (json!([1]), json!(12)), (json!([2]), json!(15))]
        );
        let removed = MappedDoc { id: "d001".into(), rows: Vec::new() };
        store.apply("g", &[removed], "s3").unwrap();
        assert_eq!(
            run().await.unwrap(),
            vec![(json!([0]), json!(109)), (json!([1]), json!(11)), (json!([2]), json!(15))]
        );
        assert_eq!(store.reductions().hits(), 1);
    }

    /// A map answer's offset is kept while the group is unchanged, and counted again after a
    /// write of its rows: without `apply_within`'s invalidation the answers after the writes
    /// below would be the first one's.
    #[tokio::test]
    async fn a_kept_offset_ends_with_the_next_write_of_its_group() {
        let (_dir, store, number) = store_with(9);
        let from_one = [("startkey", "[1]")];
        let down_from_one = [("startkey", "[1, {}]"), ("descending", "true")];
        assert_eq!(query_map(&store, number, &from_one).await.0, 3);
        assert_eq!(query_map(&store, number, &down_from_one).await.0, 3);
        assert_eq!(query_map(&store, number, &from_one).await.0, 3);
        assert_eq!(store.reductions().hits(), 1, "the repeated offset is answered from the cache");
        let added = MappedDoc { id: "d100".into(), rows: vec![vec![(json!([0, 100]), json!(100))]] };
        store.apply("g", &[added], "s2").unwrap();
        assert_eq!(query_map(&store, number, &from_one).await.0, 4);
        assert_eq!(query_map(&store, number, &down_from_one).await.0, 3);
        let removed = MappedDoc { id: "d002".into(), rows: Vec::new() };
        store.apply("g", &[removed], "s3").unwrap();
        assert_eq!(query_map(&store, number, &from_one).await.0, 4);
        assert_eq!(query_map(&store, number, &down_from_one).await.0, 2);
        assert_eq!(store.reductions().hits(), 1);
    }

    #[tokio::test]
    async fn big_groups_are_reduced_in_chunks_and_rereduced() {
        let (_dir, store, number) = store_with(2_500);
        let stats = ReduceRunner::Builtin(Builtin::Stats);
        let rows =
            reduce_rows(Arc::clone(&store), number, 0, vec![RowRange::all()], false, Grouping::All, &stats, 0, None);
        let value = &rows.await.unwrap()[0].1;
        assert_eq!(value["count"], json!(2_500));
        assert_eq!(value["sum"], json!(2_500 * 2_499 / 2));
        assert_eq!(value["max"], json!(2_499));
    }

    /// A random view query's parameters over [`index_store::tests::random_key`]'s keys.
    fn random_query(random: &mut Random, reduce: bool) -> Vec<(&'static str, String)> {
        use crate::views::index_store::tests::random_key;
        let mut pairs = Vec::new();
        let descending = random.below(3) == 0;
        match random.below(6) {
            0 => {}
            1 => pairs.push(("key", random_key(random).to_string())),
            _ => {
                let (mut a, mut b) = (random_key(random), random_key(random));
                if crate::views::collation::compare(&a, &b) == std::cmp::Ordering::Greater {
                    std::mem::swap(&mut a, &mut b);
                }
                if descending {
                    std::mem::swap(&mut a, &mut b);
                }
                if random.below(4) != 0 {
                    pairs.push(("startkey", a.to_string()));
                }
                if random.below(4) != 0 {
                    pairs.push(("endkey", b.to_string()));
                }
                if random.below(4) == 0 {
                    pairs.push(("inclusive_end", "false".to_owned()));
                }
            }
        }
        if descending {
            pairs.push(("descending", "true".to_owned()));
        }
        if random.below(3) == 0 {
            pairs.push(("skip", random.below(30).to_string()));
        }
        if random.below(3) == 0 {
            pairs.push(("limit", random.below(40).to_string()));
        }
        if reduce {
            match random.below(4) {
                0 => {}
                1 => pairs.push(("group", "true".to_owned())),
                level => pairs.push(("group_level", (level - 1).to_string())),
            }
        } else {
            pairs.push(("reduce", "false".to_owned()));
        }
        pairs
    }

    use crate::views::index_store::tests::{random_store, Random};

    #[tokio::test]
    async fn reduces_from_block_partials_match_reducing_every_row() {
        let (_dir, store, number) = random_store(26, 14);
        let store = Arc::new(store);
        let mut random = Random::new(2026);
        let mut refused = 0;
        let mut answered_rows = 0;
        for _ in 0..400 {
            let pairs = random_query(&mut random, true);
            let query = ViewQuery::parse(pairs.iter().map(|(name, value)| (*name, value.as_str()))).unwrap();
            let Ok(Plan::Reduce { ranges, grouping }) = query.plan(true) else { continue };
            let view = random.below(2) as usize;
            let builtin = [Builtin::Count, Builtin::Sum, Builtin::Stats][random.below(3) as usize];
            let reducer = ReduceRunner::Builtin(builtin);
            let (desc, skip, limit) = (query.descending, query.skip, query.limit);
            let with_blocks =
                reduce_rows(Arc::clone(&store), number, view, ranges.clone(), desc, grouping, &reducer, skip, limit)
                    .await;
            let plain =
                fold_groups(Arc::clone(&store), number, view, ranges, desc, grouping, None, &reducer, skip, limit)
                    .await;
            match (with_blocks, plain) {
                (Ok(fast), Ok(slow)) => {
                    answered_rows += slow.len();
                    assert_eq!(fast, slow, "{builtin:?} view {view} {pairs:?}");
                }
                (Err(ViewError::Reduce(fast)), Err(ViewError::Reduce(slow))) => {
                    refused += 1;
                    assert_eq!(fast, slow, "{builtin:?} view {view} {pairs:?}");
                }
                (fast, slow) => panic!("{builtin:?} view {view} {pairs:?}: {fast:?} vs {slow:?}"),
            }
        }
        assert!(refused > 0, "no query met a refused value");
        assert!(answered_rows > 1000, "only {answered_rows} groups answered");
    }

    #[tokio::test]
    async fn offsets_from_block_counts_match_counting_rows() {
        let (_dir, store, number) = random_store(5, 12);
        let store = Arc::new(store);
        let mut random = Random::new(55);
        for _ in 0..300 {
            let pairs = random_query(&mut random, false);
            let query = ViewQuery::parse(pairs.iter().map(|(name, value)| (*name, value.as_str()))).unwrap();
            let Ok(Plan::Map { ranges }) = query.plan(true) else { continue };
            let view = random.below(2) as usize;
            let mut answer =
                map_rows(Arc::clone(&store), number, view, ranges.clone(), query.descending, query.skip, query.limit)
                    .await
                    .unwrap();
            let mut rows = Vec::new();
            while let Some(row) = answer.rows.recv().await {
                rows.push(row.unwrap());
            }
            // The plain answer: every row of the view in the query's order; the offset is where
            // the first in the range stands.
            let mut every = Vec::new();
            store
                .scan(number, view, &RowRange::all(), query.descending, |row| {
                    every.push(row);
                    ControlFlow::Continue(())
                })
                .unwrap();
            let mut in_range = Vec::new();
            store
                .scan(number, view, &ranges[0], query.descending, |row| {
                    in_range.push(row);
                    ControlFlow::Continue(())
                })
                .unwrap();
            // The rows on the near side of the range, counted one by one.
            let outside = match (query.descending, &ranges[0]) {
                (false, RowRange { low: Bound::Included(bytes), .. }) => {
                    Some(RowRange { low: Bound::Unbounded, high: Bound::Excluded(bytes.clone()) })
                }
                (false, RowRange { low: Bound::Excluded(bytes), .. }) => {
                    Some(RowRange { low: Bound::Unbounded, high: Bound::Included(bytes.clone()) })
                }
                (true, RowRange { high: Bound::Included(bytes), .. }) => {
                    Some(RowRange { low: Bound::Excluded(bytes.clone()), high: Bound::Unbounded })
                }
                (true, RowRange { high: Bound::Excluded(bytes), .. }) => {
                    Some(RowRange { low: Bound::Included(bytes.clone()), high: Bound::Unbounded })
                }
                _ => None,
            };
            let mut before = 0;
            if let Some(outside) = outside {
                store
                    .scan(number, view, &outside, false, |_| {
                        before += 1;
                        ControlFlow::Continue(())
                    })
                    .unwrap();
            }
            if let Some(first) = in_range.first() {
                assert_eq!(every.iter().position(|row| row == first), Some(before as usize), "{pairs:?}");
            }
            assert_eq!(answer.offset, before + query.skip, "{pairs:?}");
            let expected: Vec<IndexRow> = in_range
                .into_iter()
                .skip(query.skip as usize)
                .take(query.limit.map_or(usize::MAX, |limit| limit as usize))
                .collect();
            assert_eq!(rows, expected, "{pairs:?}");
        }
    }
}
