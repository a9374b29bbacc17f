//! The io_uring engine: the CPU-driven fallback that runs everywhere.
//!
//! One io_uring per pool device, the device file registered (fixed file),
//! O_DIRECT, the KV memory registered as fixed buffers when the kernel allows
//! it. Each IOCTX becomes exactly one SQE: its segments' adjacent memory is
//! merged, then it is a fixed read/write when one extent remains, a
//! fixed-buffer vectored read/write (kernel 6.15+) when every extent lies in
//! one registered buffer, and a plain readv/writev otherwise. Each `submit`
//! is one io_uring_enter per device ring with work, however many IOCTXs.
//!
//! This module is one of the few places with raw memory handed to the
//! kernel; the invariant that makes it sound is stated at `Op`.

use super::{EngineStats, IoEngine};
use crate::error::{Error, Result};
use crate::p2p::{MemRegion, P2pTable};
use crate::ring::abi::*;
use crate::ring::{GioRing, IocbId};
use io_uring::{opcode, register::Probe, types, IoUring};
use std::collections::VecDeque;
use std::os::fd::{AsFd, AsRawFd, OwnedFd, RawFd};
use std::sync::Arc;

/// Settings of the io_uring engine.
#[non_exhaustive]
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct UringConfig {
    /// In-flight I/Os per device ring.
    pub queue_depth: u32,
    /// Use a kernel submission thread per ring (IORING_SETUP_SQPOLL) that
    /// idles after this many milliseconds: no syscall per batch while busy,
    /// at the price of a polling core.
    pub sqpoll_idle_ms: Option<u32>,
    /// Register the KV memory as fixed buffers (pinned once, no per-I/O page
    /// pinning). Falls back to plain iovecs, with the reason in `describe`,
    /// when the kernel refuses (RLIMIT_MEMLOCK).
    pub fixed_buffers: bool,
    /// IORING_SETUP_SINGLE_ISSUER | DEFER_TASKRUN (6.1+): completions are
    /// processed in the caller's own io_uring_enter, batched, instead of by
    /// interrupting task work; ~3% more random-read IOPS here. Only for a
    /// single-device pool without SQPOLL, and the tier must then be used
    /// (and dropped) on the thread that created it. Off by default.
    #[serde(default)]
    pub defer_taskrun: bool,
}

impl Default for UringConfig {
    fn default() -> Self {
        UringConfig {
            queue_depth: 64,
            sqpoll_idle_ms: None,
            fixed_buffers: true,
            defer_taskrun: false,
        }
    }
}

impl UringConfig {
    /// With `queue_depth` SQEs per device ring.
    pub fn with_queue_depth(mut self, queue_depth: u32) -> Self {
        self.queue_depth = queue_depth;
        self
    }
    /// With SQPOLL idling after `idle_ms` (`None`: no SQPOLL).
    pub fn with_sqpoll_idle_ms(mut self, idle_ms: Option<u32>) -> Self {
        self.sqpoll_idle_ms = idle_ms;
        self
    }
    /// With or without fixed buffers.
    pub fn with_fixed_buffers(mut self, fixed_buffers: bool) -> Self {
        self.fixed_buffers = fixed_buffers;
        self
    }
    /// With or without DEFER_TASKRUN.
    pub fn with_defer_taskrun(mut self, defer_taskrun: bool) -> Self {
        self.defer_taskrun = defer_taskrun;
        self
    }
}

/// The largest buffer io_uring registers as one fixed buffer.
const MAX_FIXED_BUFFER: u64 = 1 << 30;
/// The kernel's limit on iovecs per readv/writev.
const IOV_MAX: usize = 1024;

/// A device the engine drives: an owned descriptor of the open file or block device
/// (a duplicate of the pool's, [`crate::pool::Pool::device_fds`]); the engine keeps its
/// own duplicate for as long as it lives, so nothing rests on who is dropped first.
pub struct UringDevice {
    /// An owned descriptor of the open file or block device.
    pub fd: OwnedFd,
    /// Names the device in messages.
    pub name: String,
}

