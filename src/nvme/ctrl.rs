//! NVMe controller bring-up and synchronous commands, generic over how the
//! device is reached.
//!
//! [`Bar0`] is the controller's register file (MMIO through a VFIO or uio
//! mapping, or the simulated controller of `nvme::sim` (the `testing` feature)); [`DmaAlloc`]
//! hands out memory the device can reach ([`DmaRegion`]: a host pointer and
//! the address the device uses for it, an IOVA or a physical address).
//!
//! [`Controller::bring_up`] follows the spec's initialization sequence:
//! disable (CC.EN=0, wait CSTS.RDY=0 within CAP.TO), program the admin queue
//! (AQA/ASQ/ACQ), enable (CC: MPS from CAP.MPSMIN, 64-byte SQEs, 16-byte
//! CQEs), wait CSTS.RDY=1, Identify Controller and the namespace, Set Features
//! (Number of Queues), then create the I/O queue pairs (CQ first, zero-filled,
//! then its SQ). [`Controller::shutdown`] deletes them and performs a normal
//! shutdown (CC.SHN, wait CSTS.SHST complete).
//!
//! Every wait is bounded: a register wait by CAP.TO, a command by the
//! timeouts of [`ControllerOptions`]. A failed command returns an error whose
//! message holds the NVMe status as [`Status`](super::spec::Status) prints it (`NVMe status
//! 0x400f (generic: Data SGL Length Invalid)`); a timeout names the register
//! or the queue and the command ids outstanding.
//!
//! [`Controller::transfer`] is the synchronous data path the tests (and the
//! QEMU lane) use: it splits a transfer at the controller's maximum transfer
//! size and describes each command's memory with PRPs or with one SGL (an
//! inline Data Block, or a Last Segment of Data Blocks, chained Segments past
//! one segment), written into a per-queue descriptor page set. The nvme
//! engine keeps its own per-command descriptor memory and many commands in
//! flight; it shares the descriptor builders of [`super::spec`].

use super::queue::{Completion, QueueError, QueueMemory, QueuePair};
use super::spec::{
    aqa, build_prps, cns, cq_head_doorbell, nvm_opc, prp_list_pages_for_entries, reg,
    sq_tail_doorbell, Cap, Cc, Csts, DataPtr, Extent, IdentifyController, IdentifyNamespace,
    SglDescriptor, Shn, Shst, Sqe, Vs, IDENTIFY_DATA_LEN, SGL_DESCRIPTOR_LEN,
};
use crate::error::{Error, Result};
use std::any::Any;
use std::fmt;
use std::io;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// BAR0 register access (MMIO through a VFIO or uio mapping, or a simulated
/// controller).
///
/// # Safety
///
/// An implementation promises that:
/// - every access reaches the registers of one NVMe controller and nothing
///   else: an offset past the mapped BAR panics rather than touch other
///   memory;
/// - `read32`/`write32` are single 32-bit accesses (volatile for MMIO);
///   `read64`/`write64` are one 64-bit access or two 32-bit accesses, low
///   half first (what the spec allows for CAP, ASQ and ACQ);
/// - `write32` to a doorbell is preceded by whatever device-ordering barrier
///   the architecture needs so that the CPU's earlier stores to DMA memory
///   (SQEs, PRP lists, SGL segments) are visible to the device first (none
///   beyond the caller's `SeqCst` fence on x86-64; see
///   [`super::queue::QueueMemory`]);
/// - the controller reaches DMA memory at the addresses [`DmaRegion::dma`]
///   reports for regions from the allocator used with it.
pub unsafe trait Bar0 {
    /// Reads the 32-bit register at byte offset `off`.
    fn read32(&self, off: usize) -> u32;
    /// Writes the 32-bit register at byte offset `off`.
    fn write32(&self, off: usize, v: u32);
    /// A 64-bit register as two 32-bit accesses, low half first (what
    /// controllers accept on every bus; override for native 64-bit access).
    fn read64(&self, off: usize) -> u64 {
        let lo = self.read32(off) as u64;
        let hi = self.read32(off + 4) as u64;
        lo | hi << 32
    }
    /// A 64-bit register as two 32-bit writes, low half first.
    fn write64(&self, off: usize, v: u64) {
        self.write32(off, v as u32);
        self.write32(off + 4, (v >> 32) as u32);
    }
    /// Host address and length of the doorbell registers (BAR0 offset
    /// 0x1000 on) when they are memory another agent can be given to store
    /// into: an MMIO mapping a GPU registers as I/O memory, or the
    /// simulator's doorbell page. `None` (the default) when doorbells are
    /// reached only through `write32`.
    fn doorbells(&self) -> Option<DoorbellMemory> {
        None
    }
}

/// Where a controller's doorbell registers (BAR0 offset 0x1000 on) live in
/// this process, for an agent other than the CPU (a GPU kernel) to store
/// into.
#[derive(Clone, Copy, Debug)]
pub struct DoorbellMemory {
    /// Host address of BAR0 offset 0x1000.
    pub ptr: *mut u8,
    /// Bytes of doorbells mapped.
    pub len: usize,
    /// An MMIO mapping of a PCI BAR (a GPU registers it as I/O memory);
    /// false for ordinary memory (the simulator's doorbell page).
    pub mmio: bool,
}

/// DMA-able memory: a host virtual pointer and the address the device uses
/// (an IOVA or a physical address).
///
/// A region keeps its memory alive through an owner handle (the allocator's
/// arena), so it stays valid for as long as any clone of it exists, whoever
/// drops first. Bytes move in and out by copy only ([`DmaRegion::write`],
/// [`DmaRegion::read`]): no Rust reference into memory the device may write
/// concurrently is ever handed out.
///
/// A region is neither `Send` nor `Sync`: clones on several threads could
/// race on the same bytes.
#[derive(Clone)]
pub struct DmaRegion {
    ptr: *mut u8,
    dma: u64,
    len: usize,
    owner: Arc<dyn Any + Send + Sync>,
}

