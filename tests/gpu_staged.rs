//! The staged HBM path on a GPU: KV memory in device memory, the staging
//! kernels doing the copies, the same checks tests/staged.rs runs against
//! the CPU double (tests/common/staged.rs), plus a compute stream that
//! waits for each layer on the GPU with no host call in between.
//!
//! ```text
//! KVTIER_REQUIRE_GPU=1 cargo test --release --test gpu_staged -- --include-ignored --nocapture
//! ```
//!
//! Built on a machine without an NVIDIA driver (no `/dev/nvidiactl`, and
//! `KVTIER_GPU_TESTS` unset) every test is ignored with that reason, so the
//! runner lists them as not run; `--include-ignored` runs them (binaries built
//! here and carried to a GPU machine). A test that runs and finds no usable
//! GPU or no kernels prints `SKIPPED (<reason>)`; with `KVTIER_REQUIRE_GPU=1`
//! that is a failure, so a GPU run cannot pass by silently skipping.

mod common;
// The service helpers this file uses (the rest serve tests/service_staged.rs).
#[allow(dead_code)]
#[path = "common/service.rs"]
mod service;
#[path = "common/staged.rs"]
mod staged;

use kvtier::gpu::{probe, Context, Device, DeviceBuffer, PinnedHostBuffer};
use kvtier::memory::pattern_fill;
use kvtier::staged::{LayerWait, StagedTier, StagingConfig};
use kvtier::tier::Tier;
use kvtier::{HostLayout, KvGeometry, KvLayout, KvMemory, MemoryKind, TierBuilder};
use staged::*;

fn skip(test: &str, why: &str) {
    if std::env::var("KVTIER_REQUIRE_GPU").is_ok_and(|v| v == "1") {
        panic!("{test}: KVTIER_REQUIRE_GPU=1 but the test would be skipped: {why}");
    }
    eprintln!("{test}: SKIPPED ({why})");
}

/// The primary context of device 0 with the kernels built, or `None` after
/// saying why the test is skipped.
fn gpu(test: &str) -> Option<Context> {
    let why = match probe() {
        Err(e) => format!("no GPU: {e}"),
        Ok(i) if i.devices.is_empty() => "no GPU: the CUDA driver sees no device".into(),
        Ok(_) if !kvtier::gpu::kernels::built_with_kernels() => {
            "kvtier was built without CUDA kernels (no nvcc)".into()
        }
        Ok(_) => return Some(Context::primary(&Device::get(0).unwrap()).unwrap()),
    };
    skip(test, &why);
    None
}

/// KV memory in HBM, in vLLM's per-layer or cross-layer layout.
struct GpuRig {
    ctx: Context,
    buffers: Vec<DeviceBuffer>,
    memory: KvMemory,
}

impl GpuRig {
    fn new(ctx: &Context, layout: HostLayout) -> GpuRig {
        let g = common::tiny_geometry();
        let n = 48u32;
        let per_layer = 2 * n as usize * g.object_bytes() as usize;
        let (buffers, kv) = match layout {
            HostLayout::PerLayer => {
                let b: Vec<_> = (0..g.layers)
                    .map(|_| DeviceBuffer::zeroed(ctx, per_layer).unwrap())
                    .collect();
                let bases = b.iter().map(DeviceBuffer::device_ptr).collect();
                (b, KvLayout::PerLayer { layer_bases: bases })
            }
            HostLayout::CrossLayer => {
                let b = DeviceBuffer::zeroed(ctx, per_layer * g.layers as usize).unwrap();
                let base = b.device_ptr();
                (vec![b], KvLayout::CrossLayer { base })
            }
        };
        GpuRig {
            ctx: ctx.clone(),
            buffers,
            memory: KvMemory {
                geometry: g,
                num_blocks: n,
                layout: kv,
                kind: MemoryKind::Gpu {
                    ordinal: ctx.device().ordinal() as u32,
                },
            },
        }
    }

    /// Per-layer tensors shaped (num_blocks, 2, ...): the block-major layout.
    fn block_major(ctx: &Context) -> GpuRig {
        let mut r = GpuRig::new(ctx, HostLayout::PerLayer);
        let KvLayout::PerLayer { layer_bases } = r.memory.layout.clone() else {
            unreachable!("made per-layer")
        };
        r.memory.layout = KvLayout::BlockMajor { layer_bases };
        r
    }

