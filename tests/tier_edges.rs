//! The tier at its edges: hostile arguments (a clear error, never a panic,
//! never a store acknowledged that a later load calls corrupt) and stores
//! large enough that their checksums are taken on a worker thread.

mod common;

use common::*;
use kvtier::pool::Key;
use kvtier::tier::{Tier, TierConfig};
use kvtier::{HostKvCache, HostLayout};
use std::sync::Arc;

fn rig(dir: &TempDir) -> (Tier, Arc<HostKvCache>) {
    let geo = tiny_geometry();
    let pool = create_pool(dir, geo, 4, 1, 2);
    let mut tier = Tier::open(pool, TierConfig::default()).unwrap();
    let cache = Arc::new(HostKvCache::new(geo, 8, HostLayout::PerLayer).unwrap());
    tier.register_host_cache(cache.clone()).unwrap();
    (tier, cache)
}

/// Checksums handed to `submit_store_with_crcs` are trusted into the
/// headers: a list of the wrong length (not one per layer) is refused, as
/// it would otherwise be acknowledged and then fail every load as corrupt.
#[test]
fn store_with_checksums_of_the_wrong_length_is_refused() {
    let dir = TempDir::new("crc-len");
    let (mut tier, cache) = rig(&dir);
    let layers = tiny_geometry().layers;
    cache.fill_block(0, seed_of(1));
    let table = tier.p2p_table().unwrap().clone();
    let mut crcs = Tier::layer_crcs(&table, 0, layers).unwrap();
    crcs.pop();
    let e = tier
        .submit_store_with_crcs(&[Key::from_u64(1)], &[0], Some(&[Some(crcs)]))
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("checksum") && e.contains(&format!("{layers}")),
        "{e}"
    );
    assert!(!tier.contains(&Key::from_u64(1)));
    assert_eq!(tier.jobs_in_flight(), 0);
}

/// `Tier::layer_crcs` asked for more layers than the table holds answers
/// None (it cannot be read), rather than panicking or hashing another
/// block's objects.
#[test]
fn layer_crcs_past_the_model_is_none() {
    let dir = TempDir::new("crc-layers");
    let (tier, _cache) = rig(&dir);
    let table = tier.p2p_table().unwrap().clone();
    let layers = tiny_geometry().layers;
    assert!(Tier::layer_crcs(&table, 7, layers).is_some());
    assert!(Tier::layer_crcs(&table, 7, layers + 1).is_none());
    assert!(Tier::layer_crcs(&table, 0, u32::MAX).is_none());
}

/// A store of more than 32 MiB of blocks has its checksums taken on a
/// worker thread while the data is written: every header still records the
/// checksums of its own block (a reopened pool verifies all of them, and a
/// load verifies and returns the bytes), and a tier dropped with such a
/// store in flight lands it whole.
#[test]
fn large_store_checksums_from_the_worker_verify() {
    let geo = tiny_geometry();
    let n: u32 = 1100; // 1100 x 32 KiB: past the inline hashing limit
    assert!(n as u64 * geo.block_bytes() > 32 << 20);
    for drop_in_flight in [false, true] {
        let dir = TempDir::new(&format!("big-store-{drop_in_flight}"));
        let pool = create_pool(&dir, geo, 8, 2, 70);
        let paths = pool.paths();
        let mut tier = Tier::open(pool, TierConfig::default()).unwrap();
        let cache = Arc::new(HostKvCache::new(geo, n, HostLayout::CrossLayer).unwrap());
        tier.register_host_cache(cache.clone()).unwrap();
        let ks: Vec<Key> = (0..n as u64).map(|i| Key::from_u64(10_000 + i)).collect();
        // Memory blocks in reverse, so a checksum matched to the wrong block shows.
        let mem: Vec<u32> = (0..n).rev().collect();
        for (i, &b) in mem.iter().enumerate() {
            cache.fill_block(b, seed_of(10_000 + i as u64));
        }
        let job = tier.submit_store(&ks, &mem).unwrap();
        if drop_in_flight {
            drop(tier);
        } else {
            let r = tier.wait(job).unwrap();
            assert!(r.all_ok(), "{:?}", r.failures().next());
            cache.clear();
            let target: Vec<u32> = (0..n).collect();
            let chunk = 500;
            for (kc, tc) in ks.chunks(chunk).zip(target.chunks(chunk)) {
                let l = tier.submit_load(kc, tc, 0..geo.layers).unwrap();
                let r = tier.wait(l).unwrap();
                assert!(r.all_ok(), "{:?}", r.failures().next());
            }
            for i in 0..n {
                assert!(
                    cache.block_matches(i, seed_of(10_000 + i as u64), 0..geo.layers),
                    "block {i}"
                );
            }
            drop(tier);
        }
        let pool = kvtier::Pool::open(&paths, &Default::default()).unwrap();
        let report = pool.check(|_, _| {}).unwrap();
        assert_eq!(
            (report.blocks_ok, report.blocks_unverifiable),
            (n as u64, 0),
            "{report:?}"
        );
    }
}

