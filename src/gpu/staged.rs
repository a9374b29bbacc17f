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
//! l+1 run while layer l is copied.
//!
//! Store. The gather kernel copies the blocks' objects from HBM into a store
//! area (`store_blocks` blocks, all layers each) and computes each object's
//! crc32c on the GPU; the per-layer checksums the headers record are
//! combined from those, and the tier writes the staged bytes with its crash
//! protocol. Blocks stored from HBM are thus verifiable like any other.
//!
//! The copies go through a [`DeviceCopier`]: [`CudaCopier`] on a GPU, or
//! [`HostCopier`], the CPU test double, against host memory standing in for
//! HBM ([`StagedTier::with_host_double`]); both are held to the same tests.

use std::collections::{BTreeMap, HashMap, HashSet, VecDeque};
use std::ops::Range;
use std::sync::Arc;

use super::staging::{CopyDesc, CudaCopier, DeviceCopier, HostCopier};
use super::{
    abi, check_gpu_kv_memory, kernels, CompletionCounter, Context, Function, HostRegistration,
    KernelArgs, LaunchConfig, Module, RegisterFlags, Stream, WaitCond,
};
use crate::error::{Error, ErrorKind, Failure, Result};
use crate::memory::{DmaBuffer, HostKvCache, KvMemory, MemoryKind};
use crate::model::KvGeometry;
use crate::p2p::{MemRegion, P2pTable};
use crate::pool::Key;
use crate::tier::{JobId, JobKind, JobResult, KeyOutcome, Tier};

/// How much pinned staging the staged path holds: [`StagingConfig::for_blocks`]
/// and the `with_*` setters.
#[non_exhaustive]
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct StagingConfig {
    /// Layers of loads in flight at once (each its own buffer, reused
    /// round-robin). At least 2, so the reads of one layer overlap the copy
    /// of the one before.
    pub layer_buffers: u32,
    /// Blocks of one layer a layer buffer holds; a larger load goes through
    /// in chunks of this many per layer (each a buffer's turn).
    pub load_blocks: u32,
    /// Blocks the stores in flight may hold in staging (all layers each);
    /// a larger store goes out in chunks of this many.
    pub store_blocks: u32,
}

impl StagingConfig {
    /// `layer_buffers` layer buffers of `load_blocks` blocks each (larger
    /// loads go in chunks), stores in chunks of `store_blocks` (checked when
    /// the staged path opens).
    pub fn new(layer_buffers: u32, load_blocks: u32, store_blocks: u32) -> StagingConfig {
        StagingConfig {
            layer_buffers,
            load_blocks,
            store_blocks,
        }
    }

    /// Defaults for KV memory of `num_blocks` blocks: 4 layer buffers of
    /// 1024 blocks (larger loads go in chunks), stores in chunks of 64.
    pub fn for_blocks(num_blocks: u32) -> StagingConfig {
        StagingConfig {
            layer_buffers: 4,
            load_blocks: num_blocks.clamp(1, 1024),
            store_blocks: num_blocks.clamp(1, 64),
        }
    }

    /// With `layer_buffers` layer buffers.
    #[must_use]
    pub fn with_layer_buffers(mut self, layer_buffers: u32) -> Self {
        self.layer_buffers = layer_buffers;
        self
    }

    /// With loads of up to `load_blocks` blocks.
    #[must_use]
    pub fn with_load_blocks(mut self, load_blocks: u32) -> Self {
        self.load_blocks = load_blocks;
        self
    }

    /// With up to `store_blocks` blocks of stores in staging.
    #[must_use]
    pub fn with_store_blocks(mut self, store_blocks: u32) -> Self {
        self.store_blocks = store_blocks;
        self
    }

    /// Bytes of pinned host memory this staging takes for `g` (`u64::MAX`
    /// when that overflows: such a staging is refused).
    pub fn bytes(&self, g: &KvGeometry) -> u64 {
        self.checked_bytes(g).unwrap_or(u64::MAX)
    }

    // Checked: the sizes come from callers (Python, a CLI flag) and their
    // product overflowed into a panic (debug) or a wrapped, too-small
    // staging (release) before it was refused.
    fn checked_bytes(&self, g: &KvGeometry) -> Option<u64> {
        let obj = g.object_bytes();
        let load = (self.layer_buffers as u64)
            .checked_mul(2 * self.load_blocks as u64)?
            .checked_mul(obj)?;
        let store = (self.store_blocks as u64)
            .checked_mul(g.objects_per_block() as u64)?
            .checked_mul(obj)?;
        load.checked_add(store)
    }

    fn validate(&self, g: &KvGeometry) -> Result<()> {
        if self.layer_buffers < 2 || self.load_blocks == 0 || self.store_blocks == 0 {
            return Err(Error::invalid(format!(
                "staging of {} layer buffers, {} load blocks, {} store blocks: need at least 2 layer buffers and 1 block each",
                self.layer_buffers, self.load_blocks, self.store_blocks
            )));
        }
        // Saturating: each factor is a u32, the sum of products fits a u64
        // but not its product with a model's objects per block.
        let objects = (self.layer_buffers as u64 * self.load_blocks as u64
            + self.store_blocks as u64)
            .saturating_mul(g.objects_per_block() as u64);
        if objects > u32::MAX as u64 / 2 {
            return Err(Error::invalid(format!(
                "staging of {} layer buffers of {} load blocks and {} store blocks is {objects} objects, more than a P2P table indexes (2^31); lower StagingConfig::layer_buffers, load_blocks or store_blocks",
                self.layer_buffers, self.load_blocks, self.store_blocks
            )));
        }
        match self.checked_bytes(g) {
            Some(b) if b <= isize::MAX as u64 => Ok(()),
            _ => Err(Error::invalid(format!(
                "staging of {} layer buffers of {} load blocks and {} store blocks is more bytes than memory can map; lower StagingConfig's sizes",
                self.layer_buffers, self.load_blocks, self.store_blocks
            ))),
        }
    }
}

