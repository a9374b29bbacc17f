//! `kvtier doctor`: what this machine can run, and why not.
//!
//! Every line of the report is something probed on this machine at the time of
//! the call: sysfs and procfs files (through [`kvtier::host`]), the CUDA driver as
//! the GPU engine's own loader sees it ([`kvtier::gpu::probe()`]), an NVMe Identify
//! through the kernel's admin passthrough ([`kvtier::nvme::passthru`]), io_uring
//! rings created with the features kvtier uses, and a real `O_DIRECT` write and read
//! on the pool directory. What cannot be told says `unknown (why)`.
//!
//! The verdict is the library's engine decision ([`kvtier::engine::choice`], the
//! one `TierBuilder`'s automatic engine takes); this module gathers the detail
//! around it and renders it: `gpu` (CUDA I/O kernels on a green-context SM
//! partition), `nvme` (userspace NVMe through VFIO or uio), or `uring` (io_uring
//! with `O_DIRECT` on the pool directory; works everywhere), with the reasons
//! the others are out.

use kvtier::engine::choice::{self, Decision, Facts};
use kvtier::gpu::driver::LIBCUDA;
use kvtier::gpu::probe::version_string;
use kvtier::gpu::LoadStage;
use kvtier::host::mounts::{mount_of, mounted_at};
use kvtier::host::pci::bar_size;
use kvtier::host::size::human_bytes as human;
use kvtier::host::sysfs::{dir_names, link_name, read_trim};
use kvtier::Result;
use serde::{Deserialize, Serialize};
use std::fmt::Write as _;
use std::fs;
use std::path::{Path, PathBuf};

/// One probed fact: `ok` is `Some(true)` when it is what kvtier needs,
/// `Some(false)` when it is missing or broken, `None` when it is only
/// information (or could not be told).
#[non_exhaustive]
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Item {
    /// The thing probed ("kernel driver", "O_DIRECT", "GPU 0", ...).
    pub key: String,
    /// What was found.
    pub value: String,
    /// Fit for kvtier (`Some(true)`), missing or broken (`Some(false)`), or only information (`None`).
    pub ok: Option<bool>,
    /// Why, where from, or what to do.
    pub note: String,
}

/// One part of the machine (gpu, iommu, nvme, io_uring, pool_dir, engine) and its items.
#[non_exhaustive]
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Section {
    /// The section's name.
    pub name: String,
    /// Its items, in probe order.
    pub items: Vec<Item>,
}

/// The whole report: every section, the engine kvtier would pick, and why.
#[non_exhaustive]
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Report {
    /// The sections, in report order.
    pub sections: Vec<Section>,
    /// `gpu`, `nvme`, `uring`, or `none` when not even io_uring with O_DIRECT works.
    pub engine: String,
    /// Why that engine, and why each other one is out.
    pub engine_reason: String,
}

impl Report {
    /// The section of this name, if the report has it.
    pub fn section(&self, name: &str) -> Option<&Section> {
        self.sections.iter().find(|s| s.name == name)
    }
}

impl Section {
    /// The first item with this key.
    pub fn item(&self, key: &str) -> Option<&Item> {
        self.items.iter().find(|i| i.key == key)
    }
}

fn item(key: &str, value: impl Into<String>, ok: Option<bool>, note: impl Into<String>) -> Item {
    Item {
        key: key.to_string(),
        value: value.into(),
        ok,
        note: note.into(),
    }
}

/// Probe the machine, with `dir` as the pool directory (created if missing;
/// O_DIRECT is tried by reading the pool's first file where one is there,
/// else through a temporary file written, read and removed).
pub fn run(dir: &Path) -> Result<Report> {
    let first = kvtier::pool::place::directory_files(dir, 1);
    let facts = Facts::probe(dir, first.first().map(PathBuf::as_path))?;
    let decision = choice::decide(&facts);
    let mut gpu = gpu_items(&facts);
    gpu.extend(dma_path_items(Path::new("/")));
    let memory = memory_path_items(
        gpu_usable(&facts),
        kvtier::gpu::kernels::built_with_kernels(),
        &kvtier::gpu::dma::check_paths(Path::new("/")),
    );
    let sections = [
        ("gpu", gpu),
        ("iommu", iommu_items(&facts)),
        ("vfio", vfio_items(&facts)),
        ("nvme", nvme_items(&facts)),
        ("io_uring", uring_items(&facts)),
        ("pool_dir", pool_items(&facts)),
        ("memory", memory),
        ("engine", verdict_items(&decision, &facts)),
    ]
    .into_iter()
    .map(|(name, items)| Section {
        name: name.into(),
        items,
    })
    .collect();
    Ok(Report {
        sections,
        engine: decision.engine.as_str().to_string(),
        engine_reason: decision.reason,
    })
}

