//! The io_uring engine driven directly through gio_uring: data paths (fixed,
//! vectored-fixed, plain iovec), and failures that must reach the IOCTX.

mod common;

use common::*;
use kvtier::engine::uring::{UringConfig, UringDevice, UringEngine};
use kvtier::p2p::P2pTable;
use kvtier::pool::backing::BackingDevice;
use kvtier::ring::abi::*;
use kvtier::submitter::Submitter;
use kvtier::tier::{KeyOutcome, Tier, TierConfig};
use kvtier::{HostKvCache, HostLayout, Key};
use std::sync::Arc;

struct Rig {
    _dir: TempDir,
    _dev: BackingDevice,
    cache: Arc<HostKvCache>,
    table: Arc<P2pTable>,
    io: Submitter,
}

fn rig(fixed_buffers: bool, layout: HostLayout) -> Rig {
    let dir = TempDir::new("engine");
    let dev = BackingDevice::create(&dir.file("dev"), Some(16 << 20), 4096, false).unwrap();
    let geo = tiny_geometry();
    let cache = Arc::new(HostKvCache::new(geo, 16, layout).unwrap());
    let table = Arc::new(P2pTable::build(cache.memory()).unwrap());
    let mut engine = UringEngine::new(
        &[UringDevice {
            fd: dev.as_fd().try_clone_to_owned().unwrap(),
            name: "dev".into(),
        }],
        UringConfig::default()
            .with_queue_depth(4)
            .with_fixed_buffers(fixed_buffers),
    )
    .unwrap();
    use kvtier::engine::IoEngine;
    engine.register_memory(table.clone()).unwrap();
    let io = Submitter::new(8, Box::new(engine)).unwrap();
    Rig {
        _dir: dir,
        _dev: dev,
        cache,
        table,
        io,
    }
}

fn ctx(op: u8, off: u64, len: u32) -> IoCtx {
    IoCtx {
        op,
        dev_offset: off,
        len,
        ..Default::default()
    }
}

/// Submit one IOCB of (ctx, segs) and wait for it; returns the IOCTX statuses.
fn run(io: &mut Submitter, ctxs: &[(IoCtx, Vec<u32>)]) -> Vec<(u16, u32)> {
    let id = io.get_iocb().unwrap();
    for (c, segs) in ctxs {
        io.ring_mut().push_ctx(id, *c, segs).unwrap();
    }
    io.submit(id).unwrap();
    assert_eq!(io.wait_cqe().unwrap(), id);
    let b = io.ring().iocb(id);
    let out = b.ctx[..b.hdr.count as usize]
        .iter()
        .map(|c| (c.status, c.result))
        .collect();
    io.release(id);
    out
}

#[test]
fn write_then_read_back_through_every_path() {
    for (fixed, layout) in [
        (true, HostLayout::PerLayer),
        (true, HostLayout::CrossLayer),
        (false, HostLayout::PerLayer),
    ] {
        let mut r = rig(fixed, layout);
        let obj = tiny_geometry().object_bytes() as u32;
        for b in 0..8 {
            r.cache.fill_block(b, 100 + b as u64);
        }
        // Blocks 0..8 of layer 2, K then V, to one device extent: one IOCTX of 16 segments.
        let mut segs: Vec<u32> = (0..8).map(|b| r.table.index(b, 2, 0)).collect();
        segs.extend((0..8).map(|b| r.table.index(b, 2, 1)));
        let st = run(
            &mut r.io,
            &[(ctx(IOCTX_OP_WRITE, 1 << 20, 16 * obj), segs.clone())],
        );
        assert_eq!(st, vec![(0, 16 * obj)]);
        let st = run(&mut r.io, &[(ctx(IOCTX_OP_FLUSH, 0, 0), vec![])]);
        assert_eq!(st[0].0, 0);
        r.cache.clear();
        // Read back into the blocks in reverse order (scattered memory).
        let rev: Vec<u32> = (0..8)
            .rev()
            .map(|b| r.table.index(b, 2, 0))
            .chain((0..8).rev().map(|b| r.table.index(b, 2, 1)))
            .collect();
        let st = run(&mut r.io, &[(ctx(IOCTX_OP_READ, 1 << 20, 16 * obj), rev)]);
        assert_eq!(st, vec![(0, 16 * obj)]);
        for b in 0..8u32 {
            assert!(
                r.cache.block_matches(7 - b, 100 + b as u64, 2..3),
                "fixed={fixed} {layout:?} block {b}"
            );
        }
        let s = r.io.engine().stats();
        assert_eq!(s.ios, 3, "write, flush, read");
        if fixed {
            // Where the kernel pins the memory, both data I/Os use it (the
            // per-layer K and V runs are two extents of one buffer: vectored fixed).
            if r.io.engine().describe().contains("fixed buffer(") {
                let want = if r.io.engine().describe().contains("vectored fixed") {
                    2
                } else {
                    0
                };
                assert_eq!(s.fixed_buffer_ios, want, "{}", r.io.engine().describe());
            }
        } else {
            assert_eq!(s.fixed_buffer_ios, 0);
        }
    }
}