    fn at(&self, block: u32, layer: u32, kv: u32) -> (&DeviceBuffer, usize) {
        let a = self.memory.object_addr(block, layer, kv);
        let b = self
            .buffers
            .iter()
            .find(|b| b.device_ptr() <= a && a < b.device_ptr() + b.len() as u64)
            .unwrap();
        (b, (a - b.device_ptr()) as usize)
    }
}

impl KvRig for GpuRig {
    fn geometry(&self) -> KvGeometry {
        self.memory.geometry
    }
    fn num_blocks(&self) -> u32 {
        self.memory.num_blocks
    }
    fn write_object(&self, block: u32, layer: u32, kv: u32, data: &[u8]) {
        let (b, off) = self.at(block, layer, kv);
        b.write(off, data).unwrap();
    }
    fn read_object(&self, block: u32, layer: u32, kv: u32) -> Vec<u8> {
        let (b, off) = self.at(block, layer, kv);
        let mut v = vec![0; self.geometry().object_bytes() as usize];
        b.read(off, &mut v).unwrap();
        v
    }
    fn clear(&self) {
        for b in &self.buffers {
            b.write(0, &vec![0u8; b.len()]).unwrap();
        }
    }
    fn staged(&self, tier: Tier, cfg: StagingConfig) -> StagedTier {
        // SAFETY: the rig's buffers outlive every staged tier of a test.
        unsafe { StagedTier::on_gpu(tier, &self.ctx, self.memory.clone(), cfg).unwrap() }
    }
}

#[test]
#[cfg_attr(
    not(kvtier_gpu_tests),
    ignore = "needs an NVIDIA GPU (none at build time): run with --include-ignored on one"
)]
fn gpu_round_trip_both_layouts() {
    let Some(ctx) = gpu("gpu_round_trip_both_layouts") else {
        return;
    };
    for l in LAYOUTS {
        round_trip(&GpuRig::new(&ctx, l), &format!("gpu-staged-rt-{l:?}"));
    }
}

#[test]
#[cfg_attr(
    not(kvtier_gpu_tests),
    ignore = "needs an NVIDIA GPU (none at build time): run with --include-ignored on one"
)]
fn gpu_round_trip_block_major() {
    let Some(ctx) = gpu("gpu_round_trip_block_major") else {
        return;
    };
    round_trip(&GpuRig::block_major(&ctx), "gpu-staged-rt-block-major");
}

#[test]
#[cfg_attr(
    not(kvtier_gpu_tests),
    ignore = "needs an NVIDIA GPU (none at build time): run with --include-ignored on one"
)]
fn gpu_round_robin_and_back_pressure() {
    let Some(ctx) = gpu("gpu_round_robin_and_back_pressure") else {
        return;
    };
    for l in LAYOUTS {
        round_robin_and_back_pressure(&GpuRig::new(&ctx, l), &format!("gpu-staged-rr-{l:?}"));
    }
}

#[test]
#[cfg_attr(
    not(kvtier_gpu_tests),
    ignore = "needs an NVIDIA GPU (none at build time): run with --include-ignored on one"
)]
fn gpu_large_load_goes_in_chunks() {
    let Some(ctx) = gpu("gpu_large_load_goes_in_chunks") else {
        return;
    };
    for l in LAYOUTS {
        large_load_goes_in_chunks(&GpuRig::new(&ctx, l), &format!("gpu-staged-chunked-{l:?}"));
    }
}

#[test]
#[cfg_attr(
    not(kvtier_gpu_tests),
    ignore = "needs an NVIDIA GPU (none at build time): run with --include-ignored on one"
)]
fn gpu_store_staging_is_bounded() {
    let Some(ctx) = gpu("gpu_store_staging_is_bounded") else {
        return;
    };
    store_staging_is_bounded(
        &GpuRig::new(&ctx, HostLayout::PerLayer),
        "gpu-staged-bounded",
    );
}

#[test]
#[cfg_attr(
    not(kvtier_gpu_tests),
    ignore = "needs an NVIDIA GPU (none at build time): run with --include-ignored on one"
)]
fn gpu_store_chunks_overlap() {
    let Some(ctx) = gpu("gpu_store_chunks_overlap") else {
        return;
    };
    store_chunks_overlap(
        &GpuRig::new(&ctx, HostLayout::PerLayer),
        "gpu-staged-overlap",
    );
}

#[test]
#[cfg_attr(
    not(kvtier_gpu_tests),
    ignore = "needs an NVIDIA GPU (none at build time): run with --include-ignored on one"
)]
fn gpu_corrupt_block_is_caught() {
    let Some(ctx) = gpu("gpu_corrupt_block_is_caught") else {
        return;
    };
    for l in LAYOUTS {
        corrupt_block_is_caught(&GpuRig::new(&ctx, l), &format!("gpu-staged-corrupt-{l:?}"));
    }
}

