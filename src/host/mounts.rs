//! Who else uses a device, from the kernel's tables: mounts (/proc/self/mountinfo),
//! active swap areas (/proc/swaps), loop devices' backing files and the devices stacked
//! on a block device (sysfs partitions and holders).

use std::fs;
use std::os::unix::fs::{FileTypeExt, MetadataExt};
use std::path::{Path, PathBuf};

use crate::error::{IoContext, Result};

pub(crate) fn dev_major(rdev: u64) -> u64 {
    libc::major(rdev) as u64
}

pub(crate) fn dev_minor(rdev: u64) -> u64 {
    libc::minor(rdev) as u64
}

fn parse_maj_min(text: &str) -> Option<(u64, u64)> {
    let (maj, min) = text.trim().split_once(':')?;
    Some((maj.parse().ok()?, min.parse().ok()?))
}

/// Undo the octal escapes (`\040` for space etc.) of /proc/self/mountinfo and /proc/swaps.
fn unescape_octal(field: &str) -> String {
    let bytes = field.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'\\' && i + 4 <= bytes.len() {
            let digits = &bytes[i + 1..i + 4];
            if digits.iter().all(|d| (b'0'..=b'7').contains(d)) {
                let value = digits
                    .iter()
                    .fold(0u32, |acc, d| acc * 8 + u32::from(d - b'0'));
                if let Ok(byte) = u8::try_from(value) {
                    out.push(byte);
                    i += 4;
                    continue;
                }
            }
        }
        out.push(bytes[i]);
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// How a block device is in use by the system.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct InUse {
    /// Mount point, or "[SWAP]" for an active swap area.
    pub(crate) mount_point: String,
    /// The related device through which it is in use (a partition or a holder), if not the
    /// named device itself.
    via: Option<String>,
}

impl InUse {
    pub(crate) fn describe(&self) -> String {
        let what = if self.mount_point == "[SWAP]" {
            "is an active swap area".to_string()
        } else {
            format!("is mounted at {}", self.mount_point)
        };
        match &self.via {
            Some(via) => format!("{via} {what}"),
            None => format!("it {what}"),
        }
    }
}

/// The device itself (major, minor) plus, through sysfs, its partitions and the devices
/// stacked on it (holders: device-mapper, md, bcache), transitively. Each with a name.
pub(crate) fn related_devices(rdev: u64) -> Vec<((u64, u64), Option<String>)> {
    let mut out: Vec<((u64, u64), Option<String>)> =
        vec![((dev_major(rdev), dev_minor(rdev)), None)];
    let mut next = 0;
    while next < out.len() && out.len() < 256 {
        let ((maj, min), _) = out[next];
        next += 1;
        let dir = PathBuf::from(format!("/sys/dev/block/{maj}:{min}"));
        let mut found: Vec<((u64, u64), String)> = Vec::new();
        // Partitions: subdirectories with a `partition` file.
        if let Ok(entries) = fs::read_dir(&dir) {
            for entry in entries.flatten() {
                let sub = entry.path();
                if sub.join("partition").exists() {
                    if let Some(dev) = fs::read_to_string(sub.join("dev"))
                        .ok()
                        .and_then(|s| parse_maj_min(&s))
                    {
                        found.push((
                            dev,
                            format!("its partition /dev/{}", entry.file_name().to_string_lossy()),
                        ));
                    }
                }
            }
        }
        // Holders: links to the block devices stacked on this one.
        if let Ok(entries) = fs::read_dir(dir.join("holders")) {
            for entry in entries.flatten() {
                let name = entry.file_name().to_string_lossy().into_owned();
                if let Some(dev) = fs::read_to_string(format!("/sys/class/block/{name}/dev"))
                    .ok()
                    .and_then(|s| parse_maj_min(&s))
                {
                    found.push((dev, format!("/dev/{name}, a device stacked on it,")));
                }
            }
        }
        for (dev, name) in found {
            if !out.iter().any(|(d, _)| *d == dev) {
                out.push((dev, Some(name)));
            }
        }
    }
    out
}

/// Is any of `devices` mounted (by major:minor, or by a mount source that is that device
/// node, which catches btrfs's anonymous device numbers) or an active swap area?
pub(crate) fn find_use(devices: &[((u64, u64), Option<String>)]) -> Result<Option<InUse>> {
    let lookup = |dev: (u64, u64)| devices.iter().find(|(d, _)| *d == dev).map(|(_, n)| n);
    let lookup_source = |source: &str| -> Option<&Option<String>> {
        if !source.starts_with('/') {
            return None;
        }
        let meta = fs::metadata(source).ok()?;
        if !meta.file_type().is_block_device() {
            return None;
        }
        lookup((dev_major(meta.rdev()), dev_minor(meta.rdev())))
    };

    let mountinfo = fs::read_to_string("/proc/self/mountinfo")
        .context(|| "reading /proc/self/mountinfo".to_string())?;
    for line in mountinfo.lines() {
        let fields: Vec<&str> = line.split(' ').collect();
        if fields.len() < 5 {
            continue;
        }
        let mount_point = unescape_octal(fields[4]);
        let source = fields
            .iter()
            .position(|f| *f == "-")
            .and_then(|sep| fields.get(sep + 2))
            .map(|s| unescape_octal(s));
        let hit = parse_maj_min(fields[2])
            .and_then(&lookup)
            .or_else(|| source.as_deref().and_then(lookup_source));
        if let Some(via) = hit {
            return Ok(Some(InUse {
                mount_point,
                via: via.clone(),
            }));
        }
    }

    // Active swap areas are not in mountinfo. /proc/swaps may be absent (no swap support).
    if let Ok(swaps) = fs::read_to_string("/proc/swaps") {
        for line in swaps.lines().skip(1) {
            let Some(name) = line.split_whitespace().next() else {
                continue;
            };
            if let Some(via) = lookup_source(&unescape_octal(name)) {
                return Ok(Some(InUse {
                    mount_point: "[SWAP]".to_string(),
                    via: via.clone(),
                }));
            }
        }
    }
    Ok(None)
}

