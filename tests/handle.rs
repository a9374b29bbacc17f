//! `TierHandle` end to end on the io_uring engine over pool files: several
//! threads at once, completions through the eventfd, errors by kind.

mod common;

use common::fault::{FaultEngine, Faults, Stall};
use common::*;
use kvtier::error::ErrorKind;
use kvtier::handle::{EngineChoice, Event, HandleConfig, TierBuilder, TierHandle};
use kvtier::pool::{Key, Pool};
use kvtier::sched::Policy;
use kvtier::tier::KeyOutcome;
use kvtier::{HostKvCache, HostLayout, KvGeometry};
use std::os::fd::AsFd;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

fn keys(r: std::ops::Range<u64>) -> Vec<Key> {
    r.map(Key::from_u64).collect()
}

/// A handle on a fresh pool of `slots` blocks behind the faulty double.
fn faulty_handle(
    dir: &TempDir,
    groups: u64,
    mem_blocks: u32,
    cfg: HandleConfig,
) -> (TierHandle, Arc<HostKvCache>, Arc<Mutex<Faults>>) {
    let geo = tiny_geometry();
    let faults = Arc::new(Mutex::new(Faults::default()));
    let f = faults.clone();
    let devs = vec![dir.file("a.pool"), dir.file("b.pool")];
    let pcfg = pool_config(geo, 4, &devs, groups);
    let cache = Arc::new(HostKvCache::new(geo, mem_blocks, HostLayout::PerLayer).unwrap());
    let h = TierBuilder::default()
        .custom_engine(move || {
            let pool = Pool::create(&pcfg)?;
            let eng = uring_of(&pool)?;
            Ok((pool, Box::new(FaultEngine::wrap(eng, f)) as _))
        })
        .config(cfg)
        .host_cache(cache.clone())
        .build()
        .unwrap();
    (h, cache, faults)
}

fn store_ok(h: &TierHandle, cache: &HostKvCache, ks: &[u64], mem: &[u32]) {
    for (&k, &b) in ks.iter().zip(mem) {
        cache.fill_block(b, seed_of(k));
    }
    let keys: Vec<Key> = ks.iter().map(|&k| Key::from_u64(k)).collect();
    let job = h.submit_store(&keys, mem).unwrap();
    let r = h.wait(job).unwrap();
    assert!(r.all_ok(), "{:?}", r.failures().collect::<Vec<_>>());
}

#[test]
fn builder_opens_files_with_uring_and_auto_and_round_trips() {
    let dir = TempDir::new("handle-rt");
    let geo = tiny_geometry();
    let devs = vec![dir.file("a.pool"), dir.file("b.pool")];
    let cache = Arc::new(HostKvCache::new(geo, 64, HostLayout::CrossLayer).unwrap());
    let h = TierBuilder::default()
        .create(pool_config(geo, 8, &devs, 4))
        .engine(EngineChoice::Uring)
        .host_cache(cache.clone())
        .build()
        .unwrap();
    assert_eq!(h.engine(), "uring");
    let ks: Vec<u64> = (100..140).collect();
    let mem: Vec<u32> = (0..40).map(|i| (i * 7 + 3) % 64).collect();
    store_ok(&h, &cache, &ks, &mem);
    assert_eq!(h.lookup_prefix(&keys(100..150)), 40);
    let events = h.completions().unwrap();
    cache.clear();
    let target: Vec<u32> = (0..40).map(|i| 63 - i).collect();
    assert_eq!(h.lookup_and_pin(&keys(100..140)), 40);
    let job = h
        .submit_load(&keys(100..140), &target, 0..geo.layers)
        .unwrap();
    for layer in 0..geo.layers {
        h.wait_layer(job, layer).unwrap();
        for (i, &k) in ks.iter().enumerate() {
            assert!(cache.block_matches(target[i], seed_of(k), 0..layer + 1));
        }
    }
    assert!(h.wait(job).unwrap().all_ok());
    h.unpin(&keys(100..140));
    let mut layers = Vec::new();
    while let Some(e) = events.recv_timeout(Duration::from_secs(5)) {
        match e {
            Event::Layer {
                job: j,
                layer,
                error,
            } if j == job => {
                assert!(error.is_none());
                layers.push(layer);
            }
            Event::Finished { job: j, ok, .. } if j == job => {
                assert!(ok);
                break;
            }
            _ => {}
        }
    }
    assert_eq!(layers, (0..geo.layers).collect::<Vec<_>>(), "layer order");
    assert_eq!(h.usage().unwrap().tier.pinned_blocks, 0);
    h.close().unwrap();
    assert_eq!(h.lookup_prefix(&keys(100..101)), 0, "closed: lookups say 0");
    let err = h.submit_store(&keys(1..2), &[0]).unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Closed, "{err}");

    // Reopen with auto: on files the verdict is io_uring.
    let h = TierBuilder::default()
        .files(devs.clone())
        .engine(EngineChoice::Auto)
        .host_cache(cache.clone())
        .build()
        .unwrap();
    assert_eq!(h.engine(), "uring", "{}", h.engine_reason());
    assert_eq!(h.lookup_prefix(&keys(100..140)), 40, "stores were durable");
    drop(h);

    // Engines that drive controllers refuse files, by kind.
    let err = TierBuilder::default()
        .files(devs)
        .engine(EngineChoice::Nvme)
        .host_cache(cache)
        .build()
        .unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Unsupported, "{err}");
    assert!(err.to_string().contains("controller("), "{err}");
}

