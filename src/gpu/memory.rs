//! GPU-visible memory: device allocations, pinned host memory, registration
//! of existing host memory (the KV pool, a PCI BAR's doorbells), and the
//! completion counters a stream waits on.
//!
//! The no-CPU-in-the-loop handshake: the I/O kernel (on the I/O green
//! context) bumps an IOCB's completion counter when its last CQE arrives; the
//! compute stream was given `cuStreamWaitValue32(counter >= n)` before the
//! layer's attention kernel, so the GPU front end holds that kernel until the
//! data is in memory. The host only queues the wait, once per layer.

use super::context::{Context, Stream};
use super::driver;
use crate::error::{Error, Result};
use crate::memory::{KvMemory, MemoryKind};
use cudarc::driver::sys;
use std::sync::atomic::AtomicU32;
use std::sync::Arc;

/// Device memory (`cuMemAlloc`), freed on drop.
pub struct DeviceBuffer {
    ctx: Context,
    ptr: u64,
    len: usize,
}

impl DeviceBuffer {
    /// `len` bytes of device memory in `ctx`.
    pub fn alloc(ctx: &Context, len: usize) -> Result<DeviceBuffer> {
        if len == 0 {
            return Err(Error::invalid("device allocation of 0 bytes"));
        }
        ctx.bind()?;
        Ok(DeviceBuffer {
            ctx: ctx.clone(),
            ptr: driver::mem_alloc(len)?,
            len,
        })
    }

    /// An allocation of `len` zero bytes.
    pub fn zeroed(ctx: &Context, len: usize) -> Result<DeviceBuffer> {
        let b = Self::alloc(ctx, len)?;
        // SAFETY: the whole allocation, just made.
        unsafe { driver::memset_d8(b.ptr, 0, len)? };
        Ok(b)
    }

    /// The device address.
    pub fn device_ptr(&self) -> u64 {
        self.ptr
    }

    /// Bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// No bytes.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    fn check(&self, off: usize, len: usize) -> Result<()> {
        check_range("device buffer", off, len, self.len)
    }

    /// Synchronous copy from the host into `[off, off + data.len())`.
    pub fn write(&self, off: usize, data: &[u8]) -> Result<()> {
        self.check(off, data.len())?;
        self.ctx.bind()?;
        // SAFETY: in range of our allocation (checked).
        unsafe { driver::memcpy_htod(self.ptr + off as u64, data) }
    }

    /// Synchronous copy of `[off, off + out.len())` to the host.
    pub fn read(&self, off: usize, out: &mut [u8]) -> Result<()> {
        self.check(off, out.len())?;
        self.ctx.bind()?;
        // SAFETY: in range of our allocation (checked).
        unsafe { driver::memcpy_dtoh(out, self.ptr + off as u64) }
    }

    /// The whole buffer copied to the host.
    pub fn to_vec(&self) -> Result<Vec<u8>> {
        let mut v = vec![0; self.len];
        self.read(0, &mut v)?;
        Ok(v)
    }
}

impl Drop for DeviceBuffer {
    fn drop(&mut self) {
        let _ = self.ctx.bind();
        // cuMemFree synchronizes with work using the allocation.
        let _ = driver::mem_free(self.ptr);
    }
}

/// Page-locked host memory (`cuMemAllocHost`), mapped into the GPU's unified
/// address space; zeroed at allocation. The GPU may write it at any time, so
/// it is read and written only through copies and atomics, never as `&[u8]`.
pub struct PinnedHostBuffer {
    ctx: Context,
    ptr: *mut u8,
    dev: u64,
    len: usize,
}

// SAFETY: plain memory owned by this value; accessed through raw copies and
// atomics only.
unsafe impl Send for PinnedHostBuffer {}
// SAFETY: as above.
unsafe impl Sync for PinnedHostBuffer {}

