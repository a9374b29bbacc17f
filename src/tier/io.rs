//! Driving the engine: put planned I/O into IOCBs, account completions to
//! their jobs, and finish jobs whose work is done.

use super::jobs::{FlushAfter, IocbUse, Item, Step, GROUP_FLUSH};
use super::store::stage_headers;
use super::{trace, JobId, JobKind, JobResult, KeyOutcome, Tier};
use crate::error::{Failure, IoCause, IoFailure, Result};
use crate::plan::PlannedIo;
use crate::pool::layout::SLOT_HEADER_BYTES;
use crate::pool::Pool;
use crate::ring::abi::*;
use crate::ring::IocbId;

impl Tier {
    /// Put planned I/O into IOCBs while IOCBs are free, then hand them to the
    /// engine; then announce (and verify) loaded layers, and finish the jobs
    /// that completes.
    pub(super) fn pump(&mut self) -> Result<()> {
        self.fill_iocbs()?;
        self.io.kick()?;
        // The layers `submit_load` left unplanned, while its first layer's
        // reads are in flight.
        if self.plan_loads() {
            self.fill_iocbs()?;
            self.io.kick()?;
        }
        // Hash what landed while the engine works on what was just handed
        // to it: first the layers the compute waits for next, and announce
        // them; then the rest.
        self.hash_landed(true);
        let mut announced = self.advance_loads();
        if !self.jobs.landed.is_empty() {
            self.hash_landed(false);
            announced |= self.advance_loads();
        }
        if announced {
            self.fill_iocbs()?;
            self.io.kick()?;
        }
        Ok(())
    }

    /// Put planned I/O into IOCBs and finish completed jobs, without
    /// submitting: a wait that follows submits in its own call.
    pub(super) fn fill_iocbs(&mut self) -> Result<()> {
        let mut progressed = true;
        while progressed {
            progressed = false;
            let queue: Vec<JobId> = self.jobs.issue_queue.iter().copied().collect();
            for id in queue {
                while self.issue_one(id)? {
                    progressed = true;
                }
            }
            if self.issue_group_flush()? {
                progressed = true;
            }
            let live = &self.jobs.live;
            self.jobs.issue_queue.retain(|id| {
                live.get(id).is_some_and(|j| {
                    j.items.iter().any(|i| !i.issued())
                        || j.load.as_ref().is_some_and(|l| !l.unplanned.is_empty())
                })
            });
            // Jobs whose work is done (or that had none) finish here.
            // A load finishes once its every layer was announced (verified).
            let done: Vec<JobId> = self
                .jobs
                .live
                .iter()
                .filter(|(_, j)| {
                    j.all_items_complete()
                        && (j.kind != JobKind::Load || j.layers_done == j.layers.end)
                })
                .map(|(&id, _)| id)
                .collect();
            for id in done {
                if self.try_finish(id) {
                    progressed = true;
                }
            }
        }
        Ok(())
    }

