//! Through `kvtier serve` vs in-process, same run, same pool: load
//! bandwidth, first-layer time and lookup latency.
//!
//! One pool of `--blocks` blocks of llama3-8b (2 MiB each) is stored once;
//! then, in alternating rounds, an in-process `TierHandle` and a
//! `ServiceClient` (the service in a thread of this process, reached over
//! its Unix socket like any client) each time open the pool, load every
//! block layer by layer `--loads` times (checking the bytes of the first
//! load) and time `--lookups` lookups of 32 keys. Medians over rounds;
//! the ratios are the figures (a noisy machine moves both sides).
//!
//! `cargo run --release --example service_bench -- [--dir D] [--blocks N]
//! [--rounds R] [--loads L] [--lookups K] [--staged-double]`
//!
//! `--staged-double`: KV memory in "GPU" memory instead, on the staged
//! path's CPU double (host memory standing in for HBM, the CPU doing the
//! copy kernels' work), in-process vs through the service (the staging in
//! the memory the service shares, one service load per layer), both with
//! the same staging (4 layer buffers of 32 blocks, a store area of 16):
//! what the service's per-layer round trips cost the staged path. (A GPU's
//! copies and the CUDA IPC alternative are for a GPU run.) Both sides are
//! in 2 MiB pages only with about 300 reserved (`vm.nr_hugepages`): the
//! in-process staging and both stand-in caches take them too, beside the
//! service's slice of 160 blocks; the service says when its slice is not.

use kvtier::handle::TierBuilder;
use kvtier::memory::{pattern_fill, KvLayout, KvMemory, MemoryKind};
use kvtier::pool::{DeviceSpec, OpenExpect, PoolConfig};
use kvtier::service::{Service, ServiceClient, ServiceConfig};
use kvtier::{HostKvCache, HostLayout, Key, KvGeometry, TierApi};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

const NAMESPACE: &str = "bench/service";

/// One figure of a [`Figures`].
type Pick = fn(&Figures) -> f64;

struct Figures {
    gib_s: f64,
    first_layer_ms: f64,
    lookup_p50_us: f64,
    lookup_p99_us: f64,
}

fn seed(k: u64) -> u64 {
    k.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ 0x5eed
}

fn keys(n: u32) -> Vec<Key> {
    (0..n as u64).map(Key::from_u64).collect()
}

/// Anonymous memory in huge pages (as `DmaBuffer`, what an engine's
/// allocator gets with THP) or in 4 KiB pages (what the service's shared
/// memory gets where shmem THP is off: `shmem_enabled` is `never`).
struct Region {
    base: *mut u8,
    map: *mut libc::c_void,
    map_len: usize,
}

impl Region {
    fn new(len: usize, huge: bool) -> Region {
        let align = 2 << 20;
        let map_len = len + align;
        // SAFETY: a fresh anonymous mapping; trimmed only by our Drop.
        let map = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                map_len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        assert_ne!(map, libc::MAP_FAILED, "mmap");
        let base = (map as usize).next_multiple_of(align) as *mut u8;
        let advice = if huge {
            libc::MADV_HUGEPAGE
        } else {
            libc::MADV_NOHUGEPAGE
        };
        // SAFETY: advice and first touch inside the mapping.
        unsafe {
            libc::madvise(base as *mut libc::c_void, len, advice);
            std::ptr::write_bytes(base, 0, len);
        }
        Region { base, map, map_len }
    }
    fn addr(&self) -> u64 {
        self.base as u64
    }
    fn as_mut_ptr(&self) -> *mut u8 {
        self.base
    }
}

impl Drop for Region {
    fn drop(&mut self) {
        // SAFETY: our own mapping, no I/O into it any more.
        unsafe { libc::munmap(self.map, self.map_len) };
    }
}

/// In-process: KV memory laid out as the service's (block-major per layer),
/// so the two sides differ only by the service (and the page size).
struct InProcess {
    h: kvtier::TierHandle,
    buf: Region,
    mem: KvMemory,
}

