//! The nvme engine: IOCBs executed on CPU-polled NVMe queue pairs driven from
//! userspace (VFIO or uio; or the simulated controller, a test double).
//!
//! Each pool device is one namespace of one controller ([`NvmeNamespace`]),
//! brought up by [`crate::nvme::ctrl::Controller`] with two I/O queue pairs:
//! the first carries the data path (this engine), the second the pool's own
//! synchronous metadata I/O (superblock, header scans, `pool check`) through
//! the [`Storage`](crate::pool::Storage) trait, so neither ever reaps the other's completions.
//!
//! Memory: at [`IoEngine::register_memory`] every region of the P2P table is
//! mapped for each controller ([`DmaAlloc::map_host`](crate::nvme::ctrl::DmaAlloc::map_host): an IOMMU mapping
//! under VFIO, locked pages and their physical frames under uio) and every
//! table entry translated once into device extents. A command then costs a
//! table lookup per segment, no address arithmetic beyond merging adjacent
//! extents, and one 16-byte descriptor per extent.
//!
//! Commands: an IOCTX becomes one command, or several when its transfer
//! exceeds the controller's MDTS or one descriptor page. Its memory is an
//! inline SGL Data Block when it is one extent, else a Last Segment of Data
//! Blocks in the command's own descriptor page (one 4 KiB page per command
//! slot, so 256 extents or a 512-entry PRP list); PRPs when the controller
//! has no SGL support or when asked. The SQ doorbell is rung once per
//! batch, the CQ head doorbell once per poll that consumed entries.
//!
//! Errors: an NVMe status lands in the IOCTX as `SCT << 8 | SC` (0x000f for
//! "Data SGL Length Invalid", 0x0080 for "LBA Out of Range"); malformed
//! IOCTXs complete as `IOCTX_STATUS_INVALID`. A command that does not
//! complete within the I/O timeout stops the controller (CC.EN=0, so the
//! command can never land in memory later), fails every IOCTX it had with
//! `IOCTX_STATUS_TIMEOUT`, and `reap` returns an error naming the queue and
//! command ids; nothing waits forever.

use super::mapped::{refuse_if_in_flight, MappedTable};
use super::{EngineStats, IoEngine};
use crate::error::{Error, Result};
use crate::memory::MemoryKind;
use crate::nvme::ctrl::{Bar0, DataMode, DmaRegion};
use crate::nvme::namespace::DATA_QUEUE;
use crate::nvme::namespace::{NvmeConfig, NvmeNamespace};
use crate::nvme::spec::{build_prps, DataPtr, Extent, SglDescriptor, Sqe, SGL_DESCRIPTOR_LEN};
use crate::p2p::{MemRegion, P2pTable};
use crate::ring::abi::*;
use crate::ring::{GioRing, IocbId};
use std::collections::VecDeque;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Descriptor memory per command slot: one page of SGL descriptors (256) or
/// PRP entries (512).
const DESC_BYTES: usize = 4096;

/// One IOCTX being executed (possibly as several commands).
struct CtxState {
    iocb: IocbId,
    ctx: u32,
    outstanding: u32,
    all_issued: bool,
    status: u16,
    bytes: u64,
}

/// The IOCTX a device is cutting into commands.
struct Partial {
    cs: usize,
    write: bool,
    /// Device extents of the IOCTX's memory, adjacent ones merged.
    extents: Vec<Extent>,
    idx: usize,
    within: u64,
    done: u64,
    total: u64,
    slba: u64,
}

/// One command in flight.
struct Op {
    dev: usize,
    cs: usize,
    desc: u16,
    bytes: u64,
    /// When the command was queued: each command has its own timeout.
    submitted: Instant,
}

struct Dev<B: Bar0> {
    ns: NvmeNamespace<B>,
    nsid: u32,
    lba_shift: u32,
    page: u64,
    sgl: bool,
    /// Bytes one command may move (MDTS, and the descriptor page for PRP).
    max_cmd: u64,
    /// Descriptor pages, one per command slot.
    desc: DmaRegion,
    free_desc: Vec<u16>,
    backlog: VecDeque<(IocbId, u32)>,
    cur: Option<Partial>,
    commands: usize,
    mapped: MappedTable,
    /// Device extents of P2P entry `i`: `dma_ext[dma_first[i]..dma_first[i + 1]]`.
    dma_first: Vec<u32>,
    dma_ext: Vec<Extent>,
}