impl DmaRegion {
    /// # Safety
    ///
    /// `ptr` must be valid for reads and writes of `len` bytes for as long as
    /// `owner` is alive, not be accessed through Rust references by anyone
    /// else, and the device must reach the same bytes at `dma..dma + len`
    /// (contiguous in the device's address space).
    pub unsafe fn new(
        ptr: *mut u8,
        dma: u64,
        len: usize,
        owner: Arc<dyn Any + Send + Sync>,
    ) -> DmaRegion {
        DmaRegion {
            ptr,
            dma,
            len,
            owner,
        }
    }

    /// Host address of the region.
    pub fn ptr(&self) -> *mut u8 {
        self.ptr
    }

    /// The address the device uses for the first byte.
    pub fn dma(&self) -> u64 {
        self.dma
    }

    /// Bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// No bytes.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    fn check(&self, off: usize, len: usize, what: &str) {
        assert!(
            off.checked_add(len).is_some_and(|end| end <= self.len),
            "DMA region {what}: {len} bytes at offset {off} past its {} bytes",
            self.len
        );
    }

    /// `len` bytes at `off` of this region (sharing its memory). Panics when
    /// out of range, as slice indexing does.
    pub fn sub(&self, off: usize, len: usize) -> DmaRegion {
        self.check(off, len, "sub-region");
        DmaRegion {
            // SAFETY: in range, checked above.
            ptr: unsafe { self.ptr.add(off) },
            dma: self.dma + off as u64,
            len,
            owner: self.owner.clone(),
        }
    }

    /// The device extent of `len` bytes at `off`.
    pub fn extent(&self, off: usize, len: usize) -> Extent {
        self.check(off, len, "extent");
        Extent {
            addr: self.dma + off as u64,
            len: len as u64,
        }
    }

    /// Copies `data` in at `off` (bounds checked).
    pub fn write(&self, off: usize, data: &[u8]) {
        self.check(off, data.len(), "write");
        // SAFETY: in range; valid while `owner` lives (DmaRegion::new).
        unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), self.ptr.add(off), data.len()) }
    }

    /// Copies out from `off` into `out` (bounds checked).
    pub fn read(&self, off: usize, out: &mut [u8]) {
        self.check(off, out.len(), "read");
        // SAFETY: as in `write`.
        unsafe { std::ptr::copy_nonoverlapping(self.ptr.add(off), out.as_mut_ptr(), out.len()) }
    }

    /// The whole region copied out.
    pub fn to_vec(&self) -> Vec<u8> {
        let mut v = vec![0u8; self.len];
        self.read(0, &mut v);
        v
    }

    /// Sets every byte to `byte`.
    pub fn fill(&self, byte: u8) {
        // SAFETY: as in `write`.
        unsafe { std::ptr::write_bytes(self.ptr, byte, self.len) }
    }
}

impl fmt::Debug for DmaRegion {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "DmaRegion {{ ptr: {:p}, dma: {:#x}, len: {} }}",
            self.ptr, self.dma, self.len
        )
    }
}

/// Hands out DMA-able memory.
pub trait DmaAlloc {
    /// `bytes` bytes aligned to `align` (a power of two) in both the host and
    /// the device address space, DMA-contiguous. The contents are unspecified
    /// (the controller zero-fills what needs it).
    fn alloc(&mut self, bytes: usize, align: usize) -> Result<DmaRegion>;

    /// Makes existing host memory (the engine's registered KV memory)
    /// reachable by the device: pins it and returns the device address of
    /// every piece, in host order. The mapping is undone when the returned
    /// value is dropped.
    ///
    /// # Safety
    ///
    /// `addr..addr + len` must be mapped, writable memory that stays mapped
    /// (not freed, not remapped) for as long as the returned mapping lives:
    /// the device may read and write it until then.
    unsafe fn map_host(&mut self, addr: *mut u8, len: usize) -> Result<HostMapping> {
        let _ = (addr, len);
        Err(Error::Unsupported(
            "this DMA allocator cannot map existing host memory for the device".into(),
        ))
    }
}

/// One piece of a [`HostMapping`]: `len` bytes at host address `host` that
/// the device reaches at `dma`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MappedChunk {
    /// Host address.
    pub host: u64,
    /// Address the device uses.
    pub dma: u64,
    /// Bytes.
    pub len: u64,
}

/// Host memory mapped for a device by [`DmaAlloc::map_host`]: its pieces in
/// host order, and an owner whose drop undoes the mapping (IOMMU unmap,
/// munlock).
pub struct HostMapping {
    chunks: Vec<MappedChunk>,
    _owner: Box<dyn Any + Send>,
}

impl HostMapping {
    /// `chunks` must be sorted by host address, adjacent pieces merged where
    /// both addresses continue.
    pub fn new(chunks: Vec<MappedChunk>, owner: Box<dyn Any + Send>) -> HostMapping {
        HostMapping {
            chunks,
            _owner: owner,
        }
    }

    /// The pieces, in host address order.
    pub fn chunks(&self) -> &[MappedChunk] {
        &self.chunks
    }

    /// Host bytes covered.
    pub fn host_range(&self) -> (u64, u64) {
        match (self.chunks.first(), self.chunks.last()) {
            (Some(a), Some(b)) => (a.host, b.host + b.len),
            _ => (0, 0),
        }
    }

    /// Appends the device extents of host `addr..addr + len` to `out`
    /// (merged among themselves, never with what `out` already held); false
    /// if any byte of it lies outside the mapping.
    pub fn translate(&self, addr: u64, len: u64, out: &mut Vec<Extent>) -> bool {
        let Some(end) = addr.checked_add(len) else {
            return false;
        };
        let first = out.len();
        let mut at = addr;
        // The chunk holding `addr`: the last one starting at or before it.
        let mut i = self.chunks.partition_point(|c| c.host <= addr);
        if i == 0 {
            return false;
        }
        i -= 1;
        while at < end {
            let Some(c) = self.chunks.get(i) else {
                return false;
            };
            if at < c.host || at >= c.host + c.len {
                return false;
            }
            let take = (c.host + c.len).min(end) - at;
            let dma = c.dma + (at - c.host);
            match out[first..].last_mut() {
                Some(last) if last.addr + last.len == dma => last.len += take,
                _ => out.push(Extent {
                    addr: dma,
                    len: take,
                }),
            }
            at += take;
            i += 1;
        }
        true
    }
}

