//! `kvtier bench --memory gpu`: restore into and store from KV memory in GPU
//! HBM through the staged path (`kvtier::staged`), each beside its two
//! ceilings measured in the same run on the same pool: the disk alone and
//! the PCIe copy alone (pinned host to HBM for a restore, HBM to pinned
//! host for a store, the same bytes layer by layer). A staged path that
//! overlaps well runs close to the lower of the two. Also the gather's and
//! the GPU crc32c's shares of a store: the gather kernel with and without
//! checksums, against the store's time.
//!
//! The disk-alone figures are the same work as the staged path's disk part:
//! for a restore, the same keys loaded into host memory by the tier; for a
//! store, kvtier's engine alone writing the same bytes (from host memory
//! holding them) to the same offsets the store wrote, in the store's I/Os
//! (the objects coalesced as the store plans its data, `bench::rewrite`),
//! at the tier's queue depth, O_DIRECT, then one flush in the time (a store
//! acknowledges only durable bytes). The pool is prewritten (unless
//! `--first-fill`) and the engine alone writes the store's slots once just
//! before the store, untimed, as `kvtier bench` does for host stores: on a
//! VM's ext4 a first write to a range (unwritten extents converted at each
//! completion) runs far slower than a rewrite, and the store must not pay
//! for that while its reference does not.
//!
//! `--memory host-double` (hidden) runs the same code with host memory
//! standing in for HBM and the CPU doing the copies (the test double): it
//! checks the bench's plumbing on machines without a GPU; its copy figures
//! say nothing about a GPU.

use super::{check_scratch_pool, BenchConfig, Machine};
use kvtier::error::{Error, Result};
use kvtier::gpu::staging::{CopyDesc, CudaCopier, DeviceCopier, HostCopier};
use kvtier::gpu::{Context, Device, DeviceBuffer, PinnedHostBuffer};
use kvtier::host::size::human_bytes;
use kvtier::memory::{pattern_fill, HostKvCache, HostLayout, KvLayout, KvMemory, MemoryKind};
use kvtier::model::KvGeometry;
use kvtier::pool::{Key, OpenExpect, Pool, PoolConfig};
use kvtier::scratch::ScratchFile;
use kvtier::service::{Service, ServiceBuilder, ServiceConfig, StagedServiceClient};
use kvtier::staged::{StagedTier, StagingConfig};
use kvtier::tier::Tier;
use kvtier::{HandleConfig, TierApi, TierBuilder};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

#[derive(Clone, Debug, serde::Serialize)]
pub struct HbmResult {
    pub tokens: u64,
    pub blocks: u64,
    pub bytes: u64,
    pub restore_gib_s: f64,
    /// Time until layer 0 was in KV memory.
    pub restore_first_layer_ms: f64,
    /// Ceiling: the same load into host memory (disk read alone).
    pub disk_read_gib_s: f64,
    /// Ceiling: pinned host to KV memory, layer by layer (copy alone).
    pub h2d_gib_s: f64,
    /// restore / min(disk read, H2D).
    pub restore_vs_ceiling: f64,
    pub store_gib_s: f64,
    /// Ceiling: the engine alone writing the bytes the store wrote to the
    /// same offsets in the store's I/Os, then one flush (disk write alone).
    pub disk_write_gib_s: f64,
    /// The engine alone's untimed-before-the-store first write of the same
    /// slots, as GiB/s (with its flush): what the store would have paid on
    /// ranges not written just before. None when the slots were not known.
    pub disk_first_write_gib_s: Option<f64>,
    /// Ceiling: KV memory to pinned host (copy alone).
    pub d2h_gib_s: f64,
    /// store / min(disk write, D2H).
    pub store_vs_ceiling: f64,
    /// The gather into staging with crc32c, and the same copies without
    /// (the scatter kernel over the gather's list), for the whole context:
    /// the median of 5 timed calls on one store chunk, scaled.
    pub gather_crc_ms: f64,
    pub gather_copy_ms: f64,
    /// gather_crc / store time: the gather's share of the store (the staged
    /// path gathers chunk n+1 while chunk n is written, so this is what it
    /// would add if nothing overlapped).
    pub gather_share_of_store: f64,
    /// (gather_crc - gather_copy) / store time: the checksums' share. On a
    /// GPU the gather is bound by its PCIe writes into pinned memory and
    /// the crc32c's arithmetic hides under them, so this is ~0.
    pub crc_share_of_store: f64,
    pub verified: bool,
    /// `--service`: the same store and restore through the node's service.
    pub service: Option<ServiceFigures>,
}

/// The store and restore of a context through the node's service (`kvtier
/// serve`, started in this process on a pool of its own) by a staged client
/// of it: the slice the service shares is the staging, and the service's
/// tier does the disk I/O. The keys are other than the in-process run's;
/// the bytes are the same.
#[derive(Clone, Debug, serde::Serialize)]
pub struct ServiceFigures {
    pub restore_gib_s: f64,
    pub restore_first_layer_ms: f64,
    pub store_gib_s: f64,
    /// Against the in-process staged path of the same context, same run.
    pub restore_vs_in_process: f64,
    pub store_vs_in_process: f64,
    /// Against the ceilings of the same run: min(disk alone, copy alone).
    pub restore_vs_ceiling: f64,
    pub store_vs_ceiling: f64,
    pub verified: bool,
}

#[derive(Clone, Debug, serde::Serialize)]
pub struct HbmReport {
    pub config: BenchConfig,
    pub machine: Machine,
    /// `gpu NAME`, or "host double (no GPU: figures are not a GPU's)".
    pub memory: String,
    pub staging: StagingConfig,
    pub results: Vec<HbmResult>,
    pub skipped: Vec<String>,
    /// Shares of the staging memory and of the host memory the disk-alone
    /// references use that huge pages back (None when /proc/self/smaps
    /// cannot say): on a VM's virtio disk each 4 KiB page of an I/O can be
    /// its own DMA segment, so a store from staging in small pages is held
    /// to a reference from memory in huge pages only where these agree.
    pub staging_huge_page_share: Option<f64>,
    pub host_huge_page_share: Option<f64>,
    /// The staged tier's engine (fixed buffers over the staging or not).
    pub staging_engine: String,
    /// `--service`: how the service client's slice is cut into staging,
    /// and the share of the slice that huge pages back.
    pub service_staging: Option<StagingConfig>,
    pub service_slice_huge_page_share: Option<f64>,
    /// The service client's first jobs, untimed in the figures: one block
    /// stored and loaded back right after it connected.
    pub service_first_jobs_ms: Option<f64>,
}

