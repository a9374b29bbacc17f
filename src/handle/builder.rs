//! Opening (or creating) a pool and choosing the engine that serves it.
//!
//! Where a pool is and whether to open or create it is the library's policy
//! ([`crate::pool::place`]): a front end (the CLI, the Python bindings, a
//! node service) says `directory`, `capacity` and the model, and the builder
//! opens the pool there, or creates it where none is.

use super::{HandleConfig, Jobs, Owner, Shared, TierHandle};
use crate::engine::open::{pool_on_nvme, UserspaceEngine};
use crate::engine::IoEngine;
use crate::error::{Error, Result};
use crate::gpu::{Context, Device};
use crate::memory::{HostKvCache, KvMemory, MemoryKind};
use crate::model::{default_namespace, KvGeometry, NamedGeometry};
use crate::pool::place::{self, CreateMode, Verdict};
use crate::pool::{DeviceSpec, OpenExpect, Pool, PoolConfig, DEFAULT_GROUP_BLOCKS};
use crate::sched::Scheduler;
use crate::staged::{StagedTier, StagingConfig};
use crate::tier::{JobPath, Tier};
use nix::sys::eventfd::{EfdFlags, EventFd};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU8};
use std::sync::{mpsc, Arc, Condvar, Mutex};

/// Which engine serves the pool.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum EngineChoice {
    /// The engine `kvtier doctor` names for this machine (the same
    /// decision, `crate::engine::choice::decide`), within what the pool's location
    /// allows: files and block devices are served by io_uring; a controller
    /// by the gpu engine where the decision says it is usable, else nvme.
    #[default]
    Auto,
    /// io_uring on files or block devices.
    Uring,
    /// Userspace NVMe on a controller bound to vfio-pci or uio_pci_generic.
    Nvme,
    /// The CUDA I/O kernel driving a controller.
    Gpu,
    /// The I/O kernel's logic on CPU threads (tests without a GPU).
    GpuHost,
}

impl EngineChoice {
    /// `auto`, `uring`, `nvme`, `gpu` or `gpu-host`; `None` for anything else.
    pub fn parse(s: &str) -> Option<EngineChoice> {
        Some(match s {
            "auto" => EngineChoice::Auto,
            "uring" => EngineChoice::Uring,
            "nvme" => EngineChoice::Nvme,
            "gpu" => EngineChoice::Gpu,
            "gpu-host" => EngineChoice::GpuHost,
            _ => return None,
        })
    }
}

/// Opens a pool and an engine for it, on the I/O thread.
type EngineFactory = Box<dyn FnOnce() -> Result<(Pool, Box<dyn IoEngine>)> + Send>;

enum Location {
    Unset,
    Files(Vec<PathBuf>),
    /// A pool directory: the files kvtier makes there.
    Directory(PathBuf),
    Controller(String),
    #[cfg_attr(not(feature = "internals"), allow(dead_code))]
    Custom(EngineFactory),
}

enum Memory {
    Host(Arc<HostKvCache>),
    Raw(KvMemory),
    /// Host memory standing in for GPU memory on the staged path (the CPU
    /// test double of the staging copies).
    StagedDouble(Arc<HostKvCache>),
    /// Caller-owned host memory standing in for GPU memory on the staged
    /// path (the same double over, e.g., CPU torch tensors).
    StagedDoubleRaw(KvMemory),
}

