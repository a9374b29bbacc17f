//! The staged HBM path: a serving engine's KV cache in GPU memory, restored
//! into and stored from through pinned host staging, with any engine that
//! reaches host memory (io_uring, userspace NVMe) and no GPUDirect.
//!
//! Restore. A load is run as one tier job per layer into a *layer buffer*:
//! `layer_buffers` pinned host buffers, each holding one layer of up to
//! `load_blocks` blocks, used round-robin (layer `l` goes to buffer
//! `l % layer_buffers`). A load of more blocks goes in chunks of
//! `load_blocks`, one tier job and one buffer's turn each (chunk `c` of
//! layer `l` is unit `l * chunks + c`, in buffer `unit % layer_buffers`);
//! a layer is announced, and the load's counter reaches its value, once
//! all its chunks are copied. A layer's reads land in its buffer in the pool's
//! coalesced order (the load's blocks take staging places in slot order, so
//! a run of consecutive slots is one contiguous range on the SSD and in the
//! buffer, K objects then V objects). When the tier has verified the layer
//! (per-layer crc32c, the same check as host loads), one launch scatters it
//! into the paged HBM blocks on the copier's stream, which then writes the
//! layer's value into the completion counter: a compute stream waits on it
//! with `cuStreamWaitValue32` ([`LayerWait`]), the host gets the layer's
//! event once the counter has passed it, and only then is the buffer reused.
//! A layer whose copy or counter write fails still brings the load's counter
//! to its value (from the host once the stream's earlier work is done), so
//! a compute stream waiting on it never hangs; its event and `wait_layer`
//! carry the failure, and its keys fail in the load's result.
//! A layer whose buffer is still busy waits (back-pressure), so staging
//! stays `layer_buffers` layers however long the prefix; the reads of layer
//! l+1 run while layer l is copied. Over staging another party lays out
//! block-major per layer (the node service's slice of a client), each
//! buffer's blocks hold every layer: there a unit holds (buffer, layer),
//! and a load keeps up to twice `layer_buffers` units
//! in flight ahead of its copies.
//!
//! Store. The gather kernel copies the blocks' objects from HBM into a store
//! area (`store_blocks` blocks, all layers each) and computes each object's
//! crc32c on the GPU; the per-layer checksums the headers record are
//! combined from those, and the tier writes the staged bytes with its crash
//! protocol. Blocks stored from HBM are thus verifiable like any other. A
//! store goes in chunks of `store_chunk()` blocks, each one gather and one
//! tier store, as many in flight as the area holds: the gather of chunk
//! n+1 runs while chunk n is written (a chunk of the whole area serialized
//! them, the disk idle during each gather and the copier during each write).
//!
//! The copies go through a [`DeviceCopier`]: [`CudaCopier`] on a GPU, or
//! [`HostCopier`], the CPU test double, against host memory standing in for
//! HBM ([`StagedTier::with_host_double`]); both are held to the same tests.

mod buffers;
mod load;
mod store;

use std::collections::{BTreeMap, HashMap, HashSet, VecDeque};
use std::ops::Range;
use std::sync::Arc;

use crate::gpu::staging::{CudaCopier, DeviceCopier, HostCopier};
pub use crate::gpu::wait::{CopyMark, LayerWait, LoadCounter};
pub use buffers::StagingConfig;

use crate::error::{Error, Failure, Result};
use crate::gpu::{check_gpu_kv_memory, CompletionCounter, Context};
use crate::memory::{HostKvCache, KvLayout, KvMemory, MemoryKind};
use crate::p2p::P2pTable;
use crate::pool::Key;
use crate::tier::{
    check_job_blocks, FinishedJobs, JobId, JobKind, JobPath, JobResult, LayerDone, LayerQueued, Tier,
};
use buffers::{Layout, StagingMemory};
use load::LoadJob;
use store::{StoreAgg, StoreJob};

/// "Layer `layer` of staged load `job` is in the KV memory."
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HbmLayer {
    /// The load.
    pub job: JobId,
    /// The layer.
    pub layer: u32,
    /// Why some keys failed in this layer (their blocks must not be used).
    pub error: Option<Failure>,
    /// The copier's completion counter reaches this value once the layer's
    /// copy is done (the host's view; a compute stream waits on the load's
    /// own counter instead, see [`StagedPath::load_counter`]).
    pub counter: u32,
}

/// Over shared staging (the node service's slice), how many times
/// `layer_buffers` units a load keeps in flight ahead of its copies: there
/// every layer buffer holds every layer, so the buffers do not bound the
/// reads ahead, and each read's round trip through the service is hidden
/// only behind reads already queued there.
pub(crate) const SHARED_UNITS_AHEAD: u64 = 2;

/// Job ids of the staged path start here, apart from the tier's own.
pub(crate) const STAGED_JOB_BASE: JobId = 1 << 62;

