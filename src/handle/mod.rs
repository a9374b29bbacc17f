//! `TierHandle`: kvtier's front door for serving engines.
//!
//! A handle owns one `Tier` on its own I/O thread and is `Send + Sync +
//! Clone`: vLLM's scheduler and workers, or LMCache's store and prefetch
//! controllers, call one handle from as many threads as they like.
//!
//! # Threading contract
//!
//! - The tier, its engine and the engine's rings are created, polled and
//!   dropped on the I/O thread only. An io_uring set up with
//!   `SINGLE_ISSUER | DEFER_TASKRUN` therefore never sees another thread; no
//!   method of the handle enters the engine.
//! - `lookup_prefix`, `lookup_and_pin`, `unpin` and `contains` read or
//!   update the pool's index under the index's own lock
//!   (`crate::pool::index::SharedIndex`), which every holder keeps for a
//!   few index operations only: they never wait behind the I/O thread's
//!   poll turn (reaping, checksum hashing, planning), a submit's planning,
//!   a load, a store or another caller's `wait`. `usage` and
//!   `memory_block_use` take the core lock, which the I/O thread never holds while it sleeps or waits for a
//!   device.
//! - `submit_load` plans its reads on the calling thread under the core
//!   lock and returns at once; the I/O thread issues them. `submit_store` takes
//!   the data checksums on the calling thread (outside every lock) and puts
//!   the store in the write backlog; the I/O thread issues it when the
//!   policy allows (read first, write deferred: `crate::sched`). A full
//!   backlog refuses with [`ErrorKind::Backpressure`] and stores nothing.
//! - `wait`, `wait_layer`, `try_result` and `get_finished` wait on the job
//!   table only, never on the tier: a blocked waiter holds up nobody.
//! - Completions arrive three ways: blocking waits by job id; per-layer and
//!   per-job [`Event`]s through [`Completions`] (a channel with an eventfd
//!   that polls readable while events are queued, for epoll or asyncio); and
//!   `get_finished` for a step loop.
//! - Every job's result must be collected once (`wait`, `try_result` or
//!   `get_finished`); events only say that it is there.
//! - `close` issues the write backlog, waits for every job, stops the thread
//!   and reports the first failure. Dropping the last clone without `close`
//!   fails the stores still in the backlog (they were never acknowledged),
//!   waits only for I/O already in flight (the memory it targets must not be
//!   freed under it), and never waits for anything else.
//!
//! # Memory contract
//!
//! The memory blocks of a job must not be written by the caller until the job
//! finishes (a store's checksums are taken when it is submitted, and a load
//! writes them). The handle refuses a load into blocks that a store in the
//! backlog or in flight reads or that another load in flight writes, and a
//! store from blocks a load is writing. The scheduler checks its backlog and
//! the path (the tier, or the staged path) its own table of jobs in flight:
//! each block is checked once, by the one that holds the job using it.

mod api;
mod builder;

pub use api::TierApi;
pub use builder::{EngineChoice, TierBuilder};

use crate::error::{Error, ErrorKind, Failure, Result};
use crate::memory::HostKvCache;
use crate::model::KvGeometry;
use crate::p2p::P2pTable;
use crate::pool::index::SharedIndex;
use crate::pool::Key;
use crate::sched::{Policy, Scheduler};
use crate::staged::{CopyMark, LoadCounter};
use crate::tier::{self, JobKind, JobResult, KeyOutcome, Tier, TierConfig, Usage};
use nix::poll::{PollFd, PollFlags, PollTimeout};
use nix::sys::eventfd::{EfdFlags, EventFd};
use std::collections::{HashMap, VecDeque};
use std::ops::Range;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, RawFd};
use std::sync::atomic::{AtomicBool, AtomicU8, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, Weak};
use std::thread::{JoinHandle, ThreadId};
use std::time::{Duration, Instant};

/// A job of a handle: the id its scheduler gave it, which its path (the
/// tier, or the staged path) runs it under and its result carries.
pub type JobId = u64;

/// How the handle schedules work; see `crate::sched`.
#[non_exhaustive]
#[derive(Clone, Debug)]
pub struct HandleConfig {
    /// The tier's settings.
    pub tier: TierConfig,
    /// `Slack` (default): stores wait while any load is in flight. `Naive`:
    /// stores go as soon as the I/O thread sees them. `Sync`: stores wait
    /// for `flush_stores` or `close`.
    pub policy: Policy,
    /// Most blocks the write backlog holds before `submit_store` refuses
    /// with backpressure.
    pub backlog_limit_blocks: u64,
    /// Stores the I/O thread releases from the backlog per turn, so a long
    /// backlog cannot delay a load submitted meanwhile by more than that.
    pub stores_per_turn: usize,
}

impl Default for HandleConfig {
    fn default() -> Self {
        HandleConfig {
            tier: TierConfig::default(),
            policy: Policy::Slack,
            backlog_limit_blocks: 1 << 16,
            stores_per_turn: 4,
        }
    }
}

with_setters!(HandleConfig {
    /// With these tier settings.
    with_tier => tier: TierConfig,
    /// With this scheduling policy.
    with_policy => policy: Policy,
    /// With a write backlog of at most `backlog_limit_blocks` blocks.
    with_backlog_limit_blocks => backlog_limit_blocks: u64,
    /// With at most `stores_per_turn` stores released from the backlog per turn.
    with_stores_per_turn => stores_per_turn: usize,
});

/// A completion, in the order the I/O thread saw it; per load, layers in
/// layer order and all of them before the job's `Finished`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Event {
    /// Layer `layer` of load `job` is in memory, or failed (`error`: its
    /// memory must not be used).
    Layer {
        /// The load.
        job: JobId,
        /// The layer.
        layer: u32,
        /// Why some of its reads failed.
        error: Option<Failure>,
    },
    /// `job` finished; `ok` when every key is done. Collect its result with
    /// `wait` / `try_result` (returns at once now) or `get_finished`.
    Finished {
        /// The job.
        job: JobId,
        /// Load or store.
        kind: JobKind,
        /// Every key done.
        ok: bool,
    },
}

