//! [`StagedServiceClient`]: the handle API ([`TierApi`]) over the node's
//! service for KV memory in GPU memory, on the staged path of
//! `crate::staged`, with the service's reads and writes where the
//! in-process staged path has its tier's.
//!
//! What is shared with the service is what it already shares with every
//! client: the client's slice of its arena (a sealed memfd mapped in both
//! processes). Here that slice is the staging: its first blocks are the
//! staged path's round-robin layer buffers, the next its store area; on a
//! GPU it is registered as pinned in this process (`cuMemHostRegister`), so
//! no CUDA object crosses the process boundary. A load is one service load
//! per (layer, chunk) into the layer buffer whose turn it is (the slice
//! is block-major per layer, so a buffer holds every layer and more layers'
//! requests are out at once than there are buffers: each request's round
//! trip hides behind those queued); the service
//! verifies each layer's crc32c as it verifies any load; once it reports the
//! layer, this process copies it into its KV blocks on its own copy stream
//! (the staging kernels; the CPU double's copier without a GPU), records
//! the layer's copy mark (for `wait_layer_queued`) and advances the load's
//! counter, exactly as in-process. A store gathers its blocks from this
//! process's KV memory into the store area with a crc32c per object (on
//! the GPU), and the service stores those staging blocks with those
//! checksums (`Request::SubmitStoreCrcs`), in chunks as the area frees.
//!
//! The other way, the service writing the client's GPU memory through CUDA
//! IPC handles, would save the staging copy but puts every client's CUDA
//! context's memory in the service's hands; which is faster is to be
//! measured on a GPU (issue 25, item 4).
//!
//! One driver thread moves the staged path along: woken by the service's
//! events (a [`Completions`] stream of the underlying [`ServiceClient`]) and
//! by submits, spinning only while copies it started are in flight (a
//! GPU's copy ends with no fd to say so), as the in-process handle's I/O
//! thread does.

use super::board::{lock, Board};
use super::client::ServiceClient;
use super::protocol::{Request, Response};
use crate::error::{Error, Failure, Result};
use crate::handle::{Completions, JobId, LayerCopy, TierApi};
use crate::memory::{HostKvCache, KvMemory, MemoryKind};
use crate::model::KvGeometry;
use crate::pool::Key;
use crate::staged::{LoadCounter, StagedPath, StagingConfig, StagingJobs};
use crate::tier::{JobKind, JobResult};
use nix::poll::{PollFd, PollFlags, PollTimeout};
use nix::sys::eventfd::{EfdFlags, EventFd};
use std::ops::Range;
use std::os::fd::AsFd;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::{Duration, Instant};

/// The staged path runs its per-layer loads and per-chunk stores as this
/// client's jobs on the service, into and out of the slice it shares.
impl StagingJobs for ServiceClient {
    fn submit_layer_load(&mut self, keys: &[Key], places: &[u32], layer: u32) -> Result<JobId> {
        self.submit_load(keys, places, layer..layer + 1)
    }

    fn submit_chunk_store(
        &mut self,
        keys: &[Key],
        places: &[u32],
        crcs: &[Option<Vec<u32>>],
    ) -> Result<JobId> {
        let crcs = crcs
            .iter()
            .map(|c| {
                c.clone().ok_or_else(|| {
                    Error::internal("a staged store chunk without a key's checksums")
                })
            })
            .collect::<Result<Vec<_>>>()?;
        self.submit_store_with_crcs(keys, places, crcs)
    }

    fn poll_jobs(&mut self) -> Result<()> {
        // The reader thread files every event and result as it arrives.
        Ok(())
    }

    fn finished_jobs(&mut self) -> Vec<JobResult> {
        self.board().take_finished_or_gone()
    }

    fn wait_job(&mut self, id: JobId) -> Result<JobResult> {
        self.wait(id)
    }

