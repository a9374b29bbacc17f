//! Fault injection for tests, shared by every test file: one engine and one
//! `Storage`, configured by one [`Faults`].
//!
//! `FaultEngine` is a TEST DOUBLE of a device, not an engine for real use. It
//! holds the IOCBs the tier submits while [`Faults::hold`] is set or their
//! job's gate is closed ([`Faults::gates`]) (or, with
//! [`Faults::hold_flushes`], those that flush), then runs them on one of three
//! back ends:
//! - [`FaultEngine::open`]: the pool's files, with plain positional reads and
//!   writes (no O_DIRECT, not under the pool's lock, beside the `Pool` that
//!   holds them), so a test can make one region fail every write (a bad
//!   extent group), make writes vanish or tear while acknowledged (a lying
//!   cache), run out of space, or fail flushes;
//! - [`FaultEngine::wrap`]: a real engine (io_uring over the pool files),
//!   with chosen I/Os failed by aiming them at a device that does not exist
//!   (the engine completes them as failed without touching the disk);
//! - [`FaultEngine::bookkeeping`]: no I/O at all, every IOCTX completed as
//!   asked (for tests of the tier's accounting, not of bytes).
//!
//! Random faults ([`Faults::fail_read_permille`] and friends) and per-job
//! faults ([`Faults::fail_writes_of`], [`Faults::fail_reads_of`]) work on
//! every back end; byte-range faults on the file back end.
//! `FaultStorage` wraps a `BackingDevice` for the pool's own metadata I/O
//! (open, check, repair, format) with failing reads and a write budget that
//! stops the "process" after N writes (a crash at write N).
#![allow(dead_code)]

use kvtier::engine::{EngineStats, IoEngine};
use kvtier::host::dio::AlignedBuf;
use kvtier::p2p::P2pTable;
use kvtier::pool::backing::BackingDevice;
use kvtier::pool::Storage;
use kvtier::ring::abi::*;
use kvtier::ring::{GioRing, IocbId};
use std::collections::HashSet;
use std::fs::{File, OpenOptions};
use std::ops::Range;
use std::os::fd::RawFd;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

pub use super::Rng;

/// What a [`FaultEngine`] does wrong.
#[derive(Default, Debug)]
pub struct Faults {
    /// Writes touching these fail with EIO (a bad region: every time).
    pub fail_writes: Vec<(u16, Range<u64>)>,
    /// Reads touching these fail with EIO.
    pub fail_reads: Vec<(u16, Range<u64>)>,
    /// The first read touching each of these completes OK with one byte of
    /// it flipped, then the entry is gone: a transfer that went wrong once
    /// (a bad bus, a DMA racing a stray write), over bytes the device still
    /// holds intact.
    pub garble_reads_once: Vec<(u16, Range<u64>)>,
    /// Writes touching these complete OK but never reach the file.
    pub drop_writes: Vec<(u16, Range<u64>)>,
    /// Writes touching these complete OK but only their first half reaches
    /// the file (a torn write under a lying cache).
    pub torn_writes: Vec<(u16, Range<u64>)>,
    /// Writes touching these fail with ENOSPC (a full thin device).
    pub enospc_writes: Vec<(u16, Range<u64>)>,
    /// Every flush fails with EIO.
    pub fail_flushes: bool,
    /// Writes that failed, for the test to see.
    pub failed_writes: u64,
    /// Hold every IOCB until this is false again.
    pub hold: bool,
    /// Hold every IOCB that flushes until this is false again (a device
    /// whose flushes wait behind other writes for a long while).
    pub hold_flushes: bool,
    /// Stop the thread that enters the engine (`submit` or `reap`: inside
    /// the handle I/O thread's poll turn) while the stall is armed.
    pub stall: Option<Arc<Stall>>,
    /// `Some(jobs)`: only IOCBs of these jobs (IOCB user_data) run; the
    /// others wait until their job is added or the gate is `None`.
    pub gates: Option<HashSet<u64>>,
    /// Every write / read of these jobs fails with EIO.
    pub fail_writes_of: HashSet<u64>,
    pub fail_reads_of: HashSet<u64>,
    /// Random faults per I/O, in thousandths, drawn from `rng`.
    pub fail_read_permille: u32,
    pub fail_write_permille: u32,
    pub fail_flush_permille: u32,
    /// I/Os failed at random so far, by op (read, write, flush).
    pub injected: [u64; 3],
    pub rng: Option<Rng>,
}

