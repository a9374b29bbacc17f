//! GPU tests of the CUDA driver layer (`src/gpu/`).
//!
//! On a GPU machine (CUDA 13.0+ driver; Hopper for the green-context test):
//!
//! ```text
//! KVTIER_REQUIRE_GPU=1 cargo test --release --test gpu -- --include-ignored --nocapture
//! ```
//!
//! Built on a machine without an NVIDIA driver (no `/dev/nvidiactl`, and
//! `KVTIER_GPU_TESTS` unset) every test is ignored with that reason, so the
//! runner lists them as not run; `--include-ignored` runs them (binaries built
//! here and carried to a GPU machine). A test that runs and finds no usable
//! GPU or no kernels prints `SKIPPED (<reason>)`; with `KVTIER_REQUIRE_GPU=1`
//! that is a failure, so a GPU run cannot pass by silently skipping.

use kvtier::gpu::dma::{self, GpuDmaPath, HostBouncePath, PAGE};
use kvtier::gpu::{
    probe, register_kv_memory, CompletionCounter, Context, Device, DeviceBuffer, HostRegistration,
    KernelArgs, LaunchConfig, PinnedHostBuffer, RegisterFlags, SmPartition, WaitCond,
};
use kvtier::nvme::ctrl::{DmaAlloc, DmaRegion};
use std::any::Any;
use std::collections::BTreeSet;
use std::sync::Arc;
use std::time::Duration;

/// Two kernels: `fill(out, value, n)` writes `out[i] = value + i`;
/// `smid(out)` writes each block's SM id to `out[blockIdx.x]` after a short
/// spin, so blocks spread over every SM the context may use.
const PTX: &str = r#"
.version 7.8
.target sm_75
.address_size 64

.visible .entry fill(
    .param .u64 out,
    .param .u32 value,
    .param .u32 n
)
{
    .reg .pred %p;
    .reg .b32 %r<6>;
    .reg .b64 %rd<4>;
    ld.param.u64 %rd1, [out];
    ld.param.u32 %r1, [value];
    ld.param.u32 %r2, [n];
    mov.u32 %r3, %ctaid.x;
    mov.u32 %r4, %ntid.x;
    mov.u32 %r5, %tid.x;
    mad.lo.u32 %r3, %r3, %r4, %r5;
    setp.ge.u32 %p, %r3, %r2;
    @%p bra DONE;
    add.u32 %r4, %r1, %r3;
    cvta.to.global.u64 %rd1, %rd1;
    mul.wide.u32 %rd2, %r3, 4;
    add.u64 %rd3, %rd1, %rd2;
    st.global.u32 [%rd3], %r4;
DONE:
    ret;
}

.visible .entry smid(
    .param .u64 out
)
{
    .reg .pred %p;
    .reg .b32 %r<4>;
    .reg .b64 %rd<6>;
    ld.param.u64 %rd1, [out];
    mov.u64 %rd4, %clock64;
SPIN:
    mov.u64 %rd5, %clock64;
    sub.u64 %rd5, %rd5, %rd4;
    setp.lt.u64 %p, %rd5, 200000;
    @%p bra SPIN;
    mov.u32 %r1, %smid;
    mov.u32 %r2, %ctaid.x;
    cvta.to.global.u64 %rd1, %rd1;
    mul.wide.u32 %rd2, %r2, 4;
    add.u64 %rd3, %rd1, %rd2;
    st.global.u32 [%rd3], %r1;
    ret;
}
"#;

/// Device 0, or `None` after printing why the test is skipped (a failure
/// under `KVTIER_REQUIRE_GPU=1`).
fn gpu(test: &str) -> Option<Device> {
    let reason = match probe() {
        Err(e) => e.to_string(),
        Ok(info) if info.devices.is_empty() => "the CUDA driver sees no device".into(),
        Ok(_) => return Some(Device::get(0).expect("device 0")),
    };
    skip(test, &format!("no GPU: {reason}"));
    None
}

/// Device 0 when this build carries the CUDA kernels, or `None` after
/// saying why the test is skipped.
fn gpu_with_kernels(test: &str) -> Option<Device> {
    let dev = gpu(test)?;
    if !kvtier::gpu::kernels::built_with_kernels() {
        skip(test, "kvtier was built without CUDA kernels (no nvcc)");
        return None;
    }
    Some(dev)
}

