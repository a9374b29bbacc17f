//! The GPU engine (`kvtier::engine::gpu`) with its I/O kernel run on the
//! host: the kernel's code (`kernels/gio_nvme.cuh`) compiled for the CPU
//! (`tests/common/gio_host.rs`) stands in for the GPU through a
//! [`GioExecutor`] whose kernel addresses are host pointers and whose
//! "launch" runs the persistent kernel's blocks on host threads. The
//! controller is the simulator with its doorbell page (a test double held
//! to the QEMU suite), so the kernel's doorbell stores reach it as a GPU's
//! would reach BAR0. Everything the engine's host side does is real: the
//! kernel's queue pairs created through the admin queue, the P2P table in
//! DMA addresses, the gio SQ/CQ protocol, stop, teardown.
//!
//! Skipped, with a message, only when no host C++ compiler exists.

mod common;

#[path = "nvme_suite/mod.rs"]
mod suite;

use common::gio_host::HostLib;
use kvtier::engine::gpu::{GioExecutor, GpuEngine, GpuEngineConfig};
use kvtier::engine::nvme::{NvmeConfig, NvmeNamespace};
use kvtier::engine::IoEngine;
use kvtier::gpu::abi::{GioEngine, GIO_MODE_PERSISTENT};
use kvtier::nvme::ctrl::{Controller, ControllerOptions};
use kvtier::nvme::sim::{SimConfig, SimController, SimDoorbellPage};
use kvtier::p2p::P2pTable;
use kvtier::pool::backing::AlignedBuf;
use kvtier::ring::abi::{IOCTX_OP_READ, IOCTX_OP_WRITE, IOCTX_STATUS_TIMEOUT};
use std::any::Any;
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// The persistent kernel on host threads (one per block, 64 "threads" each).
struct HostExecutor {
    lib: &'static HostLib,
    running: Option<JoinHandle<()>>,
    launches: Arc<std::sync::atomic::AtomicU32>,
}

impl GioExecutor for HostExecutor {
    fn name(&self) -> &'static str {
        "host"
    }

    unsafe fn map_host(
        &mut self,
        ptr: *mut u8,
        _len: usize,
        _mmio: bool,
    ) -> kvtier::error::Result<(u64, Box<dyn Any + Send>)> {
        Ok((ptr as u64, Box::new(())))
    }

    unsafe fn launch(&mut self, engine: u64, blocks: u32) -> kvtier::error::Result<()> {
        assert!(self.running.is_none(), "launched twice without a join");
        let run = self.lib.run_grid;
        let eng = engine as usize;
        // SAFETY (in the thread): the engine keeps the descriptor and all it
        // names alive until join returned (GioExecutor::launch's contract).
        let e = unsafe { &*(eng as *const GioEngine) };
        assert_eq!(e.queue_count, blocks);
        self.launches
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        self.running = Some(std::thread::spawn(move || unsafe {
            run(eng as *const GioEngine, 64, GIO_MODE_PERSISTENT)
        }));
        Ok(())
    }

    fn join(&mut self, timeout: Duration) -> kvtier::error::Result<()> {
        let Some(t) = self.running.take() else {
            return Ok(());
        };
        let start = Instant::now();
        while !t.is_finished() {
            if start.elapsed() > timeout {
                self.running = Some(t);
                return Err(kvtier::error::Error::invalid("host kernel did not stop"));
            }
            std::thread::sleep(Duration::from_millis(1));
        }
        t.join().expect("host kernel thread");
        Ok(())
    }
}

fn executor(lib: &'static HostLib) -> (Box<dyn GioExecutor>, Arc<std::sync::atomic::AtomicU32>) {
    let launches = Arc::new(std::sync::atomic::AtomicU32::new(0));
    (
        Box::new(HostExecutor {
            lib,
            running: None,
            launches: launches.clone(),
        }),
        launches,
    )
}

/// A simulated controller reached through its doorbell page, brought up
/// with the host queue pairs of a namespace plus one for the GPU kernel.
fn namespace(cfg: SimConfig) -> (SimController, NvmeNamespace<SimDoorbellPage>) {
    let sim = SimController::new(cfg);
    let page = sim.doorbell_page().expect("doorbell page");
    let mut dma = sim.dma();
    let c = Controller::bring_up(
        page,
        &mut dma,
        ControllerOptions {
            name: "sim-gpu".into(),
            io_queues: 2,
            extra_io_queues: 2,
            ..Default::default()
        },
    )
    .expect("bring-up");
    let ns = NvmeNamespace::new(c, dma, &NvmeConfig::default()).expect("namespace");
    (sim, ns)
}

