//! The backing devices of a pool: regular files or block devices, each one "an SSD".
//!
//! This module (with the io_uring engine) is the only place that makes raw syscalls and
//! ioctls for the devices; everything above it is safe Rust. It enforces the rules that
//! keep kvtier from destroying data it was not given:
//!
//! * kvtier opens only the path it was named, nothing else.
//! * A block device that is mounted (itself, one of its partitions, or a device-mapper /
//!   md device stacked on it), an active swap area, or held exclusively by anyone else is
//!   refused, with or without `force`. A regular file that backs a loop device or is an
//!   active swap file is refused the same way.
//! * A device or file that holds a recognised filesystem, partition table or volume
//!   signature, any other non-zero data (anywhere, not only in its head), or a kvtier pool
//!   (reformatting loses its blocks) is refused unless `force` is set; the error names the
//!   device, what was found, and the fix.
//! * Every open device carries a `flock` while it is open (exclusive to create or serve,
//!   shared to inspect): a second process is refused with the holder's pid.
//! * A backing file is never made larger than asked, and never truncated without `force`.
//!
//! All I/O on an open [`BackingDevice`] is positional direct I/O (`O_DIRECT`) through
//! [`AlignedBuf`]s, so the page cache never holds KV data and offsets/lengths are always
//! multiples of [`DIRECT_IO_ALIGN`].

use std::fs::{self, File, OpenOptions};
use std::io::{self, ErrorKind};
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, RawFd};
use std::os::unix::fs::{FileExt, FileTypeExt, MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

use nix::errno::Errno;
use nix::fcntl::{FallocateFlags, FcntlArg, OFlag};

use crate::error::{Error, IoContext, Result};
use crate::host::dio::{dio_align, AlignedBuf, DIRECT_IO_ALIGN};
use crate::host::mounts::{block_device_use, dev_major, dev_minor, regular_file_use};
use crate::host::signature::{probe_signature, read_head, Signature, SIGNATURE_PROBE_BYTES};
use crate::host::size::human_bytes as human;

/// Which kind of thing backs a pool device.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BackingKind {
    File,
    BlockDevice,
}

// ---------------------------------------------------------------------------------------
// Raw syscalls and ioctls, each in a small function.
// ---------------------------------------------------------------------------------------

mod ioctls {
    // <linux/fs.h>: BLKGETSIZE64 = _IOR(0x12, 114, size_t); the kernel writes a u64.
    nix::ioctl_read!(blkgetsize64, 0x12, 114, u64);
    // BLKSSZGET = _IO(0x12, 104), writes an int.
    nix::ioctl_read_bad!(blksszget, 0x1268, libc::c_int);
    // BLKROGET = _IO(0x12, 94), writes an int.
    nix::ioctl_read_bad!(blkroget, 0x125e, libc::c_int);
    // BLKRRPART = _IO(0x12, 95): re-read the partition table.
    nix::ioctl_none_bad!(blkrrpart, 0x125f);
}

/// Size in bytes of the block device open as `file`.
fn block_device_size(file: &File) -> io::Result<u64> {
    let mut size: u64 = 0;
    // SAFETY: BLKGETSIZE64 writes one u64 through the pointer, which points to a live
    // local; the fd stays open for the duration of the call.
    unsafe { ioctls::blkgetsize64(file.as_raw_fd(), &mut size) }.map_err(io::Error::from)?;
    Ok(size)
}

/// Logical block size of the block device open as `file`.
fn block_device_logical_block_size(file: &File) -> io::Result<u32> {
    let mut lbs: libc::c_int = 0;
    // SAFETY: BLKSSZGET writes one c_int through the pointer, a live local; fd is open.
    unsafe { ioctls::blksszget(file.as_raw_fd(), &mut lbs) }.map_err(io::Error::from)?;
    u32::try_from(lbs).map_err(|_| io::Error::other(format!("BLKSSZGET returned {lbs}")))
}

/// Is the block device open as `file` read-only?
fn block_device_read_only(file: &File) -> io::Result<bool> {
    let mut ro: libc::c_int = 0;
    // SAFETY: BLKROGET writes one c_int through the pointer, a live local; fd is open.
    unsafe { ioctls::blkroget(file.as_raw_fd(), &mut ro) }.map_err(io::Error::from)?;
    Ok(ro != 0)
}

/// Ask the kernel to re-read the partition table (best effort: drops stale partitions
/// after a forced overwrite of a partitioned disk).
fn block_device_reread_partitions(file: &File) -> io::Result<()> {
    // SAFETY: BLKRRPART takes no argument; the fd is open for the call.
    unsafe { ioctls::blkrrpart(file.as_raw_fd()) }.map_err(io::Error::from)?;
    Ok(())
}

/// Turn on O_DIRECT for an open file (fcntl F_SETFL); EINVAL if the filesystem cannot.
fn enable_direct_io(file: &File) -> nix::Result<()> {
    let flags = OFlag::from_bits_retain(nix::fcntl::fcntl(file, FcntlArg::F_GETFL)?);
    nix::fcntl::fcntl(file, FcntlArg::F_SETFL(flags | OFlag::O_DIRECT))?;
    Ok(())
}

/// Allocate `[0, len)` of a regular file (fallocate mode 0: extends, never shrinks).
fn allocate_file(file: &File, len: u64) -> nix::Result<()> {
    let len = libc::off_t::try_from(len).map_err(|_| Errno::EFBIG)?;
    nix::fcntl::fallocate(file, FallocateFlags::empty(), 0, len)
}

// ---------------------------------------------------------------------------------------
// Helpers
// ---------------------------------------------------------------------------------------

fn backing_error(path: &Path, reason: impl Into<String>) -> Error {
    Error::Backing {
        path: path.to_path_buf(),
        reason: reason.into(),
    }
}

/// Bytes of a device past its head that [`data_beyond_head`] reads at most: all of it when
/// the data there is smaller, else evenly spread 1 MiB samples plus the last MiB (where
/// GPT backups and md 0.90/1.0 superblocks live).
const DATA_SCAN_BUDGET: u64 = 64 << 20;
const DATA_SCAN_CHUNK: u64 = 1 << 20;

/// The next data extent of a regular file at or after `from` (SEEK_DATA / SEEK_HOLE), or
/// the whole rest when the filesystem cannot say.
fn next_data_extent(file: &File, from: u64, len: u64) -> Option<(u64, u64)> {
    let fd = file.as_raw_fd();
    let at = libc::off_t::try_from(from).ok()?;
    // SAFETY: lseek only moves the offset of an open descriptor (kvtier reads and writes
    // it positionally, so the offset is not used elsewhere).
    let start = unsafe { libc::lseek(fd, at, libc::SEEK_DATA) };
    if start < 0 {
        return match io::Error::last_os_error().raw_os_error() {
            Some(libc::ENXIO) => None,
            _ => Some((from, len)),
        };
    }
    // SAFETY: as above.
    let end = unsafe { libc::lseek(fd, start, libc::SEEK_HOLE) };
    let end = if end < 0 { len } else { (end as u64).min(len) };
    let start = start as u64;
    (start < end).then_some((start, end))
}

/// Does `file` (not in O_DIRECT mode) hold non-zero bytes in `[SIGNATURE_PROBE_BYTES,
/// len)`? A head of zeros says nothing about what follows: a disk image, a database file
/// or a filesystem that keeps its first sectors empty is still someone's data. Holes of
/// regular files are skipped; beyond [`DATA_SCAN_BUDGET`] of data the scan samples.
fn data_beyond_head(file: &File, kind: BackingKind, len: u64) -> io::Result<Option<u64>> {
    let head = SIGNATURE_PROBE_BYTES as u64;
    if len <= head {
        return Ok(None);
    }
    let mut extents = Vec::new();
    match kind {
        BackingKind::BlockDevice => extents.push((head, len)),
        BackingKind::File => {
            let mut at = head;
            while at < len && extents.len() < 4096 {
                let Some((start, end)) = next_data_extent(file, at, len) else {
                    break;
                };
                extents.push((start.max(at), end));
                at = end;
            }
            if at < len && extents.len() >= 4096 {
                extents.push((at, len));
            }
        }
    }
    let total: u64 = extents.iter().map(|(a, b)| b - a).sum();
    // Read every byte when it fits the budget, else one chunk every `stride` bytes.
    let stride = if total <= DATA_SCAN_BUDGET {
        DATA_SCAN_CHUNK
    } else {
        (total / (DATA_SCAN_BUDGET / DATA_SCAN_CHUNK)).max(DATA_SCAN_CHUNK)
    };
    let mut buf = vec![0u8; DATA_SCAN_CHUNK as usize];
    let mut read_chunk = |off: u64, n: u64| -> io::Result<Option<u64>> {
        let n = n as usize;
        let mut done = 0;
        while done < n {
            match file.read_at(&mut buf[done..n], off + done as u64) {
                Ok(0) => break,
                Ok(k) => done += k,
                Err(e) if e.kind() == ErrorKind::Interrupted => continue,
                Err(e) => return Err(e),
            }
        }
        Ok(buf[..done]
            .iter()
            .position(|&b| b != 0)
            .map(|p| off + p as u64))
    };
    for &(start, end) in &extents {
        let mut off = start;
        while off < end {
            let n = DATA_SCAN_CHUNK.min(end - off);
            if let Some(at) = read_chunk(off, n)? {
                return Ok(Some(at));
            }
            off = off.saturating_add(stride);
        }
    }
    let tail = len.saturating_sub(DATA_SCAN_CHUNK).max(head);
    read_chunk(tail, len - tail)
}

