//! The engine's KV memory from Python: torch tensors (CPU or CUDA) and
//! buffers as regions, checked against the model and the layout, and the
//! CUDA context the staged HBM path needs.

use crate::errors::{to_py, usage};
use crate::lifecycle::without_gil;
use kvtier::error::Error;
use kvtier::gpu::{kernels, Context, Device};
use kvtier::memory::{KvLayout, KvMemory, MemoryKind};
use kvtier::model::{DType, KvGeometry};
use pyo3::exceptions::PyTypeError;
use pyo3::prelude::*;

/// A torch tensor's memory as kvtier registers it.
pub(crate) struct TensorRegion {
    pub(crate) addr: u64,
    pub(crate) len: u64,
    pub(crate) kind: MemoryKind,
    pub(crate) shape: Vec<u64>,
    pub(crate) element_size: u64,
    /// torch's name of the element type, e.g. "torch.bfloat16".
    pub(crate) dtype: String,
}

pub(crate) fn kind_label(k: MemoryKind) -> String {
    match k {
        MemoryKind::Host => "cpu".into(),
        MemoryKind::Gpu { ordinal } => format!("cuda:{ordinal}"),
    }
}

/// Address, length and device of a torch tensor (CPU or CUDA), refusing
/// what kvtier cannot address block by block.
pub(crate) fn tensor_region(t: &Bound<'_, PyAny>, i: usize) -> PyResult<TensorRegion> {
    let dev = t.getattr("device")?;
    let device: String = dev.getattr("type")?.extract()?;
    let kind = match device.as_str() {
        "cpu" => MemoryKind::Host,
        "cuda" => MemoryKind::Gpu {
            ordinal: dev.getattr("index")?.extract::<Option<u32>>()?.unwrap_or(0),
        },
        other => {
            return Err(to_py(Error::Unsupported(format!(
                "KV tensor {i} is on {other}; kvtier registers CPU tensors (direct I/O) and CUDA tensors (the staged HBM path): move the cache to cpu or cuda"
            ))))
        }
    };
    // KV memory is written by DMA, CPU copies and GPU kernels at the address
    // and length the object gives. A subclass of torch.Tensor can override
    // data_ptr, numel or shape: refused. Host memory is believed only from
    // torch's own tensor type, with its methods taken from the class (an
    // attribute set on the instance, which tensors take, cannot stand in for
    // them); a CUDA region is checked against the driver at registration.
    let torch = t.py().import("torch")?;
    let torch_tensor = torch.getattr("Tensor")?;
    let parameter = torch.getattr("nn")?.getattr("Parameter")?;
    let is_tensor = t.is_instance(&torch_tensor)?;
    let exact = t.get_type().is(&torch_tensor) || t.get_type().is(&parameter);
    let name = || {
        t.get_type()
            .name()
            .map(|n| n.to_string())
            .unwrap_or_else(|_| "?".into())
    };
    if is_tensor && !exact {
        return Err(PyTypeError::new_err(format!(
            "KV tensor {i} is a {}, a subclass of torch.Tensor; pass the plain tensor (t.as_subclass(torch.Tensor)), whose address and size kvtier can trust",
            name()
        )));
    }
    if kind == MemoryKind::Host && !is_tensor {
        return Err(PyTypeError::new_err(format!(
            "KV memory {i} is a {} with a data_ptr, not a torch.Tensor; pass torch tensors or buffers (bytearray, memoryview, numpy)",
            name()
        )));
    }
    // With torch function handling off, so that a TorchFunctionMode cannot
    // answer these calls for a plain tensor either.
    let no_torch_function = torch.getattr("_C")?.call_method0("DisableTorchFunction")?;
    no_torch_function.call_method0("__enter__")?;
    let region = tensor_facts(t, &torch_tensor, exact, i);
    no_torch_function.call_method1("__exit__", (t.py().None(), t.py().None(), t.py().None()))?;
    let (shape, addr, len, element_size) = region?;
    // A CUDA region need not be a torch tensor (it is checked against the
    // driver): without a dtype it is raw bytes.
    let dtype = match t.getattr("dtype") {
        Ok(d) => d.str()?.to_string(),
        Err(_) => String::new(),
    };
    Ok(TensorRegion {
        addr,
        len,
        kind,
        shape,
        element_size,
        dtype,
    })
}

