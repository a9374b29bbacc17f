//! Tier behaviour under device failures and awkward call orders, driven by
//! the shared fault double (tests/common/fault.rs) without I/O: it holds each
//! job's IOCBs until the test opens that job's gate, and can fail a job's
//! reads or writes with EIO. It checks the tier's bookkeeping, not bytes; the
//! same tier code runs on the real io_uring engine in tests/tier.rs.

mod common;

use common::fault::{FaultEngine, Faults};
use common::*;
use kvtier::pool::Key;
use kvtier::tier::{KeyOutcome, Tier, TierConfig};
use kvtier::{HostKvCache, HostLayout};
use std::collections::HashSet;
use std::sync::{Arc, Mutex};

fn rig(dir: &TempDir, groups: u64) -> (Tier, Arc<Mutex<Faults>>) {
    let geo = tiny_geometry();
    let pool = create_pool(dir, geo, 4, 1, groups);
    let gates = Arc::new(Mutex::new(Faults::default()));
    let engine = FaultEngine::bookkeeping(gates.clone());
    let mut tier = Tier::with_engine(pool, TierConfig::default(), Box::new(engine)).unwrap();
    let cache = Arc::new(HostKvCache::new(geo, 16, HostLayout::PerLayer).unwrap());
    tier.register_host_cache(cache).unwrap();
    (tier, gates)
}

/// A tier on a one-device pool of 16 slots (2 groups of 8) whose I/O the
/// fault double does on the pool's file, with 4 blocks of host memory.
struct FileRig {
    tier: Tier,
    cache: Arc<HostKvCache>,
    faults: Arc<Mutex<Faults>>,
    layout: kvtier::pool::layout::PoolLayout,
    paths: Vec<std::path::PathBuf>,
}

fn file_rig(dir: &TempDir) -> FileRig {
    let geo = tiny_geometry();
    let pool = create_pool(dir, geo, 8, 1, 2);
    let paths = pool.paths();
    let layout = pool.layout().clone();
    let faults = Arc::new(Mutex::new(Faults::default()));
    let engine = FaultEngine::open(&paths, faults.clone());
    let mut tier = Tier::with_engine(pool, TierConfig::default(), Box::new(engine)).unwrap();
    let cache = Arc::new(HostKvCache::new(geo, 4, HostLayout::PerLayer).unwrap());
    tier.register_host_cache(cache.clone()).unwrap();
    FileRig {
        tier,
        cache,
        faults,
        layout,
        paths,
    }
}

fn k(i: u64) -> Key {
    Key::from_u64(i)
}

#[test]
fn concurrent_stores_of_one_key_never_wait_on_each_other() {
    let dir = TempDir::new("dedup");
    let (mut tier, gates) = rig(&dir, 4);
    gates.lock().unwrap().gates = Some(HashSet::new());
    let a = tier.submit_store(&[k(1)], &[0]).unwrap();
    gates.lock().unwrap().fail_writes_of.insert(a);
    let b = tier.submit_store(&[k(1), k(2)], &[1, 2]).unwrap();
    gates.lock().unwrap().gates.as_mut().unwrap().insert(a);
    for _ in 0..10 {
        tier.poll().unwrap();
    }
    // A failed; B still waits for its own I/O. C shares both keys with B.
    let c = tier.submit_store(&[k(1), k(2)], &[3, 4]).unwrap();
    gates.lock().unwrap().gates = None;
    tier.drain()
        .expect("no job waits on a job that waits on it");
    let ra = tier.wait(a).unwrap();
    let rb = tier.wait(b).unwrap();
    let rc = tier.wait(c).unwrap();
    assert!(
        matches!(ra.outcomes[0], KeyOutcome::Failed(ref m) if m.message.contains("Input/output error")),
        "{ra:?}"
    );
    assert!(
        matches!(rb.outcomes[0], KeyOutcome::Failed(ref m) if m.message.contains("same key failed")),
        "{rb:?}"
    );
    assert_eq!(rb.outcomes[1], KeyOutcome::Done);
    assert_eq!(
        rc.outcomes,
        vec![KeyOutcome::Done, KeyOutcome::AlreadyStored]
    );
    assert!(tier.contains(&k(1)) && tier.contains(&k(2)));
    assert_eq!(tier.usage().reserved_blocks, 0, "no slot leaks");
}