/// The CPU-driven userspace NVMe engine (module docs).
pub struct NvmeEngine<B: Bar0> {
    cfg: NvmeConfig,
    devs: Vec<Dev<B>>,
    table: Option<Arc<P2pTable>>,
    ctxs: Vec<Option<CtxState>>,
    free_ctxs: Vec<usize>,
    ops: Vec<Option<Op>>,
    free_ops: Vec<usize>,
    in_flight: usize,
    stats: EngineStats,
    scratch: Vec<Extent>,
    next_timeout_scan: Instant,
}

impl<B: Bar0 + Send + Sync + 'static> NvmeEngine<B> {
    /// An engine over the pool's devices, in the pool's device order.
    pub fn new(devices: Vec<NvmeNamespace<B>>, cfg: NvmeConfig) -> Result<Self> {
        if devices.is_empty() {
            return Err(Error::invalid(
                "the nvme engine needs at least one namespace",
            ));
        }
        let mut devs = Vec::with_capacity(devices.len());
        for ns in devices {
            let mut shared = ns.lock();
            let name = shared.ctrl.name().to_string();
            let sgl = match cfg.data_mode {
                DataMode::Auto => shared.ctrl.sgl_supported(),
                DataMode::Prp => false,
                DataMode::Sgl | DataMode::SglSegmentsOf(_) => {
                    if !shared.ctrl.sgl_supported() {
                        return Err(Error::invalid(format!(
                            "NVMe controller {name} does not support SGLs (Identify SGLS={:#x})",
                            shared.ctrl.identify().sgls
                        ))
                        .with_fix(crate::error::Fix::UsePrp));
                    }
                    true
                }
            };
            let page = shared.ctrl.page_bytes();
            let mut max_cmd = shared.ctrl.max_transfer_bytes();
            if !sgl {
                // A PRP list of one descriptor page: PRP1 plus 512 entries,
                // one page of slack for an unaligned start.
                max_cmd = max_cmd.min((DESC_BYTES as u64 / 8 - 2) * page);
            }
            let lba = shared.ctrl.lba_bytes() as u64;
            max_cmd -= max_cmd % lba;
            let qp = shared.ctrl.io_queue(DATA_QUEUE)?;
            let slots = qp.capacity();
            let desc = shared.dma.alloc(slots * DESC_BYTES, 4096)?;
            let nsid = shared.ctrl.nsid();
            drop(shared);
            devs.push(Dev {
                nsid,
                lba_shift: lba.trailing_zeros(),
                page,
                sgl,
                max_cmd,
                desc,
                free_desc: (0..slots as u16).rev().collect(),
                backlog: VecDeque::new(),
                cur: None,
                commands: 0,
                mapped: MappedTable::default(),
                dma_first: Vec::new(),
                dma_ext: Vec::new(),
                ns,
            });
        }
        Ok(NvmeEngine {
            cfg,
            devs,
            table: None,
            ctxs: Vec::new(),
            free_ctxs: Vec::new(),
            ops: Vec::new(),
            free_ops: Vec::new(),
            in_flight: 0,
            stats: EngineStats::default(),
            scratch: Vec::new(),
            next_timeout_scan: Instant::now(),
        })
    }
}

// SAFETY: the only !Send parts are the descriptor-page regions (`Dev::desc`),
// which nothing but this engine holds and which it touches only through
// `&mut self`, under the namespace's lock; see `Shared` for the rest.
unsafe impl<B: Bar0 + Send> Send for NvmeEngine<B> {}

fn slab_put<T>(slab: &mut Vec<Option<T>>, free: &mut Vec<usize>, v: T) -> usize {
    match free.pop() {
        Some(i) => {
            slab[i] = Some(v);
            i
        }
        None => {
            slab.push(Some(v));
            slab.len() - 1
        }
    }
}