// ---------------------------------------------------------------------------------------
// BackingDevice
// ---------------------------------------------------------------------------------------

/// An open backing device: an `O_DIRECT | O_CLOEXEC` file descriptor (block devices are
/// also opened `O_EXCL`, so nobody can mount or claim them while the pool is open), its
/// usable size and kind. The descriptor carries a `flock` for as long as it is open
/// (exclusive for a writer, shared for a reader), so two processes never serve one pool
/// file at once, nor does `pool check` read a pool another process is writing.
#[derive(Debug)]
pub struct BackingDevice {
    path: PathBuf,
    file: File,
    size: u64,
    kind: BackingKind,
    logical_block_size: u32,
    access: Access,
}

/// How an open backing device is held.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Access {
    /// Read-write and alone: create, serve, repair.
    Exclusive,
    /// Read-only, beside other readers but never beside a writer: `pool info`, `check`.
    Shared,
}

/// How long an open waits for a lock (or an exclusive block-device claim) whose holder
/// has already exited: the kernel releases a dead process's files when its io_uring
/// rings are torn down, which may be tens of milliseconds after the exit.
const RELEASE_GRACE: std::time::Duration = std::time::Duration::from_millis(1500);
/// How long an open waits for a lock this very process holds (see `lock_device`).
const SELF_GRACE: std::time::Duration = std::time::Duration::from_millis(300);

/// Removes a file this module created if creating the pool device fails half way.
struct RemoveOnError<'a> {
    path: &'a Path,
    armed: bool,
}

impl Drop for RemoveOnError<'_> {
    fn drop(&mut self) {
        if self.armed {
            let _ = fs::remove_file(self.path);
        }
    }
}

fn round_down(size: u64) -> u64 {
    size - size % DIRECT_IO_ALIGN as u64
}

/// The kind of an existing path, or an error for anything that cannot back a pool.
fn backing_kind(path: &Path, meta: &fs::Metadata) -> Result<BackingKind> {
    let ft = meta.file_type();
    if ft.is_file() {
        Ok(BackingKind::File)
    } else if ft.is_block_device() {
        Ok(BackingKind::BlockDevice)
    } else {
        let what = if ft.is_dir() {
            "a directory"
        } else if ft.is_char_device() {
            "a character device"
        } else if ft.is_fifo() {
            "a FIFO"
        } else if ft.is_socket() {
            "a socket"
        } else {
            "neither a regular file nor a block device"
        };
        Err(backing_error(
            path,
            format!(
                "it is {what}; a pool device must be a regular file or a block device \
                 (for NVMe, the namespace block device such as /dev/nvme0n1)"
            ),
        ))
    }
}

fn open_error(path: &Path, kind: BackingKind, e: io::Error) -> Error {
    match (e.raw_os_error(), kind) {
        (Some(libc::EBUSY), BackingKind::BlockDevice) => backing_error(
            path,
            "it is in use (mounted, an active swap area, part of an md RAID, LVM or \
             device-mapper volume, or open by another kvtier pool); stop whatever holds it first",
        ),
        (Some(libc::EACCES) | Some(libc::EPERM), _) => backing_error(
            path,
            format!(
                "permission denied opening it read-write ({e}); run as a user who may write it"
            ),
        ),
        (Some(libc::EROFS), _) => backing_error(path, "it is on a read-only filesystem or device"),
        _ => Error::io(format!("opening backing device {}", path.display()), e),
    }
}

fn direct_io_error(path: &Path, e: Errno) -> Error {
    if e == Errno::EINVAL {
        backing_error(
            path,
            "its filesystem does not support direct I/O (O_DIRECT); put the pool file on \
             ext4, xfs or btrfs, or use a block device",
        )
    } else {
        Error::io(format!("enabling O_DIRECT on {}", path.display()), e.into())
    }
}

/// Open an existing block device read-write and exclusively (not yet O_DIRECT) after
/// checking that nothing has it mounted. Returns the file, its byte size and logical
/// block size.
fn open_block_device(path: &Path, meta: &fs::Metadata, access: Access) -> Result<(File, u64, u32)> {
    if let Some(in_use) = block_device_use(meta)? {
        return Err(backing_error(
            path,
            format!(
                "{}; kvtier never touches a mounted or active device (--force does not \
                 override this); {} first",
                in_use.describe(),
                if in_use.mount_point == "[SWAP]" {
                    "swapoff it"
                } else {
                    "unmount it"
                }
            ),
        ));
    }
    let deadline = std::time::Instant::now() + RELEASE_GRACE;
    let file = loop {
        match OpenOptions::new()
            .read(true)
            .write(access == Access::Exclusive)
            .custom_flags(libc::O_EXCL)
            .open(path)
        {
            Ok(file) => break file,
            Err(e) if e.raw_os_error() == Some(libc::EBUSY) => {
                // Another kvtier process names itself through its lock; a process that
                // just exited may still hold the claim until its io_uring rings are torn
                // down, so that is waited out briefly rather than reported as "in use".
                let holders = lock_holders(meta);
                let me = std::process::id() as i32;
                if holders.iter().any(|h| h.pid == me || process_alive(h.pid)) {
                    return Err(in_use_error(path, access, &holders));
                }
                if std::time::Instant::now() >= deadline {
                    return Err(open_error(path, BackingKind::BlockDevice, e));
                }
                std::thread::sleep(std::time::Duration::from_millis(10));
            }
            Err(e) => return Err(open_error(path, BackingKind::BlockDevice, e)),
        }
    };
    lock_device(path, &file, access)?;
    if !file
        .metadata()
        .context(|| format!("stat {}", path.display()))?
        .file_type()
        .is_block_device()
    {
        return Err(backing_error(
            path,
            "it changed while being opened; try again",
        ));
    }
    if access == Access::Exclusive
        && block_device_read_only(&file).context(|| format!("BLKROGET on {}", path.display()))?
    {
        return Err(backing_error(path, "the block device is read-only"));
    }
    let size =
        block_device_size(&file).context(|| format!("BLKGETSIZE64 on {}", path.display()))?;
    let lbs = block_device_logical_block_size(&file)
        .context(|| format!("BLKSSZGET on {}", path.display()))?;
    check_logical_block_size(path, lbs)?;
    Ok((file, size, lbs))
}

fn check_logical_block_size(path: &Path, lbs: u32) -> Result<()> {
    if lbs == 0 || !lbs.is_power_of_two() || lbs as usize > DIRECT_IO_ALIGN {
        return Err(backing_error(
            path,
            format!(
                "its direct I/O block size is {lbs} bytes; kvtier needs a power of two no \
                 larger than {DIRECT_IO_ALIGN}"
            ),
        ));
    }
    Ok(())
}

fn file_logical_block_size(path: &Path, file: &File) -> Result<u32> {
    let lbs = dio_align(file)
        .ok()
        .flatten()
        .map(|a| a.offset)
        .filter(|&o| o != 0)
        .unwrap_or(512);
    check_logical_block_size(path, lbs)?;
    Ok(lbs)
}

/// Refuse a foreign signature unless forced.
pub(crate) fn check_signature(path: &Path, sig: &Signature, force: bool) -> Result<()> {
    match sig {
        Signature::Empty => Ok(()),
        _ if force => Ok(()),
        Signature::KvtierPool => Err(backing_error(
            path,
            "it holds a kvtier pool; pass --force to reformat it (every block stored in it \
             will be lost), or open it with `kvtier pool info` to see what it holds",
        )),
        Signature::Filesystem(_) => Err(backing_error(
            path,
            format!("it holds {sig}; pass --force to overwrite it (its contents will be lost)"),
        )),
        Signature::Unknown => Err(backing_error(
            path,
            "it holds data that is not a kvtier pool (it is not all zero, does not begin with \
             the kvtier pool magic and matches no known filesystem); pass --force to \
             overwrite it (its contents will be lost)",
        )),
    }
}

fn min_size_hint() -> &'static str {
    "one superblock and one extent group"
}

/// A process holding a `flock` on a file: its pid and whether the lock is exclusive.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct LockHolder {
    pub(crate) pid: i32,
    pub(crate) exclusive: bool,
}

