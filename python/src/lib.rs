//! `kvtier._kvtier`: the Python face of [`kvtier::TierHandle`].
//!
//! Everything that can wait (loads, stores, waits, close) releases the GIL,
//! so a vLLM worker's forward pass or LMCache's other threads run while
//! kvtier does I/O. Errors become one Python exception class per
//! [`ErrorKind`], carrying the kind and, for device failures, the I/O.

use kvtier::error::{Error, ErrorKind, Failure, Fix};
use kvtier::gpu::staged::StagingConfig;
use kvtier::gpu::{kernels, CompletionCounter, Context, Device};
use kvtier::handle::{Completions, EngineChoice, Event, HandleConfig, TierBuilder as RsBuilder};
use kvtier::memory::{HostKvCache, HostLayout, KvLayout, KvMemory, MemoryKind};
use kvtier::model::{resolve_named, DType, KvGeometry, NamedGeometry};
use kvtier::pool::{DeviceSpec, Key, OpenExpect, PoolConfig, DEFAULT_GROUP_BLOCKS};
use kvtier::sched::Policy;
use kvtier::tier::{JobKind, JobResult, KeyOutcome};
use pyo3::buffer::PyBuffer;
use pyo3::create_exception;
use pyo3::exceptions::{PyException, PyTypeError};
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict, PyRange, PyTuple};
use std::os::fd::AsRawFd;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicI64, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, Once};
use std::time::Duration;

mod service;

create_exception!(
    _kvtier,
    KvtierError,
    PyException,
    "Base of every kvtier error."
);
create_exception!(
    _kvtier,
    UsageError,
    KvtierError,
    "The call was wrong: fix it; retrying unchanged fails again."
);
create_exception!(
    _kvtier,
    BackpressureError,
    KvtierError,
    "A bounded queue is full; nothing was accepted: retry after jobs finish or pins are dropped."
);
create_exception!(
    _kvtier,
    IoError,
    KvtierError,
    "A device, the kernel or the driver failed an I/O; `io` says which."
);
create_exception!(
    _kvtier,
    CorruptError,
    KvtierError,
    "Stored data or metadata fails its checks: treat the blocks as missing."
);
create_exception!(
    _kvtier,
    UnsupportedError,
    KvtierError,
    "Not available with this build, engine or machine."
);
create_exception!(_kvtier, ClosedError, KvtierError, "The handle is closed.");
create_exception!(
    _kvtier,
    InternalError,
    KvtierError,
    "kvtier's own bookkeeping failed (a bug): report it."
);

fn kind_name(k: ErrorKind) -> &'static str {
    match k {
        ErrorKind::Usage => "usage",
        ErrorKind::Backpressure => "backpressure",
        ErrorKind::Io => "io",
        ErrorKind::Corrupt => "corrupt",
        ErrorKind::Unsupported => "unsupported",
        ErrorKind::Closed => "closed",
        ErrorKind::Internal => "internal",
    }
}

fn exception_for(kind: ErrorKind, msg: String) -> PyErr {
    match kind {
        ErrorKind::Usage => UsageError::new_err(msg),
        ErrorKind::Backpressure => BackpressureError::new_err(msg),
        ErrorKind::Io => IoError::new_err(msg),
        ErrorKind::Corrupt => CorruptError::new_err(msg),
        ErrorKind::Unsupported => UnsupportedError::new_err(msg),
        ErrorKind::Closed => ClosedError::new_err(msg),
        ErrorKind::Internal => InternalError::new_err(msg),
    }
}

/// The failure as a Python exception with `kind` and `io` attributes.
fn failure_err(py: Python<'_>, f: &Failure) -> PyErr {
    // Messages quote superblocks, configs and arguments: no raw control
    // characters reach a terminal that prints them.
    let err = exception_for(f.kind, kvtier::host::printable(&f.message).into_owned());
    let v = err.value(py);
    let _ = v.setattr("kind", kind_name(f.kind));
    let io = f.io.as_ref().map(|io| {
        let d = PyDict::new(py);
        let _ = d.set_item("device", &io.device);
        let _ = d.set_item("offset", io.offset);
        let _ = d.set_item("len", io.len);
        let _ = d.set_item("op", io.op);
        let _ = d.set_item("cause", format!("{:?}", io.cause));
        d
    });
    let _ = v.setattr("io", io);
    err
}

/// The error as a Python exception; a fix the library names by its meaning
/// (`Fix`) is said as the Python API's call that makes it.
fn to_py(e: Error) -> PyErr {
    let f = match e.fix() {
        Some(fix) => {
            let mut f = Failure::from(e.without_fix());
            f.message = format!("{}; {}", f.message, fix_text(fix));
            f
        }
        None => Failure::from(e),
    };
    Python::with_gil(|py| failure_err(py, &f))
}

/// Whether the file at `p` begins with a kvtier superblock's magic (false when
/// it cannot be read: then creating over it reports why).
fn begins_a_pool(p: &std::path::Path) -> bool {
    head_of(p).is_some_and(|h| h[..8] == kvtier::host::signature::POOL_MAGIC)
}

/// The first 24 bytes of a regular file or block device (None for anything
/// else: opening a FIFO to read would wait for a writer).
fn head_of(p: &std::path::Path) -> Option<[u8; 24]> {
    use std::io::Read;
    use std::os::unix::fs::FileTypeExt;
    let ft = std::fs::metadata(p).ok()?.file_type();
    if !ft.is_file() && !ft.is_block_device() {
        return None;
    }
    let mut head = [0u8; 24];
    std::fs::File::open(p)
        .and_then(|mut f| f.read_exact(&mut head))
        .ok()?;
    Some(head)
}

/// A fix in the Python API's words.
fn fix_text(fix: &Fix) -> String {
    const ALWAYS: &str = "TierBuilder.create(\"always\")";
    match fix {
        Fix::Overwrite => format!("call {ALWAYS} to overwrite it (its contents will be lost)"),
        Fix::AllowSparse => format!("call {ALWAYS} to create it sparse anyway"),
        Fix::Truncate { to, .. } => format!(
            "call {ALWAYS} to truncate it to {to} bytes, or give a capacity() that keeps it"
        ),
        Fix::GiveSize {
            multiple_of,
            at_least,
        } => format!(
            "give capacity() (per file a multiple of {multiple_of} bytes, at least {at_least} bytes)"
        ),
        Fix::AlignSize { .. } => {
            "give a capacity() that is a multiple of 4096 bytes per file".into()
        }
        Fix::SmallerSize => "give a smaller capacity()".into(),
        Fix::LargerSize => "give a larger capacity()".into(),
        Fix::Recreate => {
            format!("recreate the pool with {ALWAYS} (every block stored in it is lost)")
        }
        Fix::RerunCreate => format!("build it again (no {ALWAYS} needed)"),
        Fix::CreatePool => "create one: TierBuilder().directory(...).capacity(...)".into(),
        Fix::NameDType => "pass dtype= to geometry() or model()".into(),
        other => other.to_string(),
    }
}