#[test]
fn lookups_and_other_jobs_do_not_wait_behind_a_held_load() {
    let dir = TempDir::new("handle-held");
    let (h, cache, faults) = faulty_handle(&dir, 4, 32, HandleConfig::default());
    store_ok(&h, &cache, &[1, 2, 3, 4], &[0, 1, 2, 3]);
    faults.lock().unwrap().hold = true;
    let load = h.submit_load(&keys(1..5), &[10, 11, 12, 13], 0..4).unwrap();
    // Another thread blocks on the held load.
    let h2 = h.clone();
    let waiter = std::thread::spawn(move || h2.wait(load).map(|r| r.all_ok()));
    std::thread::sleep(Duration::from_millis(50));
    let t = Instant::now();
    for _ in 0..1000 {
        assert_eq!(h.lookup_prefix(&keys(1..9)), 4);
        assert_eq!(h.lookup_and_pin(&keys(1..3)), 2);
        h.unpin(&keys(1..3));
    }
    let took = t.elapsed();
    assert!(
        took < Duration::from_secs(2),
        "3000 index calls took {took:?} while a load was held"
    );
    // A store accepted meanwhile is deferred (a read is in flight), not refused.
    cache.fill_block(20, seed_of(50));
    let st = h.submit_store(&keys(50..51), &[20]).unwrap();
    assert!(h.try_result(st).unwrap().is_none());
    assert_eq!(
        h.usage().unwrap().deferred_stores,
        1,
        "read first: the store waits"
    );
    assert!(!waiter.is_finished());
    faults.lock().unwrap().hold = false;
    assert!(waiter.join().unwrap().unwrap());
    assert!(
        h.wait(st).unwrap().all_ok(),
        "released once the read is done"
    );
    assert!(h.contains(&Key::from_u64(50)));
    h.close().unwrap();
}

/// The I/O thread stopped in the middle of its poll turn (inside the engine,
/// every lock of the turn held: what hashing a landed layer or planning a
/// store looks like from outside) holds up no lookup, pin or unpin: they
/// take the index's own lock. Before, they queued behind the whole turn.
#[test]
fn lookups_and_pins_do_not_wait_for_the_io_threads_turn() {
    let dir = TempDir::new("handle-turn");
    let (h, cache, faults) = faulty_handle(&dir, 4, 32, HandleConfig::default());
    store_ok(&h, &cache, &[1, 2, 3, 4], &[0, 1, 2, 3]);
    let stall = Arc::new(Stall::default());
    faults.lock().unwrap().stall = Some(stall.clone());
    stall.arm();
    let load = h.submit_load(&keys(1..5), &[10, 11, 12, 13], 0..4).unwrap();
    assert!(
        stall.wait_entered(Duration::from_secs(30)),
        "the I/O thread never entered the engine for the load"
    );
    // From another thread, so that a lookup that waits for the turn shows
    // as a missing answer rather than hanging the test.
    let h2 = h.clone();
    let (tx, rx) = std::sync::mpsc::channel();
    let caller = std::thread::spawn(move || {
        let hit = h2.lookup_prefix(&keys(1..9));
        let pinned = h2.lookup_and_pin(&keys(1..3));
        let has = h2.contains(&Key::from_u64(4)) && !h2.contains(&Key::from_u64(9));
        h2.unpin(&keys(1..3));
        let _ = tx.send((hit, pinned, has));
    });
    let answer = rx.recv_timeout(Duration::from_secs(20));
    // Let the turn go on either way, so a failure does not leave a stopped thread.
    stall.release();
    caller.join().unwrap();
    assert_eq!(
        answer.expect("lookups waited for the I/O thread's turn"),
        (4, 2, true)
    );
    assert!(h.wait(load).unwrap().all_ok());
    assert_eq!(
        h.usage().unwrap().tier.pinned_blocks,
        0,
        "the pins were dropped"
    );
    h.close().unwrap();
}