#[test]
fn tier_llama3_8b_through_the_gpu_engine() {
    let lib = lib_or_skip!();
    for prefer_sgl in [true, false] {
        let (_sim, ns) = namespace(SimConfig {
            lbas: 128 << 11,
            ..Default::default()
        });
        let line = suite::tier_llama3_8b_on(ns, &move |ns| {
            let (exec, _launches) = executor(lib);
            Box::new(
                GpuEngine::new(
                    vec![ns.clone()],
                    exec,
                    GpuEngineConfig {
                        prefer_sgl,
                        ..Default::default()
                    },
                )
                .expect("GPU engine"),
            ) as Box<dyn IoEngine>
        });
        eprintln!("gpu engine (host-run kernel, sgl={prefer_sgl}): {line}");
        assert!(line.contains("40 MiB llama3-8b KV"), "{line}");
        assert!(line.contains("gpu (host executor)"), "{line}");
    }
}

/// Errors through the kernel: a read past the namespace comes back as the
/// device's status in its IOCTX, next to good I/O in the same IOCB; a
/// command the controller drops ends in IOCTX_STATUS_TIMEOUT after the
/// kernel's batch budget, and the engine goes on; dropping the engine stops
/// the kernel and deletes its queues, so a second engine gets them again.
#[test]
fn errors_timeouts_and_teardown() {
    let lib = lib_or_skip!();
    let (sim, ns) = namespace(SimConfig::default());
    let nsze = 32768u64 * 512;
    for round in 0..2 {
        let (exec, launches) = executor(lib);
        let mut engine = GpuEngine::new(
            vec![ns.clone()],
            exec,
            GpuEngineConfig {
                batch_timeout: Duration::from_millis(200),
                ..Default::default()
            },
        )
        .unwrap_or_else(|e| panic!("engine, round {round}: {e}"));
        let mut ring = kvtier::ring::GioRing::new(4).unwrap();
        let mut mem = AlignedBuf::zeroed(4 * 16384);
        let table = P2pTable::for_buffers(mem.as_mut_ptr() as u64, 16384, 4).unwrap();
        engine.register_memory(Arc::new(table)).unwrap();
        let data = suite::pattern(16384, round);
        mem.as_mut_slice()[..16384].copy_from_slice(&data);
        let r = suite::run_iocb(
            &mut engine,
            &mut ring,
            &[(suite::ioctx(IOCTX_OP_WRITE, 1 << 20, 16384), vec![0])],
        );
        assert_eq!(r, vec![(0, 16384)]);
        let r = suite::run_iocb(
            &mut engine,
            &mut ring,
            &[
                (suite::ioctx(IOCTX_OP_READ, nsze, 16384), vec![1]),
                (suite::ioctx(IOCTX_OP_READ, 1 << 20, 16384), vec![2]),
            ],
        );
        assert_eq!(r, vec![(0x0080, 0), (0, 16384)]);
        assert_eq!(&mem.as_slice()[2 * 16384..3 * 16384], &data[..]);

        sim.drop_next_commands(1);
        let start = Instant::now();
        let r = suite::run_iocb(
            &mut engine,
            &mut ring,
            &[(suite::ioctx(IOCTX_OP_READ, 1 << 20, 16384), vec![3])],
        );
        assert_eq!(r[0].0, IOCTX_STATUS_TIMEOUT, "{r:?}");
        assert!(start.elapsed() < Duration::from_secs(5));
        // The queue keeps working after the timed-out command.
        let r = suite::run_iocb(
            &mut engine,
            &mut ring,
            &[(suite::ioctx(IOCTX_OP_READ, 1 << 20, 16384), vec![3])],
        );
        assert_eq!(r, vec![(0, 16384)]);
        let st = engine.stats();
        assert_eq!(st.errors, 2);
        assert!(st.commands >= 4 && st.doorbells >= 4, "{st:?}");
        assert_eq!(
            launches.load(std::sync::atomic::Ordering::Relaxed),
            1,
            "one resident kernel serves every IOCB"
        );
        drop(engine);
    }
}
