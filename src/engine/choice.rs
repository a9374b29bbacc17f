//! Which engine this machine can run: the facts the choice rests on, probed once
//! ([`Facts::probe`]), and the one decision over them ([`decide`]). `TierBuilder`'s
//! automatic engine and `kvtier doctor`'s verdict are this decision; the doctor
//! adds the detail it shows around it.
//!
//! `gpu` (CUDA I/O kernels on a green-context SM partition) needs a GPU, a driver
//! with green contexts and an NVMe controller the kernel can drive; `nvme`
//! (userspace NVMe through VFIO or uio) needs a controller on vfio-pci behind an
//! IOMMU (or in no-IOMMU mode) or on uio; `uring` (io_uring with `O_DIRECT` on
//! the pool directory) works everywhere those two do.

use crate::error::{Error, Result};
use crate::gpu::probe::{probe_detailed, DriverInfo, ProbeFailure};
use crate::gpu::LoadStage;
use crate::host::dio::{dio_align, AlignedBuf, DIRECT_IO_ALIGN};
use crate::host::pci::{devices as pci_devices, PciDev};
use crate::host::sysfs::{dir_names, read_trim};
use std::fmt::Write as _;
use std::fs;
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

/// Whether this build contains the GPU engine (`src/engine/gpu.rs`).
/// Its prerequisites are still probed and reported; the decision never picks
/// an engine the binary does not have.
const GPU_ENGINE_BUILT: bool = true;
/// Whether this build contains the userspace NVMe engine (VFIO/uio).
const NVME_ENGINE_BUILT: bool = true;

/// PCI vendor id of NVIDIA.
pub(crate) const NVIDIA_VENDOR: &str = "0x10de";
/// PCI class code of an NVMe controller (mass storage, non-volatile memory, NVMe).
pub const NVME_CLASS: &str = "0x010802";

/// What the engine choice rests on, as probed on this machine.
#[non_exhaustive]
pub struct Facts {
    /// NVIDIA display/3D PCI functions; `None`: /sys/bus/pci/devices unreadable.
    pub gpus_pci: Option<Vec<PciDev>>,
    /// The CUDA driver through the GPU engine's own loader.
    pub driver: std::result::Result<DriverInfo, ProbeFailure>,
    /// Entries of /sys/class/iommu; `None`: unreadable.
    pub iommu_units: Option<Vec<String>>,
    /// Entries of /sys/kernel/iommu_groups; `None`: unreadable.
    pub iommu_groups: Option<Vec<String>>,
    /// vfio's `enable_unsafe_noiommu_mode` parameter as read (`Y`/`N`).
    pub vfio_noiommu: Option<String>,
    /// NVMe PCI functions; `None`: /sys/bus/pci/devices unreadable.
    pub nvme_pci: Option<Vec<PciDev>>,
    /// Creating an io_uring with 8 entries: `Err` says why it failed.
    pub uring: std::result::Result<(), String>,
    /// The pool directory, canonical.
    pub pool_dir: PathBuf,
    /// Whether the pool directory existed before the probe created it.
    pub pool_dir_existed: bool,
    /// `O_DIRECT` tried: 4 KiB read from the pool's device where it is
    /// there, else written and read back through a temporary file.
    pub direct_io: std::result::Result<(), String>,
    /// How `direct_io` was tried, for people.
    pub direct_io_how: String,
    /// `direct_io` failed before O_DIRECT itself could be tried: no probe
    /// file could be made or written in the pool directory (no space, a
    /// read-only file system, permissions). The pool's own create or open
    /// then says what is wrong there, in its words.
    pub direct_io_untried: bool,
    /// statx's (memory, offset) direct-I/O alignment of that file, when reported.
    pub dio_align: std::result::Result<Option<(u32, u32)>, String>,
}

