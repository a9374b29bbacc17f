//! The GPU engine's device-visible state: what the CUDA I/O kernel reads and
//! writes besides the IOCBs. Twin of `kernels/gio_gpu.h`.
//!
//! The host builds these once, in memory the I/O kernel can dereference (GPU
//! memory, or pinned host memory mapped into the GPU), and launches
//! `kvtier_gio_kernel` with a pointer to one [`GioEngine`]:
//! - [`GioQueue`]: one NVMe I/O queue pair, owned by one thread block (block
//!   `b` drives `queues[b]`): the SQ/CQ and doorbell pointers, namespace, LBA
//!   shift, page size, SGL or PRP, the largest transfer of one command, the
//!   per-command descriptor slots (SGL Last Segments, PRP lists), the poll
//!   budget, and the kernel-owned ring state (SQ tail/head, CQ head, phase);
//! - [`GioRing`]: the gio_uring on the GPU side: SQ and CQ of IOCB ids over
//!   the IOCB arena, and the completion counter the compute stream waits on;
//! - [`GioDev`]: the queues of each pool device (`IoCtx::dev`);
//! - the P2P table: an array of [`crate::nvme::spec::SglDescriptor`] (the ring ABI re-exports it) holding
//!   DMA addresses, indexed by the IOCBs' segments.
//!
//! Pointers are `u64`: the structs are `Pod` and identical on every target.
//! Both sides assert every size and offset; `tests/gpu_header.rs` compiles
//! the header with `static_assert`s generated from [`gio_constants`] and
//! [`gio_layouts`], so a drift fails a test.

use bytemuck::{Pod, Zeroable};
use std::mem::{offset_of, size_of};

/// Threads per block the I/O kernel is launched with (the size of its
/// per-thread shared arrays).
pub const GIO_BLOCK_THREADS: u32 = 256;
/// NVMe commands one block puts in its SQ per doorbell, at most.
pub const GIO_MAX_BATCH: u32 = 1024;
/// A command id is `(generation << 10) | index in the batch`.
pub const GIO_CID_INDEX_BITS: u32 = 10;
/// Mask of the generation bits above the index.
pub const GIO_CID_GEN_MASK: u32 = 0x3f;

/// `kvtier_gio_kernel` mode: process the IOCBs in the gio SQ at launch, exit.
pub const GIO_MODE_ONESHOT: u32 = 0;
/// `kvtier_gio_kernel` mode: keep taking IOCBs until [`GioRing::stop`] is
/// non-zero and the SQ is drained.
pub const GIO_MODE_PERSISTENT: u32 = 1;

/// Name of the I/O kernel in `gio_kernel.cu` (cubin and PTX).
pub const GIO_KERNEL_NAME: &str = "kvtier_gio_kernel";
/// Name of the wait kernel in `gio_kernel.cu`.
pub const WAIT_KERNEL_NAME: &str = "kvtier_wait_counter";

/// One NVMe I/O queue pair as the kernel drives it (see `gio_gpu.h` for each
/// field's owner: the host sets the configuration, the kernel the state).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Pod, Zeroable)]
pub struct GioQueue {
    /// Kernel pointer to `depth` SQEs.
    pub sq: u64,
    /// Kernel pointer to `depth` CQEs (zero-filled before queue creation).
    pub cq: u64,
    /// Kernel pointer to the SQ tail doorbell (a `u32`).
    pub sq_doorbell: u64,
    /// Kernel pointer to the CQ head doorbell.
    pub cq_doorbell: u64,
    /// Kernel pointer to `depth` descriptor slots of `desc_bytes` each; slot
    /// `i` serves the command in SQ slot `i`.
    pub desc: u64,
    /// DMA address of `desc` (page-aligned, contiguous).
    pub desc_dma: u64,
    /// Poll budget per batch in nanoseconds.
    pub timeout_ns: u64,
    /// Bytes per descriptor slot, a multiple of `page_bytes`.
    pub desc_bytes: u32,
    /// Namespace the commands address.
    pub nsid: u32,
    /// Largest transfer of one command, a multiple of the LBA size.
    pub max_transfer: u32,
    /// CC.MPS page size.
    pub page_bytes: u32,
    /// NVMe queue id.
    pub qid: u16,
    /// Entries of the SQ and CQ.
    pub depth: u16,
    /// log2 of the LBA size.
    pub lba_shift: u8,
    /// 1: SGLs; 0: PRPs.
    pub use_sgl: u8,
    /// Zero.
    pub reserved0: u16,
    /// Kernel state: next SQ slot (host: 0).
    pub sq_tail: u16,
    /// Kernel state: the SQ head the controller last reported (host: 0).
    pub sq_head: u16,
    /// Kernel state: next CQ slot (host: 0).
    pub cq_head: u16,
    /// Kernel state: expected phase tag (host: 1).
    pub phase: u8,
    /// Kernel state: command id generation of the last batch (host: 0).
    pub gen: u8,
    /// Kernel state: this block's free-running position in the gio SQ.
    pub ring_cursor: u32,
    /// Commands that timed out.
    pub timeouts: u32,
    /// Commands completed by the controller.
    pub commands: u64,
    /// SQ tail doorbell writes.
    pub doorbells: u64,
    /// Zero.
    pub reserved1: [u64; 2],
}