/// What the staged path runs its reads into and writes from the staging
/// as: one load job per (layer, chunk) into staging blocks, one store job
/// per chunk from staging blocks with the checksums the gather took, and
/// the holds that keep a load's keys in the pool. The in-process [`Tier`]
/// (the staging registered with it) and a client of the node's service
/// (the staging in the memory the service shares with it,
/// `crate::service::ServiceClient`) answer it, so one staged path serves
/// GPU memory either way: same round-robin buffers, chunks, checks, copy
/// marks and counters.
pub trait StagingJobs {
    /// Load `keys` into staging blocks `places` for layer `layer`.
    fn submit_layer_load(&mut self, keys: &[Key], places: &[u32], layer: u32) -> Result<JobId>;
    /// Store `keys` from staging blocks `places`, with each key's per-layer
    /// crc32c as gathered.
    fn submit_chunk_store(
        &mut self,
        keys: &[Key],
        places: &[u32],
        crcs: &[Option<Vec<u32>>],
    ) -> Result<JobId>;
    /// Move the jobs along without blocking.
    fn poll_jobs(&mut self) -> Result<()>;
    /// Results of the jobs that ended since the last call.
    fn finished_jobs(&mut self) -> Vec<JobResult>;
    /// Block until job `id` ends; its result.
    fn wait_job(&mut self, id: JobId) -> Result<JobResult>;
    /// Whether store `id` is done reading its memory (its data written,
    /// its flushes maybe not yet): its staging may take the next chunk.
    /// Where that is not known (false), a chunk's staging waits for its
    /// store's end.
    fn store_memory_released(&self, _id: JobId) -> bool {
        false
    }
    /// Block until some I/O completes; false, without blocking, where that
    /// cannot be waited for alone or nothing is in flight (then a wait is
    /// for a job's end).
    fn wait_any_io(&mut self) -> Result<bool> {
        Ok(false)
    }
    /// Keep `keys` (all in the pool, or an error and nothing held) in the
    /// pool until [`Self::release_keys`]; one token per key.
    fn hold_keys(&mut self, keys: &[Key]) -> Result<Vec<u64>>;
    /// Give back what [`Self::hold_keys`] or [`Self::hold_present`] took.
    fn release_keys(&mut self, keys: &[Key], tokens: &[u64]);
    /// Hold those of `keys` the pool has now: (keys held, tokens).
    fn hold_present(&mut self, keys: &[Key]) -> Result<(Vec<Key>, Vec<u64>)>;
    /// Per held key: whether it left the pool since it was held (a load
    /// found its block damaged): such a key is left out of the layers not
    /// yet read, and fails alone. Asked before each layer's read, and again
    /// once a read was refused (`refused`): a path where the first answer
    /// costs a round trip (the service) may answer it with nothing left
    /// and look only after a refusal.
    fn keys_left(&self, keys: &[Key], tokens: &[u64], refused: bool) -> Vec<bool>;
}

impl StagingJobs for Tier {
    fn submit_layer_load(&mut self, keys: &[Key], places: &[u32], layer: u32) -> Result<JobId> {
        self.submit_load(keys, places, layer..layer + 1)
    }

    fn submit_chunk_store(
        &mut self,
        keys: &[Key],
        places: &[u32],
        crcs: &[Option<Vec<u32>>],
    ) -> Result<JobId> {
        self.submit_store_with_crcs(keys, places, Some(crcs))
    }

    fn poll_jobs(&mut self) -> Result<()> {
        Tier::poll(self)?;
        // The layer jobs' own events: a staged layer is announced after its copy.
        let _ = Tier::layer_events(self);
        Ok(())
    }

    fn finished_jobs(&mut self) -> Vec<JobResult> {
        Tier::get_finished(self)
    }

    fn wait_job(&mut self, id: JobId) -> Result<JobResult> {
        Tier::wait(self, id)
    }

    fn store_memory_released(&self, id: JobId) -> bool {
        Tier::store_memory_released(self, id)
    }

    fn wait_any_io(&mut self) -> Result<bool> {
        Tier::wait_any(self)
    }

    fn hold_keys(&mut self, keys: &[Key]) -> Result<Vec<u64>> {
        // Job pins, not a caller's: see `Tier::hold_job_keys`.
        self.hold_job_keys(keys)
    }

    fn release_keys(&mut self, keys: &[Key], tokens: &[u64]) {
        self.release_job_keys(keys, tokens)
    }

    fn hold_present(&mut self, keys: &[Key]) -> Result<(Vec<Key>, Vec<u64>)> {
        let held: Vec<Key> = keys.iter().filter(|k| self.contains(k)).copied().collect();
        let slots = self.hold_job_keys(&held)?;
        Ok((held, slots))
    }

    fn keys_left(&self, keys: &[Key], tokens: &[u64], _refused: bool) -> Vec<bool> {
        let index = self.pool().index();
        keys.iter()
            .zip(tokens)
            .map(|(k, &slot)| index.get(k).map(|e| e.slot) != Some(slot))
            .collect()
    }
}

/// The staged path's state beside a [`Tier`] whose registered memory is
/// the staging: every call takes that tier. The tier must be drained
/// (see [`StagedPath::drain`]) before this is dropped: its I/O targets the
/// staging memory this owns. [`StagedTier`] keeps the two together.
pub struct StagedPath {
    copier: Box<dyn DeviceCopier>,
    staging: StagingMemory,
    layout: Layout,
    /// Where staging block `p`'s object (layer, K|V) is when the staging is
    /// memory another party lays out (the node service's slice of this
    /// client, block-major per layer); `None`: the layout's own places.
    places: Option<KvMemory>,
    target: KvMemory,
    cfg: StagingConfig,
    /// The user of each layer buffer: (load job, layer, unit); over shared
    /// staging, of each (layer buffer, layer) ([`Self::slot_of`]).
    buffers: Vec<Option<(JobId, u32, u64)>>,
    /// Units a load may have submitted past the next one to copy: the
    /// layer buffers in staging of its own (they bound it anyway), more
    /// over shared staging, where they do not ([`SHARED_UNITS_AHEAD`]).
    ahead: u64,
    store_free: Vec<u32>,
    /// crc32c(K ‖ V) from K's and V's (objects of the geometry's size).
    kv_concat: crate::checksum::CrcConcat,
    /// Most blocks of chunks whose places went back before their tier
    /// store ended: each still holds header staging until it ends, which
    /// the tier's header staging must have room for beside the store area
    /// (0: places go back only when the store ends).
    released_cap: usize,
    loads: BTreeMap<JobId, LoadJob>,
    /// Tier job -> (load job, unit, positions it reads).
    layer_jobs: HashMap<JobId, (JobId, u64, Vec<u32>)>,
    store_jobs: HashMap<JobId, StoreJob>,
    stores: HashMap<JobId, StoreAgg>,
    finished: FinishedJobs,
    events: VecDeque<HbmLayer>,
    /// Layers whose copies are queued (the GPU's: a compute stream waits on
    /// the mark), before their `events` entry.
    queued: Vec<LayerQueued>,
    seq: u32,
    next_job: JobId,
    /// Counters of finished loads, with the value each was left at.
    spare_counters: Vec<(Arc<CompletionCounter>, u32)>,
    /// With `KVTIER_TRACE_STORES` set: when the path opened; each store
    /// chunk's gather and end are printed to stderr in ms since then (the
    /// tier prints each chunk's own steps), to see whether gathers and
    /// writes overlap.
    store_trace: Option<std::time::Instant>,
    _target_owner: Option<Arc<HostKvCache>>,
}

