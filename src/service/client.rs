//! [`ServiceClient`]: the handle API ([`TierApi`], as [`crate::TierHandle`])
//! over a `kvtier serve` socket; `TierBuilder::service(PATH)` opens one.
//!
//! The client's KV memory is the slice the service shares with it (a sealed
//! memfd, mapped here): [`ServiceClient::memory`] describes it as block-major
//! per-layer tensors, [`ServiceClient::write_object`] / `read_object` copy in
//! and out, and bindings build tensors over [`ServiceClient::layer_region`].
//! Block numbers are this client's own, `0..memory_blocks()`.
//!
//! One reader thread takes every frame the service sends: answers wake the
//! caller that asked, events and results fill a local job table that
//! `wait`, `wait_layer` and `try_result` read, and go to every
//! [`Completions`] stream, as the in-process handle's do. If the service goes away,
//! every waiting call and every unfinished job fails with
//! [`crate::ErrorKind::Closed`] (adapters treat that as a miss), and
//! lookups answer 0.

use super::board::{gone, lock, Board};
use super::protocol::{self, ClientKind, Request, Response};
use super::sys::{self, SharedMapping};
use crate::error::{Error, ErrorKind, Failure, Result};
use crate::handle::{Completions, JobId, LayerCopy, TierApi};
use crate::memory::{KvLayout, KvMemory, MemoryKind};
use crate::model::KvGeometry;
use crate::pool::Key;
use crate::staged::LoadCounter;
use crate::tier::{check_job_blocks, JobKind, JobResult};
use std::io::Write;
use std::ops::Range;
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// How long a call the service answers from its index (lookups, pins,
/// unpins) waits for the answer: they take microseconds, and an engine's
/// scheduler must see a service that stopped answering as a miss soon (a
/// pool's own lookup socket gives up after 2 s).
pub(crate) const INDEX_REPLY_TIMEOUT: Duration = Duration::from_secs(5);
/// How long any other call (submits, usage, the hello) waits.
pub(crate) const REPLY_TIMEOUT: Duration = Duration::from_secs(60);

struct Inner {
    stream: UnixStream,
    write: Mutex<()>,
    next_req: AtomicU64,
    /// Replies, jobs and the event streams, filled by the reader thread.
    board: Board,
    /// The memory the service shares; `None` for a lookup-only client.
    mapping: Option<Arc<SharedMapping>>,
    /// Described as mapped here (0 blocks for a lookup-only client).
    memory: KvMemory,
    namespace: String,
    model_name: String,
    layer_stride: u64,
    engine: String,
    /// Which service serves the pool, for `engine_reason`.
    served_by: String,
    reader: Mutex<Option<std::thread::JoinHandle<()>>>,
}

impl Drop for Inner {
    fn drop(&mut self) {
        let _ = self.stream.shutdown(std::net::Shutdown::Both);
        if let Some(t) = lock(&self.reader).take() {
            // The reader may hold the last reference for a moment: it never
            // joins itself.
            if t.thread().id() != std::thread::current().id() {
                let _ = t.join();
            }
        }
    }
}

/// A connection to a `kvtier serve` service; `Send + Sync + Clone`.
#[derive(Clone)]
pub struct ServiceClient {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for ServiceClient {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ServiceClient")
            .field("geometry", &self.inner.memory.geometry)
            .field("blocks", &self.inner.memory.num_blocks)
            .finish()
    }
}

/// The memory a welcome shares, checked before it is mapped: `blocks` (at
/// least one) of the geometry's K and V per layer fit one layer stride, a
/// whole number of block pairs (the service's slices are `2 x client_blocks
/// x object` bytes a layer, a client asking fewer getting the whole slice),
/// the file is every layer, and it is no larger than this machine's memory
/// (the service holds every client's slice in memory). A welcome that does
/// not add up would have this client address past its mapping, and one of
/// a file past the memory would have it fault in more than the machine has.
fn check_shared_memory(
    geometry: &KvGeometry,
    blocks: u32,
    layer_stride: u64,
    file_bytes: u64,
) -> Result<()> {
    let pair = 2 * geometry.object_bytes();
    let fits = blocks > 0
        && layer_stride % pair == 0
        && (blocks as u64)
            .checked_mul(pair)
            .is_some_and(|b| b <= layer_stride)
        && layer_stride.checked_mul(geometry.layers as u64) == Some(file_bytes);
    if !fits {
        return Err(Error::invalid(format!(
            "the kvtier service's welcome does not add up: {blocks} blocks of {}-byte objects, layer stride {layer_stride}, file {file_bytes} bytes",
            geometry.object_bytes()
        )));
    }
    if let Some(total) = crate::host::mem_total().filter(|&t| file_bytes > t) {
        return Err(Error::invalid(format!(
            "the kvtier service shares a file of {file_bytes} bytes with this client, more than this machine's {total} bytes of memory; is the socket a kvtier service?"
        )));
    }
    Ok(())
}