impl<B: Bar0> NvmeEngine<B> {
    /// Maps every table region for every controller and translates each
    /// table entry into device extents.
    /// Maps the table for every controller and translates every entry;
    /// all or nothing: on an error the engine keeps its previous view.
    fn map_table(&mut self, table: &P2pTable) -> Result<()> {
        let mut staged = Vec::with_capacity(self.devs.len());
        for dev in &self.devs {
            let ns = dev.ns.clone();
            let mapped = MappedTable::build(table, |r| {
                let mut shared = ns.lock();
                // SAFETY: the table's regions are registered memory, which
                // the tier keeps alive (and in place) for as long as an
                // engine holds its table (Tier::register_memory's contract);
                // the mapping is dropped with the engine or the next table.
                unsafe { shared.dma.map_host(r.addr as *mut u8, r.len as usize) }
            })?;
            let mut first = Vec::with_capacity(table.entries().len() + 1);
            let mut ext = Vec::with_capacity(table.entries().len());
            for (i, e) in table.entries().iter().enumerate() {
                first.push(ext.len() as u32);
                if !mapped.translate(e.addr, e.len as u64, &mut ext) {
                    return Err(Error::Registration(format!(
                        "P2P entry {i} ({:#x}, {} bytes) lies outside every mapped region of {}",
                        e.addr,
                        e.len,
                        dev.ns.path.display()
                    )));
                }
            }
            first.push(ext.len() as u32);
            staged.push((mapped, first, ext));
        }
        for (dev, (mapped, first, ext)) in self.devs.iter_mut().zip(staged) {
            dev.mapped = mapped;
            dev.dma_first = first;
            dev.dma_ext = ext;
        }
        Ok(())
    }

    fn finish_ctx(&mut self, ring: &mut GioRing, cs: usize) {
        let st = self.ctxs[cs].take().expect("live IOCTX state");
        self.free_ctxs.push(cs);
        self.in_flight -= 1;
        if st.status != IOCTX_STATUS_OK {
            self.stats.errors += 1;
        }
        let result = if st.status == IOCTX_STATUS_OK {
            st.bytes as u32
        } else {
            0
        };
        ring.complete_ctx(st.iocb, st.ctx, st.status, result);
    }

    /// Fails an IOCTX before any of its commands was issued.
    fn reject(&mut self, ring: &mut GioRing, id: IocbId, c: u32, status: u16) {
        self.in_flight -= 1;
        self.stats.errors += 1;
        ring.complete_ctx(id, c, status, 0);
    }

    /// Device extents of an IOCTX's segments on device `d`, merged, into
    /// `out`; false when a segment index is bad or the total disagrees.
    fn resolve(&self, d: usize, iocb: &Iocb, ctx: &IoCtx, out: &mut Vec<Extent>) -> bool {
        out.clear();
        let dev = &self.devs[d];
        let first = ctx.seg_first as usize;
        let Some(segs) = iocb.segs.get(first..first + ctx.seg_count as usize) else {
            return false;
        };
        for &s in segs {
            let Some(&a) = dev.dma_first.get(s as usize) else {
                return false;
            };
            let Some(&b) = dev.dma_first.get(s as usize + 1) else {
                return false;
            };
            for e in &dev.dma_ext[a as usize..b as usize] {
                match out.last_mut() {
                    Some(l) if l.addr + l.len == e.addr => l.len += e.len,
                    _ => out.push(*e),
                }
            }
        }
        let total: u64 = out.iter().map(|e| e.len).sum();
        !out.is_empty() && total == ctx.len as u64
    }

