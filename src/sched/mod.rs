//! The read-first / write-deferred I/O scheduler.
//!
//! Reads of a request's prefix are on the critical path (the next layer's
//! attention waits for them); writes of new KV are not (they only have to
//! land before the blocks are evicted from GPU memory). Issued together on
//! one SSD, large reads and writes collapse each other's bandwidth (see
//! `kvtier bench --contention`). So:
//! - loads go to the device at once;
//! - stores wait in a bounded backlog and are released only when no load is
//!   in flight and the current slack window has room for them (per the slack
//!   table), otherwise at decode steps;
//! - when the backlog is full a store is refused, and reported as not stored:
//!   an acknowledged store is never dropped.
//!
//! `Policy::Naive` releases stores at once (the interleaving Tutti measures
//! a 60% collapse for) and `Policy::Sync` does no overlap at all; both exist
//! for `kvtier replay` to compare against.

use crate::error::{Error, Result};
use crate::gpu::wait::LoadCounter;
use crate::pool::Key;
use crate::tier::{JobId, JobKind, JobPath, JobResult, LayerDone, LayerQueued, Tier};
use std::collections::{HashMap, VecDeque};
use std::ops::Range;

/// A store of `blocks` blocks can ever enter a backlog of `limit` blocks:
/// one larger is a usage error (split it), not backpressure, since no
/// amount of draining makes it fit.
pub fn check_store_fits(blocks: usize, limit: u64) -> Result<()> {
    if blocks as u64 > limit {
        return Err(Error::invalid(format!(
            "a store of {blocks} blocks is larger than the whole write backlog ({limit} blocks) and could never be accepted: split it into stores of at most {limit} blocks, or raise the backlog limit"
        )));
    }
    Ok(())
}

/// When the handle issues loads and stores.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
pub enum Policy {
    /// Reads first; writes only when no read is in flight and slack is left.
    Slack,
    /// Everything issued as soon as it is asked for.
    Naive,
    /// No overlap: each read completes before compute, writes after the prefill.
    Sync,
}

impl Policy {
    /// `slack`, `naive` or `sync`; `None` for anything else.
    pub fn parse(s: &str) -> Option<Policy> {
        match s {
            "slack" => Some(Policy::Slack),
            "naive" => Some(Policy::Naive),
            "sync" => Some(Policy::Sync),
            _ => None,
        }
    }
}

/// What a slack window allows now.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Window {
    /// Write IOCBs (here: store jobs of up to `store_batch_blocks`) that fit.
    pub write_iocbs: u32,
}

/// A store the scheduler has accepted but not yet issued.
struct Pending {
    /// Its job id, given when it was accepted and kept on every path.
    id: JobId,
    keys: Vec<Key>,
    mem_blocks: Vec<u32>,
    /// Data checksums taken when the store was accepted (see
    /// `Tier::submit_store_with_crcs`).
    crcs: Option<Vec<Option<Vec<u32>>>>,
}

/// The outcome of a store handed to the scheduler.
#[derive(Clone, Debug)]
pub enum StoreState {
    /// Waiting in the backlog.
    Deferred,
    /// Issued as job `JobId` (the id it was accepted under).
    Issued(JobId),
}

/// A job path with a policy: loads at once, stores through a bounded backlog
/// the policy releases (the handle's I/O thread drives it). The scheduler
/// numbers every job, load or store, once: the id a store is accepted under
/// (its ticket) is the id its path runs it under and its result carries.
pub struct Scheduler {
    /// The tier, or the staged HBM path in front of it: every load and
    /// store goes through this one path.
    path: Box<dyn JobPath>,
    policy: Policy,
    backlog: VecDeque<Pending>,
    backlog_blocks: u64,
    /// Memory blocks the backlog's stores read (count per block): a load
    /// into one is refused. The path's own table knows the jobs it runs.
    backlog_mem: HashMap<u32, u32>,
    /// Most blocks the backlog holds before refusing stores.
    pub backlog_limit_blocks: u64,
    next_id: JobId,
    issued: Vec<(u64, JobId)>,
    /// Stores released, and when (for reports): (ticket, while a load was in flight).
    pub released_during_reads: u64,
}

impl Scheduler {
    /// Schedules `tier`'s I/O by `policy`, with a backlog of at most `backlog_limit_blocks` blocks.
    pub fn new(tier: Tier, policy: Policy, backlog_limit_blocks: u64) -> Scheduler {
        Self::with_path(Box::new(tier), policy, backlog_limit_blocks)
    }

    /// Schedules the I/O of `path` (a [`Tier`], or `crate::staged::StagedTier`
    /// serving GPU memory through one) by `policy`.
    pub fn with_path(
        path: Box<dyn JobPath>,
        policy: Policy,
        backlog_limit_blocks: u64,
    ) -> Scheduler {
        Scheduler {
            path,
            policy,
            backlog: VecDeque::new(),
            backlog_blocks: 0,
            backlog_mem: HashMap::new(),
            backlog_limit_blocks,
            next_id: 1,
            issued: Vec::new(),
            released_during_reads: 0,
        }
    }

