//! `TierHandle`: an open tier from Python, over the library's one handle
//! API ([`kvtier::TierApi`]): a pool of this process's own or the node's
//! `kvtier serve` (then its KV memory is the slice the service shares).
//! Everything that can wait (loads, stores, waits, close) releases the GIL.

use crate::args::*;
use crate::errors::{to_py, usage};
use crate::lifecycle::{run_python_code, without_gil, FORKS};
use crate::memory::kind_label;
use crate::model::geometry_dict;
use crate::results::{event_py, result_py, EventPy, JobResultPy};
use crate::service::SharedRegion;
use kvtier::gpu::Context;
use kvtier::handle::{Completions, LayerCopy};
use kvtier::memory::{HostKvCache, KvLayout, KvMemory, MemoryKind};
use kvtier::pool::Key;
use kvtier::service::SharedMapping;
use kvtier::tier::JobKind;
use kvtier::TierApi;
use pyo3::buffer::PyBuffer;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict, PyTuple};
use std::os::fd::AsRawFd;
use std::path::PathBuf;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// An open tier: thread-safe; every method may be called from any thread.
/// The memory of a job's blocks must not be written until the job finishes.
#[pyclass(module = "kvtier._kvtier", frozen)]
pub struct TierHandle {
    // Field order is drop order: the tier (and its I/O) goes before the
    // memory it reads and writes.
    /// An in-process `kvtier::TierHandle` or a `kvtier::ServiceClient`.
    pub(crate) inner: Option<Box<dyn TierApi>>,
    pub(crate) completions: Completions,
    pub(crate) memory: KvMemory,
    pub(crate) host: Option<Arc<HostKvCache>>,
    /// Through a service: its socket, and the memory it shares (mapped
    /// here; `None` for a lookup-only client).
    pub(crate) service: Option<(PathBuf, Option<Arc<SharedMapping>>)>,
    /// The pool's namespace and the model it recorded (through a service:
    /// the service's pool's).
    pub(crate) namespace: String,
    pub(crate) model_name: String,
    /// Served through the staged HBM path (on a GPU, or its host double).
    pub(crate) staged: bool,
    /// The CUDA context of GPU KV memory (torch's primary context).
    pub(crate) gpu: Option<Context>,
    pub(crate) owners: Mutex<Vec<Py<PyAny>>>,
    pub(crate) buffers: Mutex<Vec<PyBuffer<u8>>>,
    /// FORKS when the handle was built: a different count means this is a
    /// forked child, which has the handle's memory but not its I/O thread.
    pub(crate) forks: u64,
}

/// How long a blocking wait sleeps before looking at Python's signals, so
/// that Ctrl-C (and any signal handler) runs while a job is slow or stuck.
pub(crate) const WAIT_SLICE: Duration = Duration::from_millis(50);

impl TierHandle {
    fn h(&self) -> &dyn TierApi {
        self.inner.as_deref().expect("set at build")
    }

    fn forked(&self) -> bool {
        FORKS.load(Ordering::SeqCst) != self.forks
    }

    /// The handle, for anything that does I/O or touches the KV memory:
    /// refused in a forked child, whose copy has no I/O thread (its waits
    /// would never end) and may lack the memory (kvtier's own is not
    /// inherited: it is pinned for DMA).
    fn live(&self) -> PyResult<&dyn TierApi> {
        if self.forked() {
            return Err(usage(
                "this TierHandle was opened before fork(): a child process cannot use it (its I/O thread and DMA memory, or its service connection, stay in the parent); open a tier (or connect to the service) in the child, or start workers with the 'spawn' method",
            ));
        }
        Ok(self.h())
    }

    /// write_block and friends copy with the CPU: host memory only.
    fn check_host(&self, what: &str) -> PyResult<()> {
        if self.memory.kind != MemoryKind::Host {
            return Err(usage(format!(
                "{what} copies with the CPU but the KV memory is on {}; copy through the CUDA tensors themselves (torch)",
                kind_label(self.memory.kind)
            )));
        }
        Ok(())
    }

    /// Whether `addr..+len` shares a byte with one of `block`'s objects.
    fn overlaps_block(&self, block: u32, addr: usize, len: usize) -> bool {
        let g = self.memory.geometry;
        let obj = g.object_bytes() as usize;
        (0..g.layers).any(|layer| {
            (0..2).any(|kv| {
                let o = self.memory.object_addr(block, layer, kv) as usize;
                addr < o + obj && o < addr + len
            })
        })
    }

