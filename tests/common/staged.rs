//! The staged HBM path's tests, shared by the CPU run (tests/staged.rs:
//! host memory standing in for HBM, `HostCopier` doing the kernels' copies,
//! a test double) and the GPU run (tests/gpu.rs: device memory and the
//! staging kernels). Both run every check here, against a [`KvRig`].

use crate::common::*;
use kvtier::memory::pattern_fill;
use kvtier::pool::{Key, OpenExpect, Pool};
use kvtier::staged::{StagedTier, StagingConfig};
use kvtier::tier::{KeyOutcome, Tier, TierConfig};
use kvtier::{HostLayout, KvGeometry};
use std::os::unix::fs::FileExt;
use std::path::PathBuf;

/// KV memory the staged tier serves, and the test's view of its bytes.
pub trait KvRig {
    fn geometry(&self) -> KvGeometry;
    fn num_blocks(&self) -> u32;
    fn write_object(&self, block: u32, layer: u32, kv: u32, data: &[u8]);
    fn read_object(&self, block: u32, layer: u32, kv: u32) -> Vec<u8>;
    fn clear(&self);
    /// A staged tier serving this memory over `tier`.
    fn staged(&self, tier: Tier, cfg: StagingConfig) -> StagedTier;
}

pub fn keys(ks: &[u64]) -> Vec<Key> {
    ks.iter().map(|&k| Key::from_u64(k)).collect()
}

fn object(seed: u64, layer: u32, kv: u32, g: &KvGeometry) -> Vec<u8> {
    let mut b = vec![0u8; g.object_bytes() as usize];
    pattern_fill(&mut b, seed, layer, kv);
    b
}

pub fn fill(rig: &dyn KvRig, block: u32, seed: u64) {
    let g = rig.geometry();
    for layer in 0..g.layers {
        for kv in 0..2 {
            rig.write_object(block, layer, kv, &object(seed, layer, kv, &g));
        }
    }
}

/// Layers `layers` of `block` hold what `fill(block, seed)` wrote.
pub fn matches(rig: &dyn KvRig, block: u32, seed: u64, layers: std::ops::Range<u32>) -> bool {
    let g = rig.geometry();
    layers
        .into_iter()
        .all(|l| (0..2).all(|kv| rig.read_object(block, l, kv) == object(seed, l, kv, &g)))
}

/// A pool of 64 slots over 2 files, served by a staged tier over `rig`.
pub fn staged_over(
    rig: &dyn KvRig,
    dir: &TempDir,
    cfg: StagingConfig,
) -> (StagedTier, Vec<PathBuf>) {
    let pool = create_pool(dir, rig.geometry(), 8, 2, 4);
    let paths = pool.paths();
    let tier = Tier::open(pool, TierConfig::default()).unwrap();
    (rig.staged(tier, cfg), paths)
}

pub fn config(layer_buffers: u32, load_blocks: u32, store_blocks: u32) -> StagingConfig {
    StagingConfig::new(layer_buffers, load_blocks, store_blocks)
}

/// Fill `mem` with the keys' patterns and store them, `chunk` keys a job.
pub fn store_all(rig: &dyn KvRig, st: &mut StagedTier, ks: &[u64], mem: &[u32], chunk: usize) {
    for (k, &b) in ks.iter().zip(mem) {
        fill(rig, b, seed_of(*k));
    }
    let mut jobs = Vec::new();
    for (kc, mc) in ks.chunks(chunk).zip(mem.chunks(chunk)) {
        jobs.push(st.submit_store(&keys(kc), mc).unwrap());
    }
    for j in jobs {
        let r = st.wait(j).unwrap();
        assert!(r.all_ok(), "store: {:?}", r.failures().collect::<Vec<_>>());
    }
}

