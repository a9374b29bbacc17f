//! `kvtier.connect(path)`: a [`ServiceHandle`], the handle API over a
//! `kvtier serve` socket, for the memory kinds that work over the service
//! (host memory: the KV memory the service shares with this process,
//! viewed as torch tensors through [`SharedRegion`]).

use crate::args::{
    block_arg, blocks_of, byte_buffer, job_arg, key_of, keys_of, layer_arg, layers_arg,
};
use crate::errors::{exception_for, to_py, usage};
use crate::handle::WAIT_SLICE;
use crate::lifecycle::{run_python_code, without_gil};
use crate::model::geometry_dict;
use crate::results::{event_py, result_py, EventPy, JobResultPy};
use kvtier::error::ErrorKind;
use kvtier::service::ServiceClient;
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyTuple};
use std::ffi::c_int;
use std::os::fd::AsRawFd;
use std::path::PathBuf;
use std::sync::Arc;

/// A view of part of the memory shared with the service, exporting the
/// buffer protocol (writable): `torch.frombuffer(region, dtype=...)` and
/// `memoryview(region)` keep it, and so the mapping, alive.
#[pyclass(module = "kvtier._kvtier", frozen)]
pub struct SharedRegion {
    mapping: Arc<kvtier::service::SharedMapping>,
    addr: u64,
    len: u64,
}

#[pymethods]
impl SharedRegion {
    /// # Safety
    /// `view` is the Py_buffer CPython hands a buffer exporter.
    unsafe fn __getbuffer__(
        slf: Bound<'_, Self>,
        view: *mut pyo3::ffi::Py_buffer,
        flags: c_int,
    ) -> PyResult<()> {
        let me = slf.get();
        debug_assert!(me.addr >= me.mapping.addr());
        // SAFETY: the region lies inside the mapping (made so by
        // layer_region), which lives as long as `slf`, which the buffer
        // holds a reference to (`obj`).
        let r = unsafe {
            pyo3::ffi::PyBuffer_FillInfo(
                view,
                slf.as_ptr(),
                me.addr as *mut std::ffi::c_void,
                me.len as pyo3::ffi::Py_ssize_t,
                0,
                flags,
            )
        };
        if r != 0 {
            return Err(PyErr::fetch(slf.py()));
        }
        Ok(())
    }

    unsafe fn __releasebuffer__(&self, _view: *mut pyo3::ffi::Py_buffer) {}

    fn __len__(&self) -> usize {
        self.len as usize
    }
}

/// A connection to a `kvtier serve` service: the methods of TierHandle
/// for host memory. Block numbers are this client's, 0..memory_blocks;
/// its KV memory is `layer_region(l)` per layer (kvtier.service_tensors
/// makes torch tensors of them).
#[pyclass(module = "kvtier._kvtier", frozen)]
pub struct ServiceHandle {
    client: ServiceClient,
}

impl ServiceHandle {
    fn c(&self) -> &ServiceClient {
        &self.client
    }
}

/// Connect to the kvtier service listening on `path`, sharing `blocks`
/// blocks of KV memory with it (0: as many as the service gives a client).
#[pyfunction]
#[pyo3(signature = (path, blocks = 0, memory = "cpu"))]
pub fn connect(
    py: Python<'_>,
    path: PathBuf,
    blocks: u32,
    memory: &str,
) -> PyResult<ServiceHandle> {
    if memory != "cpu" {
        return Err(exception_for(
            ErrorKind::Unsupported,
            format!(
                "memory={memory:?} over the kvtier service is not built yet: GPU KV memory needs the service's staged GPU path (issue 25, item 4: pinned staging shared by both processes, per-layer counters in shared memory); use memory=\"cpu\" or an in-process TierHandle"
            ),
        ));
    }
    let client = without_gil(py, || ServiceClient::connect(&path, blocks)).map_err(to_py)?;
    Ok(ServiceHandle { client })
}