    /// CPU copies into (`writes`) or out of a block no unfinished job is
    /// using that way: a write under a load fails its check (and drops the
    /// key as corrupt), a write under a store changes what it stores, a
    /// read under a load sees bytes half in.
    fn check_block_idle(&self, block: u32, writes: bool) -> PyResult<()> {
        match self.h().memory_block_use(block) {
            Some(JobKind::Load) => Err(usage(format!(
                "memory block {block} is the target of a load not yet finished; wait for it first"
            ))),
            Some(JobKind::Store) if writes => Err(usage(format!(
                "memory block {block} is read by a store not yet finished; wait for it before writing the block"
            ))),
            _ => Ok(()),
        }
    }

    fn check_block(&self, block: u32) -> PyResult<()> {
        if block >= self.memory.num_blocks {
            return Err(usage(format!(
                "memory block {block} is out of range: the registered KV memory has {n} blocks (0..{n})",
                n = self.memory.num_blocks
            )));
        }
        Ok(())
    }
}

#[pymethods]
impl TierHandle {
    /// The engine serving the pool and why it was picked.
    #[getter]
    fn engine(&self) -> String {
        self.h().engine().to_string()
    }

    #[getter]
    fn engine_reason(&self) -> String {
        self.h().engine_reason().to_string()
    }

    /// The pool's key namespace (through a service: the service's pool's).
    #[getter]
    fn namespace(&self) -> String {
        self.namespace.clone()
    }

    /// The model name the pool recorded at its create (through a service:
    /// the service's pool's).
    #[getter]
    fn model_name(&self) -> String {
        self.model_name.clone()
    }

    /// The socket of the kvtier service serving this handle, or None for a
    /// pool of this process's own.
    #[getter]
    fn service(&self) -> Option<String> {
        self.service.as_ref().map(|(p, _)| p.display().to_string())
    }

    /// Through a service: layer `layer` of the KV memory it shares with this
    /// process, `(blocks, 2, block_size, kv_heads, head_dim)` elements of
    /// the pool's dtype, as a writable buffer (kvtier.service_tensors makes
    /// torch tensors of them).
    fn layer_region(&self, #[pyo3(from_py_with = layer_arg)] layer: u32) -> PyResult<SharedRegion> {
        let Some((_, mapping)) = self.service.as_ref().filter(|_| !self.staged) else {
            return Err(usage(
                "layer_region() is the KV memory a kvtier service shares with this process; this handle's KV memory is the memory given to the builder (a pool of its own, or GPU memory through a service's staging)",
            ));
        };
        let mapping = mapping.as_ref().ok_or_else(lookup_only_memory)?;
        let g = self.memory.geometry;
        if layer >= g.layers {
            return Err(usage(format!(
                "layer {layer} of a {}-layer model",
                g.layers
            )));
        }
        let addr = self.memory.object_addr(0, layer, 0);
        Ok(SharedRegion::new(
            mapping.clone(),
            addr,
            2 * self.memory.num_blocks as u64 * g.object_bytes(),
        ))
    }