impl Facts {
    /// Probe the machine, with `dir` as the pool directory (created if
    /// missing). `O_DIRECT`: where `device` (the pool's first file or block
    /// device) is there, 4 KiB are read from it and nothing is written, so a
    /// pool that fills its file system, or one on a file system mounted
    /// read-only, is probed as it will be served (a temporary file could not
    /// be made there, and "O_DIRECT fails" would be wrong); else a temporary
    /// file in `dir` is written, read back and removed.
    pub fn probe(dir: &Path, device: Option<&Path>) -> Result<Facts> {
        let existed = dir.is_dir();
        if let Ok(m) = fs::metadata(dir) {
            if !m.is_dir() {
                return Err(Error::invalid(format!(
                    "pool directory {}: it is {}, not a directory; name the directory the pool files go in",
                    dir.display(),
                    crate::host::file_kind(&m.file_type())
                )));
            }
        }
        fs::create_dir_all(dir).map_err(|e| Error::io(format!("creating {}", dir.display()), e))?;
        let pool_dir = fs::canonicalize(dir).unwrap_or_else(|_| dir.to_path_buf());
        let read = device.and_then(|d| direct_read_check(d).map(|r| (d, r)));
        let read_how = |d: &Path| format!("4 KiB read from the pool's {}", d.display());
        let (direct_io, dio_align, direct_io_how, direct_io_untried) = match read {
            Some((d, r)) => (r, statx_dio_align(d), read_how(d), false),
            None => {
                // Create, write, read back, statx, remove. Created new and removed by
                // the guard: a file already at that name is reported, never written or removed.
                let tmp = pool_dir.join(format!(".kvtier-doctor-{}.tmp", std::process::id()));
                let (direct, align, untried) =
                    match crate::scratch::ScratchFile::create_new(&tmp, "kvtier doctor") {
                        Ok(scratch) => {
                            let (direct, untried) = match direct_io_check(&tmp) {
                                Ok(()) => (Ok(()), false),
                                Err((e, refused)) => (Err(e), !refused),
                            };
                            let r = (direct, statx_dio_align(&tmp), untried);
                            drop(scratch);
                            r
                        }
                        Err(e) => (Err(e.to_string()), Err(e.to_string()), true),
                    };
                (
                    direct,
                    align,
                    "4 KiB written and read back through a temporary file, removed afterwards"
                        .to_string(),
                    untried,
                )
            }
        };
        Ok(Facts {
            gpus_pci: pci_devices(Some(NVIDIA_VENDOR), "0x03"),
            driver: probe_detailed(),
            iommu_units: dir_names("/sys/class/iommu"),
            iommu_groups: dir_names("/sys/kernel/iommu_groups"),
            vfio_noiommu: read_trim("/sys/module/vfio/parameters/enable_unsafe_noiommu_mode"),
            nvme_pci: pci_devices(None, NVME_CLASS),
            uring: io_uring::IoUring::new(8)
                .map(drop)
                .map_err(|e| format!("creating an io_uring failed: {e}")),
            pool_dir,
            pool_dir_existed: existed,
            direct_io,
            direct_io_how,
            direct_io_untried,
            dio_align,
        })
    }

    /// An IOMMU translates DMA here (units or groups exist).
    pub fn iommu_active(&self) -> bool {
        self.iommu_units.as_ref().is_some_and(|u| !u.is_empty())
            || self.iommu_groups.as_ref().is_some_and(|g| !g.is_empty())
    }

    /// vfio's unsafe no-IOMMU mode is on.
    pub fn vfio_noiommu(&self) -> bool {
        self.vfio_noiommu.as_deref() == Some("Y")
    }

    /// PCI addresses of NVMe controllers bound to `driver`.
    pub fn nvme_bound_to(&self, driver: &str) -> Vec<String> {
        self.nvme_pci
            .iter()
            .flatten()
            .filter(|d| d.driver.as_deref() == Some(driver))
            .map(|d| d.addr.clone())
            .collect()
    }

