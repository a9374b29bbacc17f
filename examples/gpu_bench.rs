//! GPU measurements that need a real GPU and no NVMe controller:
//!
//! - `rate`: the I/O kernel's command rate on an SM partition of its own
//!   against a GPU-resident null controller (`kernels/null_nvme.cu`, a test
//!   double that completes every command at once and moves no data): 1-8
//!   queues, 4 KiB / 128 KiB / 512 KiB commands, SGL or PRP. Every command's
//!   completion is checked (status, bytes) and the controller's own count
//!   must equal the host's.
//! - `isolation`: a compute kernel's time alone, beside the resident I/O
//!   kernel idle and busy on its own partition, and with no partition (all
//!   on the primary context, sharing SMs).
//!
//! Run on a GPU machine (`cargo build --release --examples`, take
//! `target/release/examples/gpu_bench` along): `gpu_bench rate`,
//! `gpu_bench isolation`. Each prints `FIG` lines; exit 1 on a wrong result.

use std::time::{Duration, Instant};

use kvtier::gpu::abi::{
    GioDev, GioEngine, GioQueue, GioRing as KernelRing, GIO_BLOCK_THREADS, GIO_MODE_PERSISTENT,
};
use kvtier::gpu::{
    kernels, Context, Device, DeviceBuffer, Function, HostRegistration, KernelArgs, LaunchConfig,
    Module, PinnedHostBuffer, RegisterFlags, SmPartition, Stream,
};
use kvtier::ring::abi::{IoCtx, Iocb, SglDescriptor, IOCTX_OP_READ, IOCTX_STATUS_OK};
use kvtier::ring::{GioRing, IocbId};

type Res<T> = std::result::Result<T, String>;

fn e<E: std::fmt::Display>(what: &str) -> impl FnOnce(E) -> String + '_ {
    move |err| format!("{what}: {err}")
}

/// Bytes of each P2P extent: one K or V object of a llama3-8b block of 16
/// tokens (16 x 8 heads x 128 x 2 bytes), so a command of `bs` bytes names
/// bs/32 KiB scattered extents, as a coalesced KV restore does.
const OBJECT: usize = 32 * 1024;
/// Queue depth of every kernel queue pair (a window of 256 IOCTXs of up to
/// 2 commands each fits; MAX_BATCH is 1024).
const DEPTH: u16 = 1024;
/// IOCBs in the gio_uring.
const RING: u32 = 16;

fn load(ctx: &Context, image: kernels::KernelImage) -> Res<Module> {
    if ctx.device().compute_capability().map_err(e("cc"))? == (9, 0) {
        ctx.load_module(image.cubin).map_err(e("load cubin"))
    } else {
        let mut ptx = image.ptx.as_bytes().to_vec();
        ptx.push(0);
        ctx.load_module(&ptx).map_err(e("load ptx"))
    }
}

/// Where the I/O kernel and the null controller run.
struct Placement {
    io: Context,
    null: Context,
    /// Name for the output.
    name: String,
}

/// One I/O kernel + null controller set-up: queues in GPU memory, the gio
/// ring, engine descriptor and P2P table in pinned host memory (as the GPU
/// engine lays them out), the IOCB arena registered host memory.
struct Rig {
    queues: u32,
    bs: usize,
    segs_per_cmd: usize,
    ctx_per_iocb: usize,
    state: PinnedHostBuffer,
    ring_off: usize,
    sq_off: usize,
    cq_off: usize,
    queues_k: u64,
    engine_k: u64,
    _qmem: Vec<DeviceBuffer>,
    _p2p: P2pMem,
    p2p_count: u32,
    /// The host's position in the kernel's gio CQ (free-running).
    cq_head: u32,
    host: GioRing,
    _arena: HostRegistration,
    null_stop: PinnedHostBuffer,
    null_stats: PinnedHostBuffer,
    io_stream: Stream,
    null_stream: Stream,
    io_fn: Function,
    null_fn: Function,
    _mods: (Module, Module),
}

/// Where the P2P table lives: pinned host memory (as the GPU engine puts it
/// today) or GPU memory (read-only for the kernel, built once).
enum P2pMem {
    Pinned(PinnedHostBuffer),
    Device(DeviceBuffer),
}

fn take(at: &mut usize, n: usize) -> usize {
    let off = *at;
    *at = (*at + n).next_multiple_of(64);
    off
}

