//! kvtier: a GPU-centric NVMe SSD tier for LLM KV caches.
//!
//! # The API
//!
//! A serving engine opens a [`TierHandle`] with a [`TierBuilder`] (a pool
//! directory or devices, its capacity, the model's [`KvGeometry`], the engine's
//! KV memory: [`HostKvCache`] / [`KvMemory`], or GPU memory through a
//! [`Context`] and [`StagingConfig`]), then looks up and pins prefixes, loads
//! them layer by layer ([`Event`], [`LoadCounter`] for a GPU stream to wait on)
//! and stores new blocks ([`JobResult`], [`KeyOutcome`]). Every error is an
//! [`Error`] with an [`ErrorKind`] to act on, a [`Failure`] per key or layer,
//! and where there is one an [`error::Fix`]. [`Pool`] opens a pool to inspect,
//! check or repair it. `examples/quickstart.rs` runs the whole round trip.
//!
//! That is the whole public surface of this crate as a library. The rooms below
//! it are public only with the `internals` feature, for the tools built from
//! this repository (the CLI, the profiler, the Python bindings); the test
//! doubles (the simulated NVMe controller) and fuzzing entry points only with
//! `testing`, which the tests and the fuzz crate turn on.
//!
//! # Rooms, bottom up (docs/design.md tells the design)
//!
//! - `host`: facts about the machine (PCI functions in sysfs, mounts and holders,
//!   filesystem signatures, direct-I/O alignment and `AlignedBuf`, which of
//!   a file was never written, byte sizes for people).
//! - `checksum`: crc32c of bulk KV data (what stores record and loads verify), and
//!   the one stable hash of names (FNV-1a) for ids written down.
//! - `model` (KV geometry), `json` (strict JSON readers), `error`.
//! - `pool`: key → slot on the SSDs; `pool::backing` opens the files and block devices
//!   kvtier was given and refuses anyone else's data.
//! - `memory` + `p2p`: registered KV memory → SGL descriptors.
//! - `ring`: gio_uring, data only (IOCBs of IOCTXs, SQ and CQ of ids); its ABI
//!   re-exports the NVMe SGL descriptor `nvme::spec` owns.
//! - `nvme`: userspace NVMe (spec layouts, queue pairs, controller bring-up, uio and
//!   VFIO access with one mapped BAR0, the binder, the namespace as pool storage, a
//!   simulated controller for tests).
//! - `gpu`: the CUDA driver layer (loader, contexts, green contexts, memory, DMA paths,
//!   kernels, the staging copies and stream waits on counters, `gpu::probe()`); it
//!   names nothing above it.
//! - `engine`: who executes IOCBs (io_uring, userspace NVMe, the GPU kernel), and
//!   `engine::choice`, the one decision of which engine this machine can run (the
//!   builder's automatic engine and `kvtier doctor`'s verdict);
//!   `submitter` pairs a ring with its engine, above both.
//! - `tier` (the single-threaded core, and `tier::JobPath`, the one job path a
//!   scheduler drives), `staged` (the staged HBM path above the tier: GPU KV memory
//!   through pinned layer buffers, `staged::StagedTier`), `sched` + `slack` + `plan`
//!   (when I/O runs), `handle` (the thread-safe front door serving engines call:
//!   [`TierHandle`], opened with [`TierBuilder`]), and `service` above it (`kvtier
//!   serve`: one handle shared by every engine process on a node over a Unix socket).
//!
//! Imports between rooms run one way, with no circle: docs/design.md has the table of
//! which room may import which, and `tests/module_graph.rs` checks it.
//!
//! The command line (`kvtier` binary: pool, bench, replay, doctor, nvme) is the
//! `kvtier-cli` crate in `cli/`; this crate has no CLI dependencies.
//!
//! Raw syscalls and ioctls live in small modules behind safe types: `host::dio`
//! (statx), `host::extents` (FIEMAP), `pool::backing`'s `sys`, `scan` and `locks` (block-device ioctls,
//! fallocate, lseek, flock), `engine::uring` (io_uring through the io-uring crate,
//! poll), `nvme::{uio, vfio, mmio}` (BAR and DMA mappings, pagemap, VFIO ioctls),
//! `gpu::driver` (every CUDA driver call), `service::sys` (memfd, mmap, `SCM_RIGHTS`,
//! `SO_PEERCRED`), `scratch` (the signal handler that removes
//! scratch files), and `nvme::passthru` (the kernel driver's NVMe admin ioctl). Everything above them
//! is safe Rust over those types.

