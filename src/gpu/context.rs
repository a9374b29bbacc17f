//! Devices, contexts, modules, kernels, streams and events as RAII types.
//!
//! Lifetimes: every object holds an `Arc` of the context it was made in, so a
//! context (a primary context's retain, or a green context) is released only
//! after its last module, stream, event and allocation is gone. That is the
//! destruction order the driver needs for green contexts: streams and modules
//! first, `cuGreenCtxDestroy` last. Each operation makes its context current
//! on the calling thread first (`cuCtxSetCurrent`, cheap), so objects can be
//! used from any thread.

use super::driver::{
    self, CUcontext, CUdevice, CUevent, CUfunction, CUgreenCtx, CUmodule, CUstream,
};
use crate::error::{Error, Result};
use std::any::Any;
use std::ffi::c_void;
use std::sync::{Arc, Mutex};

/// A CUDA device by ordinal.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Device {
    ordinal: i32,
    raw: CUdevice,
}

impl Device {
    /// Device `ordinal` (0-based, in the driver's order).
    pub fn get(ordinal: i32) -> Result<Device> {
        let n = driver::device_count()?;
        if ordinal < 0 || ordinal >= n {
            return Err(Error::gpu(
                format!("device {ordinal}"),
                format!("the driver sees {n} device(s); pick an ordinal below {n}"),
            ));
        }
        Ok(Device {
            ordinal,
            raw: driver::device_get(ordinal)?,
        })
    }

    /// The CUDA device ordinal.
    pub fn ordinal(&self) -> i32 {
        self.ordinal
    }

    pub(crate) fn raw(&self) -> CUdevice {
        self.raw
    }

    /// Streaming multiprocessors of the device.
    pub fn sm_count(&self) -> Result<u32> {
        Ok(driver::device_attr(
            self.raw,
            cudarc::driver::sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT,
        )? as u32)
    }

    /// (major, minor) compute capability.
    pub fn compute_capability(&self) -> Result<(i32, i32)> {
        use cudarc::driver::sys::CUdevice_attribute as A;
        Ok((
            driver::device_attr(self.raw, A::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR)?,
            driver::device_attr(self.raw, A::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR)?,
        ))
    }
}

pub(crate) enum CtxKind {
    Primary,
    Green(CUgreenCtx),
}

pub(crate) struct CtxInner {
    raw: CUcontext,
    device: Device,
    kind: CtxKind,
}

// SAFETY: CUDA context handles may be used from any thread; the driver API is
// thread-safe, and each use makes the context current on the using thread.
unsafe impl Send for CtxInner {}
// SAFETY: as above; the handle is never mutated.
unsafe impl Sync for CtxInner {}

impl Drop for CtxInner {
    fn drop(&mut self) {
        // Errors cannot be returned from drop; the handles are gone either way.
        match self.kind {
            CtxKind::Primary => {
                let _ = driver::primary_ctx_release(self.device.raw);
            }
            CtxKind::Green(g) => {
                // The CUcontext from cuCtxFromGreenCtx belongs to the green
                // context: destroying the green context frees both. Unbind it
                // first so no thread keeps a dangling current context.
                let _ = driver::ctx_set_current(std::ptr::null_mut());
                let _ = driver::green_ctx_destroy(g);
            }
        }
    }
}

/// A CUDA context: a device's primary context, or the context of a green
/// context (`super::green::GreenContext`). Cheap to clone.
#[derive(Clone)]
pub struct Context {
    pub(crate) inner: Arc<CtxInner>,
}

impl std::fmt::Debug for Context {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "Context {{ device: {}, {} }}",
            self.inner.device.ordinal,
            match self.inner.kind {
                CtxKind::Primary => "primary",
                CtxKind::Green(_) => "green",
            }
        )
    }
}

impl Context {
    /// Retain `device`'s primary context (released when the last clone and
    /// the last object made in it are dropped).
    pub fn primary(device: &Device) -> Result<Context> {
        let raw = driver::primary_ctx_retain(device.raw)?;
        Ok(Context {
            inner: Arc::new(CtxInner {
                raw,
                device: *device,
                kind: CtxKind::Primary,
            }),
        })
    }

