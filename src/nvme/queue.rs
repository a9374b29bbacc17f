//! An NVMe queue pair: one submission queue and its completion queue, polled
//! by the CPU.
//!
//! The pair knows the protocol (slots, tails and heads, phase tags, command
//! ids, doorbell batching) and nothing about how the rings and doorbells are
//! reached: that is [`QueueMemory`], implemented by real DMA memory plus a
//! mapped BAR0 (the controller bring-up) and by simulated controllers in
//! tests.
//!
//! # Protocol
//!
//! - [`QueuePair::submit`] writes one SQE into the slot at the SQ tail and
//!   advances the tail; nothing reaches the controller until
//!   [`QueuePair::ring`] writes the tail doorbell once for the whole batch.
//! - [`QueuePair::poll`] consumes CQEs while their phase tag matches the
//!   expected phase (which flips each time the CQ head wraps), returns each
//!   with the submitter's token, and writes the CQ head doorbell once per
//!   batch.
//! - At most `depth - 1` commands are outstanding, each with its own command
//!   id (`0..depth-1`, reused in FIFO order so a stale id shows up late), and
//!   the SQ head the controller reports in every CQE is tracked: a slot is
//!   reused only once the controller has said it fetched it, so the SQ never
//!   overruns the controller and the CQ (same depth) can never overflow.
//! - [`QueuePair::wait`] and [`QueuePair::wait_all`] poll with a deadline and
//!   fail with an error naming the queue and its outstanding command ids,
//!   rather than spin forever on a controller that stopped answering.
//!
//! # Memory ordering
//!
//! - SQEs are written with volatile stores into DMA memory. Before the SQ
//!   tail doorbell is written, a `SeqCst` fence orders those stores before
//!   the doorbell store, so a controller that sees the new tail reads
//!   complete entries.
//! - A CQE is detected by a volatile load of its status field (the phase tag
//!   in bit 0). Only after the phase matches, and after an `Acquire` fence,
//!   is the whole entry read (again volatile), so no field is read from
//!   before the controller's write of the entry.
//! - Before the CQ head doorbell, a `SeqCst` fence orders the loads of the
//!   consumed entries before the store that hands their slots back to the
//!   controller.
//! - These fences order the CPU's accesses to normal memory. On x86-64 (where
//!   the QEMU lane runs) stores are not reordered with an uncached MMIO store,
//!   so they suffice. On weakly ordered CPUs the BAR0 implementation of the
//!   doorbell methods must add the device barrier of its architecture
//!   (arm64: `dsb st` / `dmb oshst`) before its MMIO store; see
//!   [`QueueMemory`].

use super::spec::{Cqe, Sqe, Status};
use std::collections::VecDeque;
use std::fmt;
use std::ptr;
use std::sync::atomic::{fence, Ordering};
use std::time::{Duration, Instant};

/// How a [`QueuePair`] reaches its rings and doorbells.
///
/// # Safety
///
/// An implementation promises, for the whole life of the value:
/// - `depth()` is constant and at least 2;
/// - for every `i < depth()`, `sq_slot(i)` is valid for a volatile write of
///   one [`Sqe`] and `cq_slot(i)` for a volatile read of one [`Cqe`], both
///   properly aligned, and distinct `i` give non-overlapping entries;
/// - the CQ entries read as zero (phase tag 0) before the controller first
///   writes them, i.e. the CQ was zero-filled before the queue was created;
/// - only the controller writes the CQ, and no one but the [`QueuePair`]
///   writes the SQ slots while the pair exists;
/// - `ring_sq_doorbell` / `ring_cq_doorbell` perform one 32-bit store of the
///   value to the queue's doorbell register (or the simulated equivalent),
///   preceded by whatever device-ordering barrier the architecture needs
///   beyond the `SeqCst` fence the pair issues (none on x86-64).
pub unsafe trait QueueMemory {
    /// Entries in the SQ and in the CQ (the pair uses queues of equal depth).
    fn depth(&self) -> u16;
    /// Pointer to SQ entry `i`.
    fn sq_slot(&mut self, i: u16) -> *mut Sqe;
    /// Pointer to CQ entry `i`.
    fn cq_slot(&self, i: u16) -> *const Cqe;
    /// Writes the SQ tail doorbell.
    fn ring_sq_doorbell(&mut self, tail: u16);
    /// Writes the CQ head doorbell.
    fn ring_cq_doorbell(&mut self, head: u16);
}