fn skip(test: &str, why: &str) {
    if std::env::var("KVTIER_REQUIRE_GPU").is_ok_and(|v| v == "1") {
        panic!("{test}: KVTIER_REQUIRE_GPU=1 but the test would be skipped: {why}");
    }
    eprintln!("{test}: SKIPPED ({why})");
}

fn words(bytes: &[u8]) -> Vec<u32> {
    bytes
        .chunks_exact(4)
        .map(|c| u32::from_ne_bytes(c.try_into().unwrap()))
        .collect()
}

#[test]
#[cfg_attr(
    not(kvtier_gpu_tests),
    ignore = "needs an NVIDIA GPU (none at build time): run with --include-ignored on one"
)]
fn probe_describes_each_device() {
    let Some(_) = gpu("probe_describes_each_device") else {
        return;
    };
    let info = probe().unwrap();
    eprintln!("{info:#?}");
    assert!(info.version >= 13000, "driver {}", info.version);
    for d in &info.devices {
        assert!(!d.name.is_empty());
        assert!(d.sm_count > 0);
        assert!(d.compute_capability.0 >= 5);
        assert!(d.total_memory > 0);
        assert!(d.stream_mem_ops);
        if d.compute_capability.0 >= 9 {
            assert!(d.green_contexts, "{}", d.green_note);
        }
    }
}

#[test]
#[cfg_attr(
    not(kvtier_gpu_tests),
    ignore = "needs an NVIDIA GPU (none at build time): run with --include-ignored on one"
)]
fn module_launch_copy_and_event_timing() {
    let Some(dev) = gpu("module_launch_copy_and_event_timing") else {
        return;
    };
    let ctx = Context::primary(&dev).unwrap();
    let module = ctx.load_module(PTX.as_bytes()).unwrap();
    let fill = module.function("fill").unwrap();
    assert!(module.function("no_such_kernel").is_err());
    let n = 10_000u32;
    let out = DeviceBuffer::zeroed(&ctx, n as usize * 4).unwrap();
    let stream = ctx.stream().unwrap();
    let (t0, t1) = (ctx.event().unwrap(), ctx.event().unwrap());
    t0.record(&stream).unwrap();
    let mut args = KernelArgs::new().arg(out.device_ptr()).arg(100u32).arg(n);
    // SAFETY: fill(u64 out, u32 value, u32 n); `out` holds n u32s and lives
    // past the synchronize below.
    unsafe {
        stream
            .launch(&fill, LaunchConfig::linear(n.div_ceil(256), 256), &mut args)
            .unwrap()
    };
    t1.record(&stream).unwrap();
    stream.synchronize().unwrap();
    let ms = t0.elapsed_ms(&t1).unwrap();
    assert!((0.0..1000.0).contains(&ms), "{ms} ms");
    let v = words(&out.to_vec().unwrap());
    assert_eq!(v.len(), n as usize);
    assert!(v.iter().enumerate().all(|(i, &x)| x == 100 + i as u32));

    // A kernel of one context cannot be launched on another context's stream.
    let Ok(part) = SmPartition::split(&dev, 8) else {
        return;
    };
    let other = part.io.stream().unwrap();
    // SAFETY: the launch is refused before it reaches the driver.
    let e = unsafe { other.launch(&fill, LaunchConfig::linear(1, 1), &mut args) }.unwrap_err();
    assert!(e.to_string().contains("another context"), "{e}");
}

