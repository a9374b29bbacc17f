//! Handing one NVMe controller from the kernel to a userspace driver
//! (`vfio-pci` or `uio_pci_generic`) and back, safe by construction.
//!
//! [`PciBinding::bind`] touches only the PCI function named by its full
//! address (`DDDD:BB:DD.F`). Unless forced it refuses a function that is not
//! an NVMe controller (class `0x0108xx`) and, when the kernel's `nvme` driver
//! has it, any of its namespaces (and their partitions) that is mounted, an
//! active swap area, held by a stacked device (md, dm), busy, or that holds a
//! recognised filesystem, partition table or volume signature
//! ([`probe_signature`]; a kvtier pool is ours and not refused). Unbinding
//! the nvme driver makes those block devices vanish under whoever uses them,
//! so the refusal says which device holds what and how to proceed.
//!
//! Then: `driver_override` := new driver (first, so no other driver can
//! claim the function while it is unbound), unbind from the current driver,
//! bind to the new one (loading its module with `modprobe` if needed), and
//! check the function's `driver` link. Dropping the binding, or
//! [`PciBinding::restore`], puts everything back: unbind from the new
//! driver, the old `driver_override`, and the original driver bound again
//! (or none, if it had none).
//!
//! All sysfs access goes through a `Kernel`: the real one under `/sys`,
//! or, in the tests, a fake sysfs tree of plain files in a temporary
//! directory whose "kernel" records each write and moves the `driver` link
//! the way Linux would.

use crate::error::{Error, Result};
use crate::host::mounts::{find_use, related_devices};
use crate::host::pci::{addrs_by_class, parse_class};
use crate::host::signature::{probe_signature, read_head, Signature};
use crate::host::sysfs::{dir_names, link_name};
use std::fs::{self, File, OpenOptions};
use std::io::{self, Write};
use std::os::unix::fs::{FileTypeExt, MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

/// The driver a controller is handed to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BindDriver {
    /// `vfio-pci`: DMA through the IOMMU (needs one, `intel_iommu=on`/`amd_iommu=on`).
    VfioPci,
    /// `uio_pci_generic`: no IOMMU; DMA to physical addresses (root only).
    UioPciGeneric,
}

impl BindDriver {
    /// The driver's name in `/sys/bus/pci/drivers` (and in `driver_override`).
    pub fn name(self) -> &'static str {
        match self {
            BindDriver::VfioPci => "vfio-pci",
            BindDriver::UioPciGeneric => "uio_pci_generic",
        }
    }

    /// The module that provides the driver.
    pub fn module(self) -> &'static str {
        match self {
            BindDriver::VfioPci => "vfio-pci",
            BindDriver::UioPciGeneric => "uio_pci_generic",
        }
    }

    /// `vfio-pci` / `vfio_pci` / `vfio`, `uio_pci_generic` / `uio-pci-generic` / `uio`.
    pub fn parse(s: &str) -> Result<BindDriver> {
        match s.to_ascii_lowercase().replace('_', "-").as_str() {
            "vfio-pci" | "vfio" => Ok(BindDriver::VfioPci),
            "uio-pci-generic" | "uio" => Ok(BindDriver::UioPciGeneric),
            _ => Err(Error::invalid(format!(
                "driver '{s}': use vfio-pci (with an IOMMU) or uio_pci_generic"
            ))),
        }
    }
}

/// PCI class of NVMe controllers (mass storage, non-volatile memory), without
/// the programming interface byte.
const NVME_CLASS_PREFIX: u32 = 0x0108;