impl Rig {
    fn new(p: &Placement, queues: u32, bs: usize, use_sgl: bool, p2p_in_hbm: bool) -> Res<Rig> {
        let segs_per_cmd = bs.div_ceil(OBJECT).max(1);
        let seg_len = bs / segs_per_cmd;
        let ctx_per_iocb = 2048usize.min(16384 / segs_per_cmd);
        let io_mod = load(&p.io, kernels::gio_kernel().map_err(e("kernel image"))?)?;
        let null_mod = load(&p.null, kernels::null_nvme().map_err(e("kernel image"))?)?;
        let io_fn = io_mod.function("kvtier_gio_kernel").map_err(e("fn"))?;
        let null_fn = null_mod.function("kvtier_null_nvme").map_err(e("fn"))?;

        // Queue memory in GPU memory: SQ, CQ (zeroed), doorbells, descriptors.
        let mut qmem = Vec::new();
        let mut descs = Vec::new();
        for q in 0..queues {
            let d = DEPTH as usize;
            let sq = DeviceBuffer::zeroed(&p.io, d * 64).map_err(e("SQ"))?;
            let cq = DeviceBuffer::zeroed(&p.io, d * 16).map_err(e("CQ"))?;
            let db = DeviceBuffer::zeroed(&p.io, 64).map_err(e("doorbells"))?;
            let desc = DeviceBuffer::zeroed(&p.io, d * 4096).map_err(e("descriptors"))?;
            descs.push(GioQueue {
                sq: sq.device_ptr(),
                cq: cq.device_ptr(),
                sq_doorbell: db.device_ptr(),
                cq_doorbell: db.device_ptr() + 4,
                desc: desc.device_ptr(),
                // The null controller reads no descriptor: any aligned address.
                desc_dma: 0x10_0000_0000 + q as u64 * (d as u64 * 4096),
                timeout_ns: 2_000_000_000,
                desc_bytes: 4096,
                nsid: 1,
                max_transfer: 1 << 20,
                page_bytes: 4096,
                qid: q as u16 + 1,
                depth: DEPTH,
                lba_shift: 9,
                use_sgl: use_sgl as u8,
                phase: 1,
                ..Default::default()
            });
            qmem.extend([sq, cq, db, desc]);
        }
        let devs = [GioDev {
            first_queue: 0,
            queue_count: queues as u16,
            reserved: 0,
        }];

        // P2P table: scattered extents (a gap after each, so none merge).
        let p2p_count = (ctx_per_iocb * segs_per_cmd) as u32;
        let table: Vec<SglDescriptor> = (0..p2p_count as u64)
            .map(|i| {
                SglDescriptor::data_block(0x20_0000_0000 + i * 2 * seg_len as u64, seg_len as u32)
            })
            .collect();
        let p2p = if p2p_in_hbm {
            let b = DeviceBuffer::alloc(&p.io, p2p_count as usize * 16).map_err(e("P2P"))?;
            b.write(0, bytemuck::cast_slice(&table)).map_err(e("P2P"))?;
            P2pMem::Device(b)
        } else {
            let b = PinnedHostBuffer::alloc(&p.io, p2p_count as usize * 16).map_err(e("P2P"))?;
            b.write(0, bytemuck::cast_slice(&table)).map_err(e("P2P"))?;
            P2pMem::Pinned(b)
        };

        let mut at = 0;
        let engine_off = take(&mut at, size_of::<GioEngine>());
        let ring_off = take(&mut at, size_of::<KernelRing>());
        let queues_off = take(&mut at, descs.len() * size_of::<GioQueue>());
        let devs_off = take(&mut at, size_of::<GioDev>());
        let sq_off = take(&mut at, RING as usize * 4);
        let cq_off = take(&mut at, RING as usize * 4);
        let passes_off = take(&mut at, RING as usize * 4);
        let state =
            PinnedHostBuffer::alloc(&p.io, at.next_multiple_of(4096)).map_err(e("state"))?;
        state
            .write(0, &vec![0u8; state.len()])
            .map_err(e("state"))?;
        let sk = state.device_ptr();

        let mut host = GioRing::new(RING).map_err(e("ring"))?;
        let arena_len = RING as usize * size_of::<Iocb>();
        // SAFETY: the arena is the ring's heap allocation, which lives in
        // `host` as long as the registration (both in the Rig; the kernels
        // are stopped before the Rig drops).
        let arena = unsafe {
            HostRegistration::register(
                &p.io,
                host.arena_ptr() as *mut u8,
                arena_len,
                RegisterFlags::DeviceMap,
            )
        }
        .map_err(e("arena"))?;
        let kring = KernelRing {
            iocbs: arena.device_ptr(),
            sq: sk + sq_off as u64,
            cq: sk + cq_off as u64,
            passes: sk + passes_off as u64,
            entries: RING,
            iocb_count: RING,
            ..Default::default()
        };
        let eng = GioEngine {
            queues: sk + queues_off as u64,
            devs: sk + devs_off as u64,
            p2p: match &p2p {
                P2pMem::Device(b) => b.device_ptr(),
                P2pMem::Pinned(b) => b.device_ptr(),
            },
            ring: sk + ring_off as u64,
            p2p_count: p2p_count as u64,
            queue_count: queues,
            dev_count: 1,
        };
        state
            .write(engine_off, bytemuck::bytes_of(&eng))
            .map_err(e("state"))?;
        state
            .write(ring_off, bytemuck::bytes_of(&kring))
            .map_err(e("state"))?;
        state
            .write(queues_off, bytemuck::cast_slice(&descs))
            .map_err(e("state"))?;
        state
            .write(devs_off, bytemuck::cast_slice(&devs))
            .map_err(e("state"))?;

        let null_stop = PinnedHostBuffer::alloc(&p.null, 64).map_err(e("stop"))?;
        null_stop.write(0, &[0u8; 64]).map_err(e("stop"))?;
        let null_stats =
            PinnedHostBuffer::alloc(&p.null, 32 * queues as usize).map_err(e("stats"))?;
        null_stats
            .write(0, &vec![0u8; 32 * queues as usize])
            .map_err(e("stats"))?;
        Ok(Rig {
            queues,
            bs,
            segs_per_cmd,
            ctx_per_iocb,
            ring_off,
            sq_off,
            cq_off,
            queues_k: sk + queues_off as u64,
            engine_k: sk + engine_off as u64,
            state,
            _qmem: qmem,
            _p2p: p2p,
            p2p_count,
            cq_head: 0,
            host,
            _arena: arena,
            null_stop,
            null_stats,
            io_stream: p.io.stream().map_err(e("stream"))?,
            null_stream: p.null.stream().map_err(e("stream"))?,
            io_fn,
            null_fn,
            _mods: (io_mod, null_mod),
        })
    }

    fn ring_u32(&self, field: usize) -> &std::sync::atomic::AtomicU32 {
        self.state
            .atomic_u32(self.ring_off + field)
            .expect("a ring field inside the state buffer")
    }

    /// Starts the null controller, then the persistent I/O kernel.
    fn start(&self) -> Res<()> {
        self.start_parts(true, true)
    }

    fn start_parts(&self, null: bool, io: bool) -> Res<()> {
        let mut a = KernelArgs::new()
            .arg(self.queues_k)
            .arg(self.queues)
            .arg(self.null_stop.device_ptr())
            .arg(self.null_stats.device_ptr());
        // SAFETY: kvtier_null_nvme(queues, count, stop, stats): all four live
        // in the Rig; the kernel is stopped (stop()) before they drop.
        if null {
            unsafe {
                self.null_stream
                    .launch(&self.null_fn, LaunchConfig::linear(self.queues, 32), &mut a)
                    .map_err(e("launch null controller"))?
            };
        }
        if !io {
            return Ok(());
        }
        let mut a = KernelArgs::new()
            .arg(self.engine_k)
            .arg(GIO_MODE_PERSISTENT);
        // SAFETY: kvtier_gio_kernel(engine, mode): the engine and all it
        // names live in the Rig until stop() has joined the kernel.
        unsafe {
            self.io_stream
                .launch(
                    &self.io_fn,
                    LaunchConfig::linear(self.queues, GIO_BLOCK_THREADS),
                    &mut a,
                )
                .map_err(e("launch I/O kernel"))?
        };
        Ok(())
    }

    fn fill(&mut self, first_cmd: u64) -> Res<IocbId> {
        let id = self.host.get_iocb().ok_or("no free IOCB")?;
        let mut segs = vec![0u32; self.segs_per_cmd];
        for k in 0..self.ctx_per_iocb {
            let cmd = first_cmd + k as u64;
            for (s, v) in segs.iter_mut().enumerate() {
                *v = ((k * self.segs_per_cmd + s) as u32) % self.p2p_count;
            }
            let ctx = IoCtx {
                dev_offset: (cmd * self.bs as u64) % (1 << 40),
                len: self.bs as u32,
                dev: 0,
                op: IOCTX_OP_READ,
                ..Default::default()
            };
            self.host.push_ctx(id, ctx, &segs).ok_or("IOCB full")?;
        }
        self.host.submit(id).map_err(e("submit"))?;
        self.host.pop_sq();
        Ok(id)
    }

    fn publish(&self, id: IocbId) {
        use std::sync::atomic::Ordering;
        let tail_f = std::mem::offset_of!(KernelRing, sq_tail);
        let tail = self.ring_u32(tail_f).load(Ordering::Relaxed);
        let slot = self.sq_off + (tail & (RING - 1)) as usize * 4;
        self.state
            .atomic_u32(slot)
            .unwrap()
            .store(id, Ordering::Relaxed);
        self.ring_u32(tail_f)
            .store(tail.wrapping_add(1), Ordering::Release);
    }