impl PinnedHostBuffer {
    /// `len` bytes of pinned, device-mapped host memory in `ctx`.
    pub fn alloc(ctx: &Context, len: usize) -> Result<PinnedHostBuffer> {
        if len == 0 {
            return Err(Error::invalid("pinned allocation of 0 bytes"));
        }
        ctx.bind()?;
        let ptr = driver::mem_alloc_host(len)?;
        // Owned from here: an error below frees it in drop.
        let mut b = PinnedHostBuffer {
            ctx: ctx.clone(),
            ptr,
            dev: 0,
            len,
        };
        // SAFETY: `len` bytes we just allocated.
        unsafe { std::ptr::write_bytes(ptr, 0, len) };
        b.dev = driver::mem_host_device_pointer(ptr)?;
        Ok(b)
    }

    /// The host address.
    pub fn host_ptr(&self) -> *mut u8 {
        self.ptr
    }

    /// The address kernels and stream operations use.
    pub fn device_ptr(&self) -> u64 {
        self.dev
    }

    /// Bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// No bytes.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    fn check(&self, off: usize, len: usize) -> Result<()> {
        check_range("pinned buffer", off, len, self.len)
    }

    /// Copies `data` in at `off` (bounds checked).
    pub fn write(&self, off: usize, data: &[u8]) -> Result<()> {
        self.check(off, data.len())?;
        // SAFETY: in range (checked); raw copy, no reference to GPU-written memory.
        unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), self.ptr.add(off), data.len()) };
        Ok(())
    }

    /// Copies out from `off` into `out` (bounds checked).
    pub fn read(&self, off: usize, out: &mut [u8]) -> Result<()> {
        self.check(off, out.len())?;
        // SAFETY: in range (checked); raw copy.
        unsafe { std::ptr::copy_nonoverlapping(self.ptr.add(off), out.as_mut_ptr(), out.len()) };
        Ok(())
    }

    /// The 32-bit word at `off` (4-byte aligned) as an atomic shared with the GPU.
    pub fn atomic_u32(&self, off: usize) -> Result<&AtomicU32> {
        self.check(off, 4)?;
        if off % 4 != 0 {
            return Err(Error::invalid(format!(
                "atomic word at unaligned offset {off}"
            )));
        }
        // SAFETY: in range, 4-byte aligned (the allocation is page-aligned),
        // valid for the life of `self`; AtomicU32 has u32's layout.
        Ok(unsafe { &*(self.ptr.add(off) as *const AtomicU32) })
    }
}

impl Drop for PinnedHostBuffer {
    fn drop(&mut self) {
        let _ = self.ctx.bind();
        // SAFETY: from mem_alloc_host, freed once; GPU users are kept alive by
        // the streams that queued them (see Stream's keep list).
        let _ = unsafe { driver::mem_free_host(self.ptr) };
    }
}

/// How [`HostRegistration::register`] maps host memory.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RegisterFlags {
    /// Ordinary memory, mapped into the GPU's address space
    /// (`CU_MEMHOSTREGISTER_DEVICEMAP | CU_MEMHOSTREGISTER_PORTABLE`).
    DeviceMap,
    /// An mmap of a PCI BAR (e.g. an NVMe controller's BAR0 with its
    /// doorbells, from VFIO): `CU_MEMHOSTREGISTER_IOMEMORY |
    /// CU_MEMHOSTREGISTER_DEVICEMAP`, so GPU stores reach the device as PCIe
    /// peer writes. The driver refuses it for memory that is not I/O memory
    /// on some systems and on others accepts it; see tests/gpu.rs.
    IoMemory,
}

impl RegisterFlags {
    fn bits(self) -> u32 {
        match self {
            // PORTABLE: the pages are pinned for every context, the green
            // contexts and a serving engine's primary context alike, so a copy
            // on any of their streams runs at pinned speed. (With unified
            // addressing the driver does this anyway; say it, not rely on it.)
            RegisterFlags::DeviceMap => {
                sys::CU_MEMHOSTREGISTER_DEVICEMAP | sys::CU_MEMHOSTREGISTER_PORTABLE
            }
            RegisterFlags::IoMemory => {
                sys::CU_MEMHOSTREGISTER_IOMEMORY
                    | sys::CU_MEMHOSTREGISTER_DEVICEMAP
                    | sys::CU_MEMHOSTREGISTER_PORTABLE
            }
        }
    }
}

