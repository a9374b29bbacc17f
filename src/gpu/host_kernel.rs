//! The I/O kernel's logic (`kernels/gio_nvme.cuh`) compiled for the CPU.
//!
//! build.rs compiles `kernels/host/gio_host.cpp` with the host C++ compiler
//! into a static library (libc only) and sets `cfg(kvtier_host_gio)`: the
//! same command building, doorbells, CQ polling, timeouts and IOCB
//! completion the CUDA kernel runs, with a block's threads run as a loop and
//! each block on its own thread. The GPU engine's host executor
//! (`HostGioExecutor` in the engine layer above) launches it, so the engine runs
//! end to end against the simulated controller and QEMU's on machines
//! without a GPU. A build without a C++ compiler has none of it and
//! [`host_kernel`] says so.

use super::abi::GioEngine;
use crate::nvme::spec::Sqe;

/// `kvtier_host_run_grid(engine, threads_per_block, mode)`: every block of
/// the kernel, concurrently, until they return.
pub(crate) type RunGrid = unsafe extern "C" fn(*const GioEngine, u32, u32);
/// `kvtier_host_build_command(engine, queue, iocb, ctx, cmd, sqe, desc,
/// desc_dma, ncmds)`: one command exactly as the kernel builds it.
pub(crate) type BuildCommand = unsafe extern "C" fn(
    *const GioEngine,
    u32,
    u32,
    u32,
    u32,
    *mut Sqe,
    *mut u8,
    u64,
    *mut u32,
) -> u16;
/// `kvtier_host_wait_counter(counter, target, timeout_ns)`: 1 when reached.
pub(crate) type WaitCounter = unsafe extern "C" fn(*const u32, u32, u64) -> i32;

/// The host build's entry points.
pub struct HostKernel {
    /// Runs the I/O kernel's grid on CPU threads.
    pub run_grid: RunGrid,
    /// Builds one NVMe command from an IOCTX.
    pub build_command: BuildCommand,
    /// Waits for a completion counter to reach a value.
    pub wait_counter: WaitCounter,
}

#[cfg(kvtier_host_gio)]
mod ffi {
    use super::{GioEngine, Sqe};
    extern "C" {
        pub fn kvtier_host_layout(out: *mut u64);
        pub fn kvtier_host_run_grid(eng: *const GioEngine, nthreads: u32, mode: u32);
        pub fn kvtier_host_build_command(
            eng: *const GioEngine,
            q: u32,
            iocb: u32,
            ctx: u32,
            cmd: u32,
            sqe: *mut Sqe,
            desc: *mut u8,
            desc_dma: u64,
            ncmds: *mut u32,
        ) -> u16;
        pub fn kvtier_host_wait_counter(counter: *const u32, target: u32, timeout_ns: u64) -> i32;
    }
}

/// The host build of the I/O kernel, or `None` when the crate was built
/// without a C++ compiler. Panics if the library was compiled against other
/// layouts than the crate's (a build that mixed headers).
pub fn host_kernel() -> Option<&'static HostKernel> {
    #[cfg(kvtier_host_gio)]
    {
        use crate::gpu::abi::{GioDev, GioQueue, GioRing};
        use crate::ring::abi::Iocb;
        use std::mem::size_of;
        static KERNEL: std::sync::OnceLock<HostKernel> = std::sync::OnceLock::new();
        Some(KERNEL.get_or_init(|| {
            let mut sizes = [0u64; 5];
            // SAFETY: writes 5 u64s.
            unsafe { ffi::kvtier_host_layout(sizes.as_mut_ptr()) };
            assert_eq!(
                sizes,
                [
                    size_of::<GioQueue>() as u64,
                    size_of::<GioRing>() as u64,
                    size_of::<GioDev>() as u64,
                    size_of::<GioEngine>() as u64,
                    size_of::<Iocb>() as u64
                ],
                "the host build of the I/O kernel and the Rust ABI disagree on struct sizes"
            );
            HostKernel {
                run_grid: ffi::kvtier_host_run_grid,
                build_command: ffi::kvtier_host_build_command,
                wait_counter: ffi::kvtier_host_wait_counter,
            }
        }))
    }
    #[cfg(not(kvtier_host_gio))]
    {
        None
    }
}