#[pymethods]
impl ServiceHandle {
    #[getter]
    fn engine(&self) -> String {
        self.c().engine().to_string()
    }

    #[getter]
    fn geometry<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        geometry_dict(py, self.c().geometry())
    }

    #[getter]
    fn memory_blocks(&self) -> u32 {
        self.c().memory_blocks()
    }

    #[getter]
    fn block_bytes(&self) -> u64 {
        self.c().geometry().block_bytes()
    }

    /// Layer `layer` of the shared KV memory: `(blocks, 2, block_size,
    /// kv_heads, head_dim)` elements of the pool's dtype, as a buffer.
    fn layer_region(&self, #[pyo3(from_py_with = layer_arg)] layer: u32) -> PyResult<SharedRegion> {
        let (addr, len) = self.c().layer_region(layer).map_err(to_py)?;
        Ok(SharedRegion {
            mapping: self.c().shared_mapping(),
            addr,
            len,
        })
    }

    fn lookup(&self, py: Python<'_>, keys: &Bound<'_, PyAny>) -> PyResult<usize> {
        let keys = keys_of(keys)?;
        Ok(without_gil(py, || self.c().lookup_prefix(&keys)))
    }

    fn lookup_and_pin(&self, py: Python<'_>, keys: &Bound<'_, PyAny>) -> PyResult<usize> {
        let keys = keys_of(keys)?;
        Ok(without_gil(py, || self.c().lookup_and_pin(&keys)))
    }

    fn unpin(&self, py: Python<'_>, keys: &Bound<'_, PyAny>) -> PyResult<()> {
        let keys = keys_of(keys)?;
        without_gil(py, || self.c().unpin(&keys));
        Ok(())
    }

    fn remove(&self, py: Python<'_>, keys: &Bound<'_, PyAny>) -> PyResult<usize> {
        let keys = keys_of(keys)?;
        without_gil(py, || self.c().remove(&keys)).map_err(to_py)
    }

    fn contains(&self, py: Python<'_>, key: &Bound<'_, PyAny>) -> PyResult<bool> {
        let k = key_of(key, 0)?;
        Ok(without_gil(py, || self.c().contains(&k)))
    }

    fn submit_store(
        &self,
        py: Python<'_>,
        keys: &Bound<'_, PyAny>,
        blocks: &Bound<'_, PyAny>,
    ) -> PyResult<u64> {
        let keys = keys_of(keys)?;
        let blocks = blocks_of(blocks)?;
        without_gil(py, || self.c().submit_store(&keys, &blocks)).map_err(to_py)
    }

    #[pyo3(signature = (keys, blocks, layers = None))]
    fn submit_load(
        &self,
        py: Python<'_>,
        keys: &Bound<'_, PyAny>,
        blocks: &Bound<'_, PyAny>,
        layers: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<u64> {
        let keys = keys_of(keys)?;
        let blocks = blocks_of(blocks)?;
        let range = layers_arg(layers, self.c().geometry().layers)?;
        without_gil(py, || self.c().submit_load(&keys, &blocks, range)).map_err(to_py)
    }

    fn wait(
        &self,
        py: Python<'_>,
        #[pyo3(from_py_with = job_arg)] job: u64,
    ) -> PyResult<JobResultPy> {
        loop {
            match without_gil(py, || self.c().wait_timeout(job, WAIT_SLICE)).map_err(to_py)? {
                Some(r) => return Ok(result_py(py, r)),
                None => py.check_signals()?,
            }
        }
    }

    fn wait_layer(
        &self,
        py: Python<'_>,
        #[pyo3(from_py_with = job_arg)] job: u64,
        #[pyo3(from_py_with = layer_arg)] layer: u32,
    ) -> PyResult<()> {
        while !without_gil(py, || self.c().wait_layer_timeout(job, layer, WAIT_SLICE))
            .map_err(to_py)?
        {
            py.check_signals()?;
        }
        Ok(())
    }

    fn try_result(
        &self,
        py: Python<'_>,
        #[pyo3(from_py_with = job_arg)] job: u64,
    ) -> PyResult<Option<JobResultPy>> {
        Ok(self
            .c()
            .try_result(job)
            .map_err(to_py)?
            .map(|r| result_py(py, r)))
    }

    /// Copy `data` (bytes-like, at most one block) into memory block
    /// `block`, objects in (layer, K|V) order; the rest is zeroed.
    fn write_block(
        &self,
        py: Python<'_>,
        #[pyo3(from_py_with = block_arg)] block: u32,
        data: &Bound<'_, PyAny>,
    ) -> PyResult<()> {
        let data = byte_buffer(data, "data")?;
        if !data.is_c_contiguous() {
            return Err(usage("write_block needs a contiguous buffer"));
        }
        // SAFETY: the held PyBuffer keeps buf_ptr..+len exported and alive;
        // write_block copies it aside before writing (it may be a view of
        // the shared memory itself).
        let src =
            unsafe { std::slice::from_raw_parts(data.buf_ptr() as *const u8, data.len_bytes()) };
        without_gil(py, || self.c().write_block(block, src)).map_err(to_py)
    }

    /// Copy memory block `block` into `out` (a writable buffer of at most
    /// one block: its first len(out) bytes, objects in (layer, K|V) order).
    fn read_block_into(
        &self,
        py: Python<'_>,
        #[pyo3(from_py_with = block_arg)] block: u32,
        out: &Bound<'_, PyAny>,
    ) -> PyResult<()> {
        let out = byte_buffer(out, "out")?;
        if out.readonly() || !out.is_c_contiguous() {
            return Err(usage("read_block_into needs a writable, contiguous buffer"));
        }
        let n = out.len_bytes();
        let mut tmp = vec![0u8; n];
        without_gil(py, || self.c().read_block_into(block, &mut tmp)).map_err(to_py)?;
        // SAFETY: `out` is exported writable for n bytes; `tmp` is ours.
        unsafe { std::ptr::copy_nonoverlapping(tmp.as_ptr(), out.buf_ptr() as *mut u8, n) };
        Ok(())
    }

    /// An eventfd that polls readable while completions are queued; then
    /// drain_completions(). Events queue from the first call on.
    fn event_fd(&self) -> i32 {
        self.c().event_fd().as_raw_fd()
    }

    /// Every queued completion event (layer done, job finished), oldest first.
    fn drain_completions(&self, py: Python<'_>) -> Vec<EventPy> {
        self.c()
            .drain_events()
            .into_iter()
            .map(|e| event_py(py, e))
            .collect()
    }

    /// The service's pool and backlog occupancy (shared by every client).
    fn usage<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        let text = without_gil(py, || self.c().usage_json()).map_err(to_py)?;
        run_python_code(py, || py.import("json")?.call_method1("loads", (text,)))
    }

    /// Results of every finished job of this client not yet collected.
    fn get_finished(&self, py: Python<'_>) -> Vec<JobResultPy> {
        self.c()
            .get_finished()
            .into_iter()
            .map(|r| result_py(py, r))
            .collect()
    }

    /// The whole memory shared with the service, `(address, bytes)`: layer
    /// `l` starts at `address + l * bytes / layers`.
    fn host_memory(&self) -> (u64, u64) {
        self.c().host_memory()
    }

    fn flush_stores(&self, py: Python<'_>) -> PyResult<()> {
        without_gil(py, || self.c().flush_stores()).map_err(to_py)
    }

    /// Wait for this client's jobs, then disconnect (its pins are dropped).
    fn close(&self, py: Python<'_>) -> PyResult<()> {
        without_gil(py, || self.c().close()).map_err(to_py)
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
        format!(
            "ServiceHandle(engine={:?}, blocks={}, {})",
            self.c().engine(),
            self.c().memory_blocks(),
            self.c().geometry().describe()
        )
    }
}
