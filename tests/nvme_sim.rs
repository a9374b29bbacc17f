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

pub mod suite {
    use kvtier::nvme::ctrl::{Bar0, Controller, DataMode, DmaAlloc, DmaRegion, IoDir};
    use kvtier::nvme::spec::{Extent, Psdt, SglDescriptor, Sqe};
    use kvtier::nvme::DataPtr;
    use std::time::{Duration, Instant};

    /// Deterministic bytes that differ per seed and position.
    pub fn pattern(len: usize, seed: u64) -> Vec<u8> {
        let mut x = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
        (0..len)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                x as u8
            })
            .collect()
    }

    fn buffer<A: DmaAlloc>(dma: &mut A, len: usize, page: u64) -> DmaRegion {
        let r = dma.alloc(len, page as usize).expect("DMA buffer");
        r.fill(0);
        r
    }

    fn write_prp<B: Bar0, A: DmaAlloc>(c: &mut Controller<B>, dma: &mut A, lba: u64, data: &[u8]) {
        let w = buffer(dma, data.len(), c.page_bytes());
        w.write(0, data);
        c.transfer(
            0,
            IoDir::Write,
            lba,
            &[w.extent(0, data.len())],
            DataMode::Prp,
        )
        .expect("PRP write");
    }

    fn read_prp<B: Bar0, A: DmaAlloc>(
        c: &mut Controller<B>,
        dma: &mut A,
        lba: u64,
        len: usize,
    ) -> Vec<u8> {
        let r = buffer(dma, len, c.page_bytes());
        r.fill(0xee);
        c.transfer(0, IoDir::Read, lba, &[r.extent(0, len)], DataMode::Prp)
            .expect("PRP read");
        r.to_vec()
    }

    fn assert_same(got: &[u8], want: &[u8], what: &str) {
        assert_eq!(got.len(), want.len(), "{what}: length");
        if let Some(i) = got.iter().zip(want).position(|(a, b)| a != b) {
            panic!(
                "{what}: first difference at byte {i}: got {:#04x}, want {:#04x}",
                got[i], want[i]
            );
        }
    }

    /// Bring-up facts every controller must report.
    pub fn identify<B: Bar0>(c: &Controller<B>) {
        let id = c.identify();
        assert!(id.nn >= 1, "NN {}", id.nn);
        assert!(id.sqe_bytes() <= 64 && id.cqe_bytes() <= 16);
        assert!(
            c.sgl_supported(),
            "SGLS {:#x}: the suite needs SGLs",
            id.sgls
        );
        let ns = c.namespace();
        assert_eq!(ns.lba_bytes, 512);
        assert!(
            ns.nsze >= 4096,
            "namespace of {} LBAs is too small for the suite",
            ns.nsze
        );
        assert!(c.io_queue_count() >= 1);
        assert_eq!(c.max_transfer_bytes() % c.page_bytes(), 0);
        if let Some(mdts) = id.max_transfer_bytes(c.cap().mpsmin_bytes()) {
            assert!(c.max_transfer_bytes() <= mdts);
        }
    }

    /// PRP write, SGL read (one inline Data Block) and PRP read back.
    pub fn prp_write_sgl_read<B: Bar0, A: DmaAlloc>(c: &mut Controller<B>, dma: &mut A, lba: u64) {
        let len = 256 * 1024;
        let data = pattern(len, lba);
        write_prp(c, dma, lba, &data);
        let r = buffer(dma, len, c.page_bytes());
        r.fill(0xee);
        c.transfer(0, IoDir::Read, lba, &[r.extent(0, len)], DataMode::Sgl)
            .expect("SGL read");
        assert_same(&r.to_vec(), &data, "SGL read of PRP-written data");
        assert_same(
            &read_prp(c, dma, lba, len),
            &data,
            "PRP read of PRP-written data",
        );
    }

    /// SGL write (one Data Block), PRP read.
    pub fn sgl_write_prp_read<B: Bar0, A: DmaAlloc>(c: &mut Controller<B>, dma: &mut A, lba: u64) {
        let len = 64 * 1024;
        let data = pattern(len, lba ^ 0xbeef);
        let w = buffer(dma, len, c.page_bytes());
        w.write(0, &data);
        c.transfer(0, IoDir::Write, lba, &[w.extent(0, len)], DataMode::Sgl)
            .expect("SGL write");
        assert_same(
            &read_prp(c, dma, lba, len),
            &data,
            "PRP read of SGL-written data",
        );
    }

    /// One SGL read command (a Last Segment of Data Blocks) into six
    /// unaligned extents of odd lengths; the bytes around them stay untouched.
    pub fn scattered_sgl_read<B: Bar0, A: DmaAlloc>(c: &mut Controller<B>, dma: &mut A, lba: u64) {
        let lens = [1001usize, 3097, 4095, 513, 7165, 513]; // 16 KiB in all
        let total: usize = lens.iter().sum();
        assert_eq!(total, 16 * 1024);
        let data = pattern(total, lba);
        write_prp(c, dma, lba, &data);
        let guard = 64;
        let bufs: Vec<DmaRegion> = lens
            .iter()
            .map(|&l| {
                let b = buffer(dma, l + 2 * guard + 8, c.page_bytes());
                b.fill(0xa5);
                b
            })
            .collect();
        let extents: Vec<Extent> = bufs
            .iter()
            .zip(lens)
            .enumerate()
            .map(|(i, (b, l))| b.extent(guard + 1 + i, l)) // odd, unaligned starts
            .collect();
        let commands = c
            .transfer(0, IoDir::Read, lba, &extents, DataMode::Sgl)
            .expect("scattered SGL read");
        assert_eq!(commands, 1, "one SGL command for all extents");
        let mut at = 0;
        for (i, (b, l)) in bufs.iter().zip(lens).enumerate() {
            let all = b.to_vec();
            let start = guard + 1 + i;
            assert_same(
                &all[start..start + l],
                &data[at..at + l],
                &format!("extent {i}"),
            );
            assert!(
                all[..start].iter().all(|&x| x == 0xa5),
                "extent {i}: bytes before it written"
            );
            assert!(
                all[start + l..].iter().all(|&x| x == 0xa5),
                "extent {i}: bytes after it written"
            );
            at += l;
        }
    }

    /// Segment -> Last Segment chains (2 and 3 segments), reads and a write.
    pub fn sgl_segment_chain<B: Bar0, A: DmaAlloc>(c: &mut Controller<B>, dma: &mut A, lba: u64) {
        let page = c.page_bytes();
        // As in the notes: Segment [DB, DB, Last Segment -> [DB, DB]].
        let lens = [4096usize, 2048, 6144, 4096];
        let total: usize = lens.iter().sum();
        let data = pattern(total, lba + 7);
        write_prp(c, dma, lba, &data);
        let bufs: Vec<DmaRegion> = lens.iter().map(|&l| buffer(dma, l, page)).collect();
        let extents: Vec<Extent> = bufs.iter().zip(lens).map(|(b, l)| b.extent(0, l)).collect();
        c.transfer(0, IoDir::Read, lba, &extents, DataMode::SglSegmentsOf(3))
            .expect("Segment -> Last Segment read");
        let got: Vec<u8> = bufs.iter().flat_map(|b| b.to_vec()).collect();
        assert_same(&got, &data, "2-segment chain read");

        // Seven extents, 3 per segment: Segment -> Segment -> Last Segment; write.
        let lens = [512usize, 1536, 999, 1049, 2048, 3584, 6656];
        let total: usize = lens.iter().sum();
        assert_eq!(total % 512, 0);
        let data = pattern(total, lba + 9);
        let bufs: Vec<DmaRegion> = lens.iter().map(|&l| buffer(dma, l + 4, page)).collect();
        let mut at = 0;
        let extents: Vec<Extent> = bufs
            .iter()
            .zip(lens)
            .map(|(b, l)| {
                b.write(3, &data[at..at + l]);
                at += l;
                b.extent(3, l)
            })
            .collect();
        c.transfer(0, IoDir::Write, lba, &extents, DataMode::SglSegmentsOf(3))
            .expect("3-segment chain write");
        assert_same(
            &read_prp(c, dma, lba, total),
            &data,
            "PRP read of chain-written data",
        );
    }

    /// Transfers larger than the maximum transfer size are split, in both
    /// modes; one command past MDTS is refused with Invalid Field.
    pub fn split_at_mdts<B: Bar0, A: DmaAlloc>(c: &mut Controller<B>, dma: &mut A, lba: u64) {
        let max = c.max_transfer_bytes() as usize;
        let len = max * 6 + max / 4; // not a multiple of the limit
        let data = pattern(len, lba);
        let w = buffer(dma, len, c.page_bytes());
        w.write(0, &data);
        let n = c
            .transfer(0, IoDir::Write, lba, &[w.extent(0, len)], DataMode::Sgl)
            .expect("split SGL write");
        assert_eq!(n, 7, "{len} bytes at {max} per command");
        let r = buffer(dma, len, c.page_bytes());
        let n = c
            .transfer(0, IoDir::Read, lba, &[r.extent(0, len)], DataMode::Prp)
            .expect("split PRP read");
        assert_eq!(n, 7);
        assert_same(&r.to_vec(), &data, "split transfers");

        if let Some(mdts) = c.identify().max_transfer_bytes(c.cap().mpsmin_bytes()) {
            let over = (mdts * 2) as usize;
            if over <= len {
                let nlb = (over / 512 - 1) as u16;
                let sqe = Sqe::read(
                    0,
                    c.nsid(),
                    lba,
                    nlb,
                    DataPtr::Sgl(SglDescriptor::data_block(r.dma(), over as u32)),
                );
                let err = c.execute(0, sqe).unwrap_err().to_string();
                assert!(err.contains("0x4002"), "one command past MDTS: {err}");
            }
        }
    }

    /// An SGL shorter than the transfer: status 0x400f in the error.
    pub fn short_sgl<B: Bar0, A: DmaAlloc>(c: &mut Controller<B>, dma: &mut A, lba: u64) {
        let b = buffer(dma, 8192, c.page_bytes());
        let sqe = Sqe::read(
            0,
            c.nsid(),
            lba,
            7,
            DataPtr::Sgl(SglDescriptor::data_block(b.dma(), 2048)),
        );
        let err = c.execute(0, sqe).unwrap_err().to_string();
        assert!(err.contains("0x400f"), "{err}");
        assert!(err.contains("Data SGL Length Invalid"), "{err}");
        assert!(err.contains("queue 1"), "{err}");
    }

    /// A bit bucket descriptor (unsupported): 0x400d.
    pub fn bit_bucket<B: Bar0>(c: &mut Controller<B>, lba: u64) {
        let sqe = Sqe::read(
            0,
            c.nsid(),
            lba,
            7,
            DataPtr::Sgl(SglDescriptor::bit_bucket(4096)),
        );
        let err = c.execute(0, sqe).unwrap_err().to_string();
        assert!(err.contains("0x400d"), "{err}");
    }

    /// PSDT=11b (reserved): 0x4002 Invalid Field.
    pub fn psdt_reserved<B: Bar0, A: DmaAlloc>(c: &mut Controller<B>, dma: &mut A, lba: u64) {
        let b = buffer(dma, 4096, c.page_bytes());
        let mut sqe = Sqe::read(
            0,
            c.nsid(),
            lba,
            7,
            DataPtr::Sgl(SglDescriptor::data_block(b.dma(), 4096)),
        );
        sqe.set_psdt(Psdt::Reserved);
        let err = c.execute(0, sqe).unwrap_err().to_string();
        assert!(err.contains("0x4002"), "{err}");
        assert!(err.contains("Invalid Field in Command"), "{err}");
    }

    /// A transfer ending past the namespace: 0x4080 LBA Out of Range, with
    /// the byte offset in the error.
    pub fn lba_out_of_range<B: Bar0, A: DmaAlloc>(c: &mut Controller<B>, dma: &mut A) {
        let nsze = c.namespace().nsze;
        let b = buffer(dma, 8192, c.page_bytes());
        let err = c
            .transfer(
                0,
                IoDir::Read,
                nsze - 4,
                &[b.extent(0, 8192)],
                DataMode::Auto,
            )
            .unwrap_err();
        let msg = err.to_string();
        assert!(msg.contains("0x4080"), "{msg}");
        assert!(msg.contains("LBA Out of Range"), "{msg}");
        assert!(
            msg.contains(&format!("offset {}", (nsze - 4) * 512)),
            "{msg}"
        );
    }

    /// A command the controller never completes (the caller arranges it with
    /// `arm`) times out with an error naming the queue, promptly; the queue
    /// stays usable.
    pub fn timeout_names_queue<B: Bar0, A: DmaAlloc>(
        c: &mut Controller<B>,
        dma: &mut A,
        lba: u64,
        arm: impl FnOnce(),
    ) {
        let b = buffer(dma, 4096, c.page_bytes());
        let old = c.io_timeout();
        c.set_io_timeout(Duration::from_millis(100));
        arm();
        let start = Instant::now();
        let err = c
            .transfer(0, IoDir::Read, lba, &[b.extent(0, 4096)], DataMode::Auto)
            .unwrap_err()
            .to_string();
        assert!(
            start.elapsed() < Duration::from_secs(5),
            "the wait must not hang"
        );
        assert!(err.contains("NVMe queue 1: no completion within"), "{err}");
        assert!(err.contains("outstanding"), "{err}");
        c.set_io_timeout(old);
        c.transfer(0, IoDir::Read, lba, &[b.extent(0, 4096)], DataMode::Auto)
            .expect("the queue works after a timeout");
    }

    /// Flush, then shutdown; I/O afterwards is refused with a clear error.
    pub fn flush_and_shutdown<B: Bar0, A: DmaAlloc>(c: &mut Controller<B>, dma: &mut A) {
        c.flush(0).expect("flush");
        c.shutdown().expect("shutdown");
        assert!(c.is_shut_down());
        let b = buffer(dma, 4096, c.page_bytes());
        let err = c
            .transfer(0, IoDir::Read, 0, &[b.extent(0, 4096)], DataMode::Auto)
            .unwrap_err()
            .to_string();
        assert!(err.contains("shut down"), "{err}");
    }
}

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
    sim_with(
        cfg,
        ControllerOptions {
            name: "sim".into(),
            ..Default::default()
        },
    )
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
        ControllerOptions {
            name: "sim".into(),
            io_queues: 3,
            io_depth: 4,
            ..Default::default()
        },
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
        ControllerOptions {
            name: "sim-page".into(),
            ..Default::default()
        },
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