    /// Fill one IOCB from the job's next issuable item. False if nothing could be issued.
    fn issue_one(&mut self, id: JobId) -> Result<bool> {
        let Some(job) = self.jobs.live.get_mut(&id) else {
            return Ok(false);
        };
        let Some(ix) = job.items.iter().position(|i| !i.issued()) else {
            return Ok(false);
        };
        if job.sequential && !job.items[..ix].iter().all(Item::complete) {
            return Ok(false);
        }
        if job.kind == JobKind::Load && job.items[ix].next == 0 {
            // The first layer goes alone: the compute waits for it first, and
            // a later layer issued beside it would take a share of the
            // device's bandwidth (4 layers at once made layer 0 take 4x the
            // average layer time at 4K tokens). After it, the look-ahead
            // below keeps the device busy.
            if ix > 0 && !job.items[0].complete() {
                return Ok(false);
            }
            let in_flight: Vec<&Item> = job.items[..ix].iter().filter(|i| !i.complete()).collect();
            let bytes: u64 = in_flight.iter().map(|i| i.bytes()).sum();
            // A grown window brings its look-ahead along: the window is
            // what keeps the device busy.
            let lookahead = self.cfg.load_lookahead_bytes.max(self.window.bytes());
            if in_flight.len() >= 2 && bytes + job.items[ix].bytes() > lookahead {
                return Ok(false);
            }
        }
        if job.kind == JobKind::Load {
            // Few reads in flight at once: they land one after another, so
            // each is hashed while later ones are still on their way (with a
            // whole layer in flight they share the device's bandwidth and
            // all land together at its end), and layer 0 is announced soon
            // after its last read.
            let out: u64 = job.items.iter().map(|i| i.bytes_out).sum();
            let item = &job.items[ix];
            let next = item.ios[item.next..].first().map_or(0, |io| io.len as u64);
            // The first layer in at least two landings with two reads in
            // flight, so all but the last read is hashed while the rest is on
            // its way and the device always has the next read (one at a time
            // left it idle between reads: layer 0 at 4K tokens took 1.42x
            // the average layer against 1.34x, medians of 4 same-run pairs).
            let cap = match ix {
                0 => (item.bytes() / 2).min(self.cfg.first_layer_inflight_bytes),
                _ => self.window.bytes(),
            };
            if out > 0 && out + next > cap {
                return Ok(false);
            }
        }
        if let Some(st) = &job.store {
            if st.abandoned.is_some() {
                // Skip the rest: mark every remaining item issued with nothing.
                for it in &mut job.items[ix..] {
                    it.next = it.ios.len();
                }
                return Ok(false);
            }
        }
        let step = job.items[ix].step;
        if job.store.is_some() && matches!(step, Step::Flush(_)) {
            // Group commit: this step waits for the next group flush, which
            // completes it (`on_group_flush`); it issues nothing itself. It
            // joins only once every write before it has completed (stores
            // run their steps in order): the flush it joins is issued after.
            if !job.items[..ix].iter().all(Item::complete) {
                return Ok(false);
            }
            let item = &mut job.items[ix];
            item.next = item.ios.len();
            item.iocbs_out += 1;
            self.jobs.flush_group.waiting.push((id, ix));
            return Ok(true);
        }
        // Skip I/O for keys that already failed (headers of failed data).
        if step == Step::Headers && job.items[ix].next == 0 {
            let staging = self.staging.as_ref().expect("a store has staging");
            stage_headers(&mut self.pool, staging, job);
        }
        if step == Step::Headers {
            let item = &job.items[ix];
            let keep: Vec<PlannedIo> = item.ios[item.next..]
                .iter()
                .filter(|io| {
                    !job.runs[io.run as usize]
                        .iter()
                        .any(|&p| job.failed(p as usize))
                })
                .cloned()
                .collect();
            let item = &mut job.items[ix];
            item.ios.truncate(item.next);
            item.ios.extend(keep);
            if item.issued() {
                return Ok(true);
            }
        }
        let Some(iocb) = self.io.get_iocb() else {
            return Ok(false);
        };
        let ring = self.io.ring_mut();
        ring.iocb_mut(iocb).hdr.user_data = id;
        let item = &mut job.items[ix];
        let first_io = item.next;
        // A verified load layer goes out in IOCBs of about `max_io_bytes`, so
        // its checksums are taken piece by piece as the reads land instead
        // of all after the layer's last read.
        let cap = match item.check {
            Some(_) => self.cfg.max_io_bytes,
            None => u64::MAX,
        };
        let mut bytes = 0u64;
        while item.next < item.ios.len() && bytes < cap {
            let io = &item.ios[item.next];
            let ctx = IoCtx {
                dev_offset: io.offset,
                len: io.len,
                dev: io.dev,
                op: io.op,
                tag: io.run,
                ..IoCtx::default()
            };
            if ring.push_ctx(iocb, ctx, &io.segs).is_none() {
                break;
            }
            bytes += io.len as u64;
            item.next += 1;
        }
        item.iocbs_out += 1;
        item.bytes_out += bytes;
        self.jobs.iocb_owner.insert(
            iocb,
            IocbUse {
                job: id,
                item: ix,
                first_io,
                bytes,
            },
        );
        if let (Some(t), Step::LoadLayer(layer)) = (self.trace.as_mut(), step) {
            t.event(id, layer, trace::Ev::Issue);
        }
        self.io.submit(iocb)?;
        Ok(true)
    }