/// Random (pattern) contents of scattered blocks go through the pool and
/// back into cleared memory at other blocks: bytes identical, layer events
/// in layer order with growing counter values, every layer in memory when
/// its event is out; the stored headers carry the crc32c the CPU computes
/// of the bytes (taken on the GPU), so `pool check` verifies every block.
pub fn round_trip(rig: &dyn KvRig, tag: &str) {
    let dir = TempDir::new(tag);
    let g = rig.geometry();
    let (mut st, _) = staged_over(rig, &dir, config(2, 40, 16));
    let ks: Vec<u64> = (500..540).collect();
    let mem: Vec<u32> = (0..40).map(|i| (i * 7 + 3) % rig.num_blocks()).collect();
    store_all(rig, &mut st, &ks, &mem, 16);
    assert_eq!(st.tier().lookup_prefix(&keys(&ks)), 40);
    for &k in &ks {
        let e = st
            .tier()
            .pool()
            .index()
            .get(&Key::from_u64(k))
            .copied()
            .unwrap();
        for l in 0..g.layers {
            let mut want = object(seed_of(k), l, 0, &g);
            want.extend(object(seed_of(k), l, 1, &g));
            assert_eq!(
                st.tier().pool().layer_crc(e.slot, l),
                Some(crc32c::crc32c(&want)),
                "key {k} layer {l}: header checksum"
            );
        }
    }
    let report = st.tier().pool().check(|_, _| {}).unwrap();
    assert_eq!(report.blocks_ok, 40, "{report:?}");
    assert_eq!(report.blocks_unverifiable, 0, "{report:?}");

    rig.clear();
    let target: Vec<u32> = (0..40).map(|i| rig.num_blocks() - 1 - i).collect();
    let first = st.next_counter_value();
    let job = st.submit_load(&keys(&ks), &target, 0..g.layers).unwrap();
    let mut events = Vec::new();
    for layer in 0..g.layers {
        st.wait_layer(job, layer).unwrap();
        for (i, &k) in ks.iter().enumerate() {
            assert!(
                matches(rig, target[i], seed_of(k), 0..layer + 1),
                "layer {layer} of key {k} not in memory after wait_layer"
            );
        }
        events.extend(st.layer_events());
    }
    let r = st.wait(job).unwrap();
    assert!(r.all_ok(), "{:?}", r.failures().collect::<Vec<_>>());
    events.extend(st.layer_events());
    let layers: Vec<u32> = events.iter().map(|e| e.layer).collect();
    assert_eq!(
        layers,
        (0..g.layers).collect::<Vec<_>>(),
        "layer events in order"
    );
    let counters: Vec<u32> = events.iter().map(|e| e.counter).collect();
    assert_eq!(counters, (first..first + g.layers).collect::<Vec<_>>());
    assert!(events.iter().all(|e| e.error.is_none()));
    assert_eq!(st.tier().usage().pinned_blocks, 0, "a finished load unpins");
    assert!(st.buffers_in_use().iter().all(Option::is_none));
}

/// Layer buffers are used round-robin and a layer waits while its buffer
/// is busy: with 2 buffers, a 4-layer load first reads layer 0 alone (the
/// layer a compute stream waits for first gets the disk to itself); once
/// layer 0 is in memory, layers 1 and 2 follow and layer 2 takes buffer 0.
/// Two loads in flight share the buffers and both land whole.
pub fn round_robin_and_back_pressure(rig: &dyn KvRig, tag: &str) {
    let dir = TempDir::new(tag);
    let g = rig.geometry();
    assert!(g.layers >= 4);
    let (mut st, _) = staged_over(rig, &dir, config(2, 16, 16));
    let ks: Vec<u64> = (0..24).collect();
    let mem: Vec<u32> = (0..24).collect();
    store_all(rig, &mut st, &ks, &mem, 12);
    rig.clear();
    let a = st
        .submit_load(&keys(&ks[..12]), &mem[..12], 0..g.layers)
        .unwrap();
    assert_eq!(
        st.buffers_in_use(),
        vec![Some((a, 0)), None],
        "the first layer alone"
    );
    st.wait_layer(a, 0).unwrap();
    assert_eq!(
        st.buffers_in_use()[0],
        Some((a, 2)),
        "buffer 0 reused for layer 2"
    );
    let b = st
        .submit_load(&keys(&ks[12..]), &mem[12..], 1..g.layers)
        .unwrap();
    let ra = st.wait(a).unwrap();
    let rb = st.wait(b).unwrap();
    assert!(ra.all_ok() && rb.all_ok());
    let mut per_job: std::collections::HashMap<u64, Vec<u32>> = Default::default();
    for e in st.layer_events() {
        per_job.entry(e.job).or_default().push(e.layer);
    }
    assert_eq!(per_job[&a], (0..g.layers).collect::<Vec<_>>());
    assert_eq!(per_job[&b], (1..g.layers).collect::<Vec<_>>());
    for (i, &k) in ks.iter().enumerate() {
        let from = if i < 12 { 0 } else { 1 };
        assert!(matches(rig, mem[i], seed_of(k), from..g.layers), "key {k}");
    }
}