/// Where each staged object lives. The tier's staging blocks
/// `0..layer_buffers * load_blocks` are the layer buffers' places: place
/// `t` is place `t % load_blocks` of buffer `t / load_blocks`, whatever the
/// layer (a buffer holds one layer of one chunk of a load at a time: K
/// objects of all its places then V objects), so a load's chunk is read
/// into whichever buffer is its turn; the blocks after are the store area
/// (a block's 2L objects contiguous).
#[derive(Clone, Copy, Debug)]
struct Layout {
    obj: u64,
    layers: u32,
    buffers: u32,
    load_blocks: u32,
    store_blocks: u32,
    load_base: u64,
    store_base: u64,
}

impl Layout {
    fn new(g: &KvGeometry, cfg: &StagingConfig, base: u64) -> Layout {
        let obj = g.object_bytes();
        Layout {
            obj,
            layers: g.layers,
            buffers: cfg.layer_buffers,
            load_blocks: cfg.load_blocks,
            store_blocks: cfg.store_blocks,
            load_base: base,
            store_base: base + cfg.layer_buffers as u64 * 2 * cfg.load_blocks as u64 * obj,
        }
    }

    fn buffer_bytes(&self) -> u64 {
        2 * self.load_blocks as u64 * self.obj
    }

    fn load_obj(&self, buffer: u32, sblock: u32, kv: u32) -> u64 {
        self.load_base
            + buffer as u64 * self.buffer_bytes()
            + (kv as u64 * self.load_blocks as u64 + sblock as u64) * self.obj
    }

    fn store_obj(&self, s: u32, layer: u32, kv: u32) -> u64 {
        self.store_base
            + ((s as u64 * self.layers as u64 + layer as u64) * 2 + kv as u64) * self.obj
    }

    /// Tier blocks that are load places (the store places follow).
    fn load_places(&self) -> u32 {
        self.buffers * self.load_blocks
    }

    /// The tier's block of place `sblock` of buffer `buffer`.
    fn load_place(&self, buffer: u32, sblock: u32) -> u32 {
        buffer * self.load_blocks + sblock
    }

    /// The tier's memory block `block` (load places first, then store places).
    fn addr(&self, block: u32, layer: u32, kv: u32) -> u64 {
        if block < self.load_places() {
            self.load_obj(block / self.load_blocks, block % self.load_blocks, kv)
        } else {
            self.store_obj(block - self.load_places(), layer, kv)
        }
    }

    fn regions(&self) -> Vec<MemRegion> {
        vec![
            MemRegion {
                addr: self.load_base,
                len: self.buffers as u64 * self.buffer_bytes(),
            },
            MemRegion {
                addr: self.store_base,
                len: self.store_blocks as u64 * 2 * self.layers as u64 * self.obj,
            },
        ]
    }
}

/// The staging memory: page-aligned host memory (huge pages where the
/// kernel gives them) for direct I/O, registered with CUDA as PORTABLE |
/// DEVICEMAP on a GPU so copies on any context's stream run at pinned speed.
struct StagingMemory {
    // Unregistered before the memory goes.
    reg: Option<HostRegistration>,
    buf: DmaBuffer,
}

impl StagingMemory {
    fn host(len: u64) -> Result<StagingMemory> {
        Ok(StagingMemory {
            reg: None,
            buf: DmaBuffer::new(len as usize)?,
        })
    }

    fn pinned(ctx: &Context, len: u64) -> Result<StagingMemory> {
        let buf = DmaBuffer::new(len as usize)?;
        // SAFETY: `buf` is our mapping and outlives the registration (field order).
        let reg = unsafe {
            HostRegistration::register(ctx, buf.as_mut_ptr(), buf.len(), RegisterFlags::DeviceMap)?
        };
        Ok(StagingMemory {
            reg: Some(reg),
            buf,
        })
    }

    /// The copier's address of host address `a` of the staging.
    fn dev(&self, a: u64) -> u64 {
        match &self.reg {
            Some(r) => r.device_ptr() + (a - self.buf.addr()),
            None => a,
        }
    }
}

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

/// A load goes through in *units*: unit `u` is chunk `u % chunks` of layer
/// `u / chunks` (a chunk is up to `load_blocks` of the load's keys in
/// staging order), read into buffer `u % layer_buffers`. A load of at most
/// `load_blocks` keys has one chunk: its units are its layers.
struct LoadJob {
    keys: Vec<Key>,
    /// The slot each key held when the load began (for `Tier::release_job_keys`).
    slots: Vec<u64>,
    hbm: Vec<u32>,
    /// The place of each key position in its chunk's buffer (slot order:
    /// coalesced).
    sblock: Vec<u32>,
    /// Positions in staging order; chunk `c` is `order[c * load_blocks..]`.
    order: Vec<u32>,
    chunks: u32,
    layers: Range<u32>,
    next_submit: u64,
    next_scatter: u64,
    /// Units from here on are not read: no key is left to read.
    skipped_from: Option<u64>,
    /// Why keys left out of a layer's read (dropped from the pool meanwhile)
    /// failed: that layer's event says so.
    dropped: BTreeMap<u32, Failure>,
    /// Landed units not yet scattered: (positions read, tier result).
    landed: BTreeMap<u64, (Vec<u32>, Option<JobResult>)>,
    /// Why the layer being scattered failed so far (over its chunks).
    layer_error: Option<Failure>,
    /// Units scattered, waiting for their copy.
    copying: VecDeque<Copying>,
    outcomes: Vec<Option<KeyOutcome>>,
    tier_jobs_out: u32,
    announced: u32,
    /// Per layer of `layers` announced: why it failed, for `wait_layer`
    /// (the events are drained by the caller).
    layer_errors: Vec<Option<Failure>>,
    /// The load's own counter on a GPU: layer `l` done at `base + l - first + 1`.
    counter: Option<LoadCounter>,
}

/// A unit whose copy was started.
struct Copying {
    unit: u64,
    /// The copier's counter value once it is done.
    seq: u32,
    /// The last chunk of its layer: the layer's event, with why it failed.
    announce: Option<Option<Failure>>,
}