impl ServiceClient {
    /// Connect to the service at `socket`, sharing `blocks` blocks of KV
    /// memory with it (0: as many as it gives a client).
    pub fn connect(socket: impl AsRef<Path>, blocks: u32) -> Result<ServiceClient> {
        Self::open(socket.as_ref(), blocks, ClientKind::Memory)
    }

    /// Connect to the service at `socket` for lookups, pins and unpins
    /// only (an engine's scheduler): no memory is shared and no client
    /// slot taken; loads and stores are refused. Its pins are dropped when
    /// it disconnects, as any client's.
    pub fn connect_lookup_only(socket: impl AsRef<Path>) -> Result<ServiceClient> {
        Self::open(socket.as_ref(), 0, ClientKind::LookupOnly)
    }

    fn open(socket: &Path, asked: u32, kind: ClientKind) -> Result<ServiceClient> {
        sys::socket_path_fits(socket)?;
        let stream = UnixStream::connect(socket).map_err(|e| {
            Error::io(
                format!(
                    "connecting to the kvtier service at {} (is a kvtier service listening on it, and may this user open the socket?)",
                    socket.display()
                ),
                e,
            )
        })?;
        // A service that stops answering (stopped, stuck) must not hang
        // the engine: the hello's answer and every send are bounded; the
        // reader thread then waits without a bound (`call` bounds replies).
        stream
            .set_read_timeout(Some(REPLY_TIMEOUT))
            .and_then(|_| stream.set_write_timeout(Some(REPLY_TIMEOUT)))
            .map_err(|e| Error::io("setting the service socket's timeouts", e))?;
        let hello = Request::Hello {
            version: protocol::VERSION,
            blocks: asked,
            kind,
        }
        .encode(1)?;
        (&stream)
            .write_all(&hello)
            .map_err(|e| Error::io("sending the hello to the kvtier service", e))?;
        let mut hb = [0u8; protocol::HEADER_BYTES];
        let fd = sys::recv_with_fd(&stream, &mut hb)?;
        let h = protocol::Header::decode(&hb)?;
        let mut body = vec![0u8; h.body_len as usize];
        std::io::Read::read_exact(&mut &stream, &mut body)
            .map_err(|e| Error::io("reading the kvtier service's welcome", e))?;
        stream
            .set_read_timeout(None)
            .map_err(|e| Error::io("setting the service socket's timeouts", e))?;
        let welcome = Response::decode(h.kind, &body).map_err(|e| {
            Error::invalid(format!(
                "the kvtier service at {} answered the hello with a welcome this library cannot read: {e}",
                socket.display()
            ))
        })?;
        let (geometry, namespace, model_name, blocks, layer_stride, file_bytes, engine) =
            match welcome {
                Response::Welcome {
                    geometry,
                    namespace,
                    model_name,
                    blocks,
                    layer_stride,
                    file_bytes,
                    engine,
                    ..
                } => (
                    geometry,
                    namespace,
                    model_name,
                    blocks,
                    layer_stride,
                    file_bytes,
                    engine,
                ),
                Response::Refused(f) => {
                    return Err(Error::Failed(
                        f.context("the kvtier service refused the hello"),
                    ))
                }
                other => {
                    return Err(Error::invalid(format!(
                        "the kvtier service answered the hello with {other:?}"
                    )))
                }
            };
        geometry.validate().map_err(|e| {
            Error::invalid(format!(
                "the kvtier service at {} sent a KV geometry this library refuses: {e}",
                socket.display()
            ))
        })?;
        let mapping = match kind {
            ClientKind::LookupOnly => {
                if fd.is_some() || blocks != 0 {
                    return Err(Error::invalid(format!(
                        "the kvtier service shared {blocks} blocks of memory with a lookup-only client"
                    )));
                }
                None
            }
            ClientKind::Memory => {
                let fd = fd.ok_or_else(|| {
                    Error::invalid("the kvtier service's welcome carried no shared memory file")
                })?;
                sys::check_sealed(&fd, file_bytes)?;
                check_shared_memory(&geometry, blocks, layer_stride, file_bytes)?;
                if asked != 0 && blocks != asked {
                    return Err(Error::invalid(format!(
                        "the kvtier service shared {blocks} blocks of memory where {asked} were asked"
                    )));
                }
                let mapping = SharedMapping::new(&fd, file_bytes)?;
                sys::seal_after_mapping(&fd)?;
                // Every page of this mapping in now, while connecting,
                // not by the first loads' and stores' copies (0.4-0.6 s
                // per 2.5 GiB of 4 KiB pages here, which a client's first
                // jobs waited for).
                sys::populate_for_write(mapping.addr(), mapping.len())?;
                Some(Arc::new(mapping))
            }
        };
        let base = mapping.as_ref().map_or(0, |m| m.addr());
        let memory = KvMemory {
            geometry,
            num_blocks: blocks,
            layout: KvLayout::BlockMajor {
                layer_bases: (0..geometry.layers as u64)
                    .map(|l| base + l * layer_stride)
                    .collect(),
            },
            kind: MemoryKind::Host,
        };
        let read_half = stream
            .try_clone()
            .map_err(|e| Error::io("cloning the service socket", e))?;
        let inner = Arc::new(Inner {
            stream,
            write: Mutex::new(()),
            next_req: AtomicU64::new(2),
            board: Board::default(),
            mapping,
            memory,
            namespace,
            model_name,
            served_by: format!(
                "the kvtier service at {} serves the pool with it",
                socket.display()
            ),
            layer_stride,
            engine,
            reader: Mutex::new(None),
        });
        let weak = Arc::downgrade(&inner);
        let t = std::thread::Builder::new()
            .name("kvtier-service-reader".into())
            .spawn(move || read_loop(read_half, weak))
            .map_err(|e| Error::io("starting the service client's reader", e))?;
        *lock(&inner.reader) = Some(t);
        Ok(ServiceClient { inner })
    }