/// Builds a [`TierHandle`]: where the pool is, whether to create it, which
/// engine, which KV memory, and the scheduling policy.
///
/// A pool in a directory kvtier manages, opened if it is there and created
/// (64 GiB over two files) if not:
///
/// ```no_run
/// # use kvtier::handle::{TierBuilder, EngineChoice};
/// # use kvtier::{HostKvCache, HostLayout, KvGeometry, DType};
/// # use std::sync::Arc;
/// # fn main() -> kvtier::Result<()> {
/// let geometry = KvGeometry { layers: 32, kv_heads: 8, head_dim: 128, dtype: DType::BF16, block_size: 16 };
/// let cache = Arc::new(HostKvCache::new(geometry, 1024, HostLayout::PerLayer)?);
/// let tier = TierBuilder::default()
///     .directory("/data/kvtier")
///     .directory_files(2)
///     .capacity(64 << 30)
///     .geometry(geometry)
///     .model_name("llama3-8b")
///     .engine(EngineChoice::Auto)
///     .host_cache(cache)
///     .build()?;
/// # Ok(()) }
/// ```
///
/// Opening or creating ([`CreateMode`], default `Auto`): a pool that is
/// there is opened; one is created where nothing is, where files hold no
/// pool and nothing but zeros (a first create killed early), or where a
/// kvtier create did not finish; anything else (a foreign file, another
/// pool, a pool partly there) is refused unless [`Self::create_mode`] says
/// [`CreateMode::Always`]. A create killed at any point leaves the old pool
/// or none, and the same build finishes it (see [`Pool::create`]).
#[derive(Default)]
pub struct TierBuilder {
    location: Option<Location>,
    create: Option<PoolConfig>,
    expect: OpenExpect,
    directory_files: Option<u32>,
    capacity: Option<u64>,
    create_mode: CreateMode,
    geometry: Option<KvGeometry>,
    model_name: Option<String>,
    namespace: Option<String>,
    tp_rank: u32,
    group_blocks: Option<u32>,
    prewrite: bool,
    engine: EngineChoice,
    config: Option<HandleConfig>,
    memory: Option<Memory>,
    staging: Option<StagingConfig>,
}

impl TierBuilder {
    /// Open the pool on these files or block devices.
    pub fn files<P: Into<PathBuf>>(mut self, paths: impl IntoIterator<Item = P>) -> Self {
        self.location = Some(Location::Files(paths.into_iter().map(Into::into).collect()));
        self
    }

    /// The pool in directory `dir`: the files kvtier makes there
    /// (`kvtier-0.pool`, ...: as many as are there, one for a new pool,
    /// unless [`Self::directory_files`] says). The directory is made when
    /// the pool is created.
    pub fn directory(mut self, dir: impl Into<PathBuf>) -> Self {
        self.location = Some(Location::Directory(dir.into()));
        self
    }

    /// How many files (1 to 64) a pool in [`Self::directory`] spreads over
    /// (default: a new pool 1, one that is there the `kvtier-N.pool` files
    /// it has); an existing pool must be opened with the count it was
    /// created with.
    pub fn directory_files(mut self, files: u32) -> Self {
        self.directory_files = Some(files);
        self
    }

    /// Total bytes of a pool this builder creates, split equally over its
    /// files (each rounded down to 4 KiB). Needed only to create; an
    /// existing pool keeps its size.
    pub fn capacity(mut self, bytes: u64) -> Self {
        self.capacity = Some(bytes);
        self
    }

    /// Open the pool that is there, or create one (default
    /// [`CreateMode::Auto`]; see the type's documentation).
    pub fn create_mode(mut self, mode: CreateMode) -> Self {
        self.create_mode = mode;
        self
    }

    /// The pool's KV geometry (default: the KV memory's). The pool opened
    /// must have it; a pool created gets it.
    pub fn geometry(mut self, geometry: KvGeometry) -> Self {
        self.geometry = Some(geometry);
        self
    }

    /// The model's name, which a created pool records and its default key
    /// namespace is made from (`name/dtype/bsN/tpR`): KV of one model is
    /// never served to another of the same shape.
    pub fn model_name(mut self, name: impl Into<String>) -> Self {
        self.model_name = Some(name.into());
        self
    }

    /// [`Self::geometry`] and [`Self::model_name`] of a resolved model (a
    /// preset or a config.json, [`crate::model::resolve_named`]).
    pub fn model(self, model: NamedGeometry) -> Self {
        self.geometry(model.geometry).model_name(model.name)
    }

    /// The key namespace (default: from the model's name, the geometry and
    /// the TP rank). A pool serves one namespace; opening it for another is
    /// refused.
    pub fn namespace(mut self, namespace: impl Into<String>) -> Self {
        self.namespace = Some(namespace.into());
        self
    }

    /// The tensor-parallel rank, part of the default namespace: ranks hold
    /// different heads, so their blocks differ under the same hash.
    pub fn tp_rank(mut self, rank: u32) -> Self {
        self.tp_rank = rank;
        self
    }

    /// Blocks per extent group of a pool this builder creates (default
    /// [`DEFAULT_GROUP_BLOCKS`]); an existing pool keeps its own.
    pub fn group_blocks(mut self, blocks: u32) -> Self {
        self.group_blocks = Some(blocks);
        self
    }

