//! Build script: compiles `kernels/*.cu` with nvcc when one is found.
//!
//! Each kernel file becomes an `sm_90` cubin (loaded as-is on Hopper) and a
//! `compute_90` PTX (JIT-compiled by the driver on newer GPUs) under
//! `$OUT_DIR/kernels/`. The crate learns the outcome through:
//! - `KVTIER_KERNELS_DIR` (compile-time env): that directory, or empty when it
//!   was built without kernels;
//! - `cfg(kvtier_kernels)`: set only when the kernels were built.
//!
//! Without nvcc the build succeeds and the GPU engine reports "built without
//! kernels": most machines that build kvtier (developers, CI) have no GPU. But
//! when nvcc *is* found, a kernel that fails to compile fails the build with
//! nvcc's output, so a broken kernel never ships silently. `KVTIER_SKIP_KERNELS=1`
//! skips kernels altogether (e.g. with an nvcc too old for the code).
//!
//! nvcc is looked for, in order, at: `$NVCC`; `$CUDA_HOME/bin/nvcc`;
//! `$CUDA_PATH/bin/nvcc`; `nvcc` on `PATH`; the PyPI wheel `nvidia-cuda-nvcc`
//! (installed by `scripts/install-nvcc.sh`). nvcc itself also honours
//! `NVCC_CCBIN` (host compiler) and `NVCC_PREPEND_FLAGS`/`NVCC_APPEND_FLAGS`.
//!
//! `tests/abi_header.rs` includes this file as a module to reuse the nvcc
//! search, so everything outside `main` is free of `cargo:` output.

use std::env;
use std::ffi::OsString;
use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;

/// The real architecture the cubins are built for (Hopper: green contexts).
pub const CUBIN_ARCH: &str = "sm_90";
/// The virtual architecture of the PTX, which newer GPUs JIT.
pub const PTX_ARCH: &str = "compute_90";

/// Environment variables whose change must rerun this script.
const WATCHED_ENV: &[&str] = &[
    "NVCC",
    "CUDA_HOME",
    "CUDA_PATH",
    "PATH",
    "PYTHON",
    "KVTIER_SKIP_KERNELS",
    "KVTIER_GPU_TESTS",
    "NVCC_CCBIN",
    "NVCC_PREPEND_FLAGS",
    "NVCC_APPEND_FLAGS",
    "CXX",
    "AR",
];

/// An nvcc found on this machine, with the include directories it needs.
#[derive(Debug, Clone)]
pub struct Nvcc {
    pub path: PathBuf,
    /// Where it was found, for messages ("$NVCC", "PATH", "PyPI wheel", ...).
    pub source: &'static str,
    /// Extra `-I` directories. Empty for a regular toolkit; for the PyPI
    /// wheels, the runtime and crt headers live in sibling packages that
    /// nvcc's profile does not point at (CUDA 12 layout: nvidia/cuda_nvcc,
    /// nvidia/cuda_runtime, nvidia/cuda_crt; CUDA 13 merges them in nvidia/cu13).
    pub include_dirs: Vec<PathBuf>,
}

/// True when `KVTIER_SKIP_KERNELS` asks to build without kernels.
pub fn skip_requested() -> bool {
    env::var_os("KVTIER_SKIP_KERNELS").is_some_and(|v| !v.is_empty() && v != "0")
}

fn is_executable(path: &Path) -> bool {
    use std::os::unix::fs::PermissionsExt;
    fs::metadata(path).is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
}

fn nonempty_env(name: &str) -> Option<OsString> {
    env::var_os(name).filter(|v| !v.is_empty())
}