/// A command ids list for messages: the first few, then a count.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CidList(pub Vec<u16>);

impl fmt::Display for CidList {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        const SHOWN: usize = 16;
        write!(f, "[")?;
        for (i, cid) in self.0.iter().take(SHOWN).enumerate() {
            if i > 0 {
                write!(f, ", ")?;
            }
            write!(f, "{cid}")?;
        }
        if self.0.len() > SHOWN {
            write!(f, ", ... {} more", self.0.len() - SHOWN)?;
        }
        write!(f, "]")
    }
}

/// Queue pair failures. A [`QueueError::Protocol`] means the controller
/// broke the protocol; the pair should be deleted and recreated.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum QueueError {
    /// A queue of fewer than 2 entries.
    #[error("NVMe queue {qid} has depth {depth}; a queue needs at least 2 entries")]
    Depth {
        /// The queue.
        qid: u16,
        /// The depth asked for.
        depth: u16,
    },
    /// No room for another command.
    #[error("NVMe queue {qid} is full: {outstanding} command(s) outstanding, {sq_used} SQ slot(s) not yet fetched by the controller, depth {depth}; poll completions before submitting more")]
    Full {
        /// The queue.
        qid: u16,
        /// Its depth.
        depth: u16,
        /// Commands outstanding.
        outstanding: usize,
        /// SQ entries the controller has not consumed.
        sq_used: u16,
    },
    /// No completion in time.
    #[error("NVMe queue {qid}: no completion within {waited:?}; {} command(s) outstanding, cids {outstanding}", outstanding.0.len())]
    Timeout {
        /// The queue.
        qid: u16,
        /// How long it waited.
        waited: Duration,
        /// The command ids outstanding.
        outstanding: CidList,
    },
    /// The controller broke the queue protocol.
    #[error("NVMe queue {qid}: controller protocol error: {reason}")]
    Protocol {
        /// The queue.
        qid: u16,
        /// What the controller did wrong.
        reason: String,
    },
}

/// One completed command.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Completion<T> {
    /// The command id.
    pub cid: u16,
    /// What the submitter passed to [`QueuePair::submit`].
    pub token: T,
    /// Its status.
    pub status: Status,
    /// Command-specific result (CQE DW0).
    pub dw0: u32,
}

impl<T> Completion<T> {
    /// `Ok(token)` on success, else the status with the token.
    pub fn result(self) -> Result<T, (Status, T)> {
        if self.status.is_success() {
            Ok(self.token)
        } else {
            Err((self.status, self.token))
        }
    }
}

/// A submission queue and its completion queue with the driver's state.
pub struct QueuePair<M: QueueMemory, T> {
    qid: u16,
    depth: u16,
    mem: M,
    /// Next SQ slot to write.
    sq_tail: u16,
    /// The tail value last written to the SQ doorbell.
    sq_rung: u16,
    /// The controller's SQ head as last reported in a CQE.
    sq_head: u16,
    cq_head: u16,
    /// The phase tag of a new CQE at `cq_head`.
    phase: bool,
    free_cids: VecDeque<u16>,
    /// Token per command id; `Some` while the command is outstanding.
    inflight: Vec<Option<T>>,
    outstanding: usize,
    sq_doorbells: u64,
    cq_doorbells: u64,
}