/// What the handle holds, for monitoring.
#[derive(Clone, Debug, serde::Serialize)]
pub struct HandleUsage {
    /// The tier's usage.
    pub tier: Usage,
    /// Stores accepted and not yet issued, and their blocks.
    pub deferred_stores: usize,
    /// Blocks of those deferred stores.
    pub deferred_blocks: u64,
}

/// A stream of [`Event`]s from one handle, for one consumer. Each
/// `Completions` gets every event from its creation on, except that once
/// more than a few thousand are queued undrained, those of jobs whose
/// results were already collected (`wait`, `try_result`, `get_finished`)
/// are dropped, so a stream nobody drains stays bounded. Its eventfd polls
/// readable exactly while events are queued, so an epoll loop (or asyncio's
/// `add_reader`) can sleep on it and then drain with `try_recv`.
pub struct Completions {
    q: Arc<EventQueue>,
}

struct EventQueue {
    events: Mutex<VecDeque<Event>>,
    cond: Condvar,
    /// Non-zero exactly while `events` is non-empty (both change under the lock).
    fd: EventFd,
    /// Queue length past which events of collected jobs are dropped (changed
    /// under the `events` lock).
    compact_at: AtomicUsize,
}

/// Jobs the table holds at most: running, or finished with their results
/// not yet collected. A serving engine has hundreds in flight; past this a
/// submit is refused as backpressure until results are collected.
pub const MAX_JOBS: usize = 1 << 16;

/// Events queued before a queue is first compacted. A subscriber that never
/// drains (a caller that only uses `wait`, as the Python module's own
/// subscription often is) would otherwise grow its queue by a load's
/// layers + 1 events per job, without end.
const EVENTS_KEPT_FLOOR: usize = 4096;

fn event_job(e: &Event) -> JobId {
    match e {
        Event::Layer { job, .. } | Event::Finished { job, .. } => *job,
    }
}

impl EventQueue {
    /// Queue `evs`. Past `compact_at` events, those of jobs whose results
    /// were already collected (`live` is false for them) are dropped: no
    /// consumer can act on them. Events of uncollected jobs are all kept;
    /// the threshold doubles with what stays, so compaction is amortised.
    fn push(&self, evs: &[Event], live: &dyn Fn(JobId) -> bool) {
        if evs.is_empty() {
            return;
        }
        let mut q = lock(&self.events);
        let was_empty = q.is_empty();
        q.extend(evs.iter().cloned());
        if q.len() > self.compact_at.load(Ordering::Relaxed) {
            q.retain(|e| live(event_job(e)));
            self.compact_at
                .store((2 * q.len()).max(EVENTS_KEPT_FLOOR), Ordering::Relaxed);
        }
        match (was_empty, q.is_empty()) {
            // Cannot fail: the counter is 0 or 1, far from overflow.
            (true, false) => {
                let _ = self.fd.write(1);
            }
            // Everything queued was dropped: stop polling readable.
            (false, true) => {
                let _ = self.fd.read();
            }
            _ => {}
        }
        self.cond.notify_all();
    }
}

/// The event streams of one handle (each [`Completions`] a consumer holds),
/// fed by whoever learns of completions: the in-process handle's I/O thread,
/// or a service client's reader.
#[derive(Default)]
pub(crate) struct EventSubscribers(Vec<Weak<EventQueue>>);

impl EventSubscribers {
    /// A new stream, which gets every event broadcast from now on.
    pub(crate) fn subscribe(&mut self) -> Result<Completions> {
        let fd = EventFd::from_flags(EfdFlags::EFD_CLOEXEC | EfdFlags::EFD_NONBLOCK)
            .map_err(|e| Error::io("creating an eventfd for completions", e.into()))?;
        let q = Arc::new(EventQueue {
            events: Mutex::new(VecDeque::new()),
            cond: Condvar::new(),
            fd,
            compact_at: AtomicUsize::new(EVENTS_KEPT_FLOOR),
        });
        self.0.push(Arc::downgrade(&q));
        Ok(Completions { q })
    }

    /// Queue `events` on every live stream; `live` says which jobs still
    /// have a result to collect (see [`EventQueue::push`]).
    pub(crate) fn broadcast(&mut self, events: &[Event], live: &dyn Fn(JobId) -> bool) {
        self.0.retain(|w| match w.upgrade() {
            Some(q) => {
                q.push(events, live);
                true
            }
            None => false,
        });
    }
}

impl Completions {
    /// The next event, if one is queued.
    pub fn try_recv(&self) -> Option<Event> {
        let mut q = lock(&self.q.events);
        let e = q.pop_front();
        if e.is_some() && q.is_empty() {
            // Reset the counter: the fd stops polling readable.
            let _ = self.q.fd.read();
        }
        e
    }

    /// The next event, waiting at most `timeout`.
    pub fn recv_timeout(&self, timeout: Duration) -> Option<Event> {
        let deadline = Instant::now() + timeout;
        let mut q = lock(&self.q.events);
        while q.is_empty() {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return None;
            }
            q = self
                .q
                .cond
                .wait_timeout(q, left)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
        let e = q.pop_front();
        if q.is_empty() {
            let _ = self.q.fd.read();
        }
        e
    }

    /// Everything queued now.
    pub fn drain(&self) -> Vec<Event> {
        let mut q = lock(&self.q.events);
        if !q.is_empty() {
            let _ = self.q.fd.read();
        }
        q.drain(..).collect()
    }
}

impl AsFd for Completions {
    fn as_fd(&self) -> BorrowedFd<'_> {
        self.q.fd.as_fd()
    }
}

impl AsRawFd for Completions {
    fn as_raw_fd(&self) -> RawFd {
        self.q.fd.as_fd().as_raw_fd()
    }
}

enum Phase {
    /// In the write backlog.
    Deferred,
    /// A tier job in flight.
    Running,
    Finished(JobResult),
}

/// Where a layer of a load stands for a compute stream
/// ([`TierHandle::wait_layer_queued`]).
#[derive(Clone)]
pub enum LayerCopy {
    /// Its copy into GPU memory is queued: a stream waits on this mark.
    Queued(CopyMark),
    /// Nothing for a stream to wait on: the layer is in memory or failed
    /// ([`TierHandle::wait_layer`] says which), or the load is not a staged
    /// GPU load.
    Settled,
}