    /// Keeps every IOCB in flight for `secs`; returns (commands, seconds).
    fn run(&mut self, secs: f64) -> Res<(u64, f64)> {
        use std::sync::atomic::Ordering;
        let mut issued = 0u64;
        for _ in 0..RING {
            let id = self.fill(issued)?;
            issued += self.ctx_per_iocb as u64;
            self.publish(id);
        }
        let cq_tail_f = std::mem::offset_of!(KernelRing, cq_tail);
        let cq_head_f = std::mem::offset_of!(KernelRing, cq_head);
        let mut head = self.cq_head;
        let mut done = 0u64;
        let mut warm = None;
        let start = Instant::now();
        let mut last = Instant::now();
        loop {
            let tail = self.ring_u32(cq_tail_f).load(Ordering::Acquire);
            if head == tail {
                if last.elapsed() > Duration::from_secs(5) {
                    return Err(format!("no IOCB completed for 5 s ({done} commands done)"));
                }
                std::hint::spin_loop();
                continue;
            }
            last = Instant::now();
            while head != tail {
                let slot = self.cq_off + (head & (RING - 1)) as usize * 4;
                let id = self.state.atomic_u32(slot).unwrap().load(Ordering::Relaxed);
                head = head.wrapping_add(1);
                let iocb = self.host.iocb(id);
                for (i, c) in iocb.ctx[..iocb.hdr.count as usize].iter().enumerate() {
                    if c.status != IOCTX_STATUS_OK || c.result as usize != self.bs {
                        return Err(format!(
                            "IOCB {id} IOCTX {i}: status {:#x} result {} (expected OK, {} bytes)",
                            c.status, c.result, self.bs
                        ));
                    }
                }
                done += iocb.hdr.count as u64;
                self.host.finish(id);
                let id = self.host.pop_cq().ok_or("CQ empty")?;
                self.host.release(id);
                // The first ring's worth warms up; time from then on.
                if warm.is_none() && done >= RING as u64 * self.ctx_per_iocb as u64 {
                    warm = Some((Instant::now(), done));
                }
                if start.elapsed().as_secs_f64() < secs + 0.2 {
                    let id = self.fill(issued)?;
                    issued += self.ctx_per_iocb as u64;
                    self.publish(id);
                }
            }
            self.ring_u32(cq_head_f).store(head, Ordering::Release);
            self.cq_head = head;
            if done == issued {
                break;
            }
        }
        let (t0, d0) = warm.unwrap_or((start, 0));
        Ok((done - d0, last.duration_since(t0).as_secs_f64()))
    }

    /// Stops both kernels; checks the null controller's counts against the
    /// commands the host saw complete.
    fn stop(&mut self, expect_commands: u64) -> Res<()> {
        use std::sync::atomic::Ordering;
        self.ring_u32(std::mem::offset_of!(KernelRing, stop))
            .store(1, Ordering::Release);
        self.io_stream.synchronize().map_err(e("I/O kernel exit"))?;
        self.null_stop
            .atomic_u32(0)
            .unwrap()
            .store(1, Ordering::Release);
        self.null_stream
            .synchronize()
            .map_err(e("null controller exit"))?;
        let mut raw = vec![0u8; 32 * self.queues as usize];
        self.null_stats.read(0, &mut raw).map_err(e("stats"))?;
        let st: &[u64] = bytemuck::cast_slice(&raw);
        let (mut cmds, mut blocks, mut bad) = (0, 0, 0);
        for q in st.chunks(4) {
            cmds += q[0];
            blocks += q[1];
            bad += q[2];
        }
        let timeouts = self.queue_sum(std::mem::offset_of!(GioQueue, timeouts), 4);
        if cmds != expect_commands
            || blocks != cmds * (self.bs as u64 >> 9)
            || bad != 0
            || timeouts != 0
        {
            return Err(format!(
                "null controller saw {cmds} commands / {blocks} blocks / {bad} bad opcodes, I/O kernel {timeouts} timeouts; host completed {expect_commands} commands of {} bytes",
                self.bs
            ));
        }
        Ok(())
    }

    fn queue_sum(&self, field: usize, width: usize) -> u64 {
        let base = self.queues_k - self.state.device_ptr();
        (0..self.queues as usize)
            .map(|q| {
                let off = base as usize + q * size_of::<GioQueue>() + field;
                let mut b = [0u8; 8];
                self.state.read(off, &mut b[..width]).unwrap();
                u64::from_le_bytes(b)
            })
            .sum()
    }
}

fn parse_list(s: &str) -> Vec<usize> {
    s.split(',')
        .filter_map(|t| {
            let t = t.trim().to_ascii_lowercase();
            let (n, m) = match t.strip_suffix('k') {
                Some(n) => (n, 1024),
                None => (t.as_str(), 1),
            };
            n.parse::<usize>().ok().map(|v| v * m)
        })
        .collect()
}

fn arg(args: &[String], name: &str, default: &str) -> String {
    args.iter()
        .position(|a| a == name)
        .and_then(|i| args.get(i + 1).cloned())
        .unwrap_or_else(|| default.to_string())
}

fn placement(dev: &Device, io_sms: u32, null_on: &str) -> Res<(Placement, Option<SmPartition>)> {
    if io_sms == 0 {
        let ctx = Context::primary(dev).map_err(e("primary context"))?;
        return Ok((
            Placement {
                io: ctx.clone(),
                null: ctx,
                name: "no partition (primary context)".into(),
            },
            None,
        ));
    }
    let part = SmPartition::split(dev, io_sms).map_err(e("green split"))?;
    let io: Context = part.io.context().clone();
    let null: Context = match null_on {
        "io" => io.clone(),
        _ => part.compute.context().clone(),
    };
    let name = format!(
        "I/O kernel on {} SMs, null controller on the {} partition ({} SMs)",
        part.io.sm_count(),
        null_on,
        if null_on == "io" {
            part.io.sm_count()
        } else {
            part.compute.sm_count()
        }
    );
    Ok((Placement { io, null, name }, Some(part)))
}