    /// Starts the next backlog IOCTX of device `d` (flushes and rejects
    /// complete or issue at once). Returns false when the backlog is empty.
    fn start_next(&mut self, ring: &mut GioRing, d: usize, qp_room: bool) -> bool {
        let Some((id, c)) = self.devs[d].backlog.pop_front() else {
            return false;
        };
        let ctx = ring.iocb(id).ctx[c as usize];
        let cs = slab_put(
            &mut self.ctxs,
            &mut self.free_ctxs,
            CtxState {
                iocb: id,
                ctx: c,
                outstanding: 0,
                all_issued: false,
                status: IOCTX_STATUS_OK,
                bytes: 0,
            },
        );
        if ctx.op == IOCTX_OP_FLUSH {
            debug_assert!(qp_room);
            self.devs[d].cur = Some(Partial {
                cs,
                write: false,
                extents: Vec::new(),
                idx: 0,
                within: 0,
                done: 0,
                total: 0,
                slba: u64::MAX, // marks a flush
            });
            return true;
        }
        let lba_mask = (1u64 << self.devs[d].lba_shift) - 1;
        let mut extents = std::mem::take(&mut self.scratch);
        let valid = self.table.is_some()
            && (ctx.op == IOCTX_OP_READ || ctx.op == IOCTX_OP_WRITE)
            && ctx.len > 0
            && ctx.dev_offset & lba_mask == 0
            && ctx.len as u64 & lba_mask == 0
            && self.resolve(d, ring.iocb(id), &ctx, &mut extents);
        if !valid {
            self.scratch = extents;
            self.ctxs[cs] = None;
            self.free_ctxs.push(cs);
            self.reject(ring, id, c, IOCTX_STATUS_INVALID);
            return true;
        }
        self.devs[d].cur = Some(Partial {
            cs,
            write: ctx.op == IOCTX_OP_WRITE,
            extents,
            idx: 0,
            within: 0,
            done: 0,
            total: ctx.len as u64,
            slba: ctx.dev_offset >> self.devs[d].lba_shift,
        });
        true
    }

