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
//! data it does not describe. The stores in flight share those flushes
//! (group commit): each flush step waits for the next flush issued after it
//! was reached, which serves every store waiting then.
//!
//! Loads into host memory verify every layer against the crc32c its header
//! recorded before the layer is announced: a block whose bytes differ from what
//! was stored (a flipped bit, a write the device acknowledged but lost) fails
//! with `KeyOutcome::Corrupt` and is dropped from the pool, never returned.
//! A write that fails with an I/O error retires the slots it covered, so one
//! bad region costs its capacity, not the cache.
//!
//! Rooms: this file is the public API; `jobs` the one table of jobs in
//! flight and results to collect; `load` plans reads, verifies layers and
//! announces them; `store` allocates, stages headers and settles stores;
//! `store_plan` is the store protocol as a pure plan (unit-tested alone);
//! `headers` a store's header sectors until they are staged; `hashing` the
//! checksums of registered memory both paths take; `results` finished jobs'
//! results until collected (the staged path keeps its own in the same shape);
//! `window` the adaptive restore window; `path` the job-path trait a scheduler
//! drives (`Tier` and the staged tier implement it); `io` moves planned I/O
//! through the gio_uring ring and accounts completions. Imports between them
//! run one way: `io` -> `store` -> `store_plan` -> `jobs` -> `headers`,
//! `jobs` -> `results`, `load` -> `jobs`, `load`/`store` -> `hashing`.

mod hashing;
mod headers;
mod io;
mod jobs;
mod load;
mod path;
mod results;
mod store;
mod store_plan;
mod trace;
pub mod window;

use crate::engine::uring::{UringConfig, UringDevice, UringEngine};
use crate::engine::{EngineStats, IoEngine};
use crate::error::{Error, Failure, Result};
use crate::memory::{DmaBuffer, HostKvCache, KvMemory, MemoryKind};
use crate::p2p::P2pTable;
use crate::pool::layout::SLOT_HEADER_BYTES;
use crate::pool::{Key, Pool};
use crate::submitter::Submitter;
use jobs::{Item, JobTable};
pub use path::JobPath;
pub(crate) use results::FinishedJobs;
use std::sync::Arc;
use store::Staging;

/// Settings of a `Tier`: [`TierConfig::default`] and the `with_*` setters.
#[non_exhaustive]
#[derive(Clone, Debug, serde::Serialize, serde::Deserialize)]
pub struct TierConfig {
    /// The io_uring engine's settings (when the tier opens one).
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
    /// Bytes of one load's reads in flight at once (at least one I/O):
    /// enough to keep the device at full bandwidth, few enough that reads
    /// land one after another rather than all at a layer's end (at 64K
    /// tokens of llama3-8b a whole 256 MiB layer in flight landed at once
    /// and was hashed after: layer 0 took 1.3-1.45x the average layer;
    /// 32 MiB: 1.1x, same total, on this VM).
    #[serde(default = "load_inflight_bytes_default")]
    pub load_inflight_bytes: u64,
    /// The most bytes of one load's reads in flight: the window starts at
    /// `load_inflight_bytes` and doubles up to this while later layers
    /// arrive measurably faster (`window::RestoreWindow`); equal to
    /// `load_inflight_bytes` keeps it fixed, the default: on the one disk
    /// measured quietly (3 alternating rounds, 2026-11-28) the fixed 32 MiB
    /// restored at 1.048x / 1.146x fio sequential read (4K / 64K tokens of
    /// llama3-8b) against 0.995x / 1.088x for a window growing to 256 MiB.
    /// Raise it for devices that want more depth.
    #[serde(default = "load_inflight_max_bytes_default")]
    pub load_inflight_max_bytes: u64,
    /// Bytes of a load's first layer in flight at once (at least one I/O,
    /// at most half of the layer). The first layer is what the compute
    /// waits for first: its reads go out a few at a time so they land one
    /// after another and each is verified as it lands, leaving only the
    /// last ones' checksums between its landing and the layer's announcement (with the whole layer in
    /// flight its reads landed together and were hashed after: at 4K
    /// tokens of llama3-8b, 16 MiB a layer, that and planning every layer
    /// before issuing the first made layer 0 1.6-2.9x the average layer).
    #[serde(default = "first_layer_inflight_bytes_default")]
    pub first_layer_inflight_bytes: u64,
    /// Verify the checksum of every block loaded into host memory (on by
    /// default; off only to measure what it costs).
    #[serde(default = "verify_loads_default")]
    pub verify_loads: bool,
}