    fn hold_keys(&mut self, keys: &[Key]) -> Result<Vec<u64>> {
        // This client's pins: the service drops them if this process dies.
        let n = self.pin_prefix(keys)?;
        if n < keys.len() {
            self.unpin(&keys[..n]);
            return Err(Error::UnknownKey {
                key: keys[n].to_string(),
            });
        }
        Ok(vec![0; keys.len()])
    }

    fn release_keys(&mut self, keys: &[Key], _tokens: &[u64]) {
        self.unpin(keys)
    }

    fn hold_present(&mut self, keys: &[Key]) -> Result<(Vec<Key>, Vec<u64>)> {
        // Runs of present keys pinned at once, one request per run: the
        // keys of a store's earlier chunks are normally all there.
        let mut held = Vec::new();
        let mut rest = keys;
        while !rest.is_empty() {
            let n = match self.pin_prefix(rest) {
                Ok(n) => n,
                Err(e) => {
                    self.unpin(&held);
                    return Err(e);
                }
            };
            held.extend_from_slice(&rest[..n]);
            // rest[n] is not in the pool: go on after it.
            rest = &rest[(n + 1).min(rest.len())..];
        }
        let tokens = vec![0; held.len()];
        Ok((held, tokens))
    }

    fn keys_left(&self, keys: &[Key], _tokens: &[u64], refused: bool) -> Vec<bool> {
        // Held keys leave the pool only when a load finds their block
        // damaged, and a layer asked for with such a key is refused: only
        // then are they looked up (one request while all are there, one
        // more per key gone), and the layer asked for again without them.
        // Looking before every layer cost a round trip each (the first
        // layer's time through the service grew by one).
        let mut left = vec![false; keys.len()];
        if !refused {
            return left;
        }
        let mut at = 0;
        while at < keys.len() {
            let n = match self.call(&Request::Lookup(keys[at..].to_vec())) {
                Ok(Response::Count(n)) => (n as usize).min(keys.len() - at),
                // The connection's end fails the submit that follows.
                _ => return left,
            };
            at += n;
            if at < keys.len() {
                left[at] = true;
                at += 1;
            }
        }
        left
    }
}

impl ServiceClient {
    /// `lookup_and_pin`, with the connection's error instead of 0.
    fn pin_prefix(&self, keys: &[Key]) -> Result<usize> {
        match self.call(&Request::LookupAndPin(keys.to_vec()))? {
            Response::Count(n) => Ok((n as usize).min(keys.len())),
            other => Err(Error::internal(format!(
                "the kvtier service answered a pin with {other:?}"
            ))),
        }
    }
}

/// The staged path and the client it runs its jobs on.
struct Core {
    path: StagedPath,
    jobs: ServiceClient,
}

struct Inner {
    client: ServiceClient,
    board: Board,
    core: Mutex<Option<Core>>,
    doorbell: Arc<EventFd>,
    stop: Arc<AtomicBool>,
    driver: Mutex<Option<std::thread::JoinHandle<()>>>,
    memory: KvMemory,
    served_by: String,
}

impl Drop for Inner {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        let _ = self.doorbell.write(1);
        if let Some(t) = lock(&self.driver).take() {
            // The driver may hold the last reference for a moment: it never
            // joins itself.
            if t.thread().id() != std::thread::current().id() {
                let _ = t.join();
            }
        }
        // The copies out of staging end before the staging goes; the
        // service's writes into it end with its jobs (its own mapping).
        if let Some(mut c) = lock(&self.core).take() {
            let _ = c.path.drain(&mut c.jobs);
        }
    }
}

/// A client of the node's service whose KV memory is its own GPU memory
/// (or, on the CPU, host memory standing in for it: the test double),
/// reached through the staged path over the memory the service shares.
/// `Send + Sync + Clone`; opened by
/// `TierBuilder::service(PATH).memory(..).build()`.
#[derive(Clone)]
pub struct StagedServiceClient {
    inner: Arc<Inner>,
    /// The host double's stand-in memory, kept alive with the client.
    _double: Option<Arc<HostKvCache>>,
}