fn rate(args: &[String]) -> Res<()> {
    let dev = Device::get(0).map_err(e("device 0"))?;
    let io_sms: u32 = arg(args, "--io-sms", "8").parse().map_err(e("--io-sms"))?;
    let null_on = arg(args, "--null-on", "compute");
    let secs: f64 = arg(args, "--seconds", "1")
        .parse()
        .map_err(e("--seconds"))?;
    let queues = parse_list(&arg(args, "--queues", "1,2,4,8"));
    let sizes = parse_list(&arg(args, "--bs", "4k,128k,512k"));
    let prp = args.iter().any(|a| a == "--prp");
    // The engine uploads its P2P table to GPU memory; --p2p host measures the
    // table read over PCIe instead.
    let p2p_hbm = arg(args, "--p2p", "hbm") == "hbm";
    let (p, _part) = placement(&dev, io_sms, &null_on)?;
    println!(
        "rate: {}; {} descriptors; P2P table in {}",
        p.name,
        if prp { "PRP" } else { "SGL" },
        if p2p_hbm {
            "GPU memory"
        } else {
            "pinned host memory"
        }
    );
    println!(
        "{:>6} {:>8} {:>6} {:>14} {:>12} {:>10}",
        "queues", "bs", "segs", "commands/s", "GB/s equiv", "commands"
    );
    for &q in &queues {
        for &bs in &sizes {
            let mut rig = Rig::new(&p, q as u32, bs, !prp, p2p_hbm)?;
            rig.start()?;
            let res = rig.run(secs);
            let (cmds, t) = match res {
                Ok(v) => v,
                Err(err) => {
                    let _ = rig.stop(0);
                    return Err(err);
                }
            };
            // The controller counted the warm-up too: compare totals.
            let total = rig.queue_sum(std::mem::offset_of!(GioQueue, commands), 8);
            rig.stop(total)?;
            let rate = cmds as f64 / t;
            println!(
                "{:>6} {:>8} {:>6} {:>14.0} {:>12.1} {:>10}",
                q,
                bs,
                rig.segs_per_cmd,
                rate,
                rate * bs as f64 / 1e9,
                total
            );
            println!(
                "FIG gpu_rate io_sms={io_sms} null_on={null_on} p2p={} queues={q} bs={bs} {} commands_per_s={rate:.0} ns_per_command={:.1}",
                if p2p_hbm { "hbm" } else { "host" },
                if prp { "prp" } else { "sgl" },
                1e9 / rate
            );
        }
    }
    Ok(())
}

/// Median of a kernel's time over `reps` launches (events).
fn time_kernel(
    s: &Stream,
    f: &Function,
    cfg: LaunchConfig,
    args: &dyn Fn() -> KernelArgs,
    reps: usize,
) -> Res<f64> {
    let ctx = s.context();
    let mut v = Vec::new();
    for r in 0..reps + 2 {
        let (a, b) = (
            ctx.event().map_err(e("event"))?,
            ctx.event().map_err(e("event"))?,
        );
        a.record(s).map_err(e("record"))?;
        let mut k = args();
        // SAFETY: the isolation kernels' arguments are device buffers that
        // outlive the synchronize below.
        unsafe { s.launch(f, cfg, &mut k).map_err(e("launch"))? };
        b.record(s).map_err(e("record"))?;
        b.synchronize().map_err(e("sync"))?;
        if r >= 2 {
            v.push(a.elapsed_ms(&b).map_err(e("elapsed"))? as f64);
        }
    }
    v.sort_by(|x, y| x.partial_cmp(y).unwrap());
    Ok(v[v.len() / 2])
}

struct Workloads {
    spin: Function,
    copy: Function,
    out: DeviceBuffer,
    src: DeviceBuffer,
    dst: DeviceBuffer,
    _m: Module,
    sms: u32,
}

impl Workloads {
    fn new(ctx: &Context, sms: u32) -> Res<Workloads> {
        let m = load(ctx, kernels::null_nvme().map_err(e("image"))?)?;
        let bytes = 1usize << 30;
        Ok(Workloads {
            spin: m.function("kvtier_spin_compute").map_err(e("fn"))?,
            copy: m.function("kvtier_stream_copy").map_err(e("fn"))?,
            out: DeviceBuffer::zeroed(ctx, 132 * 8 * 256 * 4).map_err(e("out"))?,
            src: DeviceBuffer::zeroed(ctx, bytes).map_err(e("src"))?,
            dst: DeviceBuffer::zeroed(ctx, bytes).map_err(e("dst"))?,
            _m: m,
            sms,
        })
    }

    /// (FMA-bound ms, copy ms): a fixed amount of work, whatever the SMs.
    fn measure(&self, s: &Stream, reps: usize) -> Res<(f64, f64)> {
        let out = self.out.device_ptr();
        let spin = time_kernel(
            s,
            &self.spin,
            LaunchConfig::linear(132 * 8, 256),
            &|| KernelArgs::new().arg(out).arg(20_000u32),
            reps,
        )?;
        let (src, dst, n) = (
            self.src.device_ptr(),
            self.dst.device_ptr(),
            (self.src.len() / 16) as u64,
        );
        let copy = time_kernel(
            s,
            &self.copy,
            LaunchConfig::linear(self.sms * 8, 256),
            &|| KernelArgs::new().arg(src).arg(dst).arg(n),
            reps,
        )?;
        Ok((spin, copy))
    }
}

