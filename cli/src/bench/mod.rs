//! `kvtier bench`: store and retrieve model-shaped KV caches through the
//! tier, the way a serving engine would, and report bandwidth and host cost.
//!
//! For each context length: fill a host KV cache with a known pattern, store
//! it in one go (the coalesced layout's best case, and what an engine does on
//! eviction of a finished prefix), clear memory, then retrieve it layer by
//! layer through `submit_load` and `wait_layer`, and verify every byte.

pub mod fio;
pub mod hbm;
pub mod lookup;
pub mod plot;
pub mod raw;
mod rewrite;

use fio::{IoResult, Pattern, Workload};
use kvtier::engine::uring::UringConfig;
use kvtier::error::{Error, Result};
use kvtier::host::size::human_bytes;
use kvtier::memory::{HostKvCache, HostLayout};
use kvtier::model::KvGeometry;
use kvtier::pool::{DeviceSpec, Key, Pool, PoolConfig};
use kvtier::scratch::ScratchFile;
use kvtier::tier::{Tier, TierConfig};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

/// The first failed key of a finished job as an error naming what the job
/// did ("load", "store"): a bench's figures are only of jobs that succeeded.
pub(crate) fn job_ok(r: &kvtier::tier::JobResult, what: &str) -> Result<()> {
    match r.failures().next() {
        Some((k, why)) => Err(Error::invalid(format!("{what} of key {k} failed: {why}"))),
        None => Ok(()),
    }
}

#[derive(Clone, Debug, serde::Serialize)]
pub struct BenchConfig {
    #[serde(serialize_with = "kvtier::json::path_lossy")]
    pub dir: PathBuf,
    pub model: String,
    pub geometry: KvGeometry,
    pub contexts: Vec<u64>,
    /// Total pool bytes over all devices.
    pub capacity: u64,
    pub devices: u32,
    pub group_blocks: u32,
    pub tier: TierConfig,
    pub verify: bool,
    pub cross_layer: bool,
    /// Largest store job, in blocks.
    pub store_job_blocks: u32,
    /// The pool on namespace 1 of this NVMe controller (PCI address),
    /// served by this userspace engine, instead of pool files in `dir`.
    pub nvme: Option<(String, kvtier::engine::open::UserspaceEngine)>,
    /// Format an NVMe namespace that holds other data. Pool files are
    /// scratch files, created new: never forced.
    pub force: bool,
    /// Leave the pool files in `dir` afterwards.
    pub keep: bool,
    /// Write the pool files once at creation, so that stores measure
    /// overwrites (a pool that has filled once), not a first fill.
    pub prewrite: bool,
    /// Most host memory a context's KV cache may take (`--mem-budget`):
    /// larger contexts are skipped, saying so. The run's peak RSS is about
    /// the largest context that runs (fio runs after it is freed).
    #[serde(default)]
    pub mem_budget: Option<u64>,
    /// fio reads each context's bytes from the pool file, sequentially,
    /// right before and right after its restore (`--against-fio`, pool
    /// files only): the restore's reference on the same bytes of the same
    /// disk at the same moment, where fio's 5 s runs come minutes later.
    #[serde(default)]
    pub fio_bracket: bool,
}

#[derive(Clone, Debug, serde::Serialize)]
pub struct ContextResult {
    pub tokens: u64,
    pub blocks: u64,
    pub bytes: u64,
    pub store_secs: f64,
    pub store_gib_s: f64,
    pub retrieve_secs: f64,
    pub retrieve_gib_s: f64,
    /// Time until layer 0 was in memory.
    pub first_layer_ms: f64,
    pub ios_per_layer: f64,
    pub syscalls_per_layer: f64,
    pub store_cpu_us_per_object: f64,
    pub retrieve_cpu_us_per_object: f64,
    /// Device flushes the store issued (its jobs share them: group commit).
    #[serde(default)]
    pub store_flushes: u64,
    pub verified: bool,
    /// The same bytes written by kvtier's engine alone (no checksums,
    /// headers or flushes) right after the store: from the same memory to
    /// the same offsets of the pool file, in I/Os of the store's size
    /// (`bench::rewrite`). Single-file pools only.
    pub engine_write_gib_s: Option<f64>,
    /// The same, reading: the engine alone reading the context's bytes
    /// from the pool file into as much memory.
    pub engine_read_gib_s: Option<f64>,
    /// The same write followed by one flush, the flush in the time: the
    /// durable reference a store (which acknowledges only durable bytes)
    /// is held to. From the same run as `engine_write_gib_s` (that one
    /// leaves the flush out).
    #[serde(default)]
    pub engine_write_durable_gib_s: Option<f64>,
    /// The engine alone writing the same bytes to the same offsets just
    /// before the store, then one flush: the first write to that range
    /// since the pool's creation, which on a VM's disk can run much slower
    /// than a write to a range just written. It puts the store and its
    /// reference after it on the same footing.
    #[serde(default)]
    pub engine_first_write_gib_s: Option<f64>,
    /// The engine alone writing the same bytes again right before the
    /// store (after that first write), without and with its one flush: with
    /// the write right after the store it brackets the store, so a disk
    /// that drifts during the round (a VM's neighbours, the host's cache
    /// filling) weighs on both sides alike. None where the store's slots
    /// were not known before it.
    #[serde(default)]
    pub engine_write_before_gib_s: Option<f64>,
    #[serde(default)]
    pub engine_write_before_durable_gib_s: Option<f64>,
    /// fio reading the context's bytes from the pool file in one
    /// sequential pass (`BenchConfig::fio_bracket`) right before and right
    /// after the restore.
    #[serde(default)]
    pub fio_read_before_gib_s: Option<f64>,
    #[serde(default)]
    pub fio_read_after_gib_s: Option<f64>,
    /// fio's command line for those reads; whether its buffers were in
    /// huge pages is in it (`--mem=shmhuge`).
    #[serde(default)]
    pub fio_read_cmd: Option<Vec<String>>,
    /// fio replaying the restore's reads (each layer's objects in offset
    /// order, adjacent ones merged up to the largest I/O, layer after
    /// layer: the reads the tier issues) from an iolog, at the engine's
    /// queue depth, right after the second of those reads. Against fio's
    /// sequential pass over the same bytes it says what the layer order
    /// costs on this disk; against the restore, what kvtier adds.
    #[serde(default)]
    pub fio_replay_gib_s: Option<f64>,
    #[serde(default)]
    pub fio_replay_cmd: Option<Vec<String>>,
}

/// The rate of writing the same bytes in the mean of the times at rates
/// `before` and `after` (their harmonic mean); `after` alone when nothing
/// ran before.
fn bracketed(before: Option<f64>, after: Option<f64>) -> Option<f64> {
    match (before, after) {
        (Some(b), Some(a)) if b > 0.0 && a > 0.0 => Some(2.0 / (1.0 / b + 1.0 / a)),
        (_, a) => a,
    }
}

impl ContextResult {
    /// The engine alone writing the same bytes (no flush), bracketing the
    /// store: the mean time of its writes just before and just after it.
    pub fn engine_write_bracketed_gib_s(&self) -> Option<f64> {
        bracketed(self.engine_write_before_gib_s, self.engine_write_gib_s)
    }

    /// The same with each write's one flush: the store's durable reference.
    pub fn engine_write_durable_bracketed_gib_s(&self) -> Option<f64> {
        bracketed(
            self.engine_write_before_durable_gib_s,
            self.engine_write_durable_gib_s,
        )
    }

    /// fio reading the same bytes sequentially, bracketing the restore:
    /// the mean time of its reads right before and right after it.
    pub fn fio_read_bracketed_gib_s(&self) -> Option<f64> {
        bracketed(self.fio_read_before_gib_s, self.fio_read_after_gib_s)
            .filter(|_| self.fio_read_before_gib_s.is_some())
    }

    /// Time to the first layer over the restore's average layer time.
    pub fn first_layer_vs_avg(&self, layers: u32) -> f64 {
        self.first_layer_ms / (self.retrieve_secs * 1e3 / layers.max(1) as f64)
    }
}

#[derive(Clone, Debug, serde::Serialize)]
pub struct BenchReport {
    pub config: BenchConfig,
    pub machine: Machine,
    pub engine: String,
    pub results: Vec<ContextResult>,
    pub skipped: Vec<String>,
    /// fio's reference figures on the same directory (`--against-fio`).
    pub fio: Option<FioReferences>,
    /// Share of the host KV memory backed by huge pages (None when
    /// /proc/self/smaps cannot say). Less than 1 means more DMA segments per
    /// I/O, which on a VM's virtio disk costs bandwidth: a cause of runs
    /// that differ while fio (in 4 KiB pages every time) does not.
    pub huge_page_share: Option<f64>,
    /// Peak resident memory of this process so far (getrusage); None where
    /// the kernel does not say. fio runs after the KV cache is freed.
    #[serde(default)]
    pub peak_rss: Option<PeakRss>,
}

/// Peak resident set size, bytes. (Not fio's: a child's peak counts what
/// it shared with this process when it was forked.)
#[derive(Clone, Copy, Debug, serde::Serialize)]
pub struct PeakRss {
    pub kvtier_bytes: u64,
    /// Reserved (hugetlbfs) huge pages held at the peak: the KV cache goes
    /// there when enough are free (`scripts/bench.sh` reserves some), and
    /// the kernel never counts them in the resident set, so without them
    /// the figure would leave the cache out.
    #[serde(default)]
    pub hugetlb_bytes: u64,
}

/// Bytes of reserved huge pages this process holds now (HugetlbPages in
/// /proc/self/status; 0 where the kernel does not say).
pub(crate) fn hugetlb_held_bytes() -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("HugetlbPages:"))
                .and_then(|l| l.split_whitespace().nth(1))
                .and_then(|v| v.parse::<u64>().ok())
        })
        .map_or(0, |kib| kib * 1024)
}

impl PeakRss {
    /// Now, from getrusage (ru_maxrss, KiB on Linux), with the reserved
    /// huge pages held now or at `hugetlb_peak` (sampled while the KV
    /// cache was alive), whichever is more.
    pub fn now(hugetlb_peak: u64) -> Option<PeakRss> {
        // SAFETY: getrusage fills the struct we pass.
        let mut ru: libc::rusage = unsafe { std::mem::zeroed() };
        (unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut ru) } == 0).then(|| PeakRss {
            kvtier_bytes: ru.ru_maxrss.max(0) as u64 * 1024,
            hugetlb_bytes: hugetlb_held_bytes().max(hugetlb_peak),
        })
    }

    /// The resident set plus the reserved huge pages.
    pub fn total_bytes(&self) -> u64 {
        self.kvtier_bytes + self.hugetlb_bytes
    }
}

