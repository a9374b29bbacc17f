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

    // ------------------------------------------------ the nvme engine --

    use kvtier::engine::nvme::{NvmeConfig, NvmeEngine, NvmeNamespace};
    use kvtier::engine::IoEngine;
    use kvtier::p2p::P2pTable;
    use kvtier::pool::backing::AlignedBuf;
    use kvtier::pool::{Key, OpenExpect, Pool, PoolConfig};
    use kvtier::ring::abi::{IoCtx, IOCTX_OP_READ, IOCTX_OP_WRITE, IOCTX_STATUS_INVALID};
    use kvtier::ring::GioRing;
    use kvtier::tier::{Tier, TierConfig};
    use kvtier::{HostKvCache, HostLayout};
    use std::sync::Arc;

    /// Runs one IOCB of `ctxs` (IoCtx, segments) through `engine`; returns
    /// each IOCTX's (status, result).
    pub fn run_iocb<E: IoEngine + ?Sized>(
        engine: &mut E,
        ctxs: &[(IoCtx, Vec<u32>)],
    ) -> Vec<(u16, u32)> {
        let mut ring = GioRing::new(4).unwrap();
        let id = ring.get_iocb().unwrap();
        for (c, segs) in ctxs {
            ring.push_ctx(id, *c, segs).expect("room in the IOCB");
        }
        ring.submit(id).unwrap();
        engine.submit(&mut ring).unwrap();
        let start = Instant::now();
        loop {
            if let Some(done) = ring.pop_cq() {
                assert_eq!(done, id);
                break;
            }
            engine.reap(&mut ring, true).unwrap();
            assert!(
                start.elapsed() < Duration::from_secs(30),
                "IOCB never completed"
            );
        }
        let iocb = ring.iocb(id);
        (0..ctxs.len())
            .map(|i| (iocb.ctx[i].status, iocb.ctx[i].result))
            .collect()
    }

    pub fn ioctx(op: u8, dev_offset: u64, len: u32) -> IoCtx {
        IoCtx {
            dev_offset,
            len,
            op,
            ..Default::default()
        }
    }

    /// The nvme engine on its own: eight 16 KiB buffers registered as a P2P
    /// table; a write gathering buffers 5, 1, 3 (one command, an SGL of three
    /// data blocks or a PRP list), a read scattering the same bytes into
    /// buffers 0, 6, 2, 4 in another cut, verified byte for byte; a transfer
    /// past MDTS split; then the error paths: an LBA past the namespace
    /// surfaces as NVMe status 0x0080 in the IOCTX, a length that disagrees
    /// with the segments as IOCTX_STATUS_INVALID, and nothing hangs.
    pub fn engine_scatter_gather<B, A>(c: Controller<B>, dma: A, mode: DataMode, offset: u64)
    where
        B: Bar0 + Send + Sync + 'static,
        A: DmaAlloc + Send + 'static,
    {
        let nsze = c.namespace().nsze * c.lba_bytes() as u64;
        let max_cmd = c.max_transfer_bytes();
        let cfg = NvmeConfig {
            data_mode: mode,
            ..Default::default()
        };
        let ns = NvmeNamespace::new(c, dma, &cfg).expect("namespace");
        let mut engine = NvmeEngine::new(vec![ns], cfg).expect("engine");
        const BUF: usize = 16 << 10;
        let mut mem = AlignedBuf::zeroed(8 * BUF + 1024 * 1024);
        let table = P2pTable::for_buffers(mem.as_mut_ptr() as u64, BUF as u32, 8).unwrap();
        let mut table = table;
        let big = table
            .add_extra_region(mem.as_mut_ptr() as u64 + 8 * BUF as u64, 1 << 20, 1)
            .unwrap();
        engine.register_memory(Arc::new(table)).expect("register");
        let data = pattern(3 * BUF, offset ^ 0x51);
        for (i, b) in [5usize, 1, 3].iter().enumerate() {
            mem.as_mut_slice()[b * BUF..(b + 1) * BUF]
                .copy_from_slice(&data[i * BUF..(i + 1) * BUF]);
        }
        let w = run_iocb(
            &mut engine,
            &[(ioctx(IOCTX_OP_WRITE, offset, 3 * BUF as u32), vec![5, 1, 3])],
        );
        assert_eq!(w, vec![(0, 3 * BUF as u32)], "gathered write");
        // Read back as two IOCTXs in one IOCB, into other buffers.
        let r = run_iocb(
            &mut engine,
            &[
                (ioctx(IOCTX_OP_READ, offset, 2 * BUF as u32), vec![0, 6]),
                (
                    ioctx(IOCTX_OP_READ, offset + 2 * BUF as u64, BUF as u32),
                    vec![2],
                ),
            ],
        );
        assert_eq!(r, vec![(0, 2 * BUF as u32), (0, BUF as u32)]);
        let got: Vec<u8> = [0usize, 6, 2]
            .iter()
            .flat_map(|b| mem.as_slice()[b * BUF..(b + 1) * BUF].to_vec())
            .collect();
        assert_same(&got, &data, "scattered read through the engine");

        // 1 MiB through one IOCTX: split at MDTS when MDTS is smaller.
        let big_data = pattern(1 << 20, offset ^ 0xb16);
        mem.as_mut_slice()[8 * BUF..].copy_from_slice(&big_data);
        let before = engine.stats().commands;
        let r = run_iocb(
            &mut engine,
            &[(
                ioctx(IOCTX_OP_WRITE, offset + (1 << 20), 1 << 20),
                vec![big],
            )],
        );
        assert_eq!(r, vec![(0, 1 << 20)]);
        let cmds = engine.stats().commands - before;
        assert_eq!(
            cmds,
            (1u64 << 20).div_ceil(max_cmd),
            "commands for 1 MiB at max transfer {max_cmd}"
        );
        mem.as_mut_slice()[8 * BUF..].fill(0);
        let r = run_iocb(
            &mut engine,
            &[(ioctx(IOCTX_OP_READ, offset + (1 << 20), 1 << 20), vec![big])],
        );
        assert_eq!(r, vec![(0, 1 << 20)]);
        assert_same(&mem.as_slice()[8 * BUF..], &big_data, "1 MiB split read");

        // Errors: LBA out of range (NVMe status 0x0080, DNR dropped) and a
        // malformed IOCTX, in the same IOCB as a good read.
        let r = run_iocb(
            &mut engine,
            &[
                (ioctx(IOCTX_OP_READ, nsze, BUF as u32), vec![0]),
                (ioctx(IOCTX_OP_READ, offset, BUF as u32 - 512), vec![0]),
                (ioctx(IOCTX_OP_READ, offset, BUF as u32), vec![7]),
            ],
        );
        assert_eq!(
            r[0],
            (0x0080, 0),
            "LBA out of range surfaces as its NVMe status"
        );
        assert_eq!(r[1], (IOCTX_STATUS_INVALID, 0));
        assert_eq!(r[2], (0, BUF as u32));
        assert_eq!(engine.stats().errors, 2);
        assert_eq!(engine.in_flight(), 0);
        drop(engine);
        drop(mem);
    }

    /// The tier storing and loading a llama3-8b-shaped cache (32 layers, 8 KV
    /// heads x 128, bf16, 16-token blocks: 32 KiB objects, 2 MiB blocks)
    /// through the nvme engine, the pool living directly on the namespace;
    /// then the pool reopened from the namespace, checked clean, and loaded
    /// again. Returns a summary line (bytes, commands, CPU ns per command).
    pub fn tier_llama3_8b<B, A>(c: Controller<B>, dma: A, mode: DataMode) -> String
    where
        B: Bar0 + Send + Sync + 'static,
        A: DmaAlloc + Send + 'static,
    {
        let geo = kvtier::model::preset("llama3-8b", 16).unwrap();
        let cfg = NvmeConfig {
            data_mode: mode,
            ..Default::default()
        };
        let ns = NvmeNamespace::new(c, dma, &cfg).expect("namespace");
        let pcfg = PoolConfig {
            geometry: geo,
            model: "llama3-8b".into(),
            namespace: "suite/llama3-8b".into(),
            group_blocks: 8,
            devices: Vec::new(),
            force: true,
        };
        let pool = Pool::create_on(&pcfg, vec![ns.storage()]).expect("pool on the namespace");
        let engine = NvmeEngine::new(vec![ns.clone()], cfg.clone()).expect("engine");
        let mut tier =
            Tier::with_engine(pool, TierConfig::default(), Box::new(engine)).expect("tier");
        assert_eq!(tier.engine().name(), "nvme");
        const N: u64 = 20; // 2.5 extent groups
        let cache = Arc::new(HostKvCache::new(geo, 24, HostLayout::PerLayer).unwrap());
        tier.register_host_cache(cache.clone()).unwrap();
        let seed = |k: u64| k.wrapping_mul(0x2545_F491_4F6C_DD1D) ^ 0xA5A5;
        let keys: Vec<Key> = (0..N).map(|k| Key::from_u64(9000 + k)).collect();
        let mem: Vec<u32> = (0..N as u32).map(|i| (i * 5 + 1) % 24).collect();
        for (i, &b) in mem.iter().enumerate() {
            cache.fill_block(b, seed(i as u64));
        }
        let t = Instant::now();
        let job = tier.submit_store(&keys, &mem).unwrap();
        let r = tier.wait(job).unwrap();
        assert!(r.all_ok(), "store: {:?}", r.failures().collect::<Vec<_>>());
        let store_s = t.elapsed().as_secs_f64();
        cache.clear();
        let target: Vec<u32> = (0..N as u32).map(|i| 23 - i).collect();
        let job = tier.submit_load(&keys, &target, 0..geo.layers).unwrap();
        for layer in 0..geo.layers {
            tier.wait_layer(job, layer).unwrap();
            for (i, &b) in target.iter().enumerate() {
                assert!(
                    cache.block_matches(b, seed(i as u64), layer..layer + 1),
                    "layer {layer} of block {i} after wait_layer"
                );
            }
        }
        assert!(tier.wait(job).unwrap().all_ok());
        drop(tier);

        let expect = OpenExpect {
            geometry: Some(geo),
            namespace: Some("suite/llama3-8b".into()),
        };
        let pool = Pool::open_on(vec![ns.storage()], &expect).expect("reopen from the namespace");
        assert_eq!(pool.index().live(), N);
        let report = pool.check(|_, _| {}).unwrap();
        assert!(report.is_clean(), "{report:?}");
        assert_eq!(report.blocks_ok, N);
        let engine = NvmeEngine::new(vec![ns.clone()], cfg).expect("engine");
        let mut tier =
            Tier::with_engine(pool, TierConfig::default(), Box::new(engine)).expect("tier");
        let cache = Arc::new(HostKvCache::new(geo, 24, HostLayout::CrossLayer).unwrap());
        tier.register_host_cache(cache.clone()).unwrap();
        assert_eq!(tier.lookup_prefix(&keys), N as usize);
        // Timed: the load alone, verified after.
        let before = tier.usage().engine;
        let t = Instant::now();
        let job = tier.submit_load(&keys, &mem, 0..geo.layers).unwrap();
        assert!(tier.wait(job).unwrap().all_ok());
        let load_s = t.elapsed().as_secs_f64();
        let after = tier.usage().engine;
        let cmds = after.commands - before.commands;
        let ns_per_cmd = (after.cpu_ns - before.cpu_ns) as f64 / cmds.max(1) as f64;
        let doorbells = after.doorbells - before.doorbells;
        let bytes = N * geo.block_bytes();
        for (i, &b) in mem.iter().enumerate() {
            assert!(
                cache.block_matches(b, seed(i as u64), 0..geo.layers),
                "block {i} after reopen"
            );
        }
        format!(
            "{} MiB llama3-8b KV: store {:.0} MiB/s, load {:.0} MiB/s, {} commands and {} doorbells per load, {:.0} ns host CPU per command ({})",
            bytes >> 20,
            bytes as f64 / store_s / (1 << 20) as f64,
            bytes as f64 / load_s / (1 << 20) as f64,
            cmds,
            doorbells,
            ns_per_cmd,
            tier.engine().describe()
        )
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

// ------------------------------------------------------ the nvme engine --

use kvtier::engine::nvme::{NvmeConfig, NvmeEngine, NvmeNamespace};
use kvtier::engine::IoEngine;
use kvtier::nvme::sim::SimDma;

/// A simulated controller brought up the way the nvme engine needs it: two
/// I/O queue pairs (data path and the pool's metadata).
fn sim_for_engine(cfg: SimConfig) -> (SimController, Controller<SimController>, SimDma) {
    let sim = SimController::new(cfg);
    let mut dma = sim.dma();
    let c = Controller::bring_up(
        sim.clone(),
        &mut dma,
        ControllerOptions {
            name: "sim".into(),
            io_queues: 2,
            ..Default::default()
        },
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
    use kvtier::p2p::P2pTable;
    use kvtier::pool::backing::AlignedBuf;
    use kvtier::ring::abi::{IOCTX_OP_READ, IOCTX_STATUS_TIMEOUT};
    use kvtier::ring::GioRing;
    use std::time::{Duration, Instant};

    let (sim, c, dma) = sim_for_engine(SimConfig::default());
    let cfg = NvmeConfig {
        io_timeout: Duration::from_millis(100),
        ..Default::default()
    };
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

/// The nvme engine and the tier through it against the controller running
/// asynchronously (doorbells through the page, a polling thread): the
/// engine's batching and completion polling against a concurrent writer.
#[test]
fn tier_llama3_8b_with_doorbells_through_the_page() {
    let sim = SimController::new(SimConfig {
        lbas: 128 << 11,
        ..Default::default()
    });
    let page = sim.doorbell_page().expect("doorbell page");
    let mut dma = sim.dma();
    let c = Controller::bring_up(
        page,
        &mut dma,
        ControllerOptions {
            name: "sim-page".into(),
            io_queues: 2,
            ..Default::default()
        },
    )
    .expect("bring-up through the doorbell page");
    let line = suite::tier_llama3_8b(c, dma, DataMode::Auto);
    eprintln!("{line}");
    assert!(line.contains("40 MiB llama3-8b KV"), "{line}");
}
