//! The handle against a reference model: random lookups, pins, stores (keys
//! already stored, keys repeated inside a job, keys shared between threads),
//! loads, eviction under a small pool, several threads at once, and device
//! faults injected by a double over io_uring. Every outcome is checked
//! against a plain map and every loaded byte against what its key's store
//! wrote. Deterministic seeds; the threaded part's interleaving is not, so it
//! checks what holds under every interleaving.

mod common;

use common::fault::{FaultEngine, Faults};
use common::*;
use kvtier::error::ErrorKind;
use kvtier::handle::{HandleConfig, TierBuilder, TierHandle};
use kvtier::pool::{Key, Pool};
use kvtier::tier::KeyOutcome;
use kvtier::{HostKvCache, HostLayout};
use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex};

/// Keys drawn from 0..KEYS; the pool holds SLOTS blocks, so stores evict.
const KEYS: u64 = 48;
const MEM_PER_THREAD: u32 = 16;

fn rig(dir: &TempDir, threads: u32) -> (TierHandle, Arc<HostKvCache>, Arc<Mutex<Faults>>) {
    let geo = tiny_geometry();
    let faults = Arc::new(Mutex::new(Faults::default()));
    let f = faults.clone();
    // 2 devices x 3 groups x 4 blocks = 24 slots.
    let pcfg = pool_config(geo, 4, &[dir.file("a.pool"), dir.file("b.pool")], 3);
    let cache =
        Arc::new(HostKvCache::new(geo, MEM_PER_THREAD * threads, HostLayout::PerLayer).unwrap());
    let h = TierBuilder::default()
        .custom_engine(move || {
            let pool = Pool::create(&pcfg)?;
            let eng = uring_of(&pool)?;
            Ok((pool, Box::new(FaultEngine::wrap(eng, f)) as _))
        })
        .config(HandleConfig::default())
        .host_cache(cache.clone())
        .build()
        .unwrap();
    (h, cache, faults)
}

fn key(k: u64) -> Key {
    Key::from_u64(k)
}

/// Zero a memory block, so a load that writes nothing cannot pass.
fn zero_block(cache: &HostKvCache, b: u32) {
    let g = tiny_geometry();
    let z = vec![0u8; g.object_bytes() as usize];
    for layer in 0..g.layers {
        for kv in 0..2 {
            cache.write_object(b, layer, kv, &z);
        }
    }
}

/// `n` distinct memory blocks out of `base..base + MEM_PER_THREAD`.
fn blocks(rng: &mut Rng, base: u32, n: usize) -> Vec<u32> {
    let mut all: Vec<u32> = (base..base + MEM_PER_THREAD).collect();
    for i in (1..all.len()).rev() {
        all.swap(i, rng.below(i as u64 + 1) as usize);
    }
    all.truncate(n);
    all
}

fn set_faults(faults: &Mutex<Faults>, read: u32, write: u32, flush: u32) {
    let mut f = faults.lock().unwrap();
    f.fail_read_permille = read;
    f.fail_write_permille = write;
    f.fail_flush_permille = flush;
}

/// Load `ks` into fresh blocks and check every byte of what reports done.
/// Returns false if a layer or key failed (allowed only with `faulty`).
fn load_and_check(
    h: &TierHandle,
    cache: &HostKvCache,
    rng: &mut Rng,
    base: u32,
    ks: &[u64],
    faulty: bool,
) -> bool {
    let layers_total = tiny_geometry().layers;
    let first = rng.below(layers_total as u64) as u32;
    let end = first + 1 + rng.below((layers_total - first) as u64) as u32;
    let mem = blocks(rng, base, ks.len());
    for &b in &mem {
        zero_block(cache, b);
    }
    let keys: Vec<Key> = ks.iter().map(|&k| key(k)).collect();
    let job = h
        .submit_load(&keys, &mem, first..end)
        .unwrap_or_else(|e| panic!("load of {ks:?} refused: {e}"));
    let mut all_ok = true;
    for layer in first..end {
        match h.wait_layer(job, layer) {
            Ok(()) => {
                for (i, &k) in ks.iter().enumerate() {
                    assert!(
                        cache.block_matches(mem[i], seed_of(k), layer..layer + 1),
                        "layer {layer} of key {k} reported loaded with wrong bytes"
                    );
                }
            }
            Err(e) => {
                assert!(faulty, "layer {layer} failed without a fault: {e}");
                assert_eq!(e.kind(), ErrorKind::Io, "{e}");
                all_ok = false;
            }
        }
    }
    let r = h.wait(job).unwrap();
    for (i, o) in r.outcomes.iter().enumerate() {
        match o {
            KeyOutcome::Done => assert!(
                cache.block_matches(mem[i], seed_of(ks[i]), first..end),
                "key {} reported loaded with wrong bytes",
                ks[i]
            ),
            KeyOutcome::Failed(f) => {
                assert!(faulty, "load of {} failed without a fault: {f}", ks[i]);
                assert_eq!(f.kind, ErrorKind::Io);
                assert!(f.io.is_some(), "an I/O failure names its I/O");
                all_ok = false;
            }
            o => panic!("a load outcome is Done or Failed, not {o:?}"),
        }
    }
    all_ok
}