#[test]
#[cfg_attr(
    not(kvtier_gpu_tests),
    ignore = "needs an NVIDIA GPU (none at build time): run with --include-ignored on one"
)]
fn green_split_runs_each_partition_on_its_own_sms() {
    let Some(dev) = gpu("green_split_runs_each_partition_on_its_own_sms") else {
        return;
    };
    if dev.compute_capability().unwrap().0 < 9 {
        skip(
            "green_split_runs_each_partition_on_its_own_sms",
            "GPU older than Hopper",
        );
        return;
    }
    let total = dev.sm_count().unwrap();
    // Not a multiple of 8: refused with the valid sizes named.
    let e = SmPartition::split(&dev, 12).unwrap_err().to_string();
    assert!(e.contains("multiple of"), "{e}");

    let part = SmPartition::split(&dev, 16).unwrap();
    eprintln!(
        "{:?} io {} compute {}",
        part.plan,
        part.io.sm_count(),
        part.compute.sm_count()
    );
    assert_eq!(part.io.sm_count(), 16);
    assert_eq!(part.io.sm_count() + part.compute.sm_count(), total);
    let mut seen = Vec::new();
    for (name, g) in [("io", &part.io), ("compute", &part.compute)] {
        let m = g.load_module(PTX.as_bytes()).unwrap();
        let f = m.function("smid").unwrap();
        let blocks = 4 * total;
        let out = DeviceBuffer::zeroed(g, blocks as usize * 4).unwrap();
        let s = g.stream().unwrap();
        let mut args = KernelArgs::new().arg(out.device_ptr());
        // SAFETY: smid(u64 out); out holds one u32 per block; synchronized below.
        unsafe {
            s.launch(&f, LaunchConfig::linear(blocks, 32), &mut args)
                .unwrap()
        };
        s.synchronize().unwrap();
        let sms: BTreeSet<u32> = words(&out.to_vec().unwrap()).into_iter().collect();
        eprintln!("{name}: {} distinct SMs of {}", sms.len(), g.sm_count());
        assert!(
            sms.len() as u32 <= g.sm_count(),
            "{name} ran on {} SMs, partition has {}",
            sms.len(),
            g.sm_count()
        );
        seen.push(sms);
    }
    assert!(
        seen[0].is_disjoint(&seen[1]),
        "I/O and compute partitions share SMs: {:?}",
        seen[0].intersection(&seen[1]).collect::<Vec<_>>()
    );
    // Drop order: partition (green contexts) after its modules, streams and
    // buffers, which went out of scope above; then the partition itself.
    drop(part);
}

#[test]
#[cfg_attr(
    not(kvtier_gpu_tests),
    ignore = "needs an NVIDIA GPU (none at build time): run with --include-ignored on one"
)]
fn stream_waits_on_a_counter_until_the_host_writes_it() {
    let Some(dev) = gpu("stream_waits_on_a_counter_until_the_host_writes_it") else {
        return;
    };
    let ctx = Context::primary(&dev).unwrap();
    let iocb_done = CompletionCounter::host_mapped(&ctx).unwrap();
    let layer_ready = CompletionCounter::host_mapped(&ctx).unwrap();
    let s = ctx.stream().unwrap();
    // Compute stream: wait for 3 IOCBs, then signal "layer ready".
    s.wait_counter(&iocb_done, 3, WaitCond::Geq).unwrap();
    s.write_counter(&layer_ready, 7).unwrap();
    std::thread::sleep(Duration::from_millis(200));
    assert_eq!(
        layer_ready.load().unwrap(),
        0,
        "the stream ran past the wait"
    );
    assert!(!s.is_idle().unwrap());
    iocb_done.store(2).unwrap();
    std::thread::sleep(Duration::from_millis(100));
    assert_eq!(layer_ready.load().unwrap(), 0, "2 < 3 must still block");
    iocb_done.store(3).unwrap();
    s.synchronize().unwrap();
    assert_eq!(layer_ready.load().unwrap(), 7);

    // A device-memory counter written by another stream (the I/O kernel's role).
    let dev_counter = CompletionCounter::device(&ctx).unwrap();
    let io = ctx.stream().unwrap();
    s.wait_counter(&dev_counter, 1, WaitCond::Eq).unwrap();
    s.write_counter(&layer_ready, 8).unwrap();
    io.write_counter(&dev_counter, 1).unwrap();
    s.synchronize().unwrap();
    assert_eq!(layer_ready.load().unwrap(), 8);
    assert_eq!(dev_counter.load().unwrap(), 1);
}

fn anon_pages(n: usize) -> *mut u8 {
    // SAFETY: a fresh private anonymous mapping.
    let p = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            n * PAGE,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_POPULATE,
            -1,
            0,
        )
    };
    assert_ne!(p, libc::MAP_FAILED);
    p.cast()
}

