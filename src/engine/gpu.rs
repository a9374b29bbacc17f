//! The GPU engine: a resident CUDA I/O kernel (`kernels/gio_kernel.cu`) on
//! the I/O green context's SMs takes IOCB ids from a gio_uring SQ in
//! GPU-visible memory, turns every IOCTX into NVMe commands (SGL from the
//! P2P table, or PRP), rings the doorbells, polls the CQs and publishes the
//! IOCB ids to the gio CQ with a completion counter the compute stream can
//! wait on with `cuStreamWaitValue32` — no CPU on the per-command path.
//!
//! The host's work per IOCB is O(1): [`IoEngine::submit`] stores the id in
//! the GPU SQ and advances its tail; [`IoEngine::reap`] reads the GPU CQ and
//! hands each finished IOCB back to the tier's ring. A layer's restore is a
//! handful of IOCBs whatever its number of blocks.
//!
//! Who runs the kernel is a [`GioExecutor`]: [`CudaGioExecutor`] launches
//! it on a GPU; the tests run the same kernel code compiled for the host
//! (`kernels/host/gio_host.cpp`) against the simulated controller, so the
//! engine's host side — queue creation, the P2P table in device addresses,
//! the ring protocol, stop and teardown — is tested on machines without a
//! GPU.
//!
//! How the controller reaches memory (see [`crate::gpu::dma`]): this engine
//! implements the path that works on every IOMMU setup — queues, descriptor
//! pages and the KV memory are host memory mapped for the controller by the
//! namespace's DMA allocator (VFIO IOMMU mappings, or physical addresses
//! under uio) and into the GPU by the executor (`cuMemHostRegister`), the
//! doorbells are BAR0 registered as I/O memory. KV memory in HBM needs a
//! path that gives the controller bus addresses of GPU memory (dma-buf
//! through iommufd, or peermem), which this build does not have: such a
//! registration is refused with that reason.
//!
//! Each pool device is an [`NvmeNamespace`] (its controller brought up with
//! `ControllerOptions::extra_io_queues` >= the engine's queues per device);
//! the pool's metadata keeps using the namespace's host queue.

use super::mapped::{refuse_if_in_flight, MappedTable};
use super::{EngineStats, IoEngine};
use crate::error::{Error, Result};
use crate::gpu::abi::{
    GioDev, GioEngine, GioQueue, GioRing as KernelRing, GIO_BLOCK_THREADS, GIO_KERNEL_NAME,
    GIO_MODE_PERSISTENT,
};
use crate::host::dio::AlignedBuf;
use crate::memory::MemoryKind;
use crate::nvme::ctrl::{Bar0, DmaRegion};
use crate::nvme::spec::SglDescriptor;
use crate::nvme::spec::{cq_head_doorbell, reg, sq_tail_doorbell, Extent};
use crate::nvme::NvmeNamespace;
use crate::p2p::{MemRegion, P2pTable};
use crate::pool::Storage;
use crate::ring::abi::*;
use crate::ring::{GioRing, IocbId};
use std::any::Any;
use std::mem::{offset_of, size_of};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Runs the I/O kernel and makes host memory visible to it.
pub trait GioExecutor: Send {
    /// Names the executor in messages (`cuda`, `host`).
    fn name(&self) -> &'static str;

    /// The address the kernel uses for host memory `ptr..ptr + len`
    /// (`mmio`: an MMIO mapping of a PCI BAR, the doorbells). The memory
    /// stays visible while the returned guard lives.
    ///
    /// # Safety
    /// The range must stay mapped until the guard is dropped, and the
    /// kernel must not touch it after that.
    unsafe fn map_host(
        &mut self,
        ptr: *mut u8,
        len: usize,
        mmio: bool,
    ) -> Result<(u64, Box<dyn Any + Send>)>;

    /// A read-only copy of `bytes` in the memory the kernel reads fastest,
    /// for tables built once and read on every command (the P2P table):
    /// GPU memory for a GPU (an L2 hit or an HBM read instead of a PCIe
    /// round trip per descriptor), a host copy for the host executor. The
    /// copy lives while the returned guard does.
    fn upload(&mut self, bytes: &[u8]) -> Result<(u64, Box<dyn Any + Send>)>;

    /// Starts the persistent I/O kernel (`kvtier_gio_kernel`, mode
    /// persistent) with `blocks` blocks over the engine descriptor at kernel
    /// address `engine`.
    ///
    /// # Safety
    /// Everything the descriptor names must stay valid, and its host-owned
    /// fields unchanged, until [`GioExecutor::join`] returned `Ok`.
    unsafe fn launch(&mut self, engine: u64, blocks: u32) -> Result<()>;

    /// Waits, at most `timeout`, for the kernel to exit (after the engine
    /// set the ring's `stop`). An error means it may still be running.
    fn join(&mut self, timeout: Duration) -> Result<()>;
}

/// Settings of the GPU engine: [`GpuEngineConfig::default`] and the `with_*` setters.
#[non_exhaustive]
#[derive(Clone, Debug)]
pub struct GpuEngineConfig {
    /// NVMe queue pairs the kernel drives per device (one thread block each).
    pub queues_per_device: u16,
    /// Entries per queue.
    pub queue_depth: u16,
    /// SGL when the controller supports it (else PRP); false forces PRP.
    pub prefer_sgl: bool,
    /// The kernel's poll budget per batch of commands: commands not
    /// completed by then fail with `IOCTX_STATUS_TIMEOUT`.
    pub batch_timeout: Duration,
    /// How long the I/O kernel stays resident with nothing in flight before
    /// the engine stops it (checked whenever the engine is reaped); `None`
    /// keeps it resident for the engine's life. Why not resident for good:
    /// measured on an H100 (driver 580), while any kernel is resident,
    /// cuMemFree, cuMemFreeHost and loading a module wait for it to exit, in
    /// every context of the device, with lazy or eager module loading; a
    /// serving engine in the same process (torch freeing cached memory, a
    /// JIT compiling a kernel) would hang behind an idle I/O kernel. Stopped
    /// when idle, it holds such calls only while I/O is in flight. A launch
    /// costs microseconds.
    pub idle_exit: Option<Duration>,
}