impl LoadJob {
    fn units(&self) -> Range<u64> {
        self.layers.start as u64 * self.chunks as u64..self.layers.end as u64 * self.chunks as u64
    }

    /// (layer, chunk) of unit `u`.
    fn unit(&self, u: u64) -> (u32, u32) {
        (
            (u / self.chunks as u64) as u32,
            (u % self.chunks as u64) as u32,
        )
    }

    /// The positions of chunk `c`, in staging order.
    fn chunk(&self, c: u32, load_blocks: u32) -> &[u32] {
        let lb = load_blocks as usize;
        let start = c as usize * lb;
        &self.order[start..(start + lb).min(self.order.len())]
    }
}

/// A GPU-visible counter of one load: layer `l` of a load of layers
/// `first..` is in KV memory once the counter has reached
/// `base + (l - first) + 1` (wrapping). Counters are reused by later loads,
/// from the value the last one left, so a stream still waiting on an old
/// value is never confused.
#[derive(Clone)]
pub struct LoadCounter {
    /// The counter.
    pub counter: Arc<CompletionCounter>,
    /// Its value before the load's first layer.
    pub base: u32,
    /// The load's first layer.
    pub first_layer: u32,
    /// One past the load's last layer: the counter never reaches a value
    /// for a layer at or beyond it (a wait for one would never end).
    pub layers_end: u32,
}

impl LoadCounter {
    /// The value the counter reaches once layer `layer` is copied.
    pub fn value_for(&self, layer: u32) -> u32 {
        self.base
            .wrapping_add(layer - self.first_layer)
            .wrapping_add(1)
    }

    /// Queue on a stream kvtier did not create (a serving engine's compute
    /// stream: torch's `cuda_stream`, a raw `CUstream` of `ctx`) a wait
    /// until layer `layer` is in KV memory: `cuStreamWaitValue32(counter >=
    /// value_for(layer))`, no host call when it is reached. A driver
    /// without stream memory operations answers with an error (the caller
    /// then waits on the host); kvtier's own streams use [`LayerWait`],
    /// which falls back to a wait kernel.
    ///
    /// # Safety
    /// `stream` is a live stream of `ctx` (0: its legacy default stream),
    /// and the caller keeps `self.counter` alive until the stream has
    /// passed the wait (a foreign stream cannot hold it, as
    /// `Stream::keep_alive` does for kvtier's own).
    pub unsafe fn queue_on_raw_stream(&self, ctx: &Context, stream: u64, layer: u32) -> Result<()> {
        if !(self.first_layer..self.layers_end).contains(&layer) {
            return Err(Error::invalid(format!(
                "layer {layer} is not loaded by this job (layers {}..{}): a stream waiting for it would never run",
                self.first_layer, self.layers_end
            )));
        }
        if self.counter.is_double() {
            return Err(Error::invalid(
                "this load's counter is the CPU test double's (a host word no stream can wait on); wait on the host (wait_layer)",
            ));
        }
        ctx.bind()?;
        // SAFETY: the caller's contract: a live stream of the bound context;
        // the counter is a 4-byte aligned GPU-visible word kept alive by it.
        unsafe {
            super::driver::stream_wait_value32(
                stream as usize as super::driver::CUstream,
                self.counter.device_ptr(),
                self.value_for(layer),
                0, // CU_STREAM_WAIT_VALUE_GEQ
            )
        }
    }
}

/// One tier store of a staged store: a chunk of at most `store_blocks` keys.
struct StoreJob {
    id: JobId,
    /// Position of the chunk's first key in the staged store.
    offset: usize,
    places: Vec<u32>,
}

/// A staged store, whose chunks are tier stores.
struct StoreAgg {
    keys: Vec<Key>,
    mem_blocks: Vec<u32>,
    outcomes: Vec<Option<KeyOutcome>>,
    evicted: Vec<Key>,
    chunks_out: usize,
    /// Keys from here on are in chunks not yet gathered: they go out as
    /// store staging frees (`poll`), never with the caller's thread waiting.
    next: usize,
}

/// Job ids of the staged path start here, apart from the tier's own.
pub(crate) const STAGED_JOB_BASE: JobId = 1 << 62;

/// The staged path's state beside a [`Tier`] whose registered memory is
/// the staging: every call takes that tier. The tier must be drained
/// (see [`StagedPath::drain`]) before this is dropped: its I/O targets the
/// staging memory this owns. [`StagedTier`] keeps the two together.
pub struct StagedPath {
    copier: Box<dyn DeviceCopier>,
    staging: StagingMemory,
    layout: Layout,
    target: KvMemory,
    cfg: StagingConfig,
    /// The user of each layer buffer: (load job, layer, unit).
    buffers: Vec<Option<(JobId, u32, u64)>>,
    store_free: Vec<u32>,
    loads: BTreeMap<JobId, LoadJob>,
    /// Tier job -> (load job, unit, positions it reads).
    layer_jobs: HashMap<JobId, (JobId, u64, Vec<u32>)>,
    store_jobs: HashMap<JobId, StoreJob>,
    stores: HashMap<JobId, StoreAgg>,
    finished: HashMap<JobId, JobResult>,
    finished_order: VecDeque<JobId>,
    events: VecDeque<HbmLayer>,
    seq: u32,
    next_job: JobId,
    /// Counters of finished loads, with the value each was left at.
    spare_counters: Vec<(Arc<CompletionCounter>, u32)>,
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
        let layout = Layout::new(&g, &cfg, staging.buf.addr());
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
        Ok(StagedPath {
            copier,
            staging,
            layout,
            target,
            cfg,
            buffers: vec![None; cfg.layer_buffers as usize],
            store_free: (layout.load_places()..layout.load_places() + cfg.store_blocks)
                .rev()
                .collect(),
            loads: BTreeMap::new(),
            layer_jobs: HashMap::new(),
            store_jobs: HashMap::new(),
            stores: HashMap::new(),
            finished: HashMap::new(),
            finished_order: VecDeque::new(),
            events: VecDeque::new(),
            seq: 0,
            next_job: STAGED_JOB_BASE,
            spare_counters: Vec::new(),
            _target_owner: None,
        })
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

