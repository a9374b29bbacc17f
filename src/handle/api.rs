//! [`TierApi`]: the handle API, one for every way an engine reaches a pool.
//!
//! An in-process pool ([`TierHandle`], from [`super::TierBuilder::build`])
//! and the node's shared pool through `kvtier serve`
//! (`crate::service::ServiceClient`, from `TierBuilder::service(PATH)`)
//! answer the same calls with the same meaning: an engine adapter written
//! against `&dyn TierApi` runs on either; so does GPU KV memory through the
//! service (`crate::service::StagedServiceClient`, the staged path over the
//! memory the service shares). What differs is said per method (a
//! service's usage is the service's).

use super::{Completions, JobId, LayerCopy, TierHandle};
use crate::error::{Error, Result};
use crate::memory::KvMemory;
use crate::model::KvGeometry;
use crate::pool::Key;
use crate::staged::LoadCounter;
use crate::tier::{JobKind, JobResult};
use std::ops::Range;
use std::time::Duration;

/// The handle API of a pool, in-process or through the node's service.
/// Block numbers are those of [`Self::memory`]; everything is thread-safe.
/// See [`TierHandle`] for each call's contract (threading, memory).
pub trait TierApi: Send + Sync + std::fmt::Debug {
    /// The engine serving the pool (`uring`, `nvme`, `gpu`, ...).
    fn engine(&self) -> &str;
    /// Why that engine; through a service, which service serves the pool.
    fn engine_reason(&self) -> &str;
    /// The pool's KV geometry.
    fn geometry(&self) -> &KvGeometry;
    /// The pool's key namespace (through a service: the service's pool's).
    fn namespace(&self) -> &str;
    /// The model name the pool recorded at its create.
    fn model_name(&self) -> &str;
    /// Blocks of KV memory jobs may name (`0..memory_blocks()`).
    fn memory_blocks(&self) -> u32;
    /// The KV memory as this process sees it, when the handle knows it
    /// (memory kvtier allocated or the service shares); `None` for memory
    /// the caller registered and described itself.
    fn memory(&self) -> Option<&KvMemory>;

    /// How many leading keys the pool holds (0 once closed or gone).
    fn lookup_prefix(&self, keys: &[Key]) -> usize;
    /// Like `lookup_prefix`, and pins the counted keys until `unpin`.
    fn lookup_and_pin(&self, keys: &[Key]) -> usize;
    /// Drop one pin per key; never fails.
    fn unpin(&self, keys: &[Key]);
    /// Whether the pool holds `key`.
    fn contains(&self, key: &Key) -> bool;
    /// Take `keys` out of the pool; returns how many were removed.
    fn remove(&self, keys: &[Key]) -> Result<usize>;

    /// Start loading `keys` into `mem_blocks` for `layers`; returns at once.
    fn submit_load(&self, keys: &[Key], mem_blocks: &[u32], layers: Range<u32>) -> Result<JobId>;
    /// Accept a store of `keys` from `mem_blocks` (all layers).
    fn submit_store(&self, keys: &[Key], mem_blocks: &[u32]) -> Result<JobId>;
    /// Issue every store in the write backlog now.
    fn flush_stores(&self) -> Result<()>;
    /// Which unfinished job of this handle uses memory block `block`.
    fn memory_block_use(&self, block: u32) -> Option<JobKind>;

    /// Block until `job` finishes; its result, handed out once.
    fn wait(&self, job: JobId) -> Result<JobResult>;
    /// Like `wait`; `None` if `job` has not finished within `timeout`.
    fn wait_timeout(&self, job: JobId, timeout: Duration) -> Result<Option<JobResult>>;
    /// The result of `job` if it has finished (then taken), else `None`.
    fn try_result(&self, job: JobId) -> Result<Option<JobResult>>;
    /// Every finished job's result not yet collected.
    fn get_finished(&self) -> Vec<JobResult>;
    /// Block until layer `layer` of load `job` is in memory.
    fn wait_layer(&self, job: JobId, layer: u32) -> Result<()>;
    /// Like `wait_layer`; false if the layer is not in memory by `timeout`.
    fn wait_layer_timeout(&self, job: JobId, layer: u32, timeout: Duration) -> Result<bool>;
    /// For a load into GPU memory on the staged path: once layer `layer`'s
    /// copy into GPU memory is queued, the mark a compute stream waits on
    /// (see [`TierHandle::wait_layer_queued`]); [`LayerCopy::Settled`] when
    /// there is nothing to wait on (host memory, of this process or shared
    /// by a service). `None` if not queued within `timeout`.
    fn wait_layer_queued_timeout(
        &self,
        job: JobId,
        layer: u32,
        timeout: Duration,
    ) -> Result<Option<LayerCopy>>;
    /// The per-layer GPU counter of a load on the staged HBM path
    /// (in-process or through a service); `None` where there is none (host
    /// memory, a finished load).
    fn load_counter(&self, job: JobId) -> Result<Option<LoadCounter>>;
    /// A new stream of this handle's events, with an eventfd.
    fn completions(&self) -> Result<Completions>;