with_setters!(GpuEngineConfig {
    /// With `queues_per_device` queue pairs per device.
    with_queues_per_device => queues_per_device: u16,
    /// With `queue_depth` entries per queue.
    with_queue_depth => queue_depth: u16,
    /// Preferring SGL (or forcing PRP).
    with_prefer_sgl => prefer_sgl: bool,
    /// With this poll budget per batch of commands.
    with_batch_timeout => batch_timeout: Duration,
    /// Stopping the resident kernel after this idle time (`None`: never).
    with_idle_exit => idle_exit: Option<Duration>,
});

impl Default for GpuEngineConfig {
    fn default() -> Self {
        GpuEngineConfig {
            queues_per_device: 1,
            queue_depth: 256,
            prefer_sgl: true,
            batch_timeout: Duration::from_secs(2),
            idle_exit: Some(Duration::ZERO),
        }
    }
}

/// Offsets of the kernel's state inside one host allocation.
struct StateLayout {
    engine: usize,
    ring: usize,
    queues: usize,
    devs: usize,
    sq_ids: usize,
    cq_ids: usize,
    passes: usize,
    bytes: usize,
}

impl StateLayout {
    fn new(queues: usize, devs: usize, entries: usize) -> StateLayout {
        let mut at = 0usize;
        let mut take = |n: usize| {
            let off = at;
            at = (at + n).next_multiple_of(64);
            off
        };
        let engine = take(size_of::<GioEngine>());
        let ring = take(size_of::<KernelRing>());
        let queues = take(queues * size_of::<GioQueue>());
        let devs = take(devs * size_of::<GioDev>());
        let sq_ids = take(entries * 4);
        let cq_ids = take(entries * 4);
        let passes = take(entries * 4);
        StateLayout {
            engine,
            ring,
            queues,
            devs,
            sq_ids,
            cq_ids,
            passes,
            bytes: at.next_multiple_of(4096),
        }
    }
}

/// One kernel-driven queue pair and its memory.
struct KernelQueue {
    dev: usize,
    qid: u16,
    _sq: DmaRegion,
    _cq: DmaRegion,
    _desc: DmaRegion,
}

/// The GPU-driven NVMe engine (module docs).
pub struct GpuEngine<B: Bar0> {
    cfg: GpuEngineConfig,
    exec: Box<dyn GioExecutor>,
    namespaces: Vec<NvmeNamespace<B>>,
    queues: Vec<KernelQueue>,
    /// What the kernel's queue and device descriptors start as.
    queue_descs: Vec<GioQueue>,
    dev_descs: Vec<GioDev>,
    /// The kernel's state: engine descriptor, ring, queues, devs, id rings.
    state: AlignedBuf,
    layout: StateLayout,
    /// Kernel address of `state`.
    state_k: u64,
    /// The P2P table in DMA addresses, its kernel address and entries.
    p2p: Option<AlignedBuf>,
    p2p_kernel_addr: u64,
    p2p_entries: u64,
    table: Option<Arc<P2pTable>>,
    /// Host memory mapped for each controller, kept while the table is.
    mapped: Vec<MappedTable>,
    /// Executor guards: state, queues, doorbells, arena, P2P table.
    guards: Vec<Box<dyn Any + Send>>,
    p2p_guard: Option<Box<dyn Any + Send>>,
    arena_mapped: Option<(usize, usize)>,
    running: bool,
    launches: u32,
    /// Kernel-side command timeouts already acted on.
    timeouts_seen: u64,
    entries: u32,
    sq_tail: u32,
    cq_head: u32,
    /// IOCTX count of each IOCB in flight, by id.
    inflight: Vec<u32>,
    in_flight: usize,
    last_progress: Instant,
    stats: EngineStats,
    failed: Option<String>,
}

// SAFETY: the !Send parts are the DMA regions of the kernel's queues, which
// only this engine holds (the kernel and the controller reach the memory by
// address, never through the regions), and the raw state buffers it owns.
unsafe impl<B: Bar0 + Send> Send for GpuEngine<B> {}

fn gpu_error(reason: impl Into<String>) -> Error {
    Error::gpu("GPU engine", reason)
}