/// The report as text: one line per item, `[ ok ]` (what kvtier needs),
/// `[ no ]` (missing or broken) or `[ -- ]` (information), then the engine
/// verdict.
pub fn render(r: &Report) -> String {
    let mut s = String::from("kvtier doctor\n");
    for sec in &r.sections {
        let _ = writeln!(s, "\n{}", sec.name);
        let width = sec.items.iter().map(|i| i.key.len()).max().unwrap_or(0);
        for i in &sec.items {
            let mark = match i.ok {
                Some(true) => "[ ok ]",
                Some(false) => "[ no ]",
                None => "[ -- ]",
            };
            let _ = write!(s, "  {mark} {:<width$}  {}", i.key, i.value);
            if !i.note.is_empty() {
                let _ = write!(s, " — {}", i.note);
            }
            s.push('\n');
        }
    }
    let _ = writeln!(
        s,
        "\nengine: {} — {}",
        r.engine,
        r.engine_reason.replace("; ", ";\n  ")
    );
    s
}

// ---------------------------------------------------------------------------------------
// Small file helpers
// ---------------------------------------------------------------------------------------

fn exists(path: &str) -> bool {
    Path::new(path).exists()
}

fn yes_no(b: bool) -> &'static str {
    if b {
        "yes"
    } else {
        "no"
    }
}

// ---------------------------------------------------------------------------------------
// GPU and CUDA driver
// ---------------------------------------------------------------------------------------

/// A GPU the driver loads for: one on the PCI bus or one the driver enumerates.
fn gpu_usable(f: &Facts) -> bool {
    match &f.driver {
        Ok(d) => !d.devices.is_empty() || f.gpus_pci.as_ref().is_some_and(|v| !v.is_empty()),
        Err(_) => false,
    }
}

fn gpu_items(f: &Facts) -> Vec<Item> {
    let mut items = Vec::new();

    // The kernel side: device nodes and the module's version, independent of libcuda.
    let nvidiactl = exists("/dev/nvidiactl");
    let module = read_trim("/proc/driver/nvidia/version")
        .and_then(|s| s.lines().next().map(|l| l.trim().to_string()));
    items.push(item(
        "kernel driver",
        match &module {
            Some(m) => m.clone(),
            None => "not loaded".into(),
        },
        Some(module.is_some()),
        if nvidiactl {
            "/dev/nvidiactl present"
        } else {
            "no /proc/driver/nvidia/version, no /dev/nvidiactl"
        },
    ));

    // PCI: NVIDIA display/3D controllers and their BAR1 (what P2P DMA into GPU memory targets).
    match &f.gpus_pci {
        None => items.push(item(
            "PCI GPUs",
            "unknown (cannot read /sys/bus/pci/devices)",
            None,
            "",
        )),
        Some(v) if v.is_empty() => items.push(item(
            "PCI GPUs",
            "none",
            Some(false),
            "no PCI function with vendor 0x10de and a display class in /sys/bus/pci/devices",
        )),
        Some(v) => {
            for d in v {
                let bar1 = match bar_size(&d.sysfs, 1) {
                    Some(b) => format!("BAR1 {}", human(b)),
                    None => "BAR1 unknown (resource 1 unassigned or unreadable)".into(),
                };
                items.push(item(
                    &format!("PCI GPU {}", d.addr),
                    format!("device {}, {bar1}", d.device_id),
                    Some(true),
                    format!("driver {}", d.driver.as_deref().unwrap_or("none bound")),
                ));
            }
        }
    }

    // The user-space driver, through the GPU engine's own loader (gpu::probe): what the
    // engine would see, step by step.
    let library = LIBCUDA.to_string_lossy();
    match &f.driver {
        Err(p) if p.stage == Some(LoadStage::NotFound) => {
            items.push(item(
                "CUDA driver",
                "not found",
                Some(false),
                format!("dlopen {library} failed: {}", p.reason),
            ));
        }
        Err(p) => {
            let version = match p.version {
                Some(v) => version_string(v),
                None => "unknown".into(),
            };
            let loaded = !matches!(p.stage, Some(LoadStage::NotCuda | LoadStage::VersionQuery));
            items.push(item(
                "CUDA driver",
                format!("{library} (driver API {version})"),
                Some(loaded),
                if loaded {
                    "loaded with dlopen".to_string()
                } else {
                    p.reason.clone()
                },
            ));
            match p.stage {
                Some(LoadStage::TooOld | LoadStage::MissingSymbols | LoadStage::Bindings) => items
                    .push(item(
                        "cudarc bindings",
                        if p.stage == Some(LoadStage::TooOld) {
                            "not tried"
                        } else {
                            "fail"
                        },
                        Some(false),
                        p.reason.clone(),
                    )),
                Some(LoadStage::Init) => {
                    items.push(item("cuInit", p.reason.clone(), Some(false), ""))
                }
                None => items.push(item("devices", p.reason.clone(), Some(false), "")),
                _ => {}
            }
        }
        Ok(d) => {
            items.push(item(
                "CUDA driver",
                format!("{library} (driver API {})", d.version_string()),
                Some(true),
                "loaded with dlopen",
            ));
            items.push(item(
                "cudarc bindings",
                "loads",
                Some(true),
                "cudarc 0.17 with CUDA 13.0 bindings",
            ));
            items.push(item(
                "devices",
                d.devices.len().to_string(),
                Some(!d.devices.is_empty()),
                "cuDeviceGetCount",
            ));
            for g in &d.devices {
                let bar1 = g
                    .bar1_bytes
                    .map(|b| format!(", BAR1 {}", human(b)))
                    .unwrap_or_else(|| {
                        ", BAR1 unknown (no sysfs resource for its PCI address)".into()
                    });
                items.push(item(
                    &format!("GPU {}", g.ordinal),
                    format!(
                        "{}: {} SMs, compute capability {}.{}, {}{bar1}",
                        g.name,
                        g.sm_count,
                        g.compute_capability.0,
                        g.compute_capability.1,
                        human(g.total_memory)
                    ),
                    Some(true),
                    format!("PCI {}", g.pci_bus_id.as_deref().unwrap_or("unknown")),
                ));
                items.push(item(
                    &format!("GPU {} green contexts", g.ordinal),
                    yes_no(g.green_contexts),
                    Some(g.green_contexts),
                    g.green_note.clone(),
                ));
            }
        }
    }
    items
}

