//! gio_uring: submission and completion rings of IOCB ids over an arena of IOCBs.
//!
//! The shape is io_uring's: a submitter takes a free IOCB (`get_iocb`), fills
//! its IOCTXs, and `submit`s its id into the SQ; an engine pops ids from the
//! SQ, executes every IOCTX, and pushes the id into the CQ when the last one
//! completes; the submitter reaps ids from the CQ (`poll`, `wait_cqe`), reads
//! the per-IOCTX status and `release`s the IOCB. One IOCB is one unit of
//! completion: a layer of a load, a phase of a store.
//!
//! The host ring here keeps its head/tail counters as plain integers behind
//! `&mut self`; the GPU engine maps the same arena and rings into device
//! memory, where the SQ/CQ are single-producer single-consumer with the
//! counters written with release ordering (see kernels/kvtier_abi.h).

pub mod abi;

use crate::error::{Error, Result};
use abi::*;

/// Index of an IOCB in the ring's arena.
pub type IocbId = u32;

/// A power-of-two ring of u32 ids with free-running head and tail counters.
struct IdRing {
    entries: Box<[u32]>,
    head: u32,
    tail: u32,
}

impl IdRing {
    fn new(capacity: u32) -> Self {
        debug_assert!(capacity.is_power_of_two());
        IdRing {
            entries: vec![0; capacity as usize].into_boxed_slice(),
            head: 0,
            tail: 0,
        }
    }
    fn mask(&self) -> u32 {
        self.entries.len() as u32 - 1
    }
    fn len(&self) -> u32 {
        self.tail.wrapping_sub(self.head)
    }
    fn push(&mut self, id: u32) -> bool {
        if self.len() as usize == self.entries.len() {
            return false;
        }
        let slot = (self.tail & self.mask()) as usize;
        self.entries[slot] = id;
        self.tail = self.tail.wrapping_add(1);
        true
    }
    fn pop(&mut self) -> Option<u32> {
        if self.len() == 0 {
            return None;
        }
        let id = self.entries[(self.head & self.mask()) as usize];
        self.head = self.head.wrapping_add(1);
        Some(id)
    }
}

/// The arena of IOCBs and its two rings. Engines see this type; submitters use
/// [`Submitter`](crate::submitter::Submitter), which pairs it with an engine.
pub struct GioRing {
    iocbs: Box<[Iocb]>,
    free: Vec<IocbId>,
    sq: IdRing,
    cq: IdRing,
}

/// Upper bound on ring depth: 4096 IOCBs are 512 MiB of arena.
pub(crate) const MAX_RING_DEPTH: u32 = 4096;

impl GioRing {
    /// A ring of `depth` IOCBs (a power of two, 1..=4096).
    pub fn new(depth: u32) -> Result<Self> {
        if depth == 0 || !depth.is_power_of_two() || depth > MAX_RING_DEPTH {
            return Err(Error::invalid(format!(
                "gio_uring depth {depth} must be a power of two between 1 and {MAX_RING_DEPTH}"
            )));
        }
        // Zeroed in place: an IOCB is 128 KiB and must never sit on the stack.
        let mut iocbs: Box<[Iocb]> = bytemuck::allocation::zeroed_slice_box(depth as usize);
        for (i, iocb) in iocbs.iter_mut().enumerate() {
            iocb.hdr.id = i as u32;
        }
        Ok(GioRing {
            iocbs,
            free: (0..depth).rev().collect(),
            sq: IdRing::new(depth),
            cq: IdRing::new(depth),
        })
    }

    /// IOCBs in the arena (a power of two).
    pub fn depth(&self) -> u32 {
        self.iocbs.len() as u32
    }

    /// IOCBs free to take with `get_iocb`.
    pub fn free_iocbs(&self) -> usize {
        self.free.len()
    }

    /// Take a free IOCB for filling; `None` when all are in use.
    pub fn get_iocb(&mut self) -> Option<IocbId> {
        let id = self.free.pop()?;
        let iocb = &mut self.iocbs[id as usize];
        iocb.hdr = IocbHeader {
            id,
            state: IOCB_STATE_FILLING,
            ..IocbHeader::default()
        };
        Some(id)
    }