impl<B: Bar0 + Send + Sync + 'static> GpuEngine<B> {
    /// Creates the kernel's queue pairs on every namespace's controller and
    /// the state the kernel reads; the kernel starts at the first submit
    /// after memory is registered.
    pub fn new(
        namespaces: Vec<NvmeNamespace<B>>,
        mut exec: Box<dyn GioExecutor>,
        cfg: GpuEngineConfig,
    ) -> Result<Self> {
        if namespaces.is_empty() {
            return Err(Error::invalid(
                "the GPU engine needs at least one namespace",
            ));
        }
        if cfg.queues_per_device == 0 || cfg.queue_depth < 2 {
            return Err(Error::invalid(
                "the GPU engine needs at least one queue per device of at least 2 entries",
            ));
        }
        let nq = namespaces.len() * cfg.queues_per_device as usize;
        let mut queue_descs = Vec::with_capacity(nq);
        let mut queues: Vec<KernelQueue> = Vec::with_capacity(nq);
        let mut guards: Vec<Box<dyn Any + Send>> = Vec::new();
        let mut devs = Vec::with_capacity(namespaces.len());
        for (d, ns) in namespaces.iter().enumerate() {
            devs.push(GioDev {
                first_queue: (d * cfg.queues_per_device as usize) as u16,
                queue_count: cfg.queues_per_device,
                reserved: 0,
            });
            let made = ns.with_controller(|ctrl, dma| -> Result<()> {
                let bells = ctrl.bar().doorbells().ok_or_else(|| {
                    gpu_error(format!(
                        "the doorbells of NVMe controller {} are not memory a GPU can store into; use VFIO (BAR0 mapped) or the simulator's doorbell page",
                        ctrl.name()
                    ))
                })?;
                // SAFETY: BAR0 (or the doorbell page) stays mapped while the
                // controller (held by the namespace, which this engine
                // holds) lives; the guard is dropped in `Drop` after the
                // kernel stopped.
                let (bells_k, g) = unsafe { exec.map_host(bells.ptr, bells.len, bells.mmio)? };
                guards.push(g);
                let dstrd = ctrl.cap().dstrd();
                let page = ctrl.page_bytes() as usize;
                let depth = cfg
                    .queue_depth
                    .min(ctrl.cap().max_queue_entries().min(4096) as u16);
                for _ in 0..cfg.queues_per_device {
                    let sq = dma.alloc(depth as usize * 64, page)?;
                    let cq = dma.alloc(depth as usize * 16, page)?;
                    // Two pages per command: 512 SGL data blocks, or a PRP
                    // list of 1024 slots (chained at the page boundary).
                    let desc_bytes = 2 * page;
                    let use_sgl = cfg.prefer_sgl && ctrl.sgl_supported();
                    let mut max_transfer = ctrl.max_transfer_bytes();
                    if !use_sgl {
                        // Entries the list holds, less the chain slot and
                        // one page of slack for an unaligned start.
                        max_transfer = max_transfer.min((desc_bytes as u64 / 8 - 2) * page as u64);
                    }
                    let desc = dma.alloc(depth as usize * desc_bytes, page)?;
                    let qid = ctrl.create_external_queue(depth, &sq, &cq)?;
                    let mut map = |r: &DmaRegion| -> Result<u64> {
                        // SAFETY: the region's memory lives as long as the
                        // KernelQueue holding it, dropped after the kernel
                        // stopped (Drop).
                        let (k, g) = unsafe { exec.map_host(r.ptr(), r.len(), false)? };
                        guards.push(g);
                        Ok(k)
                    };
                    let (sq_k, cq_k, desc_k) = (map(&sq)?, map(&cq)?, map(&desc)?);
                    let bell = |off: usize| bells_k + (off - reg::DOORBELL_BASE) as u64;
                    queue_descs.push(GioQueue {
                        sq: sq_k,
                        cq: cq_k,
                        sq_doorbell: bell(sq_tail_doorbell(qid, dstrd)),
                        cq_doorbell: bell(cq_head_doorbell(qid, dstrd)),
                        desc: desc_k,
                        desc_dma: desc.dma(),
                        timeout_ns: cfg.batch_timeout.as_nanos() as u64,
                        desc_bytes: desc_bytes as u32,
                        nsid: ctrl.nsid(),
                        max_transfer: max_transfer.min(u32::MAX as u64) as u32,
                        page_bytes: page as u32,
                        qid,
                        depth,
                        lba_shift: ctrl.lba_bytes().trailing_zeros() as u8,
                        use_sgl: use_sgl as u8,
                        phase: 1,
                        ..Default::default()
                    });
                    queues.push(KernelQueue {
                        dev: d,
                        qid,
                        _sq: sq,
                        _cq: cq,
                        _desc: desc,
                    });
                }
                Ok(())
            });
            if let Err(e) = made {
                Self::delete_queues(&namespaces, &queues);
                return Err(e);
            }
        }
        let layout = StateLayout::new(nq, devs.len(), 1);
        let mut engine = GpuEngine {
            cfg,
            exec,
            namespaces,
            queues,
            queue_descs,
            dev_descs: devs,
            state: AlignedBuf::zeroed(4096), // replaced by build_state below
            layout,
            state_k: 0,
            p2p: None,
            p2p_kernel_addr: 0,
            p2p_entries: 0,
            table: None,
            mapped: Vec::new(),
            guards,
            p2p_guard: None,
            arena_mapped: None,
            running: false,
            launches: 0,
            timeouts_seen: 0,
            entries: 0,
            sq_tail: 0,
            cq_head: 0,
            inflight: Vec::new(),
            in_flight: 0,
            last_progress: Instant::now(),
            stats: EngineStats::default(),
            failed: None,
        };
        // A state with one-entry id rings until the tier's ring is known
        // (stats and teardown read it before any submit).
        engine.build_state(1);
        Ok(engine)
    }

    fn delete_queues(namespaces: &[NvmeNamespace<B>], queues: &[KernelQueue]) {
        for q in queues {
            namespaces[q.dev].with_controller(|ctrl, _| {
                let _ = ctrl.delete_external_queue(q.qid);
            });
        }
    }
}