    /// Which layer buffers are in use, and by what (load job, layer).
    pub fn buffers_in_use(&self) -> Vec<Option<(JobId, u32)>> {
        self.buffers
            .iter()
            .map(|b| b.map(|(id, l, _)| (id, l)))
            .collect()
    }

    fn check_blocks(&self, keys: &[Key], blocks: &[u32], most: u32, what: &str) -> Result<()> {
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
        if keys.len() > most as usize {
            return Err(Error::invalid(format!(
                "a {what} of {} blocks exceeds the staging's {most}; split the job or raise StagingConfig::{what}_blocks",
                keys.len()
            )));
        }
        if let Some(&b) = blocks.iter().find(|&&b| b >= self.target.num_blocks) {
            return Err(Error::invalid(format!(
                "memory block {b} is out of range: the registered KV memory has {} blocks",
                self.target.num_blocks
            )));
        }
        Ok(())
    }

    /// Start restoring `keys` into the KV memory's `mem_blocks` for
    /// `layers`. Every key must be in the pool; they stay pinned until the
    /// job ends. Layers complete in order ([`Self::layer_events`]).
    pub fn submit_load(
        &mut self,
        tier: &mut Tier,
        keys: &[Key],
        mem_blocks: &[u32],
        layers: Range<u32>,
    ) -> Result<JobId> {
        // A load larger than a layer buffer goes in chunks: bounded by the
        // memory's blocks (no two keys to one block).
        self.check_blocks(keys, mem_blocks, u32::MAX, "load")?;
        let g = self.target.geometry;
        crate::tier::check_load_args(g.layers, mem_blocks, &layers)?;
        // One set of the blocks stores still have to gather, so the check is
        // linear in the blocks, not their product (a 64K-token load beside
        // a large store is 4096 x 4096 blocks).
        let ungathered: HashSet<u32> = self
            .stores
            .values()
            .flat_map(|a| a.mem_blocks[a.next..].iter().copied())
            .collect();
        if let Some(&b) = mem_blocks.iter().find(|&&b| ungathered.contains(&b)) {
            return Err(Error::invalid(format!(
                "memory block {b} is read by a store not yet gathered; wait for that store before loading into it"
            )));
        }
        // Job pins, not a caller's: see `Tier::hold_job_keys`.
        let slots = tier.hold_job_keys(keys)?;
        // Staging places in slot order: the pool's coalesced order.
        let mut order: Vec<u32> = (0..keys.len() as u32).collect();
        order.sort_by_key(|&p| slots[p as usize]);
        let lb = self.cfg.load_blocks;
        let mut sblock = vec![0; keys.len()];
        for (i, &p) in order.iter().enumerate() {
            sblock[p as usize] = i as u32 % lb;
        }
        let chunks = (keys.len() as u32).div_ceil(lb);
        let (counter, base) = match self.spare_counters.pop() {
            Some(c) => c,
            None => match self.copier.new_counter() {
                Ok(c) => (c, 0),
                Err(e) => {
                    tier.release_job_keys(keys, &slots);
                    return Err(e);
                }
            },
        };
        let counter = Some(LoadCounter {
            counter,
            base,
            first_layer: layers.start,
            layers_end: layers.end,
        });
        let id = self.next_job;
        self.next_job += 1;
        let layers_len = layers.len();
        self.loads.insert(
            id,
            LoadJob {
                counter,
                keys: keys.to_vec(),
                slots,
                hbm: mem_blocks.to_vec(),
                sblock,
                order,
                chunks,
                next_submit: layers.start as u64 * chunks as u64,
                next_scatter: layers.start as u64 * chunks as u64,
                announced: layers.start,
                layers,
                skipped_from: None,
                landed: BTreeMap::new(),
                dropped: BTreeMap::new(),
                layer_error: None,
                copying: VecDeque::new(),
                outcomes: vec![None; keys.len()],
                tier_jobs_out: 0,
                layer_errors: vec![None; layers_len],
            },
        );
        self.submit_layers(tier);
        Ok(id)
    }

    /// Start storing `keys` from the KV memory's `mem_blocks` (all layers).
    /// The blocks are gathered into staging with their checksums (on the
    /// GPU) in chunks of `store_blocks`, as store staging has room: what
    /// fits now is gathered before this returns, the rest by later polls,
    /// so the memory blocks must not be written until the store ends (loads
    /// into blocks not yet gathered are refused). Nothing here waits for a
    /// device: a caller holding a lock (the handle's I/O thread holds the
    /// index's) would hold everyone up while earlier chunks land. Chunks
    /// go out in submission order, a store's behind the stores before it.
    /// An error means nothing was accepted; a chunk that fails later fails
    /// its keys in the job's result.
    pub fn submit_store(
        &mut self,
        tier: &mut Tier,
        keys: &[Key],
        mem_blocks: &[u32],
    ) -> Result<JobId> {
        self.check_blocks(keys, mem_blocks, u32::MAX, "store")?;
        // As for loads: one set of the loads' targets, linear in the blocks.
        let loading: HashSet<u32> = self
            .loads
            .values()
            .flat_map(|j| j.hbm.iter().copied())
            .collect();
        if let Some(&b) = mem_blocks.iter().find(|&&b| loading.contains(&b)) {
            return Err(Error::invalid(format!(
                "memory block {b} is the target of a load in flight; wait for that load before storing from it"
            )));
        }
        let id = self.next_job;
        let behind = self.stores.values().any(|a| a.next < a.keys.len());
        self.stores.insert(
            id,
            StoreAgg {
                keys: keys.to_vec(),
                mem_blocks: mem_blocks.to_vec(),
                outcomes: vec![None; keys.len()],
                evicted: Vec::new(),
                chunks_out: 0,
                next: 0,
            },
        );
        if !behind {
            if let Err(e) = self.push_chunks(tier, id) {
                self.stores.remove(&id);
                return Err(e);
            }
        }
        self.next_job += 1;
        self.finish_stores();
        Ok(id)
    }

