//! Device access through VFIO type1 (an IOMMU): BAR0 mapped through the
//! VFIO device fd, DMA memory mapped at IOVAs kvtier chooses.
//!
//! [`VfioDevice::open`] takes a PCI address (checked as in
//! [`crate::host::pci::pci_device_dir`]), refuses a function not bound to
//! `vfio-pci` (binding is the caller's job: the kernel nvme driver must be
//! unbound first), opens its IOMMU group and a container with the type1
//! IOMMU, gets the device fd, maps BAR0 (region 0) and sets Memory Space
//! Enable and Bus Master Enable in the COMMAND register (config region).
//! [`VfioDevice::bar0`] is the [`Bar0`](super::ctrl::Bar0), [`VfioDevice::dma`] a [`VfioDma`]:
//! anonymous memory in chunks, each mapped with `VFIO_IOMMU_MAP_DMA` at
//! consecutive IOVAs from 4 GiB up, so any allocation is contiguous for the
//! device. Dropping the last handle unmaps the DMA and closes the fds.

use super::ctrl::{merge_chunks, DmaAlloc, DmaRegion, HostMapping, MappedChunk};
use super::mmio::{MappedBar0, Mapping};
use crate::error::{Error, Result};
use crate::host::pci::{bound_driver, pci_device_dir};
use std::fs::{File, OpenOptions};
use std::io;
use std::os::fd::{AsFd, AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::fs::FileExt;
use std::sync::Arc;

const VFIO_TYPE: u64 = b';' as u64;
const fn vfio_io(nr: u64) -> u64 {
    (VFIO_TYPE << 8) | (100 + nr)
}
const VFIO_GET_API_VERSION: u64 = vfio_io(0);
const VFIO_CHECK_EXTENSION: u64 = vfio_io(1);
const VFIO_SET_IOMMU: u64 = vfio_io(2);
const VFIO_GROUP_GET_STATUS: u64 = vfio_io(3);
const VFIO_GROUP_SET_CONTAINER: u64 = vfio_io(4);
const VFIO_GROUP_GET_DEVICE_FD: u64 = vfio_io(6);
const VFIO_DEVICE_GET_REGION_INFO: u64 = vfio_io(8);
const VFIO_IOMMU_MAP_DMA: u64 = vfio_io(13);
const VFIO_IOMMU_UNMAP_DMA: u64 = vfio_io(14);
const VFIO_API_VERSION: i32 = 0;
const VFIO_TYPE1_IOMMU: u64 = 1;
const VFIO_GROUP_FLAGS_VIABLE: u32 = 1;
const VFIO_DMA_MAP_FLAG_READ: u32 = 1;
const VFIO_DMA_MAP_FLAG_WRITE: u32 = 2;
const VFIO_PCI_BAR0_REGION_INDEX: u32 = 0;
const VFIO_PCI_CONFIG_REGION_INDEX: u32 = 7;

const PCI_COMMAND: u64 = 0x04;
const PCI_COMMAND_MEMORY: u16 = 1 << 1;
const PCI_COMMAND_MASTER: u16 = 1 << 2;

/// IOVA of the first DMA chunk.
const IOVA_BASE: u64 = 1 << 32;

#[repr(C)]
#[derive(Default)]
struct GroupStatus {
    argsz: u32,
    flags: u32,
}

#[repr(C)]
#[derive(Default)]
struct RegionInfo {
    argsz: u32,
    flags: u32,
    index: u32,
    cap_offset: u32,
    size: u64,
    offset: u64,
}

#[repr(C)]
struct DmaMap {
    argsz: u32,
    flags: u32,
    vaddr: u64,
    iova: u64,
    size: u64,
}

#[repr(C)]
struct DmaUnmap {
    argsz: u32,
    flags: u32,
    iova: u64,
    size: u64,
}

fn os_err(what: impl Into<String>) -> Error {
    Error::io(what, io::Error::last_os_error())
}

/// The open container, group and device fds, and the BAR0 mapping.
struct Inner {
    addr: String,
    container: File,
    _group: File,
    device: File,
    bar: MappedBar0,
    /// The next free IOVA of the container, shared by every allocator of
    /// this device so that two never map the same IOVA.
    next_iova: std::sync::atomic::AtomicU64,
}

fn region_info(device: &File, index: u32) -> Result<RegionInfo> {
    let mut info = RegionInfo {
        argsz: std::mem::size_of::<RegionInfo>() as u32,
        index,
        ..Default::default()
    };
    // SAFETY: the ioctl fills a struct of the size argsz says.
    if unsafe {
        libc::ioctl(
            device.as_raw_fd(),
            VFIO_DEVICE_GET_REGION_INFO as _,
            &mut info,
        )
    } != 0
    {
        return Err(os_err(format!("VFIO_DEVICE_GET_REGION_INFO({index})")));
    }
    Ok(info)
}

/// A PCI function bound to vfio-pci, in its own type1 container.
#[derive(Clone)]
pub struct VfioDevice {
    inner: Arc<Inner>,
}

impl VfioDevice {
    /// Opens the controller at PCI address `addr` (bound to vfio-pci): its group, a container with the type1 IOMMU, the device, BAR0.
    pub fn open(addr: &str) -> Result<VfioDevice> {
        let dir = pci_device_dir(addr)?;
        match bound_driver(&dir).as_deref() {
            Some("vfio-pci") => {}
            Some("nvme") => {
                return Err(Error::invalid(format!(
                    "PCI function {addr} is bound to the kernel nvme driver: unbind it first and bind it to vfio-pci"
                )))
            }
            other => {
                return Err(Error::invalid(format!(
                    "PCI function {addr} is bound to {}, not vfio-pci: bind it to vfio-pci first",
                    other.unwrap_or("no driver")
                )))
            }
        }
        let group_link = std::fs::read_link(dir.join("iommu_group"))
            .map_err(|e| Error::io(format!("{addr}: no IOMMU group (is the IOMMU on?)"), e))?;
        let group_id = group_link
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default();
        let open_rw = |p: &str| {
            OpenOptions::new()
                .read(true)
                .write(true)
                .open(p)
                .map_err(|e| Error::io(format!("opening {p}"), e))
        };
        let container = open_rw("/dev/vfio/vfio")?;
        let cfd = container.as_raw_fd();
        // SAFETY (all ioctls below): plain VFIO ioctls on fds we own, with
        // argument structs of the sizes their argsz fields say.
        if unsafe { libc::ioctl(cfd, VFIO_GET_API_VERSION as _) } != VFIO_API_VERSION {
            return Err(Error::invalid("unknown VFIO API version"));
        }
        if unsafe { libc::ioctl(cfd, VFIO_CHECK_EXTENSION as _, VFIO_TYPE1_IOMMU) } <= 0 {
            return Err(Error::invalid(
                "VFIO container does not support the type1 IOMMU",
            ));
        }
        let group = open_rw(&format!("/dev/vfio/{group_id}"))?;
        let mut status = GroupStatus {
            argsz: std::mem::size_of::<GroupStatus>() as u32,
            flags: 0,
        };
        if unsafe { libc::ioctl(group.as_raw_fd(), VFIO_GROUP_GET_STATUS as _, &mut status) } != 0 {
            return Err(os_err("VFIO_GROUP_GET_STATUS"));
        }
        if status.flags & VFIO_GROUP_FLAGS_VIABLE == 0 {
            return Err(Error::invalid(format!(
                "IOMMU group {group_id} of {addr} is not viable: bind every device in it to vfio-pci"
            )));
        }
        if unsafe { libc::ioctl(group.as_raw_fd(), VFIO_GROUP_SET_CONTAINER as _, &cfd) } != 0 {
            return Err(os_err("VFIO_GROUP_SET_CONTAINER"));
        }
        if unsafe { libc::ioctl(cfd, VFIO_SET_IOMMU as _, VFIO_TYPE1_IOMMU) } != 0 {
            return Err(os_err("VFIO_SET_IOMMU(type1)"));
        }
        let name = std::ffi::CString::new(addr.to_ascii_lowercase()).expect("checked address");
        let dfd = unsafe {
            libc::ioctl(
                group.as_raw_fd(),
                VFIO_GROUP_GET_DEVICE_FD as _,
                name.as_ptr(),
            )
        };
        if dfd < 0 {
            return Err(os_err(format!("VFIO_GROUP_GET_DEVICE_FD({addr})")));
        }
        // SAFETY: a fresh fd from the kernel, owned from here on.
        let device = File::from(unsafe { OwnedFd::from_raw_fd(dfd) });
        let bar = region_info(&device, VFIO_PCI_BAR0_REGION_INDEX)?;
        let bar = MappedBar0::map(
            device.as_fd(),
            bar.size as usize,
            bar.offset,
            None,
            &format!("BAR0 of {addr} through VFIO"),
        )?;
        let inner = Inner {
            addr: addr.to_string(),
            container,
            _group: group,
            device,
            bar,
            next_iova: std::sync::atomic::AtomicU64::new(IOVA_BASE),
        };
        let cfg = region_info(&inner.device, VFIO_PCI_CONFIG_REGION_INDEX)?;
        let mut b = [0u8; 2];
        inner
            .device
            .read_exact_at(&mut b, cfg.offset + PCI_COMMAND)
            .map_err(|e| Error::io(format!("reading COMMAND of {addr}"), e))?;
        let cmd = u16::from_le_bytes(b) | PCI_COMMAND_MEMORY | PCI_COMMAND_MASTER;
        inner
            .device
            .write_all_at(&cmd.to_le_bytes(), cfg.offset + PCI_COMMAND)
            .map_err(|e| Error::io(format!("writing COMMAND of {addr}"), e))?;
        Ok(VfioDevice {
            inner: Arc::new(inner),
        })
    }

    /// Its PCI address.
    pub fn addr(&self) -> &str {
        &self.inner.addr
    }

    /// BAR0 (shares the device: the container and its IOMMU mappings stay while it lives).
    pub fn bar0(&self) -> MappedBar0 {
        self.inner.bar.with_owner(self.inner.clone())
    }

    /// A DMA allocator mapping `chunk_bytes` at a time into this device's
    /// container.
    pub fn dma(&self, chunk_bytes: usize) -> VfioDma {
        VfioDma {
            inner: self.inner.clone(),
            chunks: Vec::new(),
            chunk: chunk_bytes.max(1 << 21),
        }
    }
}

/// One chunk of anonymous memory mapped for DMA at `iommu.iova`. Field order is drop
/// order: the IOMMU mapping goes before the memory it maps.
struct Chunk {
    iommu: HostIommuMap,
    mem: Mapping,
}

/// DMA memory for a [`VfioDevice`]: a bump allocator over chunks mapped at
/// consecutive IOVAs.
pub struct VfioDma {
    inner: Arc<Inner>,
    chunks: Vec<(Arc<Chunk>, usize)>,
    chunk: usize,
}

impl VfioDma {
    /// Reserves `len` bytes of IOVA space (2 MiB granular).
    fn take_iova(&self, len: u64) -> u64 {
        self.inner.next_iova.fetch_add(
            len.next_multiple_of(1 << 21),
            std::sync::atomic::Ordering::Relaxed,
        )
    }

    fn map_chunk(&mut self, len: usize) -> Result<Arc<Chunk>> {
        let mem = Mapping::anonymous(len)
            .map_err(|e| Error::io(format!("mapping {len} bytes for DMA"), e))?;
        // SAFETY: `mem` is memory we own; the Chunk keeps it mapped for as long as
        // the IOMMU mapping lives (it drops first). A failure drops `mem`, unmapped.
        let iommu = unsafe { self.iommu_map(mem.ptr() as u64, len as u64, "") }?;
        Ok(Arc::new(Chunk { iommu, mem }))
    }

    /// One VFIO_IOMMU_MAP_DMA of `size` bytes at `vaddr` (page aligned) at the next free
    /// IOVA, undone when the result drops; `what` adds to the error.
    ///
    /// # Safety
    /// The memory must stay mapped while the result lives.
    unsafe fn iommu_map(&self, vaddr: u64, size: u64, what: &str) -> Result<HostIommuMap> {
        let iova = self.take_iova(size);
        let map = DmaMap {
            argsz: std::mem::size_of::<DmaMap>() as u32,
            flags: VFIO_DMA_MAP_FLAG_READ | VFIO_DMA_MAP_FLAG_WRITE,
            vaddr,
            iova,
            size,
        };
        // SAFETY: the caller keeps the memory mapped while the mapping lives (this
        // function's contract); the kernel checks the range is ours and pins it.
        if unsafe {
            libc::ioctl(
                self.inner.container.as_raw_fd(),
                VFIO_IOMMU_MAP_DMA as _,
                &map,
            )
        } != 0
        {
            return Err(os_err(format!(
                "VFIO_IOMMU_MAP_DMA of {size} bytes{what} at IOVA {iova:#x}"
            )));
        }
        Ok(HostIommuMap {
            inner: self.inner.clone(),
            iova,
            size,
        })
    }
}

/// Host memory the caller owns, mapped into the container at `iova`.
struct HostIommuMap {
    inner: Arc<Inner>,
    iova: u64,
    size: u64,
}

impl Drop for HostIommuMap {
    fn drop(&mut self) {
        let unmap = DmaUnmap {
            argsz: std::mem::size_of::<DmaUnmap>() as u32,
            flags: 0,
            iova: self.iova,
            size: self.size,
        };
        // SAFETY: unmaps (and unpins) exactly what `map_host` mapped.
        unsafe {
            libc::ioctl(
                self.inner.container.as_raw_fd(),
                VFIO_IOMMU_UNMAP_DMA as _,
                &unmap,
            );
        }
    }
}

impl DmaAlloc for VfioDma {
    /// One VFIO_IOMMU_MAP_DMA of the pages spanning the range at the next
    /// free IOVA: the kernel pins them, and the device sees one contiguous
    /// IOVA range whatever the physical pages are.
    unsafe fn map_host(&mut self, addr: *mut u8, len: usize) -> Result<HostMapping> {
        let start = addr as u64 & !4095;
        let end = (addr as u64 + len as u64).next_multiple_of(4096);
        let size = end - start;
        // SAFETY: the caller keeps the memory mapped while the mapping lives (this
        // function's contract), and the mapping lives in the HostMapping returned.
        let iommu = unsafe {
            self.iommu_map(
                start,
                size,
                " of registered memory (RLIMIT_MEMLOCK must cover it)",
            )
        }?;
        Ok(HostMapping::new(
            merge_chunks([MappedChunk {
                host: start,
                dma: iommu.iova,
                len: size,
            }]),
            Box::new(iommu),
        ))
    }

    fn alloc(&mut self, bytes: usize, align: usize) -> Result<DmaRegion> {
        let bytes = bytes.max(1);
        let align = align.max(1);
        if !align.is_power_of_two() || align > 1 << 21 {
            return Err(Error::invalid(format!(
                "DMA alloc: alignment {align} must be a power of two up to 2 MiB"
            )));
        }
        let fits = |c: &Chunk, used: usize| {
            let off = used.next_multiple_of(align);
            (off + bytes <= c.mem.len()).then_some(off)
        };
        let found = self
            .chunks
            .iter()
            .enumerate()
            .find_map(|(i, (c, used))| fits(c, *used).map(|off| (i, off)));
        let (i, off) = match found {
            Some(f) => f,
            None => {
                let len = bytes.next_multiple_of(1 << 21).max(self.chunk);
                let c = self.map_chunk(len)?;
                self.chunks.push((c, 0));
                (self.chunks.len() - 1, 0)
            }
        };
        let (chunk, used) = &mut self.chunks[i];
        *used = off + bytes;
        // SAFETY: off..off+bytes lies in the chunk, mapped for the device at
        // iova..iova+len and kept alive (memory and IOMMU mapping) by the
        // owner handle; the bump allocator hands each byte out once.
        Ok(unsafe {
            DmaRegion::new(
                chunk.mem.ptr().add(off),
                chunk.iommu.iova + off as u64,
                bytes,
                chunk.clone() as Arc<dyn std::any::Any + Send + Sync>,
            )
        })
    }
}
