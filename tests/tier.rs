//! The tier end to end on the io_uring engine over pool files.

mod common;

use common::*;
use kvtier::pool::{Key, OpenExpect, Pool};
use kvtier::tier::{KeyOutcome, Tier, TierConfig};
use kvtier::{HostKvCache, HostLayout};
use std::sync::Arc;

fn keys(range: std::ops::Range<u64>) -> Vec<Key> {
    range.map(Key::from_u64).collect()
}

/// Fill memory blocks with each key's pattern and store them.
fn store(tier: &mut Tier, cache: &HostKvCache, ks: &[u64], mem: &[u32]) {
    for (k, &b) in ks.iter().zip(mem) {
        cache.fill_block(b, seed_of(*k));
    }
    let keys: Vec<Key> = ks.iter().map(|&k| Key::from_u64(k)).collect();
    let job = tier.submit_store(&keys, mem).unwrap();
    let r = tier.wait(job).unwrap();
    assert!(
        r.all_ok(),
        "store failed: {:?}",
        r.failures().collect::<Vec<_>>()
    );
}

#[test]
fn round_trip_layer_by_layer_in_order() {
    for layout in [HostLayout::PerLayer, HostLayout::CrossLayer] {
        let dir = TempDir::new("roundtrip");
        let geo = tiny_geometry();
        let pool = create_pool(&dir, geo, 8, 2, 4); // 64 slots over 2 devices
        let mut tier = Tier::open(pool, TierConfig::default()).unwrap();
        let cache = Arc::new(HostKvCache::new(geo, 64, layout).unwrap());
        tier.register_host_cache(cache.clone()).unwrap();

        // Store 40 blocks from scattered memory blocks.
        let ks: Vec<u64> = (1000..1040).collect();
        let mem: Vec<u32> = (0..40).map(|i| (i * 7 + 3) % 64).collect();
        store(&mut tier, &cache, &ks, &mem);
        assert_eq!(tier.lookup_prefix(&keys(1000..1040)), 40);

        // Clear memory and load into other blocks, layer by layer.
        cache.clear();
        let target: Vec<u32> = (0..40).map(|i| 63 - i).collect();
        let job = tier
            .submit_load(&keys(1000..1040), &target, 0..geo.layers)
            .unwrap();
        let mut seen = Vec::new();
        for layer in 0..geo.layers {
            tier.wait_layer(job, layer).unwrap();
            for (i, &k) in ks.iter().enumerate() {
                assert!(
                    cache.block_matches(target[i], seed_of(k), 0..layer + 1),
                    "layer {layer} of key {k} not in memory after wait_layer"
                );
            }
            seen.extend(tier.layer_events().into_iter().map(|e| e.layer));
        }
        let r = tier.wait(job).unwrap();
        assert!(r.all_ok());
        seen.extend(tier.layer_events().into_iter().map(|e| e.layer));
        assert_eq!(
            seen,
            (0..geo.layers).collect::<Vec<_>>(),
            "per-layer completions in layer order"
        );
        assert_eq!(tier.usage().pinned_blocks, 0, "a finished load unpins");
    }
}