#[test]
fn sequential_ops_match_the_model() {
    let dir = TempDir::new("model-seq");
    let (h, cache, faults) = rig(&dir, 1);
    let mut rng = Rng(0x5EED_0001);
    let mut present: HashSet<u64> = HashSet::new();
    let mut pins: HashMap<u64, u32> = HashMap::new();
    let mut pin_groups: Vec<Vec<u64>> = Vec::new();
    let mut stats = [0u32; 4];
    for step in 0..500 {
        let faulty = rng.chance(250);
        if faulty {
            set_faults(&faults, 300, 150, 150);
        } else {
            set_faults(&faults, 0, 0, 0);
        }
        let n = 1 + rng.below(5) as usize;
        let ks: Vec<u64> = (0..n).map(|_| rng.below(KEYS)).collect();
        let keys: Vec<Key> = ks.iter().map(|&k| key(k)).collect();
        let expect = ks.iter().take_while(|k| present.contains(k)).count();
        match rng.below(10) {
            0 | 1 => assert_eq!(h.lookup_prefix(&keys), expect, "step {step}: lookup {ks:?}"),
            2 => {
                assert_eq!(h.lookup_and_pin(&keys), expect, "step {step}: pin {ks:?}");
                for &k in &ks[..expect] {
                    *pins.entry(k).or_default() += 1;
                }
                pin_groups.push(ks[..expect].to_vec());
            }
            3 => {
                if let Some(g) = pin_groups.pop() {
                    let keys: Vec<Key> = g.iter().map(|&k| key(k)).collect();
                    h.unpin(&keys);
                    for k in g {
                        *pins.get_mut(&k).unwrap() -= 1;
                    }
                }
                // Stray unpins never fail and never release a real pin twice.
                h.unpin(&[key(KEYS + 7)]);
            }
            4..=6 => {
                stats[0] += 1;
                let mem = blocks(&mut rng, 0, n);
                for (&k, &b) in ks.iter().zip(&mem) {
                    cache.fill_block(b, seed_of(k));
                }
                let before = present.clone();
                let job = h.submit_store(&keys, &mem).unwrap();
                let r = h.wait(job).unwrap();
                for e in &r.evicted {
                    let e = e.to_string();
                    let k = (0..KEYS)
                        .find(|&k| key(k).to_string() == e)
                        .expect("an evicted key was stored");
                    assert!(
                        before.contains(&k),
                        "step {step}: evicted {k} was not stored"
                    );
                    assert_eq!(
                        pins.get(&k).copied().unwrap_or(0),
                        0,
                        "step {step}: evicted pinned key {k}"
                    );
                    assert!(
                        !ks.contains(&k),
                        "step {step}: a store evicted its own key {k}"
                    );
                    present.remove(&k);
                }
                for (i, o) in r.outcomes.iter().enumerate() {
                    let k = ks[i];
                    match o {
                        KeyOutcome::Done => {
                            assert!(!before.contains(&k), "step {step}: {k} written twice");
                            present.insert(k);
                        }
                        KeyOutcome::AlreadyStored => assert!(
                            before.contains(&k) || ks[..i].contains(&k),
                            "step {step}: {k} reported already stored"
                        ),
                        KeyOutcome::Failed(f) => {
                            stats[1] += 1;
                            let pool_full = f.kind == ErrorKind::Backpressure;
                            assert!(faulty || pool_full, "step {step}: store of {k} failed: {f}");
                        }
                        KeyOutcome::Corrupt(f) => panic!("step {step}: a store said corrupt: {f}"),
                    }
                }
                for &k in &ks {
                    assert_eq!(
                        h.contains(&key(k)),
                        present.contains(&k),
                        "step {step}: key {k}"
                    );
                }
            }
            _ => {
                // Load up to 4 stored keys, pinned first half of the time.
                let mut avail: Vec<u64> = present.iter().copied().collect();
                avail.sort_unstable();
                if avail.is_empty() {
                    continue;
                }
                let m = 1 + rng.below(avail.len().min(4) as u64) as usize;
                for i in (1..avail.len()).rev() {
                    avail.swap(i, rng.below(i as u64 + 1) as usize);
                }
                let ks: Vec<u64> = avail[..m].to_vec();
                let keys: Vec<Key> = ks.iter().map(|&k| key(k)).collect();
                let pin = rng.chance(500);
                if pin {
                    assert_eq!(h.lookup_and_pin(&keys), ks.len());
                }
                stats[2] += 1;
                if !load_and_check(&h, &cache, &mut rng, 0, &ks, faulty) {
                    stats[3] += 1;
                }
                if pin {
                    h.unpin(&keys);
                }
            }
        }
        let u = h.usage().unwrap();
        assert_eq!(u.tier.live_blocks, present.len() as u64, "step {step}");
        assert_eq!(u.tier.reserved_blocks, 0, "step {step}: no slot leaks");
    }
    set_faults(&faults, 0, 0, 0);
    for g in pin_groups.drain(..) {
        h.unpin(&g.iter().map(|&k| key(k)).collect::<Vec<_>>());
    }
    for k in 0..KEYS {
        assert_eq!(
            h.contains(&key(k)),
            present.contains(&k),
            "key {k} at the end"
        );
        if present.contains(&k) {
            assert!(load_and_check(&h, &cache, &mut rng, 0, &[k], false));
        }
    }
    assert_eq!(h.usage().unwrap().tier.pinned_blocks, 0);
    let injected = faults.lock().unwrap().injected;
    assert!(stats[0] > 50 && stats[2] > 50, "the mix ran: {stats:?}");
    assert!(
        injected.iter().all(|&n| n > 0),
        "faults were injected: {injected:?}"
    );
    assert!(
        stats[1] > 0 && stats[3] > 0,
        "faults showed up in outcomes: {stats:?}"
    );
    h.close().unwrap();
}