/// Store staging is bounded: a store larger than it goes out in chunks
/// (one job, outcomes in key order, every key stored); stores beyond what is
/// free wait for earlier ones and land; a load larger than a layer buffer
/// goes in chunks and lands whole.
pub fn store_staging_is_bounded(rig: &dyn KvRig, tag: &str) {
    let dir = TempDir::new(tag);
    let (mut st, _) = staged_over(rig, &dir, config(2, 8, 4));
    let big: Vec<u64> = (200..210).collect();
    let big_mem: Vec<u32> = (20..30).collect();
    for (k, &b) in big.iter().zip(&big_mem) {
        fill(rig, b, seed_of(*k));
    }
    let j = st.submit_store(&keys(&big), &big_mem).unwrap();
    let r = st.wait(j).unwrap();
    assert_eq!(r.keys, keys(&big));
    assert!(r.outcomes.iter().all(|o| *o == KeyOutcome::Done), "{r:?}");
    assert_eq!(st.tier().lookup_prefix(&keys(&big)), 10);
    let ks: Vec<u64> = (100..112).collect();
    let mem: Vec<u32> = (0..12).collect();
    store_all(rig, &mut st, &ks, &mem, 4); // 3 stores of 4 into 4 places
    assert_eq!(st.tier().lookup_prefix(&keys(&ks)), 12);
    // Larger than a layer buffer (8): read and copied in chunks, whole.
    rig.clear();
    let j = st.submit_load(&keys(&ks), &mem, 0..2).unwrap();
    assert!(st.wait(j).unwrap().all_ok());
    for (k, &b) in ks.iter().zip(&mem) {
        assert!(matches(rig, b, seed_of(*k), 0..2), "key {k}");
    }
    assert_eq!(st.tier().usage().pinned_blocks, 0, "a finished load unpins");
    rig.clear();
    let j = st
        .submit_load(&keys(&big[..8]), &big_mem[..8], 0..rig.geometry().layers)
        .unwrap();
    assert!(st.wait(j).unwrap().all_ok());
    for (k, &b) in big[..8].iter().zip(&big_mem) {
        assert!(
            matches(rig, b, seed_of(*k), 0..rig.geometry().layers),
            "key {k}"
        );
    }
}

/// A store area of several chunks keeps several chunks' writes in flight:
/// submitting a store of 10 blocks into an area of 8 in chunks of 2 hands
/// 4 chunks to the tier before returning (each gathered while the ones
/// before are being written), the fifth once one of them is written; every key
/// is stored whole. One chunk of the whole area (the old staging) had one
/// write in flight, its disk idle while the next chunk was gathered.
pub fn store_chunks_overlap(rig: &dyn KvRig, tag: &str) {
    let dir = TempDir::new(tag);
    let (mut st, _) = staged_over(rig, &dir, config(2, 8, 8).with_store_chunk_blocks(2));
    let ks: Vec<u64> = (300..310).collect();
    let mem: Vec<u32> = (0..10).collect();
    for (k, &b) in ks.iter().zip(&mem) {
        fill(rig, b, seed_of(*k));
    }
    let j = st.submit_store(&keys(&ks), &mem).unwrap();
    assert_eq!(
        st.path().store_chunks_in_flight(),
        4,
        "chunks of 2 in an area of 8: 4 writes in flight at once"
    );
    let r = st.wait(j).unwrap();
    assert!(r.outcomes.iter().all(|o| *o == KeyOutcome::Done), "{r:?}");
    assert_eq!(st.path().store_chunks_in_flight(), 0);
    rig.clear();
    let layers = rig.geometry().layers;
    let j = st.submit_load(&keys(&ks), &mem, 0..layers).unwrap();
    assert!(st.wait(j).unwrap().all_ok());
    for (k, &b) in ks.iter().zip(&mem) {
        assert!(matches(rig, b, seed_of(*k), 0..layers), "key {k}");
    }
    // The defaults keep several chunks in flight too.
    let d = StagingConfig::for_blocks(rig.num_blocks());
    assert!(
        d.store_blocks / d.store_chunk() >= 2 || d.store_blocks == 1,
        "{d:?}"
    );
}