fn verify_loads_default() -> bool {
    true
}

fn load_inflight_bytes_default() -> u64 {
    32 << 20
}

fn load_inflight_max_bytes_default() -> u64 {
    load_inflight_bytes_default()
}

fn first_layer_inflight_bytes_default() -> u64 {
    8 << 20
}

impl Default for TierConfig {
    fn default() -> Self {
        TierConfig {
            uring: UringConfig::default(),
            ring_depth: 64,
            max_io_bytes: 4 << 20,
            header_staging: 8192,
            load_lookahead_bytes: 64 << 20,
            load_inflight_bytes: load_inflight_bytes_default(),
            load_inflight_max_bytes: load_inflight_max_bytes_default(),
            first_layer_inflight_bytes: first_layer_inflight_bytes_default(),
            verify_loads: true,
        }
    }
}

/// The most block headers [`TierConfig::header_staging`] may stage: 1 GiB
/// of host memory, far more than any store in flight needs; a larger value
/// is a mistake (it was allocated as asked, up to 16 TiB).
pub const MAX_HEADER_STAGING: u32 = 1 << 18;

with_setters!(TierConfig {
    /// With these io_uring engine settings.
    with_uring => uring: UringConfig,
    /// With `ring_depth` IOCBs in the gio_uring ring.
    with_ring_depth => ring_depth: u32,
    /// With IOCTXs of at most `max_io_bytes` after coalescing.
    with_max_io_bytes => max_io_bytes: u64,
    /// With `header_staging` block headers staged at once.
    with_header_staging => header_staging: u32,
    /// With loads running at most `load_lookahead_bytes` ahead of their oldest incomplete layer.
    with_load_lookahead_bytes => load_lookahead_bytes: u64,
    /// With `load_inflight_bytes` of one load's reads in flight at once.
    with_load_inflight_bytes => load_inflight_bytes: u64,
    /// With the in-flight window of a load growing up to `load_inflight_max_bytes`.
    with_load_inflight_max_bytes => load_inflight_max_bytes: u64,
    /// With at most `first_layer_inflight_bytes` of a load's first layer in flight at once.
    with_first_layer_inflight_bytes => first_layer_inflight_bytes: u64,
    /// Verifying (or not) the checksum of every block loaded into host memory.
    with_verify_loads => verify_loads: bool,
});

/// A job of a tier.
pub type JobId = u64;

/// Whether a job loads or stores.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
pub enum JobKind {
    /// Pool to memory.
    Load,
    /// Memory to pool.
    Store,
}

/// Refuses a job unless its keys and memory blocks pair one to one, there
/// is at least one, and every block is below `num_blocks`; `memory` names
/// what holds those blocks. Every way a job comes in (tier, staged path,
/// handle, service client) checks it so.
pub(crate) fn check_job_blocks(
    keys: &[Key],
    blocks: &[u32],
    num_blocks: u32,
    memory: &str,
) -> Result<()> {
    if keys.len() != blocks.len() {
        return Err(Error::invalid(format!(
            "{} keys but {} memory blocks: give one memory block per key",
            keys.len(),
            blocks.len()
        )));
    }
    if keys.is_empty() {
        return Err(Error::invalid("a job needs at least one key"));
    }
    if let Some(&b) = blocks.iter().find(|&&b| b >= num_blocks) {
        return Err(Error::invalid(format!(
            "memory block {b} is out of range: {memory} has {num_blocks} blocks (0..{num_blocks})"
        )));
    }
    Ok(())
}

