//! `kvtier bench --lookups`: how long a scheduler's lookups take on a
//! `TierHandle`, idle and while loads run back to back on the same handle,
//! in alternating rounds of one run.
//!
//! One thread times `lookup_prefix` of `lookup_keys` stored keys, then
//! `lookup_and_pin` + `unpin` of the same keys, one pair of calls about every
//! 100 us (a scheduler step, not a spin: the timed thread sleeps between
//! calls and never competes with the I/O thread for a core while it does).
//! A round is an idle phase (nothing else runs) and a busy phase (another
//! thread loads the whole stored context, all layers, again and again:
//! submit, wait, submit), each of `samples` lookups. The report gives each
//! phase's p50 / p99 / p99.9 / max, the loads' bandwidth during the busy
//! phase, and per round the busy p99 over the idle p99 of the same round.

use kvtier::error::{Error, Result};
use kvtier::handle::{EngineChoice, HandleConfig, TierBuilder, TierHandle};
use kvtier::host::size::human_bytes;
use kvtier::memory::{HostKvCache, HostLayout};
use kvtier::model::KvGeometry;
use kvtier::pool::layout::{PoolLayout, DATA_OFFSET};
use kvtier::pool::{DeviceSpec, Key, Pool, PoolConfig};
use kvtier::scratch::ScratchFile;
use kvtier::tier::TierConfig;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// What `kvtier bench --lookups` runs.
#[derive(Clone, Debug, serde::Serialize)]
pub struct LookupConfig {
    #[serde(serialize_with = "kvtier::json::path_lossy")]
    pub dir: PathBuf,
    pub model: String,
    pub geometry: KvGeometry,
    /// Tokens of the stored context the busy phase loads again and again.
    pub tokens: u64,
    pub group_blocks: u32,
    pub tier: TierConfig,
    /// Keys per lookup.
    pub lookup_keys: usize,
    /// Lookups timed per phase.
    pub samples: usize,
    /// Idle / busy rounds.
    pub rounds: u32,
    /// Leave the pool file in `dir` afterwards.
    pub keep: bool,
}

/// Percentiles of one phase's calls, in microseconds.
#[derive(Clone, Debug, Default, serde::Serialize)]
pub struct Latency {
    pub samples: usize,
    pub p50_us: f64,
    pub p99_us: f64,
    pub p999_us: f64,
    pub max_us: f64,
}

impl Latency {
    /// The percentiles of `ns` (nearest rank).
    pub fn of(mut ns: Vec<u64>) -> Latency {
        if ns.is_empty() {
            return Latency::default();
        }
        ns.sort_unstable();
        let at = |p: f64| {
            let rank = ((p * ns.len() as f64).ceil() as usize).clamp(1, ns.len());
            ns[rank - 1] as f64 / 1e3
        };
        Latency {
            samples: ns.len(),
            p50_us: at(0.50),
            p99_us: at(0.99),
            p999_us: at(0.999),
            max_us: *ns.last().expect("not empty") as f64 / 1e3,
        }
    }
}

/// One phase of a round.
#[derive(Clone, Debug, serde::Serialize)]
pub struct Phase {
    /// `lookup_prefix` of the keys.
    pub lookup: Latency,
    /// `lookup_and_pin` then `unpin` of the keys, timed together.
    pub pin_unpin: Latency,
    /// Loads that finished during the phase, and their bandwidth (busy phase).
    pub loads: u64,
    pub load_gib_s: f64,
}

/// One idle phase and one busy phase.
#[derive(Clone, Debug, serde::Serialize)]
pub struct LookupRound {
    pub idle: Phase,
    pub busy: Phase,
}

impl LookupRound {
    /// Busy p99 over idle p99 of `lookup` and of `pin_unpin`.
    pub fn p99_ratios(&self) -> (f64, f64) {
        (
            self.busy.lookup.p99_us / self.idle.lookup.p99_us.max(1e-3),
            self.busy.pin_unpin.p99_us / self.idle.pin_unpin.p99_us.max(1e-3),
        )
    }
}

#[derive(Clone, Debug, serde::Serialize)]
pub struct LookupReport {
    pub config: LookupConfig,
    pub machine: super::Machine,
    pub engine: String,
    pub rounds: Vec<LookupRound>,
    /// Medians over rounds of each round's busy / idle p99.
    pub median_lookup_p99_ratio: f64,
    pub median_pin_unpin_p99_ratio: f64,
}