struct DevRing {
    ring: IoUring,
    /// The device's descriptor, registered as fixed file 0 of `ring`.
    _file: OwnedFd,
    name: String,
    in_flight: u32,
    /// IOCTXs accepted but not yet started, beyond the queue depth.
    backlog: VecDeque<(IocbId, u32)>,
    /// SQEs pushed since the last io_uring_enter.
    unsubmitted: u32,
}

/// One SQE in flight.
///
/// Soundness: `iovecs` is handed to the kernel by pointer at submission; its
/// heap buffer is neither freed nor resized until this op's CQE is reaped
/// (ops are only removed in `complete`), and `Drop` reaps every op before the
/// engine goes away. The memory the iovecs point at is registered KV memory,
/// which the tier keeps alive for as long as an engine has its table.
struct Op {
    iocb: IocbId,
    ctx: u32,
    dev: u16,
    op: u8,
    expected: u32,
    iovecs: Vec<libc::iovec>,
}

/// The io_uring engine: one ring per device (registered file, fixed buffers where the
/// kernel allows), driven from the caller's thread.
pub struct UringEngine {
    cfg: UringConfig,
    devs: Vec<DevRing>,
    table: Option<Arc<P2pTable>>,
    /// Registered fixed buffers (the same on every ring) sorted by address,
    /// with their buffer index.
    fixed: Vec<(MemRegion, u16)>,
    fixed_note: String,
    vectored_fixed: bool,
    /// The ring runs with DEFER_TASKRUN: completions appear only after an
    /// io_uring_enter with GETEVENTS from the creating thread.
    defer_taskrun: bool,
    ops: Vec<Option<Op>>,
    free_ops: Vec<usize>,
    in_flight: usize,
    stats: EngineStats,
}

// SAFETY: the raw pointers inside `Op::iovecs` point at registered memory
// that is not tied to any thread; the engine is used by one thread at a time
// (`&mut self`), which is all io_uring requires.
unsafe impl Send for UringEngine {}

impl UringEngine {
    /// An engine over `devices`, in pool device order (an IOCTX's `dev` indexes them).
    pub fn new(devices: &[UringDevice], cfg: UringConfig) -> Result<Self> {
        if cfg.queue_depth == 0 || cfg.queue_depth > 4096 {
            return Err(Error::invalid(format!(
                "io_uring queue depth {} must be between 1 and 4096",
                cfg.queue_depth
            )));
        }
        let mut devs = Vec::with_capacity(devices.len());
        let mut vectored_fixed = true;
        let mut defer_taskrun = false;
        for d in devices {
            // No COOP_TASKRUN: with it, completions are posted only when the
            // thread next enters the kernel, and a caller that only polls
            // (get_finished in an engine's step loop) would not see them.
            let defer = cfg.defer_taskrun && devices.len() == 1 && cfg.sqpoll_idle_ms.is_none();
            let build = |defer: bool| {
                let mut b = IoUring::builder();
                if let Some(idle) = cfg.sqpoll_idle_ms {
                    b.setup_sqpoll(idle);
                }
                if defer {
                    b.setup_single_issuer()
                        .setup_defer_taskrun()
                        .setup_taskrun_flag();
                }
                b.setup_cqsize(cfg.queue_depth.next_power_of_two() * 2)
                    .build(cfg.queue_depth.next_power_of_two())
            };
            let built = match build(defer) {
                Ok(r) => Ok((r, defer)),
                // Kernels before 6.1 refuse DEFER_TASKRUN: run without it.
                Err(_) if defer => build(false).map(|r| (r, false)),
                Err(e) => Err(e),
            };
            let (ring, deferred) = built.map_err(|e| {
                    Error::io(
                        format!(
                            "creating an io_uring for {} (kernel 5.6+ with io_uring enabled is required; check /proc/sys/kernel/io_uring_disabled)",
                            d.name
                        ),
                        e,
                    )
                })?;
            let file = d
                .fd
                .try_clone()
                .map_err(|e| Error::io(format!("duplicating the descriptor of {}", d.name), e))?;
            ring.submitter()
                .register_files(&[file.as_fd().as_raw_fd()])
                .map_err(|e| Error::io(format!("registering {} with io_uring", d.name), e))?;
            let mut probe = Probe::new();
            if ring.submitter().register_probe(&mut probe).is_err()
                || !probe.is_supported(opcode::ReadvFixed::CODE)
                || !probe.is_supported(opcode::WritevFixed::CODE)
            {
                vectored_fixed = false;
            }
            if deferred {
                defer_taskrun = true;
            }
            devs.push(DevRing {
                ring,
                _file: file,
                name: d.name.clone(),
                in_flight: 0,
                backlog: VecDeque::new(),
                unsubmitted: 0,
            });
        }
        Ok(UringEngine {
            cfg,
            devs,
            table: None,
            fixed: Vec::new(),
            fixed_note: "no memory registered".into(),
            vectored_fixed,
            defer_taskrun,
            ops: Vec::new(),
            free_ops: Vec::new(),
            in_flight: 0,
            stats: EngineStats::default(),
        })
    }

