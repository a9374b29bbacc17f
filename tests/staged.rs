//! The staged HBM path on the CPU: host memory stands in for the GPU's KV
//! memory and `HostCopier` (a test double) does the copies the staging
//! kernels do on a GPU. tests/gpu.rs runs the same checks
//! (tests/common/staged.rs) on device memory with the real kernels.

mod common;
#[path = "common/staged.rs"]
mod staged;

use common::fault::{FaultEngine, Faults};
use kvtier::staged::{StagedTier, StagingConfig};
use kvtier::tier::{KeyOutcome, Tier, TierConfig};
use kvtier::{HostKvCache, HostLayout, KvGeometry};
use staged::*;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// Host memory posing as HBM, copied by the CPU.
struct HostRig(Arc<HostKvCache>);

impl HostRig {
    fn new(layout: HostLayout) -> HostRig {
        HostRig(Arc::new(
            HostKvCache::new(common::tiny_geometry(), 48, layout).unwrap(),
        ))
    }
}

impl KvRig for HostRig {
    fn geometry(&self) -> KvGeometry {
        self.0.memory().geometry
    }
    fn num_blocks(&self) -> u32 {
        self.0.num_blocks()
    }
    fn write_object(&self, block: u32, layer: u32, kv: u32, data: &[u8]) {
        self.0.write_object(block, layer, kv, data)
    }
    fn read_object(&self, block: u32, layer: u32, kv: u32) -> Vec<u8> {
        let mut v = vec![0; self.geometry().object_bytes() as usize];
        self.0.read_object(block, layer, kv, &mut v);
        v
    }
    fn clear(&self) {
        self.0.clear()
    }
    fn staged(&self, tier: Tier, cfg: StagingConfig) -> StagedTier {
        StagedTier::with_host_double(tier, self.0.clone(), cfg).unwrap()
    }
}

#[test]
fn double_round_trip_both_layouts() {
    for l in LAYOUTS {
        round_trip(&HostRig::new(l), &format!("staged-rt-{l:?}"));
    }
}

#[test]
fn double_round_robin_and_back_pressure() {
    for l in LAYOUTS {
        round_robin_and_back_pressure(&HostRig::new(l), &format!("staged-rr-{l:?}"));
    }
}

#[test]
fn double_store_staging_is_bounded() {
    store_staging_is_bounded(&HostRig::new(HostLayout::PerLayer), "staged-bounded");
}

/// A staged store larger than its store area keeps writing while every
/// flush is held: a chunk's staging takes the next chunk once the chunk's
/// data is written, not once its store's flushes are done (on a device a
/// flush waits for every write queued before it, the later chunks' too,
/// so chunks held their staging until those were written and the next
/// gather found the disk idle). Written chunks whose stores have not ended
/// hold header staging, so they are bounded by the store area and by what
/// the tier's header staging has beside it: with the flushes held, the
/// area's data plus that bound is written and no more (twice the area with
/// the default header staging; the area plus 2 blocks with a header
/// staging of the area plus 3). Then the flushes go, the store ends whole,
/// and every key loads back as stored.
#[test]
fn double_store_staging_is_reused_once_a_chunk_is_written() {
    let area = 4u32;
    for (header_staging, released) in [(TierConfig::default().header_staging, area), (area + 3, 2)]
    {
        let rig = HostRig::new(HostLayout::PerLayer);
        let g = rig.geometry();
        let dir = common::TempDir::new("staged-reuse-written");
        let pool = common::create_pool(&dir, g, 8, 1, 4);
        let paths = pool.paths();
        let faults = Arc::new(Mutex::new(Faults {
            hold_flushes: true,
            ..Default::default()
        }));
        let engine = FaultEngine::open(&paths, faults.clone());
        let cfg = TierConfig::default().with_header_staging(header_staging);
        let tier = Tier::with_engine(pool, cfg, Box::new(engine)).unwrap();
        // 16 blocks in chunks of 2 through a store area of 4: 8 chunks, at
        // most 2 gathered at once.
        let mut st = rig.staged(tier, config(2, 8, area).with_store_chunk_blocks(2));
        let ks: Vec<u64> = (500..516).collect();
        let mem: Vec<u32> = (0..16).collect();
        for (k, &b) in ks.iter().zip(&mem) {
            fill(&rig, b, common::seed_of(*k));
        }
        let j = st.submit_store(&keys(&ks), &mem).unwrap();
        let bound = (area + released) as u64 * g.block_bytes();
        let written = |st: &StagedTier| st.tier().usage().engine.bytes_written;
        let deadline = Instant::now() + Duration::from_secs(10);
        while written(&st) < bound && Instant::now() < deadline {
            st.poll().unwrap();
            std::thread::sleep(Duration::from_millis(1));
        }
        for _ in 0..50 {
            st.poll().unwrap();
            std::thread::sleep(Duration::from_millis(1));
        }
        let got = written(&st);
        // Let the flushes go before judging, so a failure ends the test
        // rather than the tier waiting out held I/O when it drops.
        faults.lock().unwrap().hold_flushes = false;
        assert_eq!(
            got, bound,
            "header staging {header_staging}: the area's data and {released} written blocks' more while the flushes are held ({got} of {bound} bytes)"
        );
        let r = st.wait(j).unwrap();
        assert!(r.outcomes.iter().all(|o| *o == KeyOutcome::Done), "{r:?}");
        rig.clear();
        let j = st.submit_load(&keys(&ks), &mem, 0..g.layers).unwrap();
        assert!(st.wait(j).unwrap().all_ok());
        for (k, &b) in ks.iter().zip(&mem) {
            assert!(
                matches(&rig, b, common::seed_of(*k), 0..g.layers),
                "key {k}"
            );
        }
    }
}

#[test]
fn double_store_chunks_overlap() {
    store_chunks_overlap(&HostRig::new(HostLayout::PerLayer), "staged-overlap");
}

#[test]
fn double_corrupt_block_is_caught() {
    for l in LAYOUTS {
        corrupt_block_is_caught(&HostRig::new(l), &format!("staged-corrupt-{l:?}"));
    }
}

#[test]
fn double_large_load_goes_in_chunks() {
    for l in LAYOUTS {
        large_load_goes_in_chunks(&HostRig::new(l), &format!("staged-chunked-load-{l:?}"));
    }
}