impl fmt::Debug for HostMapping {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let (a, b) = self.host_range();
        write!(
            f,
            "HostMapping {{ host {a:#x}..{b:#x}, {} piece(s) }}",
            self.chunks.len()
        )
    }
}

/// Merges a sorted list of (host, dma, len) pieces where both continue.
pub(crate) fn merge_chunks(pieces: impl IntoIterator<Item = MappedChunk>) -> Vec<MappedChunk> {
    let mut out: Vec<MappedChunk> = Vec::new();
    for p in pieces {
        match out.last_mut() {
            Some(l) if l.host + l.len == p.host && l.dma + l.len == p.dma => l.len += p.len,
            _ => out.push(p),
        }
    }
    out
}

/// The rings and doorbells of one queue pair: [`DmaRegion`]s plus BAR0.
pub struct DmaQueue<B: Bar0> {
    bar: Arc<B>,
    sq: DmaRegion,
    cq: DmaRegion,
    depth: u16,
    sq_doorbell: usize,
    cq_doorbell: usize,
}

impl<B: Bar0> DmaQueue<B> {
    /// Queue memory of `depth` entries; zero-fills the CQ (the queue pair
    /// relies on it). Panics if a region is too small or misaligned.
    fn new(bar: Arc<B>, qid: u16, dstrd: u8, sq: DmaRegion, cq: DmaRegion, depth: u16) -> Self {
        assert!(
            sq.len() >= depth as usize * 64 && sq.dma() % 64 == 0 && sq.ptr() as usize % 64 == 0
        );
        assert!(
            cq.len() >= depth as usize * 16 && cq.dma() % 16 == 0 && cq.ptr() as usize % 16 == 0
        );
        cq.fill(0);
        sq.fill(0);
        DmaQueue {
            bar,
            sq,
            cq,
            depth,
            sq_doorbell: sq_tail_doorbell(qid, dstrd),
            cq_doorbell: cq_head_doorbell(qid, dstrd),
        }
    }

    /// The submission queue's memory.
    pub fn sq_region(&self) -> &DmaRegion {
        &self.sq
    }

    /// The completion queue's memory.
    pub fn cq_region(&self) -> &DmaRegion {
        &self.cq
    }
}

// SAFETY: `new` checks that both regions hold `depth` aligned entries and
// zero-fills the CQ; the regions stay valid while the queue holds them; only
// the controller writes the CQ (the host never touches it after `new`), only
// the QueuePair writes SQ slots; the doorbells are one 32-bit BAR0 store
// each, with the barrier the `Bar0` contract requires.
unsafe impl<B: Bar0> QueueMemory for DmaQueue<B> {
    fn depth(&self) -> u16 {
        self.depth
    }
    fn sq_slot(&mut self, i: u16) -> *mut Sqe {
        assert!(i < self.depth);
        // SAFETY: i < depth and the region holds depth entries.
        unsafe { self.sq.ptr().add(i as usize * 64) as *mut Sqe }
    }
    fn cq_slot(&self, i: u16) -> *const super::spec::Cqe {
        assert!(i < self.depth);
        // SAFETY: as above.
        unsafe { self.cq.ptr().add(i as usize * 16) as *const super::spec::Cqe }
    }
    fn ring_sq_doorbell(&mut self, tail: u16) {
        self.bar.write32(self.sq_doorbell, tail as u32);
    }
    fn ring_cq_doorbell(&mut self, head: u16) {
        self.bar.write32(self.cq_doorbell, head as u32);
    }
}

/// An I/O queue pair; the token of a command is free for the caller.
pub(crate) type IoQueue<B> = QueuePair<DmaQueue<B>, u64>;

/// How [`Controller::bring_up`] sets the controller up.
#[non_exhaustive]
#[derive(Clone, Debug)]
pub struct ControllerOptions {
    /// Names the device in messages (a PCI address, `sim`).
    pub name: String,
    /// The namespace the data path uses.
    pub nsid: u32,
    /// Admin queue entries (clamped to 2..=CAP.MQES+1 and 4096).
    pub admin_depth: u16,
    /// I/O queue pairs to create (fewer if the controller grants fewer).
    pub io_queues: u16,
    /// Entries per I/O queue (clamped to 2..=CAP.MQES+1).
    pub io_depth: u16,
    /// How long an admin command may take.
    pub admin_timeout: Duration,
    /// How long an I/O command may take.
    pub io_timeout: Duration,
    /// A ceiling on one command's transfer besides MDTS; it sizes the
    /// per-queue PRP list pages.
    pub max_command_bytes: u64,
    /// Pages of SGL descriptors per I/O queue for [`Controller::transfer`]
    /// (256 descriptors per 4 KiB page).
    pub sgl_pages: usize,
    /// Queue pairs to ask for beyond `io_queues` and leave to another
    /// owner ([`Controller::create_external_queue`]: the GPU engine's
    /// kernel drives them).
    pub extra_io_queues: u16,
}

impl Default for ControllerOptions {
    fn default() -> Self {
        ControllerOptions {
            name: "nvme".into(),
            nsid: 1,
            admin_depth: 32,
            io_queues: 1,
            io_depth: 256,
            admin_timeout: Duration::from_secs(5),
            io_timeout: Duration::from_secs(5),
            max_command_bytes: 4 << 20,
            sgl_pages: 4,
            extra_io_queues: 0,
        }
    }
}

with_setters!(ControllerOptions {
    /// Named `name` in messages.
    with_name => name: String,
    /// With the data path on namespace `nsid`.
    with_nsid => nsid: u32,
    /// With `admin_depth` admin queue entries.
    with_admin_depth => admin_depth: u16,
    /// With `io_queues` I/O queue pairs.
    with_io_queues => io_queues: u16,
    /// With `io_depth` entries per I/O queue.
    with_io_depth => io_depth: u16,
    /// With this admin command timeout.
    with_admin_timeout => admin_timeout: Duration,
    /// With this I/O command timeout.
    with_io_timeout => io_timeout: Duration,
    /// With commands of at most `max_command_bytes`.
    with_max_command_bytes => max_command_bytes: u64,
    /// With `sgl_pages` pages of SGL descriptors per I/O queue.
    with_sgl_pages => sgl_pages: usize,
    /// With `extra_io_queues` queue pairs left to another owner.
    with_extra_io_queues => extra_io_queues: u16,
});