    /// The pool's KV geometry.
    pub fn geometry(&self) -> &KvGeometry {
        &self.inner.memory.geometry
    }

    /// The engine serving the pool.
    pub fn engine(&self) -> &str {
        &self.inner.engine
    }

    /// The service's pool's key namespace.
    pub fn namespace(&self) -> &str {
        &self.inner.namespace
    }

    /// The model name the service's pool recorded at its create.
    pub fn model_name(&self) -> &str {
        &self.inner.model_name
    }

    /// Whether this client is lookup-only (shares no memory).
    pub fn is_lookup_only(&self) -> bool {
        self.inner.mapping.is_none()
    }

    fn mapping(&self) -> Result<&Arc<SharedMapping>> {
        self.inner.mapping.as_ref().ok_or_else(|| {
            Error::invalid(
                "this kvtier service client is lookup-only: it shares no KV memory with the service (connect with memory to load, store or see the memory)",
            )
        })
    }

    /// Blocks of KV memory shared with the service.
    pub fn memory_blocks(&self) -> u32 {
        self.inner.memory.num_blocks
    }

    /// This client's KV memory, as mapped here (block-major per layer).
    pub fn memory(&self) -> &KvMemory {
        &self.inner.memory
    }

    /// Address and bytes of layer `layer`'s tensor here: shaped
    /// `(blocks, 2, block_size, kv_heads, head_dim)`, then padding to the
    /// layer stride.
    pub fn layer_region(&self, layer: u32) -> Result<(u64, u64)> {
        if layer >= self.inner.memory.geometry.layers {
            return Err(Error::invalid(format!(
                "layer {layer} of a {}-layer model",
                self.inner.memory.geometry.layers
            )));
        }
        Ok((
            self.mapping()?.addr() + layer as u64 * self.inner.layer_stride,
            2 * self.inner.memory.num_blocks as u64 * self.inner.memory.geometry.object_bytes(),
        ))
    }

