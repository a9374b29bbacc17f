//! BAR0 of a PCI function mapped into this process: the one [`Bar0`] of real hardware,
//! whether the mapping came through sysfs `resource0` (uio, [`super::uio::open_bar0`]) or
//! through the VFIO device's region ([`super::vfio::VfioDevice::bar0`]).

use super::ctrl::{Bar0, DoorbellMemory};
use crate::error::{Error, Result};
use std::any::Any;
use std::io;
use std::os::fd::{AsRawFd, BorrowedFd};
use std::sync::Arc;

/// A mapping this process made (MMIO registers, or anonymous memory for DMA), unmapped
/// once, when dropped.
pub(crate) struct Mapping {
    ptr: *mut u8,
    len: usize,
}

// SAFETY: the mapping is valid until drop and only reached through raw pointers (MMIO
// with volatile accesses, DMA memory through the regions handed out of it).
unsafe impl Send for Mapping {}
// SAFETY: as above; it holds no state of its own beyond the address range.
unsafe impl Sync for Mapping {}

impl Mapping {
    /// `len` bytes of fresh private anonymous read-write memory, populated.
    pub(crate) fn anonymous(len: usize) -> io::Result<Mapping> {
        // SAFETY: a fresh anonymous mapping; checked below and owned by the Mapping.
        let ptr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_POPULATE,
                -1,
                0,
            )
        };
        if ptr == libc::MAP_FAILED {
            return Err(io::Error::last_os_error());
        }
        Ok(Mapping {
            ptr: ptr.cast(),
            len,
        })
    }

    /// The start of the mapping.
    pub(crate) fn ptr(&self) -> *mut u8 {
        self.ptr
    }

    /// Its bytes.
    pub(crate) fn len(&self) -> usize {
        self.len
    }
}

impl Drop for Mapping {
    fn drop(&mut self) {
        // SAFETY: ptr/len is a mapping made by `anonymous` or `MappedBar0::map`, owned
        // by this Mapping alone, unmapped once.
        unsafe { libc::munmap(self.ptr.cast(), self.len) };
    }
}

/// BAR0 of one PCI function, mapped. Cloning shares the mapping (and whatever else the
/// driver that mapped it keeps alive with it: the VFIO container and device).
#[derive(Clone)]
pub struct MappedBar0 {
    map: Arc<Mapping>,
    _owner: Option<Arc<dyn Any + Send + Sync>>,
}

impl MappedBar0 {
    /// Maps `len` bytes of `fd` at `offset` (a BAR file or region) read-write and
    /// shared; `owner` is kept alive as long as any clone of the mapping. `what` names
    /// the BAR in errors.
    pub(crate) fn map(
        fd: BorrowedFd<'_>,
        len: usize,
        offset: u64,
        owner: Option<Arc<dyn Any + Send + Sync>>,
        what: &str,
    ) -> Result<MappedBar0> {
        if len < 0x1000 {
            return Err(Error::invalid(format!(
                "{what}: BAR0 of {len} bytes is too small for an NVMe controller"
            )));
        }
        let offset = libc::off_t::try_from(offset)
            .map_err(|_| Error::invalid(format!("{what}: BAR0 offset {offset:#x} out of range")))?;
        // SAFETY: a fresh shared mapping of an open descriptor; the result is checked
        // below and owned by `Mapping` from then on.
        let ptr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                fd.as_raw_fd(),
                offset,
            )
        };
        if ptr == libc::MAP_FAILED {
            return Err(Error::io(
                format!("mapping {what}"),
                io::Error::last_os_error(),
            ));
        }
        Ok(MappedBar0 {
            map: Arc::new(Mapping {
                ptr: ptr.cast(),
                len,
            }),
            _owner: owner,
        })
    }

    /// The same mapping, keeping `owner` alive too.
    pub(crate) fn with_owner(&self, owner: Arc<dyn Any + Send + Sync>) -> MappedBar0 {
        MappedBar0 {
            map: self.map.clone(),
            _owner: Some(owner),
        }
    }

    /// Bytes mapped.
    pub fn len(&self) -> usize {
        self.map.len
    }

    /// Always false: a mapping shorter than the registers is refused.
    pub fn is_empty(&self) -> bool {
        self.map.len == 0
    }

    fn at<T>(&self, off: usize) -> *mut T {
        let size = std::mem::size_of::<T>();
        assert!(
            off % size == 0 && off + size <= self.map.len,
            "BAR0 access of {size} bytes at {off:#x} outside the {:#x} bytes mapped",
            self.map.len
        );
        // SAFETY: in range, checked above.
        unsafe { self.map.ptr.add(off).cast() }
    }
}

// SAFETY: accesses stay inside the mapped BAR (`at` panics otherwise) and are single
// volatile 32-bit loads and stores; 64-bit registers are two 32-bit accesses, low half
// first. On x86-64, uncached MMIO stores are ordered after the caller's earlier stores
// to DMA memory. The device reaches DMA memory at the addresses its driver's allocator
// reports: physical addresses under uio (`HugeDma`, no IOMMU), IOVAs under VFIO
// (`VfioDma` maps them into the device's container).
unsafe impl Bar0 for MappedBar0 {
    fn read32(&self, off: usize) -> u32 {
        // SAFETY: see `at`.
        unsafe { std::ptr::read_volatile(self.at::<u32>(off)) }
    }
    fn write32(&self, off: usize, v: u32) {
        // SAFETY: see `at`.
        unsafe { std::ptr::write_volatile(self.at::<u32>(off), v) }
    }
    fn doorbells(&self) -> Option<DoorbellMemory> {
        let base = super::spec::reg::DOORBELL_BASE;
        let len = self.map.len;
        (len > base).then(|| DoorbellMemory {
            // SAFETY: inside the mapping (checked length).
            ptr: unsafe { self.map.ptr.add(base) },
            len: len - base,
            mmio: true,
        })
    }
}
