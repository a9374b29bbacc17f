//! The GPU I/O kernel's logic, run on the host against the simulated NVMe
//! controller.
//!
//! `kernels/gio_nvme.cuh` (the logic `kvtier_gio_kernel` runs) is compiled
//! with the host C++ compiler together with `kernels/host/gio_host.cpp` into
//! a shared library, loaded with dlopen, and driven here: the controller is
//! brought up by `Controller::bring_up` over the simulator's doorbell page
//! (so every doorbell, the kernel's included, is a plain store to memory
//! that the simulator's polling thread picks up), and the GPU-side queue
//! pairs are created by this test through admin commands, on queue ids after
//! the Controller's own, over SQ/CQ/descriptor memory from `SimDma`. Data is
//! checked byte for byte in the namespace and in memory.
//!
//! Skipped, with a message, only when no host C++ compiler exists.

use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

use kvtier::gpu::abi::{
    GioDev, GioEngine, GioQueue, GioRing as GpuRing, GIO_BLOCK_THREADS, GIO_MODE_ONESHOT,
    GIO_MODE_PERSISTENT,
};
use kvtier::nvme::ctrl::{Controller, ControllerOptions, DataMode, DmaAlloc, DmaRegion, IoDir};
use kvtier::nvme::sim::{SimConfig, SimController, SimDma, SimDoorbellPage};
use kvtier::nvme::spec::{cq_head_doorbell, sq_tail_doorbell, SglType, Sqe};
use kvtier::nvme::SglDescriptor;
use kvtier::ring::abi::{
    IoCtx, Iocb, IOCB_STATE_COMPLETE, IOCTX_OP_READ, IOCTX_OP_WRITE, IOCTX_STATUS_INVALID,
    IOCTX_STATUS_OK, IOCTX_STATUS_TIMEOUT,
};
use kvtier::ring::{GioRing, IocbId};

mod common;
#[path = "nvme_suite/mod.rs"]
mod suite;
use common::gio_host::HostLib;
use suite::pattern;

// ---------------------------------------------------------------- the rig --

#[derive(Clone, Copy)]
struct QueueSpec {
    depth: u16,
    use_sgl: bool,
    timeout: Duration,
    /// Pages per command descriptor slot.
    desc_pages: usize,
}

impl Default for QueueSpec {
    fn default() -> Self {
        QueueSpec {
            depth: 64,
            use_sgl: true,
            timeout: Duration::from_secs(5),
            desc_pages: 1,
        }
    }
}

/// A controller, GPU-side queue pairs, a gio ring and a P2P table, all in
/// host memory (DMA memory from the simulator where the device reads it).
struct Rig {
    sim: SimController,
    ctrl: Controller<SimDoorbellPage>,
    dma: SimDma,
    queues: Box<[GioQueue]>,
    /// (SQ, CQ, descriptor slots) of each queue, kept alive.
    qmem: Vec<(DmaRegion, DmaRegion, DmaRegion)>,
    _devs: Box<[GioDev]>,
    p2p: Box<[SglDescriptor]>,
    ring: Box<GpuRing>,
    sq_ids: Box<[u32]>,
    cq_ids: Box<[u32]>,
    passes: Box<[u32]>,
    host: GioRing,
    engine: Box<GioEngine>,
    _page: SimDoorbellPage,
}