impl<M: QueueMemory, T> QueuePair<M, T> {
    /// A pair on freshly created queues (both rings empty, CQ zero-filled,
    /// controller SQ head and CQ tail at 0).
    pub fn new(qid: u16, mem: M) -> Result<Self, QueueError> {
        let depth = mem.depth();
        if depth < 2 {
            return Err(QueueError::Depth { qid, depth });
        }
        let capacity = depth - 1;
        Ok(QueuePair {
            qid,
            depth,
            mem,
            sq_tail: 0,
            sq_rung: 0,
            sq_head: 0,
            cq_head: 0,
            phase: true,
            free_cids: (0..capacity).collect(),
            inflight: (0..capacity).map(|_| None).collect(),
            outstanding: 0,
            sq_doorbells: 0,
            cq_doorbells: 0,
        })
    }

    /// The queue id.
    pub fn qid(&self) -> u16 {
        self.qid
    }

    /// Entries per queue.
    pub fn depth(&self) -> u16 {
        self.depth
    }

    /// Commands that may be outstanding at once: `depth - 1`.
    pub fn capacity(&self) -> usize {
        self.depth as usize - 1
    }

    /// Commands submitted and not completed.
    pub fn outstanding(&self) -> usize {
        self.outstanding
    }

    /// Command ids submitted and not yet completed, ascending.
    pub fn outstanding_cids(&self) -> Vec<u16> {
        self.inflight
            .iter()
            .enumerate()
            .filter(|(_, t)| t.is_some())
            .map(|(cid, _)| cid as u16)
            .collect()
    }

    /// Entries written since the last SQ doorbell.
    pub fn unrung(&self) -> u16 {
        self.ring_distance(self.sq_rung, self.sq_tail)
    }

    /// SQ slots the controller has not (to our knowledge) fetched yet.
    pub fn sq_used(&self) -> u16 {
        self.ring_distance(self.sq_head, self.sq_tail)
    }

    /// Whether [`QueuePair::submit`] would fail with [`QueueError::Full`].
    pub fn is_full(&self) -> bool {
        self.free_cids.is_empty() || self.next(self.sq_tail) == self.sq_head
    }

    /// SQ and CQ doorbell writes so far.
    pub fn doorbell_counts(&self) -> (u64, u64) {
        (self.sq_doorbells, self.cq_doorbells)
    }

    /// Its queue memory.
    pub fn memory(&self) -> &M {
        &self.mem
    }

    /// Its queue memory, to change.
    pub fn memory_mut(&mut self) -> &mut M {
        &mut self.mem
    }

    fn next(&self, i: u16) -> u16 {
        if i + 1 == self.depth {
            0
        } else {
            i + 1
        }
    }

    fn ring_distance(&self, from: u16, to: u16) -> u16 {
        ((to as u32 + self.depth as u32 - from as u32) % self.depth as u32) as u16
    }

    /// Queues `sqe` (its `cid` is replaced by a free command id, which is
    /// returned) with `token`, returned by the completion. The controller
    /// sees it at the next [`QueuePair::ring`] (or wait). On
    /// [`QueueError::Full`] nothing is written and `token` is dropped: check
    /// [`QueuePair::is_full`] first to keep it.
    pub fn submit(&mut self, mut sqe: Sqe, token: T) -> Result<u16, QueueError> {
        if self.is_full() {
            return Err(QueueError::Full {
                qid: self.qid,
                depth: self.depth,
                outstanding: self.outstanding,
                sq_used: self.sq_used(),
            });
        }
        let cid = self.free_cids.pop_front().expect("is_full checked");
        sqe.cid = cid;
        let slot = self.mem.sq_slot(self.sq_tail);
        // SAFETY: sq_tail < depth, and the QueueMemory contract makes the slot
        // valid for a volatile write of one Sqe that nobody else writes.
        unsafe { ptr::write_volatile(slot, sqe) };
        self.sq_tail = self.next(self.sq_tail);
        self.inflight[cid as usize] = Some(token);
        self.outstanding += 1;
        Ok(cid)
    }