impl Faults {
    /// Whether an IOCB of `job` may run now.
    fn admits(&self, job: u64) -> bool {
        !self.hold && self.gates.as_ref().is_none_or(|g| g.contains(&job))
    }

    /// A random or per-job fault for one IOCTX of `job`: fail it?
    fn strikes(&mut self, job: u64, op: u8) -> bool {
        let (permille, slot, of_job) = match op {
            IOCTX_OP_READ => (
                self.fail_read_permille,
                0,
                self.fail_reads_of.contains(&job),
            ),
            IOCTX_OP_WRITE => (
                self.fail_write_permille,
                1,
                self.fail_writes_of.contains(&job),
            ),
            _ => (self.fail_flush_permille, 2, false),
        };
        if of_job {
            return true;
        }
        if permille == 0 {
            return false;
        }
        let mut rng = self.rng.clone().unwrap_or(Rng(1));
        let hit = rng.chance(permille);
        self.rng = Some(rng);
        if hit {
            self.injected[slot] += 1;
        }
        hit
    }
}

/// The bytes of an I/O's memory extents `(address, length)`, in order: what
/// a device double writes.
///
/// # Safety
/// Every extent is readable memory for its length, and the lengths sum to `len`.
pub unsafe fn gather_extents(extents: &[(u64, usize)], len: usize) -> Vec<u8> {
    let mut buf = vec![0u8; len];
    let mut at = 0;
    for &(addr, n) in extents {
        // SAFETY: the caller's contract; `buf[at..at + n]` lies inside `buf`
        // because the lengths sum to `len` (the slice index checks it).
        unsafe {
            std::ptr::copy_nonoverlapping(addr as *const u8, buf[at..at + n].as_mut_ptr(), n)
        };
        at += n;
    }
    buf
}

/// Copies `buf` into an I/O's memory extents, in order: what a device double
/// reads into.
///
/// # Safety
/// Every extent is writable memory for its length that nothing else uses
/// meanwhile, and the lengths sum to `buf.len()`.
pub unsafe fn scatter_extents(buf: &[u8], extents: &[(u64, usize)]) {
    let mut at = 0;
    for &(addr, n) in extents {
        // SAFETY: the caller's contract; the slice index bounds the source.
        unsafe { std::ptr::copy_nonoverlapping(buf[at..at + n].as_ptr(), addr as *mut u8, n) };
        at += n;
    }
}

fn touches(list: &[(u16, Range<u64>)], dev: u16, off: u64, len: u64) -> bool {
    list.iter()
        .any(|(d, r)| *d == dev && off < r.end && r.start < off + len)
}

/// Stops whoever enters a [`FaultEngine`] while armed: the handle's I/O
/// thread, in the middle of its poll turn, with every lock of that turn
/// held, for as long as a test needs to see what waits for it.
#[derive(Default, Debug)]
pub struct Stall {
    /// (armed, a thread is stopped in it)
    state: Mutex<(bool, bool)>,
    cond: Condvar,
}

impl Stall {
    /// The next thread to enter the engine stops there until `release`.
    pub fn arm(&self) {
        self.state.lock().unwrap().0 = true;
    }

    /// Whether a thread is stopped in the engine, waiting at most `timeout`.
    pub fn wait_entered(&self, timeout: Duration) -> bool {
        let deadline = Instant::now() + timeout;
        let mut g = self.state.lock().unwrap();
        while !g.1 {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return false;
            }
            g = self.cond.wait_timeout(g, left).unwrap().0;
        }
        true
    }

    /// Let the stopped thread go; the stall stays disarmed.
    pub fn release(&self) {
        let mut g = self.state.lock().unwrap();
        g.0 = false;
        self.cond.notify_all();
    }

    fn enter(&self) {
        let mut g = self.state.lock().unwrap();
        if g.0 {
            g.1 = true;
            self.cond.notify_all();
            while g.0 {
                g = self.cond.wait(g).unwrap();
            }
            g.1 = false;
        }
    }
}

