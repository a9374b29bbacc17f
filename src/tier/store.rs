//! The store path: check and deduplicate the keys, allocate slots, stage
//! each new block's header with its checksums, and hand the store protocol
//! (`store_plan`) to the job table; settle the job when it finishes.

use super::hashing::layer_crcs;
use super::headers::{HeaderState, NewBlock, PendingHeaders};
use super::jobs::{Item, Job, StoreState};
use super::store_plan::{plan_store, StoreInputs};
use super::{JobId, JobKind, KeyOutcome, Tier};
use crate::error::{Error, ErrorKind, Failure, Result};
use crate::memory::{DmaBuffer, MemoryKind};
use crate::pool::layout::SLOT_HEADER_BYTES;
use crate::pool::{Key, Pool};
use std::collections::HashSet;
use std::sync::Arc;

/// Below this many bytes of blocks to hash, a store hashes them itself
/// rather than start a worker.
const INLINE_HASH_BYTES: u64 = 32 << 20;

/// Run `work` on a thread `spawn` starts, or here when no thread can be had
/// (`Err` with its result): the OS refusing a thread (a process at its
/// thread limit) slows a store down, never fails or panics it.
fn spawn_or_run<T: Send + 'static>(
    work: impl Fn() -> T + Send + Sync + 'static,
    spawn: impl FnOnce(Box<dyn FnOnce() -> T + Send>) -> std::io::Result<std::thread::JoinHandle<T>>,
) -> std::result::Result<std::thread::JoinHandle<T>, T> {
    // Shared so the work is still here when `spawn` drops the closure it refused.
    let work = std::sync::Arc::new(work);
    let theirs = work.clone();
    match spawn(Box::new(move || theirs())) {
        Ok(h) => Ok(h),
        Err(_) => Err(work()),
    }
}

/// A block the checksum worker hashes, and where its header sector goes.
struct ToHash {
    /// Its index among the store's new blocks.
    block: usize,
    /// Its staging entry.
    entry: u32,
    key: Key,
    generation: u64,
    slot: u64,
    mem_block: u32,
}

/// Put every header of a store into its staging entry, just before the
/// header writes (its data is on the device by then): most were built by
/// the checksum worker while the data was being written.
pub(super) fn stage_headers(pool: &mut Pool, staging: &Staging, job: &mut Job) {
    let st = job.store.as_mut().expect("a store");
    let Some(pending) = st.headers.take() else {
        return;
    };
    let mut sector = vec![0u8; SLOT_HEADER_BYTES as usize];
    for (b, state) in pending.join() {
        match state {
            HeaderState::Built {
                layer_crcs,
                data_crc,
            } => pool.set_slot_crcs(b.slot, Some(data_crc), Some(&layer_crcs)),
            HeaderState::Todo(crcs) => {
                let p = b.pos as usize;
                pool.write_header_sector(
                    &mut sector,
                    &job.keys[p],
                    b.slot,
                    st.generations[p],
                    crcs.as_deref(),
                );
                let ptr = staging.entry_ptr(b.header_seg - staging.first_index);
                // SAFETY: a staging entry is 4 KiB owned by this job until it finishes.
                unsafe {
                    std::ptr::copy_nonoverlapping(sector.as_ptr(), ptr, sector.len());
                }
            }
        }
    }
}

/// The header staging arena: 4 KiB buffers registered in the P2P table.
pub(super) struct Staging {
    /// Shared with checksum workers, which build header sectors in it.
    pub(super) map: Arc<DmaBuffer>,
    pub(super) first_index: u32,
    pub(super) free: Vec<u32>,
}

impl Staging {
    /// Entry 0 stays all-zero: it is the source of header invalidations.
    pub(super) const ZERO: u32 = 0;

    fn entry_ptr(&self, i: u32) -> *mut u8 {
        entry_ptr(&self.map, i)
    }
}

/// Entry `i` of a staging arena.
fn entry_ptr(map: &DmaBuffer, i: u32) -> *mut u8 {
    assert!((i as usize + 1) * SLOT_HEADER_BYTES as usize <= map.len());
    // SAFETY: inside the arena (checked above).
    unsafe {
        map.as_mut_ptr()
            .add(i as usize * SLOT_HEADER_BYTES as usize)
    }
}

