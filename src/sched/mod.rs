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
use crate::pool::Key;
use crate::staged::{LoadCounter, StagedPath};
use crate::tier::{JobId, JobResult, LayerDone, Tier};
use std::collections::VecDeque;
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
    ticket: u64,
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
    /// Issued as tier job `JobId`.
    Issued(JobId),
}

/// A tier with a policy: loads at once, stores through a bounded backlog the policy releases (the handle's I/O thread drives it).
pub struct Scheduler {
    tier: Tier,
    /// The staged HBM path, when the registered memory is GPU memory the
    /// engine cannot reach: every load and store goes through it. After
    /// `tier` so the tier's I/O into staging drains first on drop.
    staged: Option<StagedPath>,
    policy: Policy,
    backlog: VecDeque<Pending>,
    backlog_blocks: u64,
    /// Most blocks the backlog holds before refusing stores.
    pub backlog_limit_blocks: u64,
    next_ticket: u64,
    issued: Vec<(u64, JobId)>,
    /// Stores released, and when (for reports): (ticket, while a load was in flight).
    pub released_during_reads: u64,
}

impl Scheduler {
    /// Schedules `tier`'s I/O by `policy`, with a backlog of at most `backlog_limit_blocks` blocks.
    pub fn new(tier: Tier, policy: Policy, backlog_limit_blocks: u64) -> Scheduler {
        Scheduler {
            tier,
            staged: None,
            policy,
            backlog: VecDeque::new(),
            backlog_blocks: 0,
            backlog_limit_blocks,
            next_ticket: 1,
            issued: Vec::new(),
            released_during_reads: 0,
        }
    }

    /// The tier.
    pub fn tier(&self) -> &Tier {
        &self.tier
    }
    /// The tier, to change.
    pub fn tier_mut(&mut self) -> &mut Tier {
        &mut self.tier
    }
    /// The tier, for a caller done with scheduling. Refused for a staged
    /// scheduler: its tier's registered memory is the staging, which goes
    /// with the scheduler.
    pub fn into_tier(self) -> Result<Tier> {
        if self.staged.is_some() {
            return Err(Error::invalid(
                "a staged scheduler's tier reads and writes its staging: drain() the scheduler instead of taking the tier",
            ));
        }
        Ok(self.tier)
    }

    /// Serve loads and stores through the staged HBM path (see
    /// `crate::staged`), which `path` registered with this tier.
    pub fn set_staged(&mut self, path: StagedPath) {
        self.staged = Some(path);
    }

    /// The own counter of staged load `job` (GPU only).
    pub fn load_counter(&self, job: JobId) -> Option<LoadCounter> {
        self.staged.as_ref()?.load_counter(job)
    }

    /// Whether GPU memory is served through the staged path.
    pub fn is_staged(&self) -> bool {
        self.staged.is_some()
    }

    /// Move the tier (and the staged path) along without blocking.
    pub fn poll(&mut self) -> Result<()> {
        match &mut self.staged {
            Some(p) => p.poll(&mut self.tier),
            None => self.tier.poll(),
        }
    }

    /// Layers that reached memory since the last call.
    pub fn layer_events(&mut self) -> Vec<LayerDone> {
        match &mut self.staged {
            Some(p) => p
                .layer_events()
                .into_iter()
                .map(|e| LayerDone {
                    job: e.job,
                    layer: e.layer,
                    error: e.error,
                })
                .collect(),
            None => self.tier.layer_events(),
        }
    }

    /// Jobs finished since the last call.
    pub fn get_finished(&mut self) -> Vec<JobResult> {
        match &mut self.staged {
            Some(p) => p.get_finished(),
            None => self.tier.get_finished(),
        }
    }

    /// Tier jobs in flight and stores in the backlog.
    pub fn jobs_in_flight(&self) -> usize {
        match &self.staged {
            Some(p) => p.jobs_in_flight(),
            None => self.tier.jobs_in_flight(),
        }
    }

    /// Loads in flight.
    pub fn loads_in_flight(&self) -> usize {
        match &self.staged {
            Some(p) => p.loads_in_flight(),
            None => self.tier.loads_in_flight(),
        }
    }