    fn register_fixed(&mut self, table: &P2pTable) {
        self.fixed.clear();
        for dev in &self.devs {
            let _ = dev.ring.submitter().unregister_buffers();
        }
        if !self.cfg.fixed_buffers {
            self.fixed_note = "fixed buffers off".into();
            return;
        }
        let mut chunks = Vec::new();
        for r in table.regions() {
            let mut off = 0;
            while off < r.len {
                let len = (r.len - off).min(MAX_FIXED_BUFFER);
                chunks.push(MemRegion {
                    addr: r.addr + off,
                    len,
                });
                off += len;
            }
        }
        if chunks.len() > u16::MAX as usize {
            self.fixed_note = format!("{} regions: too many to register", chunks.len());
            return;
        }
        let iovecs: Vec<libc::iovec> = chunks
            .iter()
            .map(|c| libc::iovec {
                iov_base: c.addr as *mut libc::c_void,
                iov_len: c.len as usize,
            })
            .collect();
        for dev in &self.devs {
            // SAFETY: the regions are registered KV memory that outlives the
            // registration (the tier unregisters by re-registering or dropping
            // the engine before it releases the memory).
            if let Err(e) = unsafe { dev.ring.submitter().register_buffers(&iovecs) } {
                self.fixed_note = format!(
                    "fixed buffers unavailable ({e}); raise RLIMIT_MEMLOCK (ulimit -l) to pin the KV memory"
                );
                for d in &self.devs {
                    let _ = d.ring.submitter().unregister_buffers();
                }
                return;
            }
        }
        self.fixed_note = format!(
            "{} fixed buffer(s) over {}{}",
            chunks.len(),
            crate::host::size::human_bytes(chunks.iter().map(|c| c.len).sum::<u64>()),
            if self.vectored_fixed {
                ", vectored fixed I/O"
            } else {
                ""
            }
        );
        self.fixed = chunks
            .into_iter()
            .enumerate()
            .map(|(i, c)| (c, i as u16))
            .collect();
        self.fixed.sort_by_key(|(c, _)| c.addr);
    }

    /// The registered buffer holding every iovec, if one does.
    fn fixed_index(&self, iovecs: &[libc::iovec]) -> Option<u16> {
        let first = iovecs.first()?.iov_base as u64;
        let i = self.fixed.partition_point(|(r, _)| r.addr + r.len <= first);
        let (r, index) = self.fixed.get(i)?;
        let inside = iovecs.iter().all(|v| {
            let a = v.iov_base as u64;
            a >= r.addr && a + v.iov_len as u64 <= r.addr + r.len
        });
        inside.then_some(*index)
    }

    /// Resolve an IOCTX's segments into merged iovecs, or the status that
    /// rejects it.
    fn build_iovecs(&self, iocb: &Iocb, ctx: &IoCtx) -> std::result::Result<Vec<libc::iovec>, u16> {
        let table = self.table.as_ref().ok_or(IOCTX_STATUS_INVALID)?;
        let first = ctx.seg_first as usize;
        let segs = iocb
            .segs
            .get(first..first + ctx.seg_count as usize)
            .ok_or(IOCTX_STATUS_INVALID)?;
        let mut iovecs: Vec<libc::iovec> = Vec::with_capacity(segs.len().min(16));
        let mut total: u64 = 0;
        for &s in segs {
            let d = table.entry(s).ok_or(IOCTX_STATUS_INVALID)?;
            total += d.len as u64;
            match iovecs.last_mut() {
                Some(last) if last.iov_base as u64 + last.iov_len as u64 == d.addr => {
                    last.iov_len += d.len as usize;
                }
                _ => iovecs.push(libc::iovec {
                    iov_base: d.addr as *mut libc::c_void,
                    iov_len: d.len as usize,
                }),
            }
        }
        if total != ctx.len as u64 || iovecs.is_empty() || iovecs.len() > IOV_MAX {
            return Err(IOCTX_STATUS_INVALID);
        }
        Ok(iovecs)
    }

