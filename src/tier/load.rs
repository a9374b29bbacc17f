//! The load path: plan a load's reads layer by layer, verify each layer
//! against the checksums its headers recorded, announce layers in order.

use super::hashing::{hash_entries, layer_crc};
use super::jobs::{Item, Job, LayerCheck, LoadCheck, Step};
use super::{trace, JobId, JobKind, KeyOutcome, LayerDone, Tier};
use crate::error::{Error, Failure, Result};
use crate::memory::MemoryKind;
use crate::p2p::P2pTable;
use crate::plan::{self, PlannedIo};
use crate::pool::layout::PoolLayout;
use crate::pool::{Key, Pool};
use crate::ring::abi::IOCTX_OP_READ;
use std::ops::Range;

impl Tier {
    /// Start loading `keys` into `mem_blocks` for `layers`. Every key must be
    /// in the pool (count them with `lookup_prefix`); they stay pinned until
    /// the job finishes. Layers complete in order; see `layer_events`,
    /// `wait_layer`.
    pub fn submit_load(
        &mut self,
        keys: &[Key],
        mem_blocks: &[u32],
        layers: Range<u32>,
    ) -> Result<JobId> {
        self.load_job(None, keys, mem_blocks, layers)
    }

    /// `submit_load` as job `want` (the caller's numbering) or the next id.
    pub(super) fn load_job(
        &mut self,
        want: Option<JobId>,
        keys: &[Key],
        mem_blocks: &[u32],
        layers: Range<u32>,
    ) -> Result<JobId> {
        let t0 = std::time::Instant::now();
        self.check_mem_blocks(keys, mem_blocks)?;
        let geo = *self.pool.geometry();
        super::check_load_args(geo.layers, mem_blocks, &layers)?;
        if let Some(&b) = mem_blocks
            .iter()
            .find(|&&b| self.jobs.mem_busy(b, JobKind::Store))
        {
            return Err(Error::invalid(format!(
                "memory block {b} is being stored by a job in flight; wait for that store before loading into it"
            )));
        }
        if let Some((b, theirs)) = self.jobs.load_overlap(mem_blocks, &layers) {
            return Err(Error::invalid(format!(
                "memory block {b} is being loaded into (layers {}..{}) by a job in flight; \
                 wait for that load before loading into it again",
                theirs.start, theirs.end
            )));
        }
        let id = self.jobs.claim(want)?;
        let slots = self.hold_job_keys(keys)?;
        let table = self.table()?.clone();
        let verify = self.cfg.verify_loads && table.kind() == MemoryKind::Host;
        // Only the first layer is planned here: it goes to the device at
        // once, and the other layers are planned by the next pump while it
        // is in flight (planning them all first cost 0.9 ms of a 7 ms first
        // layer at 4K tokens).
        let runs = load_runs(self.pool.layout(), &slots);
        let first = self.plan_layer(&slots, &runs, mem_blocks, layers.start, verify);
        self.jobs.insert(Job {
            id,
            kind: JobKind::Load,
            keys: keys.to_vec(),
            mem_blocks: mem_blocks.to_vec(),
            outcomes: vec![None; keys.len()],
            runs,
            items: vec![first],
            sequential: false,
            layers_done: layers.start,
            layers: layers.clone(),
            store: None,
            load: Some(LoadCheck {
                running: vec![0; slots.len()],
                slots,
                verify,
                unplanned: layers.start + 1..layers.end,
            }),
        });
        if let Some(t) = self.trace.as_mut() {
            t.submitted(id, t0, layers);
        }
        self.pump_after_submit();
        Ok(id)
    }

    /// The item of layer `layer` of a load of `slots` into `mem_blocks`.
    fn plan_layer(
        &self,
        slots: &[u64],
        runs: &[Vec<u32>],
        mem_blocks: &[u32],
        layer: u32,
        verify: bool,
    ) -> Item {
        let table = self.table.as_ref().expect("checked by submit_load");
        let (ios, owners) = plan_load_layer(
            self.pool.layout(),
            self.cfg.max_io_bytes,
            slots,
            runs,
            layer,
            |p, layer, kv| table.index(mem_blocks[p as usize], layer, kv),
        );
        let mut item = Item::new(Step::LoadLayer(layer), ios);
        if verify {
            item.check = Some(LayerCheck::new(&item.ios, owners, slots.len()));
        }
        item
    }