impl Tier {
    /// Start storing `keys` from `mem_blocks` (all layers). Keys already in
    /// the pool, or being stored by another job, cost no I/O. Evicts
    /// least-recently-used unpinned blocks when the pool is full; refuses with
    /// `PoolFull` if everything is pinned.
    pub fn submit_store(&mut self, keys: &[Key], mem_blocks: &[u32]) -> Result<JobId> {
        self.submit_store_with_crcs(keys, mem_blocks, None)
    }

    /// `submit_store` with the data checksums of some blocks already taken
    /// (`crcs[i]` for `keys[i]`, by [`Tier::layer_crcs`] on another thread), so
    /// that the thread that owns the tier does not spend its time hashing.
    /// Missing ones (`None`) are computed here.
    pub fn submit_store_with_crcs(
        &mut self,
        keys: &[Key],
        mem_blocks: &[u32],
        crcs: Option<&[Option<Vec<u32>>]>,
    ) -> Result<JobId> {
        self.store_job(None, keys, mem_blocks, crcs)
    }

    /// `submit_store_with_crcs` as job `want` (the caller's numbering) or
    /// the next id.
    pub(super) fn store_job(
        &mut self,
        want: Option<JobId>,
        keys: &[Key],
        mem_blocks: &[u32],
        crcs: Option<&[Option<Vec<u32>>]>,
    ) -> Result<JobId> {
        if crcs.is_some_and(|c| c.len() != keys.len()) {
            return Err(Error::invalid("one checksum slot per key is needed"));
        }
        self.check_mem_blocks(keys, mem_blocks)?;
        let geo = *self.pool.geometry();
        // Given checksums go into the headers unchecked: a list that is not
        // one per layer was acknowledged, then every load of the block
        // failed as corrupt (and dropped it).
        if let Some(c) = crcs
            .into_iter()
            .flatten()
            .flatten()
            .find(|c| c.len() != geo.layers as usize)
        {
            return Err(Error::invalid(format!(
                "a block's checksum list has {} entries; give one crc32c per layer ({} layers)",
                c.len(),
                geo.layers
            )));
        }
        let mut outcomes = vec![None; keys.len()];
        let mut new_pos: Vec<u32> = Vec::new();
        if let Some(&b) = mem_blocks
            .iter()
            .find(|&&b| self.jobs.mem_busy(b, JobKind::Load))
        {
            return Err(Error::invalid(format!(
                "memory block {b} is the target of a load in flight; wait for that load before storing from it"
            )));
        }
        let this_job = self.jobs.claim(want)?;
        let mut waiting_on = Vec::new();
        let mut in_job = HashSet::new();
        let mut already = Vec::new();
        for (i, k) in keys.iter().enumerate() {
            let stored = {
                let mut ix = self.pool.index_mut();
                let stored = ix.get(k).is_some();
                if stored {
                    ix.touch(k);
                }
                stored
            };
            if stored {
                outcomes[i] = Some(KeyOutcome::AlreadyStored);
                already.push(*k);
            } else if let Some(&owner) = self.jobs.storing.get(k) {
                waiting_on.push((i, owner));
            } else if !in_job.insert(*k) {
                waiting_on.push((i, this_job));
            } else {
                new_pos.push(i as u32);
            }
        }
        let n = new_pos.len();
        let staging_cap = self.cfg.header_staging as usize - 1;
        if n > staging_cap {
            return Err(Error::invalid(format!(
                "a store of {n} new blocks exceeds the header staging of {staging_cap}; split the job or raise TierConfig::header_staging"
            )));
        }
        self.table()?;
        // Wait for stores in flight to return staging buffers if needed.
        while self.staging.as_ref().map_or(0, |s| s.free.len()) < n {
            if self.jobs.iocb_owner.is_empty() && self.jobs.live.is_empty() {
                return Err(Error::Ring(
                    "header staging exhausted with nothing in flight".into(),
                ));
            }
            self.wait_any()?;
        }
        // Keys reported as already stored must not be evicted by this very
        // job's allocation: hold them while it runs.
        let alloc = {
            let mut ix = self.pool.index_mut();
            for k in &already {
                ix.pin_job(k);
            }
            let alloc = ix.allocate(n as u64);
            for k in &already {
                ix.unpin_job(k);
            }
            alloc
        }?;
        let table = self.table()?.clone();
        let staging = self.staging.as_mut().expect("registered");
        let stage: Vec<u32> = (0..n)
            .map(|_| staging.free.pop().expect("counted"))
            .collect();

        let mut slots = vec![None; keys.len()];
        let mut generations = vec![0; keys.len()];
        for (j, &p) in new_pos.iter().enumerate() {
            slots[p as usize] = Some(alloc.slots[j]);
            generations[p as usize] = self.pool.next_generation();
            self.jobs.storing.insert(keys[p as usize], this_job);
        }
        let first_seg = self.staging.as_ref().expect("registered").first_index;
        let blocks: Vec<NewBlock> = new_pos
            .iter()
            .zip(&stage)
            .map(|(&p, &st)| NewBlock {
                pos: p,
                slot: slots[p as usize].expect("new key"),
                mem_block: mem_blocks[p as usize],
                header_seg: first_seg + st,
            })
            .collect();
        // The data checksums the headers record: given, or taken here for a
        // small store, or on a worker while the data is being written (a
        // 64K-token llama3-8b store hashes 8 GiB: ~0.5 s of CPU that would
        // otherwise delay the first data write).
        let mut states: Vec<HeaderState> = blocks
            .iter()
            .map(|b| HeaderState::Todo(crcs.and_then(|c| c[b.pos as usize].clone())))
            .collect();
        let mut worker = None;
        if table.kind() == MemoryKind::Host {
            let missing: Vec<usize> = (0..blocks.len())
                .filter(|&j| matches!(states[j], HeaderState::Todo(None)))
                .collect();
            if missing.len() as u64 * geo.block_bytes() <= INLINE_HASH_BYTES {
                for j in missing {
                    states[j] = HeaderState::Todo(Some(layer_crcs(
                        &table,
                        blocks[j].mem_block,
                        geo.layers,
                    )));
                }
            } else {
                // The worker builds each block's header sector in its staging
                // entry as soon as it has the block's checksums.
                let staging = self.staging.as_ref().expect("registered");
                let arena = staging.map.clone();
                let work: Vec<ToHash> = missing
                    .iter()
                    .map(|&j| {
                        let b = &blocks[j];
                        ToHash {
                            block: j,
                            entry: b.header_seg - first_seg,
                            key: keys[b.pos as usize],
                            generation: generations[b.pos as usize],
                            slot: b.slot,
                            mem_block: b.mem_block,
                        }
                    })
                    .collect();
                let writer = self.pool.header_writer();
                let table = table.clone();
                let layers = geo.layers;
                let hash = move || -> Vec<(usize, HeaderState)> {
                    work.iter()
                        .map(|w| {
                            let layer_crcs = layer_crcs(&table, w.mem_block, layers);
                            let ptr = entry_ptr(&arena, w.entry);
                            // SAFETY: the block's staging entry (4 KiB) is
                            // this job's, and nothing else touches it until
                            // the job stages its headers or finishes, both
                            // of which join this worker first; `arena` keeps
                            // the memory alive.
                            let sector = unsafe {
                                std::slice::from_raw_parts_mut(ptr, SLOT_HEADER_BYTES as usize)
                            };
                            let data_crc = writer
                                .write(sector, &w.key, w.slot, w.generation, Some(&layer_crcs))
                                .expect("built from checksums");
                            (
                                w.block,
                                HeaderState::Built {
                                    layer_crcs,
                                    data_crc,
                                },
                            )
                        })
                        .collect()
                };
                match spawn_or_run(hash, |f| {
                    std::thread::Builder::new()
                        .name("kvtier-store-crc".into())
                        .spawn(f)
                }) {
                    Ok(w) => worker = Some(w),
                    Err(got) => {
                        for (j, state) in got {
                            states[j] = state;
                        }
                    }
                }
            }
        }
        let plan = plan_store(
            &StoreInputs {
                layout: self.pool.layout(),
                max_io_bytes: self.cfg.max_io_bytes,
                keys: keys.len(),
                blocks: &blocks,
                invalidate: &alloc.needs_invalidate,
                zero_seg: first_seg + Staging::ZERO,
            },
            |mem, layer, kv| table.index(mem, layer, kv),
        );
        let runs = plan.runs;
        let items = plan
            .steps
            .into_iter()
            .map(|(step, ios)| Item::new(step, ios))
            .collect();

        let id = self.jobs.insert(Job {
            id: this_job,
            kind: JobKind::Store,
            keys: keys.to_vec(),
            mem_blocks: mem_blocks.to_vec(),
            outcomes,
            runs,
            items,
            sequential: true,
            layers: 0..0,
            layers_done: 0,
            store: Some(StoreState {
                slots,
                generations,
                staging: stage,
                invalidated: alloc.needs_invalidate,
                waiting_on,
                evicted: alloc.evicted,
                abandoned: None,
                bad_slots: Vec::new(),
                unwritable_headers: Vec::new(),
                headers: Some(PendingHeaders {
                    blocks,
                    states,
                    worker,
                }),
            }),
            load: None,
        });
        debug_assert_eq!(id, this_job);
        self.pump_after_submit();
        Ok(id)
    }