fn isolation(args: &[String]) -> Res<()> {
    let dev = Device::get(0).map_err(e("device 0"))?;
    let io_sms: u32 = arg(args, "--io-sms", "8").parse().map_err(e("--io-sms"))?;
    let queues: u32 = arg(args, "--queues", "8").parse().map_err(e("--queues"))?;
    let bs = parse_list(&arg(args, "--bs", "128k"))[0];
    let reps: usize = arg(args, "--reps", "15").parse().map_err(e("--reps"))?;
    let total = dev.sm_count().map_err(e("sm count"))?;
    let mut rows: Vec<(String, f64, f64)> = Vec::new();

    // 1. no partition, nothing else running.
    {
        let ctx = Context::primary(&dev).map_err(e("primary"))?;
        let w = Workloads::new(&ctx, total)?;
        let s = ctx.stream().map_err(e("stream"))?;
        let (a, b) = w.measure(&s, reps)?;
        rows.push((format!("all {total} SMs, alone"), a, b));
    }
    // 2-4. compute partition: alone, I/O kernel resident idle, busy.
    {
        let (p, part) = placement(&dev, io_sms, "io")?;
        let part = part.unwrap();
        let cctx = part.compute.context().clone();
        let w = Workloads::new(&cctx, part.compute.sm_count())?;
        let s = cctx.stream().map_err(e("stream"))?;
        let (a, b) = w.measure(&s, reps)?;
        let n = part.compute.sm_count();
        rows.push((format!("compute partition ({n} SMs), alone"), a, b));
        // Which resident kernel costs what while idle: each alone, then both.
        for (null, io, what) in [
            (true, false, "null controller alone"),
            (false, true, "I/O kernel alone"),
        ] {
            let mut rig = Rig::new(&p, queues, bs, true, true)?;
            rig.start_parts(null, io)?;
            std::thread::sleep(Duration::from_millis(50));
            let (a, b) = w.measure(&s, reps)?;
            rows.push((
                format!("compute partition ({n} SMs), resident idle on {io_sms} SMs: {what}"),
                a,
                b,
            ));
            rig.stop(0)?;
        }
        let mut rig = Rig::new(&p, queues, bs, true, true)?;
        rig.start()?;
        std::thread::sleep(Duration::from_millis(50));
        let (a, b) = w.measure(&s, reps)?;
        rows.push((format!("compute partition ({n} SMs), I/O kernel + null controller resident idle on {io_sms} SMs"), a, b));
        let busy = busy_measure(&mut rig, &w, &s, reps)?;
        rows.push((
            format!(
                "compute partition ({n} SMs), I/O kernel busy on {io_sms} SMs ({} cmd/s)",
                busy.2 as u64
            ),
            busy.0,
            busy.1,
        ));
        let total_cmds = rig.queue_sum(std::mem::offset_of!(GioQueue, commands), 8);
        rig.stop(total_cmds)?;
    }
    // What polling host memory from the I/O partition costs the compute
    // partition, same run: 8 pollers, acquire (a fence per poll) vs relaxed.
    {
        let (p, part) = placement(&dev, io_sms, "io")?;
        let part = part.unwrap();
        let cctx = part.compute.context().clone();
        let w = Workloads::new(&cctx, part.compute.sm_count())?;
        let s = cctx.stream().map_err(e("stream"))?;
        let m = load(&p.io, kernels::null_nvme().map_err(e("image"))?)?;
        let f = m.function("kvtier_poll_probe").map_err(e("fn"))?;
        let flag = PinnedHostBuffer::alloc(&p.io, 64).map_err(e("flag"))?;
        flag.write(0, &[0u8; 64]).map_err(e("flag"))?;
        let ps = p.io.stream().map_err(e("stream"))?;
        for (mode, sleep) in [
            (0u32, 0u32),
            (1, 0),
            (0, 256),
            (1, 256),
            (0, 4096),
            (1, 4096),
        ] {
            flag.atomic_u32(4)
                .unwrap()
                .store(0, std::sync::atomic::Ordering::Release);
            let mut a = KernelArgs::new()
                .arg(flag.device_ptr())
                .arg(mode)
                .arg(sleep)
                .arg(flag.device_ptr() + 4);
            // SAFETY: kvtier_poll_probe(flag, mode, sleep, stop): two u32 of
            // a pinned buffer that outlives the synchronize below.
            unsafe {
                ps.launch(&f, LaunchConfig::linear(8, 32), &mut a)
                    .map_err(e("launch poller"))?
            };
            std::thread::sleep(Duration::from_millis(20));
            let (a, b) = w.measure(&s, reps)?;
            flag.atomic_u32(4)
                .unwrap()
                .store(1, std::sync::atomic::Ordering::Release);
            ps.synchronize().map_err(e("poller exit"))?;
            rows.push((
                format!(
                    "compute partition, 8 pollers of pinned memory on the I/O SMs: {} every {sleep} ns",
                    if mode == 0 { "ld.acquire.sys" } else { "ld.relaxed.sys" }
                ),
                a,
                b,
            ));
        }
    }
    // 5. no partition: I/O kernel busy on the primary context beside compute.
    {
        let (p, _) = placement(&dev, 0, "io")?;
        let w = Workloads::new(&p.io, total)?;
        let s = p.io.stream().map_err(e("stream"))?;
        let mut rig = Rig::new(&p, queues, bs, true, true)?;
        rig.start()?;
        let busy = busy_measure(&mut rig, &w, &s, reps)?;
        rows.push((
            format!(
                "all {total} SMs, no partition, I/O kernel busy ({} cmd/s)",
                busy.2 as u64
            ),
            busy.0,
            busy.1,
        ));
        let total_cmds = rig.queue_sum(std::mem::offset_of!(GioQueue, commands), 8);
        rig.stop(total_cmds)?;
    }
    println!("{:<90} {:>10} {:>10}", "scenario", "FMA ms", "copy ms");
    for (n, a, b) in &rows {
        println!("{n:<90} {a:>10.3} {b:>10.3}");
    }
    let base = &rows[1];
    for (i, (n, a, b)) in rows.iter().enumerate() {
        println!(
            "FIG isolation row={i} fma_ms={a:.3} copy_ms={b:.3} fma_vs_partition_alone={:.3} copy_vs_partition_alone={:.3} ({n})",
            a / base.1,
            b / base.2
        );
    }
    Ok(())
}

/// Measures the workloads while the I/O kernel is kept busy by a host
/// thread; returns (fma ms, copy ms, commands/s during the measurement).
fn busy_measure(rig: &mut Rig, w: &Workloads, s: &Stream, reps: usize) -> Res<(f64, f64, f64)> {
    // The rig's host loop and the timed kernels must overlap: run the I/O
    // feed on this thread in slices between launches would serialise them,
    // so the feed runs on a scoped thread while this one times.
    let stop = std::sync::atomic::AtomicBool::new(false);
    std::thread::scope(|sc| {
        let h = sc.spawn(|| -> Res<(u64, f64)> {
            let mut cmds = 0;
            let mut t = 0.0;
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                let (c, s) = rig.run(0.3)?;
                cmds += c;
                t += s;
            }
            Ok((cmds, t))
        });
        std::thread::sleep(Duration::from_millis(300));
        let r = w.measure(s, reps);
        stop.store(true, std::sync::atomic::Ordering::Relaxed);
        let (c, t) = h.join().map_err(|_| "feed thread panicked".to_string())??;
        let (a, b) = r?;
        Ok((a, b, c as f64 / t.max(1e-9)))
    })
}