impl Rig {
    /// `devs[d]` = queues of device d (consecutive, in order).
    fn new(cfg: SimConfig, specs: &[QueueSpec], devs: &[u16]) -> Rig {
        let sim = SimController::new(cfg);
        let page = sim.doorbell_page().expect("doorbell page");
        let mut dma = sim.dma();
        let mut ctrl = Controller::bring_up(
            page.clone(),
            &mut dma,
            ControllerOptions::default().with_name("sim-gpu".into()),
        )
        .expect("bring-up");
        let dstrd = ctrl.cap().dstrd();
        let pg = ctrl.page_bytes() as usize;
        let mut queues = Vec::new();
        let mut qmem = Vec::new();
        for (i, s) in specs.iter().enumerate() {
            // The Controller owns queue 1; the kernel's queues follow it.
            let qid = (ctrl.io_queue_count() + 1 + i) as u16;
            let depth = s.depth as usize;
            let sq = dma.alloc(depth * 64, pg).unwrap();
            let cq = dma.alloc(depth * 16, pg).unwrap();
            let desc_bytes = s.desc_pages * pg;
            let desc = dma.alloc(depth * desc_bytes, pg).unwrap();
            sq.fill(0);
            cq.fill(0); // phase tags 0 before the controller's first pass
            desc.fill(0);
            ctrl.admin_command(
                Sqe::create_io_cq(0, qid, s.depth, cq.dma(), None),
                &format!("Create I/O CQ {qid}"),
            )
            .unwrap();
            ctrl.admin_command(
                Sqe::create_io_sq(0, qid, s.depth, sq.dma(), qid),
                &format!("Create I/O SQ {qid}"),
            )
            .unwrap();
            queues.push(GioQueue {
                sq: sq.ptr() as u64,
                cq: cq.ptr() as u64,
                sq_doorbell: page.doorbell_ptr(sq_tail_doorbell(qid, dstrd)) as u64,
                cq_doorbell: page.doorbell_ptr(cq_head_doorbell(qid, dstrd)) as u64,
                desc: desc.ptr() as u64,
                desc_dma: desc.dma(),
                timeout_ns: s.timeout.as_nanos() as u64,
                desc_bytes: desc_bytes as u32,
                nsid: ctrl.nsid(),
                max_transfer: ctrl.max_transfer_bytes() as u32,
                page_bytes: pg as u32,
                qid,
                depth: s.depth,
                lba_shift: ctrl.lba_bytes().trailing_zeros() as u8,
                use_sgl: s.use_sgl as u8,
                phase: 1,
                ..Default::default()
            });
            qmem.push((sq, cq, desc));
        }
        let mut first = 0u16;
        let devs: Box<[GioDev]> = devs
            .iter()
            .map(|&n| {
                let d = GioDev {
                    first_queue: first,
                    queue_count: n,
                    reserved: 0,
                };
                first += n;
                d
            })
            .collect();
        let depth = 16u32;
        let mut host = GioRing::new(depth).unwrap();
        let mut ring = Box::new(GpuRing {
            iocbs: host.arena_ptr() as u64,
            entries: depth,
            iocb_count: depth,
            ..Default::default()
        });
        let sq_ids = vec![0u32; depth as usize].into_boxed_slice();
        let cq_ids = vec![u32::MAX; depth as usize].into_boxed_slice();
        let passes = vec![0u32; depth as usize].into_boxed_slice();
        ring.sq = sq_ids.as_ptr() as u64;
        ring.cq = cq_ids.as_ptr() as u64;
        ring.passes = passes.as_ptr() as u64;
        let mut queues = queues.into_boxed_slice();
        let engine = Box::new(GioEngine {
            queues: queues.as_mut_ptr() as u64,
            devs: devs.as_ptr() as u64,
            p2p: 0,
            ring: &mut *ring as *mut GpuRing as u64,
            p2p_count: 0,
            queue_count: queues.len() as u32,
            dev_count: devs.len() as u32,
        });
        Rig {
            sim,
            ctrl,
            dma,
            queues,
            qmem,
            _devs: devs,
            p2p: Box::new([]),
            ring,
            sq_ids,
            cq_ids,
            passes,
            host,
            engine,
            _page: page,
        }
    }

    fn buffer(&mut self, len: usize) -> DmaRegion {
        let r = self.dma.alloc(len, 4096).unwrap();
        r.fill(0);
        r
    }

    /// Installs the P2P table (DMA addresses; the simulator's = host pointers).
    fn set_p2p(&mut self, table: Vec<SglDescriptor>) {
        self.p2p = table.into_boxed_slice();
        self.engine.p2p = self.p2p.as_ptr() as u64;
        self.engine.p2p_count = self.p2p.len() as u64;
    }

    /// Fills an IOCB (through src/ring) and marks it submitted; not yet
    /// visible to the kernel.
    fn fill(&mut self, ctxs: &[(u64, u32, u16, u8, Vec<u32>)]) -> IocbId {
        let id = self.host.get_iocb().expect("a free IOCB");
        for (dev_offset, len, dev, op, segs) in ctxs {
            let ctx = IoCtx {
                dev_offset: *dev_offset,
                len: *len,
                dev: *dev,
                op: *op,
                ..Default::default()
            };
            self.host.push_ctx(id, ctx, segs).expect("room in the IOCB");
        }
        self.host.submit(id).unwrap();
        assert_eq!(self.host.pop_sq(), Some(id));
        id
    }

    fn ring_field(&self, f: fn(*mut GpuRing) -> *mut u32) -> &AtomicU32 {
        let ring = &*self.ring as *const GpuRing as *mut GpuRing;
        // SAFETY: a 4-aligned u32 of the boxed ring, which lives as long as
        // self; the kernel threads access it with atomics too.
        unsafe { AtomicU32::from_ptr(f(ring)) }
    }

    /// Publishes an IOCB id in the gio SQ (release store of the tail).
    fn publish(&self, id: IocbId) {
        let tail = self
            .ring_field(|r| unsafe { &raw mut (*r).sq_tail })
            .load(Ordering::Relaxed);
        let slot = (tail & (self.ring.entries - 1)) as usize;
        // SAFETY: a slot of the boxed SQ array the kernel reads only below
        // the tail, which is stored after it (release).
        unsafe {
            AtomicU32::from_ptr(self.sq_ids.as_ptr().add(slot) as *mut u32)
                .store(id, Ordering::Relaxed)
        };
        self.ring_field(|r| unsafe { &raw mut (*r).sq_tail })
            .store(tail.wrapping_add(1), Ordering::Release);
    }