/// One item per way an NVMe controller can reach GPU-visible memory
/// (`kvtier::gpu::dma`): whether the machine under `root` has what the path
/// needs, whether kvtier implements it, and which deployment uses it.
fn dma_path_items(root: &Path) -> Vec<Item> {
    kvtier::gpu::dma::check_paths(root)
        .into_iter()
        .map(|c| {
            let value = match (c.available, c.implemented) {
                (true, true) => "available",
                (true, false) => "prerequisites present, not implemented in kvtier",
                (false, _) => "unavailable",
            };
            item(
                &format!("DMA path {}", c.kind.name()),
                value,
                Some(c.available && c.implemented),
                format!("{} — {}", c.detail, c.kind.deployment()),
            )
        })
        .collect()
}

/// Which path each kind of KV memory takes on this machine. Host memory:
/// every engine DMAs into it. GPU memory: directly only where a GPUDirect
/// path (dma-buf, peermem) is present *and* implemented; otherwise staged
/// through pinned host memory (`kvtier::staged`), which needs a CUDA
/// GPU and the staging kernels.
fn memory_path_items(
    gpu_usable: bool,
    kernels: bool,
    paths: &[kvtier::gpu::dma::PathCheck],
) -> Vec<Item> {
    use kvtier::gpu::dma::DmaPathKind;
    let host = item(
        "host memory",
        "direct",
        Some(true),
        "every engine (uring, nvme, gpu) reads into and writes from it",
    );
    let direct = paths
        .iter()
        .find(|c| c.kind != DmaPathKind::HostBounce && c.available && c.implemented);
    let gpu = match (direct, gpu_usable, kernels) {
        (Some(c), true, _) => item(
            "gpu memory",
            format!("direct ({})", c.kind.name()),
            Some(true),
            "the controller DMAs into HBM",
        ),
        (None, true, true) => item(
            "gpu memory",
            "staged via pinned host",
            Some(true),
            "reads land in pinned host staging, one copy kernel per layer moves them into HBM (and a gather kernel with crc32c for stores); direct when dma-buf or peermem support appears",
        ),
        (None, true, false) => item(
            "gpu memory",
            "unavailable",
            Some(false),
            "kvtier was built without its CUDA kernels: run scripts/install-nvcc.sh, then rebuild",
        ),
        (_, false, _) => item(
            "gpu memory",
            "unavailable",
            Some(false),
            "no usable CUDA GPU (see the gpu section); host memory only",
        ),
    };
    vec![host, gpu]
}

// ---------------------------------------------------------------------------------------
// IOMMU
// ---------------------------------------------------------------------------------------