impl StagedPath {
    /// The CPU test double: `cache` (host memory) stands in for the GPU's
    /// KV memory and [`HostCopier`] does the copies the kernels do on a GPU.
    pub fn with_host_double(
        tier: &mut Tier,
        cache: Arc<HostKvCache>,
        cfg: StagingConfig,
    ) -> Result<StagedPath> {
        Self::with_host_copier(tier, cache, cfg, HostCopier::default())
    }

    /// The CPU test double over memory the caller owns (e.g. CPU torch
    /// tensors posing as the GPU's KV memory in Python tests): `mem` is host
    /// memory, aligned for the copies only (16 bytes), and [`HostCopier`]
    /// does the copies the kernels do on a GPU.
    ///
    /// # Safety
    /// Every byte `mem` describes is host memory that stays allocated until
    /// the staged tier is dropped, and no one else writes it while a job
    /// that targets it is in flight.
    pub unsafe fn with_host_double_memory(
        tier: &mut Tier,
        mem: KvMemory,
        cfg: StagingConfig,
    ) -> Result<StagedPath> {
        if mem.kind != MemoryKind::Host {
            return Err(Error::invalid(
                "the staged host double copies with the CPU: its stand-in KV memory must be host memory",
            ));
        }
        let staging = StagingMemory::host(cfg.bytes(&mem.geometry).max(1))?;
        // SAFETY: the caller's contract for `mem`; staging is its own.
        unsafe { Self::new(tier, mem, Box::new(HostCopier::default()), staging, cfg) }
    }

    /// As [`Self::with_host_double`] with a given double (e.g.
    /// [`HostCopier::deferred`], whose copies end only when waited for).
    pub fn with_host_copier(
        tier: &mut Tier,
        cache: Arc<HostKvCache>,
        cfg: StagingConfig,
        copier: HostCopier,
    ) -> Result<StagedPath> {
        let g = cache.memory().geometry;
        cfg.validate(&g)?;
        let staging = StagingMemory::host(cfg.bytes(&g).max(1))?;
        let target = cache.memory().clone();
        // SAFETY: the path keeps `cache` alive; staging is its own.
        let mut s = unsafe { Self::new(tier, target, Box::new(copier), staging, cfg)? };
        s._target_owner = Some(cache);
        Ok(s)
    }

    /// Serve the engine's KV memory in GPU memory `mem` (device pointers of
    /// `ctx`'s device) through pinned staging and the staging kernels.
    ///
    /// # Safety
    /// Every byte `mem` describes must stay allocated until the staged tier
    /// is dropped, and must not be freed while a job that targets it is in
    /// flight.
    pub unsafe fn on_gpu(
        tier: &mut Tier,
        ctx: &Context,
        mem: KvMemory,
        cfg: StagingConfig,
    ) -> Result<StagedPath> {
        if !matches!(mem.kind, MemoryKind::Gpu { .. }) {
            return Err(Error::invalid(
                "the staged HBM path serves GPU memory; register host memory with the tier itself",
            ));
        }
        // Every region is device memory of ctx's device (aligned for the
        // copy kernels; no device DMAs into it, so not for direct I/O).
        check_gpu_kv_memory(ctx, &mem)?;
        cfg.validate(&mem.geometry)?;
        let g = mem.geometry;
        let capacity = (2 * cfg.load_blocks as usize)
            .max(cfg.store_blocks as usize * g.objects_per_block() as usize);
        let copier = CudaCopier::new(ctx, capacity)?;
        let staging = StagingMemory::pinned(ctx, cfg.bytes(&g))?;
        // SAFETY: the caller's contract for `mem`; staging is ours.
        unsafe { Self::new(tier, mem, Box::new(copier), staging, cfg) }
    }

