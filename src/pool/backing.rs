//! The backing devices of a pool: regular files or block devices, each one "an SSD".
//!
//! Its raw syscalls and ioctls on the devices live in `sys` (block-device ioctls,
//! O_DIRECT, fallocate), `scan` (lseek over holes) and `locks` (flock); what the host
//! says about a device (mounts, holders, signatures) comes from [`crate::host`];
//! everything above is safe Rust. It enforces the rules that keep kvtier from
//! destroying data it was not given:
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
use std::os::fd::{AsFd, AsRawFd, BorrowedFd};
use std::os::unix::fs::{FileExt, FileTypeExt, MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

use nix::errno::Errno;
use nix::fcntl::{FallocateFlags, FcntlArg, OFlag};

use crate::error::{Error, Fix, IoContext, Result};
use crate::host::dio::{dio_align, AlignedBuf, DIRECT_IO_ALIGN};
use crate::host::mounts::{block_device_use, dev_major, dev_minor, regular_file_use};
use crate::host::signature::{probe_signature, read_head, Signature, SIGNATURE_PROBE_BYTES};
use crate::host::size::human_bytes as human;

mod locks;
mod scan;
mod sys;

use locks::{in_use_error, lock_device, lock_holders, refuse_live_holders, RELEASE_GRACE};
use scan::data_beyond_head;
use sys::{
    allocate_file, block_device_logical_block_size, block_device_read_only,
    block_device_reread_partitions, block_device_size, enable_direct_io,
};

/// Which kind of thing backs a pool device.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BackingKind {
    /// A regular file.
    File,
    /// A block device.
    BlockDevice,
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

/// A refusal and the change that gets past it (each front end names the fix).
fn backing_fix(path: &Path, reason: impl Into<String>, fix: Fix) -> Error {
    backing_error(path, reason).with_fix(fix)
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
    /// This open created the file (it did not exist before).
    created: bool,
    /// For a loop device over a regular file: that file, holding the same
    /// `flock` as the device, so a pool file held through its own path is not
    /// opened again through the loop device (nor the reverse).
    _loop_backing: Option<File>,
}

/// How an open backing device is held.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Access {
    /// Read-write and alone: create, serve, repair.
    Exclusive,
    /// Read-only, beside other readers but never beside a writer: `pool info`, `check`.
    Shared,
}

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

