//! The tier's public calls under hostile arguments: a clear error, never a
//! panic, and never a store acknowledged that a later load calls corrupt.

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
