//! One client's flood is its own backpressure, never another client's: the
//! service's tier holds a bounded number of unfinished jobs and a bounded
//! write backlog for all its clients, and each client may take its share
//! (the total over the service's client slots), so a client that submits
//! stores faster than they finish is refused while the others go on.

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
