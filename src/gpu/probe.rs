//! What the CUDA driver sees: [`probe`]. Never panics; without a driver it
//! returns the loader's [`Error::Gpu`](crate::Error::Gpu) ("no CUDA driver:
//! libcuda.so.1 not found ...").

use super::driver::{self, LoadStage};
use crate::error::Result;
use cudarc::driver::sys::CUdevice_attribute as A;
use serde::Serialize;
use std::path::Path;

/// The driver and its devices.
#[non_exhaustive]
#[derive(Clone, Debug, Serialize)]
pub struct DriverInfo {
    /// Driver API version as CUDA encodes it (13000 = 13.0).
    pub version: i32,
    /// Green-context symbols libcuda lacks (empty on any 12.4+ driver).
    pub missing_green_symbols: Vec<&'static str>,
    /// Each device the driver enumerates.
    pub devices: Vec<DeviceInfo>,
}

/// One CUDA device.
#[non_exhaustive]
#[derive(Clone, Debug, Serialize)]
pub struct DeviceInfo {
    /// CUDA ordinal.
    pub ordinal: i32,
    /// Name as the driver reports it.
    pub name: String,
    /// Streaming multiprocessors.
    pub sm_count: u32,
    /// (major, minor).
    pub compute_capability: (i32, i32),
    /// Bytes of device memory.
    pub total_memory: u64,
    /// PCI address as the driver prints it (`0000:65:00.0`).
    pub pci_bus_id: Option<String>,
    /// BAR1 size from sysfs (`/sys/bus/pci/devices/<addr>/resource`); `None`
    /// = unknown (no sysfs entry, e.g. in a container). NVML is not used.
    pub bar1_bytes: Option<u64>,
    /// Green contexts usable: driver >= 12.4, compute capability >= 9.0, all
    /// green-context symbols present.
    pub green_contexts: bool,
    /// Why (or why not) green contexts.
    pub green_note: String,
    /// `CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED`: device memory can be exported
    /// as dma-buf (path (b) of [`super::dma`]).
    pub dma_buf: bool,
    /// `CU_DEVICE_ATTRIBUTE_CAN_USE_STREAM_WAIT_VALUE_NOR`-era stream memory
    /// operations (`cuStreamWaitValue32`); always true on 12.0+ drivers, read
    /// anyway so a report shows it.
    pub stream_mem_ops: bool,
}

impl DriverInfo {
    /// Version as `major.minor`.
    pub fn version_string(&self) -> String {
        version_string(self.version)
    }
}

/// Whether green contexts can be used, and why (not): driver API >= 12.4,
/// compute capability >= 9.0 (Hopper), and every green-context symbol.
pub(crate) fn green_support(version: i32, cc_major: i32, missing: &[&str]) -> (bool, String) {
    if version < 12040 {
        (
            false,
            format!(
                "driver API {} < 12.4: update the NVIDIA driver",
                version_string(version)
            ),
        )
    } else if cc_major < 9 {
        (
            false,
            format!("compute capability {cc_major}.x < 9.0: green contexts need Hopper or newer"),
        )
    } else if !missing.is_empty() {
        (false, format!("libcuda lacks {}", missing.join(", ")))
    } else {
        (
            true,
            "driver >= 12.4, compute capability >= 9.0, green-context symbols present".into(),
        )
    }
}