/// Where a [`FaultEngine`] runs the I/O it lets through.
enum Backend {
    Files(Vec<File>),
    Engine(Box<dyn IoEngine>),
    Bookkeeping,
}

/// No pool has this many devices: an IOCTX aimed here completes as
/// IOCTX_STATUS_INVALID in the wrapped engine, without any I/O.
const NO_DEVICE: u16 = u16::MAX;

pub struct FaultEngine {
    backend: Backend,
    table: Option<Arc<P2pTable>>,
    pub faults: Arc<Mutex<Faults>>,
    stats: EngineStats,
    /// IOCBs taken from the SQ and not yet run, and their IOCTXs.
    held: Vec<IocbId>,
    held_ctx: usize,
}

impl FaultEngine {
    /// On the pool's files.
    pub fn open(paths: &[PathBuf], faults: Arc<Mutex<Faults>>) -> FaultEngine {
        let files = paths
            .iter()
            .map(|p| {
                OpenOptions::new()
                    .read(true)
                    .write(true)
                    .open(p)
                    .unwrap_or_else(|e| panic!("open {}: {e}", p.display()))
            })
            .collect();
        FaultEngine::with(Backend::Files(files), faults)
    }

    /// In front of a real engine.
    pub fn wrap(inner: Box<dyn IoEngine>, faults: Arc<Mutex<Faults>>) -> FaultEngine {
        FaultEngine::with(Backend::Engine(inner), faults)
    }

    /// No I/O: IOCTXs complete with their full length unless a fault fails them.
    pub fn bookkeeping(faults: Arc<Mutex<Faults>>) -> FaultEngine {
        FaultEngine::with(Backend::Bookkeeping, faults)
    }

    fn with(backend: Backend, faults: Arc<Mutex<Faults>>) -> FaultEngine {
        FaultEngine {
            backend,
            table: None,
            faults,
            stats: EngineStats::default(),
            held: Vec::new(),
            held_ctx: 0,
        }
    }

    /// Stops here while the faults' stall is armed (not under their lock).
    fn stall_here(&self) {
        let stall = self.faults.lock().unwrap().stall.clone();
        if let Some(s) = stall {
            s.enter();
        }
    }

    /// Runs every held IOCB its faults admit; the rest stay held.
    fn pump(&mut self, ring: &mut GioRing) -> kvtier::Result<()> {
        while let Some(id) = ring.pop_sq() {
            self.held_ctx += ring.iocb(id).hdr.count as usize;
            self.held.push(id);
        }
        let mut keep = Vec::new();
        for id in std::mem::take(&mut self.held) {
            let job = ring.iocb(id).hdr.user_data;
            let b = ring.iocb(id);
            let flushes = b.ctx[..b.hdr.count as usize]
                .iter()
                .any(|c| c.op == IOCTX_OP_FLUSH);
            let f = self.faults.lock().unwrap();
            let admitted = f.admits(job) && !(flushes && f.hold_flushes);
            drop(f);
            if !admitted {
                keep.push(id);
                continue;
            }
            let n = ring.iocb(id).hdr.count;
            self.held_ctx -= n as usize;
            if n == 0 {
                ring.finish(id);
                continue;
            }
            if let Backend::Engine(inner) = &mut self.backend {
                for c in 0..n as usize {
                    let op = ring.iocb(id).ctx[c].op;
                    if self.faults.lock().unwrap().strikes(job, op) {
                        ring.iocb_mut(id).ctx[c].dev = NO_DEVICE;
                    }
                }
                // Back into the SQ for the real engine.
                ring.iocb_mut(id).hdr.state = IOCB_STATE_FILLING;
                ring.submit(id)?;
                inner.submit(ring)?;
                continue;
            }
            for c in 0..n {
                let b = ring.iocb(id);
                let ctx = b.ctx[c as usize];
                let first = ctx.seg_first as usize;
                let segs = b.segs[first..first + ctx.seg_count as usize].to_vec();
                let (status, result) = if self.faults.lock().unwrap().strikes(job, ctx.op) {
                    (IOCTX_STATUS_ERRNO, libc::EIO as u32)
                } else if matches!(self.backend, Backend::Bookkeeping) {
                    (IOCTX_STATUS_OK, ctx.len)
                } else {
                    self.execute(ctx, &segs)
                };
                ring.complete_ctx(id, c, status, result);
                self.stats.ios += 1;
            }
        }
        self.held = keep;
        Ok(())
    }