fn iommu_items(f: &Facts) -> Vec<Item> {
    let mut items = Vec::new();
    let groups = &f.iommu_groups;
    match &f.iommu_units {
        Some(u) if !u.is_empty() => items.push(item(
            "IOMMU units",
            u.join(", "),
            Some(true),
            "/sys/class/iommu",
        )),
        Some(_) => items.push(item(
            "IOMMU units",
            "none",
            Some(false),
            "/sys/class/iommu is empty: no IOMMU enabled (firmware off, kernel cmdline, or a VM without a virtual IOMMU)",
        )),
        None => items.push(item(
            "IOMMU units",
            "unknown (cannot read /sys/class/iommu)",
            None,
            "",
        )),
    }
    items.push(item(
        "IOMMU groups",
        match &groups {
            Some(g) => g.len().to_string(),
            None => "unknown (cannot read /sys/kernel/iommu_groups)".into(),
        },
        groups.as_ref().map(|g| !g.is_empty()),
        "/sys/kernel/iommu_groups",
    ));
    let cmdline = read_trim("/proc/cmdline");
    match &cmdline {
        Some(c) => {
            let params: Vec<&str> = c
                .split_whitespace()
                .filter(|t| {
                    t.starts_with("intel_iommu=")
                        || t.starts_with("amd_iommu=")
                        || t.starts_with("iommu=")
                        || t.starts_with("iommu.")
                })
                .collect();
            items.push(item(
                "kernel cmdline",
                if params.is_empty() {
                    "no intel_iommu= / amd_iommu= / iommu= parameter".to_string()
                } else {
                    params.join(" ")
                },
                None,
                if params.contains(&"iommu=pt") {
                    "passthrough for host devices; VFIO still gets translation"
                } else {
                    "/proc/cmdline"
                },
            ));
        }
        None => items.push(item(
            "kernel cmdline",
            "unknown (cannot read /proc/cmdline)",
            None,
            "",
        )),
    }
    let iommufd = exists("/dev/iommu");
    items.push(item(
        "iommufd",
        if iommufd {
            "/dev/iommu present"
        } else {
            "no /dev/iommu"
        },
        None,
        "GPU memory as dma-buf mapped through iommufd needs it",
    ));
    items
}

// ---------------------------------------------------------------------------------------
// vfio and uio
// ---------------------------------------------------------------------------------------

fn vfio_items(f: &Facts) -> Vec<Item> {
    let mut items = Vec::new();
    for m in [
        "vfio",
        "vfio_pci",
        "vfio_iommu_type1",
        "uio",
        "uio_pci_generic",
        "nvidia_peermem",
    ] {
        let p = format!("/sys/module/{m}");
        let present = exists(&p);
        let note = match m {
            "nvidia_peermem" => {
                "GPU memory physical addresses for devices without an IOMMU (not used by this build: its GPU engine keeps queues and data in host-pinned memory)".to_string()
            }
            _ if present => "loaded or built in".to_string(),
            _ => format!("not in /sys/module: modprobe {m}"),
        };
        items.push(item(
            &format!("module {m}"),
            if present { "present" } else { "absent" },
            Some(present),
            note,
        ));
    }
    let container = exists("/dev/vfio/vfio");
    items.push(item(
        "/dev/vfio/vfio",
        if container { "present" } else { "absent" },
        Some(container),
        "the VFIO container device",
    ));
    let noiommu_raw = &f.vfio_noiommu;
    let noiommu = f.vfio_noiommu();
    items.push(item(
        "vfio no-IOMMU mode",
        match &noiommu_raw {
            Some(v) => format!("{v} ({})", if noiommu { "enabled" } else { "disabled" }),
            None => "unknown (no /sys/module/vfio/parameters/enable_unsafe_noiommu_mode)".into(),
        },
        None,
        "unsafe: devices DMA to physical addresses unchecked",
    ));
    for drv in ["vfio-pci", "uio_pci_generic"] {
        let bound: Vec<String> = dir_names(format!("/sys/bus/pci/drivers/{drv}"))
            .unwrap_or_default()
            .into_iter()
            .filter(|n| n.contains(':'))
            .collect();
        items.push(item(
            &format!("bound to {drv}"),
            if bound.is_empty() {
                "no device".to_string()
            } else {
                bound.join(", ")
            },
            None,
            format!("/sys/bus/pci/drivers/{drv}"),
        ));
    }
    items
}

// ---------------------------------------------------------------------------------------
// NVMe
// ---------------------------------------------------------------------------------------

