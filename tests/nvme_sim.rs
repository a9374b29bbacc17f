//! The userspace NVMe suite, run here against the simulated controller
//! (`kvtier::nvme::sim`, a test double of hardware).
//!
//! Every check in [`suite`] is a plain function over `Controller<B: Bar0>`
//! and a `DmaAlloc`, so the QEMU lane can call the same functions in the
//! guest against QEMU's hw/nvme (through VFIO or uio). Each one uses its own
//! LBA range and verifies data by reading it back through the other DMA mode,
//! byte for byte.

use kvtier::nvme::ctrl::{Bar0, Controller, ControllerOptions, DataMode, DmaAlloc, IoDir};
use kvtier::nvme::sim::{SimConfig, SimController};

#[path = "nvme_suite/mod.rs"]
pub mod suite;

fn sim_with(
    cfg: SimConfig,
    opts: ControllerOptions,
) -> (SimController, Controller<SimController>, impl DmaAlloc) {
    let sim = SimController::new(cfg);
    let mut dma = sim.dma();
    let c = Controller::bring_up(sim.clone(), &mut dma, opts).expect("bring-up");
    (sim, c, dma)
}

fn sim(cfg: SimConfig) -> (SimController, Controller<SimController>, impl DmaAlloc) {
    sim_with(cfg, ControllerOptions::default().with_name("sim".into()))
}

#[test]
fn bring_up_and_identify() {
    let (sim, c, _dma) = sim(SimConfig::default());
    suite::identify(&c);
    assert_eq!(c.identify().mdts, 7);
    assert_eq!(c.identify().sgls, 0x1);
    assert_eq!(c.identify().model, "kvtier simulated NVMe controller");
    assert_eq!(c.namespace().nsze, 32768);
    assert_eq!(c.max_transfer_bytes(), 512 * 1024);
    assert_eq!(c.page_bytes(), 4096);
    assert_eq!(c.version().to_string(), "1.4.0");
    // Identify x2, Set Features, Create CQ + SQ.
    assert_eq!(sim.stats().admin_commands, 5);
}

#[test]
fn prp_write_sgl_read() {
    let (_sim, mut c, mut dma) = sim(SimConfig::default());
    suite::prp_write_sgl_read(&mut c, &mut dma, 0);
}

#[test]
fn sgl_write_prp_read() {
    let (_sim, mut c, mut dma) = sim(SimConfig::default());
    suite::sgl_write_prp_read(&mut c, &mut dma, 4096);
}

#[test]
fn scattered_read_through_one_sgl() {
    let (sim, mut c, mut dma) = sim(SimConfig::default());
    suite::scattered_sgl_read(&mut c, &mut dma, 64);
    assert_eq!(sim.stats().reads, 1);
}

#[test]
fn segment_chains() {
    let (_sim, mut c, mut dma) = sim(SimConfig::default());
    suite::sgl_segment_chain(&mut c, &mut dma, 128);
}

#[test]
fn split_at_mdts_3() {
    let (sim, mut c, mut dma) = sim(SimConfig {
        mdts: 3,
        ..Default::default()
    });
    assert_eq!(c.max_transfer_bytes(), 32 * 1024);
    suite::split_at_mdts(&mut c, &mut dma, 1000);
    assert_eq!(sim.stats().largest_transfer, 32 * 1024);
}

#[test]
fn long_prp_lists_chain_across_pages() {
    // 4 MiB in one command: 1024 PRP entries, a list of three pages.
    let (sim, mut c, mut dma) = sim(SimConfig {
        mdts: 10,
        lbas: 16384,
        ..Default::default()
    });
    assert_eq!(c.max_transfer_bytes(), 4 << 20);
    let len = 4 << 20;
    let data = suite::pattern(len, 42);
    let w = dma.alloc(len, 4096).unwrap();
    w.write(0, &data);
    assert_eq!(
        c.transfer(0, IoDir::Write, 0, &[w.extent(0, len)], DataMode::Prp)
            .unwrap(),
        1
    );
    assert_eq!(sim.namespace_bytes(0, len), data);
    // Read back starting mid-page: 1025 entries.
    let r = dma.alloc(len + 4096, 4096).unwrap();
    assert_eq!(
        c.transfer(0, IoDir::Read, 0, &[r.extent(512, len)], DataMode::Prp)
            .unwrap(),
        1
    );
    assert_eq!(r.sub(512, len).to_vec(), data);
    assert_eq!(sim.stats().largest_transfer, len as u64);
}