    fn completed(&self) -> u32 {
        self.ring_field(|r| unsafe { &raw mut (*r).completed })
            .load(Ordering::Acquire)
    }

    /// One one-shot launch of the kernel over everything published.
    fn run_oneshot(&self, lib: &HostLib, threads: u32) {
        // SAFETY: the engine and everything it points to live in self, and
        // nothing else touches them while the call runs.
        unsafe { (lib.run_grid)(&*self.engine, threads, GIO_MODE_ONESHOT) };
    }

    /// fill + publish + one-shot launch; returns the id.
    fn run(&mut self, lib: &HostLib, ctxs: &[(u64, u32, u16, u8, Vec<u32>)]) -> IocbId {
        let id = self.fill(ctxs);
        self.publish(id);
        self.run_oneshot(lib, GIO_BLOCK_THREADS);
        id
    }

    fn iocb(&self, id: IocbId) -> &Iocb {
        self.host.iocb(id)
    }

    fn release(&mut self, id: IocbId) {
        self.host.release(id);
    }

    /// The SQE the kernel left in queue q's SQ slot.
    fn sqe(&self, q: usize, slot: usize) -> Sqe {
        let mut b = [0u8; 64];
        self.qmem[q].0.read(slot * 64, &mut b);
        bytemuck::pod_read_unaligned(&b)
    }
}

fn statuses(iocb: &Iocb) -> Vec<u16> {
    iocb.ctx[..iocb.hdr.count as usize]
        .iter()
        .map(|c| c.status)
        .collect()
}

fn assert_complete(rig: &Rig, id: IocbId, errors: u32) {
    let h = rig.iocb(id).hdr;
    assert_eq!(h.state, IOCB_STATE_COMPLETE, "IOCB {id} complete");
    assert_eq!(h.done, h.count, "IOCB {id}: every IOCTX done");
    assert_eq!(
        h.errors,
        errors,
        "IOCB {id}: errors {:?}",
        statuses(rig.iocb(id))
    );
}

// ------------------------------------------------------------------ tests --

/// One P2P extent: a write from memory, then a read into two adjacent P2P
/// extents (merged into one): each command is one inline SGL Data Block.
#[test]
fn sgl_inline_single_extent_write_then_read() {
    let lib = lib_or_skip!();
    let mut rig = Rig::new(SimConfig::default(), &[QueueSpec::default()], &[1]);
    let len = 64 * 1024;
    let data = pattern(len, 1);
    let src = rig.buffer(len);
    src.write(0, &data);
    let dst = rig.buffer(len);
    dst.fill(0xee);
    rig.set_p2p(vec![
        SglDescriptor::data_block(src.dma(), len as u32),
        SglDescriptor::data_block(dst.dma(), (len / 4) as u32),
        SglDescriptor::data_block(dst.dma() + (len / 4) as u64, (3 * len / 4) as u32),
    ]);
    let off = 512 * 1024;
    let w = rig.run(lib, &[(off, len as u32, 0, IOCTX_OP_WRITE, vec![0])]);
    assert_complete(&rig, w, 0);
    assert_eq!(
        rig.iocb(w).ctx[0].result,
        len as u32,
        "result = bytes moved"
    );
    assert_eq!(
        rig.sim.namespace_bytes(off, len),
        data,
        "namespace after the write"
    );
    let sqe = rig.sqe(0, 0);
    assert_eq!(sqe.opcode, IOCTX_OP_WRITE);
    assert_eq!(sqe.slba(), off / 512);
    assert_eq!(
        sqe.nlb() as usize,
        len / 512,
        "LBAs (the SQE holds NLB 0-based)"
    );
    assert_eq!(sqe.cdw12 as usize, len / 512 - 1);
    assert_eq!(sqe.dptr.sgl1().sgl_type(), Some(SglType::DataBlock));

    let r = rig.run(lib, &[(off, len as u32, 0, IOCTX_OP_READ, vec![1, 2])]);
    assert_complete(&rig, r, 0);
    assert_eq!(dst.to_vec(), data, "read back byte for byte");
    let sqe = rig.sqe(0, 1);
    assert_eq!(sqe.opcode, IOCTX_OP_READ);
    assert_eq!(
        sqe.dptr.sgl1(),
        SglDescriptor::data_block(dst.dma(), len as u32),
        "adjacent extents merged into one inline Data Block"
    );
    // The completion counter and the gio CQ, in completion order.
    assert_eq!(rig.completed(), 2);
    assert_eq!(&rig.cq_ids[..2], &[w, r]);
    assert_eq!(rig.ring.cq_tail, 2);
    assert_eq!(rig.queues[0].commands, 2);
    assert_eq!(rig.queues[0].doorbells, 2, "one SQ doorbell per batch");
    assert_eq!(rig.passes[w as usize], 0, "pass counter reset for reuse");
}

