//! A simulated NVMe controller: a **test double of hardware**, for fast tests
//! of the controller bring-up, the queue pairs and the data descriptors on
//! machines without a device. It is held to the same suite
//! (`tests/nvme_sim.rs`) that runs against QEMU's emulated controller, and
//! walks data pointers the way QEMU 7.2's hw/nvme does (see
//! `shared/notes/qemu-nvme`): PRP1/PRP2/PRP lists with the page size of
//! CC.MPS; SGLs with a Data Block inline in DPTR, or a Segment/Last Segment
//! chain in which a segment holds only Data Blocks plus one trailing
//! Segment/Last Segment descriptor and its length is a non-zero multiple of
//! 16. Errors complete with Do Not Retry, as QEMU's read/write path does:
//! an SGL shorter than the transfer is 0x400f, a bit bucket 0x400d, PSDT=11b
//! 0x4002, an LBA past the namespace 0x4080, a transfer past MDTS 0x4002.
//!
//! It is driven synchronously: a doorbell write through [`Bar0`] runs the
//! controller until it has nothing to do (every SQ consumed up to its tail,
//! or the CQ it completes into full), so when the write returns the CQEs are
//! posted with the right phase tag and SQ head.
//!
//! DMA memory is host memory: [`SimDma`] allocates it and the DMA address is
//! the host pointer's value. The controller touches only memory its
//! allocator handed out (an address elsewhere is a Data Transfer Error,
//! where an IOMMU would fault), so a wrong descriptor cannot corrupt the
//! test process. The namespace is a `Vec<u8>` of 512-byte LBAs.
//!
//! Knobs for error paths QEMU cannot be asked for: [`SimController::drop_next_commands`]
//! (commands fetched and never completed) and [`SimConfig::never_ready`].
//!
//! **Doorbell page mode** ([`SimController::doorbell_page`]): a GPU I/O
//! kernel rings doorbells with plain stores to memory (a BAR0 mapped into
//! the GPU, or a doorbell page), never through a Rust method call. For that
//! the simulator also reads its doorbells from a page of `u32`s in its own
//! DMA memory, laid out like BAR0's doorbell area (SQ y tail at slot
//! `2y << DSTRD`, CQ y head at `(2y + 1) << DSTRD`), watched by a host
//! thread that forwards every changed value to the controller, which then
//! runs asynchronously to the writer, as a real device does. The page is
//! also a [`Bar0`] (registers to the controller, doorbells into the page),
//! so `Controller::bring_up` and the NVMe suite run over it unchanged.

use super::ctrl::{Bar0, DmaAlloc, DmaRegion, HostMapping, MappedChunk};
use super::spec::{
    admin_opc, cns, feature, idctl, idns, nvm_opc, reg, sgls, Cc, Cqe, Psdt, SglDescriptor,
    SglType, Sqe, Status, Vs, IDENTIFY_DATA_LEN,
};
use crate::error::{Error, Result};
use std::alloc::Layout;
use std::sync::atomic::{AtomicBool, AtomicU16, AtomicU32, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::Duration;

/// LBA size of the simulated namespace.
pub(crate) const SIM_LBA_BYTES: u64 = 512;

/// What the simulated controller reports and how it behaves.
#[derive(Clone, Debug)]
pub struct SimConfig {
    /// Namespace 1 size in 512-byte LBAs.
    pub lbas: u64,
    /// Identify MDTS (0: no limit); QEMU's default is 7 (512 KiB).
    pub mdts: u8,
    /// CAP.MQES (0-based); QEMU: 2047.
    pub mqes: u16,
    /// CAP.DSTRD (doorbell stride, 4 << n bytes).
    pub dstrd: u8,
    /// I/O queue pairs the controller has.
    pub max_io_queues: u16,
    /// Identify SGLS; QEMU 7.2: 0x1.
    pub sgls: u32,
    /// CAP.TO in 500 ms units; QEMU: 0xf.
    pub timeout_units: u8,
    /// CC.EN=1 never sets CSTS.RDY (a controller that does not come up).
    pub never_ready: bool,
}

impl Default for SimConfig {
    fn default() -> Self {
        SimConfig {
            lbas: 32768,
            mdts: 7,
            mqes: 2047,
            dstrd: 0,
            max_io_queues: 64,
            sgls: 0x1,
            timeout_units: 0xf,
            never_ready: false,
        }
    }
}

/// Counters of what the simulated controller executed.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SimStats {
    /// Admin commands executed.
    pub admin_commands: u64,
    /// I/O commands executed.
    pub io_commands: u64,
    /// Reads.
    pub reads: u64,
    /// Writes.
    pub writes: u64,
    /// Flushes.
    pub flushes: u64,
    /// Largest data transfer of one successful read or write, in bytes.
    pub largest_transfer: u64,
    /// Commands fetched and never completed ([`SimController::drop_next_commands`]).
    pub dropped: u64,
    /// Commands completed with an error status.
    pub errors: u64,
}

/// The DMA memory of one simulated controller: every allocation, freed when
/// the last handle (allocator, region, controller) is gone.
struct Arena {
    /// (address, layout) of each allocation; addresses as integers.
    allocs: Mutex<Vec<(usize, Layout)>>,
    /// (address, length) of host memory mapped by `SimDma::map_host`.
    mapped: Mutex<Vec<(u64, u64)>>,
}