    fn alloc_op(&mut self, op: Op) -> usize {
        match self.free_ops.pop() {
            Some(i) => {
                self.ops[i] = Some(op);
                i
            }
            None => {
                self.ops.push(Some(op));
                self.ops.len() - 1
            }
        }
    }

    /// Start backlog IOCTXs on device `d` up to the queue depth. Returns how
    /// many IOCTXs completed at once (rejected as invalid).
    fn fill(&mut self, ring: &mut GioRing, d: usize) -> usize {
        let mut rejected = 0;
        while self.devs[d].in_flight < self.cfg.queue_depth {
            let Some((id, c)) = self.devs[d].backlog.pop_front() else {
                break;
            };
            let iocb = ring.iocb(id);
            let ctx = iocb.ctx[c as usize];
            let iovecs = if ctx.op == IOCTX_OP_FLUSH {
                Ok(Vec::new())
            } else {
                self.build_iovecs(iocb, &ctx)
            };
            let iovecs = match iovecs {
                Ok(v) => v,
                Err(status) => {
                    self.stats.errors += 1;
                    ring.complete_ctx(id, c, status, 0);
                    self.in_flight -= 1;
                    rejected += 1;
                    continue;
                }
            };
            let fixed = if ctx.op == IOCTX_OP_FLUSH {
                None
            } else {
                self.fixed_index(&iovecs)
            };
            let op_index = self.alloc_op(Op {
                iocb: id,
                ctx: c,
                dev: ctx.dev,
                op: ctx.op,
                expected: ctx.len,
                iovecs,
            });
            let op = self.ops[op_index].as_ref().expect("just stored");
            let file = types::Fixed(0);
            let v = &op.iovecs;
            let entry = match (ctx.op, fixed) {
                (IOCTX_OP_FLUSH, _) => opcode::Fsync::new(file)
                    .flags(types::FsyncFlags::DATASYNC)
                    .build(),
                (IOCTX_OP_READ, Some(b)) if v.len() == 1 => {
                    opcode::ReadFixed::new(file, v[0].iov_base as *mut u8, v[0].iov_len as u32, b)
                        .offset(ctx.dev_offset)
                        .build()
                }
                (IOCTX_OP_WRITE, Some(b)) if v.len() == 1 => opcode::WriteFixed::new(
                    file,
                    v[0].iov_base as *const u8,
                    v[0].iov_len as u32,
                    b,
                )
                .offset(ctx.dev_offset)
                .build(),
                (IOCTX_OP_READ, Some(b)) if self.vectored_fixed => {
                    opcode::ReadvFixed::new(file, v.as_ptr(), v.len() as u32, b)
                        .offset(ctx.dev_offset)
                        .build()
                }
                (IOCTX_OP_WRITE, Some(b)) if self.vectored_fixed => {
                    opcode::WritevFixed::new(file, v.as_ptr(), v.len() as u32, b)
                        .offset(ctx.dev_offset)
                        .build()
                }
                (IOCTX_OP_READ, _) => opcode::Readv::new(file, v.as_ptr(), v.len() as u32)
                    .offset(ctx.dev_offset)
                    .build(),
                (_, _) => opcode::Writev::new(file, v.as_ptr(), v.len() as u32)
                    .offset(ctx.dev_offset)
                    .build(),
            };
            let used_fixed = fixed.is_some()
                && ctx.op != IOCTX_OP_FLUSH
                && (v.len() == 1 || self.vectored_fixed);
            let entry = entry.user_data(op_index as u64);
            let dev = &mut self.devs[d];
            // SAFETY: the SQE's pointers (iovec array, buffers) stay valid
            // until its CQE is reaped; see `Op`.
            let pushed = unsafe { dev.ring.submission().push(&entry) };
            if pushed.is_err() {
                // The SQ is sized to the queue depth, so this means SQEs of
                // the previous batch are still unconsumed: keep it for later.
                self.ops[op_index] = None;
                self.free_ops.push(op_index);
                dev.backlog.push_front((id, c));
                break;
            }
            dev.in_flight += 1;
            dev.unsubmitted += 1;
            self.stats.ios += 1;
            self.stats.commands += 1;
            if used_fixed {
                self.stats.fixed_buffer_ios += 1;
            }
        }
        rejected
    }