/// Six extents at odd, unaligned addresses: one read command whose SGL is a
/// Last Segment of six Data Blocks in the command's descriptor slot; the
/// bytes around the extents stay untouched.
#[test]
fn sgl_scattered_extents_through_a_last_segment() {
    let lib = lib_or_skip!();
    let mut rig = Rig::new(SimConfig::default(), &[QueueSpec::default()], &[1]);
    let lens = [1001usize, 3097, 4095, 513, 7165, 513];
    let total: usize = lens.iter().sum();
    let data = pattern(total, 2);
    let src = rig.buffer(total);
    src.write(0, &data);
    let guard = 64;
    let bufs: Vec<DmaRegion> = lens
        .iter()
        .map(|&l| {
            let b = rig.buffer(l + 2 * guard + 8);
            b.fill(0xa5);
            b
        })
        .collect();
    let mut table = vec![SglDescriptor::data_block(src.dma(), total as u32)];
    for (i, (b, &l)) in bufs.iter().zip(&lens).enumerate() {
        table.push(SglDescriptor::data_block(
            b.dma() + (guard + 1 + i) as u64,
            l as u32,
        ));
    }
    rig.set_p2p(table);
    let off = 4096 * 512;
    let w = rig.run(lib, &[(off, total as u32, 0, IOCTX_OP_WRITE, vec![0])]);
    assert_complete(&rig, w, 0);
    let reads_before = rig.sim.stats().reads;
    let r = rig.run(
        lib,
        &[(off, total as u32, 0, IOCTX_OP_READ, (1..=6).collect())],
    );
    assert_complete(&rig, r, 0);
    assert_eq!(rig.sim.stats().reads, reads_before + 1, "one command");
    let sqe = rig.sqe(0, 1);
    let sgl = sqe.dptr.sgl1();
    assert_eq!(sgl.sgl_type(), Some(SglType::LastSegment));
    assert_eq!(sgl.len, 6 * 16);
    assert_eq!(
        sgl.addr,
        rig.queues[0].desc_dma + rig.queues[0].desc_bytes as u64
    );
    let mut at = 0;
    for (i, (b, &l)) in bufs.iter().zip(&lens).enumerate() {
        let all = b.to_vec();
        let start = guard + 1 + i;
        assert_eq!(&all[start..start + l], &data[at..at + l], "extent {i}");
        assert!(
            all[..start].iter().all(|&x| x == 0xa5),
            "extent {i}: before"
        );
        assert!(
            all[start + l..].iter().all(|&x| x == 0xa5),
            "extent {i}: after"
        );
        at += l;
    }
}

/// PRP mode (use_sgl = 0): a first extent starting mid-page, whole pages,
/// and a last extent ending mid-page: PRP1 + a PRP list; a two-page
/// transfer uses PRP2 directly; memory PRPs cannot describe is refused
/// before anything reaches the device.
#[test]
fn prp_mode_lists_and_refusals() {
    let lib = lib_or_skip!();
    let spec = QueueSpec {
        use_sgl: false,
        ..Default::default()
    };
    let mut rig = Rig::new(SimConfig::default(), &[spec], &[1]);
    let a = rig.buffer(4 * 4096);
    let b = rig.buffer(3 * 4096);
    let c = rig.buffer(4096);
    // 3584 (tail of a page) + 8192 (two pages) + 2560 (head of a page).
    let lens = [3584usize, 8192, 2560];
    let total: usize = lens.iter().sum();
    let data = pattern(total, 3);
    // The expected bytes go in through the Controller's own (CPU) queue.
    let staging = rig.buffer(total);
    staging.write(0, &data);
    rig.ctrl
        .transfer(
            0,
            IoDir::Write,
            100,
            &[staging.extent(0, total)],
            DataMode::Prp,
        )
        .expect("CPU-path write of the expected bytes");
    rig.set_p2p(vec![
        SglDescriptor::data_block(a.dma() + 512, 3584),
        SglDescriptor::data_block(b.dma(), 8192),
        SglDescriptor::data_block(c.dma(), 2560),
        // Not PRP-describable: a middle extent that does not start a page.
        SglDescriptor::data_block(b.dma() + 8, 4096),
        SglDescriptor::data_block(b.dma(), 8192),
    ]);
    let r = rig.run(
        lib,
        &[(100 * 512, total as u32, 0, IOCTX_OP_READ, vec![0, 1, 2])],
    );
    assert_complete(&rig, r, 0);
    let mut got = a.sub(512, 3584).to_vec();
    got.extend(b.sub(0, 8192).to_vec());
    got.extend(c.sub(0, 2560).to_vec());
    assert_eq!(got, data, "PRP read byte for byte");
    let sqe = rig.sqe(0, 0);
    assert_eq!(sqe.psdt(), kvtier::nvme::spec::Psdt::Prp);
    assert_eq!(sqe.dptr.prp1, a.dma() + 512);
    assert_eq!(sqe.dptr.prp2, rig.queues[0].desc_dma, "PRP2 is the list");

    // Two pages exactly: PRP2 is the second page, no list.
    let r2 = rig.run(lib, &[(100 * 512, 8192, 0, IOCTX_OP_READ, vec![1])]);
    assert_complete(&rig, r2, 0);
    let sqe = rig.sqe(0, 1);
    assert_eq!((sqe.dptr.prp1, sqe.dptr.prp2), (b.dma(), b.dma() + 4096));

    let commands = rig.sim.stats().io_commands;
    // 3584 + 4096 + 8192 bytes, but the middle extent starts inside a page.
    let bad = rig.run(
        lib,
        &[(0, 3584 + 4096 + 8192, 0, IOCTX_OP_READ, vec![0, 3, 4])],
    );
    assert_complete(&rig, bad, 1);
    assert_eq!(rig.iocb(bad).ctx[0].status, IOCTX_STATUS_INVALID);
    assert_eq!(rig.iocb(bad).ctx[0].result, 0);
    assert_eq!(
        rig.sim.stats().io_commands,
        commands,
        "nothing reached the device"
    );
}

