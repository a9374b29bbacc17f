//! The load path: a staged load runs as one tier job per (layer, chunk)
//! into a layer buffer; a verified unit is scattered into the paged KV
//! blocks, the load's counter advanced, and the layer announced once the
//! copy is done.

use std::collections::{BTreeMap, VecDeque};
use std::ops::Range;

use super::{HbmLayer, StagedPath, StagingJobs};
use crate::error::{Error, ErrorKind, Failure, Result};
use crate::gpu::staging::{CopyDesc, DeviceCopier};
use crate::gpu::wait::LoadCounter;
use crate::pool::Key;
use crate::tier::{JobId, JobKind, JobResult, KeyOutcome, LayerQueued};

/// A load goes through in *units*: unit `u` is chunk `u % chunks` of layer
/// `u / chunks` (a chunk is up to `load_blocks` of the load's keys in
/// staging order), read into buffer `u % layer_buffers`. A load of at most
/// `load_blocks` keys has one chunk: its units are its layers.
pub(super) struct LoadJob {
    pub(super) keys: Vec<Key>,
    /// Each key's hold token (on the tier: the slot it held when the load
    /// began, for `Tier::release_job_keys`).
    pub(super) slots: Vec<u64>,
    pub(super) hbm: Vec<u32>,
    /// The place of each key position in its chunk's buffer (slot order:
    /// coalesced).
    pub(super) sblock: Vec<u32>,
    /// Positions in staging order; chunk `c` is `order[c * load_blocks..]`.
    pub(super) order: Vec<u32>,
    pub(super) chunks: u32,
    pub(super) layers: Range<u32>,
    pub(super) next_submit: u64,
    pub(super) next_scatter: u64,
    /// Units from here on are not read: no key is left to read.
    pub(super) skipped_from: Option<u64>,
    /// Keys left out of a layer's read (dropped from the pool meanwhile),
    /// by position, and why: that layer's event says so, unless an earlier
    /// layer's read of this load already reported the key failed (it found
    /// the damage itself; through the node service the pool drops the key
    /// before this path has seen that read's result).
    pub(super) dropped: BTreeMap<u32, Vec<(u32, Failure)>>,
    /// Per position: a read of this load reported the key failed.
    pub(super) reported: Vec<bool>,
    /// Landed units not yet scattered: (positions read, tier result).
    pub(super) landed: BTreeMap<u64, (Vec<u32>, Option<JobResult>)>,
    /// Why the layer being scattered failed so far (over its chunks).
    pub(super) layer_error: Option<Failure>,
    /// Units scattered, waiting for their copy.
    pub(super) copying: VecDeque<Copying>,
    pub(super) outcomes: Vec<Option<KeyOutcome>>,
    pub(super) tier_jobs_out: u32,
    pub(super) announced: u32,
    /// Per layer of `layers` announced: why it failed, for `wait_layer`
    /// (the events are drained by the caller).
    pub(super) layer_errors: Vec<Option<Failure>>,
    /// The load's own counter on a GPU: layer `l` done at `base + l - first + 1`.
    pub(super) counter: Option<LoadCounter>,
}

/// A unit whose copy was started.
pub(super) struct Copying {
    pub(super) unit: u64,
    /// The copier's counter value once it is done.
    pub(super) seq: u32,
    /// The last chunk of its layer: the layer's event, with why it failed.
    pub(super) announce: Option<Option<Failure>>,
}

impl LoadJob {
    pub(super) fn units(&self) -> Range<u64> {
        self.layers.start as u64 * self.chunks as u64..self.layers.end as u64 * self.chunks as u64
    }

    /// (layer, chunk) of unit `u`.
    pub(super) fn unit(&self, u: u64) -> (u32, u32) {
        (
            (u / self.chunks as u64) as u32,
            (u % self.chunks as u64) as u32,
        )
    }

    /// Layer `l` is being scattered: keys dropped before its read fail it,
    /// unless a read of this load reported them failed already.
    pub(super) fn note_dropped(&mut self, l: u32) {
        for (p, f) in self.dropped.remove(&l).unwrap_or_default() {
            if !std::mem::replace(&mut self.reported[p as usize], true) {
                self.layer_error.get_or_insert(f);
            }
        }
    }