    /// Gather and hand to the tier the chunks of store `id` that store
    /// staging has room for now. An error only for its first chunk (then
    /// nothing of the store went out); a later chunk's fails its keys.
    fn push_chunks(&mut self, tier: &mut Tier, id: JobId) -> Result<()> {
        let chunk = self.cfg.store_blocks as usize;
        loop {
            let Some(a) = self.stores.get_mut(&id) else {
                return Ok(());
            };
            let (start, len) = (a.next, a.keys.len());
            let end = (start + chunk).min(len);
            if start >= len || self.store_free.len() < end - start {
                return Ok(());
            }
            let keys = std::mem::take(&mut a.keys);
            let mem = std::mem::take(&mut a.mem_blocks);
            let r = self.store_chunk(tier, &keys[start..end], &mem[start..end], &keys[..start]);
            let a = self.stores.get_mut(&id).expect("in the table");
            a.keys = keys;
            a.mem_blocks = mem;
            a.next = end;
            match r {
                Ok((t, places)) => {
                    a.chunks_out += 1;
                    self.store_jobs.insert(
                        t,
                        StoreJob {
                            id,
                            offset: start,
                            places,
                        },
                    );
                }
                Err(e) if start == 0 => return Err(e),
                Err(e) => {
                    let f = Failure::from(&e);
                    for o in &mut a.outcomes[start..end] {
                        *o = Some(KeyOutcome::Failed(f.clone()));
                    }
                }
            }
        }
    }

    /// Push the chunks waiting for store staging, oldest store first.
    fn push_stores(&mut self, tier: &mut Tier) {
        let mut ids: Vec<JobId> = self
            .stores
            .iter()
            .filter(|(_, a)| a.next < a.keys.len())
            .map(|(&id, _)| id)
            .collect();
        ids.sort_unstable();
        for id in ids {
            while let Err(e) = self.push_chunks(tier, id) {
                // A first chunk failing after the store was accepted fails
                // its keys; the rest goes on.
                let f = Failure::from(&e);
                let a = self.stores.get_mut(&id).expect("listed");
                let end = a.next;
                for o in &mut a.outcomes[..end] {
                    *o = Some(KeyOutcome::Failed(f.clone()));
                }
            }
            if self.stores.get(&id).is_some_and(|a| a.next < a.keys.len()) {
                break; // later stores wait behind this one
            }
        }
    }

    /// Gather one chunk into free store places (the caller made sure there
    /// are enough) and hand it to the tier: (tier job, places).
    fn store_chunk(
        &mut self,
        tier: &mut Tier,
        keys: &[Key],
        mem_blocks: &[u32],
        earlier: &[Key],
    ) -> Result<(JobId, Vec<u32>)> {
        if self.store_free.len() < keys.len() {
            return Err(Error::invalid(
                "store staging has no room for a chunk (a bug: report it)",
            ));
        }
        // The keys earlier chunks of this store have put in the pool are
        // held while this chunk allocates, as one tier store holds its own
        // keys: the staged store must not evict what it reports stored (a
        // later chunk evicted the first chunks' blocks, all reported Done).
        let held: Vec<Key> = earlier
            .iter()
            .filter(|k| tier.contains(k))
            .copied()
            .collect();
        let slots = tier.hold_job_keys(&held)?;
        let places: Vec<u32> = (0..keys.len())
            .map(|_| self.store_free.pop().expect("counted"))
            .collect();
        let r = self.gather_and_store(tier, keys, mem_blocks, &places);
        tier.release_job_keys(&held, &slots);
        match r {
            Ok(t) => Ok((t, places)),
            Err(e) => {
                self.store_free.extend(places);
                Err(e)
            }
        }
    }

    /// Report staged stores whose chunks have all ended.
    fn finish_stores(&mut self) {
        let done: Vec<JobId> = self
            .stores
            .iter()
            .filter(|(_, a)| a.chunks_out == 0 && a.next >= a.keys.len())
            .map(|(&id, _)| id)
            .collect();
        for id in done {
            let a = self.stores.remove(&id).expect("listed");
            self.finish(JobResult {
                job: id,
                kind: JobKind::Store,
                keys: a.keys,
                outcomes: a
                    .outcomes
                    .into_iter()
                    .map(|o| {
                        o.unwrap_or_else(|| {
                            KeyOutcome::Failed(Failure::new(
                                ErrorKind::Internal,
                                "a staged store chunk ended without an outcome for this key",
                            ))
                        })
                    })
                    .collect(),
                evicted: a.evicted,
            });
        }
    }

    fn gather_and_store(
        &mut self,
        tier: &mut Tier,
        keys: &[Key],
        mem_blocks: &[u32],
        places: &[u32],
    ) -> Result<JobId> {
        let g = self.target.geometry;
        let obj = self.layout.obj;
        let mut list = Vec::with_capacity(keys.len() * g.objects_per_block() as usize);
        for (i, &b) in mem_blocks.iter().enumerate() {
            for layer in 0..g.layers {
                for kv in 0..2 {
                    let s = places[i] - self.layout.load_places();
                    list.push(CopyDesc {
                        src: self.target.object_addr(b, layer, kv),
                        dst: self.staging.dev(self.layout.store_obj(s, layer, kv)),
                        len: obj as u32,
                        reserved: 0,
                    });
                }
            }
        }
        self.copier.gather_crc32c(&list)?;
        let crcs = self.copier.finish()?;
        if crcs.len() != list.len() {
            return Err(Error::gpu(
                "staging gather",
                format!("{} checksums for {} copies", crcs.len(), list.len()),
            ));
        }
        // A layer's checksum covers K then V: combine the two objects'.
        let per_key: Vec<Option<Vec<u32>>> = crcs
            .chunks_exact(g.objects_per_block() as usize)
            .map(|c| {
                Some(
                    c.chunks_exact(2)
                        .map(|kv| crc32c::crc32c_combine(kv[0], kv[1], obj as usize))
                        .collect(),
                )
            })
            .collect();
        tier.submit_store_with_crcs(keys, places, Some(&per_key))
    }