#[test]
fn a_callers_stray_unpin_cannot_release_a_loads_pin() {
    let dir = TempDir::new("pins");
    let (mut tier, gates) = rig(&dir, 1); // 4 slots
    let job = tier
        .submit_store(&[k(1), k(2), k(3), k(4)], &[0, 1, 2, 3])
        .unwrap();
    assert!(tier.wait(job).unwrap().all_ok());
    gates.lock().unwrap().gates = Some(HashSet::new());
    let load = tier
        .submit_load(&[k(1), k(2), k(3), k(4)], &[8, 9, 10, 11], 0..4)
        .unwrap();
    tier.unpin(&[k(1), k(2), k(3), k(4)]);
    tier.unpin(&[k(1), k(2), k(3), k(4)]);
    let err = tier.submit_store(&[k(5)], &[5]).unwrap_err().to_string();
    assert!(
        err.contains("pool full"),
        "the loading blocks stay pinned: {err}"
    );
    gates.lock().unwrap().gates = None;
    assert!(tier.wait(load).unwrap().all_ok());
    let job = tier.submit_store(&[k(5)], &[5]).unwrap();
    let r = tier.wait(job).unwrap();
    assert!(r.all_ok());
    assert_eq!(r.evicted, vec![k(1)], "the store reports what it evicted");
}

#[test]
fn a_failed_layer_is_reported_not_announced_as_loaded() {
    let dir = TempDir::new("badlayer");
    let (mut tier, gates) = rig(&dir, 2);
    let job = tier.submit_store(&[k(1), k(2)], &[0, 1]).unwrap();
    assert!(tier.wait(job).unwrap().all_ok());
    gates.lock().unwrap().gates = Some(HashSet::new());
    let load = tier.submit_load(&[k(1), k(2)], &[4, 5], 0..4).unwrap();
    {
        let mut g = gates.lock().unwrap();
        g.fail_reads_of.insert(load);
        g.gates = None;
    }
    let err = tier.wait_layer(load, 0).unwrap_err().to_string();
    assert!(
        err.contains("layer 0") || err.contains("failed to load"),
        "{err}"
    );
    let events = tier.layer_events();
    assert!(events.iter().all(|e| e.error.is_some()), "{events:?}");
    let r = tier.wait(load).unwrap();
    assert!(!r.all_ok());
    assert!(
        tier.layer_events().is_empty(),
        "collected jobs leave no events behind"
    );
}

#[test]
fn memory_in_use_by_a_job_in_flight_is_refused() {
    let dir = TempDir::new("busy");
    let (mut tier, gates) = rig(&dir, 2);
    let job = tier.submit_store(&[k(1)], &[0]).unwrap();
    assert!(tier.wait(job).unwrap().all_ok());
    gates.lock().unwrap().gates = Some(HashSet::new());
    let load = tier.submit_load(&[k(1)], &[3], 0..4).unwrap();
    let err = tier.submit_store(&[k(2)], &[3]).unwrap_err().to_string();
    assert!(
        err.contains("memory block 3 is the target of a load in flight"),
        "{err}"
    );
    let store = tier.submit_store(&[k(2)], &[6]).unwrap();
    let err = tier
        .submit_load(&[k(1)], &[6], 0..4)
        .unwrap_err()
        .to_string();
    assert!(err.contains("memory block 6 is being stored"), "{err}");
    gates.lock().unwrap().gates = None;
    assert!(tier.wait(load).unwrap().all_ok());
    assert!(tier.wait(store).unwrap().all_ok());
    // Released once the jobs finish.
    let job = tier.submit_store(&[k(3)], &[3]).unwrap();
    assert!(tier.wait(job).unwrap().all_ok());
}