/// Existing host memory registered with CUDA (`cuMemHostRegister`),
/// unregistered on drop.
pub struct HostRegistration {
    ctx: Context,
    ptr: *mut u8,
    len: usize,
    dev: u64,
}

// SAFETY: holds an address, not the memory; unregistration is thread-safe.
unsafe impl Send for HostRegistration {}
// SAFETY: as above.
unsafe impl Sync for HostRegistration {}

impl HostRegistration {
    /// Register `len` bytes at `ptr`.
    ///
    /// # Safety
    /// The range must be mapped in this process (memory, or an mmap of a PCI
    /// BAR for [`RegisterFlags::IoMemory`]) and stay mapped until this value
    /// is dropped; GPU accesses through [`Self::device_ptr`] must stop before
    /// that.
    pub unsafe fn register(
        ctx: &Context,
        ptr: *mut u8,
        len: usize,
        flags: RegisterFlags,
    ) -> Result<HostRegistration> {
        if len == 0 || ptr.is_null() {
            return Err(Error::invalid("host registration of an empty range"));
        }
        ctx.bind()?;
        // SAFETY: the caller's contract.
        unsafe { driver::mem_host_register(ptr, len, flags.bits())? };
        // Owned from here: an error below unregisters in drop.
        let mut reg = HostRegistration {
            ctx: ctx.clone(),
            ptr,
            len,
            dev: 0,
        };
        reg.dev = driver::mem_host_device_pointer(ptr)?;
        Ok(reg)
    }

    /// The host address.
    pub fn host_ptr(&self) -> *mut u8 {
        self.ptr
    }

    /// The device address.
    pub fn device_ptr(&self) -> u64 {
        self.dev
    }

    /// Bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// No bytes.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

impl Drop for HostRegistration {
    fn drop(&mut self) {
        let _ = self.ctx.bind();
        // SAFETY: registered by `register`, unregistered once.
        let _ = unsafe { driver::mem_host_unregister(self.ptr) };
    }
}

/// The engine's KV memory as the GPU addresses it.
pub struct KvRegistration {
    /// `(host or device address, len, device address)` per region.
    regions: Vec<(u64, u64, u64)>,
    _registrations: Vec<HostRegistration>,
}

impl KvRegistration {
    /// The GPU address of an address inside the KV memory (the engine's
    /// pointer: host for host KV memory, device for GPU KV memory).
    pub fn device_addr(&self, addr: u64) -> Option<u64> {
        self.regions
            .iter()
            .find(|&&(a, l, _)| a <= addr && addr < a + l)
            .map(|&(a, _, d)| d + (addr - a))
    }

    /// `(engine address, len, GPU address)` of each region.
    pub fn regions(&self) -> &[(u64, u64, u64)] {
        &self.regions
    }
}

/// Make the KV pool `mem` GPU-addressable: host KV memory is registered with
/// `cuMemHostRegister(DEVICEMAP)` region by region; GPU KV memory is checked
/// to be device memory of `ctx`'s device and used as is.
///
/// # Safety
/// For host memory, the regions of `mem` must be mapped memory of this
/// process that outlives the returned registration.
pub unsafe fn register_kv_memory(ctx: &Context, mem: &KvMemory) -> Result<KvRegistration> {
    mem.validate()?;
    let mut regions = Vec::new();
    let mut regs = Vec::new();
    for (addr, len) in mem.regions() {
        match mem.kind {
            MemoryKind::Host => {
                // SAFETY: the caller's contract.
                let r = unsafe {
                    HostRegistration::register(
                        ctx,
                        addr as *mut u8,
                        len as usize,
                        RegisterFlags::DeviceMap,
                    )?
                };
                regions.push((addr, len, r.device_ptr()));
                regs.push(r);
            }
            MemoryKind::Gpu { ordinal } => {
                check_device_region(ctx, ordinal, addr, len)?;
                regions.push((addr, len, addr));
            }
        }
    }
    Ok(KvRegistration {
        regions,
        _registrations: regs,
    })
}

/// GPU KV memory `mem` (checked for copy kernels, not direct I/O) is device
/// memory of `ctx`'s device, region by region: what the staged HBM path
/// needs before its kernels write there.
pub fn check_gpu_kv_memory(ctx: &Context, mem: &KvMemory) -> Result<()> {
    mem.validate_for_copies()?;
    let MemoryKind::Gpu { ordinal } = mem.kind else {
        return Err(Error::Registration(
            "KV memory in host memory is not GPU memory; register it with the tier directly".into(),
        ));
    };
    for (addr, len) in mem.regions() {
        check_device_region(ctx, ordinal, addr, len)?;
    }
    Ok(())
}

fn check_device_region(ctx: &Context, ordinal: u32, addr: u64, len: u64) -> Result<()> {
    ctx.bind()?;
    let want = ctx.device().ordinal();
    if ordinal as i32 != want {
        return Err(Error::Registration(format!(
            "KV memory says GPU {ordinal} but the context is on GPU {want}"
        )));
    }
    for probe in [addr, addr + len - 1] {
        match driver::pointer_device_ordinal(probe)? {
            Some(o) if o == want => {}
            other => {
                return Err(Error::Registration(format!(
                    "KV region {addr:#x}+{len} is not device memory of GPU {want} (driver says {other:?}); pass the engine's CUDA tensor addresses"
                )))
            }
        }
    }
    Ok(())
}

/// How [`Stream::wait_counter`] compares.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WaitCond {
    /// `(int32)(*addr - value) >= 0`: a counter that only grows (wraps safely).
    Geq,
    /// `*addr == value`.
    Eq,
    /// `(*addr & value) != 0`.
    And,
}