    /// Why the GPU side (GPU, driver, green contexts) is not ready; empty when it is.
    fn gpu_why_not(&self) -> Vec<String> {
        let pci_gpus = self.gpus_pci.as_ref().is_some_and(|v| !v.is_empty());
        match &self.driver {
            Err(f) if f.stage == Some(LoadStage::NotFound) => {
                let mut v = vec!["no CUDA driver library (libcuda) on this machine".to_string()];
                if !pci_gpus {
                    v.push("no NVIDIA GPU on the PCI bus".into());
                }
                v
            }
            Err(f) => vec![f.reason.clone()],
            Ok(d) if d.devices.is_empty() => vec!["the CUDA driver sees no GPU".into()],
            Ok(d) if !d.devices.iter().any(|g| g.green_contexts) => {
                vec!["no GPU supports green contexts (driver 12.4+ and Hopper or newer)".into()]
            }
            Ok(_) => Vec::new(),
        }
    }
}

/// An engine kvtier can run, or none.
#[non_exhaustive]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Engine {
    /// CUDA I/O kernels on a green-context SM partition.
    Gpu,
    /// Userspace NVMe through VFIO or uio.
    Nvme,
    /// io_uring with `O_DIRECT` on the pool directory.
    Uring,
    /// Not even io_uring with `O_DIRECT` works.
    None,
}

impl Engine {
    /// `gpu`, `nvme`, `uring` or `none`.
    pub fn as_str(self) -> &'static str {
        match self {
            Engine::Gpu => "gpu",
            Engine::Nvme => "nvme",
            Engine::Uring => "uring",
            Engine::None => "none",
        }
    }
}

/// The engine kvtier would pick, why, and why each engine is out.
#[non_exhaustive]
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Decision {
    /// The engine picked.
    pub engine: Engine,
    /// Why that engine, and why each better one is out.
    pub reason: String,
    /// Why the gpu engine is out; empty when usable.
    pub gpu_out: Vec<String>,
    /// Why the nvme engine is out; empty when usable.
    pub nvme_out: Vec<String>,
    /// Why the uring engine is out; empty when usable.
    pub uring_out: Vec<String>,
}

/// The one engine decision over `f`: gpu, else nvme, else uring, else none.
pub fn decide(f: &Facts) -> Decision {
    let vfio = f.nvme_bound_to("vfio-pci");
    let uio = f.nvme_bound_to("uio_pci_generic");
    let iommu = f.iommu_active();
    // gpu: GPU + driver + green contexts + a path for the controller into GPU memory.
    let mut gpu_out = Vec::new();
    if !GPU_ENGINE_BUILT {
        gpu_out.push("the GPU engine is not built in this version".to_string());
    }
    gpu_out.extend(f.gpu_why_not());
    // The GPU engine drives a controller whose queues and data live in
    // host-pinned memory (src/engine/gpu.rs): it needs a controller on
    // vfio-pci behind an IOMMU, or on uio (physical addresses). HBM as the
    // DMA target (dma-buf/iommufd, peermem) is not in this build, so
    // nvidia_peermem alone does not make the engine usable.
    let reach = (iommu && !vfio.is_empty()) || !uio.is_empty();
    if !reach {
        gpu_out.push(
            "no NVMe controller for the GPU kernel to drive (none on vfio-pci with an IOMMU, none on uio_pci_generic); bind one with `kvtier nvme bind`"
                .into(),
        );
    }
    // nvme: a controller bound to vfio-pci (with an IOMMU or no-IOMMU mode) or uio.
    let mut nvme_out = Vec::new();
    if !NVME_ENGINE_BUILT {
        nvme_out.push("the userspace NVMe engine is not built in this version".to_string());
    }
    let vfio_usable = !vfio.is_empty() && (iommu || f.vfio_noiommu());
    if !vfio_usable && uio.is_empty() {
        nvme_out.push(if !vfio.is_empty() {
            format!(
                "NVMe controller(s) {} are on vfio-pci but there is no IOMMU and no-IOMMU mode is off",
                vfio.join(", ")
            )
        } else {
            "no NVMe controller bound to vfio-pci or uio_pci_generic".into()
        });
    }
    // uring: a ring and O_DIRECT on the pool directory.
    let mut uring_out = Vec::new();
    if let Err(w) = &f.uring {
        uring_out.push(w.clone());
    }
    if let Err(e) = &f.direct_io {
        uring_out.push(format!("O_DIRECT on {} fails: {e}", f.pool_dir.display()));
    }

    let (engine, mut reason) = if gpu_out.is_empty() {
        (
            Engine::Gpu,
            "GPU, driver, green contexts and a path into GPU memory are all here".to_string(),
        )
    } else if nvme_out.is_empty() {
        (
            Engine::Nvme,
            "an NVMe controller is bound to vfio-pci or uio".to_string(),
        )
    } else if uring_out.is_empty() {
        (Engine::Uring, uring_usable_note(&f.pool_dir))
    } else {
        (
            Engine::None,
            format!("no engine can run: {}", uring_out.join("; ")),
        )
    };
    if engine != Engine::Gpu {
        let _ = write!(reason, "; gpu is out: {}", gpu_out.join(", "));
    }
    if engine != Engine::Gpu && engine != Engine::Nvme {
        let _ = write!(reason, "; nvme is out: {}", nvme_out.join(", "));
    }
    Decision {
        engine,
        reason,
        gpu_out,
        nvme_out,
        uring_out,
    }
}