/// Finds nvcc; `None` when there is none. Never prints `cargo:` lines.
pub fn find_nvcc() -> Option<Nvcc> {
    let toolkit = |path: PathBuf, source| {
        is_executable(&path).then(|| Nvcc {
            path,
            source,
            include_dirs: Vec::new(),
        })
    };
    if let Some(nvcc) = nonempty_env("NVCC") {
        // An explicit choice is final: falling through to another nvcc would
        // hide the mistake (main warns when it is not executable).
        return toolkit(PathBuf::from(nvcc), "$NVCC").map(with_wheel_includes);
    }
    for var in ["CUDA_HOME", "CUDA_PATH"] {
        if let Some(home) = nonempty_env(var) {
            let source = if var == "CUDA_HOME" {
                "$CUDA_HOME"
            } else {
                "$CUDA_PATH"
            };
            if let Some(found) = toolkit(Path::new(&home).join("bin").join("nvcc"), source) {
                return Some(with_wheel_includes(found));
            }
        }
    }
    if let Some(path) = nonempty_env("PATH") {
        for dir in env::split_paths(&path) {
            if let Some(found) = toolkit(dir.join("nvcc"), "PATH") {
                return Some(with_wheel_includes(found));
            }
        }
    }
    nvcc_from_wheel().map(with_wheel_includes)
}

/// Asks Python where the `nvidia-cuda-nvcc` wheel put nvcc. The distribution's
/// file list is used rather than importing a module because the layout moved
/// between CUDA 12 (`nvidia/cuda_nvcc/bin/nvcc`, module `nvidia.cuda_nvcc`)
/// and CUDA 13 (`nvidia/cu13/bin/nvcc`, no such module).
fn nvcc_from_wheel() -> Option<Nvcc> {
    const SCRIPT: &str = r#"
import os, sys
from importlib import metadata
for dist in ("nvidia-cuda-nvcc", "nvidia-cuda-nvcc-cu12"):
    try:
        files = metadata.files(dist) or []
    except metadata.PackageNotFoundError:
        continue
    for f in files:
        if str(f).replace("\\", "/").endswith("bin/nvcc"):
            print(f.locate())
            sys.exit(0)
try:
    import nvidia.cuda_nvcc as m
    print(os.path.join(os.path.dirname(m.__file__), "bin", "nvcc"))
except Exception:
    pass
"#;
    let python = nonempty_env("PYTHON").unwrap_or_else(|| "python3".into());
    let out = Command::new(python).args(["-c", SCRIPT]).output().ok()?;
    if !out.status.success() {
        return None;
    }
    let path = PathBuf::from(String::from_utf8(out.stdout).ok()?.trim());
    is_executable(&path).then(|| Nvcc {
        path,
        source: "PyPI wheel nvidia-cuda-nvcc",
        include_dirs: Vec::new(),
    })
}

/// Adds the header directories of the PyPI wheels when `nvcc` is one
/// (`.../nvidia/<pkg>/bin/nvcc`); a regular toolkit needs none.
fn with_wheel_includes(mut nvcc: Nvcc) -> Nvcc {
    let top = nvcc.path.parent().and_then(Path::parent);
    let nvidia = top.and_then(Path::parent);
    if let (Some(top), Some(nvidia)) = (top, nvidia) {
        if nvidia.file_name().is_some_and(|n| n == "nvidia") {
            let candidates = [
                top.join("include"),
                nvidia.join("cuda_runtime").join("include"),
                nvidia.join("cuda_crt").join("include"),
            ];
            nvcc.include_dirs = candidates.into_iter().filter(|d| d.is_dir()).collect();
        }
    }
    nvcc
}

/// The `.cu` files of `kernels_dir`, sorted so builds are reproducible.
pub fn kernel_sources(kernels_dir: &Path) -> Vec<PathBuf> {
    let mut sources: Vec<PathBuf> = fs::read_dir(kernels_dir)
        .map(|entries| {
            entries
                .filter_map(|e| e.ok().map(|e| e.path()))
                .filter(|p| p.extension().is_some_and(|e| e == "cu"))
                .collect()
        })
        .unwrap_or_default();
    sources.sort();
    sources
}

/// The nvcc arguments shared by the cubin and the PTX compile.
pub fn common_args(nvcc: &Nvcc, kernels_dir: &Path) -> Vec<OsString> {
    let mut args: Vec<OsString> = vec!["-std=c++17".into(), "-lineinfo".into()];
    let mut include = OsString::from("-I");
    include.push(kernels_dir);
    args.push(include);
    for dir in &nvcc.include_dirs {
        let mut include = OsString::from("-I");
        include.push(dir);
        args.push(include);
    }
    args
}

