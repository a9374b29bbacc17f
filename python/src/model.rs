//! Model specs and geometries as Python sees them.

use crate::args::{block_size_arg, opt_dtype_name_arg, parse_dtype};
use crate::errors::to_py;
use kvtier::model::{resolve_named, KvGeometry};
use pyo3::prelude::*;
use pyo3::types::PyDict;

/// Parse a model spec as kvtier does, for tools that size memory before
/// opening a pool: returns the geometry dict and the model's name.
#[pyfunction]
#[pyo3(signature = (spec, block_size = 16, dtype = None))]
pub(crate) fn resolve_model<'py>(
    py: Python<'py>,
    spec: String,
    #[pyo3(from_py_with = block_size_arg)] block_size: u32,
    #[pyo3(from_py_with = opt_dtype_name_arg)] dtype: Option<String>,
) -> PyResult<(Bound<'py, PyDict>, String)> {
    let dtype = dtype.as_deref().map(parse_dtype).transpose()?;
    let n = resolve_named(&spec, block_size, dtype).map_err(to_py)?;
    let g = n.geometry;
    Ok((geometry_dict(py, &g)?, n.name))
}

/// A KV geometry as Python sees it: layers, kv_heads, head_dim, dtype,
/// block_size, object_bytes, block_bytes.
pub(crate) fn geometry_dict<'py>(py: Python<'py>, g: &KvGeometry) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    d.set_item("layers", g.layers)?;
    d.set_item("kv_heads", g.kv_heads)?;
    d.set_item("head_dim", g.head_dim)?;
    d.set_item("dtype", g.dtype.name())?;
    d.set_item("block_size", g.block_size)?;
    d.set_item("object_bytes", g.object_bytes())?;
    d.set_item("block_bytes", g.block_bytes())?;
    Ok(d)
}