    /// Account a completed IOCB to its job.
    pub(super) fn on_iocb(&mut self, iocb: IocbId) {
        let Some(u) = self.jobs.iocb_owner.remove(&iocb) else {
            self.io.release(iocb);
            return;
        };
        if u.job == GROUP_FLUSH {
            self.on_group_flush(iocb);
            return;
        }
        let (id, ix, first_io) = (u.job, u.item, u.first_io);
        let ring = self.io.ring();
        let b = ring.iocb(iocb);
        let mut failures: Vec<(u32, Failure)> = Vec::new();
        let mut media_failures: Vec<IoCtx> = Vec::new();
        let count = b.hdr.count as usize;
        let verify = self
            .jobs
            .live
            .get(&id)
            .is_some_and(|j| j.items[ix].check.is_some());
        if verify {
            for (i, c) in b.ctx[..count].iter().enumerate() {
                if c.status == IOCTX_STATUS_OK {
                    self.jobs.landed.push((id, ix, first_io + i));
                }
            }
        }
        if b.hdr.errors > 0 {
            for c in &b.ctx[..b.hdr.count as usize] {
                if c.status != IOCTX_STATUS_OK {
                    let past_end = past_the_end(c, &self.pool);
                    let mut failure = Failure::from_io(describe_failure(c, &self.pool));
                    if let Some(now) = past_end {
                        failure.message = format!(
                            "I/O error on device {} at offset {} ({} bytes): {}",
                            failure.io.as_ref().map_or("?", |io| io.device.as_str()),
                            c.dev_offset,
                            c.len,
                            shrunk_reason(now, &self.pool, c.dev)
                        );
                    }
                    failures.push((c.tag, failure));
                    if is_media_error(c) || past_end.is_some() {
                        media_failures.push(*c);
                    }
                }
            }
        }
        self.io.release(iocb);
        self.account(id, ix, u.bytes, failures, media_failures);
    }

    /// Issue the next group flush when none is in flight and flush steps
    /// wait: one FLUSH per device any of them wrote, in one IOCB. True if
    /// one was issued.
    fn issue_group_flush(&mut self) -> Result<bool> {
        let g = &self.jobs.flush_group;
        if g.in_flight.is_some() || g.waiting.is_empty() {
            return Ok(false);
        }
        let mut devs: Vec<u16> = g
            .waiting
            .iter()
            .filter_map(|(id, ix)| self.jobs.live.get(id).map(|j| &j.items[*ix]))
            .flat_map(|item| item.ios.iter().map(|io| io.dev))
            .collect();
        devs.sort_unstable();
        devs.dedup();
        let Some(iocb) = self.io.get_iocb() else {
            return Ok(false);
        };
        let ring = self.io.ring_mut();
        // The first waiting job's: a test double that holds one job's I/O
        // holds the flush that job waits for.
        ring.iocb_mut(iocb).hdr.user_data = g.waiting[0].0;
        for dev in devs {
            let ctx = IoCtx {
                dev,
                op: IOCTX_OP_FLUSH,
                ..IoCtx::default()
            };
            // One context per device: far fewer than an IOCB holds.
            let _ = ring.push_ctx(iocb, ctx, &[]);
        }
        let g = &mut self.jobs.flush_group;
        let members = std::mem::take(&mut g.waiting);
        g.issued += 1;
        g.steps += members.len() as u64;
        g.in_flight = Some((iocb, members));
        self.jobs.iocb_owner.insert(
            iocb,
            IocbUse {
                job: GROUP_FLUSH,
                item: 0,
                first_io: 0,
                bytes: 0,
            },
        );
        self.io.submit(iocb)?;
        Ok(true)
    }