    /// # Safety
    /// `target`'s memory is reachable by `copier` and outlives the result.
    unsafe fn new(
        tier: &mut Tier,
        target: KvMemory,
        copier: Box<dyn DeviceCopier>,
        staging: StagingMemory,
        cfg: StagingConfig,
    ) -> Result<StagedPath> {
        cfg.validate(&target.geometry)?;
        // A staged store chunk of `store_blocks` new blocks is one tier
        // store: larger than the tier's header staging, every one failed.
        let headers = tier.config().header_staging;
        if cfg.store_blocks >= headers {
            return Err(Error::invalid(format!(
                "StagingConfig::store_blocks is {} but TierConfig::header_staging is {headers}: a staged store chunk must fit the header staging (at most header_staging - 1 = {} blocks); lower store_blocks or raise header_staging",
                cfg.store_blocks,
                headers.saturating_sub(1)
            )));
        }
        target.validate_for_copies()?;
        let g = target.geometry;
        if g != *tier.pool().geometry() {
            return Err(Error::Registration(format!(
                "memory has geometry {} but the pool stores {}",
                g.describe(),
                tier.pool().geometry().describe()
            )));
        }
        let layout = Layout::new(&g, &cfg, staging.addr());
        let table = P2pTable::from_objects(
            g,
            layout.load_places() + cfg.store_blocks,
            MemoryKind::Host,
            layout.regions(),
            |b, l, kv| layout.addr(b, l, kv),
        )?;
        // SAFETY: the staging memory lives in self, dropped after the tier.
        // SAFETY: the staging memory lives in the result, which the caller
        // keeps until the tier has drained (StagedPath's contract).
        unsafe { tier.register_table(table)? };
        let mut path = Self::assemble(copier, staging, layout, None, target, cfg);
        // Chunks written but not ended hold header staging beside the
        // chunks in the store area: at most what is left of it, so a
        // chunk's tier store never waits for header staging (checked
        // above: store_blocks < header_staging).
        path.released_cap =
            (cfg.store_blocks as usize).min((headers - 1 - cfg.store_blocks) as usize);
        Ok(path)
    }

    /// The path's state, before any job.
    fn assemble(
        copier: Box<dyn DeviceCopier>,
        staging: StagingMemory,
        layout: Layout,
        places: Option<KvMemory>,
        target: KvMemory,
        cfg: StagingConfig,
    ) -> StagedPath {
        let slots_per_buffer = places.as_ref().map_or(1, |m| m.geometry.layers as usize);
        let ahead = match places {
            Some(_) => SHARED_UNITS_AHEAD * cfg.layer_buffers as u64,
            None => cfg.layer_buffers as u64,
        };
        StagedPath {
            copier,
            staging,
            layout,
            places,
            target,
            cfg,
            buffers: vec![None; cfg.layer_buffers as usize * slots_per_buffer],
            ahead,
            kv_concat: crate::checksum::CrcConcat::new(layout.obj),
            released_cap: 0,
            store_free: (layout.load_places()..layout.load_places() + cfg.store_blocks).collect(),
            loads: BTreeMap::new(),
            layer_jobs: HashMap::new(),
            store_jobs: HashMap::new(),
            stores: HashMap::new(),
            finished: FinishedJobs::default(),
            events: VecDeque::new(),
            queued: Vec::new(),
            seq: 0,
            next_job: STAGED_JOB_BASE,
            spare_counters: Vec::new(),
            store_trace: std::env::var_os("KVTIER_TRACE_STORES").map(|_| std::time::Instant::now()),
            _target_owner: None,
        }
    }

    /// A staged path whose staging is block-major memory `staging` that
    /// something else reads into and writes from (the node service, through
    /// the slice it shares with this client; `keep` keeps it mapped): its
    /// blocks `0..layer_buffers * load_blocks` are the layer buffers'
    /// places, the next `store_blocks` the store area. The copies go
    /// through the staging kernels on a GPU (`target` GPU memory: the
    /// staging registered as pinned here), or the CPU double (`target` host
    /// memory standing in for it, copied by [`HostCopier`]).
    ///
    /// # Safety
    /// `staging` describes host memory mapped while `keep` lives; every
    /// byte `target` describes stays allocated until the path is dropped.
    pub unsafe fn over_shared_staging(
        staging: KvMemory,
        keep: Arc<dyn Send + Sync>,
        target: KvMemory,
        cfg: StagingConfig,
    ) -> Result<StagedPath> {
        cfg.validate(&target.geometry)?;
        target.validate_for_copies()?;
        let g = target.geometry;
        if staging.geometry != g {
            return Err(Error::Registration(format!(
                "memory has geometry {} but the pool stores {}",
                g.describe(),
                staging.geometry.describe()
            )));
        }
        let KvLayout::BlockMajor { layer_bases } = &staging.layout else {
            return Err(Error::invalid(
                "shared staging must be block-major per layer (the service's slice)",
            ));
        };
        // (The service's tier bounds a store chunk by its header staging,
        // 8192 blocks by default, far past a slice's blocks: a chunk past it
        // would fail its keys with the tier's error.)
        let layout = Layout::new(&g, &cfg, 0);
        let need = layout.load_places() as u64 + cfg.store_blocks as u64;
        if need > staging.num_blocks as u64 {
            return Err(Error::invalid(format!(
                "staging of {} layer buffers of {} load blocks and {} store blocks takes {need} blocks of the {} shared with the service; lower StagingConfig's sizes or share more blocks",
                cfg.layer_buffers, cfg.load_blocks, cfg.store_blocks, staging.num_blocks
            )));
        }
        // The mapping's extent: from the lowest layer base to the end of
        // the highest layer's blocks.
        let lo = layer_bases.iter().copied().min().unwrap_or(0);
        let hi = layer_bases.iter().copied().max().unwrap_or(0)
            + 2 * staging.num_blocks as u64 * g.object_bytes();
        let (copier, ctx): (Box<dyn DeviceCopier>, Option<Context>) = match target.kind {
            MemoryKind::Gpu { ordinal } => {
                let ctx = Context::primary(&crate::gpu::Device::get(ordinal as i32)?)?;
                check_gpu_kv_memory(&ctx, &target)?;
                let capacity = (2 * cfg.load_blocks as usize)
                    .max(cfg.store_blocks as usize * g.objects_per_block() as usize);
                (Box::new(CudaCopier::new(&ctx, capacity)?), Some(ctx))
            }
            MemoryKind::Host => (Box::new(HostCopier::default()), None),
        };
        // SAFETY: the caller's contract for the staging's range and `keep`.
        let staging_mem = unsafe { StagingMemory::shared(ctx.as_ref(), lo, hi - lo, keep)? };
        Ok(Self::assemble(
            copier,
            staging_mem,
            layout,
            Some(staging),
            target,
            cfg,
        ))
    }

