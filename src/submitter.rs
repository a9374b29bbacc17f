//! The submitter's interface: a gio_uring ring ([`GioRing`], data only) paired with the
//! engine that executes it ([`IoEngine`]). It sits above both so that the ring never
//! names an engine: engines take a `&mut GioRing`, and only this pairing drives one
//! with the other.

use crate::engine::IoEngine;
use crate::error::{Error, Result};
use crate::ring::{GioRing, IocbId};

/// A ring paired with the engine that executes it: the submitter's interface.
pub struct Submitter {
    // Field order is drop order: the engine first, so an engine whose
    // device or kernel still reads the IOCB arena (the GPU engine) is
    // stopped before the arena is freed.
    engine: Box<dyn IoEngine>,
    ring: GioRing,
}

impl Submitter {
    /// A ring of `depth` IOCBs paired with `engine`.
    pub fn new(depth: u32, engine: Box<dyn IoEngine>) -> Result<Self> {
        Ok(Submitter {
            ring: GioRing::new(depth)?,
            engine,
        })
    }

    /// The ring.
    pub fn ring(&self) -> &GioRing {
        &self.ring
    }

    /// The ring, to fill IOCBs.
    pub fn ring_mut(&mut self) -> &mut GioRing {
        &mut self.ring
    }

    /// The engine.
    pub fn engine(&self) -> &dyn IoEngine {
        self.engine.as_ref()
    }

    /// The engine, to register memory.
    pub fn engine_mut(&mut self) -> &mut dyn IoEngine {
        self.engine.as_mut()
    }

    /// A free IOCB to fill, if any (see [`GioRing::get_iocb`]).
    pub fn get_iocb(&mut self) -> Option<IocbId> {
        self.ring.get_iocb()
    }

    /// Queue an IOCB; the engine starts it at the next `kick`, `poll` or `wait_cqe`.
    pub fn submit(&mut self, id: IocbId) -> Result<()> {
        self.ring.submit(id)
    }

    /// Hand every queued IOCB to the engine (one batch: for io_uring, one
    /// io_uring_enter per device ring).
    pub fn kick(&mut self) -> Result<()> {
        self.engine.submit(&mut self.ring)
    }

    /// Non-blocking: start queued IOCBs, reap device completions, and return
    /// the next completed IOCB if there is one.
    pub fn poll(&mut self) -> Result<Option<IocbId>> {
        if let Some(id) = self.ring.pop_cq() {
            return Ok(Some(id));
        }
        self.engine.submit(&mut self.ring)?;
        self.engine.reap(&mut self.ring, false)?;
        Ok(self.ring.pop_cq())
    }

    /// Block until an IOCB completes and return it. Errors if nothing is in
    /// flight (waiting would never end).
    pub fn wait_cqe(&mut self) -> Result<IocbId> {
        loop {
            if let Some(id) = self.ring.pop_cq() {
                return Ok(id);
            }
            if self.engine.in_flight() == 0 && self.ring.sq_len() == 0 {
                return Err(Error::Ring(
                    "wait_cqe with no IOCB in flight: submit one first".into(),
                ));
            }
            // Submit what is queued and wait, in one call where the engine can.
            self.engine.submit_and_wait(&mut self.ring)?;
        }
    }

    /// Give a completed IOCB back (see [`GioRing::release`]).
    pub fn release(&mut self, id: IocbId) {
        self.ring.release(id)
    }
}
