//! PCI functions as sysfs shows them (/sys/bus/pci/devices): addresses, classes, bound
//! drivers and BAR sizes. Used by the userspace NVMe drivers (uio, vfio), the binder and
//! `doctor`.

use super::sysfs::{dir_names, link_name, read_trim};
use crate::error::{Error, Result};
use std::fs;
use std::path::{Path, PathBuf};

/// The sysfs directory of PCI function `addr`, after checking that `addr`
/// is a PCI address (`DDDD:BB:DD.F`, or `BB:DD.F` for domain 0) and nothing
/// else.
pub fn pci_device_dir(addr: &str) -> Result<PathBuf> {
    let full = if addr.len() == 7 {
        format!("0000:{addr}")
    } else {
        addr.to_string()
    };
    let b = full.as_bytes();
    let ok = b.len() == 12
        && b[4] == b':'
        && b[7] == b':'
        && b[10] == b'.'
        && b.iter()
            .enumerate()
            .all(|(i, c)| matches!(i, 4 | 7 | 10) || c.is_ascii_hexdigit())
        && (b'0'..=b'7').contains(&b[11]);
    if !ok {
        return Err(Error::invalid(format!(
            "'{addr}' is not a PCI address (expected DDDD:BB:DD.F, e.g. 0000:00:04.0)"
        )));
    }
    Ok(Path::new("/sys/bus/pci/devices").join(full.to_ascii_lowercase()))
}

/// The kernel driver bound to the PCI function in `dir`, if any.
pub fn bound_driver(dir: &Path) -> Option<String> {
    link_name(dir.join("driver"))
}

/// PCI functions of class `class` (e.g. `0x010802`, NVMe), by address.
pub fn find_pci_class(class: u32) -> Result<Vec<String>> {
    addrs_by_class(Path::new("/sys"), |c| c == class)
}

/// Addresses of the PCI functions under `sys_root` (`/sys`, or a stand-in tree in tests)
/// whose class `want` accepts, sorted.
pub(crate) fn addrs_by_class(sys_root: &Path, want: impl Fn(u32) -> bool) -> Result<Vec<String>> {
    let dir = sys_root.join("bus/pci/devices");
    let entries =
        fs::read_dir(&dir).map_err(|e| Error::io(format!("reading {}", dir.display()), e))?;
    let mut out: Vec<String> = entries
        .flatten()
        .filter(|e| {
            fs::read_to_string(e.path().join("class"))
                .ok()
                .and_then(|c| parse_class(&c))
                .is_some_and(&want)
        })
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .collect();
    out.sort();
    Ok(out)
}

/// A sysfs `class` file's value (`0x010802`).
pub(crate) fn parse_class(text: &str) -> Option<u32> {
    u32::from_str_radix(text.trim().trim_start_matches("0x"), 16).ok()
}

/// A PCI function from /sys/bus/pci/devices.
pub struct PciDev {
    /// Its address, `DDDD:BB:DD.F`.
    pub addr: String,
    /// The `device` file (`0x2330`...).
    pub device_id: String,
    /// The kernel driver bound to it.
    pub driver: Option<String>,
    /// Its sysfs directory.
    pub sysfs: PathBuf,
}

/// PCI functions of this vendor (or any, `None`) whose class starts with `class_prefix`.
pub fn devices(vendor: Option<&str>, class_prefix: &str) -> Option<Vec<PciDev>> {
    let base = Path::new("/sys/bus/pci/devices");
    let names = dir_names(base)?;
    let mut out = Vec::new();
    for n in names {
        let p = base.join(&n);
        let v = read_trim(p.join("vendor")).unwrap_or_default();
        let c = read_trim(p.join("class")).unwrap_or_default();
        if vendor.is_some_and(|want| v != want) || !c.starts_with(class_prefix) {
            continue;
        }
        out.push(PciDev {
            device_id: read_trim(p.join("device")).unwrap_or_default(),
            driver: link_name(p.join("driver")),
            addr: n,
            sysfs: p,
        });
    }
    Some(out)
}

/// Size of BAR `index` from a PCI device's `resource` file (one "start end
/// flags" line of hex per resource); `None` when unassigned or unreadable.
pub fn bar_size(dev: &Path, index: usize) -> Option<u64> {
    let text = fs::read_to_string(dev.join("resource")).ok()?;
    let line = text.lines().nth(index)?;
    let mut f = line.split_whitespace();
    let parse = |s: &str| u64::from_str_radix(s.trim_start_matches("0x"), 16).ok();
    let start = parse(f.next()?)?;
    let end = parse(f.next()?)?;
    (end > start).then(|| end - start + 1)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pci_addresses_are_checked() {
        assert_eq!(
            pci_device_dir("0000:00:04.0").unwrap(),
            Path::new("/sys/bus/pci/devices/0000:00:04.0")
        );
        assert_eq!(
            pci_device_dir("00:1F.7").unwrap(),
            Path::new("/sys/bus/pci/devices/0000:00:1f.7")
        );
        for bad in [
            "",
            "../../etc",
            "0000:00:04.8",
            "0000:00:04",
            "0000/00:04.0",
            "0000:00:04.0/x",
            "zz:00.0",
        ] {
            let err = pci_device_dir(bad).unwrap_err().to_string();
            assert!(err.contains("not a PCI address"), "{bad}: {err}");
        }
    }

    #[test]
    fn bar_sizes_from_resource_file() {
        let dir = std::env::temp_dir().join(format!("kvtier-doctor-bar-{}", std::process::id()));
        fs::create_dir_all(&dir).unwrap();
        fs::write(
            dir.join("resource"),
            "0x00000000fb000000 0x00000000fbffffff 0x0000000000040200\n\
             0x0000038000000000 0x00000387ffffffff 0x000000000014220c\n\
             0x0000000000000000 0x0000000000000000 0x0000000000000000\n",
        )
        .unwrap();
        assert_eq!(bar_size(&dir, 0), Some(16 << 20));
        assert_eq!(bar_size(&dir, 1), Some(32 << 30));
        assert_eq!(bar_size(&dir, 2), None);
        assert_eq!(bar_size(&dir, 9), None);
        fs::remove_dir_all(&dir).unwrap();
    }
}
