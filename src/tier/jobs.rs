//! The job table: every job in flight with its planned I/O, the IOCBs it
//! holds, the keys and memory blocks it uses, and the results and layer
//! events waiting to be collected.

use super::headers::PendingHeaders;
use super::results::FinishedJobs;
use super::{JobId, JobKind, JobResult, KeyOutcome, LayerDone};
use crate::error::{Error, Failure, Result};
use crate::plan::PlannedIo;
use crate::pool::Key;
use crate::ring::IocbId;
use std::collections::{HashMap, VecDeque};
use std::ops::Range;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Step {
    LoadLayer(u32),
    Invalidate,
    Data,
    Headers,
    /// Flush after the step before it.
    Flush(FlushAfter),
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum FlushAfter {
    Invalidate,
    Data,
    Headers,
}

pub(super) struct Item {
    pub(super) step: Step,
    pub(super) ios: Vec<PlannedIo>,
    pub(super) next: usize,
    pub(super) iocbs_out: u32,
    /// Bytes of the item's I/O in IOCBs not yet completed.
    pub(super) bytes_out: u64,
    /// The first failure among the item's I/Os.
    pub(super) failed: Option<Failure>,
    /// A verified load layer: the checksums of its objects as they land.
    pub(super) check: Option<LayerCheck>,
}

/// The checksums of a load layer's objects, taken as each I/O lands so the
/// layer is verified by the time its last read completes (only that read's
/// bytes are hashed after it).
pub(super) struct LayerCheck {
    /// (key position, K|V) of every object, in the order the layer's I/Os
    /// carry them.
    pub(super) owners: Vec<(u32, u8)>,
    /// Index in `owners` of each I/O's first object.
    pub(super) first_obj: Vec<u32>,
    /// Per key position: crc32c of its K and V objects.
    pub(super) kv_crcs: Vec<[u32; 2]>,
}

impl LayerCheck {
    pub(super) fn new(ios: &[PlannedIo], owners: Vec<(u32, u8)>, keys: usize) -> LayerCheck {
        let mut first_obj = Vec::with_capacity(ios.len());
        let mut n = 0u32;
        for io in ios {
            first_obj.push(n);
            n += io.segs.len() as u32;
        }
        debug_assert_eq!(n as usize, owners.len());
        LayerCheck {
            owners,
            first_obj,
            kv_crcs: vec![[0; 2]; keys],
        }
    }
}

impl Item {
    pub(super) fn new(step: Step, ios: Vec<PlannedIo>) -> Item {
        Item {
            step,
            ios,
            next: 0,
            iocbs_out: 0,
            bytes_out: 0,
            failed: None,
            check: None,
        }
    }
}

impl Item {
    pub(super) fn issued(&self) -> bool {
        self.next == self.ios.len()
    }
    pub(super) fn complete(&self) -> bool {
        self.issued() && self.iocbs_out == 0
    }
    pub(super) fn bytes(&self) -> u64 {
        self.ios.iter().map(|io| io.len as u64).sum()
    }
}

pub(super) struct StoreState {
    /// Per key position: the slot being written, or None (deduplicated).
    pub(super) slots: Vec<Option<u64>>,
    pub(super) generations: Vec<u64>,
    pub(super) staging: Vec<u32>,
    pub(super) invalidated: Vec<u64>,
    /// Keys of this job that another store (or an earlier position of this
    /// one) writes: (position, that job). Their outcome follows that job's.
    pub(super) waiting_on: Vec<(usize, JobId)>,
    pub(super) evicted: Vec<Key>,
    /// Set once a failure makes the remaining steps pointless.
    pub(super) abandoned: Option<Failure>,
    /// Slots whose writes failed with an I/O error: retired when the job ends.
    pub(super) bad_slots: Vec<u64>,
    /// Slots whose old header could not be invalidated (a media error on
    /// its sector): taken out of use for this process, whatever became of
    /// the job. Left free, such a slot would be the next store's pick and
    /// fail it the same way, and every store after it.
    pub(super) unwritable_headers: Vec<u64>,
    /// Headers not yet staged (they are, just before the header writes).
    pub(super) headers: Option<PendingHeaders>,
}

/// What a load checks its bytes against.
pub(super) struct LoadCheck {
    /// The slot each key position reads (the index may drop or move a key
    /// while the load runs; the job still owns what it read).
    pub(super) slots: Vec<u64>,
    /// Verify layers as they land (host memory, `verify_loads`).
    pub(super) verify: bool,
    /// Per key: running crc32c over the layers loaded so far, for blocks whose
    /// headers carry only a whole-block checksum (checked after the last layer
    /// when the load covers them all).
    pub(super) running: Vec<u32>,
    /// Layers not planned yet: `submit_load` plans the first one only, so
    /// its reads reach the device before the rest is planned.
    pub(super) unplanned: Range<u32>,
}

pub(super) struct Job {
    pub(super) id: JobId,
    pub(super) kind: JobKind,
    pub(super) keys: Vec<Key>,
    pub(super) mem_blocks: Vec<u32>,
    pub(super) outcomes: Vec<Option<KeyOutcome>>,
    /// Runs of key positions served by one planned I/O.
    pub(super) runs: Vec<Vec<u32>>,
    pub(super) items: Vec<Item>,
    /// Items run in order; a store item waits for all before it.
    pub(super) sequential: bool,
    pub(super) layers: Range<u32>,
    pub(super) layers_done: u32,
    pub(super) store: Option<StoreState>,
    pub(super) load: Option<LoadCheck>,
}

impl Job {
    pub(super) fn fail_run(&mut self, run: u32, why: &Failure) {
        for &p in &self.runs[run as usize] {
            if self.outcomes[p as usize].is_none() {
                self.outcomes[p as usize] = Some(KeyOutcome::Failed(why.clone()));
            }
        }
    }
    pub(super) fn failed(&self, pos: usize) -> bool {
        matches!(
            self.outcomes[pos],
            Some(KeyOutcome::Failed(_) | KeyOutcome::Corrupt(_))
        )
    }
    pub(super) fn all_items_complete(&self) -> bool {
        self.items.iter().all(Item::complete)
    }
}

/// The I/O one IOCB in flight carries: I/Os `first_io..` of item `item` of
/// job `job`, `bytes` in all.
#[derive(Clone, Copy, Debug)]
pub(super) struct IocbUse {
    pub(super) job: JobId,
    pub(super) item: usize,
    pub(super) first_io: usize,
    pub(super) bytes: u64,
}

/// The `IocbUse::job` of a group flush's IOCB: it belongs to no one job.
pub(super) const GROUP_FLUSH: JobId = JobId::MAX;

/// Group commit: the stores in flight share their flushes. A store's flush
/// step (after its invalidations, its data, its headers) does not issue a
/// flush of its own: it waits for the next group flush, issued once the
/// group flush before it has completed, that flushes every device the
/// waiting steps wrote. So one flush makes the data of some stores durable
/// together with the headers of others and the invalidations of others
/// still, while their writes keep the device busy. Each waiting step joined
/// after every write of its job's step before it had completed, and the
/// group flush it joins is issued after that: what a flush of its own, issued
/// then, would have made durable, the group flush makes durable too.
#[derive(Default)]
pub(super) struct FlushGroup {
    /// Flush steps (job, item) waiting for the next group flush.
    pub(super) waiting: Vec<(JobId, usize)>,
    /// The group flush in flight: its IOCB and the steps it completes.
    pub(super) in_flight: Option<(IocbId, Vec<(JobId, usize)>)>,
    /// Group flushes issued, and flush steps they completed (monitoring).
    pub(super) issued: u64,
    pub(super) steps: u64,
}

/// Every job of a tier and what it holds, in one place.
pub(super) struct JobTable {
    /// Jobs not yet finished.
    pub(super) live: HashMap<JobId, Job>,
    /// What each IOCB in flight carries.
    pub(super) iocb_owner: HashMap<IocbId, IocbUse>,
    /// Load I/Os that landed and whose bytes are not yet hashed: (job, item,
    /// I/O of the item).
    pub(super) landed: Vec<(JobId, usize, usize)>,
    /// Jobs with items not yet fully in IOCBs, in submission order.
    pub(super) issue_queue: VecDeque<JobId>,
    /// Keys being stored, by job.
    pub(super) storing: HashMap<Key, JobId>,
    /// Memory blocks jobs in flight use: (loads writing it, stores reading it).
    mem_busy: HashMap<u32, (u32, u32)>,
    /// Results not yet collected (`wait`, `get_finished`), in finishing order.
    pub(super) finished: FinishedJobs,
    pub(super) layer_events: VecDeque<LayerDone>,
    /// Stores' flushes, shared (group commit).
    pub(super) flush_group: FlushGroup,
    next_id: JobId,
}

impl JobTable {
    pub(super) fn new() -> JobTable {
        JobTable {
            live: HashMap::new(),
            iocb_owner: HashMap::new(),
            landed: Vec::new(),
            issue_queue: VecDeque::new(),
            storing: HashMap::new(),
            mem_busy: HashMap::new(),
            finished: FinishedJobs::default(),
            layer_events: VecDeque::new(),
            flush_group: FlushGroup::default(),
            next_id: 1,
        }
    }

    /// The id a new job gets: `want` when the caller numbers its jobs (the
    /// scheduler gives every path the one id its job has from submit to
    /// result), refused while a job of that id is in flight or uncollected;
    /// else the table's next.
    pub(super) fn claim(&self, want: Option<JobId>) -> Result<JobId> {
        match want {
            None => Ok(self.next_id),
            Some(id) if id == GROUP_FLUSH || id == 0 || self.known(id) => Err(Error::invalid(
                format!("job id {id} is in use or reserved: give each job of a tier its own id"),
            )),
            Some(id) => Ok(id),
        }
    }

    /// Add a planned job (its id from `claim`) and queue its I/O; it holds
    /// its memory blocks until it finishes.
    pub(super) fn insert(&mut self, job: Job) -> JobId {
        let id = job.id;
        self.next_id = self.next_id.max(id + 1);
        for &b in &job.mem_blocks {
            let u = self.mem_busy.entry(b).or_default();
            match job.kind {
                JobKind::Load => u.0 += 1,
                JobKind::Store => u.1 += 1,
            }
        }
        self.live.insert(id, job);
        self.issue_queue.push_back(id);
        id
    }

    /// Whether a job in flight writes (a load) or reads (a store) `block`.
    pub(super) fn mem_busy(&self, block: u32, kind: JobKind) -> bool {
        self.mem_busy.get(&block).is_some_and(|u| match kind {
            JobKind::Load => u.0 > 0,
            JobKind::Store => u.1 > 0,
        })
    }

    /// A block of `mem_blocks` that a load in flight writes in one of
    /// `layers`, with that load's layers. Two loads writing one block's layer
    /// at once would each verify the other's bytes: the loser reads as
    /// corrupt, and a key stored and acknowledged is dropped from the pool.
    pub(super) fn load_overlap(
        &self,
        mem_blocks: &[u32],
        layers: &Range<u32>,
    ) -> Option<(u32, Range<u32>)> {
        if !mem_blocks.iter().any(|&b| self.mem_busy(b, JobKind::Load)) {
            return None;
        }
        let mine: std::collections::HashSet<u32> = mem_blocks.iter().copied().collect();
        self.live
            .values()
            .filter(|j| {
                j.kind == JobKind::Load
                    && j.layers.start < layers.end
                    && layers.start < j.layers.end
            })
            .find_map(|j| {
                j.mem_blocks
                    .iter()
                    .find(|b| mine.contains(b))
                    .map(|&b| (b, j.layers.clone()))
            })
    }

    /// Take a job out of flight (its result goes to `finish`).
    pub(super) fn remove(&mut self, id: JobId) -> Option<Job> {
        let job = self.live.remove(&id)?;
        for b in &job.mem_blocks {
            if let Some(u) = self.mem_busy.get_mut(b) {
                match job.kind {
                    JobKind::Load => u.0 -= 1,
                    JobKind::Store => u.1 -= 1,
                }
                if *u == (0, 0) {
                    self.mem_busy.remove(b);
                }
            }
        }
        Some(job)
    }

    /// Keep a finished job's result until it is collected.
    pub(super) fn finish(&mut self, result: JobResult) {
        self.finished.push(result);
    }

    /// Remove a collected result and the layer events of its job.
    pub(super) fn collect(&mut self, id: JobId) -> Option<JobResult> {
        let r = self.finished.take(id)?;
        if r.kind == JobKind::Load {
            self.layer_events.retain(|e| e.job != id);
        }
        Some(r)
    }

    /// Remove every collected result, in finishing order, and the layer
    /// events of those jobs.
    pub(super) fn collect_all(&mut self) -> Vec<JobResult> {
        let all = self.finished.take_all();
        let loads: std::collections::HashSet<JobId> = all
            .iter()
            .filter(|r| r.kind == JobKind::Load)
            .map(|r| r.job)
            .collect();
        if !loads.is_empty() {
            self.layer_events.retain(|e| !loads.contains(&e.job));
        }
        all
    }

    /// In flight, or finished and not yet collected.
    pub(super) fn known(&self, id: JobId) -> bool {
        self.live.contains_key(&id) || self.finished.contains(id)
    }

    pub(super) fn count(&self, kind: JobKind) -> usize {
        self.live.values().filter(|j| j.kind == kind).count()
    }
}