/// Checks that `addr` is a full PCI address, `DDDD:BB:DD.F` (hex domain,
/// bus, device up to 1f, function up to 7), and returns it lower-cased as
/// sysfs spells it.
pub(crate) fn parse_pci_address(addr: &str) -> Result<String> {
    let bad = |why: &str| {
        Error::invalid(format!(
            "'{addr}' is not a full PCI address ({why}); name the controller as \
             DDDD:BB:DD.F, e.g. 0000:01:00.0 (`kvtier nvme list` shows them)"
        ))
    };
    let b = addr.as_bytes();
    if b.len() != 12 || b[4] != b':' || b[7] != b':' || b[10] != b'.' {
        return Err(bad("expected the form DDDD:BB:DD.F"));
    }
    let hex = |r: std::ops::Range<usize>| -> Option<u32> {
        let s = &addr[r];
        if s.bytes().all(|c| c.is_ascii_hexdigit()) {
            u32::from_str_radix(s, 16).ok()
        } else {
            None
        }
    };
    let (Some(_domain), Some(_bus), Some(device), Some(function)) =
        (hex(0..4), hex(5..7), hex(8..10), hex(11..12))
    else {
        return Err(bad("domain, bus, device and function must be hexadecimal"));
    };
    if device > 0x1f {
        return Err(bad("the device number is at most 1f"));
    }
    if function > 7 {
        return Err(bad("the function number is at most 7"));
    }
    Ok(addr.to_ascii_lowercase())
}

/// What kvtier needs from the kernel besides reading sysfs files (which it
/// reads under [`Kernel::root`] directly).
trait Kernel: Send {
    /// The sysfs mount point: `/sys`, or a fake tree in the tests.
    fn root(&self) -> &Path;
    /// Writes `value` to the sysfs attribute `path` (one write, as sysfs wants).
    fn write(&mut self, path: &Path, value: &str) -> io::Result<()>;
    /// Loads a kernel module.
    fn modprobe(&mut self, module: &str) -> std::result::Result<(), String>;
    /// How the block device `name` (sysfs directory `dir`), one of its
    /// partitions or a device stacked on it is in use: mounted or swap.
    fn block_use(&self, name: &str, dir: &Path) -> Result<Option<String>>;
    /// The first bytes of block device `name` (sysfs directory `dir`), read
    /// through an exclusive open so that a device the kernel holds (mounted,
    /// swap, md/dm member) shows up as busy.
    fn block_head(&self, name: &str, dir: &Path) -> Result<Vec<u8>>;
}

/// The running kernel: `/sys`, `/dev`, `/proc/self/mountinfo`, `modprobe`.
struct SysKernel {
    root: PathBuf,
}

fn sysfs_dev(dir: &Path) -> Result<(u64, u64)> {
    let p = dir.join("dev");
    let text =
        fs::read_to_string(&p).map_err(|e| Error::io(format!("reading {}", p.display()), e))?;
    text.trim()
        .split_once(':')
        .and_then(|(a, b)| Some((a.parse().ok()?, b.parse().ok()?)))
        .ok_or_else(|| {
            Error::invalid(format!(
                "{}: '{}' is not MAJOR:MINOR",
                p.display(),
                text.trim()
            ))
        })
}

impl Kernel for SysKernel {
    fn root(&self) -> &Path {
        &self.root
    }

    fn write(&mut self, path: &Path, value: &str) -> io::Result<()> {
        // No O_CREAT, no O_TRUNC: sysfs attributes exist or the kernel has no
        // such knob; a single write(2) is what the attribute's store sees.
        let mut f = OpenOptions::new().write(true).open(path)?;
        f.write_all(value.as_bytes())
    }

    fn modprobe(&mut self, module: &str) -> std::result::Result<(), String> {
        match std::process::Command::new("modprobe").arg(module).output() {
            Ok(out) if out.status.success() => Ok(()),
            Ok(out) => Err(format!(
                "`modprobe {module}` failed ({}): {}",
                out.status,
                String::from_utf8_lossy(&out.stderr).trim()
            )),
            Err(e) => Err(format!("cannot run modprobe: {e}")),
        }
    }

    fn block_use(&self, _name: &str, dir: &Path) -> Result<Option<String>> {
        let (maj, min) = sysfs_dev(dir)?;
        let devices = related_devices(libc::makedev(maj as u32, min as u32));
        Ok(find_use(&devices)?.map(|u| u.describe()))
    }

