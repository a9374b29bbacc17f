//! A [`TierHandle`] over a `kvtier serve` socket (`TierBuilder().service(PATH)`,
//! and its short form `kvtier.connect(PATH)`), for the memory kinds that work
//! over the service (host memory: the KV memory the service shares with
//! this process, viewed as torch tensors through [`SharedRegion`]).

use crate::errors::{exception_for, to_py};
use crate::handle::TierHandle;
use crate::lifecycle::{without_gil, FORKS};
use kvtier::error::ErrorKind;
use kvtier::model::KvGeometry;
use kvtier::TierBuilder as RsBuilder;
use pyo3::prelude::*;
use std::ffi::c_int;
use std::path::PathBuf;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};

/// A view of part of the memory shared with the service, exporting the
/// buffer protocol (writable): `torch.frombuffer(region, dtype=...)` and
/// `memoryview(region)` keep it, and so the mapping, alive.
#[pyclass(module = "kvtier._kvtier", frozen)]
pub struct SharedRegion {
    mapping: Arc<kvtier::service::SharedMapping>,
    addr: u64,
    len: u64,
}

impl SharedRegion {
    /// `addr..+len`, which must lie inside `mapping`.
    pub(crate) fn new(mapping: Arc<kvtier::service::SharedMapping>, addr: u64, len: u64) -> Self {
        debug_assert!(addr >= mapping.addr() && addr + len <= mapping.addr() + mapping.len());
        SharedRegion { mapping, addr, len }
    }
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

/// Connect to the kvtier service listening on `path`, sharing `blocks`
/// blocks of KV memory with it (0: as many as the service gives a client):
/// `TierBuilder().service(path, blocks).build()`. `lookup_only=True`:
/// lookups, pins and unpins only (no memory shared; an engine's scheduler).
#[pyfunction]
#[pyo3(signature = (path, blocks = 0, memory = "cpu", lookup_only = false))]
pub fn connect(
    py: Python<'_>,
    path: PathBuf,
    blocks: u32,
    memory: &str,
    lookup_only: bool,
) -> PyResult<TierHandle> {
    if memory != "cpu" {
        return Err(exception_for(
            ErrorKind::Unsupported,
            format!(
                "memory={memory:?}: connect() shares the service's own memory, which is host memory; for GPU KV memory through the service give the CUDA tensors: TierBuilder().service(PATH).model(...).kv_memory([tensors]).build() (the staged path over the memory the service shares)"
            ),
        ));
    }
    open(py, path, blocks, None, lookup_only)
}

/// The handle of a client of the service at `path`, expecting `geometry`
/// when given (the library checks it against the one served).
pub(crate) fn open(
    py: Python<'_>,
    path: PathBuf,
    blocks: u32,
    geometry: Option<KvGeometry>,
    lookup_only: bool,
) -> PyResult<TierHandle> {
    let mut b = RsBuilder::default().service(&path).blocks(blocks);
    if let Some(g) = geometry {
        b = b.geometry(g);
    }
    if lookup_only {
        b = b.lookup_only();
    }
    let client = without_gil(py, || b.build()).map_err(to_py)?;
    // Events queue from here on, as for a pool of this process's own.
    let completions = client.completions().map_err(to_py)?;
    let memory = client.memory().clone();
    let mapping = client.shared_mapping();
    let (namespace, model_name) = (
        client.namespace().to_string(),
        client.model_name().to_string(),
    );
    Ok(TierHandle {
        inner: Some(Box::new(client)),
        completions,
        memory,
        host: None,
        service: Some((path, mapping)),
        namespace,
        model_name,
        staged: false,
        gpu: None,
        owners: Mutex::new(Vec::new()),
        buffers: Mutex::new(Vec::new()),
        forks: FORKS.load(Ordering::SeqCst),
    })
}