/// The KV memory a run targets, and its copies for the ceilings.
trait Target {
    fn memory(&self) -> &KvMemory;
    fn write(&self, addr: u64, data: &[u8]) -> Result<()>;
    fn read(&self, addr: u64, out: &mut [u8]) -> Result<()>;
    fn clear(&self) -> Result<()>;
    /// Seconds to copy `len` bytes `times` times host -> KV memory (`up`)
    /// or back, from and to pinned host memory.
    fn copy_alone(&self, len: usize, times: u32, up: bool) -> Result<f64>;
    fn copier(&self, capacity: usize) -> Result<Box<dyn DeviceCopier>>;
    /// A staging buffer the copier reaches: (host address, copier address).
    fn staging(&self, len: usize) -> Result<(Box<dyn std::any::Any>, u64)>;
    fn staged(&self, tier: Tier, cfg: StagingConfig) -> Result<StagedTier>;
    /// A staged client of the service `b` connects to, over this memory.
    fn service_client(&self, b: ServiceBuilder, cfg: StagingConfig) -> Result<StagedServiceClient>;
}

struct HostDouble(Arc<HostKvCache>);

impl Target for HostDouble {
    fn memory(&self) -> &KvMemory {
        self.0.memory()
    }
    fn write(&self, addr: u64, data: &[u8]) -> Result<()> {
        // SAFETY: `addr` is inside the cache (computed from its layout).
        unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), addr as *mut u8, data.len()) };
        Ok(())
    }
    fn read(&self, addr: u64, out: &mut [u8]) -> Result<()> {
        // SAFETY: as in write.
        unsafe { std::ptr::copy_nonoverlapping(addr as *const u8, out.as_mut_ptr(), out.len()) };
        Ok(())
    }
    fn clear(&self) -> Result<()> {
        self.0.clear();
        Ok(())
    }
    fn copy_alone(&self, len: usize, times: u32, _up: bool) -> Result<f64> {
        let a = vec![1u8; len];
        let mut b = vec![0u8; len];
        let t0 = Instant::now();
        for _ in 0..times {
            b.copy_from_slice(std::hint::black_box(&a));
        }
        std::hint::black_box(&b);
        Ok(t0.elapsed().as_secs_f64())
    }
    fn copier(&self, _capacity: usize) -> Result<Box<dyn DeviceCopier>> {
        Ok(Box::new(HostCopier::default()))
    }
    fn staging(&self, len: usize) -> Result<(Box<dyn std::any::Any>, u64)> {
        let b = kvtier::memory::DmaBuffer::new(len)?;
        let a = b.addr();
        Ok((Box::new(b), a))
    }
    fn staged(&self, tier: Tier, cfg: StagingConfig) -> Result<StagedTier> {
        StagedTier::with_host_double(tier, self.0.clone(), cfg)
    }
    fn service_client(&self, b: ServiceBuilder, cfg: StagingConfig) -> Result<StagedServiceClient> {
        b.staged_host_double(self.0.clone()).staging(cfg).build()
    }
}

struct Hbm {
    ctx: Context,
    buffers: Vec<DeviceBuffer>,
    memory: KvMemory,
}

impl Hbm {
    fn new(
        ctx: &Context,
        geometry: KvGeometry,
        num_blocks: u32,
        layout: HostLayout,
    ) -> Result<Hbm> {
        let per_layer = 2 * num_blocks as usize * geometry.object_bytes() as usize;
        let (buffers, layout) = match layout {
            HostLayout::PerLayer => {
                let b = (0..geometry.layers)
                    .map(|_| DeviceBuffer::alloc(ctx, per_layer))
                    .collect::<Result<Vec<_>>>()?;
                let bases = b.iter().map(DeviceBuffer::device_ptr).collect();
                (b, KvLayout::PerLayer { layer_bases: bases })
            }
            HostLayout::CrossLayer => {
                let b = DeviceBuffer::alloc(ctx, per_layer * geometry.layers as usize)?;
                let base = b.device_ptr();
                (vec![b], KvLayout::CrossLayer { base })
            }
        };
        let ordinal = ctx.device().ordinal() as u32;
        Ok(Hbm {
            ctx: ctx.clone(),
            buffers,
            memory: KvMemory {
                geometry,
                num_blocks,
                layout,
                kind: MemoryKind::Gpu { ordinal },
            },
        })
    }

    fn buffer_of(&self, addr: u64, len: usize) -> Result<(&DeviceBuffer, usize)> {
        self.buffers
            .iter()
            .find(|b| {
                b.device_ptr() <= addr && addr + len as u64 <= b.device_ptr() + b.len() as u64
            })
            .map(|b| (b, (addr - b.device_ptr()) as usize))
            .ok_or_else(|| Error::invalid(format!("{addr:#x}+{len} outside the bench's HBM")))
    }
}

impl Target for Hbm {
    fn memory(&self) -> &KvMemory {
        &self.memory
    }
    fn write(&self, addr: u64, data: &[u8]) -> Result<()> {
        let (b, off) = self.buffer_of(addr, data.len())?;
        b.write(off, data)
    }
    fn read(&self, addr: u64, out: &mut [u8]) -> Result<()> {
        let (b, off) = self.buffer_of(addr, out.len())?;
        b.read(off, out)
    }
    fn clear(&self) -> Result<()> {
        for b in &self.buffers {
            let zero = vec![0u8; b.len().min(64 << 20)];
            for off in (0..b.len()).step_by(zero.len()) {
                let n = zero.len().min(b.len() - off);
                b.write(off, &zero[..n])?;
            }
        }
        Ok(())
    }
    fn copy_alone(&self, len: usize, times: u32, up: bool) -> Result<f64> {
        let host = PinnedHostBuffer::alloc(&self.ctx, len)?;
        let dev = DeviceBuffer::alloc(&self.ctx, len)?;
        let s = self.ctx.stream()?;
        let (dst, src) = if up {
            (dev.device_ptr(), host.device_ptr())
        } else {
            (host.device_ptr(), dev.device_ptr())
        };
        // One copy first: the timed ones start warm.
        // SAFETY: both buffers are ours, alive until the synchronize below.
        unsafe { s.memcpy_async(dst, src, len)? };
        s.synchronize()?;
        let t0 = Instant::now();
        for _ in 0..times {
            // SAFETY: as above.
            unsafe { s.memcpy_async(dst, src, len)? };
        }
        s.synchronize()?;
        Ok(t0.elapsed().as_secs_f64())
    }
    fn copier(&self, capacity: usize) -> Result<Box<dyn DeviceCopier>> {
        Ok(Box::new(CudaCopier::new(&self.ctx, capacity)?))
    }
    fn staging(&self, len: usize) -> Result<(Box<dyn std::any::Any>, u64)> {
        let b = PinnedHostBuffer::alloc(&self.ctx, len)?;
        let a = b.device_ptr();
        Ok((Box::new(b), a))
    }
    fn staged(&self, tier: Tier, cfg: StagingConfig) -> Result<StagedTier> {
        // SAFETY: the buffers live in self, which outlives the staged tier
        // (dropped at the end of each context's run).
        unsafe { StagedTier::on_gpu(tier, &self.ctx, self.memory.clone(), cfg) }
    }
    fn service_client(&self, b: ServiceBuilder, cfg: StagingConfig) -> Result<StagedServiceClient> {
        // SAFETY: as in `staged`: the client is closed and dropped before
        // self (`run` drops its `ServiceRig` before its target).
        unsafe { b.memory(self.memory.clone()) }
            .staging(cfg)
            .build()
    }
}