    /// The whole shared mapping, `(address, bytes)` (`(0, 0)` for a
    /// lookup-only client).
    pub fn host_memory(&self) -> (u64, u64) {
        self.inner
            .mapping
            .as_ref()
            .map_or((0, 0), |m| (m.addr(), m.len()))
    }

    /// The mapping itself, for bindings that hand out views of it (it
    /// stays mapped while any clone of the `Arc` lives); `None` for a
    /// lookup-only client.
    pub fn shared_mapping(&self) -> Option<Arc<SharedMapping>> {
        self.inner.mapping.clone()
    }

    fn object_offset(&self, block: u32, layer: u32, kv: u32) -> Result<u64> {
        let m = &self.inner.memory;
        if block >= m.num_blocks || layer >= m.geometry.layers || kv > 1 {
            return Err(Error::invalid(format!(
                "object (block {block}, layer {layer}, kv {kv}) is outside this client's {} blocks of {} layers",
                m.num_blocks, m.geometry.layers
            )));
        }
        Ok(m.object_addr(block, layer, kv) - self.mapping()?.addr())
    }

    /// Copy one object (K: `kv` 0, V: 1) out of the shared memory.
    pub fn read_object(&self, block: u32, layer: u32, kv: u32, out: &mut [u8]) -> Result<()> {
        let off = self.object_offset(block, layer, kv)?;
        self.check_len(out.len())?;
        self.mapping()?.read(off, out)
    }

    /// Copy one object into the shared memory.
    pub fn write_object(&self, block: u32, layer: u32, kv: u32, data: &[u8]) -> Result<()> {
        let off = self.object_offset(block, layer, kv)?;
        self.check_len(data.len())?;
        self.mapping()?.write(off, data)
    }

    fn check_len(&self, n: usize) -> Result<()> {
        let obj = self.inner.memory.geometry.object_bytes();
        if n as u64 != obj {
            return Err(Error::invalid(format!(
                "{n} bytes for an object of {obj} bytes"
            )));
        }
        Ok(())
    }

    fn check_blocks(&self, keys: &[Key], blocks: &[u32]) -> Result<()> {
        self.mapping()?;
        check_job_blocks(
            keys,
            blocks,
            self.memory_blocks(),
            "the memory this client shares with the service",
        )
    }

    /// This client's job table.
    pub(super) fn board(&self) -> &Board {
        &self.inner.board
    }

    /// Send `req` and wait for its answer, at most [`INDEX_REPLY_TIMEOUT`]
    /// for what the service answers from its index, [`REPLY_TIMEOUT`] for
    /// the rest. A request that cannot be sent, or is not answered in time,
    /// ends the connection (the service then drops this client's pins and
    /// jobs; every wait here fails as gone, which adapters take as misses).
    pub(super) fn call(&self, req: &Request) -> Result<Response> {
        let id = self.inner.next_req.fetch_add(1, Ordering::Relaxed);
        let frame = req.encode(id)?;
        if let Some(why) = &self.inner.board.lock().broken {
            return Err(gone(why));
        }
        {
            let _w = lock(&self.inner.write);
            if let Err(e) = (&self.inner.stream).write_all(&frame) {
                // Part of a frame may be out: nothing after it would parse.
                return Err(self.end(format!("sending a request: {e}")));
            }
        }
        let timeout = match req {
            Request::Lookup(_) | Request::LookupAndPin(_) | Request::Unpin(_) => {
                INDEX_REPLY_TIMEOUT
            }
            _ => REPLY_TIMEOUT,
        };
        match self.inner.board.wait_reply(id, timeout)? {
            Some(r) => Ok(r),
            // Stopped, or stuck on a dead device: gone, for every call.
            None => Err(self.end(format!(
                "the service did not answer a request within {} s",
                timeout.as_secs()
            ))),
        }
    }