    /// Submit the next units of loads whose buffers are free.
    fn submit_layers(&mut self, tier: &mut Tier) {
        let b = self.cfg.layer_buffers;
        let lb = self.cfg.load_blocks;
        let ids: Vec<JobId> = self.loads.keys().copied().collect();
        for id in ids {
            loop {
                let job = self.loads.get_mut(&id).expect("listed");
                let u = job.next_submit;
                if u >= job.units().end || job.skipped_from.is_some() {
                    break;
                }
                let buf = (u % b as u64) as u32;
                if self.buffers[buf as usize].is_some() {
                    break; // back-pressure: the buffer's copy is not done yet
                }
                let (l, c) = job.unit(u);
                // A key another load found damaged left the pool while this
                // one held it: it fails here, alone (named in a layer job, the
                // tier refused the job and every key of the load failed).
                let index = tier.pool().index();
                for p in 0..job.keys.len() {
                    if job.outcomes[p].is_none()
                        && index.get(&job.keys[p]).map(|e| e.slot) != Some(job.slots[p])
                    {
                        let f = Failure::new(
                            ErrorKind::Corrupt,
                            format!(
                                "key {} left the pool before layer {l} was read: another load found its block damaged",
                                job.keys[p]
                            ),
                        );
                        job.dropped.entry(l).or_insert_with(|| f.clone());
                        job.outcomes[p] = Some(KeyOutcome::Corrupt(f));
                    }
                }
                // Never held into the submit below (it locks the index too).
                drop(index);
                if job.outcomes.iter().all(Option::is_some) {
                    job.skipped_from = Some(u);
                    break;
                }
                let live: Vec<u32> = job
                    .chunk(c, lb)
                    .iter()
                    .copied()
                    .filter(|&p| job.outcomes[p as usize].is_none())
                    .collect();
                if live.is_empty() {
                    // This chunk's keys have all failed, others' have not:
                    // nothing to read, in order with the rest.
                    job.landed.insert(u, (live, None));
                    job.next_submit += 1;
                    continue;
                }
                let keys: Vec<Key> = live.iter().map(|&p| job.keys[p as usize]).collect();
                let places: Vec<u32> = live
                    .iter()
                    .map(|&p| self.layout.load_place(buf, job.sblock[p as usize]))
                    .collect();
                match tier.submit_load(&keys, &places, l..l + 1) {
                    Ok(t) => {
                        job.next_submit += 1;
                        job.tier_jobs_out += 1;
                        self.buffers[buf as usize] = Some((id, l, u));
                        self.layer_jobs.insert(t, (id, u, live));
                    }
                    Err(e) => {
                        let f = Failure::from(&e).context(format_args!("layer {l}"));
                        for o in job.outcomes.iter_mut().filter(|o| o.is_none()) {
                            *o = Some(KeyOutcome::Failed(f.clone()));
                        }
                        job.layer_error.get_or_insert(f);
                        job.skipped_from = Some(u);
                    }
                }
            }
        }
    }

    fn on_tier_result(&mut self, r: JobResult) {
        if let Some((id, u, live)) = self.layer_jobs.remove(&r.job) {
            let job = self.loads.get_mut(&id).expect("a load of a layer job");
            job.tier_jobs_out -= 1;
            job.landed.insert(u, (live, Some(r)));
        } else if let Some(s) = self.store_jobs.remove(&r.job) {
            self.store_free.extend(s.places);
            if let Some(a) = self.stores.get_mut(&s.id) {
                for (i, o) in r.outcomes.into_iter().enumerate() {
                    a.outcomes[s.offset + i] = Some(o);
                }
                a.evicted.extend(r.evicted);
                a.chunks_out -= 1;
            }
        }
    }

    fn finish(&mut self, r: JobResult) {
        self.finished_order.push_back(r.job);
        self.finished.insert(r.job, r);
    }

    /// Layer `l` of a load is done (copied, failed or skipped): the load's
    /// counter must reach its value whatever happened, or a compute stream
    /// waiting on it hangs until a later load reuses the counter. Written
    /// on the copy stream after the copies; if that fails, from the host
    /// (after what the stream holds). The error: the counter is stuck.
    fn advance_counter(
        copier: &mut dyn DeviceCopier,
        c: &LoadCounter,
        l: u32,
        copy_failed: bool,
    ) -> Result<()> {
        let v = c.value_for(l);
        if !copy_failed && copier.signal_counter(&c.counter, v).is_ok() {
            return Ok(());
        }
        copier.release_counter(&c.counter, v)
    }

