//! The service's shared KV memory takes reserved (hugetlbfs) 2 MiB pages
//! where enough are free, so its transfers run as into an engine's own
//! memory in huge pages whatever `shmem_enabled` says; where too few are
//! free it stays in 4 KiB pages. Both ways a client's stored blocks load
//! back equal through the service.
//!
//! One test in its own binary: as root it raises `vm.nr_hugepages` by the
//! arena's pages for its huge half and puts it back after (no other test
//! of this binary runs meanwhile); without root that half says it skipped.

use kvtier::handle::TierBuilder;
use kvtier::memory::{hugetlb_free_bytes, pattern_fill};
use kvtier::model::{DType, KvGeometry};
use kvtier::pool::{DeviceSpec, PoolConfig};
use kvtier::service::{Service, ServiceConfig};
use kvtier::Key;
use std::path::Path;

const NR_HUGEPAGES: &str = "/proc/sys/vm/nr_hugepages";

/// Two layers of 8 KV heads x 128 (bf16, 16 tokens): 32 KiB objects, so 32
/// blocks of K and V are one 2 MiB page per layer.
fn geometry() -> KvGeometry {
    KvGeometry {
        layers: 2,
        kv_heads: 8,
        head_dim: 128,
        block_size: 16,
        dtype: DType::BF16,
    }
}

const CLIENT_BLOCKS: u32 = 32;
const CLIENTS: u32 = 2;

/// The page size (kB) of the mappings of the service's client slices in
/// this process, from /proc/self/smaps (every one the same, or None).
fn slice_page_kb() -> Option<u64> {
    let smaps = std::fs::read_to_string("/proc/self/smaps").expect("smaps");
    let mut sizes = Vec::new();
    let mut in_slice = false;
    for line in smaps.lines() {
        if line.contains('-') && line.split_whitespace().count() >= 5 {
            in_slice = line.contains("kvtier-client-");
        } else if in_slice && line.starts_with("KernelPageSize:") {
            sizes.push(line.split_whitespace().nth(1)?.parse::<u64>().ok()?);
        }
    }
    let first = *sizes.first()?;
    sizes.iter().all(|&s| s == first).then_some(first)
}

/// Start a service on a fresh pool in `dir`, store blocks from one client,
/// load them into other blocks, compare; returns the slices' page size.
fn round_trip(dir: &Path) -> u64 {
    let g = geometry();
    let pool = dir.join("svc.pool");
    let sock = dir.join("svc.sock");
    let _ = std::fs::remove_file(&pool);
    let builder = TierBuilder::default().create(
        PoolConfig::new(g, "huge-test", "test/huge").with_devices(vec![DeviceSpec {
            path: pool.clone(),
            size: Some(64 << 20),
        }]),
    );
    let service = Service::start(
        builder,
        g,
        ServiceConfig::new(&sock)
            .with_clients(CLIENTS)
            .with_client_blocks(CLIENT_BLOCKS),
    )
    .expect("service starts");
    let page_kb = slice_page_kb().expect("the service's slices are mapped here");
    let stop = service.stopper();
    let serving = std::thread::spawn(move || service.run());
    let connect = || {
        TierBuilder::default()
            .service(&sock)
            .blocks(CLIENT_BLOCKS)
            .geometry(g)
            .build()
    };
    let first = connect().expect("client connects");
    let other = connect().expect("a second client connects");
    store_and_load(&first, g, 1000);
    first.close().expect("close");
    drop(first);
    // Its slot's next client gets a new file: in the same pages as before
    // (the old one's go back once its client unmaps them), and reached by
    // the engine (a store and load through it).
    let started = std::time::Instant::now();
    let next = loop {
        match connect() {
            Ok(c) => break c,
            Err(_) if started.elapsed().as_secs() < 10 => {
                std::thread::sleep(std::time::Duration::from_millis(20));
            }
            Err(e) => panic!("the released slot is never given again: {e}"),
        }
    };
    assert_eq!(
        slice_page_kb(),
        Some(page_kb),
        "a renewed slice is in other pages than the arena's"
    );
    store_and_load(&next, g, 2000);
    for c in [next, other] {
        c.close().expect("close");
    }
    stop.stop();
    serving
        .join()
        .expect("service thread")
        .expect("service ran");
    page_kb
}

