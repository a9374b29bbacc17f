//! gio_uring: the host cost of filling and cycling IOCBs, and one IOCB end to
//! end through the io_uring engine on a small O_DIRECT file.
//!
//! * `fill_iocb`: get_iocb, push 2048 IOCTXs of 4 segments until the IOCB is
//!   full, submit, and play the engine (pop_sq, complete_ctx each, pop_cq),
//!   then release: the per-IOCTX bookkeeping a submitter and an engine do.
//! * `iocb_round_trip`: one IOCB id through both rings with no IOCTX.
//! * `uring_iocb`: one IOCB of 64 x 4 KiB reads (64 SQEs, one io_uring_enter)
//!   restoring one layer of 32 blocks scattered in memory, and for contrast
//!   the same 256 KiB as one coalesced IOCTX of 64 segments (one SQE).

use criterion::{black_box, criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use kvtier::engine::uring::{UringConfig, UringDevice, UringEngine};
use kvtier::engine::{EngineStats, IoEngine};
use kvtier::p2p::P2pTable;
use kvtier::pool::backing::BackingDevice;
use kvtier::ring::abi::{
    IoCtx, Iocb, IOCB_MAX_IOCTX, IOCB_MAX_SEGS, IOCTX_OP_FLUSH, IOCTX_OP_READ, IOCTX_OP_WRITE,
    IOCTX_STATUS_OK,
};
use kvtier::ring::GioRing;
use kvtier::submitter::Submitter;
use kvtier::{DType, HostKvCache, HostLayout, KvGeometry};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

const RING_DEPTH: u32 = 64;
const SEGS_PER_CTX: u32 = 4;
/// Reads in the end-to-end IOCB.
const READS: u32 = 64;
/// The layer the end-to-end IOCB restores.
const LOAD_LAYER: u32 = 1;
const DEVICE_BYTES: u64 = 64 << 20;
/// Device distance between the end-to-end reads: spread over the file.
const READ_STRIDE: u64 = DEVICE_BYTES / READS as u64;

fn configure<'a>(
    c: &'a mut Criterion,
    name: &str,
) -> criterion::BenchmarkGroup<'a, criterion::measurement::WallTime> {
    let mut group = c.benchmark_group(name);
    group
        .warm_up_time(Duration::from_secs(1))
        .measurement_time(Duration::from_secs(3))
        .sample_size(20);
    group
}

fn bench_ring(c: &mut Criterion) {
    let mut ring = GioRing::new(RING_DEPTH).expect("ring");
    eprintln!(
        "gio_uring: IOCB = {} KiB ({IOCB_MAX_IOCTX} IOCTXs of {} B + {IOCB_MAX_SEGS} segments; \
         one IOCTX per thread of a 2-SM Hopper scheduling unit); arena of {RING_DEPTH} IOCBs = {} MiB",
        std::mem::size_of::<Iocb>() >> 10,
        std::mem::size_of::<IoCtx>(),
        (RING_DEPTH as usize * std::mem::size_of::<Iocb>()) >> 20
    );

    let mut group = configure(c, "gio_ring");
    group.throughput(Throughput::Elements(IOCB_MAX_IOCTX as u64));
    group.bench_function(
        BenchmarkId::new("fill_iocb", format!("{IOCB_MAX_IOCTX}x{SEGS_PER_CTX}segs")),
        |b| {
            b.iter(|| {
                let id = ring.get_iocb().expect("a free IOCB");
                let mut n = 0u32;
                loop {
                    let s = n * SEGS_PER_CTX;
                    let ctx = IoCtx {
                        op: IOCTX_OP_READ,
                        dev_offset: n as u64 * (64 << 10),
                        len: 64 << 10,
                        tag: n,
                        ..Default::default()
                    };
                    if ring.push_ctx(id, ctx, &[s, s + 1, s + 2, s + 3]).is_none() {
                        break;
                    }
                    n += 1;
                }
                debug_assert_eq!(n as usize, IOCB_MAX_IOCTX);
                ring.submit(id).expect("submit");
                let eid = ring.pop_sq().expect("submitted IOCB");
                for c in 0..n {
                    ring.complete_ctx(eid, c, IOCTX_STATUS_OK, 64 << 10);
                }
                let done = ring.pop_cq().expect("completed IOCB");
                ring.release(black_box(done));
                n
            })
        },
    );

    group.throughput(Throughput::Elements(1));
    group.bench_function("iocb_round_trip", |b| {
        b.iter(|| {
            let id = ring.get_iocb().expect("a free IOCB");
            ring.submit(id).expect("submit");
            let eid = ring.pop_sq().expect("submitted IOCB");
            ring.finish(eid);
            let done = ring.pop_cq().expect("completed IOCB");
            ring.release(black_box(done));
        })
    });
    group.finish();
}