/// As above with copies that end only when waited for
/// (`HostCopier::deferred`): a buffer is reused for a later chunk only
/// after its copy ended.
#[test]
fn double_large_load_goes_in_chunks_with_deferred_copies() {
    use kvtier::gpu::staging::HostCopier;
    struct Deferred(HostRig);
    impl KvRig for Deferred {
        fn geometry(&self) -> KvGeometry {
            self.0.geometry()
        }
        fn num_blocks(&self) -> u32 {
            self.0.num_blocks()
        }
        fn write_object(&self, block: u32, layer: u32, kv: u32, data: &[u8]) {
            self.0.write_object(block, layer, kv, data)
        }
        fn read_object(&self, block: u32, layer: u32, kv: u32) -> Vec<u8> {
            self.0.read_object(block, layer, kv)
        }
        fn clear(&self) {
            self.0.clear()
        }
        fn staged(&self, tier: Tier, cfg: StagingConfig) -> StagedTier {
            StagedTier::with_host_copier(tier, self.0 .0.clone(), cfg, HostCopier::deferred())
                .unwrap()
        }
    }
    large_load_goes_in_chunks(
        &Deferred(HostRig::new(HostLayout::PerLayer)),
        "staged-chunked-load-deferred",
    );
}

/// A copy that fails on a load's last layer (the scatter's launch, or the
/// write of the load's counter after it) still brings the load's counter
/// to that layer's value, so a compute stream waiting on it goes on rather
/// than hanging until a later load reuses the counter; the layer's event
/// and `wait_layer` say it failed, its keys fail in the result, and the
/// counter serves a next load from where it was left. On the double, whose
/// counters are host words written in stream order like a GPU's, with
/// copies immediate or deferred.
#[test]
fn double_failed_last_layer_still_releases_its_counter() {
    use kvtier::gpu::staging::HostCopier;
    let rig = HostRig::new(HostLayout::PerLayer);
    let g = rig.geometry();
    let last = g.layers - 1;
    type MakeCopier = fn() -> HostCopier;
    let copiers: [(&str, MakeCopier); 4] = [
        ("scatter", || HostCopier::default().fail_scatter(g_last())),
        ("scatter-deferred", || {
            HostCopier::deferred().fail_scatter(g_last())
        }),
        ("counter", || HostCopier::default().fail_counter(g_last())),
        ("counter-deferred", || {
            HostCopier::deferred().fail_counter(g_last())
        }),
    ];
    fn g_last() -> u32 {
        common::tiny_geometry().layers - 1
    }
    for (i, (what, copier)) in copiers.into_iter().enumerate() {
        let dir = common::TempDir::new(&format!("staged-fail-last-{i}"));
        let pool = common::create_pool(&dir, g, 64, 1, 2);
        let tier = Tier::open(pool, Default::default()).unwrap();
        let mut st =
            StagedTier::with_host_copier(tier, rig.0.clone(), config(2, 8, 8), copier()).unwrap();
        let ks: Vec<u64> = (900..904).collect();
        let mem: Vec<u32> = (0..4).collect();
        store_all(&rig, &mut st, &ks, &mem, 4);
        rig.0.clear();
        let job = st.submit_load(&keys(&ks), &mem, 0..g.layers).unwrap();
        let c = st.load_counter(job).expect("the double's load counter");
        let e = st.wait_layer(job, last).unwrap_err().to_string();
        assert!(e.contains(&format!("layer {last}")), "{what}: {e}");
        assert_eq!(
            c.counter.load().unwrap(),
            c.value_for(last),
            "{what}: a stream waiting for the failed last layer would hang"
        );
        let ev: Vec<_> = st
            .layer_events()
            .into_iter()
            .filter(|e| e.job == job)
            .collect();
        assert_eq!(ev.len(), g.layers as usize, "{what}");
        assert!(
            ev[..last as usize].iter().all(|e| e.error.is_none()),
            "{what}"
        );
        assert!(ev[last as usize].error.is_some(), "{what}");
        let r = st.wait(job).unwrap();
        assert_eq!(r.failures().count(), ks.len(), "{what}");
        // The counter is reused from the value it was left at.
        let job2 = st.submit_load(&keys(&ks), &mem, 0..2).unwrap();
        let c2 = st.load_counter(job2).unwrap();
        assert!(std::sync::Arc::ptr_eq(&c.counter, &c2.counter), "{what}");
        assert_eq!(c2.base, c.value_for(last), "{what}");
        let r2 = st.wait(job2).unwrap();
        assert!(
            r2.all_ok(),
            "{what}: {:?}",
            r2.failures().collect::<Vec<_>>()
        );
        assert_eq!(c.counter.load().unwrap(), c2.value_for(1), "{what}");
        assert!(matches(&rig, 0, common::seed_of(900), 0..2), "{what}");
    }
}

/// A chunked load (4 keys through buffers of 2) whose first chunk's copy
/// fails: every key fails (never reported loaded), every layer's event
/// says so in order, and the load's counter still reaches its last
/// layer's value.
#[test]
fn double_failed_chunk_of_a_large_load_fails_it_and_releases_its_counter() {
    use kvtier::gpu::staging::HostCopier;
    let rig = HostRig::new(HostLayout::CrossLayer);
    let g = rig.geometry();
    for (i, copier) in [
        HostCopier::default().fail_scatter(0),
        HostCopier::deferred().fail_scatter(1),
    ]
    .into_iter()
    .enumerate()
    {
        let dir = common::TempDir::new(&format!("staged-fail-chunk-{i}"));
        let pool = common::create_pool(&dir, g, 64, 1, 2);
        let tier = Tier::open(pool, Default::default()).unwrap();
        let mut st =
            StagedTier::with_host_copier(tier, rig.0.clone(), config(2, 2, 8), copier).unwrap();
        let ks: Vec<u64> = (950..954).collect();
        let mem: Vec<u32> = (10..14).collect();
        store_all(&rig, &mut st, &ks, &mem, 4);
        let job = st.submit_load(&keys(&ks), &mem, 0..g.layers).unwrap();
        let c = st.load_counter(job).unwrap();
        let r = st.wait(job).unwrap();
        assert_eq!(
            r.failures().count(),
            ks.len(),
            "{i}: {:?}",
            r.failures().collect::<Vec<_>>()
        );
        let ev: Vec<_> = st.layer_events();
        assert_eq!(
            ev.iter().map(|e| e.layer).collect::<Vec<_>>(),
            (0..g.layers).collect::<Vec<_>>(),
            "{i}"
        );
        assert!(ev.iter().all(|e| e.error.is_some()), "{i}: {ev:?}");
        assert_eq!(c.counter.load().unwrap(), c.value_for(g.layers - 1), "{i}");
        assert!(st.buffers_in_use().iter().all(Option::is_none), "{i}");
        assert_eq!(st.tier().usage().pinned_blocks, 0, "{i}");
    }
}