impl Arena {
    /// Whether `addr..addr + len` lies inside one allocation.
    fn contains(&self, addr: u64, len: u64) -> bool {
        let Some(end) = addr.checked_add(len) else {
            return false;
        };
        let allocs = self.allocs.lock().unwrap_or_else(|e| e.into_inner());
        allocs
            .iter()
            .any(|&(a, l)| a as u64 <= addr && end <= a as u64 + l.size() as u64)
            || self
                .mapped
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .iter()
                .any(|&(a, l)| a <= addr && end <= a + l)
    }
}

/// Host memory the simulated device may touch until this is dropped.
struct SimMapping {
    arena: Arc<Arena>,
    range: (u64, u64),
}

impl Drop for SimMapping {
    fn drop(&mut self) {
        let mut mapped = self.arena.mapped.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(i) = mapped.iter().position(|&r| r == self.range) {
            mapped.swap_remove(i);
        }
    }
}

impl Drop for Arena {
    fn drop(&mut self) {
        let allocs = self.allocs.get_mut().unwrap_or_else(|e| e.into_inner());
        for &(a, layout) in allocs.iter() {
            // SAFETY: allocated by SimDma::alloc with this layout, freed once.
            unsafe { std::alloc::dealloc(a as *mut u8, layout) };
        }
    }
}

/// The simulated controller's DMA allocator (DMA address = host pointer).
#[derive(Clone)]
pub struct SimDma {
    arena: Arc<Arena>,
}

impl DmaAlloc for SimDma {
    fn alloc(&mut self, bytes: usize, align: usize) -> Result<DmaRegion> {
        let layout = Layout::from_size_align(bytes.max(1), align.max(1)).map_err(|e| {
            Error::invalid(format!(
                "sim DMA alloc of {bytes} bytes aligned {align}: {e}"
            ))
        })?;
        // SAFETY: layout has a non-zero size.
        let ptr = unsafe { std::alloc::alloc_zeroed(layout) };
        if ptr.is_null() {
            return Err(Error::invalid(format!(
                "sim DMA alloc of {bytes} bytes failed"
            )));
        }
        self.arena
            .allocs
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push((ptr as usize, layout));
        // SAFETY: ptr is valid for `bytes` until the arena is dropped, which
        // the region's owner handle prevents; the device address is the
        // pointer's value.
        Ok(unsafe { DmaRegion::new(ptr, ptr as u64, bytes, self.arena.clone()) })
    }

    /// The simulated device reaches host memory at its host address (no
    /// IOMMU), but only memory mapped here or allocated above.
    unsafe fn map_host(&mut self, addr: *mut u8, len: usize) -> Result<HostMapping> {
        let range = (addr as u64, len as u64);
        self.arena
            .mapped
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push(range);
        Ok(HostMapping::new(
            vec![MappedChunk {
                host: range.0,
                dma: range.0,
                len: range.1,
            }],
            Box::new(SimMapping {
                arena: self.arena.clone(),
                range,
            }),
        ))
    }
}

struct Sq {
    base: u64,
    size: u16,
    head: u16,
    tail: u16,
    cqid: u16,
}

struct Cq {
    base: u64,
    size: u16,
    tail: u16,
    /// The host's last head doorbell.
    head: u16,
    phase: bool,
}

struct Core {
    cfg: SimConfig,
    arena: Arc<Arena>,
    cap: u64,
    cc: u32,
    csts: u32,
    aqa: u32,
    asq: u64,
    acq: u64,
    intms: u32,
    /// CC.MPS page size while enabled.
    page: u64,
    sqs: Vec<Option<Sq>>,
    cqs: Vec<Option<Cq>>,
    ns: Vec<u8>,
    drop_next: u32,
    stats: SimStats,
    /// The doorbell page, when [`SimController::doorbell_page`] made one.
    db_page: Option<PageDoorbells>,
}

/// The doorbell page as the controller sees it: where it is, and the last
/// value of every slot that was forwarded, so only changes are.
struct PageDoorbells {
    addr: usize,
    slots: usize,
    seen: Vec<u32>,
}

impl PageDoorbells {
    fn slot(&self, i: usize) -> &AtomicU32 {
        assert!(i < self.slots);
        // SAFETY: addr is a 4-aligned allocation of `slots` u32s in the
        // controller's arena, kept alive by the arena the core holds; the
        // writer side uses 32-bit stores too, so access is atomic.
        unsafe { &*(self.addr as *const AtomicU32).add(i) }
    }
}

/// A simulated NVMe controller (a test double; see the module docs). Clones
/// share the controller: hand one to [`super::ctrl::Controller::bring_up`] as
/// its [`Bar0`] and keep one to steer and inspect it.
#[derive(Clone)]
pub struct SimController {
    core: Arc<Mutex<Core>>,
    arena: Arc<Arena>,
}

type Sg = Vec<(u64, u64)>;