/// A 4 MiB transfer in one command (MDTS 10): 1024 PRP entries, a list of
/// 1023 that crosses a list page, chained at its last slot; checked in the
/// SQE's list and byte for byte.
#[test]
fn prp_list_chains_across_list_pages() {
    let lib = lib_or_skip!();
    let spec = QueueSpec {
        use_sgl: false,
        depth: 8,
        desc_pages: 2,
        ..Default::default()
    };
    let mut rig = Rig::new(
        SimConfig {
            mdts: 10,
            ..Default::default()
        },
        &[spec],
        &[1],
    );
    assert_eq!(rig.queues[0].max_transfer, 4 << 20);
    let len = 4 << 20;
    let data = pattern(len, 4);
    let src = rig.buffer(len);
    src.write(0, &data);
    let dst = rig.buffer(len);
    rig.set_p2p(vec![
        SglDescriptor::data_block(src.dma(), len as u32),
        SglDescriptor::data_block(dst.dma(), len as u32),
    ]);
    let w = rig.run(lib, &[(0, len as u32, 0, IOCTX_OP_WRITE, vec![0])]);
    let r = rig.run(lib, &[(0, len as u32, 0, IOCTX_OP_READ, vec![1])]);
    assert_complete(&rig, w, 0);
    assert_complete(&rig, r, 0);
    assert_eq!(
        rig.sim.stats().largest_transfer,
        len as u64,
        "one command each"
    );
    assert!(dst.to_vec() == data, "4 MiB read back byte for byte");
    // The read's list (slot 1): entry 511 chains to the next list page.
    let desc = &rig.qmem[0].2;
    let slot = rig.queues[0].desc_bytes as usize;
    let list: Vec<u64> = bytemuck::pod_collect_to_vec(&desc.sub(slot, slot).to_vec());
    assert_eq!(list[0], dst.dma() + 4096);
    assert_eq!(
        list[511],
        rig.queues[0].desc_dma + slot as u64 + 4096,
        "chain pointer"
    );
    assert_eq!(list[512], dst.dma() + 512 * 4096);
    assert_eq!(
        list[1023],
        dst.dma() + 1023 * 4096,
        "the last entry, unchained"
    );
}

/// An IOCTX larger than the maximum transfer (MDTS 3: 32 KiB) is split into
/// commands at it, all in one batch (one doorbell).
#[test]
fn split_at_mdts() {
    let lib = lib_or_skip!();
    let mut rig = Rig::new(
        SimConfig {
            mdts: 3,
            ..Default::default()
        },
        &[QueueSpec::default()],
        &[1],
    );
    let max = rig.queues[0].max_transfer as usize;
    assert_eq!(max, 32 * 1024);
    let len = max * 6 + max / 4;
    let data = pattern(len, 5);
    let src = rig.buffer(len);
    src.write(0, &data);
    let dst = rig.buffer(len);
    rig.set_p2p(vec![
        SglDescriptor::data_block(src.dma(), len as u32),
        // The read lands in two halves that split inside a command.
        SglDescriptor::data_block(dst.dma(), (len / 2) as u32),
        SglDescriptor::data_block(dst.dma() + (len / 2) as u64, (len - len / 2) as u32),
    ]);
    let w = rig.run(lib, &[(8192, len as u32, 0, IOCTX_OP_WRITE, vec![0])]);
    assert_complete(&rig, w, 0);
    assert_eq!(
        rig.queues[0].commands, 7,
        "{len} bytes at {max} per command"
    );
    assert_eq!(rig.queues[0].doorbells, 1, "the 7 commands in one batch");
    assert_eq!(rig.sim.stats().largest_transfer, max as u64);
    assert_eq!(rig.sim.namespace_bytes(8192, len), data);
    let r = rig.run(lib, &[(8192, len as u32, 0, IOCTX_OP_READ, vec![1, 2])]);
    assert_complete(&rig, r, 0);
    assert_eq!(rig.iocb(r).ctx[0].result, len as u32);
    assert_eq!(dst.to_vec(), data);
    // The split commands cover consecutive LBAs.
    for k in 0..7 {
        let sqe = rig.sqe(0, 7 + k);
        assert_eq!(sqe.slba(), (8192 + (k * max) as u64) / 512, "command {k}");
    }
}