fn nvme_items(f: &Facts) -> Vec<Item> {
    let mut items = Vec::new();
    match &f.nvme_pci {
        None => items.push(item(
            "PCI NVMe controllers",
            "unknown (cannot read /sys/bus/pci/devices)",
            None,
            "",
        )),
        Some(v) if v.is_empty() => items.push(item(
            "PCI NVMe controllers",
            "none",
            Some(false),
            "no PCI function of class 0x010802 (NVMe) in /sys/bus/pci/devices",
        )),
        Some(v) => {
            for d in v {
                let drv = d.driver.as_deref().unwrap_or("none");
                items.push(item(
                    &format!("PCI NVMe {}", d.addr),
                    format!("driver {drv}"),
                    None,
                    match drv {
                        "vfio-pci" | "uio_pci_generic" => "usable by a userspace NVMe engine",
                        "nvme" => "kernel driver: usable through files/block devices (uring)",
                        _ => "",
                    },
                ));
            }
        }
    }

    let ctrls = dir_names("/sys/class/nvme");
    match &ctrls {
        None => items.push(item(
            "kernel NVMe controllers",
            "none",
            None,
            "no /sys/class/nvme (nvme driver not loaded or no controller)",
        )),
        Some(c) if c.is_empty() => items.push(item(
            "kernel NVMe controllers",
            "none",
            None,
            "/sys/class/nvme is empty",
        )),
        Some(c) => {
            for name in c {
                probe_controller(name, &mut items);
            }
        }
    }
    items
}

fn probe_controller(name: &str, items: &mut Vec<Item>) {
    let base = Path::new("/sys/class/nvme").join(name);
    let get = |f: &str| read_trim(base.join(f)).unwrap_or_else(|| "unknown".into());
    let driver = link_name(base.join("device/driver")).unwrap_or_else(|| "unknown".into());
    items.push(item(
        name,
        format!(
            "{} (serial {}, firmware {})",
            get("model"),
            get("serial"),
            get("firmware_rev")
        ),
        Some(true),
        format!("{} {}, driver {driver}", get("transport"), get("address")),
    ));

    // Namespaces: nvmeXnY, or nvmeXcZnY under native multipath (block device nvmeXnY).
    let namespaces: Vec<String> = dir_names(&base)
        .unwrap_or_default()
        .into_iter()
        .filter_map(|n| namespace_block_name(&n))
        .collect();
    if namespaces.is_empty() {
        items.push(item(&format!("{name} namespaces"), "none", None, ""));
    }
    for ns in namespaces {
        let dev = PathBuf::from(format!("/dev/{ns}"));
        let size = read_trim(format!("/sys/block/{ns}/size"))
            .and_then(|s| s.parse::<u64>().ok())
            .map(|sectors| human(sectors * 512))
            .unwrap_or_else(|| "size unknown".into());
        let (value, ok, note) = match mounted_at(&dev) {
            Ok(Some(m)) => (
                format!("{size}, in use at {m}"),
                Some(false),
                "mounted (or a partition / swap): kvtier refuses it without --force".to_string(),
            ),
            Ok(None) => (
                format!("{size}, not mounted"),
                Some(true),
                "free for a pool".to_string(),
            ),
            Err(e) => (
                format!("{size}, mount state unknown ({e})"),
                None,
                String::new(),
            ),
        };
        items.push(item(&format!("{name} {ns}"), value, ok, note));
        if let Some(kb) = read_trim(format!("/sys/block/{ns}/queue/max_hw_sectors_kb")) {
            items.push(item(
                &format!("{ns} max transfer"),
                format!("{kb} KiB"),
                None,
                "max_hw_sectors_kb: the kernel's limit from MDTS",
            ));
        }
    }

    // Identify Controller (SGLS, MDTS) through the admin passthrough ioctl.
    let chardev = PathBuf::from(format!("/dev/{name}"));
    // SAFETY: geteuid has no preconditions and cannot fail.
    let root = unsafe { libc::geteuid() } == 0;
    let result = if !root {
        Err("unknown (not root / no device): Identify needs CAP_SYS_ADMIN".to_string())
    } else if !chardev.exists() {
        Err(format!(
            "unknown (not root / no device): no {}",
            chardev.display()
        ))
    } else {
        kvtier::nvme::passthru::identify_controller(&chardev).map_err(|e| format!("unknown ({e})"))
    };
    match result {
        Ok(data) => {
            use kvtier::nvme::spec::{IdentifyController, IDENTIFY_DATA_LEN};
            let data: &[u8; IDENTIFY_DATA_LEN] = &data;
            let id = IdentifyController::parse(data);
            let sgl = id.sgl_supported();
            items.push(item(
                &format!("{name} SGL"),
                if sgl {
                    format!(
                        "supported{} (SGLS {:#010x})",
                        if id.sgl_dword_aligned() {
                            ", data blocks dword aligned"
                        } else {
                            ""
                        },
                        id.sgls
                    )
                } else {
                    format!("not supported (SGLS {:#010x})", id.sgls)
                },
                Some(sgl),
                if sgl {
                    "scattered extents go in one command"
                } else {
                    "PRP lists are used instead"
                },
            ));
            items.push(item(
                &format!("{name} MDTS"),
                if id.mdts == 0 {
                    "0 (no limit)".to_string()
                } else {
                    format!(
                        "{} ({} with 4 KiB CAP.MPSMIN)",
                        id.mdts,
                        human(4096u64 << id.mdts)
                    )
                },
                None,
                "Identify Controller byte 77",
            ));
        }
        Err(why) => items.push(item(&format!("{name} SGL"), why, None, "")),
    }
}