struct Entry {
    kind: JobKind,
    phase: Phase,
    keys: Vec<Key>,
    layers: Range<u32>,
    /// Next layer (absolute) not yet reported.
    layers_done: u32,
    layer_errors: Vec<Option<Failure>>,
    /// Per layer of a staged GPU load: the mark after its copy, once queued.
    layers_queued: Vec<Option<CopyMark>>,
}

#[derive(Default)]
struct Jobs {
    entries: HashMap<JobId, Entry>,
    finished_order: VecDeque<JobId>,
    /// An engine failure that stops jobs from finishing: waits on unfinished
    /// jobs return it instead of blocking forever.
    fatal: Option<Failure>,
    /// Set once the I/O thread has exited.
    stopped: bool,
    subscribers: EventSubscribers,
}

impl Jobs {
    /// A job the scheduler accepted as `id`.
    fn add(&mut self, id: JobId, e: Entry) {
        self.entries.insert(id, e);
    }

    /// Record a result.
    fn finish(&mut self, id: JobId, mut r: JobResult, events: &mut Vec<Event>) {
        let Some(e) = self.entries.get_mut(&id) else {
            return;
        };
        if matches!(e.phase, Phase::Finished(_)) {
            return;
        }
        r.job = id;
        events.push(Event::Finished {
            job: id,
            kind: e.kind,
            ok: r.all_ok(),
        });
        e.phase = Phase::Finished(r);
        self.finished_order.push_back(id);
    }

    fn take(&mut self, id: JobId) -> Option<JobResult> {
        if !matches!(self.entries.get(&id)?.phase, Phase::Finished(_)) {
            return None;
        }
        let e = self.entries.remove(&id)?;
        self.finished_order.retain(|&j| j != id);
        match e.phase {
            Phase::Finished(r) => Some(r),
            _ => None,
        }
    }

    fn broadcast(&mut self, events: &[Event]) {
        let entries = &self.entries;
        self.subscribers
            .broadcast(events, &|job: JobId| entries.contains_key(&job));
    }
}

/// A store that never reached the tier: every key failed with `why`.
fn failed_result(keys: Vec<Key>, why: &Failure) -> JobResult {
    JobResult {
        job: 0,
        kind: JobKind::Store,
        outcomes: vec![KeyOutcome::Failed(why.clone()); keys.len()],
        keys,
        evicted: Vec::new(),
    }
}

const RUNNING: u8 = 0;
/// `close`: issue the backlog, finish every job, then stop.
const CLOSE_FLUSH: u8 = 1;
/// Last clone dropped: fail the backlog, finish I/O in flight, then stop.
const CLOSE_DROP: u8 = 2;

struct Shared {
    /// The scheduler and the tier inside it. `None` once the I/O thread has
    /// dropped them. Held for a poll turn (reaping, hashing, planning) or a
    /// submit's planning, never while anyone sleeps.
    core: Mutex<Option<Scheduler>>,
    /// The tier's pool index, under its own lock: lookups, pins and unpins
    /// take only this one, never `core`.
    index: SharedIndex,
    /// False once the I/O thread has dropped the tier: lookups answer 0.
    index_open: AtomicBool,
    jobs: Mutex<Jobs>,
    cond: Condvar,
    /// Wakes the I/O thread: new work, or close.
    doorbell: EventFd,
    closing: AtomicU8,
    geometry: KvGeometry,
    mem_blocks: u32,
    /// To take store checksums on the caller's thread.
    crc_table: Option<Arc<P2pTable>>,
    /// Keeps a kvtier-allocated KV cache alive for those checksums (and
    /// describes it: `TierApi::memory`).
    host_cache: Option<Arc<HostKvCache>>,
    cfg: HandleConfig,
    engine: String,
    engine_reason: String,
    /// The pool's key namespace and the model it recorded at create.
    namespace: String,
    model_name: String,
    io_thread: ThreadId,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // A panic on another thread must not turn every later call into one:
    // the data behind these locks stays consistent between statements.
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl Shared {
    fn ring(&self) {
        let _ = self.doorbell.write(1);
    }

    fn closed_error() -> Error {
        Error::Closed("the tier handle is closed; open a new one".into())
    }
}

/// Stops the I/O thread when the last clone of a handle goes away.
struct Owner {
    shared: Arc<Shared>,
    thread: Mutex<Option<JoinHandle<Result<()>>>>,
    /// What the first `close` returned, when it failed: later ones say it too.
    close_error: Mutex<Option<Failure>>,
}

impl Drop for Owner {
    fn drop(&mut self) {
        let Some(t) = lock(&self.thread).take() else {
            return;
        };
        let _ = self.shared.closing.compare_exchange(
            RUNNING,
            CLOSE_DROP,
            Ordering::SeqCst,
            Ordering::SeqCst,
        );
        self.shared.ring();
        // Joining from the I/O thread itself would deadlock; it cannot hold
        // a handle today, but a detached thread still finishes on its own.
        if std::thread::current().id() != self.shared.io_thread {
            let _ = t.join();
        }
    }
}

/// The thread-safe front door of a tier; see the module docs for the
/// threading and memory contracts. Open one with [`TierBuilder`].
#[derive(Clone)]
pub struct TierHandle {
    shared: Arc<Shared>,
    owner: Arc<Owner>,
}

impl std::fmt::Debug for TierHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TierHandle")
            .field("engine", &self.shared.engine)
            .field("geometry", &self.shared.geometry)
            .finish()
    }
}

impl TierHandle {
    /// A [`TierBuilder`] to open one.
    pub fn builder() -> TierBuilder {
        TierBuilder::default()
    }

    /// The engine serving the pool (`uring`, `nvme`, `gpu`, ...).
    pub fn engine(&self) -> &str {
        &self.shared.engine
    }

    /// The pool's key namespace (model, dtype, layout, TP rank).
    pub fn namespace(&self) -> &str {
        &self.shared.namespace
    }

    /// The model name the pool recorded at its create.
    pub fn model_name(&self) -> &str {
        &self.shared.model_name
    }