#[test]
fn partial_layer_range_and_dedup() {
    let dir = TempDir::new("partial");
    let geo = tiny_geometry();
    let pool = create_pool(&dir, geo, 8, 1, 4);
    let mut tier = Tier::open(pool, TierConfig::default()).unwrap();
    let cache = Arc::new(HostKvCache::new(geo, 16, HostLayout::PerLayer).unwrap());
    tier.register_host_cache(cache.clone()).unwrap();
    store(&mut tier, &cache, &[1, 2, 3], &[0, 1, 2]);
    // The same keys again: no I/O, reported as already stored.
    let before = tier.usage().engine.ios;
    let job = tier.submit_store(&keys(1..4), &[5, 6, 7]).unwrap();
    let r = tier.wait(job).unwrap();
    assert!(r.outcomes.iter().all(|o| *o == KeyOutcome::AlreadyStored));
    assert_eq!(tier.usage().engine.ios, before);
    assert_eq!(tier.usage().live_blocks, 3);
    // A duplicate key inside one job is stored once.
    cache.fill_block(9, seed_of(77));
    let job = tier
        .submit_store(&[Key::from_u64(77), Key::from_u64(77)], &[9, 9])
        .unwrap();
    let r = tier.wait(job).unwrap();
    assert_eq!(
        r.outcomes,
        vec![KeyOutcome::Done, KeyOutcome::AlreadyStored]
    );
    assert_eq!(tier.usage().live_blocks, 4);

    cache.clear();
    let job = tier.submit_load(&keys(1..4), &[10, 11, 12], 2..4).unwrap();
    assert!(tier.wait(job).unwrap().all_ok());
    for (i, k) in (1..4u64).enumerate() {
        assert!(cache.block_matches(10 + i as u32, seed_of(k), 2..4));
        assert!(
            !cache.block_matches(10 + i as u32, seed_of(k), 0..1),
            "layers outside the range stay untouched"
        );
    }
}

#[test]
fn reopen_finds_every_key_and_verifies() {
    let dir = TempDir::new("reopen");
    let geo = tiny_geometry();
    let pool = create_pool(&dir, geo, 8, 3, 2);
    let paths = pool.paths();
    let ks: Vec<u64> = (0..40).collect();
    {
        let mut tier = Tier::open(pool, TierConfig::default()).unwrap();
        let cache = Arc::new(HostKvCache::new(geo, 48, HostLayout::CrossLayer).unwrap());
        tier.register_host_cache(cache.clone()).unwrap();
        for chunk in ks.chunks(7) {
            let mem: Vec<u32> = chunk.iter().map(|&k| k as u32).collect();
            store(&mut tier, &cache, chunk, &mem);
        }
    }
    // Devices named in another order still open as one pool.
    let mut rev = paths.clone();
    rev.reverse();
    let pool = Pool::open(
        &rev,
        &OpenExpect {
            geometry: Some(geo),
            namespace: Some("test/ns".into()),
        },
    )
    .unwrap();
    assert_eq!(pool.index().live(), 40);
    let report = pool.check(|_, _| {}).unwrap();
    assert!(report.is_clean(), "{report:?}");
    assert_eq!(report.blocks_ok, 40);
    let mut tier = Tier::open(pool, TierConfig::default()).unwrap();
    let cache = Arc::new(HostKvCache::new(geo, 48, HostLayout::PerLayer).unwrap());
    tier.register_host_cache(cache.clone()).unwrap();
    assert_eq!(tier.lookup_prefix(&keys(0..40)), 40);
    let mem: Vec<u32> = (0..40).collect();
    let job = tier.submit_load(&keys(0..40), &mem, 0..geo.layers).unwrap();
    assert!(tier.wait(job).unwrap().all_ok());
    for &k in &ks {
        assert!(
            cache.block_matches(k as u32, seed_of(k), 0..geo.layers),
            "key {k}"
        );
    }
}