    /// A group flush completed: each flush step it served completes, with
    /// the failure of any device of that step whose flush failed.
    fn on_group_flush(&mut self, iocb: IocbId) {
        let members = match self.jobs.flush_group.in_flight.take() {
            Some((id, members)) if id == iocb => members,
            other => {
                self.jobs.flush_group.in_flight = other;
                self.io.release(iocb);
                return;
            }
        };
        let b = self.io.ring().iocb(iocb);
        let failed: Vec<(u16, Failure)> = b.ctx[..b.hdr.count as usize]
            .iter()
            .filter(|c| c.status != IOCTX_STATUS_OK)
            .map(|c| (c.dev, Failure::from_io(describe_failure(c, &self.pool))))
            .collect();
        self.io.release(iocb);
        for (id, ix) in members {
            let Some(job) = self.jobs.live.get(&id) else {
                continue;
            };
            // As its own flush would have failed: per planned flush, the
            // run it serves.
            let failures: Vec<(u32, Failure)> = job.items[ix]
                .ios
                .iter()
                .filter_map(|io| {
                    failed
                        .iter()
                        .find(|(d, _)| *d == io.dev)
                        .map(|(_, f)| (io.run, f.clone()))
                })
                .collect();
            self.account(id, ix, 0, failures, Vec::new());
        }
    }

    /// Account one completed IOCB's worth of item `ix` of job `id`: its
    /// bytes, its failures (per run), the slots its media errors hit.
    fn account(
        &mut self,
        id: JobId,
        ix: usize,
        bytes: u64,
        failures: Vec<(u32, Failure)>,
        media_failures: Vec<IoCtx>,
    ) {
        let job = self.jobs.live.get_mut(&id).expect("IOCB of a live job");
        job.items[ix].iocbs_out -= 1;
        job.items[ix].bytes_out -= bytes;
        let step = job.items[ix].step;
        if let (Some(t), Step::LoadLayer(layer)) = (self.trace.as_mut(), step) {
            t.event(id, layer, trace::Ev::Land);
        }
        if let Some((_, msg)) = failures.first() {
            job.items[ix].failed.get_or_insert_with(|| msg.clone());
        }
        for (run, msg) in &failures {
            job.fail_run(*run, msg);
            if let Some(st) = &mut job.store {
                // A failed flush or invalidation leaves durability unknown for
                // the whole job: stop here.
                if matches!(step, Step::Flush(_) | Step::Invalidate) && st.abandoned.is_none() {
                    st.abandoned = Some(msg.clone());
                }
            }
        }
        if let Some(st) = &mut job.store {
            // A write the device refused with an I/O error marks the slots it
            // covered as bad, so the allocator stops handing them out.
            for c in &media_failures {
                if c.op != IOCTX_OP_WRITE {
                    continue;
                }
                let layout = self.pool.layout();
                let end = c.dev_offset + c.len as u64;
                let hit = |dev: u16, off: u64, len: u64| {
                    dev == c.dev && off < end && c.dev_offset < off + len
                };
                let obj = self.pool.geometry().object_bytes();
                let layers = self.pool.geometry().layers;
                for &p in &job.runs[c.tag as usize] {
                    let Some(slot) = st.slots[p as usize] else {
                        continue;
                    };
                    let (hd, ho) = layout.header_offset(slot);
                    let touched = hit(hd, ho, SLOT_HEADER_BYTES)
                        || (0..layers).any(|l| {
                            (0..2).any(|kv| {
                                let (d, o) = layout.object_offset(slot, l, kv);
                                hit(d, o, obj)
                            })
                        });
                    let bad = if step == Step::Invalidate {
                        &mut st.unwritable_headers
                    } else {
                        &mut st.bad_slots
                    };
                    if touched && !bad.contains(&slot) {
                        bad.push(slot);
                    }
                }
                // An invalidation covers slots that are not this job's keys.
                if step == Step::Invalidate {
                    for &s in &st.invalidated {
                        let (hd, ho) = layout.header_offset(s);
                        if hit(hd, ho, SLOT_HEADER_BYTES) && !st.unwritable_headers.contains(&s) {
                            st.unwritable_headers.push(s);
                        }
                    }
                }
            }
        }
        if let (Some(st), Step::Flush(FlushAfter::Invalidate)) = (&mut job.store, step) {
            if job.items[ix].complete() && st.abandoned.is_none() {
                for &s in &st.invalidated {
                    self.pool.index_mut().header_invalidated(s);
                }
            }
        }
    }

