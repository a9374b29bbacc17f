//! The userspace NVMe suite: plain functions over `Controller<B: Bar0>` and
//! a `DmaAlloc` (and, for the engines, a controller and allocator to own),
//! run against the simulated controller (`tests/nvme_sim.rs`), the GPU
//! engine's host-run kernel (`tests/gpu_engine_host.rs`) and QEMU's hw/nvme
//! in the guest (`examples/nvme_guest.rs`).
#![allow(dead_code)]
use kvtier::nvme::ctrl::{Bar0, Controller, DataMode, DmaAlloc, DmaRegion, IoDir};
use kvtier::nvme::spec::{Extent, Psdt, SglDescriptor, Sqe};
use kvtier::nvme::DataPtr;
use std::time::{Duration, Instant};

/// Deterministic bytes that differ per seed and position.
pub fn pattern(len: usize, seed: u64) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}

fn buffer<A: DmaAlloc>(dma: &mut A, len: usize, page: u64) -> DmaRegion {
    let r = dma.alloc(len, page as usize).expect("DMA buffer");
    r.fill(0);
    r
}

fn write_prp<B: Bar0, A: DmaAlloc>(c: &mut Controller<B>, dma: &mut A, lba: u64, data: &[u8]) {
    let w = buffer(dma, data.len(), c.page_bytes());
    w.write(0, data);
    c.transfer(
        0,
        IoDir::Write,
        lba,
        &[w.extent(0, data.len())],
        DataMode::Prp,
    )
    .expect("PRP write");
}

fn read_prp<B: Bar0, A: DmaAlloc>(
    c: &mut Controller<B>,
    dma: &mut A,
    lba: u64,
    len: usize,
) -> Vec<u8> {
    let r = buffer(dma, len, c.page_bytes());
    r.fill(0xee);
    c.transfer(0, IoDir::Read, lba, &[r.extent(0, len)], DataMode::Prp)
        .expect("PRP read");
    r.to_vec()
}

fn assert_same(got: &[u8], want: &[u8], what: &str) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    if let Some(i) = got.iter().zip(want).position(|(a, b)| a != b) {
        panic!(
            "{what}: first difference at byte {i}: got {:#04x}, want {:#04x}",
            got[i], want[i]
        );
    }
}

/// Bring-up facts every controller must report.
pub fn identify<B: Bar0>(c: &Controller<B>) {
    let id = c.identify();
    assert!(id.nn >= 1, "NN {}", id.nn);
    assert!(id.sqe_bytes() <= 64 && id.cqe_bytes() <= 16);
    assert!(
        c.sgl_supported(),
        "SGLS {:#x}: the suite needs SGLs",
        id.sgls
    );
    let ns = c.namespace();
    assert_eq!(ns.lba_bytes, 512);
    assert!(
        ns.nsze >= 4096,
        "namespace of {} LBAs is too small for the suite",
        ns.nsze
    );
    assert!(c.io_queue_count() >= 1);
    assert_eq!(c.max_transfer_bytes() % c.page_bytes(), 0);
    if let Some(mdts) = id.max_transfer_bytes(c.cap().mpsmin_bytes()) {
        assert!(c.max_transfer_bytes() <= mdts);
    }
}

/// PRP write, SGL read (one inline Data Block) and PRP read back.
pub fn prp_write_sgl_read<B: Bar0, A: DmaAlloc>(c: &mut Controller<B>, dma: &mut A, lba: u64) {
    let len = 256 * 1024;
    let data = pattern(len, lba);
    write_prp(c, dma, lba, &data);
    let r = buffer(dma, len, c.page_bytes());
    r.fill(0xee);
    c.transfer(0, IoDir::Read, lba, &[r.extent(0, len)], DataMode::Sgl)
        .expect("SGL read");
    assert_same(&r.to_vec(), &data, "SGL read of PRP-written data");
    assert_same(
        &read_prp(c, dma, lba, len),
        &data,
        "PRP read of PRP-written data",
    );
}

