//! kvtier from Rust: store a few blocks of KV, reopen the pool (a restart),
//! load them back layer by layer, check the bytes. Runs as written:
//!
//!     cargo run --example quickstart [POOL_DIR]
use kvtier::error::ErrorKind;
use kvtier::handle::{EngineChoice, Event, TierBuilder, TierHandle};
use kvtier::{DType, HostKvCache, HostLayout, Key, KvGeometry};
use std::path::{Path, PathBuf};
use std::sync::Arc;

const GEOMETRY: KvGeometry = KvGeometry {
    layers: 4,
    kv_heads: 2,
    head_dim: 64,
    dtype: DType::BF16,
    block_size: 16, // tokens per block: one K (or V) object = 4 KiB
};

fn open_tier(pool_dir: &Path, cache: &Arc<HostKvCache>) -> kvtier::Result<TierHandle> {
    TierBuilder::default()
        .directory(pool_dir) // opened if a pool is there, else created; or .files(..), .controller(..)
        .capacity(64 << 20) // bytes, split over the pool's files (only a create needs it)
        .geometry(GEOMETRY) // the engine's KV shape: no config.json needed
        .model_name("quickstart") // keys the namespace: KV of one model never serves another
        .engine(EngineChoice::Auto) // the engine `kvtier doctor` names; or Uring / Nvme / Gpu
        .host_cache(cache.clone()) // or unsafe .memory(KvMemory{..}): the engine's own
        .build()
}

/// One K or V object's bytes, different for every key, layer and K/V.
fn object(key: usize, layer: u32, kv: u32) -> Vec<u8> {
    let n = GEOMETRY.object_bytes() as usize;
    (0..n)
        .map(|i| (key * 31 + layer as usize * 7 + kv as usize * 3 + i) as u8)
        .collect()
}

fn main() -> kvtier::Result<()> {
    let pool_dir = std::env::args()
        .nth(1)
        .map(PathBuf::from)
        .unwrap_or_else(|| std::env::temp_dir().join("kvtier-quickstart"));
    run(&pool_dir)
}

/// Store, restart, restore, compare (`tests/readme.rs` runs it twice on one pool).
pub fn run(pool_dir: &Path) -> kvtier::Result<()> {
    let cache = Arc::new(HostKvCache::new(GEOMETRY, 8, HostLayout::PerLayer)?); // 8 memory blocks
    let keys: Vec<Key> = (1..=4u64).map(Key::from_u64).collect(); // content hashes (vLLM's, LMCache's)

    // Store blocks 0..4 of the KV cache under the keys; done = durable.
    let tier = open_tier(pool_dir, &cache)?;
    for (i, block) in (0..4).enumerate() {
        for layer in 0..GEOMETRY.layers {
            for kv in 0..2 {
                cache.write_object(block, layer, kv, &object(i, layer, kv));
            }
        }
    }
    match tier.submit_store(&keys, &[0, 1, 2, 3]) {
        Ok(job) => assert!(tier.wait(job)?.all_ok()), // `evicted` lists keys for KV events
        Err(e) if e.kind() == ErrorKind::Backpressure => { /* nothing accepted: retry later */ }
        Err(e) => return Err(e),
    }
    tier.close()?; // issues the write backlog, waits for every job, stops the I/O thread

    // A restart: the same build opens the pool; load into blocks 4..8, layer by layer.
    let tier = open_tier(pool_dir, &cache)?;
    let events = tier.completions()?; // AsRawFd: an event loop sleeps on it (epoll, asyncio)
    let n = tier.lookup_and_pin(&keys); // prefix hit, pinned; never waits behind I/O
    let target = [4, 5, 6, 7];
    let job = tier.submit_load(&keys[..n], &target[..n], 0..GEOMETRY.layers)?;
    for layer in 0..GEOMETRY.layers {
        tier.wait_layer(job, layer)?; // Err: e.kind(), e.io_failure()
                                      // ... run layer `layer` of the model here, while later layers load
    }
    assert!(tier.wait(job)?.all_ok()); // every result is collected once
    tier.unpin(&keys[..n]);
    while let Some(ev) = events.try_recv() {
        if let Event::Layer { error: Some(e), .. } = ev {
            return Err(kvtier::Error::Failed(e));
        }
    }
    let mut got = vec![0u8; GEOMETRY.object_bytes() as usize];
    let mut equal = n == keys.len();
    for (i, &block) in target[..n].iter().enumerate() {
        for layer in 0..GEOMETRY.layers {
            for kv in 0..2 {
                cache.read_object(block, layer, kv, &mut got);
                equal &= got == object(i, layer, kv);
            }
        }
    }
    tier.close()?;
    println!(
        "restored {n} blocks x {} layers, bytes equal: {equal}",
        GEOMETRY.layers
    );
    assert!(equal);
    Ok(())
}