/// Store 8 blocks from `c`'s memory under keys from `first_key`, load them
/// into other blocks, compare.
fn store_and_load(c: &kvtier::service::ServiceClient, g: KvGeometry, first_key: u64) {
    let n = g.object_bytes() as usize;
    let keys: Vec<Key> = (0..8u64).map(|k| Key::from_u64(first_key + k)).collect();
    let mut buf = vec![0u8; n];
    for b in 0..8u32 {
        for l in 0..g.layers {
            for kv in 0..2 {
                pattern_fill(&mut buf, 77 + b as u64, l, kv);
                c.write_object(b, l, kv, &buf).expect("write");
            }
        }
    }
    let blocks: Vec<u32> = (0..8).collect();
    let job = c.submit_store(&keys, &blocks).expect("store");
    assert!(c.wait(job).expect("wait").all_ok(), "the store failed");
    assert_eq!(c.lookup_and_pin(&keys), 8);
    let into: Vec<u32> = (16..24).collect();
    let job = c.submit_load(&keys, &into, 0..g.layers).expect("load");
    assert!(c.wait(job).expect("wait").all_ok(), "the load failed");
    c.unpin(&keys);
    let mut want = vec![0u8; n];
    for (i, &b) in into.iter().enumerate() {
        for l in 0..g.layers {
            for kv in 0..2 {
                pattern_fill(&mut want, 77 + i as u64, l, kv);
                c.read_object(b, l, kv, &mut buf).expect("read");
                assert!(buf == want, "block {b} layer {l} kv {kv} differs");
            }
        }
    }
}

/// Sets `vm.nr_hugepages` and puts the old value back on drop.
struct HugePages(Option<String>);

impl HugePages {
    fn set(n: u64) -> Option<HugePages> {
        let old = std::fs::read_to_string(NR_HUGEPAGES).ok()?;
        std::fs::write(NR_HUGEPAGES, n.to_string()).ok()?;
        Some(HugePages(Some(old)))
    }
}

impl Drop for HugePages {
    fn drop(&mut self) {
        if let Some(old) = self.0.take() {
            let _ = std::fs::write(NR_HUGEPAGES, old.trim());
        }
    }
}

#[test]
fn service_memory_is_in_reserved_huge_pages_when_free_and_small_pages_else() {
    let dir = kvtier::scratch::TestDir::new("service-huge");
    let arena_bytes = CLIENTS as u64 * CLIENT_BLOCKS as u64 * geometry().block_bytes();
    assert_eq!(arena_bytes, 8 << 20, "the test's arena is four 2 MiB pages");
    let free_pages = hugetlb_free_bytes() / (2 << 20);

    // Too few free: small pages (unless this machine already has them free).
    if free_pages < 4 {
        assert_eq!(
            round_trip(dir.path()),
            4,
            "no reserved pages free: 4 KiB pages"
        );
    }

    // Free reserved pages: the service takes them.
    let total: u64 = std::fs::read_to_string(NR_HUGEPAGES)
        .ok()
        .and_then(|s| s.trim().parse().ok())
        .unwrap_or(0);
    let _guard = if free_pages < 4 {
        // 16 pages more than the arena's four: another process's small
        // DMA buffer may take some meanwhile.
        match HugePages::set(total + 20 - free_pages) {
            Some(g) if hugetlb_free_bytes() >= arena_bytes => Some(g),
            _ => {
                eprintln!(
                    "SKIP the huge-page half: could not reserve 4 huge pages (not root, or no memory)"
                );
                return;
            }
        }
    } else {
        None
    };
    assert_eq!(
        round_trip(dir.path()),
        2048,
        "reserved pages free: 2 MiB pages"
    );
}