/// "Layer `layer` of load `job` is in memory", or failed to load.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LayerDone {
    /// The load.
    pub job: JobId,
    /// The layer.
    pub layer: u32,
    /// Why some of the layer's reads failed; its memory must not be used.
    pub error: Option<Failure>,
}

/// "Layer `layer` of load `job` is read and verified, and its copy into GPU
/// memory is queued on kvtier's copy stream" (the staged path): a compute
/// stream waits on `mark` rather than the host waiting for [`LayerDone`].
#[derive(Clone)]
pub struct LayerQueued {
    /// The load.
    pub job: JobId,
    /// The layer.
    pub layer: u32,
    /// After the layer's copies on the copy stream.
    pub mark: crate::gpu::wait::CopyMark,
}

/// The outcome of one key of a job.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum KeyOutcome {
    /// Loaded, or stored and durable.
    Done,
    /// Store of a key the pool already held (or another job stored): no I/O.
    AlreadyStored,
    /// Failed: the failure says why (the key's memory must not be used).
    Failed(Failure),
    /// Loaded bytes did not match the checksum stored with the block: the
    /// failure (kind Corrupt) names the device, offset and key. The block was
    /// dropped from the pool (its header invalidated) and is never served
    /// again.
    Corrupt(Failure),
}

impl KeyOutcome {
    /// Done or already stored.
    pub fn is_ok(&self) -> bool {
        !matches!(self, KeyOutcome::Failed(_) | KeyOutcome::Corrupt(_))
    }
}

/// A finished job: one outcome per key.
#[derive(Clone, Debug)]
pub struct JobResult {
    /// The job.
    pub job: JobId,
    /// Load or store.
    pub kind: JobKind,
    /// Its keys, in submission order.
    pub keys: Vec<Key>,
    /// The outcome of each key.
    pub outcomes: Vec<KeyOutcome>,
    /// Keys a store evicted to make room (for the engine's KV events).
    pub evicted: Vec<Key>,
}

impl JobResult {
    /// Every key done.
    pub fn all_ok(&self) -> bool {
        self.outcomes.iter().all(KeyOutcome::is_ok)
    }
    /// Each failed key with its failure.
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

/// What the tier holds, for monitoring.
#[derive(Clone, Debug, serde::Serialize)]
pub struct Usage {
    /// Slots in the pool.
    pub total_blocks: u64,
    /// Slots holding a stored block.
    pub live_blocks: u64,
    /// Slots free.
    pub free_blocks: u64,
    /// Blocks pinned by loads.
    pub pinned_blocks: u64,
    /// Slots being written by stores in flight.
    pub reserved_blocks: u64,
    /// Bytes of one block.
    pub block_bytes: u64,
    /// Bytes the pool can hold.
    pub capacity_bytes: u64,
    /// Bytes of stored blocks.
    pub used_bytes: u64,
    /// Jobs not finished yet.
    pub jobs_in_flight: usize,
    /// The engine's counters.
    pub engine: EngineStats,
}

/// The single-threaded core: a pool, an engine and the registered KV memory; loads and stores as jobs with per-layer completions (the thread-safe front door is [`crate::TierHandle`]).
pub struct Tier {
    // Field order is drop order: the engine (inside `io`) waits out in-flight
    // I/O before the memory it targets (staging, the host cache) goes away.
    io: Submitter,
    staging: Option<Staging>,
    memory_owner: Option<Arc<HostKvCache>>,
    table: Option<Arc<P2pTable>>,
    pool: Pool,
    cfg: TierConfig,
    jobs: JobTable,
    /// An engine failure met while submitting; reported by the next call
    /// that waits or polls.
    engine_error: Option<Error>,
    /// Submissions only plan; I/O reaches the engine in `poll` (the handle's
    /// I/O thread), never on the submitting thread.
    defer_engine_calls: bool,
    /// Per-layer timings of loads (`KVTIER_TRACE_LOADS`), for debugging.
    trace: Option<trace::LoadTrace>,
    /// Per-step timings of stores (`KVTIER_TRACE_STORES`), for debugging.
    store_trace: Option<trace::StoreTrace>,
    /// Bytes of a load's reads in flight past its first layer: adapts to
    /// the device ([`window::RestoreWindow`]).
    window: window::RestoreWindow,
    /// When each live load last announced a layer: the pace its window's
    /// reads arrive at.
    layer_clock: std::collections::HashMap<JobId, std::time::Instant>,
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
        if !(2..=MAX_HEADER_STAGING).contains(&cfg.header_staging) {
            return Err(Error::invalid(format!(
                "TierConfig::header_staging is {}: it must be 2 to {MAX_HEADER_STAGING} (the most new blocks the stores in flight hold together, {SLOT_HEADER_BYTES} B of host memory each); set it in that range",
                cfg.header_staging
            )));
        }
        if !pool.is_writable() {
            return Err(Error::invalid(
                "the pool was opened read-only (Pool::open_read_only); open it with Pool::open to serve it",
            ));
        }
        let window =
            window::RestoreWindow::new(cfg.load_inflight_bytes, cfg.load_inflight_max_bytes);
        Ok(Tier {
            io: Submitter::new(cfg.ring_depth, engine)?,
            staging: None,
            memory_owner: None,
            table: None,
            pool,
            cfg,
            jobs: JobTable::new(),
            engine_error: None,
            defer_engine_calls: false,
            trace: trace::LoadTrace::from_env(),
            store_trace: trace::StoreTrace::from_env(),
            window,
            layer_clock: Default::default(),
        })
    }

