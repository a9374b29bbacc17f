//! Power-loss consistency: the tier on a simulated SSD with a volatile write
//! cache, cut off at hundreds of points in the middle of storing.
//!
//! `tests/crash.rs` SIGKILLs a writer process, but writes the kernel already
//! accepted still land after SIGKILL, so it cannot see a missing flush or a
//! wrong write order. Here every write sits in a device cache until a FLUSH
//! makes it durable; at the power failure a random subset of the cached 4 KiB
//! sectors reaches the media (in any order, so a multi-sector write may be
//! torn) and the rest is lost. Then the pool is reopened and held to the same
//! checks as after a SIGKILL: it opens, `check` is clean, every key that was
//! acknowledged and still resident survives, and no live key returns bytes
//! other than the ones stored for it.
//!
//! Iterations: 240 by default (`KVTIER_POWER_ITERS` overrides), all on one
//! 32-slot pool that is evicted and reused by nearly every job, so reused
//! slots' old headers (the invalidation step) and headers left by failed
//! stores are exercised across reopenings.

mod common;

use common::fault::{gather_extents, scatter_extents};
use common::*;
use kvtier::engine::{EngineStats, IoEngine};
use kvtier::p2p::P2pTable;
use kvtier::ring::abi::*;
use kvtier::ring::{GioRing, IocbId};
use kvtier::tier::{KeyOutcome, Tier, TierConfig};
use kvtier::{HostKvCache, HostLayout, Key, KvGeometry, OpenExpect, Pool};
use std::collections::{BTreeMap, HashSet};
use std::fs::{File, OpenOptions};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Instant;

/// The device's write-cache granule and atomic write unit.
const SECTOR: u64 = 4096;

/// Keys per store job, at most.
const MAX_JOB: u64 = 8;

/// What the test controls and observes of the simulated device's power.
#[derive(Default)]
struct PowerState {
    /// I/Os the device still executes before the power fails; `None`: never.
    budget: Option<u64>,
    /// The power has failed: the device is gone and fails every I/O.
    failed: bool,
    /// Cached sectors that reached the media at the failure, and that were lost.
    persisted: u64,
    lost: u64,
}

/// The test's handle on the power: shared with the [`SimDevice`] it drives.
#[derive(Clone)]
struct PowerSwitch(Arc<Mutex<PowerState>>);

impl PowerSwitch {
    /// Power that fails after `ios` more I/Os have executed.
    fn failing_after(ios: u64) -> PowerSwitch {
        PowerSwitch(Arc::new(Mutex::new(PowerState {
            budget: Some(ios),
            ..PowerState::default()
        })))
    }
    fn failed(&self) -> bool {
        self.0.lock().unwrap().failed
    }
    /// (persisted, lost) cached sectors at the failure.
    fn sectors(&self) -> (u64, u64) {
        let s = self.0.lock().unwrap();
        (s.persisted, s.lost)
    }
}

/// A cached sector's versions, oldest first: (write sequence number, bytes).
type Versions = Vec<(u64, Box<[u8]>)>;

/// One IOCTX the device accepted and has not yet executed.
struct Queued {
    iocb: IocbId,
    ctx: u32,
    io: IoCtx,
    /// A FLUSH: the writes it makes durable are those executed before it
    /// was accepted (sequence numbers below this), not later ones.
    covers_below: u64,
    /// Reaps it stays in the queue before it executes (in flight meanwhile,
    /// while I/O accepted later may execute and complete).
    hold: u64,
    /// The IOCTX's P2P-table indices, or `None` when its segment range lies
    /// outside the IOCB.
    segs: Option<Vec<u32>>,
}