fn usage(msg: impl Into<String>) -> PyErr {
    to_py(Error::invalid(msg))
}

/// Keys are content hashes: `bytes` of 1 to 32 bytes (vLLM BlockHash,
/// LMCache chunk hash), or non-negative ints below 2**64.
fn key_of(o: &Bound<'_, PyAny>, i: usize) -> PyResult<Key> {
    if let Ok(b) = o.downcast::<PyBytes>() {
        return Key::new(b.as_bytes()).map_err(|e| usage(format!("key {i}: {e}")));
    }
    if let Ok(x) = o.extract::<u64>() {
        return Ok(Key::from_u64(x));
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
const MAX_KEYS_PER_CALL: usize = 1 << 22;

fn too_many(what: &str) -> PyErr {
    usage(format!(
        "more than {MAX_KEYS_PER_CALL} {what} in one call; split it into calls of at most that many"
    ))
}

/// `len(o)` when it has one (an endless iterator has none).
fn len_hint(o: &Bound<'_, PyAny>) -> Option<usize> {
    o.len().ok()
}

fn keys_of(keys: &Bound<'_, PyAny>) -> PyResult<Vec<Key>> {
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

fn blocks_of(blocks: &Bound<'_, PyAny>) -> PyResult<Vec<u32>> {
    if len_hint(blocks).is_some_and(|n| n > MAX_KEYS_PER_CALL) {
        return Err(too_many("blocks"));
    }
    blocks.extract::<Vec<u32>>().map_err(|_| {
        PyTypeError::new_err(
            "blocks must be a sequence of ints in 0..2**32 (block indexes of the registered KV memory)",
        )
    })
}

/// A byte view of any C-contiguous buffer: pyo3 refuses formats such as
/// ctypes' "<B" (LMCache's memoryviews) as u8, so cast them to "B" first.
fn byte_buffer(o: &Bound<'_, PyAny>, what: &str) -> PyResult<PyBuffer<u8>> {
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

fn key_bytes<'py>(py: Python<'py>, k: &Key) -> Bound<'py, PyBytes> {
    PyBytes::new(py, k.as_bytes())
}

/// An int argument, with errors that name it: pyo3's own conversion says
/// only "out of range integral type conversion attempted".
fn int_arg<T>(o: &Bound<'_, PyAny>, name: &str, range: &str) -> PyResult<T>
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
        $(fn $f(o: &Bound<'_, PyAny>) -> PyResult<$t> {
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
}

/// A load's `layers` argument: a non-empty step-1 range within 0..n (None: all).
fn layers_arg(layers: Option<&Bound<'_, PyAny>>, n: u32) -> PyResult<std::ops::Range<u32>> {
    let Some(r) = layers else {
        return Ok(0..n);
    };
    let r = r
        .downcast::<PyRange>()
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

fn group_blocks_arg(o: &Bound<'_, PyAny>) -> PyResult<u32> {
    match o.extract::<i64>() {
        Ok(n) if (1..=4096).contains(&n) => Ok(n as u32),
        _ => Err(usage(format!(
            "group_blocks({}) is out of range: give 1 to 4096 blocks per extent group",
            o.repr().map(|r| r.to_string()).unwrap_or_default()
        ))),
    }
}

fn staging_blocks_arg(o: &Bound<'_, PyAny>) -> PyResult<Option<u32>> {
    if o.is_none() {
        return Ok(None);
    }
    int_arg(o, "staging load_blocks/store_blocks", "1..2**32, or None").map(Some)
}

/// A size in bytes: an int, or a string with a k/m/g/t suffix (powers of 1024).
fn parse_size(o: &Bound<'_, PyAny>, what: &str) -> PyResult<u64> {
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
    let t = s.trim().to_ascii_lowercase();
    let t = t
        .strip_suffix("ib")
        .or_else(|| t.strip_suffix('b'))
        .unwrap_or(&t);
    let (num, mul) = match t.chars().last() {
        Some('k') => (&t[..t.len() - 1], 1u64 << 10),
        Some('m') => (&t[..t.len() - 1], 1 << 20),
        Some('g') => (&t[..t.len() - 1], 1 << 30),
        Some('t') => (&t[..t.len() - 1], 1 << 40),
        Some('p') => (&t[..t.len() - 1], 1 << 50),
        _ => (t, 1),
    };
    let bytes = num
        .trim()
        .parse::<f64>()
        .ok()
        .filter(|v| v.is_finite() && *v > 0.0)
        .map(|v| v * mul as f64)
        .ok_or_else(|| {
            usage(format!(
                "{what} {s:?} is not a size; write bytes or e.g. \"512m\", \"8g\""
            ))
        })?;
    if bytes >= 18_446_744_073_709_551_616.0 {
        return Err(usage(format!(
            "{what} {s:?} is out of range: give a size below 16 EiB, e.g. \"8g\""
        )));
    }
    Ok(bytes as u64)
}

enum Where {
    Files(Vec<PathBuf>),
    Dir(PathBuf, u32),
}

/// What the KV memory is, before `build`.
#[derive(Clone)]
enum Mem {
    Host {
        blocks: u32,
        layout: HostLayout,
    },
    Regions {
        regions: Vec<(u64, u64)>,
        layout: String,
        kind: MemoryKind,
        /// Per torch tensor: its shape and element size, checked against
        /// the model at build (raw buffers have none).
        shapes: Vec<Option<(Vec<u64>, u64)>>,
    },
}

/// What `build()` takes the pool's geometry from.
#[derive(Clone)]
enum ModelSpec {
    /// `model()`: a preset or a config.json, a block size, a dtype override.
    Named(String, u32, Option<String>),
    /// `geometry()`: given directly by the engine.
    Geometry(NamedGeometry),
}

fn parse_dtype(d: &str) -> PyResult<DType> {
    DType::parse(d).ok_or_else(|| {
        usage(format!(
            "dtype {d:?} is unknown; say bfloat16, float16, float32, fp8 or fp8_e5m2"
        ))
    })
}

/// Opens (or creates) a pool and serves KV memory from it. Every setter
/// returns the builder, so calls chain; `build()` opens the tier.
#[pyclass(module = "kvtier._kvtier")]
pub struct TierBuilder {
    place: Option<Where>,
    capacity: Option<u64>,
    create: String,
    model: Option<ModelSpec>,
    namespace: Option<String>,
    tp_rank: u32,
    engine: String,
    policy: String,
    backlog_blocks: Option<u64>,
    group_blocks: u32,
    mem: Option<Mem>,
    owners: Vec<Py<PyAny>>,
    buffers: Vec<PyBuffer<u8>>,
    staging: Option<StagingConfig>,
    staged_host_double: bool,
    prewrite: bool,
}

#[pymethods]
impl TierBuilder {
    #[new]
    fn new() -> Self {
        TierBuilder {
            place: None,
            capacity: None,
            create: "auto".into(),
            model: None,
            namespace: None,
            tp_rank: 0,
            engine: "auto".into(),
            policy: "slack".into(),
            backlog_blocks: None,
            group_blocks: DEFAULT_GROUP_BLOCKS,
            mem: None,
            owners: Vec::new(),
            buffers: Vec::new(),
            staging: None,
            staged_host_double: false,
            prewrite: false,
        }
    }

    /// When the pool is created: write every byte of its files once
    /// (`capacity` at the disk's write speed), so that first stores run at
    /// overwrite speed instead of converting the file system's unwritten
    /// extents (~0.6x on ext4). Block devices are never prewritten.
    #[pyo3(signature = (enabled = true))]
    fn prewrite(mut slf: PyRefMut<'_, Self>, enabled: bool) -> PyRefMut<'_, Self> {
        slf.prewrite = enabled;
        slf
    }

    /// Pinned host staging of the staged HBM path (CUDA KV tensors):
    /// `layer_buffers` layers of loads in flight (at least 2), each of up to
    /// `load_blocks` blocks (larger loads go in chunks), `store_blocks`
    /// blocks of stores in flight.
    /// Defaults: 4 buffers, min(blocks, 1024) and min(blocks, 64).
    #[pyo3(signature = (layer_buffers = 4, load_blocks = None, store_blocks = None))]
    fn staging(
        mut slf: PyRefMut<'_, Self>,
        #[pyo3(from_py_with = layer_buffers_arg)] layer_buffers: u32,
        #[pyo3(from_py_with = staging_blocks_arg)] load_blocks: Option<u32>,
        #[pyo3(from_py_with = staging_blocks_arg)] store_blocks: Option<u32>,
    ) -> PyResult<PyRefMut<'_, Self>> {
        if layer_buffers < 2 || load_blocks == Some(0) || store_blocks == Some(0) {
            return Err(usage(format!(
                "staging(layer_buffers={layer_buffers}, load_blocks={load_blocks:?}, store_blocks={store_blocks:?}): need at least 2 layer buffers and 1 block each"
            )));
        }
        // Block counts left out follow the memory's size at build.
        slf.staging = Some(StagingConfig::new(
            layer_buffers,
            load_blocks.unwrap_or(0),
            store_blocks.unwrap_or(0),
        ));
        Ok(slf)
    }

    /// TEST DOUBLE, for tests on machines without a GPU: serve the CPU
    /// tensors given to kv_memory as if they were GPU memory, through the
    /// staged HBM path with the CPU doing the staging kernels' copies. The
    /// same staging, layer order, checksums and errors as on a GPU; no
    /// device is involved and nothing is faster. Never for serving.
    fn test_only_staged_host_double(mut slf: PyRefMut<'_, Self>) -> PyRefMut<'_, Self> {
        slf.staged_host_double = true;
        slf
    }

    /// The pool's backing files or block devices.
    fn files<'a>(
        mut slf: PyRefMut<'a, Self>,
        paths: &Bound<'_, PyAny>,
    ) -> PyResult<PyRefMut<'a, Self>> {
        // A str is a sequence too (of characters): refuse it by name.
        if paths.is_instance_of::<pyo3::types::PyString>()
            || paths.is_instance_of::<PyBytes>()
            || paths.hasattr("__fspath__")?
        {
            return Err(PyTypeError::new_err(
                "files takes a list of paths, e.g. files([path]); one path is files([path]) or directory(dir)",
            ));
        }
        let paths: Vec<PathBuf> = paths.extract().map_err(|_| {
            PyTypeError::new_err("files takes a list of paths (str or os.PathLike)")
        })?;
        if paths.is_empty() {
            return Err(usage("files([]) names no file; give at least one path"));
        }
        slf.place = Some(Where::Files(paths));
        Ok(slf)
    }

    /// A pool of `devices` files (`kvtier-<i>.pool`) in `path`; the
    /// directory is created when the pool is.
    #[pyo3(signature = (path, devices = 1))]
    fn directory(
        mut slf: PyRefMut<'_, Self>,
        path: PathBuf,
        #[pyo3(from_py_with = devices_arg)] devices: u32,
    ) -> PyResult<PyRefMut<'_, Self>> {
        if devices == 0 || devices > 64 {
            return Err(usage(format!(
                "directory(devices={devices}): give 1 to 64 pool files"
            )));
        }
        slf.place = Some(Where::Dir(path, devices));
        Ok(slf)
    }

    /// Blocks per extent group of a pool this builder creates (default 64):
    /// the smallest pool is one group per file, so fewer blocks a group let
    /// small pools of large blocks exist (LMCache's 32 MiB chunks); a run
    /// of consecutive blocks is one extent per layer only within a group.
    /// An existing pool keeps the group it was created with.
    fn group_blocks(
        mut slf: PyRefMut<'_, Self>,
        #[pyo3(from_py_with = group_blocks_arg)] n: u32,
    ) -> PyRefMut<'_, Self> {
        slf.group_blocks = n;
        slf
    }

    /// Bytes of pool to create (split over the files): an int or "8g".
    fn capacity<'a>(
        mut slf: PyRefMut<'a, Self>,
        size: &Bound<'_, PyAny>,
    ) -> PyResult<PyRefMut<'a, Self>> {
        slf.capacity = Some(parse_size(size, "capacity")?);
        Ok(slf)
    }

    /// "auto" (default): open the pool if its files exist, else create it
    /// (needs `capacity`); "always": create anew over whatever is there;
    /// "never": open only.
    fn create(mut slf: PyRefMut<'_, Self>, mode: String) -> PyResult<PyRefMut<'_, Self>> {
        if !matches!(mode.as_str(), "auto" | "always" | "never") {
            return Err(usage(format!(
                "create({mode:?}): say \"auto\", \"always\" or \"never\""
            )));
        }
        slf.create = mode;
        Ok(slf)
    }

    /// The model: a preset name (llama3-8b, ...) or a Hugging Face
    /// config.json (or its directory); `block_size` tokens per block; `dtype`
    /// overrides the KV dtype ("bfloat16", "float16", "fp8", ...).
    #[pyo3(signature = (spec, block_size = 16, dtype = None))]
    fn model(
        mut slf: PyRefMut<'_, Self>,
        spec: String,
        #[pyo3(from_py_with = block_size_arg)] block_size: u32,
        dtype: Option<String>,
    ) -> PyResult<PyRefMut<'_, Self>> {
        slf.model = Some(ModelSpec::Named(spec, block_size, dtype));
        Ok(slf)
    }

    /// The KV geometry itself, for engines that know their cache's shape
    /// (no config.json to read): `layers` layers of two objects per block,
    /// each `block_size` tokens x `kv_heads` x `head_dim` elements of
    /// `dtype`; `name` names the model in the pool (at most 64 bytes kept).
    /// The last call of `model()` and `geometry()` wins.
    #[pyo3(signature = (*, layers, kv_heads, head_dim, dtype, block_size, name))]
    fn geometry(
        mut slf: PyRefMut<'_, Self>,
        layers: u32,
        kv_heads: u32,
        head_dim: u32,
        dtype: String,
        #[pyo3(from_py_with = block_size_arg)] block_size: u32,
        name: String,
    ) -> PyResult<PyRefMut<'_, Self>> {
        let dtype = parse_dtype(&dtype)?;
        let geometry = KvGeometry {
            layers,
            kv_heads,
            head_dim,
            dtype,
            block_size,
        };
        geometry.validate().map_err(to_py)?;
        if name.is_empty() || name.chars().any(char::is_control) {
            return Err(usage(format!(
                "geometry name {name:?} must be non-empty printable text (it names the model in the pool)"
            )));
        }
        slf.model = Some(ModelSpec::Geometry(NamedGeometry { geometry, name }));
        Ok(slf)
    }

    /// The key namespace (default: model/dtype/block size/TP rank). A pool
    /// serves one namespace; opening it for another is refused.
    fn namespace(mut slf: PyRefMut<'_, Self>, ns: String) -> PyRefMut<'_, Self> {
        slf.namespace = Some(ns);
        slf
    }

    /// The tensor-parallel rank, part of the default namespace: ranks hold
    /// different heads, so their blocks differ under the same hash.
    fn tp_rank(
        mut slf: PyRefMut<'_, Self>,
        #[pyo3(from_py_with = rank_arg)] rank: u32,
    ) -> PyRefMut<'_, Self> {
        slf.tp_rank = rank;
        slf
    }

    /// "auto" (the engine `kvtier doctor` names), "uring", "nvme", "gpu".
    fn engine(mut slf: PyRefMut<'_, Self>, name: String) -> PyResult<PyRefMut<'_, Self>> {
        if EngineChoice::parse(&name).is_none() {
            return Err(usage(format!(
                "engine {name:?} is unknown; say auto, uring, nvme, gpu or gpu-host"
            )));
        }
        slf.engine = name;
        Ok(slf)
    }

    /// When stores go: "slack" (default: while no load is in flight),
    /// "naive" (at once), "sync" (at `flush_stores` or `close`).
    fn policy(mut slf: PyRefMut<'_, Self>, name: String) -> PyResult<PyRefMut<'_, Self>> {
        if policy_of(&name).is_none() {
            return Err(usage(format!(
                "policy {name:?} is unknown; say slack, naive or sync"
            )));
        }
        slf.policy = name;
        Ok(slf)
    }

    /// Most blocks of accepted, not yet issued stores before `submit_store`
    /// raises BackpressureError.
    fn backlog_limit_blocks(
        mut slf: PyRefMut<'_, Self>,
        #[pyo3(from_py_with = backlog_arg)] n: u64,
    ) -> PyResult<PyRefMut<'_, Self>> {
        if n == 0 {
            return Err(usage(
                "backlog_limit_blocks(0) would refuse every store; give at least 1 (default 65536)",
            ));
        }
        slf.backlog_blocks = Some(n);
        Ok(slf)
    }

    /// KV memory kvtier allocates (page-aligned, for direct I/O):
    /// `blocks` blocks, "cross_layer" (a block's bytes contiguous: LMCache
    /// chunks, staging) or "per_layer".
    #[pyo3(signature = (blocks, layout = "cross_layer"))]
    fn host_cache<'a>(
        mut slf: PyRefMut<'a, Self>,
        #[pyo3(from_py_with = cache_blocks_arg)] blocks: u32,
        layout: &str,
    ) -> PyResult<PyRefMut<'a, Self>> {
        let layout = match layout {
            "cross_layer" => HostLayout::CrossLayer,
            "per_layer" => HostLayout::PerLayer,
            other => {
                return Err(usage(format!(
                    "host_cache layout {other:?} is unknown; say \"cross_layer\" or \"per_layer\""
                )))
            }
        };
        slf.mem = Some(Mem::Host { blocks, layout });
        Ok(slf)
    }

    /// The engine's own KV memory: CPU torch tensors or writable buffers
    /// (memoryview, bytearray, numpy), kept alive by the handle until it is
    /// closed. "per_layer": one per layer, each `(2, blocks, block_size,
    /// heads, dim)`; "block_major": one per layer, each `(blocks, 2,
    /// block_size, heads, dim)` (vLLM's CPU cache); "cross_layer": one,
    /// `(blocks, layers, 2, block_size, heads, dim)`. Each must be 4096-byte
    /// aligned for direct I/O. Buffers stay exported (a bytearray or mmap
    /// cannot be resized or closed); torch cannot be stopped from resizing a
    /// tensor's storage (`resize_`, `untyped_storage().resize_`), which would
    /// free memory kvtier still writes: never do that while the tier is open.
    #[pyo3(signature = (tensors, layout = String::from("per_layer")))]
    fn kv_memory<'a>(
        mut slf: PyRefMut<'a, Self>,
        tensors: &Bound<'_, PyAny>,
        layout: String,
    ) -> PyResult<PyRefMut<'a, Self>> {
        if !matches!(layout.as_str(), "per_layer" | "block_major" | "cross_layer") {
            return Err(usage(format!(
                "kv_memory layout {layout:?} is unknown; say \"per_layer\", \"block_major\" or \"cross_layer\""
            )));
        }
        let items: Vec<Bound<'_, PyAny>> = if tensors.hasattr("data_ptr")? {
            vec![tensors.clone()]
        } else {
            tensors
                .try_iter()
                .map_err(|_| PyTypeError::new_err("kv_memory takes a list of tensors or buffers"))?
                .collect::<PyResult<_>>()?
        };
        let mut regions = Vec::new();
        let mut owners = Vec::new();
        let mut buffers = Vec::new();
        let mut kinds = Vec::new();
        let mut shapes = Vec::new();
        for (i, t) in items.iter().enumerate() {
            let (addr, len) = if t.hasattr("data_ptr")? {
                let r = tensor_region(t, i)?;
                kinds.push(r.kind);
                shapes.push(Some((r.shape, r.element_size)));
                (r.addr, r.len)
            } else {
                kinds.push(MemoryKind::Host);
                shapes.push(None);
                // Through byte_buffer: multi-dimensional views (vLLM's
                // primary_kv_view is (chunks, bytes)) are cast to bytes first.
                let b = byte_buffer(t, &format!("KV memory {i}"))?;
                if b.readonly() {
                    return Err(usage(format!(
                        "KV memory {i} is a read-only buffer; loads write into it: pass a writable one (bytearray, a writable memoryview)"
                    )));
                }
                if !b.is_c_contiguous() {
                    return Err(usage(format!(
                        "KV memory {i} is not C-contiguous; pass one contiguous buffer per layer"
                    )));
                }
                let r = (b.buf_ptr() as u64, b.len_bytes() as u64);
                buffers.push(b);
                r
            };
            regions.push((addr, len));
            owners.push(t.clone().unbind());
        }
        let kind = kinds.first().copied().unwrap_or(MemoryKind::Host);
        if let Some(i) = kinds.iter().position(|k| *k != kind) {
            return Err(usage(format!(
                "KV memory {i} is on {} but KV memory 0 is on {}; register one device's KV cache per handle",
                kind_label(kinds[i]),
                kind_label(kind)
            )));
        }
        slf.mem = Some(Mem::Regions {
            regions,
            layout,
            kind,
            shapes,
        });
        slf.owners = owners;
        slf.buffers = buffers;
        Ok(slf)
    }

    /// Open the pool, start its engine and I/O thread, register the memory.
    fn build(mut slf: PyRefMut<'_, Self>, py: Python<'_>) -> PyResult<TierHandle> {
        let named = match slf.model.clone().ok_or_else(|| {
            usage("no model: call model(\"llama3-8b\" or \"path/to/config.json\", block_size=16) or geometry(...) before build()")
        })? {
            ModelSpec::Named(spec, block_size, dtype) => {
                let dtype = dtype.as_deref().map(parse_dtype).transpose()?;
                without_gil(py, || resolve_named(&spec, block_size, dtype))
                    .map_err(to_py)?
            }
            ModelSpec::Geometry(named) => named,
        };
        let g = named.geometry;
        let namespace = slf.namespace.clone().unwrap_or_else(|| {
            format!(
                "{}/{}/bs{}/tp{}",
                named.name,
                g.dtype.name(),
                g.block_size,
                slf.tp_rank
            )
        });
        let paths = match slf.place.as_ref() {
            None => {
                return Err(usage(
                    "no pool: call directory(path) or files([paths]) before build()",
                ))
            }
            Some(Where::Files(p)) => p.clone(),
            Some(Where::Dir(d, n)) => (0..*n)
                .map(|i| d.join(format!("kvtier-{i}.pool")))
                .collect(),
        };
        let present = paths.iter().filter(|p| p.exists()).count();
        // A first build killed before its superblocks landed leaves the files
        // (allocated, zero, or partly prewritten with zeros) and no pool: "auto"
        // creates over them, without force, so that anything but zeros in them
        // is still refused rather than formatted.
        let no_pool_yet = paths
            .iter()
            .filter(|p| p.exists())
            .all(|p| !begins_a_pool(p));
        // Some files with a superblock, and one still marked by an unfinished
        // create: killed between its superblock writes. Creating without force
        // formats over the superblocks only if that mark is their create's.
        let interrupted = !no_pool_yet
            && paths.iter().any(|p| {
                head_of(p)
                    .is_some_and(|h| kvtier::host::signature::unfinished_pool_id(&h).is_some())
            });
        if slf.create == "auto" && !no_pool_yet && !interrupted {
            // Some files carry a superblock and others none: a create killed
            // between its superblock writes, or a file replaced. Opening would
            // call the bare one "not a kvtier pool" and suggest the CLI.
            let bare: Vec<String> = paths
                .iter()
                .filter(|p| p.exists() && !begins_a_pool(p))
                .map(|p| p.display().to_string())
                .collect();
            if !bare.is_empty() {
                return Err(usage(format!(
                    "the pool is incomplete: {} has no superblock while the pool's other files do \
                     (a create killed part way, or a file replaced); create(\"always\") formats \
                     the pool anew (its blocks are lost), or restore the file",
                    bare.join(", ")
                )));
            }
        }
        let create = match slf.create.as_str() {
            "always" => true,
            "never" => false,
            _ if present == 0 || no_pool_yet || interrupted => true,
            _ if present == paths.len() => false,
            _ => {
                return Err(usage(format!(
                    "{present} of the pool's {} files exist: the pool is incomplete; restore the missing ones, or create(\"always\") to format anew",
                    paths.len()
                )))
            }
        };
        let mut b = RsBuilder::default();
        if create {
            let cap = slf.capacity.ok_or_else(|| {
                usage(format!(
                    "the pool at {} does not exist and no capacity was given: call capacity(\"8g\") to create it",
                    paths[0].display()
                ))
            })?;
            if let Some(Where::Dir(d, _)) = slf.place.as_ref() {
                std::fs::create_dir_all(d).map_err(|e| {
                    to_py(Error::io(
                        format!("creating the pool directory {}", d.display()),
                        e,
                    ))
                })?;
            }
            let per = (cap / paths.len() as u64) & !4095;
            let min = kvtier::pool::layout::PoolLayout::min_device_bytes(&g, slf.group_blocks);
            if per < min {
                return Err(usage(format!(
                    "capacity({cap}) gives each of {} pool file(s) {per} bytes, less than the {min} the smallest pool of this model needs (one group of {} blocks and the superblock area); give at least capacity({})",
                    paths.len(),
                    slf.group_blocks,
                    min * paths.len() as u64
                )));
            }
            b = b.create(
                PoolConfig::new(g, named.name.clone(), namespace.clone())
                    .with_group_blocks(slf.group_blocks)
                    .with_devices(
                        paths
                            .iter()
                            .map(|p| DeviceSpec {
                                path: p.clone(),
                                size: Some(per),
                            })
                            .collect(),
                    )
                    .with_force(slf.create == "always")
                    .with_prewrite(slf.prewrite),
            );
        } else {
            b = b.files(paths.clone()).expect(OpenExpect {
                geometry: Some(g),
                namespace: Some(namespace.clone()),
            });
        }
        b = b.engine(EngineChoice::parse(&slf.engine).expect("checked by engine()"));
        let mut cfg = HandleConfig::default()
            .with_policy(policy_of(&slf.policy).expect("checked by policy()"));
        if let Some(n) = slf.backlog_blocks {
            cfg.backlog_limit_blocks = n;
        }
        b = b.config(cfg);
        let double = slf.staged_host_double;
        // Taken only once the tier is open: a build that fails (the pool in
        // use, a bad path) can be retried on the same builder.
        let (memory, host, gpu) = match slf.mem.clone() {
            None => {
                return Err(usage(
                    "no KV memory: call host_cache(blocks) or kv_memory([tensors]) before build()",
                ))
            }
            Some(Mem::Host { blocks, layout }) => {
                let c = Arc::new(
                    without_gil(py, || HostKvCache::new(g, blocks, layout)).map_err(to_py)?,
                );
                if double {
                    return Err(usage(
                            "test_only_staged_host_double() stands CPU tensors given to kv_memory in for GPU memory; it does not apply to host_cache",
                        ));
                }
                let m = c.memory().clone();
                b = b.host_cache(c.clone());
                (m, Some(c), None)
            }
            Some(Mem::Regions {
                regions,
                layout,
                kind,
                shapes,
            }) => {
                check_shapes(&g, &layout, &shapes)?;
                if double && kind != MemoryKind::Host {
                    return Err(usage(
                            "test_only_staged_host_double() copies with the CPU: give it CPU tensors posing as GPU memory, or drop it to serve CUDA tensors through the real staged path",
                        ));
                }
                // Memory only copies touch (the staged path's, GPU or
                // double) needs 16-byte alignment; DMA targets a page.
                let copies_only = double || kind != MemoryKind::Host;
                let m = memory_of(g, &regions, &layout, kind, copies_only)?;
                if let Some(s) = slf.staging {
                    let d = StagingConfig::for_blocks(m.num_blocks);
                    b = b.staging(StagingConfig::new(
                        s.layer_buffers,
                        if s.load_blocks == 0 {
                            d.load_blocks
                        } else {
                            s.load_blocks
                        },
                        if s.store_blocks == 0 {
                            d.store_blocks
                        } else {
                            s.store_blocks
                        },
                    ));
                }
                let gpu = match kind {
                    MemoryKind::Gpu { ordinal } => Some(gpu_context(py, ordinal)?),
                    MemoryKind::Host => None,
                };
                // SAFETY: the handle object keeps every tensor and buffer
                // (`owners`, `buffers`) alive until the tier is closed and
                // dropped, and the memory contract (no writes while a job
                // uses a block) is the caller's, as documented on the class.
                // The double's memory is host memory (checked above).
                b = unsafe {
                    if double {
                        b.staged_host_double_memory(m.clone())
                    } else {
                        b.memory(m.clone())
                    }
                };
                (m, None, gpu)
            }
        };
        let staged = double || gpu.is_some();
        let handle = without_gil(py, || b.build()).map_err(to_py)?;
        let completions = handle.completions().map_err(to_py)?;
        // The memory (and the objects keeping it alive) now belong to this
        // handle: a second build() must not register it again.
        slf.mem = None;
        Ok(TierHandle {
            inner: Some(handle),
            completions,
            memory,
            host,
            namespace,
            model_name: named.name,
            staged,
            gpu,
            waited_counters: Mutex::new(Vec::new()),
            owners: Mutex::new(std::mem::take(&mut slf.owners)),
            buffers: Mutex::new(std::mem::take(&mut slf.buffers)),
            forks: FORKS.load(Ordering::SeqCst),
        })
    }
}

