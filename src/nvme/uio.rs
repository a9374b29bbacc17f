//! Device access for machines without an IOMMU: BAR0 through sysfs
//! `resource0`, DMA memory from locked 2 MiB hugepages whose physical
//! addresses come from `/proc/self/pagemap`.
//!
//! [`open_bar0`] touches only the PCI function it is given (an address
//! such as `0000:00:04.0`, looked up under `/sys/bus/pci/devices`), refuses
//! one bound to the kernel's `nvme` driver, maps `resource0` and sets Memory
//! Space Enable and Bus Master Enable in the PCI COMMAND register (through
//! the function's sysfs `config` file). Binding the function to
//! `uio_pci_generic` (or leaving it unbound) is the caller's job.
//!
//! [`HugeDma`] hands out DMA memory from arenas of 2 MiB hugepages
//! (a hugetlb memfd, locked, its pages mapped in ascending physical order).
//! The device address of a region is its physical address: an allocation
//! that fits in one hugepage is physically contiguous; a larger one is
//! placed only across hugepages that pagemap shows to be physically
//! consecutive, and fails with a clear error if there are none. Reading physical frame numbers from pagemap
//! needs `CAP_SYS_ADMIN` (root); without it the kernel reports frame 0 and
//! [`HugeDma`] refuses to hand the memory out.
//!
//! Both need root and hardware (or QEMU); the QEMU lane
//! (`scripts/qemu/run.sh`, `examples/nvme_guest.rs`) exercises them.
//! The doorbell ordering of [`MappedBar0`] relies on x86-64's store ordering for
//! uncached MMIO after the queue's `SeqCst` fence.

use super::ctrl::{merge_chunks, DmaAlloc, DmaRegion, HostMapping, MappedChunk};
use super::mmio::MappedBar0;
use crate::error::{Error, Result};
use crate::host::pci::{bound_driver, pci_device_dir};
use std::fs::{File, OpenOptions};
use std::io;
use std::os::fd::{AsFd, FromRawFd};
use std::os::unix::fs::FileExt;
use std::path::Path;
use std::sync::Arc;

/// Size of the hugepages [`HugeDma`] uses.
pub(crate) const HUGEPAGE: usize = 2 << 20;

const PCI_COMMAND: u64 = 0x04;
const PCI_COMMAND_MEMORY: u16 = 1 << 1;
const PCI_COMMAND_MASTER: u16 = 1 << 2;

/// Maps BAR0 of PCI function `addr` through sysfs `resource0` and enables memory space
/// and bus mastering. Refuses a function bound to the `nvme` driver.
pub fn open_bar0(addr: &str) -> Result<MappedBar0> {
    let dir = pci_device_dir(addr)?;
    if !dir.exists() {
        return Err(Error::invalid(format!(
            "no PCI function {addr} ({} does not exist)",
            dir.display()
        )));
    }
    if let Some(drv) = bound_driver(&dir) {
        if drv == "nvme" {
            return Err(Error::invalid(format!(
                "PCI function {addr} is bound to the kernel nvme driver: unbind it first \
                 (bind it to uio_pci_generic, or leave it unbound)"
            )));
        }
    }
    let res = dir.join("resource0");
    let file = OpenOptions::new()
        .read(true)
        .write(true)
        .open(&res)
        .map_err(|e| Error::io(format!("opening {} (needs root)", res.display()), e))?;
    let len = file
        .metadata()
        .map_err(|e| Error::io(format!("stat {}", res.display()), e))?
        .len() as usize;
    let bar = MappedBar0::map(file.as_fd(), len, 0, None, &res.display().to_string())?;
    set_command_bits(&dir, PCI_COMMAND_MEMORY | PCI_COMMAND_MASTER)?;
    Ok(bar)
}

/// Sets `bits` in the PCI COMMAND register of the function in `dir`.
fn set_command_bits(dir: &Path, bits: u16) -> Result<()> {
    let path = dir.join("config");
    let cfg: File = OpenOptions::new()
        .read(true)
        .write(true)
        .open(&path)
        .map_err(|e| Error::io(format!("opening {}", path.display()), e))?;
    let mut b = [0u8; 2];
    cfg.read_exact_at(&mut b, PCI_COMMAND)
        .map_err(|e| Error::io(format!("reading COMMAND in {}", path.display()), e))?;
    let cmd = u16::from_le_bytes(b);
    if cmd & bits != bits {
        cfg.write_all_at(&(cmd | bits).to_le_bytes(), PCI_COMMAND)
            .map_err(|e| Error::io(format!("writing COMMAND in {}", path.display()), e))?;
    }
    Ok(())
}