/// fio on the same filesystem as the pool, in the same run.
#[derive(Clone, Debug, serde::Serialize)]
pub struct FioReferences {
    pub version: String,
    /// The device's best sequential read: the higher of fio at 1 MiB x QD16
    /// and fio at kvtier's own I/O size and depth.
    pub seq_read: IoResult,
    pub seq_read_cmd: Vec<String>,
    /// Random reads of one object each: what an uncoalesced restore costs.
    pub rand_read: IoResult,
    pub rand_read_cmd: Vec<String>,
    /// The device's best sequential write (no fsync), chosen like
    /// `seq_read`.
    pub seq_write: IoResult,
    pub seq_write_cmd: Vec<String>,
    /// fio's sequential write at `seq_write`'s size and depth with
    /// `--end_fsync=1` (one fsync after the writes, in fio's run time): a
    /// store acknowledges only durable bytes, so this is its reference.
    pub seq_write_durable: IoResult,
    pub seq_write_durable_cmd: Vec<String>,
}

#[derive(Clone, Debug, serde::Serialize)]
pub struct Machine {
    pub kernel: String,
    pub cpus: usize,
    pub cpu_model: String,
    pub filesystem_of_dir: String,
}

impl Machine {
    pub fn probe(dir: &std::path::Path) -> Machine {
        let kernel = std::fs::read_to_string("/proc/sys/kernel/osrelease")
            .map(|s| s.trim().to_string())
            .unwrap_or_default();
        let cpu_model = std::fs::read_to_string("/proc/cpuinfo")
            .ok()
            .and_then(|s| {
                s.lines()
                    .find(|l| l.starts_with("model name"))
                    .and_then(|l| l.split(':').nth(1))
                    .map(|m| m.trim().to_string())
            })
            .unwrap_or_default();
        Machine {
            kernel,
            cpus: std::thread::available_parallelism().map_or(1, |n| n.get()),
            cpu_model,
            filesystem_of_dir: filesystem_of(dir),
        }
    }
}

/// "ext4 on /dev/vda" for the mount holding `dir`, from /proc/self/mounts.
fn filesystem_of(dir: &std::path::Path) -> String {
    let dir = std::fs::canonicalize(dir).unwrap_or_else(|_| dir.to_path_buf());
    let mounts = std::fs::read_to_string("/proc/self/mounts").unwrap_or_default();
    let mut best: Option<(usize, String)> = None;
    for line in mounts.lines() {
        let f: Vec<&str> = line.split_whitespace().collect();
        if f.len() < 3 || !dir.starts_with(f[1]) {
            continue;
        }
        if best.as_ref().is_none_or(|(len, _)| f[1].len() > *len) {
            best = Some((f[1].len(), format!("{} on {}", f[2], f[0])));
        }
    }
    best.map(|b| b.1).unwrap_or_else(|| "unknown".into())
}

/// (user, system) CPU seconds of this process so far.
pub(crate) fn cpu_times() -> (f64, f64) {
    // SAFETY: getrusage fills the struct we pass.
    let mut ru: libc::rusage = unsafe { std::mem::zeroed() };
    unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut ru) };
    let tv = |t: libc::timeval| t.tv_sec as f64 + t.tv_usec as f64 * 1e-6;
    (tv(ru.ru_utime), tv(ru.ru_stime))
}

fn cpu_seconds() -> f64 {
    let (user, sys) = cpu_times();
    user + sys
}

/// A progress line for a pool's prewrite: at its start, its end and every GiB.
pub(crate) fn prewrite_progress(progress: &mut impl FnMut(&str), done: u64, total: u64) {
    if done == 0 || done == total || done % (1 << 30) == 0 {
        progress(&format!(
            "prewriting the pool files: {} of {}",
            human_bytes(done),
            human_bytes(total)
        ))
    }
}

