//! The store path: a staged store is gathered from the KV memory into the
//! store area with a crc32c per object (on the GPU), in chunks as the area
//! frees, each chunk one tier store with the combined per-layer checksums.

use super::{StagedPath, StagingJobs};
use crate::error::{Error, ErrorKind, Failure, Result};
use crate::gpu::staging::CopyDesc;
use crate::pool::Key;
use crate::tier::{JobId, JobKind, JobResult, KeyOutcome};

/// One tier store of a staged store: a chunk of at most
/// `StagingConfig::store_chunk()` keys.
pub(super) struct StoreJob {
    pub(super) id: JobId,
    /// Position of the chunk's first key in the staged store.
    pub(super) offset: usize,
    pub(super) places: Vec<u32>,
    /// The places went back to the store area once the chunk's data was
    /// written (its tier store still flushes and writes headers).
    pub(super) released: bool,
}

/// A staged store, whose chunks are tier stores.
pub(super) struct StoreAgg {
    pub(super) keys: Vec<Key>,
    pub(super) mem_blocks: Vec<u32>,
    pub(super) outcomes: Vec<Option<KeyOutcome>>,
    pub(super) evicted: Vec<Key>,
    pub(super) chunks_out: usize,
    /// Keys from here on are in chunks not yet gathered: they go out as
    /// store staging frees (`poll`), never with the caller's thread waiting.
    pub(super) next: usize,
}

impl StagedPath {
    /// Start storing `keys` from the KV memory's `mem_blocks` (all layers).
    /// The blocks are gathered into staging with their checksums (on the
    /// GPU) in chunks of `StagingConfig::store_chunk()`, as store staging
    /// has room (several chunks at once when the store area holds several,
    /// each gathered while the ones before are written): what fits now is
    /// gathered before this returns, the rest by later polls,
    /// so the memory blocks must not be written until the store ends (loads
    /// into blocks not yet gathered are refused). Nothing here waits for a
    /// device: a caller holding a lock (the handle's I/O thread holds the
    /// index's) would hold everyone up while earlier chunks land. Chunks
    /// go out in submission order, a store's behind the stores before it.
    /// An error means nothing was accepted; a chunk that fails later fails
    /// its keys in the job's result.
    pub fn submit_store(
        &mut self,
        tier: &mut dyn StagingJobs,
        keys: &[Key],
        mem_blocks: &[u32],
    ) -> Result<JobId> {
        self.store_job(tier, None, keys, mem_blocks)
    }

    /// `submit_store` as job `want` (the caller's numbering) or the next id.
    pub(super) fn store_job(
        &mut self,
        tier: &mut dyn StagingJobs,
        want: Option<JobId>,
        keys: &[Key],
        mem_blocks: &[u32],
    ) -> Result<JobId> {
        let id = self.claim(want)?;
        self.check_blocks(keys, mem_blocks, u32::MAX, "store")?;
        if let Some(b) = self.block_in_use(mem_blocks, JobKind::Load) {
            return Err(Error::invalid(format!(
                "memory block {b} is the target of a load in flight; wait for that load before storing from it"
            )));
        }
        let behind = self.stores.values().any(|a| a.next < a.keys.len());
        self.stores.insert(
            id,
            StoreAgg {
                keys: keys.to_vec(),
                mem_blocks: mem_blocks.to_vec(),
                outcomes: vec![None; keys.len()],
                evicted: Vec::new(),
                chunks_out: 0,
                next: 0,
            },
        );
        if !behind {
            if let Err(e) = self.push_chunks(tier, id) {
                self.stores.remove(&id);
                return Err(e);
            }
        }
        self.next_job = self.next_job.max(id + 1);
        self.finish_stores();
        Ok(id)
    }

