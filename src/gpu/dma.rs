//! How the NVMe controller reaches memory the GPU uses: one trait,
//! [`GpuDmaPath`], three ways, and which of them a machine has
//! ([`check_paths`], shown by `kvtier doctor` in its gpu section).
//!
//! | path | deployment that needs it | data path | `kvtier doctor` checks |
//! | --- | --- | --- | --- |
//! | [`DmaPathKind::HostBounce`] | any machine where the SSD is on vfio-pci behind an IOMMU (or on uio_pci_generic without one): the default | SSD → pinned host bounce buffer → `cuMemcpyAsync` → HBM; SQ/CQ in pinned host memory, the GPU builds SQEs and polls CQs over PCIe | `/dev/vfio/vfio`, module `vfio_pci`, IOMMU units or groups in sysfs; or module `uio_pci_generic` |
//! | [`DmaPathKind::DmaBuf`] | bare metal or VMs with iommufd, for SSD → HBM without the host copy | GPU memory exported as a dma-buf (`cuMemGetHandleForAddressRange(DMA_BUF_FD)`) and mapped into the SSD's iommufd IOAS (`IOMMU_IOAS_MAP_FILE`) | `/dev/iommu`, kernel ≥ 6.13 (first with `IOMMU_IOAS_MAP_FILE`), the open NVIDIA kernel module (`/proc/driver/nvidia/version`) |
//! | [`DmaPathKind::Peermem`] | machines without an IOMMU (or with the SSD in VFIO no-IOMMU mode) | SSD → HBM at GPU BAR1 bus addresses | module `nvidia_peermem` |
//!
//! What is done and what is not:
//! - HostBounce is complete over any [`DmaAlloc`] (VFIO's `VfioDma`, uio's
//!   hugepages, or a fake in tests): it rounds to pages, maps the memory for
//!   the controller through the allocator and for the GPU with
//!   `cuMemHostRegister(DEVICEMAP)`.
//! - DmaBuf: the export is implemented ([`export_dma_buf`]); mapping the fd
//!   into an iommufd IOAS is not — mainline `IOMMU_IOAS_MAP_FILE` takes memfd
//!   files, and whether a kernel accepts a dma-buf there is only known by
//!   trying. [`DmaBufPath::alloc`] exports and then returns an error naming
//!   the missing step.
//! - Peermem: nvidia-peermem hands GPU pages to RDMA drivers inside the
//!   kernel (`nvidia_p2p_get_pages`); user space cannot get the physical
//!   addresses from it. [`PeermemPath::alloc`] returns an error saying kvtier
//!   needs a kernel module for that.

use super::context::{Context, Stream};
use super::memory::{DeviceBuffer, HostRegistration, RegisterFlags};
use crate::error::{Error, Result};
use crate::nvme::ctrl::{DmaAlloc, DmaRegion};
use serde::Serialize;
use std::os::fd::OwnedFd;
use std::path::{Path, PathBuf};

/// CUDA registers host memory in whole pages; regions are rounded to this.
pub const PAGE: usize = 4096;

/// The oldest kernel with `IOMMU_IOAS_MAP_FILE` (Linux 6.13).
pub(crate) const IOAS_MAP_FILE_KERNEL: (u32, u32) = (6, 13);

/// A way for an NVMe controller to reach GPU-visible memory.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub enum DmaPathKind {
    /// Pinned host memory the controller reaches through the IOMMU; the GPU copies it into HBM.
    HostBounce,
    /// GPU memory exported as dma-buf and mapped for the device through iommufd.
    DmaBuf,
    /// GPU memory pages from nvidia_peermem (no IOMMU).
    Peermem,
}

impl DmaPathKind {
    /// Its name in reports (`host-bounce`, `dma-buf`, `peermem`).
    pub fn name(self) -> &'static str {
        match self {
            DmaPathKind::HostBounce => "host-bounce",
            DmaPathKind::DmaBuf => "dma-buf",
            DmaPathKind::Peermem => "peermem",
        }
    }

    /// Which deployment uses it (one line, for reports).
    pub fn deployment(self) -> &'static str {
        match self {
            DmaPathKind::HostBounce => "SSD on vfio-pci behind an IOMMU (or uio): queues and bounce buffers in pinned host memory, copied to HBM with cuMemcpyAsync",
            DmaPathKind::DmaBuf => "iommufd: GPU memory exported as dma-buf and mapped for the SSD, SSD to HBM directly",
            DmaPathKind::Peermem => "no IOMMU: GPU BAR1 bus addresses via nvidia_peermem, SSD to HBM directly",
        }
    }
}

