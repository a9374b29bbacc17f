//! Crash consistency: SIGKILL a process in the middle of storing, at many
//! random points, then reopen the pool. No key acknowledged before the kill
//! may be lost; no key may return bytes other than what was stored.
//!
//! The child is the crash writer (`common::crash`, this test binary re-run on
//! `crash_writer_child`), which stores jobs of 8 blocks
//! and prints "ACK <keys>" once each job is durable. Iterations: 60 by
//! default (KVTIER_CRASH_ITERS overrides), half on a pool large enough that
//! nothing is evicted (every acknowledged key must survive), half on a small
//! pool where slots are evicted and reused on every job (the stale-header
//! path), where the newest acknowledged keys must survive.

mod common;

use common::*;
use kvtier::pool::{Key, OpenExpect, Pool};
use kvtier::tier::{Tier, TierConfig};
use kvtier::{HostKvCache, HostLayout};
use std::collections::HashSet;
use std::io::{BufRead, BufReader};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

const PER_JOB: u64 = 8;

/// The writer's last output lines, printed when an iteration fails.
static LAST_LINES: std::sync::Mutex<Vec<String>> = std::sync::Mutex::new(Vec::new());

/// When a kill's delay starts counting.
#[derive(Clone, Copy)]
enum KillFrom {
    /// Process start: the kill may land during open or registration too.
    Start,
    /// The writer's first acknowledged job: the kill lands mid-stream
    /// however slowly the machine starts the process.
    FirstAck,
}

/// Run the writer, kill it `delay` after `from`, return the keys it
/// acknowledged.
fn run_and_kill(devs: &[PathBuf], start_key: u64, delay: Duration, from: KillFrom) -> Vec<u64> {
    let mut cmd = common::crash::writer_command(devs, start_key, PER_JOB as u32, u64::MAX);
    let mut child = cmd.spawn().expect("spawn the crash writer");
    let stdout = child.stdout.take().unwrap();
    let (first_ack, acked) = std::sync::mpsc::channel::<()>();
    let reader = std::thread::spawn(move || {
        let mut lines = Vec::new();
        for l in BufReader::new(stdout).lines().map_while(|l| l.ok()) {
            if l.starts_with("ACK") && lines.iter().all(|p: &String| !p.starts_with("ACK")) {
                let _ = first_ack.send(());
            }
            lines.push(l);
        }
        lines
    });
    if let KillFrom::FirstAck = from {
        if acked.recv_timeout(Duration::from_secs(60)).is_err() {
            let _ = child.kill();
            panic!("crash-writer acknowledged nothing within 60 s");
        }
    }
    let t0 = Instant::now();
    while t0.elapsed() < delay {
        if let Ok(Some(status)) = child.try_wait() {
            let mut err = String::new();
            use std::io::Read;
            child
                .stderr
                .take()
                .unwrap()
                .read_to_string(&mut err)
                .unwrap();
            panic!("crash-writer exited on its own ({status}): {err}");
        }
        std::thread::sleep(Duration::from_millis(1));
    }
    child.kill().expect("SIGKILL");
    child.wait().unwrap();
    let lines = reader.join().unwrap();
    *LAST_LINES.lock().unwrap() = lines.iter().rev().take(8).rev().cloned().collect();
    lines
        .iter()
        .filter_map(|l| l.strip_prefix("ACK"))
        .flat_map(|l| l.split_whitespace().map(|k| k.parse::<u64>().unwrap()))
        .collect()
}