#[test]
fn error_statuses_name_the_nvme_status() {
    let (_sim, mut c, mut dma) = sim(SimConfig::default());
    suite::short_sgl(&mut c, &mut dma, 0);
    suite::bit_bucket(&mut c, 0);
    suite::psdt_reserved(&mut c, &mut dma, 0);
    suite::lba_out_of_range(&mut c, &mut dma);
    // The queue still works after errors.
    suite::sgl_write_prp_read(&mut c, &mut dma, 256);
}

#[test]
fn dropped_command_times_out_naming_the_queue() {
    let (sim, mut c, mut dma) = sim(SimConfig::default());
    let handle = sim.clone();
    suite::timeout_names_queue(&mut c, &mut dma, 0, move || handle.drop_next_commands(1));
    assert_eq!(sim.stats().dropped, 1);
}

#[test]
fn flush_and_shutdown() {
    let (sim, mut c, mut dma) = sim(SimConfig::default());
    suite::flush_and_shutdown(&mut c, &mut dma);
    assert_eq!(sim.stats().flushes, 1);
    drop(c);
    assert_eq!(sim.read32(0x14) & 1, 0, "dropping the controller resets it");
}

#[test]
fn several_io_queues() {
    let (_sim, mut c, mut dma) = sim_with(
        SimConfig::default(),
        ControllerOptions::default()
            .with_name("sim".into())
            .with_io_queues(3)
            .with_io_depth(4),
    );
    assert_eq!(c.io_queue_count(), 3);
    assert_eq!(c.io_queue(2).unwrap().qid(), 3);
    assert_eq!(c.io_queue(2).unwrap().depth(), 4);
    let data = suite::pattern(8192, 5);
    let w = dma.alloc(8192, 4096).unwrap();
    w.write(0, &data);
    // Enough commands on a depth-4 queue to wrap it several times.
    for k in 0..10u64 {
        c.transfer(
            2,
            IoDir::Write,
            k * 16,
            &[w.extent(0, 8192)],
            DataMode::Auto,
        )
        .unwrap();
    }
    let r = dma.alloc(8192, 4096).unwrap();
    c.transfer(1, IoDir::Read, 9 * 16, &[r.extent(0, 8192)], DataMode::Prp)
        .unwrap();
    assert_eq!(r.to_vec(), data);
    let Err(err) = c.io_queue(3) else {
        panic!("there is no fourth queue");
    };
    assert!(err.to_string().contains("3 I/O queue(s)"), "{err}");
}

#[test]
fn controller_that_never_gets_ready_times_out_naming_csts_and_cap_to() {
    let sim = SimController::new(SimConfig {
        never_ready: true,
        timeout_units: 1,
        ..Default::default()
    });
    let mut dma = sim.dma();
    let start = std::time::Instant::now();
    let err = Controller::bring_up(sim.clone(), &mut dma, ControllerOptions::default())
        .err()
        .expect("bring-up must fail")
        .to_string();
    assert!(start.elapsed() < std::time::Duration::from_secs(5));
    assert!(err.contains("CSTS.RDY=1"), "{err}");
    assert!(err.contains("CSTS=0x00000000"), "{err}");
    assert!(err.contains("CAP.TO=500 ms"), "{err}");
    assert_eq!(
        sim.read32(0x14) & 1,
        0,
        "a failed bring-up leaves the controller disabled"
    );
}

#[test]
fn sgl_requested_without_sgl_support_is_refused() {
    let (_sim, mut c, mut dma) = sim(SimConfig {
        sgls: 0,
        ..Default::default()
    });
    assert!(!c.sgl_supported());
    let b = dma.alloc(4096, 4096).unwrap();
    let err = c
        .transfer(0, IoDir::Read, 0, &[b.extent(0, 4096)], DataMode::Sgl)
        .unwrap_err();
    assert!(err.to_string().contains("does not support SGLs"), "{err}");
    // Auto falls back to PRP.
    c.transfer(0, IoDir::Read, 0, &[b.extent(0, 4096)], DataMode::Auto)
        .unwrap();
}