/// A tensor's shape, address, byte length and element size (see
/// `tensor_region`), its methods taken from the class when `exact`.
pub(crate) fn tensor_facts(
    t: &Bound<'_, PyAny>,
    torch_tensor: &Bound<'_, PyAny>,
    exact: bool,
    i: usize,
) -> PyResult<(Vec<u64>, u64, u64, u64)> {
    let method = |m: &str| {
        if exact {
            torch_tensor.getattr(m)?.call1((t,))
        } else {
            t.call_method0(m)
        }
    };
    if !method("is_contiguous")?.extract::<bool>()? {
        return Err(usage(format!(
            "KV tensor {i} is not contiguous (strides {}); pass the cache tensor itself, not a strided or permuted view",
            method("stride")?.str()?
        )));
    }
    let shape: Vec<u64> = t.getattr("shape")?.extract()?;
    let addr: u64 = method("data_ptr")?.extract()?;
    let numel: u64 = method("numel")?.extract()?;
    let element_size: u64 = method("element_size")?.extract()?;
    let len = numel.checked_mul(element_size).ok_or_else(|| {
        usage(format!(
            "KV tensor {i} claims {numel} elements of {element_size} bytes, more than the address space; pass the cache tensor itself"
        ))
    })?;
    Ok((shape, addr, len, element_size))
}

/// A registered tensor's shape, element size and torch dtype name.
pub(crate) type TensorShape = (Vec<u64>, u64, String);

/// Torch tensors' shapes against the model and the layout: the element
/// size is the KV dtype's (or 1, a byte view), a floating-point element
/// type is the KV dtype itself (float16 and bfloat16 have the same size but
/// other bytes: a pool's namespace names its dtype, and an engine reading
/// bf16 KV stored from an fp16 cache would compute on wrong values), and
/// the dimension that separates K from V is 2 where the layout puts it.
pub(crate) fn check_shapes(
    g: &KvGeometry,
    layout: &str,
    shapes: &[Option<TensorShape>],
) -> PyResult<()> {
    let dsize = g.dtype.bytes() as u64;
    for (i, s) in shapes.iter().enumerate() {
        let Some((shape, esz, dtype)) = s else {
            continue;
        };
        if *esz != dsize && *esz != 1 {
            return Err(usage(format!(
                "KV tensor {i} has {esz}-byte elements but the model's KV dtype {} has {dsize}: pass dtype= to model() to match the cache, or a tensor of that dtype",
                g.dtype.name()
            )));
        }
        // Integer views (uint8 bytes, vLLM's fp8 caches) carry no dtype of
        // their own; a float dtype kvtier knows must be the model's.
        if let Some(d) = DType::parse(dtype).filter(|d| *d != g.dtype) {
            return Err(usage(format!(
                "KV tensor {i} is {dtype} but the model's KV dtype is {}: pass dtype=\"{}\" to model() or geometry() to match the cache, or tensors of {} (a byte view, tensor.view(torch.uint8), registers raw bytes)",
                g.dtype.name(),
                d.name(),
                g.dtype.name()
            )));
        }
        // Only full-rank tensors are checked: flat or byte views are sized
        // by their byte count alone (memory_of).
        let (kv_dim, rank) = match layout {
            "per_layer" => (0, 5),
            "block_major" => (1, 5),
            _ => (2, 6),
        };
        if shape.len() == rank && shape[kv_dim] != 2 {
            return Err(usage(format!(
                "KV tensor {i} has shape {shape:?}: layout {layout:?} has K and V (2) in dimension {kv_dim}; pick the layout that matches the cache"
            )));
        }
        if layout == "cross_layer" && shape.len() == rank && shape[1] != g.layers as u64 {
            return Err(usage(format!(
                "cross_layer KV tensor has shape {shape:?}: dimension 1 should be the model's {} layers",
                g.layers
            )));
        }
        // The dimensions after blocks and K|V are one object: block_size x
        // heads x dim.
        if shape.len() == rank {
            let from = rank - 3;
            let obj: u64 = shape[from..].iter().product::<u64>() * esz;
            if obj != g.object_bytes() {
                return Err(usage(format!(
                    "KV tensor {i} has shape {shape:?}: dimensions {:?} hold {obj} bytes per block's K (or V), the model's {} has {}; check the model, block_size and dtype given to model()",
                    &shape[from..],
                    g.describe(),
                    g.object_bytes()
                )));
            }
        }
    }
    Ok(())
}