/// SGL write (one Data Block), PRP read.
pub fn sgl_write_prp_read<B: Bar0, A: DmaAlloc>(c: &mut Controller<B>, dma: &mut A, lba: u64) {
    let len = 64 * 1024;
    let data = pattern(len, lba ^ 0xbeef);
    let w = buffer(dma, len, c.page_bytes());
    w.write(0, &data);
    c.transfer(0, IoDir::Write, lba, &[w.extent(0, len)], DataMode::Sgl)
        .expect("SGL write");
    assert_same(
        &read_prp(c, dma, lba, len),
        &data,
        "PRP read of SGL-written data",
    );
}

/// One SGL read command (a Last Segment of Data Blocks) into six
/// unaligned extents of odd lengths; the bytes around them stay untouched.
pub fn scattered_sgl_read<B: Bar0, A: DmaAlloc>(c: &mut Controller<B>, dma: &mut A, lba: u64) {
    let lens = [1001usize, 3097, 4095, 513, 7165, 513]; // 16 KiB in all
    let total: usize = lens.iter().sum();
    assert_eq!(total, 16 * 1024);
    let data = pattern(total, lba);
    write_prp(c, dma, lba, &data);
    let guard = 64;
    let bufs: Vec<DmaRegion> = lens
        .iter()
        .map(|&l| {
            let b = buffer(dma, l + 2 * guard + 8, c.page_bytes());
            b.fill(0xa5);
            b
        })
        .collect();
    let extents: Vec<Extent> = bufs
        .iter()
        .zip(lens)
        .enumerate()
        .map(|(i, (b, l))| b.extent(guard + 1 + i, l)) // odd, unaligned starts
        .collect();
    let commands = c
        .transfer(0, IoDir::Read, lba, &extents, DataMode::Sgl)
        .expect("scattered SGL read");
    assert_eq!(commands, 1, "one SGL command for all extents");
    let mut at = 0;
    for (i, (b, l)) in bufs.iter().zip(lens).enumerate() {
        let all = b.to_vec();
        let start = guard + 1 + i;
        assert_same(
            &all[start..start + l],
            &data[at..at + l],
            &format!("extent {i}"),
        );
        assert!(
            all[..start].iter().all(|&x| x == 0xa5),
            "extent {i}: bytes before it written"
        );
        assert!(
            all[start + l..].iter().all(|&x| x == 0xa5),
            "extent {i}: bytes after it written"
        );
        at += l;
    }
}

/// Segment -> Last Segment chains (2 and 3 segments), reads and a write.
pub fn sgl_segment_chain<B: Bar0, A: DmaAlloc>(c: &mut Controller<B>, dma: &mut A, lba: u64) {
    let page = c.page_bytes();
    // As in the notes: Segment [DB, DB, Last Segment -> [DB, DB]].
    let lens = [4096usize, 2048, 6144, 4096];
    let total: usize = lens.iter().sum();
    let data = pattern(total, lba + 7);
    write_prp(c, dma, lba, &data);
    let bufs: Vec<DmaRegion> = lens.iter().map(|&l| buffer(dma, l, page)).collect();
    let extents: Vec<Extent> = bufs.iter().zip(lens).map(|(b, l)| b.extent(0, l)).collect();
    c.transfer(0, IoDir::Read, lba, &extents, DataMode::SglSegmentsOf(3))
        .expect("Segment -> Last Segment read");
    let got: Vec<u8> = bufs.iter().flat_map(|b| b.to_vec()).collect();
    assert_same(&got, &data, "2-segment chain read");

    // Seven extents, 3 per segment: Segment -> Segment -> Last Segment; write.
    let lens = [512usize, 1536, 999, 1049, 2048, 3584, 6656];
    let total: usize = lens.iter().sum();
    assert_eq!(total % 512, 0);
    let data = pattern(total, lba + 9);
    let bufs: Vec<DmaRegion> = lens.iter().map(|&l| buffer(dma, l + 4, page)).collect();
    let mut at = 0;
    let extents: Vec<Extent> = bufs
        .iter()
        .zip(lens)
        .map(|(b, l)| {
            b.write(3, &data[at..at + l]);
            at += l;
            b.extent(3, l)
        })
        .collect();
    c.transfer(0, IoDir::Write, lba, &extents, DataMode::SglSegmentsOf(3))
        .expect("3-segment chain write");
    assert_same(
        &read_prp(c, dma, lba, total),
        &data,
        "PRP read of chain-written data",
    );
}