    fn extents(&self, segs: &[u32]) -> Vec<(u64, usize)> {
        let t = self.table.as_ref().expect("memory registered");
        segs.iter()
            .map(|&i| {
                let d = t.entry(i).expect("segment in the table");
                (d.addr, d.len as usize)
            })
            .collect()
    }

    fn execute(&mut self, io: IoCtx, segs: &[u32]) -> (u16, u32) {
        let eio = (IOCTX_STATUS_ERRNO, libc::EIO as u32);
        let dev = io.dev as usize;
        let extents = if io.op == IOCTX_OP_FLUSH {
            Vec::new()
        } else {
            self.extents(segs)
        };
        let Backend::Files(files) = &self.backend else {
            unreachable!("execute runs on the file back end")
        };
        let mut f = self.faults.lock().unwrap();
        match io.op {
            IOCTX_OP_FLUSH => {
                if f.fail_flushes {
                    return eio;
                }
                files[dev].sync_data().unwrap();
                (IOCTX_STATUS_OK, 0)
            }
            IOCTX_OP_WRITE => {
                if touches(&f.fail_writes, io.dev, io.dev_offset, io.len as u64) {
                    f.failed_writes += 1;
                    return eio;
                }
                if touches(&f.enospc_writes, io.dev, io.dev_offset, io.len as u64) {
                    f.failed_writes += 1;
                    return (IOCTX_STATUS_ERRNO, libc::ENOSPC as u32);
                }
                // SAFETY: registered host memory the tier keeps alive for the
                // job; the extents' lengths sum to `io.len`.
                let buf = unsafe { gather_extents(&extents, io.len as usize) };
                if touches(&f.torn_writes, io.dev, io.dev_offset, io.len as u64) {
                    // Acknowledged whole, half of it on the device.
                    files[dev]
                        .write_all_at(&buf[..buf.len() / 2], io.dev_offset)
                        .unwrap();
                } else if !touches(&f.drop_writes, io.dev, io.dev_offset, io.len as u64) {
                    files[dev].write_all_at(&buf, io.dev_offset).unwrap();
                }
                self.stats.bytes_written += io.len as u64;
                (IOCTX_STATUS_OK, io.len)
            }
            IOCTX_OP_READ => {
                if touches(&f.fail_reads, io.dev, io.dev_offset, io.len as u64) {
                    return eio;
                }
                let mut buf = vec![0u8; io.len as usize];
                files[dev].read_exact_at(&mut buf, io.dev_offset).unwrap();
                let end = io.dev_offset + io.len as u64;
                if let Some(i) = f
                    .garble_reads_once
                    .iter()
                    .position(|(d, r)| *d == io.dev && r.start < end && io.dev_offset < r.end)
                {
                    let (_, r) = f.garble_reads_once.remove(i);
                    buf[(r.start.max(io.dev_offset) - io.dev_offset) as usize] ^= 0x01;
                }
                // SAFETY: as for writes; the load's target memory is the
                // tier's to fill while the job is in flight.
                unsafe { scatter_extents(&buf, &extents) };
                self.stats.bytes_read += io.len as u64;
                (IOCTX_STATUS_OK, io.len)
            }
            _ => (IOCTX_STATUS_INVALID, 0),
        }
    }
}