    /// Issues commands on device `d` while its queue has room and it has
    /// work; rings the SQ doorbell once. Returns commands issued.
    fn fill(&mut self, ring: &mut GioRing, d: usize) -> usize {
        let ns = self.devs[d].ns.clone();
        let mut shared = ns.lock();
        if shared.failed.is_some() {
            drop(shared);
            while let Some((id, c)) = self.devs[d].backlog.pop_front() {
                self.reject(ring, id, c, IOCTX_STATUS_TIMEOUT);
            }
            return 0;
        }
        let start = Instant::now();
        let mut issued = 0;
        let mut pieces: Vec<Extent> = Vec::new();
        while let Ok(qp) = shared.ctrl.io_queue(DATA_QUEUE) {
            if qp.is_full() {
                break;
            }
            if self.devs[d].cur.is_none() && !self.start_next(ring, d, true) {
                break;
            }
            let dev = &mut self.devs[d];
            let Some(p) = dev.cur.as_mut() else {
                continue; // the IOCTX was rejected
            };
            let cs = p.cs;
            let desc = dev
                .free_desc
                .pop()
                .expect("a descriptor page per queue slot");
            let (sqe, bytes) = if p.slba == u64::MAX {
                (Sqe::flush(0, dev.nsid), 0)
            } else {
                // Cut the next command: up to max_cmd bytes and as many
                // extents as one descriptor page holds, on an LBA boundary.
                let max_desc = if dev.sgl {
                    DESC_BYTES / SGL_DESCRIPTOR_LEN as usize
                } else {
                    usize::MAX
                };
                let mut want = (p.total - p.done).min(dev.max_cmd);
                pieces.clear();
                let (mut idx, mut within, mut got) = (p.idx, p.within, 0u64);
                while got < want && pieces.len() < max_desc {
                    let e = p.extents[idx];
                    let take = (e.len - within).min(want - got);
                    pieces.push(Extent {
                        addr: e.addr + within,
                        len: take,
                    });
                    got += take;
                    within += take;
                    if within == e.len {
                        idx += 1;
                        within = 0;
                    }
                }
                if got < want {
                    // Out of descriptors: end on an LBA boundary.
                    let lba = 1u64 << dev.lba_shift;
                    want = got - got % lba;
                    let mut cut = got - want;
                    while cut > 0 {
                        let last = pieces.last_mut().expect("pieces cover got bytes");
                        let drop_bytes = cut.min(last.len);
                        last.len -= drop_bytes;
                        cut -= drop_bytes;
                        if last.len == 0 {
                            pieces.pop();
                        }
                    }
                    // Recompute the cursor for exactly `want` bytes.
                    let (mut i2, mut w2, mut left) = (p.idx, p.within, want);
                    while left > 0 {
                        let room = p.extents[i2].len - w2;
                        if left >= room {
                            left -= room;
                            i2 += 1;
                            w2 = 0;
                        } else {
                            w2 += left;
                            left = 0;
                        }
                    }
                    idx = i2;
                    within = w2;
                }
                let slot_ptr = desc as usize * DESC_BYTES;
                let data = if want == 0 {
                    None
                } else if dev.sgl {
                    if pieces.len() == 1 {
                        Some(DataPtr::Sgl(SglDescriptor::data_block(
                            pieces[0].addr,
                            pieces[0].len as u32,
                        )))
                    } else {
                        let blocks: Vec<SglDescriptor> = pieces
                            .iter()
                            .map(|e| SglDescriptor::data_block(e.addr, e.len as u32))
                            .collect();
                        dev.desc.write(slot_ptr, bytemuck::cast_slice(&blocks));
                        Some(DataPtr::Sgl(SglDescriptor::last_segment(
                            dev.desc.dma() + slot_ptr as u64,
                            blocks.len() as u32,
                        )))
                    }
                } else {
                    let mut list = [0u64; DESC_BYTES / 8];
                    match build_prps(
                        pieces.iter(),
                        dev.page,
                        &mut list,
                        dev.desc.dma() + slot_ptr as u64,
                    ) {
                        Ok(prps) => {
                            if prps.list_slots > 0 {
                                dev.desc.write(
                                    slot_ptr,
                                    bytemuck::cast_slice(&list[..prps.list_slots]),
                                );
                            }
                            Some(prps.data_ptr())
                        }
                        Err(_) => None,
                    }
                };
                let Some(data) = data else {
                    // Memory PRPs cannot describe (or no whole LBA fits a
                    // descriptor page): the rest of the IOCTX is invalid.
                    dev.free_desc.push(desc);
                    let p = dev.cur.take().expect("current IOCTX");
                    self.scratch = p.extents;
                    let st = self.ctxs[cs].as_mut().expect("live IOCTX state");
                    st.status = IOCTX_STATUS_INVALID;
                    st.all_issued = true;
                    if st.outstanding == 0 {
                        self.finish_ctx(ring, cs);
                    }
                    continue;
                };
                let nlb = ((want >> dev.lba_shift) - 1) as u16;
                let slba = p.slba + (p.done >> dev.lba_shift);
                p.idx = idx;
                p.within = within;
                p.done += want;
                let sqe = if p.write {
                    Sqe::write(0, dev.nsid, slba, nlb, data)
                } else {
                    Sqe::read(0, dev.nsid, slba, nlb, data)
                };
                (sqe, want)
            };
            let finished = match dev.cur.as_ref() {
                Some(p) => p.slba == u64::MAX || p.done == p.total,
                None => true,
            };
            if finished {
                let p = dev.cur.take().expect("current IOCTX");
                if !p.extents.is_empty() || p.extents.capacity() > self.scratch.capacity() {
                    self.scratch = p.extents;
                }
            }
            let op = slab_put(
                &mut self.ops,
                &mut self.free_ops,
                Op {
                    dev: d,
                    cs,
                    desc,
                    bytes,
                    submitted: Instant::now(),
                },
            );
            let qp = shared.ctrl.io_queue(DATA_QUEUE).expect("checked above");
            qp.submit(sqe, op as u64)
                .expect("the queue had room (is_full checked)");
            let st = self.ctxs[cs].as_mut().expect("live IOCTX state");
            st.outstanding += 1;
            st.all_issued = finished;
            let dev = &mut self.devs[d];
            dev.commands += 1;
            issued += 1;
        }
        if issued > 0 {
            self.stats.cpu_ns += start.elapsed().as_nanos() as u64;
        }
        if let Ok(qp) = shared.ctrl.io_queue(DATA_QUEUE) {
            if qp.ring() {
                self.stats.doorbells += 1;
            }
        }
        self.stats.commands += issued as u64;
        issued
    }

