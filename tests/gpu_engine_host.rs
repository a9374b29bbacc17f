//! The GPU engine (`kvtier::engine::gpu`) with its I/O kernel run on the
//! host: the kernel's code (`kernels/gio_nvme.cuh`) compiled for the CPU
//! stands in for the GPU through `HostGioExecutor`, whose kernel addresses
//! are host pointers and whose "launch" runs the persistent kernel's blocks
//! on host threads. The
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
use kvtier::engine::gpu::{GioExecutor, GpuEngine, GpuEngineConfig, HostGioExecutor};
use kvtier::engine::IoEngine;
use kvtier::host::dio::AlignedBuf;
use kvtier::nvme::sim::SimConfig;
use kvtier::p2p::P2pTable;
use kvtier::ring::abi::{IOCTX_OP_READ, IOCTX_OP_WRITE, IOCTX_STATUS_TIMEOUT};
use std::sync::Arc;
use std::time::{Duration, Instant};

fn executor(_lib: &'static HostLib) -> Box<dyn GioExecutor> {
    Box::new(HostGioExecutor::new().expect("host build of the kernel"))
}

#[test]
fn tier_llama3_8b_through_the_gpu_engine() {
    let lib = lib_or_skip!();
    for prefer_sgl in [true, false] {
        let (_sim, ns) = suite::sim_namespace(
            SimConfig {
                lbas: 128 << 11,
                ..Default::default()
            },
            2,
        );
        let line = suite::tier_llama3_8b_on(ns, &move |ns| {
            let exec = executor(lib);
            Box::new(
                GpuEngine::new(
                    vec![ns.clone()],
                    exec,
                    GpuEngineConfig::default().with_prefer_sgl(prefer_sgl),
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
/// device's status in its IOCTX, next to good I/O in the same IOCB;
/// dropping the engine stops the kernel and deletes its queues, so a second
/// engine gets them again; a command the controller drops ends in
/// IOCTX_STATUS_TIMEOUT after the kernel's batch budget and stops the
/// controller, since it could still land later.
#[test]
fn errors_timeouts_and_teardown() {
    let lib = lib_or_skip!();
    let (sim, ns) = suite::sim_namespace(SimConfig::default(), 2);
    let nsze = 32768u64 * 512;
    for round in 0..2 {
        let exec = executor(lib);
        let mut engine = GpuEngine::new(
            vec![ns.clone()],
            exec,
            GpuEngineConfig::default()
                .with_batch_timeout(Duration::from_millis(200))
                // Round 1 keeps the kernel resident between IOCBs.
                .with_idle_exit(if round == 0 {
                    Some(Duration::ZERO)
                } else {
                    None
                }),
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

        let st = engine.stats();
        assert_eq!(st.errors, 1);
        assert!(st.commands >= 3 && st.doorbells >= 2, "{st:?}");
        // Stopped once nothing is in flight (the default idle_exit), so a
        // serving engine's cuMemFree never waits behind an idle kernel; the
        // next submit launches it again.
        let (resident, launches) = if round == 0 {
            (false, "2 kernel launch")
        } else {
            (true, "1 kernel launch")
        };
        assert_eq!(engine.kernel_resident(), resident, "round {round}");
        assert!(
            engine.describe().contains(launches),
            "round {round}: one launch per busy period, or one in all when kept resident: {}",
            engine.describe()
        );
        if round == 0 {
            // Teardown: dropping the engine stops the kernel and deletes its
            // queue pairs; the next round's engine creates them again.
            drop(engine);
            continue;
        }
        // A command the controller never completes: the kernel fails it
        // with IOCTX_STATUS_TIMEOUT after its batch budget, and because the
        // command may still land later, the engine stops the controller
        // before handing the IOCB back; the engine and the namespace's
        // metadata path then refuse to go on, saying why.
        sim.drop_next_commands(1);
        let start = Instant::now();
        let r = suite::run_iocb(
            &mut engine,
            &mut ring,
            &[(suite::ioctx(IOCTX_OP_READ, 1 << 20, 16384), vec![3])],
        );
        assert_eq!(r[0].0, IOCTX_STATUS_TIMEOUT, "{r:?}");
        assert!(start.elapsed() < Duration::from_secs(5));
        let id = ring.get_iocb().unwrap();
        ring.push_ctx(id, suite::ioctx(IOCTX_OP_READ, 1 << 20, 16384), &[3])
            .unwrap();
        ring.submit(id).unwrap();
        let err = engine.submit(&mut ring).unwrap_err().to_string();
        assert!(err.contains("controllers were stopped"), "{err}");
        let mut buf = AlignedBuf::zeroed(4096);
        let err = kvtier::pool::Storage::read_exact_at(&*ns.storage(), &mut buf, 0)
            .unwrap_err()
            .to_string();
        assert!(err.contains("controllers were stopped"), "{err}");
        drop(engine);
    }
}