impl IoEngine for FaultEngine {
    fn name(&self) -> &'static str {
        "fault-double"
    }
    /// Any kind: the double moves bytes with the CPU, and tests present host
    /// memory as device memory to see how the tier treats memory it cannot
    /// read (no data checksum).
    fn reaches(&self, _kind: kvtier::memory::MemoryKind) -> bool {
        true
    }
    fn register_memory(&mut self, table: Arc<P2pTable>) -> kvtier::Result<()> {
        if let Backend::Engine(inner) = &mut self.backend {
            inner.register_memory(table.clone())?;
        }
        self.table = Some(table);
        Ok(())
    }
    fn submit(&mut self, ring: &mut GioRing) -> kvtier::Result<()> {
        self.stall_here();
        self.pump(ring)
    }
    fn reap(&mut self, ring: &mut GioRing, wait: bool) -> kvtier::Result<()> {
        self.stall_here();
        // Held IOCBs go out once their hold or gate is lifted.
        self.pump(ring)?;
        match &mut self.backend {
            // Never wait while something is held: the test lifts the hold
            // from another thread, and a poll must come back to see it.
            Backend::Engine(inner) => inner.reap(ring, wait && self.held.is_empty()),
            _ => Ok(()),
        }
    }
    fn in_flight(&self) -> usize {
        let inner = match &self.backend {
            Backend::Engine(inner) => inner.in_flight(),
            _ => 0,
        };
        inner + self.held_ctx
    }
    fn completion_fds(&self) -> Vec<RawFd> {
        match &self.backend {
            Backend::Engine(inner) => inner.completion_fds(),
            _ => Vec::new(),
        }
    }
    fn stats(&self) -> EngineStats {
        match &self.backend {
            Backend::Engine(inner) => inner.stats(),
            _ => self.stats,
        }
    }
    fn describe(&self) -> String {
        match &self.backend {
            Backend::Engine(inner) => format!("fault-injecting double over {}", inner.describe()),
            _ => "fault-injecting test double".into(),
        }
    }
}

/// A backing device whose reads fail in `fail_reads` and whose writes stop
/// (fail, having written nothing more) once `write_budget` runs out.
pub struct FaultStorage {
    pub inner: BackingDevice,
    pub fail_reads: Vec<Range<u64>>,
    pub write_budget: Option<Arc<AtomicU64>>,
}

impl FaultStorage {
    pub fn new(inner: BackingDevice) -> FaultStorage {
        FaultStorage {
            inner,
            fail_reads: Vec::new(),
            write_budget: None,
        }
    }
    fn eio(&self, offset: u64, len: usize, what: &str) -> kvtier::Error {
        kvtier::Error::Device {
            device: self.inner.path().display().to_string(),
            offset,
            len: len as u64,
            reason: format!("{what} failed: Input/output error (injected)"),
        }
    }
}

impl Storage for FaultStorage {
    fn path(&self) -> &Path {
        self.inner.path()
    }
    fn size(&self) -> u64 {
        self.inner.size()
    }
    fn read_exact_at(&self, buf: &mut AlignedBuf, offset: u64) -> kvtier::Result<()> {
        let end = offset + buf.len() as u64;
        if self
            .fail_reads
            .iter()
            .any(|r| offset < r.end && r.start < end)
        {
            return Err(self.eio(offset, buf.len(), "read"));
        }
        self.inner.read_exact_at(buf, offset)
    }
    fn write_all_at(&self, buf: &AlignedBuf, offset: u64) -> kvtier::Result<()> {
        if let Some(b) = &self.write_budget {
            if b.fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
                .is_err()
            {
                return Err(self.eio(offset, buf.len(), "write (crashed)"));
            }
        }
        self.inner.write_all_at(buf, offset)
    }
    fn sync_data(&self) -> kvtier::Result<()> {
        self.inner.sync_data()
    }
    fn io_fd(&self) -> Option<std::os::fd::BorrowedFd<'_>> {
        Some(self.inner.as_fd())
    }
}
