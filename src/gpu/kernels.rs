//! The CUDA kernel images embedded in the crate.
//!
//! build.rs compiles every `kernels/*.cu` with nvcc, when it finds one, into
//! `$KVTIER_KERNELS_DIR/<stem>.cubin` (sm_90, loaded as-is on Hopper) and
//! `<stem>.ptx` (compute_90, JIT-compiled by the driver on newer GPUs), and
//! sets `cfg(kvtier_kernels)`. Here they become `&'static` data, so a
//! binary carries its kernels and needs no toolkit at run time. A crate
//! built without nvcc still builds and runs everything else; asking it for
//! a kernel is an error that says how to get them.

#[cfg(not(kvtier_kernels))]
use crate::error::Error;
use crate::error::Result;

/// One compiled kernel file: load `cubin` on sm_90 (Hopper), else `ptx`.
#[derive(Clone, Copy, Debug)]
pub struct KernelImage {
    /// The `.cu` file's stem (`gio_kernel`).
    pub name: &'static str,
    /// ELF cubin for sm_90.
    pub cubin: &'static [u8],
    /// PTX for compute_90 (NUL-free text, as `cuModuleLoadData` takes it
    /// after appending a NUL).
    pub ptx: &'static str,
}

/// The file names build.rs writes, per kernel source.
#[cfg(kvtier_kernels)]
macro_rules! image {
    ($stem:literal) => {
        KernelImage {
            name: $stem,
            cubin: include_bytes!(concat!(env!("KVTIER_KERNELS_DIR"), "/", $stem, ".cubin")),
            ptx: include_str!(concat!(env!("KVTIER_KERNELS_DIR"), "/", $stem, ".ptx")),
        }
    };
}

/// Whether this build carries kernel images.
pub const fn built_with_kernels() -> bool {
    cfg!(kvtier_kernels)
}

#[cfg(not(kvtier_kernels))]
fn without_kernels(what: &str) -> Error {
    Error::io(
        format!("GPU kernel {what}"),
        std::io::Error::new(
            std::io::ErrorKind::Unsupported,
            "kvtier was built without CUDA kernels (build.rs found no nvcc, or \
             KVTIER_SKIP_KERNELS=1 was set); run scripts/install-nvcc.sh (or set NVCC / \
             CUDA_HOME to a CUDA 13 toolkit), then rebuild (`touch build.rs && cargo build`)",
        ),
    )
}

/// The I/O kernel `kvtier_gio_kernel` and the wait kernel
/// `kvtier_wait_counter` (`kernels/gio_kernel.cu`).
pub fn gio_kernel() -> Result<KernelImage> {
    #[cfg(kvtier_kernels)]
    {
        Ok(image!("gio_kernel"))
    }
    #[cfg(not(kvtier_kernels))]
    {
        Err(without_kernels("gio_kernel"))
    }
}

/// The GPU-resident null NVMe controller `kvtier_null_nvme` (a test double
/// that completes every command at once, for measuring the I/O kernel's
/// command rate) and the isolation workloads `kvtier_spin_compute` and
/// `kvtier_stream_copy` (`kernels/null_nvme.cu`).
pub fn null_nvme() -> Result<KernelImage> {
    #[cfg(kvtier_kernels)]
    {
        Ok(image!("null_nvme"))
    }
    #[cfg(not(kvtier_kernels))]
    {
        Err(without_kernels("null_nvme"))
    }
}

/// The staging copies `kvtier_scatter` and `kvtier_gather_crc32c`
/// (`kernels/staging.cu`).
pub fn staging() -> Result<KernelImage> {
    #[cfg(kvtier_kernels)]
    {
        Ok(image!("staging"))
    }
    #[cfg(not(kvtier_kernels))]
    {
        Err(without_kernels("staging"))
    }
}

/// The IOCB validation kernels (`kernels/abi_check.cu`).
pub fn abi_check() -> Result<KernelImage> {
    #[cfg(kvtier_kernels)]
    {
        Ok(image!("abi_check"))
    }
    #[cfg(not(kvtier_kernels))]
    {
        Err(without_kernels("abi_check"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn images_match_the_build() {
        match gio_kernel() {
            Ok(k) => {
                assert!(built_with_kernels());
                assert!(k.cubin.starts_with(b"\x7fELF"), "cubin is ELF");
                assert!(k.ptx.contains(".entry kvtier_gio_kernel("));
                assert!(k.ptx.contains(".entry kvtier_wait_counter("));
                assert!(abi_check().unwrap().ptx.contains(".target sm_90"));
                assert!(null_nvme()
                    .unwrap()
                    .ptx
                    .contains(".entry kvtier_null_nvme("));
            }
            Err(e) => {
                assert!(!built_with_kernels());
                let msg = e.to_string();
                assert!(msg.contains("without CUDA kernels"), "{msg}");
                assert!(msg.contains("scripts/install-nvcc.sh"), "{msg}");
            }
        }
    }
}