/// Bad staging sizes are refused with what to change, before anything is
/// allocated or registered.
#[test]
fn bad_staging_config_is_refused() {
    let dir = common::TempDir::new("staged-cfg");
    let rig = HostRig::new(HostLayout::PerLayer);
    let pool = common::create_pool(&dir, rig.geometry(), 8, 1, 2);
    let tier = Tier::open(pool, Default::default()).unwrap();
    let e = StagedTier::with_host_double(tier, rig.0.clone(), config(1, 8, 8))
        .err()
        .unwrap();
    assert!(e.to_string().contains("at least 2 layer buffers"), "{e}");
}

/// A store staging larger than the tier's header staging (every staged
/// store chunk would be refused by the tier) is refused when the staged
/// tier is built, naming both fields.
#[test]
fn store_blocks_past_the_header_staging_is_refused() {
    let rig = HostRig::new(HostLayout::PerLayer);
    for (i, (headers, store, ok)) in [(8, 8, false), (8, 9, false), (8, 7, true)]
        .into_iter()
        .enumerate()
    {
        let dir = common::TempDir::new(&format!("staged-hdr-{i}"));
        let pool = common::create_pool(&dir, rig.geometry(), 8, 1, 2);
        let tc = kvtier::tier::TierConfig::default().with_header_staging(headers);
        let tier = Tier::open(pool, tc).unwrap();
        match StagedTier::with_host_double(tier, rig.0.clone(), config(2, 4, store)) {
            Ok(_) => assert!(
                ok,
                "store_blocks {store} with header_staging {headers} accepted"
            ),
            Err(e) => {
                assert!(!ok, "{e}");
                let e = e.to_string();
                assert!(
                    e.contains("store_blocks") && e.contains("header_staging"),
                    "{e}"
                );
            }
        }
    }
}

/// The staged path behind a `TierHandle` (what the Python binding opens):
/// stores from the (stand-in) GPU memory are acknowledged durable with
/// checksums, a load into cleared memory brings the bytes back with one
/// layer event per layer in layer order before the job's end, and the
/// pool checks clean (no block unverifiable).
#[test]
fn double_behind_a_tier_handle() {
    use kvtier::handle::{Event, HandleConfig, TierBuilder};
    use kvtier::sched::Policy;
    let dir = common::TempDir::new("staged-handle");
    let rig = HostRig::new(HostLayout::CrossLayer);
    let geo = rig.geometry();
    let devs = vec![dir.file("a.pool"), dir.file("b.pool")];
    let h = TierBuilder::default()
        .create(common::pool_config(geo, 8, &devs, 4))
        .config(HandleConfig::default().with_policy(Policy::Naive))
        .staging(config(2, 16, 8))
        .staged_host_double(rig.0.clone())
        .build()
        .unwrap();
    let ks: Vec<u64> = (70..86).collect();
    let mem: Vec<u32> = (0..16).map(|i| 47 - i).collect();
    for (&k, &b) in ks.iter().zip(&mem) {
        fill(&rig, b, common::seed_of(k));
    }
    let s1 = h.submit_store(&keys(&ks[..8]), &mem[..8]).unwrap();
    let s2 = h.submit_store(&keys(&ks[8..]), &mem[8..]).unwrap();
    assert!(h.wait(s1).unwrap().all_ok());
    assert!(h.wait(s2).unwrap().all_ok());
    rig.clear();
    let events = h.completions().unwrap();
    let _ = events.drain();
    let target: Vec<u32> = (0..16).collect();
    assert_eq!(h.lookup_and_pin(&keys(&ks)), 16);
    let job = h.submit_load(&keys(&ks), &target, 0..geo.layers).unwrap();
    // The double's load counter is a host word (no stream waits on it),
    // at the last layer's value once the load is done.
    let c = h.load_counter(job).unwrap().expect("a load's counter");
    // Each layer's copy is queued (a double's mark: no GPU event) or the
    // layer is already in memory; never a mark for a layer that is not.
    for l in 0..geo.layers {
        match h.wait_layer_queued(job, l).unwrap() {
            kvtier::LayerCopy::Queued(m) => assert!(m.is_double()),
            kvtier::LayerCopy::Settled => h.wait_layer(job, l).unwrap(),
        }
    }
    assert!(
        h.wait_layer_queued(job, geo.layers).is_err(),
        "a layer the load does not have"
    );
    assert!(
        h.wait_layer_queued(s1, 0).is_err(),
        "a store's (result taken) layer"
    );
    let r = h.wait(job).unwrap();
    assert!(
        h.wait_layer_queued(job, 0).is_err(),
        "its result is taken: the job is gone"
    );
    assert_eq!(c.counter.load().unwrap(), c.value_for(geo.layers - 1));
    assert!(r.all_ok(), "{:?}", r.failures().collect::<Vec<_>>());
    h.unpin(&keys(&ks));
    for (i, &k) in ks.iter().enumerate() {
        assert!(
            matches(&rig, target[i], common::seed_of(k), 0..geo.layers),
            "key {k}"
        );
    }
    let mut layers = Vec::new();
    let mut finished = false;
    while let Some(e) = events.try_recv() {
        match e {
            Event::Layer {
                job: j,
                layer,
                error,
            } if j == job => {
                assert!(error.is_none() && !finished);
                layers.push(layer);
            }
            Event::Finished { job: j, .. } if j == job => finished = true,
            _ => {}
        }
    }
    assert!(finished);
    assert_eq!(layers, (0..geo.layers).collect::<Vec<_>>());
    h.close().unwrap();
    drop(h);
    let pool = kvtier::Pool::open(&devs, &Default::default()).unwrap();
    let report = pool.check(|_, _| {}).unwrap();
    assert_eq!(
        (report.blocks_ok, report.blocks_unverifiable),
        (16, 0),
        "{report:?}"
    );
}

/// Copies that end later than the call that starts them (as a GPU's do;
/// `HostCopier::deferred`): a layer whose reads have landed and whose copy
/// is started is neither announced nor gives up its buffer until the copy
/// is done, the next layers wait for the buffers (back-pressure), and the
/// load still completes whole and in order once the copies are waited for.
#[test]
fn double_with_deferred_copies_waits_for_them() {
    use kvtier::gpu::staging::HostCopier;
    let dir = common::TempDir::new("staged-deferred");
    let rig = HostRig::new(HostLayout::PerLayer);
    let g = rig.geometry();
    let pool = common::create_pool(&dir, g, 8, 2, 4);
    let tier = Tier::open(pool, Default::default()).unwrap();
    let mut st = StagedTier::with_host_copier(
        tier,
        rig.0.clone(),
        config(2, 16, 16),
        HostCopier::deferred(),
    )
    .unwrap();
    let ks: Vec<u64> = (300..310).collect();
    let mem: Vec<u32> = (0..10).collect();
    store_all(&rig, &mut st, &ks, &mem, 10);
    rig.clear();
    let job = st.submit_load(&keys(&ks), &mem, 0..g.layers).unwrap();
    // Poll until layers 0 and 1 have landed and their copies started.
    let t0 = std::time::Instant::now();
    while st.tier().jobs_in_flight() > 0 {
        st.poll().unwrap();
        assert!(t0.elapsed().as_secs() < 30, "the reads never landed");
    }
    st.poll().unwrap();
    assert!(
        st.layer_events().is_empty(),
        "announced before its copy was done"
    );
    assert_eq!(st.buffers_in_use(), vec![Some((job, 0)), Some((job, 1))]);
    assert!(!matches(&rig, mem[0], common::seed_of(ks[0]), 0..1));
    let r = st.wait(job).unwrap();
    assert!(r.all_ok());
    let layers: Vec<u32> = st.layer_events().iter().map(|e| e.layer).collect();
    assert_eq!(layers, (0..g.layers).collect::<Vec<_>>());
    for (i, &k) in ks.iter().enumerate() {
        assert!(
            matches(&rig, mem[i], common::seed_of(k), 0..g.layers),
            "key {k}"
        );
    }
}