    /// Why that engine (the `auto` verdict, or "asked for").
    pub fn engine_reason(&self) -> &str {
        &self.shared.engine_reason
    }

    /// The pool's KV geometry.
    pub fn geometry(&self) -> &KvGeometry {
        &self.shared.geometry
    }

    /// Most blocks its write backlog holds (`HandleConfig`).
    pub(crate) fn backlog_limit_blocks(&self) -> u64 {
        self.shared.cfg.backlog_limit_blocks
    }

    /// Blocks in the registered KV memory.
    pub fn memory_blocks(&self) -> u32 {
        self.shared.mem_blocks
    }

    /// How many leading keys the pool holds. No side effects. 0 once closed.
    /// Takes only the index's lock: never waits for the I/O thread.
    pub fn lookup_prefix(&self, keys: &[Key]) -> usize {
        if !self.shared.index_open.load(Ordering::Acquire) {
            return 0;
        }
        self.shared.index.lock().lookup_prefix(keys)
    }

    /// Like `lookup_prefix`, and pins the keys it counts so that no store
    /// evicts them before the load that needs them. Undo with `unpin`.
    /// Takes only the index's lock: never waits for the I/O thread.
    pub fn lookup_and_pin(&self, keys: &[Key]) -> usize {
        if !self.shared.index_open.load(Ordering::Acquire) {
            return 0;
        }
        self.shared.index.lock().lookup_and_pin(keys)
    }

    /// Drop one pin per key. Never fails: unknown or unpinned keys (and a
    /// closed handle) are ignored.
    pub fn unpin(&self, keys: &[Key]) {
        if !self.shared.index_open.load(Ordering::Acquire) {
            return;
        }
        let mut ix = self.shared.index.lock();
        for k in keys {
            ix.unpin(k);
        }
    }

    /// Like `lookup_and_pin`, and names each entry pinned by its
    /// generation, for `unpin_entries`: a caller sharing the pool with
    /// others (the service's clients) never drops a pin on a later entry
    /// of the same key.
    pub(crate) fn lookup_and_pin_entries(&self, keys: &[Key]) -> Vec<u64> {
        if !self.shared.index_open.load(Ordering::Acquire) {
            return Vec::new();
        }
        self.shared.index.lock().lookup_and_pin_entries(keys)
    }

    /// Drop `n` pins per `(key, generation, n)` where that entry is still
    /// the key's (see `lookup_and_pin_entries`): counted, so that a client
    /// holding a key pinned millions of times costs one step to let go.
    pub(crate) fn unpin_entries(&self, pins: &[(Key, u64, u32)]) {
        if !self.shared.index_open.load(Ordering::Acquire) {
            return;
        }
        let mut ix = self.shared.index.lock();
        for (k, g, n) in pins {
            ix.unpin_entry(k, *g, *n);
        }
    }

    /// Take `keys` out of the pool now, for an engine that decides on its
    /// own what the tier holds (LMCache's L2 delete): a removed key is never
    /// served again, a load already reading it finishes, and its slot is
    /// reused once that load ends. Keys not held are skipped; returns how
    /// many were removed. Not durable by itself: a removed block's header is
    /// invalidated when its slot is next stored into, so a pool reopened
    /// before that may hold the block again (its bytes still verified).
    pub fn remove(&self, keys: &[Key]) -> Result<usize> {
        let mut core = lock(&self.shared.core);
        let s = core.as_mut().ok_or_else(Shared::closed_error)?;
        Ok(s.tier_mut().remove(keys))
    }

    /// New pages now back `ranges` of this handle's KV memory: see
    /// `Tier::remap_memory`. `Ok(false)`: try
    /// again once the I/O in flight has drained.
    pub(crate) fn remap_memory(&self, ranges: &[crate::p2p::MemRegion]) -> Result<bool> {
        let mut core = lock(&self.shared.core);
        let s = core.as_mut().ok_or_else(Shared::closed_error)?;
        s.tier_mut().remap_memory(ranges)
    }

    /// Whether the pool holds `key` (false once closed).
    pub fn contains(&self, key: &Key) -> bool {
        self.shared.index_open.load(Ordering::Acquire)
            && self.shared.index.lock().get(key).is_some()
    }

    /// What the handle holds now.
    pub fn usage(&self) -> Result<HandleUsage> {
        let core = lock(&self.shared.core);
        let s = core.as_ref().ok_or_else(Shared::closed_error)?;
        Ok(HandleUsage {
            tier: s.tier().usage(),
            deferred_stores: s.backlog_len(),
            deferred_blocks: s.backlog_blocks(),
        })
    }

    /// A new stream of this handle's events (see [`Completions`]).
    pub fn completions(&self) -> Result<Completions> {
        lock(&self.shared.jobs).subscribers.subscribe()
    }

    fn check_blocks(&self, keys: &[Key], mem_blocks: &[u32]) -> Result<()> {
        tier::check_job_blocks(
            keys,
            mem_blocks,
            self.shared.mem_blocks,
            "the registered KV memory",
        )
    }

    fn check_open(&self, jobs: &Jobs) -> Result<()> {
        if jobs.stopped || self.shared.closing.load(Ordering::SeqCst) != RUNNING {
            return Err(Shared::closed_error());
        }
        if let Some(f) = &jobs.fatal {
            return Err(Error::Failed(f.context("the tier's engine failed")));
        }
        Ok(())
    }

    /// A new job needs room in the job table: results nobody collects
    /// would otherwise grow it (about a kilobyte a job) without bound.
    fn check_job_room(jobs: &Jobs) -> Result<()> {
        if jobs.entries.len() >= MAX_JOBS {
            let held = jobs
                .entries
                .values()
                .filter(|e| matches!(e.phase, Phase::Deferred))
                .count();
            return Err(Error::Backpressure(format!(
                "{} jobs are running, held or finished with their results not collected (at most {MAX_JOBS}; {held} are stores the policy holds in the write backlog: flush_stores issues them); collect results with wait, try_result or get_finished, then submit again",
                jobs.entries.len()
            )));
        }
        Ok(())
    }