#[test]
fn memory_outside_the_dma_arena_is_a_data_transfer_error() {
    let (_sim, mut c, _dma) = sim(SimConfig::default());
    let outside = vec![0u8; 4096];
    let ext = kvtier::nvme::spec::Extent {
        addr: outside.as_ptr() as u64,
        len: 4096,
    };
    let err = c
        .transfer(0, IoDir::Read, 0, &[ext], DataMode::Sgl)
        .unwrap_err();
    assert!(err.to_string().contains("0x4004"), "{err}");
    assert!(outside.iter().all(|&b| b == 0));
}

// ------------------------------------------------------ the nvme engine --

use kvtier::engine::nvme::NvmeEngine;
use kvtier::engine::IoEngine;
use kvtier::nvme::sim::SimDma;
use kvtier::nvme::{NvmeConfig, NvmeNamespace};

/// A simulated controller brought up the way the nvme engine needs it: two
/// I/O queue pairs (data path and the pool's metadata).
fn sim_for_engine(cfg: SimConfig) -> (SimController, Controller<SimController>, SimDma) {
    let sim = SimController::new(cfg);
    let mut dma = sim.dma();
    let c = Controller::bring_up(
        sim.clone(),
        &mut dma,
        ControllerOptions::default()
            .with_name("sim".into())
            .with_io_queues(2),
    )
    .expect("bring-up");
    (sim, c, dma)
}

#[test]
fn engine_scatter_gather_sgl() {
    let (sim, c, dma) = sim_for_engine(SimConfig::default());
    suite::engine_scatter_gather(c, dma, DataMode::Sgl, 4 << 20);
    assert!(
        sim.stats().errors >= 1,
        "the out-of-range read reached the device"
    );
}

#[test]
fn engine_scatter_gather_prp() {
    let (_sim, c, dma) = sim_for_engine(SimConfig::default());
    suite::engine_scatter_gather(c, dma, DataMode::Prp, 4 << 20);
}

#[test]
fn engine_splits_at_mdts_3() {
    let (_sim, c, dma) = sim_for_engine(SimConfig {
        mdts: 3,
        ..Default::default()
    });
    assert_eq!(c.max_transfer_bytes(), 32 << 10);
    suite::engine_scatter_gather(c, dma, DataMode::Auto, 0);
}

#[test]
fn tier_llama3_8b_on_the_simulated_controller() {
    for mode in [DataMode::Auto, DataMode::Prp] {
        let (_sim, c, dma) = sim_for_engine(SimConfig {
            lbas: 128 << 11, // 128 MiB
            ..Default::default()
        });
        let line = suite::tier_llama3_8b(c, dma, mode);
        eprintln!("{line}");
        assert!(line.contains("40 MiB llama3-8b KV"), "{line}");
    }
}

#[test]
fn engine_refuses_a_controller_with_one_io_queue() {
    let (_sim, c, dma) = sim(SimConfig::default());
    let err = NvmeNamespace::new(c, dma, &NvmeConfig::default())
        .err()
        .expect("one queue is refused")
        .to_string();
    assert!(err.contains("io_queues = 2"), "{err}");
}