/// A slot whose header cannot be written (its sector fails every write) is
/// retired when invalidating it fails, so the stores after it go elsewhere;
/// before, the failed invalidation left the slot free, the next store
/// picked it again, and every later store failed the same way.
#[test]
fn a_slot_whose_header_cannot_be_invalidated_is_retired() {
    let dir = TempDir::new("badinval");
    let geo = tiny_geometry();
    let FileRig {
        mut tier,
        cache,
        faults,
        layout,
        ..
    } = file_rig(&dir);
    for i in 0..16 {
        cache.fill_block(0, seed_of(i));
        let job = tier.submit_store(&[k(i)], &[0]).unwrap();
        assert!(tier.wait(job).unwrap().all_ok());
    }
    // Every header sector of the least recently used keys' slots dies.
    let victims: Vec<u64> = (0..16u64)
        .filter(|&s| tier.pool().index().get(&k(0)).is_some_and(|e| e.slot == s))
        .collect();
    assert_eq!(victims.len(), 1);
    let (dev, off) = layout.header_offset(victims[0]);
    faults.lock().unwrap().fail_writes = vec![(dev, off..off + 4096)];
    let mut failed = 0;
    for i in 100..120 {
        cache.fill_block(1, seed_of(i));
        let job = tier.submit_store(&[k(i)], &[1]).unwrap();
        match &tier.wait(job).unwrap().outcomes[0] {
            KeyOutcome::Done => {}
            KeyOutcome::Failed(f) => {
                assert!(f.message.contains("Input/output error"), "{f}");
                failed += 1;
            }
            o => panic!("{o:?}"),
        }
    }
    assert!(
        failed <= 1,
        "{failed} of 20 stores failed on one dead header sector"
    );
    for i in 105..120 {
        let job = tier.submit_load(&[k(i)], &[2], 0..geo.layers).unwrap();
        assert_eq!(tier.wait(job).unwrap().outcomes[0], KeyOutcome::Done);
        assert!(cache.block_matches(2, seed_of(i), 0..geo.layers));
    }
}

/// A read that delivers wrong bytes once (the device still holds the stored
/// ones) costs no key: the verifier looks at the device again, copies the
/// good bytes in and the load succeeds with exactly what was stored. Bytes
/// that are wrong on the device itself still fail as corrupt and leave the
/// pool. Before, one bad transfer dropped a good, acknowledged key.
#[test]
fn a_read_garbled_once_is_healed_from_the_device_and_keeps_its_key() {
    let dir = TempDir::new("garble");
    let geo = tiny_geometry();
    let FileRig {
        mut tier,
        cache,
        faults,
        layout,
        paths,
    } = file_rig(&dir);
    for i in 0..2 {
        cache.fill_block(i as u32, seed_of(i));
    }
    let job = tier.submit_store(&[k(0), k(1)], &[0, 1]).unwrap();
    assert!(tier.wait(job).unwrap().all_ok());

    // Layer 1's V object of key 0 comes back with a flipped byte, once.
    let slot0 = tier.pool().index().get(&k(0)).unwrap().slot;
    let (dev, off) = layout.object_offset(slot0, 1, 1);
    faults.lock().unwrap().garble_reads_once = vec![(dev, off + 100..off + 101)];
    cache.clear();
    let job = tier.submit_load(&[k(0)], &[2], 0..geo.layers).unwrap();
    let got = tier.wait(job).unwrap();
    assert!(
        faults.lock().unwrap().garble_reads_once.is_empty(),
        "the garbled read happened"
    );
    assert_eq!(got.outcomes[0], KeyOutcome::Done, "{got:?}");
    assert!(cache.block_matches(2, seed_of(0), 0..geo.layers));
    assert!(tier.contains(&k(0)), "a good block stays in the pool");

    // Key 1's layer 0 K object is wrong on the device itself.
    let slot1 = tier.pool().index().get(&k(1)).unwrap().slot;
    let (dev, off) = layout.object_offset(slot1, 0, 0);
    let f = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(&paths[dev as usize])
        .unwrap();
    use std::os::unix::fs::FileExt;
    let mut b = [0u8; 1];
    f.read_exact_at(&mut b, off + 7).unwrap();
    f.write_all_at(&[b[0] ^ 0x80], off + 7).unwrap();
    f.sync_all().unwrap();
    let job = tier.submit_load(&[k(1)], &[3], 0..geo.layers).unwrap();
    let got = tier.wait(job).unwrap();
    match &got.outcomes[0] {
        KeyOutcome::Corrupt(f) => assert!(
            f.message.contains("same wrong bytes") && f.message.contains("dropped"),
            "{f}"
        ),
        o => panic!("damaged on the device, yet {o:?}"),
    }
    assert!(!tier.contains(&k(1)), "a damaged block leaves the pool");
}

