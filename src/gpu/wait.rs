//! Stream waits on completion counters: a compute stream that must not run
//! until a layer is in GPU memory waits on the counter the copy stream
//! writes (`cuStreamWaitValue32`, or a one-thread wait kernel where stream
//! memory operations are missing), with no host call in between. The staged
//! HBM path (`crate::staged`) hands out a [`LoadCounter`] per load.

use std::sync::Arc;

use super::{
    abi, kernels, CompletionCounter, Context, Event, Function, KernelArgs, LaunchConfig, Module,
    Stream, WaitCond,
};
use crate::error::{Error, ErrorKind, Result};

/// A GPU-visible counter of one load: layer `l` of a load of layers
/// `first..` is in KV memory once the counter has reached
/// `base + (l - first) + 1` (wrapping). Counters are reused by later loads,
/// from the value the last one left, so a stream still waiting on an old
/// value is never confused.
#[derive(Clone)]
pub struct LoadCounter {
    /// The counter.
    pub counter: Arc<CompletionCounter>,
    /// Its value before the load's first layer.
    pub base: u32,
    /// The load's first layer.
    pub first_layer: u32,
    /// One past the load's last layer: the counter never reaches a value
    /// for a layer at or beyond it (a wait for one would never end).
    pub layers_end: u32,
}

impl LoadCounter {
    /// The value the counter reaches once layer `layer` is copied.
    pub fn value_for(&self, layer: u32) -> u32 {
        self.base
            .wrapping_add(layer - self.first_layer)
            .wrapping_add(1)
    }

    /// Queue on a stream kvtier did not create (a serving engine's compute
    /// stream: torch's `cuda_stream`, a raw `CUstream` of `ctx`) a wait
    /// until layer `layer` is in KV memory: `cuStreamWaitValue32(counter >=
    /// value_for(layer))`, no host call when it is reached. A driver
    /// without stream memory operations answers with an error (the caller
    /// then waits on the host); kvtier's own streams use `LayerWait`,
    /// which falls back to a wait kernel.
    ///
    /// # Safety
    /// `stream` is a live stream of `ctx` (0: its legacy default stream),
    /// and the caller keeps `self.counter` alive until the stream has
    /// passed the wait (a foreign stream cannot hold it, as
    /// `Stream::keep_alive` does for kvtier's own).
    pub unsafe fn queue_on_raw_stream(&self, ctx: &Context, stream: u64, layer: u32) -> Result<()> {
        if !(self.first_layer..self.layers_end).contains(&layer) {
            return Err(Error::invalid(format!(
                "layer {layer} is not loaded by this job (layers {}..{}): a stream waiting for it would never run",
                self.first_layer, self.layers_end
            )));
        }
        if self.counter.is_double() {
            return Err(Error::invalid(
                "this load's counter is the CPU test double's (a host word no stream can wait on); wait on the host (wait_layer)",
            ));
        }
        ctx.bind()?;
        // SAFETY: the caller's contract: a live stream of the bound context;
        // the counter is a 4-byte aligned GPU-visible word kept alive by it.
        unsafe {
            super::driver::stream_wait_value32(
                stream as usize as super::driver::CUstream,
                self.counter.device_ptr(),
                self.value_for(layer),
                0, // CU_STREAM_WAIT_VALUE_GEQ
            )
        }
    }
}

/// A point on kvtier's copy stream: every copy of one layer into KV memory
/// was queued before it. A compute stream that waits on it
/// ([`CopyMark::queue_on_raw_stream`], `cuStreamWaitEvent`) runs that
/// layer's attention once the copy is done; unlike a wait on a
/// [`LoadCounter`] queued ahead of the copy, CUDA sees this dependency, so
/// its scheduler cannot order the copy behind the waiting stream (the
/// deadlock `cuStreamWaitValue32`'s documentation warns of, seen with
/// torch's legacy default stream on an H200).
#[derive(Clone)]
pub struct CopyMark {
    /// `None`: the CPU test double's copies, done by the host.
    event: Option<Arc<Event>>,
}

impl CopyMark {
    /// A mark recorded on a GPU copy stream.
    pub(crate) fn recorded(event: Event) -> CopyMark {
        CopyMark {
            event: Some(Arc::new(event)),
        }
    }

    /// The CPU double's mark: no stream can wait on it.
    pub(crate) fn double() -> CopyMark {
        CopyMark { event: None }
    }

    /// True for the CPU test double's marks.
    pub fn is_double(&self) -> bool {
        self.event.is_none()
    }

    /// Later work on `stream` (a stream kvtier did not create: torch's
    /// `cuda_stream`, 0 for the legacy default stream) waits on the GPU
    /// until the marked copies are done; the host goes on at once.
    ///
    /// # Safety
    /// `stream` is a live stream of the context the KV memory is in (the
    /// device's primary context).
    pub unsafe fn queue_on_raw_stream(&self, stream: u64) -> Result<()> {
        match &self.event {
            // SAFETY: the caller's contract.
            Some(e) => unsafe { e.queue_wait_on_raw_stream(stream) },
            None => Err(Error::invalid(
                "this layer was copied by the CPU test double: no stream can wait for it; wait on the host (wait_layer)",
            )),
        }
    }
}

/// Makes a compute stream wait for a staged layer without a host call:
/// `cuStreamWaitValue32(counter >= value)`, or, on a device without stream
/// memory operations, the wait kernel `kvtier_wait_counter` (one thread
/// polling the counter).
pub struct LayerWait {
    kernel: Option<(Function, Module)>,
    ctx: Context,
}

impl LayerWait {
    /// A waiter for streams of `ctx` (the wait kernel loads on first use).
    pub fn new(ctx: &Context) -> LayerWait {
        LayerWait {
            kernel: None,
            ctx: ctx.clone(),
        }
    }

    /// Later work on `stream` starts once `counter` has reached `value`.
    pub fn queue(
        &mut self,
        stream: &Stream,
        counter: &Arc<CompletionCounter>,
        value: u32,
    ) -> Result<()> {
        if self.kernel.is_none() {
            match stream.wait_counter(counter, value, WaitCond::Geq) {
                Ok(()) => return Ok(()),
                Err(e) if e.kind() == ErrorKind::Unsupported || e.cuda_code().is_some() => {
                    let image = kernels::gio_kernel()?;
                    let mut ptx = image.ptx.as_bytes().to_vec();
                    ptx.push(0);
                    let module = self.ctx.load_module(&ptx)?;
                    let f = module.function(abi::WAIT_KERNEL_NAME)?;
                    self.kernel = Some((f, module));
                }
                Err(e) => return Err(e),
            }
        }
        let (f, _) = self.kernel.as_ref().expect("loaded");
        let mut a = KernelArgs::new()
            .arg(counter.device_ptr())
            .arg(value)
            .arg(0u64)
            .arg(0u64);
        // SAFETY: kvtier_wait_counter(counter, target, timeout_ns, timed_out):
        // the counter is kept alive below until the stream passes the kernel;
        // a null timed_out is allowed.
        unsafe { stream.launch(f, LaunchConfig::linear(1, 1), &mut a)? };
        stream.keep_alive(counter.clone());
        Ok(())
    }
}