    /// One io_uring_enter per ring that has new SQEs.
    fn enter(&mut self) -> Result<()> {
        for dev in &mut self.devs {
            if dev.unsubmitted == 0 {
                continue;
            }
            let sqpoll_idle =
                self.cfg.sqpoll_idle_ms.is_some() && !dev.ring.submission().need_wakeup();
            match dev.ring.submit() {
                Ok(_) => {}
                // Interrupted, or the CQ is momentarily full: what the kernel
                // did not take stays in the SQ and goes with the next enter.
                Err(e) if retryable(&e) => {}
                Err(e) => return Err(enter_error(&dev.name, e)),
            }
            if !sqpoll_idle {
                self.stats.syscalls += 1;
            }
            // Without SQPOLL the kernel consumed what it took; with SQPOLL the
            // thread consumes asynchronously, and a later enter only wakes it.
            dev.unsubmitted = if self.cfg.sqpoll_idle_ms.is_some() {
                0
            } else {
                dev.ring.submission().len() as u32
            };
        }
        Ok(())
    }

    /// Reap every available CQE on every ring. Returns how many.
    fn drain(&mut self, ring: &mut GioRing) -> usize {
        let mut n = 0;
        if self.defer_taskrun {
            for dev in &mut self.devs {
                // Completions wait as deferred task work until we enter with
                // GETEVENTS (submit() adds it when the TASKRUN flag is up).
                if dev.ring.submission().taskrun() {
                    let _ = dev.ring.submit();
                    self.stats.syscalls += 1;
                }
            }
        }
        for d in 0..self.devs.len() {
            let cqes: Vec<(u64, i32)> = self.devs[d]
                .ring
                .completion()
                .map(|c| (c.user_data(), c.result()))
                .collect();
            for (ud, res) in cqes {
                self.complete(ring, ud as usize, res);
                n += 1;
            }
        }
        n
    }

    fn complete(&mut self, ring: &mut GioRing, op_index: usize, res: i32) {
        let op = self.ops[op_index].take().expect("CQE for a live op");
        self.free_ops.push(op_index);
        self.devs[op.dev as usize].in_flight -= 1;
        self.in_flight -= 1;
        let (status, result) = if res < 0 {
            (IOCTX_STATUS_ERRNO, (-res) as u32)
        } else if op.op != IOCTX_OP_FLUSH && (res as u32) < op.expected {
            (IOCTX_STATUS_SHORT, res as u32)
        } else {
            (IOCTX_STATUS_OK, res as u32)
        };
        if status == IOCTX_STATUS_OK {
            match op.op {
                IOCTX_OP_READ => self.stats.bytes_read += result as u64,
                IOCTX_OP_WRITE => self.stats.bytes_written += result as u64,
                _ => self.stats.flushes += 1,
            }
        } else {
            self.stats.errors += 1;
        }
        ring.complete_ctx(op.iocb, op.ctx, status, result);
    }

    /// Move every IOCB in the SQ into the per-device backlogs. Returns how
    /// many IOCTXs completed at once (malformed).
    fn accept(&mut self, ring: &mut GioRing) -> usize {
        let devs = &mut self.devs;
        let (kept, rejected) = super::accept_iocbs(ring, &mut self.stats, |id, c, dev| {
            devs.get_mut(dev)
                .map(|d| d.backlog.push_back((id, c)))
                .is_some()
        });
        self.in_flight += kept;
        rejected
    }