/// Two loads in flight, each with a compute stream given (right after the
/// submits, before any layer is copied) one wait per layer on that load's
/// own counter followed by a copy of that layer's objects out of HBM: every
/// snapshot holds the restored bytes, not the cleared memory, so each
/// stream waited for each of its layers on the GPU with no host call in
/// between, whatever the other load did.
#[test]
#[cfg_attr(
    not(kvtier_gpu_tests),
    ignore = "needs an NVIDIA GPU (none at build time): run with --include-ignored on one"
)]
fn gpu_compute_stream_waits_per_layer_without_the_host() {
    const NAME: &str = "gpu_compute_stream_waits_per_layer_without_the_host";
    let Some(ctx) = gpu(NAME) else {
        return;
    };
    for layout in LAYOUTS {
        let rig = GpuRig::new(&ctx, layout);
        let g = rig.geometry();
        let obj = g.object_bytes() as usize;
        let dir = common::TempDir::new(&format!("gpu-staged-wait-{layout:?}"));
        let (mut st, _) = staged_over(&rig, &dir, config(2, 16, 16));
        let ks: Vec<u64> = (900..924).collect();
        let mem: Vec<u32> = (0..24).map(|i| 40 - i).collect();
        store_all(&rig, &mut st, &ks, &mem, 12);
        rig.clear();

        let halves = [(0usize..12, 0u32..g.layers), (12..24, 1..g.layers)];
        let mut runs = Vec::new();
        for (keys_range, layers) in halves.clone() {
            let job = st
                .submit_load(
                    &keys(&ks[keys_range.clone()]),
                    &mem[keys_range.clone()],
                    layers.clone(),
                )
                .unwrap();
            let c = st
                .load_counter(job)
                .expect("a GPU load has its own counter");
            let compute = ctx.stream().unwrap();
            let snap = PinnedHostBuffer::alloc(&ctx, g.layers as usize * 12 * 2 * obj).unwrap();
            let mut wait = LayerWait::new(&ctx);
            for l in layers.clone() {
                wait.queue(&compute, &c.counter, c.value_for(l)).unwrap();
                for (i, p) in keys_range.clone().enumerate() {
                    for kv in 0..2 {
                        let at = ((l as usize * 12 + i) * 2 + kv as usize) * obj;
                        // SAFETY: the snapshot and the rig's HBM outlive the
                        // synchronize below.
                        unsafe {
                            compute
                                .memcpy_async(
                                    snap.device_ptr() + at as u64,
                                    rig.memory.object_addr(mem[p], l, kv),
                                    obj,
                                )
                                .unwrap()
                        };
                    }
                }
            }
            runs.push((job, compute, snap));
        }
        for (job, _, _) in &runs {
            assert!(st.wait(*job).unwrap().all_ok());
        }
        let mut got = vec![0u8; obj];
        let mut want = vec![0u8; obj];
        for ((keys_range, layers), (_, compute, snap)) in halves.into_iter().zip(&runs) {
            compute.synchronize().unwrap();
            for l in layers {
                for (i, p) in keys_range.clone().enumerate() {
                    for kv in 0..2 {
                        let at = ((l as usize * 12 + i) * 2 + kv as usize) * obj;
                        snap.read(at, &mut got).unwrap();
                        pattern_fill(&mut want, common::seed_of(ks[p]), l, kv);
                        assert!(
                            got == want,
                            "{layout:?}: layer {l} of key {} read before its copy",
                            ks[p]
                        );
                    }
                }
            }
        }
    }
}

/// KV memory in GPU memory through the node service (issue 25, item 4):
/// two clients of one service, each with its own HBM; the service shares
/// each client's slice, which the client registers as pinned and uses as
/// the staged path's staging. One stores (the gather kernel takes the
/// checksums, the service writes them), the other loads layer by layer:
/// each layer's copy is queued on the client's copy stream with a GPU event
/// for a compute stream, and its bytes are the first client's.
/// tests/service_staged.rs runs the same round trip on the CPU double.
#[test]
#[cfg_attr(
    not(kvtier_gpu_tests),
    ignore = "needs an NVIDIA GPU (none at build time): run with --include-ignored on one"
)]
fn gpu_round_trip_through_the_service() {
    let Some(ctx) = gpu("gpu_round_trip_through_the_service") else {
        return;
    };
    for layout in LAYOUTS {
        let dir = common::TempDir::new(&format!("gpu-svc-staged-{layout:?}"));
        let svc = service::Svc::start(&dir, 2, 64);
        let (ra, rb) = (GpuRig::new(&ctx, layout), GpuRig::new(&ctx, layout));
        // SAFETY: the rigs' HBM outlives the clients (dropped before them).
        let open = |r: &GpuRig| {
            unsafe {
                TierBuilder::default()
                    .service(&svc.sock)
                    .memory(r.memory.clone())
            }
            .build()
            .unwrap()
        };
        let (a, b) = (open(&ra), open(&rb));
        service::round_trip_between((&ra, &a), (&rb, &b), 40, 24, true);
        a.close().unwrap();
        b.close().unwrap();
        drop((a, b));
        svc.stop();
    }
}

