//! Facts about the host kvtier runs on, read from the kernel's files and a few syscalls:
//! PCI functions in sysfs ([`pci`]), who uses a block device or file ([`mounts`]), whether memory is writable ([`maps`]), what a
//! device holds ([`signature`]), direct I/O alignment and buffers ([`dio`]), which of a file's space was
//! never written ([`extents`]), and byte
//! sizes for people ([`size`]). The pool, the NVMe binder, the engines and `kvtier doctor` all
//! ask here, so each fact is read one way.

pub mod dio;
pub mod extents;
pub mod maps;
pub mod mounts;
pub mod pci;
pub mod signature;
pub mod size;
pub mod sysfs;

/// What kind of file `ft` is, for messages: "a directory", "a FIFO", ...
pub fn file_kind(ft: &std::fs::FileType) -> &'static str {
    use std::os::unix::fs::FileTypeExt;
    if ft.is_file() {
        "a regular file"
    } else if ft.is_dir() {
        "a directory"
    } else if ft.is_fifo() {
        "a FIFO"
    } else if ft.is_char_device() {
        "a character device"
    } else if ft.is_block_device() {
        "a block device"
    } else if ft.is_socket() {
        "a socket"
    } else if ft.is_symlink() {
        "a symbolic link"
    } else {
        "an unknown kind of file"
    }
}

/// MemTotal and MemAvailable from /proc/meminfo, bytes.
fn meminfo(field: &str) -> Option<u64> {
    let text = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = text.lines().find(|l| l.starts_with(field))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    kib.checked_mul(1024)
}

/// The machine's memory (MemTotal), when /proc/meminfo says.
pub fn mem_total() -> Option<u64> {
    meminfo("MemTotal:")
}

/// Memory available without swapping (MemAvailable), when /proc/meminfo says.
pub fn mem_available() -> Option<u64> {
    meminfo("MemAvailable:")
}