/// `nvme0n1` → `nvme0n1`, `nvme0c1n1` → `nvme0n1`, others → None.
fn namespace_block_name(entry: &str) -> Option<String> {
    let rest = entry.strip_prefix("nvme")?;
    let digits = |s: &str| !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit());
    let (ctrl, ns) = rest.split_once('n')?;
    if !digits(ns) {
        return None;
    }
    let ctrl = match ctrl.split_once('c') {
        Some((c, path)) if digits(c) && digits(path) => c,
        None if digits(ctrl) => ctrl,
        _ => return None,
    };
    Some(format!("nvme{ctrl}n{ns}"))
}

// ---------------------------------------------------------------------------------------
// io_uring
// ---------------------------------------------------------------------------------------

fn uring_items(f: &Facts) -> Vec<Item> {
    use io_uring::{opcode, register::Probe, IoUring};
    let mut items = Vec::new();
    items.push(item(
        "kernel",
        read_trim("/proc/sys/kernel/osrelease")
            .unwrap_or_else(|| "unknown (no /proc/sys/kernel/osrelease)".into()),
        None,
        "",
    ));
    let disabled = read_trim("/proc/sys/kernel/io_uring_disabled");
    items.push(item(
        "io_uring_disabled",
        match disabled.as_deref() {
            Some("0") => "0 (enabled for all)".to_string(),
            Some("1") => "1 (only for the io_uring_group / CAP_SYS_ADMIN)".to_string(),
            Some("2") => "2 (disabled for everyone)".to_string(),
            Some(v) => v.to_string(),
            None => "no such sysctl (kernel < 6.6: enabled)".to_string(),
        },
        disabled.as_deref().map(|v| v != "2"),
        "/proc/sys/kernel/io_uring_disabled",
    ));
    // The decision's ring (facts.uring) says whether one can be created; this
    // one asks it for the features.
    let ring = IoUring::new(8);
    items.push(item(
        "ring",
        match &ring {
            Ok(_) => "created".to_string(),
            Err(e) => format!("cannot be created: {e}"),
        },
        Some(ring.is_ok() && f.uring.is_ok()),
        "io_uring_setup with 8 entries",
    ));
    if let Ok(ring) = &ring {
        let mut probe = Probe::new();
        match ring.submitter().register_probe(&mut probe) {
            Ok(()) => {
                let ops = [
                    (
                        "READ_FIXED / WRITE_FIXED",
                        opcode::ReadFixed::CODE,
                        opcode::WriteFixed::CODE,
                        "single-extent I/O into registered buffers",
                    ),
                    (
                        "READV_FIXED / WRITEV_FIXED",
                        opcode::ReadvFixed::CODE,
                        opcode::WritevFixed::CODE,
                        "vectored I/O into registered buffers (6.15+); else plain readv/writev",
                    ),
                ];
                for (name, r, w, note) in ops {
                    let ok = probe.is_supported(r) && probe.is_supported(w);
                    items.push(item(
                        name,
                        if ok { "supported" } else { "not supported" },
                        Some(ok),
                        note,
                    ));
                }
            }
            Err(e) => items.push(item(
                "opcodes",
                format!("unknown (IORING_REGISTER_PROBE failed: {e})"),
                None,
                "",
            )),
        }
        // Fixed buffers need RLIMIT_MEMLOCK room (or CAP_IPC_LOCK).
        let reg = kvtier::engine::uring::fixed_buffers_fit(ring, 1 << 20);
        let memlock = memlock_limit();
        items.push(item(
            "fixed buffers",
            match &reg {
                Ok(()) => "1 MiB registered".to_string(),
                Err(e) => format!("registering 1 MiB failed: {e}"),
            },
            Some(reg.is_ok()),
            format!("RLIMIT_MEMLOCK {memlock}; the KV memory must fit it (or CAP_IPC_LOCK), else plain iovecs"),
        ));
    }
    let sqpoll = IoUring::<io_uring::squeue::Entry>::builder()
        .setup_sqpoll(1000)
        .build(8);
    items.push(item(
        "SQPOLL",
        match &sqpoll {
            Ok(_) => "allowed".to_string(),
            Err(e) => format!("refused: {e}"),
        },
        Some(sqpoll.is_ok()),
        "kernel submission thread (--sqpoll)",
    ));
    drop(sqpoll);
    let defer = IoUring::<io_uring::squeue::Entry>::builder()
        .setup_single_issuer()
        .setup_defer_taskrun()
        .build(8);
    items.push(item(
        "DEFER_TASKRUN",
        match &defer {
            Ok(_) => "supported".to_string(),
            Err(e) => format!("refused: {e}"),
        },
        Some(defer.is_ok()),
        "SINGLE_ISSUER | DEFER_TASKRUN (--defer-taskrun); kernel 6.1+",
    ));
    items
}