#[test]
fn engine_dropped_command_times_out_and_stops_the_controller() {
    use kvtier::host::dio::AlignedBuf;
    use kvtier::p2p::P2pTable;
    use kvtier::ring::abi::{IOCTX_OP_READ, IOCTX_STATUS_TIMEOUT};
    use kvtier::ring::GioRing;
    use std::time::{Duration, Instant};

    let (sim, c, dma) = sim_for_engine(SimConfig::default());
    let cfg = NvmeConfig::default().with_io_timeout(Duration::from_millis(100));
    let ns = NvmeNamespace::new(c, dma, &cfg).unwrap();
    let mut engine = NvmeEngine::new(vec![ns.clone()], cfg).unwrap();
    let mut mem = AlignedBuf::zeroed(8192);
    let table = P2pTable::for_buffers(mem.as_mut_ptr() as u64, 4096, 2).unwrap();
    engine.register_memory(std::sync::Arc::new(table)).unwrap();
    sim.drop_next_commands(1);
    let mut ring = GioRing::new(4).unwrap();
    let id = ring.get_iocb().unwrap();
    ring.push_ctx(id, suite::ioctx(IOCTX_OP_READ, 0, 4096), &[0])
        .unwrap();
    ring.push_ctx(id, suite::ioctx(IOCTX_OP_READ, 4096, 4096), &[1])
        .unwrap();
    ring.submit(id).unwrap();
    engine.submit(&mut ring).unwrap();
    let start = Instant::now();
    let err = loop {
        match engine.reap(&mut ring, true) {
            Err(e) => break e.to_string(),
            Ok(()) => assert!(start.elapsed() < Duration::from_secs(5), "never timed out"),
        }
    };
    assert!(start.elapsed() < Duration::from_secs(5));
    assert!(err.contains("no completion within"), "{err}");
    assert!(err.contains("the controller was stopped"), "{err}");
    assert_eq!(ring.pop_cq(), Some(id), "the IOCB completes, failed");
    let iocb = ring.iocb(id);
    assert_eq!(
        iocb.hdr.errors, 1,
        "the dropped command fails; the other completed"
    );
    assert!(
        (0..2).any(|i| iocb.ctx[i].status == IOCTX_STATUS_TIMEOUT),
        "{:?}",
        &iocb.ctx[..2]
    );
    assert_eq!(engine.in_flight(), 0);
    // The pool's metadata path on the stopped controller says so.
    let mut buf = AlignedBuf::zeroed(4096);
    let err = ns
        .storage()
        .read_exact_at(&mut buf, 0)
        .unwrap_err()
        .to_string();
    assert!(err.contains("controller was stopped"), "{err}");
}

/// The whole suite again with every doorbell (admin and I/O) written to the
/// simulator's doorbell page and forwarded by its polling thread: the
/// controller then runs asynchronously to the host, as QEMU's and a GPU
/// kernel's view of a device are, so the queue pair's phase-tag polling,
/// timeouts and doorbell batching are exercised against a concurrent writer.
#[test]
fn suite_with_doorbells_through_the_page() {
    let sim = SimController::new(SimConfig {
        mdts: 5,
        ..Default::default()
    });
    let page = sim.doorbell_page().expect("doorbell page");
    let mut dma = sim.dma();
    let mut c = Controller::bring_up(
        page.clone(),
        &mut dma,
        ControllerOptions::default().with_name("sim-page".into()),
    )
    .expect("bring-up through the doorbell page");
    suite::identify(&c);
    suite::prp_write_sgl_read(&mut c, &mut dma, 0);
    suite::sgl_write_prp_read(&mut c, &mut dma, 4096);
    suite::scattered_sgl_read(&mut c, &mut dma, 64);
    suite::sgl_segment_chain(&mut c, &mut dma, 128);
    suite::split_at_mdts(&mut c, &mut dma, 1000);
    suite::short_sgl(&mut c, &mut dma, 0);
    suite::bit_bucket(&mut c, 0);
    suite::psdt_reserved(&mut c, &mut dma, 0);
    suite::lba_out_of_range(&mut c, &mut dma);
    let handle = sim.clone();
    suite::timeout_names_queue(&mut c, &mut dma, 0, move || handle.drop_next_commands(1));
    suite::flush_and_shutdown(&mut c, &mut dma);
    let stats = sim.stats();
    assert_eq!(stats.dropped, 1);
    assert!(stats.reads > 0 && stats.writes > 0);
    // The doorbells really went through the page: it holds the admin SQ's
    // last tail (shutdown does not reset, so the page is not cleared yet).
    // SAFETY: a 4-aligned slot of the page, which `page` keeps alive.
    let admin_tail = unsafe { page.doorbell_ptr(0x1000).read_volatile() };
    assert!(admin_tail > 0, "admin SQ tail doorbell in the page");
    drop(c);
    drop(page);
}

/// A reset clears the page (values from before it must not reach queues
/// created after it), and bring-up works again over the same page.
#[test]
fn doorbell_page_survives_a_reset_and_a_second_bring_up() {
    let sim = SimController::new(SimConfig::default());
    let page = sim.doorbell_page().expect("doorbell page");
    let mut dma = sim.dma();
    for round in 0..2u64 {
        let mut c = Controller::bring_up(page.clone(), &mut dma, ControllerOptions::default())
            .expect("bring-up");
        suite::sgl_write_prp_read(&mut c, &mut dma, 8 * round);
        drop(c); // resets the controller
                 // SAFETY: a 4-aligned slot of the page, which `page` keeps alive.
        let tail = unsafe { page.doorbell_ptr(0x1000).read_volatile() };
        assert_eq!(tail, 0, "round {round}: the reset cleared the page");
    }
    assert!(
        sim.doorbell_page().is_err(),
        "a second page on the same controller is refused"
    );
}

