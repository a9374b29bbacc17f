//! `kvtier bench --memory gpu`: restore into and store from KV memory in GPU
//! HBM through the staged path (`kvtier::staged`), each beside its two
//! ceilings measured in the same run on the same pool: the disk alone (the
//! same keys loaded into, or stored from, host memory) and the PCIe copy
//! alone (pinned host to HBM for a restore, HBM to pinned host for a
//! store, the same bytes layer by layer). A staged path that overlaps
//! well runs close to the lower of the two. Also the GPU crc32c's share of
//! a store: the gather kernel with and without checksums.
//!
//! `--memory host-double` (hidden) runs the same code with host memory
//! standing in for HBM and the CPU doing the copies (the test double): it
//! checks the bench's plumbing on machines without a GPU; its figures say
//! nothing about a GPU.

use super::{check_scratch_pool, BenchConfig, Machine};
use kvtier::error::{Error, Result};
use kvtier::gpu::staging::{CopyDesc, CudaCopier, DeviceCopier, HostCopier};
use kvtier::gpu::{Context, Device, DeviceBuffer, PinnedHostBuffer};
use kvtier::host::size::human_bytes;
use kvtier::memory::{pattern_fill, HostKvCache, HostLayout, KvLayout, KvMemory, MemoryKind};
use kvtier::model::KvGeometry;
use kvtier::pool::{Key, OpenExpect, Pool, PoolConfig};
use kvtier::scratch::ScratchFile;
use kvtier::staged::{StagedTier, StagingConfig};
use kvtier::tier::Tier;
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
    /// Ceiling: the same store from host memory (disk write alone).
    pub disk_write_gib_s: f64,
    /// Ceiling: KV memory to pinned host (copy alone).
    pub d2h_gib_s: f64,
    /// store / min(disk write, D2H).
    pub store_vs_ceiling: f64,
    /// The gather into staging with crc32c, and the same copies without.
    pub gather_crc_ms: f64,
    pub gather_copy_ms: f64,
    /// (gather_crc - gather_copy) / store time.
    pub crc_share_of_store: f64,
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
            .with_group_blocks(cfg.group_blocks),
        files()?,
        per_dev,
        &mut |_, _| {},
    )?;
    check_scratch_pool(&pool, &scratch)?;
    // Half the slots: the disk-write ceiling stores the same blocks again
    // under other keys without evicting the ones the read ceiling needs.
    let slots = pool.index().total_slots() / 2;
    drop(pool);
    let (contexts, skipped, max_blocks) =
        super::contexts_that_fit(&cfg.contexts, &geo, slots, "half the pool's");
    let max_blocks = max_blocks as u32;
    let layout = if cfg.cross_layer {
        HostLayout::CrossLayer
    } else {
        HostLayout::PerLayer
    };
    let staging = StagingConfig::new(4, max_blocks.max(1), max_blocks.clamp(1, 256));
    let mut report = HbmReport {
        config: cfg.clone(),
        machine: Machine::probe(&cfg.dir),
        memory: String::new(),
        staging,
        results: Vec::new(),
        skipped,
    };
    if max_blocks == 0 {
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
    let host = Arc::new(HostKvCache::new(geo, max_blocks, layout)?);
    let obj = geo.object_bytes();
    let open_tier = || -> Result<Tier> {
        Tier::open(
            Pool::open_in_files(files()?, &OpenExpect::default())?,
            cfg.tier.clone(),
        )
    };

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

        // The crc's cost: the store's gather with and without checksums.
        let list_len = (blocks as usize * geo.objects_per_block() as usize)
            .min(staging.store_blocks as usize * geo.objects_per_block() as usize);
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
        copier.gather_crc32c(&list)?; // warm
        copier.finish()?;
        let t0 = Instant::now();
        copier.gather_crc32c(&list)?;
        copier.finish()?;
        let gather_crc = t0.elapsed().as_secs_f64();
        let t0 = Instant::now();
        copier.scatter(&list)?;
        copier.finish()?;
        let gather_copy = t0.elapsed().as_secs_f64();
        let gather_scale = blocks as f64 * geo.objects_per_block() as f64 / list_len as f64;
        drop(copier);

        progress(&format!(
            "{tokens} tokens: staged store of {}",
            human_bytes(bytes)
        ));
        let mut st = target.staged(open_tier()?, staging)?;
        let t0 = Instant::now();
        let mut jobs = Vec::new();
        for (kc, mc) in keys
            .chunks(staging.store_blocks as usize)
            .zip(mem.chunks(staging.store_blocks as usize))
        {
            jobs.push(st.submit_store(kc, mc)?);
        }
        for j in jobs {
            super::job_ok(&st.wait(j)?, "staged store")?;
        }
        let store_secs = t0.elapsed().as_secs_f64();

        target.clear()?;
        progress(&format!("{tokens} tokens: staged restore, layer by layer"));
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
            "{tokens} tokens: ceilings (disk alone, copy alone)"
        ));
        let mut tier = open_tier()?;
        tier.register_host_cache(host.clone())?;
        host.clear();
        let t0 = Instant::now();
        let j = tier.submit_load(&keys, &mem, 0..geo.layers)?;
        super::job_ok(&tier.wait(j)?, "host load")?;
        let disk_read = t0.elapsed().as_secs_f64();
        tier.layer_events();
        let wkeys: Vec<Key> = (0..blocks)
            .map(|b| Key::from_u64(seed + (1 << 39) + b))
            .collect();
        let t0 = Instant::now();
        let mut jobs = Vec::new();
        for (kc, mc) in wkeys
            .chunks(cfg.store_job_blocks as usize)
            .zip(mem.chunks(cfg.store_job_blocks as usize))
        {
            jobs.push(tier.submit_store(kc, mc)?);
        }
        for j in jobs {
            super::job_ok(&tier.wait(j)?, "host store")?;
        }
        let disk_write = t0.elapsed().as_secs_f64();
        drop(tier);
        let layer_bytes = (2 * blocks * obj) as usize;
        let h2d = target.copy_alone(layer_bytes, geo.layers, true)?;
        let d2h = target.copy_alone(layer_bytes, geo.layers, false)?;

        let (restore, disk_r, up) = (
            gib_s(bytes, restore_secs),
            gib_s(bytes, disk_read),
            gib_s(bytes, h2d),
        );
        let (store, disk_w, down) = (
            gib_s(bytes, store_secs),
            gib_s(bytes, disk_write),
            gib_s(bytes, d2h),
        );
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
            disk_write_gib_s: disk_w,
            d2h_gib_s: down,
            store_vs_ceiling: store / disk_w.min(down),
            gather_crc_ms: gather_crc * gather_scale * 1e3,
            gather_copy_ms: gather_copy * gather_scale * 1e3,
            crc_share_of_store: ((gather_crc - gather_copy) * gather_scale).max(0.0) / store_secs,
            verified,
        });
    }
    Ok(report)
}