/// A TEST DOUBLE OF HARDWARE, not an engine for real use: a simulated SSD per
/// pool device with a volatile write cache, executing IOCBs synchronously
/// against the pool's backing files (opened here without O_DIRECT).
///
/// - WRITE puts its 4 KiB sectors into the device's cache, not the file. A
///   sector written twice keeps both versions in order: the media may have
///   taken the first before the second arrived.
/// - READ reads the file overlaid with the cache (a device reads its writes).
/// - FLUSH writes to the file what was in the device's cache when the
///   flush was accepted (the writes that had completed then), not writes
///   executed after that, then completes.
/// - IOCTXs accepted by one `submit` execute in a random order at one of
///   the next few `reap`s (a flush at one of the next four), as a device
///   with a deep queue may: an I/O stays in flight while I/O accepted after
///   it executes and completes.
/// - When the [`PowerSwitch`] budget runs out, the power fails: of every
///   cached sector a random prefix of its versions reaches the file (none,
///   some or all of them; any subset of the sectors of one write, so writes
///   tear), the rest is lost, and from then on every IOCTX completes with
///   `IOCTX_STATUS_ERRNO` / EIO, so the tier's jobs fail instead of hanging.
struct SimDevice {
    files: Vec<File>,
    sizes: Vec<u64>,
    /// Per device: sector offset -> versions written and not yet flushed,
    /// oldest first, each with its write's sequence number.
    cache: Vec<BTreeMap<u64, Versions>>,
    /// Sequence number of the next write executed.
    write_seq: u64,
    table: Option<Arc<P2pTable>>,
    queue: Vec<Queued>,
    power: PowerSwitch,
    rng: Rng,
    stats: EngineStats,
}

impl SimDevice {
    /// Open the pool's backing files, in device order.
    fn open(paths: &[PathBuf], power: PowerSwitch, seed: u64) -> SimDevice {
        let files: Vec<File> = paths
            .iter()
            .map(|p| {
                OpenOptions::new()
                    .read(true)
                    .write(true)
                    .open(p)
                    .unwrap_or_else(|e| panic!("open {}: {e}", p.display()))
            })
            .collect();
        let sizes = files.iter().map(|f| f.metadata().unwrap().len()).collect();
        SimDevice {
            cache: files.iter().map(|_| BTreeMap::new()).collect(),
            write_seq: 0,
            files,
            sizes,
            table: None,
            queue: Vec::new(),
            power,
            rng: Rng(seed | 1),
            stats: EngineStats::default(),
        }
    }

    /// The power fails now: persist a random part of every cache, drop the rest.
    fn power_fail(&mut self, power: &mut PowerState) {
        // Per failure, how likely a cached sector is to have reached the media:
        // none, a quarter, half, three quarters, or all of them.
        let keep_in_4 = self.rng.below(5);
        for (dev, cache) in self.cache.iter_mut().enumerate() {
            for (sector, versions) in std::mem::take(cache) {
                let n = versions.len() as u64;
                let kept = if self.rng.below(4) < keep_in_4 {
                    // Reached the media: all versions, or (rewritten sectors)
                    // any number of the oldest ones.
                    if n > 1 && self.rng.below(2) == 0 {
                        self.rng.below(n + 1)
                    } else {
                        n
                    }
                } else {
                    0
                };
                for (_, v) in &versions[..kept as usize] {
                    self.files[dev]
                        .write_all_at(v, sector)
                        .expect("write to the backing file");
                }
                if kept == n {
                    power.persisted += 1;
                } else {
                    power.lost += 1;
                }
            }
        }
        power.failed = true;
        power.budget = None;
    }

    /// The memory extents of an IOCTX: (host address, length) per segment.
    /// `None` when a segment is unknown or the lengths disagree with `len`.
    fn extents(&self, q: &Queued) -> Option<Vec<(u64, usize)>> {
        let table = self.table.as_ref()?;
        let mut out = Vec::new();
        let mut total = 0u64;
        for &i in q.segs.as_ref()? {
            let d = table.entry(i)?;
            out.push((d.addr, d.len as usize));
            total += d.len as u64;
        }
        (total == q.io.len as u64).then_some(out)
    }

    /// A data I/O's extent is whole sectors inside the device.
    fn in_bounds(&self, io: &IoCtx) -> bool {
        (io.dev as usize) < self.files.len()
            && io.len > 0
            && io.dev_offset % SECTOR == 0
            && io.len as u64 % SECTOR == 0
            && io.dev_offset + io.len as u64 <= self.sizes[io.dev as usize]
    }