/// Who holds a `flock` on the file with metadata `meta`, from /proc/locks (the only place
/// the kernel names the owner of a flock). Empty when /proc/locks is unreadable.
pub(crate) fn lock_holders(meta: &fs::Metadata) -> Vec<LockHolder> {
    let Ok(text) = fs::read_to_string("/proc/locks") else {
        return Vec::new();
    };
    parse_lock_holders(
        &text,
        dev_major(meta.dev()),
        dev_minor(meta.dev()),
        meta.ino(),
    )
}

/// /proc/locks lines look like `1: FLOCK  ADVISORY  WRITE 1234 08:01:5678 0 EOF`
/// (device major:minor in hex, inode in decimal); `1: -> FLOCK ...` lines are waiters.
fn parse_lock_holders(text: &str, major: u64, minor: u64, ino: u64) -> Vec<LockHolder> {
    let mut out = Vec::new();
    for line in text.lines() {
        let f: Vec<&str> = line.split_whitespace().collect();
        if f.len() < 6 || f[1] != "FLOCK" {
            continue;
        }
        let mut id = f[5].splitn(3, ':');
        let (Some(maj), Some(min), Some(i)) = (id.next(), id.next(), id.next()) else {
            continue;
        };
        let same = u64::from_str_radix(maj, 16) == Ok(major)
            && u64::from_str_radix(min, 16) == Ok(minor)
            && i.parse::<u64>() == Ok(ino);
        if !same {
            continue;
        }
        if let Ok(pid) = f[4].parse::<i32>() {
            out.push(LockHolder {
                pid,
                exclusive: f[3] == "WRITE",
            });
        }
    }
    out
}

/// Is `pid` a running process (not gone, not a zombie)?
fn process_alive(pid: i32) -> bool {
    if pid <= 0 {
        return false;
    }
    match fs::read_to_string(format!("/proc/{pid}/stat")) {
        // The state is the first field after the parenthesised command name.
        Ok(stat) => stat
            .rsplit_once(") ")
            .and_then(|(_, rest)| rest.chars().next())
            .is_some_and(|state| state != 'Z' && state != 'X'),
        Err(_) => false,
    }
}

fn describe_holders(holders: &[LockHolder]) -> String {
    let me = std::process::id() as i32;
    let mut pids: Vec<String> = Vec::new();
    for h in holders {
        let what = if h.pid == me {
            format!("this process (pid {})", h.pid)
        } else if process_alive(h.pid) {
            format!("pid {}", h.pid)
        } else {
            format!("pid {}, which has exited", h.pid)
        };
        if !pids.contains(&what) {
            pids.push(what);
        }
    }
    pids.join(", ")
}

/// The error for a device another kvtier process (or this one) holds.
fn in_use_error(path: &Path, access: Access, holders: &[LockHolder]) -> Error {
    let me = std::process::id() as i32;
    let writers: Vec<LockHolder> = holders.iter().copied().filter(|h| h.exclusive).collect();
    let who = if holders.is_empty() {
        "another process".to_string()
    } else {
        describe_holders(if writers.is_empty() {
            holders
        } else {
            &writers
        })
    };
    let reason = if holders.iter().any(|h| h.pid == me) {
        format!(
            "it is in use: already open in {who}; a pool may be opened once at a time: drop \
             the other Pool (or Tier) first"
        )
    } else if access == Access::Shared || !writers.is_empty() {
        format!(
            "it is in use: {who} has it open for writing (serving, creating or repairing the \
             pool); stop that process first. Two processes on one pool would return each \
             other's bytes"
        )
    } else {
        format!(
            "it is in use: {who} has it open for reading (`kvtier pool info` or `check`); \
             wait for it to finish"
        )
    };
    backing_error(path, reason)
}