    /// Write every byte of a created pool's files once (see
    /// [`PoolConfig::prewrite`]).
    pub fn prewrite(mut self, on: bool) -> Self {
        self.prewrite = on;
        self
    }

    /// Open the pool on namespace 1 of the NVMe controller at this PCI
    /// address (bound to vfio-pci or uio_pci_generic, e.g. by `kvtier nvme
    /// bind`).
    pub fn controller(mut self, pci_addr: impl Into<String>) -> Self {
        self.location = Some(Location::Controller(pci_addr.into()));
        self
    }

    /// A pool and engine of the caller's making (a test double of a device,
    /// an engine kvtier does not know): `open` runs on the I/O thread, so
    /// whatever it creates is used only there.
    #[cfg(feature = "internals")]
    pub fn custom_engine(
        mut self,
        open: impl FnOnce() -> Result<(Pool, Box<dyn IoEngine>)> + Send + 'static,
    ) -> Self {
        self.location = Some(Location::Custom(Box::new(open)));
        self
    }

    /// Create the pool as `cfg` says instead of opening it, with
    /// `cfg.force`'s policy (no open-or-create). Without a location set, the
    /// pool goes on `cfg.devices` (files or block devices).
    pub fn create(mut self, cfg: PoolConfig) -> Self {
        self.create = Some(cfg);
        self
    }

    /// What the opened pool must match (geometry, namespace).
    pub fn expect(mut self, expect: OpenExpect) -> Self {
        self.expect = expect;
        self
    }

    /// The engine to serve the pool with (default: [`EngineChoice::Auto`]).
    pub fn engine(mut self, engine: EngineChoice) -> Self {
        self.engine = engine;
        self
    }

    /// The handle's settings (default: [`HandleConfig::default`]).
    pub fn config(mut self, config: HandleConfig) -> Self {
        self.config = Some(config);
        self
    }

    /// Serve a KV cache kvtier allocated; the handle keeps it alive.
    pub fn host_cache(mut self, cache: Arc<HostKvCache>) -> Self {
        self.memory = Some(Memory::Host(cache));
        self
    }

    /// Serve the engine's own KV memory. GPU memory (`MemoryKind::Gpu`, the
    /// engine's CUDA tensors) that the engine cannot DMA into goes through
    /// the staged path (`crate::staged`: pinned host staging, a copy
    /// kernel per layer; sized by [`Self::staging`]); loads then have a
    /// per-layer GPU counter ([`TierHandle::load_counter`]).
    ///
    /// # Safety
    /// Every byte `mem` describes must stay allocated until `close` returns
    /// (or the last clone of the handle is dropped), and must not be written
    /// by anyone else while a job that uses it is in flight.
    pub unsafe fn memory(mut self, mem: KvMemory) -> Self {
        self.memory = Some(Memory::Raw(mem));
        self
    }

    /// How much pinned host staging GPU KV memory gets (see
    /// `crate::staged`); by default [`StagingConfig::for_blocks`].
    pub fn staging(mut self, cfg: StagingConfig) -> Self {
        self.staging = Some(cfg);
        self
    }

    /// The staged HBM path with `cache` (host memory) standing in for the
    /// GPU's KV memory and the CPU doing the staging kernels' copies: the
    /// test double that runs the staged path's logic on machines without a
    /// GPU.
    #[doc(hidden)]
    pub fn staged_host_double(mut self, cache: Arc<HostKvCache>) -> Self {
        self.memory = Some(Memory::StagedDouble(cache));
        self
    }

    /// As [`Self::staged_host_double`] over host memory the caller owns
    /// (CPU tensors posing as the GPU's KV memory): the test double of the
    /// staged path for bindings that register their own memory.
    ///
    /// # Safety
    /// As [`Self::memory`]; `mem` must be host memory.
    #[doc(hidden)]
    pub unsafe fn staged_host_double_memory(mut self, mem: KvMemory) -> Self {
        self.memory = Some(Memory::StagedDoubleRaw(mem));
        self
    }

