//! `kvtier bench`: store and retrieve model-shaped KV caches through the
//! tier, the way a serving engine would, and report bandwidth and host cost.
//!
//! For each context length: fill a host KV cache with a known pattern, store
//! it in one go (the coalesced layout's best case, and what an engine does on
//! eviction of a finished prefix), clear memory, then retrieve it layer by
//! layer through `submit_load` and `wait_layer`, and verify every byte.

use crate::cli::human_bytes;
use crate::error::{Error, Result};
use crate::memory::{HostKvCache, HostLayout};
use crate::model::KvGeometry;
use crate::pool::{DeviceSpec, Key, Pool, PoolConfig};
use crate::tier::{Tier, TierConfig};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

#[derive(Clone, Debug, serde::Serialize)]
pub struct BenchConfig {
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
    pub verified: bool,
}

#[derive(Clone, Debug, serde::Serialize)]
pub struct BenchReport {
    pub config: BenchConfig,
    pub machine: Machine,
    pub engine: String,
    pub results: Vec<ContextResult>,
    pub skipped: Vec<String>,
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

fn cpu_seconds() -> f64 {
    // SAFETY: getrusage writes into the struct we pass.
    let mut ru: libc::rusage = unsafe { std::mem::zeroed() };
    unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut ru) };
    let tv = |t: libc::timeval| t.tv_sec as f64 + t.tv_usec as f64 * 1e-6;
    tv(ru.ru_utime) + tv(ru.ru_stime)
}

pub fn run(cfg: &BenchConfig, mut progress: impl FnMut(&str)) -> Result<BenchReport> {
    let geo = cfg.geometry;
    std::fs::create_dir_all(&cfg.dir)
        .map_err(|e| Error::io(format!("creating {}", cfg.dir.display()), e))?;
    let per_dev = (cfg.capacity / cfg.devices as u64) & !4095;
    let devices: Vec<DeviceSpec> = (0..cfg.devices)
        .map(|i| DeviceSpec {
            path: cfg.dir.join(format!("bench{i}.pool")),
            size: Some(per_dev),
        })
        .collect();
    progress(&format!(
        "formatting {} pool file(s) of {} in {}",
        cfg.devices,
        human_bytes(per_dev),
        cfg.dir.display()
    ));
    let pool = Pool::create(&PoolConfig {
        geometry: geo,
        model: cfg.model.clone(),
        namespace: format!("bench/{}", cfg.model),
        group_blocks: cfg.group_blocks,
        devices,
        force: false,
    })?;
    let slots = pool.index().total_slots();
    let mut skipped = Vec::new();
    let contexts: Vec<u64> = cfg
        .contexts
        .iter()
        .copied()
        .filter(|&t| {
            let fits = geo.tokens_to_blocks(t) <= slots;
            if !fits {
                skipped.push(format!(
                    "{t} tokens: {} blocks do not fit the pool's {slots} slots (raise --capacity)",
                    geo.tokens_to_blocks(t)
                ));
            }
            fits
        })
        .collect();
    let max_blocks = contexts
        .iter()
        .map(|&t| geo.tokens_to_blocks(t))
        .max()
        .unwrap_or(0);
    let mut tier = Tier::open(pool, cfg.tier.clone())?;
    let mut results = Vec::new();
    if max_blocks == 0 {
        return Ok(BenchReport {
            config: cfg.clone(),
            machine: Machine::probe(&cfg.dir),
            engine: tier.engine().describe(),
            results,
            skipped,
        });
    }
    progress(&format!(
        "allocating {} of host KV memory ({max_blocks} blocks)",
        human_bytes(max_blocks * geo.block_bytes())
    ));
    let layout = if cfg.cross_layer {
        HostLayout::CrossLayer
    } else {
        HostLayout::PerLayer
    };
    let cache = Arc::new(HostKvCache::new(geo, max_blocks as u32, layout)?);
    tier.register_host_cache(cache.clone())?;
    let engine = tier.engine().describe();

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
            let failed = r
                .failures()
                .next()
                .map(|(k, why)| format!("store of key {k} failed: {why}"));
            if let Some(msg) = failed {
                return Err(Error::invalid(msg));
            }
        }
        let store_secs = t0.elapsed().as_secs_f64();
        let store_cpu = cpu_seconds() - cpu0;

        cache.clear();
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
        tier.layer_events();
        let failed = r
            .failures()
            .next()
            .map(|(k, why)| format!("load of key {k} failed: {why}"));
        if let Some(msg) = failed {
            return Err(Error::invalid(msg));
        }
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
            verified,
        });
    }
    Ok(BenchReport {
        config: cfg.clone(),
        machine: Machine::probe(&cfg.dir),
        engine,
        results,
        skipped,
    })
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
        "{:>8} {:>10} {:>11} {:>13} {:>11} {:>10} {:>12} {:>14} {:>14}\n",
        "tokens",
        "size",
        "store GiB/s",
        "retrieve GiB/s",
        "layer0 ms",
        "I/O/layer",
        "enter/layer",
        "store us/obj",
        "load us/obj"
    );
    for r in &report.results {
        s += &format!(
            "{:>8} {:>10} {:>11.2} {:>13.2} {:>11.2} {:>10.1} {:>12.1} {:>14.3} {:>14.3}\n",
            r.tokens,
            human_bytes(r.bytes),
            r.store_gib_s,
            r.retrieve_gib_s,
            r.first_layer_ms,
            r.ios_per_layer,
            r.syscalls_per_layer,
            r.store_cpu_us_per_object,
            r.retrieve_cpu_us_per_object
        );
    }
    for k in &report.skipped {
        s += &format!("skipped {k}\n");
    }
    s
}
