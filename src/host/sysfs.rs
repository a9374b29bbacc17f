//! Small readers for the kernel's text files (/sys, /proc): a missing or unreadable file
//! is `None`, for the caller to report, never an error that stops a probe.

use std::fs;
use std::path::Path;

/// The file's text without surrounding white space.
pub fn read_trim(path: impl AsRef<Path>) -> Option<String> {
    fs::read_to_string(path).ok().map(|s| s.trim().to_string())
}

/// Sorted names in a directory; `None` when it cannot be read.
pub fn dir_names(path: impl AsRef<Path>) -> Option<Vec<String>> {
    let mut v: Vec<String> = fs::read_dir(path)
        .ok()?
        .filter_map(|e| e.ok())
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .collect();
    v.sort();
    Some(v)
}

/// The name of the link's target (the driver bound to a device, ...).
pub fn link_name(path: impl AsRef<Path>) -> Option<String> {
    fs::read_link(path)
        .ok()
        .and_then(|t| t.file_name().map(|n| n.to_string_lossy().into_owned()))
}
