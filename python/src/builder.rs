//! `TierBuilder`: the Python face of [`kvtier::TierBuilder`]. It collects
//! the calls, resolves the model and registers the Python-owned KV memory;
//! where the pool is and whether to open or create it is the library's
//! policy ([`kvtier::pool::place`]), which the Rust builder applies.

use crate::args::*;
use crate::errors::{to_py, usage};
use crate::handle::TierHandle;
use crate::lifecycle::{without_gil, FORKS};
use crate::memory::{check_shapes, gpu_context, kind_label, memory_of, tensor_region};
use kvtier::handle::{EngineChoice, HandleConfig, TierBuilder as RsBuilder};
use kvtier::memory::{HostKvCache, HostLayout, MemoryKind};
use kvtier::model::{default_namespace, resolve_named, KvGeometry, NamedGeometry};
use kvtier::pool::place::CreateMode;
use kvtier::pool::DEFAULT_GROUP_BLOCKS;
use kvtier::staged::StagingConfig;
use pyo3::buffer::PyBuffer;
use pyo3::exceptions::PyTypeError;
use pyo3::prelude::*;
use pyo3::types::PyBytes;
use std::path::PathBuf;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};

pub(crate) enum Where {
    Files(Vec<PathBuf>),
    /// The directory, and its file count if given.
    Dir(PathBuf, Option<u32>),
}

/// What the KV memory is, before `build`.
#[derive(Clone)]
pub(crate) enum Mem {
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
        shapes: Vec<Option<crate::memory::TensorShape>>,
    },
}

/// What `build()` takes the pool's geometry from.
#[derive(Clone)]
pub(crate) enum ModelSpec {
    /// `model()`: a preset or a config.json, a block size, a dtype override.
    Named(String, u32, Option<String>),
    /// `geometry()`: given directly by the engine.
    Geometry(NamedGeometry),
}

/// Opens (or creates) a pool and serves KV memory from it. Every setter
/// returns the builder, so calls chain; `build()` opens the tier.
#[pyclass(module = "kvtier._kvtier")]
pub struct TierBuilder {
    place: Option<Where>,
    capacity: Option<u64>,
    create: CreateMode,
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
    /// `service()`: the socket of the node's service, and blocks to share.
    /// And whether lookup-only.
    service: Option<(PathBuf, u32, bool)>,
}

#[pymethods]
impl TierBuilder {
    #[new]
    fn new() -> Self {
        TierBuilder {
            place: None,
            capacity: None,
            create: CreateMode::Auto,
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
            service: None,
        }
    }