/// Why uring is usable on the pool directory `dir`.
pub fn uring_usable_note(dir: &Path) -> String {
    format!("io_uring works and O_DIRECT works on {}", dir.display())
}

/// (memory alignment, offset alignment) for direct I/O from statx, when the
/// kernel and filesystem report them.
fn statx_dio_align(path: &Path) -> std::result::Result<Option<(u32, u32)>, String> {
    let f = fs::File::open(path).map_err(|e| format!("open: {e}"))?;
    let a = dio_align(&f).map_err(|e| format!("statx: {e}"))?;
    Ok(a.filter(|a| a.memory != 0).map(|a| (a.memory, a.offset)))
}

/// O_DIRECT through the probe file `tmp`. `Err((why, refused))`: `refused`
/// where the file system turned direct I/O down (EINVAL, or bytes that did
/// not come back); else the write or read failed for want of space,
/// permission or a writable file system, which says nothing of O_DIRECT.
fn direct_io_check(tmp: &Path) -> std::result::Result<(), (String, bool)> {
    let refused = |e: &std::io::Error| e.raw_os_error() == Some(libc::EINVAL);
    let f = fs::OpenOptions::new()
        .read(true)
        .write(true)
        .custom_flags(libc::O_DIRECT | libc::O_NOFOLLOW)
        .open(tmp)
        .map_err(|e| (format!("open(O_DIRECT): {e}"), refused(&e)))?;
    let mut out = AlignedBuf::zeroed(DIRECT_IO_ALIGN);
    for (i, b) in out.as_mut_slice().iter_mut().enumerate() {
        *b = (i % 251) as u8;
    }
    f.write_all_at(out.as_slice(), 0)
        .map_err(|e| (format!("direct write: {e}"), refused(&e)))?;
    let mut back = AlignedBuf::zeroed(DIRECT_IO_ALIGN);
    f.read_exact_at(back.as_mut_slice(), 0)
        .map_err(|e| (format!("direct read: {e}"), refused(&e)))?;
    if back.as_slice() != out.as_slice() {
        return Err(("read back differs from what was written".into(), true));
    }
    Ok(())
}