    /// Plan the layers of loads that `submit_load` left unplanned. True if
    /// any were.
    pub(super) fn plan_loads(&mut self) -> bool {
        let ids: Vec<JobId> = self
            .jobs
            .live
            .iter()
            .filter(|(_, j)| j.load.as_ref().is_some_and(|l| !l.unplanned.is_empty()))
            .map(|(&id, _)| id)
            .collect();
        for &id in &ids {
            let job = self.jobs.live.get_mut(&id).expect("live job");
            let load = job.load.as_mut().expect("a load");
            let layers = std::mem::replace(&mut load.unplanned, 0..0);
            let verify = load.verify;
            let (slots, runs, mem_blocks) = (
                std::mem::take(&mut load.slots),
                std::mem::take(&mut job.runs),
                std::mem::take(&mut job.mem_blocks),
            );
            let items: Vec<Item> = layers
                .map(|l| self.plan_layer(&slots, &runs, &mem_blocks, l, verify))
                .collect();
            let job = self.jobs.live.get_mut(&id).expect("live job");
            job.items.extend(items);
            job.runs = runs;
            job.mem_blocks = mem_blocks;
            job.load.as_mut().expect("a load").slots = slots;
        }
        !ids.is_empty()
    }

    /// Take the checksums of the objects of load I/Os that landed: with
    /// `next`, only those of the layer each load announces next, on this
    /// thread (the compute waits for that layer: no second thread to start
    /// and schedule first, which on a busy host cost more than it saved);
    /// otherwise all, split over two threads when there is much.
    pub(super) fn hash_landed(&mut self, next: bool) {
        let Some(table) = self.table.as_ref() else {
            self.jobs.landed.clear();
            return;
        };
        let live = &self.jobs.live;
        let is_next = |&(id, ix, _): &(JobId, usize, usize)| {
            live.get(&id)
                .is_some_and(|j| ix == (j.layers_done - j.layers.start) as usize)
        };
        let landed: Vec<(JobId, usize, usize)> = if next {
            let (now, later) = self.jobs.landed.drain(..).partition(is_next);
            self.jobs.landed = later;
            now
        } else {
            std::mem::take(&mut self.jobs.landed)
        };
        if landed.is_empty() {
            return;
        }
        // (job, item, position, K|V, P2P index) of every object landed.
        let mut todo: Vec<(JobId, usize, u32, u8, u32)> = Vec::new();
        for (id, ix, io) in landed {
            let Some(job) = self.jobs.live.get(&id) else {
                continue;
            };
            let item = &job.items[ix];
            let Some(check) = item.check.as_ref() else {
                continue;
            };
            let first = check.first_obj[io] as usize;
            for (j, &seg) in item.ios[io].segs.iter().enumerate() {
                let (p, kv) = check.owners[first + j];
                todo.push((id, ix, p, kv, seg));
            }
        }
        let crcs = hash_entries(table, todo.iter().map(|t| t.4).collect(), !next);
        if let Some(t) = self.trace.as_mut() {
            let mut last = None;
            for &(id, ix, ..) in &todo {
                if last != Some((id, ix)) {
                    let first = self.jobs.live.get(&id).map_or(0, |j| j.layers.start);
                    t.event(id, first + ix as u32, trace::Ev::Hashed);
                    last = Some((id, ix));
                }
            }
        }
        for ((id, ix, p, kv, _), crc) in todo.into_iter().zip(crcs) {
            let check = self.jobs.live.get_mut(&id).expect("live job").items[ix]
                .check
                .as_mut()
                .expect("checked above");
            check.kv_crcs[p as usize][kv as usize] = crc;
        }
    }