    /// layers, kv_heads, head_dim, dtype, block_size, object_bytes, block_bytes.
    #[getter]
    fn geometry<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let g = self.h().geometry();
        geometry_dict(py, g)
    }

    /// Blocks in the registered KV memory.
    #[getter]
    fn memory_blocks(&self) -> u32 {
        self.memory.num_blocks
    }

    /// Bytes of one block (all layers, K and V).
    #[getter]
    fn block_bytes(&self) -> u64 {
        self.memory.geometry.block_bytes()
    }

    /// How many leading keys the pool holds. No side effects.
    fn lookup(&self, py: Python<'_>, keys: &Bound<'_, PyAny>) -> PyResult<usize> {
        let h = self.live()?;
        let keys = keys_of(keys)?;
        Ok(without_gil(py, || h.lookup_prefix(&keys)))
    }

    /// Like lookup, and pins the counted keys against eviction until `unpin`.
    fn lookup_and_pin(&self, py: Python<'_>, keys: &Bound<'_, PyAny>) -> PyResult<usize> {
        let h = self.live()?;
        let keys = keys_of(keys)?;
        Ok(without_gil(py, || h.lookup_and_pin(&keys)))
    }

    /// Drop one pin per key; unknown keys are ignored.
    fn unpin(&self, py: Python<'_>, keys: &Bound<'_, PyAny>) -> PyResult<()> {
        let h = self.live()?;
        let keys = keys_of(keys)?;
        without_gil(py, || h.unpin(&keys));
        Ok(())
    }

    /// Take `keys` out of the pool (never served again; a load already
    /// reading one finishes); keys not held are skipped. Returns how many
    /// were removed. A pool reopened before a removed block's slot is reused
    /// may hold it again.
    fn remove(&self, py: Python<'_>, keys: &Bound<'_, PyAny>) -> PyResult<usize> {
        let h = self.live()?;
        let keys = keys_of(keys)?;
        without_gil(py, || h.remove(&keys)).map_err(to_py)
    }

    fn contains(&self, py: Python<'_>, key: &Bound<'_, PyAny>) -> PyResult<bool> {
        let h = self.live()?;
        let k = key_of(key, 0)?;
        Ok(without_gil(py, || h.contains(&k)))
    }

    /// Accept a store of `keys` from memory `blocks` (all layers); returns a
    /// job id at once. Raises BackpressureError when the backlog is full.
    fn submit_store(
        &self,
        py: Python<'_>,
        keys: &Bound<'_, PyAny>,
        blocks: &Bound<'_, PyAny>,
    ) -> PyResult<u64> {
        let h = self.live()?;
        let keys = keys_of(keys)?;
        let blocks = blocks_of(blocks)?;
        without_gil(py, || h.submit_store(&keys, &blocks)).map_err(to_py)
    }

    /// Start loading `keys` (all in the pool) into memory `blocks` for
    /// `layers` (a range; default all); returns a job id at once.
    #[pyo3(signature = (keys, blocks, layers = None))]
    fn submit_load(
        &self,
        py: Python<'_>,
        keys: &Bound<'_, PyAny>,
        blocks: &Bound<'_, PyAny>,
        layers: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<u64> {
        let h = self.live()?;
        let keys = keys_of(keys)?;
        let blocks = blocks_of(blocks)?;
        let range = layers_arg(layers, self.memory.geometry.layers)?;
        without_gil(py, || h.submit_load(&keys, &blocks, range)).map_err(to_py)
    }

    /// Block (GIL released) until `job` finishes; returns its result once.
    /// Signals are handled while waiting: a KeyboardInterrupt leaves the
    /// job running and its result to be collected later.
    fn wait(
        &self,
        py: Python<'_>,
        #[pyo3(from_py_with = job_arg)] job: u64,
    ) -> PyResult<JobResultPy> {
        let h = self.live()?;
        loop {
            match without_gil(py, || h.wait_timeout(job, WAIT_SLICE)).map_err(to_py)? {
                Some(r) => return Ok(result_py(py, r)),
                None => py.check_signals()?,
            }
        }
    }

    /// Block (GIL released) until `layer` of load `job` is in memory;
    /// raises the layer's failure (its memory must not be used). Signals
    /// are handled while waiting, as in wait().
    fn wait_layer(
        &self,
        py: Python<'_>,
        #[pyo3(from_py_with = job_arg)] job: u64,
        #[pyo3(from_py_with = layer_arg)] layer: u32,
    ) -> PyResult<()> {
        let h = self.live()?;
        while !without_gil(py, || h.wait_layer_timeout(job, layer, WAIT_SLICE)).map_err(to_py)? {
            py.check_signals()?;
        }
        Ok(())
    }

    /// Make CUDA stream `stream` (a raw handle: torch's
    /// `torch.cuda.current_stream().cuda_stream`) wait, on the GPU, until
    /// layer `layer` of load `job` is in the KV memory. The host waits (GIL
    /// released, signals handled) only until the layer's bytes are read
    /// and verified and their copy into GPU memory is queued; the stream
    /// then waits for that copy, so the layer's attention starts once it is
    /// done while the host goes on. Returns True when the wait was queued;
    /// False when there is nothing for a stream to wait on (host memory,
    /// the host double, a layer already in memory, or a layer that failed):
    /// then call wait_layer(), which returns at once or raises the layer's
    /// failure.
    fn stream_wait_layer(
        &self,
        py: Python<'_>,
        #[pyo3(from_py_with = job_arg)] job: u64,
        #[pyo3(from_py_with = layer_arg)] layer: u32,
        #[pyo3(from_py_with = stream_arg)] stream: u64,
    ) -> PyResult<bool> {
        if self.gpu.is_none() {
            return Ok(false);
        }
        let h = self.live()?;
        let copy = loop {
            match without_gil(py, || h.wait_layer_queued_timeout(job, layer, WAIT_SLICE))
                .map_err(to_py)?
            {
                Some(c) => break c,
                None => py.check_signals()?,
            }
        };
        match copy {
            LayerCopy::Queued(mark) if !mark.is_double() => {
                // SAFETY: the caller passes a live stream of the device's
                // primary context (torch's); CUDA keeps the event's state
                // for the queued wait.
                without_gil(py, || unsafe { mark.queue_on_raw_stream(stream) }).map_err(to_py)?;
                Ok(true)
            }
            _ => Ok(false),
        }
    }

    /// "cpu" or "cuda:N": where the registered KV memory is.
    #[getter]
    fn memory_device(&self) -> String {
        kind_label(self.memory.kind)
    }

    /// True when the KV memory is served through the staged HBM path
    /// (CUDA tensors, or the host double standing in for them).
    #[getter]
    fn staged(&self) -> bool {
        self.staged
    }

    /// The result of `job` if it finished (then taken), else None.
    fn try_result(
        &self,
        py: Python<'_>,
        #[pyo3(from_py_with = job_arg)] job: u64,
    ) -> PyResult<Option<JobResultPy>> {
        Ok(self
            .live()?
            .try_result(job)
            .map_err(to_py)?
            .map(|r| result_py(py, r)))
    }

    /// Results of every finished job not yet collected, in finishing order.
    fn get_finished(&self, py: Python<'_>) -> PyResult<Vec<JobResultPy>> {
        Ok(self
            .live()?
            .get_finished()
            .into_iter()
            .map(|r| result_py(py, r))
            .collect())
    }

    /// Issue every store in the backlog now, whatever the policy.
    fn flush_stores(&self, py: Python<'_>) -> PyResult<()> {
        let h = self.live()?;
        without_gil(py, || h.flush_stores()).map_err(to_py)
    }

    /// An eventfd that polls readable while completions are queued (for
    /// select/epoll/asyncio's add_reader); then call drain_completions().
    fn event_fd(&self) -> i32 {
        self.completions.as_raw_fd()
    }

    /// Every queued completion event (layer done, job finished), oldest first.
    /// Events queue from build() on; past a few thousand undrained, those of
    /// jobs already collected (wait, try_result, get_finished) are dropped,
    /// so a handle used only through wait() does not grow.
    fn drain_completions(&self, py: Python<'_>) -> Vec<EventPy> {
        self.completions
            .drain()
            .into_iter()
            .map(|e| event_py(py, e))
            .collect()
    }

    /// Pool and backlog occupancy, engine counters.
    fn usage<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        let h = self.live()?;
        let text = without_gil(py, || h.usage_json()).map_err(to_py)?;
        run_python_code(py, || py.import("json")?.call_method1("loads", (text,)))
    }

    /// Copy `data` (bytes-like, at most one block) into memory block
    /// `block`, object by object; the rest of the block is zeroed. For
    /// staging through kvtier-allocated memory.
    fn write_block(
        &self,
        py: Python<'_>,
        #[pyo3(from_py_with = block_arg)] block: u32,
        data: &Bound<'_, PyAny>,
    ) -> PyResult<()> {
        self.live()?;
        self.check_host("write_block")?;
        let data = byte_buffer(data, "data")?;
        self.check_block(block)?;
        self.check_block_idle(block, true)?;
        let g = self.memory.geometry;
        let obj = g.object_bytes() as usize;
        let n = data.len_bytes();
        if n as u64 > g.block_bytes() {
            return Err(usage(format!(
                "{n} bytes do not fit a block of {} bytes ({})",
                g.block_bytes(),
                g.describe()
            )));
        }
        if !data.is_c_contiguous() {
            return Err(usage("write_block needs a contiguous buffer"));
        }
        let mem = &self.memory;
        // `data` may be a view of the KV memory itself (a tensor over
        // host_memory()): then copy it aside first, so every object gets the
        // bytes `data` held at the call, whatever order the copies run in.
        let copy: Option<Vec<u8>> =
            self.overlaps_block(block, data.buf_ptr() as usize, n)
                .then(|| {
                    // SAFETY: buf_ptr..+n is the exported buffer, held by `data`.
                    unsafe { std::slice::from_raw_parts(data.buf_ptr() as *const u8, n) }.to_vec()
                });
        let src = copy
            .as_ref()
            .map_or(data.buf_ptr() as usize, |c| c.as_ptr() as usize);
        without_gil(py, || {
            for layer in 0..g.layers {
                for kv in 0..2 {
                    let i = (layer * 2 + kv) as usize * obj;
                    let dst = mem.object_addr(block, layer, kv) as *mut u8;
                    let take = n.saturating_sub(i).min(obj);
                    // SAFETY: dst is one object inside the registered memory
                    // (block checked above); src+i..+take is inside `data`
                    // (which the held PyBuffer keeps exported) or its copy,
                    // and does not overlap dst (checked above).
                    unsafe {
                        std::ptr::copy_nonoverlapping((src + i) as *const u8, dst, take);
                        std::ptr::write_bytes(dst.add(take), 0, obj - take);
                    }
                }
            }
        });
        Ok(())
    }

    /// Copy memory block `block` into `out` (a writable buffer of at most
    /// one block: its first len(out) bytes, objects in (layer, K|V) order).
    fn read_block_into(
        &self,
        py: Python<'_>,
        #[pyo3(from_py_with = block_arg)] block: u32,
        out: &Bound<'_, PyAny>,
    ) -> PyResult<()> {
        self.live()?;
        self.check_host("read_block_into")?;
        let out = byte_buffer(out, "out")?;
        self.check_block(block)?;
        self.check_block_idle(block, false)?;
        let g = self.memory.geometry;
        let obj = g.object_bytes() as usize;
        let n = out.len_bytes();
        if out.readonly() || !out.is_c_contiguous() {
            return Err(usage("read_block_into needs a writable, contiguous buffer"));
        }
        if n as u64 > g.block_bytes() {
            return Err(usage(format!(
                "a buffer of {n} bytes is larger than a block ({} bytes)",
                g.block_bytes()
            )));
        }
        let mem = &self.memory;
        // `out` may be a view of the KV memory itself: then gather into a
        // copy first, so no object is read after an earlier one overwrote it.
        let mut copy: Option<Vec<u8>> = self
            .overlaps_block(block, out.buf_ptr() as usize, n)
            .then(|| vec![0u8; n]);
        let dst = copy
            .as_mut()
            .map_or(out.buf_ptr() as usize, |c| c.as_mut_ptr() as usize);
        without_gil(py, || {
            for layer in 0..g.layers {
                for kv in 0..2 {
                    let i = (layer * 2 + kv) as usize * obj;
                    let take = n.saturating_sub(i).min(obj);
                    if take == 0 {
                        return;
                    }
                    let src = mem.object_addr(block, layer, kv) as *const u8;
                    // SAFETY: as in write_block, in the other direction.
                    unsafe { std::ptr::copy_nonoverlapping(src, (dst + i) as *mut u8, take) };
                }
            }
        });
        if let Some(c) = copy {
            // SAFETY: `out` is exported writable for n bytes; `c` is a
            // separate allocation.
            unsafe { std::ptr::copy_nonoverlapping(c.as_ptr(), out.buf_ptr() as *mut u8, n) };
        }
        Ok(())
    }

    /// Block `block` as bytes (copy).
    fn read_block<'py>(
        &self,
        py: Python<'py>,
        #[pyo3(from_py_with = block_arg)] block: u32,
    ) -> PyResult<Bound<'py, PyBytes>> {
        self.check_block(block)?;
        let n = self.memory.geometry.block_bytes() as usize;
        let buf = pyo3::types::PyByteArray::new(py, &vec![0u8; n]);
        self.read_block_into(py, block, buf.as_any())?;
        Ok(PyBytes::new(py, &buf.to_vec()))
    }

    /// Address and length of kvtier-allocated memory (host_cache), or of
    /// the memory a kvtier service shares (layer `l` at `address + l *
    /// bytes / layers`), for building a tensor over it; valid while this
    /// handle object lives.
    fn host_memory(&self) -> PyResult<(u64, u64)> {
        self.live()?;
        if let Some((_, mapping)) = self.service.as_ref().filter(|_| !self.staged) {
            let mapping = mapping.as_ref().ok_or_else(lookup_only_memory)?;
            return Ok((mapping.addr(), mapping.len()));
        }
        match (&self.host, &self.memory.layout) {
            (Some(_), KvLayout::CrossLayer { base }) => Ok((*base, self.memory.total_bytes())),
            _ => Err(usage(
                "host_memory() is for a host_cache(..., layout=\"cross_layer\"); this handle serves other memory",
            )),
        }
    }

    /// Issue the write backlog, wait for every job (GIL released), stop the
    /// I/O thread; raise the first engine failure. Later calls raise
    /// ClosedError. Through a service: wait for this process's jobs, then
    /// disconnect (its pins are dropped).
    fn close(&self, py: Python<'_>) -> PyResult<()> {
        let h = self.live()?;
        without_gil(py, || h.close()).map_err(to_py)
    }

    fn __enter__(slf: Py<Self>) -> Py<Self> {
        slf
    }

    #[pyo3(signature = (*_exc))]
    fn __exit__(&self, py: Python<'_>, _exc: &Bound<'_, PyTuple>) -> PyResult<bool> {
        self.close(py)?;
        Ok(false)
    }

    fn __repr__(&self) -> String {
        match (&self.service, &self.namespace) {
            (Some((path, _)), ns) => format!(
                "TierHandle(service={:?}, engine={}, namespace={:?}, memory_blocks={}, {})",
                path.display().to_string(),
                self.h().engine(),
                ns,
                self.memory.num_blocks,
                self.memory.geometry.describe()
            ),
            (None, ns) => format!(
                "TierHandle(engine={}, namespace={:?}, memory_blocks={})",
                self.h().engine(),
                ns,
                self.memory.num_blocks
            ),
        }
    }
}