    /// Whether a poll now may find something done.
    pub fn completions_pending(&self) -> bool {
        self.tier.completions_pending() || self.staged.as_ref().is_some_and(|p| p.copies_pending())
    }

    /// Waits for `job` to finish (releasing the backlog as the policy allows) and returns its result.
    pub fn wait(&mut self, job: JobId) -> Result<JobResult> {
        match &mut self.staged {
            Some(p) => p.wait(&mut self.tier, job),
            None => self.tier.wait(job),
        }
    }

    /// Wait for every job in flight.
    pub fn drain(&mut self) -> Result<()> {
        match &mut self.staged {
            Some(p) => p.drain(&mut self.tier),
            None => self.tier.drain(),
        }
    }

    fn store_now(
        &mut self,
        keys: &[Key],
        mem_blocks: &[u32],
        crcs: Option<&[Option<Vec<u32>>]>,
    ) -> Result<JobId> {
        match &mut self.staged {
            // The staged path takes the checksums on the GPU as it gathers.
            Some(p) => p.submit_store(&mut self.tier, keys, mem_blocks),
            None => self.tier.submit_store_with_crcs(keys, mem_blocks, crcs),
        }
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
        match &mut self.staged {
            Some(p) => p.submit_load(&mut self.tier, keys, mem_blocks, layers),
            None => self.tier.submit_load(keys, mem_blocks, layers),
        }
    }

    /// Accept a store. Naive issues it now; Slack and Sync keep it in the
    /// backlog until `release_writes`/`flush_writes`. A full backlog refuses
    /// with an error: the caller keeps its blocks (nothing was acknowledged).
    pub fn submit_store(&mut self, keys: &[Key], mem_blocks: &[u32]) -> Result<(u64, StoreState)> {
        let ticket = self.next_ticket;
        self.next_ticket += 1;
        if self.policy == Policy::Naive {
            let job = self.store_now(keys, mem_blocks, None)?;
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
        let ticket = self.next_ticket;
        self.next_ticket += 1;
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
        let n = keys.len() as u64;
        if self.backlog_blocks + n > self.backlog_limit_blocks {
            return Err(Error::Backpressure(format!(
                "write backlog full ({} of {} blocks deferred); the store of {n} blocks was not accepted and nothing of it is stored: retry after decode steps drain the backlog, or raise the backlog limit",
                self.backlog_blocks, self.backlog_limit_blocks
            )));
        }
        self.backlog_blocks += n;
        self.backlog.push_back(Pending {
            ticket,
            keys: keys.to_vec(),
            mem_blocks: mem_blocks.to_vec(),
            crcs,
        });
        Ok(())
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
        self.backlog.drain(..).map(|p| p.ticket).collect()
    }

    /// Issue every deferred store now, whatever the policy.
    pub fn flush_ready(&mut self) -> Vec<(u64, Result<JobId>)> {
        self.issue_up_to(usize::MAX)
    }

    fn issue_up_to(&mut self, max: usize) -> Vec<(u64, Result<JobId>)> {
        let mut out = Vec::new();
        while out.len() < max {
            let Some(p) = self.backlog.pop_front() else {
                break;
            };
            self.backlog_blocks -= p.keys.len() as u64;
            let r = self.store_now(&p.keys, &p.mem_blocks, p.crcs.as_deref());
            out.push((p.ticket, r));
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
            let Some(p) = self.backlog.pop_front() else {
                break;
            };
            self.issue(p)?;
            issued += 1;
        }
        Ok(issued)
    }

    /// Issue every deferred store now (end of prefill for Sync, shutdown).
    pub fn flush_writes(&mut self) -> Result<()> {
        while let Some(p) = self.backlog.pop_front() {
            if self.loads_in_flight() > 0 {
                self.released_during_reads += 1;
            }
            self.issue(p)?;
        }
        Ok(())
    }

    fn issue(&mut self, p: Pending) -> Result<()> {
        self.backlog_blocks -= p.keys.len() as u64;
        let job = self.store_now(&p.keys, &p.mem_blocks, p.crcs.as_deref())?;
        self.issued.push((p.ticket, job));
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