/// How the block device at `path` (with metadata `meta`) is in use, if it is.
pub(crate) fn block_device_use(meta: &fs::Metadata) -> Result<Option<InUse>> {
    find_use(&related_devices(meta.rdev()))
}

/// How the regular file `meta` is in use by the system: backing a loop device, or an
/// active swap file.
pub(crate) fn regular_file_use(meta: &fs::Metadata) -> Option<String> {
    let same_file = |p: &Path| {
        fs::metadata(p)
            .map(|m| m.dev() == meta.dev() && m.ino() == meta.ino())
            .unwrap_or(false)
    };
    if let Ok(entries) = fs::read_dir("/sys/block") {
        for entry in entries.flatten() {
            let name = entry.file_name().to_string_lossy().into_owned();
            if !name.starts_with("loop") {
                continue;
            }
            let Ok(backing) = fs::read_to_string(entry.path().join("loop/backing_file")) else {
                continue;
            };
            let backing = backing.trim_end_matches('\n');
            if !backing.is_empty() && same_file(Path::new(backing)) {
                return Some(format!(
                    "it is the backing file of loop device /dev/{name}; detach it first \
                     (`losetup -d /dev/{name}`)"
                ));
            }
        }
    }
    if let Ok(swaps) = fs::read_to_string("/proc/swaps") {
        for line in swaps.lines().skip(1) {
            if let Some(name) = line.split_whitespace().next() {
                if same_file(Path::new(&unescape_octal(name))) {
                    return Some("it is an active swap file; swapoff it first".to_string());
                }
            }
        }
    }
    None
}

/// Is this path (a block device) mounted, or is any partition of it (or a device-mapper /
/// md device stacked on it) mounted, or an active swap area? Returns the mount point if so
/// (`"[SWAP]"` for swap). A path that is not a block device is never mounted: `Ok(None)`.
pub fn mounted_at(path: &Path) -> Result<Option<String>> {
    let meta = fs::metadata(path).context(|| format!("stat {}", path.display()))?;
    if !meta.file_type().is_block_device() {
        return Ok(None);
    }
    Ok(block_device_use(&meta)?.map(|u| u.mount_point))
}

/// (source, mount point, filesystem type) of the mount that holds `path` (canonical):
/// the longest mount point that is a prefix of it.
pub fn mount_of(path: &Path) -> Option<(String, String, String)> {
    let text = fs::read_to_string("/proc/self/mounts").ok()?;
    let mut best: Option<(String, String, String)> = None;
    for line in text.lines() {
        let f: Vec<&str> = line.split_whitespace().collect();
        if f.len() < 3 {
            continue;
        }
        let mp = unescape_octal(f[1]);
        if path.starts_with(&mp) && best.as_ref().is_none_or(|b| mp.len() >= b.1.len()) {
            best = Some((unescape_octal(f[0]), mp, f[2].to_string()));
        }
    }
    best
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn helpers() {
        assert_eq!(unescape_octal(r"/mnt/a\040b\134c"), r"/mnt/a b\c");
        assert_eq!(unescape_octal(r"/x\04"), r"/x\04");
        assert_eq!(parse_maj_min("254:0\n"), Some((254, 0)));
        assert_eq!(parse_maj_min("junk"), None);
        assert_eq!(unescape_octal("/mnt/a\\040b"), "/mnt/a b");
        assert_eq!(unescape_octal("/plain"), "/plain");
        assert_eq!(unescape_octal("/end\\04"), "/end\\04");
    }

    /// An escape above \377 is not a byte: kept as text, never an overflow (the
    /// doctor's copy of this parser once computed it in a u8 and panicked).
    #[test]
    fn octal_escapes_beyond_a_byte_are_kept_verbatim() {
        assert_eq!(unescape_octal(r"/mnt/\777x"), r"/mnt/\777x");
        assert_eq!(unescape_octal(r"\400"), r"\400");
        assert_eq!(unescape_octal(r"a\377"), "a\u{fffd}");
        assert_eq!(unescape_octal(r"tab\011end\"), "tab\tend\\");
    }

    #[test]
    fn the_root_directory_has_a_mount() {
        let (_, mp, fstype) = mount_of(Path::new("/")).expect("/proc/self/mounts holds /");
        assert_eq!(mp, "/");
        assert!(!fstype.is_empty());
    }
}