/// "Max locked memory" soft limit from /proc/self/limits.
fn memlock_limit() -> String {
    let Some(text) = read_trim("/proc/self/limits") else {
        return "unknown (cannot read /proc/self/limits)".into();
    };
    for line in text.lines() {
        if let Some(rest) = line.strip_prefix("Max locked memory") {
            let soft = rest.split_whitespace().next().unwrap_or("unknown");
            return match soft.parse::<u64>() {
                Ok(b) => human(b),
                Err(_) => soft.to_string(),
            };
        }
    }
    "unknown (no Max locked memory line)".into()
}

// ---------------------------------------------------------------------------------------
// The pool directory
// ---------------------------------------------------------------------------------------

fn pool_items(f: &Facts) -> Vec<Item> {
    let mut items = Vec::new();
    let path = &f.pool_dir;
    items.push(item(
        "directory",
        path.display().to_string(),
        Some(true),
        if f.pool_dir_existed {
            "exists"
        } else {
            "created"
        },
    ));
    match mount_of(path) {
        Some((src, mp, fstype)) => items.push(item(
            "filesystem",
            fstype.clone(),
            None,
            format!("{src} mounted at {mp}"),
        )),
        None => items.push(item(
            "filesystem",
            "unknown (no /proc/self/mounts entry holds it)",
            None,
            "",
        )),
    }
    match nix::sys::statvfs::statvfs(path.as_path()) {
        Ok(s) => {
            let free = s.blocks_available() * s.fragment_size();
            let total = s.blocks() * s.fragment_size();
            items.push(item(
                "free space",
                format!("{} of {}", human(free), human(total)),
                Some(free > 0),
                "statvfs, available to unprivileged users",
            ));
        }
        Err(e) => items.push(item(
            "free space",
            format!("unknown (statvfs: {e})"),
            None,
            "",
        )),
    }

    // O_DIRECT: the decision's own probe.
    let direct = &f.direct_io;
    let direct_ok = direct.is_ok();
    items.push(item(
        "O_DIRECT",
        match &direct {
            Ok(()) => "works".to_string(),
            Err(e) => format!("fails: {e}"),
        },
        Some(direct_ok),
        f.direct_io_how.clone(),
    ));
    items.push(item(
        "DIO alignment",
        match &f.dio_align {
            Ok(Some((mem, off))) => format!("memory {mem} B, offset {off} B"),
            Ok(None) => "unknown (statx has no STATX_DIOALIGN here: kernel < 6.1 or the filesystem does not report it)".to_string(),
            Err(e) => format!("unknown ({e})"),
        },
        None,
        "statx STATX_DIOALIGN; kvtier aligns to 4 KiB",
    ));

    let meminfo = fs::read_to_string("/proc/meminfo").ok();
    let field = |k: &str| -> Option<String> {
        meminfo.as_ref()?.lines().find_map(|l| {
            l.strip_prefix(k)
                .and_then(|r| r.strip_prefix(':'))
                .map(|r| r.trim().to_string())
        })
    };
    match (
        field("HugePages_Total"),
        field("HugePages_Free"),
        field("Hugepagesize"),
    ) {
        (Some(t), Some(f), Some(sz)) => items.push(item(
            "hugepages",
            format!("{f} free of {t} ({sz} each)"),
            None,
            "/proc/meminfo",
        )),
        _ => items.push(item(
            "hugepages",
            "unknown (no HugePages_* in /proc/meminfo)",
            None,
            "",
        )),
    }
    let thp = read_trim("/sys/kernel/mm/transparent_hugepage/enabled");
    items.push(item(
        "transparent hugepages",
        match &thp {
            Some(t) => t
                .split_whitespace()
                .find(|w| w.starts_with('['))
                .map(|w| w.trim_matches(['[', ']']).to_string())
                .unwrap_or_else(|| t.clone()),
            None => "unknown (no /sys/kernel/mm/transparent_hugepage/enabled)".into(),
        },
        None,
        "/sys/kernel/mm/transparent_hugepage/enabled",
    ));
    items
}