#[test]
#[cfg_attr(
    not(kvtier_gpu_tests),
    ignore = "needs an NVIDIA GPU (none at build time): run with --include-ignored on one"
)]
fn iomemory_register_of_a_normal_page_and_devicemap_register() {
    let Some(dev) = gpu("iomemory_register_of_a_normal_page_and_devicemap_register") else {
        return;
    };
    let ctx = Context::primary(&dev).unwrap();
    let page = anon_pages(1);
    // IOMEMORY is for PCI BARs; on a normal page the driver either refuses
    // (an Error::Gpu carrying the CUresult) or maps it anyway. Both are
    // documented outcomes; what must hold is one or the other, cleanly.
    // SAFETY: the page stays mapped until the munmap at the end.
    match unsafe { HostRegistration::register(&ctx, page, PAGE, RegisterFlags::IoMemory) } {
        Err(e) => {
            eprintln!("IOMEMORY on a normal page refused: {e}");
            assert!(e.cuda_code().is_some(), "{e}");
            assert!(e.to_string().contains("cuMemHostRegister"), "{e}");
        }
        Ok(r) => {
            eprintln!(
                "IOMEMORY on a normal page accepted at {:#x}",
                r.device_ptr()
            );
            assert_ne!(r.device_ptr(), 0);
        }
    }
    // DEVICEMAP: a GPU store into the page is seen by the host.
    {
        // SAFETY: as above.
        let r = unsafe { HostRegistration::register(&ctx, page, PAGE, RegisterFlags::DeviceMap) }
            .unwrap();
        let buf = DeviceBuffer::alloc(&ctx, 64).unwrap();
        buf.write(0, &[0x5a; 64]).unwrap();
        let s = ctx.stream().unwrap();
        // SAFETY: both ranges valid until the synchronize below.
        unsafe {
            s.memcpy_async(r.device_ptr() + 128, buf.device_ptr(), 64)
                .unwrap()
        };
        s.synchronize().unwrap();
        // SAFETY: the page is mapped and the copy has completed.
        let got = unsafe { std::slice::from_raw_parts(page.add(128), 64) }.to_vec();
        assert_eq!(got, vec![0x5a; 64]);
    }
    // SAFETY: unregistered above (drop), nothing uses it.
    unsafe { libc::munmap(page.cast(), PAGE) };
}

/// A fake IOMMU for the bounce path: page-aligned pinned CUDA memory is not
/// needed, plain mmap'd pages with IOVAs from 4 GiB.
struct FakeVfio {
    next: u64,
}

struct Pages(*mut u8, usize);
// SAFETY: owns the mapping.
unsafe impl Send for Pages {}
// SAFETY: as above.
unsafe impl Sync for Pages {}
impl Drop for Pages {
    fn drop(&mut self) {
        // SAFETY: the mapping made in `alloc`.
        unsafe { libc::munmap(self.0.cast(), self.1) };
    }
}

impl DmaAlloc for FakeVfio {
    fn alloc(&mut self, bytes: usize, align: usize) -> kvtier::Result<DmaRegion> {
        let n = bytes.div_ceil(PAGE);
        let p = anon_pages(n);
        let iova = self.next.next_multiple_of(align as u64);
        self.next = iova + (n * PAGE) as u64;
        let owner: Arc<dyn Any + Send + Sync> = Arc::new(Pages(p, n * PAGE));
        // SAFETY: p valid for n pages while `owner` lives.
        Ok(unsafe { DmaRegion::new(p, iova, bytes, owner) })
    }
}