/// Memory the controller can DMA to and the GPU can address.
///
/// Field order is drop order: the CUDA registration goes before the memory
/// it registers.
pub struct GpuDmaRegion {
    _registration: Option<HostRegistration>,
    host: Option<DmaRegion>,
    bus: u64,
    len: usize,
    device_ptr: Option<u64>,
    kind: DmaPathKind,
}

impl GpuDmaRegion {
    /// The address the NVMe controller uses (IOVA or bus address).
    pub fn bus_addr(&self) -> u64 {
        self.bus
    }

    /// Bytes of the region.
    pub fn len(&self) -> usize {
        self.len
    }

    /// An empty region.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The address kernels use; `None` when the path was built without a
    /// CUDA context (host-only, e.g. in tests).
    pub fn device_ptr(&self) -> Option<u64> {
        self.device_ptr
    }

    /// Host view, for paths whose memory is host memory.
    pub fn host(&self) -> Option<&DmaRegion> {
        self.host.as_ref()
    }

    /// The path the region came from.
    pub fn kind(&self) -> DmaPathKind {
        self.kind
    }

    /// Data landed here must be copied to HBM before compute uses it.
    pub fn is_staging(&self) -> bool {
        self.kind == DmaPathKind::HostBounce
    }

    /// Queue a copy of `len` bytes at `off` of this (staging) region to the
    /// device address `dst` on `stream`.
    ///
    /// # Safety
    /// `dst..dst+len` must be device memory valid until the copy completes,
    /// and this region must outlive the copy (synchronize `stream` before
    /// dropping it).
    pub unsafe fn copy_to_device(
        &self,
        stream: &Stream,
        off: usize,
        dst: u64,
        len: usize,
    ) -> Result<()> {
        let src = self.device_ptr.ok_or_else(|| {
            Error::gpu(
                "staging copy",
                "this region was made without a CUDA context; build the path with one",
            )
        })?;
        if off.checked_add(len).is_none_or(|e| e > self.len) {
            return Err(Error::invalid(format!(
                "staging copy of {len} bytes at {off} past the region's {} bytes",
                self.len
            )));
        }
        // SAFETY: source in range of our registered memory; destination per
        // the caller's contract.
        unsafe { stream.memcpy_async(dst, src + off as u64, len) }
    }
}

/// How the controller reaches GPU-visible memory. `alloc` hands out memory
/// for queues (SQ, CQ) and data, DMA-contiguous for the controller and
/// addressable by the GPU's kernels.
pub trait GpuDmaPath {
    /// The kind of path.
    fn kind(&self) -> DmaPathKind;
    /// `bytes` bytes aligned to `align` (a power of two) for the controller.
    fn alloc(&mut self, bytes: usize, align: usize) -> Result<GpuDmaRegion>;
}

/// Path (a): pinned host memory mapped for the controller by `A` (VFIO
/// `VfioDma`, uio `HugeDma`, or a fake) and for the GPU by
/// `cuMemHostRegister(DEVICEMAP)`.
pub struct HostBouncePath<A: DmaAlloc> {
    alloc: A,
    ctx: Option<Context>,
}

impl<A: DmaAlloc> HostBouncePath<A> {
    /// With `ctx = None` the regions have no GPU address (for tests and for
    /// the CPU-polled nvme engine that shares the code).
    pub fn new(alloc: A, ctx: Option<Context>) -> Self {
        HostBouncePath { alloc, ctx }
    }
}

impl<A: DmaAlloc> GpuDmaPath for HostBouncePath<A> {
    fn kind(&self) -> DmaPathKind {
        DmaPathKind::HostBounce
    }

