//! Where a pool's bytes live: a small storage-backend trait.
//!
//! The pool reads and writes its superblocks and block headers through
//! [`Storage`] (a few synchronous, aligned transfers at create, open and
//! check time); the hot data path goes through an I/O engine instead. Two
//! backends exist: [`super::backing::BackingDevice`] (an O_DIRECT file or
//! block device, driven on the data path by the io_uring engine) and an NVMe
//! namespace driven from userspace (`crate::nvme::NvmeNamespace`,
//! with the nvme engine on the data path), so a pool can live directly on a
//! namespace with no kernel driver or filesystem under it.

use super::backing::BackingDevice;
use crate::error::Result;
use crate::host::dio::AlignedBuf;
use std::os::fd::BorrowedFd;
use std::path::Path;

/// What a pool's metadata and data go through: a file or block device, or an NVMe namespace driven from userspace.
pub trait Storage: Send {
    /// Names the device in messages and in `pool info` (a path, or
    /// `nvme:ADDRESS/nsN` for a namespace driven from userspace).
    fn path(&self) -> &Path;

    /// Usable bytes.
    fn size(&self) -> u64;

    /// Fill `buf` from byte `offset`; `offset` and `buf.len()` are multiples
    /// of 4096. A short read is an error naming the device and the range.
    fn read_exact_at(&self, buf: &mut AlignedBuf, offset: u64) -> Result<()>;

    /// Write all of `buf` at byte `offset` (same alignment rules).
    fn write_all_at(&self, buf: &AlignedBuf, offset: u64) -> Result<()>;

    /// Make every completed write durable (fdatasync, NVMe Flush).
    fn sync_data(&self) -> Result<()>;

    /// The file descriptor the io_uring engine drives, for file and block
    /// device backends; `None` for storage only another engine can reach.
    fn io_fd(&self) -> Option<BorrowedFd<'_>> {
        None
    }

    /// The bytes the device holds now, asked afresh (a block device can
    /// shrink under an open pool); `None` where it cannot be asked.
    fn current_size(&self) -> Option<u64> {
        None
    }
}

impl Storage for BackingDevice {
    fn path(&self) -> &Path {
        BackingDevice::path(self)
    }
    fn size(&self) -> u64 {
        BackingDevice::size(self)
    }
    fn read_exact_at(&self, buf: &mut AlignedBuf, offset: u64) -> Result<()> {
        BackingDevice::read_exact_at(self, buf, offset)
    }
    fn write_all_at(&self, buf: &AlignedBuf, offset: u64) -> Result<()> {
        BackingDevice::write_all_at(self, buf, offset)
    }
    fn sync_data(&self) -> Result<()> {
        BackingDevice::sync_data(self)
    }
    fn io_fd(&self) -> Option<BorrowedFd<'_>> {
        Some(BackingDevice::as_fd(self))
    }
    fn current_size(&self) -> Option<u64> {
        BackingDevice::current_size(self)
    }
}
