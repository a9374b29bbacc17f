//! The GPU I/O kernel's logic compiled for the host (build.rs links it into
//! the crate: `kvtier::gpu::host_kernel`); tests that need it skip, saying
//! why, in a build without a C++ compiler.

pub use kvtier::gpu::host_kernel::HostKernel as HostLib;

pub fn host_lib() -> Option<&'static HostLib> {
    let k = kvtier::gpu::host_kernel::host_kernel();
    if k.is_none() {
        eprintln!(
            "kvtier was built without a C++ compiler, so without the host build of the GPU \
             I/O kernel: these tests are skipped; install one (apt-get install g++) and rebuild"
        );
    }
    k
}

#[macro_export]
macro_rules! lib_or_skip {
    () => {
        match $crate::common::gio_host::host_lib() {
            Some(lib) => lib,
            None => {
                eprintln!("skipped: no host build of the I/O kernel");
                return;
            }
        }
    };
}
