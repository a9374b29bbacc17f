//! The coalescing planner (src/plan.rs) on one layer of a 64K-token
//! llama3-8b prefix (block 16: 4096 blocks, 32 KiB objects, 8192 objects a
//! layer), planned the way `Tier::submit_load` does: cut the job's slots into
//! runs once (`group_runs`), then per layer list (dev, offset, P2P index, run)
//! in device order and merge contiguous objects into I/Os of at most 4 MiB
//! (`coalesce`).
//!
//! Three placements of the prefix's blocks in a pool of 1024 extent groups of
//! 64 blocks:
//! * `stored_together`: slots 0..4096 in key order: 2 MiB K run + 2 MiB V run
//!   per group, one 4 MiB I/O per group, 64 I/Os;
//! * `slots_permuted`: the same slots in random key order (the planner sorts
//!   by slot, so still 64 I/Os; only the P2P indices scatter);
//! * `scattered`: 4096 random slots out of the pool's 65536 (blocks stored at
//!   different times after churn): nearly one I/O per object, the worst case.
//!
//! Engine memory blocks are random blocks of a 16384-block KV cache in every
//! case: memory placement costs no I/Os (SGL / readv scatter it).

use criterion::{black_box, criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use kvtier::p2p::P2pTable;
use kvtier::plan::{coalesce, group_runs};
use kvtier::pool::layout::PoolLayout;
use kvtier::ring::abi::IOCTX_OP_READ;
use kvtier::{KvGeometry, KvLayout, KvMemory, MemoryKind};
use std::time::Duration;

const PREFIX_TOKENS: u32 = 64 * 1024;
const GROUP_BLOCKS: u32 = 64;
const POOL_GROUPS: u32 = 1024;
const ENGINE_BLOCKS: u32 = 16384;
const MAX_IO_BYTES: u64 = 4 << 20;
const LAYER: u32 = 16;

/// splitmix64: a reproducible stream without a dev-dependency.
fn splitmix(state: &mut u64) -> u64 {
    *state = state.wrapping_add(0x9e37_79b9_7f4a_7c15);
    let mut z = *state;
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// The first `n` of a random permutation of `0..total`.
fn random_distinct(total: u64, n: usize, seed: u64) -> Vec<u64> {
    let mut all: Vec<u64> = (0..total).collect();
    let mut s = seed;
    for i in 0..n {
        let j = i + (splitmix(&mut s) % (all.len() - i) as u64) as usize;
        all.swap(i, j);
    }
    all.truncate(n);
    all
}

/// The engine's KV memory at fake, aligned addresses: the planner only needs
/// the table's indices, never the memory.
fn engine_table(geometry: KvGeometry) -> P2pTable {
    let per_layer = 2 * ENGINE_BLOCKS as u64 * geometry.object_bytes();
    let stride = per_layer.next_multiple_of(2 << 20);
    let layer_bases = (0..geometry.layers as u64)
        .map(|l| 0x7f00_0000_0000 + l * stride)
        .collect();
    P2pTable::build(&KvMemory {
        geometry,
        num_blocks: ENGINE_BLOCKS,
        layout: KvLayout::PerLayer { layer_bases },
        kind: MemoryKind::Host,
    })
    .expect("engine P2P table")
}

/// One layer's objects in device order, exactly as `Tier::submit_load` lists them.
fn layer_objects(
    layout: &PoolLayout,
    table: &P2pTable,
    runs: &[Vec<u32>],
    slots: &[u64],
    mem_blocks: &[u32],
    layer: u32,
) -> Vec<(u16, u64, u32, u32)> {
    let mut objects = Vec::new();
    for (r, run) in runs.iter().enumerate() {
        for kv in 0..2 {
            for &p in run {
                let (dev, off) = layout.object_offset(slots[p as usize], layer, kv);
                objects.push((
                    dev,
                    off,
                    table.index(mem_blocks[p as usize], layer, kv),
                    r as u32,
                ));
            }
        }
    }
    objects
}

fn bench_planner(c: &mut Criterion) {
    let geo = kvtier::model::preset("llama3-8b", 16).expect("preset");
    let obj = geo.object_bytes();
    let blocks = (PREFIX_TOKENS / geo.block_size) as usize;
    let layout = PoolLayout::new(geo, GROUP_BLOCKS, vec![POOL_GROUPS]);
    let table = engine_table(geo);
    let mem_blocks: Vec<u32> = random_distinct(ENGINE_BLOCKS as u64, blocks, 1)
        .into_iter()
        .map(|b| b as u32)
        .collect();
    let positions: Vec<u32> = (0..blocks as u32).collect();
    let together: Vec<u64> = (0..blocks as u64).collect();
    let mut permuted = together.clone();
    let order = random_distinct(blocks as u64, blocks, 2);
    for (p, &o) in order.iter().enumerate() {
        permuted[p] = together[o as usize];
    }
    let scattered = random_distinct(layout.total_slots(), blocks, 3);
    eprintln!(
        "planner: llama3-8b, {PREFIX_TOKENS}-token prefix = {blocks} blocks, {} KiB objects, \
         groups of {GROUP_BLOCKS} blocks, pool of {} slots, max I/O {} MiB, layer {LAYER}",
        obj >> 10,
        layout.total_slots(),
        MAX_IO_BYTES >> 20
    );

    let mut group = c.benchmark_group("planner");
    group
        .warm_up_time(Duration::from_secs(1))
        .measurement_time(Duration::from_secs(3))
        .sample_size(20);
    for (case, slots) in [
        ("stored_together", &together),
        ("slots_permuted", &permuted),
        ("scattered", &scattered),
    ] {
        let runs = group_runs(GROUP_BLOCKS as u64, slots, &positions);
        let objects = layer_objects(&layout, &table, &runs, slots, &mem_blocks, LAYER);
        let ios = coalesce(IOCTX_OP_READ, obj, MAX_IO_BYTES, &objects);
        let bytes: u64 = ios.iter().map(|io| io.len as u64).sum();
        assert_eq!(
            bytes,
            objects.len() as u64 * obj,
            "every object planned once"
        );
        eprintln!(
            "planner: {case}: {} runs; one layer: {} objects in -> {} I/Os out (mean {:.0} KiB, {:.1} segments per I/O)",
            runs.len(),
            objects.len(),
            ios.len(),
            bytes as f64 / ios.len() as f64 / 1024.0,
            objects.len() as f64 / ios.len() as f64
        );

        group.throughput(Throughput::Elements(blocks as u64));
        group.bench_function(BenchmarkId::new("group_runs", case), |b| {
            b.iter(|| group_runs(GROUP_BLOCKS as u64, black_box(slots), &positions))
        });
        group.throughput(Throughput::Elements(objects.len() as u64));
        group.bench_function(BenchmarkId::new("plan_layer", case), |b| {
            b.iter(|| {
                let objects =
                    layer_objects(&layout, &table, black_box(&runs), slots, &mem_blocks, LAYER);
                coalesce(IOCTX_OP_READ, obj, MAX_IO_BYTES, &objects)
            })
        });
    }
    group.finish();
}

criterion_group!(benches, bench_planner);
criterion_main!(benches);