    /// The pool of the `kvtier serve` service listening on `path`, shared
    /// with every engine process of the node, instead of a pool of this
    /// process's own: `build()` connects and returns a TierHandle with the
    /// same methods, whose KV memory is the `blocks` blocks the service
    /// shares with this process (0: as many as it gives a client;
    /// kvtier.service_tensors views them as torch tensors). The service
    /// decides the pool, engine, policy, namespace and memory, so those
    /// calls are refused with it; `model()` / `geometry()` say what this
    /// process expects the service to serve (checked at build). With
    /// `kv_memory()` of CUDA tensors (and `staging()`), the tensors are the
    /// KV memory instead, through the staged GPU path whose staging is the
    /// memory the service shares (`blocks` of it; the model is required).
    /// `lookup_only=True`: lookups, pins and unpins only (an engine's
    /// scheduler): no memory shared, no client slot taken; loads and stores
    /// are refused.
    #[pyo3(signature = (path, blocks = 0, lookup_only = false))]
    fn service(
        mut slf: PyRefMut<'_, Self>,
        path: PathBuf,
        #[pyo3(from_py_with = service_blocks_arg)] blocks: u32,
        lookup_only: bool,
    ) -> PyRefMut<'_, Self> {
        slf.service = Some((path, blocks, lookup_only));
        slf
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
    /// blocks of stores in flight, in chunks of `store_chunk_blocks` (each
    /// gathered while the ones before are written).
    /// Defaults: 4 buffers, min(blocks, 1024), min(blocks, 64) and a quarter
    /// of the store blocks.
    #[pyo3(signature = (layer_buffers = 4, load_blocks = None, store_blocks = None, store_chunk_blocks = None))]
    fn staging(
        mut slf: PyRefMut<'_, Self>,
        #[pyo3(from_py_with = layer_buffers_arg)] layer_buffers: u32,
        #[pyo3(from_py_with = staging_blocks_arg)] load_blocks: Option<u32>,
        #[pyo3(from_py_with = staging_blocks_arg)] store_blocks: Option<u32>,
        #[pyo3(from_py_with = staging_blocks_arg)] store_chunk_blocks: Option<u32>,
    ) -> PyResult<PyRefMut<'_, Self>> {
        if layer_buffers < 2
            || load_blocks == Some(0)
            || store_blocks == Some(0)
            || store_chunk_blocks == Some(0)
        {
            return Err(usage(format!(
                "staging(layer_buffers={layer_buffers}, load_blocks={load_blocks:?}, store_blocks={store_blocks:?}, store_chunk_blocks={store_chunk_blocks:?}): need at least 2 layer buffers and 1 block each"
            )));
        }
        // Block counts left out (0 here) follow the memory's size at build.
        slf.staging = Some(
            StagingConfig::new(
                layer_buffers,
                load_blocks.unwrap_or(0),
                store_blocks.unwrap_or(0),
            )
            .with_store_chunk_blocks(store_chunk_blocks.unwrap_or(0)),
        );
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
    /// directory is created when the pool is. `devices` left out: the pool
    /// there has as many files as it was made with (its superblock says),
    /// and one is created where none is.
    #[pyo3(signature = (path, devices = None))]
    fn directory<'py>(
        mut slf: PyRefMut<'py, Self>,
        path: PathBuf,
        devices: Option<Bound<'py, PyAny>>,
    ) -> PyResult<PyRefMut<'py, Self>> {
        let devices = devices.map(|d| devices_arg(&d)).transpose()?;
        if let Some(n) = devices.filter(|n| *n == 0 || *n > 64) {
            return Err(usage(format!(
                "directory(devices={n}): give 1 to 64 pool files"
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
        slf.capacity = Some(size_arg(size, "capacity")?);
        Ok(slf)
    }

    /// "auto" (default): open the pool that is there; create one (needs
    /// `capacity`) where none is, or where a kvtier create did not finish;
    /// never over data kvtier did not write. "always": create anew over
    /// whatever is there (its blocks are lost). "never": open only. The
    /// policy is the library's (`kvtier::pool::place`).
    fn create(mut slf: PyRefMut<'_, Self>, mode: String) -> PyResult<PyRefMut<'_, Self>> {
        slf.create = CreateMode::parse(&mode).ok_or_else(|| {
            usage(format!(
                "create({mode:?}): say \"auto\", \"always\" or \"never\""
            ))
        })?;
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
        #[pyo3(from_py_with = opt_dtype_name_arg)] dtype: Option<String>,
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
        #[pyo3(from_py_with = layers_count_arg)] layers: u32,
        #[pyo3(from_py_with = kv_heads_arg)] kv_heads: u32,
        #[pyo3(from_py_with = head_dim_arg)] head_dim: u32,
        #[pyo3(from_py_with = dtype_name_arg)] dtype: String,
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
        let name = pool_name_arg(name, "geometry")?;
        slf.model = Some(ModelSpec::Geometry(NamedGeometry { geometry, name }));
        Ok(slf)
    }

    /// A pool of opaque chunks of `chunk_bytes` (a secondary tier's primary
    /// chunks, whatever the layout inside them): one kvtier block per chunk,
    /// moved as it is (`kvtier::KvGeometry::opaque_chunk`); `name` names what
    /// the chunks are in the pool. The last call of `model()`, `geometry()`
    /// and `opaque_chunks()` wins.
    #[pyo3(signature = (chunk_bytes, *, name))]
    fn opaque_chunks(
        mut slf: PyRefMut<'_, Self>,
        chunk_bytes: u64,
        name: String,
    ) -> PyResult<PyRefMut<'_, Self>> {
        let geometry = KvGeometry::opaque_chunk(chunk_bytes).map_err(to_py)?;
        let name = pool_name_arg(name, "opaque_chunks")?;
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
                shapes.push(Some((r.shape, r.element_size, r.dtype)));
                (r.addr, r.len)
            } else {
                kinds.push(MemoryKind::Host);
                shapes.push(buffer_float_type(t).map(|d| (Vec::new(), 1, d.to_string())));
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

    /// Open the pool, start its engine and I/O thread, register the memory;
    /// or, after `service()`, connect to the node's service.
    fn build(mut slf: PyRefMut<'_, Self>, py: Python<'_>) -> PyResult<TierHandle> {
        if let Some((path, blocks, lookup_only)) = slf.service.clone() {
            return slf.build_service(py, path, blocks, lookup_only);
        }
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
        let namespace = slf
            .namespace
            .clone()
            .unwrap_or_else(|| default_namespace(&named.name, &g, slf.tp_rank));
        // Where the pool is and whether to open or create it: the library's
        // policy (kvtier::pool::place), applied by its builder.
        let mut b = match slf.place.as_ref() {
            None => {
                return Err(usage(
                    "no pool: call directory(path) or files([paths]) before build()",
                ))
            }
            Some(Where::Files(p)) => RsBuilder::default().files(p.clone()),
            Some(Where::Dir(d, n)) => {
                let b = RsBuilder::default().directory(d);
                match n {
                    Some(n) => b.directory_files(*n),
                    None => b,
                }
            }
        }
        .model(named.clone())
        .namespace(namespace.clone())
        .create_mode(slf.create)
        .group_blocks(slf.group_blocks)
        .prewrite(slf.prewrite);
        if let Some(c) = slf.capacity {
            b = b.capacity(c);
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
                    let store = if s.store_blocks == 0 {
                        d.store_blocks
                    } else {
                        s.store_blocks
                    };
                    b = b.staging(
                        StagingConfig::new(
                            s.layer_buffers,
                            if s.load_blocks == 0 {
                                d.load_blocks
                            } else {
                                s.load_blocks
                            },
                            store,
                        )
                        // By default 4 chunks in the store area, so gathers
                        // overlap writes.
                        .with_store_chunk_blocks(
                            if s.store_chunk_blocks == 0 {
                                store.div_ceil(4)
                            } else {
                                s.store_chunk_blocks
                            },
                        ),
                    );
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
        let (namespace, model_name) = (
            handle.namespace().to_string(),
            handle.model_name().to_string(),
        );
        // The memory (and the objects keeping it alive) now belong to this
        // handle: a second build() must not register it again.
        slf.mem = None;
        Ok(TierHandle {
            inner: Some(Box::new(handle)),
            completions,
            memory,
            host,
            service: None,
            namespace,
            model_name,
            staged,
            gpu,
            owners: Mutex::new(std::mem::take(&mut slf.owners)),
            buffers: Mutex::new(std::mem::take(&mut slf.buffers)),
            forks: FORKS.load(Ordering::SeqCst),
        })
    }
}

impl TierBuilder {
    /// The calls made on this builder that set up a pool of this process's
    /// own, by the names a Python caller wrote (the library's
    /// `TierBuilder::service` refuses the same things under its own calls).
    fn own_pool_calls(&self) -> Vec<&'static str> {
        let set = [
            (
                match self.place {
                    Some(Where::Files(_)) => "files()",
                    _ => "directory()",
                },
                self.place.is_some(),
            ),
            ("capacity()", self.capacity.is_some()),
            ("create()", self.create != CreateMode::Auto),
            ("namespace()", self.namespace.is_some()),
            ("tp_rank()", self.tp_rank != 0),
            ("engine()", self.engine != "auto"),
            ("policy()", self.policy != "slack"),
            ("backlog_limit_blocks()", self.backlog_blocks.is_some()),
            ("group_blocks()", self.group_blocks != DEFAULT_GROUP_BLOCKS),
            ("prewrite()", self.prewrite),
            ("staging()", self.staging.is_some()),
            ("test_only_staged_host_double()", self.staged_host_double),
            (
                match self.mem {
                    Some(Mem::Host { .. }) => "host_cache()",
                    _ => "kv_memory()",
                },
                self.mem.is_some(),
            ),
        ];
        set.into_iter()
            .filter_map(|(name, on)| on.then_some(name))
            .collect()
    }

    /// `build()` after `service()`: refuse what the service decides, resolve
    /// the model asked for (if any), connect.
    fn build_service(
        &mut self,
        py: Python<'_>,
        path: PathBuf,
        blocks: u32,
        lookup_only: bool,
    ) -> PyResult<TierHandle> {
        // GPU KV memory (kv_memory of CUDA tensors, or CPU tensors posing
        // as them with the double) goes through the service on the staged
        // path, with the staging the service shares: those calls are this
        // process's, not the service's.
        let staged = matches!(self.mem, Some(Mem::Regions { .. }));
        if staged && lookup_only {
            return Err(usage(
                "service(..., lookup_only=True) shares no KV memory with the service, so kv_memory() has nothing to serve: drop kv_memory() for a scheduler's lookup-only handle, or drop lookup_only to load and store",
            ));
        }
        let conflicts: Vec<&str> = self
            .own_pool_calls()
            .into_iter()
            .filter(|c| {
                !(staged
                    && matches!(
                        *c,
                        "kv_memory()" | "staging()" | "test_only_staged_host_double()"
                    ))
            })
            .collect();
        if !conflicts.is_empty() {
            return Err(usage(format!(
                "{} set up a pool of this process's own, but service({:?}) uses the node's kvtier service, which decides its pool, engine, policy, namespace and the KV memory it shares (kvtier.service_tensors(handle) views it): drop {}, or drop service() to open a pool of this process's own",
                conflicts.join(", "),
                path.display().to_string(),
                if conflicts.len() == 1 { "it" } else { "them" },
            )));
        }
        let geometry = match self.model.clone() {
            None => None,
            Some(ModelSpec::Named(spec, block_size, dtype)) => {
                let dtype = dtype.as_deref().map(parse_dtype).transpose()?;
                Some(
                    without_gil(py, || resolve_named(&spec, block_size, dtype))
                        .map_err(to_py)?
                        .geometry,
                )
            }
            Some(ModelSpec::Geometry(named)) => Some(named.geometry),
        };
        if staged {
            return self.build_staged_service(py, path, blocks, geometry);
        }
        crate::service::open(py, path, blocks, geometry, lookup_only)
    }

    /// `build()` after `service()` with `kv_memory()`: the tensors are this
    /// process's GPU KV memory (or the double's CPU stand-in), served by
    /// the staged path over the slice the service shares.
    fn build_staged_service(
        &mut self,
        py: Python<'_>,
        path: PathBuf,
        blocks: u32,
        geometry: Option<KvGeometry>,
    ) -> PyResult<TierHandle> {
        let g = geometry.ok_or_else(|| {
            usage("service() with kv_memory(): give the model (model(...) or geometry(...)) the tensors hold, which the service must serve")
        })?;
        let Some(Mem::Regions {
            regions,
            layout,
            kind,
            shapes,
        }) = self.mem.clone()
        else {
            unreachable!("checked by build_service")
        };
        check_shapes(&g, &layout, &shapes)?;
        let double = self.staged_host_double;
        if double && kind != MemoryKind::Host {
            return Err(usage(
                "test_only_staged_host_double() copies with the CPU: give it CPU tensors posing as GPU memory, or drop it to serve CUDA tensors through the real staged path",
            ));
        }
        if !double && kind == MemoryKind::Host {
            return Err(usage(
                "kv_memory() through a kvtier service is for CUDA tensors (the staged GPU path over the memory the service shares); CPU KV memory through a service is the memory it shares (kvtier.service_tensors(handle)): drop kv_memory()",
            ));
        }
        // Only copies touch it (the staged path's): 16-byte alignment.
        let m = memory_of(g, &regions, &layout, kind, true)?;
        let gpu = match kind {
            MemoryKind::Gpu { ordinal } => Some(gpu_context(py, ordinal)?),
            MemoryKind::Host => None,
        };
        let b = RsBuilder::default()
            .service(&path)
            .blocks(blocks)
            .geometry(g);
        // SAFETY: the handle object keeps every tensor and buffer (`owners`,
        // `buffers`) alive until the client is closed and dropped; the
        // double's memory is host memory (checked above).
        let mut b = unsafe {
            if double {
                b.staged_host_double_memory(m.clone())
            } else {
                b.memory(m.clone())
            }
        };
        if let Some(s) = self.staging {
            // Block counts left out (0) follow the shared slice's size.
            b = b.staging(s);
        }
        let client = without_gil(py, || b.build()).map_err(to_py)?;
        let completions = kvtier::TierApi::completions(&client).map_err(to_py)?;
        let mapping = client.shared_mapping();
        let namespace = kvtier::TierApi::namespace(&client).to_string();
        let model_name = kvtier::TierApi::model_name(&client).to_string();
        self.mem = None;
        Ok(TierHandle {
            inner: Some(Box::new(client)),
            completions,
            memory: m,
            host: None,
            service: Some((path, mapping)),
            namespace,
            model_name,
            staged: true,
            gpu,
            owners: Mutex::new(std::mem::take(&mut self.owners)),
            buffers: Mutex::new(std::mem::take(&mut self.buffers)),
            forks: FORKS.load(Ordering::SeqCst),
        })
    }
}

/// The `name=` of `geometry()` or `opaque_chunks()`: what the pool records as
/// its model, so printable and non-empty.
fn pool_name_arg(name: String, call: &str) -> PyResult<String> {
    if name.is_empty() || name.chars().any(char::is_control) {
        return Err(usage(format!(
            "{call} name {name:?} must be non-empty printable text (it names the model in the pool)"
        )));
    }
    Ok(name)
}

/// The float element type a buffer declares (numpy float16 / float32
/// arrays, memoryviews cast to 'e' or 'f'), in torch's spelling, for the
/// KV dtype check; None for bytes and integer formats (raw bytes).
fn buffer_float_type(o: &Bound<'_, PyAny>) -> Option<&'static str> {
    let mv = o
        .py()
        .import("builtins")
        .ok()?
        .getattr("memoryview")
        .ok()?
        .call1((o,))
        .ok()?;
    let format: String = mv.getattr("format").ok()?.extract().ok()?;
    match format.trim_start_matches(['<', '>', '=', '@', '!']) {
        "e" => Some("torch.float16"),
        "f" => Some("torch.float32"),
        _ => None,
    }
}