    /// Open the pool, start the engine and the I/O thread, register the
    /// memory. Everything engine-side is created on the I/O thread itself.
    pub fn build(mut self) -> Result<TierHandle> {
        let location = match self.location.take() {
            Some(l) => l,
            None => match &self.create {
                Some(c) => Location::Files(c.devices.iter().map(|d| d.path.clone()).collect()),
                None => Location::Unset,
            },
        };
        let (engine, reason) = resolve_engine(self.engine, &location)?;
        let memory = self.memory.take().ok_or_else(|| {
            Error::invalid(
                "no KV memory: give the builder host_cache(..) or memory(..) before build()",
            )
        })?;
        let (geometry, mem_blocks) = match &memory {
            Memory::Host(c) | Memory::StagedDouble(c) => (c.memory().geometry, c.num_blocks()),
            Memory::Raw(m) | Memory::StagedDoubleRaw(m) => (m.geometry, m.num_blocks),
        };
        if let Some(g) = self.geometry.filter(|g| *g != geometry) {
            return Err(Error::invalid(format!(
                "geometry(..) is {} but the KV memory holds blocks of {}; give the memory of the pool's geometry",
                g.describe(),
                geometry.describe()
            )));
        }
        let location = self.plan_pool(location, geometry)?;
        let staging = self
            .staging
            .unwrap_or_else(|| StagingConfig::for_blocks(mem_blocks));
        let host_cache = match &memory {
            Memory::Host(c) => Some(c.clone()),
            Memory::Raw(_) | Memory::StagedDouble(_) | Memory::StagedDoubleRaw(_) => None,
        };
        let create = self.create;
        let expect = self.expect;
        let config = self.config.unwrap_or_default();
        let tier_cfg = config.tier.clone();
        let policy = config.policy;
        let backlog = config.backlog_limit_blocks;

        let (tx, rx) = mpsc::channel::<Result<Arc<Shared>>>();
        let (go_tx, go_rx) = mpsc::channel::<Arc<Shared>>();
        let thread = std::thread::Builder::new()
            .name("kvtier-io".into())
            .spawn(move || -> Result<()> {
                let opened = (move || -> Result<Scheduler> {
                    let mut tier = open_tier(location, engine, create.as_ref(), &expect, tier_cfg)?;
                    tier.defer_engine_calls(true);
                    let path: Box<dyn JobPath> = match memory {
                        Memory::Host(c) => {
                            tier.register_host_cache(c)?;
                            Box::new(tier)
                        }
                        // GPU memory the engine cannot DMA into: through
                        // pinned host staging and the staging kernels.
                        Memory::Raw(m)
                            if matches!(m.kind, MemoryKind::Gpu { .. })
                                && !tier.engine().reaches(m.kind) =>
                        {
                            let MemoryKind::Gpu { ordinal } = m.kind else {
                                unreachable!("matched above")
                            };
                            let ctx = Context::primary(&Device::get(ordinal as i32)?)?;
                            // SAFETY: the caller of `TierBuilder::memory`
                            // promised the memory outlives the handle's tier.
                            Box::new(unsafe { StagedTier::on_gpu(tier, &ctx, m, staging)? })
                        }
                        Memory::Raw(m) => {
                            // SAFETY: the caller of `TierBuilder::memory` promised
                            // the memory outlives the handle's tier.
                            unsafe { tier.register_memory(m)? };
                            Box::new(tier)
                        }
                        Memory::StagedDouble(c) => {
                            Box::new(StagedTier::with_host_double(tier, c, staging)?)
                        }
                        // SAFETY: the caller of `staged_host_double_memory`
                        // promised the memory outlives the handle's tier.
                        Memory::StagedDoubleRaw(m) => Box::new(unsafe {
                            StagedTier::with_host_double_memory(tier, m, staging)?
                        }),
                    };
                    Ok(Scheduler::with_path(path, policy, backlog))
                })();
                let sched = match opened {
                    Ok(s) => s,
                    Err(e) => {
                        let _ = tx.send(Err(e));
                        return Ok(());
                    }
                };
                // Store checksums are taken from host KV memory on the
                // caller's thread; the staged path takes them on the GPU.
                let crc_table = sched.path().caller_crc_table();
                let engine_name = sched.tier().engine().name().to_string();
                let index = sched.tier().shared_index();
                let namespace = sched.tier().pool().namespace().to_string();
                let model_name = sched.tier().pool().model().to_string();
                let shared = Arc::new(Shared {
                    core: Mutex::new(Some(sched)),
                    index,
                    index_open: AtomicBool::new(true),
                    jobs: Mutex::new(Jobs::default()),
                    cond: Condvar::new(),
                    doorbell: EventFd::from_flags(EfdFlags::EFD_CLOEXEC | EfdFlags::EFD_NONBLOCK)
                        .map_err(|e| {
                        Error::io("creating the I/O thread's eventfd", e.into())
                    })?,
                    closing: AtomicU8::new(super::RUNNING),
                    geometry,
                    mem_blocks,
                    crc_table,
                    host_cache,
                    cfg: config,
                    engine: engine_name,
                    engine_reason: reason,
                    namespace,
                    model_name,
                    io_thread: std::thread::current().id(),
                });
                if tx.send(Ok(shared)).is_err() {
                    return Ok(());
                }
                // The builder hands the same Arc back once it holds the thread.
                match go_rx.recv() {
                    Ok(shared) => super::io_main(shared),
                    Err(_) => Ok(()),
                }
            })
            .map_err(|e| Error::io("starting the kvtier I/O thread", e))?;
        let shared = match rx.recv() {
            Ok(Ok(s)) => s,
            Ok(Err(e)) => {
                let _ = thread.join();
                return Err(e);
            }
            Err(_) => {
                let _ = thread.join();
                return Err(Error::Closed(
                    "the kvtier I/O thread stopped while opening the pool".into(),
                ));
            }
        };
        let owner = Arc::new(Owner {
            shared: shared.clone(),
            thread: Mutex::new(Some(thread)),
            close_error: Mutex::new(None),
        });
        let _ = go_tx.send(shared.clone());
        Ok(TierHandle { shared, owner })
    }
}