impl std::fmt::Debug for StagedServiceClient {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StagedServiceClient")
            .field("geometry", &self.inner.memory.geometry)
            .field("blocks", &self.inner.memory.num_blocks)
            .finish()
    }
}

/// Staging for a slice of `blocks` blocks: 4 layer buffers and a store
/// area of up to 64 blocks (a quarter of the slice), in chunks of a
/// quarter of it, the layer buffers sharing the rest.
pub fn staging_for_slice(blocks: u32) -> StagingConfig {
    let store = (blocks / 4).clamp(1, 64);
    StagingConfig::new(4, (blocks.saturating_sub(store) / 4).clamp(1, 1024), store)
        .with_store_chunk_blocks(store.div_ceil(4))
}

impl StagedServiceClient {
    /// Run the staged path for `target` over `client`'s shared slice.
    ///
    /// # Safety
    /// Every byte `target` describes stays allocated until the last clone
    /// of the result is dropped, and no one else writes it while a job
    /// that uses it is in flight.
    pub(super) unsafe fn open(
        client: ServiceClient,
        target: KvMemory,
        staging: Option<StagingConfig>,
        double: Option<Arc<HostKvCache>>,
        served_by: String,
    ) -> Result<StagedServiceClient> {
        let cfg = staging.unwrap_or_else(|| staging_for_slice(client.memory_blocks()));
        let keep: Arc<dyn Send + Sync> = client.shared_mapping().ok_or_else(|| {
            Error::invalid(
                "a lookup-only kvtier service client shares no memory to stage GPU KV memory through: connect with memory",
            )
        })?;
        // SAFETY: the slice stays mapped while `keep` (its mapping) lives;
        // the caller's contract for `target`.
        let path = unsafe {
            StagedPath::over_shared_staging(client.memory().clone(), keep, target.clone(), cfg)?
        };
        let doorbell = Arc::new(
            EventFd::from_flags(EfdFlags::EFD_CLOEXEC | EfdFlags::EFD_NONBLOCK)
                .map_err(|e| Error::io("creating the staged client's eventfd", e.into()))?,
        );
        let news = client.completions()?;
        let stop = Arc::new(AtomicBool::new(false));
        let inner = Arc::new(Inner {
            core: Mutex::new(Some(Core {
                path,
                jobs: client.clone(),
            })),
            client,
            board: Board::default(),
            doorbell: doorbell.clone(),
            stop: stop.clone(),
            driver: Mutex::new(None),
            memory: target,
            served_by,
        });
        let weak = Arc::downgrade(&inner);
        let t = std::thread::Builder::new()
            .name("kvtier-staged-client".into())
            .spawn(move || drive(weak, news, doorbell, stop))
            .map_err(|e| Error::io("starting the staged client's thread", e))?;
        *lock(&inner.driver) = Some(t);
        Ok(StagedServiceClient {
            inner,
            _double: double,
        })
    }

    /// The memory this client shares with the service (its staging). Not
    /// the connection underneath: a caller waiting on it could take the
    /// results this client's staged path waits for.
    pub fn shared_mapping(&self) -> Option<std::sync::Arc<super::SharedMapping>> {
        self.inner.client.shared_mapping()
    }

    /// The staging settings.
    pub fn staging(&self) -> Result<StagingConfig> {
        self.with_core(|c| Ok(*c.path.config()))
    }

    fn with_core<T>(&self, f: impl FnOnce(&mut Core) -> Result<T>) -> Result<T> {
        let mut core = lock(&self.inner.core);
        let c = core
            .as_mut()
            .ok_or_else(|| Error::Closed("this kvtier service client is closed".into()))?;
        f(c)
    }

    fn ring(&self) {
        let _ = self.inner.doorbell.write(1);
    }