    /// Take ownership of a green context (destroyed when the last user goes).
    pub(crate) fn from_green(device: &Device, green: CUgreenCtx) -> Result<Context> {
        let raw = match driver::ctx_from_green(green) {
            Ok(r) => r,
            Err(e) => {
                let _ = driver::green_ctx_destroy(green);
                return Err(e);
            }
        };
        Ok(Context {
            inner: Arc::new(CtxInner {
                raw,
                device: *device,
                kind: CtxKind::Green(green),
            }),
        })
    }

    /// The device the context is on.
    pub fn device(&self) -> Device {
        self.inner.device
    }

    /// Whether it is a green context (an SM partition).
    pub fn is_green(&self) -> bool {
        matches!(self.inner.kind, CtxKind::Green(_))
    }

    /// Make this context current on the calling thread.
    pub fn bind(&self) -> Result<()> {
        driver::ctx_set_current(self.inner.raw)
    }

    /// Whether both are the same CUDA context.
    pub fn same(&self, other: &Context) -> bool {
        Arc::ptr_eq(&self.inner, &other.inner)
    }

    /// Wait for all work in this context.
    pub fn synchronize(&self) -> Result<()> {
        self.bind()?;
        driver::ctx_synchronize()
    }

    /// A non-blocking stream in this context (for a green context, created
    /// with `cuGreenCtxStreamCreate`, so its work runs on the green context's
    /// SMs only).
    pub fn stream(&self) -> Result<Stream> {
        self.bind()?;
        let raw = match self.inner.kind {
            CtxKind::Green(g) => driver::green_ctx_stream_create(g)?,
            CtxKind::Primary => driver::stream_create()?,
        };
        Ok(Stream {
            ctx: self.clone(),
            raw,
            keep: Mutex::new(Vec::new()),
        })
    }

    internal_pub! {
        /// Load a module from an in-memory cubin, fatbin or PTX image.
        fn load_module(&self, image: &[u8]) -> Result<Module> {
            self.bind()?;
            let raw = driver::module_load_data(image)?;
            Ok(Module {
                inner: Arc::new(ModuleInner {
                    ctx: self.clone(),
                    raw,
                }),
            })
        }
    }

    /// A new event in this context.
    pub fn event(&self) -> Result<Event> {
        self.bind()?;
        Ok(Event {
            ctx: self.clone(),
            raw: driver::event_create(true)?,
        })
    }

    /// An event for ordering only (no timestamps: cheaper to record);
    /// `elapsed_ms` on it fails.
    pub fn sync_event(&self) -> Result<Event> {
        self.bind()?;
        Ok(Event {
            ctx: self.clone(),
            raw: driver::event_create(false)?,
        })
    }
}

struct ModuleInner {
    ctx: Context,
    raw: CUmodule,
}

// SAFETY: module handles are usable from any thread (see CtxInner).
unsafe impl Send for ModuleInner {}
// SAFETY: as above.
unsafe impl Sync for ModuleInner {}

impl Drop for ModuleInner {
    fn drop(&mut self) {
        if self.ctx.bind().is_ok() {
            let _ = driver::module_unload(self.raw);
        }
    }
}

/// A loaded module; its functions keep it loaded.
#[derive(Clone)]
pub struct Module {
    inner: Arc<ModuleInner>,
}

impl Module {
    /// The kernel named `name` (its `extern "C"` or mangled name), loaded
    /// onto the device now rather than at its first launch (see
    /// `driver::func_load`: a lazy first launch can wait for streams that
    /// wait for it).
    pub fn function(&self, name: &str) -> Result<Function> {
        self.inner.ctx.bind()?;
        let raw = driver::module_get_function(self.inner.raw, name)?;
        driver::func_load(raw)?;
        Ok(Function {
            module: self.inner.clone(),
            raw,
            name: name.to_string(),
        })
    }
}