/// Which memory `kvtier bench --memory` targets.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BenchMemory {
    Gpu,
    HostDouble,
}

/// Why this machine cannot run the GPU bench, naming the fix; `None` when it can.
pub fn gpu_unavailable() -> Option<String> {
    let fix = "run it on a machine where `kvtier doctor` shows a usable GPU, or drop --memory gpu to benchmark host memory";
    match kvtier::gpu::probe() {
        Err(e) => return Some(format!("`kvtier bench --memory gpu` needs a CUDA GPU, and the driver is not usable here ({e}); {fix}")),
        Ok(i) if i.devices.is_empty() => {
            return Some(format!("`kvtier bench --memory gpu` needs a CUDA GPU, and the driver sees none; {fix}"))
        }
        Ok(_) => {}
    }
    if !kvtier::gpu::kernels::built_with_kernels() {
        return Some("`kvtier bench --memory gpu` needs the staging kernels, and this kvtier was built without them (no nvcc): run scripts/install-nvcc.sh, then rebuild".into());
    }
    None
}

fn gib_s(bytes: u64, secs: f64) -> f64 {
    bytes as f64 / (1u64 << 30) as f64 / secs.max(1e-9)
}

/// Fill every block of `t` with its key's pattern (block b: seed base + b),
/// one contiguous region write at a time.
fn fill(t: &dyn Target, blocks: u64, seed_base: u64) -> Result<()> {
    let m = t.memory();
    let g = m.geometry;
    let obj = g.object_bytes() as usize;
    let mut buf = vec![0u8; obj];
    for b in 0..blocks as u32 {
        for l in 0..g.layers {
            for kv in 0..2 {
                pattern_fill(&mut buf, seed_base + b as u64, l, kv);
                t.write(m.object_addr(b, l, kv), &buf)?;
            }
        }
    }
    Ok(())
}

fn verify(t: &dyn Target, blocks: u64, seed_base: u64, tokens: u64) -> Result<()> {
    let m = t.memory();
    let g = m.geometry;
    let obj = g.object_bytes() as usize;
    let (mut want, mut got) = (vec![0u8; obj], vec![0u8; obj]);
    for b in 0..blocks as u32 {
        for l in 0..g.layers {
            for kv in 0..2 {
                pattern_fill(&mut want, seed_base + b as u64, l, kv);
                t.read(m.object_addr(b, l, kv), &mut got)?;
                if want != got {
                    return Err(Error::invalid(format!(
                        "restored block {b} (layer {l}, kv {kv}) of the {tokens}-token context differs from what was stored"
                    )));
                }
            }
        }
    }
    Ok(())
}