    fn block_head(&self, name: &str, dir: &Path) -> Result<Vec<u8>> {
        let node = PathBuf::from(format!("/dev/{name}"));
        let (maj, min) = sysfs_dev(dir)?;
        let meta = fs::metadata(&node).map_err(|e| {
            Error::io(
                format!(
                    "cannot check {} for a filesystem (is devtmpfs mounted on /dev?)",
                    node.display()
                ),
                e,
            )
        })?;
        if !meta.file_type().is_block_device()
            || (
                libc::major(meta.rdev()) as u64,
                libc::minor(meta.rdev()) as u64,
            ) != (maj, min)
        {
            return Err(Error::invalid(format!(
                "{} is not block device {maj}:{min} as sysfs says; cannot check it for a filesystem",
                node.display()
            )));
        }
        // O_EXCL on a block device: EBUSY when a filesystem, swap, md or dm
        // (or another program with O_EXCL) has it.
        let file: File = OpenOptions::new()
            .read(true)
            .custom_flags(libc::O_EXCL)
            .open(&node)
            .map_err(|e| {
                if e.raw_os_error() == Some(libc::EBUSY) {
                    Error::invalid(format!(
                        "{} is busy: the kernel or a program holds it exclusively (mounted, \
                         swap, an md/dm member or open with O_EXCL)",
                        node.display()
                    ))
                } else {
                    Error::io(
                        format!("opening {} to check for a filesystem", node.display()),
                        e,
                    )
                }
            })?;
        read_head(&file, u64::MAX)
            .map_err(|e| Error::io(format!("reading the head of {}", node.display()), e))
    }
}

/// One block device of a controller: a namespace or one of its partitions.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BlockDevice {
    /// Kernel name (`nvme0n1`, `nvme0n1p2`).
    pub name: String,
    /// The namespace it is, or belongs to.
    pub namespace: String,
    /// Why binding must not go ahead without `--force`: mounted, swap,
    /// held, busy, a filesystem or partition table. Empty when it is free.
    pub problems: Vec<String>,
    /// What its first bytes hold, when they could be read.
    pub signature: Option<Signature>,
}

/// An NVMe controller (or another PCI function of class 0x0108xx) as `kvtier nvme list` shows it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NvmeController {
    /// Its PCI address.
    pub addr: String,
    /// `vvvv:dddd`.
    pub id: String,
    /// PCI class code.
    pub class: u32,
    /// The kernel driver bound to it.
    pub driver: Option<String>,
    /// Its namespaces' block devices and their partitions (only while the
    /// kernel nvme driver has it).
    pub block_devices: Vec<BlockDevice>,
}

fn read_attr(path: &Path) -> Result<String> {
    fs::read_to_string(path)
        .map(|s| s.trim().to_string())
        .map_err(|e| Error::io(format!("reading {}", path.display()), e))
}

fn sorted_names(dir: &Path) -> Vec<String> {
    dir_names(dir).unwrap_or_default()
}

/// `nvme<digits>n<digits>` (a namespace) or `nvme<digits>c<digits>n<digits>`
/// (the hidden per-controller path of a multipath namespace, whose visible
/// block device is `nvme<subsys>n<ns>`). Returns the visible name.
fn namespace_name(entry: &str) -> Option<String> {
    let rest = entry.strip_prefix("nvme")?;
    let digits = |s: &str| !s.is_empty() && s.bytes().all(|c| c.is_ascii_digit());
    let (head, ns) = rest.split_once('n')?;
    if !digits(ns) {
        return None;
    }
    match head.split_once('c') {
        Some((subsys, ctrl)) if digits(subsys) && digits(ctrl) => {
            Some(format!("nvme{subsys}n{ns}"))
        }
        None if digits(head) => Some(format!("nvme{head}n{ns}")),
        _ => None,
    }
}

/// The sysfs directories of the block devices of the namespaces the kernel
/// nvme driver made for the controller in `dev_dir`: each namespace, then
/// its partitions. (namespace, name, dir).
fn namespace_devices(root: &Path, dev_dir: &Path) -> Vec<(String, String, PathBuf)> {
    let mut namespaces: Vec<(String, PathBuf)> = Vec::new();
    let nvme_dir = dev_dir.join("nvme");
    for ctrl in sorted_names(&nvme_dir) {
        for entry in sorted_names(&nvme_dir.join(&ctrl)) {
            let Some(name) = namespace_name(&entry) else {
                continue;
            };
            if namespaces.iter().any(|(n, _)| *n == name) {
                continue;
            }
            // /sys/class/block/NAME is the visible disk (for a multipath
            // path device, the shared head); without it, the entry itself.
            let class_dir = root.join("class/block").join(&name);
            let dir = if class_dir.exists() {
                class_dir
            } else {
                nvme_dir.join(&ctrl).join(&entry)
            };
            namespaces.push((name, dir));
        }
    }
    let mut out = Vec::new();
    for (ns, dir) in namespaces {
        out.push((ns.clone(), ns.clone(), dir.clone()));
        for part in sorted_names(&dir) {
            let sub = dir.join(&part);
            if sub.join("partition").exists() {
                out.push((ns.clone(), part, sub));
            }
        }
    }
    out
}