    /// Which unfinished job uses memory block `block`: `Load` while a load
    /// writes it (its bytes are not yet whole, and a write would fail the
    /// load's check), `Store` while a store reads it (a write would change
    /// what it stores), `None` when it is free.
    pub fn memory_block_use(&self, block: u32) -> Option<JobKind> {
        let core = lock(&self.shared.core);
        core.as_ref().and_then(|s| s.memory_block_use(block))
    }

    /// Start loading `keys` (all in the pool: count them with
    /// `lookup_prefix` or `lookup_and_pin`) into `mem_blocks` for `layers`.
    /// Returns at once; layers complete in layer order (`wait_layer`,
    /// [`Event::Layer`]). The keys stay pinned until the load finishes.
    pub fn submit_load(
        &self,
        keys: &[Key],
        mem_blocks: &[u32],
        layers: Range<u32>,
    ) -> Result<JobId> {
        self.check_blocks(keys, mem_blocks)?;
        let id = {
            let mut core = lock(&self.shared.core);
            let s = core.as_mut().ok_or_else(Shared::closed_error)?;
            let mut jobs = lock(&self.shared.jobs);
            self.check_open(&jobs)?;
            Self::check_job_room(&jobs)?;
            // The scheduler refuses a load into a block a deferred store
            // reads, the path one into a block a job in flight uses.
            let id = s.submit_load(keys, mem_blocks, layers.clone())?;
            jobs.add(
                id,
                Entry {
                    kind: JobKind::Load,
                    phase: Phase::Running,
                    keys: keys.to_vec(),
                    layers_done: layers.start,
                    layer_errors: vec![None; layers.len()],
                    layers_queued: vec![None; layers.len()],
                    layers,
                },
            );
            id
        };
        self.shared.ring();
        Ok(id)
    }

    /// Accept a store of `keys` from `mem_blocks` (all layers). Returns at
    /// once; the store is issued when no load is in flight (per the policy)
    /// and is durable when its outcome says `Done`. Keys already stored cost
    /// no I/O. A full write backlog refuses with `ErrorKind::Backpressure`.
    pub fn submit_store(&self, keys: &[Key], mem_blocks: &[u32]) -> Result<JobId> {
        self.store_job(keys, mem_blocks, None)
    }

    /// As [`Self::submit_store`], with each key's per-layer crc32c taken by
    /// the caller (`crcs[i]` for `keys[i]`, one per layer), written into
    /// the headers instead of hashing the blocks here: the node service
    /// stores so what a client gathered from its GPU memory with checksums.
    /// A key whose checksums do not match its bytes is stored, and fails
    /// verification when loaded (`KeyOutcome::Corrupt`, dropped, never
    /// served). The staged path takes its own checksums and ignores these.
    pub fn submit_store_with_crcs(
        &self,
        keys: &[Key],
        mem_blocks: &[u32],
        crcs: &[Vec<u32>],
    ) -> Result<JobId> {
        let layers = self.shared.geometry.layers as usize;
        if crcs.len() != keys.len() {
            return Err(Error::invalid(format!(
                "{} keys but {} checksum lists: give one list of per-layer crc32c per key",
                keys.len(),
                crcs.len()
            )));
        }
        if let Some((i, c)) = crcs.iter().enumerate().find(|(_, c)| c.len() != layers) {
            return Err(Error::invalid(format!(
                "key {} has {} layer checksums; the pool's model has {layers} layers",
                keys[i],
                c.len()
            )));
        }
        self.store_job(keys, mem_blocks, Some(crcs))
    }

    fn store_job(
        &self,
        keys: &[Key],
        mem_blocks: &[u32],
        given: Option<&[Vec<u32>]>,
    ) -> Result<JobId> {
        self.check_blocks(keys, mem_blocks)?;
        // Refused before any checksum is taken: such a store would never be
        // accepted, and a caller that retries on backpressure would spin.
        crate::sched::check_store_fits(keys.len(), self.shared.cfg.backlog_limit_blocks)?;
        // Checksums of the blocks not stored yet, here and without locks, so
        // neither the I/O thread nor lookups wait for the hashing.
        let crcs = match &self.shared.crc_table {
            Some(table) => {
                if !self.shared.index_open.load(Ordering::Acquire) {
                    return Err(Shared::closed_error());
                }
                let present: Vec<bool> = {
                    let ix = self.shared.index.lock();
                    keys.iter().map(|k| ix.get(k).is_some()).collect()
                };
                let layers = self.shared.geometry.layers;
                Some(
                    mem_blocks
                        .iter()
                        .zip(present)
                        .enumerate()
                        .map(|(i, (&b, p))| match (p, given) {
                            (true, _) => None,
                            (false, Some(c)) => Some(c[i].clone()),
                            (false, None) => Tier::layer_crcs(table, b, layers),
                        })
                        .collect(),
                )
            }
            None => None,
        };
        let id = {
            let mut core = lock(&self.shared.core);
            let s = core.as_mut().ok_or_else(Shared::closed_error)?;
            let mut jobs = lock(&self.shared.jobs);
            self.check_open(&jobs)?;
            Self::check_job_room(&jobs)?;
            let id = s.enqueue_store(keys, mem_blocks, crcs)?;
            jobs.add(
                id,
                Entry {
                    kind: JobKind::Store,
                    phase: Phase::Deferred,
                    keys: keys.to_vec(),
                    layers: 0..0,
                    layers_done: 0,
                    layer_errors: Vec::new(),
                    layers_queued: Vec::new(),
                },
            );
            id
        };
        self.shared.ring();
        Ok(id)
    }

    /// Issue every store in the backlog now, whatever the policy (the end
    /// of a prefill under `Policy::Sync`, before a planned shutdown).
    pub fn flush_stores(&self) -> Result<()> {
        let released = {
            let mut core = lock(&self.shared.core);
            let s = core.as_mut().ok_or_else(Shared::closed_error)?;
            s.flush_ready()
        };
        let mut events = Vec::new();
        {
            let mut jobs = lock(&self.shared.jobs);
            apply_released(&mut jobs, released, &mut events);
            jobs.broadcast(&events);
        }
        self.shared.cond.notify_all();
        self.shared.ring();
        Ok(())
    }