#[test]
#[cfg_attr(
    not(kvtier_gpu_tests),
    ignore = "needs an NVIDIA GPU (none at build time): run with --include-ignored on one"
)]
fn host_bounce_region_is_gpu_addressable_and_copies_to_hbm() {
    let Some(dev) = gpu("host_bounce_region_is_gpu_addressable_and_copies_to_hbm") else {
        return;
    };
    let ctx = Context::primary(&dev).unwrap();
    let mut path = HostBouncePath::new(FakeVfio { next: 1 << 32 }, Some(ctx.clone()));
    let r = path.alloc(3 * PAGE + 1, PAGE).unwrap();
    assert_eq!(r.len(), 4 * PAGE);
    assert_eq!(r.bus_addr(), 1 << 32);
    assert!(r.device_ptr().is_some());
    // "The controller" writes the bounce buffer; the GPU copies it to HBM.
    let data: Vec<u8> = (0..r.len()).map(|i| (i * 7) as u8).collect();
    r.host().unwrap().write(0, &data);
    let hbm = DeviceBuffer::zeroed(&ctx, r.len()).unwrap();
    let s = ctx.stream().unwrap();
    // SAFETY: `hbm` and `r` live past the synchronize.
    unsafe { r.copy_to_device(&s, 0, hbm.device_ptr(), r.len()).unwrap() };
    s.synchronize().unwrap();
    assert_eq!(hbm.to_vec().unwrap(), data);
    // A second region does not share a page with the first (double
    // registration of a page would fail).
    let r2 = path.alloc(100, 64).unwrap();
    assert!(r2.device_ptr().is_some());
}

#[test]
#[cfg_attr(
    not(kvtier_gpu_tests),
    ignore = "needs an NVIDIA GPU (none at build time): run with --include-ignored on one"
)]
fn dma_buf_export_matches_the_device_attribute() {
    let Some(dev) = gpu("dma_buf_export_matches_the_device_attribute") else {
        return;
    };
    let supported = probe().unwrap().devices[0].dma_buf;
    let ctx = Context::primary(&dev).unwrap();
    let buf = DeviceBuffer::alloc(&ctx, 2 << 20).unwrap();
    match dma::export_dma_buf(&buf, 2 << 20) {
        Ok(fd) => {
            use std::os::fd::AsRawFd;
            assert!(supported, "export worked though DMA_BUF_SUPPORTED is 0");
            assert!(fd.as_raw_fd() >= 0);
            eprintln!("dma-buf fd {}", fd.as_raw_fd());
        }
        Err(e) => {
            eprintln!("dma-buf export refused: {e}");
            assert!(!supported, "DMA_BUF_SUPPORTED but export failed: {e}");
        }
    }
    // The full path explains what is missing either way.
    let e = dma::DmaBufPath::new(ctx.clone())
        .alloc(PAGE, PAGE)
        .err()
        .unwrap()
        .to_string();
    assert!(e.contains("dma-buf"), "{e}");
}

#[test]
#[cfg_attr(
    not(kvtier_gpu_tests),
    ignore = "needs an NVIDIA GPU (none at build time): run with --include-ignored on one"
)]
fn host_kv_memory_registers_and_translates() {
    let Some(dev) = gpu("host_kv_memory_registers_and_translates") else {
        return;
    };
    let ctx = Context::primary(&dev).unwrap();
    let g = kvtier::model::preset("llama3-8b", 16).unwrap();
    let cache = kvtier::HostKvCache::new(g, 4, kvtier::HostLayout::PerLayer).unwrap();
    // SAFETY: `cache` outlives `reg` (dropped first at the end of scope).
    let reg = unsafe { register_kv_memory(&ctx, cache.memory()) }.unwrap();
    assert_eq!(reg.regions().len(), g.layers as usize);
    let obj = g.object_bytes() as usize;
    let pattern: Vec<u8> = (0..obj).map(|i| (i % 251) as u8).collect();
    cache.write_object(2, 5, 1, &pattern);
    let addr = cache.memory().object_addr(2, 5, 1);
    let src = reg.device_addr(addr).unwrap();
    let hbm = DeviceBuffer::zeroed(&ctx, obj).unwrap();
    let s = ctx.stream().unwrap();
    // SAFETY: the object is inside registered memory; hbm holds `obj` bytes;
    // synchronized below.
    unsafe { s.memcpy_async(hbm.device_ptr(), src, obj).unwrap() };
    s.synchronize().unwrap();
    assert_eq!(hbm.to_vec().unwrap(), pattern);
    drop(reg);
    // Pinned memory allocation works alongside.
    let p = PinnedHostBuffer::alloc(&ctx, 4096).unwrap();
    assert_ne!(p.device_ptr(), 0);
}

#[path = "nvme_suite/mod.rs"]
mod suite;

