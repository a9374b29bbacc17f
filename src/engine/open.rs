//! Opening a pool on an NVMe controller driven from userspace, for the CLI:
//! the controller named by its PCI address must already be bound to
//! vfio-pci (VFIO type1 behind an IOMMU) or uio_pci_generic (hugepages,
//! physical addresses) — `kvtier nvme bind ADDR -- kvtier ...` does that
//! and gives it back afterwards — and its namespace 1 holds the pool.

use super::gpu::{CudaGioExecutor, GioExecutor, GpuEngine, GpuEngineConfig, HostGioExecutor};
use super::nvme::NvmeEngine;
use super::IoEngine;
use crate::error::{Error, Result};
use crate::host::pci::{bound_driver, pci_device_dir};
use crate::nvme::ctrl::{Bar0, Controller, ControllerOptions, DmaAlloc};
use crate::nvme::uio::{open_bar0, HugeDma};
use crate::nvme::vfio::VfioDevice;
use crate::nvme::{NvmeConfig, NvmeNamespace};
use crate::pool::{OpenExpect, Pool, PoolConfig};

/// The engines that drive a controller from userspace.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
pub enum UserspaceEngine {
    /// CPU-polled queue pairs.
    Nvme,
    /// The CUDA I/O kernel on a GPU.
    Gpu,
    /// The I/O kernel's logic on CPU threads (testing without a GPU).
    GpuHost,
}

/// A pool on namespace 1 of the controller at `addr` — created with
/// `create`, else opened with `expect` — and the engine that serves it.
pub fn pool_on_nvme(
    addr: &str,
    engine: UserspaceEngine,
    create: Option<&PoolConfig>,
    expect: &OpenExpect,
) -> Result<(Pool, Box<dyn IoEngine>)> {
    let dir = pci_device_dir(addr)?;
    if !dir.exists() {
        return Err(Error::invalid(format!(
            "there is no PCI device {addr} ({} is missing); `kvtier nvme list` shows the NVMe controllers",
            dir.display()
        )));
    }
    match bound_driver(&dir).as_deref() {
        Some("vfio-pci") => {
            let dev = VfioDevice::open(addr)?;
            serve(addr, dev.bar0(), dev.dma(32 << 20), engine, create, expect)
        }
        Some("uio_pci_generic") => serve(
            addr,
            open_bar0(addr)?,
            HugeDma::new(8),
            engine,
            create,
            expect,
        ),
        other => Err(Error::invalid(format!(
            "NVMe controller {addr} is bound to {}",
            other.unwrap_or("no driver")
        ))
        .with_fix(crate::error::Fix::BindController {
            addr: addr.to_string(),
        })),
    }
}

fn serve<B, A>(
    addr: &str,
    bar: B,
    mut dma: A,
    engine: UserspaceEngine,
    create: Option<&PoolConfig>,
    expect: &OpenExpect,
) -> Result<(Pool, Box<dyn IoEngine>)>
where
    B: Bar0 + Send + Sync + 'static,
    A: DmaAlloc + Send + 'static,
{
    let opts = ControllerOptions {
        name: addr.to_string(),
        io_queues: 2,
        extra_io_queues: u16::from(engine != UserspaceEngine::Nvme),
        ..Default::default()
    };
    let ctrl = Controller::bring_up(bar, &mut dma, opts)?;
    let cfg = NvmeConfig::default();
    let ns = NvmeNamespace::new(ctrl, dma, &cfg)?;
    let pool = match create {
        Some(c) => Pool::create_on(c, vec![ns.storage()])?,
        None => Pool::open_on(vec![ns.storage()], expect)?,
    };
    let engine: Box<dyn IoEngine> = match engine {
        UserspaceEngine::Nvme => Box::new(NvmeEngine::new(vec![ns], cfg)?),
        UserspaceEngine::Gpu | UserspaceEngine::GpuHost => {
            let exec: Box<dyn GioExecutor> = if engine == UserspaceEngine::Gpu {
                crate::gpu::probe()?;
                let dev = crate::gpu::Device::get(0)?;
                Box::new(CudaGioExecutor::new(crate::gpu::Context::primary(&dev)?)?)
            } else {
                Box::new(HostGioExecutor::new().ok_or_else(|| {
                    Error::invalid(
                        "this kvtier was built without a C++ compiler, so without the host build of the I/O kernel; install g++ and rebuild",
                    )
                })?)
            };
            Box::new(GpuEngine::new(vec![ns], exec, GpuEngineConfig::default())?)
        }
    };
    Ok((pool, engine))
}