/// The nvme engine and the tier through it against the controller running
/// asynchronously (doorbells through the page, a polling thread): the
/// engine's batching and completion polling against a concurrent writer.
#[test]
fn tier_llama3_8b_with_doorbells_through_the_page() {
    let (_sim, ns) = suite::sim_namespace(
        SimConfig {
            lbas: 128 << 11,
            ..Default::default()
        },
        0,
    );
    let cfg = NvmeConfig::default();
    let line = suite::tier_llama3_8b_on(ns, &|ns| {
        Box::new(NvmeEngine::new(vec![ns.clone()], cfg.clone()).expect("engine"))
    });
    eprintln!("{line}");
    assert!(line.contains("40 MiB llama3-8b KV"), "{line}");
}

/// A metadata command (the pool's superblock and header I/O through the
/// namespace) that never completes: the error names the timeout, and the
/// controller is stopped, so the lost command cannot later read or write
/// the bounce buffer while it holds other data; the next call says so.
#[test]
fn metadata_timeout_stops_the_controller() {
    use kvtier::host::dio::AlignedBuf;
    use std::time::{Duration, Instant};
    let (sim, c, dma) = sim_for_engine(SimConfig::default());
    let cfg = NvmeConfig::default().with_io_timeout(Duration::from_millis(100));
    let ns = NvmeNamespace::new(c, dma, &cfg).unwrap();
    let storage = ns.storage();
    let mut buf = AlignedBuf::zeroed(8192);
    storage.read_exact_at(&mut buf, 0).expect("a normal read");
    sim.drop_next_commands(1);
    let start = Instant::now();
    let err = storage.write_all_at(&buf, 4096).unwrap_err().to_string();
    assert!(start.elapsed() < Duration::from_secs(5));
    assert!(err.contains("no completion within"), "{err}");
    let err = storage.read_exact_at(&mut buf, 0).unwrap_err().to_string();
    assert!(err.contains("controller was stopped"), "{err}");
}

/// A pool is formatted onto a namespace only if it holds nothing foreign:
/// an ext4 signature is refused, naming the device and `--force`; forced,
/// it is overwritten; a kvtier pool is reformatted without asking.
#[test]
fn pool_on_a_namespace_refuses_a_filesystem_unless_forced() {
    use kvtier::host::dio::AlignedBuf;
    use kvtier::pool::{Pool, PoolConfig};
    let (_sim, c, dma) = sim_for_engine(SimConfig {
        lbas: 64 << 11,
        ..Default::default()
    });
    let ns = NvmeNamespace::new(c, dma, &NvmeConfig::default()).unwrap();
    let mut head = AlignedBuf::zeroed(4096);
    head.as_mut_slice()[1080..1082].copy_from_slice(&[0x53, 0xef]); // ext2/3/4 magic
    ns.storage().write_all_at(&head, 0).unwrap();
    let mut cfg = PoolConfig::new(
        kvtier::model::preset("llama3-8b", 16).unwrap(),
        "llama3-8b",
        "t",
    )
    .with_group_blocks(4)
    .with_devices(Vec::new());
    let err = Pool::create_on(&cfg, vec![ns.storage()])
        .err()
        .expect("refused")
        .to_string();
    assert!(
        err.contains("ext2/3/4") && err.contains("PoolConfig::force"),
        "{err}"
    );
    assert!(err.contains("nvme:sim/ns1"), "{err}");
    cfg.force = true;
    Pool::create_on(&cfg, vec![ns.storage()]).expect("forced");
    // Reformatting a kvtier pool loses its blocks: that takes --force too.
    cfg.force = false;
    let err = Pool::create_on(&cfg, vec![ns.storage()])
        .err()
        .expect("refused")
        .to_string();
    assert!(
        err.contains("holds a kvtier pool") && err.contains("PoolConfig::force"),
        "{err}"
    );
    cfg.force = true;
    Pool::create_on(&cfg, vec![ns.storage()]).expect("forced reformat");
}