impl TierBuilder {
    /// The calls on this builder that set up a pool of this process's own
    /// (where it is, how it is made, its engine, policy, memory and
    /// namespace), by name: a client of the node's service
    /// (`TierBuilder::service`) has the service's, so they conflict.
    pub(crate) fn own_pool_calls(&self) -> Vec<&'static str> {
        let location = self.location.as_ref().map(|l| match l {
            Location::Unset => None,
            Location::Files(_) => Some("files(..)"),
            Location::Directory(_) => Some("directory(..)"),
            Location::Controller(_) => Some("controller(..)"),
            Location::Custom(_) => Some("custom_engine(..)"),
        });
        let memory = self.memory.as_ref().map(|m| match m {
            Memory::Host(_) => "host_cache(..)",
            Memory::Raw(_) => "memory(..)",
            Memory::StagedDouble(_) | Memory::StagedDoubleRaw(_) => "staged_host_double(..)",
        });
        let set = [
            (location.flatten(), true),
            (Some("create(..)"), self.create.is_some()),
            (
                Some("expect(..)"),
                self.expect.geometry.is_some() || self.expect.namespace.is_some(),
            ),
            (Some("directory_files(..)"), self.directory_files.is_some()),
            (Some("capacity(..)"), self.capacity.is_some()),
            (
                Some("create_mode(..)"),
                self.create_mode != CreateMode::Auto,
            ),
            (Some("namespace(..)"), self.namespace.is_some()),
            (Some("tp_rank(..)"), self.tp_rank != 0),
            (Some("group_blocks(..)"), self.group_blocks.is_some()),
            (Some("prewrite(..)"), self.prewrite),
            (Some("engine(..)"), self.engine != EngineChoice::Auto),
            (Some("config(..)"), self.config.is_some()),
            (memory, true),
            (Some("staging(..)"), self.staging.is_some()),
        ];
        set.into_iter()
            .filter_map(|(name, on)| name.filter(|_| on))
            .collect()
    }

    /// The geometry asked for with `geometry(..)` or `model(..)`, if any.
    pub(crate) fn asked_geometry(&self) -> Option<KvGeometry> {
        self.geometry
    }

    /// Where the pool is and whether to open or create it
    /// ([`crate::pool::place`]): sets `create` or `expect`, and turns a
    /// directory into its files. An explicit [`Self::create`] config, a
    /// controller and a custom engine are taken as given.
    fn plan_pool(&mut self, location: Location, memory_geometry: KvGeometry) -> Result<Location> {
        let (paths, dir) = match location {
            Location::Files(paths) if self.create.is_none() => (paths, None),
            Location::Directory(dir) => {
                let files = self
                    .directory_files
                    .unwrap_or_else(|| place::directory_files_found(&dir).max(1));
                if !(1..=64).contains(&files) {
                    return Err(Error::invalid(format!(
                        "directory_files({files}): give 1 to 64 pool files"
                    )));
                }
                if self.create.is_some() {
                    return Err(Error::invalid(
                        "create(PoolConfig) names its own devices; give it without directory(..), or use capacity(..) to create a pool in the directory",
                    ));
                }
                (place::directory_files(&dir, files), Some(dir))
            }
            other => return Ok(other),
        };
        let geometry = self.geometry.unwrap_or(memory_geometry);
        let namespace = self.namespace.clone().or_else(|| {
            self.model_name
                .as_deref()
                .map(|name| default_namespace(name, &geometry, self.tp_rank))
        });
        match place::decide(&paths, self.create_mode)? {
            Verdict::Open => {
                // What was asked for must be what is opened.
                if self.geometry.is_some() {
                    self.expect.geometry.get_or_insert(geometry);
                }
                if let Some(ns) = namespace {
                    self.expect.namespace.get_or_insert(ns);
                }
            }
            Verdict::Create { force } => {
                let group_blocks = self.group_blocks.unwrap_or(DEFAULT_GROUP_BLOCKS);
                let shown = dir.as_deref().unwrap_or(&paths[0]);
                let capacity = self.capacity.ok_or_else(|| {
                    Error::invalid(format!(
                        "pool {}: no pool is there to open, and no capacity was given to create one",
                        shown.display()
                    ))
                    .with_fix(crate::error::Fix::GiveCapacity {
                        at_least: place::min_capacity(&geometry, group_blocks, paths.len()),
                    })
                })?;
                let per_file =
                    place::bytes_per_file(capacity, paths.len(), &geometry, group_blocks, shown)?;
                if let Some(name) = self
                    .model_name
                    .as_ref()
                    .filter(|n| n.is_empty() || n.chars().any(char::is_control))
                {
                    return Err(Error::invalid(format!(
                        "model_name({name:?}) must be non-empty printable text (it names the model in the pool)"
                    )));
                }
                let (model, namespace) = match (&self.model_name, namespace) {
                    (Some(name), Some(ns)) => (name.clone(), ns),
                    (None, Some(ns)) => (ns.clone(), ns),
                    (_, None) => {
                        return Err(Error::invalid(
                            "creating a pool needs the model's name, which keys its namespace (KV of one model is never served to another of the same shape): call model_name(..) or model(..), or namespace(..)",
                        ))
                    }
                };
                if let Some(dir) = &dir {
                    std::fs::create_dir_all(dir).map_err(|e| {
                        Error::io(format!("creating the pool directory {}", dir.display()), e)
                    })?;
                }
                self.create = Some(
                    PoolConfig::new(geometry, model, namespace)
                        .with_group_blocks(group_blocks)
                        .with_devices(
                            paths
                                .iter()
                                .map(|p| DeviceSpec {
                                    path: p.clone(),
                                    size: Some(per_file),
                                })
                                .collect(),
                        )
                        .with_force(force)
                        .with_prewrite(self.prewrite),
                );
            }
        }
        Ok(Location::Files(paths))
    }
}

