//! One namespace of a controller driven from userspace ([`NvmeNamespace`]): the pool's
//! [`Storage`] for its metadata, through the controller's second I/O queue and a DMA
//! bounce buffer, and a device of the engines that drive the first queue (the nvme
//! engine on CPU-polled queues, the GPU engine's kernel). Clones share the controller
//! behind one lock; it is shut down when the last clone is dropped.

use super::ctrl::{Bar0, Controller, DataMode, DmaAlloc, DmaRegion, IoDir};
use crate::error::{Error, Result};
use crate::host::dio::AlignedBuf;
use crate::pool::Storage;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

/// The controller's I/O queue (index into its I/O queues) of the data path.
pub(crate) const DATA_QUEUE: usize = 0;
/// The I/O queue of the pool's synchronous metadata I/O.
pub(crate) const STORAGE_QUEUE: usize = 1;

/// Settings of the nvme engine and of the namespaces it drives.
#[non_exhaustive]
#[derive(Clone, Debug)]
pub struct NvmeConfig {
    /// How commands describe memory: `Auto` (SGL when the controller
    /// supports it), `Prp`, or `Sgl` (refused by a controller without SGL).
    pub data_mode: DataMode,
    /// A command that has not completed after this long stops the controller.
    pub io_timeout: Duration,
    /// Bounce buffer of the pool's metadata I/O (DMA memory, 4 KiB multiple).
    pub bounce_bytes: usize,
}

impl Default for NvmeConfig {
    fn default() -> Self {
        NvmeConfig {
            data_mode: DataMode::Auto,
            io_timeout: Duration::from_secs(5),
            bounce_bytes: 1 << 20,
        }
    }
}

impl NvmeConfig {
    /// With commands describing memory as `data_mode` says.
    pub fn with_data_mode(mut self, data_mode: DataMode) -> Self {
        self.data_mode = data_mode;
        self
    }
    /// With a command timeout of `io_timeout`.
    pub fn with_io_timeout(mut self, io_timeout: Duration) -> Self {
        self.io_timeout = io_timeout;
        self
    }
    /// With a metadata bounce buffer of `bounce_bytes`.
    pub fn with_bounce_bytes(mut self, bounce_bytes: usize) -> Self {
        self.bounce_bytes = bounce_bytes;
        self
    }
}

pub(crate) struct Shared<B: Bar0> {
    pub(crate) ctrl: Controller<B>,
    pub(crate) dma: Box<dyn DmaAlloc + Send>,
    bounce: DmaRegion,
    /// Why the controller was stopped, once it was.
    pub(crate) failed: Option<String>,
}

// SAFETY: `DmaRegion` is not Send because clones on several threads could
// race on the same bytes. Every region this value holds (queues inside the
// controller, the bounce buffer) and every region the engine allocates from
// `dma` is only touched by whoever holds the mutex around this value (the
// engine's descriptor pages are written under it too); the BAR0 handle is
// Send by bound, and the allocators' arenas are Send + Sync.
unsafe impl<B: Bar0 + Send> Send for Shared<B> {}

impl<B: Bar0> Drop for Shared<B> {
    fn drop(&mut self) {
        // A normal shutdown (delete queues, CC.SHN) so the controller flushes
        // its cache; the controller's own Drop then resets it.
        if self.failed.is_none() {
            let _ = self.ctrl.shutdown();
        }
    }
}

/// One namespace of a controller driven from userspace: the pool's
/// [`Storage`] for its metadata and a device of the [`NvmeEngine`](crate::engine::nvme::NvmeEngine). Clones
/// share the controller; it is shut down when the last clone is dropped.
pub struct NvmeNamespace<B: Bar0> {
    shared: Arc<Mutex<Shared<B>>>,
    pub(crate) path: PathBuf,
    size: u64,
    lba_bytes: u32,
}

impl<B: Bar0> Clone for NvmeNamespace<B> {
    fn clone(&self) -> Self {
        NvmeNamespace {
            shared: self.shared.clone(),
            path: self.path.clone(),
            size: self.size,
            lba_bytes: self.lba_bytes,
        }
    }
}

impl<B: Bar0 + Send + Sync + 'static> NvmeNamespace<B> {
    /// Takes a controller brought up with at least two I/O queues (the data
    /// path and the metadata path) and the DMA allocator it was brought up
    /// with.
    pub fn new(
        ctrl: Controller<B>,
        mut dma: impl DmaAlloc + Send + 'static,
        cfg: &NvmeConfig,
    ) -> Result<Self> {
        let name = ctrl.name().to_string();
        if ctrl.io_queue_count() < 2 {
            return Err(Error::invalid(format!(
                "NVMe controller {name} has {} I/O queue(s); the nvme engine needs 2 (one for data, one for the pool's metadata): bring it up with ControllerOptions::io_queues = 2",
                ctrl.io_queue_count()
            )));
        }
        let lba = ctrl.lba_bytes();
        if lba == 0 || 4096 % lba != 0 {
            return Err(Error::invalid(format!(
                "NVMe controller {name} namespace {} uses {lba}-byte LBAs; kvtier needs a format whose LBA size divides 4096 (reformat with a 512 B or 4 KiB LBA format)",
                ctrl.nsid()
            )));
        }
        if cfg.bounce_bytes == 0 || cfg.bounce_bytes % 4096 != 0 {
            return Err(Error::invalid(format!(
                "NVMe bounce buffer of {} bytes must be a non-zero multiple of 4096",
                cfg.bounce_bytes
            )));
        }
        let bounce = dma.alloc(cfg.bounce_bytes, 4096)?;
        let size = ctrl.namespace().nsze * lba as u64;
        let path = PathBuf::from(format!("nvme:{name}/ns{}", ctrl.nsid()));
        let mut ctrl = ctrl;
        ctrl.set_io_timeout(cfg.io_timeout);
        Ok(NvmeNamespace {
            shared: Arc::new(Mutex::new(Shared {
                ctrl,
                dma: Box::new(dma),
                bounce,
                failed: None,
            })),
            path,
            size,
            lba_bytes: lba,
        })
    }

    /// This namespace as the pool's storage (for `Pool::create_on` / `open_on`).
    pub fn storage(&self) -> Box<dyn Storage> {
        Box::new(self.clone())
    }
}

