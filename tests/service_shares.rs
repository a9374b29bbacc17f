//! One client's flood is its own backpressure, never another client's: the
//! service's tier holds a bounded number of unfinished jobs and a bounded
//! write backlog for all its clients, and each client may take its share
//! (the total over the service's client slots), so a client that submits
//! stores faster than they finish is refused while the others go on. And
//! one client's steady loads never keep a released slot from its next
//! client on an engine that maps memory only when idle.

mod common;
#[allow(dead_code)]
#[path = "common/service.rs"]
mod service;
#[allow(dead_code)]
#[path = "common/staged.rs"]
mod staged;

use common::TempDir;
use kvtier::service::ServiceClient;
use kvtier::{ErrorKind, HandleConfig, Key, Policy};
use service::Svc;

fn keys(first: u64) -> Vec<Key> {
    (first..first + 8).map(Key::from_u64).collect()
}

#[test]
fn one_clients_store_flood_is_its_own_backpressure() {
    let dir = TempDir::new("svc-shares");
    // Stores wait for flush_stores (the Sync policy), in a write backlog of
    // 64 blocks: 32 a client, with two client slots.
    let cfg = HandleConfig::default()
        .with_policy(Policy::Sync)
        .with_backlog_limit_blocks(64);
    let svc = Svc::start_with(&dir, 2, 8, Some(cfg));
    let a = ServiceClient::connect(&svc.sock, 0).unwrap();
    let b = ServiceClient::connect(&svc.sock, 0).unwrap();
    let blocks: Vec<u32> = (0..8).collect();
    let mut held: Vec<_> = (0..4)
        .map(|i| a.submit_store(&keys(8 * i), &blocks).unwrap())
        .collect();
    let e = a.submit_store(&keys(100), &blocks).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Backpressure, "{e}");
    assert!(e.to_string().contains("share"), "the refusal says why: {e}");
    // The other client's stores still go in, up to its own share.
    let theirs: Vec<_> = (0..4)
        .map(|i| b.submit_store(&keys(200 + 8 * i), &blocks).unwrap())
        .collect();
    // Once its stores finish, the first client may store again.
    a.flush_stores().unwrap();
    for j in held.drain(..) {
        assert!(a.wait(j).unwrap().all_ok());
    }
    for j in theirs {
        assert!(b.wait(j).unwrap().all_ok());
    }
    let j = a.submit_store(&keys(100), &blocks).unwrap();
    a.flush_stores().unwrap();
    assert!(a.wait(j).unwrap().all_ok());
    drop((a, b));
    svc.stop();
}

/// The nvme and gpu engines map a slot's new memory only with no I/O in
/// flight (`remap_when_idle`); this double of that policy wraps io_uring,
/// and takes a device busy with steady load at its word: idle only once no
/// I/O has started for 20 ms (on this fast file an instant with nothing in
/// flight comes between any two reads, which a loaded NVMe queue need
/// never give).
struct IdleRemap(Box<dyn kvtier::engine::IoEngine>, u64, std::time::Instant);

impl IdleRemap {
    fn new(inner: Box<dyn kvtier::engine::IoEngine>) -> IdleRemap {
        IdleRemap(inner, 0, std::time::Instant::now())
    }

    /// Note when I/O last started.
    fn noted(&mut self) {
        let ios = self.0.stats().iocbs;
        if ios != self.1 {
            self.1 = ios;
            self.2 = std::time::Instant::now();
        }
    }
}

impl kvtier::engine::IoEngine for IdleRemap {
    fn name(&self) -> &'static str {
        "idle-remap-double"
    }
    fn register_memory(
        &mut self,
        table: std::sync::Arc<kvtier::p2p::P2pTable>,
    ) -> kvtier::Result<()> {
        self.0.register_memory(table)
    }
    fn remap_memory(&mut self, ranges: &[kvtier::p2p::MemRegion]) -> kvtier::Result<bool> {
        self.noted();
        if self.0.in_flight() > 0 || self.2.elapsed() < std::time::Duration::from_millis(20) {
            return Ok(false);
        }
        self.0.remap_memory(ranges)
    }
    fn submit(&mut self, ring: &mut kvtier::ring::GioRing) -> kvtier::Result<()> {
        let r = self.0.submit(ring);
        self.noted();
        r
    }
    fn reap(&mut self, ring: &mut kvtier::ring::GioRing, wait: bool) -> kvtier::Result<()> {
        self.0.reap(ring, wait)
    }
    fn submit_and_wait(&mut self, ring: &mut kvtier::ring::GioRing) -> kvtier::Result<()> {
        let r = self.0.submit_and_wait(ring);
        self.noted();
        r
    }
    fn in_flight(&self) -> usize {
        self.0.in_flight()
    }
    fn completion_fds(&self) -> Vec<std::os::fd::RawFd> {
        self.0.completion_fds()
    }
    fn stats(&self) -> kvtier::engine::EngineStats {
        self.0.stats()
    }
    fn describe(&self) -> String {
        format!("idle-remap double over {}", self.0.describe())
    }
}

