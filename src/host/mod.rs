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

/// `(major, minor)` of a kernel release string (`6.8.0-45-generic`, the
/// text of /proc/sys/kernel/osrelease).
pub fn kernel_version(release: &str) -> Option<(u32, u32)> {
    let mut it = release.trim().split(['.', '-']);
    let major = it.next()?.parse().ok()?;
    let minor = it.next()?.parse().ok()?;
    Some((major, minor))
}

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

/// Whether `c` must not reach a terminal raw: C0 and C1 control characters
/// (ESC starts terminal sequences, U+009B is a one-character CSI), DEL, and
/// the bidirectional overrides that reorder what a reader sees.
fn unsafe_for_terminal(c: char) -> bool {
    c.is_control() || matches!(c, '\u{202a}'..='\u{202e}' | '\u{2066}'..='\u{2069}')
}

/// `s` with every control character but newline and tab escaped as
/// `\uXXXX` (also a valid JSON escape of the same character, so a JSON
/// document passed through stays the same document), for messages that may
/// quote superblocks, configs and arguments.
pub fn printable(s: &str) -> std::borrow::Cow<'_, str> {
    escape_if(s, |c| c != '\n' && c != '\t' && unsafe_for_terminal(c))
}

/// [`printable`] for one line: newlines and tabs escaped too (a field read
/// from a device or a config, quoted inside a message).
pub fn printable_line(s: &str) -> std::borrow::Cow<'_, str> {
    escape_if(s, unsafe_for_terminal)
}

fn escape_if(s: &str, bad: impl Fn(char) -> bool) -> std::borrow::Cow<'_, str> {
    if !s.chars().any(&bad) {
        return std::borrow::Cow::Borrowed(s);
    }
    let mut out = String::with_capacity(s.len() + 8);
    for c in s.chars() {
        if bad(c) {
            out.push_str(&format!("\\u{:04x}", c as u32));
        } else {
            out.push(c);
        }
    }
    std::borrow::Cow::Owned(out)
}

#[cfg(test)]
mod printable_tests {
    use super::*;

    #[test]
    fn control_characters_are_escaped() {
        assert_eq!(printable("plain\ttext\n"), "plain\ttext\n");
        assert_eq!(printable("a\u{1b}[31mred"), "a\\u001b[31mred");
        assert_eq!(
            printable("\u{9b}2J\u{7f}\u{202e}"),
            "\\u009b2J\\u007f\\u202e"
        );
        assert_eq!(printable_line("two\nlines\r"), "two\\u000alines\\u000d");
        // A JSON document stays the same document.
        let doc = serde_json::json!({"ns": "a\u{85}b\u{1b}"}).to_string();
        let back: serde_json::Value = serde_json::from_str(&printable(&doc)).unwrap();
        assert_eq!(back["ns"], "a\u{85}b\u{1b}");
    }
}