    /// The host address of staging block `place`'s object (`layer`, `kv`)
    /// (of `self.places`, else `self.layout`'s; fields, so a caller may
    /// hold a load's entry meanwhile).
    fn place_addr(
        places: &Option<KvMemory>,
        layout: &Layout,
        place: u32,
        layer: u32,
        kv: u32,
    ) -> u64 {
        match places {
            Some(m) => m.object_addr(place, layer, kv),
            None => layout.addr(place, layer, kv),
        }
    }

    /// Where the use of layer buffer `buf` for layer `layer` is recorded
    /// in `buffers`: the buffer in staging of its own (one layer's room);
    /// over shared staging, the buffer's blocks hold every layer (the
    /// service's slice is block-major per layer), so a unit of one layer
    /// never touches another layer's bytes and the pair is the unit of use.
    fn slot_of(places: &Option<KvMemory>, buf: u32, layer: u32) -> usize {
        match places {
            Some(m) => (buf * m.geometry.layers + layer) as usize,
            None => buf as usize,
        }
    }

    /// Its staging settings.
    pub fn config(&self) -> &StagingConfig {
        &self.cfg
    }

    /// The KV memory served (GPU memory, or the double's stand-in).
    pub fn memory(&self) -> &KvMemory {
        &self.target
    }

    /// The completion counter the copies advance, for compute streams to
    /// wait on (`None` with the host double).
    pub fn counter(&self) -> Option<&Arc<CompletionCounter>> {
        self.copier.counter()
    }

    /// The counter value the next layer copied will carry: with one load in
    /// flight, of at most `load_blocks` keys (one chunk a layer), layer `l`
    /// of a load submitted now carries `next_counter_value() + (l - first
    /// layer)`; a larger load's layers each take one value per chunk.
    pub fn next_counter_value(&self) -> u32 {
        self.seq.wrapping_add(1)
    }

    /// The counter a compute stream waits on for load `id`'s layers
    /// (queue the waits right after `submit_load`, with
    /// [`LayerWait::queue`] and [`LoadCounter::value_for`]); `None` once
    /// the load has finished. With the host double it is a host word
    /// ([`CompletionCounter::host_double`]) no stream can wait on, written
    /// as a GPU's would be.
    pub fn load_counter(&self, id: JobId) -> Option<LoadCounter> {
        self.loads.get(&id)?.counter.clone()
    }

    /// Which layer buffers are in use, and by what (load job, layer); over
    /// shared staging, per (layer buffer, layer): entry `buf * layers + layer`.
    pub fn buffers_in_use(&self) -> Vec<Option<(JobId, u32)>> {
        self.buffers
            .iter()
            .map(|b| b.map(|(id, l, _)| (id, l)))
            .collect()
    }

    fn check_blocks(&self, keys: &[Key], blocks: &[u32], most: u32, what: &str) -> Result<()> {
        check_job_blocks(
            keys,
            blocks,
            self.target.num_blocks,
            "the registered KV memory",
        )?;
        if keys.len() > most as usize {
            return Err(Error::invalid(format!(
                "a {what} of {} blocks exceeds the staging's {most}; split the job or raise StagingConfig::{what}_blocks",
                keys.len()
            )));
        }
        Ok(())
    }

    fn on_tier_result(&mut self, r: JobResult) {
        if let Some((id, u, live)) = self.layer_jobs.remove(&r.job) {
            let job = self.loads.get_mut(&id).expect("a load of a layer job");
            job.tier_jobs_out -= 1;
            job.landed.insert(u, (live, Some(r)));
        } else if let Some(s) = self.store_jobs.remove(&r.job) {
            if let Some(t0) = self.store_trace {
                eprintln!(
                    "kvtier staged store {}: chunk at key {} (tier store {}) ended at {:.2} ms, {} chunks still out",
                    s.id,
                    s.offset,
                    r.job,
                    t0.elapsed().as_secs_f64() * 1e3,
                    self.store_jobs.len()
                );
            }
            if !s.released {
                self.store_free.extend(s.places);
            }
            if let Some(a) = self.stores.get_mut(&s.id) {
                for (i, o) in r.outcomes.into_iter().enumerate() {
                    a.outcomes[s.offset + i] = Some(o);
                }
                a.evicted.extend(r.evicted);
                a.chunks_out -= 1;
            }
        }
    }

    /// Give back the store staging of chunks whose data is written: their
    /// tier stores only flush and write headers now, and a flush waits for
    /// every write queued before it (the later chunks'), so a chunk held
    /// its staging until the chunks after it were written too and the
    /// next gather found the disk idle.
    /// At most `released_cap` blocks of such chunks at once (their tier
    /// stores hold header staging until they end), oldest chunks first.
    fn release_written_chunks(&mut self, tier: &dyn StagingJobs) {
        let mut released = self.released_blocks();
        let mut jobs: Vec<JobId> = self
            .store_jobs
            .iter()
            .filter(|(_, s)| !s.released)
            .map(|(&t, _)| t)
            .collect();
        jobs.sort_unstable();
        for t in jobs {
            let s = self.store_jobs.get_mut(&t).expect("listed");
            if released + s.places.len() > self.released_cap {
                break;
            }
            if tier.store_memory_released(t) {
                s.released = true;
                released += s.places.len();
                self.store_free.extend_from_slice(&s.places);
            }
        }
    }

