//! KV memory in GPU memory through the node service, on the CPU: host
//! memory stands in for the GPU's KV memory and the staged path's CPU
//! copier (`HostCopier`, a test double) does the copies the staging kernels
//! do on a GPU. The service runs in this process (its handle's usage shows
//! what a client left behind); clients run here or, where the test is about
//! processes, as children re-running this binary. tests/gpu_staged.rs runs
//! the round trip on a GPU.

mod common;
#[path = "common/service.rs"]
mod service;
// Shared with the in-process staged tests: only the rig and its checks here.
#[allow(dead_code)]
#[path = "common/staged.rs"]
mod staged;

use kvtier::service::{ServiceClient, StagedServiceClient};
use kvtier::staged::{StagedPath, StagingConfig};
use kvtier::{HostKvCache, HostLayout, Key, LayerCopy, TierApi, TierBuilder};
use std::io::{BufRead, BufReader, Write};
use std::path::Path;
use std::process::{Child, ChildStdout, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

const ENV: &str = "KVTIER_SERVICE_STAGED_CHILD";
use service::{Svc, POOL};

fn keys_in(r: std::ops::Range<u64>) -> Vec<Key> {
    r.map(Key::from_u64).collect()
}

fn seed(k: u64) -> u64 {
    common::seed_of(k)
}

/// Blocks `mem` of `c` hold every layer of keys `first_key..` in order
/// (a load landed), but for the one at `failed` (its key failed).
fn assert_loaded(c: &HostKvCache, mem: &[u32], first_key: u64, failed: Option<usize>) {
    let layers = 0..c.memory().geometry.layers;
    for (i, &b) in mem.iter().enumerate() {
        if Some(i) != failed {
            assert!(
                c.block_matches(b, seed(first_key + i as u64), layers.clone()),
                "block {b}"
            );
        }
    }
}

/// Host memory posing as the GPU's KV memory, copied by the CPU.
struct HostRig(Arc<HostKvCache>);

impl staged::KvRig for HostRig {
    fn geometry(&self) -> kvtier::KvGeometry {
        self.0.memory().geometry
    }
    fn num_blocks(&self) -> u32 {
        self.0.num_blocks()
    }
    fn write_object(&self, block: u32, layer: u32, kv: u32, data: &[u8]) {
        self.0.write_object(block, layer, kv, data)
    }
    fn read_object(&self, block: u32, layer: u32, kv: u32) -> Vec<u8> {
        let mut v = vec![0; self.geometry().object_bytes() as usize];
        self.0.read_object(block, layer, kv, &mut v);
        v
    }
    fn clear(&self) {
        self.0.clear()
    }
    fn staged(&self, tier: kvtier::tier::Tier, cfg: StagingConfig) -> kvtier::staged::StagedTier {
        kvtier::staged::StagedTier::with_host_double(tier, self.0.clone(), cfg).unwrap()
    }
}

fn cache(layout: HostLayout, blocks: u32) -> Arc<HostKvCache> {
    Arc::new(HostKvCache::new(common::tiny_geometry(), blocks, layout).unwrap())
}

fn staged_client(
    sock: &Path,
    c: &Arc<HostKvCache>,
    cfg: Option<StagingConfig>,
) -> StagedServiceClient {
    let b = TierBuilder::default()
        .service(sock)
        .staged_host_double(c.clone());
    match cfg {
        Some(cfg) => b.staging(cfg),
        None => b,
    }
    .build()
    .unwrap()
}

/// Every byte of a cache, block by block.
fn snapshot(c: &HostKvCache) -> Vec<u8> {
    let g = c.memory().geometry;
    let mut out = Vec::new();
    let mut buf = vec![0u8; g.object_bytes() as usize];
    for b in 0..c.num_blocks() {
        for l in 0..g.layers {
            for kv in 0..2 {
                c.read_object(b, l, kv, &mut buf);
                out.extend_from_slice(&buf);
            }
        }
    }
    out
}

/// Fill blocks `0..n` of `c` with keys `first..first + n`'s bytes and store
/// them through `t`, flushed; every key must be stored.
fn store_blocks(t: &dyn TierApi, c: &HostKvCache, first: u64, n: u32) {
    for i in 0..n {
        c.fill_block(i, seed(first + i as u64));
    }
    let s = t
        .submit_store(
            &keys_in(first..first + n as u64),
            &(0..n).collect::<Vec<_>>(),
        )
        .unwrap();
    t.flush_stores().unwrap();
    let r = t.wait(s).unwrap();
    assert!(r.all_ok(), "{r:?}");
}

/// The script both ways run: store 12 blocks, clear, load them all into
/// other blocks layer by layer (waiting for each layer in order), then
/// layers 1..3 of a few into yet other blocks; each step's result checked.
fn script(t: &dyn TierApi, c: &HostKvCache) {
    let g = *t.geometry();
    store_blocks(t, c, 100, 12);
    c.clear();
    let ks = keys_in(100..112);
    assert_eq!(t.lookup_and_pin(&ks), 12);
    let into: Vec<u32> = (20..32).collect();
    let j = t.submit_load(&ks, &into, 0..g.layers).unwrap();
    for l in 0..g.layers {
        t.wait_layer(j, l).unwrap();
        for (i, &b) in into.iter().enumerate() {
            assert!(
                c.block_matches(b, seed(100 + i as u64), l..l + 1),
                "block {b} layer {l}"
            );
        }
    }
    assert!(t.wait(j).unwrap().all_ok());
    t.unpin(&ks);
    let some = keys_in(103..107);
    assert_eq!(t.lookup_and_pin(&some), 4);
    let j = t.submit_load(&some, &[40, 41, 42, 43], 1..3).unwrap();
    assert!(t.wait(j).unwrap().all_ok());
    t.unpin(&some);
    for i in 0..4u32 {
        assert!(c.block_matches(40 + i, seed(103 + i as u64), 1..3));
        assert!(
            !c.block_matches(40 + i, seed(103 + i as u64), 0..1),
            "layer 0 not loaded"
        );
    }
}

fn small_staging() -> StagingConfig {
    // Loads of 12 keys in chunks of 5; stores in chunks of 2 in an area of 4.
    StagingConfig::new(2, 5, 4).with_store_chunk_blocks(2)
}

/// One script, in-process on the staged double and through the service's
/// staged client: the same bytes land, in both layouts the staged path
/// serves.
#[test]
fn same_script_in_process_and_through_the_service_gives_equal_bytes() {
    for layout in [HostLayout::PerLayer, HostLayout::CrossLayer] {
        let dir = common::TempDir::new(&format!("svc-staged-eq-{layout:?}"));
        let here = cache(layout, 48);
        let h = TierBuilder::default()
            .directory(dir.file("own"))
            .capacity(POOL)
            .model_name("test")
            .staging(small_staging())
            .staged_host_double(here.clone())
            .build()
            .unwrap();
        script(&h, &here);
        h.close().unwrap();

        let svc = Svc::start(&dir, 2, 32);
        let there = cache(layout, 48);
        let c = staged_client(&svc.sock, &there, Some(small_staging()));
        assert_eq!(TierApi::memory_blocks(&c), 48, "the client's own KV memory");
        script(&c, &there);
        assert!(
            snapshot(&here) == snapshot(&there),
            "{layout:?}: the same script left different bytes"
        );
        c.close().unwrap();
        let u = svc.usage();
        assert_eq!(u.tier.pinned_blocks, 0, "{layout:?}: pins left behind");
        svc.stop();
    }
}

/// A load of 40 blocks through a layer buffer of 3 (14 chunks a layer, 2
/// buffers) and a store of 40 through a store area of 4: every byte lands,
/// and the staging is the small part of the slice it was given.
#[test]
fn long_load_goes_through_a_small_staging_area_in_chunks() {
    let dir = common::TempDir::new("svc-staged-long");
    let svc = Svc::start(&dir, 2, 16);
    let c = cache(HostLayout::PerLayer, 64);
    let cfg = StagingConfig::new(2, 3, 4).with_store_chunk_blocks(2);
    let t = staged_client(&svc.sock, &c, Some(cfg));
    assert_eq!(t.staging().unwrap(), cfg);
    let g = common::tiny_geometry();
    store_blocks(&t, &c, 500, 40);
    assert_eq!(t.lookup_prefix(&keys_in(500..540)), 40);
    c.clear();
    let ks = keys_in(500..540);
    assert_eq!(t.lookup_and_pin(&ks), 40);
    // Into blocks in another order than the keys, so chunks scatter.
    let into: Vec<u32> = (0..40).map(|i| 63 - i).collect();
    let j = t.submit_load(&ks, &into, 0..g.layers).unwrap();
    for l in 0..g.layers {
        t.wait_layer(j, l).unwrap();
    }
    assert!(TierApi::wait(&t, j).unwrap().all_ok());
    t.unpin(&ks);
    assert_loaded(&c, &into, 500, None);
    // The staging's places are the first 2 * 3 + 4 blocks of the slice;
    // a staging that does not fit the slice is refused with the sizes.
    let e = TierBuilder::default()
        .service(&svc.sock)
        .staged_host_double(cache(HostLayout::PerLayer, 8))
        .staging(StagingConfig::new(4, 4, 4))
        .build()
        .unwrap_err();
    assert!(e.to_string().contains("takes 20 blocks of the 16"), "{e}");
    t.close().unwrap();
    svc.stop();
}

/// Damage layer `layer` of `key`'s block on the pool's file (the service
/// stopped: the pool is opened here to find the block).
fn damage(dir: &common::TempDir, key: u64, layer: u32) {
    use std::os::unix::fs::FileExt;
    let path = dir.file("pool").join("kvtier-0.pool");
    let pool = kvtier::pool::Pool::open(std::slice::from_ref(&path), &Default::default()).unwrap();
    let slot = pool.index().get(&Key::from_u64(key)).unwrap().slot;
    let (dev, off) = pool.layout().object_offset(slot, layer, 1);
    assert_eq!(dev, 0);
    drop(pool);
    let f = std::fs::OpenOptions::new().write(true).open(&path).unwrap();
    f.write_all_at(&[0xa5], off + 3).unwrap();
    f.sync_all().unwrap();
}

/// Six blocks (keys `base..base + 6` from memory blocks 0..6) stored
/// through a staged client, the fourth one's layer 2 then damaged on the
/// pool file: a fresh service on the pool, to load them again.
fn stored_with_one_damaged(dir: &common::TempDir, c: &Arc<HostKvCache>, base: u64) -> Svc {
    {
        let svc = Svc::start(dir, 2, 32);
        store_through_service(&svc, c, base, 6);
        svc.stop();
    }
    damage(dir, base + 3, 2);
    Svc::start(dir, 2, 32)
}

/// The staged path by hand over `client`'s shared slice, into `c`
/// (2 layer buffers of 8 blocks, a store area of 4).
///
/// # Safety
/// `c` outlives the path.
unsafe fn path_over(client: &ServiceClient, c: &HostKvCache) -> StagedPath {
    // SAFETY: the caller keeps the cache alive.
    unsafe {
        StagedPath::over_shared_staging(
            client.memory().clone(),
            client.shared_mapping().expect("a memory client"),
            c.memory().clone(),
            StagingConfig::new(2, 8, 4),
        )
        .unwrap()
    }
}

/// The staged path driven by hand over a service client (its jobs are the
/// service's): each layer's copy mark comes in layer order, before its
/// event, and never for a layer that failed (one key's block is damaged on
/// the SSD in layer 2); the handle-shaped client gives marks and settles
/// the same way.
#[test]
fn copy_marks_come_in_order_and_never_for_a_failed_layer() {
    let dir = common::TempDir::new("svc-staged-marks");
    let g = common::tiny_geometry();
    let c = cache(HostLayout::PerLayer, 16);
    let svc = stored_with_one_damaged(&dir, &c, 700);
    let mut client = ServiceClient::connect(&svc.sock, 0).unwrap();
    c.clear();
    // SAFETY: the cache outlives the path (dropped at the end of the test).
    let mut path = unsafe { path_over(&client, &c) };
    let mem: Vec<u32> = (8..14).collect();
    let job = path
        .submit_load(&mut client, &keys_in(700..706), &mem, 0..g.layers)
        .unwrap();
    // The load's counter (the double's host word, written as a GPU's
    // would be): a compute stream waiting for any layer, the failed one
    // included, is released once the layer's event is out.
    let counter = path.load_counter(job).expect("a staged load has a counter");
    let (mut marks, mut events) = (Vec::new(), Vec::new());
    let t0 = Instant::now();
    while events.len() < g.layers as usize {
        assert!(
            t0.elapsed() < Duration::from_secs(30),
            "the load never ended"
        );
        path.poll(&mut client).unwrap();
        for q in path.layers_queued() {
            assert_eq!(q.job, job);
            assert!(q.mark.is_double(), "the double's copies have no GPU event");
            marks.push((q.layer, events.len()));
        }
        for e in path.layer_events() {
            let now = counter.counter.load().unwrap();
            assert!(
                now.wrapping_sub(counter.value_for(e.layer)) as i32 >= 0,
                "layer {} announced with its counter at {now}, short of {}",
                e.layer,
                counter.value_for(e.layer)
            );
            events.push((e.layer, e.error.is_some()));
        }
        std::thread::sleep(Duration::from_millis(1));
    }
    assert_eq!(
        events,
        vec![(0, false), (1, false), (2, true), (3, false)],
        "layer 2 fails (one key's block is damaged there), the others land"
    );
    assert_eq!(
        marks.iter().map(|m| m.0).collect::<Vec<_>>(),
        vec![0, 1, 3],
        "a mark per layer copied, in order, none for the failed layer"
    );
    for &(layer, seen) in &marks {
        assert!(
            seen <= layer as usize,
            "layer {layer} marked after its event"
        );
    }
    let r = path.wait(&mut client, job).unwrap();
    let failed: Vec<Key> = r.failures().map(|(k, _)| *k).collect();
    assert_eq!(failed, keys_in(703..704), "only the damaged key fails");
    assert_loaded(&c, &mem, 700, Some(3));
    path.drain(&mut client).unwrap();
    drop(path);
    drop(client);
    // The damaged key left the pool; through the handle-shaped client the
    // others load with a copy mark or a settled layer, waited for in order.
    let t = staged_client(&svc.sock, &c, None);
    let ks: Vec<Key> = keys_in(700..706)
        .into_iter()
        .filter(|k| *k != Key::from_u64(703))
        .collect();
    assert_eq!(t.lookup_and_pin(&ks), 5);
    let j = t.submit_load(&ks, &[0, 1, 2, 3, 4], 0..g.layers).unwrap();
    for l in 0..g.layers {
        match t
            .wait_layer_queued_timeout(j, l, Duration::from_secs(30))
            .unwrap()
        {
            Some(LayerCopy::Queued(m)) => assert!(m.is_double()),
            Some(LayerCopy::Settled) => {}
            None => panic!("layer {l} never queued"),
        }
        t.wait_layer(j, l).unwrap();
    }
    assert!(TierApi::wait(&t, j).unwrap().all_ok());
    assert!(
        TierApi::load_counter(&t, j).unwrap().is_none(),
        "a finished load has no counter"
    );
    t.unpin(&ks);
    t.close().unwrap();
    svc.stop();
}

/// Stores keys `first..first + n` through a staged client of `svc` (block
/// `i` of `c` holds key `first + i`).
fn store_through_service(svc: &Svc, c: &Arc<HostKvCache>, first: u64, n: u32) {
    let t = staged_client(&svc.sock, c, None);
    store_blocks(&t, c, first, n);
    t.close().unwrap();
}

/// Over the service's slice, a layer buffer holds every layer: a load
/// keeps more layers' reads in flight than there are layer buffers (each
/// read's round trip through the service hides behind those queued), and
/// still copies, marks and announces them one by one in order, bytes
/// equal.
#[test]
fn reads_run_ahead_of_the_layer_buffers_over_shared_staging() {
    let dir = common::TempDir::new("svc-staged-ahead");
    let g = common::tiny_geometry();
    let c = cache(HostLayout::PerLayer, 16);
    let svc = Svc::start(&dir, 2, 32);
    store_through_service(&svc, &c, 800, 6);
    c.clear();
    let mut client = ServiceClient::connect(&svc.sock, 0).unwrap();
    let cfg = StagingConfig::new(2, 8, 4);
    // SAFETY: the cache outlives the path (dropped at the end of the test).
    let mut path = unsafe {
        StagedPath::over_shared_staging(
            client.memory().clone(),
            client.shared_mapping().expect("a memory client"),
            c.memory().clone(),
            cfg,
        )
        .unwrap()
    };
    let mem: Vec<u32> = (8..14).collect();
    let job = path
        .submit_load(&mut client, &keys_in(800..806), &mem, 0..g.layers)
        .unwrap();
    let (mut most, mut events, mut marks) = (0, Vec::new(), Vec::new());
    let t0 = Instant::now();
    while events.len() < g.layers as usize {
        assert!(
            t0.elapsed() < Duration::from_secs(30),
            "the load never ended"
        );
        path.poll(&mut client).unwrap();
        let reading: Vec<u32> = path
            .buffers_in_use()
            .into_iter()
            .flatten()
            .map(|(_, l)| l)
            .collect();
        most = most.max(reading.len());
        marks.extend(path.layers_queued().into_iter().map(|q| q.layer));
        events.extend(
            path.layer_events()
                .into_iter()
                .map(|e| (e.layer, e.error.is_none())),
        );
        std::thread::sleep(Duration::from_millis(1));
    }
    assert!(
        most > cfg.layer_buffers as usize,
        "at most {most} layers read at once with {} layer buffers",
        cfg.layer_buffers
    );
    assert_eq!(marks, (0..g.layers).collect::<Vec<_>>());
    assert_eq!(events, (0..g.layers).map(|l| (l, true)).collect::<Vec<_>>());
    assert!(path.wait(&mut client, job).unwrap().all_ok());
    assert_loaded(&c, &mem, 800, None);
    path.drain(&mut client).unwrap();
    drop(path);
    drop(client);
    svc.stop();
}

/// The round trip tests/gpu_staged.rs makes on a GPU, on the double: two
/// staged clients of one service, one stores from its "GPU" memory, the
/// other loads layer by layer with copy marks, in both layouts.
#[test]
fn round_trip_between_two_staged_clients() {
    for layout in [HostLayout::PerLayer, HostLayout::CrossLayer] {
        let dir = common::TempDir::new(&format!("svc-staged-rt-{layout:?}"));
        let svc = Svc::start(&dir, 2, 64);
        let (ra, rb) = (HostRig(cache(layout, 48)), HostRig(cache(layout, 48)));
        let a = staged_client(&svc.sock, &ra.0, None);
        let b = staged_client(&svc.sock, &rb.0, None);
        service::round_trip_between((&ra, &a), (&rb, &b), 40, 24, false);
        a.close().unwrap();
        b.close().unwrap();
        svc.stop();
    }
}

/// A store with the client's checksums: lists that do not fit the model
/// are refused (the client stays connected); checksums that do not match
/// the bytes are written as given, and the load that reads those bytes
/// fails the key as corrupt (never serves them) and drops it.
#[test]
fn client_checksums_are_checked_by_the_load_that_reads_them() {
    let dir = common::TempDir::new("svc-staged-crcs");
    let svc = Svc::start(&dir, 2, 16);
    let c = ServiceClient::connect(&svc.sock, 0).unwrap();
    let g = common::tiny_geometry();
    let ks = keys_in(600..602);
    let e = c
        .submit_store_with_crcs(&ks, &[0, 1], vec![vec![0; 3], vec![0; 3]])
        .unwrap_err();
    assert!(e.to_string().contains("layer checksums"), "{e}");
    let e = c
        .submit_store_with_crcs(&ks, &[0, 1], vec![vec![0; 4]])
        .unwrap_err();
    assert!(e.to_string().contains("checksum lists"), "{e}");
    // Right shapes: the block's true checksums for key 600, wrong ones for 601.
    let obj = g.object_bytes() as usize;
    let mut buf = vec![0u8; obj];
    let mut crcs = Vec::new();
    for (b, k) in [(0u32, 600u64), (1, 601)] {
        let mut per_layer = Vec::new();
        for l in 0..g.layers {
            let mut layer = Vec::new();
            for kv in 0..2 {
                kvtier::memory::pattern_fill(&mut buf, seed(k), l, kv);
                c.write_object(b, l, kv, &buf).unwrap();
                layer.extend_from_slice(&buf);
            }
            per_layer.push(crc32c::crc32c(&layer) ^ u32::from(k == 601));
        }
        crcs.push(per_layer);
    }
    let s = c.submit_store_with_crcs(&ks, &[0, 1], crcs).unwrap();
    c.flush_stores().unwrap();
    assert!(c.wait(s).unwrap().all_ok());
    assert_eq!(c.lookup_and_pin(&ks), 2);
    let j = c.submit_load(&ks, &[4, 5], 0..g.layers).unwrap();
    let r = c.wait(j).unwrap();
    let failed: Vec<Key> = r.failures().map(|(k, _)| *k).collect();
    assert_eq!(failed, keys_in(601..602), "{r:?}");
    assert!(matches!(
        r.outcomes[1],
        kvtier::tier::KeyOutcome::Corrupt(_)
    ));
    c.unpin(&ks);
    assert!(
        !c.contains(&Key::from_u64(601)),
        "the damaged key left the pool"
    );
    let mut got = vec![0u8; obj];
    for l in 0..g.layers {
        for kv in 0..2 {
            kvtier::memory::pattern_fill(&mut buf, seed(600), l, kv);
            c.read_object(4, l, kv, &mut got).unwrap();
            assert_eq!(got, buf, "key 600 layer {l}");
        }
    }
    c.close().unwrap();
    svc.stop();
}

// ---------------------------------------------------------------------------
// Client processes

/// Entry point of a client process: `ROLE;SOCKET;FIRST;COUNT`.
#[test]
fn service_staged_child() {
    let Ok(spec) = std::env::var(ENV) else {
        return;
    };
    let f: Vec<&str> = spec.split(';').collect();
    let (role, sock) = (f[0], Path::new(f[1]));
    let first: u64 = f[2].parse().unwrap();
    let n: u64 = f[3].parse().unwrap();
    let say = |s: String| {
        let mut o = std::io::stdout().lock();
        let _ = writeln!(o, "{s}");
        let _ = o.flush();
    };
    let g = common::tiny_geometry();
    let c = cache(HostLayout::PerLayer, 64);
    let ks = keys_in(first..first + n);
    let into: Vec<u32> = (0..n as u32).collect();
    match role {
        // Load through the staged client and check every byte.
        "load" => {
            let t = staged_client(sock, &c, None);
            let pinned = t.lookup_and_pin(&ks);
            let j = t.submit_load(&ks, &into, 0..g.layers).unwrap();
            let r = TierApi::wait(&t, j).unwrap();
            let bad = (0..n)
                .filter(|&i| !c.block_matches(i as u32, seed(first + i), 0..g.layers))
                .count();
            say(format!("LOADED {pinned} OK {} BAD {bad}", r.all_ok()));
            t.unpin(&ks);
            t.close().unwrap();
        }
        // Pin, start a staged load and leave it in the middle (the path is
        // not moved again: its later layers wait for this process), then
        // wait to be killed.
        "load-then-die" => {
            let mut client = ServiceClient::connect(sock, 0).unwrap();
            // SAFETY: the cache lives until this process is killed.
            let mut path = unsafe {
                StagedPath::over_shared_staging(
                    client.memory().clone(),
                    client.shared_mapping().expect("a memory client"),
                    c.memory().clone(),
                    StagingConfig::new(2, 2, 2),
                )
                .unwrap()
            };
            path.submit_load(&mut client, &ks, &into, 0..g.layers)
                .unwrap();
            say("LOADING".into());
            std::thread::sleep(Duration::from_secs(600));
        }
        r => panic!("unknown role {r}"),
    }
}

struct ClientProc {
    child: Child,
    out: BufReader<ChildStdout>,
}

impl ClientProc {
    fn spawn(role: &str, sock: &Path, first: u64, n: u64) -> ClientProc {
        let mut child = Command::new(std::env::current_exe().unwrap())
            .args([
                "--exact",
                "service_staged_child",
                "--nocapture",
                "--test-threads=1",
            ])
            .env(ENV, format!("{role};{};{first};{n}", sock.display()))
            .stdout(Stdio::piped())
            .spawn()
            .unwrap();
        let out = BufReader::new(child.stdout.take().unwrap());
        ClientProc { child, out }
    }

    /// The first line starting with `prefix`; panics at EOF.
    fn until(&mut self, prefix: &str) -> String {
        loop {
            let mut line = String::new();
            if self.out.read_line(&mut line).unwrap() == 0 {
                panic!("client ended before printing {prefix}");
            }
            let line = line.trim_end();
            let line = line
                .rsplit_once("test service_staged_child ... ")
                .map_or(line, |(_, l)| l);
            if line.starts_with(prefix) {
                return line.to_string();
            }
        }
    }
}

impl Drop for ClientProc {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Blocks stored from "GPU" memory (the staged gather, checksums taken as
/// gathered) by this process load in another client process, layer by
/// layer, with every byte equal.
#[test]
fn store_from_gpu_memory_loads_in_another_process() {
    let dir = common::TempDir::new("svc-staged-2proc");
    let svc = Svc::start(&dir, 3, 32);
    let c = cache(HostLayout::CrossLayer, 32);
    let t = staged_client(&svc.sock, &c, None);
    store_blocks(&t, &c, 900, 20);
    let mut other = ClientProc::spawn("load", &svc.sock, 900, 20);
    assert_eq!(other.until("LOADED"), "LOADED 20 OK true BAD 0");
    assert!(other.child.wait().unwrap().success());
    t.close().unwrap();
    svc.stop();
}

/// A client killed in the middle of a staged load (its keys pinned, a layer
/// read into its staging, the next not asked for) leaves no pin and no job
/// in the service, and its slot serves the next client.
#[test]
fn client_killed_mid_load_leaves_no_pin_or_job() {
    let dir = common::TempDir::new("svc-staged-kill");
    let svc = Svc::start(&dir, 2, 32);
    let c = cache(HostLayout::PerLayer, 32);
    store_through_service(&svc, &c, 300, 8);
    let mut p = ClientProc::spawn("load-then-die", &svc.sock, 300, 8);
    p.until("LOADING");
    let u = svc.usage();
    assert_eq!(u.tier.pinned_blocks, 8, "the child holds its load's keys");
    let _ = p.child.kill();
    let _ = p.child.wait();
    let t0 = Instant::now();
    loop {
        let u = svc.usage();
        if u.tier.pinned_blocks == 0 && u.tier.jobs_in_flight == 0 {
            break;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(20),
            "the killed client left {} pinned blocks and {} jobs",
            u.tier.pinned_blocks,
            u.tier.jobs_in_flight
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    // Both slots serve clients again (the dead one's once its jobs ended).
    let t0 = Instant::now();
    let (a, b) = loop {
        let a = ServiceClient::connect(&svc.sock, 0);
        let b = ServiceClient::connect(&svc.sock, 0);
        match (a, b) {
            (Ok(a), Ok(b)) => break (a, b),
            _ if t0.elapsed() < Duration::from_secs(20) => {
                std::thread::sleep(Duration::from_millis(50))
            }
            (a, b) => panic!("a slot never came back: {:?} {:?}", a.err(), b.err()),
        }
    };
    drop((a, b));
    let mut other = ClientProc::spawn("load", &svc.sock, 300, 8);
    assert_eq!(other.until("LOADED"), "LOADED 8 OK true BAD 0");
    svc.stop();
}

/// A key the staged load holds leaves the pool under it (another client's
/// load finds its block damaged) before the load's next layers go out: the
/// service refuses the next layer's request naming it, the path looks the
/// keys up, fails that key alone and asks for the layer again without it.
/// It looked the keys up again only once per refusal and then asked with
/// the key again: a request loop that never returned from `poll` (seen in
/// a CI run: 3.5 million refused requests).
#[test]
fn a_key_that_leaves_the_pool_under_a_staged_load_fails_alone() {
    let dir = common::TempDir::new("svc-staged-left");
    let g = common::tiny_geometry();
    let c = cache(HostLayout::PerLayer, 16);
    let svc = stored_with_one_damaged(&dir, &c, 800);
    let (done_tx, done_rx) = std::sync::mpsc::channel();
    let sock = svc.sock.clone();
    let c2 = c.clone();
    std::thread::spawn(move || {
        let mut client = ServiceClient::connect(&sock, 0).unwrap();
        c2.clear();
        // SAFETY: the cache outlives the path (this thread holds a clone).
        let mut path = unsafe { path_over(&client, &c2) };
        let mem: Vec<u32> = (8..14).collect();
        // The load holds its keys and reads layer 0 alone first.
        let job = path
            .submit_load(&mut client, &keys_in(800..806), &mem, 0..g.layers)
            .unwrap();
        // Another client's load finds 803's layer 2 damaged: the service
        // drops the key while this load holds it.
        let other = ServiceClient::connect(&sock, 4).unwrap();
        let j = other.submit_load(&keys_in(803..804), &[0], 2..3).unwrap();
        let r = other.wait(j).unwrap();
        assert!(!r.all_ok(), "the damaged block must fail its load");
        assert!(
            !other.contains(&Key::from_u64(803)),
            "a damaged key leaves the pool"
        );
        other.close().unwrap();
        let r = path.wait(&mut client, job).unwrap();
        path.drain(&mut client).unwrap();
        let failed: Vec<Key> = r.failures().map(|(k, _)| *k).collect();
        let _ = done_tx.send((failed, mem));
    });
    let (failed, mem) = done_rx
        .recv_timeout(Duration::from_secs(60))
        .expect("the staged load never ended (a request loop in the path)");
    assert_eq!(failed, keys_in(803..804), "only the key that left fails");
    assert_loaded(&c, &mem, 800, Some(3));
    svc.stop();
}