#[test]
fn capacity_evicts_lru_unpinned_and_files_never_grow() {
    let dir = TempDir::new("capacity");
    let geo = tiny_geometry();
    let pool = create_pool(&dir, geo, 4, 2, 2); // 16 slots
    let paths = pool.paths();
    let sizes: Vec<u64> = paths
        .iter()
        .map(|p| std::fs::metadata(p).unwrap().len())
        .collect();
    let mut tier = Tier::open(pool, TierConfig::default()).unwrap();
    let cache = Arc::new(HostKvCache::new(geo, 8, HostLayout::PerLayer).unwrap());
    tier.register_host_cache(cache.clone()).unwrap();

    store(&mut tier, &cache, &[0, 1, 2, 3], &[0, 1, 2, 3]);
    assert_eq!(tier.lookup_and_pin(&keys(0..2)), 2, "pin keys 0 and 1");
    for batch in 1..10u64 {
        let ks: Vec<u64> = (batch * 4..batch * 4 + 4).collect();
        store(&mut tier, &cache, &ks, &[4, 5, 6, 7]);
        assert!(tier.usage().live_blocks <= 16);
    }
    let u = tier.usage();
    assert_eq!(u.live_blocks, 16);
    assert!(
        tier.contains(&Key::from_u64(0)) && tier.contains(&Key::from_u64(1)),
        "pinned keys survive"
    );
    assert!(
        !tier.contains(&Key::from_u64(2)),
        "oldest unpinned key evicted"
    );
    assert_eq!(
        tier.lookup_prefix(&keys(26..40)),
        14,
        "the newest keys are resident"
    );
    for (p, s) in paths.iter().zip(&sizes) {
        assert_eq!(
            std::fs::metadata(p).unwrap().len(),
            *s,
            "pool files never grow"
        );
    }
    // The survivors read back intact, including slots reused after eviction.
    cache.clear();
    let resident: Vec<u64> = (0..40)
        .filter(|&k| tier.contains(&Key::from_u64(k)))
        .collect();
    for chunk in resident.chunks(8) {
        let mem: Vec<u32> = (0..chunk.len() as u32).collect();
        let ks: Vec<Key> = chunk.iter().map(|&k| Key::from_u64(k)).collect();
        let job = tier.submit_load(&ks, &mem, 0..geo.layers).unwrap();
        assert!(tier.wait(job).unwrap().all_ok());
        for (i, &k) in chunk.iter().enumerate() {
            assert!(
                cache.block_matches(i as u32, seed_of(k), 0..geo.layers),
                "key {k}"
            );
        }
    }
    tier.unpin(&keys(0..2));
    tier.unpin(&keys(0..2)); // unpin never fails
    drop(tier);
    let pool = Pool::open(&paths, &OpenExpect::default()).unwrap();
    assert_eq!(pool.index().live(), 16);
    assert!(pool.check(|_, _| {}).unwrap().is_clean());
}

#[test]
fn full_pool_with_everything_pinned_is_refused() {
    let dir = TempDir::new("pinned");
    let geo = tiny_geometry();
    let pool = create_pool(&dir, geo, 4, 1, 1); // 4 slots
    let mut tier = Tier::open(pool, TierConfig::default()).unwrap();
    let cache = Arc::new(HostKvCache::new(geo, 8, HostLayout::PerLayer).unwrap());
    tier.register_host_cache(cache.clone()).unwrap();
    store(&mut tier, &cache, &[0, 1, 2, 3], &[0, 1, 2, 3]);
    assert_eq!(tier.lookup_and_pin(&keys(0..4)), 4);
    let err = tier
        .submit_store(&keys(10..11), &[5])
        .unwrap_err()
        .to_string();
    assert!(err.contains("pool full") && err.contains("pinned"), "{err}");
    tier.unpin(&keys(2..3));
    let job = tier.submit_store(&keys(10..11), &[5]).unwrap();
    assert!(tier.wait(job).unwrap().all_ok());
    assert!(!tier.contains(&Key::from_u64(2)));
}

#[test]
fn bad_arguments_get_clear_errors() {
    let dir = TempDir::new("badargs");
    let geo = tiny_geometry();
    let pool = create_pool(&dir, geo, 4, 1, 2);
    let mut tier = Tier::open(pool, TierConfig::default()).unwrap();
    let err = tier
        .submit_store(&keys(0..1), &[0])
        .unwrap_err()
        .to_string();
    assert!(err.contains("no KV memory registered"), "{err}");
    let cache = Arc::new(HostKvCache::new(geo, 8, HostLayout::PerLayer).unwrap());
    tier.register_host_cache(cache.clone()).unwrap();
    let err = tier
        .submit_load(&keys(5..6), &[0], 0..4)
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("is not in the pool") && err.contains("0500000000000000"),
        "{err}"
    );
    let err = tier
        .submit_store(&keys(0..1), &[8])
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("memory block 8 is out of range") && err.contains("8 blocks"),
        "{err}"
    );
    let err = tier
        .submit_store(&keys(0..2), &[1])
        .unwrap_err()
        .to_string();
    assert!(err.contains("2 keys but 1 memory blocks"), "{err}");
    store(&mut tier, &cache, &[0, 1], &[0, 1]);
    let err = tier
        .submit_load(&keys(0..1), &[0], 2..9)
        .unwrap_err()
        .to_string();
    assert!(err.contains("layer range 2..9"), "{err}");
    let err = tier
        .submit_load(&keys(0..2), &[3, 3], 0..4)
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("memory block 3 is the target of two keys"),
        "{err}"
    );
    let err = tier.wait(999).unwrap_err().to_string();
    assert!(err.contains("job 999 is unknown"), "{err}");
    // Unaligned engine memory.
    let mem = kvtier::KvMemory {
        geometry: geo,
        num_blocks: 4,
        layout: kvtier::KvLayout::CrossLayer { base: 0x1000_0100 },
        kind: kvtier::MemoryKind::Host,
    };
    // SAFETY: registration fails before any address is used.
    let err = unsafe { tier.register_memory(mem) }
        .unwrap_err()
        .to_string();
    assert!(err.contains("not aligned to 4096 bytes"), "{err}");
}