    /// Blocks of chunks whose places went back before their stores ended.
    fn released_blocks(&self) -> usize {
        self.store_jobs
            .values()
            .filter(|s| s.released)
            .map(|s| s.places.len())
            .sum()
    }

    fn finish(&mut self, r: JobResult) {
        self.finished.push(r);
    }

    /// Move everything along without blocking.
    pub fn poll(&mut self, tier: &mut dyn StagingJobs) -> Result<()> {
        self.poll_copies(tier)?;
        self.poll_reads(tier)
    }

    /// The first half of [`Self::poll`]: take the tier's results, copy
    /// what landed, announce what is copied; no new layer is asked for.
    /// Where asking costs a round trip each (the node service), a caller
    /// hands out this half's events before [`Self::poll_reads`]: a layer
    /// copied is not held back behind the requests for the next ones.
    pub fn poll_copies(&mut self, tier: &mut dyn StagingJobs) -> Result<()> {
        tier.poll_jobs()?;
        for r in tier.finished_jobs() {
            self.on_tier_result(r);
        }
        self.release_written_chunks(tier);
        self.push_stores(tier);
        self.finish_stores();
        self.scatter_landed()?;
        self.retire(tier)
    }

    /// The second half of [`Self::poll`]: ask for the layers whose turn
    /// has come.
    pub fn poll_reads(&mut self, tier: &mut dyn StagingJobs) -> Result<()> {
        self.submit_layers(tier);
        // A load whose every key has failed learns it in `submit_layers`
        // (its later layers are skipped); with nothing of it in flight no
        // later event would move it on, so its skipped layers are announced
        // and the load ended now, or a wait would find nothing to wait for.
        self.scatter_landed()?;
        self.retire(tier)?;
        Ok(())
    }

    /// Block until something moves: the oldest tier job ends, or the copies
    /// started finish.
    fn wait_some(&mut self, tier: &mut dyn StagingJobs) -> Result<()> {
        // Chunks wait for store staging that chunks being written hold: the
        // next completion may be the data write that frees it, long before
        // the oldest job ends (its flushes wait for the later chunks' writes).
        let chunks_waiting = self.stores.values().any(|a| a.next < a.keys.len());
        let releasable = self.released_blocks() < self.released_cap
            && self.store_jobs.values().any(|s| !s.released);
        if chunks_waiting && releasable && tier.wait_any_io()? {
            return Ok(());
        }
        let oldest = self
            .layer_jobs
            .keys()
            .chain(self.store_jobs.keys())
            .min()
            .copied();
        if let Some(t) = oldest {
            let r = tier.wait_job(t)?;
            self.on_tier_result(r);
        } else if self.loads.values().any(|j| !j.copying.is_empty()) {
            self.copier.finish()?;
        } else {
            return Err(Error::internal(
                "staged tier: a job is unfinished with nothing in flight",
            ));
        }
        Ok(())
    }

    /// The id a new job gets: `want` when the caller numbers its jobs,
    /// refused while a job of that id is in flight or uncollected; else the
    /// path's next.
    fn claim(&self, want: Option<JobId>) -> Result<JobId> {
        match want {
            None => Ok(self.next_job),
            Some(id) if self.known(id) => Err(Error::invalid(format!(
                "job id {id} is in use: give each staged job its own id"
            ))),
            Some(id) => Ok(id),
        }
    }

    fn known(&self, id: JobId) -> bool {
        self.loads.contains_key(&id) || self.finished.contains(id) || self.stores.contains_key(&id)
    }

    /// Wait for job `id` and take its result.
    pub fn wait(&mut self, tier: &mut dyn StagingJobs, id: JobId) -> Result<JobResult> {
        if !self.known(id) {
            return Err(Error::invalid(format!(
                "no staged job {id} in flight or unreported"
            )));
        }
        loop {
            self.poll(tier)?;
            if let Some(r) = self.finished.take(id) {
                return Ok(r);
            }
            self.wait_some(tier)?;
        }
    }

    /// Wait until layer `layer` of load `id` is in the KV memory. As
    /// `Tier::wait_layer`: an error if the layer failed (a key's bytes did
    /// not verify, a read failed: its memory must not be used), or, once the
    /// load has ended, if any key failed; a layer the load does not cover is
    /// refused (it is never "in memory").
    pub fn wait_layer(&mut self, tier: &mut dyn StagingJobs, id: JobId, layer: u32) -> Result<()> {
        if !self.known(id) || self.stores.contains_key(&id) {
            return Err(Error::invalid(format!(
                "no staged load {id} in flight or unreported"
            )));
        }
        loop {
            self.poll(tier)?;
            match self.loads.get(&id) {
                Some(j) if !j.layers.contains(&layer) => {
                    return Err(Error::invalid(format!(
                        "job {id} is not a load of layer {layer}"
                    )))
                }
                Some(j) if j.announced <= layer => self.wait_some(tier)?,
                Some(j) => {
                    return match &j.layer_errors[(layer - j.layers.start) as usize] {
                        Some(f) => Err(Error::Failed(
                            f.context(format_args!("layer {layer} of job {id} failed")),
                        )),
                        None => Ok(()),
                    }
                }
                None => {
                    return match self.finished.get(id) {
                        Some(r) if r.kind != JobKind::Load => Err(Error::invalid(format!(
                            "job {id} is not a load of layer {layer}"
                        ))),
                        Some(r) => match r.failures().next() {
                            Some((k, f)) => Err(Error::Failed(
                                f.context(format_args!("job {id} failed to load key {k}")),
                            )),
                            None => Ok(()),
                        },
                        None => Ok(()),
                    }
                }
            }
        }
    }