pub fn run(cfg: &BenchConfig, mut progress: impl FnMut(&str)) -> Result<BenchReport> {
    let geo = cfg.geometry;
    if cfg.fio_bracket && fio::fio_available().is_none() {
        return Err(Error::invalid(
            "--against-fio needs fio: install it (apt-get install fio)",
        ));
    }
    crate::cli::make_dir(&cfg.dir)?;
    let pool_cfg = |devices: Vec<DeviceSpec>, force: bool| {
        PoolConfig::new(geo, cfg.model.clone(), format!("bench/{}", cfg.model))
            .with_group_blocks(cfg.group_blocks)
            .with_devices(devices)
            .with_force(force)
            .with_prewrite(cfg.prewrite)
    };
    let mut scratch: Vec<ScratchFile> = Vec::new();
    let (pool, engine) = match &cfg.nvme {
        Some((addr, which)) => {
            progress(&format!(
                "formatting a pool on namespace 1 of NVMe controller {addr} ({which:?} engine)"
            ));
            let (pool, engine) = kvtier::engine::open::pool_on_nvme(
                addr,
                *which,
                Some(&pool_cfg(Vec::new(), cfg.force)),
                &Default::default(),
            )?;
            (pool, Some(engine))
        }
        None => {
            // The library's split of a capacity over files, refused in the
            // bench's own flags before any file is made.
            let per_dev = kvtier::pool::place::bytes_per_file(
                cfg.capacity,
                cfg.devices as usize,
                &cfg.geometry,
                cfg.group_blocks,
                &cfg.dir,
            )
            .map_err(|e| match e.fix() {
                Some(&kvtier::error::Fix::GiveCapacity { at_least }) => Error::invalid(format!(
                    "--capacity {} over {} device(s) gives each {}; one superblock and one \
                     extent group of {} blocks need {} per device: raise --capacity to at least {}{}",
                    human_bytes(cfg.capacity),
                    cfg.devices,
                    human_bytes(kvtier::pool::place::split_capacity(
                        cfg.capacity,
                        cfg.devices as usize
                    )),
                    cfg.group_blocks,
                    human_bytes(at_least / cfg.devices as u64),
                    human_bytes(at_least),
                    if cfg.group_blocks > 1 {
                        " (or lower --group-blocks)"
                    } else {
                        ""
                    }
                )),
                _ => e,
            })?;
            // Created new here, so a file already at one of these names
            // (or a symlink planted there) is refused, never formatted;
            // dropped on every way out of this function, which removes
            // exactly the files made here.
            for i in 0..cfg.devices {
                let path = cfg.dir.join(format!("bench{i}.pool"));
                scratch.push(ScratchFile::create_new(&path, "kvtier bench")?);
            }
            // Formatted and served through the descriptors created here,
            // never reopened by name: a symlink swapped in meanwhile
            // receives nothing.
            let files = scratch
                .iter()
                .map(ScratchFile::descriptor)
                .collect::<Result<Vec<_>>>()?;
            progress(&format!(
                "formatting {} pool file(s) of {} in {}",
                cfg.devices,
                human_bytes(per_dev),
                cfg.dir.display()
            ));
            let pool = Pool::create_in_files(
                &pool_cfg(Vec::new(), false),
                files,
                per_dev,
                &mut |done, total| prewrite_progress(&mut progress, done, total),
            )?;
            check_scratch_pool(&pool, &scratch)?;
            (pool, None)
        }
    };
    if cfg.keep {
        scratch.iter_mut().for_each(ScratchFile::keep);
    }
    let slots = pool.index().total_slots();
    // The memory budget first: a context over it is skipped for that, the
    // fix that runs it, even where the pool (sized by default for the
    // contexts within the budget) could not hold it either.
    let (contexts, mut skipped) = match cfg.mem_budget {
        Some(budget) => {
            let (fit, over, _) = contexts_within_memory(&cfg.contexts, &geo, budget);
            (fit, over)
        }
        None => (cfg.contexts.clone(), Vec::new()),
    };
    let (contexts, over_capacity, max_blocks) =
        contexts_that_fit(&contexts, &geo, slots, "the pool's");
    skipped.extend(over_capacity);
    let mut tier = match engine {
        Some(e) => Tier::with_engine(pool, cfg.tier.clone(), e)?,
        None => Tier::open(pool, cfg.tier.clone())?,
    };
    let mut results = Vec::new();
    if max_blocks == 0 {
        return Ok(BenchReport {
            config: cfg.clone(),
            machine: Machine::probe(&cfg.dir),
            engine: tier.engine().describe(),
            results,
            skipped,
            fio: None,
            huge_page_share: None,
            peak_rss: PeakRss::now(0),
        });
    }
    crate::cli::check_host_memory(
        max_blocks.saturating_mul(geo.block_bytes()),
        &format!("a {max_blocks}-block context"),
        "give smaller --contexts",
    )?;
    progress(&format!(
        "allocating {} of host KV memory ({max_blocks} blocks)",
        human_bytes(max_blocks * geo.block_bytes())
    ));
    let layout = if cfg.cross_layer {
        HostLayout::CrossLayer
    } else {
        HostLayout::PerLayer
    };
    // fio's reads beside each restore (`fio_bracket`) get huge-page buffers
    // as its later runs do: while the KV memory takes what it can of the
    // reserved huge pages, fio's share is held aside.
    let fio_bracket = match (&scratch[..], cfg.fio_bracket) {
        ([file], true) => Some(file),
        (_, true) => {
            skipped.push(
                "fio reading each context's bytes beside its restore: pool files of one device only"
                    .to_string(),
            );
            None
        }
        _ => None,
    };
    let fio_buffers = fio_bracket
        .map(|_| fio::buffer_bytes(cfg.tier.max_io_bytes, cfg.tier.uring.queue_depth, 1));
    let fio_share = fio_buffers
        .filter(|&b| kvtier::memory::hugetlb_free_bytes() >= b)
        .and_then(|b| kvtier::memory::DmaBuffer::new(b as usize).ok());
    let cache = Arc::new(HostKvCache::new(geo, max_blocks as u32, layout)?);
    drop(fio_share);
    // The cache lives until the contexts are done: what it holds in
    // reserved huge pages (which the resident set leaves out) is the peak.
    let hugetlb_peak = hugetlb_held_bytes();
    tier.register_host_cache(cache.clone())?;
    let engine = tier.engine().describe();
    let huge_page_share = tier.p2p_table().and_then(|t| {
        let regions: Vec<(u64, u64)> = t.regions().iter().map(|r| (r.addr, r.len)).collect();
        huge_page_share(&regions)
    });

    let mut stored_blocks = 0u64;
    for (ci, &tokens) in contexts.iter().enumerate() {
        let blocks = geo.tokens_to_blocks(tokens);
        let key_base = (ci as u64 + 1) << 40;
        let keys: Vec<Key> = (0..blocks).map(|b| Key::from_u64(key_base + b)).collect();
        let mem: Vec<u32> = (0..blocks as u32).collect();
        progress(&format!("{tokens} tokens: filling {blocks} blocks"));
        for b in 0..blocks {
            cache.fill_block(b as u32, key_base + b);
        }
        let bytes = blocks * geo.block_bytes();
        let objects = blocks * geo.objects_per_block() as u64;

        progress(&format!("{tokens} tokens: storing {}", human_bytes(bytes)));
        // The slots the store will take: a fresh pool hands out its free
        // slots in order, so while nothing was evicted they follow the
        // contexts stored before (checked after the store); never-used
        // slots, so writing their data first changes nothing stored.
        let planned: Option<Vec<u64>> = (stored_blocks + blocks <= slots)
            .then(|| (stored_blocks..stored_blocks + blocks).collect());
        stored_blocks = stored_blocks.saturating_add(blocks);
        if planned.is_none() {
            // Evicting from here on: later slots are not foreseeable.
            stored_blocks = u64::MAX;
        }
        // The engine alone writes the same bytes to them first, untimed as
        // the store's reference: on a VM's disk the first write in a while
        // to a range can run much slower than one to a range just written
        // (this VM: 1.1-3.4 GiB/s against 3.8-5.0 at 64K tokens), so the
        // store and its reference after it (below) both write a range just
        // written.
        // The engine alone writing the planned slots from the context's
        // memory (one file), then one flush.
        let shape = rewrite::StoreShape {
            job_blocks: cfg.store_job_blocks as usize,
            max_io_bytes: cfg.tier.max_io_bytes,
            uring: &cfg.tier.uring,
        };
        let rewrite_planned = |file: &ScratchFile, planned: &[u64]| -> Result<rewrite::Rewrite> {
            let (fd, path) = file.descriptor()?;
            rewrite::rewrite_slots(
                &tier,
                &fd,
                &path.display().to_string(),
                planned,
                &mem,
                &shape,
            )
        };
        let mut first_write = None;
        match (&scratch[..], &planned) {
            ([file], Some(planned)) => {
                progress(&format!(
                    "{tokens} tokens: the engine alone writing the same {} first",
                    human_bytes(bytes)
                ));
                match rewrite_planned(file, planned) {
                    Ok(r) => first_write = Some(r.durable_gib_s),
                    Err(e) => skipped.push(format!(
                        "{tokens} tokens: the engine-alone first write did not run: {e}"
                    )),
                }
            }
            ([_], None) => skipped.push(format!(
                "{tokens} tokens: no engine-alone write before the store: the store evicts \
                 (the pool cannot hold every context), so its slots are not known before it"
            )),
            _ => {}
        }
        // The same write again, timed: the reference's half before the
        // store (its other half runs right after it).
        let mut before = None;
        if let (Some(_), [file], Some(planned)) = (first_write, &scratch[..], &planned) {
            progress(&format!(
                "{tokens} tokens: the engine alone writing the same {} again, then one flush (before the store)",
                human_bytes(bytes)
            ));
            match rewrite_planned(file, planned) {
                Ok(r) => before = Some(r),
                Err(e) => skipped.push(format!(
                    "{tokens} tokens: the engine-alone write before the store did not run: {e}"
                )),
            }
        }
        let flushes0 = tier.usage().engine.flushes;
        let cpu0 = cpu_seconds();
        let t0 = Instant::now();
        let mut jobs = Vec::new();
        for (kc, mc) in keys
            .chunks(cfg.store_job_blocks as usize)
            .zip(mem.chunks(cfg.store_job_blocks as usize))
        {
            jobs.push(tier.submit_store(kc, mc)?);
        }
        for j in jobs {
            let r = tier.wait(j)?;
            job_ok(&r, "store")?;
        }
        let store_secs = t0.elapsed().as_secs_f64();
        let store_cpu = cpu_seconds() - cpu0;
        let store_flushes = tier.usage().engine.flushes - flushes0;
        // Its durable reference, right after it (the machine's load then
        // is the store's): the engine alone writing the same bytes from
        // the same memory to the same offsets, then one flush.
        let mut reference = None;
        let same_slots = planned.as_ref().is_none_or(|planned| {
            let ix = tier.pool().index();
            keys.iter()
                .zip(planned)
                .all(|(k, &s)| ix.get(k).is_some_and(|e| e.slot == s))
        });
        if !same_slots {
            first_write = None;
            before = None;
            skipped.push(format!(
                "{tokens} tokens: the store took other slots than the engine alone wrote \
                 first; that first write is left out"
            ));
        }
        if let [file] = &scratch[..] {
            progress(&format!(
                "{tokens} tokens: the engine alone writing the same {} again, then one flush (after the store)",
                human_bytes(bytes)
            ));
            let (fd, path) = file.descriptor()?;
            match rewrite::rewrite_stored(
                &tier,
                &fd,
                &path.display().to_string(),
                &keys,
                &mem,
                &shape,
            ) {
                Ok(r) => reference = Some(r),
                Err(e) => skipped.push(format!(
                    "{tokens} tokens: the engine-alone write did not run: {e}"
                )),
            }
        }

        cache.clear();
        // fio reading the same bytes in one sequential pass, right before
        // and right after the restore.
        // The restore's reads, whose first (the lowest offset of layer 0)
        // is where the context's bytes begin; replayed by fio below.
        let fio_read = fio_bracket.and_then(|file| {
            let (fd, _) = file.descriptor().ok()?;
            let reads = restore_reads(tier.pool(), &keys, cfg.tier.max_io_bytes);
            let first = reads.first()?.0;
            let file_len = fd.metadata().ok()?.len();
            let w = fio_span_read(
                &fd,
                first,
                bytes,
                file_len,
                cfg.tier.max_io_bytes,
                cfg.tier.uring.queue_depth,
            );
            // The descriptor fio opens the file through stays open until
            // the replay is done.
            Some((fd, w, reads))
        });
        // The pass's rate, or a line in `skipped` saying why it did not run.
        let fio_pass = |when: &str,
                        progress: &mut dyn FnMut(&str),
                        skipped: &mut Vec<String>|
         -> Option<f64> {
            let (_, w, _) = fio_read.as_ref()?;
            progress(&format!(
                "{tokens} tokens: fio reading the same {} of the pool file {when} the restore",
                human_bytes(bytes)
            ));
            fio::run_fio(w)
                .map(|r| r.read_bw / GIB)
                .map_err(|e| {
                    skipped.push(format!(
                        "{tokens} tokens: fio's read {when} the restore did not run: {e}"
                    ))
                })
                .ok()
        };
        let fio_before = fio_pass("before", &mut progress, &mut skipped);
        progress(&format!("{tokens} tokens: retrieving layer by layer"));
        let s0 = tier.usage().engine;
        let cpu0 = cpu_seconds();
        let t0 = Instant::now();
        let job = tier.submit_load(&keys, &mem, 0..geo.layers)?;
        tier.wait_layer(job, 0)?;
        let first_layer_ms = t0.elapsed().as_secs_f64() * 1e3;
        for l in 1..geo.layers {
            tier.wait_layer(job, l)?;
        }
        let r = tier.wait(job)?;
        let retrieve_secs = t0.elapsed().as_secs_f64();
        let retrieve_cpu = cpu_seconds() - cpu0;
        let s1 = tier.usage().engine;
        let fio_after = fio_before.and_then(|_| fio_pass("after", &mut progress, &mut skipped));
        // fio replaying the restore's own reads (same offsets, sizes and
        // order), at the engine's depth: what the layer order costs on
        // this disk, apart from what kvtier's engine costs.
        let fio_replay =
            fio_read
                .as_ref()
                .filter(|_| fio_after.is_some())
                .and_then(|(_, w, reads)| {
                    progress(&format!(
                        "{tokens} tokens: fio replaying the restore's reads"
                    ));
                    let run = || -> Result<(f64, Vec<String>)> {
                        let log = ScratchFile::create_new(
                            &cfg.dir.join("fio-restore-reads.iolog"),
                            "kvtier bench",
                        )?;
                        let target = w.file.display().to_string();
                        let mut text =
                            format!("fio version 2 iolog\n{target} add\n{target} open\n");
                        for (offset, len) in reads {
                            text += &format!("{target} read {offset} {len}\n");
                        }
                        text += &format!("{target} close\n");
                        std::io::Write::write_all(&mut log.file(), text.as_bytes()).map_err(
                            |e| Error::io(format!("writing {}", log.path().display()), e),
                        )?;
                        let replay = Workload {
                            replay: Some(proc_fd_path(log.file())),
                            ..w.clone()
                        };
                        let r = fio::run_fio(&replay)?;
                        if r.read_ios != reads.len() as u64 {
                            return Err(Error::invalid(format!(
                                "fio replayed {} of the restore's {} reads",
                                r.read_ios,
                                reads.len()
                            )));
                        }
                        // The log's bytes over fio's run time: in a replay fio
                        // leaves out of its byte count reads it had in flight
                        // (512 MiB of 4 MiB reads at depth 64 counted 260 MiB,
                        // 2 GiB about 1.8: its own rate read 12% low).
                        let replayed: u64 = reads.iter().map(|r| r.1).sum();
                        Ok((
                            replayed as f64 / GIB / r.secs.max(1e-9),
                            fio::fio_args(&replay),
                        ))
                    };
                    match run() {
                        Ok(r) => Some(r),
                        Err(e) => {
                            skipped.push(format!(
                            "{tokens} tokens: fio's replay of the restore's reads did not run: {e}"
                        ));
                            None
                        }
                    }
                });
        tier.layer_events();
        job_ok(&r, "load")?;
        progress(&format!(
            "{tokens} tokens: loads now keep {} of reads in flight",
            human_bytes(tier.load_window_bytes())
        ));
        let verified = if cfg.verify {
            progress(&format!("{tokens} tokens: verifying"));
            for b in 0..blocks {
                if !cache.block_matches(b as u32, key_base + b, 0..geo.layers) {
                    return Err(Error::invalid(format!(
                        "retrieved block {b} of the {tokens}-token context differs from what was stored"
                    )));
                }
            }
            true
        } else {
            false
        };
        let gib = bytes as f64 / (1u64 << 30) as f64;
        results.push(ContextResult {
            tokens,
            blocks,
            bytes,
            store_secs,
            store_gib_s: gib / store_secs,
            retrieve_secs,
            retrieve_gib_s: gib / retrieve_secs,
            first_layer_ms,
            ios_per_layer: (s1.ios - s0.ios) as f64 / geo.layers as f64,
            syscalls_per_layer: (s1.syscalls - s0.syscalls) as f64 / geo.layers as f64,
            store_cpu_us_per_object: store_cpu * 1e6 / objects as f64,
            retrieve_cpu_us_per_object: retrieve_cpu * 1e6 / objects as f64,
            store_flushes,
            verified,
            engine_write_gib_s: reference.as_ref().map(|r| r.unflushed_gib_s),
            engine_read_gib_s: None,
            engine_write_durable_gib_s: reference.as_ref().map(|r| r.durable_gib_s),
            engine_first_write_gib_s: first_write,
            engine_write_before_gib_s: before.as_ref().map(|r| r.unflushed_gib_s),
            engine_write_before_durable_gib_s: before.as_ref().map(|r| r.durable_gib_s),
            fio_read_before_gib_s: fio_before,
            fio_read_after_gib_s: fio_after,
            fio_read_cmd: fio_read.as_ref().map(|(_, w, _)| fio::fio_args(w)),
            fio_replay_gib_s: fio_replay.as_ref().map(|r| r.0),
            fio_replay_cmd: fio_replay.map(|r| r.1),
        });
    }
    // The engine-alone read of each context's bytes, on the pool file
    // itself once the tier and its memory are gone.
    drop(tier);
    drop(cache);
    if let [file] = &scratch[..] {
        for r in &mut results {
            progress(&format!(
                "{} tokens: the engine alone reading {} into as much memory",
                r.tokens,
                human_bytes(r.bytes)
            ));
            // The store's largest I/O, or the whole context when it is
            // smaller (a few blocks).
            let w = Workload {
                pattern: Pattern::Read,
                bs: cfg.tier.max_io_bytes.min(r.bytes),
                iodepth: cfg.tier.uring.queue_depth,
                size: r.bytes,
                offset: 0,
                replay: None,
                runtime_secs: 0.0,
                file: file.path().to_path_buf(),
                rwmix_read: 100,
                numjobs: 1,
                end_fsync: false,
            };
            // A comparison beside the results: if it cannot run, say so
            // and keep the results. Through the pool file's own descriptor
            // (in direct-I/O mode since the pool was made), never reopened
            // by name.
            let alone = || -> Result<f64> {
                let (fd, _) = file.descriptor()?;
                let (rd, _) = raw::run_on(&fd, &w, r.bytes, &cfg.tier.uring)?;
                Ok(rd.read_bw / GIB)
            };
            match alone() {
                Ok(rd) => r.engine_read_gib_s = Some(rd),
                Err(e) => skipped.push(format!(
                    "{} tokens: the engine-alone read did not run: {e}",
                    r.tokens
                )),
            }
        }
    }
    Ok(BenchReport {
        config: cfg.clone(),
        machine: Machine::probe(&cfg.dir),
        engine,
        results,
        skipped,
        fio: None,
        huge_page_share,
        peak_rss: PeakRss::now(hugetlb_peak),
    })
}

