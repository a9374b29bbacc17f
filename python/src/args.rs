//! Python arguments as kvtier's types: keys, block lists, byte buffers,
//! ints with named ranges, sizes, dtypes and policies. Each error names the
//! argument and what it takes.

use crate::errors::usage;
use kvtier::host::size::{parse_size, SizeError};
use kvtier::model::DType;
use kvtier::pool::Key;
use kvtier::sched::Policy;
use pyo3::buffer::PyBuffer;
use pyo3::exceptions::PyTypeError;
use pyo3::prelude::*;
use pyo3::types::PyBytes;

/// Keys are content hashes: `bytes` of 1 to 32 bytes (vLLM BlockHash,
/// LMCache chunk hash), or non-negative ints below 2**64.
pub(crate) fn key_of(o: &Bound<'_, PyAny>, i: usize) -> PyResult<Key> {
    if let Ok(b) = o.downcast::<PyBytes>() {
        return Key::new(b.as_bytes()).map_err(|e| usage(format!("key {i}: {e}")));
    }
    // bool is an int to Python: True and False would be stored as keys 1
    // and 0, colliding with those ints; a bool where a hash belongs is a
    // caller's bug, named here.
    if o.is_instance_of::<pyo3::types::PyBool>() {
        return Err(PyTypeError::new_err(format!(
            "key {i} is {o}, a bool; a key is bytes (1 to 32 bytes of content hash) or an int in 0..2**64"
        )));
    }
    if let Ok(x) = o.extract::<u64>() {
        return Ok(Key::from_u64(x));
    }
    if o.is_instance_of::<pyo3::types::PyInt>() {
        return Err(usage(format!(
            "key {i} is {o}, out of range: an int key is in 0..2**64 (or pass 1 to 32 bytes of content hash)"
        )));
    }
    Err(PyTypeError::new_err(format!(
        "key {i} is a {}; a key is bytes (1 to 32 bytes of content hash) or an int in 0..2**64",
        o.get_type()
            .name()
            .map(|n| n.to_string())
            .unwrap_or_default()
    )))
}

/// Most keys (or blocks) one call takes: 2**22 blocks of 16 tokens are 64M
/// tokens, far past any prompt; the bound keeps an endless iterator (or a
/// huge range) from growing a list until the process runs out of memory.
pub(crate) const MAX_KEYS_PER_CALL: usize = 1 << 22;

pub(crate) fn too_many(what: &str) -> PyErr {
    usage(format!(
        "more than {MAX_KEYS_PER_CALL} {what} in one call; split it into calls of at most that many"
    ))
}

/// `len(o)` when it has one (an endless iterator has none).
pub(crate) fn len_hint(o: &Bound<'_, PyAny>) -> Option<usize> {
    o.len().ok()
}

pub(crate) fn keys_of(keys: &Bound<'_, PyAny>) -> PyResult<Vec<Key>> {
    if keys.downcast::<PyBytes>().is_ok() {
        return Err(PyTypeError::new_err(
            "keys is one bytes object; pass a list of keys, e.g. [key]",
        ));
    }
    if len_hint(keys).is_some_and(|n| n > MAX_KEYS_PER_CALL) {
        return Err(too_many("keys"));
    }
    let mut out = Vec::with_capacity(len_hint(keys).unwrap_or(0));
    let it = keys
        .try_iter()
        .map_err(|_| PyTypeError::new_err("keys must be a sequence of bytes or ints"))?;
    for (i, k) in it.enumerate() {
        if i == MAX_KEYS_PER_CALL {
            return Err(too_many("keys"));
        }
        out.push(key_of(&k?, i)?);
    }
    Ok(out)
}

pub(crate) fn blocks_of(blocks: &Bound<'_, PyAny>) -> PyResult<Vec<u32>> {
    if len_hint(blocks).is_some_and(|n| n > MAX_KEYS_PER_CALL) {
        return Err(too_many("blocks"));
    }
    // A list of ints at C speed; anything else (a numpy array, a torch
    // tensor of block ids as vLLM's block tables are) item by item, each
    // through __index__, so that a bad id is named with its place.
    if let Ok(v) = blocks.extract::<Vec<u32>>() {
        return Ok(v);
    }
    let not_ints = || {
        PyTypeError::new_err(
            "blocks must be a sequence of ints in 0..2**32 (block indexes of the registered KV memory)",
        )
    };
    let it = blocks.try_iter().map_err(|_| not_ints())?;
    let mut out = Vec::with_capacity(len_hint(blocks).unwrap_or(0));
    for (i, b) in it.enumerate() {
        if i == MAX_KEYS_PER_CALL {
            return Err(too_many("blocks"));
        }
        let b = b?;
        let n = b
            .call_method0("__index__")
            .map_err(|_| {
                let t = b
                    .get_type()
                    .name()
                    .map(|n| n.to_string())
                    .unwrap_or_default();
                PyTypeError::new_err(format!(
                    "block {i} is a {t}; blocks are ints in 0..2**32 (block indexes of the registered KV memory)"
                ))
            })?;
        out.push(n.extract::<u32>().map_err(|_| {
            usage(format!(
                "block {i} is {n}, out of range: block indexes of the registered KV memory are in 0..2**32"
            ))
        })?);
    }
    Ok(out)
}