    /// Writes the SQ tail doorbell if entries were submitted since the last
    /// one: one doorbell per batch. Returns whether it rang.
    pub fn ring(&mut self) -> bool {
        if self.sq_tail == self.sq_rung {
            return false;
        }
        // The SQEs' stores happen before the doorbell store (module docs).
        fence(Ordering::SeqCst);
        self.mem.ring_sq_doorbell(self.sq_tail);
        self.sq_rung = self.sq_tail;
        self.sq_doorbells += 1;
        true
    }

    /// Consumes up to `max` completions (the ones already posted; it does not
    /// wait) and returns them in completion order.
    pub fn poll(&mut self, max: usize) -> Result<Vec<Completion<T>>, QueueError> {
        let mut out = Vec::new();
        self.poll_into(max, &mut out)?;
        Ok(out)
    }

    /// [`QueuePair::poll`] appending to `out`; returns how many were added.
    /// On a protocol error the completions consumed before the bad entry
    /// stay in `out`, and the bad entry is consumed too.
    pub fn poll_into(
        &mut self,
        max: usize,
        out: &mut Vec<Completion<T>>,
    ) -> Result<usize, QueueError> {
        let mut consumed = 0usize;
        let mut added = 0usize;
        let mut result = Ok(());
        while consumed < max {
            let slot = self.mem.cq_slot(self.cq_head);
            // SAFETY: cq_head < depth; the QueueMemory contract makes the slot
            // valid for volatile reads. Only the status field is read first.
            let status = unsafe { ptr::addr_of!((*slot).status).read_volatile() };
            if (status & 1 != 0) != self.phase {
                break;
            }
            // Read the rest of the entry only after its phase tag matched.
            fence(Ordering::Acquire);
            // SAFETY: as above.
            let cqe = unsafe { slot.read_volatile() };
            self.cq_head = self.next(self.cq_head);
            if self.cq_head == 0 {
                self.phase = !self.phase;
            }
            consumed += 1;
            match self.complete(&cqe) {
                Ok(c) => {
                    out.push(c);
                    added += 1;
                }
                Err(e) => {
                    result = Err(e);
                    break;
                }
            }
        }
        if consumed > 0 {
            // Loads of the consumed entries happen before their slots are
            // handed back (module docs).
            fence(Ordering::SeqCst);
            self.mem.ring_cq_doorbell(self.cq_head);
            self.cq_doorbells += 1;
        }
        result.map(|()| added)
    }

    fn protocol(&self, reason: String) -> QueueError {
        QueueError::Protocol {
            qid: self.qid,
            reason,
        }
    }

    /// Retires the command a CQE completes.
    fn complete(&mut self, cqe: &Cqe) -> Result<Completion<T>, QueueError> {
        if cqe.sq_id != self.qid {
            return Err(self.protocol(format!(
                "completion for cid {} names SQ {}",
                cqe.cid, cqe.sq_id
            )));
        }
        // The reported head lies between the last known head and the last
        // tail the controller was told about.
        if cqe.sq_head >= self.depth
            || self.ring_distance(self.sq_head, cqe.sq_head)
                > self.ring_distance(self.sq_head, self.sq_rung)
        {
            return Err(self.protocol(format!(
                "completion for cid {} reports SQ head {}, outside {}..={} (depth {})",
                cqe.cid, cqe.sq_head, self.sq_head, self.sq_rung, self.depth
            )));
        }
        self.sq_head = cqe.sq_head;
        let token = self
            .inflight
            .get_mut(cqe.cid as usize)
            .and_then(Option::take)
            .ok_or_else(|| {
                self.protocol(format!(
                    "completion for cid {}, which is not outstanding (outstanding: {})",
                    cqe.cid,
                    CidList(self.outstanding_cids())
                ))
            })?;
        self.free_cids.push_back(cqe.cid);
        self.outstanding -= 1;
        Ok(Completion {
            cid: cqe.cid,
            token,
            status: cqe.status(),
            dw0: cqe.dw0,
        })
    }