    /// Announce the layers of loads that are in memory, in order, each
    /// verified first. Runs after new I/O was handed to the engine, so the
    /// checksum work overlaps the reads of later layers. True if any layer
    /// was announced.
    pub(super) fn advance_loads(&mut self) -> bool {
        let mut any = false;
        let mut ids: Vec<JobId> = self
            .jobs
            .live
            .iter()
            .filter(|(_, j)| j.kind == JobKind::Load && j.layers_done < j.layers.end)
            .map(|(&id, _)| id)
            .collect();
        ids.sort_unstable();
        for id in ids {
            let job = self.jobs.live.get_mut(&id).expect("live job");
            while job.layers_done < job.layers.end {
                let li = (job.layers_done - job.layers.start) as usize;
                // Complete, and every read of it hashed (a pass that
                // hashed only the layer before leaves it for the next).
                if job.items.get(li).is_none_or(|i| !i.complete())
                    || self.jobs.landed.iter().any(|&(j, i, _)| j == id && i == li)
                {
                    break;
                }
                let layer = job.layers_done;
                if job.load.as_ref().is_some_and(|l| l.verify) {
                    if let Some(msg) =
                        verify_layer(job, layer, &mut self.pool, self.table.as_deref())
                    {
                        job.items[li].failed.get_or_insert(msg);
                    }
                }
                self.jobs.layer_events.push_back(LayerDone {
                    job: id,
                    layer,
                    error: job.items[li].failed.clone(),
                });
                if let Some(t) = self.trace.as_mut() {
                    t.event(id, layer, trace::Ev::Announce);
                }
                // The pace of the layers after the first is the window's.
                let now = std::time::Instant::now();
                if let Some(prev) = self.layer_clock.insert(id, now) {
                    let nanos = now.duration_since(prev).as_nanos() as u64;
                    self.window.observe(job.items[li].bytes(), nanos);
                }
                job.layers_done += 1;
                any = true;
            }
        }
        any
    }

    /// Release what a finished load held: its keys' pins.
    pub(super) fn finish_load(&mut self, job: &mut Job) {
        self.layer_clock.remove(&job.id);
        if let Some(t) = self.trace.as_mut() {
            t.finished(job.id);
        }
        let slots = job.load.take().map(|l| l.slots).unwrap_or_default();
        for (i, k) in job.keys.iter().enumerate() {
            let slot = slots.get(i).copied();
            let mut ix = self.pool.index_mut();
            if slot.is_none() || ix.get(k).map(|e| e.slot) == slot {
                ix.unpin_job(k);
            } else if let Some(s) = slot {
                // The key was dropped (its block failed verification)
                // while this load read it.
                ix.release_condemned(s);
            }
            if job.outcomes[i].is_none() {
                job.outcomes[i] = Some(KeyOutcome::Done);
            }
        }
    }
}

/// What a second look at the device found for a layer whose landed bytes
/// differ from their stored checksum.
#[derive(Debug, PartialEq, Eq)]
enum SecondLook {
    /// The device holds the stored bytes, and they are now in memory: the
    /// first transfer went wrong, not the block.
    Healed,
    /// The device holds the stored bytes, but memory still differs after
    /// they were copied in (something else writes that memory block).
    MemoryChanging,
    /// The device's bytes differ too, or cannot be read: the block is bad.
    Damaged(String),
}

/// Read layer `layer` of `slot` from the device again, bypassing the engine,
/// and compare it with `want`, the layer's stored checksum; when it matches,
/// copy it into memory block `mem_block` and check memory once more. A block
/// is condemned (dropped from the pool) only on this evidence: a single bad
/// transfer must not cost a good, acknowledged key.
fn second_look(
    pool: &Pool,
    table: &P2pTable,
    slot: u64,
    layer: u32,
    mem_block: u32,
    want: u32,
) -> SecondLook {
    let obj = pool.geometry().object_bytes() as usize;
    let mut halves = Vec::with_capacity(2);
    for kv in 0..2 {
        let (dev, off) = pool.layout().object_offset(slot, layer, kv);
        let Some(storage) = pool.devices().get(dev as usize) else {
            return SecondLook::Damaged(format!("device #{dev} is not in the pool"));
        };
        let mut buf = crate::host::dio::AlignedBuf::zeroed(obj);
        if let Err(e) = storage.read_exact_at(&mut buf, off) {
            return SecondLook::Damaged(format!("reading it again failed: {e}"));
        }
        halves.push(buf);
    }
    let on_device = halves.iter().fold(0, |crc, h| {
        crate::checksum::crc32c_append(crc, h.as_slice())
    });
    if on_device != want {
        return SecondLook::Damaged("the device returned the same wrong bytes again".into());
    }
    for (kv, h) in halves.iter().enumerate() {
        let d = table
            .entry(table.index(mem_block, layer, kv as u32))
            .expect("a registered memory block");
        debug_assert_eq!(d.len as usize, obj);
        // SAFETY: the descriptor addresses registered host memory of this
        // load's target block, which the load owns until it finishes (stores
        // from it and other loads into it are refused meanwhile).
        unsafe { std::ptr::copy_nonoverlapping(h.as_ptr(), d.addr as *mut u8, obj) };
    }
    if layer_crc(table, mem_block, layer) == want {
        SecondLook::Healed
    } else {
        SecondLook::MemoryChanging
    }
}

