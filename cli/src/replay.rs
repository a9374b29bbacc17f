//! `kvtier replay`: play a prefill's per-layer compute times (from a slack
//! table) against real I/O on a pool, under a scheduling policy, and measure
//! what the GPU would have waited (bubble time).
//!
//! The setup stores the request's prefix (untimed) and leaves a backlog of
//! pending writes (the previous request's new KV, as in Tutti's example).
//! Then, per layer: wait until the layer's KV is in memory (the bubble), then
//! "compute" for the layer's time (spinning, polling the tier so I/O keeps
//! flowing, as a GPU would keep running). After the prefill, decode steps
//! drain the write backlog.

use kvtier::error::{Error, Result};
use kvtier::memory::{HostKvCache, HostLayout};
use kvtier::model::KvGeometry;
use kvtier::pool::{Key, Pool, PoolConfig};
use kvtier::sched::{Policy, Scheduler, Window};
use kvtier::scratch::ScratchFile;
use kvtier::tier::{Tier, TierConfig};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// What to replay.
#[derive(Clone, Debug, serde::Serialize)]
pub struct ReplayPlan {
    pub geometry: KvGeometry,
    pub input_tokens: u64,
    pub prefix_tokens: u64,
    /// Compute time of each layer of the prefill, before scaling.
    pub layer_compute_us: Vec<f64>,
    /// Write IOCBs each layer's slack window admits (slack policy).
    pub layer_write_iocbs: Vec<u32>,
    /// Decode step time and its write window, for draining the backlog.
    pub decode_step_us: f64,
    pub decode_write_iocbs: u32,
    /// Recomputing the whole prefix instead (compute of input+prefix, no cache).
    pub recompute_us: f64,
    /// Multiplies every compute time (to fit a slow disk to a fast GPU's table).
    pub time_scale: f64,
    /// Blocks of pending writes at the start.
    pub pending_write_blocks: u64,
}

#[derive(Clone, Debug, serde::Serialize)]
pub struct ReplayResult {
    pub policy: Policy,
    pub compute_us: f64,
    pub total_us: f64,
    pub bubble_us: f64,
    pub layer_bubble_us: Vec<f64>,
    /// Prefix bytes / time until the last layer was in memory.
    pub read_gib_s: f64,
    /// Time until every pending write was durable.
    pub writes_done_us: f64,
    /// Stores issued while a load was in flight.
    pub writes_during_reads: u64,
}

pub struct ReplayRig {
    tier: Option<Tier>,
    /// The rig's pool file: created new, removed when the rig is dropped.
    _pool_file: ScratchFile,
    prefix: Vec<Key>,
    prefix_mem: Vec<u32>,
    write_mem: Vec<u32>,
    next_write_key: u64,
    plan: ReplayPlan,
}

const GIB: f64 = (1u64 << 30) as f64;