    /// Start loading `keys` into this process's KV memory blocks
    /// `mem_blocks` for `layers` (see [`crate::TierHandle::submit_load`]).
    pub fn submit_load(
        &self,
        keys: &[Key],
        mem_blocks: &[u32],
        layers: Range<u32>,
    ) -> Result<JobId> {
        let id = self.with_core(|c| {
            let id = c
                .path
                .submit_load(&mut c.jobs, keys, mem_blocks, layers.clone())?;
            // Filed before the driver can move it (it takes this lock).
            self.inner
                .board
                .add_job(id, JobKind::Load, keys, mem_blocks, Some(layers));
            Ok(id)
        })?;
        self.ring();
        Ok(id)
    }

    /// Start storing `keys` from this process's KV memory blocks
    /// `mem_blocks` (see [`crate::TierHandle::submit_store`]): gathered
    /// with their checksums into the shared staging, stored by the service.
    pub fn submit_store(&self, keys: &[Key], mem_blocks: &[u32]) -> Result<JobId> {
        let id = self.with_core(|c| {
            let id = c.path.submit_store(&mut c.jobs, keys, mem_blocks)?;
            self.inner
                .board
                .add_job(id, JobKind::Store, keys, mem_blocks, None);
            Ok(id)
        })?;
        self.ring();
        Ok(id)
    }

    /// The load's GPU counter (see [`crate::TierHandle::load_counter`]).
    pub fn load_counter(&self, job: JobId) -> Result<Option<LoadCounter>> {
        self.with_core(|c| Ok(c.path.load_counter(job)))
    }

    /// Wait for every job of this client, then disconnect.
    pub fn close(&self) -> Result<()> {
        self.inner.board.wait_all()?;
        self.inner.client.close()
    }
}

/// One turn: move the staged path, file what it did. Whether copies it
/// started are in flight (then the driver looks again at once).
fn turn(inner: &Inner) -> bool {
    let mut core = lock(&inner.core);
    let Some(c) = core.as_mut() else {
        return false;
    };
    // What landed is copied and announced before the next layers are
    // asked for: each request waits for the service's answer, and a
    // layer's waiter must not wait for those too.
    let moved = c.path.poll_copies(&mut c.jobs).and_then(|()| {
        publish(inner, &mut c.path);
        c.path.poll_reads(&mut c.jobs)
    });
    if let Err(e) = moved {
        drop(core);
        // The copier failed in a way the path could not pin on a layer:
        // every wait says so rather than hanging.
        inner.board.set_broken(format!(
            "the staged path's copies failed: {}",
            Failure::from(&e)
        ));
        return false;
    }
    publish(inner, &mut c.path);
    c.path.copies_pending()
}

/// File the path's news on the client's job table.
fn publish(inner: &Inner, path: &mut StagedPath) {
    for q in path.layers_queued() {
        inner.board.layer_queued(q.job, q.layer, q.mark);
    }
    for e in path.layer_events() {
        inner.board.layer_done(e.job, e.layer, e.error);
    }
    for r in path.get_finished() {
        inner.board.finished(r);
    }
}

fn drive(inner: Weak<Inner>, news: Completions, doorbell: Arc<EventFd>, stop: Arc<AtomicBool>) {
    while !stop.load(Ordering::SeqCst) {
        let busy = match inner.upgrade() {
            Some(i) => turn(&i),
            None => return,
        };
        if busy {
            std::thread::yield_now();
            continue;
        }
        let mut pfds = [
            PollFd::new(news.as_fd(), PollFlags::POLLIN),
            PollFd::new(doorbell.as_fd(), PollFlags::POLLIN),
        ];
        // The timeout bounds the cost of a missed wake-up (and notices a
        // connection that ended without an event).
        let _ = nix::poll::poll(&mut pfds, PollTimeout::from(50u16));
        let _ = news.drain();
        let _ = doorbell.read();
    }
}