impl InProcess {
    fn open(pool: &Path, g: KvGeometry, blocks: u32, huge: bool) -> kvtier::Result<InProcess> {
        let per_layer = 2 * blocks as u64 * g.object_bytes();
        let buf = Region::new((per_layer * g.layers as u64) as usize, huge);
        let mem = KvMemory {
            geometry: g,
            num_blocks: blocks,
            layout: KvLayout::BlockMajor {
                layer_bases: (0..g.layers as u64)
                    .map(|l| buf.addr() + l * per_layer)
                    .collect(),
            },
            kind: MemoryKind::Host,
        };
        // SAFETY: `buf` lives in the returned value next to the handle,
        // which is closed (`close`) before it is dropped.
        let h = unsafe { open_builder(pool, g).memory(mem.clone()) }.build()?;
        Ok(InProcess { h, buf, mem })
    }

    fn check(&self, block: u32, key: u64, g: &KvGeometry) -> bool {
        let n = g.object_bytes() as usize;
        let mut want = vec![0u8; n];
        (0..g.layers).all(|l| {
            (0..2).all(|kv| {
                pattern_fill(&mut want, seed(key), l, kv);
                let off = (self.mem.object_addr(block, l, kv) - self.buf.addr()) as usize;
                // SAFETY: inside `buf` (the memory's own description), no
                // job running (the load was waited for).
                let got = unsafe { std::slice::from_raw_parts(self.buf.as_mut_ptr().add(off), n) };
                got == want.as_slice()
            })
        })
    }
}

/// Whether `client`'s memory block `block` holds key `key`'s bytes.
fn service_check(client: &ServiceClient, block: u32, key: u64, g: &KvGeometry) -> bool {
    let mut want = vec![0u8; g.object_bytes() as usize];
    let mut got = want.clone();
    (0..g.layers).all(|l| {
        (0..2).all(|kv| {
            pattern_fill(&mut want, seed(key), l, kv);
            client.read_object(block, l, kv, &mut got).is_ok() && want == got
        })
    })
}

/// The same calls on either side: `t` is an in-process `TierHandle` or a
/// service client, both through the one handle API.
fn measure(
    t: &dyn TierApi,
    check: &dyn Fn(u32, u64) -> bool,
    g: &KvGeometry,
    blocks: u32,
    loads: u32,
    lookups: u32,
) -> Figures {
    let ks = keys(blocks);
    // Blocks in reverse: a load is not a straight copy of the pool's order.
    let mem: Vec<u32> = (0..blocks).rev().collect();
    let mut total = Duration::ZERO;
    let mut first = Vec::new();
    for i in 0..loads {
        assert_eq!(t.lookup_and_pin(&ks), blocks as usize, "the pool lost keys");
        let t0 = Instant::now();
        let job = t.submit_load(&ks, &mem, 0..g.layers).expect("submit_load");
        t.wait_layer(job, 0).expect("layer 0");
        first.push(t0.elapsed());
        assert!(t.wait(job).expect("wait").all_ok(), "a load failed");
        total += t0.elapsed();
        t.unpin(&ks);
        if i == 0 {
            for (k, &b) in mem.iter().enumerate() {
                assert!(check(b, k as u64), "block {b} (key {k}) has wrong bytes");
            }
        }
    }
    let mut lat: Vec<Duration> = (0..lookups)
        .map(|i| {
            let s = (i * 7) % (blocks - 32);
            let q = &ks[s as usize..s as usize + 32];
            let t0 = Instant::now();
            assert_eq!(t.lookup_prefix(q), 32);
            t0.elapsed()
        })
        .collect();
    lat.sort();
    first.sort();
    let bytes = blocks as f64 * g.block_bytes() as f64 * loads as f64;
    Figures {
        gib_s: bytes / total.as_secs_f64() / (1u64 << 30) as f64,
        first_layer_ms: first[first.len() / 2].as_secs_f64() * 1e3,
        lookup_p50_us: lat[lat.len() / 2].as_secs_f64() * 1e6,
        lookup_p99_us: lat[lat.len() * 99 / 100].as_secs_f64() * 1e6,
    }
}

fn arg(args: &[String], name: &str, default: u64) -> u64 {
    args.windows(2)
        .find(|w| w[0] == name)
        .map(|w| w[1].parse().expect("a number"))
        .unwrap_or(default)
}

