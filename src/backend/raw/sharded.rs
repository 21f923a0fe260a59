//! A lazy k-way merge of sharded ordered reads: each shard of an index (a DynamoDB GSI partition,
//! a Firestore collection group split by a shard field, ...) is read in small chunks in its own
//! key order, and the merge hands out entries in the global order, refilling a shard's buffer only
//! when it runs empty.
//!
//! A page of `L` entries over `S` shards therefore reads about `L + S * chunk` entries and holds at
//! most `S * chunk` of them at once, whatever the size of the index: the cost of a page is
//! proportional to the page, and memory is bounded.

use std::cmp::Ordering;
use std::collections::VecDeque;

use async_trait::async_trait;

use crate::error::Result;

/// One chunk of a shard read: the entries, in the shard's order, and where to continue (`None`
/// when the shard has nothing more in range).
pub struct Chunk<E, C> {
    pub entries: Vec<E>,
    pub cursor: Option<C>,
}

/// Reads one shard of an ordered index in chunks.
#[async_trait]
pub trait ShardReader: Send + Sync {
    /// What the index yields.
    type Entry: Send;
    /// The order the shards share (the merge compares these).
    type Key: Ord + Send;
    /// Where a shard's read continues (a page token of the underlying store).
    type Cursor: Send;

    fn key(entry: &Self::Entry) -> Self::Key;

    /// At most `limit` entries of `shard` after `cursor` (`None`: from the start of the range).
    async fn read(
        &self,
        shard: u32,
        cursor: Option<Self::Cursor>,
        limit: usize,
    ) -> Result<Chunk<Self::Entry, Self::Cursor>>;
}

struct ShardBuffer<E, C> {
    shard: u32,
    buffer: VecDeque<E>,
    cursor: Option<C>,
    /// Whether the shard has been read to the end of the range.
    exhausted: bool,
}

/// The merge of every shard of a [`ShardReader`], ascending by key or descending.
pub struct ShardedMerge<R: ShardReader> {
    reader: R,
    shards: Vec<ShardBuffer<R::Entry, R::Cursor>>,
    chunk: usize,
    descending: bool,
}

impl<R: ShardReader> ShardedMerge<R> {
    /// A merge over shards `0..shard_count`, reading `chunk` entries per shard read.
    pub fn new(reader: R, shard_count: u32, chunk: usize, descending: bool) -> Self {
        let shards = (0..shard_count)
            .map(|shard| ShardBuffer { shard, buffer: VecDeque::new(), cursor: None, exhausted: false })
            .collect();
        ShardedMerge { reader, shards, chunk: chunk.max(1), descending }
    }

    /// A chunk size that keeps a page of `page` entries over `shards` shards near `2 * page` reads
    /// without sending many tiny requests.
    pub fn chunk_for(page: usize, shards: u32) -> usize {
        (page / shards.max(1) as usize + 1).clamp(4, 100)
    }

    /// The next entry in the merged order, or `None` when every shard is exhausted.
    pub async fn next(&mut self) -> Result<Option<R::Entry>> {
        self.refill_empty().await?;
        let mut best: Option<(usize, R::Key)> = None;
        for (index, shard) in self.shards.iter().enumerate() {
            let Some(head) = shard.buffer.front() else { continue };
            let key = R::key(head);
            let better = match &best {
                None => true,
                Some((_, current)) => {
                    let order = key.cmp(current);
                    if self.descending {
                        order == Ordering::Greater
                    } else {
                        order == Ordering::Less
                    }
                }
            };
            if better {
                best = Some((index, key));
            }
        }
        Ok(best.and_then(|(index, _)| self.shards[index].buffer.pop_front()))
    }

    /// Reads, concurrently, every shard whose buffer is empty and that has more in range, until it
    /// holds an entry or is exhausted (a store may answer a chunk with nothing but a cursor).
    async fn refill_empty(&mut self) -> Result<()> {
        let reader = &self.reader;
        let chunk = self.chunk;
        let refills = self.shards.iter_mut().filter(|s| s.buffer.is_empty() && !s.exhausted).map(|state| async move {
            while state.buffer.is_empty() && !state.exhausted {
                let read = reader.read(state.shard, state.cursor.take(), chunk).await?;
                state.buffer.extend(read.entries);
                state.exhausted = read.cursor.is_none();
                state.cursor = read.cursor;
            }
            Result::Ok(())
        });
        futures::future::try_join_all(refills).await?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering as AtomicOrdering};

    /// Shards of sorted numbers, counting how many entries were read.
    struct Numbers {
        shards: Vec<Vec<u32>>,
        read: AtomicUsize,
        descending: bool,
    }

    #[async_trait]
    impl ShardReader for Numbers {
        type Entry = u32;
        type Key = u32;
        type Cursor = usize;

        fn key(entry: &u32) -> u32 {
            *entry
        }

        async fn read(&self, shard: u32, cursor: Option<usize>, limit: usize) -> Result<Chunk<u32, usize>> {
            let mut values = self.shards[shard as usize].clone();
            if self.descending {
                values.reverse();
            }
            let from = cursor.unwrap_or(0);
            let entries: Vec<u32> = values.iter().skip(from).take(limit).copied().collect();
            self.read.fetch_add(entries.len(), AtomicOrdering::Relaxed);
            let next = from + entries.len();
            Ok(Chunk { entries, cursor: (next < values.len()).then_some(next) })
        }
    }

    fn sharded(count: u32, shards: u32, descending: bool) -> Numbers {
        let mut split = vec![Vec::new(); shards as usize];
        for n in 0..count {
            // Uneven on purpose: shard 0 gets most, the last shard none.
            let shard = if n % 3 == 0 { 0 } else { n % (shards - 1) };
            split[shard as usize].push(n);
        }
        Numbers { shards: split, read: AtomicUsize::new(0), descending }
    }

    #[tokio::test]
    async fn merges_every_shard_in_order_both_ways() {
        for descending in [false, true] {
            let mut merge = ShardedMerge::new(sharded(500, 7, descending), 7, 5, descending);
            let mut out = Vec::new();
            while let Some(n) = merge.next().await.unwrap() {
                out.push(n);
            }
            let mut expected: Vec<u32> = (0..500).collect();
            if descending {
                expected.reverse();
            }
            assert_eq!(out, expected);
        }
    }

    #[tokio::test]
    async fn a_page_reads_about_the_page_plus_one_chunk_per_shard() {
        let (shards, chunk, page) = (16, 4, 50);
        let mut merge = ShardedMerge::new(sharded(100_000, shards, false), shards, chunk, false);
        for expected in 0..page as u32 {
            assert_eq!(merge.next().await.unwrap(), Some(expected));
        }
        let read = merge.reader.read.load(AtomicOrdering::Relaxed);
        assert!(read <= page + shards as usize * chunk, "read {read} entries for a page of {page}");
    }
}