#[test]
fn concurrent_callers_keep_every_acknowledged_store_and_every_byte() {
    const THREADS: u32 = 3;
    let dir = TempDir::new("model-conc");
    let (h, cache, faults) = rig(&dir, THREADS);
    set_faults(&faults, 20, 20, 20);
    let acked = Arc::new(Mutex::new(HashSet::<u64>::new()));
    let evicted = Arc::new(Mutex::new(HashSet::<String>::new()));
    let workers: Vec<_> = (0..THREADS)
        .map(|t| {
            let (h, cache, acked, evicted) =
                (h.clone(), cache.clone(), acked.clone(), evicted.clone());
            std::thread::spawn(move || {
                let mut rng = Rng(0xC0DE_0000 + t as u64);
                let base = t * MEM_PER_THREAD;
                let mut loads = 0;
                for _ in 0..150 {
                    let n = 1 + rng.below(4) as usize;
                    let ks: Vec<u64> = (0..n).map(|_| rng.below(KEYS)).collect();
                    let keys: Vec<Key> = ks.iter().map(|&k| key(k)).collect();
                    match rng.below(3) {
                        0 => {
                            h.lookup_prefix(&keys);
                        }
                        1 => {
                            let mem = blocks(&mut rng, base, n);
                            for (&k, &b) in ks.iter().zip(&mem) {
                                cache.fill_block(b, seed_of(k));
                            }
                            let job = match h.submit_store(&keys, &mem) {
                                Ok(j) => j,
                                Err(e) if e.kind() == ErrorKind::Backpressure => continue,
                                Err(e) => panic!("store refused: {e}"),
                            };
                            let r = h.wait(job).unwrap();
                            let mut a = acked.lock().unwrap();
                            for (i, o) in r.outcomes.iter().enumerate() {
                                match o {
                                    KeyOutcome::Done => {
                                        a.insert(ks[i]);
                                    }
                                    KeyOutcome::AlreadyStored => {}
                                    KeyOutcome::Failed(f) => assert!(
                                        matches!(f.kind, ErrorKind::Io | ErrorKind::Backpressure),
                                        "{f}"
                                    ),
                                    KeyOutcome::Corrupt(f) => panic!("a store said corrupt: {f}"),
                                }
                            }
                            evicted
                                .lock()
                                .unwrap()
                                .extend(r.evicted.iter().map(|k| k.to_string()));
                        }
                        _ => {
                            // Pinned keys must stay loadable until unpinned.
                            let m = h.lookup_and_pin(&keys);
                            if m > 0 {
                                let mut seen = HashSet::new();
                                let ks: Vec<u64> = ks[..m]
                                    .iter()
                                    .copied()
                                    .filter(|k| seen.insert(*k))
                                    .collect();
                                load_and_check(&h, &cache, &mut rng, base, &ks, true);
                                loads += 1;
                            }
                            h.unpin(&keys[..m]);
                        }
                    }
                }
                loads
            })
        })
        .collect();
    let loads: u32 = workers.into_iter().map(|w| w.join().unwrap()).sum();
    assert!(loads > 20, "loads ran: {loads}");
    set_faults(&faults, 0, 0, 0);
    let acked = acked.lock().unwrap();
    let evicted = evicted.lock().unwrap();
    let mut rng = Rng(7);
    let mut live = 0;
    for k in 0..KEYS {
        if acked.contains(&k) && !evicted.contains(&key(k).to_string()) {
            assert!(
                h.contains(&key(k)),
                "acknowledged key {k} lost without eviction"
            );
        }
        if h.contains(&key(k)) {
            live += 1;
            assert!(load_and_check(&h, &cache, &mut rng, 0, &[k], false));
        }
    }
    let u = h.usage().unwrap();
    assert_eq!(u.tier.live_blocks, live);
    assert_eq!(u.tier.pinned_blocks, 0, "every pin was dropped");
    assert_eq!(u.tier.reserved_blocks, 0);
    h.close().unwrap();
}