    /// The tier.
    pub fn tier(&self) -> &Tier {
        self.path.tier()
    }
    /// The tier, to change.
    pub fn tier_mut(&mut self) -> &mut Tier {
        self.path.tier_mut()
    }
    /// The path its jobs run on.
    pub fn path(&self) -> &dyn JobPath {
        self.path.as_ref()
    }
    /// The tier, for a caller done with scheduling. Refused for a staged
    /// scheduler: its tier's registered memory is the staging, which goes
    /// with the scheduler.
    pub fn into_tier(self) -> Result<Tier> {
        self.path.into_tier()
    }

    /// The own counter of staged load `job` (GPU only).
    pub fn load_counter(&self, job: JobId) -> Option<LoadCounter> {
        self.path.load_counter(job)
    }

    /// Move the path along without blocking.
    pub fn poll(&mut self) -> Result<()> {
        self.path.poll()
    }

    /// Layers whose copy into GPU memory was queued since the last call.
    pub fn layers_queued(&mut self) -> Vec<LayerQueued> {
        self.path.layers_queued()
    }

    /// Layers that reached memory since the last call.
    pub fn layer_events(&mut self) -> Vec<LayerDone> {
        self.path.layer_events()
    }

    /// Jobs finished since the last call.
    pub fn get_finished(&mut self) -> Vec<JobResult> {
        self.path.get_finished()
    }

    /// Jobs in flight on the path (not the backlog's).
    pub fn jobs_in_flight(&self) -> usize {
        self.path.jobs_in_flight()
    }

    /// Loads in flight.
    pub fn loads_in_flight(&self) -> usize {
        self.path.loads_in_flight()
    }

    /// Whether a poll now may find something done.
    pub fn completions_pending(&self) -> bool {
        self.path.completions_pending()
    }

    /// Waits for `job` to finish and returns its result.
    pub fn wait(&mut self, job: JobId) -> Result<JobResult> {
        self.path.wait(job)
    }

    /// Wait for every job in flight.
    pub fn drain(&mut self) -> Result<()> {
        self.path.drain()
    }

    fn take_id(&mut self) -> JobId {
        let id = self.next_id;
        self.next_id += 1;
        id
    }

    fn store_now(
        &mut self,
        id: JobId,
        keys: &[Key],
        mem_blocks: &[u32],
        crcs: Option<&[Option<Vec<u32>>]>,
    ) -> Result<JobId> {
        self.path.submit_store(id, keys, mem_blocks, crcs)?;
        Ok(id)
    }
    /// The policy.
    pub fn policy(&self) -> Policy {
        self.policy
    }
    /// Blocks in the backlog.
    pub fn backlog_blocks(&self) -> u64 {
        self.backlog_blocks
    }

    /// Reads are never held back.
    pub fn submit_load(
        &mut self,
        keys: &[Key],
        mem_blocks: &[u32],
        layers: Range<u32>,
    ) -> Result<JobId> {
        if let Some(b) = mem_blocks.iter().find(|b| self.backlog_mem.contains_key(b)) {
            return Err(Error::invalid(format!(
                "memory block {b} is read by a store not yet issued; wait for that store before loading into it"
            )));
        }
        let id = self.take_id();
        self.path.submit_load(id, keys, mem_blocks, layers)?;
        Ok(id)
    }

    /// Accept a store. Naive issues it now; Slack and Sync keep it in the
    /// backlog until `release_writes`/`flush_writes`. A full backlog refuses
    /// with an error: the caller keeps its blocks (nothing was acknowledged).
    pub fn submit_store(&mut self, keys: &[Key], mem_blocks: &[u32]) -> Result<(u64, StoreState)> {
        let ticket = self.take_id();
        if self.policy == Policy::Naive {
            let job = self.store_now(ticket, keys, mem_blocks, None)?;
            self.issued.push((ticket, job));
            return Ok((ticket, StoreState::Issued(job)));
        }
        self.defer(ticket, keys, mem_blocks, None)?;
        Ok((ticket, StoreState::Deferred))
    }

    /// Accept a store into the backlog whatever the policy; `release_ready`
    /// or `flush_ready` issue it later, on the thread that owns the tier.
    /// A full backlog refuses with `Error::Backpressure` and accepts nothing.
    pub fn enqueue_store(
        &mut self,
        keys: &[Key],
        mem_blocks: &[u32],
        crcs: Option<Vec<Option<Vec<u32>>>>,
    ) -> Result<u64> {
        let ticket = self.take_id();
        self.defer(ticket, keys, mem_blocks, crcs)?;
        Ok(ticket)
    }