pub fn run(
    cfg: &BenchConfig,
    which: BenchMemory,
    service: bool,
    mut progress: impl FnMut(&str),
) -> Result<HbmReport> {
    if cfg.nvme.is_some() {
        return Err(Error::Unsupported(
            "--memory gpu runs on pool files (--engine uring) in this build".into(),
        ));
    }
    if which == BenchMemory::Gpu {
        if let Some(why) = gpu_unavailable() {
            return Err(Error::Unsupported(why));
        }
    }
    let geo = cfg.geometry;
    crate::cli::make_dir(&cfg.dir)?;
    let per_dev = (cfg.capacity / cfg.devices as u64) & !4095;
    let mut scratch = Vec::new();
    for i in 0..cfg.devices {
        let path = cfg.dir.join(format!("bench-hbm{i}.pool"));
        scratch.push(ScratchFile::create_new(&path, "kvtier bench")?);
    }
    if cfg.keep {
        scratch.iter_mut().for_each(ScratchFile::keep);
    }
    // Created, formatted and reopened through the descriptors made here,
    // never by name (a symlink swapped in meanwhile receives nothing).
    let files = || {
        scratch
            .iter()
            .map(ScratchFile::descriptor)
            .collect::<Result<Vec<_>>>()
    };
    let pool = Pool::create_in_files(
        &PoolConfig::new(geo, cfg.model.clone(), format!("bench/{}", cfg.model))
            .with_group_blocks(cfg.group_blocks)
            .with_prewrite(cfg.prewrite),
        files()?,
        per_dev,
        &mut |done, total| super::prewrite_progress(&mut progress, done, total),
    )?;
    check_scratch_pool(&pool, &scratch)?;
    let slots = pool.index().total_slots();
    drop(pool);
    let (contexts, mut skipped, max_blocks) =
        super::contexts_that_fit(&cfg.contexts, &geo, slots, "the pool's");
    let max_blocks = max_blocks as u32;
    let layout = if cfg.cross_layer {
        HostLayout::CrossLayer
    } else {
        HostLayout::PerLayer
    };
    // A store area of up to 256 blocks in 4 chunks: the gather of one chunk
    // runs while the chunks before it are written.
    let store_blocks = max_blocks.clamp(1, 256);
    let staging = StagingConfig::new(4, max_blocks.max(1), store_blocks)
        .with_store_chunk_blocks(store_blocks.div_ceil(4));
    let mut report = HbmReport {
        config: cfg.clone(),
        machine: Machine::probe(&cfg.dir),
        memory: String::new(),
        staging,
        results: Vec::new(),
        skipped: Vec::new(),
        staging_huge_page_share: None,
        host_huge_page_share: None,
        staging_engine: String::new(),
        service_staging: None,
        service_slice_huge_page_share: None,
        service_first_jobs_ms: None,
    };
    if max_blocks == 0 {
        report.skipped = skipped;
        return Ok(report);
    }
    crate::cli::check_host_memory(
        staging.bytes(&geo) + max_blocks as u64 * geo.block_bytes(),
        &format!("staging and a host copy of a {max_blocks}-block context"),
        "give smaller --contexts",
    )?;
    let target: Box<dyn Target> = match which {
        BenchMemory::Gpu => {
            let dev = Device::get(0)?;
            let ctx = Context::primary(&dev)?;
            report.memory = format!("gpu {}", kvtier::gpu::probe()?.devices[0].name);
            Box::new(Hbm::new(&ctx, geo, max_blocks, layout)?)
        }
        BenchMemory::HostDouble => {
            report.memory =
                "host double (no GPU: the CPU does the copies; figures are not a GPU's)".into();
            Box::new(HostDouble(Arc::new(HostKvCache::new(
                geo, max_blocks, layout,
            )?)))
        }
    };
    // Host memory holding the same bytes as the KV memory: the disk-alone
    // references write from it and read into it.
    let host = Arc::new(HostKvCache::new(geo, max_blocks, layout)?);
    let obj = geo.object_bytes();
    let open_tier = || -> Result<Tier> {
        Tier::open(
            Pool::open_in_files(files()?, &OpenExpect::default())?,
            cfg.tier.clone(),
        )
    };
    let host_tier = || -> Result<Tier> {
        let mut t = open_tier()?;
        t.register_host_cache(host.clone())?;
        Ok(t)
    };
    let pool_file = || -> Result<(std::fs::File, String)> {
        match &scratch[..] {
            [f] => {
                let (fd, path) = f.descriptor()?;
                Ok((fd, path.display().to_string()))
            }
            _ => Err(Error::invalid(
                "--memory gpu's disk-write reference rewrites one pool file: give --devices 1",
            )),
        }
    };

    // Declared after `target`, so dropped (its client closed) before it.
    let rig = if service {
        let st = service_staging(&staging, max_blocks);
        let rig = ServiceRig::start(cfg, target.as_ref(), st, &mut progress)?;
        report.service_staging = Some(st);
        report.service_first_jobs_ms = Some(rig.first_job_ms);
        Some(rig)
    } else {
        None
    };
    let mut stored_blocks = 0u64;
    for (ci, &tokens) in contexts.iter().enumerate() {
        let blocks = geo.tokens_to_blocks(tokens);
        let bytes = blocks * geo.block_bytes();
        let seed = (ci as u64 + 1) << 40;
        let keys: Vec<Key> = (0..blocks).map(|b| Key::from_u64(seed + b)).collect();
        let mem: Vec<u32> = (0..blocks as u32).collect();
        progress(&format!(
            "{tokens} tokens: filling {} of KV memory",
            human_bytes(bytes)
        ));
        fill(target.as_ref(), blocks, seed)?;
        for b in 0..blocks {
            host.fill_block(b as u32, seed + b);
        }

        // The crc's cost: the store's gather of one chunk with and without
        // checksums (the scatter kernel over the same list), each the median
        // of 5 calls after a warm one.
        let list_len = (blocks as usize).min(staging.store_chunk() as usize)
            * geo.objects_per_block() as usize;
        let (_stage, stage_addr) = target.staging(list_len * obj as usize)?;
        let m = target.memory();
        let list: Vec<CopyDesc> = (0..list_len)
            .map(|i| {
                let (b, o) = (
                    (i / geo.objects_per_block() as usize) as u32,
                    i % geo.objects_per_block() as usize,
                );
                CopyDesc {
                    src: m.object_addr(b, (o / 2) as u32, (o % 2) as u32),
                    dst: stage_addr + i as u64 * obj,
                    len: obj as u32,
                    reserved: 0,
                }
            })
            .collect();
        let mut copier = target.copier(list_len)?;
        let (gather_crc, gather_copy) = time_gathers(copier.as_mut(), &list, 5)?;
        let gather_scale = blocks as f64 * geo.objects_per_block() as f64 / list_len as f64;
        drop(copier);

        // The slots the store will take: a fresh pool hands out its free
        // slots in order, so while nothing was evicted they follow the
        // contexts stored before (checked after the store).
        let planned: Option<Vec<u64>> = (stored_blocks + blocks <= slots)
            .then(|| (stored_blocks..stored_blocks + blocks).collect());
        stored_blocks = match planned {
            Some(_) => stored_blocks + blocks,
            None => u64::MAX,
        };
        let mut first_write = None;
        match &planned {
            Some(planned) => {
                progress(&format!(
                    "{tokens} tokens: the engine alone writing the store's slots first (untimed)"
                ));
                let (fd, name) = pool_file()?;
                let t = host_tier()?;
                let r = super::rewrite::rewrite_slots(
                    &t,
                    &fd,
                    &name,
                    planned,
                    &mem,
                    &super::rewrite::StoreShape {
                        job_blocks: staging.store_chunk() as usize,
                        max_io_bytes: cfg.tier.max_io_bytes,
                        uring: &cfg.tier.uring,
                    },
                )?;
                first_write = Some(r.durable_gib_s);
            }
            None => skipped.push(format!(
                "{tokens} tokens: no engine-alone write before the store: the store evicts \
                 (the pool cannot hold every context), so its slots are not known before it"
            )),
        }

        progress(&format!(
            "{tokens} tokens: staged store of {}",
            human_bytes(bytes)
        ));
        let mut st = target.staged(open_tier()?, staging)?;
        let t0 = Instant::now();
        let mut jobs = Vec::new();
        for (kc, mc) in keys
            .chunks(cfg.store_job_blocks as usize)
            .zip(mem.chunks(cfg.store_job_blocks as usize))
        {
            jobs.push(st.submit_store(kc, mc)?);
        }
        for j in jobs {
            super::job_ok(&st.wait(j)?, "staged store")?;
        }
        let store_secs = t0.elapsed().as_secs_f64();
        if report.staging_huge_page_share.is_none() {
            report.staging_huge_page_share = huge_pages_of(st.tier());
            report.staging_engine = st.tier().engine().describe();
        }
        if let Some(planned) = &planned {
            let ix = st.tier().pool().index();
            if !keys
                .iter()
                .zip(planned)
                .all(|(k, &s)| ix.get(k).is_some_and(|e| e.slot == s))
            {
                first_write = None;
                skipped.push(format!(
                    "{tokens} tokens: the store took other slots than the engine alone wrote \
                     first; that first write is left out"
                ));
            }
        }
        drop(st);

        // Its disk-alone reference, right after it: the same bytes (host
        // memory holds them) to the same offsets in the same I/Os, then
        // one flush.
        progress(&format!(
            "{tokens} tokens: the engine alone writing the same {} again, then one flush",
            human_bytes(bytes)
        ));
        let disk_write = {
            let (fd, name) = pool_file()?;
            let t = host_tier()?;
            if report.host_huge_page_share.is_none() {
                report.host_huge_page_share = huge_pages_of(&t);
            }
            super::rewrite::rewrite_stored(
                &t,
                &fd,
                &name,
                &keys,
                &mem,
                &super::rewrite::StoreShape {
                    job_blocks: staging.store_chunk() as usize,
                    max_io_bytes: cfg.tier.max_io_bytes,
                    uring: &cfg.tier.uring,
                },
            )?
            .durable_gib_s
        };

        target.clear()?;
        progress(&format!("{tokens} tokens: staged restore, layer by layer"));
        let mut st = target.staged(open_tier()?, staging)?;
        let t0 = Instant::now();
        let job = st.submit_load(&keys, &mem, 0..geo.layers)?;
        st.wait_layer(job, 0)?;
        let first_ms = t0.elapsed().as_secs_f64() * 1e3;
        let r = st.wait(job)?;
        let restore_secs = t0.elapsed().as_secs_f64();
        super::job_ok(&r, "staged restore")?;
        st.layer_events();
        drop(st);
        let verified = if cfg.verify {
            progress(&format!("{tokens} tokens: verifying"));
            verify(target.as_ref(), blocks, seed, tokens)?;
            true
        } else {
            false
        };

        progress(&format!(
            "{tokens} tokens: ceilings (disk read alone, copy alone)"
        ));
        let mut tier = host_tier()?;
        host.clear();
        let t0 = Instant::now();
        let j = tier.submit_load(&keys, &mem, 0..geo.layers)?;
        super::job_ok(&tier.wait(j)?, "host load")?;
        let disk_read = t0.elapsed().as_secs_f64();
        tier.layer_events();
        drop(tier);
        let layer_bytes = (2 * blocks * obj) as usize;
        let h2d = target.copy_alone(layer_bytes, geo.layers, true)?;
        let d2h = target.copy_alone(layer_bytes, geo.layers, false)?;

        let (restore, disk_r, up) = (
            gib_s(bytes, restore_secs),
            gib_s(bytes, disk_read),
            gib_s(bytes, h2d),
        );
        let (store, down) = (gib_s(bytes, store_secs), gib_s(bytes, d2h));
        let service = match &rig {
            Some(rig) => {
                let keys: Vec<Key> = (0..blocks)
                    .map(|b| Key::from_u64(seed + SERVICE_KEYS + b))
                    .collect();
                // KV memory holds the context again: the restore above
                // put it back (and verified it, unless --no-verify).
                let f = rig.store_and_restore(cfg, target.as_ref(), &keys, &mem, &mut progress)?;
                let verified = if cfg.verify {
                    progress(&format!("{tokens} tokens: verifying the service's restore"));
                    verify(target.as_ref(), blocks, seed, tokens)?;
                    true
                } else {
                    false
                };
                let (s_restore, s_store) =
                    (gib_s(bytes, f.restore_secs), gib_s(bytes, f.store_secs));
                Some(ServiceFigures {
                    restore_gib_s: s_restore,
                    restore_first_layer_ms: f.first_layer_ms,
                    store_gib_s: s_store,
                    restore_vs_in_process: s_restore / restore.max(1e-9),
                    store_vs_in_process: s_store / store.max(1e-9),
                    restore_vs_ceiling: s_restore / disk_r.min(up),
                    store_vs_ceiling: s_store / disk_write.min(down),
                    verified,
                })
            }
            None => None,
        };
        report.results.push(HbmResult {
            tokens,
            blocks,
            bytes,
            restore_gib_s: restore,
            restore_first_layer_ms: first_ms,
            disk_read_gib_s: disk_r,
            h2d_gib_s: up,
            restore_vs_ceiling: restore / disk_r.min(up),
            store_gib_s: store,
            disk_write_gib_s: disk_write,
            disk_first_write_gib_s: first_write,
            d2h_gib_s: down,
            store_vs_ceiling: store / disk_write.min(down),
            gather_crc_ms: gather_crc * gather_scale * 1e3,
            gather_copy_ms: gather_copy * gather_scale * 1e3,
            gather_share_of_store: gather_crc * gather_scale / store_secs,
            crc_share_of_store: ((gather_crc - gather_copy) * gather_scale).max(0.0) / store_secs,
            verified,
            service,
        });
    }
    if let Some(rig) = rig {
        report.service_slice_huge_page_share = rig.slice_huge_page_share();
        rig.finish()?;
    }
    report.skipped = skipped;
    Ok(report)
}