    /// Bytes a load keeps in flight past its first layer now: the adaptive
    /// window ([`window::RestoreWindow`]).
    pub fn load_window_bytes(&self) -> u64 {
        self.window.bytes()
    }

    /// The pool.
    pub fn pool(&self) -> &Pool {
        &self.pool
    }

    /// The engine.
    pub fn engine(&self) -> &dyn IoEngine {
        self.io.engine()
    }

    /// New pages now back `ranges` of the registered memory (the service's
    /// arena gives a slice's next client a file of its own, mapped over the
    /// same addresses): make the engine reach them. `Ok(false)`: the engine
    /// can only do it with no I/O in flight; call again later. No job may
    /// target `ranges` meanwhile.
    pub(crate) fn remap_memory(&mut self, ranges: &[crate::p2p::MemRegion]) -> Result<bool> {
        self.io.engine_mut().remap_memory(ranges)
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
        if !self.jobs.live.is_empty() {
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
                "the {} engine cannot reach {:?} memory directly; register host memory, or serve GPU memory through the staged path (TierBuilder::memory, or staged::StagedTier: pinned host staging and a copy kernel per layer); `kvtier doctor` says which path each memory kind takes here",
                self.io.engine().name(),
                mem.kind
            )));
        }
        if mem.kind == MemoryKind::Host {
            // Its shape first (alignment, overlaps, overflow): clearer errors.
            mem.validate()?;
            if let Err((addr, len, why)) = crate::host::maps::check_read_write(&mem.regions()) {
                return Err(Error::Registration(format!(
                    "KV memory at {addr:#x} ({len} bytes) cannot receive loads: {why}; register memory this process can write (not a read-only buffer, tensor or file mapping)"
                )));
            }
        }
        // SAFETY: the caller's contract covers the table built from `mem`.
        unsafe { self.register_table(P2pTable::build(&mem)?) }
    }

    /// Register memory described by a P2P table built elsewhere (the staged
    /// HBM path's host staging, `crate::staged`), as `register_memory`
    /// does for a table it builds.
    ///
    /// # Safety
    /// As `register_memory`: every byte the table's entries address stays
    /// allocated until the tier is dropped or memory is registered again.
    pub unsafe fn register_table(&mut self, mut table: P2pTable) -> Result<()> {
        if !self.jobs.live.is_empty() {
            return Err(Error::invalid(
                "cannot register KV memory while jobs are in flight; wait for them first",
            ));
        }
        if table.geometry() != Some(self.pool.geometry()) {
            return Err(Error::Registration(
                "the P2P table's geometry is not the pool's".into(),
            ));
        }
        if !self.io.engine().reaches(table.kind()) {
            return Err(Error::Unsupported(format!(
                "the {} engine cannot reach {:?} memory",
                self.io.engine().name(),
                table.kind()
            )));
        }
        let n = self.cfg.header_staging;
        let map = DmaBuffer::new(n as usize * SLOT_HEADER_BYTES as usize)?;
        let first_index = table.add_extra_region(map.addr(), SLOT_HEADER_BYTES as u32, n)?;
        let table = Arc::new(table);
        self.io.engine_mut().register_memory(table.clone())?;
        self.table = Some(table);
        self.staging = Some(Staging {
            map: Arc::new(map),
            first_index,
            free: (1..n).rev().collect(),
        });
        self.memory_owner = None;
        Ok(())
    }

    pub(super) fn table(&self) -> Result<&Arc<P2pTable>> {
        self.table.as_ref().ok_or_else(|| {
            Error::invalid(
                "no KV memory registered: call register_memory / register_host_cache first",
            )
        })
    }

    /// How many leading keys the pool holds. No side effects (no LRU touch, no pin).
    pub fn lookup_prefix(&self, keys: &[Key]) -> usize {
        self.pool.index().lookup_prefix(keys)
    }

    /// Like `lookup_prefix`, and pins the keys it counts so they cannot be
    /// evicted before the load that needs them. Undo with `unpin`.
    pub fn lookup_and_pin(&mut self, keys: &[Key]) -> usize {
        self.pool.index_mut().lookup_and_pin(keys)
    }

    /// The pool's index for readers on other threads: lookups, pins and
    /// unpins through it never wait for this tier's I/O, hashing or
    /// planning (see [`crate::pool::index::SharedIndex`]).
    pub fn shared_index(&self) -> crate::pool::index::SharedIndex {
        self.pool.shared_index()
    }

    /// Hold `keys` for a load that runs as several tier jobs (the staged
    /// HBM path's, one tier job per layer) with job pins, as a tier load
    /// holds its own: a caller's stray `unpin` cannot release them between
    /// the layer jobs (with a caller's pin, it could, and a store then
    /// evicted a block the load had still to read). All or nothing: an
    /// unknown key pins none. Returns each key's slot for
    /// [`Self::release_job_keys`].
    pub(crate) fn hold_job_keys(&mut self, keys: &[Key]) -> Result<Vec<u64>> {
        let mut slots = Vec::with_capacity(keys.len());
        // One lock for the check and the pins: nothing evicts in between.
        let mut ix = self.pool.index_mut();
        for k in keys {
            match ix.get(k) {
                Some(e) => slots.push(e.slot),
                None => return Err(Error::UnknownKey { key: k.to_string() }),
            }
        }
        for k in keys {
            ix.pin_job(k);
            ix.touch(k);
        }
        Ok(slots)
    }

    /// Give back what [`Self::hold_job_keys`] took; a key dropped meanwhile
    /// (its block failed verification) gives back its condemned slot.
    pub(crate) fn release_job_keys(&mut self, keys: &[Key], slots: &[u64]) {
        let mut ix = self.pool.index_mut();
        for (k, &slot) in keys.iter().zip(slots) {
            if ix.get(k).map(|e| e.slot) == Some(slot) {
                ix.unpin_job(k);
            } else {
                ix.release_condemned(slot);
            }
        }
    }

    /// Drop one pin per key. Never fails: unknown or unpinned keys are ignored.
    pub fn unpin(&mut self, keys: &[Key]) {
        let mut ix = self.pool.index_mut();
        for k in keys {
            ix.unpin(k);
        }
    }

    /// Take `keys` out of the pool (see [`crate::pool::index::Index::remove`]):
    /// never served again; each slot is free once no load reads it. Keys
    /// not held (never stored, evicted, or still being stored) are skipped.
    /// Returns how many were removed.
    pub fn remove(&mut self, keys: &[Key]) -> usize {
        let mut ix = self.pool.index_mut();
        keys.iter().filter(|k| ix.remove(k).is_some()).count()
    }

    /// Whether the pool holds `key`.
    pub fn contains(&self, key: &Key) -> bool {
        self.pool.index().get(key).is_some()
    }

    pub(super) fn check_mem_blocks(&self, keys: &[Key], mem_blocks: &[u32]) -> Result<()> {
        let table = self.table()?;
        check_job_blocks(
            keys,
            mem_blocks,
            table.num_blocks(),
            "the registered KV memory",
        )
    }

    /// After a job is created its id must reach the caller, so an engine
    /// failure here is kept and reported by the next wait or poll.
    pub(super) fn pump_after_submit(&mut self) {
        if self.defer_engine_calls {
            return;
        }
        if let Err(e) = self.pump() {
            self.engine_error.get_or_insert(e);
        }
    }

    pub(super) fn take_engine_error(&mut self) -> Result<()> {
        match self.engine_error.take() {
            Some(e) => Err(e),
            None => Ok(()),
        }
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

    /// Block until at least one IOCB completes: true; false, without
    /// blocking, when none is in flight or queued to go (nothing would
    /// complete; loaded layers still get announced).
    pub fn wait_any(&mut self) -> Result<bool> {
        self.take_engine_error()?;
        self.fill_iocbs()?;
        if self.jobs.iocb_owner.is_empty() {
            self.pump()?;
            return Ok(false);
        }
        let iocb = self.io.wait_cqe()?;
        self.on_iocb(iocb);
        while let Some(iocb) = self.io.poll()? {
            self.on_iocb(iocb);
        }
        self.pump()?;
        Ok(true)
    }

    fn check_job(&self, id: JobId) -> Result<()> {
        if self.jobs.known(id) {
            Ok(())
        } else {
            Err(Error::invalid(format!(
                "job {id} is unknown or its result was already taken (by wait, poll or get_finished: each result is handed out once)"
            )))
        }
    }

    /// One step of a blocking wait: wait for an IOCB, or fail if nothing
    /// in flight can ever finish the job.
    fn wait_step(&mut self, id: JobId) -> Result<()> {
        if self.jobs.iocb_owner.is_empty() {
            self.pump()?;
            if self.jobs.iocb_owner.is_empty() && self.jobs.live.contains_key(&id) {
                return Err(Error::Ring(format!("job {id} cannot make progress")));
            }
        }
        self.wait_any().map(drop)
    }

    /// Whether store `id` is done reading its memory blocks: every data
    /// write it issued has completed and no worker still hashes them (its
    /// header writes and flushes may still be on their way), or it has
    /// finished. A staged path gathers its next chunk into such a chunk's
    /// staging rather than wait out flushes that other chunks' writes hold
    /// up. False for a load or an unknown job.
    pub fn store_memory_released(&self, id: JobId) -> bool {
        match self.jobs.live.get(&id) {
            Some(j) if j.kind == JobKind::Store => {
                let hashing = j
                    .store
                    .as_ref()
                    .and_then(|s| s.headers.as_ref())
                    .is_some_and(|h| h.worker.is_some());
                !hashing
                    && j.items
                        .iter()
                        .filter(|i| i.step == jobs::Step::Data)
                        .all(Item::complete)
            }
            Some(_) => false,
            None => self.jobs.finished.get(id).is_some_and(|r| r.kind == JobKind::Store),
        }
    }

    /// Block until `job` finishes; returns (and removes) its result. Every
    /// job's result must be collected, here or with `get_finished`.
    pub fn wait(&mut self, id: JobId) -> Result<JobResult> {
        self.check_job(id)?;
        loop {
            if let Some(r) = self.jobs.collect(id) {
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
            match self.jobs.live.get(&id) {
                None => {
                    // Finished: its result says which keys failed.
                    let r = self.jobs.finished.get(id).expect("checked");
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
        self.jobs.layer_events.drain(..).collect()
    }

    /// Layers of `job` in memory so far (from the start of its range).
    pub fn layers_done(&self, id: JobId) -> Option<u32> {
        self.jobs
            .live
            .get(&id)
            .map(|j| j.layers_done - j.layers.start)
    }

    /// Results of every job finished and not yet collected, in finishing order.
    pub fn get_finished(&mut self) -> Vec<JobResult> {
        self.jobs.collect_all()
    }

    /// Wait for every job in flight.
    pub fn drain(&mut self) -> Result<()> {
        while !self.jobs.live.is_empty() {
            let before = self.jobs.live.len();
            self.wait_any()?;
            if self.jobs.iocb_owner.is_empty() && self.jobs.live.len() == before {
                self.pump()?;
                if self.jobs.live.len() == before && self.jobs.iocb_owner.is_empty() {
                    return Err(Error::Ring("jobs in flight cannot make progress".into()));
                }
            }
        }
        Ok(())
    }

    /// Load jobs not yet finished (the scheduler holds writes back while
    /// any read is in flight).
    pub fn loads_in_flight(&self) -> usize {
        self.jobs.count(JobKind::Load)
    }

    /// Store jobs not yet finished.
    pub fn stores_in_flight(&self) -> usize {
        self.jobs.count(JobKind::Store)
    }

    /// What the tier holds now.
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
            jobs_in_flight: self.jobs.live.len(),
            engine: self.io.engine().stats(),
        }
    }

    /// Its settings.
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

    /// Group commit so far: (group flushes issued, store flush steps they
    /// completed). Each store has up to three flush steps (after its
    /// invalidations, its data, its headers); stores in flight together
    /// share flushes, so the second figure exceeds the first.
    pub fn group_flushes(&self) -> (u64, u64) {
        let g = &self.jobs.flush_group;
        (g.issued, g.steps)
    }

    /// Jobs not yet finished (loads and stores).
    pub fn jobs_in_flight(&self) -> usize {
        self.jobs.live.len()
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
            // Past the table's layers the indices reach other blocks' objects
            // (or the header staging), not this block's.
            MemoryKind::Host
                if mem_block < table.num_blocks()
                    && table.geometry().is_some_and(|g| layers <= g.layers) =>
            {
                Some(hashing::layer_crcs(table, mem_block, layers))
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
        // Checksum workers of stores that could not finish read the KV
        // memory, which may go away with the tier: wait for them.
        for job in self.jobs.live.values_mut() {
            if let Some(h) = job.store.as_mut().and_then(|s| s.headers.take()) {
                h.join();
            }
        }
    }
}

/// The checks every load's arguments get, whichever path serves it: a
/// layer range inside the model, and no memory block named by two keys
/// (two reads racing into one block would leave either's bytes).
pub(crate) fn check_load_args(
    layers_in_model: u32,
    mem_blocks: &[u32],
    layers: &std::ops::Range<u32>,
) -> Result<()> {
    if layers.start >= layers.end || layers.end > layers_in_model {
        return Err(Error::invalid(format!(
            "layer range {}..{} is empty or outside the model's {} layers",
            layers.start, layers.end, layers_in_model
        )));
    }
    let mut seen = std::collections::HashSet::new();
    if let Some(&b) = mem_blocks.iter().find(|&&b| !seen.insert(b)) {
        return Err(Error::invalid(format!(
            "memory block {b} is the target of two keys in one load"
        )));
    }
    Ok(())
}