impl<B: Bar0> GpuEngine<B> {
    fn at<T>(&self, off: usize) -> *mut T {
        debug_assert!(off + size_of::<T>() <= self.state.len());
        // SAFETY: inside the state buffer (layout offsets).
        unsafe { self.state.as_ptr().add(off) as *mut T }
    }

    fn ring_field(&self, off: usize) -> &AtomicU32 {
        // SAFETY: a 4-aligned u32 of the ring inside the state buffer, which
        // lives as long as self; the kernel accesses it concurrently only
        // with atomics and volatile accesses.
        unsafe { &*self.at::<AtomicU32>(self.layout.ring + off) }
    }

    /// A fresh state buffer for id rings of `entries` slots, holding the
    /// queue and device descriptors (host-owned fields).
    fn build_state(&mut self, entries: usize) {
        self.layout = StateLayout::new(self.queue_descs.len(), self.dev_descs.len(), entries);
        self.state = AlignedBuf::zeroed(self.layout.bytes);
        let (qo, d) = (self.layout.queues, self.layout.devs);
        let s = self.state.as_mut_slice();
        let qb = bytemuck::cast_slice::<GioQueue, u8>(&self.queue_descs);
        s[qo..qo + qb.len()].copy_from_slice(qb);
        let db = bytemuck::cast_slice::<GioDev, u8>(&self.dev_descs);
        s[d..d + db.len()].copy_from_slice(db);
    }

    /// Sizes the id rings for the tier's ring and maps the state and the
    /// IOCB arena for the kernel (once; a ring of another depth is refused).
    fn prepare(&mut self, ring: &mut GioRing) -> Result<()> {
        let entries = ring.depth();
        let arena = (
            ring.arena_ptr() as usize,
            entries as usize * size_of::<Iocb>(),
        );
        if let Some(m) = self.arena_mapped {
            if m != arena {
                return Err(gpu_error(
                    "the GPU engine serves one gio_uring; it was given another",
                ));
            }
            return Ok(());
        }
        self.build_state(entries as usize);
        let (qn, dn) = (self.queue_descs.len(), self.dev_descs.len());
        // SAFETY: the state buffer lives until Drop, which stops the kernel
        // before dropping the guard; the arena belongs to the tier's ring,
        // which outlives its engine (the Submitter drops the engine first).
        let (state_k, g) = unsafe {
            self.exec
                .map_host(self.state.as_mut_ptr(), self.state.len(), false)?
        };
        self.guards.push(g);
        let (arena_k, g) = unsafe { self.exec.map_host(arena.0 as *mut u8, arena.1, false)? };
        self.guards.push(g);
        self.state_k = state_k;
        self.entries = entries;
        self.inflight = vec![0; entries as usize];
        let l = &self.layout;
        let kring = KernelRing {
            iocbs: arena_k,
            sq: state_k + l.sq_ids as u64,
            cq: state_k + l.cq_ids as u64,
            passes: state_k + l.passes as u64,
            entries,
            iocb_count: entries,
            ..Default::default()
        };
        let keng = GioEngine {
            queues: state_k + l.queues as u64,
            devs: state_k + l.devs as u64,
            p2p: 0,
            ring: state_k + l.ring as u64,
            p2p_count: 0,
            queue_count: qn as u32,
            dev_count: dn as u32,
        };
        let (ro, eo) = (l.ring, l.engine);
        let s = self.state.as_mut_slice();
        s[ro..ro + size_of::<KernelRing>()].copy_from_slice(bytemuck::bytes_of(&kring));
        s[eo..eo + size_of::<GioEngine>()].copy_from_slice(bytemuck::bytes_of(&keng));
        self.arena_mapped = Some(arena);
        Ok(())
    }

    /// Points the kernel's engine descriptor at the current P2P table; only
    /// while the kernel is not running (it reads the descriptor freely).
    fn write_p2p(&mut self) {
        if self.state_k == 0 || self.running {
            return;
        }
        let (addr, count) = match &self.p2p {
            Some(_) => (self.p2p_kernel_addr, self.p2p_entries),
            None => (0, 0),
        };
        let eo = self.layout.engine;
        // SAFETY: two u64 fields of the engine descriptor inside the state
        // buffer; no kernel runs, so nothing else accesses them.
        unsafe {
            self.at::<u64>(eo + offset_of!(GioEngine, p2p))
                .write_volatile(addr);
            self.at::<u64>(eo + offset_of!(GioEngine, p2p_count))
                .write_volatile(count);
        }
    }

    /// Stops the kernel (ring.stop, then join). If it does not stop, the
    /// controllers are reset so nothing more lands, the engine fails, and
    /// its memory is leaked at drop rather than freed under the kernel.
    fn stop_kernel(&mut self) -> Result<()> {
        if !self.running {
            return Ok(());
        }
        self.ring_field(offset_of!(KernelRing, stop))
            .store(1, Ordering::Release);
        let timeout = self.cfg.batch_timeout * 2 + Duration::from_secs(2);
        match self.exec.join(timeout) {
            Ok(()) => {
                self.running = false;
                self.ring_field(offset_of!(KernelRing, stop))
                    .store(0, Ordering::Release);
                Ok(())
            }
            Err(e) => {
                // `running` stays true and `stop` stays set: Drop takes the
                // leak path.
                let why =
                    format!("the GPU I/O kernel did not stop ({e}); the controllers were reset");
                self.fail_controllers(&why);
                Err(gpu_error(why))
            }
        }
    }

    /// Stops every controller (CC.EN=0) so no command of this engine can
    /// land in memory any more, and fails the engine.
    fn fail_controllers(&mut self, why: &str) {
        for ns in &self.namespaces {
            ns.fail(why.to_string());
        }
        self.failed.get_or_insert_with(|| why.to_string());
    }