/// The staged restore: io_uring O_DIRECT reads into pinned host KV memory
/// (the tier's load path, layer by layer), each layer copied on to HBM as
/// soon as it lands, beside its two ceilings from the same run: the disk
/// read alone (the same load, no copy) and the pinned H2D copy alone (the
/// same per-layer copies, no disk). Every byte that reaches HBM is checked.
fn restore(args: &[String]) -> Res<()> {
    use kvtier::memory::{HostKvCache, HostLayout, KvLayout};
    use kvtier::pool::{DeviceSpec, Key, Pool, PoolConfig};
    use kvtier::tier::{Tier, TierConfig};
    use std::sync::Arc;

    let dir = std::path::PathBuf::from(arg(args, "--dir", "./kvtier-data"));
    let model = arg(args, "--model", "llama3-8b");
    let contexts = parse_list(&arg(args, "--contexts", "4096,16384"));
    let reps: usize = arg(args, "--reps", "3").parse().map_err(e("--reps"))?;
    let geo = kvtier::model::preset(&model, 16).map_err(e("--model"))?;
    let max_tokens = *contexts.iter().max().ok_or("--contexts is empty")? as u64;
    let max_blocks = geo.tokens_to_blocks(max_tokens);
    let pool_bytes = ((max_blocks * geo.block_bytes()) * 5 / 4 + (256 << 20)) & !4095;
    std::fs::create_dir_all(&dir).map_err(e("--dir"))?;
    let path = dir.join("gpu_bench_restore.pool");
    if path.exists() {
        return Err(format!(
            "{} exists; remove it (gpu_bench creates its own pool file and never reuses one)",
            path.display()
        ));
    }
    struct Cleanup(std::path::PathBuf);
    impl Drop for Cleanup {
        fn drop(&mut self) {
            let _ = std::fs::remove_file(&self.0);
        }
    }
    let pool = Pool::create(
        &PoolConfig::new(geo, model.clone(), format!("gpu_bench/{model}"))
            .with_group_blocks(64)
            .with_devices(vec![DeviceSpec {
                path: path.clone(),
                size: Some(pool_bytes),
            }]),
    )
    .map_err(e("pool create"))?;
    let _cleanup = Cleanup(path.clone());
    let mut tier = Tier::open(pool, TierConfig::default()).map_err(e("tier open"))?;
    let cache = Arc::new(
        HostKvCache::new(geo, max_blocks as u32, HostLayout::PerLayer)
            .map_err(e("host KV cache"))?,
    );
    tier.register_host_cache(cache.clone())
        .map_err(e("register"))?;

    let dev = Device::get(0).map_err(e("device 0"))?;
    let ctx = Context::primary(&dev).map_err(e("primary context"))?;
    // Pin the host KV cache for the copies (the uring engine reads into it
    // with O_DIRECT whatever CUDA thinks of it).
    let regs: Vec<HostRegistration> = cache
        .memory()
        .regions()
        .into_iter()
        // SAFETY: the cache's mappings live in `cache` until the end of this
        // function, after the registrations (dropped first, declared later).
        .map(|(a, l)| unsafe {
            HostRegistration::register(&ctx, a as *mut u8, l as usize, RegisterFlags::DeviceMap)
        })
        .collect::<kvtier::Result<_>>()
        .map_err(e("cuMemHostRegister of the KV cache"))?;
    let layer_bases: Vec<u64> = match &cache.memory().layout {
        KvLayout::PerLayer { layer_bases } => layer_bases.clone(),
        _ => return Err("per-layer layout expected".into()),
    };
    let dev_of = |host: u64| -> u64 {
        regs.iter()
            .find(|r| (r.host_ptr() as u64..r.host_ptr() as u64 + r.len() as u64).contains(&host))
            .map(|r| r.device_ptr() + (host - r.host_ptr() as u64))
            .expect("a registered address")
    };
    let obj = geo.object_bytes();
    let copy = ctx.stream().map_err(e("stream"))?;
    println!(
        "restore: {model}, pool file {} on {}, block 16 tokens, per-layer layout, {} layers",
        path.display(),
        dir.display(),
        geo.layers
    );
    println!(
        "{:>8} {:>10} {:>12} {:>12} {:>12} {:>12} {:>8}",
        "tokens", "MiB", "disk GB/s", "H2D GB/s", "staged GB/s", "first ms", "vs min"
    );
    for (ci, &tokens) in contexts.iter().enumerate() {
        let blocks = geo.tokens_to_blocks(tokens as u64);
        let layer_bytes = 2 * blocks * obj;
        let hbm = DeviceBuffer::alloc(&ctx, (layer_bytes * geo.layers as u64) as usize)
            .map_err(e("HBM"))?;
        let key_base = (ci as u64 + 1) << 40;
        let keys: Vec<Key> = (0..blocks).map(|b| Key::from_u64(key_base + b)).collect();
        let mem: Vec<u32> = (0..blocks as u32).collect();
        for b in 0..blocks {
            cache.fill_block(b as u32, key_base + b);
        }
        let mut jobs = Vec::new();
        for (kc, mc) in keys.chunks(256).zip(mem.chunks(256)) {
            jobs.push(tier.submit_store(kc, mc).map_err(e("store"))?);
        }
        for j in jobs {
            let r = tier.wait(j).map_err(e("store"))?;
            if !r.all_ok() {
                return Err("a store failed".into());
            }
        }
        let total = (layer_bytes * geo.layers as u64) as f64;
        let h2d_layer = |l: u32| -> Res<()> {
            // The per-layer layout holds all K objects, then all V objects:
            // the first `blocks` of each are the restored ones.
            let half = blocks * obj;
            for kv in 0..2u64 {
                let src = dev_of(layer_bases[l as usize] + kv * cache.num_blocks() as u64 * obj);
                // SAFETY: a registered host range and the HBM buffer, both
                // alive until the stream is synchronized below.
                unsafe {
                    copy.memcpy_async(
                        hbm.device_ptr() + l as u64 * layer_bytes + kv * half,
                        src,
                        half as usize,
                    )
                    .map_err(e("H2D"))?
                }
            }
            Ok(())
        };
        let (mut disk, mut h2d, mut staged, mut first) = (vec![], vec![], vec![], vec![]);
        for _ in 0..reps {
            // Disk alone.
            cache.clear();
            let t0 = Instant::now();
            let job = tier
                .submit_load(&keys, &mem, 0..geo.layers)
                .map_err(e("load"))?;
            let r = tier.wait(job).map_err(e("load"))?;
            if !r.all_ok() {
                return Err("a load failed".into());
            }
            disk.push(total / t0.elapsed().as_secs_f64() / 1e9);
            // H2D alone.
            let t0 = Instant::now();
            for l in 0..geo.layers {
                h2d_layer(l)?;
            }
            copy.synchronize().map_err(e("sync"))?;
            h2d.push(total / t0.elapsed().as_secs_f64() / 1e9);
            // Staged: each layer's copy queued as soon as its reads are done.
            cache.clear();
            hbm.write(0, &vec![0u8; 4096]).map_err(e("clear HBM"))?;
            let t0 = Instant::now();
            let job = tier
                .submit_load(&keys, &mem, 0..geo.layers)
                .map_err(e("load"))?;
            for l in 0..geo.layers {
                tier.wait_layer(job, l).map_err(e("wait_layer"))?;
                h2d_layer(l)?;
                if l == 0 {
                    copy.synchronize().map_err(e("sync"))?;
                    first.push(t0.elapsed().as_secs_f64() * 1e3);
                }
            }
            copy.synchronize().map_err(e("sync"))?;
            staged.push(total / t0.elapsed().as_secs_f64() / 1e9);
            let r = tier.wait(job).map_err(e("load"))?;
            if !r.all_ok() {
                return Err("a staged load failed".into());
            }
            tier.layer_events();
        }
        // Every byte in HBM equals what was stored.
        let got = hbm.to_vec().map_err(e("D2H"))?;
        let mut want = vec![0u8; obj as usize];
        for l in 0..geo.layers {
            for b in 0..blocks as u32 {
                for kv in 0..2u32 {
                    kvtier::memory::pattern_fill(&mut want, key_base + b as u64, l, kv);
                    let off =
                        (l as u64 * layer_bytes + (kv as u64 * blocks + b as u64) * obj) as usize;
                    if got[off..off + obj as usize] != want[..] {
                        return Err(format!(
                            "HBM bytes of block {b} layer {l} kv {kv} differ from what was stored"
                        ));
                    }
                }
            }
        }
        let med = |v: &mut Vec<f64>| {
            v.sort_by(|a, b| a.partial_cmp(b).unwrap());
            v[v.len() / 2]
        };
        let (d, h, s, f) = (
            med(&mut disk),
            med(&mut h2d),
            med(&mut staged),
            med(&mut first),
        );
        println!(
            "{:>8} {:>10.0} {:>12.2} {:>12.2} {:>12.2} {:>12.2} {:>8.2}",
            tokens,
            total / 1048576.0,
            d,
            h,
            s,
            f,
            s / d.min(h)
        );
        println!("FIG restore tokens={tokens} disk_gbs={d:.2} h2d_gbs={h:.2} staged_gbs={s:.2} staged_vs_min={:.3} first_layer_ms={f:.2} verified=yes", s / d.min(h));
    }
    drop(regs);
    Ok(())
}