/// Reopen, check, load every live key and compare its bytes.
fn verify_pool(devs: &[PathBuf], must_have: &[u64], iteration: usize) -> usize {
    let pool = Pool::open(devs, &OpenExpect::default())
        .unwrap_or_else(|e| panic!("iteration {iteration}: pool does not reopen: {e}"));
    assert!(
        pool.damaged_headers().is_empty(),
        "iteration {iteration}: damaged headers after a crash: {:?}",
        pool.damaged_headers()
    );
    let report = pool.check(|_, _| {}).unwrap();
    assert!(
        report.is_clean(),
        "iteration {iteration}: pool check: {report:?}"
    );
    let geo = *pool.geometry();
    let live: Vec<u64> = pool
        .index()
        .entries()
        .map(|(k, _)| u64::from_le_bytes(k.as_bytes()[..8].try_into().unwrap()))
        .collect();
    let live_set: HashSet<u64> = live.iter().copied().collect();
    for k in must_have {
        assert!(
            live_set.contains(k),
            "iteration {iteration}: key {k} was acknowledged as stored but is lost (writer's last lines {:?}; must-have {:?}, live {} keys: {:?})",
            LAST_LINES.lock().unwrap(),
            must_have,
            live.len(),
            { let mut l = live.clone(); l.sort(); l }
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
        assert!(tier.wait(job).unwrap().all_ok());
        for (i, &k) in chunk.iter().enumerate() {
            assert!(
                cache.block_matches(i as u32, seed_of(k), 0..geo.layers),
                "iteration {iteration}: key {k} returned bytes that differ from what was stored"
            );
        }
    }
    live.len()
}

/// Even iterations: 5-125 ms after process start (open, registration or
/// mid-stream); odd ones: 1-40 ms after the first acknowledged job.
fn kill_point(rng: &mut Rng, i: usize) -> (Duration, KillFrom) {
    if i % 2 == 0 {
        (Duration::from_millis(5 + rng.next() % 120), KillFrom::Start)
    } else {
        (
            Duration::from_millis(1 + rng.next() % 40),
            KillFrom::FirstAck,
        )
    }
}

/// The crash writer's entry point when this binary is re-run as the child.
#[test]
fn crash_writer_child() {
    common::crash::child_main()
}

#[test]
fn sigkill_during_stores_loses_nothing_acknowledged() {
    let iters = crash_iterations(60);
    let mut rng = Rng(0x9E37_79B9_7F4A_7C15);
    let geo = tiny_geometry();

    // Phase 1: no eviction. 2 devices x 512 groups x 8 = 8192 slots.
    let dir = TempDir::new("crash-big");
    let pool = create_pool(&dir, geo, 8, 2, 512);
    let big = pool.paths();
    let slots = pool.index().total_slots();
    drop(pool);
    let mut acked: Vec<u64> = Vec::new();
    let mut kills_with_acks = 0;
    for i in 0..iters / 2 {
        let (delay, from) = kill_point(&mut rng, i);
        let got = run_and_kill(&big, (i as u64 + 1) << 32, delay, from);
        kills_with_acks += !got.is_empty() as usize;
        acked.extend(&got);
        assert!(
            (acked.len() as u64) < slots,
            "phase 1 must not evict; grow the pool"
        );
        let live = verify_pool(&big, &acked, i);
        assert!(live >= acked.len());
    }

    // Phase 2: a 32-slot pool, evicting and reusing slots on every job.
    let dir2 = TempDir::new("crash-small");
    let pool = create_pool(&dir2, geo, 8, 2, 2);
    let small = pool.paths();
    let cap = pool.index().total_slots();
    drop(pool);
    // `order` is the LRU order the next writer starts from: every live key
    // by store generation (acknowledged or not: a job killed after its
    // headers landed leaves durable, unacknowledged keys that are newer than
    // the acknowledged ones and take room), then this writer's stores.
    let mut order: Vec<u64> = Vec::new();
    let mut acked_here: HashSet<u64> = HashSet::new();
    for i in iters / 2..iters {
        let (delay, from) = kill_point(&mut rng, i);
        let got = run_and_kill(&small, (i as u64 + 1) << 32, delay, from);
        kills_with_acks += !got.is_empty() as usize;
        acked_here.extend(&got);
        order.extend(&got);
        // At the kill, one job (PER_JOB slots) may have been evicting the
        // oldest keys; the newest cap - PER_JOB are certain to be resident,
        // and of those, the acknowledged ones must be.
        let safe = (cap - PER_JOB) as usize;
        let must: Vec<u64> = order
            .iter()
            .rev()
            .take(safe)
            .filter(|k| acked_here.contains(k))
            .copied()
            .collect();
        verify_pool(&small, &must, i);
        let pool = Pool::open(&small, &OpenExpect::default()).unwrap();
        let mut live: Vec<(u64, u64)> = pool
            .index()
            .entries()
            .map(|(k, e)| {
                (
                    e.generation,
                    u64::from_le_bytes(k.as_bytes()[..8].try_into().unwrap()),
                )
            })
            .collect();
        live.sort();
        order = live.into_iter().map(|(_, k)| k).collect();
    }
    eprintln!(
        "{iters} kills, {kills_with_acks} after at least one acknowledged job, {} keys acknowledged in phase 1",
        acked.len()
    );
    // Every other kill counts from the first acknowledgement, so at least
    // half land mid-stream on any machine; the rest may land anywhere.
    assert!(
        kills_with_acks >= iters / 2,
        "at least half the kills should land mid-stream"
    );
}