/// fio reading `bytes` of the open pool file `fd` in one sequential pass,
/// from the context's first object at `first` (moved back where the file
/// ends first), in the engine's largest I/O at its queue depth. fio opens
/// the file through this process's descriptor (`/proc/PID/fd/N`), never by
/// its name, read-only.
fn fio_span_read(
    fd: &std::fs::File,
    first: u64,
    bytes: u64,
    file_len: u64,
    max_io: u64,
    iodepth: u32,
) -> Workload {
    let bs = max_io.min(bytes).max(4096);
    let size = (bytes / bs * bs).max(bs).min(file_len / 4096 * 4096);
    let offset = first.min(file_len.saturating_sub(size)) / 4096 * 4096;
    Workload {
        pattern: Pattern::Read,
        bs,
        iodepth,
        size,
        offset,
        replay: None,
        runtime_secs: 0.0,
        file: proc_fd_path(fd),
        rwmix_read: 100,
        numjobs: 1,
        end_fsync: false,
    }
}

/// The path through which another process opens the file this process
/// holds open as `f` (`/proc/PID/fd/N`): the very file, whatever its name
/// now points to.
fn proc_fd_path(f: &std::fs::File) -> PathBuf {
    use std::os::fd::AsRawFd;
    PathBuf::from(format!("/proc/{}/fd/{}", std::process::id(), f.as_raw_fd()))
}

/// The reads a layer-by-layer restore of `keys` issues on a pool of one
/// device, in order: each layer's objects (K and V of every block) sorted by
/// offset, adjacent ones merged up to `max_io` bytes, layer after layer.
fn restore_reads(pool: &Pool, keys: &[Key], max_io: u64) -> Vec<(u64, u64)> {
    let layout = pool.layout();
    let index = pool.index();
    let object = layout.geometry.object_bytes();
    let slots: Vec<u64> = keys
        .iter()
        .filter_map(|k| index.get(k))
        .map(|e| e.slot)
        .collect();
    let mut reads = Vec::new();
    for layer in 0..layout.geometry.layers {
        let mut offsets: Vec<u64> = slots
            .iter()
            .flat_map(|&slot| (0..2).map(move |kv| layout.object_offset(slot, layer, kv).1))
            .collect();
        offsets.sort_unstable();
        let mut run: Option<(u64, u64)> = None;
        for o in offsets {
            run = match run {
                Some((at, len)) if at + len == o && len + object <= max_io => {
                    Some((at, len + object))
                }
                Some(done) => {
                    reads.push(done);
                    Some((o, object))
                }
                None => Some((o, object)),
            };
        }
        reads.extend(run);
    }
    reads
}

/// The share of the memory `regions` (address, length) backed by huge
/// pages, from /proc/self/smaps: transparent ones (AnonHugePages) or a
/// hugetlbfs mapping (KernelPageSize 2048 kB or more).
pub(crate) fn huge_page_share(regions: &[(u64, u64)]) -> Option<f64> {
    let smaps = std::fs::read_to_string("/proc/self/smaps").ok()?;
    let total: u64 = regions.iter().map(|r| r.1).sum();
    if total == 0 {
        return None;
    }
    let overlaps = |lo: u64, hi: u64| regions.iter().any(|&(a, len)| lo < a + len && a < hi);
    let mut huge = 0u64;
    let mut cur: Option<(u64, u64)> = None;
    let mut page_kb = 4u64;
    for line in smaps.lines() {
        let mut f = line.split_whitespace();
        let first = f.next().unwrap_or("");
        if let Some((lo, hi)) = first.split_once('-').and_then(|(a, b)| {
            Some((
                u64::from_str_radix(a, 16).ok()?,
                u64::from_str_radix(b, 16).ok()?,
            ))
        }) {
            cur = overlaps(lo, hi).then_some((lo, hi));
            page_kb = 4;
            continue;
        }
        let Some((lo, hi)) = cur else { continue };
        let kb = || f.clone().next().and_then(|v| v.parse::<u64>().ok());
        match first {
            "KernelPageSize:" => page_kb = kb().unwrap_or(4),
            "AnonHugePages:" if page_kb < 2048 => huge += kb().unwrap_or(0) << 10,
            // hugetlbfs pages are not in Rss: counted as these two.
            "Private_Hugetlb:" | "Shared_Hugetlb:" if page_kb >= 2048 => {
                huge += (kb().unwrap_or(0) << 10).min(hi - lo)
            }
            _ => {}
        }
    }
    Some((huge as f64 / total as f64).min(1.0))
}

/// The pool must be on the very files created for it: a file swapped in
/// under one of their names between creation and formatting would
/// otherwise be benchmarked (and then left behind).
pub(crate) fn check_scratch_pool(pool: &Pool, scratch: &[ScratchFile]) -> Result<()> {
    for ((fd, name), s) in pool.device_fds()?.into_iter().zip(scratch) {
        if !s.is_fd(fd) {
            return Err(Error::Backing {
                path: s.path().to_path_buf(),
                reason: format!(
                    "was replaced while being formatted ({name} is another file); \
                     something else writes to this directory: pick another --dir"
                ),
            });
        }
    }
    Ok(())
}

/// Run fio's sequential and random read on a file beside the pool.
pub fn fio_references(cfg: &BenchConfig, progress: &dyn Fn(&str)) -> Result<FioReferences> {
    let version = fio::fio_available().ok_or_else(|| {
        Error::invalid("--against-fio needs fio: install it (apt-get install fio)")
    })?;
    let scratch = ScratchFile::create_new(&cfg.dir.join("fio-reference.dat"), "kvtier bench")?;
    let file = scratch.path().to_path_buf();
    let size = cfg.capacity.clamp(1 << 30, 4 << 30) & !((1 << 20) - 1);
    progress(&format!(
        "fio: laying out a {} test file",
        human_bytes(size)
    ));
    fio::prepare_file(&file, size, true)?;
    let run_fsync = |pattern, bs: u64, iodepth, end_fsync| -> Result<(IoResult, Vec<String>)> {
        let w = Workload {
            pattern,
            bs,
            iodepth,
            size,
            offset: 0,
            replay: None,
            runtime_secs: 5.0,
            file: file.clone(),
            rwmix_read: 100,
            numjobs: 1,
            end_fsync,
        };
        progress(&format!(
            "fio: {} bs={} iodepth={iodepth}{}",
            pattern.fio_name(),
            human_bytes(bs),
            if end_fsync { " end_fsync=1" } else { "" }
        ));
        Ok((fio::run_fio(&w)?, fio::fio_args(&w)))
    };
    let run = |pattern, bs, iodepth| run_fsync(pattern, bs, iodepth, false);
    // Writes first, then flushed: what the host's cache still holds after
    // them would otherwise be written back under the reads (and under the
    // next run's restore when runs alternate).
    let wa = run(Pattern::Write, 1 << 20, 16);
    let wb = run(
        Pattern::Write,
        cfg.tier.max_io_bytes,
        cfg.tier.uring.queue_depth,
    );
    // The durable write at the better shape of the two.
    let better = match (&wa, &wb) {
        (Ok(a), Ok(b)) if b.0.write_bw > a.0.write_bw => {
            (cfg.tier.max_io_bytes, cfg.tier.uring.queue_depth)
        }
        _ => (1 << 20, 16),
    };
    let wd = run_fsync(Pattern::Write, better.0, better.1, true);
    std::fs::File::open(&file)
        .and_then(|f| f.sync_all())
        .map_err(|e| Error::io(format!("flushing {}", file.display()), e))?;
    let a = run(Pattern::Read, 1 << 20, 16);
    let b = run(
        Pattern::Read,
        cfg.tier.max_io_bytes,
        cfg.tier.uring.queue_depth,
    );
    let r = run(Pattern::RandRead, cfg.geometry.object_bytes(), 32);
    drop(scratch);
    let (a, b, r, wa, wb, wd) = (a?, b?, r?, wa?, wb?, wd?);
    let seq = if a.0.read_bw >= b.0.read_bw { a } else { b };
    let wseq = if wa.0.write_bw >= wb.0.write_bw {
        wa
    } else {
        wb
    };
    Ok(FioReferences {
        version,
        seq_read: seq.0,
        seq_read_cmd: seq.1,
        rand_read: r.0,
        rand_read_cmd: r.1,
        seq_write: wseq.0,
        seq_write_cmd: wseq.1,
        seq_write_durable: wd.0,
        seq_write_durable_cmd: wd.1,
    })
}

const GIB: f64 = (1u64 << 30) as f64;