    /// Layers that reached the KV memory since the last call, in layer
    /// order per load.
    pub fn layer_events(&mut self) -> Vec<HbmLayer> {
        self.events.drain(..).collect()
    }

    /// Layers whose copy into KV memory was queued since the last call, in
    /// layer order per load (each before its [`Self::layer_events`] entry).
    pub fn layers_queued(&mut self) -> Vec<LayerQueued> {
        std::mem::take(&mut self.queued)
    }

    /// Results of jobs that ended, in the order they ended.
    pub fn get_finished(&mut self) -> Vec<JobResult> {
        self.finished.take_all()
    }

    /// Wait for every job.
    pub fn drain(&mut self, tier: &mut dyn StagingJobs) -> Result<()> {
        loop {
            self.poll(tier)?;
            if self.loads.is_empty() && self.stores.is_empty() {
                return Ok(());
            }
            self.wait_some(tier)?;
        }
    }
}

impl StagedPath {
    /// Whether `id` is a job of the staged path (not one of the tier's).
    pub fn owns(id: JobId) -> bool {
        id >= STAGED_JOB_BASE
    }

    /// Staged loads and stores not yet finished.
    pub fn jobs_in_flight(&self) -> usize {
        self.loads.len() + self.stores.len()
    }

    /// Loads in flight.
    pub fn loads_in_flight(&self) -> usize {
        self.loads.len()
    }

    /// Chunks of staged stores gathered and handed to the tier whose tier
    /// stores have not been seen to end (each holds its store places until
    /// its data is written, its header staging until it ends).
    pub fn store_chunks_in_flight(&self) -> usize {
        self.store_jobs.len()
    }

    /// The first of `blocks` (of the KV memory served) that a staged job of
    /// `kind` uses: a load writing it, or a store that has still to gather
    /// it (a gathered chunk reads the staging, no longer the block). One set
    /// of the jobs' blocks, so the check is linear in the blocks, not their
    /// product (a 64K-token load beside a large store is 4096 x 4096 blocks).
    pub fn block_in_use(&self, blocks: &[u32], kind: JobKind) -> Option<u32> {
        let busy: HashSet<u32> = match kind {
            JobKind::Load => self
                .loads
                .values()
                .flat_map(|j| j.hbm.iter().copied())
                .collect(),
            JobKind::Store => self
                .stores
                .values()
                .flat_map(|a| a.mem_blocks[a.next..].iter().copied())
                .collect(),
        };
        if busy.is_empty() {
            return None;
        }
        blocks.iter().copied().find(|b| busy.contains(b))
    }

    /// Copies started whose end only a later poll sees (no fd says so:
    /// the copier's counter is polled).
    pub fn copies_pending(&self) -> bool {
        self.loads.values().any(|j| !j.copying.is_empty())
    }
}

/// A [`Tier`] and the [`StagedPath`] serving GPU memory through it, kept
/// together so that the tier's I/O drains before the staging goes.
pub struct StagedTier {
    // Field order is drop order: the tier drains its I/O into staging first.
    tier: Tier,
    path: StagedPath,
}

impl StagedTier {
    /// The CPU test double: `cache` (host memory) stands in for the GPU's
    /// KV memory and [`HostCopier`] does the copies the kernels do on a GPU.
    pub fn with_host_double(
        mut tier: Tier,
        cache: Arc<HostKvCache>,
        cfg: StagingConfig,
    ) -> Result<StagedTier> {
        let path = StagedPath::with_host_double(&mut tier, cache, cfg)?;
        Ok(StagedTier { tier, path })
    }

    /// As [`StagedPath::with_host_double_memory`], with the tier.
    ///
    /// # Safety
    /// As [`StagedPath::with_host_double_memory`].
    pub unsafe fn with_host_double_memory(
        mut tier: Tier,
        mem: KvMemory,
        cfg: StagingConfig,
    ) -> Result<StagedTier> {
        // SAFETY: the caller's contract.
        let path = unsafe { StagedPath::with_host_double_memory(&mut tier, mem, cfg)? };
        Ok(StagedTier { tier, path })
    }

    /// As [`Self::with_host_double`] with a given double.
    pub fn with_host_copier(
        mut tier: Tier,
        cache: Arc<HostKvCache>,
        cfg: StagingConfig,
        copier: HostCopier,
    ) -> Result<StagedTier> {
        let path = StagedPath::with_host_copier(&mut tier, cache, cfg, copier)?;
        Ok(StagedTier { tier, path })
    }

    /// GPU memory `mem` of `ctx`'s device, through pinned staging.
    ///
    /// # Safety
    /// As [`StagedPath::on_gpu`].
    pub unsafe fn on_gpu(
        mut tier: Tier,
        ctx: &Context,
        mem: KvMemory,
        cfg: StagingConfig,
    ) -> Result<StagedTier> {
        // SAFETY: the caller's contract.
        let path = unsafe { StagedPath::on_gpu(&mut tier, ctx, mem, cfg)? };
        Ok(StagedTier { tier, path })
    }

    /// The tier under the staged path.
    pub fn tier(&self) -> &Tier {
        &self.tier
    }