impl SimController {
    /// A simulated controller that behaves as `cfg` says.
    pub fn new(cfg: SimConfig) -> SimController {
        let arena = Arc::new(Arena {
            allocs: Mutex::new(Vec::new()),
            mapped: Mutex::new(Vec::new()),
        });
        let cap = cfg.mqes as u64
            | (1 << 16) // CQR
            | ((cfg.timeout_units as u64) << 24)
            | (((cfg.dstrd & 0xf) as u64) << 32)
            | (1 << 37) // CSS: NVM
            | (4 << 52); // MPSMAX 64 KiB, MPSMIN 4 KiB
        let queues = cfg.max_io_queues as usize + 1;
        let core = Core {
            ns: vec![0u8; (cfg.lbas * SIM_LBA_BYTES) as usize],
            arena: arena.clone(),
            cap,
            cc: 0,
            csts: 0,
            aqa: 0,
            asq: 0,
            acq: 0,
            intms: 0,
            page: 4096,
            sqs: (0..queues).map(|_| None).collect(),
            cqs: (0..queues).map(|_| None).collect(),
            drop_next: 0,
            stats: SimStats::default(),
            db_page: None,
            cfg,
        };
        SimController {
            core: Arc::new(Mutex::new(core)),
            arena,
        }
    }

    fn core(&self) -> MutexGuard<'_, Core> {
        self.core.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The allocator of this controller's DMA memory.
    pub fn dma(&self) -> SimDma {
        SimDma {
            arena: self.arena.clone(),
        }
    }

    /// The next `n` commands fetched (admin or I/O) are never completed.
    pub fn drop_next_commands(&self, n: u32) {
        self.core().drop_next = n;
    }

    /// What it executed so far.
    pub fn stats(&self) -> SimStats {
        self.core().stats
    }

    /// `len` bytes of the namespace at byte `offset` (panics past its end).
    pub fn namespace_bytes(&self, offset: u64, len: usize) -> Vec<u8> {
        let core = self.core();
        core.ns[offset as usize..offset as usize + len].to_vec()
    }

    /// Switches on doorbell page mode (see the module docs): allocates the
    /// page from this controller's DMA memory and starts the host thread
    /// that forwards changed doorbells to the controller. Doorbell writes
    /// through [`Bar0`] on `self` keep working too (the controller does not
    /// care who rang), but a queue should be rung one way only. Fails if a
    /// page already exists or the queues' doorbells do not fit in one.
    ///
    /// The thread stops and is joined when the last handle of the returned
    /// page is dropped; dropping it while the page's memory is still being
    /// written is harmless (the stores land, nobody forwards them).
    pub fn doorbell_page(&self) -> Result<SimDoorbellPage> {
        let stride = 4usize << self.core().cfg.dstrd;
        let queues = self.core().cfg.max_io_queues as usize + 1;
        let bytes = (2 * queues * stride).next_multiple_of(4096);
        let region = self.dma().alloc(bytes, 4096)?;
        region.fill(0);
        {
            let mut core = self.core();
            if core.db_page.is_some() {
                return Err(Error::invalid(
                    "this simulated controller already has a doorbell page",
                ));
            }
            core.db_page = Some(PageDoorbells {
                addr: region.ptr() as usize,
                slots: bytes / 4,
                seen: vec![0; bytes / 4],
            });
        }
        let stop = Arc::new(AtomicBool::new(false));
        let thread = {
            let ctrl = self.clone();
            let stop = stop.clone();
            std::thread::Builder::new()
                .name("sim-nvme-doorbells".into())
                .spawn(move || {
                    while !stop.load(Ordering::Acquire) {
                        if !ctrl.core().forward_page_doorbells() {
                            // Idle: a short sleep keeps a test machine's
                            // cores free; a doorbell waits ~0.1 ms at most.
                            std::thread::sleep(Duration::from_micros(20));
                        }
                    }
                })
                .map_err(|e| Error::io("start the simulated doorbell thread", e))?
        };
        Ok(SimDoorbellPage {
            inner: Arc::new(PageInner {
                ctrl: self.clone(),
                addr: region.ptr() as usize,
                dma: region.dma(),
                bytes,
                stop,
                thread: Mutex::new(Some(thread)),
            }),
        })
    }
}

struct PageInner {
    ctrl: SimController,
    addr: usize,
    dma: u64,
    bytes: usize,
    stop: Arc<AtomicBool>,
    thread: Mutex<Option<JoinHandle<()>>>,
}

impl Drop for PageInner {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Release);
        let thread = self.thread.get_mut().unwrap_or_else(|e| e.into_inner());
        if let Some(t) = thread.take() {
            let _ = t.join();
        }
        // The controller stops watching (the memory itself belongs to the
        // arena and is freed with it).
        self.ctrl.core().db_page = None;
    }
}

/// The simulated controller's doorbell page (see the module docs). Clones
/// share it; the forwarding thread runs while any clone exists.
///
/// As a [`Bar0`] it sends register accesses to the controller and stores
/// doorbell writes into the page, so a `Controller` brought up over it rings
/// every queue through memory, asynchronously, like a GPU kernel does.
#[derive(Clone)]
pub struct SimDoorbellPage {
    inner: Arc<PageInner>,
}

impl SimDoorbellPage {
    /// The controller behind the page.
    pub fn controller(&self) -> &SimController {
        &self.inner.ctrl
    }

    /// Host address of the page's first byte (doorbell offset 0x1000).
    pub fn ptr(&self) -> *mut u8 {
        self.inner.addr as *mut u8
    }

    /// DMA address of the page (the simulator's DMA address = host pointer).
    pub fn dma(&self) -> u64 {
        self.inner.dma
    }

    /// Bytes.
    pub fn len(&self) -> usize {
        self.inner.bytes
    }

    /// No bytes.
    pub fn is_empty(&self) -> bool {
        self.inner.bytes == 0
    }