    /// The positions of chunk `c`, in staging order.
    pub(super) fn chunk(&self, c: u32, load_blocks: u32) -> &[u32] {
        let lb = load_blocks as usize;
        let start = c as usize * lb;
        &self.order[start..(start + lb).min(self.order.len())]
    }
}

impl StagedPath {
    /// Start restoring `keys` into the KV memory's `mem_blocks` for
    /// `layers`. Every key must be in the pool; they stay pinned until the
    /// job ends. Layers complete in order ([`Self::layer_events`]).
    pub fn submit_load(
        &mut self,
        tier: &mut dyn StagingJobs,
        keys: &[Key],
        mem_blocks: &[u32],
        layers: Range<u32>,
    ) -> Result<JobId> {
        self.load_job(tier, None, keys, mem_blocks, layers)
    }

    /// `submit_load` as job `want` (the caller's numbering) or the next id.
    pub(super) fn load_job(
        &mut self,
        tier: &mut dyn StagingJobs,
        want: Option<JobId>,
        keys: &[Key],
        mem_blocks: &[u32],
        layers: Range<u32>,
    ) -> Result<JobId> {
        let id = self.claim(want)?;
        // A load larger than a layer buffer goes in chunks: bounded by the
        // memory's blocks (no two keys to one block).
        self.check_blocks(keys, mem_blocks, u32::MAX, "load")?;
        let g = self.target.geometry;
        crate::tier::check_load_args(g.layers, mem_blocks, &layers)?;
        // Two loads scattering into one block would leave either's bytes
        // under both loads' announcements.
        if let Some(b) = self.block_in_use(mem_blocks, JobKind::Load) {
            return Err(Error::invalid(format!(
                "memory block {b} is the target of a load in flight; wait for that load before loading into it again"
            )));
        }
        if let Some(b) = self.block_in_use(mem_blocks, JobKind::Store) {
            return Err(Error::invalid(format!(
                "memory block {b} is read by a store not yet gathered; wait for that store before loading into it"
            )));
        }
        let slots = tier.hold_keys(keys)?;
        // Staging places in slot order: the pool's coalesced order.
        let mut order: Vec<u32> = (0..keys.len() as u32).collect();
        order.sort_by_key(|&p| slots[p as usize]);
        let lb = self.cfg.load_blocks;
        let mut sblock = vec![0; keys.len()];
        for (i, &p) in order.iter().enumerate() {
            sblock[p as usize] = i as u32 % lb;
        }
        let chunks = (keys.len() as u32).div_ceil(lb);
        let (counter, base) = match self.spare_counters.pop() {
            Some(c) => c,
            None => match self.copier.new_counter() {
                Ok(c) => (c, 0),
                Err(e) => {
                    tier.release_keys(keys, &slots);
                    return Err(e);
                }
            },
        };
        let counter = Some(LoadCounter {
            counter,
            base,
            first_layer: layers.start,
            layers_end: layers.end,
        });
        self.next_job = self.next_job.max(id + 1);
        let layers_len = layers.len();
        self.loads.insert(
            id,
            LoadJob {
                counter,
                keys: keys.to_vec(),
                slots,
                hbm: mem_blocks.to_vec(),
                sblock,
                order,
                chunks,
                next_submit: layers.start as u64 * chunks as u64,
                next_scatter: layers.start as u64 * chunks as u64,
                announced: layers.start,
                layers,
                skipped_from: None,
                landed: BTreeMap::new(),
                dropped: BTreeMap::new(),
                reported: vec![false; keys.len()],
                layer_error: None,
                copying: VecDeque::new(),
                outcomes: vec![None; keys.len()],
                tier_jobs_out: 0,
                layer_errors: vec![None; layers_len],
            },
        );
        self.submit_layers(tier);
        Ok(id)
    }

