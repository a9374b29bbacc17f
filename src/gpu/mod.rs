//! The CUDA driver layer of the GPU engine.
//!
//! Layers, bottom up:
//! - [`driver`]: every raw CUDA driver call, through cudarc's `driver::sys`
//!   function table that kvtier loads itself after probing libcuda with
//!   `dlopen`/`dlsym` (cudarc's own loader panics without a driver). Nothing
//!   outside `driver` calls CUDA.
//! - [`probe`](mod@probe): what the driver sees ([`probe()`]), never panicking.
//! - [`context`]: devices, primary contexts, modules, kernels, streams,
//!   events — RAII types that hold their context alive.
//! - [`green`]: green contexts and the I/O / compute SM split.
//! - [`memory`]: device, pinned and registered host memory (BAR0 too),
//!   KV-pool registration, and the completion counters that a stream waits
//!   on with `cuStreamWaitValue32` (no CPU in the loop).
//! - [`dma`]: how an NVMe controller reaches GPU-visible memory
//!   ([`dma::GpuDmaPath`]) and which of those paths this machine has.
//!
//! - [`abi`]: the Rust twin of `kernels/gio_gpu.h` (queue, ring, device and
//!   engine descriptors the I/O kernel reads), with size/offset asserts.
//! - [`kernels`]: the embedded cubin/PTX images that `build.rs` compiled.
//! - [`host_kernel`]: the same I/O kernel logic compiled for the CPU (the
//!   GPU engine's host executor).
//! - [`staging`]: scatter/gather between pinned staging and paged KV blocks
//!   in GPU memory, with crc32c on the GPU (the copies of the staged HBM
//!   path, which lives above the tier in `crate::staged`).
//! - [`wait`]: compute streams waiting on completion counters
//!   ([`wait::LoadCounter`], [`wait::LayerWait`]).
//!
//! Nothing here names the tier, the engines or anything above them.

pub mod abi;
pub mod context;
pub mod dma;
pub mod driver;
pub mod green;
pub mod host_kernel;
pub mod kernels;
pub mod memory;
pub mod probe;
pub mod staging;
pub mod wait;

pub use context::{Context, Device, Event, Function, KernelArgs, LaunchConfig, Module, Stream};
pub use dma::{DmaPathKind, GpuDmaPath, GpuDmaRegion, HostBouncePath};
pub use driver::{LoadError, LoadStage};
pub use green::{GreenContext, SmGranularity, SmPartition, SplitPlan};
pub use memory::{
    check_gpu_kv_memory, register_kv_memory, CompletionCounter, DeviceBuffer, HostRegistration,
    KvRegistration, PinnedHostBuffer, RegisterFlags, WaitCond,
};
pub use probe::{probe, probe_detailed, DeviceInfo, DriverInfo, ProbeFailure};