    /// Where the doorbell at BAR0 offset `bar_off` (>= 0x1000, e.g. from
    /// `spec::sq_tail_doorbell`) lives in the page. Panics past the page.
    pub fn doorbell_ptr(&self, bar_off: usize) -> *mut u32 {
        let off = bar_off
            .checked_sub(reg::DOORBELL_BASE)
            .filter(|o| o % 4 == 0 && o + 4 <= self.inner.bytes)
            .unwrap_or_else(|| {
                panic!(
                    "BAR0 offset {bar_off:#x} is not a doorbell of this {}-byte page",
                    self.inner.bytes
                )
            });
        // SAFETY: in range, checked above.
        unsafe { self.ptr().add(off) as *mut u32 }
    }
}

// SAFETY: register accesses go to the simulated controller (see the impl
// for SimController); a doorbell write is one 32-bit atomic store (Release,
// after the caller's fence) into the page, inside its bounds or a panic.
unsafe impl Bar0 for SimDoorbellPage {
    fn read32(&self, off: usize) -> u32 {
        self.inner.ctrl.read32(off)
    }
    fn write32(&self, off: usize, v: u32) {
        if off >= reg::DOORBELL_BASE {
            let p = self.doorbell_ptr(off);
            // SAFETY: a 4-aligned u32 of the page, alive while `inner` is.
            unsafe { (*(p as *const AtomicU32)).store(v, Ordering::Release) };
        } else {
            self.inner.ctrl.write32(off, v);
        }
    }
    fn doorbells(&self) -> Option<super::ctrl::DoorbellMemory> {
        Some(super::ctrl::DoorbellMemory {
            ptr: self.ptr(),
            len: self.len(),
            mmio: false,
        })
    }
}

// SAFETY: every access is to the simulated register file (offsets not
// decoded are ignored); doorbell writes run the controller synchronously
// under the lock, after the caller's fence; the controller reads and writes
// only memory its own arena allocated, at DMA address == host pointer.
unsafe impl Bar0 for SimController {
    fn read32(&self, off: usize) -> u32 {
        self.core().read32(off)
    }
    fn write32(&self, off: usize, v: u32) {
        self.core().write32(off, v)
    }
    fn read64(&self, off: usize) -> u64 {
        let core = self.core();
        core.read32(off) as u64 | (core.read32(off + 4) as u64) << 32
    }
    fn write64(&self, off: usize, v: u64) {
        let mut core = self.core();
        core.write32(off, v as u32);
        core.write32(off + 4, (v >> 32) as u32);
    }
}

const CSTS_RDY: u32 = 1;
const CSTS_SHST_COMPLETE: u32 = 2 << 2;
/// Segments followed for one SGL before the simulator gives up (a cycle).
const MAX_SGL_SEGMENTS: usize = 4096;

impl Core {
    fn read32(&self, off: usize) -> u32 {
        match off {
            reg::CAP => self.cap as u32,
            0x04 => (self.cap >> 32) as u32,
            reg::VS => Vs::new(1, 4, 0).0,
            reg::INTMS | reg::INTMC => self.intms,
            reg::CC => self.cc,
            reg::CSTS => self.csts,
            reg::AQA => self.aqa,
            reg::ASQ => self.asq as u32,
            0x2c => (self.asq >> 32) as u32,
            reg::ACQ => self.acq as u32,
            0x34 => (self.acq >> 32) as u32,
            _ => 0,
        }
    }

    fn write32(&mut self, off: usize, v: u32) {
        let enabled = Cc(self.cc).en();
        match off {
            reg::INTMS => self.intms |= v,
            reg::INTMC => self.intms &= !v,
            reg::CC => self.write_cc(v),
            reg::AQA if !enabled => self.aqa = v,
            reg::ASQ if !enabled => self.asq = (self.asq & !0xffff_ffff) | v as u64,
            0x2c if !enabled => self.asq = (self.asq & 0xffff_ffff) | (v as u64) << 32,
            reg::ACQ if !enabled => self.acq = (self.acq & !0xffff_ffff) | v as u64,
            0x34 if !enabled => self.acq = (self.acq & 0xffff_ffff) | (v as u64) << 32,
            o if o >= reg::DOORBELL_BASE => self.doorbell(o - reg::DOORBELL_BASE, v),
            _ => {}
        }
    }

    fn write_cc(&mut self, v: u32) {
        let (old, new) = (Cc(self.cc), Cc(v));
        self.cc = v;
        if !old.en() && new.en() {
            self.enable();
        } else if old.en() && !new.en() {
            self.reset();
        }
        // Shutdown completes at once (QEMU sets CSTS to SHST complete).
        if new.shn() != 0 && old.shn() == 0 {
            self.csts = CSTS_SHST_COMPLETE;
        } else if new.shn() == 0 && old.shn() != 0 {
            self.csts &= !CSTS_SHST_COMPLETE;
        }
    }

    fn reset(&mut self) {
        self.sqs.iter_mut().for_each(|q| *q = None);
        self.cqs.iter_mut().for_each(|q| *q = None);
        self.csts = 0;
        // A reset clears the doorbells: values from before it must not be
        // forwarded to the queues created after it.
        if let Some(page) = self.db_page.as_mut() {
            page.seen.iter_mut().for_each(|v| *v = 0);
            for i in 0..page.slots {
                page.slot(i).store(0, Ordering::Release);
            }
        }
    }