/// `--plot`: bandwidth against context length with fio's lines.
pub fn plot(report: &BenchReport, path: &std::path::Path) -> Result<()> {
    let pts = |f: fn(&ContextResult) -> f64| -> Vec<(f64, f64)> {
        report
            .results
            .iter()
            .map(|r| (r.tokens as f64, f(r)))
            .collect()
    };
    let series = vec![
        plot::Series {
            label: "kvtier retrieve (layer by layer)".into(),
            points: pts(|r| r.retrieve_gib_s),
        },
        plot::Series {
            label: "kvtier store".into(),
            points: pts(|r| r.store_gib_s),
        },
    ];
    let mut refs = Vec::new();
    if let Some(f) = &report.fio {
        refs.push(("fio sequential read".to_string(), f.seq_read.read_bw / GIB));
        refs.push((
            "fio sequential write".to_string(),
            f.seq_write.write_bw / GIB,
        ));
        refs.push((
            "fio random read (one object per I/O)".to_string(),
            f.rand_read.read_bw / GIB,
        ));
    }
    plot::plot_bandwidth_svg(
        "--plot",
        path,
        &format!(
            "kvtier {} on {}",
            report.config.model, report.machine.filesystem_of_dir
        ),
        &series,
        &refs,
    )
}

/// One run of the raw benchmark: kvtier's engine, and fio when asked.
#[derive(Clone, Debug, serde::Serialize)]
pub struct RawRun {
    pub name: String,
    pub kvtier: IoResult,
    pub engine: raw::EngineReport,
    pub fio: Option<IoResult>,
    pub fio_cmd: Option<Vec<String>>,
}

#[derive(Clone, Debug, serde::Serialize)]
pub struct RawReport {
    pub workload: Workload,
    /// Memory kvtier's I/Os took their buffers from in turn (fio's is
    /// always iodepth x bs).
    pub buffer_bytes: u64,
    pub machine: Machine,
    pub engine: UringConfig,
    pub fio_version: Option<String>,
    pub runs: Vec<RawRun>,
}

/// `--pattern` (and `--contention`): kvtier's engine on a file, and fio with
/// the same workload on the same file when `against_fio`.
/// `w.file` is created new for the run and removed after it unless `keep`.
#[allow(clippy::too_many_arguments)]
pub fn raw_suite(
    w: &Workload,
    contention: bool,
    against_fio: bool,
    repeat: u32,
    engine: &UringConfig,
    buffer_bytes: u64,
    keep: bool,
    progress: &dyn Fn(&str),
) -> Result<RawReport> {
    // Every number first: nothing is laid out for a run that cannot start.
    raw::check_workload(
        w,
        &[raw::Stream {
            pattern: w.pattern,
            iodepth: w.iodepth,
            region: (0, w.size),
        }],
        buffer_bytes,
    )?;
    let fio_version = if against_fio {
        Some(fio::fio_available().ok_or_else(|| {
            Error::invalid("--against-fio needs fio: install it (apt-get install fio)")
        })?)
    } else {
        None
    };
    let mut scratch = ScratchFile::create_new(&w.file, "kvtier bench")?;
    if keep {
        scratch.keep();
    }
    progress(&format!(
        "laying out {} at {}",
        human_bytes(w.size),
        w.file.display()
    ));
    fio::prepare_file(&w.file, w.size, true)?;
    let mut runs = Vec::new();
    // kvtier and fio alternate `repeat` times; each reports its median run,
    // so a noisy moment of the shared disk does not decide the ratio.
    let mut one = |name: &str, w: &Workload, streams: Option<&[raw::Stream]>| -> Result<()> {
        let mut ks = Vec::new();
        let mut fs = Vec::new();
        for i in 0..repeat.max(1) {
            progress(&format!("kvtier: {name} ({}/{})", i + 1, repeat.max(1)));
            ks.push(match streams {
                Some(s) => raw::run_streams(w, s, buffer_bytes, engine)?,
                None => raw::run(w, buffer_bytes, engine)?,
            });
            if against_fio && streams.is_none() {
                progress(&format!("fio: {name} ({}/{})", i + 1, repeat.max(1)));
                fs.push(fio::run_fio(w)?);
            }
        }
        ks.sort_by(|a, b| a.0.total_bw().total_cmp(&b.0.total_bw()));
        fs.sort_by(|a, b| a.total_bw().total_cmp(&b.total_bw()));
        let (k, e) = ks.swap_remove(ks.len() / 2);
        let f = (!fs.is_empty()).then(|| fs.swap_remove(fs.len() / 2));
        runs.push(RawRun {
            name: name.to_string(),
            kvtier: k,
            engine: e,
            fio_cmd: f.as_ref().map(|_| fio::fio_args(w)),
            fio: f,
        });
        Ok(())
    };
    if contention {
        let half = (w.size / 2) / w.bs * w.bs;
        let read = Workload {
            pattern: Pattern::Read,
            ..w.clone()
        };
        let write = Workload {
            pattern: Pattern::Write,
            ..w.clone()
        };
        one(
            &format!("read alone (bs={} qd={})", human_bytes(w.bs), w.iodepth),
            &read,
            None,
        )?;
        one(
            &format!("write alone (bs={} qd={})", human_bytes(w.bs), w.iodepth),
            &write,
            None,
        )?;
        let both = [
            raw::Stream {
                pattern: Pattern::Read,
                iodepth: w.iodepth,
                region: (0, half),
            },
            raw::Stream {
                pattern: Pattern::Write,
                iodepth: w.iodepth,
                region: (half, w.size),
            },
        ];
        one("read + write at once", w, Some(&both))?;
    } else {
        one(
            &format!(
                "{} bs={} iodepth={}",
                w.pattern.fio_name(),
                human_bytes(w.bs),
                w.iodepth
            ),
            w,
            None,
        )?;
    }
    Ok(RawReport {
        workload: w.clone(),
        buffer_bytes: buffer_bytes.max(w.bs * w.iodepth as u64),
        machine: Machine::probe(w.file.parent().unwrap_or(std::path::Path::new("."))),
        engine: engine.clone(),
        fio_version,
        runs,
    })
}

pub fn render_raw(r: &RawReport) -> String {
    let mut s = format!(
        "file {} ({}), machine: {} CPUs, kernel {}, {}\n",
        r.workload.file.display(),
        human_bytes(r.workload.size),
        r.machine.cpus,
        r.machine.kernel,
        r.machine.filesystem_of_dir
    );
    if let Some(v) = &r.fio_version {
        s += &format!("reference: {v}, ioengine=io_uring direct=1, same file, same run\n");
    }
    let fio_buffer = r.workload.bs * r.workload.iodepth as u64;
    if r.buffer_bytes > fio_buffer {
        s += &format!(
            "kvtier's I/Os walk {} of buffers in turn (fio reuses its {} = iodepth x bs)\n",
            human_bytes(r.buffer_bytes),
            human_bytes(fio_buffer)
        );
    }
    s += &format!(
        "\n{:<34} {:>11} {:>11} {:>10} {:>10} {:>9} {:>9}\n",
        "run", "read MiB/s", "write MiB/s", "IOPS", "CPU us/IO", "p99 us", "vs fio"
    );
    let mib = (1u64 << 20) as f64;
    let line = |who: &str, x: &IoResult| {
        let ios = (x.read_ios + x.write_ios) as f64 / x.secs.max(1e-9);
        let p99 = x.lat_p99_us_read.max(x.lat_p99_us_write);
        format!(
            "{:<34} {:>11.1} {:>11.1} {:>10.0} {:>10.2} {:>9.0}",
            who,
            x.read_bw / mib,
            x.write_bw / mib,
            ios,
            x.cpu_us_per_io(),
            p99
        )
    };
    for run in &r.runs {
        let ratio = run
            .fio
            .as_ref()
            .map(|f| format!("{:>8.3}x", run.kvtier.total_bw() / f.total_bw().max(1.0)))
            .unwrap_or_default();
        s += &format!(
            "{} {}\n",
            line(&format!("kvtier {}", run.name), &run.kvtier),
            ratio
        );
        s += &format!(
            "{:<34} {} I/Os ({} on fixed buffers), {} syscalls; {}{}\n",
            "",
            run.engine.stats.ios,
            run.engine.stats.fixed_buffer_ios,
            run.engine.stats.syscalls,
            run.engine.describe,
            run.engine
                .huge_page_share
                .map(|h| format!("; buffers {:.0}% in huge pages", h * 100.0))
                .unwrap_or_default()
        );
        if let Some(f) = &run.fio {
            s += &format!("{}\n", line(&format!("fio    {}", run.name), f));
            s += &format!(
                "{:<34} bandwidth {:.3}x fio, CPU per I/O {:.3}x fio\n",
                "  kvtier/fio",
                run.kvtier.total_bw() / f.total_bw().max(1.0),
                run.kvtier.cpu_us_per_io() / f.cpu_us_per_io().max(1e-9)
            );
        }
    }
    if r.runs.len() == 3 && r.runs[2].name.starts_with("read + write") {
        let alone = r.runs[0].kvtier.read_bw + r.runs[1].kvtier.write_bw;
        let both = r.runs[2].kvtier.total_bw();
        s += &format!(
            "\ncontention: read alone {:.0} MiB/s, write alone {:.0} MiB/s; at once: read {:.0} + write {:.0} = {:.0} MiB/s ({:.0}% of read alone, {:.0}% of the sum alone)\n",
            r.runs[0].kvtier.read_bw / mib,
            r.runs[1].kvtier.write_bw / mib,
            r.runs[2].kvtier.read_bw / mib,
            r.runs[2].kvtier.write_bw / mib,
            both / mib,
            100.0 * r.runs[2].kvtier.read_bw / r.runs[0].kvtier.read_bw.max(1.0),
            100.0 * both / alone.max(1.0)
        );
    }
    s
}

/// `--repeat N` of the KV bench: N rounds, each a fresh pool (kvtier) then
/// fio's references on the same directory, and the medians of every figure
/// and of every round's kvtier/fio ratio (a ratio is taken within a round,
/// so a slow moment of a shared disk moves both sides of it).
#[derive(Clone, Debug, serde::Serialize)]
pub struct RepeatedReport {
    pub rounds: Vec<BenchReport>,
    pub medians: Vec<ContextMedians>,
}

