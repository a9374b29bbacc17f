//! A faulty device for handle tests: wraps a real engine (io_uring over pool
//! files), can hold every IOCB until released, and fails chosen I/Os by
//! pointing them at a device that does not exist, so the engine completes
//! them as failed without touching the disk (a failed read leaves memory
//! unwritten, a failed write or flush leaves the device unwritten).

use kvtier::engine::{EngineStats, IoEngine};
use kvtier::p2p::P2pTable;
use kvtier::ring::abi::*;
use kvtier::ring::{GioRing, IocbId};
use std::os::fd::RawFd;
use std::sync::{Arc, Mutex};

/// A small deterministic generator (splitmix64): tests need no crate for it.
#[derive(Clone)]
pub struct Rng(pub u64);

impl Rng {
    pub fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    /// Uniform in 0..n (n > 0).
    pub fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
    pub fn chance(&mut self, permille: u32) -> bool {
        self.below(1000) < permille as u64
    }
}

#[derive(Default)]
pub struct Faults {
    /// Hold every IOCB the tier submits until this is false again.
    pub hold: bool,
    /// Per I/O, in thousandths.
    pub fail_read_permille: u32,
    pub fail_write_permille: u32,
    pub fail_flush_permille: u32,
    /// I/Os failed so far, by op (read, write, flush).
    pub injected: [u64; 3],
    pub rng: Option<Rng>,
}

pub struct FaultyEngine {
    inner: Box<dyn IoEngine>,
    faults: Arc<Mutex<Faults>>,
    held: Vec<IocbId>,
    held_ctx: usize,
}

/// No pool has this many devices: an IOCTX aimed here completes as
/// IOCTX_STATUS_INVALID without any I/O.
const NO_DEVICE: u16 = u16::MAX;

impl FaultyEngine {
    pub fn new(inner: Box<dyn IoEngine>, faults: Arc<Mutex<Faults>>) -> FaultyEngine {
        FaultyEngine {
            inner,
            faults,
            held: Vec::new(),
            held_ctx: 0,
        }
    }

    /// Take the SQ, hold it or sabotage some IOCTXs, and give the rest back.
    fn intercept(&mut self, ring: &mut GioRing) -> kvtier::Result<()> {
        while let Some(id) = ring.pop_sq() {
            self.held_ctx += ring.iocb(id).hdr.count as usize;
            self.held.push(id);
        }
        let mut f = self.faults.lock().unwrap();
        if f.hold || self.held.is_empty() {
            return Ok(());
        }
        let mut rng = f.rng.clone().unwrap_or(Rng(1));
        for id in std::mem::take(&mut self.held) {
            let count = ring.iocb(id).hdr.count as usize;
            for c in 0..count {
                let op = ring.iocb(id).ctx[c].op;
                let (permille, slot) = match op {
                    IOCTX_OP_READ => (f.fail_read_permille, 0),
                    IOCTX_OP_WRITE => (f.fail_write_permille, 1),
                    _ => (f.fail_flush_permille, 2),
                };
                if permille > 0 && rng.chance(permille) {
                    ring.iocb_mut(id).ctx[c].dev = NO_DEVICE;
                    f.injected[slot] += 1;
                }
            }
            // Back into the SQ for the real engine.
            ring.iocb_mut(id).hdr.state = IOCB_STATE_FILLING;
            ring.submit(id)?;
        }
        f.rng = Some(rng);
        self.held_ctx = 0;
        Ok(())
    }
}

impl IoEngine for FaultyEngine {
    fn name(&self) -> &'static str {
        "faulty-double"
    }
    fn register_memory(&mut self, t: Arc<P2pTable>) -> kvtier::Result<()> {
        self.inner.register_memory(t)
    }
    fn submit(&mut self, ring: &mut GioRing) -> kvtier::Result<()> {
        self.intercept(ring)?;
        self.inner.submit(ring)
    }
    fn reap(&mut self, ring: &mut GioRing, wait: bool) -> kvtier::Result<()> {
        // Held IOCBs go out once the hold is lifted.
        self.intercept(ring)?;
        self.inner.submit(ring)?;
        if !self.held.is_empty() {
            return self.inner.reap(ring, false);
        }
        self.inner.reap(ring, wait)
    }
    fn in_flight(&self) -> usize {
        self.inner.in_flight() + self.held_ctx
    }
    fn completion_fds(&self) -> Vec<RawFd> {
        self.inner.completion_fds()
    }
    fn stats(&self) -> EngineStats {
        self.inner.stats()
    }
    fn describe(&self) -> String {
        format!("faulty double over {}", self.inner.describe())
    }
}