    /// Forwards every doorbell of the page whose value changed since it was
    /// last forwarded; runs the controller for each. Returns whether any was
    /// (so the polling thread knows whether to back off). Called under the
    /// core lock, so a reset never interleaves with reading the page.
    fn forward_page_doorbells(&mut self) -> bool {
        let Some(page) = self.db_page.as_ref() else {
            return false;
        };
        let mut changed = Vec::new();
        for i in 0..page.slots {
            let v = page.slot(i).load(Ordering::Acquire);
            if v != page.seen[i] {
                changed.push((i, v));
            }
        }
        for &(i, v) in &changed {
            if let Some(page) = self.db_page.as_mut() {
                page.seen[i] = v;
            }
            self.doorbell(i * 4, v);
        }
        !changed.is_empty()
    }

    /// CC.EN 0 -> 1: checks the configuration and the admin queue (a bad one
    /// leaves CSTS.RDY at 0, as QEMU does) and creates queue 0.
    fn enable(&mut self) {
        let cc = Cc(self.cc);
        let page = cc.page_bytes();
        let sq_entries = (self.aqa & 0xfff) as u16 + 1;
        let cq_entries = ((self.aqa >> 16) & 0xfff) as u16 + 1;
        let ok = !self.cfg.never_ready
            && cc.css() == 0
            && cc.iosqes() == 6
            && cc.iocqes() == 4
            && (4096..=65536).contains(&page)
            && sq_entries >= 2
            && cq_entries >= 2
            && self.asq % page == 0
            && self.acq % page == 0
            && self.arena.contains(self.asq, sq_entries as u64 * 64)
            && self.arena.contains(self.acq, cq_entries as u64 * 16);
        if !ok {
            return;
        }
        self.page = page;
        self.sqs[0] = Some(Sq {
            base: self.asq,
            size: sq_entries,
            head: 0,
            tail: 0,
            cqid: 0,
        });
        self.cqs[0] = Some(Cq {
            base: self.acq,
            size: cq_entries,
            tail: 0,
            head: 0,
            phase: true,
        });
        self.csts = CSTS_RDY;
    }

    fn doorbell(&mut self, off: usize, v: u32) {
        if self.csts & CSTS_RDY == 0 {
            return;
        }
        let stride = 4usize << self.cfg.dstrd;
        if off % stride != 0 {
            return;
        }
        let index = off / stride;
        let qid = index / 2;
        if index % 2 == 0 {
            match self.sqs.get_mut(qid).and_then(Option::as_mut) {
                Some(sq) if v < sq.size as u32 => sq.tail = v as u16,
                _ => return, // QEMU ignores (and reports by AER) bad doorbells
            }
        } else {
            match self.cqs.get_mut(qid).and_then(Option::as_mut) {
                Some(cq) if v < cq.size as u32 => cq.head = v as u16,
                _ => return,
            }
        }
        self.run();
    }

    /// Executes commands until no SQ has one left that can complete.
    fn run(&mut self) {
        loop {
            let mut progressed = false;
            for qid in 0..self.sqs.len() {
                while let Some(sqe) = self.fetch(qid) {
                    progressed = true;
                    if self.drop_next > 0 {
                        self.drop_next -= 1;
                        self.stats.dropped += 1;
                        continue;
                    }
                    let result = if qid == 0 {
                        self.stats.admin_commands += 1;
                        self.admin(&sqe)
                    } else {
                        self.stats.io_commands += 1;
                        self.io(&sqe)
                    };
                    let (status, dw0) = match result {
                        Ok(dw0) => (Status::SUCCESS, dw0),
                        Err(status) => {
                            self.stats.errors += 1;
                            (status.with_dnr(), 0)
                        }
                    };
                    self.post(qid, sqe.cid, status, dw0);
                }
            }
            if !progressed {
                return;
            }
        }
    }

    /// The next SQE of `qid`, if there is one and its CQ has room.
    fn fetch(&mut self, qid: usize) -> Option<Sqe> {
        let sq = self.sqs[qid].as_ref()?;
        if sq.head == sq.tail {
            return None;
        }
        let cq = self.cqs[sq.cqid as usize].as_ref()?;
        if (cq.tail + 1) % cq.size == cq.head {
            return None; // CQ full: wait for the host's head doorbell
        }
        let addr = sq.base + sq.head as u64 * 64;
        let mut sqe = Sqe::default();
        self.dma_read(addr, bytemuck::bytes_of_mut(&mut sqe)).ok()?;
        let sq = self.sqs[qid].as_mut()?;
        sq.head = (sq.head + 1) % sq.size;
        Some(sqe)
    }

    fn post(&mut self, qid: usize, cid: u16, status: Status, dw0: u32) {
        let Some(sq) = self.sqs[qid].as_ref() else {
            return;
        };
        let sq_head = sq.head;
        let cqid = sq.cqid as usize;
        let Some(cq) = self.cqs[cqid].as_mut() else {
            return;
        };
        let cqe = Cqe {
            dw0,
            dw1: 0,
            sq_head,
            sq_id: qid as u16,
            cid,
            status: Cqe::status_field(status, cq.phase),
        };
        let addr = cq.base + cq.tail as u64 * 16;
        cq.tail = (cq.tail + 1) % cq.size;
        if cq.tail == 0 {
            cq.phase = !cq.phase;
        }
        // The first 14 bytes, then the status (phase tag) with a Release
        // store: a host polling the phase tag concurrently (doorbell page
        // mode) must never see the new phase before the rest of the entry.
        let bytes = bytemuck::bytes_of(&cqe);
        if self.arena.contains(addr, 16) && addr % 2 == 0 {
            let _ = self.dma_write(addr, &bytes[..14]);
            // SAFETY: the 16-byte entry lies in one live allocation of the
            // arena (checked above), so the u16 at +14 is in it, 2-aligned.
            let status = unsafe { &*((addr as usize + 14) as *const AtomicU16) };
            status.store(cqe.status, Ordering::Release);
        }
    }