/// Runs one nvcc compile; `Err` carries nvcc's output for the build failure.
fn run_nvcc(
    nvcc: &Nvcc,
    common: &[OsString],
    mode: &str,
    arch: &str,
    src: &Path,
    out: &Path,
) -> Result<(), String> {
    let mut cmd = Command::new(&nvcc.path);
    cmd.arg(mode)
        .arg(format!("-arch={arch}"))
        .args(common)
        .arg("-o")
        .arg(out)
        .arg(src);
    let shown = format!("{cmd:?}");
    let output = cmd
        .output()
        .map_err(|e| format!("could not run {}: {e}", nvcc.path.display()))?;
    let stderr = String::from_utf8_lossy(&output.stderr);
    if !output.status.success() {
        return Err(format!(
            "{shown}\nexited with {}\n{}{}",
            output.status,
            String::from_utf8_lossy(&output.stdout),
            stderr
        ));
    }
    if !stderr.trim().is_empty() {
        for line in stderr.lines() {
            println!("cargo:warning=nvcc: {line}");
        }
    }
    match fs::metadata(out) {
        Ok(m) if m.len() > 0 => Ok(()),
        _ => Err(format!("{shown}\nsucceeded but wrote no {}", out.display())),
    }
}

/// Compiles the I/O kernel's logic for the host (`kernels/host/gio_host.cpp`,
/// libc only) into `out_dir/libkvtier_gio_host.a` with the host C++
/// compiler (`$CXX`, else c++, g++, clang++). `Ok(None)`: no compiler.
pub fn compile_host_kernel(kernels_dir: &Path, out_dir: &Path) -> Result<Option<String>, String> {
    let candidates = nonempty_env("CXX")
        .map(|c| vec![c.to_string_lossy().into_owned()])
        .unwrap_or_else(|| vec!["c++".into(), "g++".into(), "clang++".into()]);
    let Some(cxx) = candidates.into_iter().find(|c| {
        Command::new(c)
            .arg("--version")
            .output()
            .is_ok_and(|o| o.status.success())
    }) else {
        return Ok(None);
    };
    fs::create_dir_all(out_dir).map_err(|e| format!("create {}: {e}", out_dir.display()))?;
    let obj = out_dir.join("gio_host.o");
    let out = Command::new(&cxx)
        .args(["-std=c++17", "-O2", "-fPIC", "-fno-exceptions", "-fno-rtti"])
        .args(["-Wall", "-Wextra", "-Werror", "-c"])
        .arg("-I")
        .arg(kernels_dir)
        .arg(kernels_dir.join("host").join("gio_host.cpp"))
        .arg("-o")
        .arg(&obj)
        .output()
        .map_err(|e| format!("running {cxx}: {e}"))?;
    if !out.status.success() {
        return Err(format!(
            "{cxx} failed on kernels/host/gio_host.cpp:\n{}",
            String::from_utf8_lossy(&out.stderr)
        ));
    }
    let ar = nonempty_env("AR")
        .map(|a| a.to_string_lossy().into_owned())
        .unwrap_or_else(|| "ar".into());
    let lib = out_dir.join("libkvtier_gio_host.a");
    let _ = fs::remove_file(&lib);
    let out = Command::new(&ar)
        .arg("crs")
        .arg(&lib)
        .arg(&obj)
        .output()
        .map_err(|e| format!("running {ar}: {e}"))?;
    if !out.status.success() {
        return Err(format!(
            "{ar} failed on {}:\n{}",
            obj.display(),
            String::from_utf8_lossy(&out.stderr)
        ));
    }
    Ok(Some(cxx))
}