    /// Finish a job whose items are complete. False if it still waits on
    /// another job's store of a shared key.
    fn try_finish(&mut self, id: JobId) -> bool {
        let job = self.jobs.live.get(&id).expect("live job");
        if let Some(st) = &job.store {
            // Wait only for the job that owned the key when this one was
            // submitted (never for a later one: two jobs could wait on each other).
            if st
                .waiting_on
                .iter()
                .any(|&(_, owner)| owner != id && self.jobs.live.contains_key(&owner))
            {
                return false;
            }
        }
        let mut job = self.jobs.remove(id).expect("live job");
        let evicted = match job.kind {
            JobKind::Load => {
                self.finish_load(&mut job);
                Vec::new()
            }
            JobKind::Store => self.finish_store(&mut job),
        };
        self.jobs.finish(JobResult {
            job: id,
            kind: job.kind,
            keys: job.keys,
            outcomes: job
                .outcomes
                .into_iter()
                .map(|o| o.unwrap_or(KeyOutcome::Done))
                .collect(),
            evicted,
        });
        true
    }
}

/// An I/O error that says the device's media failed there (rather than a
/// malformed request, a short transfer or a full filesystem).
fn is_media_error(c: &IoCtx) -> bool {
    match c.status {
        IOCTX_STATUS_ERRNO => c.result as i32 == libc::EIO,
        // NVMe: Media and Data Integrity Errors (status code type 2).
        s if s != IOCTX_STATUS_OK && s < IOCTX_STATUS_ERRNO => (s >> 8) & 0x7 == 2,
        _ => false,
    }
}

/// A write refused because the device now ends before it: a block device
/// that shrank under the pool (the kernel says ENOSPC, as for a full thin
/// device, where the space can come back). Its size now, if so: the slots
/// past the end are gone like bad sectors, and are retired the same way.
fn past_the_end(c: &IoCtx, pool: &Pool) -> Option<u64> {
    if c.op != IOCTX_OP_WRITE || c.status != IOCTX_STATUS_ERRNO || c.result as i32 != libc::ENOSPC {
        return None;
    }
    let now = pool.devices().get(c.dev as usize)?.current_size()?;
    (now < c.dev_offset + c.len as u64).then_some(now)
}

fn shrunk_reason(now: u64, pool: &Pool, dev: u16) -> String {
    let size = pool.devices().get(dev as usize).map_or(0, |d| d.size());
    format!(
        "write failed: the device now ends at {now} bytes, before this write: it shrank \
         under the pool, which uses {size} bytes of it (slots past its end are retired); \
         grow it back to at least {size} bytes"
    )
}

fn describe_failure(c: &IoCtx, pool: &Pool) -> IoFailure {
    let device = pool
        .devices()
        .get(c.dev as usize)
        .map(|d| d.path().display().to_string())
        .unwrap_or_else(|| format!("#{}", c.dev));
    let op = match c.op {
        IOCTX_OP_READ => "read",
        IOCTX_OP_WRITE => "write",
        _ => "flush",
    };
    let cause = match c.status {
        IOCTX_STATUS_ERRNO => IoCause::Errno(c.result as i32),
        IOCTX_STATUS_SHORT => IoCause::Short {
            done: c.result as u64,
        },
        IOCTX_STATUS_INVALID => IoCause::Malformed,
        IOCTX_STATUS_TIMEOUT => IoCause::Timeout,
        s => IoCause::NvmeStatus(s as u32),
    };
    IoFailure {
        device,
        offset: c.dev_offset,
        len: c.len as u64,
        op,
        cause,
    }
}