    /// End the connection for `why`: every wait here fails as gone (with
    /// this reason), and the service, seeing it closed, drops this
    /// client's pins and jobs. The error to return.
    fn end(&self, why: String) -> Error {
        let e = gone(&why);
        self.inner.board.set_broken(why);
        let _ = self.inner.stream.shutdown(std::net::Shutdown::Both);
        e
    }

    /// How many leading keys the pool holds (0 if the service is gone).
    pub fn lookup_prefix(&self, keys: &[Key]) -> usize {
        self.prefix_in_parts(keys, |ks| Request::Lookup(ks.to_vec()))
    }

    /// A prefix count asked in parts of at most [`protocol::MAX_KEYS`]
    /// keys (the most one frame takes), stopping at the first part not
    /// wholly held: a longer prefix is counted, not refused (0).
    fn prefix_in_parts(&self, keys: &[Key], request: impl Fn(&[Key]) -> Request) -> usize {
        let mut held = 0;
        for part in keys.chunks(protocol::MAX_KEYS) {
            let n = match self.call(&request(part)) {
                Ok(Response::Count(n)) => (n as usize).min(part.len()),
                _ => 0,
            };
            held += n;
            if n < part.len() {
                break;
            }
        }
        held
    }

    /// Like `lookup_prefix`, and pins the keys it counts for this client
    /// (dropped by `unpin`, or when this client disconnects).
    pub fn lookup_and_pin(&self, keys: &[Key]) -> usize {
        self.prefix_in_parts(keys, |ks| Request::LookupAndPin(ks.to_vec()))
    }

    /// Drop one of this client's pins per key; never fails.
    pub fn unpin(&self, keys: &[Key]) {
        for part in keys.chunks(protocol::MAX_KEYS) {
            let _ = self.call(&Request::Unpin(part.to_vec()));
        }
    }

    /// Whether the pool holds `key`.
    pub fn contains(&self, key: &Key) -> bool {
        self.lookup_prefix(std::slice::from_ref(key)) == 1
    }

    /// Take `keys` out of the pool (see [`crate::TierHandle::remove`]).
    pub fn remove(&self, keys: &[Key]) -> Result<usize> {
        let mut removed = 0;
        for part in keys.chunks(protocol::MAX_KEYS) {
            match self.call(&Request::Remove(part.to_vec()))? {
                Response::Count(n) => removed += n as usize,
                other => return Err(unexpected(&other)),
            }
        }
        Ok(removed)
    }

    fn submitted(
        &self,
        r: Response,
        kind: JobKind,
        keys: &[Key],
        blocks: &[u32],
        layers: Option<Range<u32>>,
    ) -> Result<JobId> {
        match r {
            Response::Job(j) => {
                self.inner.board.add_job(j, kind, keys, blocks, layers);
                Ok(j)
            }
            other => Err(unexpected(&other)),
        }
    }

    /// Start loading `keys` into this client's `mem_blocks` for `layers`
    /// (see [`crate::TierHandle::submit_load`]).
    pub fn submit_load(
        &self,
        keys: &[Key],
        mem_blocks: &[u32],
        layers: Range<u32>,
    ) -> Result<JobId> {
        self.check_blocks(keys, mem_blocks)?;
        let r = self.call(&Request::SubmitLoad {
            keys: keys.to_vec(),
            blocks: mem_blocks.to_vec(),
            layers: layers.clone(),
        })?;
        self.submitted(r, JobKind::Load, keys, mem_blocks, Some(layers))
    }

    /// Accept a store of `keys` from this client's `mem_blocks` (see
    /// [`crate::TierHandle::submit_store`]).
    pub fn submit_store(&self, keys: &[Key], mem_blocks: &[u32]) -> Result<JobId> {
        self.check_blocks(keys, mem_blocks)?;
        let r = self.call(&Request::SubmitStore {
            keys: keys.to_vec(),
            blocks: mem_blocks.to_vec(),
        })?;
        self.submitted(r, JobKind::Store, keys, mem_blocks, None)
    }