    /// Submit the next units of loads whose buffers are free.
    pub(super) fn submit_layers(&mut self, tier: &mut dyn StagingJobs) {
        let b = self.cfg.layer_buffers;
        let lb = self.cfg.load_blocks;
        let ids: Vec<JobId> = self.loads.keys().copied().collect();
        for id in ids {
            // A layer's request was just refused: look its keys up again
            // (the check below drops those that left, so each retry has
            // fewer keys and the retries end).
            let mut refused = false;
            loop {
                let job = self.loads.get_mut(&id).expect("listed");
                let u = job.next_submit;
                if u >= job.units().end || job.skipped_from.is_some() {
                    break;
                }
                // The first layer alone until it has landed: read together
                // with the next layers it shares the disk with them and
                // lands with them (about layer_buffers times the average
                // layer's time, seen on an H200's disk and the CPU double),
                // while a compute stream waits for it and nothing else.
                let first = job.units().start;
                let first_layer = first..first + job.chunks as u64;
                if !first_layer.contains(&u)
                    && first_layer
                        .clone()
                        .any(|x| x >= job.next_scatter && !job.landed.contains_key(&x))
                {
                    break;
                }
                let (l, c) = job.unit(u);
                let buf = (u % b as u64) as u32;
                let slot = Self::slot_of(&self.places, buf, l);
                if self.buffers[slot].is_some() {
                    break; // back-pressure: the buffer's copy is not done yet
                }
                if u >= job.next_scatter + self.ahead {
                    break; // as many units ahead of the copies as it may
                }
                // A key another load found damaged left the pool while this
                // one held it: it fails here, alone (named in a layer job, the
                // tier refused the job and every key of the load failed).
                let left = tier.keys_left(&job.keys, &job.slots, std::mem::take(&mut refused));
                for p in (0..job.keys.len()).filter(|&p| left[p]) {
                    if job.outcomes[p].is_none() {
                        let f = Failure::new(
                            ErrorKind::Corrupt,
                            format!(
                                "key {} left the pool before layer {l} was read: another load found its block damaged",
                                job.keys[p]
                            ),
                        );
                        job.dropped.entry(l).or_default().push((p as u32, f.clone()));
                        job.outcomes[p] = Some(KeyOutcome::Corrupt(f));
                    }
                }
                if job.outcomes.iter().all(Option::is_some) {
                    job.skipped_from = Some(u);
                    break;
                }
                let live: Vec<u32> = job
                    .chunk(c, lb)
                    .iter()
                    .copied()
                    .filter(|&p| job.outcomes[p as usize].is_none())
                    .collect();
                if live.is_empty() {
                    // This chunk's keys have all failed, others' have not:
                    // nothing to read, in order with the rest.
                    job.landed.insert(u, (live, None));
                    job.next_submit += 1;
                    continue;
                }
                let keys: Vec<Key> = live.iter().map(|&p| job.keys[p as usize]).collect();
                let places: Vec<u32> = live
                    .iter()
                    .map(|&p| self.layout.load_place(buf, job.sblock[p as usize]))
                    .collect();
                match tier.submit_layer_load(&keys, &places, l) {
                    Ok(t) => {
                        job.next_submit += 1;
                        job.tier_jobs_out += 1;
                        self.buffers[slot] = Some((id, l, u));
                        self.layer_jobs.insert(t, (id, u, live));
                    }
                    Err(e) => {
                        // A key left the pool between the check above and
                        // this submit (through the node service, its loads
                        // run beside this path's): the check drops it, and
                        // the layer is asked for again without it.
                        let left = tier.keys_left(&job.keys, &job.slots, true);
                        if (0..job.keys.len()).any(|p| job.outcomes[p].is_none() && left[p]) {
                            refused = true;
                            continue;
                        }
                        let f = Failure::from(&e).context(format_args!("layer {l}"));
                        for o in job.outcomes.iter_mut().filter(|o| o.is_none()) {
                            *o = Some(KeyOutcome::Failed(f.clone()));
                        }
                        job.layer_error.get_or_insert(f);
                        job.skipped_from = Some(u);
                    }
                }
            }
        }
    }