/// Direction of a [`Controller::transfer`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum IoDir {
    /// Device to memory.
    Read,
    /// Memory to device.
    Write,
}

/// How [`Controller::transfer`] describes memory.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DataMode {
    /// SGL when Identify's SGLS says the controller supports it, else PRP.
    Auto,
    /// PRP1/PRP2 and PRP lists (memory must follow PRP's page rules).
    Prp,
    /// One SGL per command: an inline Data Block for one extent, else a Last
    /// Segment of Data Blocks (chained Segments when they exceed a page).
    Sgl,
    /// As `Sgl`, with at most this many descriptors per segment (the chain
    /// pointer included; at least 2), to build Segment chains on purpose.
    SglSegmentsOf(usize),
}

struct IoSlot<B: Bar0> {
    qp: IoQueue<B>,
    /// Descriptor memory (PRP lists or SGL segments) of the synchronous path.
    scratch: DmaRegion,
}

/// A controller brought up, with its admin queue and I/O queue pairs.
pub struct Controller<B: Bar0> {
    bar: Arc<B>,
    name: String,
    cap: Cap,
    vs: Vs,
    page: u64,
    ready_timeout: Duration,
    admin: QueuePair<DmaQueue<B>, u64>,
    identify: IdentifyController,
    namespace: IdentifyNamespace,
    nsid: u32,
    io: Vec<IoSlot<B>>,
    admin_timeout: Duration,
    io_timeout: Duration,
    max_transfer: u64,
    /// I/O queue pairs the controller granted (Set Features).
    granted_queues: u16,
    /// Queue ids created for another owner, deleted by shutdown.
    external: Vec<u16>,
    admin_align: usize,
    /// CC.EN is 1 (cleared by shutdown's reset in Drop).
    enabled: bool,
    shut_down: bool,
    _identify_buf: DmaRegion,
}

fn timed_out(context: String, what: String) -> Error {
    Error::io(context, io::Error::new(io::ErrorKind::TimedOut, what))
}

/// Polls CSTS until `done` holds; fails on CFS, on a BAR reading all ones,
/// or after `timeout`.
fn wait_csts<B: Bar0>(
    bar: &B,
    name: &str,
    cap: Cap,
    timeout: Duration,
    what: &str,
    done: impl Fn(Csts) -> bool,
) -> Result<Csts> {
    let start = Instant::now();
    loop {
        let csts = Csts(bar.read32(reg::CSTS));
        if csts.0 == u32::MAX {
            return Err(Error::io(
                format!("NVMe controller {name}"),
                io::Error::other(format!(
                    "CSTS reads 0xffffffff while waiting for {what}: the device is gone or its memory space is disabled"
                )),
            ));
        }
        if done(csts) {
            return Ok(csts);
        }
        if csts.cfs() {
            return Err(Error::io(
                format!("NVMe controller {name}"),
                io::Error::other(format!(
                    "controller fatal status (CSTS={:#010x}) while waiting for {what}; the controller needs a reset",
                    csts.0
                )),
            ));
        }
        if start.elapsed() >= timeout {
            return Err(timed_out(
                format!("NVMe controller {name}"),
                format!(
                    "timed out after {} ms waiting for {what} (CSTS={:#010x}, CAP.TO={} ms)",
                    start.elapsed().as_millis(),
                    csts.0,
                    cap.timeout_ms()
                ),
            ));
        }
        std::thread::sleep(Duration::from_micros(20));
    }
}

/// Submits one command and waits for its completion (other completions
/// that show up, late answers to commands that timed out earlier, are
/// dropped).
fn run_command<M: QueueMemory>(
    qp: &mut QueuePair<M, u64>,
    sqe: Sqe,
    timeout: Duration,
) -> std::result::Result<Completion<u64>, QueueError> {
    let cid = qp.submit(sqe, 0)?;
    let deadline = Instant::now() + timeout;
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        let mut mine = None;
        for c in qp.wait(left)? {
            if c.cid == cid {
                mine = Some(c);
            }
        }
        if let Some(c) = mine {
            return Ok(c);
        }
    }
}

fn admin_command<M: QueueMemory>(
    qp: &mut QueuePair<M, u64>,
    name: &str,
    sqe: Sqe,
    what: &str,
    timeout: Duration,
) -> Result<u32> {
    let context = || format!("NVMe controller {name}: {what}");
    let c = run_command(qp, sqe, timeout).map_err(|e| match e {
        QueueError::Timeout { .. } => timed_out(context(), e.to_string()),
        e => Error::io(context(), io::Error::other(e)),
    })?;
    if !c.status.is_success() {
        return Err(Error::io(context(), io::Error::other(c.status)));
    }
    Ok(c.dw0)
}

/// Disables the controller on drop unless disarmed: a failed bring-up does
/// not leave it enabled with queues in memory about to be freed.
struct DisableGuard<'a, B: Bar0> {
    bar: &'a B,
    armed: bool,
}

impl<B: Bar0> Drop for DisableGuard<'_, B> {
    fn drop(&mut self) {
        if self.armed {
            self.bar.write32(reg::CC, 0);
        }
    }
}