/// `with_*` setters for a config's public fields, each taking the value and
/// returning the config: the configs are `#[non_exhaustive]`, so code outside
/// the crate builds one from `Default` (or a constructor) and these.
macro_rules! with_setters {
    ($ty:ty { $($(#[$doc:meta])* $setter:ident => $field:ident : $t:ty),* $(,)? }) => {
        impl $ty {
            $(
                $(#[$doc])*
                #[must_use]
                pub fn $setter(mut self, $field: $t) -> Self {
                    self.$field = $field;
                    self
                }
            )*
        }
    };
}

/// A room below the curated API: public with the `internals` feature (the
/// CLI, the profiler, the Python bindings and this crate's tests turn it on),
/// crate-private otherwise, so a user of the library sees the handle, its
/// builder, the config types, errors, geometry and pool inspection only.
macro_rules! internal_room {
    ($($(#[$meta:meta])* $name:ident;)*) => {$(
        $(#[$meta])*
        #[cfg(feature = "internals")]
        #[warn(missing_docs)]
        pub mod $name;
        $(#[$meta])*
        #[cfg(not(feature = "internals"))]
        #[allow(dead_code, unused_imports)]
        pub(crate) mod $name;
    )*};
}

/// A method public to the tools built from this repository (the `internals`
/// feature) and crate-private otherwise: the curated API's types keep the
/// calls that reach below it (a pool's index and layout, raw storage) out of
/// a library user's view.
macro_rules! internal_pub {
    ($(#[$meta:meta])* fn $($rest:tt)*) => {
        $(#[$meta])*
        #[cfg(feature = "internals")]
        pub fn $($rest)*
        $(#[$meta])*
        #[cfg(not(feature = "internals"))]
        #[allow(dead_code)]
        pub(crate) fn $($rest)*
    };
    ($(#[$meta:meta])* unsafe fn $($rest:tt)*) => {
        $(#[$meta])*
        #[cfg(feature = "internals")]
        pub unsafe fn $($rest)*
        $(#[$meta])*
        #[cfg(not(feature = "internals"))]
        #[allow(dead_code)]
        pub(crate) unsafe fn $($rest)*
    };
}

// The curated API.
#[warn(missing_docs)]
pub mod error;
#[warn(missing_docs)]
pub mod handle;
#[warn(missing_docs)]
pub mod memory;
#[warn(missing_docs)]
pub mod model;
#[warn(missing_docs)]
pub mod pool;
#[warn(missing_docs)]
pub mod service;

internal_room! {
    checksum;
    engine;
    gpu;
    host;
    json;
    nvme;
    p2p;
    plan;
    ring;
    sched;
    scratch;
    slack;
    staged;
    submitter;
    tier;
}

/// Entry points of the decoders of untrusted bytes, for the fuzz targets and
/// `tests/fuzz_decoders.rs` (the `testing` feature).
#[cfg(feature = "testing")]
#[doc(hidden)]
pub mod fuzzing;

pub use error::{Error, ErrorKind, Failure, Fix, IoCause, IoFailure, Result};
pub use handle::{EngineChoice, Event, HandleConfig, LayerCopy, TierBuilder, TierHandle};
pub use memory::{HostKvCache, HostLayout, KvLayout, KvMemory, MemoryKind};
pub use model::{DType, KvGeometry};
pub use pool::CreateMode;
pub use pool::{DeviceSpec, Key, OpenExpect, Pool, PoolConfig};
pub use tier::Usage;
pub use tier::{JobId, JobKind, JobResult, KeyOutcome, LayerDone, TierConfig};
// The config types and GPU handles the curated API's signatures take.
pub use engine::uring::UringConfig;
pub use engine::EngineStats;
pub use gpu::{CompletionCounter, Context, Device, Event as GpuEvent, Stream, WaitCond};
pub use sched::Policy;
pub use staged::{CopyMark, LoadCounter, StagingConfig};
#[cfg(feature = "internals")]
pub use tier::Tier;