/// One mapping of hugepages with the physical address of each.
struct Arena {
    ptr: *mut u8,
    len: usize,
    phys: Vec<u64>,
}

// SAFETY: the memory is plain anonymous memory valid until drop; regions
// handed out are not Send/Sync themselves.
unsafe impl Send for Arena {}
unsafe impl Sync for Arena {}

impl Drop for Arena {
    fn drop(&mut self) {
        // SAFETY: ptr/len is the mapping made in `Arena::new`, unmapped once.
        unsafe { libc::munmap(self.ptr.cast(), self.len) };
    }
}

impl Arena {
    /// Maps `hugepages` hugepages of a hugetlb memfd, then maps them again,
    /// in ascending physical order, into one 2 MiB-aligned virtual range, so
    /// that hugepages the kernel handed out physically adjacent (in any
    /// order) end up virtually adjacent too.
    fn new(hugepages: usize) -> Result<Arena> {
        let len = hugepages * HUGEPAGE;
        let os = |what: &str| Error::io(what.to_string(), io::Error::last_os_error());
        // SAFETY: plain syscalls on a fresh fd and fresh mappings, each
        // checked; every mapping made here is either returned in the Arena
        // (unmapped by its Drop) or unmapped before returning.
        unsafe {
            let fd = libc::memfd_create(
                c"kvtier-dma".as_ptr(),
                libc::MFD_HUGETLB | libc::MFD_CLOEXEC,
            );
            if fd < 0 {
                return Err(os("memfd_create(MFD_HUGETLB) for DMA hugepages"));
            }
            let fd = std::os::fd::OwnedFd::from_raw_fd(fd);
            let raw = std::os::fd::AsRawFd::as_raw_fd(&fd);
            if libc::ftruncate(raw, len as libc::off_t) != 0 {
                return Err(os("sizing the DMA hugepage memfd"));
            }

            let first = libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED | libc::MAP_POPULATE,
                raw,
                0,
            );
            if first == libc::MAP_FAILED {
                return Err(os(&format!(
                    "mapping {hugepages} 2 MiB hugepages (reserve them: echo N > /proc/sys/vm/nr_hugepages)"
                )));
            }
            let phys = page_frames(first.cast(), hugepages);
            libc::munmap(first, len);
            let phys = phys?;
            let mut order: Vec<usize> = (0..hugepages).collect();
            order.sort_by_key(|&i| phys[i]);
            // A 2 MiB-aligned virtual range for MAP_FIXED hugetlb mappings.
            let resv = libc::mmap(
                std::ptr::null_mut(),
                len + HUGEPAGE,
                libc::PROT_NONE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE,
                -1,
                0,
            );
            if resv == libc::MAP_FAILED {
                return Err(os("reserving address space for DMA hugepages"));
            }
            let base = (resv as usize).next_multiple_of(HUGEPAGE);
            let head = base - resv as usize;
            if head > 0 {
                libc::munmap(resv, head);
            }
            if HUGEPAGE - head > 0 {
                libc::munmap((base + len) as *mut libc::c_void, HUGEPAGE - head);
            }
            let mut arena = Arena {
                ptr: base as *mut u8,
                len,
                phys: Vec::new(),
            };
            for (j, &i) in order.iter().enumerate() {
                let p = libc::mmap(
                    (base + j * HUGEPAGE) as *mut libc::c_void,
                    HUGEPAGE,
                    libc::PROT_READ | libc::PROT_WRITE,
                    libc::MAP_SHARED | libc::MAP_FIXED | libc::MAP_POPULATE,
                    raw,
                    (i * HUGEPAGE) as libc::off_t,
                );
                if p == libc::MAP_FAILED {
                    return Err(os("remapping a DMA hugepage"));
                }
            }
            if libc::mlock(base as *const libc::c_void, len) != 0 {
                return Err(os("locking DMA hugepages"));
            }
            // Read the frames again through the final mapping: what the
            // device addresses must be what the CPU maps.
            arena.phys = page_frames(arena.ptr, hugepages)?;
            Ok(arena)
        }
    }

    /// Whether hugepages `first..=last` are physically consecutive.
    fn contiguous(&self, first: usize, last: usize) -> bool {
        (first..last).all(|i| self.phys[i + 1] == self.phys[i] + HUGEPAGE as u64)
    }
}

