//! Engines execute IOCBs: they take IOCB ids from a gio_uring SQ, move every
//! IOCTX's bytes between the pool's devices and registered memory, and post
//! the ids to the CQ. The tier never knows which engine runs: io_uring here
//! (CPU-driven, runs everywhere), userspace NVMe through VFIO, and the GPU
//! engine whose CUDA kernels consume the same IOCB layout.

pub mod choice;
pub mod gpu;
pub mod mapped;
pub mod nvme;
pub mod open;
pub mod uring;

use crate::error::Result;
use crate::memory::MemoryKind;
use crate::p2p::{MemRegion, P2pTable};
use crate::ring::abi::IOCTX_STATUS_INVALID;
use crate::ring::{GioRing, IocbId};
use std::os::fd::RawFd;
use std::sync::Arc;

/// Counters every engine keeps; the benchmarks report them per layer.
#[non_exhaustive]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct EngineStats {
    /// IOCBs taken from the SQ.
    pub iocbs: u64,
    /// IOCTXs executed (one device I/O each).
    pub ios: u64,
    /// Bytes read from devices.
    pub bytes_read: u64,
    /// Bytes written to devices.
    pub bytes_written: u64,
    /// Flush commands issued.
    pub flushes: u64,
    /// Calls into the kernel to submit or wait (io_uring_enter, poll).
    pub syscalls: u64,
    /// I/Os that used a registered (fixed) buffer instead of an iovec list.
    pub fixed_buffer_ios: u64,
    /// IOCTXs completed with a non-zero status.
    pub errors: u64,
    /// Device commands issued (an IOCTX larger than the device's transfer
    /// limit is several); the io_uring engine counts one per IOCTX.
    pub commands: u64,
    /// Host CPU time spent building commands and retiring completions:
    /// the engine's own work per command, without doorbell MMIO (which a
    /// TCG guest emulates synchronously) or idle polling. Measured by the
    /// nvme engine; 0 elsewhere.
    pub cpu_ns: u64,
    /// Doorbell writes (SQ tail and CQ head), nvme engine only: one per
    /// batch, not per command.
    pub doorbells: u64,
}

/// An engine executes the IOCBs of a [`GioRing`]: it takes ids from the SQ, moves every
/// IOCTX's bytes, and posts the ids to the CQ. The tier never knows which engine runs.
pub trait IoEngine: Send {
    /// The engine's name (`uring`, `nvme`, `gpu`) in reports and messages.
    fn name(&self) -> &'static str;

    /// Make registered memory reachable: the engine resolves IOCTX segments
    /// through this table from now on and may pin or map its regions (fixed
    /// buffers, IOMMU). Must not be called with I/O in flight.
    fn register_memory(&mut self, table: Arc<P2pTable>) -> Result<()>;

    /// New pages now back `ranges` of the registered memory (a file mapped
    /// over the same addresses; no I/O in flight targets them): make every
    /// later I/O reach the new pages, not the ones the registration pinned.
    /// `Ok(false)`: not while I/O is in flight (an engine that can only
    /// register again when idle); call again once it has drained. The
    /// default is for engines that resolve addresses on every I/O and pin
    /// nothing at registration: nothing to do.
    fn remap_memory(&mut self, ranges: &[MemRegion]) -> Result<bool> {
        let _ = ranges;
        Ok(true)
    }

    /// Start the IOCBs waiting in the ring's SQ, as many IOCTXs as the queue
    /// depth allows (the rest wait inside the engine), with one batch
    /// submission per device queue.
    fn submit(&mut self, ring: &mut GioRing) -> Result<()>;

    /// Reap device completions, record each IOCTX's status, and post IOCBs
    /// whose last IOCTX completed to the CQ. With `wait`, block until at least
    /// one IOCTX completes (returns at once when nothing is in flight).
    fn reap(&mut self, ring: &mut GioRing, wait: bool) -> Result<()>;

    /// `submit` then `reap(ring, true)`; engines that can submit and wait in
    /// one call (io_uring_enter with both counts) override it.
    fn submit_and_wait(&mut self, ring: &mut GioRing) -> Result<()> {
        self.submit(ring)?;
        self.reap(ring, true)
    }

    /// IOCTXs accepted and not yet completed.
    fn in_flight(&self) -> usize;

    /// Whether this engine's devices can move data to and from memory of
    /// `kind`. The tier refuses a registration the engine cannot reach with
    /// this answer, instead of the engine failing later. Host memory by
    /// default: every engine here reaches it.
    fn reaches(&self, kind: MemoryKind) -> bool {
        kind == MemoryKind::Host
    }

    /// File descriptors that poll readable when `reap` has a completion to
    /// find, so a thread can sleep in poll(2) on them together with its own
    /// wake-up fd. Empty when the engine cannot say (CPU- or GPU-polled
    /// queues): callers then poll `reap` without waiting.
    fn completion_fds(&self) -> Vec<RawFd> {
        Vec::new()
    }

    /// Its counters so far.
    fn stats(&self) -> EngineStats;

    /// A line for `kvtier pool info` / bench output: queue depth, fixed
    /// buffers, SQPOLL, and why an optional feature is off.
    fn describe(&self) -> String;
}

/// Moves every IOCB in the ring's SQ to a CPU-driven engine: an empty IOCB
/// completes at once; each IOCTX is offered to `queue(iocb, ctx, dev)`,
/// which keeps it and returns true, or returns false when the engine has no
/// device `dev`: that IOCTX completes as `IOCTX_STATUS_INVALID` (an error).
/// Returns (IOCTXs kept, IOCTXs rejected).
pub(crate) fn accept_iocbs(
    ring: &mut GioRing,
    stats: &mut EngineStats,
    mut queue: impl FnMut(IocbId, u32, usize) -> bool,
) -> (usize, usize) {
    let (mut kept, mut rejected) = (0, 0);
    while let Some(id) = ring.pop_sq() {
        stats.iocbs += 1;
        let count = ring.iocb(id).hdr.count;
        if count == 0 {
            ring.finish(id);
            continue;
        }
        for c in 0..count {
            let dev = ring.iocb(id).ctx[c as usize].dev as usize;
            if queue(id, c, dev) {
                kept += 1;
            } else {
                stats.errors += 1;
                ring.complete_ctx(id, c, IOCTX_STATUS_INVALID, 0);
                rejected += 1;
            }
        }
    }
    (kept, rejected)
}