/// Transfers larger than the maximum transfer size are split, in both
/// modes; one command past MDTS is refused with Invalid Field.
pub fn split_at_mdts<B: Bar0, A: DmaAlloc>(c: &mut Controller<B>, dma: &mut A, lba: u64) {
    let max = c.max_transfer_bytes() as usize;
    let len = max * 6 + max / 4; // not a multiple of the limit
    let data = pattern(len, lba);
    let w = buffer(dma, len, c.page_bytes());
    w.write(0, &data);
    let n = c
        .transfer(0, IoDir::Write, lba, &[w.extent(0, len)], DataMode::Sgl)
        .expect("split SGL write");
    assert_eq!(n, 7, "{len} bytes at {max} per command");
    let r = buffer(dma, len, c.page_bytes());
    let n = c
        .transfer(0, IoDir::Read, lba, &[r.extent(0, len)], DataMode::Prp)
        .expect("split PRP read");
    assert_eq!(n, 7);
    assert_same(&r.to_vec(), &data, "split transfers");

    if let Some(mdts) = c.identify().max_transfer_bytes(c.cap().mpsmin_bytes()) {
        let over = (mdts * 2) as usize;
        if over <= len {
            let nlb = (over / 512 - 1) as u16;
            let sqe = Sqe::read(
                0,
                c.nsid(),
                lba,
                nlb,
                DataPtr::Sgl(SglDescriptor::data_block(r.dma(), over as u32)),
            );
            let err = c.execute(0, sqe).unwrap_err().to_string();
            assert!(err.contains("0x4002"), "one command past MDTS: {err}");
        }
    }
}

/// An SGL shorter than the transfer: status 0x400f in the error.
pub fn short_sgl<B: Bar0, A: DmaAlloc>(c: &mut Controller<B>, dma: &mut A, lba: u64) {
    let b = buffer(dma, 8192, c.page_bytes());
    let sqe = Sqe::read(
        0,
        c.nsid(),
        lba,
        7,
        DataPtr::Sgl(SglDescriptor::data_block(b.dma(), 2048)),
    );
    let err = c.execute(0, sqe).unwrap_err().to_string();
    assert!(err.contains("0x400f"), "{err}");
    assert!(err.contains("Data SGL Length Invalid"), "{err}");
    assert!(err.contains("queue 1"), "{err}");
}

/// A bit bucket descriptor (unsupported): 0x400d.
pub fn bit_bucket<B: Bar0>(c: &mut Controller<B>, lba: u64) {
    let sqe = Sqe::read(
        0,
        c.nsid(),
        lba,
        7,
        DataPtr::Sgl(SglDescriptor::bit_bucket(4096)),
    );
    let err = c.execute(0, sqe).unwrap_err().to_string();
    assert!(err.contains("0x400d"), "{err}");
}

/// PSDT=11b (reserved): 0x4002 Invalid Field.
pub fn psdt_reserved<B: Bar0, A: DmaAlloc>(c: &mut Controller<B>, dma: &mut A, lba: u64) {
    let b = buffer(dma, 4096, c.page_bytes());
    let mut sqe = Sqe::read(
        0,
        c.nsid(),
        lba,
        7,
        DataPtr::Sgl(SglDescriptor::data_block(b.dma(), 4096)),
    );
    sqe.set_psdt(Psdt::Reserved);
    let err = c.execute(0, sqe).unwrap_err().to_string();
    assert!(err.contains("0x4002"), "{err}");
    assert!(err.contains("Invalid Field in Command"), "{err}");
}