#[test]
fn completions_eventfd_wakes_poll() {
    let dir = TempDir::new("handle-efd");
    let (h, cache, faults) = faulty_handle(&dir, 4, 32, HandleConfig::default());
    store_ok(&h, &cache, &[1, 2], &[0, 1]);
    let comp = h.completions().unwrap();
    let poll_once = |ms: u16| {
        let mut fds = [nix::poll::PollFd::new(
            comp.as_fd(),
            nix::poll::PollFlags::POLLIN,
        )];
        nix::poll::poll(&mut fds, nix::poll::PollTimeout::from(ms)).unwrap()
    };
    assert_eq!(poll_once(0), 0, "nothing queued: not readable");
    faults.lock().unwrap().hold = true;
    let job = h.submit_load(&keys(1..3), &[5, 6], 0..4).unwrap();
    std::thread::sleep(Duration::from_millis(30));
    assert_eq!(poll_once(0), 0, "a held load completes nothing");
    faults.lock().unwrap().hold = false;
    let mut seen = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(10);
    while !seen.iter().any(|e| matches!(e, Event::Finished { .. })) {
        assert!(Instant::now() < deadline, "no completion: {seen:?}");
        // Sleep in poll(2) until the eventfd says there is something.
        if poll_once(1000) == 1 {
            while let Some(e) = comp.try_recv() {
                seen.push(e);
            }
            assert_eq!(poll_once(0), 0, "drained: not readable any more");
        }
    }
    let layers: Vec<u32> = seen
        .iter()
        .filter_map(|e| match e {
            Event::Layer { job: j, layer, .. } if *j == job => Some(*layer),
            _ => None,
        })
        .collect();
    assert_eq!(layers, vec![0, 1, 2, 3]);
    assert!(h.try_result(job).unwrap().unwrap().all_ok());
    h.close().unwrap();
}

#[test]
fn errors_carry_kinds_backpressure_io_usage() {
    let dir = TempDir::new("handle-kinds");
    let cfg = HandleConfig::default()
        .with_policy(Policy::Sync)
        .with_backlog_limit_blocks(4);
    let (h, cache, faults) = faulty_handle(&dir, 4, 32, cfg);
    h.submit_store(&keys(1..4), &[0, 1, 2]).unwrap();
    let err = h.submit_store(&keys(10..12), &[3, 4]).unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Backpressure, "{err}");
    let err = h.submit_load(&keys(77..78), &[9], 0..4).unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Usage, "{err}");
    let err = h.submit_load(&keys(1..2), &[999], 0..4).unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Usage, "{err}");
    h.flush_stores().unwrap();
    // Device faults: every read fails, as an I/O failure with its device.
    cache.fill_block(7, seed_of(20));
    let st = h.submit_store(&keys(20..21), &[7]).unwrap();
    h.flush_stores().unwrap();
    h.wait(st).unwrap();
    faults.lock().unwrap().fail_read_permille = 1000;
    let load = h.submit_load(&keys(20..21), &[8], 0..4).unwrap();
    let err = h.wait_layer(load, 0).unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Io, "{err}");
    let io = err.io_failure().expect("the failed I/O is named");
    assert_eq!(io.op, "read");
    assert!(io.len > 0);
    let r = h.wait(load).unwrap();
    match &r.outcomes[0] {
        KeyOutcome::Failed(f) => assert_eq!(f.kind, ErrorKind::Io),
        o => panic!("expected a failed load, got {o:?}"),
    }
    h.close().unwrap();
}

#[test]
fn drop_without_close_does_not_hang_and_keeps_acknowledged_stores() {
    let dir = TempDir::new("handle-drop");
    let geo: KvGeometry = tiny_geometry();
    let devs = vec![dir.file("a.pool")];
    let cache = Arc::new(HostKvCache::new(geo, 16, HostLayout::PerLayer).unwrap());
    let cfg = HandleConfig::default().with_policy(Policy::Sync);
    let h = TierBuilder::default()
        .create(pool_config(geo, 4, &devs, 4))
        .config(cfg.clone())
        .host_cache(cache.clone())
        .build()
        .unwrap();
    cache.fill_block(0, seed_of(1));
    let a = h.submit_store(&keys(1..2), &[0]).unwrap();
    h.flush_stores().unwrap();
    assert!(h.wait(a).unwrap().all_ok());
    let _never = h.submit_store(&keys(2..3), &[1]).unwrap(); // stays in the backlog
    let h2 = h.clone();
    let t = Instant::now();
    drop(h);
    drop(h2);
    assert!(t.elapsed() < Duration::from_secs(5));
    let h = TierBuilder::default()
        .files(devs)
        .config(cfg)
        .host_cache(cache)
        .build()
        .unwrap();
    assert!(h.contains(&Key::from_u64(1)), "acknowledged store kept");
    assert!(
        !h.contains(&Key::from_u64(2)),
        "a never-issued store left nothing"
    );
}