/// The service run's keys: the in-process run's plus this (the same bytes
/// under other keys, so the service's store writes them anew).
const SERVICE_KEYS: u64 = 1 << 39;

/// The service client's staging: the in-process run's store area and
/// chunks, and 4 layer buffers of at most 256 blocks. A slice's block holds
/// every layer (the service shares block-major memory), so its layer
/// buffers take 32 times the memory of the in-process path's for
/// llama3-8b: loads of more blocks go in chunks of 256 per layer, as a
/// client's default staging (`staging_for_slice`) does with its slice.
fn service_staging(in_process: &StagingConfig, max_blocks: u32) -> StagingConfig {
    StagingConfig::new(4, max_blocks.clamp(1, 256), in_process.store_blocks)
        .with_store_chunk_blocks(in_process.store_chunk())
}

/// Seconds of a run through the service.
struct ServiceTimes {
    store_secs: f64,
    restore_secs: f64,
    first_layer_ms: f64,
}

/// The node's service, started in this process on a pool of its own in a
/// new directory under --dir (made like the bench's, prewritten alike),
/// and one staged client of it over the bench's KV memory. Dropped (or
/// `finish`ed), it closes the client, stops the service (every job
/// ended) and removes what it made: the pool file, the socket, the
/// directory.
struct ServiceRig {
    client: Option<StagedServiceClient>,
    stopper: Option<kvtier::service::Stopper>,
    thread: Option<std::thread::JoinHandle<Result<()>>>,
    dir: PathBuf,
    sock: PathBuf,
    /// The pool's files in `dir`.
    files: u32,
    /// A one-block store and load back, the client's first jobs.
    first_job_ms: f64,
}