    /// Launches the kernel if it is not running; its blocks start reading
    /// the gio SQ at `from` (the tail before the IOCBs just published).
    fn start_kernel(&mut self, from: u32) -> Result<()> {
        if self.running {
            return Ok(());
        }
        if let Some(why) = &self.failed {
            return Err(gpu_error(why.clone()));
        }
        self.write_p2p();
        let tail = from;
        for q in 0..self.queues.len() {
            let off =
                self.layout.queues + q * size_of::<GioQueue>() + offset_of!(GioQueue, ring_cursor);
            // SAFETY: inside the state buffer; the kernel is not running.
            unsafe { self.at::<u32>(off).write_volatile(tail) };
        }
        // SAFETY: the descriptor and everything it names live until Drop or
        // the next stop_kernel, both of which join the kernel first.
        unsafe {
            self.exec.launch(
                self.state_k + self.layout.engine as u64,
                self.queues.len() as u32,
            )?
        };
        self.running = true;
        self.launches += 1;
        Ok(())
    }

    /// Moves finished IOCBs from the kernel's CQ to the tier's ring.
    fn drain(&mut self, ring: &mut GioRing) -> usize {
        let start = Instant::now();
        let tail = self
            .ring_field(offset_of!(KernelRing, cq_tail))
            .load(Ordering::Acquire);
        if self.cq_head != tail {
            // A command the kernel timed out may still be executing on the
            // controller: stop the controllers before the tier gets its
            // IOCB back and reuses the memory (the kernel counts timeouts
            // before it publishes the IOCB).
            let timeouts = self.queue_timeouts();
            if timeouts > self.timeouts_seen {
                self.timeouts_seen = timeouts;
                self.fail_controllers(&format!(
                    "{timeouts} NVMe command(s) got no completion within the kernel's batch timeout ({:?}); the controllers were stopped (CC.EN=0) so they cannot land later: reopen the pool to go on",
                    self.cfg.batch_timeout
                ));
            }
        }
        let mut n = 0;
        while self.cq_head != tail {
            let slot = (self.cq_head & (self.entries - 1)) as usize;
            // SAFETY: a u32 of the CQ id ring inside the state buffer,
            // published by the kernel before cq_tail (Acquire above).
            let id: IocbId = unsafe {
                self.at::<u32>(self.layout.cq_ids + slot * 4)
                    .read_volatile()
            };
            self.cq_head = self.cq_head.wrapping_add(1);
            let count = match self.inflight.get_mut(id as usize) {
                Some(c) if *c > 0 => std::mem::take(c),
                // Failed by the host already (a stall), or not ours.
                _ => continue,
            };
            self.in_flight -= count as usize;
            let iocb = ring.iocb(id);
            for c in &iocb.ctx[..iocb.hdr.count as usize] {
                if c.status != IOCTX_STATUS_OK {
                    self.stats.errors += 1;
                    continue;
                }
                match c.op {
                    IOCTX_OP_READ => self.stats.bytes_read += c.result as u64,
                    IOCTX_OP_WRITE => self.stats.bytes_written += c.result as u64,
                    _ => self.stats.flushes += 1,
                }
            }
            ring.finish(id);
            n += 1;
        }
        if n > 0 {
            self.ring_field(offset_of!(KernelRing, cq_head))
                .store(self.cq_head, Ordering::Release);
            self.last_progress = Instant::now();
            // Host work per IOCB, not per command: the kernel builds those.
            self.stats.cpu_ns += start.elapsed().as_nanos() as u64;
        }
        n
    }

    /// Commands the kernel timed out, over all queues.
    fn queue_timeouts(&self) -> u64 {
        (0..self.queues.len())
            .map(|q| {
                let off =
                    self.layout.queues + q * size_of::<GioQueue>() + offset_of!(GioQueue, timeouts);
                // SAFETY: inside the state buffer; written by the kernel
                // before the IOCB it affects is published (cq_tail, read
                // with Acquire first).
                unsafe { self.at::<u32>(off).read_volatile() as u64 }
            })
            .sum()
    }

    /// Sums a kernel-owned u64 counter over the queues.
    fn queue_counter(&self, field: usize) -> u64 {
        (0..self.queues.len())
            .map(|q| {
                let off = self.layout.queues + q * size_of::<GioQueue>() + field;
                // SAFETY: inside the state buffer; the kernel writes it with
                // plain stores, a torn read only skews a statistic.
                unsafe { self.at::<u64>(off).read_volatile() }
            })
            .sum()
    }
}

impl<B: Bar0 + Send> GpuEngine<B> {
    /// Whether the I/O kernel is resident now (see
    /// [`GpuEngineConfig::idle_exit`]).
    pub fn kernel_resident(&self) -> bool {
        self.running
    }