#[test]
fn coalesced_layer_load_issues_one_io_per_group() {
    // llama3-8b's object (8 kv heads x 128 x bf16 x 16 tokens = 32 KiB), two
    // layers to keep the test small; a layer's I/O count does not depend on
    // how many layers there are. 64K tokens = 4096 blocks = 64 groups of 64.
    let mut geo = kvtier::model::preset("llama3-8b", 16).unwrap();
    geo.layers = 2;
    let dir = TempDir::new("coalesce");
    let pool = create_pool(&dir, geo, 64, 2, 32);
    let mut tier = Tier::open(pool, TierConfig::default()).unwrap();
    let cache = Arc::new(HostKvCache::new(geo, 4096, HostLayout::PerLayer).unwrap());
    tier.register_host_cache(cache.clone()).unwrap();
    let ks: Vec<u64> = (0..4096).collect();
    let mem: Vec<u32> = (0..4096).collect();
    store(&mut tier, &cache, &ks, &mem);
    // Engine memory in another (scattered) order than the store's.
    let target: Vec<u32> = (0..4096u32).map(|i| (i * 2897) % 4096).collect();
    cache.clear();
    let before = tier.usage().engine;
    let job = tier.submit_load(&keys(0..4096), &target, 1..2).unwrap();
    assert!(tier.wait(job).unwrap().all_ok());
    let after = tier.usage().engine;
    let ios = after.ios - before.ios;
    let iocbs = after.iocbs - before.iocbs;
    eprintln!(
        "one layer of 4096 blocks (8192 objects): {ios} I/Os in {iocbs} IOCB(s), {} syscalls",
        after.syscalls - before.syscalls
    );
    assert_eq!(ios, 64, "one I/O per extent group per layer");
    // A verified layer goes out in IOCBs of about max_io_bytes (here one
    // 4 MiB I/O each), so its checksums are taken as each one lands.
    assert_eq!(iocbs, 64);
    for i in (0..4096).step_by(97) {
        assert!(cache.block_matches(target[i], seed_of(i as u64), 1..2));
    }
}

#[test]
fn sqpoll_and_no_fixed_buffers_round_trip() {
    for (sqpoll, fixed) in [(Some(20), true), (None, false)] {
        let dir = TempDir::new("sqpoll");
        let geo = tiny_geometry();
        let pool = create_pool(&dir, geo, 8, 2, 2);
        let cfg = TierConfig::default().with_uring(
            kvtier::engine::uring::UringConfig::default()
                .with_queue_depth(8)
                .with_sqpoll_idle_ms(sqpoll)
                .with_fixed_buffers(fixed)
                .with_defer_taskrun(false),
        );
        let mut tier = Tier::open(pool, cfg).unwrap();
        let cache = Arc::new(HostKvCache::new(geo, 32, HostLayout::PerLayer).unwrap());
        tier.register_host_cache(cache.clone()).unwrap();
        let ks: Vec<u64> = (0..24).collect();
        let mem: Vec<u32> = (0..24).collect();
        store(&mut tier, &cache, &ks, &mem);
        cache.clear();
        let job = tier.submit_load(&keys(0..24), &mem, 0..geo.layers).unwrap();
        assert!(tier.wait(job).unwrap().all_ok());
        for &k in &ks {
            assert!(
                cache.block_matches(k as u32, seed_of(k), 0..geo.layers),
                "sqpoll {sqpoll:?} fixed {fixed}: key {k}"
            );
        }
        let d = tier.engine().describe();
        assert!(
            d.contains(if sqpoll.is_some() {
                "SQPOLL"
            } else {
                "no SQPOLL"
            }),
            "{d}"
        );
    }
}