/// Damage layer 0 of `key`'s block on the SSD (one byte of its K object).
fn damage_layer0(st: &StagedTier, paths: &[std::path::PathBuf], key: u64) {
    use std::os::unix::fs::FileExt;
    let slot = st
        .tier()
        .pool()
        .index()
        .get(&kvtier::pool::Key::from_u64(key))
        .unwrap()
        .slot;
    let (dev, off) = st.tier().pool().layout().object_offset(slot, 0, 0);
    let f = std::fs::OpenOptions::new()
        .write(true)
        .open(&paths[dev as usize])
        .unwrap();
    f.write_all_at(&[0x5a], off + 7).unwrap();
    f.sync_all().unwrap();
}

/// A load whose every key fails in an early layer (here: its only block is
/// corrupt in layer 0) ends with its result: the later layers are not read
/// and are announced failed, `wait` returns the per-key outcome (never an
/// error saying the job cannot progress), buffers and pins are given back.
/// Copies that end late (`HostCopier::deferred`) make the last layer job
/// land before any buffer frees, so the skip happens with nothing in flight.
#[test]
fn double_load_whose_every_key_fails_ends_with_its_result() {
    use kvtier::gpu::staging::HostCopier;
    use kvtier::tier::KeyOutcome;
    for deferred in [true, false] {
        let dir = common::TempDir::new(&format!("staged-allfail-{deferred}"));
        let rig = HostRig::new(HostLayout::PerLayer);
        let g = rig.geometry();
        let (st, paths) = staged_over(&rig, &dir, config(2, 16, 16));
        drop(st);
        let pool = kvtier::Pool::open(&paths, &Default::default()).unwrap();
        let tier = Tier::open(pool, Default::default()).unwrap();
        let copier = if deferred {
            HostCopier::deferred()
        } else {
            HostCopier::default()
        };
        let mut st =
            StagedTier::with_host_copier(tier, rig.0.clone(), config(2, 16, 16), copier).unwrap();
        store_all(&rig, &mut st, &[7], &[3], 1);
        damage_layer0(&st, &paths, 7);
        rig.clear();
        let job = st.submit_load(&keys(&[7]), &[3], 0..g.layers).unwrap();
        let r = st
            .wait(job)
            .unwrap_or_else(|e| panic!("deferred={deferred}: wait failed: {e}"));
        assert!(matches!(r.outcomes[0], KeyOutcome::Corrupt(_)), "{r:?}");
        let ev = st.layer_events();
        assert_eq!(
            ev.iter().map(|e| e.layer).collect::<Vec<_>>(),
            (0..g.layers).collect::<Vec<_>>()
        );
        assert!(ev[0].error.is_some() && ev[g.layers as usize - 1].error.is_some());
        assert!(st.buffers_in_use().iter().all(Option::is_none));
        assert_eq!(st.tier().usage().pinned_blocks, 0);
        let u = st.tier().usage();
        assert_eq!(
            u.free_blocks + u.live_blocks,
            u.total_blocks,
            "the dropped block's slot is free again once the load ends: {u:?}"
        );
        st.drain().unwrap();
    }
}

/// `StagedTier::wait_layer` keeps `Tier::wait_layer`'s contract: a layer
/// whose bytes failed verification is an error (its memory must not be
/// used), in flight or after the load ended; a layer the load does not
/// cover is refused rather than reported in memory.
#[test]
fn double_wait_layer_reports_a_failed_layer() {
    let dir = common::TempDir::new("staged-wait-layer");
    let rig = HostRig::new(HostLayout::PerLayer);
    let g = rig.geometry();
    let (mut st, paths) = staged_over(&rig, &dir, config(2, 16, 16));
    store_all(&rig, &mut st, &[1, 2], &[0, 1], 2);
    damage_layer0(&st, &paths, 2);
    rig.clear();
    let job = st
        .submit_load(&keys(&[1, 2]), &[0, 1], 0..g.layers)
        .unwrap();
    let e = st.wait_layer(job, 0).unwrap_err();
    assert_eq!(e.kind(), kvtier::ErrorKind::Corrupt, "{e}");
    let job2 = st.submit_load(&keys(&[1]), &[5], 1..g.layers).unwrap();
    let e = st.wait_layer(job2, 0).unwrap_err();
    assert!(e.to_string().contains("not a load of layer 0"), "{e}");
    st.wait_layer(job2, 1).unwrap();
    // Ended (result not yet taken): the failure still shows.
    st.drain().unwrap();
    assert!(st.wait_layer(job, g.layers - 1).is_err());
    assert!(!st.wait(job).unwrap().all_ok());
    assert!(st.wait(job2).unwrap().all_ok());
}

/// Hostile staging sizes (ones whose byte count overflows, or whose
/// blocks a P2P table cannot index) are refused with what to change: no
/// arithmetic overflow panic, no attempt to map petabytes.
#[test]
fn huge_staging_config_is_refused() {
    let rig = HostRig::new(HostLayout::PerLayer);
    for (i, cfg) in [
        config(u32::MAX, u32::MAX, u32::MAX),
        config(2, u32::MAX, 1),
        config(2, 1, u32::MAX),
        config(u32::MAX, 1 << 20, 1),
    ]
    .into_iter()
    .enumerate()
    {
        let dir = common::TempDir::new(&format!("staged-huge-cfg-{i}"));
        let pool = common::create_pool(&dir, rig.geometry(), 8, 1, 2);
        let tier = Tier::open(pool, Default::default()).unwrap();
        let e = StagedTier::with_host_double(tier, rig.0.clone(), cfg)
            .err()
            .unwrap_or_else(|| panic!("{cfg:?} accepted"));
        assert!(e.to_string().contains("staging"), "{cfg:?}: {e}");
    }
}