    fn alloc(&mut self, bytes: usize, align: usize) -> Result<GpuDmaRegion> {
        if bytes == 0 || !align.is_power_of_two() {
            return Err(Error::invalid(format!(
                "GPU DMA alloc of {bytes} bytes aligned {align}: need bytes > 0 and a power-of-two alignment"
            )));
        }
        // Whole pages: CUDA registers pages, and two registrations may not
        // share one.
        let len = bytes.next_multiple_of(PAGE);
        let region = self.alloc.alloc(len, align.max(PAGE))?;
        if region.ptr() as usize % PAGE != 0 || region.len() < len {
            return Err(Error::invalid(format!(
                "DMA allocator returned {region:?} for {len} page-aligned bytes"
            )));
        }
        if region.dma() % align as u64 != 0 {
            return Err(Error::invalid(format!(
                "DMA allocator returned bus address {:#x}, not aligned to {align}",
                region.dma()
            )));
        }
        let registration = match &self.ctx {
            None => None,
            // SAFETY: the region's memory stays mapped while `region` (held
            // by the GpuDmaRegion, dropped after the registration) lives.
            Some(ctx) => Some(unsafe {
                HostRegistration::register(ctx, region.ptr(), len, RegisterFlags::DeviceMap)?
            }),
        };
        Ok(GpuDmaRegion {
            device_ptr: registration.as_ref().map(|r| r.device_ptr()),
            _registration: registration,
            bus: region.dma(),
            len,
            host: Some(region),
            kind: DmaPathKind::HostBounce,
        })
    }
}

/// Export `len` bytes of `buf` from offset 0 as a dma-buf fd. `len` is
/// rounded up to [`PAGE`] and must fit in the buffer.
pub fn export_dma_buf(buf: &DeviceBuffer, len: usize) -> Result<OwnedFd> {
    let len = len.next_multiple_of(PAGE);
    if len > buf.len() || buf.device_ptr() % PAGE as u64 != 0 {
        return Err(Error::invalid(format!(
            "dma-buf export of {len} bytes: the buffer ({} bytes at {:#x}) must be page-aligned and hold whole pages",
            buf.len(),
            buf.device_ptr()
        )));
    }
    super::driver::mem_dma_buf_fd(buf.device_ptr(), len)
}

/// Path (b): GPU memory as dma-buf, mapped through iommufd. See the module
/// doc: the export works; the iommufd mapping is not implemented.
pub struct DmaBufPath {
    ctx: Context,
    root: PathBuf,
}

impl DmaBufPath {
    /// The path for GPU memory of `ctx`.
    pub fn new(ctx: Context) -> Self {
        DmaBufPath {
            ctx,
            root: PathBuf::from("/"),
        }
    }
}

impl GpuDmaPath for DmaBufPath {
    fn kind(&self) -> DmaPathKind {
        DmaPathKind::DmaBuf
    }

    fn alloc(&mut self, bytes: usize, _align: usize) -> Result<GpuDmaRegion> {
        let check = check_dma_buf(&self.root);
        let len = bytes.max(1).next_multiple_of(PAGE);
        let buf = DeviceBuffer::alloc(&self.ctx, len)?;
        let fd = export_dma_buf(&buf, len)?;
        drop(fd);
        Err(Error::gpu(
            "dma-buf DMA path",
            format!(
                "exported {len} bytes of GPU memory as a dma-buf, but kvtier does not map dma-bufs into an iommufd IOAS yet (IOMMU_IOAS_MAP_FILE with a dma-buf fd); machine: {}; use the host-bounce path",
                check.detail
            ),
        ))
    }
}

/// Path (c): physical addresses from nvidia-peermem. Not reachable from user
/// space; see the module doc.
pub struct PeermemPath {
    root: PathBuf,
}

impl PeermemPath {
    /// The path.
    pub fn new() -> Self {
        PeermemPath {
            root: PathBuf::from("/"),
        }
    }
}

impl Default for PeermemPath {
    fn default() -> Self {
        Self::new()
    }
}

impl GpuDmaPath for PeermemPath {
    fn kind(&self) -> DmaPathKind {
        DmaPathKind::Peermem
    }

    fn alloc(&mut self, _bytes: usize, _align: usize) -> Result<GpuDmaRegion> {
        Err(peermem_error(&self.root))
    }
}

fn peermem_error(root: &Path) -> Error {
    let loaded = root.join("sys/module/nvidia_peermem").exists();
    Error::gpu(
        "peermem DMA path",
        format!(
            "nvidia_peermem is {}; it gives GPU page addresses only to RDMA drivers inside the kernel (nvidia_p2p_get_pages), so kvtier needs a kernel module of its own to obtain the bus addresses of GPU memory for the NVMe controller, and does not ship one; use the host-bounce path (IOMMU) instead",
            if loaded { "loaded" } else { "not loaded" }
        ),
    )
}