/// After taking a file's lock: does `path` still name the file that was opened
/// (`meta`, from its descriptor)? A process that failed to create it removes it while
/// holding the lock; one that waited for that lock must not format the unlinked file
/// and report a pool nobody can open.
fn check_still_named(path: &Path, meta: &fs::Metadata) -> Result<()> {
    match fs::metadata(path) {
        Ok(now) if now.dev() == meta.dev() && now.ino() == meta.ino() => Ok(()),
        Ok(_) | Err(_) => Err(backing_error(
            path,
            "another process removed or replaced it while this one was opening it (two \
             `pool create` of one file at once?); run the command again",
        )),
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
        let what = crate::host::file_kind(&ft);
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
        // EPERM where EACCES is the usual refusal: the file's immutable or
        // append-only attribute, which refuses root as well.
        (Some(libc::EPERM), BackingKind::File) => backing_error(
            path,
            format!(
                "it may not be opened read-write, not even by root ({e}): a file marked \
                 immutable or append-only (`lsattr` shows i or a) refuses every user; clear \
                 that with `chattr -i -a {}`",
                path.display()
            ),
        ),
        (Some(libc::EACCES) | Some(libc::EPERM), _) => backing_error(
            path,
            format!(
                "permission denied opening it read-write ({e}); run as a user who may write it"
            ),
        ),
        (Some(libc::EMFILE) | Some(libc::ENFILE), _) => backing_error(
            path,
            format!(
                "this process may open no more files ({e}); raise the open-file limit \
                 (`ulimit -n`, LimitNOFILE= for a service) or name fewer devices"
            ),
        ),
        (Some(libc::EROFS), _) => backing_error(
            path,
            "it is on a read-only filesystem or device; make it writable (remount it \
             read-write) to create or serve a pool there (inspecting a pool and checking it \
             without repairing only read)",
        ),
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
/// A block device opened for a pool: (descriptor, size, logical block
/// size, the locked backing file of a loop device).
type OpenedBlockDevice = (File, u64, u32, Option<File>);

/// If `meta` (a block device) is a loop device over a regular file, open that
/// file and take the lock `access` takes on it: a pool file another process
/// holds through its own name is refused through the loop device too (the
/// device's own lock is another inode's and would not see that holder).
fn lock_loop_backing(path: &Path, meta: &fs::Metadata, access: Access) -> Result<Option<File>> {
    let (maj, min) = (libc::major(meta.rdev()), libc::minor(meta.rdev()));
    let Ok(backing) = fs::read_to_string(format!("/sys/dev/block/{maj}:{min}/loop/backing_file"))
    else {
        return Ok(None);
    };
    let backing = Path::new(backing.trim_end_matches('\n'));
    // Absent (deleted, or in another mount namespace): no one can open it by name.
    let Ok(file) = File::open(backing) else {
        return Ok(None);
    };
    if !file.metadata().is_ok_and(|m| m.file_type().is_file()) {
        return Ok(None);
    }
    lock_device(backing, &file, access).map_err(|e| {
        backing_error(
            path,
            format!(
                "it is a loop device over {}, which is in use: {e}",
                crate::host::printable(&backing.display().to_string())
            ),
        )
    })?;
    Ok(Some(file))
}

fn open_block_device(
    path: &Path,
    meta: &fs::Metadata,
    access: Access,
) -> Result<OpenedBlockDevice> {
    if let Some(in_use) = block_device_use(meta)? {
        return Err(backing_error(
            path,
            format!(
                "{}; kvtier never touches a mounted or active device (no override exists); \
                 {} first",
                in_use.describe(),
                if in_use.mount_point == "[SWAP]" {
                    "swapoff it"
                } else {
                    "unmount it"
                }
            ),
        ));
    }
    let started = std::time::Instant::now();
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
                // A live holder is waited out briefly too (`refuse_live_holders`).
                let holders = lock_holders(meta);
                if refuse_live_holders(&holders, started) {
                    return Err(in_use_error(path, access, &holders));
                }
                if started.elapsed() >= RELEASE_GRACE {
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
    let loop_backing = lock_loop_backing(path, meta, access)?;
    Ok((file, size, lbs, loop_backing))
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
        // What was on it was given up when that create began (forced if it held
        // anything): formatting again needs no force.
        Signature::Empty | Signature::KvtierUnfinished => Ok(()),
        _ if force => Ok(()),
        Signature::KvtierPool => Err(backing_fix(
            path,
            "it holds a kvtier pool (inspect it to see what it holds); formatting it loses \
             every block stored in it",
            Fix::Recreate,
        )),
        Signature::Filesystem(_) => {
            Err(backing_fix(path, format!("it holds {sig}"), Fix::Overwrite))
        }
        Signature::Unknown => Err(backing_fix(
            path,
            "it holds data that is not a kvtier pool (it is not all zero, does not begin with \
             the kvtier pool magic and matches no known filesystem)",
            Fix::Overwrite,
        )),
    }
}

/// `sig`, or [`Signature::KvtierUnfinished`] for a valid pool superblock whose pool id is
/// in `unfinished` (that pool's create was killed after this superblock landed).
fn of_unfinished_create(sig: Signature, head: &[u8], unfinished: &[[u8; 16]]) -> Signature {
    let n = std::mem::size_of::<crate::pool::layout::Superblock>();
    if sig != Signature::KvtierPool || unfinished.is_empty() || head.len() < n {
        return sig;
    }
    let sb: crate::pool::layout::Superblock = bytemuck::pod_read_unaligned(&head[..n]);
    if sb.crc_ok() && unfinished.contains(&sb.pool_uuid) {
        Signature::KvtierUnfinished
    } else {
        sig
    }
}

/// Give a pool file (now `len` bytes) its `size` bytes of space and put it in
/// direct-I/O mode; returns its logical block size.
fn allocate_for_pool(path: &Path, file: &File, len: u64, size: u64, force: bool) -> Result<u32> {
    match allocate_file(file, size) {
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
            // What is free, so the fix can be sized without another tool.
            let free = match nix::sys::statvfs::fstatvfs(file) {
                Ok(v) => format!(
                    "{} is free there",
                    human(v.blocks_available() * v.fragment_size())
                ),
                Err(_) => "free space there".to_string(),
            };
            return Err(backing_fix(
                path,
                format!(
                    "not enough free space on its filesystem for {} ({size} bytes); {free}",
                    human(size)
                ),
                Fix::SmallerSize,
            ));
        }
        Err(Errno::EFBIG) => {
            return Err(backing_fix(
                path,
                format!(
                    "{} is larger than its filesystem allows for one file",
                    human(size)
                ),
                Fix::SmallerSize,
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

    enable_direct_io(file).map_err(|e| direct_io_error(path, e))?;
    file_logical_block_size(path, file)
}

/// Whether `file` (of `len` bytes, not yet in O_DIRECT mode) holds a sound
/// backup superblock: a pool whose primary superblock was damaged or lost.
pub(crate) fn has_backup_superblock(file: &File, len: u64) -> bool {
    use crate::pool::layout::{Superblock, SUPERBLOCK_OFFSETS};
    SUPERBLOCK_OFFSETS[1..].iter().any(|&off| {
        let mut b = [0u8; std::mem::size_of::<Superblock>()];
        off + 4096 <= len && file.read_exact_at(&mut b, off).is_ok() && {
            let sb: Superblock = bytemuck::pod_read_unaligned(&b);
            sb.is_sound() && sb.backup_offsets().contains(&off)
        }
    })
}

/// `sig`, or [`Signature::KvtierPool`] for a device that looks empty or holds
/// unrecognised bytes at its head but keeps a sound backup superblock: a pool
/// whose primary superblock was lost is still a pool (formatting over it
/// needs --force).
fn of_backup(sig: Signature, file: &File, len: u64) -> Signature {
    match sig {
        Signature::Empty | Signature::Unknown if has_backup_superblock(file, len) => {
            Signature::KvtierPool
        }
        sig => sig,
    }
}

fn symlink_loop_error(path: &Path) -> Error {
    backing_error(
        path,
        "it is a symbolic link that leads back to itself (a loop of links, or more than \
         40 in a row); name the pool file or device itself",
    )
}

/// The directory a new file at `path` goes in ("." for a bare name).
fn containing_dir(path: &Path) -> &Path {
    path.parent()
        .filter(|p| !p.as_os_str().is_empty())
        .unwrap_or(Path::new("."))
}

fn min_size_hint() -> &'static str {
    "one superblock and one extent group"
}

/// What identifies a backing device whatever path names it: the device number for block
/// devices (two nodes of one disk are one disk), else the file's device and inode (a hard
/// link, `./`, or a symlink name the same file).
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub(crate) enum DeviceIdentity {
    Block(u64),
    File(u64, u64),
    /// Not there yet: its canonical directory and file name.
    New(PathBuf),
}

pub(crate) fn device_identity(path: &Path) -> DeviceIdentity {
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
    Err(backing_fix(
        path,
        "its filesystem cannot preallocate space (fallocate is not supported), so the pool \
         file would be sparse and stores could fail later when the filesystem fills up; put \
         it on ext4, xfs, btrfs or tmpfs",
        Fix::AllowSparse,
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
        Self::create_for(path, size, min_size, force, &[])
    }

    /// [`BackingDevice::create`], formatting without `force` over a pool superblock
    /// whose id is in `unfinished`: a pool whose create was killed between its
    /// superblock writes (another of its devices still carries that create's mark).
    pub(crate) fn create_for(
        path: &Path,
        size: Option<u64>,
        min_size: u64,
        force: bool,
        unfinished: &[[u8; 16]],
    ) -> Result<BackingDevice> {
        let min_size = min_size.max(DIRECT_IO_ALIGN as u64);
        if let Ok(link) = fs::symlink_metadata(path) {
            if link.file_type().is_symlink() && fs::metadata(path).is_err() {
                let target = fs::read_link(path)
                    .map(|t| t.display().to_string())
                    .unwrap_or_else(|_| "?".into());
                if let Err(e) = fs::metadata(path) {
                    if e.raw_os_error() == Some(libc::ELOOP) {
                        return Err(symlink_loop_error(path));
                    }
                }
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
                BackingKind::File => {
                    Self::create_file(path, Some(meta), size, min_size, force, unfinished)
                }
                BackingKind::BlockDevice => {
                    Self::create_block_device(path, &meta, size, min_size, force, unfinished)
                }
            },
            Err(e) if e.kind() == ErrorKind::NotFound => {
                Self::create_file(path, None, size, min_size, force, unfinished)
            }
            Err(e) => Err(Error::io(format!("stat {}", path.display()), e)),
        }
    }

    /// A pool device on a regular file the caller created new and still holds
    /// open (a scratch file): sized and put in direct-I/O mode through this
    /// descriptor, never reopened by `path` (which only names it in
    /// messages), so a name swapped for a link meanwhile redirects nothing.
    /// The file must still be empty: anything written to it since is refused.
    pub fn create_in_file(
        file: File,
        path: &Path,
        size: u64,
        min_size: u64,
    ) -> Result<BackingDevice> {
        if size % DIRECT_IO_ALIGN as u64 != 0 || size < min_size.max(DIRECT_IO_ALIGN as u64) {
            return Err(backing_error(
                path,
                format!(
                    "{size} bytes is not a multiple of {DIRECT_IO_ALIGN} of at least \
                     {min_size} bytes ({}); give a size that is",
                    min_size_hint()
                ),
            ));
        }
        lock_device(path, &file, Access::Exclusive)?;
        let meta = file
            .metadata()
            .context(|| format!("stat {}", path.display()))?;
        if !meta.file_type().is_file() || meta.len() != 0 {
            return Err(backing_error(
                path,
                "is not the empty file just created for the pool (something wrote to it \
                 meanwhile); pick a directory nothing else writes to",
            ));
        }
        let logical_block_size = allocate_for_pool(path, &file, 0, size, false)?;
        Ok(BackingDevice {
            path: path.to_path_buf(),
            file,
            size,
            kind: BackingKind::File,
            logical_block_size,
            access: Access::Exclusive,
            created: false,
            _loop_backing: None,
        })
    }

    /// A pool device reopened through a descriptor of its regular file the
    /// caller holds (a scratch file), not by `path` (which only names it).
    pub fn open_file(file: File, path: &Path, access: Access) -> Result<BackingDevice> {
        lock_device(path, &file, access)?;
        let meta = file
            .metadata()
            .context(|| format!("stat {}", path.display()))?;
        if !meta.file_type().is_file() {
            return Err(backing_error(path, "is not a regular file"));
        }
        let size = round_down(meta.len());
        if size == 0 {
            return Err(backing_error(
                path,
                format!("it is only {} bytes, too small to hold a pool", meta.len()),
            ));
        }
        let logical_block_size = file_logical_block_size(path, &file)?;
        enable_direct_io(&file).map_err(|e| direct_io_error(path, e))?;
        Ok(BackingDevice {
            path: path.to_path_buf(),
            file,
            size,
            kind: BackingKind::File,
            logical_block_size,
            access,
            created: false,
            _loop_backing: None,
        })
    }

    fn create_file(
        path: &Path,
        meta: Option<fs::Metadata>,
        size: Option<u64>,
        min_size: u64,
        force: bool,
        unfinished: &[[u8; 16]],
    ) -> Result<BackingDevice> {
        // An existing regular file and no size given: the pool takes the
        // file's size, as it takes a block device's (whether the file may be
        // formatted at all is decided below, by what it holds).
        let size = size.or_else(|| {
            meta.as_ref()
                .filter(|m| m.file_type().is_file() && m.len() > 0)
                .map(|m| round_down(m.len()))
        });
        let Some(size) = size else {
            return Err(backing_fix(
                path,
                "a backing file needs a size",
                Fix::GiveSize {
                    multiple_of: DIRECT_IO_ALIGN as u64,
                    at_least: min_size,
                },
            ));
        };
        if size % DIRECT_IO_ALIGN as u64 != 0 {
            return Err(backing_fix(
                path,
                format!(
                    "the requested size {size} bytes is not a multiple of {DIRECT_IO_ALIGN} \
                     (direct I/O alignment)"
                ),
                Fix::AlignSize {
                    example: round_down(size).max(DIRECT_IO_ALIGN as u64),
                },
            ));
        }
        if size < min_size {
            return Err(backing_fix(
                path,
                format!(
                    "backing file is {}; the pool needs at least {min_size} bytes ({}: {})",
                    human(size),
                    human(min_size),
                    min_size_hint()
                ),
                Fix::LargerSize,
            ));
        }
        if let Some(meta) = &meta {
            if let Some(why) = regular_file_use(meta) {
                return Err(backing_error(path, why));
            }
        }

        let open_existing = || {
            OpenOptions::new()
                .read(true)
                .write(true)
                .open(path)
                .map_err(|e| open_error(path, BackingKind::File, e))
        };
        let checked_use = meta.is_some();
        let (file, created) = if checked_use {
            (open_existing()?, false)
        } else {
            match OpenOptions::new()
                .read(true)
                .write(true)
                .create_new(true)
                .mode(0o600)
                .open(path)
            {
                Ok(f) => (f, true),
                // Another process created it since we looked (a second
                // `pool create` of the same file): it is an existing file
                // now, and its lock or its contents decide below.
                Err(e) if e.kind() == ErrorKind::AlreadyExists => (open_existing()?, false),
                Err(e) if e.kind() == ErrorKind::NotFound => {
                    return Err(backing_error(
                        path,
                        format!(
                            "its directory {} does not exist; create it first",
                            containing_dir(path).display()
                        ),
                    ))
                }
                Err(e) if e.kind() == ErrorKind::PermissionDenied => {
                    return Err(backing_error(
                        path,
                        format!(
                            "permission denied creating it in {} ({e}); create the pool in a \
                             directory this user may write",
                            containing_dir(path).display()
                        ),
                    ))
                }
                Err(e) => return Err(open_error(path, BackingKind::File, e)),
            }
        };
        // Lock before looking at (or truncating) anything: a live pool's writer or reader
        // holds it, and formatting under it would corrupt both. A file this process
        // created but another one locked first (it opened the new file in between) is
        // that process's now: a refusal here leaves it alone.
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
        check_still_named(path, &meta)?;
        // Ours to remove on failure only if nobody else locked it first and wrote to
        // it: a process that opened our new file, locked it before us and formatted a
        // pool in it (all while we were descheduled) has made it its own. Declared
        // after `file`, so dropped before it: a failed create removes its file while
        // still holding the lock, and whoever waited for that lock then finds the path
        // gone (`check_still_named`) instead of formatting an unlinked file.
        let mut guard = RemoveOnError {
            path,
            armed: created && meta.len() == 0,
        };
        if !created && !checked_use {
            if let Some(why) = regular_file_use(&meta) {
                return Err(backing_error(path, why));
            }
        }
        let len = meta.len();

        let mut sig = if len == 0 {
            Signature::Empty
        } else {
            let head = read_head(&file, len).context(|| format!("reading {}", path.display()))?;
            of_backup(
                of_unfinished_create(probe_signature(&head), &head, unfinished),
                &file,
                len,
            )
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
                return Err(backing_fix(
                    path,
                    format!(
                        "the file is {} ({len} bytes), larger than the requested size {} \
                         ({size} bytes); kvtier does not shrink it silently",
                        human(len),
                        human(size),
                    ),
                    Fix::Truncate {
                        to: size,
                        or_size: round_down(len),
                    },
                ));
            }
            file.set_len(size)
                .context(|| format!("truncating {} to {size} bytes", path.display()))?;
        }

        let logical_block_size = allocate_for_pool(path, &file, len, size, force)?;
        let dev = BackingDevice {
            path: path.to_path_buf(),
            file,
            size,
            kind: BackingKind::File,
            logical_block_size,
            access: Access::Exclusive,
            created: guard.armed,
            _loop_backing: None,
        };
        if !matches!(
            sig,
            Signature::Empty | Signature::KvtierPool | Signature::KvtierUnfinished
        ) {
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
        unfinished: &[[u8; 16]],
    ) -> Result<BackingDevice> {
        let (file, device_size, logical_block_size, loop_backing) =
            open_block_device(path, meta, Access::Exclusive)?;
        let usable = match size {
            None => round_down(device_size),
            Some(s) => {
                if s % DIRECT_IO_ALIGN as u64 != 0 {
                    return Err(backing_fix(
                        path,
                        format!(
                            "the requested size {s} bytes is not a multiple of \
                             {DIRECT_IO_ALIGN} (direct I/O alignment); leaving the size out \
                             uses the whole device"
                        ),
                        Fix::AlignSize {
                            example: round_down(s).max(DIRECT_IO_ALIGN as u64),
                        },
                    ));
                }
                if s > device_size {
                    return Err(backing_fix(
                        path,
                        format!(
                            "the requested size {} ({s} bytes) is larger than the device, \
                             which holds {} ({device_size} bytes); leaving the size out uses \
                             the whole device",
                            human(s),
                            human(device_size)
                        ),
                        Fix::SmallerSize,
                    ));
                }
                s
            }
        };
        if usable < min_size {
            let too_small = format!(
                "{} is {}; the pool needs at least {min_size} bytes ({}: {})",
                if size.is_some() {
                    "the requested size"
                } else {
                    "the block device"
                },
                human(usable),
                human(min_size),
                min_size_hint(),
            );
            return Err(match size {
                Some(_) => backing_fix(path, too_small, Fix::LargerSize),
                None => backing_error(path, format!("{too_small}; use a larger device")),
            });
        }

        let head =
            read_head(&file, device_size).context(|| format!("reading {}", path.display()))?;
        let mut sig = of_backup(
            of_unfinished_create(probe_signature(&head), &head, unfinished),
            &file,
            device_size,
        );
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
            created: false,
            _loop_backing: loop_backing,
        };
        if !matches!(
            sig,
            Signature::Empty | Signature::KvtierPool | Signature::KvtierUnfinished
        ) {
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
    /// [`POOL_MAGIC`](crate::host::signature::POOL_MAGIC). A block device's size is the whole device rounded down to
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
                return Err(backing_fix(path, "it does not exist", Fix::CreatePool))
            }
            Err(e) if e.raw_os_error() == Some(libc::ELOOP) => {
                return Err(symlink_loop_error(path))
            }
            Err(e) => return Err(Error::io(format!("stat {}", path.display()), e)),
        };
        let kind = backing_kind(path, &meta)?;
        let (file, raw_size, lbs, loop_backing) = match kind {
            BackingKind::BlockDevice => open_block_device(path, &meta, access)?,
            BackingKind::File => {
                if let Some(why) = regular_file_use(&meta) {
                    return Err(backing_error(path, why));
                }
                let file = OpenOptions::new()
                    .read(true)
                    .write(access == Access::Exclusive)
                    .open(path)
                    .map_err(|e| match e.kind() {
                        ErrorKind::PermissionDenied if access != Access::Exclusive => {
                            backing_error(
                                path,
                                format!(
                                    "permission denied opening it to read ({e}); run as a user \
                                     who may read it"
                                ),
                            )
                        }
                        _ => open_error(path, kind, e),
                    })?;
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
                (file, meta.len(), lbs, None)
            }
        };
        // A primary superblock that is damaged, unreadable or zeroed, where a
        // backup copy survives, is the pool's to recover (Pool::open), unless
        // something else (a filesystem, a partition table) was put there.
        let sig = match read_head(&file, raw_size) {
            Ok(head) => match probe_signature(&head) {
                Signature::Empty | Signature::Unknown if has_backup_superblock(&file, raw_size) => {
                    Signature::KvtierPool
                }
                sig => sig,
            },
            Err(_) if has_backup_superblock(&file, raw_size) => Signature::KvtierPool,
            Err(e) => return Err(Error::io(format!("reading {}", path.display()), e)),
        };
        if sig == Signature::KvtierUnfinished {
            return Err(backing_fix(
                path,
                format!("it is not a kvtier pool (found: {sig}: a create on it did not finish)"),
                Fix::RerunCreate,
            ));
        }
        if sig != Signature::KvtierPool {
            let found = if raw_size == 0 {
                "it is empty".to_string()
            } else {
                format!("found: {sig}")
            };
            return Err(backing_fix(
                path,
                format!("it is not a kvtier pool ({found})"),
                Fix::CreatePool,
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
            created: false,
            _loop_backing: loop_backing,
        })
    }

    /// The path it was opened by.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Usable size in bytes: the file length, or the device (or requested) size; always a
    /// multiple of [`DIRECT_IO_ALIGN`].
    pub fn size(&self) -> u64 {
        self.size
    }

    /// The bytes it holds now (BLKGETSIZE64, or the file's length), asked
    /// afresh: a block device can shrink under an open pool. `None` if the
    /// kernel will not say.
    pub fn current_size(&self) -> Option<u64> {
        match self.kind {
            BackingKind::BlockDevice => block_device_size(&self.file).ok(),
            BackingKind::File => self.file.metadata().ok().map(|m| m.len()),
        }
    }

    /// Whether [`BackingDevice::create`] made the file (it was not there
    /// before): a create that fails later removes only such files.
    pub fn created(&self) -> bool {
        self.created
    }

    /// File or block device.
    pub fn kind(&self) -> BackingKind {
        self.kind
    }

    /// Read-only or read-write.
    pub fn access(&self) -> Access {
        self.access
    }

    /// BLKSSZGET for block devices; for files the filesystem's direct I/O offset alignment
    /// (statx STATX_DIOALIGN) where reported, else 512. Always divides [`DIRECT_IO_ALIGN`].
    pub fn logical_block_size(&self) -> u32 {
        self.logical_block_size
    }

    /// The O_DIRECT descriptor, for io_uring registration (which takes its own
    /// duplicate: [`crate::engine::uring::UringDevice`]).
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
                    let fix = if e.raw_os_error() == Some(libc::ENOSPC) {
                        // Only a sparse file (created with --force where the file
                        // system could not preallocate) or a thin device fills up.
                        "; the file system or thin device under it is full: free space there, or make the pool smaller"
                    } else {
                        ""
                    };
                    return Err(self.device_error(
                        offset,
                        len,
                        format!("{op} failed after {done} of {len} bytes: {e}{fix}"),
                    ));
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
mod tests;
