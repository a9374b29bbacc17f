//! The raw syscalls and ioctls on a backing device, each in a small function with its
//! SAFETY argument: block-device size, logical block size, read-only flag and partition
//! re-read, O_DIRECT on an open file, preallocation.

use super::*;

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
pub(super) fn block_device_size(file: &File) -> io::Result<u64> {
    let mut size: u64 = 0;
    // SAFETY: BLKGETSIZE64 writes one u64 through the pointer, which points to a live
    // local; the fd stays open for the duration of the call.
    unsafe { ioctls::blkgetsize64(file.as_raw_fd(), &mut size) }.map_err(io::Error::from)?;
    Ok(size)
}

/// Logical block size of the block device open as `file`.
pub(super) fn block_device_logical_block_size(file: &File) -> io::Result<u32> {
    let mut lbs: libc::c_int = 0;
    // SAFETY: BLKSSZGET writes one c_int through the pointer, a live local; fd is open.
    unsafe { ioctls::blksszget(file.as_raw_fd(), &mut lbs) }.map_err(io::Error::from)?;
    u32::try_from(lbs).map_err(|_| io::Error::other(format!("BLKSSZGET returned {lbs}")))
}

/// Is the block device open as `file` read-only?
pub(super) fn block_device_read_only(file: &File) -> io::Result<bool> {
    let mut ro: libc::c_int = 0;
    // SAFETY: BLKROGET writes one c_int through the pointer, a live local; fd is open.
    unsafe { ioctls::blkroget(file.as_raw_fd(), &mut ro) }.map_err(io::Error::from)?;
    Ok(ro != 0)
}

/// Ask the kernel to re-read the partition table (best effort: drops stale partitions
/// after a forced overwrite of a partitioned disk).
pub(super) fn block_device_reread_partitions(file: &File) -> io::Result<()> {
    // SAFETY: BLKRRPART takes no argument; the fd is open for the call.
    unsafe { ioctls::blkrrpart(file.as_raw_fd()) }.map_err(io::Error::from)?;
    Ok(())
}

/// Turn on O_DIRECT for an open file (fcntl F_SETFL); EINVAL if the filesystem cannot.
pub(super) fn enable_direct_io(file: &File) -> nix::Result<()> {
    let flags = OFlag::from_bits_retain(nix::fcntl::fcntl(file, FcntlArg::F_GETFL)?);
    nix::fcntl::fcntl(file, FcntlArg::F_SETFL(flags | OFlag::O_DIRECT))?;
    Ok(())
}

/// Allocate `[0, len)` of a regular file (fallocate mode 0: extends, never shrinks).
pub(super) fn allocate_file(file: &File, len: u64) -> nix::Result<()> {
    let len = libc::off_t::try_from(len).map_err(|_| Errno::EFBIG)?;
    nix::fcntl::fallocate(file, FallocateFlags::empty(), 0, len)
}
