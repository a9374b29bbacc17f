//! A client's slice goes to its next client only once no job of its uses
//! it, including a job its reader thread is submitting at the moment the
//! dispatcher drops the client for not reading (its queue full): that
//! job's I/O must use the bytes the client gave it, never the placeholder
//! or the next client's memory that the slice is renewed with.

mod common;

use common::{seed_of, TempDir};
use kvtier::memory::pattern_fill;
use kvtier::model::DType;
use kvtier::service::protocol::{self, Request, Response};
use kvtier::service::{Service, ServiceClient, ServiceConfig};
use kvtier::{HostKvCache, HostLayout, Key, KvGeometry, TierBuilder};
use std::io::Write;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::net::UnixStream;
use std::sync::Arc;
use std::time::{Duration, Instant};

fn keys(r: std::ops::Range<u64>) -> Vec<Key> {
    r.map(Key::from_u64).collect()
}

/// Bytes queued for reading on `st`.
fn queued(st: &UnixStream) -> i32 {
    let mut n: libc::c_int = 0;
    // SAFETY: FIONREAD into a c_int on a socket we own.
    assert_eq!(
        unsafe { libc::ioctl(st.as_raw_fd(), libc::FIONREAD, &mut n) },
        0
    );
    n
}

/// A raw client: its welcome's file mapped and sealed, as kvtier's client
/// does; it reads nothing after the welcome.
struct Raw {
    st: UnixStream,
    base: *mut u8,
    layer_stride: u64,
    object_bytes: u64,
}

impl Raw {
    fn connect(sock: &std::path::Path) -> Raw {
        let st = UnixStream::connect(sock).unwrap();
        let hello = Request::Hello {
            version: protocol::VERSION,
            blocks: 0,
            kind: protocol::ClientKind::Memory,
        };
        (&st).write_all(&hello.encode(1).unwrap()).unwrap();
        let mut buf = vec![0u8; 64 << 10];
        let (n, fd) = {
            let mut iov = [std::io::IoSliceMut::new(&mut buf)];
            let mut space = nix::cmsg_space!([RawFd; 1]);
            let msg = nix::sys::socket::recvmsg::<()>(
                st.as_raw_fd(),
                &mut iov,
                Some(&mut space),
                nix::sys::socket::MsgFlags::empty(),
            )
            .unwrap();
            let fd = msg
                .cmsgs()
                .unwrap()
                .find_map(|c| match c {
                    nix::sys::socket::ControlMessageOwned::ScmRights(f) => f.first().copied(),
                    _ => None,
                })
                .expect("the welcome carries the slice's file");
            (msg.bytes, fd)
        };
        // SAFETY: a descriptor just received, ours alone.
        let fd = unsafe { OwnedFd::from_raw_fd(fd) };
        let (h, body) = protocol::read_frame(&mut &buf[..n]).unwrap().unwrap();
        let Response::Welcome {
            geometry,
            layer_stride,
            file_bytes,
            ..
        } = Response::decode(h.kind, &body).unwrap()
        else {
            panic!("no welcome")
        };
        // SAFETY: a shared mapping of the file's whole size.
        let base = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                file_bytes as usize,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                fd.as_raw_fd(),
                0,
            )
        };
        assert_ne!(base, libc::MAP_FAILED);
        let seals = libc::F_SEAL_FUTURE_WRITE | libc::F_SEAL_SEAL;
        // SAFETY: fcntl on our descriptor.
        assert_eq!(
            unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_ADD_SEALS, seals) },
            0
        );
        Raw {
            st,
            base: base as *mut u8,
            layer_stride,
            object_bytes: geometry.object_bytes(),
        }
    }

    fn fill(&self, g: &KvGeometry, block: u32, key: u64) {
        for l in 0..g.layers {
            for kv in 0..2 {
                let at = l as u64 * self.layer_stride
                    + (2 * block as u64 + kv as u64) * self.object_bytes;
                // SAFETY: inside the mapping (block < the slice's blocks).
                let obj = unsafe {
                    std::slice::from_raw_parts_mut(
                        self.base.add(at as usize),
                        self.object_bytes as usize,
                    )
                };
                pattern_fill(obj, seed_of(key), l, kv as u32);
            }
        }
    }
}