    /// Consumes every posted completion of device `d`. Returns how many.
    fn drain(&mut self, ring: &mut GioRing, d: usize) -> Result<usize> {
        if self.devs[d].commands == 0 {
            return Ok(0);
        }
        let ns = self.devs[d].ns.clone();
        let mut shared = ns.lock();
        let mut done = Vec::new();
        let polled = match shared.ctrl.io_queue(DATA_QUEUE) {
            Ok(qp) => qp.poll_into(usize::MAX, &mut done),
            Err(_) => Ok(0),
        };
        drop(shared);
        let start = Instant::now();
        let n = done.len();
        if n > 0 {
            self.stats.doorbells += 1; // the CQ head doorbell of this poll
        }
        for c in done {
            let op = self.ops[c.token as usize]
                .take()
                .expect("CQE for a live command");
            self.free_ops.push(c.token as usize);
            let dev = &mut self.devs[op.dev];
            dev.free_desc.push(op.desc);
            dev.commands -= 1;
            let st = self.ctxs[op.cs].as_mut().expect("live IOCTX state");
            st.outstanding -= 1;
            if c.status.is_success() {
                st.bytes += op.bytes;
                let (r, w) = (ring.iocb(st.iocb).ctx[st.ctx as usize].op, op.bytes);
                match r {
                    IOCTX_OP_READ => self.stats.bytes_read += w,
                    IOCTX_OP_WRITE => self.stats.bytes_written += w,
                    _ => self.stats.flushes += 1,
                }
            } else if st.status == IOCTX_STATUS_OK {
                st.status = c.status.code();
            }
            if st.outstanding == 0 && st.all_issued {
                self.finish_ctx(ring, op.cs);
            }
        }
        self.stats.cpu_ns += start.elapsed().as_nanos() as u64;
        if let Err(e) = polled {
            return Err(self.fail_device(
                ring,
                d,
                format!("the controller broke the queue protocol ({e})"),
            ));
        }
        Ok(n)
    }

    /// Stops device `d`'s controller and fails everything it had.
    fn fail_device(&mut self, ring: &mut GioRing, d: usize, why: String) -> Error {
        let ns = self.devs[d].ns.clone();
        let mut shared = ns.lock();
        let cids = shared
            .ctrl
            .io_queue(DATA_QUEUE)
            .map(|q| q.outstanding_cids())
            .unwrap_or_default();
        let reset = shared.ctrl.reset_after_failure();
        let name = shared.ctrl.name().to_string();
        let reason = format!(
            "{why}; cids {cids:?} on I/O queue 1 of NVMe controller {name} outstanding; the controller was stopped (CC.EN=0{}) so they cannot land later: reopen the pool to go on",
            match &reset {
                Ok(()) => String::new(),
                Err(e) => format!(", and the reset failed: {e}"),
            }
        );
        shared.failed = Some(reason.clone());
        drop(shared);
        if reset.is_err() {
            // The controller may still DMA: never hand its descriptor pages
            // or the mapped memory back.
            std::mem::forget(self.devs[d].desc.clone());
            std::mem::forget(std::mem::take(&mut self.devs[d].mapped));
        }
        // Fail every command of this device, then what was waiting.
        for i in 0..self.ops.len() {
            if self.ops[i].as_ref().is_some_and(|o| o.dev == d) {
                let op = self.ops[i].take().expect("checked");
                self.free_ops.push(i);
                self.devs[d].free_desc.push(op.desc);
                let st = self.ctxs[op.cs].as_mut().expect("live IOCTX state");
                st.outstanding -= 1;
                st.status = IOCTX_STATUS_TIMEOUT;
                if st.outstanding == 0 {
                    st.all_issued = true;
                    self.finish_ctx(ring, op.cs);
                }
            }
        }
        self.devs[d].commands = 0;
        if let Some(p) = self.devs[d].cur.take() {
            if let Some(st) = self.ctxs[p.cs].as_mut() {
                st.status = IOCTX_STATUS_TIMEOUT;
                st.all_issued = true;
                if st.outstanding == 0 {
                    self.finish_ctx(ring, p.cs);
                }
            }
        }
        while let Some((id, c)) = self.devs[d].backlog.pop_front() {
            self.reject(ring, id, c, IOCTX_STATUS_TIMEOUT);
        }
        Error::Device {
            device: self.devs[d].ns.path.display().to_string(),
            offset: 0,
            len: 0,
            reason,
        }
    }

    fn accept(&mut self, ring: &mut GioRing) {
        let devs = &mut self.devs;
        let (kept, rejected) = super::accept_iocbs(ring, &mut self.stats, |id, c, dev| {
            devs.get_mut(dev)
                .map(|d| d.backlog.push_back((id, c)))
                .is_some()
        });
        self.in_flight += kept;
        self.stats.ios += (kept + rejected) as u64;
    }