/// `O_DIRECT` on an existing pool file or block device, by reading its
/// first 4 KiB (a short read of a short file is fine: the open and a read
/// went through). `None` where `device` is not a regular file or block
/// device that opens: then a temporary file decides (a pool device that
/// cannot be opened gets its own error from the pool, naming the fix).
/// `Some(Err)` only where the file system refuses direct I/O (EINVAL).
fn direct_read_check(device: &Path) -> Option<std::result::Result<(), String>> {
    use std::os::unix::fs::FileTypeExt;
    let t = fs::metadata(device).ok()?.file_type();
    if !t.is_file() && !t.is_block_device() {
        return None;
    }
    let refused = |e: &std::io::Error| e.raw_os_error() == Some(libc::EINVAL);
    let f = match fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_DIRECT | libc::O_NONBLOCK | libc::O_CLOEXEC)
        .open(device)
    {
        Ok(f) => f,
        Err(e) if refused(&e) => return Some(Err(format!("open(O_DIRECT): {e}"))),
        Err(_) => return None,
    };
    let mut buf = AlignedBuf::zeroed(DIRECT_IO_ALIGN);
    match f.read_at(buf.as_mut_slice(), 0) {
        Ok(_) => Some(Ok(())),
        Err(e) if refused(&e) => Some(Err(format!("direct read: {e}"))),
        Err(_) => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn facts(dir: &Path) -> Facts {
        Facts {
            gpus_pci: Some(Vec::new()),
            driver: Err(ProbeFailure {
                stage: Some(LoadStage::NotFound),
                version: None,
                reason: "not found".into(),
            }),
            iommu_units: Some(Vec::new()),
            iommu_groups: Some(Vec::new()),
            vfio_noiommu: None,
            nvme_pci: Some(Vec::new()),
            uring: Ok(()),
            pool_dir: dir.to_path_buf(),
            pool_dir_existed: true,
            direct_io: Ok(()),
            direct_io_how: String::new(),
            direct_io_untried: false,
            dio_align: Ok(None),
        }
    }

    fn ctrl(addr: &str, driver: &str) -> PciDev {
        PciDev {
            addr: addr.into(),
            device_id: "0x0010".into(),
            driver: Some(driver.into()),
            sysfs: PathBuf::from("/nonexistent"),
        }
    }

    #[test]
    fn uring_when_nothing_else() {
        let d = decide(&facts(Path::new("/p")));
        assert_eq!(d.engine, Engine::Uring);
        assert!(
            d.reason.starts_with("io_uring works and O_DIRECT works on /p; gpu is out: no CUDA driver library (libcuda) on this machine, no NVIDIA GPU on the PCI bus"),
            "{}",
            d.reason
        );
        assert!(
            d.reason.contains("; nvme is out: no NVMe controller bound"),
            "{}",
            d.reason
        );
        assert!(d.uring_out.is_empty());
    }

    #[test]
    fn nvme_needs_an_iommu_or_noiommu_mode_for_vfio() {
        let mut f = facts(Path::new("/p"));
        f.nvme_pci = Some(vec![ctrl("0000:01:00.0", "vfio-pci")]);
        let d = decide(&f);
        assert_eq!(d.engine, Engine::Uring);
        assert!(
            d.nvme_out[0].contains("0000:01:00.0 are on vfio-pci but there is no IOMMU"),
            "{:?}",
            d.nvme_out
        );
        f.vfio_noiommu = Some("Y".into());
        assert_eq!(decide(&f).engine, Engine::Nvme);
        f.vfio_noiommu = None;
        f.iommu_groups = Some(vec!["0".into()]);
        let d = decide(&f);
        assert_eq!(d.engine, Engine::Nvme);
        assert!(
            d.reason.contains("; gpu is out:") && !d.reason.contains("nvme is out"),
            "{}",
            d.reason
        );
    }

    #[test]
    fn none_when_direct_io_fails() {
        let mut f = facts(Path::new("/p"));
        f.direct_io = Err("direct write: EINVAL".into());
        let d = decide(&f);
        assert_eq!(d.engine, Engine::None);
        assert!(
            d.reason
                .starts_with("no engine can run: O_DIRECT on /p fails: direct write: EINVAL"),
            "{}",
            d.reason
        );
    }

    #[test]
    fn probe_writes_and_removes_its_file() {
        let dir = std::env::temp_dir().join(format!("kvtier-choice-{}", std::process::id()));
        let _ = fs::remove_dir_all(&dir);
        let f = Facts::probe(&dir, None).unwrap();
        assert!(!f.pool_dir_existed);
        assert_eq!(
            fs::read_dir(&dir).unwrap().count(),
            0,
            "the probe left a file"
        );
        let again = Facts::probe(&dir, None).unwrap();
        assert!(again.pool_dir_existed);
        // Whatever this machine is, the decision names one engine and says why.
        let d = decide(&again);
        assert!(!d.reason.is_empty());
        fs::remove_dir_all(&dir).unwrap();
    }
}