/// The gio_uring as the kernel sees it: SQ and CQ of IOCB ids (free-running
/// `u32` counters, index = counter & (entries - 1)) over the IOCB arena.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Pod, Zeroable)]
pub struct GioRing {
    /// Kernel pointer to the IOCB arena.
    pub iocbs: u64,
    /// Kernel pointer to `entries` SQ ids.
    pub sq: u64,
    /// Kernel pointer to `entries` CQ ids.
    pub cq: u64,
    /// Kernel pointer to `iocb_count` `u32`s, zeroed once: blocks that have
    /// passed each IOCB. The last block to pass an IOCB publishes it, so no
    /// block still reads an IOCB the host has reaped and refilled.
    pub passes: u64,
    /// A power of two >= `iocb_count`.
    pub entries: u32,
    /// IOCBs in the ring.
    pub iocb_count: u32,
    /// SQ producer counter (host, release store after the ids).
    pub sq_tail: u32,
    /// CQ consumer counter (host only).
    pub cq_head: u32,
    /// CQ producer counter (kernel).
    pub cq_tail: u32,
    /// CQ tickets handed out (kernel).
    pub cq_reserve: u32,
    /// Completion counter: +1 per completed IOCB, after its CQ entry and
    /// IOCTX statuses are visible. Wait with `cuStreamWaitValue32` (GEQ).
    pub completed: u32,
    /// Non-zero: a persistent kernel exits once the SQ is drained.
    pub stop: u32,
    /// SQ ids past `iocb_count` that were skipped.
    pub bad_ids: u32,
    /// Zero.
    pub reserved: [u32; 3],
}

/// The queues of one pool device: `queues[first_queue..first_queue +
/// queue_count]`; IOCTX `i` of an IOCB goes to `first_queue + i % queue_count`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Pod, Zeroable)]
pub struct GioDev {
    /// Index of the device's first queue.
    pub first_queue: u16,
    /// Queues of the device.
    pub queue_count: u16,
    /// Zero.
    pub reserved: u32,
}

/// The I/O kernel's one argument.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Pod, Zeroable)]
pub struct GioEngine {
    /// Kernel pointer to `queue_count` [`GioQueue`] (one block each).
    pub queues: u64,
    /// Kernel pointer to `dev_count` [`GioDev`].
    pub devs: u64,
    /// Kernel pointer to the P2P table (`p2p_count` SGL descriptors).
    pub p2p: u64,
    /// Kernel pointer to the [`GioRing`].
    pub ring: u64,
    /// Descriptors in the P2P table.
    pub p2p_count: u64,
    /// Queues (one thread block each).
    pub queue_count: u32,
    /// Pool devices.
    pub dev_count: u32,
}