    /// Block until `job` finishes and return (remove) its result.
    pub fn wait(&self, job: JobId) -> Result<JobResult> {
        Ok(self.wait_until(job, None)?.expect("no deadline"))
    }

    /// Like `wait`, but gives up after `timeout`: `None` if `job` has not
    /// finished by then (its result stays to be collected). Callers that
    /// must stay responsive (a Python thread that handles Ctrl-C) wait in
    /// slices with this.
    pub fn wait_timeout(&self, job: JobId, timeout: Duration) -> Result<Option<JobResult>> {
        self.wait_until(job, Some(Instant::now() + timeout))
    }

    fn wait_until(&self, job: JobId, deadline: Option<Instant>) -> Result<Option<JobResult>> {
        let mut jobs = lock(&self.shared.jobs);
        loop {
            if !jobs.entries.contains_key(&job) {
                return Err(Error::invalid(format!(
                    "job {job} is unknown or its result was already taken (by wait, try_result or get_finished: each result is handed out once, to one caller)"
                )));
            }
            if let Some(r) = jobs.take(job) {
                return Ok(Some(r));
            }
            let (j, timed_out) = self.wait_for_change(jobs, job, deadline)?;
            jobs = j;
            if timed_out {
                return Ok(jobs.take(job));
            }
        }
    }

    /// Sleeps until the job table changes (or `deadline` passes: then the
    /// flag is true), unless the handle can no longer finish `job` (a fatal
    /// engine error, or closed): then that error.
    fn wait_for_change<'a>(
        &'a self,
        jobs: MutexGuard<'a, Jobs>,
        job: JobId,
        deadline: Option<Instant>,
    ) -> Result<(MutexGuard<'a, Jobs>, bool)> {
        if let Some(f) = &jobs.fatal {
            return Err(Error::Failed(f.context(format_args!("job {job}"))));
        }
        if jobs.stopped {
            return Err(Shared::closed_error());
        }
        Ok(match deadline {
            None => (
                self.shared
                    .cond
                    .wait(jobs)
                    .unwrap_or_else(|e| e.into_inner()),
                false,
            ),
            Some(d) => {
                let left = d.saturating_duration_since(Instant::now());
                if left.is_zero() {
                    return Ok((jobs, true));
                }
                let (g, t) = self
                    .shared
                    .cond
                    .wait_timeout(jobs, left)
                    .unwrap_or_else(|e| e.into_inner());
                (g, t.timed_out())
            }
        })
    }

    /// The result of `job` if it has finished (then removed), else None.
    pub fn try_result(&self, job: JobId) -> Result<Option<JobResult>> {
        let mut jobs = lock(&self.shared.jobs);
        if !jobs.entries.contains_key(&job) {
            return Err(Error::invalid(format!(
                "job {job} is unknown or its result was already taken (by wait, try_result or get_finished: each result is handed out once, to one caller)"
            )));
        }
        Ok(jobs.take(job))
    }

    /// Block until layer `layer` of load `job` is in memory. An error (with
    /// the failed I/O in its [`Failure`]) means the layer must not be used.
    pub fn wait_layer(&self, job: JobId, layer: u32) -> Result<()> {
        self.wait_layer_until(job, layer, None).map(|_| ())
    }

    /// Like `wait_layer`, but gives up after `timeout`: false if the layer
    /// is not in memory by then.
    pub fn wait_layer_timeout(&self, job: JobId, layer: u32, timeout: Duration) -> Result<bool> {
        self.wait_layer_until(job, layer, Some(Instant::now() + timeout))
    }

    fn wait_layer_until(&self, job: JobId, layer: u32, deadline: Option<Instant>) -> Result<bool> {
        let done = self.wait_on_layer(job, layer, deadline, |e| {
            if e.layers_done > layer {
                return Some(match &e.layer_errors[(layer - e.layers.start) as usize] {
                    Some(f) => Err(Error::Failed(
                        f.context(format_args!("layer {layer} of job {job} failed")),
                    )),
                    None => Ok(()),
                });
            }
            let Phase::Finished(r) = &e.phase else {
                return None;
            };
            // Finished without this layer's event: only when it failed.
            Some(match r.failures().next() {
                Some((k, f)) => Err(Error::Failed(
                    f.context(format_args!("job {job} failed to load key {k}")),
                )),
                None => Ok(()),
            })
        })?;
        Ok(done.is_some())
    }

    /// Blocks until `settle`, looking at load `job`'s entry (for a layer it
    /// has) under the job lock after every change, has an answer; `None`
    /// once `deadline` has passed without one.
    fn wait_on_layer<T>(
        &self,
        job: JobId,
        layer: u32,
        deadline: Option<Instant>,
        settle: impl Fn(&Entry) -> Option<Result<T>>,
    ) -> Result<Option<T>> {
        let mut jobs = lock(&self.shared.jobs);
        let mut expired = false;
        loop {
            let Some(e) = jobs.entries.get(&job) else {
                return Err(Error::invalid(format!(
                    "job {job} is unknown or its result was already taken (by wait, try_result or get_finished: each result is handed out once, to one caller)"
                )));
            };
            if e.kind != JobKind::Load || !e.layers.contains(&layer) {
                return Err(Error::invalid(format!(
                    "job {job} is not a load of layer {layer}"
                )));
            }
            if let Some(r) = settle(e) {
                return r.map(Some);
            }
            if expired {
                return Ok(None);
            }
            // After a timeout, one more look: the change may have come with it.
            (jobs, expired) = self.wait_for_change(jobs, job, deadline)?;
        }
    }

    /// For a load into GPU KV memory on the staged path: block until layer
    /// `layer`'s bytes are read from the pool, verified, and their copy into
    /// GPU memory is queued on kvtier's copy stream; then a compute stream
    /// waits for that copy on the GPU with the returned mark
    /// ([`CopyMark::queue_on_raw_stream`]), so the layer's attention starts
    /// as soon as the copy is done while the host goes on launching.
    /// [`LayerCopy::Settled`] when there is nothing for a stream to wait on:
    /// the layer is already in memory or failed ([`Self::wait_layer`] says
    /// which, at once), or the load is not a staged GPU load.
    ///
    /// Why the host waits for the copy to be queued rather than queuing a
    /// wait on [`Self::load_counter`] at once: a stream memory wait is a
    /// dependency CUDA cannot see, and its scheduler may then order
    /// kvtier's copy behind the waiting stream (`cuStreamWaitValue32`'s
    /// documented deadlock; a prefill on torch's default stream hung so on
    /// an H200). Waiting on an event recorded after the copy cannot.
    pub fn wait_layer_queued(&self, job: JobId, layer: u32) -> Result<LayerCopy> {
        self.wait_layer_queued_until(job, layer, None)
            .map(|c| c.unwrap_or(LayerCopy::Settled))
    }

    /// Like [`Self::wait_layer_queued`], but gives up after `timeout`:
    /// `None` if the layer's copy is not queued by then.
    pub fn wait_layer_queued_timeout(
        &self,
        job: JobId,
        layer: u32,
        timeout: Duration,
    ) -> Result<Option<LayerCopy>> {
        self.wait_layer_queued_until(job, layer, Some(Instant::now() + timeout))
    }

    fn wait_layer_queued_until(
        &self,
        job: JobId,
        layer: u32,
        deadline: Option<Instant>,
    ) -> Result<Option<LayerCopy>> {
        self.wait_on_layer(job, layer, deadline, |e| {
            if e.layers_done > layer || matches!(e.phase, Phase::Finished(_)) {
                return Some(Ok(LayerCopy::Settled));
            }
            e.layers_queued[(layer - e.layers.start) as usize]
                .clone()
                .map(|m| Ok(LayerCopy::Queued(m)))
        })
    }

    /// For a load into GPU KV memory on the staged path: the load's own
    /// completion counter, which reaches `value_for(l)` once layer `l` is in
    /// HBM. A compute stream queues `cuStreamWaitValue32` on it (see
    /// `crate::staged::LayerWait`) right after the submit, so each
    /// layer's attention starts when its copy is done, with no host call in
    /// between. `None` for host memory or a load that has finished; with
    /// the CPU double, a host word no stream can wait on, written as the
    /// GPU's would be.
    pub fn load_counter(&self, job: JobId) -> Result<Option<LoadCounter>> {
        let core = lock(&self.shared.core);
        let s = core.as_ref().ok_or_else(Shared::closed_error)?;
        Ok(s.load_counter(job))
    }

    /// Results of every finished job not yet collected, in finishing order.
    pub fn get_finished(&self) -> Vec<JobResult> {
        let mut jobs = lock(&self.shared.jobs);
        // Every finished job leaves the order at once (one pass, not a
        // retain per job: thousands may wait here).
        let ids = std::mem::take(&mut jobs.finished_order);
        ids.into_iter()
            .filter_map(|id| match jobs.entries.remove(&id)?.phase {
                Phase::Finished(r) => Some(r),
                _ => None,
            })
            .collect()
    }

    /// Issue the write backlog, wait for every job, stop the I/O thread and
    /// drop the tier on it. Returns the first engine failure, if any. Later
    /// calls on any clone fail with `ErrorKind::Closed` (lookups return 0,
    /// `unpin` does nothing). Results not yet collected stay collectable.
    pub fn close(&self) -> Result<()> {
        // Held until the I/O thread is joined: a `close` on another clone at
        // the same time waits here for every job, rather than returning Ok
        // while stores are still being written (its caller may take that as
        // "all durable" and exit).
        let mut thread = lock(&self.owner.thread);
        let Some(t) = thread.take() else {
            return match lock(&self.owner.close_error).as_ref() {
                Some(f) => Err(Error::Failed(f.context("closing the tier handle"))),
                None => Ok(()),
            };
        };
        let _ = self.shared.closing.compare_exchange(
            RUNNING,
            CLOSE_FLUSH,
            Ordering::SeqCst,
            Ordering::SeqCst,
        );
        self.shared.ring();
        let r = match t.join() {
            Ok(r) => r,
            Err(_) => Err(Error::Closed(
                "the tier's I/O thread panicked; its jobs did not finish".into(),
            )),
        };
        if let Err(e) = &r {
            *lock(&self.owner.close_error) = Some(Failure::from(e));
        }
        drop(thread);
        r
    }
}

