//! Crash consistency through the front door the serving engines use: a child
//! process drives a `TierHandle` with the default scheduling policy (stores
//! wait in the write backlog while a load is in flight), several stores and
//! a load outstanding at once, and now and then closes or drops the handle
//! and opens a new one on the same files. It prints a job's keys only once
//! the job's own result says they are stored. The parent SIGKILLs it at a
//! random moment (during open, with stores deferred behind a load, during
//! eviction on a small pool, inside `close` or `Drop`), reopens the pool and
//! requires: the pool checks clean, every live key loads exactly its bytes,
//! and every acknowledged key that eviction cannot have taken is there.
//!
//! Iterations: 16 per test by default, `KVTIER_CRASH_ITERS` overrides.

mod common;

use common::*;
use kvtier::error::ErrorKind;
use kvtier::handle::{TierBuilder, TierHandle};
use kvtier::pool::{Key, OpenExpect, Pool};
use kvtier::tier::{JobKind, JobResult, KeyOutcome, Tier, TierConfig};
use kvtier::{HostKvCache, HostLayout};
use std::collections::{HashSet, VecDeque};
use std::io::{BufRead, BufReader, Write};
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

const ENV: &str = "KVTIER_HANDLE_CRASH_CHILD";
const PER_JOB: u64 = 8;
/// Stores outstanding at once (each reads its own 8 memory blocks).
const STORE_SLOTS: u64 = 4;
/// Memory blocks 0..8 are the load target; stores read from 8.. .
const LOAD_BLOCKS: u32 = PER_JOB as u32;

// ---------------------------------------------------------------------------
// The child

/// The child's entry point when this binary is re-run with [`ENV`] set:
/// `START;SEED;DEV[;DEV...]`.
#[test]
fn handle_crash_child() {
    let Ok(spec) = std::env::var(ENV) else {
        return;
    };
    let mut f = spec.split(';');
    let start: u64 = f.next().unwrap().parse().unwrap();
    let seed: u64 = f.next().unwrap().parse().unwrap();
    let devs: Vec<PathBuf> = f.map(PathBuf::from).collect();
    if let Err(e) = child(&devs, start, seed) {
        println!("ERROR {e}");
        std::process::exit(1);
    }
}

fn open_handle(devs: &[PathBuf], cache: &Arc<HostKvCache>) -> kvtier::Result<TierHandle> {
    TierBuilder::default()
        .files(devs.iter().cloned())
        .host_cache(cache.clone())
        .build()
}

struct Child {
    out: std::io::StdoutLock<'static>,
    /// Store jobs outstanding: (job, first key, buffer slot).
    stores: VecDeque<(u64, u64, u64)>,
    free_slots: Vec<u64>,
    load: Option<(u64, Vec<u64>)>,
    last_acked: Option<u64>,
}

impl Child {
    fn say(&mut self, line: &str) {
        let _ = writeln!(self.out, "{line}");
        let _ = self.out.flush();
    }

    /// Account one collected result: acknowledge stored keys, check loaded
    /// bytes, free the memory the job used.
    fn settle(&mut self, r: JobResult, cache: &HostKvCache) {
        match r.kind {
            JobKind::Store => {
                let Some(pos) = self.stores.iter().position(|s| s.0 == r.job) else {
                    self.say(&format!("BAD unknown store job {}", r.job));
                    return;
                };
                let (_, first, slot) = self.stores.remove(pos).unwrap();
                self.free_slots.push(slot);
                let mut line = String::from("ACK");
                for (k, o) in r.keys.iter().zip(&r.outcomes) {
                    if matches!(o, KeyOutcome::Done | KeyOutcome::AlreadyStored) {
                        line += &format!(" {}", key_u64(k));
                    }
                }
                if r.all_ok() {
                    self.last_acked = Some(first);
                }
                self.say(&line);
            }
            JobKind::Load => {
                let Some((job, keys)) = self.load.take() else {
                    self.say("BAD a load finished that was not submitted");
                    return;
                };
                assert_eq!(job, r.job);
                let layers = 0..tiny_geometry().layers;
                for (i, (k, o)) in keys.iter().zip(&r.outcomes).enumerate() {
                    if matches!(o, KeyOutcome::Done)
                        && !cache.block_matches(i as u32, seed_of(*k), layers.clone())
                    {
                        self.say(&format!("BAD key {k} loaded bytes that differ"));
                    }
                }
            }
        }
    }
}