/// A transfer ending past the namespace: 0x4080 LBA Out of Range, with
/// the byte offset in the error.
pub fn lba_out_of_range<B: Bar0, A: DmaAlloc>(c: &mut Controller<B>, dma: &mut A) {
    let nsze = c.namespace().nsze;
    let b = buffer(dma, 8192, c.page_bytes());
    let err = c
        .transfer(
            0,
            IoDir::Read,
            nsze - 4,
            &[b.extent(0, 8192)],
            DataMode::Auto,
        )
        .unwrap_err();
    let msg = err.to_string();
    assert!(msg.contains("0x4080"), "{msg}");
    assert!(msg.contains("LBA Out of Range"), "{msg}");
    assert!(
        msg.contains(&format!("offset {}", (nsze - 4) * 512)),
        "{msg}"
    );
}

/// A command the controller never completes (the caller arranges it with
/// `arm`) times out with an error naming the queue, promptly; the queue
/// stays usable.
pub fn timeout_names_queue<B: Bar0, A: DmaAlloc>(
    c: &mut Controller<B>,
    dma: &mut A,
    lba: u64,
    arm: impl FnOnce(),
) {
    let b = buffer(dma, 4096, c.page_bytes());
    let old = c.io_timeout();
    c.set_io_timeout(Duration::from_millis(100));
    arm();
    let start = Instant::now();
    let err = c
        .transfer(0, IoDir::Read, lba, &[b.extent(0, 4096)], DataMode::Auto)
        .unwrap_err()
        .to_string();
    assert!(
        start.elapsed() < Duration::from_secs(5),
        "the wait must not hang"
    );
    assert!(err.contains("NVMe queue 1: no completion within"), "{err}");
    assert!(err.contains("outstanding"), "{err}");
    c.set_io_timeout(old);
    c.transfer(0, IoDir::Read, lba, &[b.extent(0, 4096)], DataMode::Auto)
        .expect("the queue works after a timeout");
}

// ------------------------------------------------ the nvme engine --

use kvtier::engine::nvme::NvmeEngine;
use kvtier::engine::IoEngine;
use kvtier::host::dio::AlignedBuf;
use kvtier::nvme::{NvmeConfig, NvmeNamespace};
use kvtier::p2p::P2pTable;
use kvtier::pool::{Key, OpenExpect, Pool, PoolConfig};
use kvtier::ring::abi::{IoCtx, IOCTX_OP_READ, IOCTX_OP_WRITE, IOCTX_STATUS_INVALID};
use kvtier::ring::GioRing;
use kvtier::tier::{Tier, TierConfig};
use kvtier::{HostKvCache, HostLayout};
use std::sync::Arc;

/// Runs one IOCB of `ctxs` (IoCtx, segments) through `engine`; returns
/// each IOCTX's (status, result).
pub fn run_iocb<E: IoEngine + ?Sized>(
    engine: &mut E,
    ring: &mut GioRing,
    ctxs: &[(IoCtx, Vec<u32>)],
) -> Vec<(u16, u32)> {
    let id = ring.get_iocb().unwrap();
    for (c, segs) in ctxs {
        ring.push_ctx(id, *c, segs).expect("room in the IOCB");
    }
    ring.submit(id).unwrap();
    engine.submit(ring).unwrap();
    let start = Instant::now();
    loop {
        if let Some(done) = ring.pop_cq() {
            assert_eq!(done, id);
            break;
        }
        engine.reap(ring, true).unwrap();
        assert!(
            start.elapsed() < Duration::from_secs(30),
            "IOCB never completed"
        );
    }
    let iocb = ring.iocb(id);
    let out = (0..ctxs.len())
        .map(|i| (iocb.ctx[i].status, iocb.ctx[i].result))
        .collect();
    ring.release(id);
    out
}

pub fn ioctx(op: u8, dev_offset: u64, len: u32) -> IoCtx {
    IoCtx {
        dev_offset,
        len,
        op,
        ..Default::default()
    }
}