    /// What the pool holds (the service's, shared by its clients), as the
    /// JSON of [`super::HandleUsage`].
    fn usage_json(&self) -> Result<String>;
    /// Finish this handle's jobs and let go of the pool (in-process: issue
    /// the backlog and stop the I/O thread; a service client: disconnect).
    fn close(&self) -> Result<()>;

    /// The in-process handle behind this one, for what only it has
    /// (`None` through a service).
    fn in_process(&self) -> Option<&TierHandle> {
        None
    }
}

impl TierApi for TierHandle {
    fn engine(&self) -> &str {
        TierHandle::engine(self)
    }
    fn engine_reason(&self) -> &str {
        TierHandle::engine_reason(self)
    }
    fn geometry(&self) -> &KvGeometry {
        TierHandle::geometry(self)
    }
    fn namespace(&self) -> &str {
        TierHandle::namespace(self)
    }
    fn model_name(&self) -> &str {
        TierHandle::model_name(self)
    }
    fn memory_blocks(&self) -> u32 {
        TierHandle::memory_blocks(self)
    }
    fn memory(&self) -> Option<&KvMemory> {
        self.shared.host_cache.as_ref().map(|c| c.memory())
    }
    fn lookup_prefix(&self, keys: &[Key]) -> usize {
        TierHandle::lookup_prefix(self, keys)
    }
    fn lookup_and_pin(&self, keys: &[Key]) -> usize {
        TierHandle::lookup_and_pin(self, keys)
    }
    fn unpin(&self, keys: &[Key]) {
        TierHandle::unpin(self, keys)
    }
    fn contains(&self, key: &Key) -> bool {
        TierHandle::contains(self, key)
    }
    fn remove(&self, keys: &[Key]) -> Result<usize> {
        TierHandle::remove(self, keys)
    }
    fn submit_load(&self, keys: &[Key], mem_blocks: &[u32], layers: Range<u32>) -> Result<JobId> {
        TierHandle::submit_load(self, keys, mem_blocks, layers)
    }
    fn submit_store(&self, keys: &[Key], mem_blocks: &[u32]) -> Result<JobId> {
        TierHandle::submit_store(self, keys, mem_blocks)
    }
    fn flush_stores(&self) -> Result<()> {
        TierHandle::flush_stores(self)
    }
    fn memory_block_use(&self, block: u32) -> Option<JobKind> {
        TierHandle::memory_block_use(self, block)
    }
    fn wait(&self, job: JobId) -> Result<JobResult> {
        TierHandle::wait(self, job)
    }
    fn wait_timeout(&self, job: JobId, timeout: Duration) -> Result<Option<JobResult>> {
        TierHandle::wait_timeout(self, job, timeout)
    }
    fn try_result(&self, job: JobId) -> Result<Option<JobResult>> {
        TierHandle::try_result(self, job)
    }
    fn get_finished(&self) -> Vec<JobResult> {
        TierHandle::get_finished(self)
    }
    fn wait_layer(&self, job: JobId, layer: u32) -> Result<()> {
        TierHandle::wait_layer(self, job, layer)
    }
    fn wait_layer_timeout(&self, job: JobId, layer: u32, timeout: Duration) -> Result<bool> {
        TierHandle::wait_layer_timeout(self, job, layer, timeout)
    }
    fn wait_layer_queued_timeout(
        &self,
        job: JobId,
        layer: u32,
        timeout: Duration,
    ) -> Result<Option<LayerCopy>> {
        TierHandle::wait_layer_queued_timeout(self, job, layer, timeout)
    }
    fn load_counter(&self, job: JobId) -> Result<Option<LoadCounter>> {
        TierHandle::load_counter(self, job)
    }
    fn completions(&self) -> Result<Completions> {
        TierHandle::completions(self)
    }
    fn usage_json(&self) -> Result<String> {
        serde_json::to_string(&self.usage()?)
            .map_err(|e| Error::invalid(format!("rendering the handle's usage: {e}")))
    }
    fn close(&self) -> Result<()> {
        TierHandle::close(self)
    }
    fn in_process(&self) -> Option<&TierHandle> {
        Some(self)
    }
}