/// What a machine offers for one path.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct PathCheck {
    /// The path.
    pub kind: DmaPathKind,
    /// The machine has the prerequisites.
    pub available: bool,
    /// kvtier implements the path end to end.
    pub implemented: bool,
    /// What was found or is missing.
    pub detail: String,
}

fn non_empty_dir(p: &Path) -> bool {
    std::fs::read_dir(p).is_ok_and(|mut d| d.next().is_some())
}


fn check_dma_buf(root: &Path) -> PathCheck {
    let mut missing = Vec::new();
    let mut found = Vec::new();
    if root.join("dev/iommu").exists() {
        found.push("/dev/iommu".to_string());
    } else {
        missing.push("no /dev/iommu (kernel without CONFIG_IOMMUFD, or no IOMMU)".to_string());
    }
    let release = std::fs::read_to_string(root.join("proc/sys/kernel/osrelease")).ok();
    match release.as_deref().and_then(crate::host::kernel_version) {
        Some(v) if v >= IOAS_MAP_FILE_KERNEL => found.push(format!("kernel {}.{}", v.0, v.1)),
        Some(v) => missing.push(format!(
            "kernel {}.{} < {}.{} (no IOMMU_IOAS_MAP_FILE)",
            v.0, v.1, IOAS_MAP_FILE_KERNEL.0, IOAS_MAP_FILE_KERNEL.1
        )),
        None => missing.push("kernel version unknown (no /proc/sys/kernel/osrelease)".into()),
    }
    match std::fs::read_to_string(root.join("proc/driver/nvidia/version")) {
        Ok(v) if v.contains("Open Kernel Module") => found.push("open NVIDIA kernel module".into()),
        Ok(_) => missing.push(
            "the proprietary NVIDIA kernel module is loaded; dma-buf export needs the open one"
                .into(),
        ),
        Err(_) => missing.push("no NVIDIA kernel module (/proc/driver/nvidia/version)".into()),
    }
    PathCheck {
        kind: DmaPathKind::DmaBuf,
        available: missing.is_empty(),
        implemented: false,
        detail: if missing.is_empty() {
            format!(
                "{}; kvtier exports the dma-buf but does not map it into iommufd yet",
                found.join(", ")
            )
        } else {
            missing.join("; ")
        },
    }
}