/// Mark released stores as running, or failed when their path refused them.
fn apply_released(jobs: &mut Jobs, released: Vec<(JobId, Result<JobId>)>, events: &mut Vec<Event>) {
    for (id, r) in released {
        match r {
            Ok(_) => {
                // Only a store still marked deferred: `flush_stores` applies
                // its release after the I/O thread may have seen it finish.
                if let Some(e) = jobs.entries.get_mut(&id) {
                    if matches!(e.phase, Phase::Deferred) {
                        e.phase = Phase::Running;
                    }
                }
            }
            Err(err) => {
                let f = Failure::from(err);
                // The tier refused it at issue time (every block pinned, say):
                // nothing was written; the keys are reported as not stored.
                let keys = jobs
                    .entries
                    .get(&id)
                    .map(|e| e.keys.clone())
                    .unwrap_or_default();
                jobs.finish(id, failed_result(keys, &f), events);
            }
        }
    }
}

/// Everything the I/O thread learned in one turn, applied under the job lock.
struct Turn {
    released: Vec<(JobId, Result<JobId>)>,
    layers_queued: Vec<tier::LayerQueued>,
    layer_events: Vec<tier::LayerDone>,
    finished: Vec<JobResult>,
    failed_backlog: Vec<u64>,
    error: Option<Error>,
    /// Look again before sleeping: this turn moved something, and what it
    /// started may already be complete.
    again: bool,
}