fn policy_of(s: &str) -> Option<Policy> {
    Some(match s {
        "slack" => Policy::Slack,
        "naive" => Policy::Naive,
        "sync" => Policy::Sync,
        _ => return None,
    })
}

/// A torch tensor's memory as kvtier registers it.
struct TensorRegion {
    addr: u64,
    len: u64,
    kind: MemoryKind,
    shape: Vec<u64>,
    element_size: u64,
}

fn kind_label(k: MemoryKind) -> String {
    match k {
        MemoryKind::Host => "cpu".into(),
        MemoryKind::Gpu { ordinal } => format!("cuda:{ordinal}"),
    }
}

/// Address, length and device of a torch tensor (CPU or CUDA), refusing
/// what kvtier cannot address block by block.
fn tensor_region(t: &Bound<'_, PyAny>, i: usize) -> PyResult<TensorRegion> {
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
    Ok(TensorRegion {
        addr,
        len,
        kind,
        shape,
        element_size,
    })
}

/// A tensor's shape, address, byte length and element size (see
/// `tensor_region`), its methods taken from the class when `exact`.
fn tensor_facts(
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

/// Torch tensors' shapes against the model and the layout: the element
/// size is the KV dtype's (or 1, a byte view), and the dimension that
/// separates K from V is 2 where the layout puts it.
fn check_shapes(g: &KvGeometry, layout: &str, shapes: &[Option<(Vec<u64>, u64)>]) -> PyResult<()> {
    let dsize = g.dtype.bytes() as u64;
    for (i, s) in shapes.iter().enumerate() {
        let Some((shape, esz)) = s else { continue };
        if *esz != dsize && *esz != 1 {
            return Err(usage(format!(
                "KV tensor {i} has {esz}-byte elements but the model's KV dtype {} has {dsize}: pass dtype= to model() to match the cache, or a tensor of that dtype",
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
fn gpu_context(py: Python<'_>, ordinal: u32) -> PyResult<Context> {
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
fn memory_of(
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

/// A finished job: per-key outcomes, and the keys a store evicted.
#[pyclass(module = "kvtier._kvtier", frozen, get_all)]
pub struct JobResultPy {
    job: u64,
    /// "load" or "store".
    kind: &'static str,
    keys: Vec<Py<PyBytes>>,
    /// Per key: "done", "already_stored" or "failed".
    outcomes: Vec<&'static str>,
    /// Per key: None, or the failure as an exception (not raised).
    errors: Vec<Option<PyObject>>,
    evicted: Vec<Py<PyBytes>>,
}

#[pymethods]
impl JobResultPy {
    /// Every key done (or already stored).
    #[getter]
    fn ok(&self) -> bool {
        self.errors.iter().all(Option::is_none)
    }

    /// Raise the first key's failure, if any.
    fn raise_for_failure(&self, py: Python<'_>) -> PyResult<()> {
        match self.errors.iter().flatten().next() {
            Some(e) => Err(PyErr::from_value(e.bind(py).clone())),
            None => Ok(()),
        }
    }

    fn __repr__(&self) -> String {
        let failed = self.errors.iter().filter(|e| e.is_some()).count();
        format!(
            "JobResult(job={}, kind={}, keys={}, failed={failed}, evicted={})",
            self.job,
            self.kind,
            self.keys.len(),
            self.evicted.len()
        )
    }
}

fn result_py(py: Python<'_>, r: JobResult) -> JobResultPy {
    JobResultPy {
        job: r.job,
        kind: match r.kind {
            JobKind::Load => "load",
            JobKind::Store => "store",
        },
        keys: r.keys.iter().map(|k| key_bytes(py, k).unbind()).collect(),
        outcomes: r
            .outcomes
            .iter()
            .map(|o| match o {
                KeyOutcome::Done => "done",
                KeyOutcome::AlreadyStored => "already_stored",
                KeyOutcome::Failed(_) => "failed",
                KeyOutcome::Corrupt(_) => "corrupt",
            })
            .collect(),
        errors: r
            .outcomes
            .iter()
            .map(|o| match o {
                KeyOutcome::Failed(f) | KeyOutcome::Corrupt(f) => {
                    Some(failure_err(py, f).into_value(py).into_any())
                }
                _ => None,
            })
            .collect(),
        evicted: r
            .evicted
            .iter()
            .map(|k| key_bytes(py, k).unbind())
            .collect(),
    }
}

/// A completion: layer `layer` of load `job` is in memory (or failed), or
/// `job` finished.
#[pyclass(module = "kvtier._kvtier", frozen, get_all)]
pub struct EventPy {
    /// "layer" or "finished".
    kind: &'static str,
    job: u64,
    /// The layer, for "layer" events.
    layer: Option<u32>,
    /// "load" or "store", for "finished" events.
    job_kind: Option<&'static str>,
    ok: bool,
    /// The failure as an exception (not raised), when not ok.
    error: Option<PyObject>,
}

#[pymethods]
impl EventPy {
    fn __repr__(&self) -> String {
        match self.kind {
            "layer" => format!(
                "Event(layer {} of job {}, ok={})",
                self.layer.unwrap_or(0),
                self.job,
                self.ok
            ),
            _ => format!("Event(job {} finished, ok={})", self.job, self.ok),
        }
    }
}

fn event_py(py: Python<'_>, e: Event) -> EventPy {
    match e {
        Event::Layer { job, layer, error } => EventPy {
            kind: "layer",
            job,
            layer: Some(layer),
            job_kind: None,
            ok: error.is_none(),
            error: error.map(|f| failure_err(py, &f).into_value(py).into_any()),
        },
        Event::Finished { job, kind, ok } => EventPy {
            kind: "finished",
            job,
            layer: None,
            job_kind: Some(match kind {
                JobKind::Load => "load",
                JobKind::Store => "store",
            }),
            ok,
            error: None,
        },
    }
}

/// An open tier: thread-safe; every method may be called from any thread.
/// The memory of a job's blocks must not be written until the job finishes.
#[pyclass(module = "kvtier._kvtier", frozen)]
pub struct TierHandle {
    // Field order is drop order: the tier (and its I/O) goes before the
    // memory it reads and writes.
    inner: Option<kvtier::TierHandle>,
    completions: Completions,
    memory: KvMemory,
    host: Option<Arc<HostKvCache>>,
    namespace: String,
    model_name: String,
    /// Served through the staged HBM path (on a GPU, or its host double).
    staged: bool,
    /// The CUDA context of GPU KV memory (torch's primary context).
    gpu: Option<Context>,
    /// Counters a foreign stream was told to wait on: kept until the handle
    /// goes, since kvtier cannot see when such a stream passes its wait.
    /// Loads reuse counters, so this holds at most one per concurrent load.
    waited_counters: Mutex<Vec<Arc<CompletionCounter>>>,
    owners: Mutex<Vec<Py<PyAny>>>,
    buffers: Mutex<Vec<PyBuffer<u8>>>,
    /// FORKS when the handle was built: a different count means this is a
    /// forked child, which has the handle's memory but not its I/O thread.
    forks: u64,
}

/// fork()s this process has gone through, counted in the child.
static FORKS: AtomicU64 = AtomicU64::new(0);

extern "C" fn count_fork_in_child() {
    FORKS.fetch_add(1, Ordering::SeqCst);
}

/// Set by an atexit hook: the interpreter is exiting.
static EXITING: AtomicBool = AtomicBool::new(false);
/// The thread that ran the hook (the one finalizing the interpreter).
static EXIT_TID: AtomicI64 = AtomicI64::new(0);

#[pyfunction]
fn _mark_exiting() {
    // SAFETY: gettid has no preconditions.
    EXIT_TID.store(unsafe { libc::gettid() } as i64, Ordering::SeqCst);
    EXITING.store(true, Ordering::SeqCst);
}

/// Whether the interpreter has begun exiting (kvtier's atexit hook ran):
/// threads other than the exiting one no longer come back from kvtier calls.
#[pyfunction]
fn _exiting() -> bool {
    EXITING.load(Ordering::SeqCst)
}

/// While above zero, threads come back from kvtier calls even though the
/// interpreter is exiting: an exit handler is waiting for them (blocked in
/// a join, without the GIL), so they retake the GIL before finalization
/// starts. Raised and lowered by `_exit_grace`.
static EXIT_GRACE: AtomicU64 = AtomicU64::new(0);

/// Enter (`True`) or leave (`False`) a stretch of an exit handler that
/// waits for threads inside kvtier calls (KvtierL2.close joining its
/// workers): while in it, they finish their calls instead of parking.
#[pyfunction]
fn _exit_grace(on: bool) {
    if on {
        EXIT_GRACE.fetch_add(1, Ordering::SeqCst);
    } else {
        let _ = EXIT_GRACE.fetch_update(Ordering::SeqCst, Ordering::SeqCst, |g| g.checked_sub(1));
    }
}

/// Run `f` with the GIL released. Once the interpreter is exiting, a thread
/// other than the one finalizing it never takes the GIL back: CPython up to
/// 3.13 ends such a (daemon) thread with pthread_exit as it retakes the GIL,
/// and that forced unwind through Rust frames aborts the whole process
/// ("FATAL: exception not rethrown") instead of letting it exit. The thread
/// parks until the process is gone; its call never returns, as CPython
/// would have it. (3.14 parks such threads itself; the hook is not set there.)
fn without_gil<T, F>(py: Python<'_>, f: F) -> T
where
    F: Send + FnOnce() -> T,
    T: Send,
{
    py.allow_threads(|| {
        let r = f();
        // SAFETY: gettid has no preconditions.
        if EXITING.load(Ordering::SeqCst)
            && unsafe { libc::gettid() } as i64 != EXIT_TID.load(Ordering::SeqCst)
        {
            while EXIT_GRACE.load(Ordering::SeqCst) == 0 {
                std::thread::park_timeout(Duration::from_millis(5));
            }
        }
        r
    })
}

/// How long a blocking wait sleeps before looking at Python's signals, so
/// that Ctrl-C (and any signal handler) runs while a job is slow or stuck.
const WAIT_SLICE: Duration = Duration::from_millis(50);

impl TierHandle {
    fn h(&self) -> &kvtier::TierHandle {
        self.inner.as_ref().expect("set at build")
    }

    fn forked(&self) -> bool {
        FORKS.load(Ordering::SeqCst) != self.forks
    }

    /// The handle, for anything that does I/O or touches the KV memory:
    /// refused in a forked child, whose copy has no I/O thread (its waits
    /// would never end) and may lack the memory (kvtier's own is not
    /// inherited: it is pinned for DMA).
    fn live(&self) -> PyResult<&kvtier::TierHandle> {
        if self.forked() {
            return Err(usage(
                "this TierHandle was opened before fork(): a child process cannot use it (its I/O thread and DMA memory stay in the parent); open a tier in the child on a pool of its own, or start workers with the 'spawn' method",
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

    #[getter]
    fn namespace(&self) -> String {
        self.namespace.clone()
    }

    #[getter]
    fn model_name(&self) -> String {
        self.model_name.clone()
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
    /// layer `layer` of load `job` is in the KV memory: the host does not
    /// wait. Returns True when the wait was queued; False when there is no
    /// GPU counter to wait on (host memory, the host double, or a load that
    /// already finished): then call wait_layer(). Failed layers still
    /// release the stream; their blocks are reported in the job's result.
    fn stream_wait_layer(
        &self,
        py: Python<'_>,
        #[pyo3(from_py_with = job_arg)] job: u64,
        #[pyo3(from_py_with = layer_arg)] layer: u32,
        #[pyo3(from_py_with = stream_arg)] stream: u64,
    ) -> PyResult<bool> {
        let Some(ctx) = &self.gpu else {
            return Ok(false);
        };
        let Some(c) = self.live()?.load_counter(job).map_err(to_py)? else {
            return Ok(false);
        };
        // SAFETY: the caller passes a live stream of the device's primary
        // context (torch's); the counter is kept in `waited_counters` until
        // this handle is dropped, after the tier.
        without_gil(py, || unsafe { c.queue_on_raw_stream(ctx, stream, layer) }).map_err(to_py)?;
        let mut kept = self
            .waited_counters
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        if !kept.iter().any(|k| Arc::ptr_eq(k, &c.counter)) {
            kept.push(c.counter);
        }
        Ok(true)
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
        let u = self.live()?.usage().map_err(to_py)?;
        let text = serde_json::to_string(&u).map_err(|e| to_py(Error::invalid(e.to_string())))?;
        py.import("json")?.call_method1("loads", (text,))
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

    /// Address and length of kvtier-allocated memory (host_cache), for
    /// building a tensor over it; valid while this handle object lives.
    fn host_memory(&self) -> PyResult<(u64, u64)> {
        self.live()?;
        match (&self.host, &self.memory.layout) {
            (Some(_), KvLayout::CrossLayer { base }) => Ok((*base, self.memory.total_bytes())),
            _ => Err(usage(
                "host_memory() is for a host_cache(..., layout=\"cross_layer\"); this handle serves other memory",
            )),
        }
    }

    /// Issue the write backlog, wait for every job (GIL released), stop the
    /// I/O thread; raise the first engine failure. Later calls raise ClosedError.
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
        format!(
            "TierHandle(engine={}, namespace={:?}, memory_blocks={})",
            self.h().engine(),
            self.namespace,
            self.memory.num_blocks
        )
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
        // Streams told to wait on our counters may not have reached the
        // wait yet (it reads the counter when they do): let them pass it
        // before the counters are freed.
        if let (Some(ctx), Ok(k)) = (&self.gpu, self.waited_counters.get_mut()) {
            if !k.is_empty() {
                let _ = ctx.synchronize();
            }
        }
        self.owners.get_mut().map(|v| v.clear()).ok();
        self.buffers.get_mut().map(|v| v.clear()).ok();
    }
}

/// Parse a model spec as kvtier does, for tools that size memory before
/// opening a pool: returns the geometry dict and the model's name.
#[pyfunction]
#[pyo3(signature = (spec, block_size = 16, dtype = None))]
fn resolve_model<'py>(
    py: Python<'py>,
    spec: String,
    #[pyo3(from_py_with = block_size_arg)] block_size: u32,
    dtype: Option<String>,
) -> PyResult<(Bound<'py, PyDict>, String)> {
    let dtype = match dtype {
        Some(d) => Some(DType::parse(&d).ok_or_else(|| {
            usage(format!(
                "dtype {d:?} is unknown; say bfloat16, float16, float32, fp8 or fp8_e5m2"
            ))
        })?),
        None => None,
    };
    let n = resolve_named(&spec, block_size, dtype).map_err(to_py)?;
    let g = n.geometry;
    Ok((geometry_dict(py, &g)?, n.name))
}

/// Median nanoseconds of `iters` calls of `op` on the handle's Rust
/// TierHandle, with no Python between calls: the baseline the Python
/// bindings are compared against (scripts/py-latency.py). `op`: "lookup"
/// (`keys` all), "store" (one new key per call, from block 0, waited),
/// "load" (`keys[0]` into block 1, all layers, waited).
#[pyfunction]
fn rust_latency(
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

#[pymodule]
fn _kvtier(m: &Bound<'_, PyModule>) -> PyResult<()> {
    let py = m.py();
    static AT_FORK: Once = Once::new();
    // SAFETY: the child handler only increments an atomic.
    AT_FORK.call_once(|| unsafe {
        libc::pthread_atfork(None, None, Some(count_fork_in_child));
    });
    // Before the interpreter ends daemon threads: see without_gil.
    let vi = py.import("sys")?.getattr("version_info")?;
    let version: (u32, u32) = (vi.get_item(0)?.extract()?, vi.get_item(1)?.extract()?);
    if version < (3, 14) {
        py.import("atexit")?
            .getattr("register")?
            .call1((wrap_pyfunction!(_mark_exiting, m)?,))?;
    }
    m.add_function(wrap_pyfunction!(_exiting, m)?)?;
    m.add_function(wrap_pyfunction!(_exit_grace, m)?)?;
    m.add_class::<TierBuilder>()?;
    m.add_class::<TierHandle>()?;
    m.add_class::<service::ServiceHandle>()?;
    m.add_class::<service::SharedRegion>()?;
    m.add_function(wrap_pyfunction!(service::connect, m)?)?;
    m.add("JobResult", py.get_type::<JobResultPy>())?;
    m.add("Event", py.get_type::<EventPy>())?;
    m.add_function(wrap_pyfunction!(resolve_model, m)?)?;
    m.add_function(wrap_pyfunction!(rust_latency, m)?)?;
    m.add("KvtierError", py.get_type::<KvtierError>())?;
    m.add("UsageError", py.get_type::<UsageError>())?;
    m.add("BackpressureError", py.get_type::<BackpressureError>())?;
    m.add("IoError", py.get_type::<IoError>())?;
    m.add("CorruptError", py.get_type::<CorruptError>())?;
    m.add("UnsupportedError", py.get_type::<UnsupportedError>())?;
    m.add("ClosedError", py.get_type::<ClosedError>())?;
    m.add("InternalError", py.get_type::<InternalError>())?;
    Ok(())
}

/// A KV geometry as Python sees it: layers, kv_heads, head_dim, dtype,
/// block_size, object_bytes, block_bytes.
fn geometry_dict<'py>(py: Python<'py>, g: &KvGeometry) -> PyResult<Bound<'py, PyDict>> {
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