/// Clear the per-layer checksum flag of `slot`'s header (resealed, as a
/// forger or an older writer would leave it): the block then carries only
/// its whole-block checksum.
fn strip_layer_crcs(layout: &kvtier::pool::layout::PoolLayout, path: &std::path::Path, slot: u64) {
    use kvtier::pool::layout::BlockHeader;
    use std::os::unix::fs::FileExt;
    let (_, off) = layout.header_offset(slot);
    let f = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(path)
        .unwrap();
    let mut raw = vec![0u8; std::mem::size_of::<BlockHeader>()];
    f.read_exact_at(&mut raw, off).unwrap();
    let mut h: BlockHeader = bytemuck::pod_read_unaligned(&raw);
    assert_ne!(h.flags & 2, 0, "stored with per-layer checksums");
    h.flags &= !2; // BLOCK_FLAG_LAYER_CRCS
    h.seal();
    f.write_all_at(bytemuck::bytes_of(&h), off).unwrap();
}

/// Flip one bit (chosen by `rng`) of layer `layer` of `slot` on the device.
fn flip_bit_in_layer(
    layout: &kvtier::pool::layout::PoolLayout,
    path: &std::path::Path,
    slot: u64,
    layer: u32,
    rng: &mut Rng,
) {
    use std::os::unix::fs::FileExt;
    let kv = rng.below(2) as u32;
    let (_, off) = layout.object_offset(slot, layer, kv);
    let at = off + rng.below(layout.geometry.object_bytes());
    let f = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(path)
        .unwrap();
    let mut b = [0u8; 1];
    f.read_exact_at(&mut b, at).unwrap();
    f.write_all_at(&[b[0] ^ (1 << rng.below(8))], at).unwrap();
}

/// A load of any layer range of a block that carries only a whole-block
/// checksum is verified: every partial range (and the whole one), with one
/// bit flipped on the device in each layer in turn, ends Corrupt (the bit
/// in the range) or Corrupt / Done with the stored bytes (outside it), never
/// Done with wrong bytes; a clean block loads every range. Before, a range
/// that did not run from layer 0 to the last layer was never verified.
#[test]
fn every_layer_range_of_a_block_with_only_a_whole_checksum_is_verified() {
    let dir = TempDir::new("wholeonly");
    let geo = tiny_geometry();
    let n = geo.layers;
    let ranges: Vec<(u32, u32)> = (0..n)
        .flat_map(|s| (s + 1..=n).map(move |e| (s, e)))
        .collect();
    // One key per (range, flipped layer), and one clean key.
    let cases: Vec<(u32, u32, u32)> = ranges
        .iter()
        .flat_map(|&(s, e)| (0..n).map(move |f| (s, e, f)))
        .collect();
    let clean = cases.len() as u64;
    let pool = create_pool(&dir, geo, 8, 1, cases.len().div_ceil(8) as u64 + 1);
    let paths = pool.paths();
    let layout = pool.layout().clone();
    let mut tier = Tier::open(pool, TierConfig::default()).unwrap();
    let cache = Arc::new(HostKvCache::new(geo, 8, HostLayout::PerLayer).unwrap());
    tier.register_host_cache(cache.clone()).unwrap();
    let all: Vec<u64> = (0..=clean).collect();
    for chunk in all.chunks(8) {
        for (i, &key) in chunk.iter().enumerate() {
            cache.fill_block(i as u32, seed_of(key));
        }
        let keys: Vec<Key> = chunk.iter().map(|&i| k(i)).collect();
        let mem: Vec<u32> = (0..chunk.len() as u32).collect();
        let job = tier.submit_store(&keys, &mem).unwrap();
        assert!(tier.wait(job).unwrap().all_ok());
    }
    let slots: Vec<u64> = all
        .iter()
        .map(|&i| tier.pool().index().get(&k(i)).unwrap().slot)
        .collect();
    drop(tier);
    let mut rng = Rng(23);
    for (i, &(_, _, f)) in cases.iter().enumerate() {
        strip_layer_crcs(&layout, &paths[0], slots[i]);
        flip_bit_in_layer(&layout, &paths[0], slots[i], f, &mut rng);
    }
    strip_layer_crcs(&layout, &paths[0], slots[clean as usize]);

    let pool = kvtier::pool::Pool::open(&paths, &Default::default()).unwrap();
    for &s in &slots {
        assert!(pool.layer_crc(s, 0).is_none(), "whole-block checksum only");
    }
    let mut tier = Tier::open(pool, TierConfig::default()).unwrap();
    tier.register_host_cache(cache.clone()).unwrap();
    for (i, &(s, e, f)) in cases.iter().enumerate() {
        cache.clear();
        let what = format!("layers {s}..{e}, bit flipped in layer {f}");
        let got = match tier.submit_load(&[k(i as u64)], &[0], s..e) {
            Ok(job) => tier.wait(job).unwrap().outcomes[0].clone(),
            Err(err) => {
                assert!(!err.to_string().is_empty());
                continue; // refused: acceptable
            }
        };
        match got {
            KeyOutcome::Corrupt(_) => assert!(!tier.contains(&k(i as u64)), "{what}"),
            KeyOutcome::Done => {
                assert!(
                    !(s..e).contains(&f),
                    "{what}: Done with a flipped bit loaded"
                );
                assert!(cache.block_matches(0, seed_of(i as u64), s..e), "{what}");
            }
            o => panic!("{what}: {o:?}"),
        }
    }
    // The clean block loads every range, with its bytes, and stays.
    for &(s, e) in &ranges {
        cache.clear();
        let job = tier.submit_load(&[k(clean)], &[1], s..e).unwrap();
        let got = tier.wait(job).unwrap();
        assert_eq!(got.outcomes[0], KeyOutcome::Done, "clean {s}..{e}");
        assert!(
            cache.block_matches(1, seed_of(clean), s..e),
            "clean {s}..{e}"
        );
    }
    assert!(tier.contains(&k(clean)));
}