// ---------------------------------------------------------------------------------------
// Verdict
// ---------------------------------------------------------------------------------------

/// One item per engine: usable, or out and why (the decision's own reasons).
fn verdict_items(d: &Decision, f: &Facts) -> Vec<Item> {
    vec![
        verdict_item("gpu", &d.gpu_out, "usable"),
        verdict_item("nvme", &d.nvme_out, "usable"),
        verdict_item(
            "uring",
            &d.uring_out,
            &choice::uring_usable_note(&f.pool_dir),
        ),
    ]
}

fn verdict_item(name: &str, out: &[String], ok_note: &str) -> Item {
    if out.is_empty() {
        item(name, "usable", Some(true), ok_note)
    } else {
        item(name, "out", Some(false), out.join("; "))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn namespace_names() {
        assert_eq!(namespace_block_name("nvme0n1").as_deref(), Some("nvme0n1"));
        assert_eq!(
            namespace_block_name("nvme2c3n12").as_deref(),
            Some("nvme2n12")
        );
        assert_eq!(namespace_block_name("nvme0"), None);
        assert_eq!(namespace_block_name("nvme0n"), None);
        assert_eq!(namespace_block_name("power"), None);
        assert_eq!(namespace_block_name("nvmeXn1"), None);
    }

    #[test]
    fn memory_paths_say_direct_or_staged() {
        use kvtier::gpu::dma::{DmaPathKind, PathCheck};
        let check = |kind, available, implemented| PathCheck {
            kind,
            available,
            implemented,
            detail: String::new(),
        };
        let none = [
            check(DmaPathKind::HostBounce, true, true),
            check(DmaPathKind::DmaBuf, true, false),
            check(DmaPathKind::Peermem, false, false),
        ];
        let items = memory_path_items(true, true, &none);
        assert_eq!(
            (items[0].key.as_str(), items[0].value.as_str()),
            ("host memory", "direct")
        );
        assert_eq!(items[1].value, "staged via pinned host");
        assert_eq!(items[1].ok, Some(true));
        let peermem = [check(DmaPathKind::Peermem, true, true)];
        assert_eq!(
            memory_path_items(true, true, &peermem)[1].value,
            "direct (peermem)"
        );
        let no_kernels = memory_path_items(true, false, &none);
        assert!(
            no_kernels[1].note.contains("install-nvcc"),
            "{:?}",
            no_kernels[1]
        );
        let no_gpu = memory_path_items(false, true, &peermem);
        assert_eq!(
            (no_gpu[1].value.as_str(), no_gpu[1].ok),
            ("unavailable", Some(false))
        );
    }

    #[test]
    fn dma_path_items_name_each_path() {
        let root = std::env::temp_dir().join(format!("kvtier-doctor-dma-{}", std::process::id()));
        fs::create_dir_all(root.join("sys/module/nvidia_peermem")).unwrap();
        let items = dma_path_items(&root);
        let keys: Vec<&str> = items.iter().map(|i| i.key.as_str()).collect();
        assert_eq!(
            keys,
            [
                "DMA path host-bounce",
                "DMA path dma-buf",
                "DMA path peermem"
            ]
        );
        assert_eq!(items[0].value, "unavailable");
        assert_eq!(items[0].ok, Some(false));
        assert_eq!(
            items[2].value,
            "prerequisites present, not implemented in kvtier"
        );
        assert!(items[2].note.contains("no IOMMU"), "{}", items[2].note);
        fs::remove_dir_all(&root).unwrap();
    }

    #[test]
    fn render_marks_and_verdict() {
        let r = Report {
            sections: vec![Section {
                name: "s".into(),
                items: vec![
                    item("a", "1", Some(true), "n"),
                    item("b", "2", Some(false), ""),
                    item("c", "3", None, ""),
                ],
            }],
            engine: "uring".into(),
            engine_reason: "x; y".into(),
        };
        let t = render(&r);
        assert!(t.contains("[ ok ] a  1 — n"), "{t}");
        assert!(t.contains("[ no ] b  2\n"), "{t}");
        assert!(t.contains("[ -- ] c  3"), "{t}");
        assert!(t.contains("engine: uring — x;\n  y"), "{t}");
    }
}