    /// Scatter every landed unit that is next in its load's order.
    fn scatter_landed(&mut self) -> Result<()> {
        let b = self.cfg.layer_buffers;
        let lb = self.cfg.load_blocks;
        let ids: Vec<JobId> = self.loads.keys().copied().collect();
        for id in ids {
            loop {
                let job = self.loads.get_mut(&id).expect("listed");
                let u = job.next_scatter;
                if u >= job.units().end {
                    break;
                }
                let (l, c) = job.unit(u);
                let last = c + 1 == job.chunks;
                if job.skipped_from.is_some_and(|s| u >= s) {
                    // Not read: announced with the failure once the copies
                    // before it are done.
                    if let Some(f) = job.dropped.remove(&l) {
                        job.layer_error.get_or_insert(f);
                    }
                    if last {
                        let mut error = job.layer_error.take().unwrap_or_else(|| {
                            Failure::new(
                                ErrorKind::Io,
                                format!(
                                    "layer {l} not read: every key of the load failed before it"
                                ),
                            )
                        });
                        if let Some(cnt) = &job.counter {
                            if let Err(e) =
                                Self::advance_counter(self.copier.as_mut(), cnt, l, false)
                            {
                                error = error.context(format_args!(
                                    "and its counter could not be advanced: {e}"
                                ));
                            }
                        }
                        // Announced once the copy stream has passed the
                        // counter write, as a copied layer is.
                        let seq = self.seq.wrapping_add(1);
                        if self.copier.signal(seq).is_ok() {
                            self.seq = seq;
                        }
                        job.copying.push_back(Copying {
                            unit: u,
                            seq: self.seq,
                            announce: Some(Some(error)),
                        });
                    }
                    job.next_scatter += 1;
                    continue;
                }
                let Some((live, r)) = job.landed.remove(&u) else {
                    break;
                };
                if let Some(f) = job.dropped.remove(&l) {
                    job.layer_error.get_or_insert(f);
                }
                if let Some(r) = &r {
                    for (i, &p) in live.iter().enumerate() {
                        if let KeyOutcome::Failed(f) | KeyOutcome::Corrupt(f) = &r.outcomes[i] {
                            if job.outcomes[p as usize].is_none() {
                                job.outcomes[p as usize] = Some(r.outcomes[i].clone());
                            }
                            job.layer_error.get_or_insert_with(|| f.clone());
                        }
                    }
                }
                let buf = (u % b as u64) as u32;
                let chunk = job.chunk(c, lb);
                let mut list = Vec::with_capacity(2 * chunk.len());
                for kv in 0..2 {
                    for &p in chunk {
                        if job.outcomes[p as usize].is_some() {
                            continue;
                        }
                        list.push(CopyDesc {
                            src: self.staging.dev(self.layout.load_obj(
                                buf,
                                job.sblock[p as usize],
                                kv,
                            )),
                            dst: self.target.object_addr(job.hbm[p as usize], l, kv),
                            len: self.layout.obj as u32,
                            reserved: 0,
                        });
                    }
                }
                let copied = if list.is_empty() {
                    Ok(())
                } else {
                    self.copier.scatter(&list)
                };
                let seq = self.seq.wrapping_add(1);
                // The load's counter only at a layer's last chunk: a compute
                // stream waits for whole layers.
                let copied = copied
                    .and_then(|()| match (&job.counter, last) {
                        (Some(c), true) => self.copier.signal_counter(&c.counter, c.value_for(l)),
                        _ => Ok(()),
                    })
                    .and_then(|()| self.copier.signal(seq));
                if let Err(e) = copied {
                    // Whatever of this copy did start ends before its buffer
                    // can be read into again (its entry below carries no new
                    // counter value to wait for).
                    let _ = self.copier.finish();
                    let mut f =
                        Failure::from(&e).context(format_args!("copying layer {l} to GPU memory"));
                    if let (Some(cnt), true) = (&job.counter, last) {
                        if let Err(e) = Self::advance_counter(self.copier.as_mut(), cnt, l, true) {
                            f = f.context(format_args!(
                                "and its counter could not be advanced: {e}"
                            ));
                        }
                    }
                    for o in job.outcomes.iter_mut().filter(|o| o.is_none()) {
                        *o = Some(KeyOutcome::Failed(f.clone()));
                    }
                    job.layer_error.get_or_insert(f);
                    job.copying.push_back(Copying {
                        unit: u,
                        seq: self.seq,
                        announce: last.then(|| job.layer_error.take()),
                    });
                } else {
                    self.seq = seq;
                    job.copying.push_back(Copying {
                        unit: u,
                        seq,
                        announce: last.then(|| job.layer_error.take()),
                    });
                }
                job.next_scatter += 1;
            }
        }
        Ok(())
    }

    /// Announce layers whose copies are done, free their buffers, and end
    /// loads with nothing left.
    fn retire(&mut self, tier: &mut Tier) -> Result<()> {
        let now = self.copier.signaled()?;
        let b = self.cfg.layer_buffers as u64;
        let mut done = Vec::new();
        for (&id, job) in self.loads.iter_mut() {
            while let Some(front) = job.copying.front() {
                if (now.wrapping_sub(front.seq) as i32) < 0 {
                    break;
                }
                let Copying {
                    unit,
                    seq,
                    announce,
                } = job.copying.pop_front().expect("front");
                let (l, _) = job.unit(unit);
                let buf = (unit % b) as usize;
                if self.buffers[buf] == Some((id, l, unit)) {
                    self.buffers[buf] = None;
                }
                if let Some(error) = announce {
                    job.announced = l + 1;
                    job.layer_errors[(l - job.layers.start) as usize] = error.clone();
                    self.events.push_back(HbmLayer {
                        job: id,
                        layer: l,
                        error,
                        counter: seq,
                    });
                }
            }
            if job.next_scatter >= job.units().end
                && job.copying.is_empty()
                && job.tier_jobs_out == 0
            {
                done.push(id);
            }
        }
        for id in done {
            let job = self.loads.remove(&id).expect("listed");
            tier.release_job_keys(&job.keys, &job.slots);
            if let Some(c) = job.counter {
                // Layers not copied (failed keys, skipped layers) still
                // reached their values: every scatter signals, and a skipped
                // layer is signalled below, so the last value is final.
                let last = c.value_for(job.layers.end - 1);
                self.spare_counters.push((c.counter, last));
            }
            self.finish(JobResult {
                job: id,
                kind: JobKind::Load,
                keys: job.keys,
                outcomes: job
                    .outcomes
                    .into_iter()
                    .map(|o| o.unwrap_or(KeyOutcome::Done))
                    .collect(),
                evicted: Vec::new(),
            });
        }
        Ok(())
    }