/// Everything that argues against taking the block device away.
fn inspect_block(
    kernel: &dyn Kernel,
    ns: &str,
    name: &str,
    dir: &Path,
    is_namespace: bool,
) -> BlockDevice {
    let mut problems = Vec::new();
    let holders = sorted_names(&dir.join("holders"));
    if !holders.is_empty() {
        problems.push(format!(
            "/dev/{name} is held by {} (a device stacked on it: md RAID or device-mapper); \
             stop that device first",
            holders
                .iter()
                .map(|h| format!("/dev/{h}"))
                .collect::<Vec<_>>()
                .join(", ")
        ));
    }
    // Mounts and swap of the namespace cover its partitions and holders.
    if is_namespace {
        match kernel.block_use(name, dir) {
            Ok(Some(how)) => {
                problems.push(format!("/dev/{name}: {how}; unmount it (or swapoff) first"))
            }
            Ok(None) => {}
            Err(e) => problems.push(format!("cannot tell whether /dev/{name} is mounted: {e}")),
        }
    }
    let mut signature = None;
    match kernel.block_head(name, dir) {
        Ok(head) => {
            let sig = probe_signature(&head);
            if let Signature::Filesystem(_) = sig {
                problems.push(format!(
                    "/dev/{name} holds {sig}; binding the controller to a userspace driver \
                     takes it away from the kernel and kvtier will overwrite it"
                ));
            }
            signature = Some(sig);
        }
        Err(e) => problems.push(e.to_string()),
    }
    BlockDevice {
        name: name.to_string(),
        namespace: ns.to_string(),
        problems,
        signature,
    }
}

fn controller(kernel: &dyn Kernel, addr: &str) -> Result<NvmeController> {
    let dir = kernel.root().join("bus/pci/devices").join(addr);
    let class = parse_class(&read_attr(&dir.join("class"))?).unwrap_or(0);
    let vendor = read_attr(&dir.join("vendor")).unwrap_or_default();
    let device = read_attr(&dir.join("device")).unwrap_or_default();
    let driver = link_name(dir.join("driver"));
    let block_devices = if driver.as_deref() == Some("nvme") {
        namespace_devices(kernel.root(), &dir)
            .into_iter()
            .map(|(ns, name, bdir)| inspect_block(kernel, &ns, &name, &bdir, ns == name))
            .collect()
    } else {
        Vec::new()
    };
    Ok(NvmeController {
        addr: addr.to_string(),
        id: format!(
            "{}:{}",
            vendor.trim_start_matches("0x"),
            device.trim_start_matches("0x")
        ),
        class,
        driver,
        block_devices,
    })
}

fn list_in(kernel: &dyn Kernel) -> Result<Vec<NvmeController>> {
    let addrs = addrs_by_class(kernel.root(), |c| c >> 8 == NVME_CLASS_PREFIX)?;
    addrs.iter().map(|a| controller(kernel, a)).collect()
}

/// The NVMe controllers of this machine (PCI class 0x0108xx), with their
/// drivers and, for those the kernel nvme driver has, their block devices
/// and whether they are mounted or hold a filesystem.
pub fn list_controllers() -> Result<Vec<NvmeController>> {
    list_in(&SysKernel {
        root: PathBuf::from("/sys"),
    })
}

/// A PCI function handed to `vfio-pci` or `uio_pci_generic` for as long as
/// this value lives; dropping it (or [`PciBinding::restore`]) gives it back
/// to the driver it had.
pub struct PciBinding {
    kernel: Box<dyn Kernel>,
    addr: String,
    driver: BindDriver,
    /// The driver the function had before (None: unbound).
    original: Option<String>,
    /// `driver_override` before (None: "(null)").
    original_override: Option<String>,
    /// It already was bound to `driver`: nothing to undo.
    unchanged: bool,
    /// Problems `force` overrode.
    forced: Vec<String>,
    /// Something was written to sysfs (a failed bind has something to undo).
    written: bool,
    done: bool,
}