pub fn render(r: &HbmReport) -> String {
    use std::fmt::Write;
    let mut s = String::new();
    let _ = writeln!(
        s,
        "kvtier bench --memory: {} · model {} · staging {} ({} layer buffers, loads <= {} blocks, stores <= {})",
        r.memory,
        r.config.model,
        human_bytes(r.staging.bytes(&r.config.geometry)),
        r.staging.layer_buffers,
        r.staging.load_blocks,
        r.staging.store_blocks
    );
    let _ = writeln!(
        s,
        "{:>8} {:>9} | {:>8} {:>8} {:>8} {:>6} | {:>8} {:>8} {:>8} {:>6} | {:>7}",
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
        "crc"
    );
    for x in &r.results {
        let _ = writeln!(
            s,
            "{:>8} {:>9} | {:>8.2} {:>8.2} {:>8.2} {:>5.2}x | {:>8.2} {:>8.2} {:>8.2} {:>5.2}x | {:>6.1}%",
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
            x.crc_share_of_store * 100.0
        );
    }
    let _ = writeln!(
        s,
        "GiB/s; ratio = staged / min(disk alone, copy alone), same run; crc = the GPU crc32c's share of the store time"
    );
    for k in &r.skipped {
        let _ = writeln!(s, "skipped: {k}");
    }
    s
}