    /// Execute one IOCTX: (status, result).
    fn execute(&mut self, q: &Queued) -> (u16, u32) {
        let eio = (IOCTX_STATUS_ERRNO, libc::EIO as u32);
        {
            let power = self.power.clone();
            let mut p = power.0.lock().unwrap();
            if p.failed {
                return eio;
            }
            match p.budget {
                Some(0) => {
                    self.power_fail(&mut p);
                    return eio;
                }
                Some(ref mut n) => *n -= 1,
                None => {}
            }
        }
        let io = q.io;
        let dev = io.dev as usize;
        match io.op {
            IOCTX_OP_FLUSH => {
                if dev >= self.files.len() {
                    return (IOCTX_STATUS_INVALID, 0);
                }
                // What had executed when the flush was accepted reaches the
                // media; later versions stay cached.
                let below = q.covers_below;
                let cache = &mut self.cache[dev];
                for (&sector, versions) in cache.iter_mut() {
                    let n = versions.iter().take_while(|(seq, _)| *seq < below).count();
                    if n > 0 {
                        self.files[dev]
                            .write_all_at(&versions[n - 1].1, sector)
                            .expect("write to the backing file");
                        versions.drain(..n);
                    }
                }
                cache.retain(|_, v| !v.is_empty());
                self.stats.flushes += 1;
                (IOCTX_STATUS_OK, 0)
            }
            IOCTX_OP_WRITE => {
                let Some(extents) = self.extents(q).filter(|_| self.in_bounds(&io)) else {
                    return (IOCTX_STATUS_INVALID, 0);
                };
                // SAFETY: the descriptors are from the P2P table the tier
                // registered; register_memory's contract keeps that host
                // memory allocated while a job that reads it is in flight, and
                // `extents` checked that their lengths sum to `io.len`.
                let buf = unsafe { gather_extents(&extents, io.len as usize) };
                let seq = self.write_seq;
                self.write_seq += 1;
                for (i, sector) in buf.chunks(SECTOR as usize).enumerate() {
                    self.cache[dev]
                        .entry(io.dev_offset + i as u64 * SECTOR)
                        .or_default()
                        .push((seq, sector.into()));
                }
                self.stats.bytes_written += io.len as u64;
                (IOCTX_STATUS_OK, io.len)
            }
            IOCTX_OP_READ => {
                let Some(extents) = self.extents(q).filter(|_| self.in_bounds(&io)) else {
                    return (IOCTX_STATUS_INVALID, 0);
                };
                let mut buf = vec![0u8; io.len as usize];
                self.files[dev]
                    .read_exact_at(&mut buf, io.dev_offset)
                    .expect("read the backing file");
                let end = io.dev_offset + io.len as u64;
                for (&sector, versions) in self.cache[dev].range(io.dev_offset..end) {
                    let at = (sector - io.dev_offset) as usize;
                    buf[at..at + SECTOR as usize].copy_from_slice(
                        &versions.last().expect("a cached sector has a version").1,
                    );
                }
                // SAFETY: as for writes, the registered memory outlives the
                // job that loads into it, and the tier hands a load's target
                // memory to no other I/O while it is in flight.
                unsafe { scatter_extents(&buf, &extents) };
                self.stats.bytes_read += io.len as u64;
                (IOCTX_STATUS_OK, io.len)
            }
            _ => (IOCTX_STATUS_INVALID, 0),
        }
    }
}

impl IoEngine for SimDevice {
    fn name(&self) -> &'static str {
        "sim-volatile-cache"
    }

    fn register_memory(&mut self, table: Arc<P2pTable>) -> kvtier::Result<()> {
        assert!(self.queue.is_empty(), "register_memory with I/O in flight");
        self.table = Some(table);
        Ok(())
    }

    fn submit(&mut self, ring: &mut GioRing) -> kvtier::Result<()> {
        while let Some(id) = ring.pop_sq() {
            self.stats.iocbs += 1;
            let b = ring.iocb(id);
            if b.hdr.count == 0 {
                ring.finish(id);
                continue;
            }
            for c in 0..b.hdr.count {
                let io = b.ctx[c as usize];
                let first = io.seg_first as usize;
                let segs = b
                    .segs
                    .get(first..first + io.seg_count as usize)
                    .map(<[u32]>::to_vec);
                self.queue.push(Queued {
                    iocb: id,
                    ctx: c,
                    io,
                    covers_below: self.write_seq,
                    hold: if io.op == IOCTX_OP_FLUSH {
                        self.rng.below(4)
                    } else {
                        self.rng.below(3)
                    },
                    segs,
                });
            }
        }
        Ok(())
    }

    fn reap(&mut self, ring: &mut GioRing, _wait: bool) -> kvtier::Result<()> {
        // Everything accepted executes now, in a random order.
        let mut queue = std::mem::take(&mut self.queue);
        for i in (1..queue.len()).rev() {
            let j = self.rng.below(i as u64 + 1) as usize;
            queue.swap(i, j);
        }
        for mut q in queue {
            if q.hold > 0 {
                // Still in flight at this reap.
                q.hold -= 1;
                self.queue.push(q);
                continue;
            }
            let (status, result) = self.execute(&q);
            self.stats.ios += 1;
            if status != IOCTX_STATUS_OK {
                self.stats.errors += 1;
            }
            ring.complete_ctx(q.iocb, q.ctx, status, result);
        }
        Ok(())
    }

    fn in_flight(&self) -> usize {
        self.queue.len()
    }

    fn stats(&self) -> EngineStats {
        self.stats
    }

    fn describe(&self) -> String {
        format!(
            "simulated SSD x{} with a volatile write cache (test double)",
            self.files.len()
        )
    }
}