#[test]
fn one_iocb_of_many_ioctxs_is_one_submission_per_queue_depth() {
    let mut r = rig(true, HostLayout::PerLayer);
    let obj = tiny_geometry().object_bytes() as u32;
    let ctxs: Vec<(IoCtx, Vec<u32>)> = (0..16)
        .map(|b| {
            (
                ctx(IOCTX_OP_WRITE, b as u64 * obj as u64, obj),
                vec![r.table.index(b, 0, 0)],
            )
        })
        .collect();
    let st = run(&mut r.io, &ctxs);
    assert!(st.iter().all(|&(s, n)| s == 0 && n == obj));
    let s = r.io.engine().stats();
    assert_eq!((s.iocbs, s.ios), (1, 16));
    // Queue depth 4: 16 I/Os need at least 4 submissions, and one wait per completion batch at most.
    assert!(s.syscalls <= 32, "{s:?}");
}

#[test]
fn kernel_errors_short_reads_and_malformed_ioctxs_reach_the_ioctx() {
    let mut r = rig(true, HostLayout::PerLayer);
    let obj = tiny_geometry().object_bytes() as u32;
    let seg = r.table.index(0, 0, 0);
    let st = run(
        &mut r.io,
        &[
            // An offset that is negative as a loff_t: the kernel fails it (EINVAL).
            (ctx(IOCTX_OP_READ, 1 << 63, obj), vec![seg]),
            // Past the end of the 16 MiB file: a short (zero-byte) read.
            (ctx(IOCTX_OP_READ, 16 << 20, obj), vec![seg]),
            // Length that disagrees with its segments.
            (ctx(IOCTX_OP_READ, 0, obj * 2), vec![seg]),
            // A P2P index outside the table.
            (ctx(IOCTX_OP_READ, 0, obj), vec![u32::MAX]),
            // And one good I/O in the same IOCB still completes.
            (ctx(IOCTX_OP_READ, 0, obj), vec![seg]),
        ],
    );
    assert_eq!(st[0], (IOCTX_STATUS_ERRNO, libc::EINVAL as u32));
    assert_eq!(st[1], (IOCTX_STATUS_SHORT, 0));
    assert_eq!(st[2].0, IOCTX_STATUS_INVALID);
    assert_eq!(st[3].0, IOCTX_STATUS_INVALID);
    assert_eq!(st[4], (0, obj));
    assert_eq!(r.io.engine().stats().errors, 4);
    // A device index the engine does not have.
    let mut bad = ctx(IOCTX_OP_READ, 0, obj);
    bad.dev = 3;
    assert_eq!(
        run(&mut r.io, &[(bad, vec![seg])])[0].0,
        IOCTX_STATUS_INVALID
    );
    // Waiting with nothing in flight is an error, not a hang.
    assert!(r.io.wait_cqe().is_err());
}

#[test]
fn a_short_read_fails_the_keys_it_serves_with_a_message() {
    let dir = TempDir::new("shortload");
    let geo = tiny_geometry();
    let pool = create_pool(&dir, geo, 4, 1, 4);
    let path = pool.paths()[0].clone();
    let mut tier = Tier::open(pool, TierConfig::default()).unwrap();
    let cache = Arc::new(HostKvCache::new(geo, 16, HostLayout::PerLayer).unwrap());
    tier.register_host_cache(cache.clone()).unwrap();
    let ks: Vec<Key> = (0..16).map(Key::from_u64).collect();
    let mem: Vec<u32> = (0..16).collect();
    let job = tier.submit_store(&ks, &mem).unwrap();
    assert!(tier.wait(job).unwrap().all_ok());
    // The device shrinks under the pool: the last groups' reads come back short.
    let layout = tier.pool().layout().clone();
    let (_, cut, _) = layout.group_headers(2);
    std::fs::OpenOptions::new()
        .write(true)
        .open(&path)
        .unwrap()
        .set_len(cut)
        .unwrap();
    let job = tier.submit_load(&ks, &mem, 0..geo.layers).unwrap();
    let r = tier.wait(job).unwrap();
    for (i, o) in r.outcomes.iter().enumerate() {
        if i < 8 {
            assert_eq!(*o, KeyOutcome::Done, "key {i} lives in groups 0-1");
        } else {
            match o {
                KeyOutcome::Failed(m) => assert!(
                    m.message.contains("short read") && m.message.contains(path.to_str().unwrap()),
                    "{m}"
                ),
                other => panic!("key {i}: {other:?}"),
            }
        }
    }
}