/// `close` from two threads at once: the second returns only once the
/// first has finished every job, so either caller may take Ok as "all
/// stores durable" and exit the process.
#[test]
fn a_second_close_returns_only_when_the_first_has_finished() {
    let dir = TempDir::new("handle-close2");
    let (h, cache, faults) = faulty_handle(&dir, 4, 32, HandleConfig::default());
    faults.lock().unwrap().hold = true;
    cache.fill_block(0, seed_of(7));
    let st = h.submit_store(&keys(7..8), &[0]).unwrap();
    let h1 = h.clone();
    let first = std::thread::spawn(move || h1.close());
    // Give the first close time to take the I/O thread.
    std::thread::sleep(Duration::from_millis(100));
    let f = faults.clone();
    let lift = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_millis(300));
        f.lock().unwrap().hold = false;
    });
    h.close().unwrap();
    let r = h.try_result(st).unwrap();
    assert!(
        r.is_some_and(|r| r.all_ok()),
        "the second close returned while the first was still writing"
    );
    first.join().unwrap().unwrap();
    lift.join().unwrap();
}

#[test]
fn an_undrained_completion_stream_stays_bounded_and_keeps_uncollected_jobs() {
    // A subscriber that never drains, beside a caller that collects every
    // result with wait(): the stream drops the collected jobs' events once
    // a few thousand are queued, and keeps every event of a job not yet
    // collected.
    let dir = TempDir::new("handle-events");
    let (h, cache, _) = faulty_handle(&dir, 4, 8, HandleConfig::default());
    let events = h.completions().unwrap();
    store_ok(&h, &cache, &[1], &[0]);
    let layers = h.geometry().layers;
    let kept = h.submit_load(&keys(1..2), &[7], 0..layers).unwrap();
    h.wait_layer(kept, layers - 1).unwrap();
    for i in 0..3000u32 {
        let j = h.submit_load(&keys(1..2), &[1 + i % 6], 0..layers).unwrap();
        h.wait(j).unwrap();
    }
    let got = events.drain();
    assert!(
        got.len() < 2 * 4096,
        "{} events queued for jobs already collected",
        got.len()
    );
    let of_kept: Vec<&Event> = got
        .iter()
        .filter(
            |e| matches!(e, Event::Layer { job, .. } | Event::Finished { job, .. } if *job == kept),
        )
        .collect();
    assert_eq!(of_kept.len(), layers as usize + 1, "{of_kept:?}");
    assert!(h.wait(kept).unwrap().all_ok());
    h.close().unwrap();
}

#[test]
fn results_nobody_collects_are_bounded_by_backpressure() {
    // Fire-and-forget stores (of a key already stored: no I/O) until the job
    // table is full: the next submit is backpressure naming the fix, and
    // collecting the results makes room again.
    let dir = TempDir::new("handle-uncollected");
    let (h, cache, _) = faulty_handle(&dir, 4, 8, HandleConfig::default());
    store_ok(&h, &cache, &[1], &[0]);
    let mut submitted = 0usize;
    let refusal = loop {
        match h.submit_store(&keys(1..2), &[0]) {
            Ok(_) => submitted += 1,
            Err(e) if e.to_string().contains("not collected") => break e,
            // The write backlog is full for a moment: the I/O thread catches up.
            Err(e) if e.kind() == kvtier::ErrorKind::Backpressure => {
                std::thread::sleep(std::time::Duration::from_millis(1))
            }
            Err(e) => panic!("{e}"),
        }
    };
    assert_eq!(refusal.kind(), kvtier::ErrorKind::Backpressure);
    assert!(refusal.to_string().contains("get_finished"), "{refusal}");
    assert_eq!(submitted, kvtier::handle::MAX_JOBS);
    let mut collected = 0;
    while collected < submitted {
        collected += h.get_finished().len();
    }
    let j = h.submit_store(&keys(1..2), &[0]).unwrap();
    assert!(h.wait(j).unwrap().all_ok());
    h.close().unwrap();
}