/// A header staging past its bound (each entry is 4 KiB of host memory)
/// or below 2 is refused when the tier is built, naming the field and the
/// range, instead of allocating whatever was asked.
#[test]
fn header_staging_out_of_range_is_refused() {
    for (i, n) in [0, 1, kvtier::tier::MAX_HEADER_STAGING + 1, u32::MAX]
        .into_iter()
        .enumerate()
    {
        let dir = TempDir::new(&format!("hdr-staging-{i}"));
        let pool = create_pool(&dir, tiny_geometry(), 4, 1, 2);
        let e = Tier::open(pool, TierConfig::default().with_header_staging(n))
            .err()
            .unwrap()
            .to_string();
        assert!(
            e.contains("header_staging")
                && e.contains(&kvtier::tier::MAX_HEADER_STAGING.to_string()),
            "{n}: {e}"
        );
    }
    let dir = TempDir::new("hdr-staging-max");
    let pool = create_pool(&dir, tiny_geometry(), 4, 1, 2);
    let cfg = TierConfig::default().with_header_staging(kvtier::tier::MAX_HEADER_STAGING);
    Tier::open(pool, cfg).unwrap();
}

/// Two loads writing one memory block at once (in one job, or in two jobs in
/// flight together) would each verify the other's bytes: the loser reads as
/// corrupt and its key, stored and acknowledged, is dropped from the pool.
/// Both are refused with an error naming the block; the keys stay.
#[test]
fn loads_into_one_memory_block_at_once_are_refused_and_lose_no_key() {
    let dir = TempDir::new("load-overlap");
    let (mut tier, cache) = rig(&dir);
    let layers = tiny_geometry().layers;
    for k in 1..=2u64 {
        cache.fill_block(k as u32, seed_of(k));
    }
    let ks = [Key::from_u64(1), Key::from_u64(2)];
    let job = tier.submit_store(&ks, &[1, 2]).unwrap();
    assert!(tier.wait(job).unwrap().all_ok());

    // One job, one block named twice.
    let e = tier
        .submit_load(&ks, &[5, 5], 0..layers)
        .err()
        .map(|e| e.to_string())
        .unwrap_or_default();
    assert!(
        e.contains("memory block 5") && e.contains("two keys"),
        "a load naming block 5 twice: {e:?}"
    );
    // Two jobs in flight together.
    let a = tier.submit_load(&ks[..1], &[6], 0..layers).unwrap();
    match tier.submit_load(&ks[1..], &[6], 0..layers) {
        Ok(b) => {
            let rb = tier.wait(b).map(|r| r.outcomes);
            let ra = tier.wait(a).map(|r| r.outcomes);
            panic!(
                "a second load into block 6 while the first runs was accepted: {ra:?} {rb:?}; keys kept: {} {}",
                tier.contains(&ks[0]),
                tier.contains(&ks[1])
            );
        }
        Err(e) => assert!(e.to_string().contains("memory block 6"), "{e}"),
    }
    assert!(tier.wait(a).unwrap().all_ok());
    assert!(cache.block_matches(6, seed_of(1), 0..layers));
    assert!(
        tier.contains(&ks[0]) && tier.contains(&ks[1]),
        "no key lost"
    );
    // Different layers of one block at once do not overlap: both go.
    let a = tier.submit_load(&ks[1..], &[7], 0..2).unwrap();
    let b = tier.submit_load(&ks[1..], &[7], 2..layers).unwrap();
    assert!(tier.wait(a).unwrap().all_ok() && tier.wait(b).unwrap().all_ok());
    assert!(cache.block_matches(7, seed_of(2), 0..layers));
}

/// Through the job path a job runs under the id its caller (the scheduler)
/// gave it, and that id is its result's; an id still in flight or
/// uncollected is refused with nothing started, and the tier's own numbering
/// goes on past the ids it was given.
#[test]
fn job_path_runs_jobs_under_the_callers_ids_and_refuses_one_in_use() {
    use kvtier::tier::JobPath;
    let dir = TempDir::new("path-ids");
    let (mut tier, cache) = rig(&dir);
    let layers = tiny_geometry().layers;
    cache.fill_block(0, seed_of(1));
    JobPath::submit_store(&mut tier, 40, &[Key::from_u64(1)], &[0], None).unwrap();
    let e = JobPath::submit_store(&mut tier, 40, &[Key::from_u64(2)], &[1], None)
        .unwrap_err()
        .to_string();
    assert!(e.contains("job id 40 is in use"), "{e}");
    assert_eq!(
        tier.jobs_in_flight(),
        1,
        "the refused store started nothing"
    );
    let r = JobPath::wait(&mut tier, 40).unwrap();
    assert_eq!(r.job, 40);
    assert!(r.all_ok(), "{r:?}");
    JobPath::submit_load(&mut tier, 41, &[Key::from_u64(1)], &[5], 0..layers).unwrap();
    let r = JobPath::wait(&mut tier, 41).unwrap();
    assert_eq!(r.job, 41);
    assert!(r.all_ok(), "{r:?}");
    assert!(cache.block_matches(5, seed_of(1), 0..layers));
    // Collected: the id is free again, and the tier's own ids come after it.
    let own = tier
        .submit_load(&[Key::from_u64(1)], &[6], 0..layers)
        .unwrap();
    assert!(own > 41, "{own}");
    assert!(tier.wait(own).unwrap().all_ok());
}