/// Time `samples` lookups and pin/unpin pairs, one pair about every 100 us.
fn time_lookups(h: &TierHandle, keys: &[Key], per_call: usize, samples: usize) -> (Phase, bool) {
    let mut lookup = Vec::with_capacity(samples);
    let mut pin = Vec::with_capacity(samples);
    let mut all_hit = true;
    let windows = keys.len().saturating_sub(per_call) + 1;
    for i in 0..samples {
        // A different window of the stored prefix each time, from its start
        // (a prefix lookup) or from inside it.
        let w = &keys[(i * 7919) % windows..][..per_call];
        let t = Instant::now();
        let n = std::hint::black_box(h.lookup_prefix(w));
        lookup.push(t.elapsed().as_nanos() as u64);
        let t = Instant::now();
        let m = h.lookup_and_pin(w);
        h.unpin(&w[..m]);
        pin.push(t.elapsed().as_nanos() as u64);
        all_hit &= n == per_call && m == per_call;
        std::thread::sleep(Duration::from_micros(50));
    }
    (
        Phase {
            lookup: Latency::of(lookup),
            pin_unpin: Latency::of(pin),
            loads: 0,
            load_gib_s: 0.0,
        },
        all_hit,
    )
}

/// Load `keys` into `mem`, all layers, again and again until `stop`:
/// (loads finished, seconds).
fn load_loop(
    h: &TierHandle,
    keys: &[Key],
    mem: &[u32],
    layers: u32,
    stop: &AtomicBool,
) -> Result<(u64, f64)> {
    let t0 = Instant::now();
    let mut n = 0;
    while !stop.load(Ordering::Relaxed) {
        let job = h.submit_load(keys, mem, 0..layers)?;
        let r = h.wait(job)?;
        super::job_ok(&r, "load")?;
        n += 1;
    }
    Ok((n, t0.elapsed().as_secs_f64()))
}

pub fn run(cfg: &LookupConfig, mut progress: impl FnMut(&str)) -> Result<LookupReport> {
    let geo = cfg.geometry;
    if cfg.lookup_keys == 0 || cfg.samples == 0 || cfg.rounds == 0 {
        return Err(Error::invalid(
            "the lookup bench needs at least one key per lookup, one sample and one round",
        ));
    }
    let blocks = geo.tokens_to_blocks(cfg.tokens);
    if blocks < cfg.lookup_keys as u64 {
        return Err(Error::invalid(format!(
            "a {}-token context has {blocks} blocks, fewer than the {} keys of one lookup; give a longer context",
            cfg.tokens, cfg.lookup_keys
        )));
    }
    let bytes = blocks * geo.block_bytes();
    crate::cli::check_host_memory(
        bytes,
        &format!("the lookup bench's {}-token context", cfg.tokens),
        "give a shorter context (--contexts)",
    )?;
    crate::cli::make_dir(&cfg.dir)?;
    // One pool file holding the context, and no more: nothing is evicted.
    let group = PoolLayout::group_bytes_for(&geo, cfg.group_blocks);
    let groups = blocks.div_ceil(cfg.group_blocks as u64);
    let size = (DATA_OFFSET + groups * group).next_multiple_of(4096);
    let mut scratch = ScratchFile::create_new(&cfg.dir.join("lookup0.pool"), "kvtier bench")?;
    if cfg.keep {
        scratch.keep();
    }
    progress(&format!(
        "formatting a pool file of {} in {}",
        human_bytes(size),
        cfg.dir.display()
    ));
    let pool_cfg = PoolConfig::new(geo, cfg.model.clone(), format!("bench/{}", cfg.model))
        .with_group_blocks(cfg.group_blocks)
        .with_devices(vec![DeviceSpec {
            path: scratch.path().to_path_buf(),
            size: Some(size),
        }]);
    drop(Pool::create(&pool_cfg)?);
    let cache = Arc::new(HostKvCache::new(geo, blocks as u32, HostLayout::PerLayer)?);
    let h = TierBuilder::default()
        .files([scratch.path().to_path_buf()])
        .engine(EngineChoice::Uring)
        .config(HandleConfig::default().with_tier(cfg.tier.clone()))
        .host_cache(cache.clone())
        .build()?;
    let result = measure(cfg, &h, &cache, blocks, &mut progress);
    let closed = h.close();
    let rounds = result?;
    closed?;
    let median = |f: &dyn Fn(&LookupRound) -> f64| super::median(rounds.iter().map(f).collect());
    Ok(LookupReport {
        config: cfg.clone(),
        machine: super::Machine::probe(&cfg.dir),
        engine: h.engine().to_string(),
        median_lookup_p99_ratio: median(&|r| r.p99_ratios().0),
        median_pin_unpin_p99_ratio: median(&|r| r.p99_ratios().1),
        rounds,
    })
}