fn io_main(shared: Arc<Shared>) -> Result<()> {
    let mut first_error: Option<Error> = None;
    loop {
        // Consume wake-ups first: one that arrives after this is seen next turn.
        let _ = shared.doorbell.read();
        let closing = shared.closing.load(Ordering::SeqCst);
        let (turn, in_flight, backlog, fds) = {
            let mut core = lock(&shared.core);
            let s = core.as_mut().expect("only this thread takes the scheduler");
            let mut turn = Turn {
                released: Vec::new(),
                layers_queued: Vec::new(),
                layer_events: Vec::new(),
                finished: Vec::new(),
                failed_backlog: Vec::new(),
                error: None,
                again: false,
            };
            match closing {
                CLOSE_FLUSH => turn.released = s.flush_ready(),
                CLOSE_DROP => turn.failed_backlog = s.take_backlog(),
                _ => turn.released = s.release_ready(shared.cfg.stores_per_turn),
            }
            let mut r = s.poll();
            if r.is_ok() && closing == RUNNING {
                // Loads that just finished may let deferred stores go now.
                let more = s.release_ready(shared.cfg.stores_per_turn);
                if !more.is_empty() {
                    turn.released.extend(more);
                    r = s.poll();
                }
            }
            turn.error = r.err();
            // Layer events before results: collecting a result drops its events.
            turn.layers_queued = s.layers_queued();
            turn.layer_events = s.layer_events();
            turn.finished = s.get_finished();
            turn.again = s.completions_pending()
                || !turn.released.is_empty()
                || !turn.layers_queued.is_empty()
                || !turn.layer_events.is_empty()
                || !turn.finished.is_empty();
            (
                turn,
                s.jobs_in_flight(),
                s.backlog_len(),
                s.tier().engine().completion_fds(),
            )
        };
        let fatal_now = turn.error.is_some();
        let again = turn.again;
        apply_turn(&shared, turn, &mut first_error);
        let done = closing != RUNNING && in_flight == 0 && backlog == 0;
        // A broken engine will not finish what it holds: stop rather than spin.
        if done || (closing != RUNNING && fatal_now) {
            break;
        }
        if !again || fatal_now {
            sleep(&shared, in_flight > 0, &fds, fatal_now);
        }
    }
    // Drop the tier here, on its own thread (its engine may be bound to it).
    let sched = lock(&shared.core).take();
    shared.index_open.store(false, Ordering::Release);
    if let Some(mut s) = sched {
        if let Err(e) = s.drain() {
            first_error.get_or_insert(e);
        }
        let mut events = Vec::new();
        let finished = s.get_finished();
        drop(s);
        let mut jobs = lock(&shared.jobs);
        for r in finished {
            jobs.finish(r.job, r, &mut events);
        }
        jobs.broadcast(&events);
    }
    {
        let mut jobs = lock(&shared.jobs);
        jobs.stopped = true;
        // Whatever did not finish never will: say so instead of blocking.
        let open: Vec<JobId> = jobs
            .entries
            .iter()
            .filter(|(_, e)| !matches!(e.phase, Phase::Finished(_)))
            .map(|(&id, _)| id)
            .collect();
        let why = Failure::new(
            ErrorKind::Closed,
            "the handle was closed before this job finished",
        );
        let mut events = Vec::new();
        for id in open {
            let keys = jobs.entries[&id].keys.clone();
            let kind = jobs.entries[&id].kind;
            let mut r = failed_result(keys, &why);
            r.kind = kind;
            jobs.finish(id, r, &mut events);
        }
        jobs.broadcast(&events);
    }
    shared.cond.notify_all();
    match first_error {
        Some(e) => Err(e),
        None => Ok(()),
    }
}

fn apply_turn(shared: &Shared, turn: Turn, first_error: &mut Option<Error>) {
    let mut events = Vec::new();
    let mut jobs = lock(&shared.jobs);
    apply_released(&mut jobs, turn.released, &mut events);
    for id in turn.failed_backlog {
        if let Some(e) = jobs.entries.get(&id) {
            let keys = e.keys.clone();
            let why = Failure::new(
                ErrorKind::Closed,
                "the tier handle was dropped before this store was issued; nothing of it is stored",
            );
            jobs.finish(id, failed_result(keys, &why), &mut events);
        }
    }
    for q in turn.layers_queued {
        // As layer events below: only a running job's are news.
        let Some(e) = jobs.entries.get_mut(&q.job) else {
            continue;
        };
        if !matches!(e.phase, Phase::Running) {
            continue;
        }
        if let Some(slot) = q
            .layer
            .checked_sub(e.layers.start)
            .and_then(|li| e.layers_queued.get_mut(li as usize))
        {
            *slot = Some(q.mark);
        }
    }
    for ev in turn.layer_events {
        // A running job's: a layer event of a job no longer here (its
        // result collected) or not yet running says nothing to anyone.
        let Some(e) = jobs.entries.get_mut(&ev.job) else {
            continue;
        };
        if !matches!(e.phase, Phase::Running) {
            continue;
        }
        let li = (ev.layer - e.layers.start) as usize;
        if let Some(slot) = e.layer_errors.get_mut(li) {
            *slot = ev.error.clone();
        }
        e.layers_done = e.layers_done.max(ev.layer + 1);
        events.push(Event::Layer {
            job: ev.job,
            layer: ev.layer,
            error: ev.error,
        });
    }
    for r in turn.finished {
        jobs.finish(r.job, r, &mut events);
    }
    if let Some(e) = turn.error {
        let f = Failure::from(&e);
        jobs.fatal.get_or_insert(f);
        first_error.get_or_insert(e);
    }
    jobs.broadcast(&events);
    drop(jobs);
    shared.cond.notify_all();
}

/// Sleep until the doorbell rings or (with I/O in flight) the engine has a
/// completion. Engines without completion fds are polled: yield instead.
fn sleep(shared: &Shared, busy: bool, fds: &[RawFd], failing: bool) {
    if failing {
        std::thread::sleep(Duration::from_millis(1));
        return;
    }
    if busy && fds.is_empty() {
        // CPU- or GPU-polled queues: a completion shows only by looking.
        std::thread::yield_now();
        return;
    }
    let mut pfds = vec![PollFd::new(shared.doorbell.as_fd(), PollFlags::POLLIN)];
    if busy {
        for &fd in fds {
            // SAFETY: the engine owns these fds and outlives this call: the
            // tier is dropped only by this thread, after the loop.
            let b = unsafe { BorrowedFd::borrow_raw(fd) };
            pfds.push(PollFd::new(b, PollFlags::POLLIN));
        }
    }
    // The timeout only bounds the cost of a missed wake-up; none is expected.
    let _ = nix::poll::poll(&mut pfds, PollTimeout::from(100u16));
}