    /// Fill SQEs from every backlog up to the queue depth. Returns how many
    /// IOCTXs completed at once (malformed). Submission is `enter`'s job.
    fn fill_all(&mut self, ring: &mut GioRing) -> usize {
        (0..self.devs.len()).map(|d| self.fill(ring, d)).sum()
    }
}

/// A submission error, explained where the cause is ours to name.
fn enter_error(name: &str, e: std::io::Error) -> Error {
    if e.raw_os_error() == Some(libc::EEXIST) {
        return Error::io(
            format!(
                "io_uring on {name} was created by another thread; with UringConfig::defer_taskrun the tier must be used on the thread that opened it (turn defer_taskrun off to move it between threads)"
            ),
            e,
        );
    }
    Error::io(format!("io_uring submit on {name}"), e)
}

fn retryable(e: &std::io::Error) -> bool {
    matches!(
        e.raw_os_error(),
        Some(libc::EINTR) | Some(libc::EAGAIN) | Some(libc::EBUSY)
    )
}

impl IoEngine for UringEngine {
    fn name(&self) -> &'static str {
        "uring"
    }

    fn register_memory(&mut self, table: Arc<P2pTable>) -> Result<()> {
        super::mapped::refuse_if_in_flight(self.in_flight)?;
        self.register_fixed(&table);
        self.table = Some(table);
        Ok(())
    }

    /// Fixed buffers hold the pages they were registered over: each one
    /// that overlaps `ranges` is registered again in place (the kernel keeps
    /// the old pages for I/O already submitted, so this needs no drain).
    /// Addresses outside the fixed buffers are resolved on every I/O.
    fn remap_memory(&mut self, ranges: &[MemRegion]) -> Result<bool> {
        for (chunk, index) in &self.fixed {
            if !ranges
                .iter()
                .any(|r| r.addr < chunk.addr + chunk.len && chunk.addr < r.addr + r.len)
            {
                continue;
            }
            let iov = [libc::iovec {
                iov_base: chunk.addr as *mut libc::c_void,
                iov_len: chunk.len as usize,
            }];
            for dev in &self.devs {
                // SAFETY: the same registered KV memory as at registration
                // (the tier's contract keeps it mapped), now backed by new
                // pages; the buffer index is one this ring registered.
                unsafe { dev.ring.submitter().register_buffers_update(*index as u32, &iov, None) }
                    .map_err(|e| {
                        Error::io(
                            format!(
                                "registering fixed buffer {index} again over new pages at {:#x}",
                                chunk.addr
                            ),
                            e,
                        )
                    })?;
            }
        }
        Ok(true)
    }

    fn submit(&mut self, ring: &mut GioRing) -> Result<()> {
        self.accept(ring);
        self.fill_all(ring);
        self.enter()
    }

    fn submit_and_wait(&mut self, ring: &mut GioRing) -> Result<()> {
        // Fill SQEs without entering: the wait submits them in the same
        // io_uring_enter (one syscall per batch instead of two).
        let rejected = self.accept(ring) + self.fill_all(ring);
        if rejected > 0 {
            // An IOCB may already be complete: do not block.
            return self.enter();
        }
        self.reap(ring, true)
    }

    fn reap(&mut self, ring: &mut GioRing, wait: bool) -> Result<()> {
        loop {
            let done = self.drain(ring) + self.fill_all(ring);
            if done > 0 || !wait || self.in_flight == 0 {
                return self.enter();
            }
            let busy: Vec<usize> = (0..self.devs.len())
                .filter(|&d| self.devs[d].in_flight > 0)
                .collect();
            if busy.len() == 1 {
                // Submit what is pending and wait, in one call.
                let sqpoll = self.cfg.sqpoll_idle_ms.is_some();
                let dev = &mut self.devs[busy[0]];
                match dev.ring.submit_and_wait(1) {
                    Ok(_) => {}
                    Err(e) if retryable(&e) => {}
                    Err(e) => return Err(enter_error(&dev.name, e)),
                }
                dev.unsubmitted = if sqpoll {
                    0
                } else {
                    dev.ring.submission().len() as u32
                };
            } else {
                // Several rings busy: submit what is pending, then sleep until
                // any has a completion (an io_uring fd polls readable when its
                // CQ is non-empty).
                self.enter()?;
                let mut fds: Vec<libc::pollfd> = busy
                    .iter()
                    .map(|&d| libc::pollfd {
                        fd: self.devs[d].ring.as_raw_fd(),
                        events: libc::POLLIN,
                        revents: 0,
                    })
                    .collect();
                // SAFETY: fds is a live array of fds.len() pollfd structs.
                let r = unsafe { libc::poll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, 100) };
                if r < 0 {
                    let e = std::io::Error::last_os_error();
                    if !retryable(&e) {
                        return Err(Error::io("poll on io_uring rings", e));
                    }
                }
            }
            self.stats.syscalls += 1;
        }
    }

    fn in_flight(&self) -> usize {
        self.in_flight
    }

    fn completion_fds(&self) -> Vec<RawFd> {
        // An io_uring fd polls readable while its CQ holds entries (and, with
        // DEFER_TASKRUN, while completions wait as task work): `reap` uses
        // the same property when several rings are busy.
        self.devs.iter().map(|d| d.ring.as_raw_fd()).collect()
    }

    fn stats(&self) -> EngineStats {
        self.stats
    }

    fn describe(&self) -> String {
        format!(
            "io_uring: {} ring(s), queue depth {}, {}{}, {}",
            self.devs.len(),
            self.cfg.queue_depth,
            match self.cfg.sqpoll_idle_ms {
                Some(ms) => format!("SQPOLL (idle {ms} ms)"),
                None => "no SQPOLL".into(),
            },
            if self.defer_taskrun {
                ", DEFER_TASKRUN"
            } else {
                ""
            },
            self.fixed_note
        )
    }
}