impl ServiceRig {
    fn start(
        cfg: &BenchConfig,
        target: &dyn Target,
        staging: StagingConfig,
        progress: &mut dyn FnMut(&str),
    ) -> Result<ServiceRig> {
        let g = cfg.geometry;
        // A directory of this run's own: create_dir fails where anything
        // is, so nothing of anyone else's is opened, written or removed.
        let dir = cfg
            .dir
            .join(format!("bench-service-{}", std::process::id()));
        std::fs::create_dir(&dir).map_err(|e| {
            Error::io(
                format!(
                    "making {} for the service's pool (remove it if a past run left it)",
                    dir.display()
                ),
                e,
            )
        })?;
        let slice_blocks = staging.load_blocks * staging.layer_buffers + staging.store_blocks;
        progress(&format!(
            "--service: the node's service on a pool of its own ({}{}), its client sharing {} of staging",
            human_bytes(cfg.capacity),
            if cfg.prewrite { ", prewritten" } else { "" },
            human_bytes(slice_blocks as u64 * g.block_bytes())
        ));
        let sock = dir.join("kvtier.sock");
        let mut rig = ServiceRig {
            client: None,
            stopper: None,
            thread: None,
            dir: dir.clone(),
            sock: sock.clone(),
            files: cfg.devices,
            first_job_ms: 0.0,
        };
        let builder = TierBuilder::default()
            .directory(&dir)
            .directory_files(cfg.devices)
            .capacity(cfg.capacity)
            .geometry(g)
            .model_name(cfg.model.clone())
            .group_blocks(cfg.group_blocks)
            .prewrite(cfg.prewrite)
            .config({
                let mut c = HandleConfig::default();
                c.tier = cfg.tier.clone();
                c
            });
        let svc = Service::start(
            builder,
            g,
            ServiceConfig::new(&sock)
                .with_clients(1)
                .with_client_blocks(slice_blocks),
        )?;
        rig.stopper = Some(svc.stopper());
        rig.thread = Some(
            std::thread::Builder::new()
                .name("bench-service".into())
                .spawn(move || svc.run())
                .map_err(|e| Error::io("starting the bench's service thread", e))?,
        );
        let client = target.service_client(TierBuilder::default().service(&sock), staging)?;
        // One block stored and loaded back first, untimed but said: a
        // client's first job carries the service's check of its slice (every
        // page faulted in), which the contexts' figures leave out as the
        // in-process path's leave out its registration.
        let t0 = Instant::now();
        let key = [Key::from_u64(SERVICE_KEYS - 1)];
        super::job_ok(
            &client.wait(client.submit_store(&key, &[0])?)?,
            "the service's first store",
        )?;
        super::job_ok(
            &client.wait(client.submit_load(&key, &[0], 0..g.layers)?)?,
            "the service's first load",
        )?;
        rig.first_job_ms = t0.elapsed().as_secs_f64() * 1e3;
        rig.client = Some(client);
        Ok(rig)
    }

    /// The share of the client's slice in huge pages (smaps counts a
    /// hugetlbfs page where this mapping has touched it: ask after a run).
    fn slice_huge_page_share(&self) -> Option<f64> {
        let m = self.client.as_ref()?.shared_mapping()?;
        super::huge_page_share(&[(m.addr(), m.len())])
    }

    /// Store `keys` from `mem` of `target` in the bench's store jobs,
    /// clear `target`, restore them layer by layer.
    fn store_and_restore(
        &self,
        cfg: &BenchConfig,
        target: &dyn Target,
        keys: &[Key],
        mem: &[u32],
        progress: &mut dyn FnMut(&str),
    ) -> Result<ServiceTimes> {
        let client = self
            .client
            .as_ref()
            .ok_or_else(|| Error::internal("the bench's service client is gone"))?;
        let g = cfg.geometry;
        let tokens = keys.len() as u64 * g.block_size as u64;
        progress(&format!(
            "{tokens} tokens: staged store through the service"
        ));
        let t0 = Instant::now();
        let mut jobs = Vec::new();
        let per_job = cfg.store_job_blocks as usize;
        for (kc, mc) in keys.chunks(per_job).zip(mem.chunks(per_job)) {
            jobs.push(client.submit_store(kc, mc)?);
        }
        for j in jobs {
            super::job_ok(&client.wait(j)?, "staged store through the service")?;
        }
        let store_secs = t0.elapsed().as_secs_f64();
        target.clear()?;
        progress(&format!(
            "{tokens} tokens: staged restore through the service, layer by layer"
        ));
        let t0 = Instant::now();
        let job = client.submit_load(keys, mem, 0..g.layers)?;
        client.wait_layer(job, 0)?;
        let first_layer_ms = t0.elapsed().as_secs_f64() * 1e3;
        super::job_ok(&client.wait(job)?, "staged restore through the service")?;
        Ok(ServiceTimes {
            store_secs,
            restore_secs: t0.elapsed().as_secs_f64(),
            first_layer_ms,
        })
    }

    /// Close the client, stop the service, remove what was made; the first
    /// error of these.
    fn finish(mut self) -> Result<()> {
        self.end()
    }

    fn end(&mut self) -> Result<()> {
        let closed = self.client.take().map_or(Ok(()), |c| c.close());
        if let Some(s) = &self.stopper {
            s.stop();
        }
        let stopped = match self.thread.take() {
            Some(t) => t
                .join()
                .unwrap_or_else(|_| Err(Error::internal("the bench's service thread panicked"))),
            None => Ok(()),
        };
        // Only what this rig made: the socket (the service removes it as
        // it stops), the pool's files, then the directory, which
        // remove_dir leaves if anything else is in it.
        let _ = std::fs::remove_file(&self.sock);
        let removed = kvtier::pool::place::directory_files(&self.dir, self.files)
            .into_iter()
            .filter(|f| f.exists())
            .try_for_each(|f| {
                std::fs::remove_file(&f)
                    .map_err(|e| Error::io(format!("removing {}", f.display()), e))
            })
            .and_then(|()| {
                std::fs::remove_dir(&self.dir)
                    .map_err(|e| Error::io(format!("removing {}", self.dir.display()), e))
            });
        closed.and(stopped).and(removed)
    }
}

impl Drop for ServiceRig {
    fn drop(&mut self) {
        if self.thread.is_some() || self.dir.exists() {
            let _ = self.end();
        }
    }
}

/// The share of a tier's registered memory that huge pages back.
fn huge_pages_of(t: &Tier) -> Option<f64> {
    let regions: Vec<(u64, u64)> = t
        .p2p_table()?
        .regions()
        .iter()
        .map(|r| (r.addr, r.len))
        .collect();
    super::huge_page_share(&regions)
}