    /// Maps the table for every controller and builds the kernel's P2P
    /// table of device addresses; all or nothing. The kernel has one table
    /// for every queue, so every controller must see the memory at the same
    /// addresses (uio: physical; one VFIO container), else it is refused.
    fn map_table(&mut self, table: &P2pTable) -> Result<()> {
        let mut mapped = Vec::with_capacity(self.namespaces.len());
        for ns in &self.namespaces {
            mapped.push(MappedTable::build(table, |r| {
                ns.with_controller(|_, dma| {
                    // SAFETY: registered memory stays alive and in place
                    // while an engine holds its table (Tier::register_memory's
                    // contract).
                    unsafe { dma.map_host(r.addr as *mut u8, r.len as usize) }
                })
            })?);
        }
        let mut descs: Vec<SglDescriptor> = Vec::with_capacity(table.entries().len());
        let mut ext: Vec<Extent> = Vec::with_capacity(2);
        let mut other: Vec<Extent> = Vec::with_capacity(2);
        for (i, e) in table.entries().iter().enumerate() {
            ext.clear();
            if !mapped[0].translate(e.addr, e.len as u64, &mut ext) {
                return Err(Error::Registration(format!(
                    "P2P entry {i} ({:#x}, {} bytes) lies outside the memory mapped for the controllers",
                    e.addr, e.len
                )));
            }
            if ext.len() != 1 {
                return Err(Error::Registration(format!(
                    "P2P entry {i} ({:#x}, {} bytes) is not contiguous in the controllers' address space ({} pieces): the GPU engine takes one descriptor per object; back the KV memory with hugepages, or use VFIO",
                    e.addr,
                    e.len,
                    ext.len()
                )));
            }
            for (d, m) in mapped.iter().enumerate().skip(1) {
                other.clear();
                if !m.translate(e.addr, e.len as u64, &mut other) || other != ext {
                    return Err(Error::Registration(format!(
                        "{} and {} reach registered memory at different addresses (P2P entry {i}: {:x?} vs {:x?}); the GPU kernel shares one P2P table across controllers: put them in one VFIO container, or serve them with separate engines",
                        self.namespaces[0].path().display(),
                        self.namespaces[d].path().display(),
                        ext,
                        other
                    )));
                }
            }
            descs.push(SglDescriptor::data_block(ext[0].addr, e.len));
        }
        let mut buf = AlignedBuf::zeroed((descs.len() * 16).max(4096).next_multiple_of(4096));
        buf.as_mut_slice()[..descs.len() * 16].copy_from_slice(bytemuck::cast_slice(&descs));
        // The kernel's copy: measured on an H100, a table in GPU memory made
        // 16-segment commands 1.4x faster than one read over PCIe. Replaced
        // only after the kernel stopped; Drop stops the kernel first.
        let (k, g) = self.exec.upload(buf.as_slice())?;
        self.p2p_guard = Some(g);
        self.p2p_kernel_addr = k;
        self.p2p_entries = descs.len() as u64;
        self.p2p = Some(buf);
        self.mapped = mapped;
        Ok(())
    }
}

impl<B: Bar0 + Send> GpuEngine<B> {
    /// Fails every IOCB still in flight after the kernel was stopped for
    /// making no progress.
    fn fail_in_flight(&mut self, ring: &mut GioRing) {
        for id in 0..self.inflight.len() {
            let count = std::mem::take(&mut self.inflight[id]);
            if count == 0 {
                continue;
            }
            let iocb = ring.iocb_mut(id as IocbId);
            for c in &mut iocb.ctx[..count as usize] {
                c.status = IOCTX_STATUS_TIMEOUT;
                c.result = 0;
            }
            iocb.hdr.done = count;
            iocb.hdr.errors = count;
            self.stats.errors += count as u64;
            ring.finish(id as IocbId);
        }
        self.in_flight = 0;
    }

    /// The kernel fails commands itself after its batch timeout; an IOCB
    /// that still does not come back means the kernel is gone or stuck.
    fn check_stall(&mut self, ring: &mut GioRing) -> Result<()> {
        let limit = self.cfg.batch_timeout * 2 + Duration::from_secs(2);
        if self.in_flight == 0 || self.last_progress.elapsed() < limit {
            return Ok(());
        }
        let completed = self
            .ring_field(offset_of!(KernelRing, completed))
            .load(Ordering::Acquire);
        let why = format!(
            "no IOCB completed for {limit:?} ({} IOCTXs in flight, {} IOCBs submitted, {completed} completed by the kernel); the controllers were stopped",
            self.in_flight, self.sq_tail
        );
        self.fail_controllers(&why);
        if self.stop_kernel().is_ok() {
            // What the kernel published before it stopped goes back as it
            // finished; the rest fails.
            self.drain(ring);
            self.fail_in_flight(ring);
        }
        // If the kernel did not stop, its IOCBs stay in flight: the kernel
        // may still write them, so they are never handed back.
        Err(gpu_error(why))
    }
}

