//! The staged HBM path on the CPU: host memory stands in for the GPU's KV
//! memory and `HostCopier` (a test double) does the copies the staging
//! kernels do on a GPU. tests/gpu.rs runs the same checks
//! (tests/common/staged.rs) on device memory with the real kernels.

mod common;
#[path = "common/staged.rs"]
mod staged;

use kvtier::gpu::staged::{StagedTier, StagingConfig};
use kvtier::tier::Tier;
use kvtier::{HostKvCache, HostLayout, KvGeometry};
use staged::*;
use std::sync::Arc;

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

#[test]
fn double_corrupt_block_is_caught() {
    for l in LAYOUTS {
        corrupt_block_is_caught(&HostRig::new(l), &format!("staged-corrupt-{l:?}"));
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
    // The double has no GPU counters: nothing for a compute stream to wait on.
    assert!(h.load_counter(job).unwrap().is_none());
    let r = h.wait(job).unwrap();
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