    /// The staged path.
    pub fn path(&self) -> &StagedPath {
        &self.path
    }

    /// Its staging settings.
    pub fn config(&self) -> &StagingConfig {
        self.path.config()
    }

    /// The GPU KV memory it serves.
    pub fn memory(&self) -> &KvMemory {
        self.path.memory()
    }

    /// The completion counter streams wait on, when there is one.
    pub fn counter(&self) -> Option<&Arc<CompletionCounter>> {
        self.path.counter()
    }

    /// The value the counter takes after the next layer lands.
    pub fn next_counter_value(&self) -> u32 {
        self.path.next_counter_value()
    }

    /// Per layer buffer, the (load, layer) it holds.
    pub fn buffers_in_use(&self) -> Vec<Option<(JobId, u32)>> {
        self.path.buffers_in_use()
    }

    /// The counter of load `id` (while in flight).
    pub fn load_counter(&self, id: JobId) -> Option<LoadCounter> {
        self.path.load_counter(id)
    }

    /// Loads `keys` into GPU memory blocks `mem_blocks` through staging, layer by layer.
    pub fn submit_load(
        &mut self,
        keys: &[Key],
        mem_blocks: &[u32],
        layers: Range<u32>,
    ) -> Result<JobId> {
        self.path
            .submit_load(&mut self.tier, keys, mem_blocks, layers)
    }

    /// Stores GPU memory blocks `mem_blocks` under `keys`, gathered through staging.
    pub fn submit_store(&mut self, keys: &[Key], mem_blocks: &[u32]) -> Result<JobId> {
        self.path.submit_store(&mut self.tier, keys, mem_blocks)
    }

    /// Advances everything in flight without blocking.
    pub fn poll(&mut self) -> Result<()> {
        self.path.poll(&mut self.tier)
    }

    /// Waits for job `id` and returns its result.
    pub fn wait(&mut self, id: JobId) -> Result<JobResult> {
        self.path.wait(&mut self.tier, id)
    }

    /// Waits until `layer` of load `id` is in GPU memory.
    pub fn wait_layer(&mut self, id: JobId, layer: u32) -> Result<()> {
        self.path.wait_layer(&mut self.tier, id, layer)
    }

    /// Layers landed since the last call.
    pub fn layer_events(&mut self) -> Vec<HbmLayer> {
        self.path.layer_events()
    }

    /// Layers whose copy was queued since the last call.
    pub fn layers_queued(&mut self) -> Vec<LayerQueued> {
        self.path.layers_queued()
    }

    /// Jobs finished since the last call.
    pub fn get_finished(&mut self) -> Vec<JobResult> {
        self.path.get_finished()
    }

    /// Waits for every job in flight.
    pub fn drain(&mut self) -> Result<()> {
        self.path.drain(&mut self.tier)
    }
}

impl JobPath for StagedTier {
    fn tier(&self) -> &Tier {
        &self.tier
    }

    fn tier_mut(&mut self) -> &mut Tier {
        &mut self.tier
    }

    fn submit_load(
        &mut self,
        id: JobId,
        keys: &[Key],
        mem_blocks: &[u32],
        layers: Range<u32>,
    ) -> Result<()> {
        self.path
            .load_job(&mut self.tier, Some(id), keys, mem_blocks, layers)
            .map(|_| ())
    }

    fn submit_store(
        &mut self,
        id: JobId,
        keys: &[Key],
        mem_blocks: &[u32],
        _crcs: Option<&[Option<Vec<u32>>]>,
    ) -> Result<()> {
        // The checksums are taken on the GPU as the blocks are gathered.
        self.path
            .store_job(&mut self.tier, Some(id), keys, mem_blocks)
            .map(|_| ())
    }

    fn poll(&mut self) -> Result<()> {
        StagedTier::poll(self)
    }

    fn layers_queued(&mut self) -> Vec<LayerQueued> {
        StagedTier::layers_queued(self)
    }

    fn layer_events(&mut self) -> Vec<LayerDone> {
        StagedTier::layer_events(self)
            .into_iter()
            .map(|e| LayerDone {
                job: e.job,
                layer: e.layer,
                error: e.error,
            })
            .collect()
    }

    fn get_finished(&mut self) -> Vec<JobResult> {
        StagedTier::get_finished(self)
    }

    fn wait(&mut self, id: JobId) -> Result<JobResult> {
        StagedTier::wait(self, id)
    }

    fn drain(&mut self) -> Result<()> {
        StagedTier::drain(self)
    }

    fn jobs_in_flight(&self) -> usize {
        self.path.jobs_in_flight()
    }

    fn loads_in_flight(&self) -> usize {
        self.path.loads_in_flight()
    }

    fn completions_pending(&self) -> bool {
        self.tier.completions_pending() || self.path.copies_pending()
    }

    fn block_in_use(&self, blocks: &[u32], kind: JobKind) -> Option<u32> {
        self.path.block_in_use(blocks, kind)
    }

    fn caller_crc_table(&self) -> Option<Arc<P2pTable>> {
        None
    }

    fn load_counter(&self, id: JobId) -> Option<LoadCounter> {
        self.path.load_counter(id)
    }

    fn into_tier(self: Box<Self>) -> Result<Tier> {
        Err(Error::invalid(
            "a staged scheduler's tier reads and writes its staging: drain() the scheduler instead of taking the tier",
        ))
    }
}

impl Drop for StagedTier {
    fn drop(&mut self) {
        // Stores in flight land (their bytes are in staging), as Tier's drop does.
        let _ = self.drain();
    }
}