fn key_u64(k: &Key) -> u64 {
    u64::from_le_bytes(k.as_bytes()[..8].try_into().unwrap())
}

/// The keys the tier's index holds, sorted.
fn resident(tier: &Tier) -> Vec<u64> {
    let mut v: Vec<u64> = tier
        .pool()
        .index()
        .entries()
        .map(|(k, _)| key_u64(k))
        .collect();
    v.sort_unstable();
    v
}

/// Reopen after the power failure, check, and load every live key through
/// the io_uring engine. Returns the live keys.
fn verify_pool(paths: &[PathBuf], must_survive: &[u64], what: &str) -> Vec<u64> {
    let pool = Pool::open(paths, &OpenExpect::default())
        .unwrap_or_else(|e| panic!("{what}: the pool does not reopen: {e}"));
    let report = pool.check(|_, _| {}).unwrap();
    assert!(report.is_clean(), "{what}: pool check: {report:?}");
    let geo = *pool.geometry();
    let mut live: Vec<u64> = pool.index().entries().map(|(k, _)| key_u64(k)).collect();
    live.sort_unstable();
    let live_set: HashSet<u64> = live.iter().copied().collect();
    for k in must_survive {
        assert!(
            live_set.contains(k),
            "{what}: key {k} was acknowledged and resident at the power failure but is lost"
        );
    }
    let cfg = TierConfig::default().with_header_staging(64);
    let mut tier = Tier::open(pool, cfg).unwrap();
    let cache = Arc::new(HostKvCache::new(geo, 16, HostLayout::PerLayer).unwrap());
    tier.register_host_cache(cache.clone()).unwrap();
    for chunk in live.chunks(16) {
        cache.clear();
        let ks: Vec<Key> = chunk.iter().map(|&k| Key::from_u64(k)).collect();
        let mem: Vec<u32> = (0..chunk.len() as u32).collect();
        let job = tier.submit_load(&ks, &mem, 0..geo.layers).unwrap();
        let res = tier.wait(job).unwrap();
        assert!(res.all_ok(), "{what}: load failed: {:?}", res.outcomes);
        for (i, &k) in chunk.iter().enumerate() {
            assert!(
                cache.block_matches(i as u32, seed_of(k), 0..geo.layers),
                "{what}: key {k} returned bytes that differ from what was stored"
            );
        }
    }
    live
}

/// A 32-slot pool (2 devices x 2 groups x 8 blocks) in `KVTIER_TEST_DIR` if
/// set, else on tmpfs (/dev/shm) when it takes one (direct I/O on tmpfs needs
/// Linux 6.6), else in the temp dir. The medium does not matter here (the
/// simulated device is the medium), and on tmpfs the ~50 direct reads per
/// iteration of reopening and checking the pool cost no disk round trip.
fn small_pool(geo: KvGeometry) -> (TempDir, Pool) {
    let shm = Path::new("/dev/shm");
    if std::env::var_os("KVTIER_TEST_DIR").is_none() && shm.is_dir() {
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_nanos();
        let dir = TempDir(shm.join(format!("kvtier-power-loss-{}-{nanos}", std::process::id())));
        if std::fs::create_dir_all(dir.path()).is_ok() {
            let devs = [dir.file("ssd0.pool"), dir.file("ssd1.pool")];
            if let Ok(pool) = Pool::create(&pool_config(geo, 8, &devs, 2)) {
                return (dir, pool);
            }
        }
    }
    let dir = TempDir::new("power-loss");
    let pool = create_pool(&dir, geo, 8, 2, 2);
    (dir, pool)
}

