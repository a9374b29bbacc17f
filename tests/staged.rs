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
    let e = StagedTier::with_host_double(tier, rig.0.clone(), config(1, 8, 8)).err().unwrap();
    assert!(e.to_string().contains("at least 2 layer buffers"), "{e}");
}