/// Which host CUDA calls wait for a resident kernel: the I/O kernel stays
/// resident (idle) on its partition while each call runs on another thread,
/// in the primary context (where a serving engine's torch lives) and in the
/// compute partition's context. A call still running after 2 s is reported
/// as blocked; stopping the I/O kernel then lets it finish.
fn blocking(args: &[String]) -> Res<()> {
    let dev = Device::get(0).map_err(e("device 0"))?;
    let io_sms: u32 = arg(args, "--io-sms", "8").parse().map_err(e("--io-sms"))?;
    let (p, part) = placement(&dev, io_sms, "io")?;
    let part = part.ok_or("--io-sms 0: nothing to measure")?;
    let primary = Context::primary(&dev).map_err(e("primary"))?;
    let compute = part.compute.context().clone();
    // Pre-made objects to free while the kernel is resident.
    let mut rig = Rig::new(&p, 1, 4096, true, true)?;
    type Op = Box<dyn FnOnce() -> Res<()> + Send>;
    let mut ops: Vec<(String, Op)> = Vec::new();
    for (cname, ctx) in [("primary", primary.clone()), ("compute", compute.clone())] {
        let c = ctx.clone();
        ops.push((
            format!("{cname}: cuMemAlloc 1 MiB"),
            Box::new(move || {
                DeviceBuffer::alloc(&c, 1 << 20)
                    .map(std::mem::forget)
                    .map_err(e("alloc"))
            }),
        ));
        let b = DeviceBuffer::alloc(&ctx, 1 << 20).map_err(e("alloc"))?;
        ops.push((
            format!("{cname}: cuMemFree 1 MiB"),
            Box::new(move || {
                drop(b);
                Ok(())
            }),
        ));
        let c = ctx.clone();
        ops.push((
            format!("{cname}: cuMemAllocHost 1 MiB"),
            Box::new(move || {
                PinnedHostBuffer::alloc(&c, 1 << 20)
                    .map(std::mem::forget)
                    .map_err(e("alloc host"))
            }),
        ));
        let h = PinnedHostBuffer::alloc(&ctx, 1 << 20).map_err(e("alloc host"))?;
        ops.push((
            format!("{cname}: cuMemFreeHost 1 MiB"),
            Box::new(move || {
                drop(h);
                Ok(())
            }),
        ));
        let c = ctx.clone();
        ops.push((
            format!("{cname}: load module + first launch"),
            Box::new(move || {
                let m = load(&c, kernels::abi_check().map_err(e("image"))?)?;
                let _ = m;
                let w = load(&c, kernels::null_nvme().map_err(e("image"))?)?;
                let f = w.function("kvtier_spin_compute").map_err(e("fn"))?;
                let out = DeviceBuffer::zeroed(&c, 4096).map_err(e("out"))?;
                let s = c.stream().map_err(e("stream"))?;
                let mut a = KernelArgs::new().arg(out.device_ptr()).arg(10u32);
                // SAFETY: kvtier_spin_compute(out, iters): 32 floats in a 4 KiB buffer, synchronized below.
                unsafe {
                    s.launch(&f, LaunchConfig::linear(1, 32), &mut a)
                        .map_err(e("launch"))?
                };
                s.synchronize().map_err(e("sync"))?;
                std::mem::forget((out, w, s));
                Ok(())
            }),
        ));
    }
    drop(rig.stop(0));
    // Each call in a resident period of its own: one blocked call can hold
    // the driver's lock for the next.
    for (name, op) in ops {
        let mut rig = Rig::new(&p, 1, 4096, true, true)?;
        rig.start_parts(false, true)?;
        std::thread::sleep(Duration::from_millis(50));
        let (tx, rx) = std::sync::mpsc::channel();
        let t0 = Instant::now();
        let h = std::thread::spawn(move || {
            let r = op();
            let _ = tx.send(r);
        });
        let blocked = match rx.recv_timeout(Duration::from_millis(1500)) {
            Ok(r) => {
                r?;
                println!(
                    "FIG while_resident {name}: {:.2} ms",
                    t0.elapsed().as_secs_f64() * 1e3
                );
                None
            }
            Err(_) => Some(rx),
        };
        rig.stop(0)?;
        if let Some(rx) = blocked {
            match rx.recv_timeout(Duration::from_secs(5)) {
                Ok(r) => {
                    r?;
                    println!(
                        "FIG while_resident {name}: BLOCKED until the I/O kernel exited ({:.0} ms)",
                        t0.elapsed().as_secs_f64() * 1e3
                    );
                }
                Err(_) => println!(
                    "FIG while_resident {name}: still blocked 5 s after the I/O kernel exited"
                ),
            }
        }
        let _ = h.join();
    }
    drop(part);
    Ok(())
}