    /// Gather and hand to the tier the chunks of store `id` that store
    /// staging has room for now. An error only for its first chunk (then
    /// nothing of the store went out); a later chunk's fails its keys.
    pub(super) fn push_chunks(&mut self, tier: &mut dyn StagingJobs, id: JobId) -> Result<()> {
        let chunk = self.cfg.store_chunk() as usize;
        loop {
            let Some(a) = self.stores.get_mut(&id) else {
                return Ok(());
            };
            let (start, len) = (a.next, a.keys.len());
            let end = (start + chunk).min(len);
            if start >= len || self.store_free.len() < end - start {
                return Ok(());
            }
            let keys = std::mem::take(&mut a.keys);
            let mem = std::mem::take(&mut a.mem_blocks);
            let r = self.store_chunk(tier, &keys[start..end], &mem[start..end], &keys[..start]);
            let a = self.stores.get_mut(&id).expect("in the table");
            a.keys = keys;
            a.mem_blocks = mem;
            a.next = end;
            match r {
                Ok((t, places)) => {
                    a.chunks_out += 1;
                    self.store_jobs.insert(
                        t,
                        StoreJob {
                            id,
                            offset: start,
                            places,
                            released: false,
                        },
                    );
                }
                Err(e) if start == 0 => return Err(e),
                Err(e) => {
                    let f = Failure::from(&e);
                    for o in &mut a.outcomes[start..end] {
                        *o = Some(KeyOutcome::Failed(f.clone()));
                    }
                }
            }
        }
    }

    /// Push the chunks waiting for store staging, oldest store first.
    pub(super) fn push_stores(&mut self, tier: &mut dyn StagingJobs) {
        let mut ids: Vec<JobId> = self
            .stores
            .iter()
            .filter(|(_, a)| a.next < a.keys.len())
            .map(|(&id, _)| id)
            .collect();
        ids.sort_unstable();
        for id in ids {
            while let Err(e) = self.push_chunks(tier, id) {
                // A first chunk failing after the store was accepted fails
                // its keys; the rest goes on.
                let f = Failure::from(&e);
                let a = self.stores.get_mut(&id).expect("listed");
                let end = a.next;
                for o in &mut a.outcomes[..end] {
                    *o = Some(KeyOutcome::Failed(f.clone()));
                }
            }
            if self.stores.get(&id).is_some_and(|a| a.next < a.keys.len()) {
                break; // later stores wait behind this one
            }
        }
    }

    /// Gather one chunk into free store places (the caller made sure there
    /// are enough) and hand it to the tier: (tier job, places).
    pub(super) fn store_chunk(
        &mut self,
        tier: &mut dyn StagingJobs,
        keys: &[Key],
        mem_blocks: &[u32],
        earlier: &[Key],
    ) -> Result<(JobId, Vec<u32>)> {
        if self.store_free.len() < keys.len() {
            return Err(Error::internal("store staging has no room for a chunk"));
        }
        // The keys earlier chunks of this store have put in the pool are
        // held while this chunk allocates, as one tier store holds its own
        // keys: the staged store must not evict what it reports stored (a
        // later chunk evicted the first chunks' blocks, all reported Done).
        let (held, slots) = tier.hold_present(earlier)?;
        let places = take_places(&mut self.store_free, keys.len());
        let r = self.gather_and_store(tier, keys, mem_blocks, &places);
        tier.release_keys(&held, &slots);
        match r {
            Ok(t) => Ok((t, places)),
            Err(e) => {
                self.store_free.extend(places);
                Err(e)
            }
        }
    }

    /// Report staged stores whose chunks have all ended.
    pub(super) fn finish_stores(&mut self) {
        let done: Vec<JobId> = self
            .stores
            .iter()
            .filter(|(_, a)| a.chunks_out == 0 && a.next >= a.keys.len())
            .map(|(&id, _)| id)
            .collect();
        for id in done {
            let a = self.stores.remove(&id).expect("listed");
            self.finish(JobResult {
                job: id,
                kind: JobKind::Store,
                keys: a.keys,
                outcomes: a
                    .outcomes
                    .into_iter()
                    .map(|o| {
                        o.unwrap_or_else(|| {
                            KeyOutcome::Failed(Failure::new(
                                ErrorKind::Internal,
                                "a staged store chunk ended without an outcome for this key",
                            ))
                        })
                    })
                    .collect(),
                evicted: a.evicted,
            });
        }
    }