    /// Settle a finished store: commit the keys whose data and headers are
    /// durable, give back the slots of the rest, retire slots the device
    /// refused, return the header staging. Returns the keys it evicted.
    pub(super) fn finish_store(&mut self, job: &mut Job) -> Vec<Key> {
        let mut st = job.store.take().expect("store state");
        // A worker still hashing reads the job's memory: wait for it before
        // the memory is free to be loaded into.
        if let Some(h) = st.headers.take() {
            h.join();
        }
        // Slots are retired only when the device still completed the
        // job's flushes: a device that fails everything (gone, or
        // power lost) would otherwise retire every slot it was asked
        // to write, for a fault that is not in those sectors.
        let retire = st.abandoned.is_none();
        for (i, k) in job.keys.iter().enumerate() {
            if let Some(slot) = st.slots[i] {
                self.jobs.storing.remove(k);
                let ok = st.abandoned.is_none() && !job.failed(i);
                if ok {
                    self.pool.index_mut().commit(*k, slot, st.generations[i]);
                    job.outcomes[i] = Some(KeyOutcome::Done);
                } else {
                    // Its header may have reached the device before a
                    // later failure: treat it as stale until rewritten.
                    let mut ix = self.pool.index_mut();
                    ix.abort(slot);
                    ix.mark_stale_header(slot);
                    if (retire && st.bad_slots.contains(&slot))
                        || st.unwritable_headers.contains(&slot)
                    {
                        ix.retire(slot);
                    }
                    drop(ix);
                    if job.outcomes[i].is_none() {
                        let why = st
                            .abandoned
                            .clone()
                            .unwrap_or_else(|| Failure::new(ErrorKind::Internal, "store failed"));
                        job.outcomes[i] = Some(KeyOutcome::Failed(why));
                    }
                }
            }
        }
        for &(p, _) in &st.waiting_on {
            job.outcomes[p] = Some(if self.pool.index().get(&job.keys[p]).is_some() {
                KeyOutcome::AlreadyStored
            } else {
                KeyOutcome::Failed(Failure::new(
                    ErrorKind::Io,
                    "another job storing the same key failed; store it again",
                ))
            });
        }
        // A failed invalidation abandons its job before any flush could
        // tell one bad sector from a device failing everything, so its
        // slots leave use in memory only (not recorded on the device): a
        // sector that is really bad fails once more after a reopen and is
        // taken out again, and one that was not comes back.
        for &s in &st.unwritable_headers {
            self.pool.index_mut().retire(s);
        }
        if retire && !st.bad_slots.is_empty() {
            // Retired in memory whatever happens; if the bad table
            // cannot be written the slots fail again after a reopen
            // and are retired again, which loses nothing stored.
            let _ = self.pool.retire_slots(&st.bad_slots);
        }
        if let Some(staging) = self.staging.as_mut() {
            staging.free.extend(st.staging);
        }
        st.evicted
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A refused thread: the work runs on the caller's thread and its
    /// result comes back, with no panic.
    #[test]
    fn refused_thread_runs_the_work_here() {
        let data: Vec<u32> = (0..1000).collect();
        let work = move || data.iter().map(|&x| x as u64).sum::<u64>();
        let got = spawn_or_run(work.clone(), |_| {
            Err(std::io::Error::new(
                std::io::ErrorKind::WouldBlock,
                "Resource temporarily unavailable",
            ))
        });
        assert_eq!(got.err(), Some(499_500));
        let h = spawn_or_run(work, |f| std::thread::Builder::new().spawn(f)).unwrap();
        assert_eq!(h.join().unwrap(), 499_500);
    }
}