impl WaitCond {
    fn bits(self) -> u32 {
        use sys::CUstreamWaitValue_flags as F;
        (match self {
            WaitCond::Geq => F::CU_STREAM_WAIT_VALUE_GEQ,
            WaitCond::Eq => F::CU_STREAM_WAIT_VALUE_EQ,
            WaitCond::And => F::CU_STREAM_WAIT_VALUE_AND,
        }) as u32
    }
}

enum CounterMem {
    Host(PinnedHostBuffer),
    Device(DeviceBuffer),
    /// The CPU test double's: a plain host word no GPU can reach.
    Double(Box<std::sync::atomic::AtomicU32>),
}

/// A 32-bit completion counter in GPU-visible memory: written by kernels or
/// `cuStreamWriteValue32`, waited on by streams with `cuStreamWaitValue32`.
/// `host_mapped` counters live in pinned host memory (the host can read and
/// write them too); `device` counters in HBM (cheaper for GPU-only traffic).
pub struct CompletionCounter {
    mem: CounterMem,
}

impl CompletionCounter {
    /// A counter in pinned host memory (host and GPU read and write it).
    pub fn host_mapped(ctx: &Context) -> Result<Arc<CompletionCounter>> {
        Ok(Arc::new(CompletionCounter {
            mem: CounterMem::Host(PinnedHostBuffer::alloc(ctx, 4)?),
        }))
    }

    /// A counter in device memory (GPU traffic only).
    pub fn device(ctx: &Context) -> Result<Arc<CompletionCounter>> {
        Ok(Arc::new(CompletionCounter {
            mem: CounterMem::Device(DeviceBuffer::zeroed(ctx, 4)?),
        }))
    }

    /// A counter in plain host memory for the CPU test double of the
    /// staging copies (`super::staging::HostCopier`): it is loaded and
    /// stored like the others, but no stream can wait on it or write it.
    pub fn host_double() -> Arc<CompletionCounter> {
        Arc::new(CompletionCounter {
            mem: CounterMem::Double(Box::new(std::sync::atomic::AtomicU32::new(0))),
        })
    }

    /// Whether this is the double's host word (no stream may use it).
    pub fn is_double(&self) -> bool {
        matches!(self.mem, CounterMem::Double(_))
    }

    /// The counter's device address, for kernels and stream waits.
    pub fn device_ptr(&self) -> u64 {
        match &self.mem {
            CounterMem::Host(b) => b.device_ptr(),
            CounterMem::Device(b) => b.device_ptr(),
            CounterMem::Double(a) => a.as_ptr() as u64,
        }
    }