/// A caller's stray `unpin` (one more than its pins, as `Tier` and the
/// handle allow) cannot release a staged load's hold on its keys between
/// its layer jobs: a store that fills the pool meanwhile evicts other
/// blocks, never one the load still has to read, and the load lands whole.
/// (As tests/tier_faults.rs checks for a tier load.)
#[test]
fn double_stray_unpin_cannot_release_a_staged_loads_keys() {
    use kvtier::gpu::staging::HostCopier;
    use kvtier::staged::StagedPath;
    let dir = common::TempDir::new("staged-stray-unpin");
    let rig = HostRig::new(HostLayout::PerLayer);
    let g = rig.geometry();
    let pool = common::create_pool(&dir, g, 4, 1, 2); // 8 slots
    let mut tier = Tier::open(pool, Default::default()).unwrap();
    let mut path = StagedPath::with_host_copier(
        &mut tier,
        rig.0.clone(),
        config(2, 8, 8),
        HostCopier::deferred(),
    )
    .unwrap();
    let old: Vec<u64> = (1..9).collect();
    let old_mem: Vec<u32> = (0..8).collect();
    for (&k, &b) in old.iter().zip(&old_mem) {
        fill(&rig, b, common::seed_of(k));
    }
    let s = path.submit_store(&mut tier, &keys(&old), &old_mem).unwrap();
    assert!(path.wait(&mut tier, s).unwrap().all_ok());
    rig.clear();
    let load = path
        .submit_load(&mut tier, &keys(&[1]), &[40], 0..g.layers)
        .unwrap();
    // Layers 0 and 1 land; their copies wait, so layer 2 is not yet read.
    let t0 = std::time::Instant::now();
    while tier.jobs_in_flight() > 0 {
        path.poll(&mut tier).unwrap();
        assert!(t0.elapsed().as_secs() < 30, "the reads never landed");
    }
    tier.unpin(&keys(&[1]));
    assert_eq!(tier.usage().pinned_blocks, 1, "the load still holds key 1");
    // Eight new blocks: every unpinned block is evicted for them; with key
    // 1 held, the pool cannot take all eight and refuses the store.
    let new: Vec<u64> = (100..108).collect();
    let new_mem: Vec<u32> = (10..18).collect();
    if let Ok(s) = path.submit_store(&mut tier, &keys(&new), &new_mem) {
        let r = path.wait(&mut tier, s).unwrap();
        assert!(
            !r.evicted.contains(&kvtier::pool::Key::from_u64(1)),
            "{r:?}"
        );
    }
    let r = path.wait(&mut tier, load).unwrap();
    assert!(r.all_ok(), "{r:?}");
    assert!(matches(&rig, 40, common::seed_of(1), 0..g.layers));
    assert_eq!(tier.usage().pinned_blocks, 0);
    path.drain(&mut tier).unwrap();
}

/// Several threads on one staged `TierHandle` (the default read-first
/// policy, small staging so layer buffers and store chunks are contended):
/// each stores its own keys from its own blocks, clears them, loads them
/// back into other blocks of its own, and checks every byte; meanwhile a
/// thread looks up and pins/unpins. Everything lands, nothing hangs, and
/// the pool checks clean.
#[test]
fn double_handle_under_several_threads() {
    use kvtier::handle::TierBuilder;
    let dir = common::TempDir::new("staged-threads");
    let rig = HostRig::new(HostLayout::PerLayer);
    let cache = rig.0.clone();
    let geo = rig.geometry();
    let devs = vec![dir.file("a.pool"), dir.file("b.pool")];
    let h = TierBuilder::default()
        .create(common::pool_config(geo, 8, &devs, 8))
        .staging(config(2, 6, 3))
        .staged_host_double(cache.clone())
        .build()
        .unwrap();
    const THREADS: u64 = 4;
    const ROUNDS: u64 = 5;
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let looker = {
        let h = h.clone();
        let stop = stop.clone();
        std::thread::spawn(move || {
            let ks = keys(&(0..THREADS * 100).collect::<Vec<_>>());
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                let n = h.lookup_and_pin(&ks[..8]);
                h.unpin(&ks[..n]);
                let _ = h.usage().unwrap();
            }
        })
    };
    let workers: Vec<_> = (0..THREADS)
        .map(|t| {
            let h = h.clone();
            let cache = cache.clone();
            std::thread::spawn(move || {
                // Blocks 12t..12t+6 to store from, 12t+6..12t+12 to load into.
                let src: Vec<u32> = (0..6).map(|i| 12 * t as u32 + i).collect();
                let dst: Vec<u32> = (0..6).map(|i| 12 * t as u32 + 6 + i).collect();
                for round in 0..ROUNDS {
                    let ks: Vec<u64> = (0..6).map(|i| 1000 * (t + 1) + 10 * round + i).collect();
                    for (&k, &b) in ks.iter().zip(&src) {
                        cache.fill_block(b, common::seed_of(k));
                    }
                    let s = loop {
                        match h.submit_store(&keys(&ks), &src) {
                            Ok(s) => break s,
                            Err(e) if e.kind() == kvtier::ErrorKind::Backpressure => {
                                std::thread::yield_now()
                            }
                            Err(e) => panic!("store: {e}"),
                        }
                    };
                    let r = h.wait(s).unwrap();
                    assert!(r.all_ok(), "thread {t} round {round}: {r:?}");
                    for &b in &dst {
                        cache.write_object(b, 0, 0, &vec![0u8; geo.object_bytes() as usize]);
                    }
                    assert_eq!(h.lookup_and_pin(&keys(&ks)), 6);
                    let l = h.submit_load(&keys(&ks), &dst, 0..geo.layers).unwrap();
                    h.unpin(&keys(&ks));
                    for layer in 0..geo.layers {
                        h.wait_layer(l, layer).unwrap();
                    }
                    let r = h.wait(l).unwrap();
                    assert!(r.all_ok(), "thread {t} round {round}: {r:?}");
                    for (&k, &b) in ks.iter().zip(&dst) {
                        assert!(
                            cache.block_matches(b, common::seed_of(k), 0..geo.layers),
                            "thread {t} round {round} key {k}: wrong bytes"
                        );
                    }
                }
            })
        })
        .collect();
    for w in workers {
        w.join().unwrap();
    }
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    looker.join().unwrap();
    h.close().unwrap();
    drop(h);
    let pool = kvtier::Pool::open(&devs, &Default::default()).unwrap();
    let report = pool.check(|_, _| {}).unwrap();
    assert_eq!(report.blocks_unverifiable, 0, "{report:?}");
    assert_eq!(report.blocks_ok, THREADS * ROUNDS * 6, "{report:?}");
}

