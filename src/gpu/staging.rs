//! Copies between pinned staging memory and a serving engine's paged KV
//! blocks in GPU memory, for the staged HBM path (no GPUDirect needed).
//!
//! A restore reads a layer's objects from the SSDs into pinned staging, then
//! one [`DeviceCopier::scatter`] puts each object at its block's place in
//! HBM; a store runs [`DeviceCopier::gather_crc32c`], which copies each
//! object from HBM into staging and returns its crc32c, so blocks stored
//! from GPU memory carry a data checksum like blocks stored from host memory.
//!
//! Two copiers, held to the same tests: [`CudaCopier`] (the kernels of
//! `kernels/staging.cu`, one launch per call, on its own stream) and
//! [`HostCopier`], a test double that does the same copies with the CPU on
//! host memory (for machines without a GPU).

use bytemuck::{Pod, Zeroable};

use std::sync::Arc;

use super::wait::CopyMark;
use super::{
    kernels, CompletionCounter, Context, Event, Function, KernelArgs, LaunchConfig, Module,
    PinnedHostBuffer, Stream,
};
use crate::error::{Error, Result};

/// One copy: `len` bytes from `src` to `dst` (unified addresses: device
/// pointers or the device view of pinned host memory). Twin of
/// `kvtier_copy` in `kernels/staging.cu`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Pod, Zeroable)]
pub struct CopyDesc {
    /// Source address.
    pub src: u64,
    /// Destination address.
    pub dst: u64,
    /// Bytes.
    pub len: u32,
    /// Zero.
    pub reserved: u32,
}

const _: () = assert!(size_of::<CopyDesc>() == 24);
const _: () = assert!(std::mem::offset_of!(CopyDesc, len) == 16);

/// Copy lists a [`CudaCopier`] fills in turn: more than the staged path's
/// layer buffers (4 by default), so a list is normally long done with when
/// it comes round again.
const COPY_LISTS: usize = 8;

/// Threads per block of the gather kernel (`KVTIER_STAGING_THREADS`).
const STAGING_THREADS: u32 = 256;

/// Scatter and gather between staging and KV memory.
pub trait DeviceCopier: Send {
    /// Starts every copy of `list`; returns once they are queued.
    fn scatter(&mut self, list: &[CopyDesc]) -> Result<()>;
    /// Starts every copy of `list` and the crc32c of each copy's bytes;
    /// [`Self::finish`] returns the checksums, in `list` order.
    fn gather_crc32c(&mut self, list: &[CopyDesc]) -> Result<()>;
    /// Waits for everything started; returns the checksums of the last
    /// gather (empty after a scatter).
    fn finish(&mut self) -> Result<Vec<u32>>;
    /// After the copies started so far, the copier's completion counter
    /// becomes `value` (on a GPU: written by the copy stream, so a compute
    /// stream waiting on the counter starts once those copies are done,
    /// with no host call in between).
    fn signal(&mut self, value: u32) -> Result<()>;
    /// The completion counter now: every copy started before
    /// `signal(v)` is done once this has reached `v`.
    fn signaled(&self) -> Result<u32>;
    /// The completion counter as a GPU-visible word streams can wait on
    /// (`None` for the host double).
    fn counter(&self) -> Option<&Arc<CompletionCounter>> {
        None
    }
    /// After the copies started so far, `counter` (another GPU-visible
    /// counter: one load's own) becomes `value`. Only for copiers that have
    /// a [`Self::counter`].
    fn signal_counter(&mut self, counter: &Arc<CompletionCounter>, value: u32) -> Result<()>;
    /// After a copy or a counter write failed: `counter` becomes `value` at
    /// once, from the host, after whatever was started before (so a later
    /// write of an older value cannot undo it), and a stream waiting on it
    /// goes on instead of hanging until a later load reuses the counter.
    fn release_counter(&mut self, counter: &Arc<CompletionCounter>, value: u32) -> Result<()>;
    /// A counter for one load, of the kind `signal_counter` writes.
    fn new_counter(&self) -> Result<Arc<CompletionCounter>>;
    /// A mark after the copies started so far, for a compute stream to
    /// wait on (an event recorded on the copy stream; the double's has
    /// none).
    fn mark(&mut self) -> Result<CopyMark>;
}

