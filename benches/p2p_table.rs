//! P2P table for a 60 GiB KV pool (Tutti's example): the build at
//! registration, its size next to the NVMe PRP lists the same memory would
//! need, and the per-layer descriptor lookup a restore does.
//!
//! The memory is described by fake, aligned addresses: building the table
//! only computes addresses and never touches the memory, so no 60 GiB
//! allocation is made (and `-- --test` in CI stays cheap).

use criterion::{black_box, criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use kvtier::p2p::{prp_list_bytes, P2pTable};
use kvtier::{KvLayout, KvMemory, MemoryKind};
use std::time::Duration;

const POOL_BYTES: u64 = 60 << 30;
/// Tokens of the prefix whose layer the lookup bench resolves.
const PREFIX_TOKENS: u32 = 64 * 1024;
const MIB: f64 = (1u64 << 20) as f64;
const GIB: f64 = (1u64 << 30) as f64;

/// llama3-8b at block size 32 (64 KiB objects), as vLLM's per-layer tensors
/// at made-up, 2 MiB-aligned, non-overlapping addresses.
fn sixty_gib_memory() -> KvMemory {
    let geometry = kvtier::model::preset("llama3-8b", 32).expect("preset");
    let num_blocks = (POOL_BYTES / geometry.block_bytes()) as u32;
    let per_layer = 2 * num_blocks as u64 * geometry.object_bytes();
    let stride = per_layer.next_multiple_of(2 << 20);
    let base = 0x7f00_0000_0000u64;
    let layer_bases = (0..geometry.layers as u64)
        .map(|l| base + l * stride)
        .collect();
    KvMemory {
        geometry,
        num_blocks,
        layout: KvLayout::PerLayer { layer_bases },
        kind: MemoryKind::Host,
    }
}

/// splitmix64: a reproducible stream without a dev-dependency.
fn splitmix(state: &mut u64) -> u64 {
    *state = state.wrapping_add(0x9e37_79b9_7f4a_7c15);
    let mut z = *state;
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// `n` distinct memory blocks out of `num_blocks`, in random order: where a
/// paged-KV allocator puts a long prefix after the cache has churned.
fn scattered_blocks(num_blocks: u32, n: u32, seed: u64) -> Vec<u32> {
    let mut all: Vec<u32> = (0..num_blocks).collect();
    let mut s = seed;
    for i in 0..n as usize {
        let j = i + (splitmix(&mut s) % (all.len() - i) as u64) as usize;
        all.swap(i, j);
    }
    all.truncate(n as usize);
    all
}

fn bench_p2p_table(c: &mut Criterion) {
    let mem = sixty_gib_memory();
    let g = mem.geometry;
    let object_bytes = g.object_bytes();
    let total_bytes = mem.total_bytes();
    let table = P2pTable::build(&mem).expect("P2P table for the 60 GiB pool");
    let descriptors = table.entries().len() as u64;
    let table_bytes = table.table_bytes();
    let prp_bytes = prp_list_bytes(total_bytes, object_bytes);
    eprintln!(
        "p2p_table: llama3-8b, block {} tokens, {} KiB objects, {} blocks, {:.1} GiB of KV memory",
        g.block_size,
        object_bytes >> 10,
        mem.num_blocks,
        total_bytes as f64 / GIB
    );
    eprintln!(
        "p2p_table: {descriptors} SGL descriptors = {table_bytes} B ({:.2} MiB); \
         PRP lists for the same memory: {prp_bytes} B ({:.2} GiB); PRP / SGL = {:.0}x",
        table_bytes as f64 / MIB,
        prp_bytes as f64 / GIB,
        prp_bytes as f64 / table_bytes as f64
    );

    let mut group = c.benchmark_group("p2p_table");
    group
        .warm_up_time(Duration::from_secs(1))
        .measurement_time(Duration::from_secs(3))
        .sample_size(20);

    group.throughput(Throughput::Elements(descriptors));
    group.bench_function(BenchmarkId::new("build", "60GiB_64KiB_objects"), |b| {
        b.iter(|| P2pTable::build(black_box(&mem)).expect("build"))
    });

    // One layer of a 64K-token prefix whose blocks are scattered over the
    // engine's KV memory: K and V of every block, by index, in the order a
    // load names them.
    let blocks = scattered_blocks(mem.num_blocks, PREFIX_TOKENS / g.block_size, 0x6b76_7469);
    let layer = g.layers / 2;
    let lookups = blocks.len() as u64 * 2;
    eprintln!(
        "p2p_table: lookup = one layer of a {PREFIX_TOKENS}-token prefix: {} blocks x K,V = {lookups} descriptors ({:.1} MiB of KV)",
        blocks.len(),
        (lookups * object_bytes) as f64 / MIB
    );
    group.throughput(Throughput::Elements(lookups));
    group.bench_function(BenchmarkId::new("lookup_layer", "64K_tokens"), |b| {
        b.iter(|| {
            let (mut addr_sum, mut bytes) = (0u64, 0u64);
            for &block in black_box(&blocks) {
                for kv in 0..2 {
                    let e = table
                        .entry(table.index(block, layer, kv))
                        .expect("index inside the table");
                    addr_sum = addr_sum.wrapping_add(e.addr);
                    bytes += e.len as u64;
                }
            }
            (addr_sum, bytes)
        })
    });
    group.finish();
}

criterion_group!(benches, bench_p2p_table);
criterion_main!(benches);
