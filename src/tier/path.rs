//! The job path: what a scheduler asks of whatever runs its jobs, so it has
//! one path whether the tier serves the registered memory itself (host
//! memory, or memory its engine reaches) or the staged HBM path serves GPU
//! memory through the tier (`crate::staged::StagedTier`).
//!
//! A job's life on any path: submitted under an id the caller chose (the
//! scheduler numbers every job once, from submit to result, so nothing
//! above the path translates ids), moved along by `poll`, its layers
//! announced in order (`layer_events`), its result handed out once
//! (`get_finished` or `wait`). No path cancels a job once submitted: what
//! the caller can still take back is a store in the scheduler's backlog,
//! which never reached a path.

use super::{JobId, JobKind, JobResult, LayerDone, LayerQueued, Tier};
use crate::error::Result;
use crate::gpu::wait::LoadCounter;
use crate::p2p::P2pTable;
use crate::pool::Key;
use std::ops::Range;
use std::sync::Arc;

/// Runs loads and stores for a scheduler: [`Tier`] and
/// `crate::staged::StagedTier` implement it.
pub trait JobPath: Send {
    /// The tier underneath (its pool, engine, index and usage).
    fn tier(&self) -> &Tier;

    /// The tier underneath, to change (remove keys, settings).
    fn tier_mut(&mut self) -> &mut Tier;

    /// Start loading `keys` into memory blocks `mem_blocks` for `layers` as
    /// job `id`. Refused (nothing started) when `id` is already a job of
    /// this path in flight or uncollected.
    fn submit_load(
        &mut self,
        id: JobId,
        keys: &[Key],
        mem_blocks: &[u32],
        layers: Range<u32>,
    ) -> Result<()>;

    /// Start storing `keys` from memory blocks `mem_blocks` as job `id`,
    /// with the data checksums the caller took ([`Self::caller_crc_table`];
    /// a path that takes its own ignores them).
    fn submit_store(
        &mut self,
        id: JobId,
        keys: &[Key],
        mem_blocks: &[u32],
        crcs: Option<&[Option<Vec<u32>>]>,
    ) -> Result<()>;

    /// Move everything along without blocking.
    fn poll(&mut self) -> Result<()>;

    /// Layers in memory (or failed) since the last call, in layer order per load.
    fn layer_events(&mut self) -> Vec<LayerDone>;

    /// Results of jobs finished since the last call, each handed out once.
    fn get_finished(&mut self) -> Vec<JobResult>;

    /// Block until job `id` finishes; its result (then not in `get_finished`).
    fn wait(&mut self, id: JobId) -> Result<JobResult>;

    /// Block until every job in flight has finished.
    fn drain(&mut self) -> Result<()>;

    /// Jobs not yet finished.
    fn jobs_in_flight(&self) -> usize;

    /// Loads not yet finished (the scheduler holds stores back while any is).
    fn loads_in_flight(&self) -> usize;

    /// Whether a poll now may find something done that no fd announces.
    fn completions_pending(&self) -> bool;

    /// The first of `blocks` that a job of `kind` on this path uses: a load
    /// writing it (its bytes are not whole yet), or a store still reading it.
    /// The path's own table is the one that knows; its submits refuse a
    /// load into a block a store reads, two loads into one block's layers,
    /// and a store from a block a load writes.
    fn block_in_use(&self, blocks: &[u32], kind: JobKind) -> Option<u32>;

    /// The registered memory whose stores the caller may checksum on its own
    /// thread (host memory), or `None` when the path takes them itself (the
    /// staged path, on the GPU as it gathers).
    fn caller_crc_table(&self) -> Option<Arc<P2pTable>>;

    /// Layers whose copy into GPU memory was queued since the last call (the
    /// staged path's loads; they come before those layers' [`LayerDone`]).
    fn layers_queued(&mut self) -> Vec<LayerQueued> {
        Vec::new()
    }

    /// The GPU completion counter of load `id` a compute stream can wait on
    /// (the staged path's loads, while in flight); `None` elsewhere.
    fn load_counter(&self, _id: JobId) -> Option<LoadCounter> {
        None
    }

    /// The plain tier back, for a caller done with scheduling; refused by a
    /// path whose tier cannot outlive it (the staged path's tier reads and
    /// writes the staging it owns).
    fn into_tier(self: Box<Self>) -> Result<Tier>;
}

impl JobPath for Tier {
    fn tier(&self) -> &Tier {
        self
    }

    fn tier_mut(&mut self) -> &mut Tier {
        self
    }

    fn submit_load(
        &mut self,
        id: JobId,
        keys: &[Key],
        mem_blocks: &[u32],
        layers: Range<u32>,
    ) -> Result<()> {
        self.load_job(Some(id), keys, mem_blocks, layers)
            .map(|_| ())
    }

    fn submit_store(
        &mut self,
        id: JobId,
        keys: &[Key],
        mem_blocks: &[u32],
        crcs: Option<&[Option<Vec<u32>>]>,
    ) -> Result<()> {
        self.store_job(Some(id), keys, mem_blocks, crcs).map(|_| ())
    }

    fn poll(&mut self) -> Result<()> {
        Tier::poll(self)
    }

    fn layer_events(&mut self) -> Vec<LayerDone> {
        Tier::layer_events(self)
    }

    fn get_finished(&mut self) -> Vec<JobResult> {
        Tier::get_finished(self)
    }

    fn wait(&mut self, id: JobId) -> Result<JobResult> {
        Tier::wait(self, id)
    }

    fn drain(&mut self) -> Result<()> {
        Tier::drain(self)
    }

    fn jobs_in_flight(&self) -> usize {
        Tier::jobs_in_flight(self)
    }

    fn loads_in_flight(&self) -> usize {
        Tier::loads_in_flight(self)
    }

    fn completions_pending(&self) -> bool {
        Tier::completions_pending(self)
    }

    fn block_in_use(&self, blocks: &[u32], kind: JobKind) -> Option<u32> {
        blocks
            .iter()
            .copied()
            .find(|&b| self.jobs.mem_busy(b, kind))
    }

    fn caller_crc_table(&self) -> Option<Arc<P2pTable>> {
        self.p2p_table().cloned()
    }

    fn into_tier(self: Box<Self>) -> Result<Tier> {
        Ok(*self)
    }
}