    /// Move everything along without blocking.
    pub fn poll(&mut self, tier: &mut Tier) -> Result<()> {
        tier.poll()?;
        for r in tier.get_finished() {
            self.on_tier_result(r);
        }
        self.push_stores(tier);
        self.finish_stores();
        // The layer jobs' own events: a staged layer is announced after its copy.
        let _ = tier.layer_events();
        self.scatter_landed()?;
        self.retire(tier)?;
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
    fn wait_some(&mut self, tier: &mut Tier) -> Result<()> {
        let oldest = self
            .layer_jobs
            .keys()
            .chain(self.store_jobs.keys())
            .min()
            .copied();
        if let Some(t) = oldest {
            let r = tier.wait(t)?;
            self.on_tier_result(r);
        } else if self.loads.values().any(|j| !j.copying.is_empty()) {
            self.copier.finish()?;
        } else {
            return Err(Error::invalid(
                "staged tier: a job is unfinished with nothing in flight (a bug: report it)",
            ));
        }
        Ok(())
    }

    fn known(&self, id: JobId) -> bool {
        self.loads.contains_key(&id)
            || self.finished.contains_key(&id)
            || self.stores.contains_key(&id)
    }

    /// Wait for job `id` and take its result.
    pub fn wait(&mut self, tier: &mut Tier, id: JobId) -> Result<JobResult> {
        if !self.known(id) {
            return Err(Error::invalid(format!(
                "no staged job {id} in flight or unreported"
            )));
        }
        loop {
            self.poll(tier)?;
            if let Some(r) = self.finished.remove(&id) {
                self.finished_order.retain(|&j| j != id);
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
    pub fn wait_layer(&mut self, tier: &mut Tier, id: JobId, layer: u32) -> Result<()> {
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
                    return match self.finished.get(&id) {
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

    /// Results of jobs that ended, in the order they ended.
    pub fn get_finished(&mut self) -> Vec<JobResult> {
        let mut out = Vec::new();
        while let Some(id) = self.finished_order.pop_front() {
            if let Some(r) = self.finished.remove(&id) {
                out.push(r);
            }
        }
        out
    }

    /// Wait for every job.
    pub fn drain(&mut self, tier: &mut Tier) -> Result<()> {
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

    /// Jobs finished since the last call.
    pub fn get_finished(&mut self) -> Vec<JobResult> {
        self.path.get_finished()
    }

    /// Waits for every job in flight.
    pub fn drain(&mut self) -> Result<()> {
        self.path.drain(&mut self.tier)
    }
}

impl Drop for StagedTier {
    fn drop(&mut self) {
        // Stores in flight land (their bytes are in staging), as Tier's drop does.
        let _ = self.drain();
    }
}

/// Makes a compute stream wait for a staged layer without a host call:
/// `cuStreamWaitValue32(counter >= value)`, or, on a device without stream
/// memory operations, the wait kernel `kvtier_wait_counter` (one thread
/// polling the counter).
pub struct LayerWait {
    kernel: Option<(Function, Module)>,
    ctx: Context,
}

impl LayerWait {
    /// A waiter for streams of `ctx` (the wait kernel loads on first use).
    pub fn new(ctx: &Context) -> LayerWait {
        LayerWait {
            kernel: None,
            ctx: ctx.clone(),
        }
    }

    /// Later work on `stream` starts once `counter` has reached `value`.
    pub fn queue(
        &mut self,
        stream: &Stream,
        counter: &Arc<CompletionCounter>,
        value: u32,
    ) -> Result<()> {
        if self.kernel.is_none() {
            match stream.wait_counter(counter, value, WaitCond::Geq) {
                Ok(()) => return Ok(()),
                Err(e) if e.kind() == ErrorKind::Unsupported || e.cuda_code().is_some() => {
                    let image = kernels::gio_kernel()?;
                    let mut ptx = image.ptx.as_bytes().to_vec();
                    ptx.push(0);
                    let module = self.ctx.load_module(&ptx)?;
                    let f = module.function(abi::WAIT_KERNEL_NAME)?;
                    self.kernel = Some((f, module));
                }
                Err(e) => return Err(e),
            }
        }
        let (f, _) = self.kernel.as_ref().expect("loaded");
        let mut a = KernelArgs::new()
            .arg(counter.device_ptr())
            .arg(value)
            .arg(0u64)
            .arg(0u64);
        // SAFETY: kvtier_wait_counter(counter, target, timeout_ns, timed_out):
        // the counter is kept alive below until the stream passes the kernel;
        // a null timed_out is allowed.
        unsafe { stream.launch(f, LaunchConfig::linear(1, 1), &mut a)? };
        stream.keep_alive(counter.clone());
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Load places are a buffer's whatever the layer: place `t` is place
    /// `t % load_blocks` of buffer `t / load_blocks`, K objects of a buffer
    /// then V objects; the store area follows the buffers with a block's 2L
    /// objects together; nothing of one overlaps the other.
    #[test]
    fn staging_layout_places_chunks_in_buffers() {
        let g = KvGeometry {
            layers: 6,
            kv_heads: 2,
            head_dim: 64,
            dtype: crate::model::DType::BF16,
            block_size: 16,
        };
        let cfg = StagingConfig {
            layer_buffers: 2,
            load_blocks: 3,
            store_blocks: 2,
        };
        let obj = g.object_bytes();
        let l = Layout::new(&g, &cfg, 1 << 30);
        assert_eq!(l.load_places(), 6);
        assert_eq!(l.addr(0, 0, 0), 1 << 30);
        assert_eq!(l.addr(2, 0, 0), (1 << 30) + 2 * obj);
        assert_eq!(l.addr(0, 0, 1), (1 << 30) + 3 * obj);
        assert_eq!(l.addr(l.load_place(1, 1), 1, 0), (1 << 30) + 6 * obj + obj);
        for t in 0..6 {
            for kv in 0..2 {
                assert_eq!(l.addr(t, 4, kv), l.addr(t, 0, kv), "any layer");
                assert_eq!(
                    l.addr(t, 1, kv),
                    l.load_obj(t / 3, t % 3, kv),
                    "place {t} is buffer {}'s",
                    t / 3
                );
            }
        }
        let store0 = (1 << 30) + 2 * 6 * obj;
        assert_eq!(l.addr(6, 0, 0), store0);
        assert_eq!(l.addr(6, 5, 1), store0 + 11 * obj);
        assert_eq!(l.addr(7, 0, 0), store0 + 12 * obj);
        let r = l.regions();
        assert_eq!(r[0].addr + r[0].len, r[1].addr);
        assert_eq!(r[0].len + r[1].len, cfg.bytes(&g));
        assert_eq!(l.addr(7, 5, 1) + obj, r[1].addr + r[1].len);
    }
}