/// A kernel of a loaded module.
#[derive(Clone)]
pub struct Function {
    module: Arc<ModuleInner>,
    raw: CUfunction,
    name: String,
}

// SAFETY: function handles are usable from any thread (see CtxInner).
unsafe impl Send for Function {}
// SAFETY: as above.
unsafe impl Sync for Function {}

impl Function {
    /// The function's name in its module.
    pub fn name(&self) -> &str {
        &self.name
    }
}

/// Grid and block shape of a launch.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LaunchConfig {
    /// Blocks in x, y, z.
    pub grid: (u32, u32, u32),
    /// Threads per block in x, y, z.
    pub block: (u32, u32, u32),
    /// Dynamic shared memory per block.
    pub shared_bytes: u32,
}

impl LaunchConfig {
    /// A 1-D launch of `grid` blocks of `block` threads.
    pub fn linear(grid: u32, block: u32) -> Self {
        LaunchConfig {
            grid: (grid, 1, 1),
            block: (block, 1, 1),
            shared_bytes: 0,
        }
    }
}

/// Kernel parameters by value, in order: each is boxed so the pointer array
/// `cuLaunchKernel` reads stays valid while the args live.
#[derive(Default)]
pub struct KernelArgs {
    values: Vec<Box<dyn Any>>,
    ptrs: Vec<*mut c_void>,
}

impl KernelArgs {
    /// No arguments yet.
    pub fn new() -> Self {
        Self::default()
    }

    /// Append one parameter. `T` must be the kernel parameter's exact type
    /// (`u64` for a device pointer, `u32` for `unsigned int`, a `#[repr(C)]`
    /// struct for a struct parameter).
    pub fn arg<T: Copy + 'static>(mut self, v: T) -> Self {
        let mut b: Box<T> = Box::new(v);
        self.ptrs.push((&mut *b as *mut T).cast());
        self.values.push(b);
        self
    }

    /// Arguments pushed.
    pub fn len(&self) -> usize {
        self.ptrs.len()
    }

    /// No arguments pushed.
    pub fn is_empty(&self) -> bool {
        self.ptrs.is_empty()
    }
}

/// A stream. Objects whose memory queued work uses (stream memory ops on a
/// [`super::memory::CompletionCounter`]) are kept alive here until
/// [`Stream::synchronize`]; if the stream is dropped with work still pending
/// (a wait that was never satisfied), they are leaked rather than freed under
/// the GPU.
pub struct Stream {
    ctx: Context,
    raw: CUstream,
    keep: Mutex<Vec<Arc<dyn Any + Send + Sync>>>,
}

// SAFETY: stream handles are usable from any thread (see CtxInner); `keep`
// is behind a Mutex.
unsafe impl Send for Stream {}
// SAFETY: as above.
unsafe impl Sync for Stream {}

impl Drop for Stream {
    fn drop(&mut self) {
        let _ = self.ctx.bind();
        let keep = std::mem::take(self.keep.get_mut().unwrap_or_else(|e| e.into_inner()));
        if !keep.is_empty() && !driver::stream_query(self.raw).unwrap_or(false) {
            // Work may still touch these: never free memory under the GPU.
            std::mem::forget(keep);
        }
        // cuStreamDestroy returns at once; queued work still completes.
        let _ = driver::stream_destroy(self.raw);
    }
}

impl Stream {
    /// The context the stream belongs to.
    pub fn context(&self) -> &Context {
        &self.ctx
    }

    pub(crate) fn raw(&self) -> CUstream {
        self.raw
    }

    pub(crate) fn keep_alive(&self, obj: Arc<dyn Any + Send + Sync>) {
        self.keep
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push(obj);
    }

    /// Block until everything queued so far has completed.
    pub fn synchronize(&self) -> Result<()> {
        self.ctx.bind()?;
        driver::stream_synchronize(self.raw)?;
        self.keep.lock().unwrap_or_else(|e| e.into_inner()).clear();
        Ok(())
    }

    /// `true` when everything queued so far has completed.
    pub fn is_idle(&self) -> Result<bool> {
        driver::stream_query(self.raw)
    }