/// Verify layer `layer` of every key a load has not already failed. A key
/// whose bytes differ from its stored checksum gets a second look at the
/// device (`second_look`): if the device holds the stored bytes they are
/// copied in and the key is fine (or fails as an I/O error, kept in the
/// pool, when memory keeps changing); otherwise it becomes `Corrupt` and
/// leaves the pool. Returns the first failure (the layer's error).
fn verify_layer(
    job: &mut Job,
    layer: u32,
    pool: &mut Pool,
    table: Option<&P2pTable>,
) -> Option<Failure> {
    let range = job.layers.clone();
    let range_end = layer + 1 == range.end;
    let li = (layer - range.start) as usize;
    let kv_crcs = &job.items[li].check.as_ref()?.kv_crcs;
    let check = job.load.as_mut().expect("a load");
    let mut bad = Vec::new();
    let mut first = None;
    for (p, kv) in kv_crcs.iter().enumerate() {
        if matches!(
            job.outcomes[p],
            Some(KeyOutcome::Failed(_) | KeyOutcome::Corrupt(_))
        ) {
            continue;
        }
        let slot = check.slots[p];
        let crc_now = pool.kv_concat().apply(kv[0], kv[1]);
        let ok = match pool.layer_crc(slot, layer) {
            Some(want) => crc_now == want,
            // Only a whole-block checksum (a model deeper than a header
            // sector's per-layer table, or a header without that table):
            // checkable once the range is in. A range that is not the whole
            // block is completed with the other layers' checksums, read from
            // the device past the engine, so every range is verified.
            None => {
                check.running[p] = pool.layer_concat().apply(check.running[p], crc_now);
                match pool.block_crc(slot) {
                    Some(want) if range_end => {
                        match whole_crc_around(pool, slot, &range, check.running[p]) {
                            Ok(got) => got == want,
                            Err(e) => {
                                let failure = Failure::new(
                                    crate::error::ErrorKind::Io,
                                    format!(
                                        "key {}: its block carries only a whole-block checksum, \
                                         and reading the layers outside {}..{} to verify the \
                                         loaded ones failed ({e}); the block stays in the pool",
                                        job.keys[p], range.start, range.end
                                    ),
                                );
                                job.outcomes[p] = Some(KeyOutcome::Failed(failure.clone()));
                                first.get_or_insert(failure);
                                continue;
                            }
                        }
                    }
                    _ => true,
                }
            }
        };
        if !ok {
            bad.push((p, slot));
        }
    }
    for (p, slot) in bad {
        let key = job.keys[p];
        let (dev, off) = pool.layout().object_offset(slot, layer, 0);
        let device = pool
            .devices()
            .get(dev as usize)
            .map(|d| d.path().display().to_string())
            .unwrap_or_else(|| format!("#{dev}"));
        // Blocks with only a whole-block checksum: the device's copy of the
        // whole block is checked again. Intact there, the transfer went wrong;
        // but layers before this one were announced before they could be
        // verified, so the key fails (as an I/O error, kept in the pool)
        // rather than being healed behind the caller's back.
        let look = match (table, pool.layer_crc(slot, layer)) {
            (Some(t), Some(want)) => {
                Some(second_look(pool, t, slot, layer, job.mem_blocks[p], want))
            }
            (_, None) => Some(match whole_block_on_device(pool, slot) {
                Ok(true) => SecondLook::MemoryChanging,
                Ok(false) => SecondLook::Damaged(
                    "the device holds bytes that do not match the block's checksum".into(),
                ),
                Err(e) => SecondLook::Damaged(format!("reading it again failed: {e}")),
            }),
            (None, Some(_)) => None,
        };
        let damage = match look {
            Some(SecondLook::Healed) => continue,
            Some(SecondLook::MemoryChanging) => {
                let msg = if pool.layer_crc(slot, layer).is_some() {
                    format!(
                        "key {key}: layer {layer} landed in memory block {} with bytes other than \
                         the device's, and that memory changed again after they were copied \
                         in: something else writes it while it is being loaded; the block on \
                         {device} is intact and stays in the pool; load it again once nothing \
                         else writes that memory",
                        job.mem_blocks[p]
                    )
                } else {
                    format!(
                        "key {key}: layers {}..{} landed in memory block {} with bytes other \
                         than the device's (the block carries only a whole-block checksum, so \
                         the layers were announced before they could be checked); the block on \
                         {device} is intact and stays in the pool; load it again",
                        range.start, range.end, job.mem_blocks[p]
                    )
                };
                let failure = Failure::new(crate::error::ErrorKind::Io, msg);
                job.outcomes[p] = Some(KeyOutcome::Failed(failure.clone()));
                first.get_or_insert(failure);
                continue;
            }
            Some(SecondLook::Damaged(why)) => format!(" ({why})"),
            None => String::new(),
        };
        // Only drop the key if the index still maps it to the slot this load
        // read (it may have been dropped and stored anew meanwhile).
        let dropped = if pool.index().get(&key).map(|e| e.slot) == Some(slot) {
            match pool.drop_damaged(&key) {
                Ok(_) => "it was dropped from the pool; store it again".to_string(),
                Err(e) => format!(
                    "it was dropped from the index, but its header could not be cleared ({e})"
                ),
            }
        } else {
            "it was already dropped from the pool".to_string()
        };
        let failure = Failure::corrupt(
            &key.to_string(),
            &device,
            off,
            &format!(
                "layer {layer} (slot {slot}) does not match the checksum stored with it{damage}; {dropped}"
            ),
        );
        job.outcomes[p] = Some(KeyOutcome::Corrupt(failure.clone()));
        first.get_or_insert(failure);
    }
    first
}