    fn dma_read(&self, addr: u64, out: &mut [u8]) -> std::result::Result<(), Status> {
        if !self.arena.contains(addr, out.len() as u64) {
            return Err(Status::DATA_TRANSFER_ERROR);
        }
        // SAFETY: inside one live allocation of the arena (DMA address ==
        // host pointer), which this controller keeps alive.
        unsafe {
            std::ptr::copy_nonoverlapping(addr as usize as *const u8, out.as_mut_ptr(), out.len())
        };
        Ok(())
    }

    fn dma_write(&self, addr: u64, data: &[u8]) -> std::result::Result<(), Status> {
        if !self.arena.contains(addr, data.len() as u64) {
            return Err(Status::DATA_TRANSFER_ERROR);
        }
        // SAFETY: as in dma_read.
        unsafe {
            std::ptr::copy_nonoverlapping(data.as_ptr(), addr as usize as *mut u8, data.len())
        };
        Ok(())
    }

    fn read_u64(&self, addr: u64) -> std::result::Result<u64, Status> {
        let mut b = [0u8; 8];
        self.dma_read(addr, &mut b)?;
        Ok(u64::from_le_bytes(b))
    }

    /// Checks that the device may touch `len` bytes at `addr`.
    fn map(&self, sg: &mut Sg, addr: u64, len: u64) -> std::result::Result<(), Status> {
        if !self.arena.contains(addr, len) {
            return Err(Status::DATA_TRANSFER_ERROR);
        }
        sg.push((addr, len));
        Ok(())
    }

    // ------------------------------------------------------ data pointers --

    fn map_dptr(&self, sqe: &Sqe, len: u64) -> std::result::Result<Sg, Status> {
        match sqe.psdt() {
            Psdt::Prp => self.map_prp(sqe.dptr.prp1, sqe.dptr.prp2, len),
            Psdt::SglMptrContiguous | Psdt::SglMptrSgl => {
                if self.cfg.sgls & sgls::SUPPORT_MASK == 0 {
                    return Err(Status::INVALID_FIELD);
                }
                self.map_sgl(sqe.dptr.sgl1(), len)
            }
            Psdt::Reserved => Err(Status::INVALID_FIELD),
        }
    }

    /// QEMU's nvme_map_prp: PRP1 up to its page end, then PRP2 as the next
    /// page or as a PRP list whose last slot chains to the next list page
    /// while more than a page remains.
    fn map_prp(&self, prp1: u64, prp2: u64, mut len: u64) -> std::result::Result<Sg, Status> {
        let page = self.page;
        let mut sg = Sg::new();
        let first = (page - prp1 % page).min(len);
        self.map(&mut sg, prp1, first)?;
        len -= first;
        if len == 0 {
            return Ok(sg);
        }
        if len <= page {
            if prp2 % page != 0 {
                return Err(Status::PRP_OFFSET_INVALID);
            }
            self.map(&mut sg, prp2, len)?;
            return Ok(sg);
        }
        let mut list = prp2;
        let mut entries = (page - prp2 % page) / 8;
        let mut i = 0u64;
        while len > 0 {
            let mut entry = self.read_u64(list + i * 8)?;
            if i == entries - 1 && len > page {
                if entry % page != 0 {
                    return Err(Status::PRP_OFFSET_INVALID);
                }
                list = entry;
                entries = page / 8;
                i = 0;
                entry = self.read_u64(list)?;
            }
            if entry % page != 0 {
                return Err(Status::PRP_OFFSET_INVALID);
            }
            let n = len.min(page);
            self.map(&mut sg, entry, n)?;
            len -= n;
            i += 1;
        }
        Ok(sg)
    }

    /// QEMU's nvme_map_sgl: an inline Data Block, or segments each read
    /// whole; a segment ending in a Data Block ends the list, else its last
    /// descriptor (Segment or Last Segment) points at the next one.
    fn map_sgl(&self, sgl: SglDescriptor, len: u64) -> std::result::Result<Sg, Status> {
        let mut sg = Sg::new();
        let mut left = len;
        if sgl.sgl_type() == Some(SglType::DataBlock) {
            self.map_sgl_data(&[sgl], &mut left, &mut sg)?;
        } else {
            let mut cur = sgl;
            let mut segments = 0;
            loop {
                if !matches!(
                    cur.sgl_type(),
                    Some(SglType::Segment | SglType::LastSegment)
                ) {
                    return Err(Status::INVALID_SGL_SEGMENT_DESCRIPTOR);
                }
                let seg_len = cur.len as u64;
                if seg_len == 0 || seg_len % 16 != 0 {
                    return Err(Status::INVALID_SGL_SEGMENT_DESCRIPTOR);
                }
                if u64::MAX - cur.addr < seg_len {
                    return Err(Status::DATA_SGL_LENGTH_INVALID);
                }
                segments += 1;
                if segments > MAX_SGL_SEGMENTS {
                    return Err(Status::INVALID_SGL_SEGMENT_DESCRIPTOR);
                }
                let mut descs = vec![SglDescriptor::default(); (seg_len / 16) as usize];
                self.dma_read(cur.addr, bytemuck::cast_slice_mut(&mut descs))?;
                let last = *descs.last().expect("seg_len >= 16");
                if last.sgl_type() == Some(SglType::DataBlock) {
                    self.map_sgl_data(&descs, &mut left, &mut sg)?;
                    break;
                }
                if cur.sgl_type() == Some(SglType::LastSegment) {
                    return Err(Status::INVALID_SGL_SEGMENT_DESCRIPTOR);
                }
                self.map_sgl_data(&descs[..descs.len() - 1], &mut left, &mut sg)?;
                cur = last;
            }
        }
        if left != 0 {
            return Err(Status::DATA_SGL_LENGTH_INVALID);
        }
        Ok(sg)
    }