    pub(super) fn gather_and_store(
        &mut self,
        tier: &mut dyn StagingJobs,
        keys: &[Key],
        mem_blocks: &[u32],
        places: &[u32],
    ) -> Result<JobId> {
        let g = self.target.geometry;
        let obj = self.layout.obj;
        let mut list = Vec::with_capacity(keys.len() * g.objects_per_block() as usize);
        for (i, &b) in mem_blocks.iter().enumerate() {
            for layer in 0..g.layers {
                for kv in 0..2 {
                    list.push(CopyDesc {
                        src: self.target.object_addr(b, layer, kv),
                        dst: self.staging.dev(Self::place_addr(
                            &self.places,
                            &self.layout,
                            places[i],
                            layer,
                            kv,
                        )),
                        len: obj as u32,
                        reserved: 0,
                    });
                }
            }
        }
        let t_gather = self.store_trace.map(|t0| t0.elapsed());
        self.copier.gather_crc32c(&list)?;
        let crcs = self.copier.finish()?;
        if let (Some(t0), Some(a)) = (self.store_trace, t_gather) {
            eprintln!(
                "kvtier staged store: gathered {} blocks {:.2}..{:.2} ms ({} chunks out before it)",
                keys.len(),
                a.as_secs_f64() * 1e3,
                t0.elapsed().as_secs_f64() * 1e3,
                self.store_jobs.len()
            );
        }
        if crcs.len() != list.len() {
            return Err(Error::gpu(
                "staging gather",
                format!("{} checksums for {} copies", crcs.len(), list.len()),
            ));
        }
        // A layer's checksum covers K then V: combine the two objects'
        // through the precomputed shift (`crc32c_combine` rebuilt it per
        // call: 15 us each, 30 ms per 64-block chunk of llama3-8b on the
        // thread that drives the writes).
        let per_key: Vec<Option<Vec<u32>>> = crcs
            .chunks_exact(g.objects_per_block() as usize)
            .map(|c| {
                Some(
                    c.chunks_exact(2)
                        .map(|kv| self.kv_concat.apply(kv[0], kv[1]))
                        .collect(),
                )
            })
            .collect();
        tier.submit_chunk_store(keys, places, &per_key)
    }
}

/// Take `n` places from `free` (at least `n` of them): the lowest run of
/// `n` consecutive places where there is one, else the lowest `n`, in
/// ascending order either way. A chunk's blocks then sit side by side in
/// each layer of the store area (layer-major), so a write of one layer's
/// K (or V) objects of consecutive slots is one span of staging, not a
/// segment per block (best effort: places free in the order chunks are
/// written, and slots come from the pool's allocator).
pub(super) fn take_places(free: &mut Vec<u32>, n: usize) -> Vec<u32> {
    free.sort_unstable();
    let start = (0..=free.len().saturating_sub(n))
        .find(|&i| n > 0 && free[i + n - 1] - free[i] == n as u32 - 1)
        .unwrap_or(0);
    free.drain(start..start + n).collect()
}

#[cfg(test)]
mod tests {
    use super::take_places;

    #[test]
    fn places_are_the_lowest_consecutive_run_else_the_lowest() {
        let mut free = vec![9, 2, 0, 5, 6, 7, 3];
        assert_eq!(take_places(&mut free, 3), vec![5, 6, 7]);
        assert_eq!(free, vec![0, 2, 3, 9]);
        assert_eq!(take_places(&mut free, 2), vec![2, 3]);
        assert_eq!(take_places(&mut free, 2), vec![0, 9]);
        assert!(free.is_empty());
        let mut one = vec![4, 1];
        assert_eq!(take_places(&mut one, 1), vec![1]);
        assert_eq!(take_places(&mut one, 0), Vec::<u32>::new());
        assert_eq!(one, vec![4]);
    }
}
