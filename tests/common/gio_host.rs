//! The GPU I/O kernel's logic (`kernels/gio_nvme.cuh` with
//! `kernels/host/gio_host.cpp`) compiled for the host into a shared library
//! and loaded with dlopen, once per test process: the host-run tests of the
//! kernel and of the GPU engine drive it against the simulated controller.

use super::{find_compiler, kernels_dir, TempDir};
use kvtier::gpu::abi::{GioDev, GioEngine, GioQueue, GioRing as GpuRing};
use kvtier::nvme::spec::Sqe;
use kvtier::ring::abi::Iocb;
use std::ffi::{c_void, CString};
use std::sync::OnceLock;

// ------------------------------------------------------------ the library --

pub type RunGrid = unsafe extern "C" fn(*const GioEngine, u32, u32);
pub type BuildCommand = unsafe extern "C" fn(
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
pub type WaitCounter = unsafe extern "C" fn(*const u32, u32, u64) -> i32;
pub type Layout = unsafe extern "C" fn(*mut u64);

pub struct HostLib {
    pub run_grid: RunGrid,
    pub build_command: BuildCommand,
    pub wait_counter: WaitCounter,
}

/// Compiles and loads the host build of the kernel once per test process;
/// `None` when there is no C++ compiler.
pub fn host_lib() -> Option<&'static HostLib> {
    static LIB: OnceLock<Option<HostLib>> = OnceLock::new();
    LIB.get_or_init(|| {
        let Some(cxx) = find_compiler("CXX", &["c++", "g++", "clang++"]) else {
            eprintln!(
                "no host C++ compiler (tried $CXX, c++, g++, clang++): the GPU kernel's host-run \
                 tests are skipped; install one (e.g. `apt-get install g++`) to run them"
            );
            return None;
        };
        let dir = TempDir::new("gio-host");
        let so = dir.file("libgio_host.so");
        let out = std::process::Command::new(&cxx)
            .args(["-std=c++17", "-O1", "-g", "-shared", "-fPIC", "-pthread"])
            .args(["-Wall", "-Wextra", "-Werror"])
            .arg("-I")
            .arg(kernels_dir())
            .arg(kernels_dir().join("host").join("gio_host.cpp"))
            .arg("-o")
            .arg(&so)
            .output()
            .unwrap_or_else(|e| panic!("could not run {cxx}: {e}"));
        assert!(
            out.status.success(),
            "{cxx} failed on kernels/host/gio_host.cpp:\n{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let path = CString::new(so.to_str().expect("utf-8 temp path")).unwrap();
        // SAFETY: a library we just built; its initialisers are the C++
        // runtime's. The handle is never closed (the functions are 'static);
        // the file may go with the temp dir once mapped.
        let handle = unsafe { libc::dlopen(path.as_ptr(), libc::RTLD_NOW | libc::RTLD_LOCAL) };
        assert!(!handle.is_null(), "dlopen {}", so.display());
        let sym = |name: &str| -> *mut c_void {
            let c = CString::new(name).unwrap();
            // SAFETY: a valid handle and a NUL-terminated name.
            let p = unsafe { libc::dlsym(handle, c.as_ptr()) };
            assert!(!p.is_null(), "{name} not exported by gio_host.cpp");
            p
        };
        // SAFETY (the transmutes): each symbol is the extern "C" function of
        // gio_host.cpp with exactly this signature.
        let layout: Layout = unsafe { std::mem::transmute(sym("kvtier_host_layout")) };
        let mut sizes = [0u64; 5];
        // SAFETY: writes 5 u64s.
        unsafe { layout(sizes.as_mut_ptr()) };
        assert_eq!(
            sizes,
            [
                size_of::<GioQueue>() as u64,
                size_of::<GpuRing>() as u64,
                size_of::<GioDev>() as u64,
                size_of::<GioEngine>() as u64,
                size_of::<Iocb>() as u64
            ],
            "the host library and the Rust ABI disagree on struct sizes"
        );
        Some(HostLib {
            run_grid: unsafe {
                std::mem::transmute::<*mut c_void, RunGrid>(sym("kvtier_host_run_grid"))
            },
            build_command: unsafe {
                std::mem::transmute::<*mut c_void, BuildCommand>(sym("kvtier_host_build_command"))
            },
            wait_counter: unsafe {
                std::mem::transmute::<*mut c_void, WaitCounter>(sym("kvtier_host_wait_counter"))
            },
        })
    })
    .as_ref()
}

#[macro_export]
macro_rules! lib_or_skip {
    () => {
        match $crate::common::gio_host::host_lib() {
            Some(lib) => lib,
            None => {
                eprintln!("skipped: no host C++ compiler");
                return;
            }
        }
    };
}