#[test]
fn a_store_submitted_as_its_client_is_dropped_keeps_its_bytes() {
    // Objects of 32 KiB: the service hashes a 40-block store (20 MiB) long
    // enough for a load submitted just before it to finish meanwhile.
    let g = KvGeometry {
        layers: 8,
        kv_heads: 8,
        head_dim: 128,
        dtype: DType::BF16,
        block_size: 16,
    };
    let dir = TempDir::new("svc-release");
    let sock = dir.file("kvtier.sock");
    let builder = TierBuilder::default()
        .directory(dir.file("pool"))
        .capacity(256 << 20)
        .geometry(g)
        .model_name("test");
    let cfg = ServiceConfig::new(&sock)
        .with_clients(2)
        .with_client_blocks(48)
        .with_client_queue(1);
    let svc = Service::start(builder, g, cfg).unwrap();
    let handle = svc.handle().clone();
    let stopper = svc.stopper();
    let thread = std::thread::spawn(move || svc.run());

    // Keys 0..4 in the pool, for the load.
    {
        let w = ServiceClient::connect(&sock, 0).unwrap();
        let mut buf = vec![0u8; g.object_bytes() as usize];
        for b in 0..4u32 {
            for l in 0..g.layers {
                for kv in 0..2 {
                    pattern_fill(&mut buf, seed_of(b as u64), l, kv);
                    w.write_object(b, l, kv, &buf).unwrap();
                }
            }
        }
        let j = w.submit_store(&keys(0..4), &[0, 1, 2, 3]).unwrap();
        w.flush_stores().unwrap();
        assert!(w.wait(j).unwrap().all_ok());
    }

    let raw = Raw::connect(&sock);
    const STORED: u64 = 1000;
    const N: u32 = 40;
    for b in 0..N {
        raw.fill(&g, b, STORED + b as u64);
    }
    // Lookups, unread, until the service's writer is blocked on a full
    // socket: its queue (1 frame) is empty then, and the second frame
    // sent to this client after that drops it.
    let mut req = 10;
    let mut last = queued(&raw.st);
    loop {
        (&raw.st)
            .write_all(&Request::Lookup(keys(0..1)).encode(req).unwrap())
            .unwrap();
        req += 1;
        let t = Instant::now();
        while queued(&raw.st) == last && t.elapsed() < Duration::from_millis(200) {
            std::thread::sleep(Duration::from_micros(200));
        }
        let now = queued(&raw.st);
        if now == last {
            break;
        }
        last = now;
        assert!(req < 100_000, "the socket never filled");
    }
    // A load (its answer fills the queue, its first layer event drops the
    // client, its result frees the slice if nothing else is counted), then
    // a store whose submit is hashing when that happens.
    let load = Request::SubmitLoad {
        keys: keys(0..4),
        blocks: vec![44, 45, 46, 47],
        layers: 0..g.layers,
    };
    let store = Request::SubmitStore {
        keys: keys(STORED..STORED + N as u64),
        blocks: (0..N).collect(),
    };
    let mut burst = load.encode(req).unwrap();
    burst.extend(store.encode(req + 1).unwrap());
    (&raw.st).write_all(&burst).unwrap();

    // The store, submitted, finishes (whole or absent); whatever of it the
    // pool holds loads back as the client's bytes.
    let all = keys(STORED..STORED + N as u64);
    let t = Instant::now();
    while handle.lookup_prefix(&all) < N as usize && t.elapsed() < Duration::from_secs(20) {
        std::thread::sleep(Duration::from_millis(20));
    }
    let held = handle.lookup_prefix(&all);
    drop(raw);
    drop(handle);
    stopper.stop();
    thread.join().unwrap().unwrap();
    // The pool, opened in-process: whatever of the store it holds loads
    // back as the client's bytes.
    let cache = Arc::new(HostKvCache::new(g, N, HostLayout::PerLayer).unwrap());
    let local = TierBuilder::default()
        .directory(dir.file("pool"))
        .create_mode(kvtier::CreateMode::Never)
        .geometry(g)
        .host_cache(cache.clone())
        .build()
        .unwrap();
    let n = local.lookup_and_pin(&all);
    eprintln!("{held} of {N} stored keys held, {n} after the restart");
    // Its submit went in before the client was dropped: it finishes whole.
    assert_eq!(n, N as usize, "the dropped client's store is not whole");
    let mut bad = Vec::new();
    {
        let blocks: Vec<u32> = (0..n as u32).collect();
        let j = local.submit_load(&all[..n], &blocks, 0..g.layers).unwrap();
        let res = local.wait(j).unwrap();
        for (i, o) in res.outcomes.iter().enumerate() {
            if !(o.is_ok()
                && cache.block_matches(i as u32, seed_of(STORED + i as u64), 0..g.layers))
            {
                bad.push((i, format!("{o:?}")));
            }
        }
    }
    local.close().unwrap();
    assert!(
        bad.is_empty(),
        "{} of {n} keys of the dropped client's store load wrong: {:?}",
        bad.len(),
        &bad[..bad.len().min(3)]
    );
}