/// The staged HBM path's copies for one llama3-8b layer: scatter of the
/// layer's objects from pinned staging into permuted HBM blocks (one
/// launch) beside one contiguous pinned H2D copy of the same bytes (the
/// ceiling) and one cuMemcpyAsync per object; gather with crc32c on the GPU
/// beside the same gather without checksums (the crc's cost). Median of
/// `--reps`; bytes and checksums checked once.
fn staging(args: &[String]) -> Res<()> {
    use kvtier::gpu::staging::{CopyDesc, CudaCopier, DeviceCopier};
    let tokens: usize = arg(args, "--tokens", "4096")
        .parse()
        .map_err(e("--tokens"))?;
    let reps: usize = arg(args, "--reps", "21").parse().map_err(e("--reps"))?;
    let obj = 32 * 1024usize; // llama3-8b, 16-token blocks
    let n = tokens.div_ceil(16) * 2; // K and V of each block: one layer
    let bytes = n * obj;
    let dev = Device::get(0).map_err(e("device 0"))?;
    let ctx = Context::primary(&dev).map_err(e("primary"))?;
    let staging = PinnedHostBuffer::alloc(&ctx, bytes).map_err(e("staging"))?;
    let back = PinnedHostBuffer::alloc(&ctx, bytes).map_err(e("staging"))?;
    // The KV cache: 4x the layer's blocks, the layer's objects at permuted places.
    let hbm = DeviceBuffer::zeroed(&ctx, 4 * bytes).map_err(e("HBM"))?;
    let mut x = 0x9E37_79B9_7F4A_7C15u64;
    let data: Vec<u8> = (0..bytes / 8)
        .flat_map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x.to_le_bytes()
        })
        .collect();
    staging.write(0, &data).map_err(e("staging"))?;
    let place = |i: usize| (i * 2654435761usize) % (4 * n);
    let down: Vec<CopyDesc> = (0..n)
        .map(|i| CopyDesc {
            src: staging.device_ptr() + (i * obj) as u64,
            dst: hbm.device_ptr() + (place(i) * obj) as u64,
            len: obj as u32,
            reserved: 0,
        })
        .collect();
    let up: Vec<CopyDesc> = (0..n)
        .map(|i| CopyDesc {
            src: down[i].dst,
            dst: back.device_ptr() + (i * obj) as u64,
            len: obj as u32,
            reserved: 0,
        })
        .collect();
    let mut c = CudaCopier::new(&ctx, n).map_err(e("copier"))?;
    let s = c.stream();
    let timed = |f: &mut dyn FnMut() -> Res<()>, s: &Stream| -> Res<f64> {
        let mut v = Vec::new();
        for r in 0..reps + 2 {
            s.synchronize().map_err(e("sync"))?;
            let t0 = Instant::now();
            f()?;
            s.synchronize().map_err(e("sync"))?;
            if r >= 2 {
                v.push(t0.elapsed().as_secs_f64());
            }
        }
        v.sort_by(|a, b| a.partial_cmp(b).unwrap());
        Ok(v[v.len() / 2])
    };
    let copy_stream = ctx.stream().map_err(e("stream"))?;
    let h2d = timed(
        &mut || unsafe {
            // SAFETY: pinned staging and the HBM buffer outlive the sync.
            copy_stream
                .memcpy_async(hbm.device_ptr(), staging.device_ptr(), bytes)
                .map_err(e("H2D"))
        },
        &copy_stream,
    )?;
    let per_object = timed(
        &mut || {
            for d in &down {
                // SAFETY: as above.
                unsafe {
                    copy_stream
                        .memcpy_async(d.dst, d.src, d.len as usize)
                        .map_err(e("H2D"))?
                };
            }
            Ok(())
        },
        &copy_stream,
    )?;
    let _ = s;
    let scatter = {
        let mut v = Vec::new();
        for r in 0..reps + 2 {
            let t0 = Instant::now();
            c.scatter(&down).map_err(e("scatter"))?;
            c.finish().map_err(e("scatter"))?;
            if r >= 2 {
                v.push(t0.elapsed().as_secs_f64());
            }
        }
        v.sort_by(|a, b| a.partial_cmp(b).unwrap());
        v[v.len() / 2]
    };
    let got = hbm.to_vec().map_err(e("D2H"))?;
    for i in 0..n {
        let d = place(i) * obj;
        if got[d..d + obj] != data[i * obj..(i + 1) * obj] {
            return Err(format!("scatter: object {i} differs in HBM"));
        }
    }
    let (mut gather_plain, mut gather_crc) = (Vec::new(), Vec::new());
    let mut crcs = Vec::new();
    for r in 0..reps + 2 {
        let t0 = Instant::now();
        c.scatter(&up).map_err(e("gather"))?;
        c.finish().map_err(e("gather"))?;
        let plain = t0.elapsed().as_secs_f64();
        let t0 = Instant::now();
        c.gather_crc32c(&up).map_err(e("gather"))?;
        crcs = c.finish().map_err(e("gather"))?;
        let with = t0.elapsed().as_secs_f64();
        if r >= 2 {
            gather_plain.push(plain);
            gather_crc.push(with);
        }
    }
    let mut back_bytes = vec![0u8; bytes];
    back.read(0, &mut back_bytes).map_err(e("read back"))?;
    if back_bytes != data {
        return Err("gather: bytes back in staging differ".into());
    }
    for (i, crc) in crcs.iter().enumerate() {
        if *crc != crc32c::crc32c(&data[i * obj..(i + 1) * obj]) {
            return Err(format!(
                "gather: crc32c of object {i} differs from the CPU's"
            ));
        }
    }
    let med = |v: &mut Vec<f64>| {
        v.sort_by(|a, b| a.partial_cmp(b).unwrap());
        v[v.len() / 2]
    };
    let (gp, gc) = (med(&mut gather_plain), med(&mut gather_crc));
    let gbs = |t: f64| bytes as f64 / t / 1e9;
    println!("staging: one llama3-8b layer at {tokens} tokens: {n} objects of 32 KiB ({} MiB), median of {reps}", bytes >> 20);
    println!("  H2D one contiguous copy (ceiling) {:8.1} GB/s", gbs(h2d));
    println!(
        "  H2D one cuMemcpyAsync per object  {:8.1} GB/s",
        gbs(per_object)
    );
    println!(
        "  scatter kernel, permuted blocks   {:8.1} GB/s ({:.2}x the ceiling)",
        gbs(scatter),
        h2d / scatter
    );
    println!("  gather (D2H) kernel               {:8.1} GB/s", gbs(gp));
    println!(
        "  gather + crc32c on the GPU        {:8.1} GB/s (crc costs {:+.1}%)",
        gbs(gc),
        (gc / gp - 1.0) * 100.0
    );
    println!(
        "FIG staging tokens={tokens} h2d_gbs={:.1} per_object_gbs={:.1} scatter_gbs={:.1} scatter_vs_h2d={:.3} gather_gbs={:.1} gather_crc_gbs={:.1} crc_cost_pct={:.1} verified=yes",
        gbs(h2d),
        gbs(per_object),
        gbs(scatter),
        h2d / scatter,
        gbs(gp),
        gbs(gc),
        (gc / gp - 1.0) * 100.0
    );
    Ok(())
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let r = match args.get(1).map(String::as_str) {
        Some("rate") => rate(&args[2..]),
        Some("isolation") => isolation(&args[2..]),
        Some("restore") => restore(&args[2..]),
        Some("blocking") => blocking(&args[2..]),
        Some("staging") => staging(&args[2..]),
        _ => Err("usage: gpu_bench rate [--io-sms 8] [--null-on compute|io] [--queues 1,2,4,8] [--bs 4k,128k,512k] [--seconds 1] [--prp] [--p2p hbm|host]\n       gpu_bench isolation [--io-sms 8] [--queues 8] [--bs 128k] [--reps 15]\n       gpu_bench restore [--dir ./kvtier-data] [--model llama3-8b] [--contexts 4096,16384] [--reps 3]\n       gpu_bench blocking [--io-sms 8]\n       gpu_bench staging [--tokens 4096] [--reps 21]".into()),
    };
    if let Err(msg) = r {
        eprintln!("gpu_bench: {msg}");
        std::process::exit(1);
    }
}
