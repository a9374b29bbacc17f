//! The node service in a test's own process, and the round trip through
//! its staged GPU client that the CPU double (tests/service_staged.rs) and
//! the GPU run (tests/gpu_staged.rs) both make.

use crate::common::*;
use crate::staged::{fill, keys, matches, KvRig};
use kvtier::service::{Service, ServiceConfig, Stopper};
use kvtier::{LayerCopy, TierApi, TierBuilder, TierHandle};
use std::path::PathBuf;
use std::time::Duration;

pub const POOL: u64 = 64 << 20;

/// A service on a pool in `dir` (of `tiny_geometry`), run on a thread.
pub struct Svc {
    stopper: Stopper,
    thread: Option<std::thread::JoinHandle<kvtier::Result<()>>>,
    pub sock: PathBuf,
    pub handle: TierHandle,
}

impl Svc {
    pub fn start(dir: &TempDir, clients: u32, client_blocks: u32) -> Svc {
        Svc::start_with(dir, clients, client_blocks, None)
    }

    /// `start`, the service's handle with `config` (its policy, backlog).
    pub fn start_with(
        dir: &TempDir,
        clients: u32,
        client_blocks: u32,
        config: Option<kvtier::HandleConfig>,
    ) -> Svc {
        Svc::start_shaped(dir, tiny_geometry(), clients, client_blocks, config)
    }

    /// `start_with` for a pool of geometry `g`.
    pub fn start_shaped(
        dir: &TempDir,
        g: kvtier::KvGeometry,
        clients: u32,
        client_blocks: u32,
        config: Option<kvtier::HandleConfig>,
    ) -> Svc {
        let sock = dir.file("kvtier.sock");
        let builder = TierBuilder::default()
            .directory(dir.file("pool"))
            .capacity(POOL)
            .geometry(g)
            .model_name("test");
        let builder = match config {
            Some(c) => builder.config(c),
            None => builder,
        };
        let cfg = ServiceConfig::new(&sock)
            .with_clients(clients)
            .with_client_blocks(client_blocks);
        let svc = Service::start(builder, g, cfg).unwrap();
        let handle = svc.handle().clone();
        let stopper = svc.stopper();
        let thread = Some(std::thread::spawn(move || svc.run()));
        Svc {
            stopper,
            thread,
            sock,
            handle,
        }
    }

    pub fn usage(&self) -> kvtier::handle::HandleUsage {
        self.handle.usage().unwrap()
    }

    /// Stop it: every acknowledged job finishes first.
    pub fn stop(mut self) {
        self.stopper.stop();
        if let Some(t) = self.thread.take() {
            t.join().unwrap().unwrap();
        }
    }
}

impl Drop for Svc {
    fn drop(&mut self) {
        self.stopper.stop();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// Blocks `0..n` of `a`'s KV memory, filled by key `first + i`, are stored
/// through client `a` (gathered with their checksums into its staging) and
/// loaded through client `b` (another client of the service) into `b`'s
/// blocks in reverse order, layer by layer: each layer's copy is queued
/// with a mark a compute stream waits on (a GPU event when `gpu`, else the
/// double's), and its bytes are what `a` held.
pub fn round_trip_between(
    a: (&dyn KvRig, &dyn TierApi),
    b: (&dyn KvRig, &dyn TierApi),
    first: u64,
    n: u32,
    gpu: bool,
) {
    let g = a.0.geometry();
    let ks: Vec<u64> = (first..first + n as u64).collect();
    for i in 0..n {
        fill(a.0, i, seed_of(first + i as u64));
    }
    let s =
        a.1.submit_store(&keys(&ks), &(0..n).collect::<Vec<_>>())
            .unwrap();
    a.1.flush_stores().unwrap();
    let r = a.1.wait(s).unwrap();
    assert!(r.all_ok(), "{r:?}");
    b.0.clear();
    assert_eq!(b.1.lookup_and_pin(&keys(&ks)), n as usize);
    let into: Vec<u32> = (0..n).map(|i| b.0.num_blocks() - 1 - i).collect();
    let j = b.1.submit_load(&keys(&ks), &into, 0..g.layers).unwrap();
    let mut marks = 0;
    for l in 0..g.layers {
        match b
            .1
            .wait_layer_queued_timeout(j, l, Duration::from_secs(60))
            .unwrap()
        {
            Some(LayerCopy::Queued(m)) => {
                assert_eq!(m.is_double(), !gpu, "layer {l}'s mark");
                marks += 1;
            }
            Some(LayerCopy::Settled) => {}
            None => panic!("layer {l}'s copy was never queued"),
        }
        b.1.wait_layer(j, l).unwrap();
        for (i, &blk) in into.iter().enumerate() {
            assert!(
                matches(b.0, blk, seed_of(ks[i]), l..l + 1),
                "layer {l} of key {} in block {blk}",
                ks[i]
            );
        }
    }
    assert!(b.1.wait(j).unwrap().all_ok());
    b.1.unpin(&keys(&ks));
    eprintln!(
        "{marks} of {} layers waited for by their copy mark",
        g.layers
    );
}