/// One context length's medians over the rounds.
#[derive(Clone, Debug, serde::Serialize)]
pub struct ContextMedians {
    pub tokens: u64,
    pub store_gib_s: f64,
    pub retrieve_gib_s: f64,
    pub first_layer_ms: f64,
    /// First layer / the average layer of the same restore.
    pub first_layer_vs_avg: f64,
    /// Per round store / fio sequential write, then the median.
    pub store_vs_fio_write: Option<f64>,
    /// Per round retrieve / fio sequential read, then the median.
    pub retrieve_vs_fio_read: Option<f64>,
    pub fio_write_gib_s: Option<f64>,
    pub fio_read_gib_s: Option<f64>,
    /// Per round store / the engine alone writing the same bytes from the
    /// same memory to the same offsets, then the median.
    pub store_vs_engine_write: Option<f64>,
    /// Per round retrieve / the engine alone reading the same bytes into
    /// as much memory, then the median.
    pub retrieve_vs_engine_read: Option<f64>,
    /// Per round store / fio's sequential write with `--end_fsync=1`.
    pub store_vs_fio_write_durable: Option<f64>,
    pub fio_write_durable_gib_s: Option<f64>,
    /// Per round store / the engine alone writing the same bytes followed
    /// by one flush.
    pub store_vs_engine_write_durable: Option<f64>,
    /// Per round retrieve / fio reading the same bytes of the pool file
    /// right before and after it (`ContextResult::fio_read_bracketed_gib_s`).
    #[serde(default)]
    pub retrieve_vs_fio_read_same_bytes: Option<f64>,
    #[serde(default)]
    pub fio_read_same_bytes_gib_s: Option<f64>,
    /// Per round retrieve / fio replaying the restore's reads.
    #[serde(default)]
    pub retrieve_vs_fio_replay: Option<f64>,
    /// Per round fio's replay / its sequential pass over the same bytes.
    #[serde(default)]
    pub fio_replay_vs_same_bytes: Option<f64>,
}

/// The middle value (the mean of the two middle ones for an even count).
pub(crate) fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    let n = v.len();
    match n {
        0 => f64::NAN,
        _ if n % 2 == 1 => v[n / 2],
        _ => (v[n / 2 - 1] + v[n / 2]) / 2.0,
    }
}

impl RepeatedReport {
    /// The medians of `rounds` (each context as measured in every round).
    pub fn new(rounds: Vec<BenchReport>) -> RepeatedReport {
        let layers = rounds.first().map_or(1, |r| r.config.geometry.layers);
        let tokens: Vec<u64> = rounds
            .first()
            .map(|r| r.results.iter().map(|c| c.tokens).collect())
            .unwrap_or_default();
        let medians = tokens
            .iter()
            .map(|&t| {
                let per: Vec<(&ContextResult, Option<&FioReferences>)> = rounds
                    .iter()
                    .filter_map(|r| {
                        r.results
                            .iter()
                            .find(|c| c.tokens == t)
                            .map(|c| (c, r.fio.as_ref()))
                    })
                    .collect();
                let of = |f: &dyn Fn(&ContextResult) -> f64| {
                    median(per.iter().map(|(c, _)| f(c)).collect())
                };
                let of_some = |f: &dyn Fn(&ContextResult) -> Option<f64>| {
                    let v: Vec<f64> = per.iter().filter_map(|(c, _)| f(c)).collect();
                    (!v.is_empty()).then(|| median(v))
                };
                let with_fio = |f: &dyn Fn(&ContextResult, &FioReferences) -> f64| {
                    let v: Vec<f64> = per.iter().filter_map(|(c, r)| r.map(|r| f(c, r))).collect();
                    (!v.is_empty()).then(|| median(v))
                };
                ContextMedians {
                    tokens: t,
                    store_gib_s: of(&|c| c.store_gib_s),
                    retrieve_gib_s: of(&|c| c.retrieve_gib_s),
                    first_layer_ms: of(&|c| c.first_layer_ms),
                    first_layer_vs_avg: of(&|c| c.first_layer_vs_avg(layers)),
                    store_vs_fio_write: with_fio(&|c, f| {
                        c.store_gib_s / (f.seq_write.write_bw / GIB).max(1e-9)
                    }),
                    retrieve_vs_fio_read: with_fio(&|c, f| {
                        c.retrieve_gib_s / (f.seq_read.read_bw / GIB).max(1e-9)
                    }),
                    fio_write_gib_s: with_fio(&|_, f| f.seq_write.write_bw / GIB),
                    fio_read_gib_s: with_fio(&|_, f| f.seq_read.read_bw / GIB),
                    store_vs_engine_write: of_some(&|c| {
                        c.engine_write_bracketed_gib_s()
                            .map(|e| c.store_gib_s / e.max(1e-9))
                    }),
                    retrieve_vs_engine_read: of_some(&|c| {
                        c.engine_read_gib_s.map(|e| c.retrieve_gib_s / e.max(1e-9))
                    }),
                    store_vs_fio_write_durable: with_fio(&|c, f| {
                        c.store_gib_s / (f.seq_write_durable.write_bw / GIB).max(1e-9)
                    }),
                    fio_write_durable_gib_s: with_fio(&|_, f| f.seq_write_durable.write_bw / GIB),
                    store_vs_engine_write_durable: of_some(&|c| {
                        c.engine_write_durable_bracketed_gib_s()
                            .map(|e| c.store_gib_s / e.max(1e-9))
                    }),
                    retrieve_vs_fio_read_same_bytes: of_some(&|c| {
                        c.fio_read_bracketed_gib_s()
                            .map(|f| c.retrieve_gib_s / f.max(1e-9))
                    }),
                    fio_read_same_bytes_gib_s: of_some(&|c| c.fio_read_bracketed_gib_s()),
                    retrieve_vs_fio_replay: of_some(&|c| {
                        c.fio_replay_gib_s.map(|p| c.retrieve_gib_s / p.max(1e-9))
                    }),
                    fio_replay_vs_same_bytes: of_some(&|c| {
                        let f = c.fio_read_bracketed_gib_s()?;
                        c.fio_replay_gib_s.map(|p| p / f.max(1e-9))
                    }),
                }
            })
            .collect();
        RepeatedReport { rounds, medians }
    }
}

/// Each round's table, then the medians.
pub fn render_repeated(r: &RepeatedReport) -> String {
    let mut s = String::new();
    for (i, round) in r.rounds.iter().enumerate() {
        s += &format!("== round {} of {}\n", i + 1, r.rounds.len());
        s += &render(round);
        s += "\n";
    }
    s += &format!(
        "== medians of {} rounds (ratios taken within each round)\n{:>8} {:>11} {:>14} {:>10} {:>11} {:>16} {:>10} {:>18} {:>10} {:>20} {:>22}\n",
        r.rounds.len(),
        "tokens",
        "store GiB/s",
        "retrieve GiB/s",
        "layer0 ms",
        "layer0/avg",
        "store/fio write",
        "fio write",
        "retrieve/fio read",
        "fio read",
        "store/engine write",
        "retrieve/engine read"
    );
    let opt = |v: Option<f64>, prec: usize| v.map_or("-".to_string(), |x| format!("{x:.prec$}"));
    for m in &r.medians {
        s += &format!(
            "{:>8} {:>11.2} {:>14.2} {:>10.2} {:>11.2} {:>16} {:>10} {:>18} {:>10} {:>20} {:>22}\n",
            m.tokens,
            m.store_gib_s,
            m.retrieve_gib_s,
            m.first_layer_ms,
            m.first_layer_vs_avg,
            opt(m.store_vs_fio_write, 3),
            opt(m.fio_write_gib_s, 2),
            opt(m.retrieve_vs_fio_read, 3),
            opt(m.fio_read_gib_s, 2),
            opt(m.store_vs_engine_write, 3),
            opt(m.retrieve_vs_engine_read, 3)
        );
    }
    // A store acknowledges only durable bytes: its references with a flush.
    s += &format!(
        "durable references (medians of each round's ratio):\n{:>8} {:>24} {:>20} {:>27}\n",
        "tokens", "store/fio write+fsync", "fio write+fsync", "store/engine write+flush"
    );
    for m in &r.medians {
        s += &format!(
            "{:>8} {:>24} {:>20} {:>27}\n",
            m.tokens,
            opt(m.store_vs_fio_write_durable, 3),
            opt(m.fio_write_durable_gib_s, 2),
            opt(m.store_vs_engine_write_durable, 3)
        );
    }
    if r.medians
        .iter()
        .any(|m| m.retrieve_vs_fio_read_same_bytes.is_some())
    {
        s += &format!(
            "restore against fio reading the same bytes of the pool file right before and after it, and replaying the restore's reads (medians of each round's ratio):\n{:>8} {:>26} {:>22} {:>22} {:>26}\n",
            "tokens", "retrieve/fio same bytes", "fio same bytes GiB/s", "retrieve/fio replay", "fio replay/same bytes"
        );
        for m in &r.medians {
            s += &format!(
                "{:>8} {:>26} {:>22} {:>22} {:>26}\n",
                m.tokens,
                opt(m.retrieve_vs_fio_read_same_bytes, 3),
                opt(m.fio_read_same_bytes_gib_s, 2),
                opt(m.retrieve_vs_fio_replay, 3),
                opt(m.fio_replay_vs_same_bytes, 3)
            );
        }
    }
    s
}

/// ", {x}x the engine alone writing the same bytes from the same memory".
fn engine_write_note(r: &ContextResult) -> String {
    let mut s = r.engine_write_bracketed_gib_s().map_or(String::new(), |e| {
        format!(
            ", {:.3}x kvtier's engine alone writing the same bytes from the same memory to the same offsets ({e:.2} GiB/s)",
            r.store_gib_s / e.max(1e-9)
        )
    });
    if let Some(d) = r.engine_write_durable_bracketed_gib_s() {
        s += &format!(
            ", {:.3}x it followed by one flush ({d:.2} GiB/s)",
            r.store_gib_s / d.max(1e-9)
        );
    }
    if let (Some(b), Some(a)) = (
        r.engine_write_before_durable_gib_s,
        r.engine_write_durable_gib_s,
    ) {
        s += &format!(
            " (with its flush {b:.2} GiB/s right before the store and {a:.2} right after; the store against their mean time)"
        );
    }
    if let Some(f) = r.engine_first_write_gib_s {
        s += &format!(" (the first such write, to a range not written since the pool's creation: {f:.2} GiB/s)");
    }
    s
}

/// "retrieve {x}x the engine alone reading the same bytes into as much
/// memory", and against fio reading them right before and after it.
fn engine_read_note(r: &ContextResult) -> String {
    let mut s = r.engine_read_gib_s.map_or(String::new(), |e| {
        format!(
            "; retrieve {:.3}x the engine alone reading them into as much memory ({e:.2} GiB/s)",
            r.retrieve_gib_s / e.max(1e-9)
        )
    });
    if let (Some(f), Some(b), Some(a)) = (
        r.fio_read_bracketed_gib_s(),
        r.fio_read_before_gib_s,
        r.fio_read_after_gib_s,
    ) {
        s += &format!(
            "; retrieve {:.3}x fio reading the same bytes of the pool file in one sequential pass ({b:.2} GiB/s right before the restore, {a:.2} right after; the restore against their mean time)",
            r.retrieve_gib_s / f.max(1e-9)
        );
        if let Some(p) = r.fio_replay_gib_s {
            s += &format!(
                "; fio replaying the restore's own reads in its layer order {p:.2} GiB/s ({:.3}x its sequential pass: what the layer order costs on this disk), the restore {:.3}x that replay",
                p / f.max(1e-9),
                r.retrieve_gib_s / p.max(1e-9)
            );
        }
    }
    s
}