    /// Rings the SQ doorbell if needed, then polls until at least one
    /// completion arrives (returning every one available) or `timeout`
    /// passes. Returns an empty list at once when nothing is outstanding.
    pub fn wait(&mut self, timeout: Duration) -> Result<Vec<Completion<T>>, QueueError> {
        self.ring();
        let mut out = Vec::new();
        if self.outstanding == 0 {
            return Ok(out);
        }
        let start = Instant::now();
        loop {
            if self.poll_into(usize::MAX, &mut out)? > 0 {
                return Ok(out);
            }
            if start.elapsed() >= timeout {
                return Err(self.timeout(start.elapsed()));
            }
            std::hint::spin_loop();
        }
    }

    /// Rings the SQ doorbell if needed, then polls until nothing is
    /// outstanding. `timeout` bounds the whole wait; on expiry the error
    /// names the commands still outstanding (the completions gathered so far
    /// are dropped with their tokens: use [`QueuePair::wait`] in a loop to
    /// keep them).
    pub fn wait_all(&mut self, timeout: Duration) -> Result<Vec<Completion<T>>, QueueError> {
        self.ring();
        let mut out = Vec::new();
        let start = Instant::now();
        while self.outstanding > 0 {
            if self.poll_into(usize::MAX, &mut out)? == 0 {
                if start.elapsed() >= timeout {
                    return Err(self.timeout(start.elapsed()));
                }
                std::hint::spin_loop();
            }
        }
        Ok(out)
    }