fn measure(
    cfg: &LookupConfig,
    h: &TierHandle,
    cache: &HostKvCache,
    blocks: u64,
    progress: &mut dyn FnMut(&str),
) -> Result<Vec<LookupRound>> {
    let geo = cfg.geometry;
    let keys: Vec<Key> = (0..blocks).map(|b| Key::from_u64((1 << 40) + b)).collect();
    let mem: Vec<u32> = (0..blocks as u32).collect();
    for b in 0..blocks {
        cache.fill_block(b as u32, (1 << 40) + b);
    }
    progress(&format!(
        "{} tokens: storing {}",
        cfg.tokens,
        human_bytes(blocks * geo.block_bytes())
    ));
    for (kc, mc) in keys.chunks(4096).zip(mem.chunks(4096)) {
        let r = h.wait(h.submit_store(kc, mc)?)?;
        super::job_ok(&r, "store")?;
    }
    let gib = (blocks * geo.block_bytes()) as f64 / (1u64 << 30) as f64;
    let mut rounds = Vec::new();
    for round in 1..=cfg.rounds {
        progress(&format!(
            "round {round}/{}: {} lookups idle",
            cfg.rounds, cfg.samples
        ));
        let (idle, hit) = time_lookups(h, &keys, cfg.lookup_keys, cfg.samples);
        if !hit {
            return Err(Error::invalid(
                "a lookup of stored keys missed: the pool lost keys it held",
            ));
        }
        progress(&format!(
            "round {round}/{}: {} lookups while loads of {} run back to back",
            cfg.rounds,
            cfg.samples,
            human_bytes(blocks * geo.block_bytes())
        ));
        let stop = AtomicBool::new(false);
        let (busy, loaded) = std::thread::scope(|s| {
            let loader = s.spawn(|| load_loop(h, &keys, &mem, geo.layers, &stop));
            // The first load under way before the first timed lookup.
            while h.usage().is_ok_and(|u| u.tier.jobs_in_flight == 0) && !loader.is_finished() {
                std::thread::yield_now();
            }
            let timed = time_lookups(h, &keys, cfg.lookup_keys, cfg.samples);
            stop.store(true, Ordering::Relaxed);
            let loaded = loader
                .join()
                .unwrap_or_else(|_| Err(Error::invalid("the loading thread panicked")));
            (timed, loaded)
        });
        let (mut busy, hit) = busy;
        let (loads, secs) = loaded?;
        if !hit {
            return Err(Error::invalid(
                "a lookup of stored keys missed while loads ran: the pool lost keys it held",
            ));
        }
        busy.loads = loads;
        busy.load_gib_s = loads as f64 * gib / secs.max(1e-9);
        rounds.push(LookupRound { idle, busy });
    }
    Ok(rounds)
}

pub fn render(r: &LookupReport) -> String {
    let c = &r.config;
    let mut out = format!(
        "lookup latency on one handle: {} ({} engine), {} keys per call, {} calls per phase\n\
         busy: another thread loads a {}-token context ({}, all {} layers) again and again\n\
         machine: {} ({} CPUs), {}\n\n",
        c.model,
        r.engine,
        c.lookup_keys,
        c.samples,
        c.tokens,
        human_bytes(c.geometry.tokens_to_blocks(c.tokens) * c.geometry.block_bytes()),
        c.geometry.layers,
        r.machine.cpu_model,
        r.machine.cpus,
        r.machine.filesystem_of_dir,
    );
    out += &format!(
        "{:>5} {:>5} {:>30} {:>30} {:>13}\n",
        "round",
        "phase",
        "lookup p50/p99/p99.9/max us",
        "pin+unpin p50/p99/p99.9/max",
        "loads GiB/s"
    );
    let lat = |l: &Latency| {
        format!(
            "{:.1}/{:.1}/{:.1}/{:.0}",
            l.p50_us, l.p99_us, l.p999_us, l.max_us
        )
    };
    for (i, round) in r.rounds.iter().enumerate() {
        for (name, p) in [("idle", &round.idle), ("busy", &round.busy)] {
            let loads = if name == "busy" {
                format!("{:.2} ({} loads)", p.load_gib_s, p.loads)
            } else {
                "-".into()
            };
            out += &format!(
                "{:>5} {:>5} {:>30} {:>30} {:>13}\n",
                i + 1,
                name,
                lat(&p.lookup),
                lat(&p.pin_unpin),
                loads
            );
        }
        let (a, b) = round.p99_ratios();
        out += &format!(
            "{:>5} p99 busy/idle: lookup {a:.2}x, pin+unpin {b:.2}x\n",
            ""
        );
    }
    out += &format!(
        "\nmedian over {} round(s) of p99 busy/idle: lookup {:.2}x, pin+unpin {:.2}x (goal: <= 2x)\n",
        r.rounds.len(),
        r.median_lookup_p99_ratio,
        r.median_pin_unpin_p99_ratio
    );
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn percentiles_are_nearest_rank() {
        let l = Latency::of((1..=1000).map(|i| i * 1000).collect());
        assert_eq!(l.samples, 1000);
        assert_eq!(l.p50_us, 500.0);
        assert_eq!(l.p99_us, 990.0);
        assert_eq!(l.p999_us, 999.0);
        assert_eq!(l.max_us, 1000.0);
        let one = Latency::of(vec![2500]);
        assert_eq!((one.p50_us, one.p99_us, one.max_us), (2.5, 2.5, 2.5));
        assert_eq!(Latency::of(Vec::new()).samples, 0);
    }
}
