//! The tier API that serving engines call.
//!
//! Shaped so thin adapters fit LMCache's L2 adapter and vLLM's offloading
//! worker: `lookup_prefix` (no side effects), `lookup_and_pin` / `unpin`,
//! `submit_load(keys, memory blocks, layers)` with a completion per layer,
//! `submit_store(keys, memory blocks)`, and `poll` / `wait` / `get_finished`
//! with a per-key outcome.
//!
//! Loads: the keys' slots are sorted and cut into runs of consecutive slots of
//! one extent group; per layer each run is one contiguous device extent (two
//! when the run is not a whole group), so a layer costs O(groups) I/Os, each
//! one IOCTX whose segments are P2P-table indices. Each layer is its own IOCB,
//! and layers complete to the caller strictly in order.
//!
//! Stores are crash-consistent: (1) headers of reused slots that still
//! describe an evicted block are zeroed, then flushed; (2) data is written,
//! then flushed; (3) headers are written, then flushed; (4) only then do the
//! keys enter the index and the job report success. A crash at any point
//! leaves either the old state or the new one visible, never a header over
//! data it does not describe.
//!
//! Loads into host memory verify every layer against the crc32c its header
//! recorded before the layer is announced: a block whose bytes differ from what
//! was stored (a flipped bit, a write the device acknowledged but lost) fails
//! with `KeyOutcome::Corrupt` and is dropped from the pool, never returned.
//! A write that fails with an I/O error retires the slots it covered, so one
//! bad region costs its capacity, not the cache.

use crate::engine::uring::{UringConfig, UringDevice, UringEngine};
use crate::engine::{EngineStats, IoEngine};
use crate::error::{Error, ErrorKind, Failure, IoCause, IoFailure, Result};
use crate::memory::{DmaBuffer, HostKvCache, KvMemory, MemoryKind};
use crate::p2p::P2pTable;
use crate::plan::{self, PlannedIo};
use crate::pool::layout::SLOT_HEADER_BYTES;
use crate::pool::{Key, Pool};
use crate::ring::abi::*;
use crate::ring::IocbId;
use crate::submitter::Submitter;
use std::collections::{HashMap, HashSet, VecDeque};
use std::ops::Range;
use std::sync::Arc;

#[derive(Clone, Debug, serde::Serialize, serde::Deserialize)]
pub struct TierConfig {
    pub uring: UringConfig,
    /// IOCBs in the gio_uring ring.
    pub ring_depth: u32,
    /// Largest device I/O one IOCTX may cover after coalescing.
    pub max_io_bytes: u64,
    /// Block headers that can be staged at once: the most new blocks the
    /// stores in flight may hold together.
    pub header_staging: u32,
    /// How far a load may run ahead of its oldest incomplete layer, in
    /// bytes: later layers wait so the next layer the compute needs gets the
    /// device's bandwidth, not a share of it (two layers are always allowed
    /// in flight so the device never idles between layers).
    pub load_lookahead_bytes: u64,
    /// Verify the checksum of every block loaded into host memory (on by
    /// default; off only to measure what it costs).
    #[serde(default = "verify_loads_default")]
    pub verify_loads: bool,
}

fn verify_loads_default() -> bool {
    true
}

impl Default for TierConfig {
    fn default() -> Self {
        TierConfig {
            uring: UringConfig::default(),
            ring_depth: 64,
            max_io_bytes: 4 << 20,
            header_staging: 8192,
            load_lookahead_bytes: 64 << 20,
            verify_loads: true,
        }
    }
}

pub type JobId = u64;

#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
pub enum JobKind {
    Load,
    Store,
}

/// "Layer `layer` of load `job` is in memory", or failed to load.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LayerDone {
    pub job: JobId,
    pub layer: u32,
    /// Why some of the layer's reads failed; its memory must not be used.
    pub error: Option<Failure>,
}

/// The outcome of one key of a job.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum KeyOutcome {
    /// Loaded, or stored and durable.
    Done,
    /// Store of a key the pool already held (or another job stored): no I/O.
    AlreadyStored,
    Failed(Failure),
    /// Loaded bytes did not match the checksum stored with the block: the
    /// failure (kind Corrupt) names the device, offset and key. The block was
    /// dropped from the pool (its header invalidated) and is never served
    /// again.
    Corrupt(Failure),
}

impl KeyOutcome {
    pub fn is_ok(&self) -> bool {
        !matches!(self, KeyOutcome::Failed(_) | KeyOutcome::Corrupt(_))
    }
}

#[derive(Clone, Debug)]
pub struct JobResult {
    pub job: JobId,
    pub kind: JobKind,
    pub keys: Vec<Key>,
    pub outcomes: Vec<KeyOutcome>,
    /// Keys a store evicted to make room (for the engine's KV events).
    pub evicted: Vec<Key>,
}

impl JobResult {
    pub fn all_ok(&self) -> bool {
        self.outcomes.iter().all(KeyOutcome::is_ok)
    }
    pub fn failures(&self) -> impl Iterator<Item = (&Key, &Failure)> {
        self.keys
            .iter()
            .zip(&self.outcomes)
            .filter_map(|(k, o)| match o {
                KeyOutcome::Failed(f) | KeyOutcome::Corrupt(f) => Some((k, f)),
                _ => None,
            })
    }
}