    /// The IOCB `id`.
    pub fn iocb(&self, id: IocbId) -> &Iocb {
        &self.iocbs[id as usize]
    }

    /// The whole arena (`depth()` IOCBs, index = id), for an engine that
    /// reads IOCBs where they are, such as the GPU I/O kernel (or its
    /// host-run test). While code behind this pointer runs, the ring must
    /// not be used through `&mut self`.
    pub fn arena_ptr(&mut self) -> *mut Iocb {
        self.iocbs.as_mut_ptr()
    }

    /// The IOCB for the engine (to record completions) or the submitter (while filling).
    pub fn iocb_mut(&mut self, id: IocbId) -> &mut Iocb {
        &mut self.iocbs[id as usize]
    }

    /// Append one IOCTX and its segments to an IOCB being filled. Returns the
    /// IOCTX's index, or `None` when the IOCB has no room (submit it and take
    /// another).
    pub fn push_ctx(&mut self, id: IocbId, mut ctx: IoCtx, segs: &[u32]) -> Option<u32> {
        let iocb = &mut self.iocbs[id as usize];
        debug_assert_eq!(iocb.hdr.state, IOCB_STATE_FILLING);
        let n = iocb.hdr.count as usize;
        let s = iocb.hdr.seg_count as usize;
        if n >= IOCB_MAX_IOCTX || s + segs.len() > IOCB_MAX_SEGS || segs.len() > u16::MAX as usize {
            return None;
        }
        iocb.segs[s..s + segs.len()].copy_from_slice(segs);
        ctx.seg_first = s as u32;
        ctx.seg_count = segs.len() as u16;
        ctx.status = 0;
        ctx.result = 0;
        iocb.ctx[n] = ctx;
        iocb.hdr.count += 1;
        iocb.hdr.seg_count += segs.len() as u32;
        Some(n as u32)
    }

    /// Room left in an IOCB being filled: (IOCTXs, segments).
    pub fn room(&self, id: IocbId) -> (usize, usize) {
        let h = &self.iocbs[id as usize].hdr;
        (
            IOCB_MAX_IOCTX - h.count as usize,
            IOCB_MAX_SEGS - h.seg_count as usize,
        )
    }

    /// Queue a filled IOCB for the engine.
    pub fn submit(&mut self, id: IocbId) -> Result<()> {
        let iocb = &mut self.iocbs[id as usize];
        if iocb.hdr.state != IOCB_STATE_FILLING {
            return Err(Error::Ring(format!(
                "IOCB {id} submitted in state {} (only an IOCB from get_iocb can be submitted)",
                iocb.hdr.state
            )));
        }
        iocb.hdr.state = IOCB_STATE_SUBMITTED;
        iocb.hdr.done = 0;
        iocb.hdr.errors = 0;
        // The SQ has as many slots as there are IOCBs, so it cannot be full.
        let pushed = self.sq.push(id);
        debug_assert!(pushed);
        Ok(())
    }

    /// IOCBs submitted and not yet taken by an engine.
    pub fn sq_len(&self) -> usize {
        self.sq.len() as usize
    }

    /// Completed IOCBs not yet taken by the submitter.
    pub fn cq_len(&self) -> usize {
        self.cq.len() as usize
    }

    /// Engine side: the next submitted IOCB.
    pub fn pop_sq(&mut self) -> Option<IocbId> {
        self.sq.pop()
    }

    /// Engine side: record one IOCTX's completion; when it is the IOCB's last,
    /// the IOCB moves to the CQ. Returns true when the IOCB completed.
    pub fn complete_ctx(&mut self, id: IocbId, ctx: u32, status: u16, result: u32) -> bool {
        let iocb = &mut self.iocbs[id as usize];
        let c = &mut iocb.ctx[ctx as usize];
        c.status = status;
        c.result = result;
        iocb.hdr.done += 1;
        if status != IOCTX_STATUS_OK {
            iocb.hdr.errors += 1;
        }
        if iocb.hdr.done == iocb.hdr.count {
            self.finish(id);
            true
        } else {
            false
        }
    }