fn key_u64(k: &Key) -> u64 {
    u64::from_le_bytes(k.as_bytes()[..8].try_into().unwrap())
}

fn child(devs: &[PathBuf], start: u64, seed: u64) -> kvtier::Result<()> {
    let mut rng = Rng(seed | 1);
    let probe = Pool::open_read_only(devs, &OpenExpect::default())?;
    let geo = *probe.geometry();
    drop(probe);
    let blocks = LOAD_BLOCKS + (STORE_SLOTS * PER_JOB) as u32;
    let cache = Arc::new(HostKvCache::new(geo, blocks, HostLayout::PerLayer)?);
    let mut c = Child {
        out: std::io::stdout().lock(),
        stores: VecDeque::new(),
        free_slots: (0..STORE_SLOTS).collect(),
        load: None,
        last_acked: None,
    };
    let mut h = open_handle(devs, &cache)?;
    c.say("READY");
    let mut next = start;
    let mut steps_to_cycle = 8 + rng.below(40);
    loop {
        for r in h.get_finished() {
            c.settle(r, &cache);
        }
        // A load of the newest acknowledged job: stores submitted while it
        // runs wait in the backlog behind it.
        if c.load.is_none() && rng.chance(700) {
            if let Some(first) = c.last_acked {
                let ks: Vec<u64> = (first..first + PER_JOB).collect();
                let keys: Vec<Key> = ks.iter().map(|&k| Key::from_u64(k)).collect();
                let n = h.lookup_and_pin(&keys);
                if n == keys.len() {
                    let mem: Vec<u32> = (0..PER_JOB as u32).collect();
                    let id = h.submit_load(&keys, &mem, 0..geo.layers)?;
                    c.load = Some((id, ks));
                    c.say("LOAD");
                }
                h.unpin(&keys[..n]);
            }
        }
        if let Some(slot) = c.free_slots.pop() {
            let base = LOAD_BLOCKS + (slot * PER_JOB) as u32;
            let mem: Vec<u32> = (base..base + PER_JOB as u32).collect();
            for (i, k) in (next..next + PER_JOB).enumerate() {
                cache.fill_block(base + i as u32, seed_of(k));
            }
            let keys: Vec<Key> = (next..next + PER_JOB).map(Key::from_u64).collect();
            c.say(&format!("SUBMIT {next}"));
            match h.submit_store(&keys, &mem) {
                Ok(id) => {
                    if c.load.is_some() && h.usage()?.deferred_stores > 0 {
                        c.say("DEFERRED");
                    }
                    c.stores.push_back((id, next, slot));
                    next += PER_JOB;
                }
                Err(e) if e.kind() == ErrorKind::Backpressure => c.free_slots.push(slot),
                Err(e) => return Err(e),
            }
        } else {
            let (id, ..) = *c.stores.front().unwrap();
            let r = h.wait(id)?;
            c.settle(r, &cache);
        }
        steps_to_cycle -= 1;
        if steps_to_cycle == 0 {
            steps_to_cycle = 8 + rng.below(40);
            if rng.chance(500) {
                // close issues the backlog and finishes every job; their
                // results stay collectable.
                c.say("CLOSE");
                h.close()?;
                for r in h.get_finished() {
                    c.settle(r, &cache);
                }
                c.say("CLOSED");
            } else {
                // Dropping fails the stores still deferred (never
                // acknowledged) and waits only for I/O in flight.
                c.say("DROP");
                drop(h);
                c.stores.clear();
                c.load = None;
                c.free_slots = (0..STORE_SLOTS).collect();
                c.say("DROPPED");
            }
            if !c.stores.is_empty() || c.load.is_some() {
                c.say("BAD jobs left unfinished after close");
            }
            // Reopening at once must find the pool free.
            h = open_handle(devs, &cache)?;
            c.say("REOPENED");
        }
    }
}

// ---------------------------------------------------------------------------
// The parent

struct Run {
    /// Acknowledged keys.
    acked: Vec<u64>,
    /// The first key of every store submitted, in order.
    submitted: Vec<u64>,
    lines: Vec<String>,
}