    fn defer(
        &mut self,
        ticket: u64,
        keys: &[Key],
        mem_blocks: &[u32],
        crcs: Option<Vec<Option<Vec<u32>>>>,
    ) -> Result<()> {
        check_store_fits(keys.len(), self.backlog_limit_blocks)?;
        if let Some(b) = self.path.block_in_use(mem_blocks, JobKind::Load) {
            return Err(Error::invalid(format!(
                "memory block {b} is the target of a load not yet finished; wait for that load before storing from it"
            )));
        }
        let n = keys.len() as u64;
        if self.backlog_blocks + n > self.backlog_limit_blocks {
            return Err(Error::Backpressure(format!(
                "write backlog full ({} of {} blocks deferred); the store of {n} blocks was not accepted and nothing of it is stored: retry after decode steps drain the backlog, or raise the backlog limit",
                self.backlog_blocks, self.backlog_limit_blocks
            )));
        }
        self.backlog_blocks += n;
        for &b in mem_blocks {
            *self.backlog_mem.entry(b).or_default() += 1;
        }
        self.backlog.push_back(Pending {
            id: ticket,
            keys: keys.to_vec(),
            mem_blocks: mem_blocks.to_vec(),
            crcs,
        });
        Ok(())
    }

    /// Which job uses memory block `block`: `Load` while a load writes it,
    /// `Store` while a store reads it (deferred, or on the path), `None` when
    /// it is free. One answer from the two places jobs are: the backlog and
    /// the path's own table.
    pub fn memory_block_use(&self, block: u32) -> Option<JobKind> {
        if self.path.block_in_use(&[block], JobKind::Load).is_some() {
            Some(JobKind::Load)
        } else if self.backlog_mem.contains_key(&block)
            || self.path.block_in_use(&[block], JobKind::Store).is_some()
        {
            Some(JobKind::Store)
        } else {
            None
        }
    }

    /// Deferred stores in the backlog.
    pub fn backlog_len(&self) -> usize {
        self.backlog.len()
    }

    /// Issue the deferred stores the policy allows now, at most `max`: Slack
    /// only while no load is in flight, Naive always, Sync never (see
    /// `flush_ready`). Each store's own result comes back with its ticket, so
    /// a store the tier refuses (the pool full of pinned blocks) is reported,
    /// never dropped. Does not poll the tier.
    pub fn release_ready(&mut self, max: usize) -> Vec<(u64, Result<JobId>)> {
        let allowed = match self.policy {
            Policy::Slack => self.loads_in_flight() == 0,
            Policy::Naive => true,
            Policy::Sync => false,
        };
        if !allowed {
            return Vec::new();
        }
        self.issue_up_to(max)
    }

    /// Remove every deferred store without issuing it (a shutdown that does
    /// not flush); returns their tickets. Nothing of them was acknowledged.
    pub fn take_backlog(&mut self) -> Vec<u64> {
        self.backlog_blocks = 0;
        self.backlog_mem.clear();
        self.backlog.drain(..).map(|p| p.id).collect()
    }

    /// Issue every deferred store now, whatever the policy.
    pub fn flush_ready(&mut self) -> Vec<(u64, Result<JobId>)> {
        self.issue_up_to(usize::MAX)
    }

    fn issue_up_to(&mut self, max: usize) -> Vec<(u64, Result<JobId>)> {
        let mut out = Vec::new();
        while out.len() < max {
            let Some(p) = self.pop_backlog() else {
                break;
            };
            let r = self.store_now(p.id, &p.keys, &p.mem_blocks, p.crcs.as_deref());
            out.push((p.id, r));
        }
        out
    }

    /// A slack window opened (a layer's compute, or a decode step): issue
    /// deferred stores that fit, but never while a read is in flight.
    /// Returns how many stores were issued.
    pub fn release_writes(&mut self, window: Window) -> Result<u32> {
        if self.policy != Policy::Slack {
            return Ok(0);
        }
        self.poll()?;
        if self.loads_in_flight() > 0 {
            return Ok(0);
        }
        let mut issued = 0;
        while issued < window.write_iocbs {
            let Some(p) = self.pop_backlog() else {
                break;
            };
            self.issue(p)?;
            issued += 1;
        }
        Ok(issued)
    }

    /// Issue every deferred store now (end of prefill for Sync, shutdown).
    pub fn flush_writes(&mut self) -> Result<()> {
        while let Some(p) = self.pop_backlog() {
            if self.loads_in_flight() > 0 {
                self.released_during_reads += 1;
            }
            self.issue(p)?;
        }
        Ok(())
    }

    /// The oldest deferred store, out of the backlog's accounting.
    fn pop_backlog(&mut self) -> Option<Pending> {
        let p = self.backlog.pop_front()?;
        self.backlog_blocks -= p.keys.len() as u64;
        for b in &p.mem_blocks {
            if let Some(c) = self.backlog_mem.get_mut(b) {
                *c -= 1;
                if *c == 0 {
                    self.backlog_mem.remove(b);
                }
            }
        }
        Some(p)
    }

    fn issue(&mut self, p: Pending) -> Result<()> {
        let job = self.store_now(p.id, &p.keys, &p.mem_blocks, p.crcs.as_deref())?;
        self.issued.push((p.id, job));
        Ok(())
    }

    /// Wait for every issued store and return their results with tickets.
    pub fn wait_stores(&mut self) -> Result<Vec<(u64, JobResult)>> {
        let issued = std::mem::take(&mut self.issued);
        issued
            .into_iter()
            .map(|(t, j)| Ok((t, self.wait(j)?)))
            .collect()
    }
}