fn open_builder(pool: &Path, g: KvGeometry) -> TierBuilder {
    TierBuilder::default().files([pool]).expect(OpenExpect {
        geometry: Some(g),
        namespace: Some(NAMESPACE.into()),
    })
}

/// The staged double's sides: in-process and through a service, with the
/// same staging; returns (in-process, service) figures of one round.
fn staged_double_round(
    dir: &Path,
    pool: &Path,
    g: KvGeometry,
    blocks: u32,
    loads: u32,
    lookups: u32,
) -> kvtier::Result<(Figures, Figures)> {
    use kvtier::staged::StagingConfig;
    let cfg = StagingConfig::new(4, 32, 16).with_store_chunk_blocks(4);
    let check_of = |c: &HostKvCache, b: u32, k: u64| c.block_matches(b, seed(k), 0..g.layers);
    let here = Arc::new(HostKvCache::new(g, blocks, HostLayout::PerLayer)?);
    let h = open_builder(pool, g)
        .staging(cfg)
        .staged_host_double(here.clone())
        .build()?;
    let a = measure(
        &h,
        &|b, k| check_of(&here, b, k),
        &g,
        blocks,
        loads,
        lookups,
    );
    h.close()?;
    let sock = dir.join("bench.sock");
    let s = Service::start(
        open_builder(pool, g),
        g,
        ServiceConfig::new(&sock)
            .with_clients(1)
            // The staging's 4 * 32 + 16 blocks, rounded up to whole 2 MiB
            // pages per layer (32 llama3-8b blocks of K and V): else the
            // slice is in 4 KiB pages whatever vm.nr_hugepages holds, and
            // in-process staging is in (transparent) huge pages.
            .with_client_blocks((4 * 32 + 16u32).next_multiple_of(32)),
    )?;
    let stop = s.stopper();
    let t = std::thread::spawn(move || s.run());
    let there = Arc::new(HostKvCache::new(g, blocks, HostLayout::PerLayer)?);
    let c = TierBuilder::default()
        .service(&sock)
        .geometry(g)
        .staged_host_double(there.clone())
        .staging(cfg)
        .build()?;
    let b = measure(
        &c,
        &|b, k| check_of(&there, b, k),
        &g,
        blocks,
        loads,
        lookups,
    );
    c.close()?;
    drop(c);
    stop.stop();
    t.join().expect("service thread")?;
    Ok((a, b))
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

fn main() -> kvtier::Result<()> {
    let args: Vec<String> = std::env::args().collect();
    let dir = args
        .windows(2)
        .find(|w| w[0] == "--dir")
        .map(|w| PathBuf::from(&w[1]))
        .unwrap_or_else(|| PathBuf::from("./kvtier-service-bench"));
    let blocks = arg(&args, "--blocks", 128) as u32;
    let rounds = arg(&args, "--rounds", 3) as u32;
    let loads = arg(&args, "--loads", 4) as u32;
    let lookups = arg(&args, "--lookups", 2000) as u32;
    let g = kvtier::model::preset("llama3-8b", 16)?;
    std::fs::create_dir_all(&dir).map_err(|e| kvtier::Error::io("creating --dir", e))?;
    let pool = dir.join("bench.pool");
    let _ = std::fs::remove_file(&pool);
    let group = 64u64;
    let groups = (blocks as u64).div_ceil(group) + 1;
    let size = kvtier::pool::layout::DATA_OFFSET
        + groups * kvtier::pool::layout::PoolLayout::group_bytes_for(&g, group as u32);

    // Store every block once.
    {
        let cache = Arc::new(HostKvCache::new(g, blocks, HostLayout::PerLayer)?);
        for b in 0..blocks {
            cache.fill_block(b, seed(b as u64));
        }
        let h = TierBuilder::default()
            .create(
                PoolConfig::new(g, "llama3-8b", NAMESPACE)
                    .with_group_blocks(group as u32)
                    .with_prewrite(true)
                    .with_devices(vec![DeviceSpec {
                        path: pool.clone(),
                        size: Some(size),
                    }]),
            )
            .host_cache(cache)
            .build()?;
        let job = h.submit_store(&keys(blocks), &(0..blocks).collect::<Vec<_>>())?;
        assert!(h.wait(job)?.all_ok(), "the store failed");
        h.close()?;
    }
    println!(
        "pool: {blocks} blocks of llama3-8b ({} MiB each), {} MiB per load, engine uring",
        g.block_bytes() >> 20,
        (blocks as u64 * g.block_bytes()) >> 20
    );
    if args.iter().any(|a| a == "--staged-double") {
        let (mut here, mut there) = (Vec::new(), Vec::new());
        for round in 0..rounds {
            let (a, b) = staged_double_round(&dir, &pool, g, blocks, loads, lookups)?;
            for (name, f) in [("staged in-process", &a), ("staged service", &b)] {
                println!(
                    "round {round} {name:18}: {:.2} GiB/s, first layer {:.2} ms",
                    f.gib_s, f.first_layer_ms
                );
            }
            here.push(a);
            there.push(b);
        }
        let m = |v: &[Figures], f: Pick| median(v.iter().map(f).collect());
        println!("median of {rounds} rounds (CPU double): figure | in-process | service | service / in-process");
        let rows: [(&str, Pick); 2] = [
            ("load GiB/s", |f| f.gib_s),
            ("first layer ms", |f| f.first_layer_ms),
        ];
        for (name, f) in rows {
            let (a, b) = (m(&here, f), m(&there, f));
            println!("FIG {name:16} | {a:8.2} | {b:8.2} | {:.2}x", b / a);
        }
        let _ = std::fs::remove_file(&pool);
        return Ok(());
    }
    let mut figs: [Vec<Figures>; 3] = [Vec::new(), Vec::new(), Vec::new()];
    let names = ["in-process", "in-process 4K", "service"];
    for round in 0..rounds {
        for (i, huge) in [(0, true), (1, false)] {
            let t = InProcess::open(&pool, g, blocks, huge)?;
            let f = measure(&t.h, &|b, k| t.check(b, k, &g), &g, blocks, loads, lookups);
            t.h.close()?;
            figs[i].push(f);
        }
        {
            let sock = dir.join("bench.sock");
            let s = Service::start(
                open_builder(&pool, g),
                g,
                ServiceConfig::new(&sock)
                    .with_clients(1)
                    .with_client_blocks(blocks),
            )?;
            let stop = s.stopper();
            let t = std::thread::spawn(move || s.run());
            let c = TierBuilder::default()
                .service(&sock)
                .blocks(blocks)
                .geometry(g)
                .build()?;
            let check = |b, k| service_check(&c, b, k, &g);
            let f = measure(&c, &check, &g, blocks, loads, lookups);
            c.close()?;
            drop(c);
            stop.stop();
            t.join().expect("service thread")?;
            figs[2].push(f);
        }
        for (name, v) in names.iter().zip(&figs) {
            let f = &v[round as usize];
            println!(
                "round {round} {name:14}: {:.2} GiB/s, first layer {:.2} ms, lookup p50 {:.1} us p99 {:.1} us",
                f.gib_s, f.first_layer_ms, f.lookup_p50_us, f.lookup_p99_us
            );
        }
    }
    let m = |v: &[Figures], f: Pick| median(v.iter().map(f).collect());
    let rows: [(&str, Pick); 4] = [
        ("load GiB/s", |f| f.gib_s),
        ("first layer ms", |f| f.first_layer_ms),
        ("lookup p50 us", |f| f.lookup_p50_us),
        ("lookup p99 us", |f| f.lookup_p99_us),
    ];
    println!(
        "median of {rounds} rounds: figure | in-process (THP) | in-process (4K pages) | service | service / in-process | service / in-process 4K"
    );
    for (name, f) in rows {
        let (a, b, c) = (m(&figs[0], f), m(&figs[1], f), m(&figs[2], f));
        println!(
            "FIG {name:16} | {a:8.2} | {b:8.2} | {c:8.2} | {:.2}x | {:.2}x",
            c / a,
            c / b
        );
    }
    let _ = std::fs::remove_file(&pool);
    Ok(())
}