/// The test double: the same copies done by the CPU on host addresses.
/// By default a copy is done when the call returns; [`HostCopier::deferred`]
/// holds scatters (and the counters) back until [`DeviceCopier::finish`],
/// as a GPU's asynchronous copies do, so the staged path's waiting for a
/// copy is tested on the CPU too. Loads' counters are host words
/// ([`CompletionCounter::host_double`]) written in stream order as a GPU's
/// are, so what a compute stream waiting on one would see is tested too;
/// [`HostCopier::fail_scatter`] / [`HostCopier::fail_counter`] make a call
/// fail as a launch or a stream write can on a GPU.
#[derive(Default)]
pub struct HostCopier {
    crcs: Vec<u32>,
    counter: u32,
    deferred: bool,
    pending: Vec<CopyDesc>,
    pending_counter: Option<u32>,
    /// Loads' counter writes not yet done (deferred), in order.
    pending_counters: Vec<(Arc<CompletionCounter>, u32)>,
    scatters: u32,
    counter_writes: u32,
    fail_scatter: Option<u32>,
    fail_counter: Option<u32>,
}

impl HostCopier {
    /// A double whose scatters and counters advance only at `finish`.
    pub fn deferred() -> HostCopier {
        HostCopier {
            deferred: true,
            ..HostCopier::default()
        }
    }

    /// The `n`th scatter (from 0) fails and copies nothing, as a failed launch.
    pub fn fail_scatter(mut self, n: u32) -> HostCopier {
        self.fail_scatter = Some(n);
        self
    }

    /// The `n`th write of a load's counter (from 0) fails and writes nothing.
    pub fn fail_counter(mut self, n: u32) -> HostCopier {
        self.fail_counter = Some(n);
        self
    }

    /// Everything started is done: copies, then counters, in order.
    fn drain(&mut self) -> Result<()> {
        self.pending.drain(..).for_each(|c| HostCopier::copy(&c));
        for (c, v) in self.pending_counters.drain(..) {
            c.store(v)?;
        }
        if let Some(v) = self.pending_counter.take() {
            self.counter = v;
        }
        Ok(())
    }

    fn copy(c: &CopyDesc) {
        if c.len == 0 {
            return;
        }
        // SAFETY: the caller of scatter/gather names host memory it owns
        // for these ranges (the double's contract, as the kernel's is GPU-
        // visible memory); the ranges of one copy do not overlap.
        unsafe {
            std::ptr::copy_nonoverlapping(c.src as *const u8, c.dst as *mut u8, c.len as usize)
        };
    }
}

impl DeviceCopier for HostCopier {
    fn scatter(&mut self, list: &[CopyDesc]) -> Result<()> {
        self.crcs.clear();
        let n = self.scatters;
        self.scatters += 1;
        if self.fail_scatter == Some(n) {
            return Err(Error::gpu(
                "staging scatter (host double)",
                format!("scatter {n} fails as asked"),
            ));
        }
        if self.deferred {
            self.pending.extend_from_slice(list);
        } else {
            list.iter().for_each(HostCopier::copy);
        }
        Ok(())
    }

    fn gather_crc32c(&mut self, list: &[CopyDesc]) -> Result<()> {
        // Work on one stream runs in order: earlier scatters first.
        self.pending.drain(..).for_each(|c| HostCopier::copy(&c));
        self.crcs.clear();
        for c in list {
            HostCopier::copy(c);
            // SAFETY: as in `copy`: the source range is the caller's memory.
            let bytes = unsafe { std::slice::from_raw_parts(c.src as *const u8, c.len as usize) };
            self.crcs.push(crate::checksum::crc32c(bytes));
        }
        Ok(())
    }

    fn finish(&mut self) -> Result<Vec<u32>> {
        self.drain()?;
        Ok(std::mem::take(&mut self.crcs))
    }

    fn signal(&mut self, value: u32) -> Result<()> {
        if self.deferred {
            self.pending_counter = Some(value);
        } else {
            self.counter = value;
        }
        Ok(())
    }

    fn signaled(&self) -> Result<u32> {
        Ok(self.counter)
    }

    fn signal_counter(&mut self, counter: &Arc<CompletionCounter>, value: u32) -> Result<()> {
        let n = self.counter_writes;
        self.counter_writes += 1;
        if self.fail_counter == Some(n) {
            return Err(Error::gpu(
                "counter write (host double)",
                format!("counter write {n} fails as asked"),
            ));
        }
        if self.deferred {
            self.pending_counters.push((counter.clone(), value));
            Ok(())
        } else {
            counter.store(value)
        }
    }