#[test]
fn defer_taskrun_round_trip_and_the_thread_rule() {
    let dir = TempDir::new("defer");
    let geo = tiny_geometry();
    let cfg = TierConfig::default()
        .with_uring(kvtier::engine::uring::UringConfig::default().with_defer_taskrun(true));
    let pool = create_pool(&dir, geo, 8, 1, 4);
    let mut tier = Tier::open(pool, cfg.clone()).unwrap();
    let cache = Arc::new(HostKvCache::new(geo, 32, HostLayout::PerLayer).unwrap());
    tier.register_host_cache(cache.clone()).unwrap();
    let ks: Vec<u64> = (0..16).collect();
    let mem: Vec<u32> = (0..16).collect();
    store(&mut tier, &cache, &ks, &mem);
    cache.clear();
    let job = tier.submit_load(&keys(0..16), &mem, 0..geo.layers).unwrap();
    // Completions of a deferred-task-work ring must show up for a caller that only polls.
    let t0 = std::time::Instant::now();
    let mut done = Vec::new();
    while done.is_empty() {
        tier.poll().unwrap();
        done = tier.get_finished();
        assert!(
            t0.elapsed().as_secs() < 10,
            "polling never saw the load finish"
        );
    }
    assert!(done[0].all_ok() && done[0].job == job);
    for &k in &ks {
        assert!(cache.block_matches(k as u32, seed_of(k), 0..geo.layers));
    }
    drop(tier);
    // Used from another thread: a clear error, and a clean drop.
    let pool = Pool::open(&[dir.file("ssd0.pool")], &OpenExpect::default()).unwrap();
    let mut tier = Tier::open(pool, cfg).unwrap();
    tier.register_host_cache(cache.clone()).unwrap();
    if !tier.engine().describe().contains("DEFER_TASKRUN") {
        eprintln!("kernel without DEFER_TASKRUN: thread rule not exercised");
        return;
    }
    std::thread::spawn(move || {
        let job = tier
            .submit_load(&keys(0..4), &[0, 1, 2, 3], 0..geo.layers)
            .unwrap();
        let err = tier.wait(job).unwrap_err().to_string();
        assert!(err.contains("another thread"), "{err}");
    })
    .join()
    .unwrap();
}