impl std::fmt::Debug for PciBinding {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PciBinding")
            .field("addr", &self.addr)
            .field("driver", &self.driver)
            .field("original", &self.original)
            .field("unchanged", &self.unchanged)
            .finish()
    }
}

fn write_attr(kernel: &mut dyn Kernel, path: &Path, value: &str) -> Result<()> {
    kernel.write(path, value).map_err(|e| {
        Error::io(
            format!("writing '{}' to {}", value.trim_end(), path.display()),
            e,
        )
    })
}

impl PciBinding {
    /// Hands the PCI function `addr` (`DDDD:BB:DD.F`) to `driver`, after the
    /// checks in the module documentation; `force` turns their refusals into
    /// [`PciBinding::forced`] notes (an invalid address or a missing
    /// function is refused regardless).
    pub fn bind(addr: &str, driver: BindDriver, force: bool) -> Result<PciBinding> {
        Self::bind_with(
            Box::new(SysKernel {
                root: PathBuf::from("/sys"),
            }),
            addr,
            driver,
            force,
        )
    }

    fn bind_with(
        kernel: Box<dyn Kernel>,
        addr: &str,
        driver: BindDriver,
        force: bool,
    ) -> Result<PciBinding> {
        let addr = parse_pci_address(addr)?;
        let dev_dir = kernel.root().join("bus/pci/devices").join(&addr);
        if !dev_dir.exists() {
            return Err(Error::invalid(format!(
                "no PCI function {addr} ({} does not exist); `kvtier nvme list` shows the NVMe controllers",
                dev_dir.display()
            )));
        }
        let ctrl = controller(kernel.as_ref(), &addr)?;
        let mut problems = Vec::new();
        if ctrl.class >> 8 != NVME_CLASS_PREFIX {
            problems.push(format!(
                "{addr} is not an NVMe controller (PCI class {:#08x}, NVMe is 0x0108xx)",
                ctrl.class
            ));
        }
        problems.extend(
            ctrl.block_devices
                .iter()
                .flat_map(|b| b.problems.iter().cloned()),
        );
        if !problems.is_empty() && !force {
            return Err(Error::invalid(format!(
                "refusing to bind {addr} to {}: {}{}",
                driver.name(),
                problems.join("; "),
                if ctrl.block_devices.iter().any(|b| !b.problems.is_empty()) {
                    ". Unmount / stop using the devices first (forced, the data on them may \
                     be lost)"
                } else {
                    ""
                }
            ))
            .with_fix(crate::error::Fix::ForceBind));
        }
        let original_override = {
            let text = read_attr(&dev_dir.join("driver_override"))?;
            (!text.is_empty() && text != "(null)").then_some(text)
        };
        let mut b = PciBinding {
            kernel,
            addr,
            driver,
            original: ctrl.driver.clone(),
            original_override,
            unchanged: ctrl.driver.as_deref() == Some(driver.name()),
            forced: problems,
            written: false,
            done: false,
        };
        if b.unchanged {
            b.done = true;
            return Ok(b);
        }
        if let Err(e) = b.hand_over() {
            // Undo what was done (best effort) and report both.
            b.done = true;
            if !b.written {
                return Err(e);
            }
            return Err(match b.undo() {
                Ok(()) => e,
                Err(undo) => {
                    Error::invalid(format!("{e}; and putting {} back failed: {undo}", b.addr))
                }
            });
        }
        Ok(b)
    }

    fn driver_dir(&self, name: &str) -> PathBuf {
        self.kernel.root().join("bus/pci/drivers").join(name)
    }

    fn dev_dir(&self) -> PathBuf {
        self.kernel.root().join("bus/pci/devices").join(&self.addr)
    }

    fn current_driver(&self) -> Option<String> {
        link_name(self.dev_dir().join("driver"))
    }