/// Physical addresses of the `n` 2 MiB hugepages mapped at `ptr` (faulting
/// each in first), from /proc/self/pagemap.
///
/// # Safety
///
/// `ptr..ptr + n * HUGEPAGE` must be a writable mapping of hugepages whose
/// first byte of each page may be overwritten.
unsafe fn page_frames(ptr: *mut u8, n: usize) -> Result<Vec<u64>> {
    let pagemap =
        File::open("/proc/self/pagemap").map_err(|e| Error::io("opening /proc/self/pagemap", e))?;
    let mut out = Vec::with_capacity(n);
    for i in 0..n {
        // SAFETY: inside the mapping (caller); the write faults it in.
        let p = unsafe { ptr.add(i * HUGEPAGE) };
        unsafe { std::ptr::write_volatile(p, 0) };
        let mut e = [0u8; 8];
        pagemap
            .read_exact_at(&mut e, (p as u64 / 4096) * 8)
            .map_err(|e| Error::io("reading /proc/self/pagemap", e))?;
        let entry = u64::from_le_bytes(e);
        let pfn = entry & ((1 << 55) - 1);
        if entry & (1 << 63) == 0 || pfn == 0 {
            return Err(Error::invalid(format!(
                "pagemap gives no physical frame for a locked hugepage (entry {entry:#x}): \
                 reading physical addresses needs root (CAP_SYS_ADMIN)"
            )));
        }
        let phys = pfn * 4096;
        if phys % HUGEPAGE as u64 != 0 {
            return Err(Error::invalid(format!(
                "hugepage at physical {phys:#x} is not 2 MiB aligned"
            )));
        }
        out.push(phys);
    }
    Ok(out)
}

/// DMA memory from locked 2 MiB hugepages, device address = physical
/// address. A bump allocator: memory comes back when the allocator and every
/// region from it are dropped.
pub struct HugeDma {
    arenas: Vec<(Arc<Arena>, usize)>,
    chunk: usize,
}

impl HugeDma {
    /// An allocator mapping `chunk_hugepages` hugepages at a time (more for
    /// an allocation that needs more).
    pub fn new(chunk_hugepages: usize) -> HugeDma {
        HugeDma {
            arenas: Vec::new(),
            chunk: chunk_hugepages.max(1),
        }
    }

    /// Hugepages mapped so far.
    pub fn hugepages(&self) -> usize {
        self.arenas.iter().map(|(a, _)| a.phys.len()).sum()
    }

    /// Places `bytes` at `align` in `arena` from `from`: the offset, or None.
    fn place(arena: &Arena, mut from: usize, bytes: usize, align: usize) -> Option<usize> {
        loop {
            let off = from.next_multiple_of(align);
            let end = off.checked_add(bytes)?;
            if end > arena.len {
                return None;
            }
            let first = off / HUGEPAGE;
            let last = (end - 1) / HUGEPAGE;
            if arena.contiguous(first, last) {
                return Some(off);
            }
            // Start again at the hugepage after the break in contiguity.
            let brk = (first..last)
                .find(|&i| arena.phys[i + 1] != arena.phys[i] + HUGEPAGE as u64)
                .expect("not contiguous");
            from = (brk + 1) * HUGEPAGE;
        }
    }
}

/// Host memory locked for DMA by `HugeDma::map_host`; unlocked on drop.
struct LockedRange {
    addr: usize,
    len: usize,
}

impl Drop for LockedRange {
    fn drop(&mut self) {
        // SAFETY: the range `map_host` locked; munlock only changes residency.
        unsafe { libc::munlock(self.addr as *const libc::c_void, self.len) };
    }
}