/// Which paths the machine under `root` (`/` for this one; a fake tree in
/// tests) offers.
pub fn check_paths(root: &Path) -> Vec<PathCheck> {
    let iommu = non_empty_dir(&root.join("sys/class/iommu"))
        || non_empty_dir(&root.join("sys/kernel/iommu_groups"));
    let vfio = root.join("dev/vfio/vfio").exists() && root.join("sys/module/vfio_pci").exists();
    let uio = root.join("sys/module/uio_pci_generic").exists();
    let bounce = PathCheck {
        kind: DmaPathKind::HostBounce,
        available: (vfio && iommu) || uio,
        implemented: true,
        detail: match (vfio, iommu, uio) {
            (true, true, _) => "vfio-pci with an IOMMU".into(),
            (_, _, true) => "uio_pci_generic (bounce buffers at physical addresses; root only)".into(),
            (true, false, false) => {
                "vfio-pci but no IOMMU: enable it (intel_iommu=on / amd_iommu=on) or modprobe uio_pci_generic".into()
            }
            (false, _, false) => {
                "neither vfio-pci (modprobe vfio-pci, /dev/vfio/vfio) nor uio_pci_generic".into()
            }
        },
    };
    let peermem = root.join("sys/module/nvidia_peermem").exists();
    vec![
        bounce,
        check_dma_buf(root),
        PathCheck {
            kind: DmaPathKind::Peermem,
            available: peermem,
            implemented: false,
            detail: if peermem {
                "nvidia_peermem loaded; user space cannot get GPU bus addresses from it: kvtier would need its own kernel module".into()
            } else {
                "nvidia_peermem not loaded (modprobe nvidia-peermem); even then kvtier would need its own kernel module".into()
            },
        },
    ]
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::any::Any;
    use std::sync::{Arc, Mutex};

    /// A fake VFIO: page-aligned heap memory "mapped" at IOVAs from 1 GiB,
    /// recording each map so the test can check what the controller would see.
    struct FakeIommu {
        next_iova: u64,
        maps: Arc<Mutex<Vec<(usize, u64, usize)>>>,
    }

    struct Mem {
        ptr: *mut u8,
        layout: std::alloc::Layout,
    }
    // SAFETY: owns plain memory.
    unsafe impl Send for Mem {}
    // SAFETY: as above.
    unsafe impl Sync for Mem {}
    impl Drop for Mem {
        fn drop(&mut self) {
            // SAFETY: allocated with this layout in `alloc`.
            unsafe { std::alloc::dealloc(self.ptr, self.layout) }
        }
    }

    impl DmaAlloc for FakeIommu {
        fn alloc(&mut self, bytes: usize, align: usize) -> Result<DmaRegion> {
            let layout = std::alloc::Layout::from_size_align(bytes, align).unwrap();
            // SAFETY: non-zero size.
            let ptr = unsafe { std::alloc::alloc_zeroed(layout) };
            assert!(!ptr.is_null());
            let iova = self.next_iova.next_multiple_of(align as u64);
            self.next_iova = iova + bytes as u64;
            self.maps.lock().unwrap().push((ptr as usize, iova, bytes));
            let owner: Arc<dyn Any + Send + Sync> = Arc::new(Mem { ptr, layout });
            // SAFETY: ptr valid for `bytes` while `owner` lives; the "device"
            // address is the fake IOVA.
            Ok(unsafe { DmaRegion::new(ptr, iova, bytes, owner) })
        }
    }

    #[test]
    fn host_bounce_rounds_to_pages_and_reports_the_iova() {
        let maps = Arc::new(Mutex::new(Vec::new()));
        let mut path = HostBouncePath::new(
            FakeIommu {
                next_iova: 1 << 30,
                maps: maps.clone(),
            },
            None,
        );
        assert_eq!(path.kind(), DmaPathKind::HostBounce);
        let sq = path.alloc(64 * 64, 64).unwrap();
        let data = path.alloc(5000, 4096).unwrap();
        assert_eq!(sq.len(), 4096);
        assert_eq!(data.len(), 8192, "5000 bytes round up to two pages");
        assert_eq!(sq.bus_addr(), 1 << 30);
        assert_eq!(data.bus_addr(), (1 << 30) + 4096);
        assert!(sq.is_staging());
        assert_eq!(sq.device_ptr(), None, "no context, no GPU address");
        let m = maps.lock().unwrap();
        assert_eq!(m.len(), 2);
        assert_eq!(m[1].2, 8192, "the allocator saw the page-rounded size");
        assert_eq!(m[0].0 % PAGE, 0, "host memory page-aligned");
        // What the controller writes at the IOVA is what the host reads.
        data.host().unwrap().write(4999, &[0xab]);
        let mut b = [0u8; 1];
        data.host().unwrap().read(4999, &mut b);
        assert_eq!(b[0], 0xab);
        assert!(path.alloc(0, 8).is_err());
        assert!(path.alloc(8, 3).is_err());
    }

    #[test]
    fn host_bounce_refuses_an_allocator_that_breaks_alignment() {
        struct Odd;
        impl DmaAlloc for Odd {
            fn alloc(&mut self, bytes: usize, _align: usize) -> Result<DmaRegion> {
                let v: Arc<dyn Any + Send + Sync> = Arc::new(vec![0u8; bytes + 8]);
                let p = v.downcast_ref::<Vec<u8>>().unwrap().as_ptr() as *mut u8;
                // SAFETY: `p` valid for bytes+8 while `v` lives; only read in this test.
                Ok(unsafe { DmaRegion::new(p, 0x1001, bytes, v) })
            }
        }
        let e = HostBouncePath::new(Odd, None)
            .alloc(4096, 4096)
            .err()
            .unwrap();
        let s = e.to_string();
        assert!(s.contains("DMA allocator returned"), "{s}");
    }

    fn fake_root(name: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("kvtier-dma-{}-{name}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        d
    }

    fn touch(root: &Path, rel: &str) {
        let p = root.join(rel);
        std::fs::create_dir_all(p.parent().unwrap()).unwrap();
        std::fs::write(p, "").unwrap();
    }

    fn mkdir(root: &Path, rel: &str) {
        std::fs::create_dir_all(root.join(rel)).unwrap();
    }

    #[test]
    fn nothing_on_an_empty_machine() {
        let r = fake_root("empty");
        let c = check_paths(&r);
        assert_eq!(c.len(), 3);
        assert!(c.iter().all(|c| !c.available), "{c:?}");
        assert!(c[0].detail.contains("neither vfio-pci"), "{}", c[0].detail);
        assert!(c[1].detail.contains("no /dev/iommu"), "{}", c[1].detail);
        assert!(
            c[1].detail.contains("kernel version unknown"),
            "{}",
            c[1].detail
        );
        assert!(c[2].detail.contains("not loaded"), "{}", c[2].detail);
        std::fs::remove_dir_all(&r).unwrap();
    }

    #[test]
    fn vfio_with_iommu_and_iommufd_on_a_new_kernel() {
        let r = fake_root("full");
        touch(&r, "dev/vfio/vfio");
        mkdir(&r, "sys/module/vfio_pci");
        mkdir(&r, "sys/kernel/iommu_groups/7");
        touch(&r, "dev/iommu");
        std::fs::create_dir_all(r.join("proc/sys/kernel")).unwrap();
        std::fs::write(r.join("proc/sys/kernel/osrelease"), "6.14.2-arch1\n").unwrap();
        std::fs::create_dir_all(r.join("proc/driver/nvidia")).unwrap();
        std::fs::write(
            r.join("proc/driver/nvidia/version"),
            "NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  580.65.06\n",
        )
        .unwrap();
        mkdir(&r, "sys/module/nvidia_peermem");
        let c = check_paths(&r);
        assert!(c[0].available && c[0].implemented, "{:?}", c[0]);
        assert_eq!(c[0].detail, "vfio-pci with an IOMMU");
        assert!(c[1].available && !c[1].implemented, "{:?}", c[1]);
        assert!(c[1].detail.contains("kernel 6.14"), "{}", c[1].detail);
        assert!(c[2].available && !c[2].implemented, "{:?}", c[2]);
        assert!(c[2].detail.contains("own kernel module"), "{}", c[2].detail);
        let e = peermem_error(&r).to_string();
        assert!(e.contains("nvidia_peermem is loaded"), "{e}");
        assert!(e.contains("kernel module of its own"), "{e}");
        std::fs::remove_dir_all(&r).unwrap();
    }

    #[test]
    fn old_kernel_proprietary_module_and_vfio_without_iommu() {
        let r = fake_root("old");
        touch(&r, "dev/vfio/vfio");
        mkdir(&r, "sys/module/vfio_pci");
        mkdir(&r, "sys/class/iommu"); // present but empty: no IOMMU
        touch(&r, "dev/iommu");
        std::fs::create_dir_all(r.join("proc/sys/kernel")).unwrap();
        std::fs::write(r.join("proc/sys/kernel/osrelease"), "5.15.0-105-generic").unwrap();
        std::fs::create_dir_all(r.join("proc/driver/nvidia")).unwrap();
        std::fs::write(
            r.join("proc/driver/nvidia/version"),
            "NVRM version: NVIDIA UNIX x86_64 Kernel Module  550.54.15\n",
        )
        .unwrap();
        let c = check_paths(&r);
        assert!(!c[0].available);
        assert!(c[0].detail.contains("but no IOMMU"), "{}", c[0].detail);
        assert!(!c[1].available);
        assert!(
            c[1].detail.contains("kernel 5.15 < 6.13"),
            "{}",
            c[1].detail
        );
        assert!(
            c[1].detail.contains("needs the open one"),
            "{}",
            c[1].detail
        );
        // uio alone makes the bounce path available.
        mkdir(&r, "sys/module/uio_pci_generic");
        assert!(check_paths(&r)[0].available);
        std::fs::remove_dir_all(&r).unwrap();
    }

    #[test]
    fn kernel_versions() {
        assert_eq!(crate::host::kernel_version("6.8.0-45-generic"), Some((6, 8)));
        assert_eq!(crate::host::kernel_version("6.13\n"), Some((6, 13)));
        assert_eq!(crate::host::kernel_version("6"), None);
        assert_eq!(crate::host::kernel_version("x.y"), None);
        assert!((6, 13) >= IOAS_MAP_FILE_KERNEL && (6, 12) < IOAS_MAP_FILE_KERNEL);
    }

    #[test]
    fn peermem_path_always_explains() {
        let e = PeermemPath::new()
            .alloc(4096, 4096)
            .err()
            .unwrap()
            .to_string();
        assert!(e.contains("kernel module"), "{e}");
    }
}