/// The primary context of CUDA device `ordinal` (torch's), after checking
/// that everything the staged HBM path needs is here: the error names what
/// is missing and the fix.
pub(crate) fn gpu_context(py: Python<'_>, ordinal: u32) -> PyResult<Context> {
    let fix = "CUDA KV tensors are served through kvtier's staged HBM path, which needs the NVIDIA driver (libcuda), a visible GPU and a kvtier built with its kernels (nvcc on PATH when the wheel was built)";
    let r = without_gil(py, || -> Result<Context, (Error, &'static str)> {
        kernels::staging().map_err(|e| {
            (
                e,
                "rebuild the wheel with nvcc on PATH (CUDA toolkit), or register CPU tensors",
            )
        })?;
        let dev = Device::get(ordinal as i32).map_err(|e| {
            (
                e,
                "install the NVIDIA driver and check CUDA_VISIBLE_DEVICES, or register CPU tensors",
            )
        })?;
        Context::primary(&dev)
            .map_err(|e| (e, "check the driver (nvidia-smi), or register CPU tensors"))
    });
    r.map_err(|(e, hint)| to_py(Error::Unsupported(format!("{fix}: {e}; fix: {hint}"))))
}

/// The KvMemory these regions describe, checking sizes against the model.
pub(crate) fn memory_of(
    g: KvGeometry,
    regions: &[(u64, u64)],
    layout: &str,
    kind: MemoryKind,
    copies_only: bool,
) -> PyResult<KvMemory> {
    let obj = g.object_bytes();
    let (layout, per_block, got) = match layout {
        "per_layer" | "block_major" => {
            if regions.len() != g.layers as usize {
                return Err(usage(format!(
                    "{layout} KV memory has {} tensors but the model has {} layers; pass one tensor per layer",
                    regions.len(),
                    g.layers
                )));
            }
            let first = regions[0].1;
            if let Some((i, r)) = regions.iter().enumerate().find(|(_, r)| r.1 != first) {
                return Err(usage(format!(
                    "KV tensor {i} has {} bytes but tensor 0 has {first}; every layer's tensor must be the same size",
                    r.1
                )));
            }
            let layer_bases = regions.iter().map(|r| r.0).collect();
            (
                if layout == "block_major" {
                    KvLayout::BlockMajor { layer_bases }
                } else {
                    KvLayout::PerLayer { layer_bases }
                },
                2 * obj,
                first,
            )
        }
        _ => {
            if regions.len() != 1 {
                return Err(usage(format!(
                    "cross_layer KV memory is one tensor; got {}",
                    regions.len()
                )));
            }
            (
                KvLayout::CrossLayer { base: regions[0].0 },
                g.block_bytes(),
                regions[0].1,
            )
        }
    };
    if got == 0 || got % per_block != 0 {
        return Err(usage(format!(
            "a KV tensor of {got} bytes is not a whole number of blocks of {per_block} bytes ({}); check the model, block_size and dtype given to model()",
            g.describe()
        )));
    }
    let num_blocks = u32::try_from(got / per_block).map_err(|_| {
        usage(format!(
            "{} blocks is more than kvtier indexes",
            got / per_block
        ))
    })?;
    let m = KvMemory {
        geometry: g,
        num_blocks,
        layout,
        kind,
    };
    if copies_only {
        m.validate_for_copies().map_err(to_py)?;
    } else {
        m.validate().map_err(to_py)?;
    }
    Ok(m)
}