    fn ensure_loaded(&mut self, driver: &str, module: &str) -> Result<()> {
        if self.driver_dir(driver).exists() {
            return Ok(());
        }
        let tried = self.kernel.modprobe(module);
        if self.driver_dir(driver).exists() {
            return Ok(());
        }
        Err(Error::invalid(format!(
            "driver {driver} is not loaded ({} does not exist) and loading it failed: {}; \
             load the kernel module {module} (`modprobe {module}`){}",
            self.driver_dir(driver).display(),
            tried
                .err()
                .unwrap_or_else(|| "modprobe succeeded but the driver did not appear".into()),
            if driver == "vfio-pci" {
                ", which also needs the IOMMU on (intel_iommu=on or amd_iommu=on)"
            } else {
                ""
            }
        )))
    }

    /// Binds the function to `driver` and checks that it took.
    fn bind_to(&mut self, driver: &str) -> Result<()> {
        let bind = self.driver_dir(driver).join("bind");
        let addr = self.addr.clone();
        write_attr(self.kernel.as_mut(), &bind, &addr)?;
        match self.current_driver() {
            Some(d) if d == driver => Ok(()),
            other => Err(Error::invalid(format!(
                "{addr}: after writing to {} its driver is {}, not {driver}",
                bind.display(),
                other.as_deref().unwrap_or("none")
            ))),
        }
    }

    fn unbind_current(&mut self) -> Result<()> {
        if let Some(cur) = self.current_driver() {
            let unbind = self.driver_dir(&cur).join("unbind");
            let addr = self.addr.clone();
            write_attr(self.kernel.as_mut(), &unbind, &addr)?;
            if let Some(still) = self.current_driver() {
                return Err(Error::invalid(format!(
                    "{addr}: still bound to {still} after writing to {}",
                    unbind.display()
                )));
            }
        }
        Ok(())
    }

    fn hand_over(&mut self) -> Result<()> {
        let (name, module) = (self.driver.name(), self.driver.module());
        self.ensure_loaded(name, module)?;
        let ovr = self.dev_dir().join("driver_override");
        self.written = true;
        write_attr(self.kernel.as_mut(), &ovr, name)?;
        self.unbind_current()?;
        self.bind_to(name)
    }

    /// Back to the state before: no userspace driver, the old override, the old driver.
    fn undo(&mut self) -> Result<()> {
        match self.current_driver() {
            Some(d) if d == self.driver.name() => self.unbind_current()?,
            None => {}
            Some(other) if Some(&other) == self.original.as_ref() => {}
            Some(other) => {
                return Err(Error::invalid(format!(
                    "{} is bound to {other}, not {} as kvtier left it; leaving it alone",
                    self.addr,
                    self.driver.name()
                )))
            }
        }
        // An empty line clears driver_override.
        let ovr = self.dev_dir().join("driver_override");
        let value = format!("{}\n", self.original_override.as_deref().unwrap_or(""));
        write_attr(self.kernel.as_mut(), &ovr, &value)?;
        if let Some(orig) = self.original.clone() {
            if self.current_driver().as_ref() != Some(&orig) {
                self.ensure_loaded(&orig, &orig)?;
                self.bind_to(&orig)?;
            }
        }
        Ok(())
    }

    /// Gives the function back to its original driver (or leaves it
    /// unbound if it had none), reporting what failed.
    pub fn restore(mut self) -> Result<()> {
        self.done = true;
        if self.unchanged {
            return Ok(());
        }
        self.undo()
    }

    /// The PCI address, lower-cased.
    pub fn addr(&self) -> &str {
        &self.addr
    }

    /// The driver the function is bound to now.
    pub fn driver(&self) -> BindDriver {
        self.driver
    }

    /// The driver it had before (and gets back), if any.
    pub fn original_driver(&self) -> Option<&str> {
        self.original.as_deref()
    }

    /// It was bound to the requested driver already: nothing was done and
    /// nothing will be undone.
    pub fn was_already_bound(&self) -> bool {
        self.unchanged
    }

    /// The refusals `force` overrode (empty without force or when there were none).
    pub fn forced(&self) -> &[String] {
        &self.forced
    }
}

impl Drop for PciBinding {
    fn drop(&mut self) {
        if !self.done {
            self.done = true;
            if let Err(e) = self.undo() {
                {
                    // Never panics on a closed stderr: this runs while giving a device back.
                    use std::io::Write as _;
                    let _ = writeln!(
                        std::io::stderr(),
                        "kvtier: giving {} back to its driver: {e}",
                        self.addr
                    );
                }
            }
        }
    }
}

#[cfg(test)]
mod tests;
