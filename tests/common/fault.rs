//! Fault injection for tests: an engine and a `Storage` that run on a pool's
//! backing files and fail, drop or refuse I/O in chosen byte ranges.
//!
//! `FaultEngine` is a TEST DOUBLE of a device, not an engine for real use: it
//! executes IOCTXs synchronously with plain positional reads and writes on
//! the pool's files (opened without O_DIRECT and without the pool's lock,
//! beside the `Pool` that holds them), so a test can make one region of a
//! device fail every write (a bad extent group), make writes in a range
//! vanish while being acknowledged (a lying cache), or fail flushes.
//! `FaultStorage` wraps a `BackingDevice` for the pool's own metadata I/O
//! (open, check, repair, format) with failing reads and a write budget that
//! stops the "process" after N writes (a crash at write N).
#![allow(dead_code)]

use kvtier::engine::{EngineStats, IoEngine};
use kvtier::p2p::P2pTable;
use kvtier::pool::backing::{AlignedBuf, BackingDevice};
use kvtier::pool::Storage;
use kvtier::ring::abi::*;
use kvtier::ring::GioRing;
use std::fs::{File, OpenOptions};
use std::ops::Range;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

/// What a [`FaultEngine`] does wrong, per device: byte ranges.
#[derive(Default, Debug)]
pub struct Faults {
    /// Writes touching these fail with EIO (a bad region: every time).
    pub fail_writes: Vec<(u16, Range<u64>)>,
    /// Reads touching these fail with EIO.
    pub fail_reads: Vec<(u16, Range<u64>)>,
    /// Writes touching these complete OK but never reach the file.
    pub drop_writes: Vec<(u16, Range<u64>)>,
    /// Every flush fails with EIO.
    pub fail_flushes: bool,
    /// Writes that failed, for the test to see.
    pub failed_writes: u64,
}

fn touches(list: &[(u16, Range<u64>)], dev: u16, off: u64, len: u64) -> bool {
    list.iter()
        .any(|(d, r)| *d == dev && off < r.end && r.start < off + len)
}

pub struct FaultEngine {
    files: Vec<File>,
    table: Option<Arc<P2pTable>>,
    pub faults: Arc<Mutex<Faults>>,
    stats: EngineStats,
}

impl FaultEngine {
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
        FaultEngine {
            files,
            table: None,
            faults,
            stats: EngineStats::default(),
        }
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
        let mut f = self.faults.lock().unwrap();
        match io.op {
            IOCTX_OP_FLUSH => {
                if f.fail_flushes {
                    return eio;
                }
                self.files[dev].sync_data().unwrap();
                (IOCTX_STATUS_OK, 0)
            }
            IOCTX_OP_WRITE => {
                if touches(&f.fail_writes, io.dev, io.dev_offset, io.len as u64) {
                    f.failed_writes += 1;
                    return eio;
                }
                let mut buf = vec![0u8; io.len as usize];
                let mut at = 0;
                for (addr, len) in self.extents(segs) {
                    // SAFETY: registered host memory the tier keeps alive for
                    // the job; the extents' lengths sum to `io.len`.
                    unsafe {
                        std::ptr::copy_nonoverlapping(
                            addr as *const u8,
                            buf[at..].as_mut_ptr(),
                            len,
                        )
                    };
                    at += len;
                }
                if !touches(&f.drop_writes, io.dev, io.dev_offset, io.len as u64) {
                    self.files[dev].write_all_at(&buf, io.dev_offset).unwrap();
                }
                self.stats.bytes_written += io.len as u64;
                (IOCTX_STATUS_OK, io.len)
            }
            IOCTX_OP_READ => {
                if touches(&f.fail_reads, io.dev, io.dev_offset, io.len as u64) {
                    return eio;
                }
                let mut buf = vec![0u8; io.len as usize];
                self.files[dev]
                    .read_exact_at(&mut buf, io.dev_offset)
                    .unwrap();
                let mut at = 0;
                for (addr, len) in self.extents(segs) {
                    // SAFETY: as for writes; the load's target memory is the
                    // tier's to fill while the job is in flight.
                    unsafe {
                        std::ptr::copy_nonoverlapping(buf[at..].as_ptr(), addr as *mut u8, len)
                    };
                    at += len;
                }
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
        self.table = Some(table);
        Ok(())
    }
    fn submit(&mut self, ring: &mut GioRing) -> kvtier::Result<()> {
        while let Some(id) = ring.pop_sq() {
            let n = ring.iocb(id).hdr.count;
            if n == 0 {
                ring.finish(id);
                continue;
            }
            for c in 0..n {
                let b = ring.iocb(id);
                let ctx = b.ctx[c as usize];
                let first = ctx.seg_first as usize;
                let segs = b.segs[first..first + ctx.seg_count as usize].to_vec();
                let (status, result) = self.execute(ctx, &segs);
                ring.complete_ctx(id, c, status, result);
                self.stats.ios += 1;
            }
        }
        Ok(())
    }
    fn reap(&mut self, _ring: &mut GioRing, _wait: bool) -> kvtier::Result<()> {
        Ok(())
    }
    fn in_flight(&self) -> usize {
        0
    }
    fn stats(&self) -> EngineStats {
        self.stats
    }
    fn describe(&self) -> String {
        "fault-injecting test double".into()
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
    fn raw_fd(&self) -> Option<std::os::fd::RawFd> {
        Some(self.inner.raw_fd())
    }
}