    fn timeout(&self, waited: Duration) -> QueueError {
        QueueError::Timeout {
            qid: self.qid,
            waited,
            outstanding: CidList(self.outstanding_cids()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::nvme::spec::{DataPtr, Status};

    /// A minimal controller: fetches SQEs up to the doorbell, and completes
    /// them at once (in order) or when the test says, posting CQEs with the
    /// right phase and SQ head.
    struct FakeController {
        qid: u16,
        sq: Vec<Sqe>,
        cq: Vec<Cqe>,
        /// Controller's SQ head (next entry to fetch) and CQ tail.
        head: u16,
        cq_tail: u16,
        phase: bool,
        /// The host's last CQ head doorbell value.
        host_cq_head: u16,
        /// Fetched and not yet completed.
        fetched: Vec<Sqe>,
        auto_complete: bool,
        /// Report this SQ head instead of the real one (a lagging controller).
        report_head: Option<u16>,
        sq_rings: Vec<u16>,
        cq_rings: Vec<u16>,
    }

    impl FakeController {
        fn new(qid: u16, depth: u16, auto_complete: bool) -> Self {
            FakeController {
                qid,
                sq: vec![Sqe::default(); depth as usize],
                cq: vec![Cqe::default(); depth as usize],
                head: 0,
                cq_tail: 0,
                phase: true,
                host_cq_head: 0,
                fetched: Vec::new(),
                auto_complete,
                report_head: None,
                sq_rings: Vec::new(),
                cq_rings: Vec::new(),
            }
        }

        fn depth(&self) -> u16 {
            self.sq.len() as u16
        }

        /// Posts a CQE for `cid` (which need not have been fetched: tests of
        /// protocol errors post bogus ones).
        fn post(&mut self, cid: u16, status: Status, dw0: u32) {
            let next = (self.cq_tail + 1) % self.depth();
            assert_ne!(next, self.host_cq_head, "fake: the CQ would overflow");
            self.cq[self.cq_tail as usize] = Cqe {
                dw0,
                dw1: 0,
                sq_head: self.report_head.unwrap_or(self.head),
                sq_id: self.qid,
                cid,
                status: Cqe::status_field(status, self.phase),
            };
            self.cq_tail = next;
            if self.cq_tail == 0 {
                self.phase = !self.phase;
            }
        }

        /// Completes the fetched command `cid`.
        fn complete(&mut self, cid: u16, status: Status) {
            let i = self
                .fetched
                .iter()
                .position(|s| s.cid == cid)
                .unwrap_or_else(|| panic!("fake: cid {cid} was not fetched"));
            let sqe = self.fetched.remove(i);
            // dw0 echoes the SLBA so tests can check which command it was.
            self.post(cid, status, sqe.cdw10);
        }
    }

    unsafe impl QueueMemory for FakeController {
        fn depth(&self) -> u16 {
            self.sq.len() as u16
        }
        fn sq_slot(&mut self, i: u16) -> *mut Sqe {
            &mut self.sq[i as usize]
        }
        fn cq_slot(&self, i: u16) -> *const Cqe {
            &self.cq[i as usize]
        }
        fn ring_sq_doorbell(&mut self, tail: u16) {
            assert!(tail < self.depth(), "fake: SQ tail {tail} out of range");
            self.sq_rings.push(tail);
            while self.head != tail {
                self.fetched.push(self.sq[self.head as usize]);
                self.head = (self.head + 1) % self.depth();
            }
            if self.auto_complete {
                let cids: Vec<u16> = self.fetched.iter().map(|s| s.cid).collect();
                for cid in cids {
                    self.complete(cid, Status::SUCCESS);
                }
            }
        }
        fn ring_cq_doorbell(&mut self, head: u16) {
            assert!(head < self.depth(), "fake: CQ head {head} out of range");
            self.host_cq_head = head;
            self.cq_rings.push(head);
        }
    }

    fn read(slba: u64) -> Sqe {
        Sqe::read(
            0,
            1,
            slba,
            0,
            DataPtr::Prp {
                prp1: 0x1000,
                prp2: 0,
            },
        )
    }

    fn pair(qid: u16, depth: u16, auto: bool) -> QueuePair<FakeController, u64> {
        QueuePair::new(qid, FakeController::new(qid, depth, auto)).unwrap()
    }

    #[test]
    fn wraps_around_many_times_with_depth_4() {
        let mut qp = pair(1, 4, true);
        let mut next_token = 0u64;
        for round in 0..10u64 {
            let batch = 1 + round % 3; // 1, 2 or 3 commands (capacity 3)
            let mut expected = Vec::new();
            for _ in 0..batch {
                let cid = qp.submit(read(next_token), next_token).unwrap();
                expected.push((cid, next_token));
                next_token += 1;
            }
            assert_eq!(qp.unrung() as u64, batch);
            assert!(qp.ring());
            assert!(!qp.ring(), "nothing new: no second doorbell");
            let done = qp.poll(usize::MAX).unwrap();
            let got: Vec<(u16, u64)> = done.iter().map(|c| (c.cid, c.token)).collect();
            assert_eq!(got, expected, "round {round}");
            for c in &done {
                assert!(c.status.is_success());
                assert_eq!(c.dw0 as u64, c.token, "the fake echoes the SLBA");
            }
            assert_eq!(qp.outstanding(), 0);
        }
        // 1+2+3 repeated: 19 commands over a 4-entry ring wrapped 4 times.
        assert_eq!(next_token, 19);
        let (sq_db, cq_db) = qp.doorbell_counts();
        assert_eq!(
            (sq_db, cq_db),
            (10, 10),
            "one doorbell of each kind per batch"
        );
        let fake = qp.memory();
        assert_eq!(fake.sq_rings.len(), 10);
        assert_eq!(*fake.cq_rings.last().unwrap(), 19 % 4);
        assert_eq!(fake.head, 19 % 4);
    }

    #[test]
    fn out_of_order_completions_find_their_tokens() {
        let mut qp = pair(2, 8, false);
        let cids: Vec<u16> = (0..5u64)
            .map(|t| qp.submit(read(100 + t), 100 + t).unwrap())
            .collect();
        qp.ring();
        assert!(qp.poll(16).unwrap().is_empty(), "nothing completed yet");
        let fake = qp.memory_mut();
        fake.complete(cids[3], Status::SUCCESS);
        fake.complete(cids[0], Status::LBA_OUT_OF_RANGE);
        fake.complete(cids[4], Status::DATA_SGL_LENGTH_INVALID.with_dnr());
        let done = qp.poll(16).unwrap();
        let got: Vec<(u16, u64)> = done.iter().map(|c| (c.cid, c.token)).collect();
        assert_eq!(got, vec![(cids[3], 103), (cids[0], 100), (cids[4], 104)]);
        assert!(done[0].status.is_success());
        assert!(done[1].status.is(Status::LBA_OUT_OF_RANGE));
        assert_eq!(done[2].status.raw(), 0x400f);
        assert_eq!(
            done[2].clone().result(),
            Err((Status::from_raw(0x400f), 104))
        );
        assert_eq!(qp.outstanding_cids(), vec![cids[1], cids[2]]);
        let fake = qp.memory_mut();
        fake.complete(cids[2], Status::SUCCESS);
        fake.complete(cids[1], Status::SUCCESS);
        let done = qp.wait_all(Duration::from_secs(1)).unwrap();
        let got: Vec<u64> = done.iter().map(|c| c.token).collect();
        assert_eq!(got, vec![102, 101]);
        assert_eq!(qp.outstanding(), 0);
    }

    #[test]
    fn queue_full_then_free_again() {
        let mut qp = pair(1, 4, false);
        for t in 0..3 {
            qp.submit(read(t), t).unwrap();
        }
        assert!(qp.is_full());
        let err = qp.submit(read(9), 9).unwrap_err();
        assert!(matches!(
            err,
            QueueError::Full {
                qid: 1,
                depth: 4,
                outstanding: 3,
                ..
            }
        ));
        assert!(err.to_string().contains("NVMe queue 1 is full"), "{err}");
        qp.ring();
        qp.memory_mut().complete(1, Status::SUCCESS);
        assert_eq!(qp.poll(8).unwrap().len(), 1);
        assert!(!qp.is_full());
        assert_eq!(qp.submit(read(10), 10).unwrap(), 1, "the only free id");
        assert!(qp.submit(read(11), 11).is_err());
    }

    #[test]
    fn a_lagging_sq_head_keeps_slots_reserved() {
        // The controller completes commands but reports SQ head 0: the host
        // must not reuse slots the controller has not confirmed fetching,
        // even though command ids are free.
        let mut qp = pair(1, 4, false);
        qp.memory_mut().report_head = Some(0);
        for t in 0..3 {
            qp.submit(read(t), t).unwrap();
        }
        qp.ring();
        for cid in 0..3 {
            qp.memory_mut().complete(cid, Status::SUCCESS);
        }
        assert_eq!(qp.poll(8).unwrap().len(), 3);
        assert_eq!(qp.outstanding(), 0);
        assert_eq!(qp.sq_used(), 3);
        let err = qp.submit(read(3), 3).unwrap_err();
        assert!(
            matches!(
                err,
                QueueError::Full {
                    outstanding: 0,
                    sq_used: 3,
                    ..
                }
            ),
            "{err}"
        );
        // Once a completion reports the real head, slots free up.
        qp.memory_mut().report_head = None;
        qp.memory_mut().post(0, Status::SUCCESS, 0); // a stale duplicate...
        let err = qp.poll(8).unwrap_err();
        assert!(err.to_string().contains("not outstanding"), "{err}");
        assert_eq!(qp.sq_used(), 0, "...whose SQ head still counts");
        qp.submit(read(3), 3).unwrap();
    }

    #[test]
    fn poll_respects_max_and_batches_cq_doorbells() {
        let mut qp = pair(1, 8, true);
        for t in 0..5 {
            qp.submit(read(t), t).unwrap();
        }
        qp.ring();
        assert_eq!(qp.poll(2).unwrap().len(), 2);
        assert_eq!(qp.memory().cq_rings, vec![2]);
        assert_eq!(qp.poll(2).unwrap().len(), 2);
        assert_eq!(qp.poll(2).unwrap().len(), 1);
        assert!(qp.poll(2).unwrap().is_empty());
        assert_eq!(
            qp.memory().cq_rings,
            vec![2, 4, 5],
            "no doorbell for an empty poll"
        );
        assert_eq!(qp.doorbell_counts(), (1, 3));
        // Freed ids go to the back: the next command gets an unused one.
        assert_eq!(qp.submit(read(5), 5).unwrap(), 5);
    }

    #[test]
    fn wait_times_out_naming_queue_and_cids() {
        let mut qp = pair(3, 8, false);
        qp.submit(read(0), 0).unwrap();
        qp.submit(read(1), 1).unwrap();
        // wait rings the doorbell itself: the fake fetched both commands.
        let err = qp.wait(Duration::from_millis(20)).unwrap_err();
        assert_eq!(qp.memory().fetched.len(), 2);
        let QueueError::Timeout {
            qid,
            waited,
            ref outstanding,
        } = err
        else {
            panic!("expected a timeout, got {err}");
        };
        assert_eq!(qid, 3);
        assert!(waited >= Duration::from_millis(20));
        assert_eq!(outstanding.0, vec![0, 1]);
        let msg = err.to_string();
        assert!(
            msg.starts_with("NVMe queue 3: no completion within"),
            "{msg}"
        );
        assert!(
            msg.ends_with("2 command(s) outstanding, cids [0, 1]"),
            "{msg}"
        );

        let err = qp.wait_all(Duration::from_millis(5)).unwrap_err();
        assert!(matches!(err, QueueError::Timeout { qid: 3, .. }));
        // Once the controller answers, wait returns what is there.
        qp.memory_mut().complete(1, Status::SUCCESS);
        let done = qp.wait(Duration::from_secs(1)).unwrap();
        assert_eq!(done.len(), 1);
        assert_eq!(done[0].token, 1);
        qp.memory_mut().complete(0, Status::SUCCESS);
        assert_eq!(qp.wait_all(Duration::from_secs(1)).unwrap().len(), 1);
        assert!(
            qp.wait(Duration::from_millis(1)).unwrap().is_empty(),
            "nothing outstanding"
        );
    }

    #[test]
    fn protocol_errors_are_reported_not_hung() {
        let mut qp = pair(1, 8, false);
        qp.submit(read(0), 0).unwrap();
        qp.ring();
        qp.memory_mut().complete(0, Status::SUCCESS);
        qp.memory_mut().post(5, Status::SUCCESS, 0);
        let mut out = Vec::new();
        let err = qp.poll_into(8, &mut out).unwrap_err();
        assert_eq!(out.len(), 1, "completions before the bad entry are kept");
        assert_eq!(
            err.to_string(),
            "NVMe queue 1: controller protocol error: completion for cid 5, which is not outstanding (outstanding: [])"
        );
        assert!(qp.poll(8).unwrap().is_empty(), "the bad entry was consumed");

        let mut qp = pair(2, 8, false);
        qp.memory_mut().qid = 9;
        qp.submit(read(0), 0).unwrap();
        qp.ring();
        qp.memory_mut().complete(0, Status::SUCCESS);
        let err = qp.poll(8).unwrap_err();
        assert!(err.to_string().contains("names SQ 9"), "{err}");

        let mut qp = pair(1, 8, false);
        qp.submit(read(0), 0).unwrap();
        qp.ring();
        qp.memory_mut().report_head = Some(5);
        qp.memory_mut().complete(0, Status::SUCCESS);
        let err = qp.poll(8).unwrap_err();
        assert!(
            err.to_string().contains("reports SQ head 5, outside 0..=1"),
            "{err}"
        );
    }

    #[test]
    fn depth_below_two_is_refused() {
        let err = QueuePair::<_, u64>::new(1, FakeController::new(1, 1, false))
            .err()
            .unwrap();
        assert_eq!(err, QueueError::Depth { qid: 1, depth: 1 });
    }

    #[test]
    fn cid_list_display_truncates() {
        assert_eq!(CidList(vec![]).to_string(), "[]");
        assert_eq!(CidList(vec![4, 2]).to_string(), "[4, 2]");
        let long = CidList((0..20).collect());
        assert_eq!(
            long.to_string(),
            "[0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, ... 4 more]"
        );
    }
}