impl ReplayRig {
    /// Create a pool under `dir` and store the prefix (untimed).
    pub fn new(dir: &std::path::Path, plan: ReplayPlan, tier_cfg: TierConfig) -> Result<ReplayRig> {
        let g = plan.geometry;
        if plan.layer_compute_us.len() != g.layers as usize {
            return Err(Error::invalid(format!(
                "replay plan has {} layer times for a {}-layer model",
                plan.layer_compute_us.len(),
                g.layers
            )));
        }
        let prefix_blocks = g.tokens_to_blocks(plan.prefix_tokens);
        if prefix_blocks == 0 {
            return Err(Error::invalid(
                "--prefix must be at least one block of tokens",
            ));
        }
        let writes = plan.pending_write_blocks;
        let too_big = || {
            Error::invalid(format!(
                "a replay of {} prefix blocks with {writes} blocks of pending writes is too large; give a smaller --prefix, --input or --pending-writes",
                prefix_blocks
            ))
        };
        let mem_blocks = prefix_blocks
            .checked_add(writes)
            .and_then(|n| u32::try_from(n).ok())
            .ok_or_else(too_big)?;
        crate::cli::check_host_memory(
            (mem_blocks as u64).saturating_mul(g.block_bytes()),
            &format!(
                "replaying {prefix_blocks} prefix blocks and {writes} blocks of pending writes"
            ),
            "give a smaller --prefix, --input or --pending-writes",
        )?;
        let group = 64u32;
        let groups = writes
            .checked_mul(4)
            .and_then(|w| w.checked_add(prefix_blocks))
            .map(|b| b.div_ceil(group as u64) + 2)
            .ok_or_else(too_big)?;
        let size = groups
            .checked_mul(kvtier::pool::layout::PoolLayout::group_bytes_for(&g, group))
            .and_then(|b| b.checked_add(kvtier::pool::layout::DATA_OFFSET))
            .ok_or_else(too_big)?;
        crate::cli::make_dir(dir)?;
        // Created new, never forced: a file or symlink already at this name
        // is refused rather than formatted.
        let pool_file = ScratchFile::create_new(&dir.join("replay.pool"), "kvtier replay")?;
        // Formatted and served through the descriptor created here, never
        // reopened by name.
        let pool = Pool::create_in_files(
            &PoolConfig::new(g, "replay", "replay").with_group_blocks(group),
            vec![pool_file.descriptor()?],
            size,
            &mut |_, _| {},
        )?;
        crate::bench::check_scratch_pool(&pool, std::slice::from_ref(&pool_file))?;
        let mut tier = Tier::open(pool, tier_cfg)?;
        let cache = Arc::new(HostKvCache::new(g, mem_blocks, HostLayout::PerLayer)?);
        tier.register_host_cache(cache.clone())?;
        let prefix: Vec<Key> = (0..prefix_blocks)
            .map(|b| Key::from_u64(1 << 40 | b))
            .collect();
        let prefix_mem: Vec<u32> = (0..prefix_blocks as u32).collect();
        for &b in &prefix_mem {
            cache.fill_block(b, b as u64);
        }
        for (k, m) in prefix.chunks(4096).zip(prefix_mem.chunks(4096)) {
            let job = tier.submit_store(k, m)?;
            let r = tier.wait(job)?;
            if !r.all_ok() {
                return Err(Error::invalid("storing the replay prefix failed"));
            }
        }
        let write_mem = (prefix_blocks as u32..mem_blocks).collect();
        Ok(ReplayRig {
            tier: Some(tier),
            _pool_file: pool_file,
            prefix,
            prefix_mem,
            write_mem,
            next_write_key: 2 << 40,
            plan,
        })
    }

    pub fn set_time_scale(&mut self, scale: f64) {
        self.plan.time_scale = scale;
    }