    /// QEMU's nvme_map_sgl_data: Data Blocks only; zero-length ones are
    /// skipped; past the transfer's end a non-empty one is an error unless
    /// SGLS allows longer SGLs.
    fn map_sgl_data(
        &self,
        descs: &[SglDescriptor],
        left: &mut u64,
        sg: &mut Sg,
    ) -> std::result::Result<(), Status> {
        for d in descs {
            match d.sgl_type() {
                Some(SglType::DataBlock) => {}
                Some(SglType::Segment | SglType::LastSegment) => {
                    return Err(Status::INVALID_NUMBER_OF_SGL_DESCRIPTORS)
                }
                _ => return Err(Status::SGL_DESCRIPTOR_TYPE_INVALID),
            }
            let dlen = d.len as u64;
            if dlen == 0 {
                continue;
            }
            if *left == 0 {
                if self.cfg.sgls & sgls::LONGER_THAN_DATA != 0 {
                    break;
                }
                return Err(Status::DATA_SGL_LENGTH_INVALID);
            }
            if u64::MAX - d.addr < dlen {
                return Err(Status::DATA_SGL_LENGTH_INVALID);
            }
            let n = (*left).min(dlen);
            self.map(sg, d.addr, n)?;
            *left -= n;
        }
        Ok(())
    }

    // ------------------------------------------------------------ commands --

    fn io(&mut self, sqe: &Sqe) -> std::result::Result<u32, Status> {
        if sqe.nsid != 1 && !(sqe.opcode == nvm_opc::FLUSH && sqe.nsid == u32::MAX) {
            return Err(Status::INVALID_NAMESPACE_OR_FORMAT);
        }
        let write = match sqe.opcode {
            nvm_opc::FLUSH => {
                self.stats.flushes += 1;
                return Ok(0);
            }
            nvm_opc::READ => false,
            nvm_opc::WRITE => true,
            _ => return Err(Status::INVALID_OPCODE),
        };
        let nlb = sqe.nlb() as u64;
        let bytes = nlb * SIM_LBA_BYTES;
        if self.cfg.mdts != 0 && bytes > self.page << self.cfg.mdts {
            return Err(Status::INVALID_FIELD);
        }
        let slba = sqe.slba();
        if slba.checked_add(nlb).is_none_or(|end| end > self.cfg.lbas) {
            return Err(Status::LBA_OUT_OF_RANGE);
        }
        let sg = self.map_dptr(sqe, bytes)?;
        let mut off = (slba * SIM_LBA_BYTES) as usize;
        for (addr, len) in sg {
            let len = len as usize;
            if write {
                let mut buf = vec![0u8; len];
                self.dma_read(addr, &mut buf)?;
                self.ns[off..off + len].copy_from_slice(&buf);
            } else {
                self.dma_write(addr, &self.ns[off..off + len])?;
            }
            off += len;
        }
        if write {
            self.stats.writes += 1;
        } else {
            self.stats.reads += 1;
        }
        self.stats.largest_transfer = self.stats.largest_transfer.max(bytes);
        Ok(0)
    }