impl<B: Bar0> Controller<B> {
    /// Resets and initializes the controller behind `bar`, with queue memory
    /// from `dma`, and creates `opts.io_queues` I/O queue pairs.
    pub fn bring_up<A: DmaAlloc>(bar: B, dma: &mut A, opts: ControllerOptions) -> Result<Self> {
        let bar = Arc::new(bar);
        let name = opts.name.clone();
        let ctx = || format!("NVMe controller {name}");
        let cap = Cap(bar.read64(reg::CAP));
        if cap.0 == u64::MAX {
            return Err(Error::io(
                ctx(),
                io::Error::other(
                    "CAP reads all ones: the device is gone or its memory space is disabled",
                ),
            ));
        }
        let vs = Vs(bar.read32(reg::VS));
        if !cap.supports_nvm() {
            return Err(Error::io(
                ctx(),
                io::Error::other(format!(
                    "CAP.CSS={:#x} lacks the NVM command set",
                    cap.css()
                )),
            ));
        }
        let ready_timeout = Duration::from_millis(cap.timeout_ms().max(500));
        let page = cap.mpsmin_bytes();
        let mps = (page.trailing_zeros() - 12) as u8;
        let dstrd = cap.dstrd();
        let mqes = cap.max_queue_entries().min(u16::MAX as u32) as u16;

        // 1. Disable.
        if Cc(bar.read32(reg::CC)).en() {
            bar.write32(reg::CC, 0);
        }
        wait_csts(
            &*bar,
            &name,
            cap,
            ready_timeout,
            "CSTS.RDY=0 after CC.EN=0",
            |c| !c.rdy(),
        )?;

        // 2. Admin queue.
        let admin_depth = opts.admin_depth.clamp(2, mqes.min(4096));
        let align = page as usize;
        let asq = dma.alloc(admin_depth as usize * 64, align)?;
        let acq = dma.alloc(admin_depth as usize * 16, align)?;
        for r in [&asq, &acq] {
            if r.dma() % page != 0 {
                return Err(Error::internal(format!("DMA allocator returned {r:?}, not aligned to the controller's {page}-byte page")));
            }
        }
        let admin_mem = DmaQueue::new(bar.clone(), 0, dstrd, asq.clone(), acq.clone(), admin_depth);
        bar.write32(
            reg::AQA,
            aqa(admin_depth, admin_depth).expect("depth clamped to 2..=4096"),
        );
        bar.write64(reg::ASQ, asq.dma());
        bar.write64(reg::ACQ, acq.dma());
        // Polled queues: mask every (pin-based) interrupt.
        bar.write32(reg::INTMS, u32::MAX);

        // 3. Enable.
        let mut guard = DisableGuard {
            bar: &*bar,
            armed: true,
        };
        bar.write32(reg::CC, Cc::nvm_enable(mps).0);
        wait_csts(
            &*bar,
            &name,
            cap,
            ready_timeout,
            "CSTS.RDY=1 after CC.EN=1",
            |c| c.rdy(),
        )?;
        let mut admin = QueuePair::new(0, admin_mem).map_err(|e| Error::internal(e.to_string()))?;
        let admin_timeout = opts.admin_timeout;

        // 4. Identify.
        let idbuf = dma.alloc(IDENTIFY_DATA_LEN, align.max(IDENTIFY_DATA_LEN))?;
        let mut data = [0u8; IDENTIFY_DATA_LEN];
        idbuf.fill(0);
        admin_command(
            &mut admin,
            &name,
            Sqe::identify(0, cns::CONTROLLER, 0, idbuf.dma()),
            "Identify Controller",
            admin_timeout,
        )?;
        idbuf.read(0, &mut data);
        let identify = IdentifyController::parse(&data);
        if identify.sqe_bytes() > 64 || identify.cqe_bytes() > 16 {
            return Err(Error::io(ctx(), io::Error::other(format!("Identify Controller: SQES={:#x} CQES={:#x} require entries larger than 64/16 bytes", identify.sqes, identify.cqes))));
        }
        idbuf.fill(0);
        let what = format!("Identify Namespace {}", opts.nsid);
        admin_command(
            &mut admin,
            &name,
            Sqe::identify(0, cns::NAMESPACE, opts.nsid, idbuf.dma()),
            &what,
            admin_timeout,
        )?;
        idbuf.read(0, &mut data);
        let namespace =
            IdentifyNamespace::parse(&data).map_err(|e| Error::io(ctx(), io::Error::other(e)))?;
        if namespace.nsze == 0 {
            return Err(Error::io(
                ctx(),
                io::Error::other(format!("namespace {} is inactive (NSZE 0)", opts.nsid)),
            ));
        }
        if namespace.metadata_bytes != 0 {
            return Err(Error::io(ctx(), io::Error::other(format!("namespace {} is formatted with {} metadata bytes per LBA; kvtier needs a format without metadata", opts.nsid, namespace.metadata_bytes))));
        }

        // 5. Number of queues.
        let wanted = opts.io_queues.max(1).saturating_add(opts.extra_io_queues);
        let dw0 = admin_command(
            &mut admin,
            &name,
            Sqe::set_features_num_queues(0, wanted, wanted),
            "Set Features (Number of Queues)",
            admin_timeout,
        )?;
        let (sqa, cqa) = super::spec::allocated_queues(dw0);
        let granted = (wanted as u32).min(sqa).min(cqa) as u16;
        let queues = granted.min(opts.io_queues.max(1));

        // Largest transfer of one command.
        let lba = namespace.lba_bytes as u64;
        let mdts = identify
            .max_transfer_bytes(cap.mpsmin_bytes())
            .unwrap_or(u64::MAX);
        let max_transfer = mdts.min(65536 * lba).min(opts.max_command_bytes) / page * page;
        if max_transfer < lba.max(page) {
            return Err(Error::invalid(format!("NVMe controller {name}: the largest command transfer ({max_transfer} bytes) is below one LBA or page; raise max_command_bytes")));
        }
        let prp_pages = prp_list_pages_for_entries((max_transfer / page) as usize + 1, page);
        let scratch_bytes = (prp_pages.max(opts.sgl_pages).max(1) as u64 * page) as usize;

        // 6. I/O queues: CQ first (zeroed), then the SQ that completes into it.
        let io_depth = opts.io_depth.clamp(2, mqes);
        let mut io = Vec::new();
        for qid in 1..=queues {
            let sq = dma.alloc(io_depth as usize * 64, align)?;
            let cq = dma.alloc(io_depth as usize * 16, align)?;
            let scratch = dma.alloc(scratch_bytes, align)?;
            let mem = DmaQueue::new(bar.clone(), qid, dstrd, sq.clone(), cq.clone(), io_depth);
            admin_command(
                &mut admin,
                &name,
                Sqe::create_io_cq(0, qid, io_depth, cq.dma(), None),
                &format!("Create I/O CQ {qid}"),
                admin_timeout,
            )?;
            admin_command(
                &mut admin,
                &name,
                Sqe::create_io_sq(0, qid, io_depth, sq.dma(), qid),
                &format!("Create I/O SQ {qid}"),
                admin_timeout,
            )?;
            let qp = QueuePair::new(qid, mem).map_err(|e| Error::internal(e.to_string()))?;
            io.push(IoSlot { qp, scratch });
        }
        guard.armed = false;
        drop(guard);
        Ok(Controller {
            bar,
            name,
            cap,
            vs,
            page,
            ready_timeout,
            admin,
            identify,
            namespace,
            nsid: opts.nsid,
            io,
            admin_timeout,
            io_timeout: opts.io_timeout,
            max_transfer,
            granted_queues: granted,
            external: Vec::new(),
            admin_align: align,
            enabled: true,
            shut_down: false,
            _identify_buf: idbuf,
        })
    }