/// A byte view of any C-contiguous buffer: pyo3 refuses formats such as
/// ctypes' "<B" (LMCache's memoryviews) as u8, so cast them to "B" first.
pub(crate) fn byte_buffer(o: &Bound<'_, PyAny>, what: &str) -> PyResult<PyBuffer<u8>> {
    if let Ok(b) = PyBuffer::<u8>::get(o) {
        return Ok(b);
    }
    let mv = o
        .py()
        .import("builtins")?
        .getattr("memoryview")?
        .call1((o,))
        .map_err(|_| {
            PyTypeError::new_err(format!(
                "{what} must be a buffer (bytes, bytearray, memoryview, numpy array)"
            ))
        })?;
    let cast = mv.call_method1("cast", ("B",)).map_err(|_| {
        usage(format!(
            "{what} must be C-contiguous to be copied as bytes; pass a contiguous buffer"
        ))
    })?;
    PyBuffer::<u8>::get(&cast)
}

pub(crate) fn key_bytes<'py>(py: Python<'py>, k: &Key) -> Bound<'py, PyBytes> {
    PyBytes::new(py, k.as_bytes())
}

/// An int argument, with errors that name it: pyo3's own conversion says
/// only "out of range integral type conversion attempted".
pub(crate) fn int_arg<T>(o: &Bound<'_, PyAny>, name: &str, range: &str) -> PyResult<T>
where
    T: for<'a> FromPyObject<'a>,
{
    o.extract::<T>().map_err(|_| {
        if o.is_instance_of::<pyo3::types::PyInt>() {
            usage(format!(
                "{name} {o} is out of range: give an int in {range}"
            ))
        } else {
            let t = o
                .get_type()
                .name()
                .map(|n| n.to_string())
                .unwrap_or_default();
            PyTypeError::new_err(format!("{name} must be an int in {range}, not a {t}"))
        }
    })
}

macro_rules! int_args {
    ($($f:ident: $t:ty = $name:literal, $range:literal;)*) => {
        $(pub(crate) fn $f(o: &Bound<'_, PyAny>) -> PyResult<$t> {
            int_arg(o, $name, $range)
        })*
    };
}

int_args! {
    devices_arg: u32 = "devices", "1..=64";
    block_size_arg: u32 = "block_size", "1..=1048576 (tokens per block)";
    cache_blocks_arg: u32 = "blocks", "1..2**32";
    rank_arg: u32 = "tp_rank", "0..2**32";
    backlog_arg: u64 = "backlog_limit_blocks", "1..2**64";
    block_arg: u32 = "block", "0..memory_blocks";
    job_arg: u64 = "job", "1..2**64 (an id submit_load or submit_store returned)";
    layer_arg: u32 = "layer", "0..layers";
    stream_arg: u64 = "stream", "0..2**64 (torch.cuda.current_stream().cuda_stream)";
    layer_buffers_arg: u32 = "layer_buffers", "2..2**32";
    layers_count_arg: u32 = "layers", "1..2**32 (transformer layers)";
    kv_heads_arg: u32 = "kv_heads", "1..2**32 (KV heads per rank; 1 for MLA's latent)";
    head_dim_arg: u32 = "head_dim", "1..2**32 (elements per head and token)";
    service_blocks_arg: u32 = "blocks", "0..2**32 (0: as many as the service gives a client)";
}

pub(crate) fn group_blocks_arg(o: &Bound<'_, PyAny>) -> PyResult<u32> {
    match o.extract::<i64>() {
        Ok(n) if (1..=4096).contains(&n) => Ok(n as u32),
        _ => Err(usage(format!(
            "group_blocks({}) is out of range: give 1 to 4096 blocks per extent group",
            o.repr().map(|r| r.to_string()).unwrap_or_default()
        ))),
    }
}

pub(crate) fn staging_blocks_arg(o: &Bound<'_, PyAny>) -> PyResult<Option<u32>> {
    if o.is_none() {
        return Ok(None);
    }
    int_arg(
        o,
        "staging load_blocks/store_blocks/store_chunk_blocks",
        "1..2**32, or None",
    )
    .map(Some)
}

/// A size in bytes: an int, or a string with a k/m/g/t/p suffix (powers of
/// 1024), read by the library's one size parser.
pub(crate) fn size_arg(o: &Bound<'_, PyAny>, what: &str) -> PyResult<u64> {
    if o.is_instance_of::<pyo3::types::PyBool>() {
        return Err(PyTypeError::new_err(format!(
            "{what} must be bytes as an int or a string like \"8g\", not a bool"
        )));
    }
    if let Ok(n) = o.extract::<u64>() {
        return Ok(n);
    }
    if o.is_instance_of::<pyo3::types::PyInt>() {
        return Err(usage(format!(
            "{what} {o} is out of range: give a positive number of bytes below 2**64, or a string like \"8g\""
        )));
    }
    let s: String = o.extract().map_err(|_| {
        PyTypeError::new_err(format!(
            "{what} must be bytes as an int or a string like \"8g\""
        ))
    })?;
    match parse_size(&s) {
        Ok(n) if n > 0 => Ok(n),
        Ok(_) | Err(SizeError::NotASize) => Err(usage(format!(
            "{what} {s:?} is not a size; write bytes or e.g. \"512m\", \"8g\""
        ))),
        Err(SizeError::TooLarge) => Err(usage(format!(
            "{what} {s:?} is out of range: give a size below 16 EiB, e.g. \"8g\""
        ))),
    }
}

/// A `dtype=` argument: a name ("bfloat16", "fp8", ...) or a torch dtype
/// (`torch.bfloat16`, what a cache tensor's `.dtype` is), read as its name.
pub(crate) fn dtype_name_arg(o: &Bound<'_, PyAny>) -> PyResult<String> {
    if let Ok(s) = o.extract::<String>() {
        return Ok(s);
    }
    let is_torch_dtype = o.get_type().module().is_ok_and(|m| m == "torch")
        && o.get_type().name().is_ok_and(|n| n == "dtype");
    if is_torch_dtype {
        return Ok(o.str()?.to_string());
    }
    Err(PyTypeError::new_err(format!(
        "dtype must be a name such as \"bfloat16\" or a torch dtype such as torch.bfloat16, not a {}",
        o.get_type()
            .name()
            .map(|n| n.to_string())
            .unwrap_or_default()
    )))
}

pub(crate) fn opt_dtype_name_arg(o: &Bound<'_, PyAny>) -> PyResult<Option<String>> {
    if o.is_none() {
        return Ok(None);
    }
    dtype_name_arg(o).map(Some)
}

pub(crate) fn parse_dtype(d: &str) -> PyResult<DType> {
    DType::parse(d).ok_or_else(|| {
        usage(format!(
            "dtype {d:?} is unknown; say bfloat16, float16, float32, fp8 or fp8_e5m2"
        ))
    })
}

pub(crate) fn policy_of(s: &str) -> Option<Policy> {
    Some(match s {
        "slack" => Policy::Slack,
        "naive" => Policy::Naive,
        "sync" => Policy::Sync,
        _ => return None,
    })
}

/// A load's `layers` argument: a non-empty step-1 range within 0..n (None: all).
pub(crate) fn layers_arg(
    layers: Option<&Bound<'_, PyAny>>,
    n: u32,
) -> PyResult<std::ops::Range<u32>> {
    let Some(r) = layers else {
        return Ok(0..n);
    };
    let r = r
        .downcast::<pyo3::types::PyRange>()
        .map_err(|_| PyTypeError::new_err("layers must be a range, e.g. range(0, layers)"))?;
    let bound = |name: &str| -> PyResult<i64> {
        r.getattr(name)?.extract().map_err(|_| {
            usage(format!(
                "layers {}: its {name} is out of range; give a range within 0..{n}",
                r.repr().map(|x| x.to_string()).unwrap_or_default()
            ))
        })
    };
    let (s, e, st) = (bound("start")?, bound("stop")?, bound("step")?);
    if st != 1 || s < 0 || e <= s || e > n as i64 {
        return Err(usage(format!(
            "layers range({s}, {e}, {st}) is not a non-empty step-1 range within 0..{n}"
        )));
    }
    Ok(s as u32..e as u32)
}