    fn release_counter(&mut self, counter: &Arc<CompletionCounter>, value: u32) -> Result<()> {
        self.drain()?;
        counter.store(value)
    }

    fn new_counter(&self) -> Result<Arc<CompletionCounter>> {
        Ok(CompletionCounter::host_double())
    }

    fn mark(&mut self) -> Result<CopyMark> {
        Ok(CopyMark::double())
    }
}

/// The copier on a GPU: `kvtier_scatter` / `kvtier_gather_crc32c`, one
/// launch per call on a stream of its own; the copy list and the checksums
/// travel through pinned memory.
pub struct CudaCopier {
    stream: Stream,
    scatter_fn: Function,
    gather_fn: Function,
    /// Copy lists, used in turn: a launch reads its list while the next
    /// ones are written, so layer l+1's copy is queued while layer l's runs
    /// (one list synchronized the stream before every launch). Each list's
    /// event is recorded after the launch that reads it and waited for
    /// only when that list comes round again.
    lists: Vec<(PinnedHostBuffer, Event, bool)>,
    next_list: usize,
    crcs: PinnedHostBuffer,
    capacity: usize,
    last_gather: usize,
    /// A gather writes `crcs` and `finish` has not read them yet.
    crcs_busy: bool,
    sms: u32,
    counter: Arc<CompletionCounter>,
    _module: Module,
    _ctx: Context,
}

// SAFETY: CUDA objects are used from one thread at a time (&mut self), each
// call binds the context first.
unsafe impl Send for CudaCopier {}

impl CudaCopier {
    /// A copier for up to `capacity` copies per call in `ctx`.
    pub fn new(ctx: &Context, capacity: usize) -> Result<CudaCopier> {
        if capacity == 0 {
            return Err(Error::invalid("a staging copier for 0 copies per call"));
        }
        let image = kernels::staging()?;
        let module = if ctx.device().compute_capability()? == (9, 0) {
            ctx.load_module(image.cubin)?
        } else {
            let mut ptx = image.ptx.as_bytes().to_vec();
            ptx.push(0);
            ctx.load_module(&ptx)?
        };
        Ok(CudaCopier {
            stream: ctx.stream()?,
            scatter_fn: module.function("kvtier_scatter")?,
            gather_fn: module.function("kvtier_gather_crc32c")?,
            lists: (0..COPY_LISTS)
                .map(|_| {
                    Ok((
                        PinnedHostBuffer::alloc(ctx, capacity * size_of::<CopyDesc>())?,
                        ctx.sync_event()?,
                        false,
                    ))
                })
                .collect::<Result<_>>()?,
            next_list: 0,
            crcs: PinnedHostBuffer::alloc(ctx, capacity * 4)?,
            capacity,
            last_gather: 0,
            crcs_busy: false,
            sms: ctx.device().sm_count()?,
            // Host-mapped: the host polls it to reuse staging, streams wait on it.
            counter: CompletionCounter::host_mapped(ctx)?,
            _module: module,
            _ctx: ctx.clone(),
        })
    }

    /// The stream the copies run on (to order other work after them).
    pub fn stream(&self) -> &Stream {
        &self.stream
    }

    /// Write `list` into the next copy list: (its device address, copies).
    /// Only the launch that last read that list is waited for.
    fn load_list(&mut self, list: &[CopyDesc]) -> Result<(u64, u32)> {
        if list.len() > self.capacity {
            return Err(Error::invalid(format!(
                "{} copies in one call; this copier takes at most {}",
                list.len(),
                self.capacity
            )));
        }
        let (buf, done, used) = &mut self.lists[self.next_list];
        if *used {
            done.synchronize()?;
            *used = false;
        }
        buf.write(0, bytemuck::cast_slice(list))?;
        Ok((buf.device_ptr(), list.len() as u32))
    }

    /// After a launch that reads the current list: mark where it is done
    /// with it, and move on to the next list.
    fn launched(&mut self) -> Result<()> {
        let (_, done, used) = &mut self.lists[self.next_list];
        done.record(&self.stream)?;
        *used = true;
        self.next_list = (self.next_list + 1) % self.lists.len();
        Ok(())
    }

    fn grid(&self, n: u32) -> u32 {
        n.clamp(1, 4 * self.sms)
    }
}