/// With an engine that maps a slot's new memory only when nothing is in
/// flight, a slot released while another client keeps loads going still
/// reaches its next client: after a second new loads and stores are
/// refused as backpressure until the I/O drains, then taken again.
#[test]
fn a_slot_renews_under_steady_load_on_an_engine_that_maps_only_when_idle() {
    use kvtier::pool::Pool;
    use kvtier::service::{Service, ServiceConfig};
    use kvtier::TierBuilder;
    use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
    use std::sync::Arc;
    use std::time::{Duration, Instant};

    let dir = TempDir::new("svc-fence");
    let g = common::tiny_geometry();
    let devs = vec![dir.file("a.pool")];
    let pcfg = common::pool_config(g, 4, &devs, 64);
    let builder = TierBuilder::default().custom_engine(move || {
        let pool = Pool::create(&pcfg)?;
        let uring = common::uring_of(&pool)?;
        Ok((pool, Box::new(IdleRemap::new(uring)) as _))
    });
    let sock = dir.file("s.sock");
    let svc = Service::start(
        builder,
        g,
        ServiceConfig::new(&sock)
            .with_clients(2)
            .with_client_blocks(64),
    )
    .unwrap();
    let stopper = svc.stopper();
    let serving = std::thread::spawn(move || svc.run());
    let loader = ServiceClient::connect(&sock, 0).unwrap();
    let blocks: Vec<u32> = (0..64).collect();
    let stored: Vec<Key> = (0..64u64).map(|k| Key::from_u64(900 + k)).collect();
    let job = loader.submit_store(&stored, &blocks).unwrap();
    assert!(loader.wait(job).unwrap().all_ok());
    // Loads without a pause: two at a time, all 64 blocks each.
    let stop = Arc::new(AtomicBool::new(false));
    let (refused, done) = (Arc::new(AtomicU64::new(0)), Arc::new(AtomicU64::new(0)));
    let steady = {
        let (stop, refused, done) = (stop.clone(), refused.clone(), done.clone());
        let stored = stored.clone();
        std::thread::spawn(move || {
            // (job, the half of the blocks it loads into)
            let mut out: std::collections::VecDeque<(_, u32)> = Default::default();
            while !stop.load(Ordering::SeqCst) {
                while out.len() < 2 {
                    let half = out.front().map_or(0, |&(_, h)| 1 - h);
                    let ks = stored[32 * half as usize..32 * (half as usize + 1)].to_vec();
                    let bs: Vec<u32> = (32 * half..32 * (half + 1)).collect();
                    match loader.submit_load(&ks, &bs, 0..g.layers) {
                        Ok(j) => out.push_back((j, half)),
                        Err(e) if e.kind() == ErrorKind::Backpressure => {
                            refused.fetch_add(1, Ordering::SeqCst);
                            break;
                        }
                        Err(e) => panic!("{e}"),
                    }
                }
                if let Some((j, _)) = out.pop_front() {
                    assert!(loader.wait(j).unwrap().all_ok());
                    done.fetch_add(1, Ordering::SeqCst);
                } else {
                    std::thread::sleep(Duration::from_millis(5));
                }
            }
            for (j, _) in out {
                loader.wait(j).unwrap();
            }
        })
    };
    while done.load(Ordering::SeqCst) < 4 {
        assert!(!steady.is_finished(), "the steady loads stopped");
        std::thread::sleep(Duration::from_millis(5));
    }
    // A client takes the other slot and leaves; the next one must get it.
    let leaving = ServiceClient::connect(&sock, 0).unwrap();
    leaving.close().unwrap();
    drop(leaving);
    let started = Instant::now();
    let next = loop {
        match ServiceClient::connect(&sock, 0) {
            Ok(c) => break c,
            Err(e) => {
                assert!(
                    started.elapsed() < Duration::from_secs(20),
                    "the released slot never reached its next client under load: {e}"
                );
                std::thread::sleep(Duration::from_millis(20));
            }
        }
    };
    // Its memory is the engine's: a store and load through it.
    let ks: Vec<Key> = (0..4u64).map(|k| Key::from_u64(2000 + k)).collect();
    let job = next.submit_store(&ks, &[0, 1, 2, 3]);
    let job = match job {
        Ok(j) => j,
        Err(_) => {
            std::thread::sleep(Duration::from_millis(200));
            next.submit_store(&ks, &[0, 1, 2, 3]).unwrap()
        }
    };
    assert!(next.wait(job).unwrap().all_ok());
    let before = done.load(Ordering::SeqCst);
    std::thread::sleep(Duration::from_millis(300));
    assert!(
        done.load(Ordering::SeqCst) > before,
        "loads are not taken again after the slot was renewed"
    );
    assert!(
        refused.load(Ordering::SeqCst) > 0,
        "the steady loads were never held: the slot renewed without the fence"
    );
    stop.store(true, Ordering::SeqCst);
    steady.join().unwrap();
    drop(next);
    stopper.stop();
    serving.join().unwrap().unwrap();
    eprintln!(
        "steady loads: {} done, {} refused while the slot was renewed",
        done.load(Ordering::SeqCst),
        refused.load(Ordering::SeqCst)
    );
}