/// A staged store larger than the store staging goes out in chunks whose
/// outcomes land at their own keys' positions, also when a later chunk is
/// refused (the pool full of pinned blocks): the keys stored are `Done`
/// and in the pool, the refused ones `Failed` and not, positions intact.
#[test]
fn double_chunked_store_outcomes_map_to_their_keys() {
    use kvtier::staged::StagedPath;
    use kvtier::tier::KeyOutcome;
    let dir = common::TempDir::new("staged-chunks");
    let rig = HostRig::new(HostLayout::CrossLayer);
    let pool = common::create_pool(&dir, rig.geometry(), 4, 1, 2); // 8 slots
    let mut tier = Tier::open(pool, Default::default()).unwrap();
    let mut path = StagedPath::with_host_double(&mut tier, rig.0.clone(), config(2, 8, 2)).unwrap();
    let old: Vec<u64> = (1..6).collect();
    let old_mem: Vec<u32> = (0..5).collect();
    for (&k, &b) in old.iter().zip(&old_mem) {
        fill(&rig, b, common::seed_of(k));
    }
    let s = path.submit_store(&mut tier, &keys(&old), &old_mem).unwrap();
    assert!(path.wait(&mut tier, s).unwrap().all_ok());
    assert_eq!(tier.lookup_and_pin(&keys(&old)), 5); // 3 slots left
                                                     // Chunks of 2: [50, 51] [52, 1 (already stored)] [53, 54].
    let ks = [50, 51, 52, 1, 53, 54];
    let mem: Vec<u32> = (10..16).collect();
    for (&k, &b) in ks.iter().zip(&mem) {
        fill(&rig, b, common::seed_of(k));
    }
    let s = path.submit_store(&mut tier, &keys(&ks), &mem).unwrap();
    let r = path.wait(&mut tier, s).unwrap();
    assert_eq!(r.keys, keys(&ks));
    assert_eq!(
        r.outcomes[..4],
        [
            KeyOutcome::Done,
            KeyOutcome::Done,
            KeyOutcome::Done,
            KeyOutcome::AlreadyStored
        ],
        "{r:?}"
    );
    assert!(
        r.outcomes[4..]
            .iter()
            .all(|o| matches!(o, KeyOutcome::Failed(_))),
        "{r:?}"
    );
    for (i, &k) in ks.iter().enumerate() {
        assert_eq!(
            tier.contains(&kvtier::pool::Key::from_u64(k)),
            i < 4,
            "key {k}"
        );
    }
    tier.unpin(&keys(&old));
    rig.clear();
    let l = path
        .submit_load(
            &mut tier,
            &keys(&ks[..3]),
            &[20, 21, 22],
            0..rig.geometry().layers,
        )
        .unwrap();
    assert!(path.wait(&mut tier, l).unwrap().all_ok());
    for (i, &k) in ks[..3].iter().enumerate() {
        assert!(
            matches(
                &rig,
                20 + i as u32,
                common::seed_of(k),
                0..rig.geometry().layers
            ),
            "key {k}"
        );
    }
    path.drain(&mut tier).unwrap();
}

/// Dropping (or closing) a staged handle with loads, issued stores and
/// deferred stores all in flight returns (no hang), and what reached the
/// pool verifies: no block is left unverifiable or damaged.
#[test]
fn double_handle_drop_with_staged_jobs_in_flight() {
    use kvtier::handle::TierBuilder;
    for close in [false, true] {
        let dir = common::TempDir::new(&format!("staged-drop-{close}"));
        let rig = HostRig::new(HostLayout::PerLayer);
        let geo = rig.geometry();
        let devs = vec![dir.file("a.pool"), dir.file("b.pool")];
        let h = TierBuilder::default()
            .create(common::pool_config(geo, 8, &devs, 4))
            .staging(config(2, 8, 2))
            .staged_host_double(rig.0.clone())
            .build()
            .unwrap();
        let ks: Vec<u64> = (0..8).collect();
        let src: Vec<u32> = (0..8).collect();
        for (&k, &b) in ks.iter().zip(&src) {
            fill(&rig, b, common::seed_of(k));
        }
        let s = h.submit_store(&keys(&ks), &src).unwrap();
        assert!(h.wait(s).unwrap().all_ok());
        let t0 = std::time::Instant::now();
        let _l = h
            .submit_load(&keys(&ks), &(20..28).collect::<Vec<_>>(), 0..geo.layers)
            .unwrap();
        let more: Vec<u64> = (100..108).collect();
        for (&k, &b) in more.iter().zip(&src) {
            fill(&rig, b, common::seed_of(k));
        }
        let _s = h.submit_store(&keys(&more), &src).unwrap();
        if close {
            h.close().unwrap();
        }
        drop(h);
        assert!(t0.elapsed().as_secs() < 30, "drop took {:?}", t0.elapsed());
        let pool = kvtier::Pool::open(&devs, &Default::default()).unwrap();
        let report = pool.check(|_, _| {}).unwrap();
        assert_eq!(report.blocks_unverifiable, 0, "{report:?}");
        assert!(report.blocks_ok >= 8, "{report:?}");
        assert_eq!(report.blocks_ok, pool.index().live(), "{report:?}");
    }
}