/// A block whose bytes on the SSD changed after the store is caught when
/// its layer lands in staging (Corrupt, never copied on), the layer's event
/// says so, the other keys load whole, and the block leaves the pool.
pub fn corrupt_block_is_caught(rig: &dyn KvRig, tag: &str) {
    let dir = TempDir::new(tag);
    let g = rig.geometry();
    let (mut st, paths) = staged_over(rig, &dir, config(2, 16, 16));
    let ks: Vec<u64> = (0..12).collect();
    let mem: Vec<u32> = (0..12).collect();
    store_all(rig, &mut st, &ks, &mem, 12);
    let slot = st
        .tier()
        .pool()
        .index()
        .get(&Key::from_u64(5))
        .unwrap()
        .slot;
    let (dev, off) = st.tier().pool().layout().object_offset(slot, 2, 1);
    let f = std::fs::OpenOptions::new()
        .write(true)
        .open(&paths[dev as usize])
        .unwrap();
    f.write_all_at(&[0x42], off + 100).unwrap();
    f.sync_all().unwrap();
    rig.clear();
    let job = st.submit_load(&keys(&ks), &mem, 0..g.layers).unwrap();
    let r = st.wait(job).unwrap();
    let events = st.layer_events();
    assert_eq!(events.len(), g.layers as usize);
    for (i, o) in r.outcomes.iter().enumerate() {
        if ks[i] == 5 {
            assert!(
                matches!(o, KeyOutcome::Corrupt(f) if f.kind == kvtier::ErrorKind::Corrupt),
                "{o:?}"
            );
            // Layers before the damage arrived; the damaged one was never copied.
            assert!(matches(rig, mem[i], seed_of(5), 0..2));
            assert!(rig.read_object(mem[i], 2, 1).iter().all(|&b| b == 0));
        } else {
            assert_eq!(o, &KeyOutcome::Done, "key {}", ks[i]);
            assert!(
                matches(rig, mem[i], seed_of(ks[i]), 0..g.layers),
                "key {}",
                ks[i]
            );
        }
    }
    assert!(events[2]
        .error
        .as_ref()
        .is_some_and(|f| f.kind == kvtier::ErrorKind::Corrupt));
    assert!(events[0].error.is_none() && events[1].error.is_none());
    assert!(
        !st.tier().contains(&Key::from_u64(5)),
        "a corrupt block leaves the pool"
    );
    drop(st);
    let pool = Pool::open(&paths, &OpenExpect::default()).unwrap();
    assert!(pool.index().get(&Key::from_u64(5)).is_none());
}

/// The layouts both runs cover.
pub const LAYOUTS: [HostLayout; 2] = [HostLayout::PerLayer, HostLayout::CrossLayer];

/// A load of more blocks than a layer buffer holds goes through in chunks
/// (17 keys through buffers of 5: 4 chunks a layer), beside a second load
/// sharing the buffers: every layer's event once, in layer order, after
/// all its chunks are in memory; the load's counter at its layer's value
/// by then; the bytes whole; nothing left pinned or busy.
pub fn large_load_goes_in_chunks(rig: &dyn KvRig, tag: &str) {
    let dir = TempDir::new(tag);
    let g = rig.geometry();
    let (mut st, _) = staged_over(rig, &dir, config(3, 5, 16));
    let ks: Vec<u64> = (700..724).collect();
    let mem: Vec<u32> = (0..24).map(|i| (i * 5 + 1) % rig.num_blocks()).collect();
    store_all(rig, &mut st, &ks, &mem, 16);
    rig.clear();
    let (big, small) = (17, 24);
    let a = st
        .submit_load(&keys(&ks[..big]), &mem[..big], 0..g.layers)
        .unwrap();
    let b = st
        .submit_load(&keys(&ks[big..small]), &mem[big..small], 1..g.layers)
        .unwrap();
    let ca = st.load_counter(a).expect("a load's counter");
    let mut events = Vec::new();
    for layer in 0..g.layers {
        st.wait_layer(a, layer).unwrap();
        let now = ca.counter.load().unwrap();
        assert!(
            now.wrapping_sub(ca.value_for(layer)) as i32 >= 0,
            "layer {layer}: counter {now} below {}",
            ca.value_for(layer)
        );
        for (i, &k) in ks[..big].iter().enumerate() {
            assert!(
                matches(rig, mem[i], seed_of(k), 0..layer + 1),
                "layer {layer} of key {k} (chunk {}) not in memory after wait_layer",
                i / 5
            );
        }
        events.extend(st.layer_events());
    }
    let ra = st.wait(a).unwrap();
    let rb = st.wait(b).unwrap();
    assert!(ra.all_ok(), "{:?}", ra.failures().collect::<Vec<_>>());
    assert!(rb.all_ok(), "{:?}", rb.failures().collect::<Vec<_>>());
    events.extend(st.layer_events());
    let of = |job| -> Vec<u32> {
        events
            .iter()
            .filter(|e| e.job == job)
            .map(|e| e.layer)
            .collect()
    };
    assert_eq!(of(a), (0..g.layers).collect::<Vec<_>>());
    assert_eq!(of(b), (1..g.layers).collect::<Vec<_>>());
    assert!(events.iter().all(|e| e.error.is_none()));
    let counters: Vec<u32> = events
        .iter()
        .filter(|e| e.job == a)
        .map(|e| e.counter)
        .collect();
    assert!(
        counters
            .windows(2)
            .all(|w| w[1].wrapping_sub(w[0]) as i32 > 0),
        "{counters:?}"
    );
    for (i, &k) in ks.iter().enumerate() {
        let from = if i < big { 0 } else { 1 };
        assert!(matches(rig, mem[i], seed_of(k), from..g.layers), "key {k}");
    }
    assert_eq!(st.tier().usage().pinned_blocks, 0, "finished loads unpin");
    assert!(st.buffers_in_use().iter().all(Option::is_none));
}