    /// As [`Self::submit_store`], with each key's per-layer crc32c taken
    /// by this process (the staged GPU path's gather): the service writes
    /// them into the headers instead of hashing the blocks itself, so the
    /// checksums cover the bytes as they were in this process's memory.
    pub fn submit_store_with_crcs(
        &self,
        keys: &[Key],
        mem_blocks: &[u32],
        crcs: Vec<Vec<u32>>,
    ) -> Result<JobId> {
        self.check_blocks(keys, mem_blocks)?;
        let r = self.call(&Request::SubmitStoreCrcs {
            keys: keys.to_vec(),
            blocks: mem_blocks.to_vec(),
            crcs,
        })?;
        self.submitted(r, JobKind::Store, keys, mem_blocks, None)
    }

    /// Issue every store in the service's backlog now.
    pub fn flush_stores(&self) -> Result<()> {
        match self.call(&Request::FlushStores)? {
            Response::Ok => Ok(()),
            other => Err(unexpected(&other)),
        }
    }

    /// Block until `job` finishes and return (remove) its result.
    pub fn wait(&self, job: JobId) -> Result<JobResult> {
        Ok(self.wait_until(job, None)?.expect("no deadline"))
    }

    /// Like `wait`, giving up after `timeout` (`None`: not finished yet).
    pub fn wait_timeout(&self, job: JobId, timeout: Duration) -> Result<Option<JobResult>> {
        self.wait_until(job, Some(Instant::now() + timeout))
    }

    /// The result of `job` if it has finished (then removed), else None.
    pub fn try_result(&self, job: JobId) -> Result<Option<JobResult>> {
        self.wait_until(job, Some(Instant::now()))
    }

    fn wait_until(&self, job: JobId, deadline: Option<Instant>) -> Result<Option<JobResult>> {
        self.inner.board.wait_until(job, deadline)
    }
    /// Results of every finished job of this client not yet collected.
    pub fn get_finished(&self) -> Vec<JobResult> {
        self.inner.board.get_finished()
    }
    /// Block until layer `layer` of load `job` is in this client's memory;
    /// an error means the layer must not be used.
    pub fn wait_layer(&self, job: JobId, layer: u32) -> Result<()> {
        self.wait_layer_until(job, layer, None).map(|_| ())
    }

    /// Like `wait_layer`; false if the layer is not in memory by `timeout`.
    pub fn wait_layer_timeout(&self, job: JobId, layer: u32, timeout: Duration) -> Result<bool> {
        self.wait_layer_until(job, layer, Some(Instant::now() + timeout))
    }

    fn wait_layer_until(&self, job: JobId, layer: u32, deadline: Option<Instant>) -> Result<bool> {
        self.inner.board.wait_layer_until(job, layer, deadline)
    }
    /// A new stream of this client's events (layer done, job finished),
    /// with an eventfd that polls readable while events are queued; as
    /// [`crate::TierHandle::completions`].
    pub fn completions(&self) -> Result<Completions> {
        self.inner.board.subscribe()
    }

    /// Which unfinished job of this client uses memory block `block`:
    /// `Load` while a load writes it, `Store` while a store reads it.
    pub fn memory_block_use(&self, block: u32) -> Option<JobKind> {
        self.inner.board.memory_block_use(block)
    }
    /// The service's usage (the pool's, shared by every client), as JSON of
    /// [`crate::handle::HandleUsage`].
    pub fn usage_json(&self) -> Result<String> {
        match self.call(&Request::Usage)? {
            Response::Usage(j) => Ok(j),
            other => Err(unexpected(&other)),
        }
    }

    /// Wait for every job this client submitted, then disconnect (the
    /// service drops this client's pins). Results not yet collected stay
    /// collectable on this object.
    pub fn close(&self) -> Result<()> {
        self.inner.board.wait_all()?;
        let _ = self.inner.stream.shutdown(std::net::Shutdown::Both);
        Ok(())
    }
}