/// Probe the driver and every device. Errors only when the driver cannot be
/// loaded at all; a device whose query fails is reported with what is known.
pub fn probe() -> Result<DriverInfo> {
    let version = driver::version()?;
    let missing = driver::missing_green_symbols()?;
    let n = driver::device_count()?;
    let mut devices = Vec::new();
    for ordinal in 0..n {
        let dev = driver::device_get(ordinal)?;
        let attr = |a: A| driver::device_attr(dev, a).unwrap_or(0);
        let cc = (
            attr(A::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR),
            attr(A::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR),
        );
        let pci = driver::device_pci_bus_id(dev).ok();
        let bar1 = pci.as_ref().and_then(|a| {
            crate::host::pci::bar_size(
                &Path::new("/sys/bus/pci/devices").join(a.to_ascii_lowercase()),
                1,
            )
        });
        let (green, note) = green_support(version, cc.0, &missing);
        devices.push(DeviceInfo {
            ordinal,
            name: driver::device_name(dev)?,
            sm_count: attr(A::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT).max(0) as u32,
            compute_capability: cc,
            total_memory: driver::device_total_mem(dev).unwrap_or(0),
            pci_bus_id: pci,
            bar1_bytes: bar1,
            green_contexts: green,
            green_note: note,
            dma_buf: attr(A::CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED) != 0,
            stream_mem_ops: attr(A::CU_DEVICE_ATTRIBUTE_CAN_USE_STREAM_MEM_OPS_V1) != 0
                || version >= 12000,
        });
    }
    Ok(DriverInfo {
        version,
        missing_green_symbols: missing,
        devices,
    })
}

/// Why [`probe`] found no usable driver, step by step: the loader's [`LoadStage`] (with
/// an old driver's version), or `stage: None` when the driver loaded and a device query
/// failed.
#[non_exhaustive]
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ProbeFailure {
    /// The loading step that failed; `None`: the driver loaded, a device query failed.
    pub stage: Option<LoadStage>,
    /// The driver API version, when it was read.
    pub version: Option<i32>,
    /// What failed and the fix.
    pub reason: String,
}

/// [`probe`], with the failure in the finer steps `kvtier doctor` reports (an old driver's
/// version, a library that is not libcuda, `cuInit`).
pub fn probe_detailed() -> std::result::Result<DriverInfo, ProbeFailure> {
    if let Some(e) = driver::load_error() {
        return Err(ProbeFailure {
            stage: Some(e.stage),
            version: e.version,
            reason: e.reason,
        });
    }
    probe().map_err(|e| ProbeFailure {
        stage: None,
        version: driver::version().ok(),
        reason: e.to_string(),
    })
}

/// Driver API version as `major.minor` (13000 → "13.0").
pub fn version_string(v: i32) -> String {
    format!("{}.{}", v / 1000, (v % 1000) / 10)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn probe_never_panics_and_names_libcuda_when_absent() {
        match probe() {
            Ok(info) => {
                // A machine with a driver: the loader insists on 13.0+.
                assert!(info.version >= driver::MIN_DRIVER_API, "{info:?}");
            }
            Err(e) => {
                let s = e.to_string();
                assert!(s.starts_with("GPU: CUDA driver: "), "{s}");
                // Where dlopen fails (this machine), the loader's first step
                // is what the error names.
                if driver::preflight(driver::LIBCUDA).is_err_and(|e| e.reason.contains("not found"))
                {
                    assert!(s.contains("no CUDA driver: libcuda.so.1 not found"), "{s}");
                }
            }
        }
        // A second call answers from the cached load, still without panicking, and the
        // detailed probe agrees with it.
        match (probe(), probe_detailed()) {
            (Ok(a), Ok(b)) => assert_eq!(a.version, b.version),
            (Err(a), Err(b)) => assert!(a.to_string().contains(&b.reason), "{a} / {b:?}"),
            (a, b) => panic!("probe {a:?} but probe_detailed {b:?}"),
        }
        if driver::preflight(driver::LIBCUDA).is_err_and(|e| e.stage == LoadStage::NotFound) {
            let f = probe_detailed().unwrap_err();
            assert_eq!((f.stage, f.version), (Some(LoadStage::NotFound), None));
        }
    }

    #[test]
    fn green_support_rules() {
        assert!(green_support(13000, 9, &[]).0);
        assert!(green_support(12040, 10, &[]).0);
        let (ok, why) = green_support(12030, 9, &[]);
        assert!(!ok && why.contains("12.3 < 12.4"), "{why}");
        let (ok, why) = green_support(13000, 8, &[]);
        assert!(!ok && why.contains("8.x < 9.0"), "{why}");
        let (ok, why) = green_support(13000, 9, &["cuGreenCtxCreate"]);
        assert!(!ok && why.contains("cuGreenCtxCreate"), "{why}");
    }
}