/// NVMe errors surface per IOCTX (SCT << 8 | SC, DNR dropped), next to
/// IOCTXs that succeed in the same IOCB; malformed IOCTXs are INVALID.
#[test]
fn nvme_errors_and_invalid_ioctxs_per_ioctx() {
    let lib = lib_or_skip!();
    let mut rig = Rig::new(SimConfig::default(), &[QueueSpec::default()], &[1]);
    let buf = rig.buffer(3 * 8192);
    rig.set_p2p(vec![
        SglDescriptor::data_block(buf.dma(), 8192),
        SglDescriptor::data_block(buf.dma() + 8192, 8192),
        SglDescriptor::data_block(buf.dma() + 16384, 8192),
    ]);
    let nsze_bytes = rig.ctrl.namespace().nsze * 512;
    let id = rig.run(
        lib,
        &[
            (0, 8192, 0, IOCTX_OP_READ, vec![0]),
            (nsze_bytes - 4096, 8192, 0, IOCTX_OP_READ, vec![1]), // past the end
            (8192, 8192, 0, IOCTX_OP_READ, vec![2]),
            (0, 8192, 7, IOCTX_OP_READ, vec![0]),  // no device 7
            (0, 8192, 0, IOCTX_OP_READ, vec![99]), // no P2P entry 99
            (0, 4096, 0, IOCTX_OP_READ, vec![0]),  // len != segments
            (100, 8192, 0, IOCTX_OP_READ, vec![0]), // not LBA-aligned
            (0, 8192, 0, 0x7f, vec![0]),           // not an NVM opcode we issue
        ],
    );
    assert_complete(&rig, id, 6);
    let st = statuses(rig.iocb(id));
    assert_eq!(
        st,
        [
            IOCTX_STATUS_OK,
            0x0080, // LBA Out of Range (the simulator's 0x4080 without DNR)
            IOCTX_STATUS_OK,
            IOCTX_STATUS_INVALID,
            IOCTX_STATUS_INVALID,
            IOCTX_STATUS_INVALID,
            IOCTX_STATUS_INVALID,
            IOCTX_STATUS_INVALID
        ]
    );
    let res: Vec<u32> = rig.iocb(id).ctx[..8].iter().map(|c| c.result).collect();
    assert_eq!(res, [8192, 0, 8192, 0, 0, 0, 0, 0]);
    assert_eq!(
        rig.queues[0].commands, 3,
        "only the three valid IOCTXs were sent"
    );
}

/// With one device served by two queues, each block walks only the IOCTXs
/// it owns (i % 2), invalid ones included: an IOCTX naming no device is
/// failed by the block that visits it, and the IOCB still completes with
/// every IOCTX accounted for.
#[test]
fn two_queues_of_one_device_split_the_ioctxs_invalid_ones_too() {
    let lib = lib_or_skip!();
    let mut rig = Rig::new(
        SimConfig::default(),
        &[QueueSpec::default(), QueueSpec::default()],
        &[2],
    );
    let buf = rig.buffer(4 * 8192);
    rig.set_p2p(
        (0..4)
            .map(|i| SglDescriptor::data_block(buf.dma() + i * 8192, 8192))
            .collect(),
    );
    let id = rig.run(
        lib,
        &[
            (0, 8192, 0, IOCTX_OP_READ, vec![0]),
            (8192, 8192, 7, IOCTX_OP_READ, vec![1]), // no device 7: block 1's
            (16384, 8192, 0, IOCTX_OP_READ, vec![2]),
            (24576, 8192, 9, IOCTX_OP_READ, vec![3]), // no device 9: block 1's
            (32768, 8192, 0, IOCTX_OP_READ, vec![3]),
        ],
    );
    assert_complete(&rig, id, 2);
    assert_eq!(
        statuses(rig.iocb(id)),
        [
            IOCTX_STATUS_OK,
            IOCTX_STATUS_INVALID,
            IOCTX_STATUS_OK,
            IOCTX_STATUS_INVALID,
            IOCTX_STATUS_OK
        ]
    );
    assert_eq!(rig.queues[0].commands, 3, "block 0 ran IOCTXs 0, 2 and 4");
    assert_eq!(
        rig.queues[1].commands, 0,
        "block 1 owned only invalid IOCTXs"
    );
}