// Layout asserts: kernels/gio_gpu.h asserts the same numbers.
const _: () = {
    assert!(size_of::<GioQueue>() == 128);
    assert!(offset_of!(GioQueue, sq) == 0);
    assert!(offset_of!(GioQueue, cq) == 8);
    assert!(offset_of!(GioQueue, sq_doorbell) == 16);
    assert!(offset_of!(GioQueue, cq_doorbell) == 24);
    assert!(offset_of!(GioQueue, desc) == 32);
    assert!(offset_of!(GioQueue, desc_dma) == 40);
    assert!(offset_of!(GioQueue, timeout_ns) == 48);
    assert!(offset_of!(GioQueue, desc_bytes) == 56);
    assert!(offset_of!(GioQueue, nsid) == 60);
    assert!(offset_of!(GioQueue, max_transfer) == 64);
    assert!(offset_of!(GioQueue, page_bytes) == 68);
    assert!(offset_of!(GioQueue, qid) == 72);
    assert!(offset_of!(GioQueue, depth) == 74);
    assert!(offset_of!(GioQueue, lba_shift) == 76);
    assert!(offset_of!(GioQueue, use_sgl) == 77);
    assert!(offset_of!(GioQueue, sq_tail) == 80);
    assert!(offset_of!(GioQueue, sq_head) == 82);
    assert!(offset_of!(GioQueue, cq_head) == 84);
    assert!(offset_of!(GioQueue, phase) == 86);
    assert!(offset_of!(GioQueue, gen) == 87);
    assert!(offset_of!(GioQueue, ring_cursor) == 88);
    assert!(offset_of!(GioQueue, timeouts) == 92);
    assert!(offset_of!(GioQueue, commands) == 96);
    assert!(offset_of!(GioQueue, doorbells) == 104);

    assert!(size_of::<GioRing>() == 80);
    assert!(offset_of!(GioRing, iocbs) == 0);
    assert!(offset_of!(GioRing, sq) == 8);
    assert!(offset_of!(GioRing, cq) == 16);
    assert!(offset_of!(GioRing, passes) == 24);
    assert!(offset_of!(GioRing, entries) == 32);
    assert!(offset_of!(GioRing, iocb_count) == 36);
    assert!(offset_of!(GioRing, sq_tail) == 40);
    assert!(offset_of!(GioRing, cq_head) == 44);
    assert!(offset_of!(GioRing, cq_tail) == 48);
    assert!(offset_of!(GioRing, cq_reserve) == 52);
    assert!(offset_of!(GioRing, completed) == 56);
    assert!(offset_of!(GioRing, stop) == 60);
    assert!(offset_of!(GioRing, bad_ids) == 64);

    assert!(size_of::<GioDev>() == 8);
    assert!(offset_of!(GioDev, first_queue) == 0);
    assert!(offset_of!(GioDev, queue_count) == 2);

    assert!(size_of::<GioEngine>() == 48);
    assert!(offset_of!(GioEngine, queues) == 0);
    assert!(offset_of!(GioEngine, devs) == 8);
    assert!(offset_of!(GioEngine, p2p) == 16);
    assert!(offset_of!(GioEngine, ring) == 24);
    assert!(offset_of!(GioEngine, p2p_count) == 32);
    assert!(offset_of!(GioEngine, queue_count) == 40);
    assert!(offset_of!(GioEngine, dev_count) == 44);

    assert!(GIO_MAX_BATCH <= 1 << GIO_CID_INDEX_BITS);
};

/// The constants `gio_gpu.h` must define with the same values.
pub fn gio_constants() -> Vec<(&'static str, u64)> {
    vec![
        ("KVTIER_GIO_BLOCK_THREADS", GIO_BLOCK_THREADS as u64),
        ("KVTIER_GIO_MAX_BATCH", GIO_MAX_BATCH as u64),
        ("KVTIER_GIO_CID_INDEX_BITS", GIO_CID_INDEX_BITS as u64),
        ("KVTIER_GIO_CID_GEN_MASK", GIO_CID_GEN_MASK as u64),
        ("KVTIER_GIO_MODE_ONESHOT", GIO_MODE_ONESHOT as u64),
        ("KVTIER_GIO_MODE_PERSISTENT", GIO_MODE_PERSISTENT as u64),
        ("KVTIER_GIO_QUEUE_SIZE", size_of::<GioQueue>() as u64),
        ("KVTIER_GIO_RING_SIZE", size_of::<GioRing>() as u64),
        ("KVTIER_GIO_DEV_SIZE", size_of::<GioDev>() as u64),
        ("KVTIER_GIO_ENGINE_SIZE", size_of::<GioEngine>() as u64),
    ]
}

/// Every size (`None`) and field offset of the structs, as (C type, member,
/// value), for the header test to compare with C's `sizeof`/`offsetof`.
pub fn gio_layouts() -> Vec<(&'static str, Option<&'static str>, usize)> {
    macro_rules! layout {
        ($c:literal, $ty:ty; $($f:ident),*) => {{
            let mut v = vec![($c, None, size_of::<$ty>())];
            $(v.push(($c, Some(stringify!($f)), offset_of!($ty, $f)));)*
            v
        }};
    }
    let mut all = layout!("kvtier_gio_queue", GioQueue; sq, cq, sq_doorbell, cq_doorbell, desc,
        desc_dma, timeout_ns, desc_bytes, nsid, max_transfer, page_bytes, qid, depth, lba_shift,
        use_sgl, reserved0, sq_tail, sq_head, cq_head, phase, gen, ring_cursor, timeouts,
        commands, doorbells, reserved1);
    all.extend(
        layout!("kvtier_gio_ring", GioRing; iocbs, sq, cq, passes, entries, iocb_count, sq_tail,
        cq_head, cq_tail, cq_reserve, completed, stop, bad_ids, reserved),
    );
    all.extend(layout!("kvtier_gio_dev", GioDev; first_queue, queue_count, reserved));
    all.extend(
        layout!("kvtier_gio_engine", GioEngine; queues, devs, p2p, ring, p2p_count,
        queue_count, dev_count),
    );
    all
}