/// A load's first layer reaches the device alone, at most half of it at a
/// time, so its reads land one after another and are verified as they
/// land; no later layer is issued beside it; every layer still arrives
/// whole and verified.
#[test]
fn first_layer_goes_to_the_device_alone_half_at_a_time() {
    use common::fault::{FaultEngine, Faults};
    use std::sync::Mutex;

    let dir = TempDir::new("firstlayer");
    let geo = tiny_geometry();
    let pool = create_pool(&dir, geo, 16, 1, 2); // 32 slots in groups of 16
    let uring = uring_of(&pool).unwrap();
    let faults = Arc::new(Mutex::new(Faults::default()));
    let engine = FaultEngine::wrap(uring, faults.clone());
    // One object per read: layer 0 of 16 blocks is 32 reads.
    let cfg = TierConfig::default().with_max_io_bytes(geo.object_bytes());
    let mut tier = Tier::with_engine(pool, cfg, Box::new(engine)).unwrap();
    let cache = Arc::new(HostKvCache::new(geo, 16, HostLayout::PerLayer).unwrap());
    tier.register_host_cache(cache.clone()).unwrap();
    let ks: Vec<u64> = (500..516).collect();
    let mem: Vec<u32> = (0..16).collect();
    store(&mut tier, &cache, &ks, &mem);
    cache.clear();

    faults.lock().unwrap().hold = true;
    let job = tier
        .submit_load(&keys(500..516), &mem, 0..geo.layers)
        .unwrap();
    assert_eq!(
        tier.engine().in_flight(),
        16,
        "half of layer 0's 32 reads goes out at submission"
    );
    for _ in 0..5 {
        tier.poll().unwrap();
    }
    assert_eq!(
        tier.engine().in_flight(),
        16,
        "nothing more (no later layer) goes out while those are held"
    );
    assert_eq!(tier.layers_done(job), Some(0));

    faults.lock().unwrap().hold = false;
    for layer in 0..geo.layers {
        tier.wait_layer(job, layer).unwrap();
        for (i, &k) in ks.iter().enumerate() {
            assert!(
                cache.block_matches(mem[i], seed_of(k), 0..layer + 1),
                "layer {layer} of key {k} not in memory after wait_layer"
            );
        }
    }
    let r = tier.wait(job).unwrap();
    assert!(r.outcomes.iter().all(|o| *o == KeyOutcome::Done), "{r:?}");
}

/// A prewritten pool: every byte of its files written once at creation
/// (progress reported up to their size), none left as unwritten extents,
/// and it stores and loads like any other. A pool created without it is
/// reported with its never-written bytes (skipped, saying so, where the
/// file system cannot tell).
#[test]
fn prewritten_pool_has_no_unwritten_space_and_round_trips() {
    let dir = TempDir::new("prewrite");
    let geo = tiny_geometry();
    let devs = [dir.file("a.pool"), dir.file("b.pool")];
    let cfg = pool_config(geo, 8, &devs, 4).with_prewrite(true);
    let mut calls: Vec<(u64, u64)> = Vec::new();
    let pool = Pool::create_with_progress(&cfg, &mut |d, t| calls.push((d, t))).unwrap();
    // Every byte past each file's first 4 KiB (its superblock, written by
    // the format itself).
    let total = 2 * (device_bytes(&geo, 8, 4) - 4096);
    assert_eq!(
        calls.first(),
        Some(&(0, total)),
        "progress starts at 0 of all"
    );
    assert_eq!(calls.last(), Some(&(total, total)), "progress ends at all");
    assert!(calls.windows(2).all(|w| w[0].0 <= w[1].0), "{calls:?}");
    for d in &pool.info().devices {
        assert!(
            matches!(d.unwritten_bytes, Some(0) | None),
            "{}: {:?} unwritten after prewrite",
            d.path.display(),
            d.unwritten_bytes
        );
    }
    let mut tier = Tier::open(pool, TierConfig::default()).unwrap();
    let cache = Arc::new(HostKvCache::new(geo, 16, HostLayout::PerLayer).unwrap());
    tier.register_host_cache(cache.clone()).unwrap();
    let ks: Vec<u64> = (50..66).collect();
    let mem: Vec<u32> = (0..16).collect();
    store(&mut tier, &cache, &ks, &mem);
    cache.clear();
    let job = tier
        .submit_load(&keys(50..66), &mem, 0..geo.layers)
        .unwrap();
    assert!(tier.wait(job).unwrap().all_ok());
    for (i, &k) in ks.iter().enumerate() {
        assert!(cache.block_matches(mem[i], seed_of(k), 0..geo.layers));
    }
    drop(tier);

    // Without prewrite: no progress, and the never-written space is told.
    let plain = TempDir::new("no-prewrite");
    let mut called = false;
    let pool = Pool::create_with_progress(
        &pool_config(geo, 8, &[plain.file("c.pool")], 4),
        &mut |_, _| called = true,
    )
    .unwrap();
    assert!(!called, "no prewrite, no progress");
    match pool.info().devices[0].unwritten_bytes {
        Some(u) if u > 0 => {}
        other => eprintln!("SKIP: this file system reports no unwritten extents ({other:?})"),
    }
}
