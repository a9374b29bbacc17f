//! `kvtier._kvtier`: the Python face of [`kvtier::TierHandle`].
//!
//! A thin layer, one module per concern: the library decides (where a pool
//! is, whether to open or create it, what a size or a model means); these
//! modules convert Python arguments and objects to its types and its errors
//! to Python exceptions. Everything that can wait (loads, stores, waits,
//! close) releases the GIL, so a vLLM worker's forward pass or LMCache's
//! other threads run while kvtier does I/O.

mod args;
mod builder;
mod errors;
mod handle;
mod lifecycle;
mod memory;
mod model;
mod results;
mod service;

use pyo3::prelude::*;

#[pymodule]
fn _kvtier(m: &Bound<'_, PyModule>) -> PyResult<()> {
    let py = m.py();
    lifecycle::install(m)?;
    m.add_class::<builder::TierBuilder>()?;
    m.add_class::<handle::TierHandle>()?;
    // The name `kvtier.connect` handles had before they were TierHandles.
    m.add("ServiceHandle", py.get_type::<handle::TierHandle>())?;
    m.add_class::<service::SharedRegion>()?;
    m.add_function(wrap_pyfunction!(service::connect, m)?)?;
    m.add("JobResult", py.get_type::<results::JobResultPy>())?;
    m.add("Event", py.get_type::<results::EventPy>())?;
    m.add_function(wrap_pyfunction!(model::resolve_model, m)?)?;
    m.add_function(wrap_pyfunction!(handle::rust_latency, m)?)?;
    errors::add_exceptions(m)
}