/// A staged store larger than the store staging does not hold the handle
/// up while its later chunks wait for staging: with the device holding
/// every I/O, the store's first chunk cannot finish, yet lookups, a load's
/// submission and another store's acceptance return at once (the handle's
/// threading contract: the I/O thread never holds the index lock while it
/// waits for a device). Once the device goes on, every key lands.
#[test]
fn double_handle_chunked_store_does_not_block_the_handle() {
    use common::fault::{FaultEngine, Faults};
    use kvtier::handle::{HandleConfig, TierBuilder};
    use kvtier::sched::Policy;
    use std::sync::mpsc;
    use std::sync::Mutex;
    use std::time::Duration;
    let dir = common::TempDir::new("staged-chunk-block");
    let rig = HostRig::new(HostLayout::PerLayer);
    let geo = rig.geometry();
    let faults = Arc::new(Mutex::new(Faults::default()));
    let f = faults.clone();
    let pcfg = common::pool_config(geo, 8, &[dir.file("a.pool"), dir.file("b.pool")], 4);
    let h = TierBuilder::default()
        .custom_engine(move || {
            let pool = kvtier::Pool::create(&pcfg)?;
            let eng = common::uring_of(&pool)?;
            Ok((pool, Box::new(FaultEngine::wrap(eng, f)) as _))
        })
        .config(HandleConfig::default().with_policy(Policy::Naive))
        .staging(config(2, 8, 2))
        .staged_host_double(rig.0.clone())
        .build()
        .unwrap();
    let old: Vec<u64> = (1..3).collect();
    for (&k, b) in old.iter().zip(0..) {
        fill(&rig, b, common::seed_of(k));
    }
    let s0 = h.submit_store(&keys(&old), &[0, 1]).unwrap();
    assert!(h.wait(s0).unwrap().all_ok());
    faults.lock().unwrap().hold = true;
    let ks: Vec<u64> = (10..16).collect();
    let mem: Vec<u32> = (10..16).collect();
    for (&k, &b) in ks.iter().zip(&mem) {
        fill(&rig, b, common::seed_of(k));
    }
    let s = h.submit_store(&keys(&ks), &mem).unwrap(); // 3 chunks of 2
                                                       // Let the I/O thread issue it and reach its second chunk.
    std::thread::sleep(Duration::from_millis(200));
    let (tx, rx) = mpsc::channel();
    let h2 = h.clone();
    let probe = std::thread::spawn(move || {
        let n = h2.lookup_prefix(&keys(&[1, 2]));
        let l = h2.submit_load(&keys(&[1, 2]), &[30, 31], 0..1);
        let s = h2.submit_store(&keys(&[40]), &[40]);
        tx.send((n, l.is_ok(), s.is_ok())).unwrap();
    });
    let got = rx.recv_timeout(Duration::from_secs(10));
    faults.lock().unwrap().hold = false;
    probe.join().unwrap();
    assert_eq!(
        got,
        Ok((2, true, true)),
        "the handle was held up by a store waiting for staging"
    );
    let r = h.wait(s).unwrap();
    assert!(r.all_ok(), "{r:?}");
    h.close().unwrap();
}

/// Chunks of a staged store that wait for staging are gathered later, so
/// their memory blocks still hold the data to store: a load into them is
/// refused until the store has gathered them (else the store would take
/// the load's bytes, with checksums to match, under its keys).
#[test]
fn double_load_into_blocks_of_a_store_not_yet_gathered_is_refused() {
    let dir = common::TempDir::new("staged-pending-gather");
    let rig = HostRig::new(HostLayout::PerLayer);
    let g = rig.geometry();
    let (mut st, _) = staged_over(&rig, &dir, config(2, 8, 2));
    store_all(&rig, &mut st, &[1], &[40], 1);
    let ks: Vec<u64> = (10..16).collect();
    let mem: Vec<u32> = (10..16).collect();
    for (&k, &b) in ks.iter().zip(&mem) {
        fill(&rig, b, common::seed_of(k));
    }
    let s = st.submit_store(&keys(&ks), &mem).unwrap(); // chunks of 2
    let e = st.submit_load(&keys(&[1]), &[15], 0..g.layers).unwrap_err();
    assert!(e.to_string().contains("not yet gathered"), "{e}");
    let r = st.wait(s).unwrap();
    assert!(r.all_ok(), "{r:?}");
    let l = st.submit_load(&keys(&[1]), &[15], 0..g.layers).unwrap();
    assert!(st.wait(l).unwrap().all_ok());
    rig.clear();
    let l = st.submit_load(&keys(&ks), &mem, 0..g.layers).unwrap();
    assert!(st.wait(l).unwrap().all_ok());
    for (&k, &b) in ks.iter().zip(&mem) {
        assert!(matches(&rig, b, common::seed_of(k), 0..g.layers), "key {k}");
    }
}

/// Damage layer `layer` of `key`'s block on the SSD.
fn damage_layer(st: &StagedTier, paths: &[std::path::PathBuf], key: u64, layer: u32) {
    use std::os::unix::fs::FileExt;
    let slot = st
        .tier()
        .pool()
        .index()
        .get(&kvtier::pool::Key::from_u64(key))
        .unwrap()
        .slot;
    let (dev, off) = st.tier().pool().layout().object_offset(slot, layer, 1);
    let f = std::fs::OpenOptions::new()
        .write(true)
        .open(&paths[dev as usize])
        .unwrap();
    f.write_all_at(&[0xa5], off + 3).unwrap();
    f.sync_all().unwrap();
}

/// Two loads share a key (a common prefix) whose block is damaged in a late
/// layer: the load that finds it first drops it from the pool. The other
/// load fails that key only; its other keys still land whole (its later
/// layer jobs used to name the dropped key, which the tier refused, and
/// every key of the load failed).
#[test]
fn double_key_dropped_by_another_load_fails_only_that_key() {
    use kvtier::tier::KeyOutcome;
    let dir = common::TempDir::new("staged-shared-corrupt");
    let rig = HostRig::new(HostLayout::PerLayer);
    let g = rig.geometry();
    let (mut st, paths) = staged_over(&rig, &dir, config(2, 8, 8));
    store_all(&rig, &mut st, &[1, 2], &[0, 1], 2);
    damage_layer(&st, &paths, 1, g.layers - 1);
    rig.clear();
    let b = st.submit_load(&keys(&[1]), &[10], 0..g.layers).unwrap();
    let a = st
        .submit_load(&keys(&[1, 2]), &[20, 21], 0..g.layers)
        .unwrap();
    let ra = st.wait(a).unwrap();
    let rb = st.wait(b).unwrap();
    // The layer from which key 1 was left out says so.
    let ev: Vec<_> = st
        .layer_events()
        .into_iter()
        .filter(|e| e.job == a)
        .collect();
    assert_eq!(ev.len(), g.layers as usize);
    assert!(ev.iter().any(|e| e.error.is_some()), "{ev:?}");
    assert!(!rb.all_ok(), "{rb:?}");
    assert!(!ra.outcomes[0].is_ok(), "{ra:?}");
    assert_eq!(ra.outcomes[1], KeyOutcome::Done, "{ra:?}");
    assert!(matches(&rig, 21, common::seed_of(2), 0..g.layers));
    let u = st.tier().usage();
    assert_eq!(u.pinned_blocks, 0);
    assert_eq!(u.free_blocks + u.live_blocks, u.total_blocks, "{u:?}");
}

/// Two staged loads into one memory block would scatter either's bytes
/// under both announcements: the second is refused until the first ends,
/// and the key it asked for stays served.
#[test]
fn double_second_load_into_a_block_under_load_is_refused() {
    let dir = common::TempDir::new("staged-double-load");
    let rig = HostRig::new(HostLayout::PerLayer);
    let g = rig.geometry();
    let (mut st, _) = staged_over(&rig, &dir, config(2, 8, 2));
    store_all(&rig, &mut st, &[1, 2], &[40, 41], 1);
    let a = st.submit_load(&keys(&[1]), &[7], 0..g.layers).unwrap();
    let e = st.submit_load(&keys(&[2]), &[7], 0..g.layers).unwrap_err();
    assert!(e.to_string().contains("target of a load in flight"), "{e}");
    assert!(st.wait(a).unwrap().all_ok());
    let b = st.submit_load(&keys(&[2]), &[7], 0..g.layers).unwrap();
    assert!(st.wait(b).unwrap().all_ok());
    assert!(st.tier().contains(&keys(&[2])[0]));
}