    /// One pass: completions, then new commands. Returns completions seen.
    fn step(&mut self, ring: &mut GioRing) -> Result<usize> {
        let mut n = 0;
        let mut first_err = None;
        for d in 0..self.devs.len() {
            match self.drain(ring, d) {
                Ok(k) => n += k,
                Err(e) => {
                    first_err.get_or_insert(e);
                }
            }
        }
        for d in 0..self.devs.len() {
            self.fill(ring, d);
        }
        match first_err {
            Some(e) => Err(e),
            None => Ok(n),
        }
    }

    /// Fails a device with a command unanswered past the I/O timeout (each
    /// command is timed from its submission, so one lost command is found
    /// even while others keep completing). Scans at most every millisecond.
    fn check_timeouts(&mut self, ring: &mut GioRing) -> Result<()> {
        let now = Instant::now();
        if self.in_flight == 0 || now < self.next_timeout_scan {
            return Ok(());
        }
        self.next_timeout_scan = now + Duration::from_millis(1);
        let late = self
            .ops
            .iter()
            .flatten()
            .find(|o| now.duration_since(o.submitted) >= self.cfg.io_timeout)
            .map(|o| o.dev);
        if let Some(d) = late {
            let why = format!(
                "a command got no completion within {:?} (the I/O timeout)",
                self.cfg.io_timeout
            );
            return Err(self.fail_device(ring, d, why));
        }
        Ok(())
    }
}

impl<B: Bar0 + Send> IoEngine for NvmeEngine<B> {
    fn name(&self) -> &'static str {
        "nvme"
    }

    fn register_memory(&mut self, table: Arc<P2pTable>) -> Result<()> {
        refuse_if_in_flight(self.in_flight)?;
        if table.kind() != MemoryKind::Host {
            return Err(Error::Registration(
                "the nvme engine moves data to and from host memory; GPU memory needs the gpu engine".into(),
            ));
        }
        self.map_table(&table)?;
        self.table = Some(table);
        Ok(())
    }

    fn submit(&mut self, ring: &mut GioRing) -> Result<()> {
        self.accept(ring);
        self.step(ring).map(|_| ())
    }

    fn reap(&mut self, ring: &mut GioRing, wait: bool) -> Result<()> {
        loop {
            let n = self.step(ring)?;
            if n > 0 || !wait || self.in_flight == 0 {
                return self.check_timeouts(ring);
            }
            self.check_timeouts(ring)?;
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
        self.stats
    }

    fn describe(&self) -> String {
        let d = &self.devs[0];
        format!(
            "nvme: {} namespace(s) ({}), queue depth {}, {}, at most {} per command",
            self.devs.len(),
            self.devs
                .iter()
                .map(|d| d.ns.path.display().to_string())
                .collect::<Vec<_>>()
                .join(", "),
            d.free_desc.len() + d.commands,
            if d.sgl { "SGL" } else { "PRP" },
            crate::host::size::human_bytes(d.max_cmd)
        )
    }
}

impl<B: Bar0> Drop for NvmeEngine<B> {
    fn drop(&mut self) {
        // Commands still in flight may DMA into registered memory or our
        // descriptor pages: wait them out (bounded by the I/O timeout),
        // else stop the controller before the mappings go.
        for d in 0..self.devs.len() {
            let deadline = Instant::now() + self.cfg.io_timeout;
            while self.devs[d].commands > 0 && Instant::now() < deadline {
                let ns = self.devs[d].ns.clone();
                let mut shared = ns.lock();
                let mut done: Vec<crate::nvme::Completion<u64>> = Vec::new();
                if let Ok(qp) = shared.ctrl.io_queue(DATA_QUEUE) {
                    let _ = qp.poll_into(usize::MAX, &mut done);
                } else {
                    break;
                }
                self.devs[d].commands -= done.len().min(self.devs[d].commands);
            }
            if self.devs[d].commands > 0 {
                let mut shared = self.devs[d].ns.lock();
                let _ = shared.ctrl.reset_after_failure();
                shared.failed =
                    Some("stopped when its engine was dropped with commands in flight".into());
            }
        }
    }
}