impl<B: Bar0 + Send> IoEngine for GpuEngine<B> {
    fn name(&self) -> &'static str {
        "gpu"
    }

    fn reaches(&self, kind: MemoryKind) -> bool {
        // The controller DMAs into host-pinned memory the GPU also maps; HBM
        // as its target needs dma-buf through iommufd or peermem, which this
        // build does not have (the register_memory check below says so too).
        kind == MemoryKind::Host
    }

    fn register_memory(&mut self, table: Arc<P2pTable>) -> Result<()> {
        refuse_if_in_flight(self.in_flight)?;
        if table.kind() != MemoryKind::Host {
            return Err(Error::Registration(
                "KV memory in GPU HBM as a direct DMA target needs a way for the NVMe controller to reach it (dma-buf through iommufd, or peermem), which this build does not have; serve it through the staged path instead (TierBuilder::memory with MemoryKind::Gpu does that, or staged::StagedTier: reads land in pinned host staging, one kernel per layer copies them into HBM), see `kvtier doctor`".into(),
            ));
        }
        // The kernel reads the table while it runs: swap it while stopped.
        self.stop_kernel()?;
        self.p2p_guard = None;
        self.p2p = None;
        self.map_table(&table)?;
        self.write_p2p();
        self.table = Some(table);
        Ok(())
    }

    fn submit(&mut self, ring: &mut GioRing) -> Result<()> {
        if let Some(why) = &self.failed {
            return Err(gpu_error(why.clone()));
        }
        if self.table.is_none() {
            return Err(Error::invalid(
                "the GPU engine has no registered memory: register the KV memory first",
            ));
        }
        self.prepare(ring)?;
        let start = Instant::now();
        let mask = self.entries - 1;
        let from = self.sq_tail;
        let mut pushed = false;
        while let Some(id) = ring.pop_sq() {
            self.stats.iocbs += 1;
            let count = ring.iocb(id).hdr.count;
            if count == 0 {
                ring.finish(id);
                continue;
            }
            if self.in_flight == 0 {
                self.last_progress = Instant::now();
            }
            self.stats.ios += count as u64;
            self.in_flight += count as usize;
            self.inflight[id as usize] = count;
            let slot = (self.sq_tail & mask) as usize;
            // SAFETY: a u32 of the SQ id ring inside the state buffer; the
            // kernel reads it only after the tail store below (Release).
            unsafe {
                self.at::<u32>(self.layout.sq_ids + slot * 4)
                    .write_volatile(id)
            };
            self.sq_tail = self.sq_tail.wrapping_add(1);
            pushed = true;
        }
        if pushed {
            self.ring_field(offset_of!(KernelRing, sq_tail))
                .store(self.sq_tail, Ordering::Release);
            self.stats.cpu_ns += start.elapsed().as_nanos() as u64;
            self.start_kernel(from)?;
        }
        Ok(())
    }

    fn reap(&mut self, ring: &mut GioRing, wait: bool) -> Result<()> {
        loop {
            let n = self.drain(ring);
            if n > 0 || !wait || self.in_flight == 0 {
                self.check_stall(ring)?;
                if self.in_flight == 0
                    && self.running
                    && self
                        .cfg
                        .idle_exit
                        .is_some_and(|d| self.last_progress.elapsed() >= d)
                {
                    self.stop_kernel()?;
                }
                return Ok(());
            }
            self.check_stall(ring)?;
            std::hint::spin_loop();
        }
    }

    /// Its mappings name the pages pinned at registration: map the whole
    /// table again, once nothing is in flight.
    fn remap_memory(&mut self, _ranges: &[MemRegion]) -> Result<bool> {
        let table = self.table.clone();
        super::mapped::remap_when_idle(self, table)
    }

    fn in_flight(&self) -> usize {
        self.in_flight
    }

    fn stats(&self) -> EngineStats {
        let mut s = self.stats;
        s.commands = self.queue_counter(offset_of!(GioQueue, commands));
        s.doorbells = self.queue_counter(offset_of!(GioQueue, doorbells));
        s
    }

    fn describe(&self) -> String {
        format!(
            "gpu ({} executor): {} namespace(s), {} kernel queue pair(s) of depth {}, {}, {} kernel launch(es)",
            self.exec.name(),
            self.namespaces.len(),
            self.queues.len(),
            self.cfg.queue_depth,
            if self.cfg.prefer_sgl {
                "SGL where supported"
            } else {
                "PRP"
            },
            self.launches
        )
    }
}

impl<B: Bar0> Drop for GpuEngine<B> {
    fn drop(&mut self) {
        if self.running {
            self.ring_field(offset_of!(KernelRing, stop))
                .store(1, Ordering::Release);
            let timeout = self.cfg.batch_timeout * 2 + Duration::from_secs(2);
            if self.exec.join(timeout).is_ok() {
                self.running = false;
            }
        }
        if self.running {
            // The kernel may still read or write this memory: stop the
            // controllers and leak it rather than free it under the GPU.
            self.fail_controllers("the GPU I/O kernel did not stop when its engine was dropped");
            std::mem::forget(std::mem::replace(&mut self.state, AlignedBuf::zeroed(4096)));
            std::mem::forget(self.p2p.take());
            std::mem::forget(std::mem::take(&mut self.queues));
            std::mem::forget(std::mem::take(&mut self.guards));
            std::mem::forget(self.p2p_guard.take());
            std::mem::forget(std::mem::take(&mut self.mapped));
            return;
        }
        for q in &self.queues {
            self.namespaces[q.dev].with_controller(|ctrl, _| {
                let _ = ctrl.delete_external_queue(q.qid);
            });
        }
    }
}

/// Runs the I/O kernel on a GPU: the module loaded in the I/O green
/// context (or any context), one stream, host memory registered with
/// `cuMemHostRegister` (BAR0 as I/O memory).
pub struct CudaGioExecutor {
    ctx: crate::gpu::Context,
    _module: crate::gpu::Module,
    func: crate::gpu::Function,
    stream: crate::gpu::Stream,
}

// SAFETY: CUDA driver objects may be used from any thread once their
// context is bound, which every call through these types does first; the
// executor is used by one thread at a time (&mut self).
unsafe impl Send for CudaGioExecutor {}

impl CudaGioExecutor {
    /// Loads `kvtier_gio_kernel` in `ctx` (the I/O partition's context from
    /// [`crate::gpu::SmPartition::split`], so the kernel runs on those SMs
    /// only): the sm_90 cubin on compute capability 9.0, else the PTX.
    pub fn new(ctx: crate::gpu::Context) -> Result<Self> {
        let image = crate::gpu::kernels::gio_kernel()?;
        let cc = ctx.device().compute_capability()?;
        let module = if cc == (9, 0) {
            ctx.load_module(image.cubin)?
        } else {
            let mut ptx = image.ptx.as_bytes().to_vec();
            ptx.push(0);
            ctx.load_module(&ptx)?
        };
        let func = module.function(GIO_KERNEL_NAME)?;
        let stream = ctx.stream()?;
        Ok(CudaGioExecutor {
            ctx,
            _module: module,
            func,
            stream,
        })
    }
}