/// The keys of the next store job: new keys, recently stored ones (likely
/// resident: AlreadyStored), old ones (likely evicted: stored again, while
/// their old header may still be on the device), and duplicates within the job.
fn pick_job(rng: &mut Rng, used: &mut Vec<u64>, next_key: &mut u64) -> Vec<u64> {
    let n = 1 + rng.below(MAX_JOB);
    let mut keys: Vec<u64> = Vec::new();
    for _ in 0..n {
        let r = rng.below(100);
        let k = if r < 10 && !keys.is_empty() {
            keys[rng.below(keys.len() as u64) as usize]
        } else if r < 30 && !used.is_empty() {
            let recent = used.len().min(24) as u64;
            used[used.len() - 1 - rng.below(recent) as usize]
        } else if r < 45 && !used.is_empty() {
            used[rng.below(used.len() as u64) as usize]
        } else {
            *next_key += 1;
            used.push(*next_key);
            *next_key
        };
        keys.push(k);
    }
    keys
}

#[test]
fn power_loss_during_stores_loses_nothing_acknowledged() {
    let iters: usize = std::env::var("KVTIER_POWER_ITERS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(240);
    let t0 = Instant::now();
    let mut rng = Rng(0x5DEE_CE66_D1CE_4E5B);
    let geo = tiny_geometry();
    // 2 devices x 2 groups x 8 blocks = 32 slots.
    let (_dir, pool) = small_pool(geo);
    let paths = pool.paths();
    let slots = pool.index().total_slots();
    drop(pool);
    let cache = Arc::new(HostKvCache::new(geo, MAX_JOB as u32, HostLayout::PerLayer).unwrap());

    let mut used: Vec<u64> = Vec::new();
    let mut next_key = 0u64;
    let (mut jobs, mut acked, mut already, mut evicted) = (0u64, 0u64, 0u64, 0u64);
    let (mut partial_failures, mut survivors_checked, mut max_live) = (0u64, 0u64, 0usize);
    for it in 0..iters {
        let budget = rng.below(320);
        let what = format!("iteration {it} (power fails after {budget} I/Os)");
        let power = PowerSwitch::failing_after(budget);
        let pool = Pool::open(&paths, &OpenExpect::default()).unwrap();
        // Keys live at open were verified byte for byte by the previous
        // iteration (or there are none): the tier may hold them as durable.
        let mut known: HashSet<u64> = pool.index().entries().map(|(k, _)| key_u64(k)).collect();
        let engine = SimDevice::open(&pool.paths(), power.clone(), rng.next());
        let mut tier = Tier::with_engine(pool, TierConfig::default(), Box::new(engine)).unwrap();
        tier.register_host_cache(cache.clone()).unwrap();

        // Survival rule. A key must survive the power failure when it is in
        // the tier's index right after `submit_store` of the job during which
        // the power fails returned, or was acknowledged by that job itself.
        // Sound because:
        // - the index holds only keys whose store committed (data and header
        //   flushed, then the job said Done) or that were live at open; we
        //   assert below that it holds nothing else, so these are exactly the
        //   acknowledged keys that have not been evicted;
        // - eviction happens only in `submit_store`'s slot allocation, which
        //   is synchronous: a key still indexed after it returns was not
        //   evicted by the failing job, and one job runs at a time, so no
        //   other job can evict it before the failure;
        // - the failing job writes only into the slots it allocated (free or
        //   evicted ones), never into an indexed key's data or header;
        // - a key the failing job itself reported Done or AlreadyStored was
        //   acknowledged as durable; the tier pins AlreadyStored keys against
        //   the job's own allocation, so they are in the snapshot anyway.
        // Keys evicted earlier (or by the failing job's allocation) may
        // vanish or reappear with their old bytes; since a key's bytes follow
        // from the key, reappearing is fine, and every live key's bytes are
        // checked anyway.
        let must_survive: Vec<u64> = loop {
            let keys = pick_job(&mut rng, &mut used, &mut next_key);
            for (i, &k) in keys.iter().enumerate() {
                cache.fill_block(i as u32, seed_of(k));
            }
            let ks: Vec<Key> = keys.iter().map(|&k| Key::from_u64(k)).collect();
            let mem: Vec<u32> = (0..keys.len() as u32).collect();
            let before = resident(&tier);
            let job = tier
                .submit_store(&ks, &mem)
                .unwrap_or_else(|e| panic!("{what}: submit_store: {e}"));
            let after = resident(&tier);
            let gone: Vec<u64> = before
                .iter()
                .copied()
                .filter(|k| after.binary_search(k).is_err())
                .collect();
            evicted += gone.len() as u64;
            for k in &after {
                assert!(
                    known.contains(k),
                    "{what}: the index holds key {k}, which was never acknowledged"
                );
            }
            let res = tier
                .wait(job)
                .unwrap_or_else(|e| panic!("{what}: wait: {e}"));
            jobs += 1;
            let mut reported: Vec<u64> = res.evicted.iter().map(key_u64).collect();
            reported.sort_unstable();
            assert_eq!(
                reported, gone,
                "{what}: the job's evicted keys are not the ones that left the index"
            );
            let mut ok_keys = Vec::new();
            for (k, o) in keys.iter().zip(&res.outcomes) {
                match o {
                    KeyOutcome::Done => ok_keys.push(*k),
                    KeyOutcome::AlreadyStored => {
                        already += 1;
                        ok_keys.push(*k);
                    }
                    KeyOutcome::Failed(_) | KeyOutcome::Corrupt(_) => {}
                }
            }
            acked += ok_keys.len() as u64;
            known.extend(&ok_keys);
            if res.all_ok() {
                assert!(
                    !power.failed(),
                    "{what}: a store with I/O after the power failure succeeded"
                );
                continue;
            }
            let why: Vec<_> = res.failures().collect();
            assert!(
                power.failed(),
                "{what}: a store failed with the power on: {why:?}"
            );
            let mut must = after;
            must.extend(ok_keys);
            must.sort_unstable();
            must.dedup();
            break must;
        };
        drop(tier);
        let (persisted, lost) = power.sectors();
        partial_failures += (persisted > 0 && lost > 0) as u64;
        survivors_checked += must_survive.len() as u64;
        let live = verify_pool(&paths, &must_survive, &what);
        max_live = max_live.max(live.len());
        assert!(live.len() as u64 <= slots);
    }
    eprintln!(
        "{iters} power failures in {:.1} s: {jobs} store jobs, {acked} keys acknowledged \
         ({already} already stored), {evicted} evictions, {survivors_checked} survivals \
         checked, {partial_failures} failures kept part of the cache, {} distinct keys",
        t0.elapsed().as_secs_f64(),
        used.len()
    );
    // The run must have reached the paths it is here for.
    assert!(evicted > slots * 4, "too few evictions: {evicted}");
    assert!(already > 0, "no store met a key already stored");
    assert!(
        partial_failures as usize >= iters / 10,
        "too few failures left part of the cache on the media: {partial_failures}"
    );
    assert!(max_live as u64 >= slots / 2, "the pool never filled up");
}

/// Group commit under power loss: batches of concurrent store jobs (2 to 6
/// at once, each on its own memory) share their flushes, and the power
/// fails at a random point of a batch. Every key a job of the batch
/// reported Done, and every key resident once the batch was submitted,
/// survives; no key returns other bytes than its own; the pool checks clean.
#[test]
fn power_loss_during_concurrent_stores_loses_nothing_acknowledged() {
    let iters: usize = std::env::var("KVTIER_POWER_ITERS")
        .ok()
        .and_then(|s| s.parse().ok())
        .map_or(160, |n: usize| n * 2 / 3);
    const MAX_JOBS: u64 = 6;
    const MAX_KEYS: u64 = 4;
    let t0 = Instant::now();
    let mut rng = Rng(0x6C0F_FEE5_0DD5_EED5);
    let geo = tiny_geometry();
    let (_dir, pool) = small_pool(geo);
    let paths = pool.paths();
    drop(pool);
    let cache = Arc::new(
        HostKvCache::new(geo, (MAX_JOBS * MAX_KEYS) as u32, HostLayout::PerLayer).unwrap(),
    );
    let mut used: Vec<u64> = Vec::new();
    let mut next_key = 0u64;
    let (mut jobs, mut acked, mut survivors_checked) = (0u64, 0u64, 0u64);
    let (mut flushes, mut flush_steps, mut most_shared) = (0u64, 0u64, 0u64);
    for it in 0..iters {
        let budget = rng.below(400);
        let what = format!("iteration {it} (power fails after {budget} I/Os)");
        let power = PowerSwitch::failing_after(budget);
        let pool = Pool::open(&paths, &OpenExpect::default()).unwrap();
        let mut known: HashSet<u64> = pool.index().entries().map(|(k, _)| key_u64(k)).collect();
        let engine = SimDevice::open(&pool.paths(), power.clone(), rng.next());
        let mut tier = Tier::with_engine(pool, TierConfig::default(), Box::new(engine)).unwrap();
        tier.register_host_cache(cache.clone()).unwrap();
        // Submissions only plan (allocation and eviction happen there, all
        // before any I/O of the batch); the waits below run the batch.
        tier.defer_engine_calls(true);
        // Survival rule: the keys resident once every job of the batch was
        // submitted (no later allocation can evict them; the jobs write only
        // into the slots they allocated), and every key a job of the batch
        // reported Done (committed after the allocations that could evict it).
        let must_survive: Vec<u64> = loop {
            let n = 2 + rng.below(MAX_JOBS - 1);
            let mut batch = Vec::new();
            for j in 0..n {
                let mut keys = pick_job(&mut rng, &mut used, &mut next_key);
                keys.truncate(MAX_KEYS as usize);
                let base = (j * MAX_KEYS) as u32;
                for (i, &k) in keys.iter().enumerate() {
                    cache.fill_block(base + i as u32, seed_of(k));
                }
                let ks: Vec<Key> = keys.iter().map(|&k| Key::from_u64(k)).collect();
                let mem: Vec<u32> = (base..base + keys.len() as u32).collect();
                let job = tier
                    .submit_store(&ks, &mem)
                    .unwrap_or_else(|e| panic!("{what}: submit_store: {e}"));
                batch.push((job, keys));
            }
            let resident_now = resident(&tier);
            for k in &resident_now {
                assert!(
                    known.contains(k),
                    "{what}: the index holds key {k}, which was never acknowledged"
                );
            }
            let (issued0, steps0) = tier.group_flushes();
            let mut done = Vec::new();
            let mut failed = Vec::new();
            for (job, keys) in &batch {
                let res = tier
                    .wait(*job)
                    .unwrap_or_else(|e| panic!("{what}: wait: {e}"));
                jobs += 1;
                for (k, o) in keys.iter().zip(&res.outcomes) {
                    match o {
                        KeyOutcome::Done => done.push(*k),
                        KeyOutcome::AlreadyStored => {}
                        KeyOutcome::Failed(f) | KeyOutcome::Corrupt(f) => failed.push(f.clone()),
                    }
                }
            }
            let (issued1, steps1) = tier.group_flushes();
            flushes += issued1 - issued0;
            flush_steps += steps1 - steps0;
            most_shared = most_shared.max(steps1 - steps0 - (issued1 - issued0));
            acked += done.len() as u64;
            known.extend(&done);
            if failed.is_empty() {
                assert!(
                    !power.failed(),
                    "{what}: a batch with I/O after the power failure succeeded"
                );
                continue;
            }
            assert!(
                power.failed(),
                "{what}: a store failed with the power on: {failed:?}"
            );
            let mut must = resident_now;
            must.extend(done);
            must.sort_unstable();
            must.dedup();
            break must;
        };
        drop(tier);
        survivors_checked += must_survive.len() as u64;
        verify_pool(&paths, &must_survive, &what);
    }
    eprintln!(
        "{iters} power failures in {:.1} s: {jobs} concurrent store jobs, {acked} keys \
         acknowledged, {survivors_checked} survivals checked; {flush_steps} flush steps \
         served by {flushes} group flushes",
        t0.elapsed().as_secs_f64()
    );
    assert!(acked > 0 && survivors_checked > 0);
    // The jobs of a batch did share flushes.
    assert!(
        flush_steps > flushes && most_shared > 0,
        "no flush was shared: {flush_steps} steps, {flushes} flushes"
    );
}