fn engine_label(e: EngineChoice) -> &'static str {
    match e {
        EngineChoice::Auto | EngineChoice::Uring => "uring",
        EngineChoice::Nvme => "nvme",
        EngineChoice::Gpu => "gpu",
        EngineChoice::GpuHost => "gpu-host",
    }
}

/// The engine for `location`, with the reason. `Auto` takes the engine decision
/// (`kvtier doctor`'s verdict, [`crate::engine::choice`]).
fn resolve_engine(choice: EngineChoice, location: &Location) -> Result<(EngineChoice, String)> {
    match (choice, location) {
        (_, Location::Unset) => Err(Error::invalid(
            "no pool location: call directory(..), files(..), controller(..) or create(..) on the builder",
        )),
        (_, Location::Custom(_)) => Ok((EngineChoice::Uring, "a custom engine".into())),
        (EngineChoice::Uring, Location::Files(_) | Location::Directory(_)) => {
            Ok((choice, "asked for".into()))
        }
        (EngineChoice::Uring, Location::Controller(addr)) => Err(Error::Unsupported(format!(
            "io_uring serves files and block devices, not controller {addr} driven from userspace; give the namespace's block device (/dev/nvmeXnY, controller on the kernel's nvme driver) with files(..), or pick the nvme or gpu engine"
        ))),
        (_, Location::Controller(_)) if choice != EngineChoice::Auto => {
            Ok((choice, "asked for".into()))
        }
        (_, Location::Files(_) | Location::Directory(_)) if choice != EngineChoice::Auto => Err(Error::Unsupported(format!(
            "the {} engine drives an NVMe controller from userspace, not files or block devices; name the controller with controller(PCI_ADDR) after `kvtier nvme bind`, or use the uring engine",
            engine_label(choice)
        ))),
        (_, loc) => {
            // The pool's first device: where it is there, O_DIRECT is tried
            // by reading it (a full or read-only file system takes no probe
            // file, and its pool still opens or gets its own error).
            let first = match loc {
                Location::Files(p) => p.first().cloned(),
                Location::Directory(d) => place::directory_files(d, 1).into_iter().next(),
                _ => None,
            };
            let dir = first.as_deref().map_or_else(std::env::temp_dir, probe_dir);
            use crate::engine::choice::{decide, Engine, Facts};
            let facts = Facts::probe(&dir, first.as_deref())?;
            let decision = decide(&facts);
            let verdict = decision.engine.as_str();
            let why = decision.reason;
            match (decision.engine, loc) {
                // No probe file could be made or written there (no space,
                // read-only, permissions): O_DIRECT is untried, not refused,
                // and the pool's create or open names what is wrong there
                // (this said "no engine can serve this pool").
                (Engine::None, Location::Files(_) | Location::Directory(_))
                    if facts.direct_io_untried && facts.uring.is_ok() =>
                {
                    Ok((
                        EngineChoice::Uring,
                        format!(
                            "io_uring works; O_DIRECT on {} could not be tried ({}), so the pool's own open decides",
                            facts.pool_dir.display(),
                            facts.direct_io.as_ref().err().map_or("", String::as_str)
                        ),
                    ))
                }
                (Engine::Gpu, Location::Controller(_)) => Ok((EngineChoice::Gpu, why)),
                (Engine::Nvme, Location::Controller(_)) => Ok((EngineChoice::Nvme, why)),
                (Engine::Gpu | Engine::Nvme, Location::Files(_) | Location::Directory(_)) => Ok((
                    EngineChoice::Uring,
                    format!(
                        "the pool is on files or block devices, which io_uring serves (kvtier doctor would pick {verdict} for a pool on a controller: {why})"
                    ),
                )),
                (Engine::Uring, Location::Files(_) | Location::Directory(_)) => {
                    Ok((EngineChoice::Uring, why))
                }
                _ => Err(Error::Unsupported(format!(
                    "no engine can serve this pool here: kvtier doctor says {verdict}: {why}"
                ))),
            }
        }
    }
}