#[derive(Clone, Debug, serde::Serialize)]
pub struct Usage {
    pub total_blocks: u64,
    pub live_blocks: u64,
    pub free_blocks: u64,
    pub pinned_blocks: u64,
    /// Slots being written by stores in flight.
    pub reserved_blocks: u64,
    pub block_bytes: u64,
    pub capacity_bytes: u64,
    pub used_bytes: u64,
    pub jobs_in_flight: usize,
    pub engine: EngineStats,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Step {
    LoadLayer(u32),
    Invalidate,
    Data,
    Headers,
    /// Flush after the step before it.
    Flush(FlushAfter),
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum FlushAfter {
    Invalidate,
    Data,
    Headers,
}

struct Item {
    step: Step,
    ios: Vec<PlannedIo>,
    next: usize,
    iocbs_out: u32,
    /// The first failure among the item's I/Os.
    failed: Option<Failure>,
}

impl Item {
    fn new(step: Step, ios: Vec<PlannedIo>) -> Item {
        Item {
            step,
            ios,
            next: 0,
            iocbs_out: 0,
            failed: None,
        }
    }
}

impl Item {
    fn issued(&self) -> bool {
        self.next == self.ios.len()
    }
    fn complete(&self) -> bool {
        self.issued() && self.iocbs_out == 0
    }
    fn bytes(&self) -> u64 {
        self.ios.iter().map(|io| io.len as u64).sum()
    }
}

struct StoreState {
    /// Per key position: the slot being written, or None (deduplicated).
    slots: Vec<Option<u64>>,
    generations: Vec<u64>,
    staging: Vec<u32>,
    invalidated: Vec<u64>,
    /// Keys of this job that another store (or an earlier position of this
    /// one) writes: (position, that job). Their outcome follows that job's.
    waiting_on: Vec<(usize, JobId)>,
    evicted: Vec<Key>,
    /// Set once a failure makes the remaining steps pointless.
    abandoned: Option<Failure>,
    /// Slots whose writes failed with an I/O error: retired when the job ends.
    bad_slots: Vec<u64>,
}

/// What a load checks its bytes against.
struct LoadCheck {
    /// The slot each key position reads (the index may drop or move a key
    /// while the load runs; the job still owns what it read).
    slots: Vec<u64>,
    /// Verify layers as they land (host memory, `verify_loads`).
    verify: bool,
    /// Per key: running crc32c over the layers loaded so far, for blocks whose
    /// headers carry only a whole-block checksum (checked after the last layer
    /// when the load covers them all).
    running: Vec<u32>,
}

struct Job {
    id: JobId,
    kind: JobKind,
    keys: Vec<Key>,
    mem_blocks: Vec<u32>,
    outcomes: Vec<Option<KeyOutcome>>,
    /// Runs of key positions served by one planned I/O.
    runs: Vec<Vec<u32>>,
    items: Vec<Item>,
    /// Items run in order; a store item waits for all before it.
    sequential: bool,
    layers: Range<u32>,
    layers_done: u32,
    store: Option<StoreState>,
    load: Option<LoadCheck>,
}

impl Job {
    fn fail_run(&mut self, run: u32, why: &Failure) {
        for &p in &self.runs[run as usize] {
            if self.outcomes[p as usize].is_none() {
                self.outcomes[p as usize] = Some(KeyOutcome::Failed(why.clone()));
            }
        }
    }
    fn failed(&self, pos: usize) -> bool {
        matches!(
            self.outcomes[pos],
            Some(KeyOutcome::Failed(_) | KeyOutcome::Corrupt(_))
        )
    }
    fn all_items_complete(&self) -> bool {
        self.items.iter().all(Item::complete)
    }
}

/// The header staging arena: 4 KiB buffers registered in the P2P table.
struct Staging {
    map: DmaBuffer,
    first_index: u32,
    free: Vec<u32>,
}

impl Staging {
    /// Entry 0 stays all-zero: it is the source of header invalidations.
    const ZERO: u32 = 0;

    fn entry_ptr(&self, i: u32) -> *mut u8 {
        // SAFETY: i < entries (callers use indices from `free`/ZERO).
        unsafe {
            self.map
                .as_mut_ptr()
                .add(i as usize * SLOT_HEADER_BYTES as usize)
        }
    }
}

pub struct Tier {
    // Field order is drop order: the engine (inside `io`) waits out in-flight
    // I/O before the memory it targets (staging, the host cache) goes away.
    io: Submitter,
    staging: Option<Staging>,
    memory_owner: Option<Arc<HostKvCache>>,
    table: Option<Arc<P2pTable>>,
    pool: Pool,
    cfg: TierConfig,
    jobs: HashMap<JobId, Job>,
    iocb_owner: HashMap<IocbId, (JobId, usize)>,
    /// Jobs with items not yet fully in IOCBs, in submission order.
    issue_queue: VecDeque<JobId>,
    /// Keys being stored, by job.
    storing: HashMap<Key, JobId>,
    /// Memory blocks jobs in flight use: (loads writing it, stores reading it).
    mem_busy: HashMap<u32, (u32, u32)>,
    /// Results not yet collected (`wait`, `get_finished`), in finishing order.
    finished: HashMap<JobId, JobResult>,
    finished_order: VecDeque<JobId>,
    layer_events: VecDeque<LayerDone>,
    /// An engine failure met while submitting; reported by the next call
    /// that waits or polls.
    engine_error: Option<Error>,
    next_job: JobId,
    /// Submissions only plan; I/O reaches the engine in `poll` (the handle's
    /// I/O thread), never on the submitting thread.
    defer_engine_calls: bool,
}

impl Tier {
    /// Serve `pool` through the io_uring engine.
    pub fn open(pool: Pool, cfg: TierConfig) -> Result<Tier> {
        let devices: Vec<UringDevice> = pool
            .device_fds()?
            .into_iter()
            .map(|(fd, name)| UringDevice { fd, name })
            .collect();
        let engine = UringEngine::new(&devices, cfg.uring.clone())?;
        Self::with_engine(pool, cfg, Box::new(engine))
    }

    /// Serve `pool` through any engine (the engine must drive the pool's devices in order).
    pub fn with_engine(pool: Pool, cfg: TierConfig, engine: Box<dyn IoEngine>) -> Result<Tier> {
        if cfg.max_io_bytes < pool.geometry().object_bytes() {
            return Err(Error::invalid(format!(
                "max_io_bytes {} is smaller than one object ({} B)",
                cfg.max_io_bytes,
                pool.geometry().object_bytes()
            )));
        }
        if cfg.header_staging < 2 {
            return Err(Error::invalid("header_staging must be at least 2"));
        }
        if !pool.is_writable() {
            return Err(Error::invalid(
                "the pool was opened read-only (Pool::open_read_only); open it with Pool::open to serve it",
            ));
        }
        Ok(Tier {
            io: Submitter::new(cfg.ring_depth, engine)?,
            staging: None,
            memory_owner: None,
            table: None,
            pool,
            cfg,
            jobs: HashMap::new(),
            iocb_owner: HashMap::new(),
            issue_queue: VecDeque::new(),
            storing: HashMap::new(),
            mem_busy: HashMap::new(),
            finished: HashMap::new(),
            finished_order: VecDeque::new(),
            layer_events: VecDeque::new(),
            engine_error: None,
            next_job: 1,
            defer_engine_calls: false,
        })
    }

    pub fn pool(&self) -> &Pool {
        &self.pool
    }

    pub fn engine(&self) -> &dyn IoEngine {
        self.io.engine()
    }

    /// Register a host KV cache kvtier allocated: the tier keeps it alive.
    pub fn register_host_cache(&mut self, cache: Arc<HostKvCache>) -> Result<()> {
        // SAFETY: the tier holds `cache` for as long as the registration lasts.
        unsafe { self.register_memory(cache.memory().clone())? };
        self.memory_owner = Some(cache);
        Ok(())
    }

    /// Register the engine's KV memory and build its P2P table.
    ///
    /// # Safety
    /// Every byte `mem` describes must stay allocated until the tier is
    /// dropped or memory is registered again, and must not be freed while a
    /// job that targets it is in flight.
    pub unsafe fn register_memory(&mut self, mem: KvMemory) -> Result<()> {
        if !self.jobs.is_empty() {
            return Err(Error::invalid(
                "cannot register KV memory while jobs are in flight; wait for them first",
            ));
        }
        if mem.geometry != *self.pool.geometry() {
            return Err(Error::Registration(format!(
                "memory has geometry {} but the pool stores {}",
                mem.geometry.describe(),
                self.pool.geometry().describe()
            )));
        }
        if !self.io.engine().reaches(mem.kind) {
            return Err(Error::Unsupported(format!(
                "the {} engine cannot reach {:?} memory; register host memory, or use an engine that reaches it (`kvtier doctor` says which this machine has)",
                self.io.engine().name(),
                mem.kind
            )));
        }
        let mut table = P2pTable::build(&mem)?;
        let n = self.cfg.header_staging;
        let map = DmaBuffer::new(n as usize * SLOT_HEADER_BYTES as usize)?;
        let first_index = table.add_extra_region(map.addr(), SLOT_HEADER_BYTES as u32, n)?;
        let table = Arc::new(table);
        self.io.engine_mut().register_memory(table.clone())?;
        self.table = Some(table);
        self.staging = Some(Staging {
            map,
            first_index,
            free: (1..n).rev().collect(),
        });
        self.memory_owner = None;
        Ok(())
    }

    fn table(&self) -> Result<&Arc<P2pTable>> {
        self.table.as_ref().ok_or_else(|| {
            Error::invalid(
                "no KV memory registered: call register_memory / register_host_cache first",
            )
        })
    }

    /// How many leading keys the pool holds. No side effects (no LRU touch, no pin).
    pub fn lookup_prefix(&self, keys: &[Key]) -> usize {
        keys.iter()
            .take_while(|k| self.pool.index().get(k).is_some())
            .count()
    }

    /// Like `lookup_prefix`, and pins the keys it counts so they cannot be
    /// evicted before the load that needs them. Undo with `unpin`.
    pub fn lookup_and_pin(&mut self, keys: &[Key]) -> usize {
        let n = self.lookup_prefix(keys);
        for k in &keys[..n] {
            self.pool.index_mut().pin(k);
            self.pool.index_mut().touch(k);
        }
        n
    }

    /// Drop one pin per key. Never fails: unknown or unpinned keys are ignored.
    pub fn unpin(&mut self, keys: &[Key]) {
        for k in keys {
            self.pool.index_mut().unpin(k);
        }
    }

    pub fn contains(&self, key: &Key) -> bool {
        self.pool.index().get(key).is_some()
    }

    fn check_mem_blocks(&self, keys: &[Key], mem_blocks: &[u32]) -> Result<()> {
        let table = self.table()?;
        if keys.len() != mem_blocks.len() {
            return Err(Error::invalid(format!(
                "{} keys but {} memory blocks: give one memory block per key",
                keys.len(),
                mem_blocks.len()
            )));
        }
        if keys.is_empty() {
            return Err(Error::invalid("a job needs at least one key"));
        }
        if let Some(&b) = mem_blocks.iter().find(|&&b| b >= table.num_blocks()) {
            return Err(Error::invalid(format!(
                "memory block {b} is out of range: the registered KV memory has {} blocks (0..{})",
                table.num_blocks(),
                table.num_blocks()
            )));
        }
        Ok(())
    }

    /// Start loading `keys` into `mem_blocks` for `layers`. Every key must be
    /// in the pool (count them with `lookup_prefix`); they stay pinned until
    /// the job finishes. Layers complete in order; see `layer_events`,
    /// `wait_layer`.
    pub fn submit_load(
        &mut self,
        keys: &[Key],
        mem_blocks: &[u32],
        layers: Range<u32>,
    ) -> Result<JobId> {
        self.check_mem_blocks(keys, mem_blocks)?;
        let geo = *self.pool.geometry();
        if layers.start >= layers.end || layers.end > geo.layers {
            return Err(Error::invalid(format!(
                "layer range {}..{} is empty or outside the model's {} layers",
                layers.start, layers.end, geo.layers
            )));
        }
        let mut seen = HashSet::new();
        if let Some(&b) = mem_blocks.iter().find(|&&b| !seen.insert(b)) {
            return Err(Error::invalid(format!(
                "memory block {b} is the target of two keys in one load"
            )));
        }
        if let Some(&b) = mem_blocks
            .iter()
            .find(|b| self.mem_busy.get(b).is_some_and(|u| u.1 > 0))
        {
            return Err(Error::invalid(format!(
                "memory block {b} is being stored by a job in flight; wait for that store before loading into it"
            )));
        }
        let mut slots = Vec::with_capacity(keys.len());
        for k in keys {
            match self.pool.index().get(k) {
                Some(e) => slots.push(e.slot),
                None => return Err(Error::UnknownKey { key: k.to_string() }),
            }
        }
        for k in keys {
            self.pool.index_mut().pin_job(k);
            self.pool.index_mut().touch(k);
        }
        for &b in mem_blocks {
            self.mem_busy.entry(b).or_default().0 += 1;
        }
        let table = self.table()?.clone();
        let positions: Vec<u32> = (0..keys.len() as u32).collect();
        let runs = self.group_runs(&slots, &positions);
        let mut items = Vec::new();
        for layer in layers.clone() {
            let mut objects = Vec::new();
            for (r, run) in runs.iter().enumerate() {
                for kv in 0..2 {
                    for &p in run {
                        let (dev, off) =
                            self.pool
                                .layout()
                                .object_offset(slots[p as usize], layer, kv);
                        objects.push((
                            dev,
                            off,
                            table.index(mem_blocks[p as usize], layer, kv),
                            r as u32,
                        ));
                    }
                }
            }
            items.push(Item::new(
                Step::LoadLayer(layer),
                self.coalesce(IOCTX_OP_READ, &objects),
            ));
        }
        let verify = self.cfg.verify_loads && table.kind() == MemoryKind::Host;
        let id = self.new_job(Job {
            id: 0,
            kind: JobKind::Load,
            keys: keys.to_vec(),
            mem_blocks: mem_blocks.to_vec(),
            outcomes: vec![None; keys.len()],
            runs,
            items,
            sequential: false,
            layers_done: layers.start,
            layers,
            store: None,
            load: Some(LoadCheck {
                running: vec![0; slots.len()],
                slots,
                verify,
            }),
        });
        self.pump_after_submit();
        Ok(id)
    }

    /// Start storing `keys` from `mem_blocks` (all layers). Keys already in
    /// the pool, or being stored by another job, cost no I/O. Evicts
    /// least-recently-used unpinned blocks when the pool is full; refuses with
    /// `PoolFull` if everything is pinned.
    pub fn submit_store(&mut self, keys: &[Key], mem_blocks: &[u32]) -> Result<JobId> {
        self.submit_store_with_crcs(keys, mem_blocks, None)
    }

    /// `submit_store` with the data checksums of some blocks already taken
    /// (`crcs[i]` for `keys[i]`, by [`Tier::layer_crcs`] on another thread), so
    /// that the thread that owns the tier does not spend its time hashing.
    /// Missing ones (`None`) are computed here.
    pub fn submit_store_with_crcs(
        &mut self,
        keys: &[Key],
        mem_blocks: &[u32],
        crcs: Option<&[Option<Vec<u32>>]>,
    ) -> Result<JobId> {
        if crcs.is_some_and(|c| c.len() != keys.len()) {
            return Err(Error::invalid("one checksum slot per key is needed"));
        }
        self.check_mem_blocks(keys, mem_blocks)?;
        let geo = *self.pool.geometry();
        let mut outcomes = vec![None; keys.len()];
        let mut new_pos: Vec<u32> = Vec::new();
        if let Some(&b) = mem_blocks
            .iter()
            .find(|b| self.mem_busy.get(b).is_some_and(|u| u.0 > 0))
        {
            return Err(Error::invalid(format!(
                "memory block {b} is the target of a load in flight; wait for that load before storing from it"
            )));
        }
        let this_job = self.next_job;
        let mut waiting_on = Vec::new();
        let mut in_job = HashSet::new();
        let mut already = Vec::new();
        for (i, k) in keys.iter().enumerate() {
            if self.pool.index().get(k).is_some() {
                self.pool.index_mut().touch(k);
                outcomes[i] = Some(KeyOutcome::AlreadyStored);
                already.push(*k);
            } else if let Some(&owner) = self.storing.get(k) {
                waiting_on.push((i, owner));
            } else if !in_job.insert(*k) {
                waiting_on.push((i, this_job));
            } else {
                new_pos.push(i as u32);
            }
        }
        let n = new_pos.len();
        let staging_cap = self.cfg.header_staging as usize - 1;
        if n > staging_cap {
            return Err(Error::invalid(format!(
                "a store of {n} new blocks exceeds the header staging of {staging_cap}; split the job or raise TierConfig::header_staging"
            )));
        }
        self.table()?;
        // Wait for stores in flight to return staging buffers if needed.
        while self.staging.as_ref().map_or(0, |s| s.free.len()) < n {
            if self.iocb_owner.is_empty() && self.jobs.is_empty() {
                return Err(Error::Ring(
                    "header staging exhausted with nothing in flight".into(),
                ));
            }
            self.wait_any()?;
        }
        // Keys reported as already stored must not be evicted by this very
        // job's allocation: hold them while it runs.
        for k in &already {
            self.pool.index_mut().pin_job(k);
        }
        let alloc = self.pool.index_mut().allocate(n as u64);
        for k in &already {
            self.pool.index_mut().unpin_job(k);
        }
        let alloc = alloc?;
        for &b in mem_blocks {
            self.mem_busy.entry(b).or_default().1 += 1;
        }
        let table = self.table()?.clone();
        let staging = self.staging.as_mut().expect("registered");
        let stage: Vec<u32> = (0..n)
            .map(|_| staging.free.pop().expect("counted"))
            .collect();

        let mut slots = vec![None; keys.len()];
        let mut generations = vec![0; keys.len()];
        for (j, &p) in new_pos.iter().enumerate() {
            slots[p as usize] = Some(alloc.slots[j]);
            generations[p as usize] = self.pool.next_generation();
            self.storing.insert(keys[p as usize], this_job);
        }
        let slot_by_pos: Vec<u64> = slots.iter().map(|s| s.unwrap_or(u64::MAX)).collect();
        let mut runs = self.group_runs(&slot_by_pos, &new_pos);
        let all_run = runs.len() as u32;
        runs.push(new_pos.clone());
        let mut items = Vec::new();

        // (1) Invalidate stale headers in reused slots.
        if !alloc.needs_invalidate.is_empty() {
            let zero = self.staging.as_ref().expect("registered").first_index + Staging::ZERO;
            // Adjacent header sectors go out as one vectored write (each
            // segment the same zero sector).
            let mut zeros: Vec<(u16, u64, u32, u32)> = alloc
                .needs_invalidate
                .iter()
                .map(|&s| {
                    let (dev, off) = self.pool.layout().header_offset(s);
                    (dev, off, zero, all_run)
                })
                .collect();
            zeros.sort_unstable_by_key(|&(dev, off, _, _)| (dev, off));
            let ios = plan::coalesce(
                IOCTX_OP_WRITE,
                SLOT_HEADER_BYTES,
                self.cfg.max_io_bytes,
                &zeros,
            );
            items.push(self.flush_after(Step::Invalidate, ios, all_run, FlushAfter::Invalidate));
        }
        // (2) Data, in device order per run: (layer, K|V, slot).
        let mut objects = Vec::new();
        for (r, run) in runs[..all_run as usize].iter().enumerate() {
            for layer in 0..geo.layers {
                for kv in 0..2 {
                    for &p in run {
                        let slot = slots[p as usize].expect("new key");
                        let (dev, off) = self.pool.layout().object_offset(slot, layer, kv);
                        objects.push((
                            dev,
                            off,
                            table.index(mem_blocks[p as usize], layer, kv),
                            r as u32,
                        ));
                    }
                }
            }
        }
        let data = self.coalesce(IOCTX_OP_WRITE, &objects);
        items.push(self.flush_after(Step::Data, data, all_run, FlushAfter::Data));
        // (3) Headers, one per block, with the data checksums taken now. The
        // header sectors of a run's consecutive slots are adjacent on the
        // device: one vectored write per run, not one write per block (a
        // 64K-token llama3-8b store has 4096 headers).
        let mut run_of = vec![all_run; keys.len()];
        for (r, run) in runs[..all_run as usize].iter().enumerate() {
            for &p in run {
                run_of[p as usize] = r as u32;
            }
        }
        let mut header_objects: Vec<(u16, u64, u32, u32)> = Vec::with_capacity(n);
        let mut sector = vec![0u8; SLOT_HEADER_BYTES as usize];
        for (j, &p) in new_pos.iter().enumerate() {
            let slot = slots[p as usize].expect("new key");
            // Device memory is not readable here: such blocks carry no data
            // checksum (`pool check` counts them as unverifiable).
            let given = crcs.and_then(|c| c[p as usize].clone());
            let crcs = match table.kind() {
                MemoryKind::Host if given.is_some() => given,
                MemoryKind::Host => Some(layer_crcs(&table, mem_blocks[p as usize], geo.layers)),
                MemoryKind::Gpu { .. } => None,
            };
            self.pool.write_header_sector(
                &mut sector,
                &keys[p as usize],
                slot,
                generations[p as usize],
                crcs.as_deref(),
            );
            let staging = self.staging.as_ref().expect("registered");
            let ptr = staging.entry_ptr(stage[j]);
            // SAFETY: a staging entry is 4 KiB owned by this job until it finishes.
            unsafe {
                std::ptr::copy_nonoverlapping(sector.as_ptr(), ptr, sector.len());
            }
            let (dev, off) = self.pool.layout().header_offset(slot);
            header_objects.push((dev, off, staging.first_index + stage[j], run_of[p as usize]));
        }
        header_objects.sort_unstable_by_key(|&(dev, off, _, _)| (dev, off));
        let header_ios = plan::coalesce(
            IOCTX_OP_WRITE,
            SLOT_HEADER_BYTES,
            self.cfg.max_io_bytes,
            &header_objects,
        );
        items.push(self.flush_after(Step::Headers, header_ios, all_run, FlushAfter::Headers));
        let items = items.into_iter().flatten().collect();

        let id = self.new_job(Job {
            id: 0,
            kind: JobKind::Store,
            keys: keys.to_vec(),
            mem_blocks: mem_blocks.to_vec(),
            outcomes,
            runs,
            items,
            sequential: true,
            layers: 0..0,
            layers_done: 0,
            store: Some(StoreState {
                slots,
                generations,
                staging: stage,
                invalidated: alloc.needs_invalidate,
                waiting_on,
                evicted: alloc.evicted,
                abandoned: None,
                bad_slots: Vec::new(),
            }),
            load: None,
        });
        debug_assert_eq!(id, this_job);
        self.pump_after_submit();
        Ok(id)
    }

    /// `step`'s I/Os followed by one flush per device they touched.
    fn flush_after(
        &self,
        step: Step,
        ios: Vec<PlannedIo>,
        all_run: u32,
        what: FlushAfter,
    ) -> [Item; 2] {
        let mut devs: Vec<u16> = ios.iter().map(|io| io.dev).collect();
        devs.sort_unstable();
        devs.dedup();
        let flushes = devs
            .into_iter()
            .map(|dev| PlannedIo {
                op: IOCTX_OP_FLUSH,
                dev,
                offset: 0,
                len: 0,
                segs: Vec::new(),
                run: all_run,
            })
            .collect();
        [Item::new(step, ios), Item::new(Step::Flush(what), flushes)]
    }

    fn group_runs(&self, slots: &[u64], positions: &[u32]) -> Vec<Vec<u32>> {
        plan::group_runs(self.pool.layout().group_blocks as u64, slots, positions)
    }

    fn coalesce(&self, op: u8, objects: &[(u16, u64, u32, u32)]) -> Vec<PlannedIo> {
        plan::coalesce(
            op,
            self.pool.geometry().object_bytes(),
            self.cfg.max_io_bytes,
            objects,
        )
    }

    fn new_job(&mut self, mut job: Job) -> JobId {
        let id = self.next_job;
        self.next_job += 1;
        job.id = id;
        self.jobs.insert(id, job);
        self.issue_queue.push_back(id);
        id
    }

    /// After a job is created its id must reach the caller, so an engine
    /// failure here is kept and reported by the next wait or poll.
    fn pump_after_submit(&mut self) {
        if self.defer_engine_calls {
            return;
        }
        if let Err(e) = self.pump() {
            self.engine_error.get_or_insert(e);
        }
    }

    fn take_engine_error(&mut self) -> Result<()> {
        match self.engine_error.take() {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }

    /// Put planned I/O into IOCBs while IOCBs are free, then hand them to the
    /// engine; then announce (and verify) loaded layers, and finish the jobs
    /// that completes.
    fn pump(&mut self) -> Result<()> {
        self.fill_iocbs()?;
        self.io.kick()?;
        if self.advance_loads() {
            self.fill_iocbs()?;
            self.io.kick()?;
        }
        Ok(())
    }

    /// Put planned I/O into IOCBs and finish completed jobs, without
    /// submitting: a wait that follows submits in its own call.
    fn fill_iocbs(&mut self) -> Result<()> {
        let mut progressed = true;
        while progressed {
            progressed = false;
            let queue: Vec<JobId> = self.issue_queue.iter().copied().collect();
            for id in queue {
                while self.issue_one(id)? {
                    progressed = true;
                }
            }
            self.issue_queue.retain(|id| {
                self.jobs
                    .get(id)
                    .is_some_and(|j| j.items.iter().any(|i| !i.issued()))
            });
            // Jobs whose work is done (or that had none) finish here.
            // A load finishes once its every layer was announced (verified).
            let done: Vec<JobId> = self
                .jobs
                .iter()
                .filter(|(_, j)| {
                    j.all_items_complete()
                        && (j.kind != JobKind::Load || j.layers_done == j.layers.end)
                })
                .map(|(&id, _)| id)
                .collect();
            for id in done {
                if self.try_finish(id) {
                    progressed = true;
                }
            }
        }
        Ok(())
    }

    /// Fill one IOCB from the job's next issuable item. False if nothing could be issued.
    fn issue_one(&mut self, id: JobId) -> Result<bool> {
        let Some(job) = self.jobs.get_mut(&id) else {
            return Ok(false);
        };
        let Some(ix) = job.items.iter().position(|i| !i.issued()) else {
            return Ok(false);
        };
        if job.sequential && !job.items[..ix].iter().all(Item::complete) {
            return Ok(false);
        }
        if job.kind == JobKind::Load && job.items[ix].next == 0 {
            // The first layer goes alone: the compute waits for it first, and
            // a later layer issued beside it would take a share of the
            // device's bandwidth (4 layers at once made layer 0 take 4x the
            // average layer time at 4K tokens). After it, the look-ahead
            // below keeps the device busy.
            if ix > 0 && !job.items[0].complete() {
                return Ok(false);
            }
            let in_flight: Vec<&Item> = job.items[..ix].iter().filter(|i| !i.complete()).collect();
            let bytes: u64 = in_flight.iter().map(|i| i.bytes()).sum();
            if in_flight.len() >= 2 && bytes + job.items[ix].bytes() > self.cfg.load_lookahead_bytes
            {
                return Ok(false);
            }
        }
        if let Some(st) = &job.store {
            if st.abandoned.is_some() {
                // Skip the rest: mark every remaining item issued with nothing.
                for it in &mut job.items[ix..] {
                    it.next = it.ios.len();
                }
                return Ok(false);
            }
        }
        // Skip I/O for keys that already failed (headers of failed data).
        let step = job.items[ix].step;
        if step == Step::Headers {
            let item = &job.items[ix];
            let keep: Vec<PlannedIo> = item.ios[item.next..]
                .iter()
                .filter(|io| {
                    !job.runs[io.run as usize]
                        .iter()
                        .any(|&p| job.failed(p as usize))
                })
                .cloned()
                .collect();
            let item = &mut job.items[ix];
            item.ios.truncate(item.next);
            item.ios.extend(keep);
            if item.issued() {
                return Ok(true);
            }
        }
        let Some(iocb) = self.io.get_iocb() else {
            return Ok(false);
        };
        let ring = self.io.ring_mut();
        ring.iocb_mut(iocb).hdr.user_data = id;
        let item = &mut job.items[ix];
        while item.next < item.ios.len() {
            let io = &item.ios[item.next];
            let ctx = IoCtx {
                dev_offset: io.offset,
                len: io.len,
                dev: io.dev,
                op: io.op,
                tag: io.run,
                ..IoCtx::default()
            };
            if ring.push_ctx(iocb, ctx, &io.segs).is_none() {
                break;
            }
            item.next += 1;
        }
        item.iocbs_out += 1;
        self.iocb_owner.insert(iocb, (id, ix));
        self.io.submit(iocb)?;
        Ok(true)
    }

    /// Account a completed IOCB to its job.
    fn on_iocb(&mut self, iocb: IocbId) {
        let Some((id, ix)) = self.iocb_owner.remove(&iocb) else {
            self.io.release(iocb);
            return;
        };
        let ring = self.io.ring();
        let b = ring.iocb(iocb);
        let mut failures: Vec<(u32, Failure)> = Vec::new();
        let mut media_failures: Vec<IoCtx> = Vec::new();
        if b.hdr.errors > 0 {
            for c in &b.ctx[..b.hdr.count as usize] {
                if c.status != IOCTX_STATUS_OK {
                    failures.push((c.tag, Failure::from_io(describe_failure(c, &self.pool))));
                    if is_media_error(c) {
                        media_failures.push(*c);
                    }
                }
            }
        }
        self.io.release(iocb);
        let job = self.jobs.get_mut(&id).expect("IOCB of a live job");
        job.items[ix].iocbs_out -= 1;
        let step = job.items[ix].step;
        if let Some((_, msg)) = failures.first() {
            job.items[ix].failed.get_or_insert_with(|| msg.clone());
        }
        for (run, msg) in &failures {
            job.fail_run(*run, msg);
            if let Some(st) = &mut job.store {
                // A failed flush or invalidation leaves durability unknown for
                // the whole job: stop here.
                if matches!(step, Step::Flush(_) | Step::Invalidate) && st.abandoned.is_none() {
                    st.abandoned = Some(msg.clone());
                }
            }
        }
        if let Some(st) = &mut job.store {
            // A write the device refused with an I/O error marks the slots it
            // covered as bad, so the allocator stops handing them out.
            for c in &media_failures {
                if c.op != IOCTX_OP_WRITE {
                    continue;
                }
                let layout = self.pool.layout();
                let end = c.dev_offset + c.len as u64;
                let hit = |dev: u16, off: u64, len: u64| {
                    dev == c.dev && off < end && c.dev_offset < off + len
                };
                let obj = self.pool.geometry().object_bytes();
                let layers = self.pool.geometry().layers;
                for &p in &job.runs[c.tag as usize] {
                    let Some(slot) = st.slots[p as usize] else {
                        continue;
                    };
                    let (hd, ho) = layout.header_offset(slot);
                    let touched = hit(hd, ho, SLOT_HEADER_BYTES)
                        || (0..layers).any(|l| {
                            (0..2).any(|kv| {
                                let (d, o) = layout.object_offset(slot, l, kv);
                                hit(d, o, obj)
                            })
                        });
                    if touched && !st.bad_slots.contains(&slot) {
                        st.bad_slots.push(slot);
                    }
                }
                // An invalidation covers slots that are not this job's keys.
                if step == Step::Invalidate {
                    for &s in &st.invalidated {
                        let (hd, ho) = layout.header_offset(s);
                        if hit(hd, ho, SLOT_HEADER_BYTES) && !st.bad_slots.contains(&s) {
                            st.bad_slots.push(s);
                        }
                    }
                }
            }
        }
        if let (Some(st), Step::Flush(FlushAfter::Invalidate)) = (&mut job.store, step) {
            if job.items[ix].complete() && st.abandoned.is_none() {
                for &s in &st.invalidated {
                    self.pool.index_mut().header_invalidated(s);
                }
            }
        }
    }

    /// Announce the layers of loads that are in memory, in order, each
    /// verified first. Runs after new I/O was handed to the engine, so the
    /// checksum work overlaps the reads of later layers. True if any layer
    /// was announced.
    fn advance_loads(&mut self) -> bool {
        let mut any = false;
        let mut ids: Vec<JobId> = self
            .jobs
            .iter()
            .filter(|(_, j)| j.kind == JobKind::Load && j.layers_done < j.layers.end)
            .map(|(&id, _)| id)
            .collect();
        ids.sort_unstable();
        for id in ids {
            let job = self.jobs.get_mut(&id).expect("live job");
            while job.layers_done < job.layers.end {
                let li = (job.layers_done - job.layers.start) as usize;
                if !job.items[li].complete() {
                    break;
                }
                let layer = job.layers_done;
                if job.load.as_ref().is_some_and(|l| l.verify) {
                    if let Some(msg) = verify_layer(job, layer, &mut self.pool, self.table.as_ref())
                    {
                        job.items[li].failed.get_or_insert(msg);
                    }
                }
                self.layer_events.push_back(LayerDone {
                    job: id,
                    layer,
                    error: job.items[li].failed.clone(),
                });
                job.layers_done += 1;
                any = true;
            }
        }
        any
    }

    /// Finish a job whose items are complete. False if it still waits on
    /// another job's store of a shared key.
    fn try_finish(&mut self, id: JobId) -> bool {
        let job = self.jobs.get(&id).expect("live job");
        if let Some(st) = &job.store {
            // Wait only for the job that owned the key when this one was
            // submitted (never for a later one: two jobs could wait on each other).
            if st
                .waiting_on
                .iter()
                .any(|&(_, owner)| owner != id && self.jobs.contains_key(&owner))
            {
                return false;
            }
        }
        let mut job = self.jobs.remove(&id).expect("live job");
        let mut evicted = Vec::new();
        match job.kind {
            JobKind::Load => {
                let slots = job.load.take().map(|l| l.slots).unwrap_or_default();
                for (i, k) in job.keys.iter().enumerate() {
                    let slot = slots.get(i).copied();
                    let ix = self.pool.index_mut();
                    if slot.is_none() || ix.get(k).map(|e| e.slot) == slot {
                        ix.unpin_job(k);
                    } else if let Some(s) = slot {
                        // The key was dropped (its block failed verification)
                        // while this load read it.
                        ix.release_condemned(s);
                    }
                    if job.outcomes[i].is_none() {
                        job.outcomes[i] = Some(KeyOutcome::Done);
                    }
                }
            }
            JobKind::Store => {
                let st = job.store.take().expect("store state");
                // Slots are retired only when the device still completed the
                // job's flushes: a device that fails everything (gone, or
                // power lost) would otherwise retire every slot it was asked
                // to write, for a fault that is not in those sectors.
                let retire = st.abandoned.is_none();
                for (i, k) in job.keys.iter().enumerate() {
                    if let Some(slot) = st.slots[i] {
                        self.storing.remove(k);
                        let ok = st.abandoned.is_none() && !job.failed(i);
                        if ok {
                            self.pool.index_mut().commit(*k, slot, st.generations[i]);
                            job.outcomes[i] = Some(KeyOutcome::Done);
                        } else {
                            // Its header may have reached the device before a
                            // later failure: treat it as stale until rewritten.
                            self.pool.index_mut().abort(slot);
                            self.pool.index_mut().mark_stale_header(slot);
                            if retire && st.bad_slots.contains(&slot) {
                                self.pool.index_mut().retire(slot);
                            }
                            if job.outcomes[i].is_none() {
                                let why = st.abandoned.clone().unwrap_or_else(|| {
                                    Failure::new(ErrorKind::Internal, "store failed")
                                });
                                job.outcomes[i] = Some(KeyOutcome::Failed(why));
                            }
                        }
                    }
                }
                for &(p, _) in &st.waiting_on {
                    job.outcomes[p] = Some(if self.pool.index().get(&job.keys[p]).is_some() {
                        KeyOutcome::AlreadyStored
                    } else {
                        KeyOutcome::Failed(Failure::new(
                            ErrorKind::Io,
                            "another job storing the same key failed; store it again",
                        ))
                    });
                }
                if retire && !st.bad_slots.is_empty() {
                    // Retired in memory whatever happens; if the bad table
                    // cannot be written the slots fail again after a reopen
                    // and are retired again, which loses nothing stored.
                    let _ = self.pool.retire_slots(&st.bad_slots);
                }
                if let Some(staging) = self.staging.as_mut() {
                    staging.free.extend(st.staging);
                }
                evicted = st.evicted;
            }
        }
        for b in job.mem_blocks.iter() {
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
        self.finished.insert(
            id,
            JobResult {
                job: id,
                kind: job.kind,
                keys: job.keys,
                outcomes: job
                    .outcomes
                    .into_iter()
                    .map(|o| o.unwrap_or(KeyOutcome::Done))
                    .collect(),
                evicted,
            },
        );
        self.finished_order.push_back(id);
        true
    }

    /// Remove a collected result and the layer events of its job.
    fn collect(&mut self, id: JobId) -> Option<JobResult> {
        let r = self.finished.remove(&id)?;
        self.finished_order.retain(|&j| j != id);
        if r.kind == JobKind::Load {
            self.layer_events.retain(|e| e.job != id);
        }
        Some(r)
    }

    /// Progress without blocking: issue what fits, reap what completed.
    pub fn poll(&mut self) -> Result<()> {
        self.take_engine_error()?;
        self.pump()?;
        while let Some(iocb) = self.io.poll()? {
            self.on_iocb(iocb);
        }
        self.pump()
    }

    /// Block until at least one IOCB completes (or nothing is in flight).
    fn wait_any(&mut self) -> Result<()> {
        self.take_engine_error()?;
        self.fill_iocbs()?;
        if self.iocb_owner.is_empty() {
            // Nothing to wait for, but loaded layers may wait to be announced.
            return self.pump();
        }
        let iocb = self.io.wait_cqe()?;
        self.on_iocb(iocb);
        while let Some(iocb) = self.io.poll()? {
            self.on_iocb(iocb);
        }
        self.pump()
    }

    fn check_job(&self, id: JobId) -> Result<()> {
        if self.jobs.contains_key(&id) || self.finished.contains_key(&id) {
            Ok(())
        } else {
            Err(Error::invalid(format!(
                "job {id} is unknown or its result was already taken"
            )))
        }
    }

    /// One step of a blocking wait: wait for an IOCB, or fail if nothing
    /// in flight can ever finish the job.
    fn wait_step(&mut self, id: JobId) -> Result<()> {
        if self.iocb_owner.is_empty() {
            self.pump()?;
            if self.iocb_owner.is_empty() && self.jobs.contains_key(&id) {
                return Err(Error::Ring(format!("job {id} cannot make progress")));
            }
        }
        self.wait_any()
    }

    /// Block until `job` finishes; returns (and removes) its result. Every
    /// job's result must be collected, here or with `get_finished`.
    pub fn wait(&mut self, id: JobId) -> Result<JobResult> {
        self.check_job(id)?;
        loop {
            if let Some(r) = self.collect(id) {
                return Ok(r);
            }
            self.wait_step(id)?;
        }
    }

    /// Block until layer `layer` of load `job` is in memory. Errors if its
    /// reads failed: the layer's memory must not be used then.
    pub fn wait_layer(&mut self, id: JobId, layer: u32) -> Result<()> {
        self.check_job(id)?;
        loop {
            let failed = |items: &[Item], first: u32| -> Result<()> {
                match &items[(layer - first) as usize].failed {
                    Some(f) => Err(Error::Failed(
                        f.context(format_args!("layer {layer} of job {id} failed")),
                    )),
                    None => Ok(()),
                }
            };
            match self.jobs.get(&id) {
                None => {
                    // Finished: its result says which keys failed.
                    let r = self.finished.get(&id).expect("checked");
                    return match r.failures().next() {
                        Some((k, f)) if r.kind == JobKind::Load => Err(Error::Failed(
                            f.context(format_args!("job {id} failed to load key {k}")),
                        )),
                        _ => Ok(()),
                    };
                }
                Some(j) if j.kind != JobKind::Load || !j.layers.contains(&layer) => {
                    return Err(Error::invalid(format!(
                        "job {id} is not a load of layer {layer}"
                    )))
                }
                Some(j) if j.layers_done > layer => return failed(&j.items, j.layers.start),
                _ => self.wait_step(id)?,
            }
        }
    }

    /// Layers of loads that reached memory since the last call, in order per job.
    pub fn layer_events(&mut self) -> Vec<LayerDone> {
        self.layer_events.drain(..).collect()
    }

    /// Layers of `job` in memory so far (from the start of its range).
    pub fn layers_done(&self, id: JobId) -> Option<u32> {
        self.jobs.get(&id).map(|j| j.layers_done - j.layers.start)
    }

    /// Results of every job finished and not yet collected, in finishing order.
    pub fn get_finished(&mut self) -> Vec<JobResult> {
        let ids: Vec<JobId> = self.finished_order.iter().copied().collect();
        ids.into_iter().filter_map(|id| self.collect(id)).collect()
    }

    /// Wait for every job in flight.
    pub fn drain(&mut self) -> Result<()> {
        while !self.jobs.is_empty() {
            let before = self.jobs.len();
            self.wait_any()?;
            if self.iocb_owner.is_empty() && self.jobs.len() == before {
                self.pump()?;
                if self.jobs.len() == before && self.iocb_owner.is_empty() {
                    return Err(Error::Ring("jobs in flight cannot make progress".into()));
                }
            }
        }
        Ok(())
    }

    /// Load jobs not yet finished (the scheduler holds writes back while
    /// any read is in flight).
    pub fn loads_in_flight(&self) -> usize {
        self.jobs
            .values()
            .filter(|j| j.kind == JobKind::Load)
            .count()
    }

    /// Store jobs not yet finished.
    pub fn stores_in_flight(&self) -> usize {
        self.jobs
            .values()
            .filter(|j| j.kind == JobKind::Store)
            .count()
    }

    pub fn usage(&self) -> Usage {
        let ix = self.pool.index();
        let bb = self.pool.geometry().block_bytes();
        Usage {
            total_blocks: ix.total_slots(),
            live_blocks: ix.live(),
            free_blocks: ix.free_slots(),
            pinned_blocks: ix.pinned(),
            reserved_blocks: ix.reserved(),
            block_bytes: bb,
            capacity_bytes: ix.total_slots() * bb,
            used_bytes: ix.live() * bb,
            jobs_in_flight: self.jobs.len(),
            engine: self.io.engine().stats(),
        }
    }

    pub fn config(&self) -> &TierConfig {
        &self.cfg
    }

    /// After this, `submit_load` and `submit_store` only plan their I/O and
    /// `poll` hands it to the engine: the handle's I/O thread polls, so an
    /// engine bound to one thread (io_uring with DEFER_TASKRUN) is only ever
    /// entered there.
    pub fn defer_engine_calls(&mut self, on: bool) {
        self.defer_engine_calls = on;
    }

    /// Completed IOCBs the next `poll` will account (an engine can
    /// complete an IOCB while accepting it, with nothing for a thread that
    /// sleeps on the engine's fds to wake up for).
    pub fn completions_pending(&self) -> bool {
        self.io.ring().cq_len() > 0
    }

    /// Jobs not yet finished (loads and stores).
    pub fn jobs_in_flight(&self) -> usize {
        self.jobs.len()
    }

    /// The P2P table of the registered memory, if any.
    pub fn p2p_table(&self) -> Option<&Arc<P2pTable>> {
        self.table.as_ref()
    }

    /// The data checksums a store of `mem_block` records in its header (one
    /// crc32c per layer, K then V), or None when the memory is not readable
    /// by the CPU (GPU memory).
    pub fn layer_crcs(table: &P2pTable, mem_block: u32, layers: u32) -> Option<Vec<u32>> {
        match table.kind() {
            MemoryKind::Host if mem_block < table.num_blocks() => {
                Some(layer_crcs(table, mem_block, layers))
            }
            _ => None,
        }
    }
}

impl Drop for Tier {
    fn drop(&mut self) {
        // Let stores in flight land rather than leave half a job behind; a
        // crash instead of a drop is what the store protocol is for.
        let _ = self.drain();
    }
}

/// The bytes of one object of a memory block.
fn object_bytes(table: &P2pTable, mem_block: u32, layer: u32, kv: u32) -> &[u8] {
    let d = table
        .entry(table.index(mem_block, layer, kv))
        .expect("in table");
    // SAFETY: the descriptor addresses registered host memory the caller
    // keeps alive (register_memory's contract), and no I/O writes it now: a
    // store reads it, or the load that wrote this layer has completed.
    unsafe { std::slice::from_raw_parts(d.addr as *const u8, d.len as usize) }
}

/// crc32c of layer `layer` of a memory block: its K object, then its V object.
fn layer_crc(table: &P2pTable, mem_block: u32, layer: u32) -> u32 {
    (0..2).fold(0, |crc, kv| {
        crc32c::crc32c_append(crc, object_bytes(table, mem_block, layer, kv))
    })
}

/// One crc32c per layer of a block in host memory (what its header records).
fn layer_crcs(table: &P2pTable, mem_block: u32, layers: u32) -> Vec<u32> {
    (0..layers)
        .map(|l| layer_crc(table, mem_block, l))
        .collect()
}

/// The checksums of layer `layer` of every key a load still serves whose
/// header has per-layer checksums, on several threads when there are many:
/// the first layer's check is on the critical path of a restore (the compute
/// waits for it), where later layers' overlap the reads of the next ones.
fn layer_crcs_parallel(job: &Job, layer: u32, pool: &Pool, table: &P2pTable) -> Vec<Option<u32>> {
    let check = job.load.as_ref().expect("a load");
    let todo: Vec<(usize, u32)> = (0..job.keys.len())
        .filter(|&p| !job.failed(p) && pool.layer_crc(check.slots[p], layer).is_some())
        .map(|p| (p, job.mem_blocks[p]))
        .collect();
    let mut got = vec![None; job.keys.len()];
    // Below this many blocks a thread costs more than it saves.
    const PER_THREAD: usize = 64;
    let threads = std::thread::available_parallelism()
        .map_or(1, |n| n.get())
        .min(8)
        .min(todo.len().div_ceil(PER_THREAD))
        .max(1);
    if threads == 1 {
        for &(p, mem) in &todo {
            got[p] = Some(layer_crc(table, mem, layer));
        }
        return got;
    }
    let chunk = todo.len().div_ceil(threads);
    let parts: Vec<Vec<(usize, u32)>> = std::thread::scope(|s| {
        let handles: Vec<_> = todo
            .chunks(chunk)
            .map(|part| {
                s.spawn(move || {
                    part.iter()
                        .map(|&(p, mem)| (p, layer_crc(table, mem, layer)))
                        .collect::<Vec<_>>()
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().expect("a checksum thread panicked"))
            .collect()
    });
    for (p, crc) in parts.into_iter().flatten() {
        got[p] = Some(crc);
    }
    got
}

/// Verify layer `layer` of every key a load has not already failed; a key
/// whose bytes differ from its stored checksum becomes `Corrupt` and leaves
/// the pool. Returns the first mismatch's message (the layer's error).
fn verify_layer(
    job: &mut Job,
    layer: u32,
    pool: &mut Pool,
    table: Option<&Arc<P2pTable>>,
) -> Option<Failure> {
    let table = table?;
    let last = layer + 1 == pool.geometry().layers && job.layers.start == 0;
    let got = layer_crcs_parallel(job, layer, pool, table);
    let mut first = None;
    for (p, &crc_now) in got.iter().enumerate() {
        if job.failed(p) {
            continue;
        }
        let check = job.load.as_mut().expect("a load");
        let slot = check.slots[p];
        let mem = job.mem_blocks[p];
        let ok = match pool.layer_crc(slot, layer) {
            Some(want) => crc_now == Some(want),
            // Only a whole-block checksum: checkable once every layer is in.
            None => {
                check.running[p] = (0..2).fold(check.running[p], |crc, kv| {
                    crc32c::crc32c_append(crc, object_bytes(table, mem, layer, kv))
                });
                !last || pool.block_crc(slot).is_none_or(|w| w == check.running[p])
            }
        };
        if ok {
            continue;
        }
        let key = job.keys[p];
        let (dev, off) = pool.layout().object_offset(slot, layer, 0);
        let device = pool
            .devices()
            .get(dev as usize)
            .map(|d| d.path().display().to_string())
            .unwrap_or_else(|| format!("#{dev}"));
        // Only drop the key if the index still maps it to the slot this load
        // read (it may have been dropped and stored anew meanwhile).
        let dropped = if pool.index().get(&key).map(|e| e.slot) == Some(slot) {
            match pool.drop_damaged(&key) {
                Ok(_) => "it was dropped from the pool; store it again".to_string(),
                Err(e) => format!(
                    "it was dropped from the index, but its header could not be cleared ({e})"
                ),
            }
        } else {
            "it was already dropped from the pool".to_string()
        };
        let failure = Failure::corrupt(
            &key.to_string(),
            &device,
            off,
            &format!(
                "layer {layer} (slot {slot}) does not match the checksum stored with it; {dropped}"
            ),
        );
        job.outcomes[p] = Some(KeyOutcome::Corrupt(failure.clone()));
        first.get_or_insert(failure);
    }
    first
}

/// An I/O error that says the device's media failed there (rather than a
/// malformed request, a short transfer or a full filesystem).
fn is_media_error(c: &IoCtx) -> bool {
    match c.status {
        IOCTX_STATUS_ERRNO => c.result as i32 == libc::EIO,
        // NVMe: Media and Data Integrity Errors (status code type 2).
        s if s != IOCTX_STATUS_OK && s < IOCTX_STATUS_ERRNO => (s >> 8) & 0x7 == 2,
        _ => false,
    }
}

fn describe_failure(c: &IoCtx, pool: &Pool) -> IoFailure {
    let device = pool
        .devices()
        .get(c.dev as usize)
        .map(|d| d.path().display().to_string())
        .unwrap_or_else(|| format!("#{}", c.dev));
    let op = match c.op {
        IOCTX_OP_READ => "read",
        IOCTX_OP_WRITE => "write",
        _ => "flush",
    };
    let cause = match c.status {
        IOCTX_STATUS_ERRNO => IoCause::Errno(c.result as i32),
        IOCTX_STATUS_SHORT => IoCause::Short {
            done: c.result as u64,
        },
        IOCTX_STATUS_INVALID => IoCause::Malformed,
        IOCTX_STATUS_TIMEOUT => IoCause::Timeout,
        s => IoCause::NvmeStatus(s as u32),
    };
    IoFailure {
        device,
        offset: c.dev_offset,
        len: c.len as u64,
        op,
        cause,
    }
}