/// The report as a table.
pub fn render(report: &BenchReport) -> String {
    let mut s = String::new();
    let g = &report.config.geometry;
    s += &format!(
        "model {} ({}), {} device(s), group {} blocks\nengine: {}\nmachine: {} CPUs, kernel {}, {}\n\n",
        report.config.model,
        g.describe(),
        report.config.devices,
        report.config.group_blocks,
        report.engine,
        report.machine.cpus,
        report.machine.kernel,
        report.machine.filesystem_of_dir
    );
    s += &format!(
        "{:>8} {:>10} {:>11} {:>13} {:>11} {:>10} {:>10} {:>12} {:>14} {:>14} {:>14}\n",
        "tokens",
        "size",
        "store GiB/s",
        "retrieve GiB/s",
        "layer0 ms",
        "layer0/avg",
        "I/O/layer",
        "enter/layer",
        "store us/obj",
        "load us/obj",
        "store flushes"
    );
    for r in &report.results {
        s += &format!(
            "{:>8} {:>10} {:>11.2} {:>13.2} {:>11.2} {:>10.2} {:>10.1} {:>12.1} {:>14.3} {:>14.3} {:>14}\n",
            r.tokens,
            human_bytes(r.bytes),
            r.store_gib_s,
            r.retrieve_gib_s,
            r.first_layer_ms,
            r.first_layer_vs_avg(g.layers),
            r.ios_per_layer,
            r.syscalls_per_layer,
            r.store_cpu_us_per_object,
            r.retrieve_cpu_us_per_object,
            r.store_flushes
        );
    }
    for k in &report.skipped {
        s += &format!("skipped {k}\n");
    }
    if report.fio.is_none() {
        for r in report
            .results
            .iter()
            .filter(|r| r.engine_write_gib_s.is_some())
        {
            s += &format!(
                "{:>8} tokens: store{}{}\n",
                r.tokens,
                engine_write_note(r).trim_start_matches(','),
                engine_read_note(r)
            );
        }
    }
    if let Some(h) = report.huge_page_share {
        s += &format!(
            "host KV memory in huge pages: {:.0}% (fewer DMA segments per I/O; on a VM a low share costs bandwidth)\n",
            h * 100.0
        );
    }
    if let Some(p) = report.peak_rss {
        s += &format!(
            "peak RSS: kvtier {}{}{}\n",
            human_bytes(p.total_bytes()),
            if p.hugetlb_bytes > 0 {
                format!(
                    " ({} of it in reserved huge pages, which RSS leaves out)",
                    human_bytes(p.hugetlb_bytes)
                )
            } else {
                String::new()
            },
            report
                .config
                .mem_budget
                .map(|b| format!(" (--mem-budget {} for the KV cache)", human_bytes(b)))
                .unwrap_or_default()
        );
    }
    if let Some(f) = &report.fio {
        let seq = f.seq_read.read_bw / GIB;
        s += &format!(
            "\nreference ({}): sequential read {:.2} GiB/s [{}], random {} reads {:.2} GiB/s\n",
            f.version,
            seq,
            f.seq_read_cmd.join(" "),
            human_bytes(g.object_bytes()),
            f.rand_read.read_bw / GIB
        );
        let wseq = f.seq_write.write_bw / GIB;
        s += &format!(
            "reference: sequential write {:.2} GiB/s [{}]\n",
            wseq,
            f.seq_write_cmd.join(" ")
        );
        let wdur = f.seq_write_durable.write_bw / GIB;
        s += &format!(
            "reference: sequential write + end fsync {:.2} GiB/s [{}]\n",
            wdur,
            f.seq_write_durable_cmd.join(" ")
        );
        if let Some((r, cmd)) = report
            .results
            .iter()
            .find_map(|r| r.fio_read_cmd.as_ref().map(|c| (r, c)))
        {
            let pages = if cmd.iter().any(|a| a == "--mem=shmhuge") {
                ""
            } else {
                " (fio's buffers in 4 KiB pages: no reserved huge pages were free for them while the KV memory held its own; scripts/bench.sh reserves some)"
            };
            s += &format!(
                "reference: fio reading each context's bytes of the pool file right before and after its restore [fio {}] ({} tokens; the others alike){pages}\n",
                cmd.join(" "),
                r.tokens
            );
        }
        for r in &report.results {
            s += &format!(
                "{:>8} tokens: retrieve {:.3}x fio sequential read, {:.1}x fio random object reads; store {:.3}x fio sequential write, {:.3}x fio write + end fsync{}\n",
                r.tokens,
                r.retrieve_gib_s / seq,
                r.retrieve_gib_s / (f.rand_read.read_bw / GIB).max(1e-9),
                r.store_gib_s / wseq.max(1e-9),
                r.store_gib_s / wdur.max(1e-9),
                engine_write_note(r) + &engine_read_note(r)
            );
        }
    }
    s
}

/// The contexts whose blocks fit `slots` (what the run can hold), a line for
/// each one left out naming the fix, and the most blocks one context needs.
pub(crate) fn contexts_that_fit(
    contexts: &[u64],
    geo: &KvGeometry,
    slots: u64,
    whose: &str,
) -> (Vec<u64>, Vec<String>, u64) {
    let (fit, over): (Vec<u64>, Vec<u64>) = contexts
        .iter()
        .partition(|&&t| geo.tokens_to_blocks(t) <= slots);
    let skipped = over
        .iter()
        .map(|&t| {
            format!(
                "{t} tokens: {} blocks do not fit {whose} {slots} slots (raise --capacity)",
                geo.tokens_to_blocks(t)
            )
        })
        .collect();
    let max_blocks = most_blocks(&fit, geo);
    (fit, skipped, max_blocks)
}

/// The most `kvtier bench` makes its pool when `--capacity` is not given
/// (its fixed default before it was sized to the contexts).
pub const DEFAULT_MAX_CAPACITY: u64 = 12 << 30;

/// The bench's pool when `--capacity` is not given: the smallest pool of
/// `devices` files that holds every context that will run (within
/// `mem_budget`) at once, since the run stores them one after another into
/// the same pool and a store that evicts has no engine-alone reference;
/// at most [`DEFAULT_MAX_CAPACITY`] (a context over it is skipped, naming
/// --capacity). The pool is prewritten at creation, so a fixed 12 GiB cost
/// that much free disk and writing time even where only 4K and 16K tokens
/// run (`scripts/bench.sh`'s 4 GiB memory budget: 2.6 GiB for llama3-8b).
pub fn default_capacity(
    contexts: &[u64],
    geo: &KvGeometry,
    mem_budget: Option<u64>,
    devices: u32,
    group_blocks: u32,
) -> u64 {
    use kvtier::pool::layout::{PoolLayout, DATA_OFFSET};
    let devices = u64::from(devices.max(1));
    // Groups go round-robin over the files: each holds its share, whole groups.
    let bytes_for = |blocks: u64| {
        let groups = blocks
            .div_ceil(devices)
            .div_ceil(u64::from(group_blocks))
            .max(1);
        let per_dev = DATA_OFFSET + groups * PoolLayout::group_bytes_for(geo, group_blocks);
        per_dev.next_multiple_of(4096).saturating_mul(devices)
    };
    let runnable = match mem_budget {
        Some(budget) => contexts_within_memory(contexts, geo, budget).0,
        None => contexts.to_vec(),
    };
    let blocks: u64 = runnable
        .iter()
        .map(|&t| geo.tokens_to_blocks(t))
        .filter(|&b| bytes_for(b) <= DEFAULT_MAX_CAPACITY)
        .sum();
    if blocks == 0 {
        // Nothing runs: the old default, so each skip line names its fix.
        return DEFAULT_MAX_CAPACITY;
    }
    bytes_for(blocks).min(DEFAULT_MAX_CAPACITY)
}

/// The most blocks any of `contexts` needs (0 for none).
fn most_blocks(contexts: &[u64], geo: &KvGeometry) -> u64 {
    contexts
        .iter()
        .map(|&t| geo.tokens_to_blocks(t))
        .max()
        .unwrap_or(0)
}