    internal_pub! {
        /// Queue `func` on this stream.
        ///
        /// # Safety
        /// `args` must match the kernel's parameter list exactly (count, order,
        /// types), and every device address among them must stay valid for what
        /// the kernel does with it until the launch completes.
        unsafe fn launch(
            &self,
            func: &Function,
            cfg: LaunchConfig,
            args: &mut KernelArgs,
        ) -> Result<()> {
            if !func.module.ctx.same(&self.ctx) {
                return Err(Error::gpu(
                    format!("launch of {}", func.name),
                    "the kernel's module was loaded in another context than the stream's; load the module in the stream's context (each green context needs its own)",
                ));
            }
            self.ctx.bind()?;
            // SAFETY: forwarded to the caller's contract; `args` outlives the call.
            unsafe {
                driver::launch_kernel(
                    func.raw,
                    cfg.grid,
                    cfg.block,
                    cfg.shared_bytes,
                    self.raw,
                    &mut args.ptrs,
                )
            }
        }
    }

    /// Queue an asynchronous copy between unified addresses.
    ///
    /// # Safety
    /// Both ranges must be device memory or pinned/registered host memory
    /// valid until the copy completes on this stream.
    pub unsafe fn memcpy_async(&self, dst: u64, src: u64, len: usize) -> Result<()> {
        self.ctx.bind()?;
        // SAFETY: the caller's contract.
        unsafe { driver::memcpy_async(dst, src, len, self.raw) }
    }
}

/// A CUDA event (timing enabled unless made by `Context::sync_event`).
pub struct Event {
    ctx: Context,
    raw: CUevent,
}

// SAFETY: event handles are usable from any thread (see CtxInner).
unsafe impl Send for Event {}
// SAFETY: as above.
unsafe impl Sync for Event {}

impl Drop for Event {
    fn drop(&mut self) {
        let _ = self.ctx.bind();
        let _ = driver::event_destroy(self.raw);
    }
}

impl Event {
    /// Records the event on `stream`.
    pub fn record(&self, stream: &Stream) -> Result<()> {
        self.ctx.bind()?;
        driver::event_record(self.raw, stream.raw)
    }

    /// Waits for the event's work to complete.
    pub fn synchronize(&self) -> Result<()> {
        driver::event_synchronize(self.raw)
    }

    /// Later work on `stream`, a stream kvtier did not create (an engine's
    /// compute stream: torch's `cuda_stream`), waits on the GPU until the
    /// work recorded in this event is done.
    ///
    /// # Safety
    /// `stream` is a live stream of this event's context (0: its legacy
    /// default stream). The event itself may be dropped at once: CUDA keeps
    /// what a queued wait needs.
    pub unsafe fn queue_wait_on_raw_stream(&self, stream: u64) -> Result<()> {
        self.ctx.bind()?;
        // SAFETY: the caller's contract; the event is live.
        unsafe { driver::stream_wait_event(stream as usize as CUstream, self.raw) }
    }

    /// Milliseconds from `self` to `end` (both recorded and completed).
    pub fn elapsed_ms(&self, end: &Event) -> Result<f32> {
        driver::event_elapsed_ms(self.raw, end.raw)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kernel_args_point_at_their_values() {
        let a = KernelArgs::new().arg(0xdead_beef_u64).arg(7u32).arg(1.5f32);
        assert_eq!(a.len(), 3);
        // SAFETY: each pointer was made from the Box of that type, still alive.
        unsafe {
            assert_eq!(*(a.ptrs[0] as *const u64), 0xdead_beef);
            assert_eq!(*(a.ptrs[1] as *const u32), 7);
            assert_eq!(*(a.ptrs[2] as *const f32), 1.5);
        }
    }

    #[test]
    fn without_a_driver_devices_are_errors() {
        if driver::preflight(driver::LIBCUDA).is_ok() {
            return; // a machine with a driver: tests/gpu.rs covers it
        }
        let e = Device::get(0).unwrap_err().to_string();
        assert!(e.contains("libcuda.so.1 not found"), "{e}");
    }
}