/// A command the controller fetches and never completes ends in the timeout
/// status within the poll budget instead of hanging; its IOCB completes, and
/// the queue keeps working afterwards.
#[test]
fn dropped_command_ends_in_timeout_status() {
    let lib = lib_or_skip!();
    let spec = QueueSpec {
        timeout: Duration::from_millis(100),
        ..Default::default()
    };
    let mut rig = Rig::new(SimConfig::default(), &[spec], &[1]);
    let buf = rig.buffer(3 * 4096);
    rig.set_p2p(vec![
        SglDescriptor::data_block(buf.dma(), 4096),
        SglDescriptor::data_block(buf.dma() + 4096, 4096),
        SglDescriptor::data_block(buf.dma() + 8192, 4096),
    ]);
    rig.sim.drop_next_commands(1);
    let start = Instant::now();
    let id = rig.run(
        lib,
        &[
            (0, 4096, 0, IOCTX_OP_READ, vec![0]),
            (4096, 4096, 0, IOCTX_OP_READ, vec![1]),
        ],
    );
    let took = start.elapsed();
    assert!(
        took >= Duration::from_millis(100),
        "waited the budget: {took:?}"
    );
    assert!(took < Duration::from_secs(5), "did not hang: {took:?}");
    assert_complete(&rig, id, 1);
    assert_eq!(
        statuses(rig.iocb(id)),
        [IOCTX_STATUS_TIMEOUT, IOCTX_STATUS_OK]
    );
    assert_eq!(rig.iocb(id).ctx[0].result, 0);
    assert_eq!(rig.queues[0].timeouts, 1);
    assert_eq!(rig.sim.stats().dropped, 1);
    assert_eq!(rig.completed(), 1, "the IOCB completed");
    rig.release(id);
    let again = rig.run(lib, &[(8192, 4096, 0, IOCTX_OP_READ, vec![2])]);
    assert_complete(&rig, again, 0);
    assert_eq!(rig.completed(), 2);
}

/// More IOCTXs than threads in a block and more commands than the SQ holds:
/// several windows and several batches per window, with a small "block".
#[test]
fn many_ioctxs_through_a_small_queue() {
    let lib = lib_or_skip!();
    let spec = QueueSpec {
        depth: 16,
        ..Default::default()
    };
    let mut rig = Rig::new(SimConfig::default(), &[spec], &[1]);
    let n = 300usize;
    let data = pattern(n * 4096, 6);
    let src = rig.buffer(n * 4096);
    src.write(0, &data);
    let dst = rig.buffer(n * 4096);
    let mut table = Vec::new();
    for i in 0..n {
        table.push(SglDescriptor::data_block(
            src.dma() + (i * 4096) as u64,
            4096,
        ));
    }
    for i in 0..n {
        table.push(SglDescriptor::data_block(
            dst.dma() + (i * 4096) as u64,
            4096,
        ));
    }
    rig.set_p2p(table);
    // Writes in reverse device order, so the namespace order is checked.
    let writes: Vec<_> = (0..n)
        .map(|i| {
            (
                ((n - 1 - i) * 4096) as u64,
                4096u32,
                0u16,
                IOCTX_OP_WRITE,
                vec![i as u32],
            )
        })
        .collect();
    let w = rig.fill(&writes);
    rig.publish(w);
    rig.run_oneshot(lib, 64);
    assert_complete(&rig, w, 0);
    assert!(
        rig.queues[0].doorbells >= (n / 15) as u64,
        "batches bounded by the SQ"
    );
    let reads: Vec<_> = (0..n)
        .map(|i| {
            (
                ((n - 1 - i) * 4096) as u64,
                4096u32,
                0u16,
                IOCTX_OP_READ,
                vec![(n + i) as u32],
            )
        })
        .collect();
    let r = rig.run(lib, &reads);
    assert_complete(&rig, r, 0);
    assert_eq!(dst.to_vec(), data);
    for i in 0..n {
        assert_eq!(
            rig.sim.namespace_bytes(((n - 1 - i) * 4096) as u64, 4096),
            &data[i * 4096..(i + 1) * 4096],
            "IOCTX {i}"
        );
    }
}