/// Seconds of one gather with checksums and of the same copies without
/// (the scatter kernel over the gather's list), each the median of `n`
/// calls, alternated after a warm call of each so that neither runs on a
/// cold or a hot machine alone.
fn time_gathers(copier: &mut dyn DeviceCopier, list: &[CopyDesc], n: usize) -> Result<(f64, f64)> {
    copier.gather_crc32c(list)?;
    copier.finish()?;
    copier.scatter(list)?;
    copier.finish()?;
    let (mut with, mut without) = (Vec::with_capacity(n), Vec::with_capacity(n));
    for _ in 0..n.max(1) {
        let t0 = Instant::now();
        copier.gather_crc32c(list)?;
        let crcs = copier.finish()?;
        with.push(t0.elapsed().as_secs_f64());
        if crcs.len() != list.len() {
            return Err(Error::internal(format!(
                "the gather returned {} checksums for {} copies",
                crcs.len(),
                list.len()
            )));
        }
        let t0 = Instant::now();
        copier.scatter(list)?;
        copier.finish()?;
        without.push(t0.elapsed().as_secs_f64());
    }
    let median = |mut v: Vec<f64>| {
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    Ok((median(with), median(without)))
}

pub fn render(r: &HbmReport) -> String {
    use std::fmt::Write;
    let share = |x: Option<f64>| x.map_or("?".to_string(), |x| format!("{:.0}%", x * 100.0));
    let mut s = String::new();
    let _ = writeln!(
        s,
        "kvtier bench --memory: {} · model {} · staging {} ({} layer buffers, loads <= {} blocks, stores <= {} in chunks of {}) · huge pages: staging {}, host {}",
        r.memory,
        r.config.model,
        human_bytes(r.staging.bytes(&r.config.geometry)),
        r.staging.layer_buffers,
        r.staging.load_blocks,
        r.staging.store_blocks,
        r.staging.store_chunk(),
        share(r.staging_huge_page_share),
        share(r.host_huge_page_share)
    );
    let _ = writeln!(
        s,
        "{:>8} {:>9} | {:>8} {:>8} {:>8} {:>6} | {:>8} {:>8} {:>8} {:>6} | {:>7} {:>7}",
        "tokens",
        "bytes",
        "restore",
        "disk rd",
        "H2D",
        "ratio",
        "store",
        "disk wr",
        "D2H",
        "ratio",
        "gather",
        "crc"
    );
    for x in &r.results {
        let _ = writeln!(
            s,
            "{:>8} {:>9} | {:>8.2} {:>8.2} {:>8.2} {:>5.2}x | {:>8.2} {:>8.2} {:>8.2} {:>5.2}x | {:>6.1}% {:>6.2}%",
            x.tokens,
            human_bytes(x.bytes),
            x.restore_gib_s,
            x.disk_read_gib_s,
            x.h2d_gib_s,
            x.restore_vs_ceiling,
            x.store_gib_s,
            x.disk_write_gib_s,
            x.d2h_gib_s,
            x.store_vs_ceiling,
            x.gather_share_of_store * 100.0,
            x.crc_share_of_store * 100.0
        );
    }
    let _ = writeln!(
        s,
        "GiB/s; ratio = staged / min(disk alone, copy alone), same run; disk wr = the engine alone \
         writing the store's bytes to its offsets in its I/Os, then one flush; gather, crc = the \
         gather's (with crc32c) and the crc32c's own shares of the store time (gathers overlap writes)"
    );
    if let Some(st) = &r.service_staging {
        let _ = writeln!(
            s,
            "through the node's service (a staged client; staging {}: {} layer buffers of {} blocks, stores <= {} in chunks of {}; slice in huge pages: {}; its first jobs, one block stored and loaded, untimed: {:.0} ms):",
            human_bytes(
                (st.layer_buffers as u64 * st.load_blocks as u64 + st.store_blocks as u64)
                    * r.config.geometry.block_bytes()
            ),
            st.layer_buffers,
            st.load_blocks,
            st.store_blocks,
            st.store_chunk(),
            share(r.service_slice_huge_page_share),
            r.service_first_jobs_ms.unwrap_or(0.0)
        );
        let _ = writeln!(
            s,
            "{:>8} | {:>8} {:>9} {:>7} {:>9} | {:>8} {:>9} {:>7}",
            "tokens", "restore", "layer0 ms", "ratio", "vs in-proc", "store", "ratio", "vs in-proc"
        );
        for x in &r.results {
            if let Some(v) = &x.service {
                let _ = writeln!(
                    s,
                    "{:>8} | {:>8.2} {:>9.1} {:>6.2}x {:>9.2}x | {:>8.2} {:>6.2}x {:>9.2}x",
                    x.tokens,
                    v.restore_gib_s,
                    v.restore_first_layer_ms,
                    v.restore_vs_ceiling,
                    v.restore_vs_in_process,
                    v.store_gib_s,
                    v.store_vs_ceiling,
                    v.store_vs_in_process
                );
            }
        }
        let _ = writeln!(
            s,
            "ratio = through the service / min(disk alone, copy alone) of the same run; vs in-proc = / the in-process staged path's of the same context"
        );
    }
    for k in &r.skipped {
        let _ = writeln!(s, "skipped: {k}");
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvtier::engine::uring::{UringConfig, UringDevice, UringEngine};
    use kvtier::engine::{EngineStats, IoEngine};
    use kvtier::p2p::P2pTable;
    use kvtier::ring::abi::{IOCB_STATE_FILLING, IOCTX_OP_WRITE};
    use kvtier::ring::GioRing;
    use kvtier::tier::TierConfig;
    use std::os::fd::RawFd;
    use std::sync::Mutex;

    /// The uring engine, recording every write it is given: (offset, bytes,
    /// segments).
    struct Recording {
        inner: UringEngine,
        writes: Arc<Mutex<Vec<(u64, u32, usize)>>>,
        /// Per write: the contiguous memory spans its segments make (what
        /// the engine merges them into: one DMA segment each).
        spans: Arc<Mutex<Vec<usize>>>,
        table: Option<Arc<P2pTable>>,
    }

    impl Recording {
        /// Note the IOCBs waiting in the SQ, then queue them again as they were.
        fn record(&mut self, ring: &mut GioRing) {
            let mut ids = Vec::new();
            while let Some(id) = ring.pop_sq() {
                ids.push(id);
            }
            for id in ids {
                let iocb = ring.iocb(id);
                let mut w = self.writes.lock().unwrap();
                for c in &iocb.ctx[..iocb.hdr.count as usize] {
                    if c.op == IOCTX_OP_WRITE {
                        w.push((c.dev_offset, c.len, c.seg_count as usize));
                        let first = c.seg_first as usize;
                        let segs = &iocb.segs[first..first + c.seg_count as usize];
                        let table = self.table.as_ref().expect("memory registered");
                        let mut spans = 0;
                        let mut end = None;
                        for &i in segs {
                            let d = table.entry(i).expect("a segment of the table");
                            if end != Some(d.addr) {
                                spans += 1;
                            }
                            end = Some(d.addr + d.len as u64);
                        }
                        self.spans.lock().unwrap().push(spans);
                    }
                }
                drop(w);
                ring.iocb_mut(id).hdr.state = IOCB_STATE_FILLING;
                ring.submit(id).unwrap();
            }
        }
    }

    impl IoEngine for Recording {
        fn name(&self) -> &'static str {
            "uring"
        }
        fn register_memory(&mut self, table: Arc<P2pTable>) -> Result<()> {
            self.table = Some(table.clone());
            self.inner.register_memory(table)
        }
        fn submit(&mut self, ring: &mut GioRing) -> Result<()> {
            self.record(ring);
            self.inner.submit(ring)
        }
        fn submit_and_wait(&mut self, ring: &mut GioRing) -> Result<()> {
            self.record(ring);
            self.inner.submit_and_wait(ring)
        }
        fn reap(&mut self, ring: &mut GioRing, wait: bool) -> Result<()> {
            self.inner.reap(ring, wait)
        }
        fn in_flight(&self) -> usize {
            self.inner.in_flight()
        }
        fn completion_fds(&self) -> Vec<RawFd> {
            self.inner.completion_fds()
        }
        fn stats(&self) -> EngineStats {
            self.inner.stats()
        }
        fn describe(&self) -> String {
            self.inner.describe()
        }
    }

    /// The disk-write reference is the staged store's disk work: the data
    /// writes a staged store (chunked, several chunks in flight, from the
    /// store staging) gives the engine are, write for write, the ones the
    /// reference plans from host memory: same offsets, same sizes, same
    /// segment counts (the old reference stored other keys at other slots);
    /// and each reads one contiguous span of the store staging.
    #[test]
    fn reference_writes_are_the_staged_stores_data_writes() {
        let dir = std::env::temp_dir().join(format!(
            "kvtier-hbm-plan-{}-{:?}",
            std::process::id(),
            std::time::SystemTime::now()
        ));
        std::fs::create_dir_all(&dir).unwrap();
        struct Rm(std::path::PathBuf);
        impl Drop for Rm {
            fn drop(&mut self) {
                let _ = std::fs::remove_dir_all(&self.0);
            }
        }
        let _rm = Rm(dir.clone());
        let geo = KvGeometry {
            layers: 3,
            kv_heads: 2,
            head_dim: 64,
            dtype: kvtier::DType::BF16,
            block_size: 16,
        };
        assert_eq!(geo.object_bytes(), 4096);
        let scratch = ScratchFile::create_new(&dir.join("p.pool"), "test").unwrap();
        let pool = Pool::create_in_files(
            &PoolConfig::new(geo, "t", "t/plan").with_group_blocks(4),
            vec![scratch.descriptor().unwrap()],
            64 << 20,
            &mut |_, _| {},
        )
        .unwrap();
        let fds = pool.device_fds().unwrap();
        let uring = UringConfig::default();
        let writes = Arc::new(Mutex::new(Vec::new()));
        let spans = Arc::new(Mutex::new(Vec::new()));
        let engine = Recording {
            inner: UringEngine::new(
                &fds.into_iter()
                    .map(|(fd, name)| UringDevice { fd, name })
                    .collect::<Vec<_>>(),
                uring.clone(),
            )
            .unwrap(),
            writes: writes.clone(),
            spans: spans.clone(),
            table: None,
        };
        // 12 KiB I/Os: a group's 4 objects of a layer's K split in two.
        let max_io = 3 * 4096;
        let tier = Tier::with_engine(
            pool,
            TierConfig::default().with_max_io_bytes(max_io),
            Box::new(engine),
        )
        .unwrap();
        let blocks = 10u32;
        let target = Arc::new(HostKvCache::new(geo, blocks, HostLayout::PerLayer).unwrap());
        let host = HostKvCache::new(geo, blocks, HostLayout::PerLayer).unwrap();
        for b in 0..blocks {
            target.fill_block(b, 7 + b as u64);
            host.fill_block(b, 7 + b as u64);
        }
        let staging = StagingConfig::new(2, 4, 4).with_store_chunk_blocks(2);
        let mut st = StagedTier::with_host_double(tier, target, staging).unwrap();
        // Blocks stored out of order, so chunks' slots are not their blocks.
        let mem: Vec<u32> = vec![3, 1, 4, 0, 9, 2, 6, 5, 8, 7];
        let keys: Vec<Key> = (0..blocks as u64).map(|i| Key::from_u64(100 + i)).collect();
        let j = st.submit_store(&keys, &mem).unwrap();
        assert!(st.wait(j).unwrap().all_ok());
        let slots: Vec<u64> = keys
            .iter()
            .map(|k| st.tier().pool().index().get(k).unwrap().slot)
            .collect();
        let layout = st.tier().pool().layout();
        let object_offsets: std::collections::HashSet<u64> = slots
            .iter()
            .flat_map(|&s| (0..geo.layers).flat_map(move |l| (0..2).map(move |kv| (s, l, kv))))
            .map(|(s, l, kv)| layout.object_offset(s, l, kv).1)
            .collect();
        let data_writes: Vec<((u64, u32, usize), usize)> = writes
            .lock()
            .unwrap()
            .iter()
            .copied()
            .zip(spans.lock().unwrap().iter().copied())
            .filter(|(w, _)| object_offsets.contains(&w.0))
            .collect();
        // Each data write reads one span of staging (a chunk's places side
        // by side in each layer), whatever its objects: one DMA segment.
        assert!(data_writes.iter().any(|(w, _)| w.2 >= 2), "{data_writes:?}");
        assert!(
            data_writes.iter().all(|&(_, spans)| spans == 1),
            "writes from staging in several spans: {data_writes:?}"
        );
        let mut got: Vec<(u64, u32, usize)> = data_writes.iter().map(|&(w, _)| w).collect();
        let table = P2pTable::build(host.memory()).unwrap();
        let mut want: Vec<(u64, u32, usize)> =
            super::super::rewrite::plan_writes(st.tier(), &table, &slots, &mem, 2, max_io)
                .unwrap()
                .into_iter()
                .map(|w| (w.offset, w.len, w.segs.len()))
                .collect();
        got.sort_unstable();
        want.sort_unstable();
        assert!(want.len() > 10, "{want:?}");
        assert_eq!(got, want);
        let bytes: u64 = want.iter().map(|w| w.1 as u64).sum();
        assert_eq!(bytes, blocks as u64 * geo.block_bytes());
        drop(st);
        drop(scratch);
    }
}