impl Drop for UringEngine {
    fn drop(&mut self) {
        // Never let the kernel write into memory or read iovecs we are about
        // to free: wait out every SQE the kernel has taken. Backlogged
        // IOCTXs were never started and need nothing.
        for dev in &mut self.devs {
            while dev.in_flight > 0 {
                match dev.ring.submit_and_wait(1) {
                    Ok(_) => dev.unsubmitted = dev.ring.submission().len() as u32,
                    Err(e) if retryable(&e) => {}
                    // DEFER_TASKRUN ring dropped on another thread with
                    // nothing ever handed to the kernel: nothing to wait for.
                    Err(e)
                        if e.raw_os_error() == Some(libc::EEXIST)
                            && dev.in_flight == dev.unsubmitted =>
                    {
                        break
                    }
                    Err(e) => {
                        // Returning would free memory the device may still
                        // DMA into; there is no safe way on.
                        eprintln!(
                            "kvtier: io_uring on {} failed with I/O in flight: {e}",
                            dev.name
                        );
                        std::process::abort();
                    }
                }
                let n = dev.ring.completion().count() as u32;
                dev.in_flight = dev.in_flight.saturating_sub(n);
            }
            // Let go of the registered descriptors now: the kernel tears a
            // closed ring down asynchronously, and until then its registered
            // files stay open, so their locks (and a block device's exclusive
            // claim) would outlive this engine and refuse the next opener.
            let _ = dev.ring.submitter().unregister_files();
            let _ = dev.ring.submitter().unregister_buffers();
        }
    }
}

/// Whether `len` bytes of fixed buffers can be registered with `ring` here
/// (RLIMIT_MEMLOCK room, or CAP_IPC_LOCK): registers a zeroed buffer and
/// unregisters it; `kvtier doctor` reports the answer.
pub fn fixed_buffers_fit(ring: &IoUring, len: usize) -> std::io::Result<()> {
    let buf = crate::host::dio::AlignedBuf::zeroed(len);
    let iov = [libc::iovec {
        iov_base: buf.as_ptr() as *mut libc::c_void,
        iov_len: buf.len(),
    }];
    // SAFETY: the iovec describes `buf`, which outlives the registration: it is
    // unregistered below, before `buf` drops, and the ring is never used with it
    // for I/O.
    let reg = unsafe { ring.submitter().register_buffers(&iov) };
    let _ = ring.submitter().unregister_buffers();
    drop(buf);
    reg
}