impl TierApi for StagedServiceClient {
    fn engine(&self) -> &str {
        self.inner.client.engine()
    }
    fn engine_reason(&self) -> &str {
        &self.inner.served_by
    }
    fn geometry(&self) -> &KvGeometry {
        &self.inner.memory.geometry
    }
    fn memory_blocks(&self) -> u32 {
        self.inner.memory.num_blocks
    }
    fn namespace(&self) -> &str {
        self.inner.client.namespace()
    }
    fn model_name(&self) -> &str {
        self.inner.client.model_name()
    }
    fn memory(&self) -> Option<&KvMemory> {
        Some(&self.inner.memory)
    }
    fn lookup_prefix(&self, keys: &[Key]) -> usize {
        self.inner.client.lookup_prefix(keys)
    }
    fn lookup_and_pin(&self, keys: &[Key]) -> usize {
        self.inner.client.lookup_and_pin(keys)
    }
    fn unpin(&self, keys: &[Key]) {
        self.inner.client.unpin(keys)
    }
    fn contains(&self, key: &Key) -> bool {
        self.inner.client.contains(key)
    }
    fn remove(&self, keys: &[Key]) -> Result<usize> {
        self.inner.client.remove(keys)
    }
    fn submit_load(&self, keys: &[Key], mem_blocks: &[u32], layers: Range<u32>) -> Result<JobId> {
        StagedServiceClient::submit_load(self, keys, mem_blocks, layers)
    }
    fn submit_store(&self, keys: &[Key], mem_blocks: &[u32]) -> Result<JobId> {
        StagedServiceClient::submit_store(self, keys, mem_blocks)
    }
    /// The staged path sends each chunk as it is gathered; this issues the
    /// service's backlog.
    fn flush_stores(&self) -> Result<()> {
        self.inner.client.flush_stores()
    }
    fn memory_block_use(&self, block: u32) -> Option<JobKind> {
        self.inner.board.memory_block_use(block)
    }
    fn wait(&self, job: JobId) -> Result<JobResult> {
        Ok(self
            .inner
            .board
            .wait_until(job, None)?
            .expect("no deadline"))
    }
    fn wait_timeout(&self, job: JobId, timeout: Duration) -> Result<Option<JobResult>> {
        self.inner
            .board
            .wait_until(job, Some(Instant::now() + timeout))
    }
    fn try_result(&self, job: JobId) -> Result<Option<JobResult>> {
        self.inner.board.wait_until(job, Some(Instant::now()))
    }
    fn get_finished(&self) -> Vec<JobResult> {
        self.inner.board.get_finished()
    }
    fn wait_layer(&self, job: JobId, layer: u32) -> Result<()> {
        self.inner
            .board
            .wait_layer_until(job, layer, None)
            .map(|_| ())
    }
    fn wait_layer_timeout(&self, job: JobId, layer: u32, timeout: Duration) -> Result<bool> {
        self.inner
            .board
            .wait_layer_until(job, layer, Some(Instant::now() + timeout))
    }
    fn wait_layer_queued_timeout(
        &self,
        job: JobId,
        layer: u32,
        timeout: Duration,
    ) -> Result<Option<LayerCopy>> {
        self.inner
            .board
            .wait_layer_queued_until(job, layer, Some(Instant::now() + timeout))
    }
    fn load_counter(&self, job: JobId) -> Result<Option<LoadCounter>> {
        StagedServiceClient::load_counter(self, job)
    }
    fn completions(&self) -> Result<Completions> {
        self.inner.board.subscribe()
    }
    fn usage_json(&self) -> Result<String> {
        self.inner.client.usage_json()
    }
    fn close(&self) -> Result<()> {
        StagedServiceClient::close(self)
    }
}

/// Where `mem` is, for the builder's refusal of memory the staged path
/// does not serve.
pub(super) fn check_staged_memory(mem: &KvMemory) -> Result<()> {
    match mem.kind {
        MemoryKind::Gpu { .. } => Ok(()),
        MemoryKind::Host => Err(Error::invalid(
            "memory(..) through the service is for GPU memory (the staged path); host KV memory is the memory the service shares: drop memory(..) and use the client's memory()",
        )),
    }
}