    /// The name in messages.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Its BAR0.
    pub fn bar(&self) -> &B {
        &self.bar
    }

    /// CAP as read at bring-up.
    pub fn cap(&self) -> Cap {
        self.cap
    }

    /// VS as read at bring-up.
    pub fn version(&self) -> Vs {
        self.vs
    }

    /// The memory page size the controller was enabled with (CC.MPS).
    pub fn page_bytes(&self) -> u64 {
        self.page
    }

    /// Identify Controller data.
    pub fn identify(&self) -> &IdentifyController {
        &self.identify
    }

    /// Identify Namespace data of the data path's namespace.
    pub fn namespace(&self) -> &IdentifyNamespace {
        &self.namespace
    }

    /// The data path's namespace.
    pub fn nsid(&self) -> u32 {
        self.nsid
    }

    /// Bytes of one LBA.
    pub fn lba_bytes(&self) -> u32 {
        self.namespace.lba_bytes
    }

    /// Whether the controller takes SGLs for NVM commands.
    pub fn sgl_supported(&self) -> bool {
        self.identify.sgl_supported()
    }

    /// The largest transfer of one command: MDTS (in CAP.MPSMIN units), at
    /// most 65536 LBAs and `max_command_bytes`, a multiple of the page.
    pub fn max_transfer_bytes(&self) -> u64 {
        self.max_transfer
    }

    /// I/O queue pairs created.
    pub fn io_queue_count(&self) -> usize {
        self.io.len()
    }

    /// The `i`th I/O queue pair (queue id `i + 1`).
    pub fn io_queue(&mut self, i: usize) -> Result<&mut IoQueue<B>> {
        self.slot(i).map(|s| &mut s.qp)
    }

    fn slot(&mut self, i: usize) -> Result<&mut IoSlot<B>> {
        let n = self.io.len();
        let name = &self.name;
        let shut = self.shut_down;
        self.io.get_mut(i).ok_or_else(|| {
            Error::invalid(if shut {
                format!("NVMe controller {name} is shut down; it has no I/O queues")
            } else {
                format!("NVMe controller {name} has {n} I/O queue(s); there is no queue index {i}")
            })
        })
    }

    /// How long an I/O command may take.
    pub fn io_timeout(&self) -> Duration {
        self.io_timeout
    }

    /// Sets how long an I/O command may take.
    pub fn set_io_timeout(&mut self, timeout: Duration) {
        self.io_timeout = timeout;
    }

    /// Runs one admin command; returns the completion's DW0.
    pub fn admin_command(&mut self, sqe: Sqe, what: &str) -> Result<u32> {
        if self.shut_down {
            return Err(Error::invalid(format!(
                "NVMe controller {} is shut down",
                self.name
            )));
        }
        admin_command(&mut self.admin, &self.name, sqe, what, self.admin_timeout)
    }

    /// Runs one I/O command as given (its `cid` is assigned) on I/O queue
    /// `i` and waits for it. A status other than success, or no completion
    /// within the I/O timeout, is an [`Error::Device`] whose reason names the
    /// queue and the NVMe status (or the timeout).
    pub fn execute(&mut self, i: usize, sqe: Sqe) -> Result<Completion<u64>> {
        let lba = self.namespace.lba_bytes as u64;
        let timeout = self.io_timeout;
        let name = self.name.clone();
        let slot = self.slot(i)?;
        let qid = slot.qp.qid();
        let (what, offset, len) = match sqe.opcode {
            nvm_opc::READ => ("read", sqe.slba().wrapping_mul(lba), sqe.nlb() as u64 * lba),
            nvm_opc::WRITE => (
                "write",
                sqe.slba().wrapping_mul(lba),
                sqe.nlb() as u64 * lba,
            ),
            nvm_opc::FLUSH => ("flush", 0, 0),
            _ => ("command", 0, 0),
        };
        let device = |reason: String| Error::Device {
            device: name.clone(),
            offset,
            len,
            reason,
        };
        let c = run_command(&mut slot.qp, sqe, timeout).map_err(|e| {
            device(format!(
                "{what} (opcode {:#04x}) on queue {qid}: {e}",
                sqe.opcode
            ))
        })?;
        if !c.status.is_success() {
            return Err(device(format!(
                "{what} (opcode {:#04x}) on queue {qid}, cid {}: {}",
                sqe.opcode, c.cid, c.status
            )));
        }
        Ok(c)
    }

    /// Flush on I/O queue `i`.
    pub fn flush(&mut self, i: usize) -> Result<()> {
        let sqe = Sqe::flush(0, self.nsid);
        self.execute(i, sqe).map(|_| ())
    }