/// crc32c of layer `layer` of `slot` as the device holds it (its K then V
/// object), read past the engine.
fn device_layer_crc(pool: &Pool, slot: u64, layer: u32) -> Result<u32> {
    let obj = pool.geometry().object_bytes() as usize;
    let mut buf = crate::host::dio::AlignedBuf::zeroed(obj);
    let mut crc = 0;
    for kv in 0..2 {
        let (dev, off) = pool.layout().object_offset(slot, layer, kv);
        let storage = pool
            .devices()
            .get(dev as usize)
            .ok_or_else(|| Error::invalid(format!("device #{dev} is not in the pool")))?;
        storage.read_exact_at(&mut buf, off)?;
        crc = crate::checksum::crc32c_append(crc, buf.as_slice());
    }
    Ok(crc)
}

/// The whole-block checksum of `slot` with layers `range` taken from a load
/// (`in_range`: their joined checksum) and every other layer from the device.
fn whole_crc_around(pool: &Pool, slot: u64, range: &Range<u32>, in_range: u32) -> Result<u32> {
    let layers = pool.geometry().layers;
    if range.start == 0 && range.end == layers {
        return Ok(in_range);
    }
    let concat = *pool.layer_concat();
    let mut before = None;
    for l in 0..range.start {
        let c = device_layer_crc(pool, slot, l)?;
        before = Some(before.map_or(c, |b| concat.apply(b, c)));
    }
    let range_bytes =
        (range.end - range.start) as usize * 2 * pool.geometry().object_bytes() as usize;
    let mut crc = match before {
        Some(b) => crc32c::crc32c_combine(b, in_range, range_bytes),
        None => in_range,
    };
    for l in range.end..layers {
        crc = concat.apply(crc, device_layer_crc(pool, slot, l)?);
    }
    Ok(crc)
}

/// Whether the device holds `slot`'s whole block as its checksum says.
fn whole_block_on_device(pool: &Pool, slot: u64) -> Result<bool> {
    let Some(want) = pool.block_crc(slot) else {
        return Ok(true);
    };
    let concat = *pool.layer_concat();
    let mut crc = None;
    for l in 0..pool.geometry().layers {
        let c = device_layer_crc(pool, slot, l)?;
        crc = Some(crc.map_or(c, |b| concat.apply(b, c)));
    }
    Ok(crc == Some(want))
}