/// The nvme engine on its own: eight 16 KiB buffers registered as a P2P
/// table; a write gathering buffers 5, 1, 3 (one command, an SGL of three
/// data blocks or a PRP list), a read scattering the same bytes into
/// buffers 0, 6, 2, 4 in another cut, verified byte for byte; a transfer
/// past MDTS split; then the error paths: an LBA past the namespace
/// surfaces as NVMe status 0x0080 in the IOCTX, a length that disagrees
/// with the segments as IOCTX_STATUS_INVALID, and nothing hangs.
pub fn engine_scatter_gather<B, A>(c: Controller<B>, dma: A, mode: DataMode, offset: u64)
where
    B: Bar0 + Send + Sync + 'static,
    A: DmaAlloc + Send + 'static,
{
    let nsze = c.namespace().nsze * c.lba_bytes() as u64;
    let max_cmd = c.max_transfer_bytes();
    let cfg = NvmeConfig::default().with_data_mode(mode);
    let ns = NvmeNamespace::new(c, dma, &cfg).expect("namespace");
    let mut engine = NvmeEngine::new(vec![ns], cfg).expect("engine");
    let mut ring = GioRing::new(4).unwrap();
    const BUF: usize = 16 << 10;
    let mut mem = AlignedBuf::zeroed(8 * BUF + 1024 * 1024);
    let table = P2pTable::for_buffers(mem.as_mut_ptr() as u64, BUF as u32, 8).unwrap();
    let mut table = table;
    let big = table
        .add_extra_region(mem.as_mut_ptr() as u64 + 8 * BUF as u64, 1 << 20, 1)
        .unwrap();
    engine.register_memory(Arc::new(table)).expect("register");
    let data = pattern(3 * BUF, offset ^ 0x51);
    for (i, b) in [5usize, 1, 3].iter().enumerate() {
        mem.as_mut_slice()[b * BUF..(b + 1) * BUF].copy_from_slice(&data[i * BUF..(i + 1) * BUF]);
    }
    let w = run_iocb(
        &mut engine,
        &mut ring,
        &[(ioctx(IOCTX_OP_WRITE, offset, 3 * BUF as u32), vec![5, 1, 3])],
    );
    assert_eq!(w, vec![(0, 3 * BUF as u32)], "gathered write");
    // Read back as two IOCTXs in one IOCB, into other buffers.
    let r = run_iocb(
        &mut engine,
        &mut ring,
        &[
            (ioctx(IOCTX_OP_READ, offset, 2 * BUF as u32), vec![0, 6]),
            (
                ioctx(IOCTX_OP_READ, offset + 2 * BUF as u64, BUF as u32),
                vec![2],
            ),
        ],
    );
    assert_eq!(r, vec![(0, 2 * BUF as u32), (0, BUF as u32)]);
    let got: Vec<u8> = [0usize, 6, 2]
        .iter()
        .flat_map(|b| mem.as_slice()[b * BUF..(b + 1) * BUF].to_vec())
        .collect();
    assert_same(&got, &data, "scattered read through the engine");

    // 1 MiB through one IOCTX: split at MDTS when MDTS is smaller.
    let big_data = pattern(1 << 20, offset ^ 0xb16);
    mem.as_mut_slice()[8 * BUF..].copy_from_slice(&big_data);
    let before = engine.stats().commands;
    let r = run_iocb(
        &mut engine,
        &mut ring,
        &[(
            ioctx(IOCTX_OP_WRITE, offset + (1 << 20), 1 << 20),
            vec![big],
        )],
    );
    assert_eq!(r, vec![(0, 1 << 20)]);
    let cmds = engine.stats().commands - before;
    assert_eq!(
        cmds,
        (1u64 << 20).div_ceil(max_cmd),
        "commands for 1 MiB at max transfer {max_cmd}"
    );
    mem.as_mut_slice()[8 * BUF..].fill(0);
    let r = run_iocb(
        &mut engine,
        &mut ring,
        &[(ioctx(IOCTX_OP_READ, offset + (1 << 20), 1 << 20), vec![big])],
    );
    assert_eq!(r, vec![(0, 1 << 20)]);
    assert_same(&mem.as_slice()[8 * BUF..], &big_data, "1 MiB split read");

    // Errors: LBA out of range (NVMe status 0x0080, DNR dropped) and a
    // malformed IOCTX, in the same IOCB as a good read.
    let r = run_iocb(
        &mut engine,
        &mut ring,
        &[
            (ioctx(IOCTX_OP_READ, nsze, BUF as u32), vec![0]),
            (ioctx(IOCTX_OP_READ, offset, BUF as u32 - 512), vec![0]),
            (ioctx(IOCTX_OP_READ, offset, BUF as u32), vec![7]),
        ],
    );
    assert_eq!(
        r[0],
        (0x0080, 0),
        "LBA out of range surfaces as its NVMe status"
    );
    assert_eq!(r[1], (IOCTX_STATUS_INVALID, 0));
    assert_eq!(r[2], (0, BUF as u32));
    assert_eq!(engine.stats().errors, 2);
    assert_eq!(engine.in_flight(), 0);
    drop(engine);
    drop(mem);
}