/// The GPU engine end to end on a GPU: the real I/O kernel, resident on the
/// I/O green context's SMs (Hopper; the primary context elsewhere), drives
/// the simulated controller (a test double held to the QEMU suite) through
/// its doorbell page, mapped into the GPU: the tier stores and loads a
/// llama3-8b-shaped cache, reopens the pool from the namespace and loads it
/// again, byte for byte.
#[test]
#[cfg_attr(
    not(kvtier_gpu_tests),
    ignore = "needs an NVIDIA GPU (none at build time): run with --include-ignored on one"
)]
fn gpu_engine_drives_the_simulated_controller() {
    use kvtier::engine::gpu::{CudaGioExecutor, GpuEngine, GpuEngineConfig};
    use kvtier::nvme::sim::SimConfig;
    const NAME: &str = "gpu_engine_drives_the_simulated_controller";
    let Some(dev) = gpu_with_kernels(NAME) else {
        return;
    };
    let part = if dev.compute_capability().unwrap().0 >= 9 {
        Some(SmPartition::split(&dev, 8).expect("8 SMs for I/O"))
    } else {
        None
    };
    let ctx = match &part {
        Some(p) => p.io.context().clone(),
        None => Context::primary(&dev).unwrap(),
    };
    let (_sim, ns) = suite::sim_namespace(
        SimConfig {
            lbas: 128 << 11,
            ..Default::default()
        },
        1,
    );
    let line = suite::tier_llama3_8b_on(ns, &|ns| {
        let exec = CudaGioExecutor::new(ctx.clone()).expect("I/O kernel module");
        Box::new(
            GpuEngine::new(vec![ns.clone()], Box::new(exec), GpuEngineConfig::default())
                .expect("GPU engine"),
        )
    });
    eprintln!("{NAME}: {line}");
    assert!(line.contains("gpu (cuda executor)"), "{line}");
    drop(part);
}

/// The GPU engine stops its I/O kernel once nothing is in flight, so a
/// serving engine in the same process can free memory while kvtier is idle:
/// measured on an H100, cuMemFree waits for any resident kernel to exit,
/// in every context of the device. A kept-resident kernel (idle_exit None)
/// must hold such a call; a stopped one must not.
#[test]
#[cfg_attr(
    not(kvtier_gpu_tests),
    ignore = "needs an NVIDIA GPU (none at build time): run with --include-ignored on one"
)]
fn idle_gpu_engine_does_not_hold_cumemfree() {
    use kvtier::engine::gpu::{CudaGioExecutor, GpuEngine, GpuEngineConfig};
    use kvtier::host::dio::AlignedBuf;
    use kvtier::nvme::sim::SimConfig;
    use kvtier::p2p::P2pTable;
    use kvtier::ring::abi::IOCTX_OP_WRITE;
    const NAME: &str = "idle_gpu_engine_does_not_hold_cumemfree";
    let Some(dev) = gpu_with_kernels(NAME) else {
        return;
    };
    let primary = Context::primary(&dev).unwrap();
    // Frees a 1 MiB device buffer of the primary context on another thread;
    // true when it returned within 3 s.
    let free_returns = |ctx: &Context| {
        let buf = DeviceBuffer::alloc(ctx, 1 << 20).unwrap();
        let (tx, rx) = std::sync::mpsc::channel();
        let h = std::thread::spawn(move || {
            drop(buf);
            let _ = tx.send(());
        });
        let quick = rx.recv_timeout(Duration::from_secs(3)).is_ok();
        (quick, h)
    };
    for idle_exit in [Some(Duration::ZERO), None] {
        let (_sim, ns) = suite::sim_namespace(SimConfig::default(), 1);
        let exec = CudaGioExecutor::new(primary.clone()).expect("I/O kernel module");
        let mut engine = GpuEngine::new(
            vec![ns.clone()],
            Box::new(exec),
            GpuEngineConfig::default().with_idle_exit(idle_exit),
        )
        .expect("GPU engine");
        let mut ring = kvtier::ring::GioRing::new(4).unwrap();
        let mut mem = AlignedBuf::zeroed(4 * 16384);
        let table = P2pTable::for_buffers(mem.as_mut_ptr() as u64, 16384, 4).unwrap();
        kvtier::engine::IoEngine::register_memory(&mut engine, Arc::new(table)).unwrap();
        let r = suite::run_iocb(
            &mut engine,
            &mut ring,
            &[(suite::ioctx(IOCTX_OP_WRITE, 1 << 20, 16384), vec![0])],
        );
        assert_eq!(r, vec![(0, 16384)]);
        let (quick, h) = free_returns(&primary);
        if idle_exit.is_some() {
            assert!(!engine.kernel_resident(), "stopped once idle");
            assert!(
                quick,
                "cuMemFree waited although the I/O kernel was stopped"
            );
            h.join().unwrap();
        } else {
            assert!(engine.kernel_resident());
            eprintln!("{NAME}: resident kernel held cuMemFree: {}", !quick);
            drop(engine); // stops the kernel: the free goes through
            h.join().unwrap();
        }
    }
}