fn run_and_kill(devs: &[PathBuf], start: u64, seed: u64, delay: Duration) -> Run {
    let mut spec = format!("{start};{seed}");
    for d in devs {
        spec.push(';');
        spec.push_str(d.to_str().unwrap());
    }
    let mut child = Command::new(std::env::current_exe().unwrap())
        .args(["handle_crash_child", "--exact", "--nocapture"])
        .args(["--test-threads=1"])
        .env(ENV, spec)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let stdout = child.stdout.take().unwrap();
    let (ready_tx, ready) = std::sync::mpsc::channel::<()>();
    let reader = std::thread::spawn(move || {
        let mut lines = Vec::new();
        for l in BufReader::new(stdout).lines().map_while(|l| l.ok()) {
            // The harness prints "test handle_crash_child ... " before it.
            if l.ends_with("READY") {
                let _ = ready_tx.send(());
            }
            lines.push(l);
        }
        lines
    });
    if ready.recv_timeout(Duration::from_secs(60)).is_err() {
        let _ = child.kill();
        let _ = child.wait();
        let mut err = String::new();
        use std::io::Read;
        let _ = child.stderr.take().unwrap().read_to_string(&mut err);
        let lines = reader.join().unwrap();
        panic!(
            "the handle child never became ready: {:?} {err}",
            &lines[lines.len().saturating_sub(12)..]
        );
    }
    let t0 = Instant::now();
    while t0.elapsed() < delay {
        if let Ok(Some(status)) = child.try_wait() {
            let lines = reader.join().unwrap();
            let mut err = String::new();
            use std::io::Read;
            let _ = child.stderr.take().unwrap().read_to_string(&mut err);
            panic!(
                "the handle child exited on its own ({status}): {:?} {err}",
                &lines[lines.len().saturating_sub(12)..]
            );
        }
        std::thread::sleep(Duration::from_millis(1));
    }
    child.kill().unwrap();
    child.wait().unwrap();
    let lines = reader.join().unwrap();
    let bad: Vec<&String> = lines
        .iter()
        .filter(|l| l.starts_with("BAD") || l.starts_with("ERROR"))
        .collect();
    assert!(bad.is_empty(), "the child saw: {bad:?}");
    let acked = lines
        .iter()
        .filter_map(|l| l.strip_prefix("ACK"))
        .flat_map(|l| l.split_whitespace().map(|k| k.parse::<u64>().unwrap()))
        .collect();
    let submitted = lines
        .iter()
        .filter_map(|l| l.strip_prefix("SUBMIT "))
        .map(|k| k.parse().unwrap())
        .collect();
    Run {
        acked,
        submitted,
        lines,
    }
}

/// Reopen, check, require `must`, load the live keys `load_these` accepts
/// and compare their bytes.
fn verify(
    devs: &[PathBuf],
    must: &[u64],
    it: usize,
    run: &Run,
    load_these: impl Fn(u64) -> bool,
) -> u64 {
    let pool = Pool::open(devs, &OpenExpect::default())
        .unwrap_or_else(|e| panic!("iteration {it}: the pool does not reopen: {e}"));
    let report = pool.check(|_, _| {}).unwrap();
    assert!(report.is_clean(), "iteration {it}: pool check: {report:?}");
    let geo = *pool.geometry();
    let live: Vec<u64> = pool.index().entries().map(|(k, _)| key_u64(k)).collect();
    let total = live.len() as u64;
    let live_set: HashSet<u64> = live.iter().copied().collect();
    let live: Vec<u64> = live.into_iter().filter(|&k| load_these(k)).collect();
    for k in must {
        assert!(
            live_set.contains(k),
            "iteration {it}: key {k} was acknowledged as stored but is lost; the child's last lines: {:?}",
            &run.lines[run.lines.len().saturating_sub(12)..]
        );
    }
    let mut tier = Tier::open(pool, TierConfig::default()).unwrap();
    let cache = Arc::new(HostKvCache::new(geo, 64, HostLayout::PerLayer).unwrap());
    tier.register_host_cache(cache.clone()).unwrap();
    for chunk in live.chunks(64) {
        cache.clear();
        let ks: Vec<Key> = chunk.iter().map(|&k| Key::from_u64(k)).collect();
        let mem: Vec<u32> = (0..chunk.len() as u32).collect();
        let job = tier.submit_load(&ks, &mem, 0..geo.layers).unwrap();
        let r = tier.wait(job).unwrap();
        for (i, &k) in chunk.iter().enumerate() {
            assert!(
                matches!(r.outcomes[i], KeyOutcome::Done)
                    && cache.block_matches(i as u32, seed_of(k), 0..geo.layers),
                "iteration {it}: key {k} did not load its bytes: {:?}",
                r.outcomes[i]
            );
        }
    }
    total
}