    /// Moves the bytes of `mem` (device extents, in order; their total a
    /// multiple of the LBA size) to or from the namespace starting at LBA
    /// `slba`, on I/O queue `i`, one command at a time, each at most
    /// [`Controller::max_transfer_bytes`]. Returns the number of commands.
    pub fn transfer(
        &mut self,
        i: usize,
        dir: IoDir,
        slba: u64,
        mem: &[Extent],
        mode: DataMode,
    ) -> Result<usize> {
        let lba = self.namespace.lba_bytes as u64;
        let total: u64 = mem.iter().map(|e| e.len).sum();
        if total == 0 || total % lba != 0 || mem.iter().any(|e| e.len == 0) {
            return Err(Error::internal(format!("NVMe transfer of {total} bytes in {} extent(s): extents must be non-empty and total a multiple of the {lba}-byte LBA", mem.len())));
        }
        let sgl = match mode {
            DataMode::Auto => self.sgl_supported(),
            DataMode::Prp => false,
            DataMode::Sgl | DataMode::SglSegmentsOf(_) => {
                if !self.sgl_supported() {
                    return Err(Error::invalid(format!(
                        "NVMe controller {} does not support SGLs (Identify SGLS={:#x}); use PRP",
                        self.name, self.identify.sgls
                    )));
                }
                true
            }
        };
        if sgl
            && self.identify.sgl_dword_aligned()
            && mem.iter().any(|e| e.addr % 4 != 0 || e.len % 4 != 0)
        {
            return Err(Error::invalid(format!(
                "NVMe controller {} requires dword-aligned SGL data blocks",
                self.name
            )));
        }
        let per_segment = match mode {
            DataMode::SglSegmentsOf(n) if n < 2 => {
                return Err(Error::invalid(
                    "an SGL segment needs room for at least 2 descriptors",
                ))
            }
            DataMode::SglSegmentsOf(n) => n,
            _ => (self.page / SGL_DESCRIPTOR_LEN as u64) as usize,
        };
        let mut cursor = 0usize; // extent index
        let mut within = 0u64; // bytes of mem[cursor] consumed
        let mut done = 0u64;
        let mut commands = 0usize;
        while done < total {
            let chunk = (total - done).min(self.max_transfer);
            let mut pieces = Vec::new();
            let mut need = chunk;
            while need > 0 {
                let e = mem[cursor];
                let take = (e.len - within).min(need);
                pieces.push(Extent {
                    addr: e.addr + within,
                    len: take,
                });
                need -= take;
                within += take;
                if within == e.len {
                    cursor += 1;
                    within = 0;
                }
            }
            let data = if sgl {
                self.build_sgl(i, &pieces, per_segment)?
            } else {
                self.build_prp(i, &pieces)?
            };
            let nlb = (chunk / lba - 1) as u16;
            let lba_at = slba + done / lba;
            let sqe = match dir {
                IoDir::Read => Sqe::read(0, self.nsid, lba_at, nlb, data),
                IoDir::Write => Sqe::write(0, self.nsid, lba_at, nlb, data),
            };
            self.execute(i, sqe)?;
            commands += 1;
            done += chunk;
        }
        Ok(commands)
    }

    fn build_prp(&mut self, i: usize, pieces: &[Extent]) -> Result<DataPtr> {
        let page = self.page;
        let scratch = self.slot(i)?.scratch.clone();
        let mut list = vec![0u64; scratch.len() / 8];
        let prps = build_prps(pieces, page, &mut list, scratch.dma())
            .map_err(|e| Error::internal(e.to_string()))?;
        if prps.list_slots > 0 {
            scratch.write(0, bytemuck::cast_slice(&list[..prps.list_slots]));
        }
        Ok(prps.data_ptr())
    }

    /// One SGL for `pieces`: inline Data Block, one Last Segment, or a chain
    /// of Segments of at most `per` descriptors ending in a Last Segment.
    fn build_sgl(&mut self, i: usize, pieces: &[Extent], per: usize) -> Result<DataPtr> {
        let mut blocks = Vec::with_capacity(pieces.len());
        for p in pieces {
            // A data block holds at most u32::MAX bytes: split longer extents.
            let mut off = 0u64;
            while off < p.len {
                let n = (p.len - off).min(u32::MAX as u64 & !0xfff);
                blocks.push(SglDescriptor::data_block(p.addr + off, n as u32));
                off += n;
            }
        }
        if blocks.len() == 1 {
            return Ok(DataPtr::Sgl(blocks[0]));
        }
        // Segments: all but the last hold data blocks and a pointer to the
        // next. Consecutive Segment descriptors never have the same length:
        // QEMU's hw/nvme (7.2, nvme_map_sgl) reads the next segment over the
        // descriptor it then checks for "Last Segment", so Segment ->
        // Segment of equal lengths fails with 0x400d there. Alternating
        // per-1 and per-2 data blocks costs nothing on other controllers.
        let mut segments: Vec<Vec<SglDescriptor>> = Vec::new();
        let mut rest = &blocks[..];
        while rest.len() > per {
            let take = if per > 2 && segments.len() % 2 == 1 {
                per - 2
            } else {
                per - 1
            };
            let (head, tail) = rest.split_at(take);
            segments.push(head.to_vec());
            rest = tail;
        }
        segments.push(rest.to_vec());
        let descriptors: usize = blocks.len() + segments.len() - 1;
        let scratch = self.slot(i)?.scratch.clone();
        if descriptors * SGL_DESCRIPTOR_LEN as usize > scratch.len() {
            return Err(Error::invalid(format!(
                "an SGL of {} descriptors needs {} bytes; queue {i}'s descriptor pages hold {} (raise ControllerOptions::sgl_pages)",
                descriptors,
                descriptors * SGL_DESCRIPTOR_LEN as usize,
                scratch.len()
            )));
        }
        // Lay the segments out back to back; each ends with a pointer to the next.
        let mut offsets = Vec::with_capacity(segments.len());
        let mut off = 0usize;
        for (k, s) in segments.iter().enumerate() {
            offsets.push(off);
            off += (s.len() + usize::from(k + 1 < segments.len())) * SGL_DESCRIPTOR_LEN as usize;
        }
        let pointer = |k: usize| {
            let addr = scratch.dma() + offsets[k] as u64;
            let n = (segments[k].len() + usize::from(k + 1 < segments.len())) as u32;
            if k + 1 == segments.len() {
                SglDescriptor::last_segment(addr, n)
            } else {
                SglDescriptor::segment(addr, n)
            }
        };
        for k in 0..segments.len() {
            let mut s = segments[k].clone();
            if k + 1 < segments.len() {
                s.push(pointer(k + 1));
            }
            scratch.write(offsets[k], bytemuck::cast_slice(&s));
        }
        Ok(DataPtr::Sgl(pointer(0)))
    }