#[test]
fn a_second_load_into_a_block_under_load_is_refused_and_the_key_kept() {
    // Each load checks the bytes in its memory block: a second load landing
    // there meanwhile would fail the first's check and drop a good key.
    let dir = TempDir::new("handle-double-load");
    let (h, cache, faults) = faulty_handle(&dir, 4, 8, HandleConfig::default());
    store_ok(&h, &cache, &[1, 2], &[0, 1]);
    let layers = h.geometry().layers;
    for _ in 0..20 {
        // The first load's reads are held, so it is still in flight when
        // the second arrives (a tiny load could otherwise finish first).
        faults.lock().unwrap().hold = true;
        let a = h.submit_load(&keys(1..2), &[3], 0..layers).unwrap();
        assert_eq!(h.memory_block_use(3), Some(kvtier::tier::JobKind::Load));
        let err = h.submit_load(&keys(2..3), &[3], 0..layers).unwrap_err();
        assert_eq!(err.kind(), ErrorKind::Usage, "{err}");
        faults.lock().unwrap().hold = false;
        assert!(h.wait(a).unwrap().all_ok());
        assert_eq!(h.memory_block_use(3), None);
    }
    assert_eq!(h.lookup_prefix(&keys(1..3)), 2);
    h.close().unwrap();
}

#[test]
fn removed_keys_are_never_served_and_their_slots_are_reused() {
    let dir = TempDir::new("handle-remove");
    let geo = tiny_geometry();
    let devs = vec![dir.file("a.pool"), dir.file("b.pool")];
    // 2 devices x 1 group x 4 blocks: 8 slots.
    let cache = Arc::new(HostKvCache::new(geo, 16, HostLayout::CrossLayer).unwrap());
    let h = TierBuilder::default()
        .create(pool_config(geo, 4, &devs, 1))
        .engine(EngineChoice::Uring)
        .host_cache(cache.clone())
        .build()
        .unwrap();
    let total = h.usage().unwrap().tier.total_blocks;
    assert_eq!(total, 8);
    store_ok(
        &h,
        &cache,
        &(0..8).collect::<Vec<_>>(),
        &(0..8).collect::<Vec<_>>(),
    );
    // A load reading key 0 is under way when key 0 is removed: it still
    // finishes with the stored bytes.
    assert_eq!(h.lookup_and_pin(&keys(0..1)), 1);
    let job = h.submit_load(&keys(0..1), &[15], 0..geo.layers).unwrap();
    assert_eq!(h.remove(&keys(0..4)).unwrap(), 4);
    assert_eq!(h.remove(&keys(0..4)).unwrap(), 0, "removed once");
    assert_eq!(h.remove(&keys(100..101)).unwrap(), 0, "never stored");
    let r = h.wait(job).unwrap();
    assert!(r.all_ok(), "{:?}", r.failures().collect::<Vec<_>>());
    assert!(cache.block_matches(15, seed_of(0), 0..geo.layers));
    h.unpin(&keys(0..1));
    for k in 0..4 {
        assert!(!h.contains(&Key::from_u64(k)), "key {k} still served");
    }
    assert_eq!(h.lookup_prefix(&keys(4..8)), 4);
    let u = h.usage().unwrap().tier;
    assert_eq!((u.live_blocks, u.free_blocks), (4, 4));
    // A removed key is not held: loading it is refused by kind.
    let err = h
        .submit_load(&keys(1..2), &[14], 0..geo.layers)
        .unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Usage, "{err}");
    // The four freed slots take four new keys without evicting any kept one.
    store_ok(&h, &cache, &[20, 21, 22, 23], &[8, 9, 10, 11]);
    assert_eq!(h.lookup_prefix(&keys(4..8)), 4, "nothing kept was evicted");
    // A removed key stored again is a new store, loaded back byte-equal.
    cache.fill_block(12, seed_of(1));
    let r = h.wait(h.submit_store(&keys(1..2), &[12]).unwrap()).unwrap();
    assert_eq!(r.outcomes, vec![KeyOutcome::Done]);
    assert_eq!(r.evicted, keys(4..5), "the oldest kept key made room");
    cache.clear();
    let r = h
        .wait(h.submit_load(&keys(1..2), &[13], 0..geo.layers).unwrap())
        .unwrap();
    assert!(r.all_ok());
    assert!(cache.block_matches(13, seed_of(1), 0..geo.layers));
    h.close().unwrap();
    assert_eq!(h.remove(&keys(1..2)).unwrap_err().kind(), ErrorKind::Closed);
}