/// Take the lock that goes with `access` on an open backing device. A conflicting lock
/// whose holders have all exited is waited out for [`RELEASE_GRACE`]; one held by a live
/// process (or by this one) is refused at once, naming it.
fn lock_device(path: &Path, file: &File, access: Access) -> Result<()> {
    let op = match access {
        Access::Exclusive => libc::LOCK_EX,
        Access::Shared => libc::LOCK_SH,
    } | libc::LOCK_NB;
    let deadline = std::time::Instant::now() + RELEASE_GRACE;
    loop {
        // SAFETY: flock takes an open descriptor and flags; `file` is open for the call.
        let rc = unsafe { libc::flock(file.as_raw_fd(), op) };
        if rc == 0 {
            return Ok(());
        }
        let e = io::Error::last_os_error();
        match e.raw_os_error() {
            Some(libc::EINTR) => continue,
            Some(libc::EWOULDBLOCK) => {}
            _ => return Err(Error::io(format!("locking {}", path.display()), e)),
        }
        let meta = file
            .metadata()
            .context(|| format!("stat {}", path.display()))?;
        let holders = lock_holders(&meta);
        let me = std::process::id() as i32;
        let other = holders.iter().any(|h| h.pid != me && process_alive(h.pid));
        // A lock this process holds may be a child's inherited copy of our
        // descriptor for the moment between its fork and exec: wait that out
        // briefly before calling it a second open.
        let mine = holders.iter().any(|h| h.pid == me);
        let now = std::time::Instant::now();
        if other || now >= deadline || (mine && now + RELEASE_GRACE - SELF_GRACE >= deadline) {
            return Err(in_use_error(path, access, &holders));
        }
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
}

/// What identifies a backing device whatever path names it: the device number for block
/// devices (two nodes of one disk are one disk), else the file's device and inode (a hard
/// link, `./`, or a symlink name the same file).
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum DeviceIdentity {
    Block(u64),
    File(u64, u64),
    /// Not there yet: its canonical directory and file name.
    New(PathBuf),
}

pub fn device_identity(path: &Path) -> DeviceIdentity {
    match fs::metadata(path) {
        Ok(m) if m.file_type().is_block_device() => DeviceIdentity::Block(m.rdev()),
        Ok(m) => DeviceIdentity::File(m.dev(), m.ino()),
        Err(_) => {
            let parent = path
                .parent()
                .filter(|p| !p.as_os_str().is_empty())
                .unwrap_or(Path::new("."));
            let dir = fs::canonicalize(parent).unwrap_or_else(|_| parent.to_path_buf());
            DeviceIdentity::New(dir.join(path.file_name().unwrap_or_default()))
        }
    }
}

/// A filesystem that cannot preallocate: the pool file would be sparse, and a store
/// could fail later when the filesystem fills up. Refused unless forced.
fn check_sparse_ok(path: &Path, force: bool) -> Result<()> {
    if force {
        return Ok(());
    }
    Err(backing_error(
        path,
        "its filesystem cannot preallocate space (fallocate is not supported), so the pool \
         file would be sparse and stores could fail later when the filesystem fills up; put \
         it on ext4, xfs, btrfs or tmpfs, or pass --force to create it sparse anyway",
    ))
}

impl BackingDevice {
    /// Format-time open.
    ///
    /// * Regular file: created (mode 0600) if missing; `size` is required and must be a
    ///   multiple of [`DIRECT_IO_ALIGN`]. The file is fallocated to exactly `size` bytes,
    ///   never larger. An existing file larger than `size` is an error unless `force`, in
    ///   which case it is truncated to `size`. An existing file that is not all zero, or
    ///   that holds a kvtier pool, is refused unless `force`. A file backing a loop device
    ///   or serving as swap is always refused, as is one another process holds open.
    ///   A filesystem that cannot preallocate (the file would be sparse) needs `force`.
    /// * Block device: `size` None uses the whole device (rounded down to
    ///   [`DIRECT_IO_ALIGN`]); `Some(s)` must be a multiple of it and at most the device
    ///   size. A mounted device (or mounted partition / stacked device) is always refused;
    ///   a recognised signature or unknown data is refused unless `force`.
    ///
    /// With `force`, a foreign signature found in the first [`SIGNATURE_PROBE_BYTES`] is
    /// zeroed so the device no longer looks like what it was. `min_size` is the smallest
    /// usable size; anything below it (or below [`DIRECT_IO_ALIGN`]) is an error.
    pub fn create(
        path: &Path,
        size: Option<u64>,
        min_size: u64,
        force: bool,
    ) -> Result<BackingDevice> {
        let min_size = min_size.max(DIRECT_IO_ALIGN as u64);
        if let Ok(link) = fs::symlink_metadata(path) {
            if link.file_type().is_symlink() && fs::metadata(path).is_err() {
                let target = fs::read_link(path)
                    .map(|t| t.display().to_string())
                    .unwrap_or_else(|_| "?".into());
                return Err(backing_error(
                    path,
                    format!(
                        "it is a symbolic link to {target}, which does not exist; kvtier does \
                         not create files through a dangling link: name the file itself"
                    ),
                ));
            }
        }
        match fs::metadata(path) {
            Ok(meta) => match backing_kind(path, &meta)? {
                BackingKind::File => Self::create_file(path, Some(meta), size, min_size, force),
                BackingKind::BlockDevice => {
                    Self::create_block_device(path, &meta, size, min_size, force)
                }
            },
            Err(e) if e.kind() == ErrorKind::NotFound => {
                Self::create_file(path, None, size, min_size, force)
            }
            Err(e) => Err(Error::io(format!("stat {}", path.display()), e)),
        }
    }

    fn create_file(
        path: &Path,
        meta: Option<fs::Metadata>,
        size: Option<u64>,
        min_size: u64,
        force: bool,
    ) -> Result<BackingDevice> {
        let Some(size) = size else {
            return Err(backing_error(
                path,
                format!(
                    "a backing file needs a size; give --size (a multiple of \
                     {DIRECT_IO_ALIGN} bytes, at least {min_size} bytes)"
                ),
            ));
        };
        if size % DIRECT_IO_ALIGN as u64 != 0 {
            return Err(backing_error(
                path,
                format!(
                    "the requested size {size} bytes is not a multiple of {DIRECT_IO_ALIGN} \
                     (direct I/O alignment); give a --size that is, e.g. {} bytes",
                    round_down(size).max(DIRECT_IO_ALIGN as u64)
                ),
            ));
        }
        if size < min_size {
            return Err(backing_error(
                path,
                format!(
                    "backing file is {}; the pool needs at least {min_size} bytes ({}: {}); \
                     give a larger --size",
                    human(size),
                    human(min_size),
                    min_size_hint()
                ),
            ));
        }
        if let Some(meta) = &meta {
            if let Some(why) = regular_file_use(meta) {
                return Err(backing_error(path, why));
            }
        }

        let mut guard = RemoveOnError { path, armed: false };
        let file = if meta.is_some() {
            OpenOptions::new()
                .read(true)
                .write(true)
                .open(path)
                .map_err(|e| open_error(path, BackingKind::File, e))?
        } else {
            let file = OpenOptions::new()
                .read(true)
                .write(true)
                .create_new(true)
                .mode(0o600)
                .open(path)
                .map_err(|e| match e.kind() {
                    ErrorKind::NotFound => backing_error(
                        path,
                        format!(
                            "its directory {} does not exist; create it first",
                            path.parent()
                                .filter(|p| !p.as_os_str().is_empty())
                                .unwrap_or(Path::new("."))
                                .display()
                        ),
                    ),
                    _ => open_error(path, BackingKind::File, e),
                })?;
            guard.armed = true;
            file
        };
        // Lock before looking at (or truncating) anything: a live pool's writer or reader
        // holds it, and formatting under it would corrupt both.
        lock_device(path, &file, Access::Exclusive)?;
        let meta = file
            .metadata()
            .context(|| format!("stat {}", path.display()))?;
        if !meta.file_type().is_file() {
            return Err(backing_error(
                path,
                "it changed while being opened; try again",
            ));
        }
        let len = meta.len();

        let mut sig = if len == 0 {
            Signature::Empty
        } else {
            let head = read_head(&file, len).context(|| format!("reading {}", path.display()))?;
            probe_signature(&head)
        };
        if sig == Signature::Empty
            && !force
            && data_beyond_head(&file, BackingKind::File, len)
                .context(|| format!("reading {}", path.display()))?
                .is_some()
        {
            sig = Signature::Unknown;
        }
        check_signature(path, &sig, force)?;

        if len > size {
            if !force {
                return Err(backing_error(
                    path,
                    format!(
                        "the file is {} ({len} bytes), larger than the requested size {} \
                         ({size} bytes); kvtier does not shrink it silently: pass --force to \
                         truncate it to {size} bytes, or give --size {}",
                        human(len),
                        human(size),
                        round_down(len)
                    ),
                ));
            }
            file.set_len(size)
                .context(|| format!("truncating {} to {size} bytes", path.display()))?;
        }

        match allocate_file(&file, size) {
            Ok(()) => {}
            Err(Errno::EOPNOTSUPP) => {
                check_sparse_ok(path, force)?;
                // Forced: extend (sparsely) instead.
                if len < size {
                    file.set_len(size)
                        .context(|| format!("extending {} to {size} bytes", path.display()))?;
                }
            }
            Err(Errno::ENOSPC) => {
                return Err(backing_error(
                    path,
                    format!(
                        "not enough free space on its filesystem for {} ({size} bytes); free \
                         space or give a smaller --size",
                        human(size)
                    ),
                ))
            }
            Err(Errno::EFBIG) => {
                return Err(backing_error(
                    path,
                    format!(
                        "{} is larger than its filesystem allows for one file; give a smaller \
                         --size",
                        human(size)
                    ),
                ))
            }
            Err(e) => {
                return Err(Error::io(
                    format!("allocating {size} bytes for {}", path.display()),
                    e.into(),
                ))
            }
        }
        let actual = file
            .metadata()
            .context(|| format!("stat {}", path.display()))?
            .len();
        if actual != size {
            return Err(backing_error(
                path,
                format!("after allocation it is {actual} bytes, not the {size} asked for"),
            ));
        }

        enable_direct_io(&file).map_err(|e| direct_io_error(path, e))?;
        let logical_block_size = file_logical_block_size(path, &file)?;
        let dev = BackingDevice {
            path: path.to_path_buf(),
            file,
            size,
            kind: BackingKind::File,
            logical_block_size,
            access: Access::Exclusive,
        };
        if !matches!(sig, Signature::Empty | Signature::KvtierPool) {
            dev.wipe_head()?;
        }
        guard.armed = false;
        Ok(dev)
    }

    fn create_block_device(
        path: &Path,
        meta: &fs::Metadata,
        size: Option<u64>,
        min_size: u64,
        force: bool,
    ) -> Result<BackingDevice> {
        let (file, device_size, logical_block_size) =
            open_block_device(path, meta, Access::Exclusive)?;
        let usable = match size {
            None => round_down(device_size),
            Some(s) => {
                if s % DIRECT_IO_ALIGN as u64 != 0 {
                    return Err(backing_error(
                        path,
                        format!(
                            "the requested size {s} bytes is not a multiple of \
                             {DIRECT_IO_ALIGN} (direct I/O alignment); give a --size that \
                             is, or leave it out to use the whole device"
                        ),
                    ));
                }
                if s > device_size {
                    return Err(backing_error(
                        path,
                        format!(
                            "the requested size {} ({s} bytes) is larger than the device, \
                             which holds {} ({device_size} bytes); give a smaller --size or \
                             leave it out to use the whole device",
                            human(s),
                            human(device_size)
                        ),
                    ));
                }
                s
            }
        };
        if usable < min_size {
            return Err(backing_error(
                path,
                format!(
                    "{} is {}; the pool needs at least {min_size} bytes ({}: {}); {}",
                    if size.is_some() {
                        "the requested size"
                    } else {
                        "the block device"
                    },
                    human(usable),
                    human(min_size),
                    min_size_hint(),
                    if size.is_some() {
                        "give a larger --size"
                    } else {
                        "use a larger device"
                    }
                ),
            ));
        }

        let head =
            read_head(&file, device_size).context(|| format!("reading {}", path.display()))?;
        let mut sig = probe_signature(&head);
        if sig == Signature::Empty
            && !force
            && data_beyond_head(&file, BackingKind::BlockDevice, device_size)
                .context(|| format!("reading {}", path.display()))?
                .is_some()
        {
            sig = Signature::Unknown;
        }
        check_signature(path, &sig, force)?;

        enable_direct_io(&file).map_err(|e| direct_io_error(path, e))?;
        let dev = BackingDevice {
            path: path.to_path_buf(),
            file,
            size: usable,
            kind: BackingKind::BlockDevice,
            logical_block_size,
            access: Access::Exclusive,
        };
        if !matches!(sig, Signature::Empty | Signature::KvtierPool) {
            dev.wipe_head()?;
            if matches!(
                sig,
                Signature::Filesystem("dos partition table" | "GPT partition table")
            ) {
                // Best effort: drop the kernel's view of the old partitions so nobody
                // mounts one over the pool. Fails harmlessly on partitions / loop devices
                // without partition scanning.
                let _ = block_device_reread_partitions(&dev.file);
            }
        }
        Ok(dev)
    }

    /// Zero the first `SIGNATURE_PROBE_BYTES` (or the whole device if smaller) and sync.
    fn wipe_head(&self) -> Result<()> {
        let len = (SIGNATURE_PROBE_BYTES as u64).min(self.size) as usize;
        let zeros = AlignedBuf::zeroed(len);
        self.write_all_at(&zeros, 0)?;
        self.sync_data()
    }

    /// Reopen an existing pool device (no formatting, no size change). Errors if the path
    /// is missing, is a mounted / in-use block device, or does not begin with
    /// [`POOL_MAGIC`]. A block device's size is the whole device rounded down to
    /// [`DIRECT_IO_ALIGN`] (the superblock records how much of it the pool uses); a file's
    /// is its length, likewise rounded down.
    pub fn open(path: &Path) -> Result<BackingDevice> {
        Self::open_with(path, Access::Exclusive)
    }

    /// [`BackingDevice::open`] for `access`: `Shared` opens read-only (writes fail) under
    /// a shared lock, for inspecting a pool no process is writing.
    pub fn open_with(path: &Path, access: Access) -> Result<BackingDevice> {
        let meta = match fs::metadata(path) {
            Ok(meta) => meta,
            Err(e) if e.kind() == ErrorKind::NotFound => {
                return Err(backing_error(
                    path,
                    "it does not exist; create a pool with `kvtier pool create`",
                ))
            }
            Err(e) => return Err(Error::io(format!("stat {}", path.display()), e)),
        };
        let kind = backing_kind(path, &meta)?;
        let (file, raw_size, lbs) = match kind {
            BackingKind::BlockDevice => open_block_device(path, &meta, access)?,
            BackingKind::File => {
                if let Some(why) = regular_file_use(&meta) {
                    return Err(backing_error(path, why));
                }
                let file = OpenOptions::new()
                    .read(true)
                    .write(access == Access::Exclusive)
                    .open(path)
                    .map_err(|e| open_error(path, kind, e))?;
                lock_device(path, &file, access)?;
                let meta = file
                    .metadata()
                    .context(|| format!("stat {}", path.display()))?;
                if !meta.file_type().is_file() {
                    return Err(backing_error(
                        path,
                        "it changed while being opened; try again",
                    ));
                }
                let lbs = file_logical_block_size(path, &file)?;
                (file, meta.len(), lbs)
            }
        };
        let head = read_head(&file, raw_size).context(|| format!("reading {}", path.display()))?;
        let sig = probe_signature(&head);
        if sig != Signature::KvtierPool {
            let found = if raw_size == 0 {
                "it is empty".to_string()
            } else {
                format!("found: {sig}")
            };
            return Err(backing_error(
                path,
                format!("it is not a kvtier pool ({found}); create one with `kvtier pool create`"),
            ));
        }
        let size = round_down(raw_size);
        if size == 0 {
            return Err(backing_error(
                path,
                format!("it is only {raw_size} bytes, too small to hold a pool"),
            ));
        }
        enable_direct_io(&file).map_err(|e| direct_io_error(path, e))?;
        Ok(BackingDevice {
            path: path.to_path_buf(),
            file,
            size,
            kind,
            logical_block_size: lbs,
            access,
        })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Usable size in bytes: the file length, or the device (or requested) size; always a
    /// multiple of [`DIRECT_IO_ALIGN`].
    pub fn size(&self) -> u64 {
        self.size
    }

    pub fn kind(&self) -> BackingKind {
        self.kind
    }

    pub fn access(&self) -> Access {
        self.access
    }

    /// BLKSSZGET for block devices; for files the filesystem's direct I/O offset alignment
    /// (statx STATX_DIOALIGN) where reported, else 512. Always divides [`DIRECT_IO_ALIGN`].
    pub fn logical_block_size(&self) -> u32 {
        self.logical_block_size
    }

    /// The O_DIRECT descriptor, for io_uring registration. Valid while `self` lives.
    pub fn raw_fd(&self) -> RawFd {
        self.file.as_raw_fd()
    }

    pub fn as_fd(&self) -> BorrowedFd<'_> {
        self.file.as_fd()
    }

    fn device_error(&self, offset: u64, len: usize, reason: String) -> Error {
        Error::Device {
            device: self.path.display().to_string(),
            offset,
            len: len as u64,
            reason,
        }
    }

    fn check_range(&self, offset: u64, len: usize, op: &str) -> Result<()> {
        if offset % DIRECT_IO_ALIGN as u64 != 0 {
            return Err(Error::invalid(format!(
                "direct {op} of {len} bytes on {} at offset {offset}: the offset is not a \
                 multiple of {DIRECT_IO_ALIGN}",
                self.path.display()
            )));
        }
        let end = offset.checked_add(len as u64);
        if end.is_none_or(|end| end > self.size) {
            return Err(self.device_error(
                offset,
                len,
                format!(
                    "the {op} ends past the end of the device ({} bytes)",
                    self.size
                ),
            ));
        }
        Ok(())
    }

    /// Read `buf.len()` bytes at `offset` (a multiple of [`DIRECT_IO_ALIGN`]) with direct
    /// I/O. A short read, a range past the end, or an I/O error is an `Error::Device`.
    pub fn read_exact_at(&self, buf: &mut AlignedBuf, offset: u64) -> Result<()> {
        let len = buf.len();
        self.check_range(offset, len, "read")?;
        let slice = buf.as_mut_slice();
        self.transfer(offset, len, "read", "got", |done| {
            self.file.read_at(&mut slice[done..], offset + done as u64)
        })
    }

    /// Write all of `buf` at `offset` (a multiple of [`DIRECT_IO_ALIGN`]) with direct I/O.
    /// Never writes past [`BackingDevice::size`]. Errors are `Error::Device`. Not durable
    /// until [`BackingDevice::sync_data`].
    pub fn write_all_at(&self, buf: &AlignedBuf, offset: u64) -> Result<()> {
        let len = buf.len();
        self.check_range(offset, len, "write")?;
        let slice = buf.as_slice();
        self.transfer(offset, len, "write", "wrote", |done| {
            self.file.write_at(&slice[done..], offset + done as u64)
        })
    }

    /// Drive a positional transfer of `len` bytes to completion: retries
    /// interrupted calls, and reports short or failed transfers (a partial
    /// transfer that stops off a direct-I/O boundary is an error too).
    fn transfer(
        &self,
        offset: u64,
        len: usize,
        op: &str,
        verb: &str,
        mut step: impl FnMut(usize) -> std::io::Result<usize>,
    ) -> Result<()> {
        let mut done = 0usize;
        while done < len {
            match step(done) {
                Ok(0) => {
                    let why = if op == "read" {
                        " (the device ended early)"
                    } else {
                        ""
                    };
                    return Err(self.device_error(
                        offset,
                        len,
                        format!("short {op}: {verb} {done} of {len} bytes{why}"),
                    ));
                }
                Ok(n) => {
                    done += n;
                    if done < len && done % DIRECT_IO_ALIGN != 0 {
                        return Err(self.device_error(
                            offset,
                            len,
                            format!("short {op}: {verb} {done} of {len} bytes"),
                        ));
                    }
                }
                Err(e) if e.kind() == ErrorKind::Interrupted => continue,
                Err(e) => {
                    return Err(self.device_error(
                        offset,
                        len,
                        format!("{op} failed after {done} of {len} bytes: {e}"),
                    ))
                }
            }
        }
        Ok(())
    }

    /// fdatasync: makes prior writes durable (files and block devices alike; on a block
    /// device it flushes the drive's volatile write cache).
    pub fn sync_data(&self) -> Result<()> {
        self.file
            .sync_data()
            .context(|| format!("fdatasync of backing device {}", self.path.display()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::host::mounts::mounted_at;
    use crate::host::signature::POOL_MAGIC;
    use std::io::Write;
    use std::process::Command;
    use std::sync::atomic::{AtomicUsize, Ordering};

    const MIB: u64 = 1024 * 1024;

    /// A unique scratch directory under the system temp dir, removed on drop.
    struct TempDir(PathBuf);

    impl TempDir {
        fn new(tag: &str) -> TempDir {
            static COUNTER: AtomicUsize = AtomicUsize::new(0);
            let nanos = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map(|d| d.as_nanos())
                .unwrap_or(0);
            let dir = std::env::temp_dir().join(format!(
                "kvtier-backing-{tag}-{}-{}-{nanos}",
                std::process::id(),
                COUNTER.fetch_add(1, Ordering::Relaxed)
            ));
            fs::create_dir_all(&dir).unwrap();
            TempDir(dir)
        }

        fn path(&self, name: &str) -> PathBuf {
            self.0.join(name)
        }
    }

    impl Drop for TempDir {
        fn drop(&mut self) {
            let _ = fs::remove_dir_all(&self.0);
        }
    }

    fn write_file(path: &Path, bytes: &[u8]) {
        let mut f = File::create(path).unwrap();
        f.write_all(bytes).unwrap();
        f.sync_all().unwrap();
    }

    fn pattern(len: usize, seed: u8) -> AlignedBuf {
        let mut buf = AlignedBuf::zeroed(len);
        for (i, b) in buf.as_mut_slice().iter_mut().enumerate() {
            *b = (i as u8).wrapping_mul(31).wrapping_add(seed);
        }
        buf
    }

    fn write_magic(dev: &BackingDevice) {
        let mut sb = AlignedBuf::zeroed(DIRECT_IO_ALIGN);
        sb.as_mut_slice()[..8].copy_from_slice(&POOL_MAGIC);
        dev.write_all_at(&sb, 0).unwrap();
        dev.sync_data().unwrap();
    }

    fn backing_reason(err: Error) -> String {
        match err {
            Error::Backing { reason, .. } => reason,
            other => panic!("expected Error::Backing, got {other:?}"),
        }
    }

    // ---- probe_signature ---------------------------------------------------------------

    // ---- AlignedBuf --------------------------------------------------------------------

    // ---- file-backed devices -----------------------------------------------------------

    #[test]
    fn backing_device_is_send_and_sync() {
        fn assert_send_sync<T: Send + Sync>() {}
        assert_send_sync::<BackingDevice>();
    }

    #[test]
    fn file_pool_create_write_read() {
        let dir = TempDir::new("rw");
        let path = dir.path("pool.img");
        let size = 8 * MIB;
        let dev = BackingDevice::create(&path, Some(size), MIB, false).unwrap();
        assert_eq!(dev.size(), size);
        assert_eq!(dev.kind(), BackingKind::File);
        assert_eq!(dev.path(), path.as_path());
        let lbs = dev.logical_block_size();
        assert!(lbs >= 512 && DIRECT_IO_ALIGN as u32 % lbs == 0, "lbs {lbs}");
        assert!(dev.raw_fd() >= 0);
        assert_eq!(dev.as_fd().as_raw_fd(), dev.raw_fd());
        let meta = fs::metadata(&path).unwrap();
        assert_eq!(meta.len(), size);
        assert_eq!(meta.mode() & 0o777, 0o600);
        // fallocate really allocated the space (not a sparse file).
        assert!(meta.blocks() * 512 >= size, "blocks {}", meta.blocks());
        // The descriptor is really O_DIRECT.
        let flags = nix::fcntl::fcntl(dev.as_fd(), FcntlArg::F_GETFL).unwrap();
        assert_ne!(flags & libc::O_DIRECT, 0);

        for (offset, len, seed) in [
            (0u64, 4096usize, 1u8),
            (4096, 8192, 2),
            (3 * MIB, 64 * 1024, 3),
            (size - 4096, 4096, 4),
        ] {
            let data = pattern(len, seed);
            dev.write_all_at(&data, offset).unwrap();
            let mut back = AlignedBuf::zeroed(len);
            dev.read_exact_at(&mut back, offset).unwrap();
            assert_eq!(back.as_slice(), data.as_slice(), "offset {offset}");
        }
        dev.sync_data().unwrap();

        // Misaligned offset: a programming error, reported as such.
        let buf = AlignedBuf::zeroed(4096);
        assert!(matches!(
            dev.write_all_at(&buf, 512),
            Err(Error::InvalidArgument(_))
        ));
        // Past the end: refused, the file never grows.
        let err = dev
            .write_all_at(&AlignedBuf::zeroed(8192), size - 4096)
            .unwrap_err();
        assert!(matches!(err, Error::Device { .. }), "{err:?}");
        let err = dev.write_all_at(&buf, size).unwrap_err();
        assert!(matches!(err, Error::Device { .. }), "{err:?}");
        assert_eq!(fs::metadata(&path).unwrap().len(), size);
        drop(dev);

        // Not a pool yet (offset 0 holds a test pattern)...
        let reason = backing_reason(BackingDevice::open(&path).unwrap_err());
        assert!(reason.contains("not a kvtier pool"), "{reason}");
        assert!(reason.contains("kvtier pool create"), "{reason}");

        // ...until the magic is written at byte 0.
        OpenOptions::new()
            .write(true)
            .open(&path)
            .unwrap()
            .write_all_at(&POOL_MAGIC, 0)
            .unwrap();
        let dev = BackingDevice::open(&path).unwrap();
        assert_eq!(dev.size(), size);
        assert_eq!(dev.kind(), BackingKind::File);
        let mut back = AlignedBuf::zeroed(8192);
        dev.read_exact_at(&mut back, 4096).unwrap();
        assert_eq!(back.as_slice(), pattern(8192, 2).as_slice());
        assert_eq!(fs::metadata(&path).unwrap().len(), size);
        drop(dev);
        // Re-creating over an existing pool needs force (its blocks would be lost) and
        // keeps the size exact.
        let reason =
            backing_reason(BackingDevice::create(&path, Some(size), MIB, false).unwrap_err());
        assert!(
            reason.contains("holds a kvtier pool") && reason.contains("--force"),
            "{reason}"
        );
        let dev = BackingDevice::create(&path, Some(size), MIB, true).unwrap();
        assert_eq!(dev.size(), size);
        assert_eq!(fs::metadata(&path).unwrap().len(), size);
    }

    #[test]
    fn a_second_opener_is_refused_naming_the_holder() {
        let dir = TempDir::new("lock");
        let path = dir.path("pool.img");
        let dev = BackingDevice::create(&path, Some(8 * MIB), MIB, false).unwrap();
        write_magic(&dev);
        let me = std::process::id();
        // A writer holds it: no second writer, no reader, no re-create (even forced).
        for err in [
            BackingDevice::open(&path).unwrap_err(),
            BackingDevice::open_with(&path, Access::Shared).unwrap_err(),
            BackingDevice::create(&path, Some(8 * MIB), MIB, true).unwrap_err(),
        ] {
            let text = err.to_string();
            assert!(
                text.contains("pool.img")
                    && text.contains("in use")
                    && text.contains(&format!("pid {me}")),
                "{text}"
            );
        }
        drop(dev);
        // Readers share; a writer waits for them to go.
        let r1 = BackingDevice::open_with(&path, Access::Shared).unwrap();
        let r2 = BackingDevice::open_with(&path, Access::Shared).unwrap();
        let mut buf = AlignedBuf::zeroed(4096);
        r1.read_exact_at(&mut buf, 0).unwrap();
        assert!(r1.write_all_at(&buf, 0).is_err(), "a reader cannot write");
        let text = BackingDevice::open(&path).unwrap_err().to_string();
        assert!(
            text.contains("in use") && text.contains(&format!("pid {me}")),
            "{text}"
        );
        drop((r1, r2));
        BackingDevice::open(&path).unwrap();
    }

    #[test]
    fn lock_holders_are_parsed_from_proc_locks() {
        let text = "1: FLOCK  ADVISORY  WRITE 4242 00:2a:1234 0 EOF\n\
                    1: -> FLOCK  ADVISORY  WRITE 99 00:2a:1234 0 EOF\n\
                    2: POSIX  ADVISORY  WRITE 7 00:2a:1234 0 EOF\n\
                    3: FLOCK  ADVISORY  READ 17 fd:01:1234 0 EOF\n\
                    4: FLOCK  ADVISORY  READ 18 00:2a:1234 0 EOF\n";
        assert_eq!(
            parse_lock_holders(text, 0, 0x2a, 1234),
            vec![
                LockHolder {
                    pid: 4242,
                    exclusive: true
                },
                LockHolder {
                    pid: 18,
                    exclusive: false
                }
            ]
        );
        assert_eq!(parse_lock_holders(text, 0xfd, 1, 1234).len(), 1);
        assert!(!process_alive(-1) && process_alive(std::process::id() as i32));
    }

    #[test]
    fn dangling_symlink_sparse_files_and_identities_are_named() {
        let dir = TempDir::new("names");
        let link = dir.path("link.pool");
        std::os::unix::fs::symlink(dir.path("missing/target.pool"), &link).unwrap();
        let reason =
            backing_reason(BackingDevice::create(&link, Some(8 * MIB), MIB, false).unwrap_err());
        assert!(
            reason.contains("symbolic link") && reason.contains("does not exist"),
            "{reason}"
        );
        let reason = backing_reason(check_sparse_ok(&link, false).unwrap_err());
        assert!(
            reason.contains("fallocate") && reason.contains("--force"),
            "{reason}"
        );
        check_sparse_ok(&link, true).unwrap();

        let a = dir.path("a.pool");
        write_file(&a, &[0u8; 4096]);
        fs::hard_link(&a, dir.path("b.pool")).unwrap();
        assert_eq!(device_identity(&a), device_identity(&dir.path("b.pool")));
        assert_eq!(
            device_identity(&dir.path("new.pool")),
            device_identity(&dir.0.join(".").join("new.pool"))
        );
        assert_ne!(device_identity(&a), device_identity(&dir.path("new.pool")));
    }

    #[test]
    fn data_past_the_first_256_kib_is_foreign_data() {
        let dir = TempDir::new("deep");
        let path = dir.path("image.bin");
        let mut img = vec![0u8; 8 * MIB as usize];
        img[5 * MIB as usize + 77] = 1;
        write_file(&path, &img);
        let reason =
            backing_reason(BackingDevice::create(&path, Some(8 * MIB), MIB, false).unwrap_err());
        assert!(
            reason.contains("not a kvtier pool") && reason.contains("--force"),
            "{reason}"
        );
        assert_eq!(fs::read(&path).unwrap(), img, "untouched");
        // A sparse or zero file is still fine.
        let zero = dir.path("zero.bin");
        fs::File::create(&zero).unwrap().set_len(8 * MIB).unwrap();
        BackingDevice::create(&zero, Some(8 * MIB), MIB, false).unwrap();
    }

    #[test]
    fn file_create_grows_an_existing_smaller_pool_file_exactly() {
        let dir = TempDir::new("grow");
        let path = dir.path("pool.img");
        let dev = BackingDevice::create(&path, Some(4 * MIB), MIB, false).unwrap();
        write_magic(&dev);
        drop(dev);
        let dev = BackingDevice::create(&path, Some(6 * MIB), MIB, true).unwrap();
        assert_eq!(dev.size(), 6 * MIB);
        assert_eq!(fs::metadata(&path).unwrap().len(), 6 * MIB);
    }

    #[test]
    fn file_create_refuses_foreign_data_without_force() {
        let dir = TempDir::new("foreign");
        let path = dir.path("notes.txt");
        write_file(&path, b"my precious notes\n");

        let err = BackingDevice::create(&path, Some(8 * MIB), MIB, false).unwrap_err();
        let text = err.to_string();
        assert!(text.contains("--force"), "{text}");
        assert!(text.contains(&path.display().to_string()), "{text}");
        assert!(text.contains("not a kvtier pool"), "{text}");
        // Untouched.
        assert_eq!(fs::read(&path).unwrap(), b"my precious notes\n");

        let dev = BackingDevice::create(&path, Some(8 * MIB), MIB, true).unwrap();
        assert_eq!(dev.size(), 8 * MIB);
        assert_eq!(fs::metadata(&path).unwrap().len(), 8 * MIB);
        // The old data is gone from the head.
        let mut head = AlignedBuf::zeroed(SIGNATURE_PROBE_BYTES);
        dev.read_exact_at(&mut head, 0).unwrap();
        assert_eq!(probe_signature(head.as_slice()), Signature::Empty);
    }

    #[test]
    fn file_create_refuses_ext4_magic_without_force() {
        let dir = TempDir::new("ext4");
        let path = dir.path("fs.img");
        let mut img = vec![0u8; 2 * MIB as usize];
        img[1080] = 0x53;
        img[1081] = 0xef;
        write_file(&path, &img);
        let err = BackingDevice::create(&path, Some(2 * MIB), MIB, false).unwrap_err();
        let text = err.to_string();
        assert!(text.contains("ext2/3/4"), "{text}");
        assert!(text.contains("pass --force to overwrite it"), "{text}");

        let reason = backing_reason(BackingDevice::open(&path).unwrap_err());
        assert!(
            reason.contains("not a kvtier pool (found: an ext2/3/4 filesystem)"),
            "{reason}"
        );

        let dev = BackingDevice::create(&path, Some(2 * MIB), MIB, true).unwrap();
        assert_eq!(dev.size(), 2 * MIB);
    }

    #[test]
    fn file_create_size_rules() {
        let dir = TempDir::new("sizes");
        let path = dir.path("pool.img");

        let reason = backing_reason(
            BackingDevice::create(&path, Some(8 * MIB + 100), MIB, false).unwrap_err(),
        );
        assert!(reason.contains("not a multiple of 4096"), "{reason}");
        assert!(!path.exists(), "nothing created on a bad size");

        let reason = backing_reason(BackingDevice::create(&path, None, MIB, false).unwrap_err());
        assert!(reason.contains("--size"), "{reason}");

        let min = 4 * MIB + 8192;
        let err = BackingDevice::create(&path, Some(MIB), min, false).unwrap_err();
        let reason = backing_reason(err);
        assert!(reason.contains("1 MiB"), "{reason}");
        assert!(reason.contains(&min.to_string()), "{reason}");
        assert!(reason.contains("give a larger --size"), "{reason}");
        assert!(!path.exists());

        // Exactly the minimum is fine.
        let dev = BackingDevice::create(&path, Some(min), min, false).unwrap();
        assert_eq!(dev.size(), min);
    }

    #[test]
    fn file_create_never_shrinks_without_force() {
        let dir = TempDir::new("shrink");
        let path = dir.path("pool.img");
        let dev = BackingDevice::create(&path, Some(8 * MIB), MIB, false).unwrap();
        drop(dev);

        let reason =
            backing_reason(BackingDevice::create(&path, Some(4 * MIB), MIB, false).unwrap_err());
        assert!(reason.contains("--force"), "{reason}");
        assert!(
            reason.contains("larger than the requested size"),
            "{reason}"
        );
        assert_eq!(fs::metadata(&path).unwrap().len(), 8 * MIB);

        let dev = BackingDevice::create(&path, Some(4 * MIB), MIB, true).unwrap();
        assert_eq!(dev.size(), 4 * MIB);
        assert_eq!(fs::metadata(&path).unwrap().len(), 4 * MIB);
    }

    #[test]
    fn create_refuses_directories_and_missing_parents() {
        let dir = TempDir::new("dirs");
        let reason =
            backing_reason(BackingDevice::create(&dir.0, Some(8 * MIB), MIB, true).unwrap_err());
        assert!(reason.contains("a directory"), "{reason}");

        let path = dir.path("no/such/dir/pool.img");
        let reason =
            backing_reason(BackingDevice::create(&path, Some(8 * MIB), MIB, false).unwrap_err());
        assert!(reason.contains("does not exist"), "{reason}");

        let reason = backing_reason(BackingDevice::open(&dir.0).unwrap_err());
        assert!(reason.contains("a directory"), "{reason}");
    }

    #[test]
    fn open_errors_are_clear() {
        let dir = TempDir::new("open");
        let missing = dir.path("missing.img");
        let reason = backing_reason(BackingDevice::open(&missing).unwrap_err());
        assert!(reason.contains("does not exist"), "{reason}");
        assert!(reason.contains("kvtier pool create"), "{reason}");

        let empty = dir.path("empty.img");
        write_file(&empty, b"");
        let reason = backing_reason(BackingDevice::open(&empty).unwrap_err());
        assert!(
            reason.contains("not a kvtier pool (it is empty)"),
            "{reason}"
        );

        let zeros = dir.path("zeros.img");
        write_file(&zeros, &vec![0u8; 65536]);
        let reason = backing_reason(BackingDevice::open(&zeros).unwrap_err());
        assert!(reason.contains("all zero"), "{reason}");

        let text = dir.path("text.img");
        write_file(&text, b"hello world");
        let err = BackingDevice::open(&text).unwrap_err();
        let msg = err.to_string();
        assert!(msg.contains(&text.display().to_string()), "{msg}");
        assert!(msg.contains("not a kvtier pool"), "{msg}");
    }

    #[test]
    fn short_reads_are_device_errors() {
        let dir = TempDir::new("short");
        let path = dir.path("pool.img");
        let size = 8 * MIB;
        let dev = BackingDevice::create(&path, Some(size), MIB, false).unwrap();
        write_magic(&dev);

        // Past the end of the device.
        let mut buf = AlignedBuf::zeroed(8192);
        match dev.read_exact_at(&mut buf, size - 4096).unwrap_err() {
            Error::Device {
                device,
                offset,
                len,
                reason,
            } => {
                assert_eq!(device, path.display().to_string());
                assert_eq!(offset, size - 4096);
                assert_eq!(len, 8192);
                assert!(reason.contains("past the end"), "{reason}");
            }
            other => panic!("expected Error::Device, got {other:?}"),
        }

        // The file shrinks under us: pread comes back short.
        OpenOptions::new()
            .write(true)
            .open(&path)
            .unwrap()
            .set_len(size - 4096)
            .unwrap();
        match dev.read_exact_at(&mut buf, size - 8192).unwrap_err() {
            Error::Device { reason, len, .. } => {
                assert_eq!(len, 8192);
                assert!(reason.contains("short read: got 4096 of 8192"), "{reason}");
            }
            other => panic!("expected Error::Device, got {other:?}"),
        }
    }

    // ---- mounts ------------------------------------------------------------------------

    /// The block device mounted at "/" according to mountinfo, if its node exists.
    fn root_device() -> Option<PathBuf> {
        let mountinfo = fs::read_to_string("/proc/self/mountinfo").ok()?;
        for line in mountinfo.lines() {
            let fields: Vec<&str> = line.split(' ').collect();
            if fields.get(4) != Some(&"/") {
                continue;
            }
            let sep = fields.iter().position(|f| *f == "-")?;
            let source = fields.get(sep + 2)?;
            let meta = fs::metadata(source).ok()?;
            if meta.file_type().is_block_device() {
                return Some(PathBuf::from(source));
            }
        }
        None
    }

    #[test]
    fn mounted_at_finds_the_root_device() {
        match root_device() {
            Some(dev) => {
                assert_eq!(mounted_at(&dev).unwrap().as_deref(), Some("/"), "{dev:?}");
                // And create refuses it, even with force.
                let reason =
                    backing_reason(BackingDevice::create(&dev, None, MIB, true).unwrap_err());
                assert!(reason.contains("mounted at /"), "{reason}");
                let reason = backing_reason(BackingDevice::open(&dev).unwrap_err());
                assert!(reason.contains("mounted at /"), "{reason}");
            }
            None => eprintln!(
                "note: the root filesystem's block device node was not found; \
                 skipping the mounted_at(\"/\") assertion"
            ),
        }
        // A regular file is never "mounted".
        let dir = TempDir::new("mnt");
        let file = dir.path("f");
        write_file(&file, b"x");
        assert_eq!(mounted_at(&file).unwrap(), None);
        assert!(mounted_at(&dir.path("missing")).is_err());
    }

    // ---- loop devices ------------------------------------------------------------------

    fn run(cmd: &str, args: &[&str]) -> std::result::Result<String, String> {
        let out = Command::new(cmd)
            .args(args)
            .output()
            .map_err(|e| format!("{cmd}: {e}"))?;
        if out.status.success() {
            Ok(String::from_utf8_lossy(&out.stdout).trim().to_string())
        } else {
            Err(format!(
                "{cmd} {}: {}",
                args.join(" "),
                String::from_utf8_lossy(&out.stderr).trim()
            ))
        }
    }

    /// A loop device over a file, detached on drop.
    struct Loop(PathBuf);

    impl Loop {
        fn attach(file: &Path, partscan: bool) -> std::result::Result<Loop, String> {
            let file = file.to_str().ok_or("non-UTF-8 path")?;
            let mut args = vec!["-f", "--show"];
            if partscan {
                args.push("-P");
            }
            args.push(file);
            run("losetup", &args).map(|dev| Loop(PathBuf::from(dev)))
        }
    }

    impl Drop for Loop {
        fn drop(&mut self) {
            if let Some(dev) = self.0.to_str() {
                let _ = run("losetup", &["-d", dev]);
            }
        }
    }

    /// A mount, unmounted on drop.
    struct Mount(PathBuf);

    impl Drop for Mount {
        fn drop(&mut self) {
            if let Some(dir) = self.0.to_str() {
                let _ = run("umount", &[dir]);
            }
        }
    }

    fn mkfs_and_mount(dev: &Path, dir: &Path) -> std::result::Result<Mount, String> {
        let dev = dev.to_str().ok_or("non-UTF-8 path")?;
        run("mkfs.ext4", &["-q", "-F", dev])?;
        fs::create_dir_all(dir).map_err(|e| e.to_string())?;
        run("mount", &[dev, dir.to_str().ok_or("non-UTF-8 path")?])?;
        Ok(Mount(dir.to_path_buf()))
    }

    #[test]
    fn loop_device_create_open_and_mount_checks() {
        let dir = TempDir::new("loop");
        let img = dir.path("disk.img");
        let size = 16 * MIB;
        File::create(&img).unwrap().set_len(size).unwrap();
        let lo = match Loop::attach(&img, false) {
            Ok(lo) => lo,
            Err(why) => {
                eprintln!("note: skipping the loop-device test: {why}");
                return;
            }
        };
        let path = lo.0.clone();
        assert!(fs::metadata(&path).unwrap().file_type().is_block_device());
        assert_eq!(mounted_at(&path).unwrap(), None);

        // Size checks against BLKGETSIZE64.
        let reason =
            backing_reason(BackingDevice::create(&path, Some(32 * MIB), MIB, false).unwrap_err());
        assert!(reason.contains("larger than the device"), "{reason}");
        let reason =
            backing_reason(BackingDevice::create(&path, None, 64 * MIB, false).unwrap_err());
        assert!(reason.contains("16 MiB") && reason.contains(&(64 * MIB).to_string()));

        // A blank device is accepted without force; not a pool until the magic is written.
        let dev = BackingDevice::create(&path, None, MIB, false).unwrap();
        assert_eq!(dev.kind(), BackingKind::BlockDevice);
        assert_eq!(dev.size(), size);
        let lbs = dev.logical_block_size();
        assert!(lbs >= 512 && DIRECT_IO_ALIGN as u32 % lbs == 0, "lbs {lbs}");
        // Held exclusively: a second exclusive open is refused as "in use".
        let reason = backing_reason(BackingDevice::open(&path).unwrap_err());
        assert!(reason.contains("in use"), "{reason}");
        let data = pattern(65536, 7);
        dev.write_all_at(&data, MIB).unwrap();
        let mut back = AlignedBuf::zeroed(65536);
        dev.read_exact_at(&mut back, MIB).unwrap();
        assert_eq!(back.as_slice(), data.as_slice());
        assert!(matches!(
            dev.read_exact_at(&mut back, size),
            Err(Error::Device { .. })
        ));
        dev.sync_data().unwrap();
        drop(dev);
        let reason = backing_reason(BackingDevice::open(&path).unwrap_err());
        assert!(reason.contains("not a kvtier pool"), "{reason}");
        // The data at 1 MiB is someone's, though the head is all zero.
        let reason =
            backing_reason(BackingDevice::create(&path, Some(8 * MIB), MIB, false).unwrap_err());
        assert!(reason.contains("--force"), "{reason}");

        let dev = BackingDevice::create(&path, Some(8 * MIB), MIB, true).unwrap();
        assert_eq!(dev.size(), 8 * MIB);
        write_magic(&dev);
        drop(dev);
        let dev = BackingDevice::open(&path).unwrap();
        assert_eq!(dev.size(), size);
        assert_eq!(dev.kind(), BackingKind::BlockDevice);
        drop(dev);

        // A filesystem on it: mounted -> refused even with force; unmounted -> needs force.
        let mnt = dir.path("mnt");
        match mkfs_and_mount(&path, &mnt) {
            Ok(mount) => {
                let mp = mounted_at(&path).unwrap();
                assert_eq!(mp.as_deref(), Some(mnt.to_str().unwrap()));
                let reason =
                    backing_reason(BackingDevice::create(&path, None, MIB, true).unwrap_err());
                assert!(reason.contains("mounted at"), "{reason}");
                assert!(reason.contains("unmount"), "{reason}");
                drop(mount);
                assert_eq!(mounted_at(&path).unwrap(), None);

                let reason =
                    backing_reason(BackingDevice::create(&path, None, MIB, false).unwrap_err());
                assert!(reason.contains("ext2/3/4"), "{reason}");
                assert!(reason.contains("pass --force to overwrite it"), "{reason}");
                let reason = backing_reason(BackingDevice::open(&path).unwrap_err());
                assert!(reason.contains("found: an ext2/3/4 filesystem"), "{reason}");

                let dev = BackingDevice::create(&path, None, MIB, true).unwrap();
                let mut head = AlignedBuf::zeroed(SIGNATURE_PROBE_BYTES);
                dev.read_exact_at(&mut head, 0).unwrap();
                assert_eq!(probe_signature(head.as_slice()), Signature::Empty);
            }
            Err(why) => eprintln!("note: skipping the mounted-filesystem part: {why}"),
        }
        drop(lo);

        // A partitioned disk whose partition is mounted: the whole disk is in use.
        let img2 = dir.path("parted.img");
        let mut mbr = vec![0u8; 512];
        mbr[446 + 4] = 0x83;
        mbr[446 + 8..446 + 12].copy_from_slice(&2048u32.to_le_bytes());
        mbr[446 + 12..446 + 16].copy_from_slice(&((size / 512 - 2048) as u32).to_le_bytes());
        mbr[510] = 0x55;
        mbr[511] = 0xaa;
        write_file(&img2, &mbr);
        OpenOptions::new()
            .write(true)
            .open(&img2)
            .unwrap()
            .set_len(size)
            .unwrap();
        let lo = match Loop::attach(&img2, true) {
            Ok(lo) => lo,
            Err(why) => {
                eprintln!("note: skipping the partition test: {why}");
                return;
            }
        };
        let part = PathBuf::from(format!("{}p1", lo.0.display()));
        if !part.exists() {
            // Kernels without msdos partition parsing: add the partition with BLKPG.
            let _ = run("partx", &["-a", lo.0.to_str().unwrap()]);
        }
        for _ in 0..50 {
            if part.exists() {
                break;
            }
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
        if !part.exists() {
            eprintln!("note: skipping the partition test: {part:?} did not appear");
            return;
        }
        let reason = backing_reason(BackingDevice::create(&lo.0, None, MIB, false).unwrap_err());
        assert!(reason.contains("dos partition table"), "{reason}");
        match mkfs_and_mount(&part, &dir.path("pmnt")) {
            Ok(mount) => {
                let mp = mounted_at(&lo.0).unwrap();
                assert_eq!(mp.as_deref(), dir.path("pmnt").to_str());
                let reason =
                    backing_reason(BackingDevice::create(&lo.0, None, MIB, true).unwrap_err());
                assert!(reason.contains(&part.display().to_string()), "{reason}");
                assert!(reason.contains("mounted at"), "{reason}");
                drop(mount);
            }
            Err(why) => eprintln!("note: skipping the mounted-partition part: {why}"),
        }
        drop(lo);
    }
}