/// The persistent kernel: two queues (one per device, one block each) take
/// IOCBs as they are published; each IOCB spans both devices and completes
/// once, by the last block to pass it; the host waits on the completion
/// counter (the wait kernel's logic); stop ends the kernel.
#[test]
fn persistent_kernel_two_devices() {
    let lib = lib_or_skip!();
    let mut rig = Rig::new(
        SimConfig::default(),
        &[QueueSpec::default(), QueueSpec::default()],
        &[1, 1],
    );
    let k = 3usize;
    let len = 16 * 1024;
    let data = pattern(2 * k * len, 7);
    let src = rig.buffer(2 * k * len);
    src.write(0, &data);
    let table: Vec<SglDescriptor> = (0..2 * k)
        .map(|i| SglDescriptor::data_block(src.dma() + (i * len) as u64, len as u32))
        .collect();
    rig.set_p2p(table);
    // Device 1's region of the shared namespace starts at 8 MiB.
    let base = [0u64, 8 << 20];
    let ids: Vec<IocbId> = (0..k)
        .map(|j| {
            rig.fill(&[
                (
                    base[0] + (j * len) as u64,
                    len as u32,
                    0,
                    IOCTX_OP_WRITE,
                    vec![(2 * j) as u32],
                ),
                (
                    base[1] + (j * len) as u64,
                    len as u32,
                    1,
                    IOCTX_OP_WRITE,
                    vec![(2 * j + 1) as u32],
                ),
            ])
        })
        .collect();
    let engine = &*rig.engine as *const GioEngine as usize;
    let run_grid = lib.run_grid;
    // SAFETY: the engine and everything it points to outlive the thread
    // (joined below); the test thread only touches the ring's atomics.
    let kernel = std::thread::spawn(move || unsafe {
        run_grid(engine as *const GioEngine, 32, GIO_MODE_PERSISTENT)
    });
    let counter = rig
        .ring_field(|r| unsafe { &raw mut (*r).completed })
        .as_ptr() as *const u32;
    for (j, &id) in ids.iter().enumerate() {
        std::thread::sleep(Duration::from_millis(5)); // the kernel idles first
        rig.publish(id);
        // SAFETY: the counter is the boxed ring's, alive until the end.
        let reached = unsafe { (lib.wait_counter)(counter, j as u32 + 1, 5_000_000_000) };
        assert_eq!(reached, 1, "IOCB {id} completed within 5 s");
    }
    // SAFETY: as above; an unreachable target times out instead of hanging.
    assert_eq!(
        unsafe { (lib.wait_counter)(counter, k as u32 + 1, 10_000_000) },
        0
    );
    rig.ring_field(|r| unsafe { &raw mut (*r).stop })
        .store(1, Ordering::Release);
    kernel
        .join()
        .expect("the persistent kernel returns after stop");
    assert_eq!(rig.completed(), k as u32);
    assert_eq!(&rig.cq_ids[..k], &ids[..], "published in completion order");
    for &id in &ids {
        assert_complete(&rig, id, 0);
        assert_eq!(rig.passes[id as usize], 0);
    }
    for j in 0..k {
        for (d, dev_base) in base.iter().enumerate() {
            let i = 2 * j + d;
            assert_eq!(
                rig.sim.namespace_bytes(dev_base + (j * len) as u64, len),
                &data[i * len..(i + 1) * len],
                "IOCB {j} device {d}"
            );
        }
    }
    assert_eq!(rig.queues[0].commands, k as u64);
    assert_eq!(rig.queues[1].commands, k as u64);
    assert_eq!(rig.queues[0].ring_cursor, k as u32);
    assert_eq!(rig.queues[1].ring_cursor, k as u32);
}

/// The host entry point that builds one command matches what the kernel
/// wrote: a direct check of the command builder's SGL choice.
#[test]
fn build_command_entry_point_agrees() {
    let lib = lib_or_skip!();
    let mut rig = Rig::new(SimConfig::default(), &[QueueSpec::default()], &[1]);
    let a = rig.buffer(8192);
    rig.set_p2p(vec![
        SglDescriptor::data_block(a.dma(), 4096),
        SglDescriptor::data_block(a.dma() + 4096 + 512, 2048),
    ]);
    let id = rig.fill(&[(0, 6144, 0, IOCTX_OP_READ, vec![0, 1])]);
    let mut sqe = Sqe::default();
    let mut desc = vec![0u8; 4096];
    let mut n = 0u32;
    // SAFETY: every pointer is valid for what the function writes (one SQE,
    // a 4 KiB slot, one u32); the engine lives in rig.
    let st = unsafe {
        (lib.build_command)(
            &*rig.engine,
            0,
            id,
            0,
            0,
            &mut sqe,
            desc.as_mut_ptr(),
            0x1000,
            &mut n,
        )
    };
    assert_eq!(st, IOCTX_STATUS_OK);
    assert_eq!(n, 1);
    assert_eq!(sqe.dptr.sgl1(), SglDescriptor::last_segment(0x1000, 2));
    let descs: Vec<SglDescriptor> = bytemuck::pod_collect_to_vec(&desc[..32]);
    assert_eq!(
        descs,
        [
            SglDescriptor::data_block(a.dma(), 4096),
            SglDescriptor::data_block(a.dma() + 4096 + 512, 2048)
        ]
    );
}