    /// Creates an I/O queue pair whose rings are `sq` (`depth` 64-byte
    /// entries) and `cq` (`depth` 16-byte entries, zero-filled here) for
    /// another owner to drive, on the next free queue id within what the
    /// controller granted (ask with `ControllerOptions::extra_io_queues`).
    /// Returns the queue id. The owner must stop using it before
    /// [`Controller::delete_external_queue`] or shutdown, which deletes it.
    pub fn create_external_queue(
        &mut self,
        depth: u16,
        sq: &DmaRegion,
        cq: &DmaRegion,
    ) -> Result<u16> {
        let name = self.name.clone();
        let mqes = self.cap.max_queue_entries().min(4096) as u16;
        if depth < 2 || depth > mqes {
            return Err(Error::invalid(format!(
                "NVMe controller {name}: a queue of {depth} entries; it takes 2 to {mqes}"
            )));
        }
        let align = self.admin_align as u64;
        if sq.len() < depth as usize * 64
            || cq.len() < depth as usize * 16
            || sq.dma() % align != 0
            || cq.dma() % align != 0
        {
            return Err(Error::invalid(format!(
                "NVMe controller {name}: queue memory must hold {depth} entries and be {align}-byte aligned"
            )));
        }
        let used: Vec<u16> = self
            .io
            .iter()
            .map(|s| s.qp.qid())
            .chain(self.external.iter().copied())
            .collect();
        let qid = (1..=self.granted_queues)
            .find(|q| !used.contains(q))
            .ok_or_else(|| {
                Error::invalid(format!(
                    "NVMe controller {name} granted {} I/O queue pair(s), all in use; bring it up with more ControllerOptions::extra_io_queues",
                    self.granted_queues
                ))
            })?;
        cq.fill(0);
        sq.fill(0);
        self.admin_command(
            Sqe::create_io_cq(0, qid, depth, cq.dma(), None),
            &format!("Create I/O CQ {qid}"),
        )?;
        if let Err(e) = self.admin_command(
            Sqe::create_io_sq(0, qid, depth, sq.dma(), qid),
            &format!("Create I/O SQ {qid}"),
        ) {
            let _ = self.admin_command(Sqe::delete_io_cq(0, qid), &format!("Delete I/O CQ {qid}"));
            return Err(e);
        }
        self.external.push(qid);
        Ok(qid)
    }

    /// Deletes a queue pair made by [`Controller::create_external_queue`].
    pub fn delete_external_queue(&mut self, qid: u16) -> Result<()> {
        let Some(i) = self.external.iter().position(|&q| q == qid) else {
            return Err(Error::invalid(format!(
                "NVMe controller {}: queue {qid} is not an external queue",
                self.name
            )));
        };
        self.external.swap_remove(i);
        let sq = self.admin_command(Sqe::delete_io_sq(0, qid), &format!("Delete I/O SQ {qid}"));
        let cq = self.admin_command(Sqe::delete_io_cq(0, qid), &format!("Delete I/O CQ {qid}"));
        sq.and(cq).map(|_| ())
    }

    /// Deletes the I/O queues (each SQ before its CQ) and performs a normal
    /// shutdown: CC.SHN = normal, then CSTS.SHST = complete within CAP.TO.
    /// The controller is reset (CC.EN=0) when dropped.
    pub fn shutdown(&mut self) -> Result<()> {
        if self.shut_down {
            return Ok(());
        }
        let mut first_err = None;
        for qid in std::mem::take(&mut self.external) {
            self.external.push(qid);
            if let Err(e) = self.delete_external_queue(qid) {
                first_err.get_or_insert(e);
            }
        }
        let queues: Vec<u16> = self.io.iter().map(|s| s.qp.qid()).collect();
        for qid in queues.into_iter().rev() {
            for (sqe, what) in [
                (Sqe::delete_io_sq(0, qid), format!("Delete I/O SQ {qid}")),
                (Sqe::delete_io_cq(0, qid), format!("Delete I/O CQ {qid}")),
            ] {
                if let Err(e) = self.admin_command(sqe, &what) {
                    first_err.get_or_insert(e);
                }
            }
        }
        self.io.clear();
        self.shut_down = true;
        let cc = Cc(self.bar.read32(reg::CC)).with_shn(Shn::Normal);
        self.bar.write32(reg::CC, cc.0);
        wait_csts(
            &*self.bar,
            &self.name,
            self.cap,
            self.ready_timeout,
            "CSTS.SHST=complete after CC.SHN=normal",
            |c| c.shst() == Shst::Complete,
        )?;
        match first_err {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }

    /// Stops the controller at once after a failure (a command that never
    /// completed): CC.EN=0, then CSTS.RDY=0 within CAP.TO, so it no longer
    /// touches queue or data memory. Its I/O queues are gone afterwards
    /// (the controller counts as shut down); bring it up again to go on.
    pub fn reset_after_failure(&mut self) -> Result<()> {
        self.io.clear();
        self.external.clear();
        self.shut_down = true;
        if !self.enabled {
            return Ok(());
        }
        self.bar.write32(reg::CC, 0);
        self.enabled = false;
        wait_csts(
            &*self.bar,
            &self.name,
            self.cap,
            self.ready_timeout,
            "CSTS.RDY=0 after a reset",
            |c| !c.rdy(),
        )
        .map(|_| ())
    }

    /// Whether [`Controller::shutdown`] has run.
    pub fn is_shut_down(&self) -> bool {
        self.shut_down
    }
}

impl<B: Bar0> Drop for Controller<B> {
    /// Resets the controller (CC.EN=0) and waits, at most CAP.TO, for
    /// CSTS.RDY=0, so it stops using queue memory before that is released.
    fn drop(&mut self) {
        if self.enabled {
            self.bar.write32(reg::CC, 0);
            let _ = wait_csts(
                &*self.bar,
                &self.name,
                self.cap,
                self.ready_timeout,
                "CSTS.RDY=0",
                |c| !c.rdy(),
            );
            self.enabled = false;
        }
    }
}