/// The directory the engine decision probes for O_DIRECT: the first device's.
fn probe_dir(first: &Path) -> PathBuf {
    first
        .parent()
        .filter(|p| !p.as_os_str().is_empty())
        .map(Path::to_path_buf)
        .unwrap_or_else(|| PathBuf::from("."))
}

fn open_tier(
    location: Location,
    engine: EngineChoice,
    create: Option<&PoolConfig>,
    expect: &OpenExpect,
    cfg: crate::tier::TierConfig,
) -> Result<Tier> {
    match location {
        Location::Files(paths) => {
            let pool = match create {
                Some(c) => Pool::create(c)?,
                None => Pool::open(&paths, expect)?,
            };
            Tier::open(pool, cfg)
        }
        Location::Controller(addr) => {
            let ue = match engine {
                EngineChoice::Nvme => UserspaceEngine::Nvme,
                EngineChoice::Gpu => UserspaceEngine::Gpu,
                EngineChoice::GpuHost => UserspaceEngine::GpuHost,
                other => {
                    return Err(Error::Unsupported(format!(
                        "the {} engine does not drive a controller",
                        engine_label(other)
                    )))
                }
            };
            let (pool, eng) = pool_on_nvme(&addr, ue, create, expect)?;
            Tier::with_engine(pool, cfg, eng)
        }
        Location::Custom(open) => {
            let (pool, eng) = open()?;
            Tier::with_engine(pool, cfg, eng)
        }
        Location::Unset | Location::Directory(_) => Err(Error::invalid("no pool location")),
    }
}