    fn admin(&mut self, sqe: &Sqe) -> std::result::Result<u32, Status> {
        // SGLs are not used for admin commands on PCIe.
        if sqe.psdt() != Psdt::Prp {
            return Err(Status::INVALID_FIELD);
        }
        let qid = (sqe.cdw10 & 0xffff) as usize;
        let qsize = (sqe.cdw10 >> 16) as u16; // 0-based
        let max_qid = self.cfg.max_io_queues as usize;
        match sqe.opcode {
            admin_opc::IDENTIFY => {
                let data = match (sqe.cdw10 & 0xff) as u8 {
                    cns::CONTROLLER => self.identify_controller(),
                    cns::NAMESPACE if sqe.nsid == 1 => self.identify_namespace(),
                    cns::NAMESPACE => return Err(Status::INVALID_NAMESPACE_OR_FORMAT),
                    cns::ACTIVE_NAMESPACES => {
                        let mut d = vec![0u8; IDENTIFY_DATA_LEN];
                        if sqe.nsid < 1 {
                            d[..4].copy_from_slice(&1u32.to_le_bytes());
                        }
                        d
                    }
                    _ => return Err(Status::INVALID_FIELD),
                };
                let sg = self.map_prp(sqe.dptr.prp1, sqe.dptr.prp2, IDENTIFY_DATA_LEN as u64)?;
                let mut off = 0usize;
                for (addr, len) in sg {
                    self.dma_write(addr, &data[off..off + len as usize])?;
                    off += len as usize;
                }
                Ok(0)
            }
            admin_opc::SET_FEATURES if (sqe.cdw10 & 0xff) as u8 == feature::NUMBER_OF_QUEUES => {
                if sqe.cdw11 & 0xffff == 0xffff || sqe.cdw11 >> 16 == 0xffff {
                    return Err(Status::INVALID_FIELD);
                }
                // QEMU grants every queue it has, whatever was asked.
                let n = self.cfg.max_io_queues as u32 - 1;
                Ok(n << 16 | n)
            }
            admin_opc::SET_FEATURES => Err(Status::INVALID_FIELD),
            admin_opc::CREATE_IO_CQ => {
                if qid == 0 || qid > max_qid || self.cqs[qid].is_some() {
                    return Err(Status::INVALID_QUEUE_IDENTIFIER);
                }
                self.check_queue(sqe, qsize, 16)?;
                self.cqs[qid] = Some(Cq {
                    base: sqe.dptr.prp1,
                    size: qsize + 1,
                    tail: 0,
                    head: 0,
                    phase: true,
                });
                Ok(0)
            }
            admin_opc::CREATE_IO_SQ => {
                if qid == 0 || qid > max_qid || self.sqs[qid].is_some() {
                    return Err(Status::INVALID_QUEUE_IDENTIFIER);
                }
                let cqid = (sqe.cdw11 >> 16) as usize;
                if cqid == 0 || cqid > max_qid || self.cqs[cqid].is_none() {
                    return Err(Status::COMPLETION_QUEUE_INVALID);
                }
                self.check_queue(sqe, qsize, 64)?;
                self.sqs[qid] = Some(Sq {
                    base: sqe.dptr.prp1,
                    size: qsize + 1,
                    head: 0,
                    tail: 0,
                    cqid: cqid as u16,
                });
                Ok(0)
            }
            admin_opc::DELETE_IO_SQ => {
                if qid == 0 || qid > max_qid || self.sqs[qid].is_none() {
                    return Err(Status::INVALID_QUEUE_IDENTIFIER);
                }
                self.sqs[qid] = None;
                Ok(0)
            }
            admin_opc::DELETE_IO_CQ => {
                if qid == 0 || qid > max_qid || self.cqs[qid].is_none() {
                    return Err(Status::COMPLETION_QUEUE_INVALID);
                }
                if self.sqs.iter().flatten().any(|sq| sq.cqid as usize == qid) {
                    return Err(Status::INVALID_QUEUE_DELETION);
                }
                self.cqs[qid] = None;
                Ok(0)
            }
            _ => Err(Status::INVALID_OPCODE),
        }
    }

    /// QEMU's checks of a queue to create (size, PRP1 alignment, PC), plus
    /// the simulator's own: the ring must lie in memory it handed out.
    fn check_queue(&self, sqe: &Sqe, qsize: u16, entry: u64) -> std::result::Result<(), Status> {
        if qsize == 0 || qsize as u64 > self.cap & 0xffff {
            return Err(Status::INVALID_QUEUE_SIZE);
        }
        let base = sqe.dptr.prp1;
        if base == 0 || base % self.page != 0 {
            return Err(Status::PRP_OFFSET_INVALID);
        }
        if sqe.cdw11 & 1 == 0 {
            return Err(Status::INVALID_FIELD); // CAP.CQR: queues must be contiguous
        }
        if !self.arena.contains(base, (qsize as u64 + 1) * entry) {
            return Err(Status::INVALID_FIELD);
        }
        Ok(())
    }

    fn identify_controller(&self) -> Vec<u8> {
        let mut d = vec![0u8; IDENTIFY_DATA_LEN];
        let mut put = |off: usize, bytes: &[u8]| d[off..off + bytes.len()].copy_from_slice(bytes);
        let text = |s: &str, n: usize| format!("{s:<n$}").into_bytes();
        put(idctl::VID, &0x1b36u16.to_le_bytes()); // QEMU's vendor id
        put(idctl::SSVID, &0x1af4u16.to_le_bytes());
        put(idctl::SN, &text("KVTIERSIM0001", idctl::SN_LEN));
        put(
            idctl::MN,
            &text("kvtier simulated NVMe controller", idctl::MN_LEN),
        );
        put(idctl::FR, &text("1.0", idctl::FR_LEN));
        put(idctl::MDTS, &[self.cfg.mdts]);
        put(idctl::VER, &Vs::new(1, 4, 0).0.to_le_bytes());
        put(idctl::SQES, &[0x66]);
        put(idctl::CQES, &[0x44]);
        put(idctl::NN, &1u32.to_le_bytes());
        put(idctl::VWC, &[1]);
        put(idctl::SGLS, &self.cfg.sgls.to_le_bytes());
        d
    }

    fn identify_namespace(&self) -> Vec<u8> {
        let mut d = vec![0u8; IDENTIFY_DATA_LEN];
        for off in [idns::NSZE, idns::NCAP, idns::NUSE] {
            d[off..off + 8].copy_from_slice(&self.cfg.lbas.to_le_bytes());
        }
        d[idns::NLBAF] = 0; // one format
        d[idns::FLBAS] = 0;
        let lbaf0: u32 = 9 << 16; // 512-byte LBAs, no metadata
        d[idns::LBAF..idns::LBAF + 4].copy_from_slice(&lbaf0.to_le_bytes());
        d
    }
}