    /// Layer `l` of a load is done (copied, failed or skipped): the load's
    /// counter must reach its value whatever happened, or a compute stream
    /// waiting on it hangs until a later load reuses the counter. Written
    /// on the copy stream after the copies; if that fails, from the host
    /// (after what the stream holds). The error: the counter is stuck.
    pub(super) fn advance_counter(
        copier: &mut dyn DeviceCopier,
        c: &LoadCounter,
        l: u32,
        copy_failed: bool,
    ) -> Result<()> {
        let v = c.value_for(l);
        if !copy_failed && copier.signal_counter(&c.counter, v).is_ok() {
            return Ok(());
        }
        copier.release_counter(&c.counter, v)
    }

    /// Scatter every landed unit that is next in its load's order.
    pub(super) fn scatter_landed(&mut self) -> Result<()> {
        let b = self.cfg.layer_buffers;
        let lb = self.cfg.load_blocks;
        let ids: Vec<JobId> = self.loads.keys().copied().collect();
        for id in ids {
            loop {
                let job = self.loads.get_mut(&id).expect("listed");
                let u = job.next_scatter;
                if u >= job.units().end {
                    break;
                }
                let (l, c) = job.unit(u);
                let last = c + 1 == job.chunks;
                if job.skipped_from.is_some_and(|s| u >= s) {
                    // Not read: announced with the failure once the copies
                    // before it are done.
                    job.note_dropped(l);
                    if last {
                        let mut error = job.layer_error.take().unwrap_or_else(|| {
                            Failure::new(
                                ErrorKind::Io,
                                format!(
                                    "layer {l} not read: every key of the load failed before it"
                                ),
                            )
                        });
                        if let Some(cnt) = &job.counter {
                            if let Err(e) =
                                Self::advance_counter(self.copier.as_mut(), cnt, l, false)
                            {
                                error = error.context(format_args!(
                                    "and its counter could not be advanced: {e}"
                                ));
                            }
                        }
                        // Announced once the copy stream has passed the
                        // counter write, as a copied layer is.
                        let seq = self.seq.wrapping_add(1);
                        if self.copier.signal(seq).is_ok() {
                            self.seq = seq;
                        }
                        job.copying.push_back(Copying {
                            unit: u,
                            seq: self.seq,
                            announce: Some(Some(error)),
                        });
                    }
                    job.next_scatter += 1;
                    continue;
                }
                let Some((live, r)) = job.landed.remove(&u) else {
                    break;
                };
                job.note_dropped(l);
                if let Some(r) = &r {
                    for (i, &p) in live.iter().enumerate() {
                        if let KeyOutcome::Failed(f) | KeyOutcome::Corrupt(f) = &r.outcomes[i] {
                            job.reported[p as usize] = true;
                            if job.outcomes[p as usize].is_none() {
                                job.outcomes[p as usize] = Some(r.outcomes[i].clone());
                            }
                            job.layer_error.get_or_insert_with(|| f.clone());
                        }
                    }
                }
                let buf = (u % b as u64) as u32;
                let chunk = job.chunk(c, lb);
                let mut list = Vec::with_capacity(2 * chunk.len());
                for kv in 0..2 {
                    for &p in chunk {
                        if job.outcomes[p as usize].is_some() {
                            continue;
                        }
                        list.push(CopyDesc {
                            src: self.staging.dev(Self::place_addr(
                                &self.places,
                                &self.layout,
                                self.layout.load_place(buf, job.sblock[p as usize]),
                                l,
                                kv,
                            )),
                            dst: self.target.object_addr(job.hbm[p as usize], l, kv),
                            len: self.layout.obj as u32,
                            reserved: 0,
                        });
                    }
                }
                let copied = if list.is_empty() {
                    Ok(())
                } else {
                    self.copier.scatter(&list)
                };
                let seq = self.seq.wrapping_add(1);
                // The load's counter only at a layer's last chunk: a compute
                // stream waits for whole layers.
                let copied = copied
                    .and_then(|()| match (&job.counter, last) {
                        (Some(c), true) => self.copier.signal_counter(&c.counter, c.value_for(l)),
                        _ => Ok(()),
                    })
                    .and_then(|()| self.copier.signal(seq));
                if let Err(e) = copied {
                    // Whatever of this copy did start ends before its buffer
                    // can be read into again (its entry below carries no new
                    // counter value to wait for).
                    let _ = self.copier.finish();
                    let mut f =
                        Failure::from(&e).context(format_args!("copying layer {l} to GPU memory"));
                    if let (Some(cnt), true) = (&job.counter, last) {
                        if let Err(e) = Self::advance_counter(self.copier.as_mut(), cnt, l, true) {
                            f = f.context(format_args!(
                                "and its counter could not be advanced: {e}"
                            ));
                        }
                    }
                    for o in job.outcomes.iter_mut().filter(|o| o.is_none()) {
                        *o = Some(KeyOutcome::Failed(f.clone()));
                    }
                    job.layer_error.get_or_insert(f);
                    job.copying.push_back(Copying {
                        unit: u,
                        seq: self.seq,
                        announce: last.then(|| job.layer_error.take()),
                    });
                } else {
                    self.seq = seq;
                    // A whole layer queued with nothing failed: a compute
                    // stream may wait for it on the GPU from now on. (A
                    // failed one only gets its event, once its copies are
                    // done: the host then learns which blocks to drop. A
                    // mark that cannot be recorded means the same.)
                    if last && job.layer_error.is_none() {
                        if let Ok(mark) = self.copier.mark() {
                            self.queued.push(LayerQueued {
                                job: id,
                                layer: l,
                                mark,
                            });
                        }
                    }
                    job.copying.push_back(Copying {
                        unit: u,
                        seq,
                        announce: last.then(|| job.layer_error.take()),
                    });
                }
                job.next_scatter += 1;
            }
        }
        Ok(())
    }