/// A model deeper than a header sector's per-layer table (993 layers) keeps
/// only whole-block checksums; partial loads of it are verified too.
#[test]
fn a_partial_load_of_a_model_deeper_than_a_header_is_verified() {
    let dir = TempDir::new("deep");
    let geo = kvtier::model::KvGeometry {
        layers: 993,
        kv_heads: 1,
        head_dim: 128,
        dtype: kvtier::model::DType::BF16,
        block_size: 16,
    };
    let pool = create_pool(&dir, geo, 1, 1, 3);
    let paths = pool.paths();
    let layout = pool.layout().clone();
    let mut tier = Tier::open(pool, TierConfig::default()).unwrap();
    let cache = Arc::new(HostKvCache::new(geo, 2, HostLayout::PerLayer).unwrap());
    tier.register_host_cache(cache.clone()).unwrap();
    for i in 0..3u64 {
        cache.fill_block(0, seed_of(i));
        let job = tier.submit_store(&[k(i)], &[0]).unwrap();
        assert!(tier.wait(job).unwrap().all_ok());
    }
    let slot = |t: &Tier, i: u64| t.pool().index().get(&k(i)).unwrap().slot;
    let (s1, s2) = (slot(&tier, 1), slot(&tier, 2));
    assert!(tier.pool().layer_crc(s1, 0).is_none());
    drop(tier);
    let mut rng = Rng(993);
    flip_bit_in_layer(&layout, &paths[0], s1, 500, &mut rng);
    flip_bit_in_layer(&layout, &paths[0], s2, 3, &mut rng);
    let pool = kvtier::pool::Pool::open(&paths, &Default::default()).unwrap();
    let mut tier = Tier::open(pool, TierConfig::default()).unwrap();
    tier.register_host_cache(cache.clone()).unwrap();
    let load = |tier: &mut Tier, i: u64, r: std::ops::Range<u32>| {
        cache.clear();
        let job = tier.submit_load(&[k(i)], &[1], r).unwrap();
        tier.wait(job).unwrap().outcomes[0].clone()
    };
    assert_eq!(load(&mut tier, 0, 400..600), KeyOutcome::Done);
    assert!(cache.block_matches(1, seed_of(0), 400..600));
    assert_eq!(load(&mut tier, 0, 992..993), KeyOutcome::Done);
    assert!(matches!(
        load(&mut tier, 1, 400..600),
        KeyOutcome::Corrupt(_)
    ));
    // A bit outside the range still makes the block fail its checksum.
    assert!(matches!(
        load(&mut tier, 2, 990..993),
        KeyOutcome::Corrupt(_)
    ));
    assert!(!tier.contains(&k(1)) && !tier.contains(&k(2)) && tier.contains(&k(0)));
}