impl GioExecutor for CudaGioExecutor {
    fn name(&self) -> &'static str {
        "cuda"
    }

    unsafe fn map_host(
        &mut self,
        ptr: *mut u8,
        len: usize,
        mmio: bool,
    ) -> Result<(u64, Box<dyn Any + Send>)> {
        use crate::gpu::{HostRegistration, RegisterFlags};
        let flags = if mmio {
            RegisterFlags::IoMemory
        } else {
            RegisterFlags::DeviceMap
        };
        // SAFETY: forwarded to the caller's contract.
        let reg = unsafe { HostRegistration::register(&self.ctx, ptr, len, flags)? };
        Ok((reg.device_ptr(), Box::new(reg)))
    }

    fn upload(&mut self, bytes: &[u8]) -> Result<(u64, Box<dyn Any + Send>)> {
        let buf = crate::gpu::DeviceBuffer::alloc(&self.ctx, bytes.len().max(1))?;
        buf.write(0, bytes)?;
        Ok((buf.device_ptr(), Box::new(buf)))
    }

    unsafe fn launch(&mut self, engine: u64, blocks: u32) -> Result<()> {
        let mut args = crate::gpu::KernelArgs::new()
            .arg(engine)
            .arg(GIO_MODE_PERSISTENT);
        // SAFETY: kvtier_gio_kernel(const kvtier_gio_engine*, uint32_t):
        // a 64-bit device address and a u32; validity of what it names is
        // the caller's contract.
        unsafe {
            self.stream.launch(
                &self.func,
                crate::gpu::LaunchConfig::linear(blocks, GIO_BLOCK_THREADS),
                &mut args,
            )
        }
    }

    fn join(&mut self, timeout: Duration) -> Result<()> {
        let start = Instant::now();
        while !self.stream.is_idle()? {
            if start.elapsed() >= timeout {
                return Err(gpu_error(format!(
                    "the I/O kernel did not exit within {timeout:?} of being told to stop"
                )));
            }
            std::thread::sleep(Duration::from_micros(100));
        }
        Ok(())
    }
}

/// Runs the I/O kernel's logic on CPU threads ([`crate::gpu::host_kernel`]):
/// kernel addresses are host pointers, a launch runs the persistent
/// kernel's blocks on host threads (64 "threads" per block). For testing the
/// engine without a GPU — against the simulated controller's doorbell page
/// or a real controller's BAR0 (uio/VFIO), where its doorbell stores are
/// plain MMIO writes — never for speed.
pub struct HostGioExecutor {
    kernel: &'static crate::gpu::host_kernel::HostKernel,
    running: Option<std::thread::JoinHandle<()>>,
    launches: u32,
}

impl HostGioExecutor {
    /// `None` in a build without a C++ compiler (no host build of the kernel).
    pub fn new() -> Option<HostGioExecutor> {
        crate::gpu::host_kernel::host_kernel().map(|kernel| HostGioExecutor {
            kernel,
            running: None,
            launches: 0,
        })
    }

    /// Kernel launches so far (one resident kernel serves every IOCB).
    pub fn launches(&self) -> u32 {
        self.launches
    }
}

impl GioExecutor for HostGioExecutor {
    fn name(&self) -> &'static str {
        "host"
    }

    unsafe fn map_host(
        &mut self,
        ptr: *mut u8,
        _len: usize,
        _mmio: bool,
    ) -> Result<(u64, Box<dyn Any + Send>)> {
        Ok((ptr as u64, Box::new(())))
    }

    fn upload(&mut self, bytes: &[u8]) -> Result<(u64, Box<dyn Any + Send>)> {
        let mut buf = AlignedBuf::zeroed(bytes.len().max(1).next_multiple_of(4096));
        buf.as_mut_slice()[..bytes.len()].copy_from_slice(bytes);
        Ok((buf.as_mut_ptr() as u64, Box::new(buf)))
    }

    unsafe fn launch(&mut self, engine: u64, _blocks: u32) -> Result<()> {
        if self.running.is_some() {
            return Err(gpu_error("the host I/O kernel is already running"));
        }
        let run = self.kernel.run_grid;
        let eng = engine as usize;
        self.launches += 1;
        self.running = Some(
            std::thread::Builder::new()
                .name("kvtier-gio-host".into())
                // SAFETY: the engine keeps the descriptor and everything it
                // names alive until join returned (launch's contract).
                .spawn(move || unsafe { run(eng as *const GioEngine, 64, GIO_MODE_PERSISTENT) })
                .map_err(|e| Error::io("spawning the host I/O kernel", e))?,
        );
        Ok(())
    }

    fn join(&mut self, timeout: Duration) -> Result<()> {
        let Some(t) = self.running.take() else {
            return Ok(());
        };
        let start = Instant::now();
        while !t.is_finished() {
            if start.elapsed() >= timeout {
                self.running = Some(t);
                return Err(gpu_error(format!(
                    "the host I/O kernel did not exit within {timeout:?} of being told to stop"
                )));
            }
            std::thread::sleep(Duration::from_millis(1));
        }
        t.join()
            .map_err(|_| gpu_error("the host I/O kernel panicked"))
    }
}