/// The tier storing and loading a llama3-8b-shaped cache (32 layers, 8 KV
/// heads x 128, bf16, 16-token blocks: 32 KiB objects, 2 MiB blocks)
/// through the nvme engine, the pool living directly on the namespace;
/// then the pool reopened from the namespace, checked clean, and loaded
/// again. Returns a summary line (bytes, commands, CPU ns per command).
pub fn tier_llama3_8b<B, A>(c: Controller<B>, dma: A, mode: DataMode) -> String
where
    B: Bar0 + Send + Sync + 'static,
    A: DmaAlloc + Send + 'static,
{
    let cfg = NvmeConfig::default().with_data_mode(mode);
    let ns = NvmeNamespace::new(c, dma, &cfg).expect("namespace");
    tier_llama3_8b_on(ns, &|ns| {
        Box::new(NvmeEngine::new(vec![ns.clone()], cfg.clone()).expect("engine"))
    })
}

/// [`tier_llama3_8b`] on a namespace, through engines `engine` makes (the
/// nvme engine, the GPU engine): one for the first tier, one after reopen.
pub fn tier_llama3_8b_on<B>(
    ns: NvmeNamespace<B>,
    engine: &dyn Fn(&NvmeNamespace<B>) -> Box<dyn IoEngine>,
) -> String
where
    B: Bar0 + Send + Sync + 'static,
{
    let geo = kvtier::model::preset("llama3-8b", 16).unwrap();
    let pcfg = PoolConfig::new(geo, "llama3-8b", "suite/llama3-8b")
        .with_group_blocks(8)
        .with_devices(Vec::new())
        .with_force(true);
    let pool = Pool::create_on(&pcfg, vec![ns.storage()]).expect("pool on the namespace");
    let mut tier = Tier::with_engine(pool, TierConfig::default(), engine(&ns)).expect("tier");
    const N: u64 = 20; // 2.5 extent groups
    let cache = Arc::new(HostKvCache::new(geo, 24, HostLayout::PerLayer).unwrap());
    tier.register_host_cache(cache.clone()).unwrap();
    let seed = |k: u64| k.wrapping_mul(0x2545_F491_4F6C_DD1D) ^ 0xA5A5;
    let keys: Vec<Key> = (0..N).map(|k| Key::from_u64(9000 + k)).collect();
    let mem: Vec<u32> = (0..N as u32).map(|i| (i * 5 + 1) % 24).collect();
    for (i, &b) in mem.iter().enumerate() {
        cache.fill_block(b, seed(i as u64));
    }
    let t = Instant::now();
    let job = tier.submit_store(&keys, &mem).unwrap();
    let r = tier.wait(job).unwrap();
    assert!(r.all_ok(), "store: {:?}", r.failures().collect::<Vec<_>>());
    let store_s = t.elapsed().as_secs_f64();
    cache.clear();
    let target: Vec<u32> = (0..N as u32).map(|i| 23 - i).collect();
    let job = tier.submit_load(&keys, &target, 0..geo.layers).unwrap();
    for layer in 0..geo.layers {
        tier.wait_layer(job, layer).unwrap();
        for (i, &b) in target.iter().enumerate() {
            assert!(
                cache.block_matches(b, seed(i as u64), layer..layer + 1),
                "layer {layer} of block {i} after wait_layer"
            );
        }
    }
    assert!(tier.wait(job).unwrap().all_ok());
    drop(tier);
    drop(cache); // its hugepages back before the second cache takes some

    let expect = OpenExpect {
        geometry: Some(geo),
        namespace: Some("suite/llama3-8b".into()),
    };
    let pool = Pool::open_on(vec![ns.storage()], &expect).expect("reopen from the namespace");
    assert_eq!(pool.index().live(), N);
    let report = pool.check(|_, _| {}).unwrap();
    assert!(report.is_clean(), "{report:?}");
    assert_eq!(report.blocks_ok, N);
    let mut tier = Tier::with_engine(pool, TierConfig::default(), engine(&ns)).expect("tier");
    let cache = Arc::new(HostKvCache::new(geo, 24, HostLayout::CrossLayer).unwrap());
    tier.register_host_cache(cache.clone()).unwrap();
    assert_eq!(tier.lookup_prefix(&keys), N as usize);
    // Timed: the load alone, verified after.
    let before = tier.usage().engine;
    let t = Instant::now();
    let job = tier.submit_load(&keys, &mem, 0..geo.layers).unwrap();
    assert!(tier.wait(job).unwrap().all_ok());
    let load_s = t.elapsed().as_secs_f64();
    let after = tier.usage().engine;
    let cmds = after.commands - before.commands;
    let ns_per_cmd = (after.cpu_ns - before.cpu_ns) as f64 / cmds.max(1) as f64;
    let doorbells = after.doorbells - before.doorbells;
    let bytes = N * geo.block_bytes();
    for (i, &b) in mem.iter().enumerate() {
        assert!(
            cache.block_matches(b, seed(i as u64), 0..geo.layers),
            "block {i} after reopen"
        );
    }
    format!(
        "{} MiB llama3-8b KV: store {:.0} MiB/s, load {:.0} MiB/s, {} commands and {} doorbells per load, {:.0} ns host CPU per command ({})",
        bytes >> 20,
        bytes as f64 / store_s / (1 << 20) as f64,
        bytes as f64 / load_s / (1 << 20) as f64,
        cmds,
        doorbells,
        ns_per_cmd,
        tier.engine().describe()
    )
}