    /// Announce layers whose copies are done, free their buffers, and end
    /// loads with nothing left.
    pub(super) fn retire(&mut self, tier: &mut dyn StagingJobs) -> Result<()> {
        let now = self.copier.signaled()?;
        let b = self.cfg.layer_buffers as u64;
        let mut done = Vec::new();
        for (&id, job) in self.loads.iter_mut() {
            while let Some(front) = job.copying.front() {
                if (now.wrapping_sub(front.seq) as i32) < 0 {
                    break;
                }
                let Copying {
                    unit,
                    seq,
                    announce,
                } = job.copying.pop_front().expect("front");
                let (l, _) = job.unit(unit);
                let slot = Self::slot_of(&self.places, (unit % b) as u32, l);
                if self.buffers[slot] == Some((id, l, unit)) {
                    self.buffers[slot] = None;
                }
                if let Some(error) = announce {
                    job.announced = l + 1;
                    job.layer_errors[(l - job.layers.start) as usize] = error.clone();
                    self.events.push_back(HbmLayer {
                        job: id,
                        layer: l,
                        error,
                        counter: seq,
                    });
                }
            }
            if job.next_scatter >= job.units().end
                && job.copying.is_empty()
                && job.tier_jobs_out == 0
            {
                done.push(id);
            }
        }
        if !done.is_empty() {
            // Marks of loads that finished earlier and were never collected
            // only hold CUDA events: a caller that never collects them must
            // not gather one per layer of every load. (Those of the loads
            // finishing now stay for the next collection, with their
            // layers' events.)
            let loads = &self.loads;
            self.queued.retain(|q| loads.contains_key(&q.job));
        }
        for id in done {
            let job = self.loads.remove(&id).expect("listed");
            tier.release_keys(&job.keys, &job.slots);
            if let Some(c) = job.counter {
                // Layers not copied (failed keys, skipped layers) still
                // reached their values: every scatter signals, and a skipped
                // layer is signalled below, so the last value is final.
                let last = c.value_for(job.layers.end - 1);
                self.spare_counters.push((c.counter, last));
            }
            self.finish(JobResult {
                job: id,
                kind: JobKind::Load,
                keys: job.keys,
                outcomes: job
                    .outcomes
                    .into_iter()
                    .map(|o| o.unwrap_or(KeyOutcome::Done))
                    .collect(),
                evicted: Vec::new(),
            });
        }
        Ok(())
    }
}