/// Plan the reads of a load: `slots[p]` is key position p's slot,
/// `seg(p, layer, kv)` the P2P index its object lands in. Returns the runs of
/// positions (a read's `run`) and, per layer of `layers`, its reads (per run
/// one contiguous extent per layer, two when the run is not a whole group)
/// with the (position, K|V) of each object they carry, in order.
#[cfg(test)]
#[allow(clippy::type_complexity)]
pub(super) fn plan_load(
    layout: &PoolLayout,
    max_io_bytes: u64,
    slots: &[u64],
    layers: Range<u32>,
    seg: impl Fn(u32, u32, u32) -> u32,
) -> (Vec<Vec<u32>>, Vec<(Vec<PlannedIo>, Vec<(u32, u8)>)>) {
    let runs = load_runs(layout, slots);
    let per_layer = layers
        .map(|layer| plan_load_layer(layout, max_io_bytes, slots, &runs, layer, &seg))
        .collect();
    (runs, per_layer)
}

/// The runs of key positions whose slots are consecutive in one extent
/// group (each is read by one I/O per layer, or two).
pub(super) fn load_runs(layout: &PoolLayout, slots: &[u64]) -> Vec<Vec<u32>> {
    let positions: Vec<u32> = (0..slots.len() as u32).collect();
    plan::group_runs(layout.group_blocks as u64, slots, &positions)
}

/// The reads of one layer of a load (see `plan_load`).
pub(super) fn plan_load_layer(
    layout: &PoolLayout,
    max_io_bytes: u64,
    slots: &[u64],
    runs: &[Vec<u32>],
    layer: u32,
    seg: impl Fn(u32, u32, u32) -> u32,
) -> (Vec<PlannedIo>, Vec<(u32, u8)>) {
    let mut objects = Vec::new();
    let mut owners = Vec::new();
    for (r, run) in runs.iter().enumerate() {
        for kv in 0..2 {
            for &p in run {
                let (dev, off) = layout.object_offset(slots[p as usize], layer, kv);
                objects.push((dev, off, seg(p, layer, kv), r as u32));
                owners.push((p, kv as u8));
            }
        }
    }
    let ios = plan::coalesce(
        IOCTX_OP_READ,
        layout.geometry.object_bytes(),
        max_io_bytes,
        &objects,
    );
    (ios, owners)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::{DType, KvGeometry};

    #[test]
    fn load_plan_names_the_owner_of_every_object_it_reads() {
        // 3 layers, 4 KiB objects, groups of 4 slots on one device.
        let g = KvGeometry {
            layers: 3,
            kv_heads: 1,
            head_dim: 128,
            dtype: DType::F16,
            block_size: 16,
        };
        let layout = PoolLayout::new(g, 4, vec![4]);
        // Positions 0..4: slots 5, 4, 9, 6 -> runs [1, 0, 3] (slots 4..6) and [2].
        let slots = [5, 4, 9, 6];
        let seg = |p: u32, l: u32, kv: u32| p * 100 + l * 10 + kv;
        let (runs, layers) = plan_load(&layout, 1 << 20, &slots, 1..3, seg);
        assert_eq!(runs, vec![vec![1, 0, 3], vec![2]]);
        assert_eq!(layers.len(), 2, "layers 1 and 2");
        for (i, (ios, owners)) in layers.iter().enumerate() {
            let layer = 1 + i as u32;
            // Run 0 is a whole extent (K of 3 slots then V of 3 slots, with
            // the group's 4th slot between them): two I/Os; run 1 two more.
            assert_eq!(ios.len(), 4, "{ios:?}");
            let segs: Vec<u32> = ios.iter().flat_map(|io| io.segs.clone()).collect();
            assert_eq!(segs.len(), owners.len());
            for (&s, &(p, kv)) in segs.iter().zip(owners) {
                assert_eq!(s, seg(p, layer, kv as u32));
            }
            for io in ios {
                assert_eq!(io.op, IOCTX_OP_READ);
                // Each read starts at its first object's place on the device.
                let (p, kv) = first_owner(io, ios, owners);
                let want = layout.object_offset(slots[p as usize], layer, kv as u32);
                assert_eq!((io.dev, io.offset), want);
            }
        }
    }

    /// The owner of the first object `io` carries.
    fn first_owner(io: &PlannedIo, ios: &[PlannedIo], owners: &[(u32, u8)]) -> (u32, u8) {
        let before: usize = ios
            .iter()
            .take_while(|x| !std::ptr::eq(*x, io))
            .map(|x| x.segs.len())
            .sum();
        owners[before]
    }
}
