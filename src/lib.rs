//! kvtier: a GPU-centric NVMe SSD tier for LLM KV caches.
//!
//! Rooms, bottom up (docs/design.md tells the design):
//!
//! - `host`: facts about the machine (PCI functions in sysfs, mounts and holders,
//!   filesystem signatures, direct-I/O alignment and [`host::dio::AlignedBuf`], which of
//!   a file was never written, byte sizes for people).
//! - `checksum`: crc32c of bulk KV data (what stores record and loads verify).
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
//!   kernels, [`gpu::probe()`]).
//! - `engine`: who executes IOCBs (io_uring, userspace NVMe, the GPU kernel), and
//!   `engine::choice`, the one decision of which engine this machine can run (the
//!   builder's automatic engine and `kvtier doctor`'s verdict);
//!   `submitter` pairs a ring with its engine, above both.
//! - `tier` (the single-threaded core), `sched` + `slack` + `plan` (when I/O runs),
//!   `handle` (the thread-safe front door serving engines call: [`TierHandle`],
//!   opened with [`TierBuilder`]), and `service` above it (`kvtier serve`: one
//!   handle shared by every engine process on a node over a Unix socket).
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

#[warn(missing_docs)]
pub mod checksum;
#[warn(missing_docs)]
pub mod engine;
#[warn(missing_docs)]
pub mod error;
#[doc(hidden)]
pub mod fuzzing;
#[warn(missing_docs)]
pub mod gpu;
#[warn(missing_docs)]
pub mod handle;
#[warn(missing_docs)]
pub mod host;
#[warn(missing_docs)]
pub mod json;
#[warn(missing_docs)]
pub mod memory;
#[warn(missing_docs)]
pub mod model;
#[warn(missing_docs)]
pub mod nvme;
#[warn(missing_docs)]
pub mod p2p;
#[warn(missing_docs)]
pub mod plan;
#[warn(missing_docs)]
pub mod pool;
#[warn(missing_docs)]
pub mod ring;
#[warn(missing_docs)]
pub mod sched;
#[warn(missing_docs)]
pub mod scratch;
#[warn(missing_docs)]
pub mod service;
#[warn(missing_docs)]
pub mod slack;
#[warn(missing_docs)]
pub mod submitter;
#[warn(missing_docs)]
pub mod tier;

pub use error::{Error, ErrorKind, Failure, IoCause, IoFailure, Result};
pub use handle::{EngineChoice, Event, HandleConfig, TierBuilder, TierHandle};
pub use memory::{HostKvCache, HostLayout, KvLayout, KvMemory, MemoryKind};
pub use model::{DType, KvGeometry};
pub use pool::{DeviceSpec, Key, OpenExpect, Pool, PoolConfig};
pub use tier::{JobId, JobResult, KeyOutcome, LayerDone, Tier, TierConfig};