    /// The value now (an atomic load for host-mapped counters, a copy for
    /// device counters).
    pub fn load(&self) -> Result<u32> {
        match &self.mem {
            CounterMem::Host(b) => Ok(b.atomic_u32(0)?.load(std::sync::atomic::Ordering::Acquire)),
            CounterMem::Device(b) => {
                let mut v = [0u8; 4];
                b.read(0, &mut v)?;
                Ok(u32::from_ne_bytes(v))
            }
            CounterMem::Double(a) => Ok(a.load(std::sync::atomic::Ordering::Acquire)),
        }
    }

    /// Set the value from the host (what a CPU-side completion does; the I/O
    /// kernel does the same with a store on the GPU).
    pub fn store(&self, v: u32) -> Result<()> {
        match &self.mem {
            CounterMem::Host(b) => {
                b.atomic_u32(0)?
                    .store(v, std::sync::atomic::Ordering::Release);
                Ok(())
            }
            CounterMem::Device(b) => b.write(0, &v.to_ne_bytes()),
            CounterMem::Double(a) => {
                a.store(v, std::sync::atomic::Ordering::Release);
                Ok(())
            }
        }
    }
}

impl Stream {
    /// Queue a wait: later work on this stream starts only once `counter`
    /// satisfies `cond` against `value`. The counter is kept alive until the
    /// wait has completed (see [`Stream`]).
    pub fn wait_counter(
        &self,
        counter: &Arc<CompletionCounter>,
        value: u32,
        cond: WaitCond,
    ) -> Result<()> {
        refuse_double(counter)?;
        self.context().bind()?;
        // SAFETY: a 4-byte aligned GPU-visible word, kept alive by `keep_alive`
        // until the stream has passed the wait.
        unsafe {
            driver::stream_wait_value32(self.raw(), counter.device_ptr(), value, cond.bits())?
        };
        self.keep_alive(counter.clone());
        Ok(())
    }

    /// Queue a store of `value` into `counter` after the work queued so far.
    pub fn write_counter(&self, counter: &Arc<CompletionCounter>, value: u32) -> Result<()> {
        refuse_double(counter)?;
        self.context().bind()?;
        // SAFETY: as in `wait_counter`.
        unsafe { driver::stream_write_value32(self.raw(), counter.device_ptr(), value)? };
        self.keep_alive(counter.clone());
        Ok(())
    }
}

/// A stream handed the CPU double's counter would write a host address.
fn refuse_double(counter: &CompletionCounter) -> Result<()> {
    if counter.is_double() {
        return Err(Error::invalid(
            "a CPU test double's counter given to a GPU stream; use a counter of the GPU's context",
        ));
    }
    Ok(())
}

/// `len` bytes at `off` must lie inside a buffer of `total` bytes.
fn check_range(what: &str, off: usize, len: usize, total: usize) -> Result<()> {
    if off.checked_add(len).is_none_or(|e| e > total) {
        return Err(Error::invalid(format!(
            "{what}: {len} bytes at offset {off} past its {total} bytes"
        )));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn flag_bits_are_the_cuda_values() {
        // From cuda.h: PORTABLE 0x01, DEVICEMAP 0x02, IOMEMORY 0x04; wait GEQ 0,
        // EQ 1, AND 2.
        assert_eq!(RegisterFlags::DeviceMap.bits(), 0x03);
        assert_eq!(RegisterFlags::IoMemory.bits(), 0x07);
        assert_eq!(WaitCond::Geq.bits(), 0);
        assert_eq!(WaitCond::Eq.bits(), 1);
        assert_eq!(WaitCond::And.bits(), 2);
    }

    #[test]
    fn kv_translation_is_by_region() {
        let k = KvRegistration {
            regions: vec![(0x1000, 0x100, 0x9000), (0x5000, 0x10, 0x5000)],
            _registrations: Vec::new(),
        };
        assert_eq!(k.device_addr(0x1000), Some(0x9000));
        assert_eq!(k.device_addr(0x10ff), Some(0x90ff));
        assert_eq!(k.device_addr(0x1100), None);
        assert_eq!(k.device_addr(0x5008), Some(0x5008));
        assert_eq!(k.device_addr(0xfff), None);
    }
}
