//! kvtier: a GPU-centric NVMe SSD tier for LLM KV caches.
//!
//! Rooms (see DESIGN.md): `model` (KV geometry), `pool` (key → GPU file on the
//! SSDs), `memory` + `p2p` (registered KV memory → SGL descriptors), `ring`
//! (gio_uring: IOCBs of IOCTXs), `engine` (who executes IOCBs: io_uring,
//! userspace NVMe, the GPU kernel), `tier` (the single-threaded core),
//! `handle` (the thread-safe front door serving engines call: [`TierHandle`],
//! opened with [`TierBuilder`]). Raw syscalls live only in `engine::uring`
//! and `pool::backing`.

pub mod bench;
pub mod cli;
pub mod doctor;
pub mod engine;
pub mod error;
#[doc(hidden)]
pub mod fuzzing;
pub mod gpu;
pub mod handle;
pub mod host;
pub mod json;
pub mod memory;
pub mod model;
pub mod nvme;
pub mod nvme_cli;
pub mod p2p;
pub mod plan;
pub mod pool;
pub mod replay;
pub mod ring;
pub mod sched;
pub mod scratch;
pub mod slack;
pub mod submitter;
pub mod tier;

pub use error::{Error, ErrorKind, Failure, IoCause, IoFailure, Result};
pub use handle::{EngineChoice, Event, HandleConfig, TierBuilder, TierHandle};
pub use memory::{HostKvCache, HostLayout, KvLayout, KvMemory, MemoryKind};
pub use model::{DType, KvGeometry};
pub use pool::{DeviceSpec, Key, OpenExpect, Pool, PoolConfig};
pub use tier::{JobId, JobResult, KeyOutcome, LayerDone, Tier, TierConfig};