impl DeviceCopier for CudaCopier {
    fn scatter(&mut self, list: &[CopyDesc]) -> Result<()> {
        self.last_gather = 0;
        if list.is_empty() {
            return Ok(());
        }
        let (dev, n) = self.load_list(list)?;
        let mut a = KernelArgs::new().arg(dev).arg(n);
        // SAFETY: kvtier_scatter(list, n): the list is not written again
        // before the event `launched` records after this launch has passed;
        // the copies' ranges are the caller's GPU-visible memory.
        unsafe {
            self.stream.launch(
                &self.scatter_fn,
                LaunchConfig::linear(self.grid(n), STAGING_THREADS),
                &mut a,
            )?
        };
        self.launched()
    }

    fn gather_crc32c(&mut self, list: &[CopyDesc]) -> Result<()> {
        self.last_gather = 0;
        if list.is_empty() {
            return Ok(());
        }
        // One checksum buffer: a previous gather not yet finished (its
        // checksums unread) must end before this one writes it. Scatters in
        // flight are not waited for: a store does not wait for loads' copies.
        if self.crcs_busy {
            self.stream.synchronize()?;
        }
        let (dev, n) = self.load_list(list)?;
        self.crcs_busy = true;
        self.last_gather = n as usize;
        let mut a = KernelArgs::new()
            .arg(dev)
            .arg(n)
            .arg(self.crcs.device_ptr());
        // SAFETY: kvtier_gather_crc32c(list, n, crc): the list as in
        // scatter; crc is not read or rewritten before the stream is
        // synchronized; ranges as in scatter.
        unsafe {
            self.stream.launch(
                &self.gather_fn,
                LaunchConfig::linear(self.grid(n), STAGING_THREADS),
                &mut a,
            )?
        };
        self.launched()
    }

    fn finish(&mut self) -> Result<Vec<u32>> {
        self.stream.synchronize()?;
        self.crcs_busy = false;
        let mut out = vec![0u8; self.last_gather * 4];
        self.crcs.read(0, &mut out)?;
        self.last_gather = 0;
        // A byte buffer has no u32 alignment: decode, do not cast.
        Ok(out
            .chunks_exact(4)
            .map(|w| u32::from_ne_bytes([w[0], w[1], w[2], w[3]]))
            .collect())
    }

    fn signal(&mut self, value: u32) -> Result<()> {
        self.stream.write_counter(&self.counter, value)
    }

    fn signaled(&self) -> Result<u32> {
        self.counter.load()
    }

    fn counter(&self) -> Option<&Arc<CompletionCounter>> {
        Some(&self.counter)
    }

    fn signal_counter(&mut self, counter: &Arc<CompletionCounter>, value: u32) -> Result<()> {
        self.stream.write_counter(counter, value)
    }

    fn release_counter(&mut self, counter: &Arc<CompletionCounter>, value: u32) -> Result<()> {
        // Writes the stream still holds (older values) land first; a stream
        // in error has nothing more to land, and the host write goes on.
        let _ = self.stream.synchronize();
        counter.store(value)
    }

    fn new_counter(&self) -> Result<Arc<CompletionCounter>> {
        CompletionCounter::device(&self._ctx)
    }

    fn mark(&mut self) -> Result<CopyMark> {
        let e = self._ctx.sync_event()?;
        e.record(&self.stream)?;
        Ok(CopyMark::recorded(e))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The double: scattered copies land where named, the gather's
    /// checksums are crc32c of the bytes (the same checks the GPU test runs
    /// against CudaCopier).
    #[test]
    fn host_copier_scatters_and_checksums() {
        let src: Vec<u8> = (0..64 * 1024u32).map(|i| (i * 7 + 3) as u8).collect();
        let mut dst = vec![0u8; 64 * 1024];
        let list: Vec<CopyDesc> = (0..16u64)
            .map(|i| CopyDesc {
                src: src.as_ptr() as u64 + i * 4096,
                dst: dst.as_mut_ptr() as u64 + (15 - i) * 4096,
                len: 4096,
                reserved: 0,
            })
            .collect();
        let mut c = HostCopier::default();
        c.scatter(&list).unwrap();
        assert!(c.finish().unwrap().is_empty());
        for i in 0..16 {
            assert_eq!(
                dst[(15 - i) * 4096..(16 - i) * 4096],
                src[i * 4096..(i + 1) * 4096]
            );
        }
        c.gather_crc32c(&list).unwrap();
        let crcs = c.finish().unwrap();
        for (i, crc) in crcs.iter().enumerate() {
            assert_eq!(*crc, crc32c::crc32c(&src[i * 4096..(i + 1) * 4096]));
        }
    }
}