/// 5-400 ms after the child is ready: inside the first jobs, mid-stream,
/// inside a close / drop / reopen cycle.
fn delay(rng: &mut Rng) -> Duration {
    Duration::from_millis(5 + rng.below(400))
}

#[test]
fn sigkill_through_the_handle_loses_nothing_acknowledged() {
    let iters = crash_iterations(16);
    let mut rng = Rng(0x5DEE_CE66_D1CE_4E5B);
    let geo = tiny_geometry();
    // No eviction: 2 devices x 512 groups x 8 blocks.
    let dir = TempDir::new("handle-crash");
    let devs: Vec<PathBuf> = (0..2).map(|i| dir.file(&format!("ssd{i}.pool"))).collect();
    let fresh_pool = || {
        let mut cfg = pool_config(geo, 8, &devs, 512);
        cfg.force = true;
        Pool::create(&cfg).unwrap().index().total_slots()
    };
    let slots = fresh_pool();
    let mut acked: Vec<u64> = Vec::new();
    let (mut loads, mut deferred, mut total_acked) = (0, 0, 0);
    for i in 0..iters {
        let run = run_and_kill(&devs, (i as u64 + 1) << 32, rng.next(), delay(&mut rng));
        acked.extend(&run.acked);
        total_acked += run.acked.len();
        loads += run.lines.iter().filter(|l| *l == "LOAD").count();
        deferred += run.lines.iter().filter(|l| *l == "DEFERRED").count();
        // This run's keys each time, every key at the end.
        let last = i + 1 == iters;
        let live = verify(&devs, &acked, i, &run, |k| last || k >> 32 == i as u64 + 1);
        // Nothing may have been evicted (acknowledged or not, every key
        // stored takes a slot): start a fresh pool long before it fills.
        assert!(live < slots, "the pool filled up; grow it");
        if live > slots / 2 {
            fresh_pool();
            acked.clear();
        }
    }
    eprintln!(
        "{iters} kills, {total_acked} keys acknowledged, {loads} loads, {deferred} stores seen deferred behind one"
    );
    assert!(total_acked > 0 && loads > 0 && deferred > 0);
}

#[test]
fn sigkill_through_the_handle_while_evicting_keeps_the_newest() {
    let iters = crash_iterations(16);
    let mut rng = Rng(0x2545_F491_4F6C_DD1D);
    let geo = tiny_geometry();
    // 2 devices x 8 groups x 8 blocks = 128 slots: every run evicts.
    let dir = TempDir::new("handle-crash-small");
    let pool = create_pool(&dir, geo, 8, 2, 8);
    let devs = pool.paths();
    let cap = pool.index().total_slots();
    drop(pool);
    let mut evicting = 0;
    for i in 0..iters {
        let run = run_and_kill(&devs, (i as u64 + 1) << 32, rng.next(), delay(&mut rng));
        // Newer than a job's keys in LRU order, at the kill: at most one
        // store and one load (8 keys each) per store submitted after it. So
        // the jobs among the last `window` submitted cannot have been
        // evicted.
        let window = (cap / (2 * PER_JOB)).saturating_sub(2) as usize;
        let recent: HashSet<u64> = run.submitted.iter().rev().take(window).copied().collect();
        let acked: HashSet<u64> = run.acked.iter().copied().collect();
        let must: Vec<u64> = recent
            .iter()
            .flat_map(|&first| first..first + PER_JOB)
            .filter(|k| acked.contains(k))
            .collect();
        evicting += (run.submitted.len() as u64 * PER_JOB > cap) as usize;
        verify(&devs, &must, i, &run, |_| true);
    }
    eprintln!("{iters} kills, {evicting} in runs that evicted");
}