impl TierApi for ServiceClient {
    fn engine(&self) -> &str {
        ServiceClient::engine(self)
    }
    fn engine_reason(&self) -> &str {
        &self.inner.served_by
    }
    fn geometry(&self) -> &KvGeometry {
        ServiceClient::geometry(self)
    }
    fn memory_blocks(&self) -> u32 {
        ServiceClient::memory_blocks(self)
    }
    fn namespace(&self) -> &str {
        ServiceClient::namespace(self)
    }
    fn model_name(&self) -> &str {
        ServiceClient::model_name(self)
    }
    fn memory(&self) -> Option<&KvMemory> {
        (!self.is_lookup_only()).then(|| ServiceClient::memory(self))
    }
    fn lookup_prefix(&self, keys: &[Key]) -> usize {
        ServiceClient::lookup_prefix(self, keys)
    }
    fn lookup_and_pin(&self, keys: &[Key]) -> usize {
        ServiceClient::lookup_and_pin(self, keys)
    }
    fn unpin(&self, keys: &[Key]) {
        ServiceClient::unpin(self, keys)
    }
    fn contains(&self, key: &Key) -> bool {
        ServiceClient::contains(self, key)
    }
    fn remove(&self, keys: &[Key]) -> Result<usize> {
        ServiceClient::remove(self, keys)
    }
    fn submit_load(&self, keys: &[Key], mem_blocks: &[u32], layers: Range<u32>) -> Result<JobId> {
        ServiceClient::submit_load(self, keys, mem_blocks, layers)
    }
    fn submit_store(&self, keys: &[Key], mem_blocks: &[u32]) -> Result<JobId> {
        ServiceClient::submit_store(self, keys, mem_blocks)
    }
    fn flush_stores(&self) -> Result<()> {
        ServiceClient::flush_stores(self)
    }
    fn memory_block_use(&self, block: u32) -> Option<JobKind> {
        ServiceClient::memory_block_use(self, block)
    }
    fn wait(&self, job: JobId) -> Result<JobResult> {
        ServiceClient::wait(self, job)
    }
    fn wait_timeout(&self, job: JobId, timeout: Duration) -> Result<Option<JobResult>> {
        ServiceClient::wait_timeout(self, job, timeout)
    }
    fn try_result(&self, job: JobId) -> Result<Option<JobResult>> {
        ServiceClient::try_result(self, job)
    }
    fn get_finished(&self) -> Vec<JobResult> {
        ServiceClient::get_finished(self)
    }
    fn wait_layer(&self, job: JobId, layer: u32) -> Result<()> {
        ServiceClient::wait_layer(self, job, layer)
    }
    fn wait_layer_timeout(&self, job: JobId, layer: u32, timeout: Duration) -> Result<bool> {
        ServiceClient::wait_layer_timeout(self, job, layer, timeout)
    }
    /// Settled: this client's memory is host memory the service shares
    /// (GPU memory through a service is `StagedServiceClient`'s);
    /// `wait_layer` is the wait.
    fn wait_layer_queued_timeout(
        &self,
        _job: JobId,
        _layer: u32,
        _timeout: Duration,
    ) -> Result<Option<LayerCopy>> {
        Ok(Some(LayerCopy::Settled))
    }
    /// None: host loads have no GPU counter (as above).
    fn load_counter(&self, _job: JobId) -> Result<Option<LoadCounter>> {
        Ok(None)
    }
    fn completions(&self) -> Result<Completions> {
        ServiceClient::completions(self)
    }
    fn usage_json(&self) -> Result<String> {
        ServiceClient::usage_json(self)
    }
    fn close(&self) -> Result<()> {
        ServiceClient::close(self)
    }
}

fn unexpected(r: &Response) -> Error {
    Error::Failed(Failure::new(
        ErrorKind::Internal,
        format!("the kvtier service answered with an unexpected {r:?}"),
    ))
}

fn read_loop(stream: UnixStream, inner: std::sync::Weak<Inner>) {
    let mut r = &stream;
    let why = loop {
        let (h, body) = match protocol::read_frame(&mut r) {
            Ok(Some(f)) => f,
            Ok(None) => break "the service closed the connection".to_string(),
            Err(e) => break e.to_string(),
        };
        let msg = match Response::decode(h.kind, &body) {
            Ok(m) => m,
            Err(e) => break e.to_string(),
        };
        let Some(inner) = inner.upgrade() else {
            return;
        };
        match msg {
            Response::Layer { job, layer, error } => inner.board.layer_done(job, layer, error),
            Response::Finished(r) => inner.board.finished(r),
            other => {
                inner.board.lock().replies.insert(h.req, other);
                inner.board.notify();
            }
        }
    };
    if let Some(inner) = inner.upgrade() {
        inner.board.set_broken(why);
    }
}