impl Drop for TierHandle {
    fn drop(&mut self) {
        if self.forked() {
            // A forked child's copy: the I/O thread (which dropping would
            // join) lives in the parent, and the kvtier-allocated memory was
            // not inherited. Leave all of it to the process's exit, and let
            // the parent's pool alone.
            std::mem::forget(self.inner.take());
            std::mem::forget(self.host.take());
            std::mem::forget(self.gpu.take());
            return;
        }
        // The tier first (waits for I/O in flight), then the memory: the
        // tensors must outlive every DMA into them. Dropping Python objects
        // needs no GIL with pyo3 (they are queued until it is held).
        drop(self.inner.take());
        self.owners.get_mut().map(|v| v.clear()).ok();
        self.buffers.get_mut().map(|v| v.clear()).ok();
    }
}

/// Median nanoseconds of `iters` calls of `op` on the handle's Rust
/// TierHandle, with no Python between calls: the baseline the Python
/// bindings are compared against (scripts/py-latency.py). `op`: "lookup"
/// (`keys` all), "store" (one new key per call, from block 0, waited),
/// "load" (`keys[0]` into block 1, all layers, waited).
#[pyfunction]
pub(crate) fn rust_latency(
    py: Python<'_>,
    handle: &TierHandle,
    op: &str,
    keys: &Bound<'_, PyAny>,
    iters: usize,
    key_base: u64,
) -> PyResult<u64> {
    let keys = keys_of(keys)?;
    if !matches!(op, "lookup" | "store" | "load") {
        return Err(usage(format!(
            "op {op:?} is unknown; say lookup, store or load"
        )));
    }
    if op != "store" && keys.is_empty() {
        return Err(usage(format!("op {op:?} needs at least one key")));
    }
    if !(1..=1_000_000).contains(&iters) {
        return Err(usage(format!("iters={iters}: give 1 to 1000000")));
    }
    let h = handle.live()?;
    let layers = h.geometry().layers;
    let op = op.to_string();
    without_gil(py, || -> kvtier::Result<u64> {
        let mut t = Vec::with_capacity(iters);
        for i in 0..iters {
            let s = std::time::Instant::now();
            match op.as_str() {
                "lookup" => {
                    std::hint::black_box(h.lookup_prefix(&keys));
                }
                "store" => {
                    let j =
                        h.submit_store(&[Key::from_u64(key_base.wrapping_add(i as u64))], &[0])?;
                    h.wait(j)?;
                }
                _ => {
                    let j = h.submit_load(&keys[..1], &[1], 0..layers)?;
                    h.wait(j)?;
                }
            }
            t.push(s.elapsed().as_nanos() as u64);
        }
        t.sort_unstable();
        Ok(t.get(t.len() / 2).copied().unwrap_or(0))
    })
    .map_err(to_py)
}

/// A memory call on a lookup-only service handle.
fn lookup_only_memory() -> PyErr {
    usage(
        "this handle is a lookup-only client of the kvtier service: it shares no KV memory with the service (connect without lookup_only to load, store or see the memory)",
    )
}