/// Through the service on a GPU, a compute stream of the loading client
/// waits for each layer on the load's counter (queued right after the
/// submit, no host call in between) and then snapshots the layer: the
/// snapshot holds the restored bytes, not the cleared memory, so the
/// client's own copy of each layer out of the shared staging came first.
#[test]
#[cfg_attr(
    not(kvtier_gpu_tests),
    ignore = "needs an NVIDIA GPU (none at build time): run with --include-ignored on one"
)]
fn gpu_compute_stream_waits_per_layer_through_the_service() {
    const NAME: &str = "gpu_compute_stream_waits_per_layer_through_the_service";
    let Some(ctx) = gpu(NAME) else {
        return;
    };
    use kvtier::TierApi;
    let dir = common::TempDir::new("gpu-svc-staged-wait");
    let svc = service::Svc::start(&dir, 2, 64);
    let (ra, rb) = (
        GpuRig::new(&ctx, HostLayout::PerLayer),
        GpuRig::new(&ctx, HostLayout::PerLayer),
    );
    // SAFETY: the rigs' HBM outlives the clients (dropped before them).
    let open = |r: &GpuRig| {
        unsafe {
            TierBuilder::default()
                .service(&svc.sock)
                .memory(r.memory.clone())
        }
        .build()
        .unwrap()
    };
    let (a, b) = (open(&ra), open(&rb));
    let g = ra.geometry();
    let obj = g.object_bytes() as usize;
    let ks: Vec<u64> = (700..712).collect();
    for (i, &k) in ks.iter().enumerate() {
        fill(&ra, i as u32, common::seed_of(k));
    }
    let s = a
        .submit_store(&keys(&ks), &(0..12).collect::<Vec<_>>())
        .unwrap();
    a.flush_stores().unwrap();
    assert!(TierApi::wait(&a, s).unwrap().all_ok());
    rb.clear();
    assert_eq!(b.lookup_and_pin(&keys(&ks)), 12);
    let mem: Vec<u32> = (0..12).map(|i| 40 - i).collect();
    let job = b.submit_load(&keys(&ks), &mem, 0..g.layers).unwrap();
    let c = TierApi::load_counter(&b, job)
        .unwrap()
        .expect("a GPU load through the service has its own counter");
    let compute = ctx.stream().unwrap();
    let snap = PinnedHostBuffer::alloc(&ctx, g.layers as usize * 12 * 2 * obj).unwrap();
    let mut wait = LayerWait::new(&ctx);
    for l in 0..g.layers {
        wait.queue(&compute, &c.counter, c.value_for(l)).unwrap();
        for (i, &m) in mem.iter().enumerate() {
            for kv in 0..2 {
                let at = ((l as usize * 12 + i) * 2 + kv as usize) * obj;
                // SAFETY: the snapshot and the rig's HBM outlive the
                // synchronize below.
                unsafe {
                    compute
                        .memcpy_async(
                            snap.device_ptr() + at as u64,
                            rb.memory.object_addr(m, l, kv),
                            obj,
                        )
                        .unwrap()
                };
            }
        }
    }
    assert!(TierApi::wait(&b, job).unwrap().all_ok());
    compute.synchronize().unwrap();
    let (mut got, mut want) = (vec![0u8; obj], vec![0u8; obj]);
    for l in 0..g.layers {
        for (i, &k) in ks.iter().enumerate() {
            for kv in 0..2 {
                let at = ((l as usize * 12 + i) * 2 + kv as usize) * obj;
                snap.read(at, &mut got).unwrap();
                pattern_fill(&mut want, common::seed_of(k), l, kv);
                assert!(got == want, "layer {l} of key {k} read before its copy");
            }
        }
    }
    b.unpin(&keys(&ks));
    a.close().unwrap();
    b.close().unwrap();
    drop((a, b));
    svc.stop();
}