/// Every layer of a clean load is marked "copy queued" once (the mark a
/// compute stream waits on instead of the host waiting for the copy), in
/// layer order, never after that layer's event; a layer whose copy failed
/// gets no mark, only its failed event (the host must learn which blocks
/// to drop). With copies immediate and deferred (a GPU's, ending later).
#[test]
fn double_layers_are_marked_when_their_copy_is_queued() {
    use kvtier::gpu::staging::HostCopier;
    let rig = HostRig::new(HostLayout::PerLayer);
    let g = rig.geometry();
    let last = g.layers - 1;
    type MakeCopier = fn() -> HostCopier;
    let copiers: [(&str, MakeCopier, bool); 3] = [
        ("immediate", HostCopier::default, false),
        ("deferred", HostCopier::deferred, false),
        (
            "deferred, last layer fails",
            || HostCopier::deferred().fail_scatter(common::tiny_geometry().layers - 1),
            true,
        ),
    ];
    for (i, (what, copier, fails)) in copiers.into_iter().enumerate() {
        let dir = common::TempDir::new(&format!("staged-marks-{i}"));
        let pool = common::create_pool(&dir, g, 64, 1, 2);
        let tier = Tier::open(pool, Default::default()).unwrap();
        let mut st =
            StagedTier::with_host_copier(tier, rig.0.clone(), config(2, 8, 8), copier()).unwrap();
        let ks: Vec<u64> = (900..904).collect();
        let mem: Vec<u32> = (0..4).collect();
        store_all(&rig, &mut st, &ks, &mem, 4);
        st.layers_queued();
        rig.0.clear();
        let job = st.submit_load(&keys(&ks), &mem, 0..g.layers).unwrap();
        // (layer, drain round) of each mark and each event.
        let mut marks = Vec::new();
        let mut events = Vec::new();
        let mut round = 0;
        let mut idle = 0;
        while events.len() < g.layers as usize {
            let seen = marks.len() + events.len();
            if idle > 1000 {
                // Deferred copies end only when waited for, as a GPU's
                // are seen to end only by a wait or a query.
                let _ = st.wait_layer(job, events.len() as u32);
                idle = 0;
            } else {
                st.poll().unwrap();
            }
            for q in st.layers_queued() {
                assert_eq!(q.job, job, "{what}");
                assert!(
                    q.mark.is_double(),
                    "{what}: the double's copies have no GPU event"
                );
                marks.push((q.layer, round));
            }
            for e in st.layer_events().into_iter().filter(|e| e.job == job) {
                events.push((e.layer, round, e.error.is_some()));
            }
            round += 1;
            idle = if marks.len() + events.len() == seen {
                idle + 1
            } else {
                0
            };
            assert!(round < 1_000_000, "{what}: the load never ended");
            std::thread::yield_now();
        }
        let want: Vec<u32> = if fails {
            (0..last).collect()
        } else {
            (0..g.layers).collect()
        };
        assert_eq!(
            marks.iter().map(|m| m.0).collect::<Vec<_>>(),
            want,
            "{what}"
        );
        for &(layer, r) in &marks {
            let (_, er, failed) = events[layer as usize];
            assert!(r <= er, "{what}: layer {layer} marked after its event");
            assert!(!failed, "{what}: a failed layer {layer} was marked");
        }
        assert_eq!(events[last as usize].2, fails, "{what}");
        let r = st.wait(job).unwrap();
        assert_eq!(r.all_ok(), !fails, "{what}");
    }
}

/// A load's first layer is read alone: no buffer holds a later layer until
/// every unit (chunk) of the first layer has landed, so the layer a compute
/// stream waits for first does not share the disk with the ones after it.
/// Whole-layer units and a first layer of two chunks; the bytes all land.
#[test]
fn double_first_layer_is_read_alone() {
    use kvtier::gpu::staging::HostCopier;
    let rig = HostRig::new(HostLayout::PerLayer);
    let g = rig.geometry();
    assert!(g.layers >= 2, "the tiny model has several layers");
    for (i, load_blocks) in [8u32, 4].into_iter().enumerate() {
        let dir = common::TempDir::new(&format!("staged-first-alone-{i}"));
        let pool = common::create_pool(&dir, g, 64, 1, 2);
        let tier = Tier::open(pool, Default::default()).unwrap();
        let cfg = config(4, load_blocks, 8);
        let mut st =
            StagedTier::with_host_copier(tier, rig.0.clone(), cfg, HostCopier::deferred()).unwrap();
        let ks: Vec<u64> = (500..508).collect();
        let mem: Vec<u32> = (10..18).collect();
        store_all(&rig, &mut st, &ks, &mem, 8);
        rig.0.clear();
        let job = st.submit_load(&keys(&ks), &mem, 0..g.layers).unwrap();
        let held: Vec<_> = st.buffers_in_use().into_iter().flatten().collect();
        let chunks = 8 / load_blocks as usize;
        assert_eq!(
            held,
            vec![(job, 0); chunks],
            "load_blocks {load_blocks}: only the first layer's units may be read at first"
        );
        st.wait_layer(job, 0).unwrap();
        let r = st.wait(job).unwrap();
        assert!(r.all_ok(), "{:?}", r.failures().collect::<Vec<_>>());
        for (k, &b) in ks.iter().zip(&mem) {
            assert!(
                matches(&rig, b, common::seed_of(*k), 0..g.layers),
                "key {k}"
            );
        }
    }
}

/// A caller that never collects the copy marks does not gather them: after
/// many loads, only the last finished load's marks are still held (each
/// would hold a CUDA event on a GPU).
#[test]
fn double_uncollected_marks_are_bounded() {
    let rig = HostRig::new(HostLayout::PerLayer);
    let g = rig.geometry();
    let dir = common::TempDir::new("staged-marks-bounded");
    let (mut st, _) = staged_over(&rig, &dir, config(2, 8, 8));
    let ks: Vec<u64> = (700..704).collect();
    let mem: Vec<u32> = (0..4).collect();
    store_all(&rig, &mut st, &ks, &mem, 4);
    for _ in 0..20 {
        let job = st.submit_load(&keys(&ks), &mem, 0..g.layers).unwrap();
        assert!(st.wait(job).unwrap().all_ok());
    }
    let held = st.layers_queued();
    assert!(
        held.len() <= g.layers as usize,
        "{} marks held after 20 loads of {} layers",
        held.len(),
        g.layers
    );
}