/// The staged HBM path's copies on a GPU: objects scattered from pinned
/// staging into permuted blocks of HBM land byte for byte; gathered back
/// into staging with crc32c computed on the GPU, the bytes and every
/// checksum equal the CPU's (the crc32c crate). Aligned KV objects and odd
/// sizes (the byte path, and a length that leaves a remainder). The same
/// checks run against the host double in src/gpu/staging.rs.
#[test]
#[cfg_attr(
    not(kvtier_gpu_tests),
    ignore = "needs an NVIDIA GPU (none at build time): run with --include-ignored on one"
)]
fn staging_scatter_and_gather_crc32c_match_the_cpu() {
    use kvtier::gpu::staging::{CopyDesc, CudaCopier, DeviceCopier};
    const NAME: &str = "staging_scatter_and_gather_crc32c_match_the_cpu";
    let Some(dev) = gpu_with_kernels(NAME) else {
        return;
    };
    let ctx = Context::primary(&dev).unwrap();
    let sizes = [32768usize, 4096, 4096 + 13, 100, 1, 65536 + 4000];
    let slot = 128 * 1024usize;
    let n = 64usize;
    let staging = PinnedHostBuffer::alloc(&ctx, n * slot).unwrap();
    let back = PinnedHostBuffer::alloc(&ctx, n * slot).unwrap();
    let hbm = DeviceBuffer::zeroed(&ctx, n * slot).unwrap();
    let mut x = 0x1234_5678_9abc_def0u64;
    let data: Vec<u8> = (0..n * slot)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect();
    staging.write(0, &data).unwrap();
    let len = |i: usize| sizes[i % sizes.len()];
    let block = |i: usize| (i * 37 + 11) % n; // a permutation of 0..64
    let down: Vec<CopyDesc> = (0..n)
        .map(|i| CopyDesc {
            src: staging.device_ptr() + (i * slot) as u64,
            dst: hbm.device_ptr() + (block(i) * slot) as u64,
            len: len(i) as u32,
            reserved: 0,
        })
        .collect();
    let mut c = CudaCopier::new(&ctx, n).unwrap();
    c.scatter(&down).unwrap();
    assert!(c.finish().unwrap().is_empty());
    let got = hbm.to_vec().unwrap();
    for i in 0..n {
        let (s, d) = (i * slot, block(i) * slot);
        assert_eq!(got[d..d + len(i)], data[s..s + len(i)], "object {i} in HBM");
    }
    let up: Vec<CopyDesc> = down
        .iter()
        .map(|d| CopyDesc {
            src: d.dst,
            dst: back.device_ptr() + (d.src - staging.device_ptr()),
            ..*d
        })
        .collect();
    c.gather_crc32c(&up).unwrap();
    let crcs = c.finish().unwrap();
    assert_eq!(crcs.len(), n);
    let mut round = vec![0u8; n * slot];
    back.read(0, &mut round).unwrap();
    for i in 0..n {
        let s = i * slot;
        assert_eq!(round[s..s + len(i)], data[s..s + len(i)], "object {i} back");
        assert_eq!(
            crcs[i],
            crc32c::crc32c(&data[s..s + len(i)]),
            "crc of object {i} ({} bytes)",
            len(i)
        );
    }
    // More copies than the copier was made for: refused, nothing launched.
    let too_many = vec![down[0]; n + 1];
    assert!(c.scatter(&too_many).is_err());
}