/// The contexts whose host KV memory (one block of memory per block stored)
/// fits `budget` bytes, a line for each one left out saying what it needs
/// and what this machine has, and the most blocks one context needs.
pub(crate) fn contexts_within_memory(
    contexts: &[u64],
    geo: &KvGeometry,
    budget: u64,
) -> (Vec<u64>, Vec<String>, u64) {
    let need = |t: u64| geo.tokens_to_blocks(t).saturating_mul(geo.block_bytes());
    let (fit, over): (Vec<u64>, Vec<u64>) = contexts.iter().partition(|&&t| need(t) <= budget);
    let avail = kvtier::host::mem_available()
        .map(|a| format!("; this machine has {} available", human_bytes(a)))
        .unwrap_or_default();
    let skipped = over
        .iter()
        .map(|&t| {
            format!(
                "{t} tokens: its KV cache needs {} of host memory, over the --mem-budget of {}{avail} (raise --mem-budget to run it)",
                human_bytes(need(t)),
                human_bytes(budget)
            )
        })
        .collect();
    let max_blocks = most_blocks(&fit, geo);
    (fit, skipped, max_blocks)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The bracketing reference is the rate of the mean time: 4 GiB/s
    /// before and 2 after take 0.25 + 0.5 s per GiB, 2.67 GiB/s (not the
    /// mean rate, 3); the write after alone stands where none ran before.
    #[test]
    fn the_store_reference_is_the_mean_time_of_its_two_halves() {
        let r = bracketed(Some(4.0), Some(2.0)).unwrap();
        assert!((r - 8.0 / 3.0).abs() < 1e-12, "{r}");
        assert_eq!(bracketed(None, Some(2.0)), Some(2.0));
        assert_eq!(bracketed(Some(0.0), Some(2.0)), Some(2.0));
        assert_eq!(bracketed(Some(3.0), None), None);
    }

    #[test]
    fn contexts_over_the_memory_budget_are_skipped_with_the_reason() {
        let geo = kvtier::model::preset("llama3-8b", 16).unwrap();
        // 2 MiB blocks: 4096 tokens = 512 MiB, 16384 = 2 GiB, 65536 = 8 GiB.
        let (fit, skipped, max) = contexts_within_memory(&[4096, 16384, 65536], &geo, 4 << 30);
        assert_eq!(fit, vec![4096, 16384]);
        assert_eq!(max, 1024);
        assert_eq!(skipped.len(), 1);
        assert!(
            skipped[0].starts_with("65536 tokens")
                && skipped[0].contains("8 GiB")
                && skipped[0].contains("--mem-budget of 4 GiB")
                && skipped[0].contains("raise --mem-budget"),
            "{}",
            skipped[0]
        );
        let (fit, skipped, max) = contexts_within_memory(&[65536], &geo, 1 << 30);
        assert!(fit.is_empty() && max == 0 && skipped.len() == 1);
    }

    /// Without --capacity the pool holds every context that runs:
    /// every slot count is checked against the pool layout's own count of
    /// a file of that size, for one and for several files.
    #[test]
    fn the_default_capacity_holds_the_largest_context_that_runs() {
        use kvtier::pool::layout::PoolLayout;
        use kvtier::pool::place::split_capacity;
        let geo = kvtier::model::preset("llama3-8b", 16).unwrap();
        let slots = |cap: u64, devs: u32, g: u32| {
            u64::from(PoolLayout::groups_fitting(
                &geo,
                g,
                split_capacity(cap, devs as usize),
            )) * u64::from(g)
                * u64::from(devs)
        };
        let contexts = [4096, 16384, 65536, 131072];
        // scripts/bench.sh's 4 GiB budget: 4K and 16K tokens (256 + 1024
        // blocks) run, both held at once (no store evicts).
        let cap = default_capacity(&contexts, &geo, Some(4 << 30), 1, 64);
        assert!(
            slots(cap, 1, 64) >= 1280 && cap < (2 << 30) + (768 << 20),
            "{cap}"
        );
        // No budget: 4K + 16K + 64K (5376 blocks, 10.5 GiB) run; 128K needs
        // 16 GiB, over 12 GiB, and is skipped.
        let cap = default_capacity(&contexts, &geo, None, 1, 64);
        assert!(
            slots(cap, 1, 64) >= 5376 && cap <= DEFAULT_MAX_CAPACITY,
            "{cap}"
        );
        // More than 12 GiB together: 12 GiB (the largest still fits).
        let cap = default_capacity(&[65536, 65536], &geo, None, 1, 64);
        assert_eq!(cap, DEFAULT_MAX_CAPACITY);
        // Several files, odd group sizes: whole groups per file.
        for (devs, g, tokens) in [(3, 64, 16384), (2, 7, 4096), (4, 1, 16), (5, 16, 100)] {
            let cap = default_capacity(&[tokens, 16], &geo, None, devs, g);
            assert!(
                slots(cap, devs, g) > geo.tokens_to_blocks(tokens), // and the 16-token one's block
                "{devs} files, groups of {g}, {tokens} tokens: {cap}"
            );
            assert!(cap >= kvtier::pool::place::min_capacity(&geo, g, devs as usize));
        }
        // Nothing runs: the fixed default, whose skip lines name each fix.
        assert_eq!(
            default_capacity(&[65536], &geo, Some(1 << 30), 1, 64),
            DEFAULT_MAX_CAPACITY
        );
    }

    /// `--against-fio`: fio reads each context's bytes of the pool file in
    /// one sequential pass right before and right after its restore,
    /// through this process's descriptor, read-only, from the context's
    /// first object; the restore still verifies every byte (fio wrote
    /// nothing), and the pool files are gone afterwards.
    #[test]
    fn fio_reads_each_contexts_bytes_beside_its_restore() {
        if fio::fio_available().is_none() {
            eprintln!("SKIP: fio is not installed (apt-get install fio)");
            return;
        }
        let dir = kvtier::scratch::TestDir::new("bench-fio-bracket");
        let geo = kvtier::model::preset("llama3-8b", 16).unwrap();
        let cfg = BenchConfig {
            dir: dir.path().to_path_buf(),
            model: "llama3-8b".to_string(),
            geometry: geo,
            contexts: vec![256, 1024],
            capacity: 256 << 20,
            devices: 1,
            group_blocks: 8,
            tier: TierConfig::default(),
            verify: true,
            cross_layer: false,
            store_job_blocks: 4096,
            nvme: None,
            force: false,
            keep: false,
            prewrite: true,
            mem_budget: None,
            fio_bracket: true,
        };
        let report = run(&cfg, |_| {}).unwrap();
        assert_eq!(report.results.len(), 2, "{:?}", report.skipped);
        assert!(
            !report.skipped.iter().any(|k| k.contains("fio")),
            "{:?}",
            report.skipped
        );
        let mut offsets = Vec::new();
        for r in &report.results {
            assert!(r.verified);
            assert!(r.fio_read_before_gib_s.unwrap() > 0.0);
            assert!(r.fio_read_after_gib_s.unwrap() > 0.0);
            assert!(r.fio_read_bracketed_gib_s().unwrap() > 0.0);
            let cmd = r.fio_read_cmd.as_ref().unwrap();
            let arg = |name: &str| {
                cmd.iter()
                    .find_map(|a| a.strip_prefix(name))
                    .unwrap_or_else(|| panic!("no {name} in {cmd:?}"))
                    .to_string()
            };
            assert!(cmd.iter().any(|a| a == "--readonly"), "{cmd:?}");
            assert!(cmd.iter().any(|a| a == "--rw=read"), "{cmd:?}");
            let file = arg("--filename=");
            assert!(
                file.starts_with(&format!("/proc/{}/fd/", std::process::id())),
                "{file}"
            );
            assert_eq!(arg("--size="), format!("{}m", r.bytes >> 20));
            offsets.push(arg("--offset=").parse::<u64>().unwrap());
        }
        // Past the superblock area; the second context after the first.
        assert!(offsets[0] > 0 && offsets[1] > offsets[0], "{offsets:?}");
        // fio replayed the restore's reads from an iolog of its own
        // (removed after), without registered files (fio refuses them).
        for r in &report.results {
            assert!(r.fio_replay_gib_s.unwrap() > 0.0);
            let cmd = r.fio_replay_cmd.as_ref().unwrap();
            assert!(
                cmd.iter().any(|a| a.starts_with("--read_iolog=/proc/")),
                "{cmd:?}"
            );
            assert!(!cmd.iter().any(|a| a == "--registerfiles"), "{cmd:?}");
            assert!(cmd.iter().any(|a| a == "--readonly"), "{cmd:?}");
        }
        assert!(render(&report).contains("fio reading the same bytes of the pool file"));
        let left: Vec<_> = std::fs::read_dir(dir.path()).unwrap().collect();
        assert!(left.is_empty(), "{left:?}");
    }

    /// The restore's reads as fio replays them: layer by layer, each
    /// layer's K and V objects of every block in offset order, adjacent
    /// ones merged up to the largest I/O; every object read once.
    #[test]
    fn the_restore_reads_cover_every_object_once_in_layer_order() {
        let dir = kvtier::scratch::TestDir::new("bench-restore-reads");
        let geo = kvtier::model::preset("llama3-8b", 16).unwrap();
        let file = ScratchFile::create_new(&dir.file("p.pool"), "test").unwrap();
        let cfg = PoolConfig::new(geo, "llama3-8b".to_string(), "t").with_group_blocks(8);
        let pool = Pool::create_in_files(
            &cfg,
            vec![file.descriptor().unwrap()],
            256 << 20,
            &mut |_, _| {},
        )
        .unwrap();
        let mut tier = Tier::open(pool, TierConfig::default()).unwrap();
        let cache = Arc::new(HostKvCache::new(geo, 12, HostLayout::PerLayer).unwrap());
        tier.register_host_cache(cache).unwrap();
        let keys: Vec<Key> = (0..12).map(Key::from_u64).collect();
        let mem: Vec<u32> = (0..12).collect();
        let job = tier.submit_store(&keys, &mem).unwrap();
        job_ok(&tier.wait(job).unwrap(), "store").unwrap();
        let pool = tier.pool();
        let object = geo.object_bytes();
        // Blocks 0-7 fill a group, 8-11 begin the next: per layer, the
        // first group's K and V runs adjacent (16 objects, one read), the
        // second's apart (4 and 4: slots 12-15 lie between them).
        let reads = restore_reads(pool, &keys, 4 << 20);
        assert_eq!(reads.len(), 3 * geo.layers as usize);
        assert_eq!(reads[0].1, 16 * object);
        assert_eq!((reads[1].1, reads[2].1), (4 * object, 4 * object));
        assert_eq!(reads[2].0 - reads[1].0, 8 * object);
        let layout = pool.layout();
        let slot0 = pool.index().get(&keys[0]).unwrap().slot;
        assert_eq!(reads[0].0, layout.object_offset(slot0, 0, 0).1);
        assert_eq!(reads[3].0, layout.object_offset(slot0, 1, 0).1);
        // Capped at 4 objects: each layer's 24 objects in 6 reads.
        let reads = restore_reads(pool, &keys, 4 * object);
        assert_eq!(reads.len(), 6 * geo.layers as usize);
        let total: u64 = reads.iter().map(|r| r.1).sum();
        assert_eq!(total, 12 * geo.block_bytes());
    }

    /// The span fio reads: whole I/Os of the engine's largest size from the
    /// context's first object, moved back where it would pass the file's
    /// end, 4 KiB aligned.
    #[test]
    fn the_fio_span_stays_in_the_file() {
        let f = std::fs::File::open("/dev/null").unwrap();
        let w = fio_span_read(&f, 1 << 20, 64 << 20, 1 << 30, 4 << 20, 64);
        assert_eq!(
            (w.offset, w.size, w.bs, w.iodepth),
            (1 << 20, 64 << 20, 4 << 20, 64)
        );
        // 6 MiB in 4 MiB I/Os: one whole I/O.
        let w = fio_span_read(&f, 1 << 20, 6 << 20, 1 << 30, 4 << 20, 64);
        assert_eq!((w.offset, w.size), (1 << 20, 4 << 20));
        // Smaller than one I/O: one I/O of its size.
        let w = fio_span_read(&f, 1 << 20, 2 << 20, 1 << 30, 4 << 20, 64);
        assert_eq!((w.offset, w.size, w.bs), (1 << 20, 2 << 20, 2 << 20));
        // Near the end: moved back into the file, aligned.
        let w = fio_span_read(&f, (1 << 30) - 8192, 64 << 20, (1 << 30) + 100, 4 << 20, 64);
        assert_eq!(w.offset + w.size, 1 << 30);
        assert_eq!(w.offset % 4096, 0);
        assert!(w.file.starts_with("/proc"));
        assert!(fio::fio_args(&w).contains(&"--readonly".to_string()));
    }

    /// Memory on reserved (hugetlbfs) pages counts as huge: smaps reports
    /// those pages as Private_Hugetlb, never in Rss, and the share said 0%
    /// for them (an 8 GiB cache with two layers there read "93%").
    #[test]
    fn huge_page_share_counts_hugetlb_pages() {
        const LEN: usize = 4 << 20;
        if kvtier::memory::hugetlb_free_bytes() < LEN as u64 {
            eprintln!("SKIP: no free reserved huge pages (echo 8 > /proc/sys/vm/nr_hugepages)");
            return;
        }
        let buf = kvtier::memory::DmaBuffer::new(LEN).unwrap();
        let share = huge_page_share(&[(buf.addr(), LEN as u64)]).unwrap();
        assert!(share > 0.99, "hugetlbfs-backed buffer counted {share}");
    }
}