/// Flush, then shutdown; I/O afterwards is refused with a clear error.
pub fn flush_and_shutdown<B: Bar0, A: DmaAlloc>(c: &mut Controller<B>, dma: &mut A) {
    c.flush(0).expect("flush");
    c.shutdown().expect("shutdown");
    assert!(c.is_shut_down());
    let b = buffer(dma, 4096, c.page_bytes());
    let err = c
        .transfer(0, IoDir::Read, 0, &[b.extent(0, 4096)], DataMode::Auto)
        .unwrap_err()
        .to_string();
    assert!(err.contains("shut down"), "{err}");
}

/// A simulated controller (a test double) reached through its doorbell
/// page, so it runs asynchronously to the host as a real one does, brought
/// up for a namespace (two host queue pairs) plus `extra` queue pairs for a
/// GPU kernel; `cfg.lbas` sizes the namespace.
pub fn sim_namespace(
    cfg: kvtier::nvme::sim::SimConfig,
    extra: u16,
) -> (
    kvtier::nvme::sim::SimController,
    NvmeNamespace<kvtier::nvme::sim::SimDoorbellPage>,
) {
    let sim = kvtier::nvme::sim::SimController::new(cfg);
    let page = sim.doorbell_page().expect("doorbell page");
    let mut dma = sim.dma();
    let c = Controller::bring_up(
        page,
        &mut dma,
        kvtier::nvme::ctrl::ControllerOptions::default()
            .with_name("sim-page".into())
            .with_io_queues(2)
            .with_extra_io_queues(extra),
    )
    .expect("bring-up through the doorbell page");
    let ns = NvmeNamespace::new(c, dma, &NvmeConfig::default()).expect("namespace");
    (sim, ns)
}