/// Whether the tests that need a GPU run by default (`cfg(kvtier_gpu_tests)`):
/// on a machine with an NVIDIA driver node, or with `KVTIER_GPU_TESTS=1`.
/// Elsewhere they are ignored with a reason, so the test runner reports them
/// as not run instead of as passed; `--include-ignored` runs them anyway
/// (binaries built here and carried to a GPU machine).
fn gpu_tests_cfg() {
    println!("cargo:rustc-check-cfg=cfg(kvtier_gpu_tests)");
    let node = std::path::Path::new("/dev/nvidiactl");
    if node.exists() {
        // Watched only where it exists: a missing path would rerun this script on every build.
        println!("cargo:rerun-if-changed={}", node.display());
    }
    if node.exists() || env::var("KVTIER_GPU_TESTS").is_ok_and(|v| v == "1") {
        println!("cargo:rustc-cfg=kvtier_gpu_tests");
    }
}

fn without_kernels() {
    println!("cargo:rustc-env=KVTIER_KERNELS_DIR=");
}

fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    println!("cargo:rerun-if-changed=kernels");
    for var in WATCHED_ENV {
        println!("cargo:rerun-if-env-changed={var}");
    }
    println!("cargo:rustc-check-cfg=cfg(kvtier_kernels)");
    println!("cargo:rustc-check-cfg=cfg(kvtier_host_gio)");
    gpu_tests_cfg();

    // The I/O kernel's logic for the CPU: the GPU engine's host executor.
    let manifest = PathBuf::from(env::var_os("CARGO_MANIFEST_DIR").expect("cargo sets it"));
    let host_dir = PathBuf::from(env::var_os("OUT_DIR").expect("cargo sets it")).join("host");
    match compile_host_kernel(&manifest.join("kernels"), &host_dir) {
        Ok(Some(_)) => {
            println!("cargo:rustc-link-search=native={}", host_dir.display());
            println!("cargo:rustc-link-lib=static=kvtier_gio_host");
            println!("cargo:rustc-cfg=kvtier_host_gio");
        }
        Ok(None) => println!(
            "cargo:warning=no C++ compiler ($CXX, c++, g++, clang++): the GPU engine's host executor is not built (apt-get install g++)"
        ),
        Err(message) => {
            eprintln!("error: {message}");
            std::process::exit(1);
        }
    }

    if skip_requested() {
        without_kernels();
        return;
    }
    let Some(nvcc) = find_nvcc() else {
        if let Some(explicit) = nonempty_env("NVCC") {
            println!(
                "cargo:warning=NVCC={} is not an executable; building without kernels",
                Path::new(&explicit).display()
            );
        }
        without_kernels();
        return;
    };
    // A newer nvcc at the same path (wheel upgrade) must rebuild the kernels.
    println!("cargo:rerun-if-changed={}", nvcc.path.display());

    let manifest = PathBuf::from(env::var_os("CARGO_MANIFEST_DIR").expect("cargo sets it"));
    let kernels_dir = manifest.join("kernels");
    let out_dir = PathBuf::from(env::var_os("OUT_DIR").expect("cargo sets it")).join("kernels");
    // Start empty so a removed .cu leaves no stale cubin behind.
    if out_dir.exists() {
        fs::remove_dir_all(&out_dir).expect("remove stale $OUT_DIR/kernels");
    }
    fs::create_dir_all(&out_dir).expect("create $OUT_DIR/kernels");

    let common = common_args(&nvcc, &kernels_dir);
    for src in kernel_sources(&kernels_dir) {
        let stem = src.file_stem().expect("a .cu file has a stem");
        let cubin = out_dir.join(stem).with_extension("cubin");
        let ptx = out_dir.join(stem).with_extension("ptx");
        let result = run_nvcc(&nvcc, &common, "-cubin", CUBIN_ARCH, &src, &cubin)
            .and_then(|()| run_nvcc(&nvcc, &common, "-ptx", PTX_ARCH, &src, &ptx));
        if let Err(message) = result {
            eprintln!(
                "error: nvcc ({}, found via {}) failed on {}; fix the kernel, or set \
                 KVTIER_SKIP_KERNELS=1 to build without kernels:\n{message}",
                nvcc.path.display(),
                nvcc.source,
                src.display()
            );
            std::process::exit(1);
        }
    }

    println!("cargo:rustc-env=KVTIER_KERNELS_DIR={}", out_dir.display());
    println!("cargo:rustc-cfg=kvtier_kernels");
}