    /// Engine side: an IOCB with no IOCTXs completes at once.
    pub fn finish(&mut self, id: IocbId) {
        self.iocbs[id as usize].hdr.state = IOCB_STATE_COMPLETE;
        let pushed = self.cq.push(id);
        debug_assert!(pushed);
    }

    /// Submitter side: the next completed IOCB, if any.
    pub fn pop_cq(&mut self) -> Option<IocbId> {
        self.cq.pop()
    }

    /// Return a completed IOCB to the free list.
    pub fn release(&mut self, id: IocbId) {
        let iocb = &mut self.iocbs[id as usize];
        debug_assert_eq!(iocb.hdr.state, IOCB_STATE_COMPLETE);
        iocb.hdr.state = IOCB_STATE_FREE;
        self.free.push(id);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn depth_must_be_power_of_two() {
        assert!(GioRing::new(3).is_err());
        assert!(GioRing::new(0).is_err());
        assert!(GioRing::new(8192).is_err());
        let msg = GioRing::new(3).err().unwrap().to_string();
        assert!(msg.contains("power of two"), "{msg}");
    }

    #[test]
    fn iocb_lifecycle_and_fifo_order() {
        let mut r = GioRing::new(4).unwrap();
        let ids: Vec<_> = (0..4).map(|_| r.get_iocb().unwrap()).collect();
        assert!(r.get_iocb().is_none(), "all four handed out");
        for &id in &ids {
            let ctx = IoCtx {
                op: IOCTX_OP_READ,
                len: 4096,
                ..Default::default()
            };
            assert_eq!(r.push_ctx(id, ctx, &[id * 10]), Some(0));
            r.submit(id).unwrap();
        }
        assert!(r.submit(ids[0]).is_err(), "double submit is refused");
        // The engine sees them in submission order...
        let popped: Vec<_> = std::iter::from_fn(|| r.pop_sq()).collect();
        assert_eq!(popped, ids);
        // ...completes them out of order...
        for &id in ids.iter().rev() {
            assert!(r.complete_ctx(id, 0, 0, 4096));
        }
        let reaped: Vec<_> = std::iter::from_fn(|| r.pop_cq()).collect();
        assert_eq!(reaped, ids.iter().rev().copied().collect::<Vec<_>>());
        for id in reaped {
            assert_eq!(r.iocb(id).hdr.state, IOCB_STATE_COMPLETE);
            assert_eq!(r.iocb(id).ctx[0].result, 4096);
            assert_eq!(r.iocb(id).segs[0], id * 10);
            r.release(id);
        }
        assert_eq!(r.free_iocbs(), 4);
    }

    #[test]
    fn push_ctx_respects_limits_and_counts_errors() {
        let mut r = GioRing::new(1).unwrap();
        let id = r.get_iocb().unwrap();
        let segs = vec![7u32; 1000];
        let mut pushed = 0;
        while r.push_ctx(id, IoCtx::default(), &segs).is_some() {
            pushed += 1;
        }
        assert_eq!(
            pushed,
            IOCB_MAX_SEGS / 1000,
            "segment array bounds the IOCB"
        );
        assert_eq!(r.room(id).1, IOCB_MAX_SEGS - pushed * 1000);
        r.submit(id).unwrap();
        assert_eq!(r.pop_sq(), Some(id));
        for c in 0..pushed as u32 {
            let status = if c == 3 { IOCTX_STATUS_SHORT } else { 0 };
            r.complete_ctx(id, c, status, 0);
        }
        assert_eq!(r.iocb(id).hdr.errors, 1);
        assert_eq!(r.pop_cq(), Some(id));

        let mut r = GioRing::new(1).unwrap();
        let id = r.get_iocb().unwrap();
        for _ in 0..IOCB_MAX_IOCTX {
            assert!(r.push_ctx(id, IoCtx::default(), &[]).is_some());
        }
        assert!(r.push_ctx(id, IoCtx::default(), &[]).is_none());
    }
}