impl DmaAlloc for HugeDma {
    /// Without an IOMMU the device uses physical addresses: the range is
    /// locked (mlock faults every page in, writable) and each 4 KiB page's
    /// frame read from /proc/self/pagemap, adjacent frames merged. Locked
    /// hugetlb pages never move; locked 4 KiB or THP pages can in principle
    /// be migrated by compaction, so register hugepage-backed memory here
    /// (kvtier's own host KV cache is) or use VFIO, where the IOMMU pins.
    unsafe fn map_host(&mut self, addr: *mut u8, len: usize) -> Result<HostMapping> {
        let start = addr as usize & !4095;
        let end = (addr as usize + len).next_multiple_of(4096);
        let size = end - start;
        // SAFETY: the caller's contract: the range is mapped memory.
        if unsafe { libc::mlock(start as *const libc::c_void, size) } != 0 {
            return Err(Error::io(
                format!("locking {size} bytes of registered memory for DMA (RLIMIT_MEMLOCK must cover it)"),
                io::Error::last_os_error(),
            ));
        }
        let lock = LockedRange {
            addr: start,
            len: size,
        };
        let pagemap = File::open("/proc/self/pagemap")
            .map_err(|e| Error::io("opening /proc/self/pagemap", e))?;
        let pages = size / 4096;
        let mut raw = vec![0u8; pages * 8];
        pagemap
            .read_exact_at(&mut raw, (start as u64 / 4096) * 8)
            .map_err(|e| Error::io("reading /proc/self/pagemap", e))?;
        let mut chunks = Vec::with_capacity(pages);
        for (i, e) in raw.chunks_exact(8).enumerate() {
            let entry = u64::from_le_bytes(e.try_into().expect("8 bytes"));
            let pfn = entry & ((1 << 55) - 1);
            if entry & (1 << 63) == 0 || pfn == 0 {
                return Err(Error::invalid(format!(
                    "pagemap gives no physical frame for locked page {:#x} (entry {entry:#x}): \
                     physical addresses need root (CAP_SYS_ADMIN)",
                    start + i * 4096
                )));
            }
            chunks.push(MappedChunk {
                host: (start + i * 4096) as u64,
                dma: pfn * 4096,
                len: 4096,
            });
        }
        Ok(HostMapping::new(merge_chunks(chunks), Box::new(lock)))
    }

    fn alloc(&mut self, bytes: usize, align: usize) -> Result<DmaRegion> {
        let bytes = bytes.max(1);
        let align = align.max(1);
        if !align.is_power_of_two() || align > HUGEPAGE {
            return Err(Error::invalid(format!(
                "DMA alloc: alignment {align} must be a power of two up to 2 MiB"
            )));
        }
        let mut found = None;
        for (i, (arena, used)) in self.arenas.iter().enumerate() {
            if let Some(off) = Self::place(arena, *used, bytes, align) {
                found = Some((i, off));
                break;
            }
        }
        let (i, off) = match found {
            Some(f) => f,
            None => {
                let pages = bytes.div_ceil(HUGEPAGE).max(self.chunk);
                let arena = Arena::new(pages)?;
                let off = Self::place(&arena, 0, bytes, align).ok_or_else(|| {
                    Error::invalid(format!(
                        "DMA alloc of {bytes} bytes: no physically contiguous run of {} hugepages \
                         among {pages} mapped (physical {:x?})",
                        bytes.div_ceil(HUGEPAGE),
                        arena.phys
                    ))
                })?;
                self.arenas.push((Arc::new(arena), 0));
                (self.arenas.len() - 1, off)
            }
        };
        let (arena, used) = &mut self.arenas[i];
        *used = off + bytes;
        let phys = arena.phys[off / HUGEPAGE] + (off % HUGEPAGE) as u64;
        // SAFETY: off..off+bytes lies inside the arena, whose hugepages in
        // that range are physically consecutive (place), locked, and mapped
        // until the arena (kept alive by the region's owner) is dropped; the
        // bump allocator never hands the same bytes out twice.
        Ok(unsafe {
            DmaRegion::new(
                arena.ptr.add(off),
                phys,
                bytes,
                arena.clone() as Arc<dyn std::any::Any + Send + Sync>,
            )
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn placement_respects_physical_contiguity() {
        // No real memory: only the placement logic over fake frames.
        let arena = Arena {
            ptr: std::ptr::null_mut(),
            len: 4 * HUGEPAGE,
            phys: vec![0x4000_0000, 0x4020_0000, 0x1000_0000, 0x1020_0000],
        };
        assert_eq!(HugeDma::place(&arena, 0, 4096, 4096), Some(0));
        assert_eq!(HugeDma::place(&arena, 100, 64, 4096), Some(4096));
        // 3 MiB from 1 MiB fits in pages 0-1.
        assert_eq!(
            HugeDma::place(&arena, 1 << 20, 3 << 20, 4096),
            Some(1 << 20)
        );
        // From page 1, 3 MiB cannot span pages 1-2: it moves to page 2.
        assert_eq!(
            HugeDma::place(&arena, HUGEPAGE + 4096, 3 << 20, 4096),
            Some(2 * HUGEPAGE)
        );
        assert_eq!(HugeDma::place(&arena, 0, 5 << 20, 4096), None);
        std::mem::forget(arena);
    }
}