    /// Replay the prefill (and the decode steps that drain writes) once.
    pub fn run(&mut self, policy: Policy, with_writes: bool) -> Result<ReplayResult> {
        let plan = self.plan.clone();
        let g = plan.geometry;
        let tier = self.tier.take().expect("rig tier");
        let mut sched = Scheduler::new(tier, policy, u64::MAX);
        let scale = plan.time_scale;
        let layer_us: Vec<f64> = plan.layer_compute_us.iter().map(|u| u * scale).collect();
        let result = (|| -> Result<ReplayResult> {
            // The pending writes: fresh keys each run, so each run writes.
            let mut write_keys = Vec::new();
            if with_writes {
                for _ in 0..plan.pending_write_blocks {
                    write_keys.push(Key::from_u64(self.next_write_key));
                    self.next_write_key += 1;
                }
            }
            let t0 = Instant::now();
            for (k, m) in write_keys.chunks(256).zip(self.write_mem.chunks(256)) {
                sched.submit_store(k, m)?;
            }
            let mut load = None;
            if policy != Policy::Sync {
                load = Some(sched.submit_load(&self.prefix, &self.prefix_mem, 0..g.layers)?);
            }
            let mut bubbles = Vec::with_capacity(g.layers as usize);
            let mut reads_done = Duration::ZERO;
            for l in 0..g.layers {
                let w = Instant::now();
                match load {
                    Some(job) => sched.tier_mut().wait_layer(job, l)?,
                    None => {
                        let job = sched.submit_load(&self.prefix, &self.prefix_mem, l..l + 1)?;
                        sched.tier_mut().wait(job)?;
                    }
                }
                bubbles.push(w.elapsed().as_secs_f64() * 1e6);
                if l == g.layers - 1 {
                    reads_done = t0.elapsed();
                }
                sched.release_writes(Window {
                    write_iocbs: plan.layer_write_iocbs[l as usize],
                })?;
                spin(&mut sched, layer_us[l as usize])?;
            }
            if let Some(job) = load {
                sched.tier_mut().wait(job)?;
            }
            let prefill = t0.elapsed();
            // Decode steps drain what is still deferred.
            match policy {
                Policy::Sync => sched.flush_writes()?,
                _ => {
                    let mut steps = 0;
                    while sched.backlog_blocks() > 0 {
                        sched.release_writes(Window {
                            write_iocbs: plan.decode_write_iocbs.max(1),
                        })?;
                        spin(&mut sched, plan.decode_step_us * scale)?;
                        steps += 1;
                        if steps > 100_000 {
                            sched.flush_writes()?;
                        }
                    }
                }
            }
            for (_, r) in sched.wait_stores()? {
                if !r.all_ok() {
                    return Err(Error::invalid("a replay store failed"));
                }
            }
            let writes_done = t0.elapsed();
            let prefix_bytes = self.prefix.len() as f64 * g.block_bytes() as f64;
            Ok(ReplayResult {
                policy,
                compute_us: layer_us.iter().sum(),
                total_us: prefill.as_secs_f64() * 1e6,
                bubble_us: bubbles.iter().sum(),
                layer_bubble_us: bubbles,
                read_gib_s: prefix_bytes / GIB / reads_done.as_secs_f64(),
                writes_done_us: writes_done.as_secs_f64() * 1e6,
                writes_during_reads: sched.released_during_reads,
            })
        })();
        let mut tier = sched.into_tier()?;
        // Leave the pool as the next run expects: the pending writes are
        // evicted by later runs' stores; nothing else changes.
        let _ = tier.drain();
        self.tier = Some(tier);
        result
    }
}

/// "Compute" for `us` microseconds, polling the tier so the I/O it has
/// queued keeps flowing, the way a GPU computes while the SSD works.
fn spin(sched: &mut Scheduler, us: f64) -> Result<()> {
    let span = Duration::try_from_secs_f64(us.max(0.0) * 1e-6)
        .ok()
        .filter(|d| d.as_secs() < 86_400)
        .ok_or_else(|| {
            Error::invalid(format!(
                "a compute time of {us:e} us is too long to replay; give a smaller --time-scale or --layer-us"
            ))
        })?;
    let end = Instant::now() + span;
    loop {
        sched.tier_mut().poll()?;
        let now = Instant::now();
        if now >= end {
            return Ok(());
        }
        std::thread::sleep((end - now).min(Duration::from_micros(50)));
    }
}

/// A replay plan from a slack table: the per-layer compute times and write
/// windows at (input, prefix), the decode step at input+prefix, and the
/// cost of recomputing the whole prefix (input+prefix new tokens, no cache).
pub fn plan_from_table(
    path: &std::path::Path,
    expect: Option<&KvGeometry>,
    input: u64,
    prefix: u64,
) -> Result<(KvGeometry, ReplayPlan)> {
    let table = kvtier::slack::SlackTable::load(path)?;
    if let Some(g) = expect {
        table.check_geometry(g)?;
    }
    let geometry = &table.geometry();
    let layers = geometry.layers;
    let mut compute = Vec::with_capacity(layers as usize);
    let mut writes = Vec::with_capacity(layers as usize);
    let mut recompute = 0.0;
    for l in 0..layers {
        let s = table.layer(input, prefix, l)?;
        compute.push(s.compute_us);
        writes.push(s.write_iocbs);
        recompute += table.layer(input + prefix, 0, l)?.compute_us;
    }
    let d = table.decode(input + prefix);
    Ok((
        *geometry,
        ReplayPlan {
            geometry: *geometry,
            input_tokens: input,
            prefix_tokens: prefix,
            layer_compute_us: compute,
            layer_write_iocbs: writes,
            decode_step_us: d.step_us,
            decode_write_iocbs: d.write_iocbs,
            recompute_us: recompute,
            time_scale: 1.0,
            pending_write_blocks: 0,
        },
    ))
}