impl<B: Bar0> NvmeNamespace<B> {
    pub(crate) fn lock(&self) -> MutexGuard<'_, Shared<B>> {
        self.shared.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Runs `f` on the controller and its DMA allocator, under the lock the
    /// metadata path and the nvme engine take too (the GPU engine creates
    /// its kernel's queues this way).
    pub(crate) fn with_controller<R>(
        &self,
        f: impl FnOnce(&mut Controller<B>, &mut dyn DmaAlloc) -> R,
    ) -> R {
        let mut shared = self.lock();
        let Shared { ctrl, dma, .. } = &mut *shared;
        f(ctrl, dma.as_mut())
    }

    /// Stops the controller after a failure of an agent driving it (the GPU
    /// kernel), so nothing lands in memory later; the metadata path then
    /// says why.
    pub(crate) fn fail(&self, why: String) {
        let mut shared = self.lock();
        let _ = shared.ctrl.reset_after_failure();
        shared.failed.get_or_insert(why);
    }

    /// The controller's name (PCI address, `sim`).
    pub fn name(&self) -> String {
        self.lock().ctrl.name().to_string()
    }

    fn check(&self, shared: &Shared<B>, offset: u64, len: usize, op: &str) -> Result<()> {
        if let Some(why) = &shared.failed {
            return Err(self.device_error(offset, len, format!("{op}: {why}")));
        }
        if offset % 4096 != 0 || len % 4096 != 0 {
            return Err(Error::invalid(format!(
                "{op} of {len} bytes at {offset} on {}: offset and length must be multiples of 4096",
                self.path.display()
            )));
        }
        if offset + len as u64 > self.size {
            return Err(self.device_error(
                offset,
                len,
                format!("{op} past the end of the namespace ({} bytes)", self.size),
            ));
        }
        Ok(())
    }

    fn device_error(&self, offset: u64, len: usize, reason: String) -> Error {
        Error::Device {
            device: self.path.display().to_string(),
            offset,
            len: len as u64,
            reason,
        }
    }

    /// Moves `len` bytes between the bounce buffer and LBAs at `offset`.
    fn bounce_io(shared: &mut Shared<B>, dir: IoDir, offset: u64, len: usize) -> Result<()> {
        let lba = shared.ctrl.lba_bytes() as u64;
        let mem = [shared.bounce.extent(0, len)];
        let r = shared
            .ctrl
            .transfer(STORAGE_QUEUE, dir, offset / lba, &mem, DataMode::Auto)
            .map(|_| ());
        Self::stop_if_stuck(shared, r)
    }

    /// After a failed metadata command: if one is still outstanding (it
    /// timed out), the controller is stopped, so it cannot read or write the
    /// bounce buffer later, when it holds other data.
    fn stop_if_stuck(shared: &mut Shared<B>, r: Result<()>) -> Result<()> {
        if r.is_err()
            && shared
                .ctrl
                .io_queue(STORAGE_QUEUE)
                .is_ok_and(|q| q.outstanding() > 0)
        {
            let _ = shared.ctrl.reset_after_failure();
            shared.failed.get_or_insert_with(|| {
                "the controller was stopped after a metadata command got no completion".into()
            });
        }
        r
    }
}

impl<B: Bar0 + Send> Storage for NvmeNamespace<B> {
    fn path(&self) -> &Path {
        &self.path
    }

    fn size(&self) -> u64 {
        self.size
    }

    fn read_exact_at(&self, buf: &mut AlignedBuf, offset: u64) -> Result<()> {
        let mut shared = self.lock();
        self.check(&shared, offset, buf.len(), "read")?;
        let step = shared.bounce.len();
        let mut done = 0;
        while done < buf.len() {
            let n = (buf.len() - done).min(step);
            Self::bounce_io(&mut shared, IoDir::Read, offset + done as u64, n)?;
            shared
                .bounce
                .read(0, &mut buf.as_mut_slice()[done..done + n]);
            done += n;
        }
        Ok(())
    }

    fn write_all_at(&self, buf: &AlignedBuf, offset: u64) -> Result<()> {
        let mut shared = self.lock();
        self.check(&shared, offset, buf.len(), "write")?;
        let step = shared.bounce.len();
        let mut done = 0;
        while done < buf.len() {
            let n = (buf.len() - done).min(step);
            shared.bounce.write(0, &buf.as_slice()[done..done + n]);
            Self::bounce_io(&mut shared, IoDir::Write, offset + done as u64, n)?;
            done += n;
        }
        Ok(())
    }

    fn sync_data(&self) -> Result<()> {
        let mut shared = self.lock();
        self.check(&shared, 0, 0, "flush")?;
        let r = shared.ctrl.flush(STORAGE_QUEUE);
        Self::stop_if_stuck(&mut shared, r)
    }
}