/// A directory under the temp dir (or `KVTIER_TEST_DIR`), removed on drop.
struct TempDir(PathBuf);

impl TempDir {
    fn new() -> TempDir {
        let base = std::env::var_os("KVTIER_TEST_DIR")
            .map(PathBuf::from)
            .unwrap_or_else(std::env::temp_dir);
        let p = base.join(format!("kvtier-bench-gio-{}", std::process::id()));
        std::fs::create_dir_all(&p).expect("bench temp dir");
        TempDir(p)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// Submit one IOCB of `ctxs`, wait for it, check every IOCTX moved its bytes.
fn run_iocb(io: &mut Submitter, ctxs: &[(IoCtx, Vec<u32>)]) {
    let id = io.get_iocb().expect("a free IOCB");
    for (c, segs) in ctxs {
        io.ring_mut().push_ctx(id, *c, segs).expect("room");
    }
    io.submit(id).expect("submit");
    let done = io.wait_cqe().expect("wait_cqe");
    assert_eq!(done, id);
    let b = io.ring().iocb(id);
    for c in &b.ctx[..b.hdr.count as usize] {
        assert_eq!(
            c.status, IOCTX_STATUS_OK,
            "IOCTX failed: result {}",
            c.result
        );
        assert_eq!(c.result, c.len);
    }
    io.release(id);
}

fn stats_delta(a: EngineStats, b: EngineStats) -> (u64, u64, u64, u64) {
    (
        b.iocbs - a.iocbs,
        b.ios - a.ios,
        b.syscalls - a.syscalls,
        b.fixed_buffer_ios - a.fixed_buffer_ios,
    )
}

fn bench_uring(c: &mut Criterion) {
    // Drop order (reverse of declaration): engine, table, cache, device, dir.
    let dir = TempDir::new();
    let path = dir.0.join("dev");
    let dev = BackingDevice::create(&path, Some(DEVICE_BYTES), 4096, false).expect("backing file");
    let geo = KvGeometry {
        layers: 4,
        kv_heads: 2,
        head_dim: 64,
        dtype: DType::BF16,
        block_size: 16,
    };
    let obj = geo.object_bytes() as u32;
    // One layer of 32 blocks, K run then V run (the device order a load
    // plans): the 64 objects both IOCBs read into.
    let blocks = READS / 2;
    let cache = HostKvCache::new(geo, blocks, HostLayout::PerLayer).expect("host KV cache");
    let table = Arc::new(P2pTable::build(cache.memory()).expect("P2P table"));
    let mut engine = UringEngine::new(
        &[UringDevice {
            fd: dev.as_fd().try_clone_to_owned().unwrap(),
            name: "bench".into(),
        }],
        UringConfig::default(),
    )
    .expect("io_uring engine");
    engine
        .register_memory(table.clone())
        .expect("register memory");
    let mut io = Submitter::new(RING_DEPTH, Box::new(engine)).expect("gio_uring");

    // The prefix's blocks sit scattered in the engine's memory (13 is coprime
    // to 32: a fixed permutation), so no two objects are adjacent in memory.
    let mem_blocks: Vec<u32> = (0..blocks).map(|b| (b * 13 + 5) % blocks).collect();
    let objects: Vec<u32> = (0..2)
        .flat_map(|kv| mem_blocks.iter().map(move |&b| (b, kv)))
        .map(|(b, kv)| table.index(b, LOAD_LAYER, kv))
        .collect();
    let ctx = |op: u8, off: u64, len: u32| IoCtx {
        op,
        dev_offset: off,
        len,
        ..Default::default()
    };
    // 64 separate 4 KiB objects spread over the file...
    let scattered: Vec<(IoCtx, Vec<u32>)> = objects
        .iter()
        .enumerate()
        .map(|(i, &s)| (ctx(IOCTX_OP_READ, i as u64 * READ_STRIDE, obj), vec![s]))
        .collect();
    // ...and the same bytes as one 256 KiB extent (what the planner makes of
    // a run stored together), scattered into the same 64 objects by SGL/readv.
    let coalesced_off = READ_STRIDE / 2;
    let coalesced = vec![(
        ctx(IOCTX_OP_READ, coalesced_off, READS * obj),
        objects.clone(),
    )];

    // Write real data where the reads go (an fallocated file's unwritten
    // extents read as zeros without touching the disk), then flush.
    for b in 0..blocks {
        cache.fill_block(b, 7 + b as u64);
    }
    let as_writes = |v: &[(IoCtx, Vec<u32>)]| -> Vec<(IoCtx, Vec<u32>)> {
        v.iter()
            .map(|(c, s)| {
                (
                    IoCtx {
                        op: IOCTX_OP_WRITE,
                        ..*c
                    },
                    s.clone(),
                )
            })
            .collect()
    };
    run_iocb(&mut io, &as_writes(&scattered));
    run_iocb(&mut io, &as_writes(&coalesced));
    run_iocb(&mut io, &[(ctx(IOCTX_OP_FLUSH, 0, 0), vec![])]);
    for reads in [&scattered, &coalesced] {
        cache.clear();
        run_iocb(&mut io, reads);
        assert!(
            (0..blocks).all(|b| cache.block_matches(b, 7 + b as u64, LOAD_LAYER..LOAD_LAYER + 1)),
            "the reads bring back what was written"
        );
    }

    eprintln!(
        "gio_uring: engine {}: {}; device {} ({} MiB, O_DIRECT)",
        io.engine().name(),
        io.engine().describe(),
        path.display(),
        DEVICE_BYTES >> 20
    );
    let mut group = configure(c, "uring_iocb");
    group.throughput(Throughput::Bytes(READS as u64 * obj as u64));
    for (name, ctxs) in [
        (format!("{READS}x4KiB_reads"), &scattered),
        (
            format!("1x{}KiB_read_{READS}segs", (READS * obj) >> 10),
            &coalesced,
        ),
    ] {
        let before = io.engine().stats();
        run_iocb(&mut io, ctxs);
        let (iocbs, ios, syscalls, fixed) = stats_delta(before, io.engine().stats());
        eprintln!(
            "gio_uring: {name}: one IOCB = {iocbs} IOCB, {ios} device I/Os, {syscalls} syscalls, {fixed} fixed-buffer I/Os"
        );
        group.bench_function(BenchmarkId::new("end_to_end", &name), |b| {
            b.iter(|| {
                let id = io.get_iocb().expect("a free IOCB");
                for (c, segs) in ctxs {
                    io.ring_mut().push_ctx(id, *c, segs).expect("room");
                }
                io.submit(id).expect("submit");
                let done = io.wait_cqe().expect("wait_cqe");
                assert_eq!(io.ring().iocb(done).hdr.errors, 0, "IOCTX errors");
                io.release(done);
            })
        });
    }
    group.finish();
}

criterion_group!(benches, bench_ring, bench_uring);
criterion_main!(benches);
