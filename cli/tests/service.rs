//! `kvtier serve` with real client processes: two engines sharing one pool,
//! lookups hammered while loads run, clients and the service killed with
//! SIGKILL, hostile clients, and SIGTERM.
//!
//! The service is the `kvtier` binary; client processes are this test
//! binary re-run with `KVTIER_SERVE_CHILD` set (`service_child` below).

#[path = "../../tests/common/mod.rs"]
mod common;

use common::*;
use kvtier::memory::pattern_fill;
use kvtier::service::protocol::{self, Header, Request};
use kvtier::service::ServiceClient;
use kvtier::{ErrorKind, Key};
use std::io::{BufRead, BufReader, Read, Write};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdout, Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

const ENV: &str = "KVTIER_SERVE_CHILD";
const BIN: &str = env!("CARGO_BIN_EXE_kvtier");

// ---------------------------------------------------------------------------
// Blocks: a key's bytes follow from the key.

fn fill(c: &ServiceClient, block: u32, key: u64) {
    let g = c.geometry();
    let mut buf = vec![0u8; g.object_bytes() as usize];
    for l in 0..g.layers {
        for kv in 0..2 {
            pattern_fill(&mut buf, seed_of(key), l, kv);
            c.write_object(block, l, kv, &buf).unwrap();
        }
    }
}

fn layer_matches(c: &ServiceClient, block: u32, key: u64, layer: u32) -> bool {
    let g = c.geometry();
    let mut want = vec![0u8; g.object_bytes() as usize];
    let mut got = vec![0u8; g.object_bytes() as usize];
    (0..2).all(|kv| {
        pattern_fill(&mut want, seed_of(key), layer, kv);
        c.read_object(block, layer, kv, &mut got).unwrap();
        want == got
    })
}

fn keys(range: std::ops::Range<u64>) -> Vec<Key> {
    range.map(Key::from_u64).collect()
}

/// Store keys `first..first + n` in chunks of the client's blocks; each
/// key is reported to `ack` once its store's result says it is durable.
fn store_range(
    c: &ServiceClient,
    first: u64,
    n: u64,
    mut ack: impl FnMut(u64),
) -> kvtier::Result<()> {
    let per = (c.memory_blocks() as u64).min(16);
    let mut k = first;
    while k < first + n {
        let m = per.min(first + n - k);
        for i in 0..m {
            fill(c, i as u32, k + i);
        }
        let blocks: Vec<u32> = (0..m as u32).collect();
        let job = c.submit_store(&keys(k..k + m), &blocks)?;
        let r = c.wait(job)?;
        for (i, o) in r.outcomes.iter().enumerate() {
            assert!(o.is_ok(), "key {} not stored: {o:?}", k + i as u64);
            ack(k + i as u64);
        }
        k += m;
    }
    Ok(())
}

/// Load keys `first..first + n` (all present) layer by layer, checking each
/// layer's bytes as its event arrives. The number of wrong blocks.
fn load_range(c: &ServiceClient, first: u64, n: u64) -> kvtier::Result<u64> {
    let per = c.memory_blocks() as u64;
    let layers = c.geometry().layers;
    let mut bad = 0;
    let mut k = first;
    while k < first + n {
        let m = per.min(first + n - k);
        let ks = keys(k..k + m);
        let found = c.lookup_and_pin(&ks);
        assert_eq!(found as u64, m, "keys {k}.. not all found");
        let blocks: Vec<u32> = (0..m as u32).collect();
        let job = c.submit_load(&ks, &blocks, 0..layers)?;
        for l in 0..layers {
            c.wait_layer(job, l)?;
            bad += (0..m)
                .filter(|&i| !layer_matches(c, i as u32, k + i, l))
                .count() as u64;
        }
        let r = c.wait(job)?;
        assert!(r.all_ok(), "{r:?}");
        c.unpin(&ks);
        k += m;
    }
    Ok(bad)
}

// ---------------------------------------------------------------------------
// The child

/// Entry point of a client process: `ROLE;SOCKET;FIRST;COUNT`.
#[test]
fn service_child() {
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
    if role == "pin-only" {
        // A scheduler's connection: lookup-only, pins, then waits to be killed.
        let c = ServiceClient::connect_lookup_only(sock).unwrap();
        say(format!(
            "PINNED {}",
            c.lookup_and_pin(&keys(first..first + n))
        ));
        std::thread::sleep(Duration::from_secs(600));
        return;
    }
    if role == "connect" {
        match ServiceClient::connect(sock, 0) {
            Ok(_) => say("CONNECTED".into()),
            Err(e) => say(format!("REFUSED {e}")),
        }
        return;
    }
    let c = connect_retrying(sock);
    match role {
        // Store, then stay alive until stdin closes.
        "store" => {
            store_range(&c, first, n, |k| say(format!("ACK {k}"))).unwrap();
            say("STORED".into());
            let mut line = String::new();
            let _ = std::io::stdin().read_line(&mut line);
        }
        // Store until the service goes away.
        "store-until-gone" => match store_range(&c, first, n, |k| say(format!("ACK {k}"))) {
            Ok(()) => say("STORED".into()),
            Err(e) => say(format!("GONE {:?} {e}", e.kind())),
        },
        "load" => {
            let bad = load_range(&c, first, n).unwrap();
            say(format!("LOADED {n} BAD {bad}"));
        }
        // Pin and start a load, then wait to be killed.
        "pin-load" => {
            let ks = keys(first..first + n);
            say(format!("PINNED {}", c.lookup_and_pin(&ks)));
            let blocks: Vec<u32> = (0..n as u32).collect();
            c.submit_load(&ks, &blocks, 0..c.geometry().layers).unwrap();
            say("LOADING".into());
            std::thread::sleep(Duration::from_secs(600));
        }
        // Submit a store, then wait to be killed.
        "store-then-die" => {
            for i in 0..n {
                fill(&c, i as u32, first + i);
            }
            let blocks: Vec<u32> = (0..n as u32).collect();
            c.submit_store(&keys(first..first + n), &blocks).unwrap();
            say("SUBMITTED".into());
            std::thread::sleep(Duration::from_secs(600));
        }
        // Only connect (run under another uid by the parent).
        "connect" => unreachable!("handled before connecting"),
        r => panic!("unknown role {r}"),
    }
}

/// Connect, retrying while every client slot is taken (a killed client's
/// slot comes back once its jobs end).
fn connect_retrying(sock: &Path) -> ServiceClient {
    let t0 = Instant::now();
    loop {
        match ServiceClient::connect(sock, 0) {
            Ok(c) => return c,
            Err(e)
                if e.kind() == ErrorKind::Backpressure
                    && t0.elapsed() < Duration::from_secs(30) =>
            {
                std::thread::sleep(Duration::from_millis(50))
            }
            Err(e) => panic!("connecting to {}: {e}", sock.display()),
        }
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
                "service_child",
                "--nocapture",
                "--test-threads=1",
            ])
            .env(ENV, format!("{role};{};{first};{n}", sock.display()))
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .unwrap();
        let out = BufReader::new(child.stdout.take().unwrap());
        ClientProc { child, out }
    }

    /// Lines until one starting with `prefix` (returned); panics at EOF.
    fn until(&mut self, prefix: &str, mut each: impl FnMut(&str)) -> String {
        loop {
            let mut line = String::new();
            if self.out.read_line(&mut line).unwrap() == 0 {
                panic!("client ended before printing {prefix}");
            }
            // libtest's "test service_child ... " starts the first line.
            let line = line.trim_end();
            let line = line
                .rsplit_once("test service_child ... ")
                .map_or(line, |(_, l)| l)
                .to_string();
            if line.starts_with(prefix) {
                return line;
            }
            each(&line);
        }
    }

    fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    fn finish(mut self) -> bool {
        drop(self.child.stdin.take());
        self.child.wait().unwrap().success()
    }
}

impl Drop for ClientProc {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

// ---------------------------------------------------------------------------
// The service

struct Serve {
    child: Child,
    sock: PathBuf,
    log: PathBuf,
}

impl Serve {
    fn start(dir: &TempDir, capacity: u64, clients: u32, client_blocks: u32) -> Serve {
        Serve::start_with(dir, capacity, clients, client_blocks, &[])
    }

    fn start_with(
        dir: &TempDir,
        capacity: u64,
        clients: u32,
        client_blocks: u32,
        extra: &[&str],
    ) -> Serve {
        let cfg = tiny_config(dir);
        let sock = dir.file("kvtier.sock");
        let log = dir.file(&format!(
            "serve-{}.log",
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .unwrap()
                .as_nanos()
        ));
        let child = Command::new(BIN)
            .args(["serve", "--dir"])
            .arg(dir.file("pool"))
            .args(["--capacity", &capacity.to_string(), "--model"])
            .arg(&cfg)
            .arg("--socket")
            .arg(&sock)
            .args(["--clients", &clients.to_string()])
            .args(["--client-blocks", &client_blocks.to_string()])
            .args(extra)
            .stderr(std::fs::File::create(&log).unwrap())
            .spawn()
            .unwrap();
        let s = Serve { child, sock, log };
        let t0 = Instant::now();
        while !s.log_text().contains("serving ") {
            if t0.elapsed() > Duration::from_secs(30) {
                panic!("kvtier serve did not start: {}", s.log_text());
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        s
    }

    fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// Wait until the log has `needle` (a line the service writes after
    /// something happened on another thread).
    fn wait_log(&self, needle: &str) {
        let t0 = Instant::now();
        while !self.log_text().contains(needle) {
            assert!(
                t0.elapsed() < Duration::from_secs(20),
                "no {needle:?} in the service log:\n{}",
                self.log_text()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    fn kill9(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    fn sigterm(&mut self) -> std::process::ExitStatus {
        self.signal(nix::sys::signal::Signal::SIGTERM)
    }

    fn signal(&mut self, sig: nix::sys::signal::Signal) -> std::process::ExitStatus {
        nix::sys::signal::kill(nix::unistd::Pid::from_raw(self.child.id() as i32), sig).unwrap();
        self.child.wait().unwrap()
    }
}

impl Drop for Serve {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

const POOL: u64 = 64 << 20;

// ---------------------------------------------------------------------------
// Tests

#[test]
fn two_client_processes_share_one_pool() {
    let dir = TempDir::new("serve-two");
    let s = Serve::start(&dir, POOL, 4, 64);
    use std::os::unix::fs::PermissionsExt;
    let mode = std::fs::metadata(&s.sock).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode, 0o600, "the socket is for this user only");
    let mut a = ClientProc::spawn("store", &s.sock, 0, 100);
    let mut acked = 0;
    a.until("STORED", |l| acked += l.starts_with("ACK ") as u64);
    assert_eq!(acked, 100);
    // A is still connected while B finds and loads its keys.
    let mut b = ClientProc::spawn("load", &s.sock, 0, 100);
    let line = b.until("LOADED", |_| {});
    assert_eq!(line, "LOADED 100 BAD 0");
    assert!(b.finish());
    assert!(a.finish());
    s.wait_log("disconnected");
}

#[test]
fn lookups_hammered_while_loads_run() {
    let dir = TempDir::new("serve-hammer");
    let s = Serve::start(&dir, POOL, 8, 64);
    let writer = ServiceClient::connect(&s.sock, 0).unwrap();
    store_range(&writer, 0, 64, |_| {}).unwrap();
    let loader = ServiceClient::connect(&s.sock, 0).unwrap();
    let lookers: Vec<ServiceClient> = (0..3)
        .map(|_| ServiceClient::connect(&s.sock, 1).unwrap())
        .collect();
    let stop = Arc::new(AtomicBool::new(false));
    let lookups = Arc::new(AtomicU64::new(0));
    let all = keys(0..64);
    let threads: Vec<_> = (0..9)
        .map(|t| {
            let c = lookers[t % 3].clone();
            let (stop, lookups, all) = (stop.clone(), lookups.clone(), all.clone());
            std::thread::spawn(move || {
                while !stop.load(Ordering::Relaxed) {
                    assert_eq!(c.lookup_prefix(&all), 64);
                    assert_eq!(c.lookup_and_pin(&all[..8]), 8);
                    c.unpin(&all[..8]);
                    lookups.fetch_add(2, Ordering::Relaxed);
                }
            })
        })
        .collect();
    let mut loads = 0;
    let t0 = Instant::now();
    while loads < 10 || t0.elapsed() < Duration::from_millis(500) {
        assert_eq!(load_range(&loader, 0, 64).unwrap(), 0);
        loads += 1;
    }
    stop.store(true, Ordering::Relaxed);
    for t in threads {
        t.join().unwrap();
    }
    assert!(
        lookups.load(Ordering::Relaxed) > 100,
        "lookups did not run beside the loads"
    );
    // Every pin the lookers took was dropped: nothing stays pinned.
    writer.close().unwrap();
}

/// A pool of 128 blocks; clients pin, load and store, are killed, and the
/// keys they pinned can be evicted afterwards, their slots reused, and no
/// block they were storing is served with wrong bytes.
#[test]
fn killed_clients_leave_no_pins_and_no_half_blocks() {
    let dir = TempDir::new("serve-kill");
    let geo = tiny_geometry();
    let cap = device_bytes(&geo, kvtier::pool::DEFAULT_GROUP_BLOCKS, 2);
    let s = Serve::start(&dir, cap, 2, 128);
    let me = ServiceClient::connect(&s.sock, 0).unwrap();
    store_range(&me, 0, 128, |_| {}).unwrap();
    assert_eq!(
        me.lookup_prefix(&keys(0..128)),
        128,
        "the pool holds 128 blocks"
    );

    // A client pins every block of the pool, starts loading them, dies.
    let mut p = ClientProc::spawn("pin-load", &s.sock, 0, 128);
    assert_eq!(p.until("PINNED", |_| {}), "PINNED 128");
    p.until("LOADING", |_| {});
    p.kill();
    s.wait_log("disconnected");
    // Its pins are gone: a store of 128 new keys evicts all the old ones.
    store_range(&me, 1000, 128, |_| {}).expect("the killed client's pins were dropped");
    assert_eq!(me.lookup_prefix(&keys(1000..1128)), 128);

    // A client (in the slot the dead one held: there are two) submits a
    // store and dies before its result.
    let mut d = ClientProc::spawn("store-then-die", &s.sock, 2000, 64);
    d.until("SUBMITTED", |_| {});
    d.kill();
    // Its store finishes (its memory lives on in the service) or not; every
    // key of it that the pool serves has exactly its bytes.
    std::thread::sleep(Duration::from_millis(300));
    let present: Vec<u64> = (2000..2064)
        .filter(|&k| me.contains(&Key::from_u64(k)))
        .collect();
    for chunk in present.chunks(64) {
        let ks: Vec<Key> = chunk.iter().map(|&k| Key::from_u64(k)).collect();
        assert_eq!(me.lookup_and_pin(&ks), ks.len());
        let blocks: Vec<u32> = (0..ks.len() as u32).collect();
        let job = me.submit_load(&ks, &blocks, 0..geo.layers).unwrap();
        assert!(me.wait(job).unwrap().all_ok());
        for (i, &k) in chunk.iter().enumerate() {
            for l in 0..geo.layers {
                assert!(layer_matches(&me, i as u32, k, l), "key {k} layer {l}");
            }
        }
        me.unpin(&ks);
    }
    // Its slot came back: a third client connects and stores, and the new
    // keys are all there.
    let mut e = ClientProc::spawn("store", &s.sock, 3000, 128);
    e.until("STORED", |_| {});
    assert!(e.finish());
    assert_eq!(me.lookup_prefix(&keys(3000..3128)), 128);
}

#[test]
fn service_killed_mid_store_keeps_every_acknowledged_store() {
    let dir = TempDir::new("serve-crash");
    let mut s = Serve::start(&dir, POOL, 4, 64);
    let mut w = ClientProc::spawn("store-until-gone", &s.sock, 0, 1500);
    let mut acked = Vec::new();
    while acked.len() < 200 {
        let line = w.until("ACK ", |_| {});
        acked.push(line[4..].parse::<u64>().unwrap());
    }
    s.kill9();
    // The client sees the service go: its waiting call fails as Closed.
    let last = w.until("GONE", |l| {
        if let Some(k) = l.strip_prefix("ACK ") {
            acked.push(k.parse().unwrap());
        }
    });
    assert!(last.contains("Closed"), "{last}");
    drop(w);
    let s = Serve::start(&dir, POOL, 4, 64);
    let c = ServiceClient::connect(&s.sock, 0).unwrap();
    let n = acked.len() as u64;
    assert_eq!(acked, (0..n).collect::<Vec<_>>());
    assert_eq!(
        load_range(&c, 0, n).unwrap(),
        0,
        "a wrong byte after the restart"
    );
}

/// Writes `bytes` on a new connection; true once the service has closed it.
fn dropped_after(sock: &Path, frames: &[Vec<u8>]) -> bool {
    let mut st = UnixStream::connect(sock).unwrap();
    // Well above the service's 10 s hello timeout, which is what drops a
    // peer that never sends a whole hello (the HTTP line): at 10 s too, the
    // two raced, and under a full test run's load this read gave up first.
    st.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
    for f in frames {
        if st.write_all(f).is_err() {
            return true;
        }
    }
    let mut buf = vec![0u8; 1 << 16];
    loop {
        match st.read(&mut buf) {
            Ok(0) => return true,
            Ok(_) => {}
            Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => return true,
            Err(_) => return false,
        }
    }
}

fn hello() -> Vec<u8> {
    Request::Hello {
        version: protocol::VERSION,
        blocks: 0,
        kind: protocol::ClientKind::Memory,
    }
    .encode(1)
    .unwrap()
}

/// The next frame on `st`, decoded.
fn next_response(st: &mut UnixStream) -> protocol::Response {
    let (h, body) = protocol::read_frame(st).unwrap().expect("a frame");
    protocol::Response::decode(h.kind, &body).unwrap()
}

/// A client of the protocol's first version (magic, version 1, blocks) is
/// refused with a frame it can read, naming both versions and the fix, and
/// the service goes on serving.
#[test]
fn a_client_of_another_protocol_version_is_refused_clearly() {
    let dir = TempDir::new("serve-version");
    let s = Serve::start(&dir, POOL, 2, 16);
    let mut v1 = protocol::MAGIC.to_vec();
    v1.extend_from_slice(&1u32.to_le_bytes());
    v1.extend_from_slice(&0u32.to_le_bytes());
    let mut frame = Header {
        body_len: v1.len() as u32,
        kind: 1,
        flags: 0,
        req: 1,
    }
    .encode()
    .to_vec();
    frame.extend_from_slice(&v1);
    let mut st = UnixStream::connect(&s.sock).unwrap();
    st.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    st.write_all(&frame).unwrap();
    match next_response(&mut st) {
        protocol::Response::Refused(f) => {
            let m = f.to_string();
            assert!(
                m.contains("version 1")
                    && m.contains(&format!("version {}", protocol::VERSION))
                    && m.contains("one kvtier release"),
                "{m}"
            );
        }
        other => panic!("a version-1 hello was answered with {other:?}"),
    }
    let mut rest = Vec::new();
    assert_eq!(st.read_to_end(&mut rest).unwrap(), 0, "the connection ends");
    s.wait_log("speaks service protocol version 1");
    let c = ServiceClient::connect(&s.sock, 0).unwrap();
    assert_eq!(c.lookup_prefix(&keys(0..4)), 0);
}

/// The welcome names the pool's namespace and model: a client of the
/// service sees what an in-process handle on the same pool sees.
#[test]
fn service_clients_see_the_pools_namespace_and_model() {
    use kvtier::{HostKvCache, HostLayout, TierApi, TierBuilder};
    let dir = TempDir::new("serve-namespace");
    let mut s = Serve::start(&dir, POOL, 2, 16);
    let data = TierBuilder::default().service(&s.sock).build().unwrap();
    let lookups = TierBuilder::default()
        .service(&s.sock)
        .lookup_only()
        .build()
        .unwrap();
    let served: Vec<(String, String)> = [&data, &lookups]
        .iter()
        .map(|c| (c.namespace().to_string(), c.model_name().to_string()))
        .collect();
    drop((data, lookups));
    assert!(s.sigterm().success());
    // The same pool, opened in-process (the service let go of it): no
    // model or namespace given, so it is the pool's own that it reports.
    let g = tiny_geometry();
    let local = TierBuilder::default()
        .directory(dir.file("pool"))
        .create_mode(kvtier::CreateMode::Never)
        .geometry(g)
        .host_cache(Arc::new(
            HostKvCache::new(g, 4, HostLayout::PerLayer).unwrap(),
        ))
        .build()
        .unwrap();
    let own = (
        TierApi::namespace(&local).to_string(),
        TierApi::model_name(&local).to_string(),
    );
    assert!(!own.0.is_empty() && !own.1.is_empty(), "{own:?}");
    assert_eq!(served, vec![own.clone(), own]);
    local.close().unwrap();
}

/// A lookup-only client (an engine's scheduler) takes no memory and no
/// client slot, is bounded by --lookup-clients, is refused loads and
/// stores (staying connected, the service unharmed), and its pins go when
/// its process is killed.
#[test]
fn lookup_only_clients_share_no_memory_and_lose_their_pins_when_killed() {
    use kvtier::{TierApi, TierBuilder};
    let dir = TempDir::new("serve-lookup-only");
    let geo = tiny_geometry();
    let cap = device_bytes(&geo, kvtier::pool::DEFAULT_GROUP_BLOCKS, 2);
    let s = Serve::start_with(&dir, cap, 1, 128, &["--lookup-clients", "2"]);
    // The one memory slot is taken; lookup-only clients still get in.
    let me = ServiceClient::connect(&s.sock, 0).unwrap();
    store_range(&me, 0, 128, |_| {}).unwrap();
    let lo = TierBuilder::default()
        .service(&s.sock)
        .lookup_only()
        .build()
        .unwrap();
    assert!(lo.is_lookup_only() && TierApi::memory(&lo).is_none());
    assert_eq!(lo.lookup_prefix(&keys(0..128)), 128);
    assert_eq!(lo.lookup_and_pin(&keys(0..4)), 4);
    lo.unpin(&keys(0..4));
    let e = lo.submit_load(&keys(0..1), &[0], 0..1).unwrap_err();
    assert!(e.to_string().contains("lookup-only"), "{e}");
    let e = TierBuilder::default()
        .service(&s.sock)
        .lookup_only()
        .blocks(4)
        .build()
        .unwrap_err();
    assert!(e.to_string().contains("lookup_only"), "{e}");

    // A hostile lookup-only client asks for a load and a store anyway: each
    // is refused with an error, and it stays connected.
    let mut st = UnixStream::connect(&s.sock).unwrap();
    st.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    let hello_lo = Request::Hello {
        version: protocol::VERSION,
        blocks: 0,
        kind: protocol::ClientKind::LookupOnly,
    }
    .encode(1)
    .unwrap();
    st.write_all(&hello_lo).unwrap();
    match next_response(&mut st) {
        protocol::Response::Welcome {
            blocks, file_bytes, ..
        } => assert_eq!((blocks, file_bytes), (0, 0)),
        other => panic!("{other:?}"),
    }
    let load = Request::SubmitLoad {
        keys: keys(0..2),
        blocks: vec![0, 1],
        layers: 0..geo.layers,
    };
    let store = Request::SubmitStore {
        keys: keys(500..502),
        blocks: vec![0, 1],
    };
    for (i, r) in [load, store].iter().enumerate() {
        st.write_all(&r.encode(2 + i as u64).unwrap()).unwrap();
        match next_response(&mut st) {
            protocol::Response::Refused(f) => {
                assert!(f.to_string().contains("lookup-only"), "{f}")
            }
            other => panic!("{other:?}"),
        }
    }
    st.write_all(&Request::Lookup(keys(0..8)).encode(9).unwrap())
        .unwrap();
    assert!(matches!(
        next_response(&mut st),
        protocol::Response::Count(8)
    ));
    assert_eq!(me.lookup_prefix(&keys(500..502)), 0, "nothing was stored");
    // Two lookup-only clients are connected: a third is refused, clearly.
    let e = ServiceClient::connect_lookup_only(&s.sock).unwrap_err();
    assert!(e.to_string().contains("lookup_clients"), "{e}");
    drop(st);
    drop(lo);

    // A scheduler process pins every block of the pool and is killed: its
    // pins go, so a store of 128 new keys can evict them all.
    let t0 = Instant::now();
    let mut p = loop {
        let mut p = ClientProc::spawn("pin-only", &s.sock, 0, 128);
        // Its place comes back once the service has seen the two go.
        match std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| p.until("PINNED", |_| {}))) {
            Ok(line) => {
                assert_eq!(line, "PINNED 128");
                break p;
            }
            Err(_) if t0.elapsed() < Duration::from_secs(20) => {
                p.kill();
                std::thread::sleep(Duration::from_millis(100));
            }
            Err(_) => panic!("the pin-only client never connected"),
        }
    };
    assert!(
        !stored_all(&me, 1000, 16),
        "a pinned block was evicted while the scheduler lived"
    );
    assert_eq!(me.lookup_prefix(&keys(0..128)), 128);
    p.kill();
    let t0 = Instant::now();
    // Its pins are dropped once the service sees it gone.
    while !(1000..1128).step_by(16).all(|k| stored_all(&me, k, 16)) {
        assert!(
            t0.elapsed() < Duration::from_secs(20),
            "the killed scheduler's pins were not dropped"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    assert_eq!(me.lookup_prefix(&keys(1000..1128)), 128);
    assert_eq!(me.lookup_prefix(&keys(0..1)), 0);
}

/// Store keys `first..first + n` (n up to the client's blocks); whether
/// every one was stored (a full pool of pinned blocks refuses them).
fn stored_all(c: &ServiceClient, first: u64, n: u64) -> bool {
    for i in 0..n {
        fill(c, i as u32, first + i);
    }
    let blocks: Vec<u32> = (0..n as u32).collect();
    match c.submit_store(&keys(first..first + n), &blocks) {
        Ok(job) => c.wait(job).is_ok_and(|r| r.all_ok()),
        Err(_) => false,
    }
}

#[test]
fn hostile_clients_are_dropped_and_others_keep_working() {
    let dir = TempDir::new("serve-hostile");
    let s = Serve::start(&dir, POOL, 8, 16);
    let good = ServiceClient::connect(&s.sock, 0).unwrap();
    store_range(&good, 0, 16, |_| {}).unwrap();

    // Not the protocol at all.
    assert!(dropped_after(
        &s.sock,
        &[b"GET / HTTP/1.1\r\nHost: x\r\n\r\n".to_vec()]
    ));
    // A header announcing a 4 GiB body.
    let huge = Header {
        body_len: u32::MAX,
        kind: 2,
        flags: 0,
        req: 1,
    };
    assert!(dropped_after(&s.sock, &[hello(), huge.encode().to_vec()]));
    // A wrong protocol version.
    let mut old = hello();
    old[protocol::HEADER_BYTES + 8] ^= 0xff;
    assert!(dropped_after(&s.sock, &[old]));
    // A load into a block outside the client's memory.
    let claim = Request::SubmitLoad {
        keys: keys(0..1),
        blocks: vec![16 * 8 + 3],
        layers: 0..1,
    }
    .encode(2)
    .unwrap();
    assert!(dropped_after(&s.sock, &[hello(), claim]));
    // An unknown message kind.
    let odd = Header {
        body_len: 0,
        kind: 0x7777,
        flags: 0,
        req: 3,
    };
    assert!(dropped_after(&s.sock, &[hello(), odd.encode().to_vec()]));
    // Truncated: a header, then the connection ends mid-body.
    let mut cut = Request::Lookup(keys(0..4)).encode(4).unwrap();
    cut.truncate(cut.len() - 3);
    {
        let mut st = UnixStream::connect(&s.sock).unwrap();
        st.write_all(&hello()).unwrap();
        st.write_all(&cut).unwrap();
        st.shutdown(std::net::Shutdown::Write).unwrap();
        let mut rest = Vec::new();
        st.read_to_end(&mut rest).unwrap();
    }
    // Stalled: a header, part of the body, then nothing (the connection
    // open): dropped once the body is late, while others are served.
    let stalled = {
        let sock = s.sock.clone();
        std::thread::spawn(move || {
            let t0 = Instant::now();
            assert!(dropped_after(&sock, &[hello(), cut]));
            t0.elapsed()
        })
    };

    s.wait_log("stream ended inside a frame body");
    s.wait_log("larger than the");
    s.wait_log("protocol version");
    s.wait_log("outside the 16 blocks");
    s.wait_log("unknown request kind");
    // The good client never noticed.
    assert_eq!(load_range(&good, 0, 16).unwrap(), 0);
    store_range(&good, 100, 16, |_| {}).unwrap();
    assert_eq!(good.lookup_prefix(&keys(100..116)), 16);
    let took = stalled.join().unwrap();
    assert!(took >= Duration::from_secs(4), "dropped after {took:?}");
    s.wait_log("did not arrive in time");
    // A client asking for more memory than a client gets is refused clearly.
    let e = ServiceClient::connect(&s.sock, 17).unwrap_err();
    assert!(e.to_string().contains("client_blocks"), "{e}");
}

#[test]
fn sigterm_finishes_acknowledged_stores_and_exits_0() {
    let dir = TempDir::new("serve-term");
    let mut s = Serve::start(&dir, POOL, 4, 64);
    let c = ServiceClient::connect(&s.sock, 0).unwrap();
    let mut jobs = Vec::new();
    for j in 0..4u64 {
        for i in 0..16 {
            fill(&c, (j * 16 + i) as u32, j * 16 + i);
        }
        let blocks: Vec<u32> = (j as u32 * 16..j as u32 * 16 + 16).collect();
        jobs.push(c.submit_store(&keys(j * 16..j * 16 + 16), &blocks).unwrap());
    }
    let status = s.sigterm();
    assert!(status.success(), "{status:?}: {}", s.log_text());
    assert!(!s.sock.exists(), "the socket is removed on exit");
    let log = s.log_text();
    assert!(log.contains("SIGTERM received"), "{log}");
    // Every store accepted before SIGTERM finished before the exit.
    for j in jobs {
        let r = c.wait(j).unwrap();
        assert!(r.all_ok(), "{r:?}");
    }
    // After the exit, calls fail as Closed, lookups miss.
    assert_eq!(c.lookup_prefix(&keys(0..1)), 0);
    drop(c);
    let s = Serve::start(&dir, POOL, 4, 64);
    let c = ServiceClient::connect(&s.sock, 0).unwrap();
    assert_eq!(load_range(&c, 0, 64).unwrap(), 0);
}

/// SIGHUP (the terminal or ssh session of a foreground service closed)
/// stops the service as SIGTERM does: the stores it accepted finish, the
/// socket goes, exit 0. It killed the service outright, leaving its
/// socket behind and failing every job in flight as gone.
#[test]
fn sighup_stops_the_service_as_sigterm_does() {
    let dir = TempDir::new("serve-hup");
    let mut s = Serve::start(&dir, POOL, 4, 64);
    let c = ServiceClient::connect(&s.sock, 0).unwrap();
    for i in 0..16 {
        fill(&c, i as u32, 500 + i);
    }
    let job = c
        .submit_store(&keys(500..516), &(0..16).collect::<Vec<_>>())
        .unwrap();
    let status = s.signal(nix::sys::signal::Signal::SIGHUP);
    assert!(status.success(), "{status:?}: {}", s.log_text());
    assert!(!s.sock.exists(), "the socket is removed on exit");
    assert!(s.log_text().contains("SIGHUP received"), "{}", s.log_text());
    assert!(c.wait(job).unwrap().all_ok());
}

/// Runs the `connect` role as `uid`:`gid`; its one line.
fn connect_as(sock: &Path, uid: u32, gid: u32) -> String {
    use std::os::unix::process::CommandExt;
    let out = Command::new(std::env::current_exe().unwrap())
        .args([
            "--exact",
            "service_child",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(ENV, format!("connect;{};0;0", sock.display()))
        .uid(uid)
        .gid(gid)
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    text.lines()
        .map(|l| {
            l.rsplit_once("test service_child ... ")
                .map_or(l, |(_, r)| r)
        })
        .find(|l| l.starts_with("CONNECTED") || l.starts_with("REFUSED"))
        .unwrap_or_else(|| panic!("no answer from the client: {text}"))
        .to_string()
}

/// The socket is this user's only (0600), or a group's (0660 with
/// --group); and a peer of another uid outside the group is refused by its
/// credentials even where the socket's mode would let it connect.
#[test]
fn only_this_user_or_the_named_group_may_connect() {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        eprintln!("skipped: running clients as other users needs root");
        return;
    }
    let dir = TempDir::new("serve-peer");
    let s = Serve::start_with(&dir, POOL, 4, 16, &["--group", "0"]);
    use std::os::unix::fs::{MetadataExt, PermissionsExt};
    let meta = std::fs::metadata(&s.sock).unwrap();
    assert_eq!(meta.permissions().mode() & 0o777, 0o660);
    assert_eq!(meta.gid(), 0);
    // A member of the group connects.
    assert_eq!(connect_as(&s.sock, 65534, 0), "CONNECTED");
    // Anyone else: the socket's mode keeps them out ...
    let line = connect_as(&s.sock, 65534, 65534);
    assert!(
        line.starts_with("REFUSED") && line.contains("Permission denied"),
        "{line}"
    );
    // ... and where it would not, their credentials do.
    std::fs::set_permissions(&s.sock, std::fs::Permissions::from_mode(0o666)).unwrap();
    let line = connect_as(&s.sock, 65534, 65534);
    assert!(line.starts_with("REFUSED"), "{line}");
    s.wait_log("uid 65534: not this service's uid (0) nor in group 0");
}

// ---------------------------------------------------------------------------
// `TierBuilder::service`: the handle API of an in-process pool

/// The bytes of memory block `block` (every object, in (layer, K|V) order)
/// of a handle whose memory it knows.
fn block_bytes_of(t: &dyn kvtier::TierApi, block: u32) -> Vec<u8> {
    let m = t.memory().expect("a handle over memory it knows");
    let obj = m.geometry.object_bytes() as usize;
    let mut out = Vec::new();
    for l in 0..m.geometry.layers {
        for kv in 0..2 {
            let a = m.object_addr(block, l, kv) as *const u8;
            // SAFETY: one object inside the handle's memory, which lives as
            // long as `t`; no job uses the block (the caller waited).
            out.extend_from_slice(unsafe { std::slice::from_raw_parts(a, obj) });
        }
    }
    out
}

fn fill_through(t: &dyn kvtier::TierApi, block: u32, key: u64) {
    let m = t.memory().expect("a handle over memory it knows");
    let mut buf = vec![0u8; m.geometry.object_bytes() as usize];
    for l in 0..m.geometry.layers {
        for kv in 0..2 {
            pattern_fill(&mut buf, seed_of(key), l, kv);
            let a = m.object_addr(block, l, kv) as *mut u8;
            // SAFETY: as in block_bytes_of; no job uses the block yet.
            unsafe { std::ptr::copy_nonoverlapping(buf.as_ptr(), a, buf.len()) };
        }
    }
}

/// One script of handle calls, the same on any `TierApi`: store 8 keys,
/// look them up, pin, load them back layer by layer into other blocks
/// (watching the event stream), remove one. Returns the loaded bytes.
fn exercise(t: &dyn kvtier::TierApi) -> Vec<u8> {
    use kvtier::{Event, JobKind};
    let layers = t.geometry().layers;
    assert!(t.memory_blocks() >= 16, "{}", t.memory_blocks());
    let events = t.completions().unwrap();
    let ks = keys(0..8);
    for i in 0..8 {
        fill_through(t, i, i as u64);
    }
    assert_eq!(t.lookup_prefix(&ks), 0);
    let store = t.submit_store(&ks, &(0..8).collect::<Vec<_>>()).unwrap();
    t.flush_stores().unwrap();
    let r = t.wait(store).unwrap();
    assert!(r.all_ok(), "{r:?}");
    assert_eq!(r.kind, JobKind::Store);
    assert_eq!(r.keys, ks);
    // A result is handed out once.
    let again = t.try_result(store).unwrap_err();
    assert_eq!(again.kind(), ErrorKind::Usage, "{again}");
    assert_eq!(t.memory_block_use(0), None);
    assert_eq!(t.lookup_prefix(&ks), 8);
    assert!(t.contains(&Key::from_u64(3)));
    assert!(!t.contains(&Key::from_u64(99)));
    assert_eq!(t.lookup_and_pin(&keys(0..10)), 8);
    let dst: Vec<u32> = (8..16).rev().collect();
    let load = t.submit_load(&ks, &dst, 0..layers).unwrap();
    // Out of range and mismatched jobs are refused before anything runs.
    let e = t
        .submit_load(&ks[..1], &[t.memory_blocks()], 0..1)
        .unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Usage, "{e}");
    for l in 0..layers {
        t.wait_layer(load, l).unwrap();
    }
    assert!(t.wait_layer_timeout(load, 0, Duration::ZERO).unwrap());
    // Host memory: no GPU counter to wait on, in-process or not.
    assert!(t.load_counter(load).unwrap().is_none());
    let r = loop {
        if let Some(r) = t.wait_timeout(load, Duration::from_millis(10)).unwrap() {
            break r;
        }
    };
    assert!(r.all_ok(), "{r:?}");
    assert!(t.get_finished().is_empty());
    t.unpin(&keys(0..10));
    // Every layer's event, then the job's, on the stream and its eventfd.
    let mut seen = Vec::new();
    let t0 = Instant::now();
    while seen.len() < layers as usize + 2 && t0.elapsed() < Duration::from_secs(10) {
        seen.extend(events.recv_timeout(Duration::from_millis(50)));
    }
    let layer_events = seen
        .iter()
        .filter(|e| matches!(e, Event::Layer { job, error: None, .. } if *job == load))
        .count();
    assert_eq!(layer_events, layers as usize, "{seen:?}");
    assert!(seen.contains(&Event::Finished {
        job: load,
        kind: JobKind::Load,
        ok: true
    }));
    assert!(seen.contains(&Event::Finished {
        job: store,
        kind: JobKind::Store,
        ok: true
    }));
    let loaded: Vec<u8> = dst.iter().flat_map(|&b| block_bytes_of(t, b)).collect();
    assert_eq!(t.remove(&ks[7..]).unwrap(), 1);
    assert_eq!(t.lookup_prefix(&ks), 7);
    let usage: serde_json::Value = serde_json::from_str(&t.usage_json().unwrap()).unwrap();
    assert!(usage["tier"].is_object(), "{usage}");
    assert!(!t.engine().is_empty() && !t.engine_reason().is_empty());
    loaded
}

#[test]
fn builder_service_gives_the_handle_api_of_an_in_process_pool() {
    use kvtier::{HostKvCache, HostLayout, TierApi, TierBuilder};
    let dir = TempDir::new("serve-builder");
    let s = Serve::start(&dir, POOL, 4, 32);
    let client = TierBuilder::default()
        .service(&s.sock)
        .blocks(16)
        .build()
        .unwrap();
    let g = *client.geometry();
    let cache = Arc::new(HostKvCache::new(g, 16, HostLayout::PerLayer).unwrap());
    let local = TierBuilder::default()
        .directory(dir.file("own-pool"))
        .capacity(POOL)
        .geometry(g)
        .model_name("tiny")
        .host_cache(cache)
        .build()
        .unwrap();
    // The same script through one API: the bytes each side loads are equal,
    // and are the bytes stored.
    let handles: [&dyn TierApi; 2] = [&local, &client];
    let [a, b] = handles.map(exercise);
    assert!(a == b, "a service load differs from an in-process one");
    let want: Vec<u8> = (8..16)
        .rev()
        .flat_map(|b| {
            let key = (15 - b) as u64;
            (0..g.layers).flat_map(move |l| {
                (0..2).flat_map(move |kv| {
                    let mut o = vec![0u8; g.object_bytes() as usize];
                    pattern_fill(&mut o, seed_of(key), l, kv);
                    o
                })
            })
        })
        .collect();
    assert!(a == want, "the loaded bytes are not the stored ones");
    assert!(client.in_process().is_none() && local.in_process().is_some());
    assert!(client.engine_reason().contains("kvtier service"));
    TierApi::close(&client).unwrap();
    TierApi::close(&local).unwrap();
}

#[test]
fn builder_service_refuses_what_the_service_decides() {
    use kvtier::{CreateMode, HostKvCache, HostLayout, KvGeometry, TierBuilder};
    let dir = TempDir::new("serve-conflicts");
    let s = Serve::start(&dir, POOL, 4, 32);
    let e = TierBuilder::default()
        .directory(dir.file("mine"))
        .capacity(POOL)
        .create_mode(CreateMode::Never)
        .service(&s.sock)
        .build()
        .unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Usage, "{e}");
    let text = e.to_string();
    for call in [
        "directory(..)",
        "capacity(..)",
        "create_mode(..)",
        "service(",
    ] {
        assert!(text.contains(call), "{call} not named: {text}");
    }
    let g = *TierBuilder::default()
        .service(&s.sock)
        .build()
        .unwrap()
        .geometry();
    let cache = Arc::new(HostKvCache::new(g, 4, HostLayout::PerLayer).unwrap());
    let e = TierBuilder::default()
        .host_cache(cache)
        .tp_rank(1)
        .service(&s.sock)
        .build()
        .unwrap_err();
    let text = e.to_string();
    assert!(
        text.contains("host_cache(..)") && text.contains("tp_rank(..)"),
        "{text}"
    );
    // The geometry asked for is checked against the one served.
    let other = KvGeometry {
        layers: g.layers + 1,
        ..g
    };
    let e = TierBuilder::default()
        .geometry(other)
        .service(&s.sock)
        .build()
        .unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Usage, "{e}");
    assert!(e.to_string().contains("serves"), "{e}");
    // The served geometry, given before or after service(..), is accepted.
    TierBuilder::default()
        .geometry(g)
        .service(&s.sock)
        .build()
        .unwrap();
    TierBuilder::default()
        .service(&s.sock)
        .geometry(g)
        .blocks(4)
        .build()
        .unwrap();
}

/// Threads of process `pid` now.
fn threads_of(pid: u32) -> usize {
    std::fs::read_dir(format!("/proc/{pid}/task"))
        .unwrap()
        .count()
}

/// Connections that never say hello wait in the accept loop's poll, not on
/// a thread each, hold up nobody, and are closed at the hello's deadline.
#[test]
fn silent_connections_take_no_thread() {
    let dir = TempDir::new("serve-silent");
    let s = Serve::start(&dir, POOL, 4, 16);
    let pid = s.child.id();
    let before = threads_of(pid);
    let silent: Vec<UnixStream> = (0..40)
        .map(|_| UnixStream::connect(&s.sock).unwrap())
        .collect();
    // A client that does say hello is served meanwhile.
    let c = ServiceClient::connect(&s.sock, 0).unwrap();
    store_range(&c, 0, 4, |_| {}).unwrap();
    assert_eq!(c.lookup_prefix(&keys(0..4)), 4);
    let during = threads_of(pid);
    // The one client's reader and writer; not one per silent connection.
    assert!(during <= before + 4, "{before} threads, then {during}");
    drop(c);
    s.wait_log("disconnected");
    // Past the hello's deadline the service closes them.
    s.wait_log("sent no hello within");
    let mut last = &silent[39];
    let mut buf = [0u8; 1];
    assert_eq!(last.read(&mut buf).unwrap(), 0, "closed by the service");
}

/// Connections that send part of a hello and stall wait in the accept
/// loop's poll too: before, each got a thread of its own as soon as its
/// first byte came (a peer made thousands), and a client that says hello
/// meanwhile is served at once.
#[test]
fn stalled_hellos_take_no_thread_and_hold_up_nobody() {
    let dir = TempDir::new("serve-stalled-hello");
    let s = Serve::start(&dir, POOL, 4, 16);
    let pid = s.child.id();
    let before = threads_of(pid);
    let h = hello();
    let stalled: Vec<UnixStream> = (0..200)
        .map(|i| {
            let mut st = UnixStream::connect(&s.sock).unwrap();
            st.write_all(&h[..1 + i % (h.len() - 1)]).unwrap();
            st
        })
        .collect();
    let t0 = Instant::now();
    let c = ServiceClient::connect(&s.sock, 0).unwrap();
    store_range(&c, 0, 4, |_| {}).unwrap();
    assert_eq!(c.lookup_prefix(&keys(0..4)), 4);
    assert!(t0.elapsed() < Duration::from_secs(5), "{:?}", t0.elapsed());
    let during = threads_of(pid);
    // The one client's reader and writer; not one per stalled hello.
    assert!(during <= before + 4, "{before} threads, then {during}");
    // Past the hello's deadline the service closes them.
    s.wait_log("sent no hello within");
    let mut last = &stalled[199];
    let mut buf = [0u8; 1];
    last.set_read_timeout(Some(Duration::from_secs(10)))
        .unwrap();
    assert_eq!(last.read(&mut buf).unwrap(), 0, "closed by the service");
}

/// A client that stops inside a frame's header is dropped once the header
/// is late, as one inside a body is (it held its reader thread and its
/// slot for as long as it lived).
#[test]
fn a_client_stalled_inside_a_frame_header_is_dropped() {
    let dir = TempDir::new("serve-stalled-header");
    let s = Serve::start(&dir, POOL, 4, 16);
    let lookup = Request::Lookup(keys(0..4)).encode(2).unwrap();
    let t0 = Instant::now();
    assert!(dropped_after(&s.sock, &[hello(), lookup[..7].to_vec()]));
    let took = t0.elapsed();
    assert!(took >= Duration::from_secs(4), "dropped after {took:?}");
    s.wait_log("header did not arrive in time");
}

/// Client memory the machine cannot hold is refused at start, naming the
/// settings to lower, before a pool is made: the engine pins the whole
/// arena, and 64 clients of 65536 blocks of an 8B model (8 TiB) grew the
/// service to 23 GiB until the OOM killer ended it.
#[test]
fn client_memory_past_the_machines_is_refused_at_start() {
    let dir = TempDir::new("serve-huge-arena");
    let pool = dir.file("pool");
    let mut child = Command::new(env!("CARGO_BIN_EXE_kvtier"))
        .args([
            "serve",
            "--dir",
            pool.to_str().unwrap(),
            "--capacity",
            "200m",
        ])
        .args(["--socket", dir.file("s.sock").to_str().unwrap()])
        .args(["--clients", "64", "--client-blocks", "65536"])
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let t0 = Instant::now();
    let code = loop {
        if let Some(st) = child.try_wait().unwrap() {
            break st.code();
        }
        if t0.elapsed() > Duration::from_secs(10) {
            let _ = child.kill();
            let _ = child.wait();
            panic!("the service started with 8 TiB of client memory");
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    let mut err = String::new();
    child
        .stderr
        .take()
        .unwrap()
        .read_to_string(&mut err)
        .unwrap();
    assert_eq!(code, Some(2), "{err}");
    assert!(
        err.contains("64 clients x 65536 blocks")
            && err.contains("available")
            && err.contains("fewer clients or client blocks"),
        "{err}"
    );
    assert!(
        !pool.exists(),
        "no pool is made for a service that cannot start"
    );
}

/// Peak resident memory of process `pid`, bytes.
fn peak_rss_of(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let kib: u64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.split_whitespace().next())
        .and_then(|v| v.parse().ok())
        .unwrap();
    kib << 10
}

/// A client's pins go in one step per key when it leaves, however many
/// times it pinned each: the service listed every pin, so a key pinned
/// 2 million times (a few seconds of 65536-key requests) took 100 MB and
/// more at the disconnect, and 100 million 4.8 GB.
#[test]
fn a_clients_many_pins_of_one_key_cost_nothing_to_drop() {
    let dir = TempDir::new("serve-pins");
    let s = Serve::start(&dir, POOL, 2, 16);
    let c = ServiceClient::connect(&s.sock, 0).unwrap();
    store_range(&c, 0, 1, |_| {}).unwrap();
    let pinner = ServiceClient::connect_lookup_only(&s.sock).unwrap();
    let same = vec![Key::from_u64(0); protocol::MAX_KEYS];
    for _ in 0..32 {
        assert_eq!(pinner.lookup_and_pin(&same), protocol::MAX_KEYS);
    }
    let before = peak_rss_of(s.child.id());
    drop(pinner);
    let t0 = Instant::now();
    while pinned_blocks(&c) != 0 {
        assert!(t0.elapsed() < Duration::from_secs(20), "the pins stayed");
        std::thread::sleep(Duration::from_millis(20));
    }
    let grew = peak_rss_of(s.child.id()).saturating_sub(before);
    assert!(grew < 32 << 20, "the disconnect took {} MiB", grew >> 20);
}

/// A socket path in a directory that is not there is refused before the
/// pool is opened: the bind failed only after a pool had been created for
/// a service that never ran.
#[test]
fn a_socket_in_a_missing_directory_is_refused_before_a_pool_is_made() {
    let dir = TempDir::new("serve-nosockdir");
    let pool = dir.file("pool");
    // `kvtier serve` on a small pool in `pool` at socket path `socket`.
    let serve = |socket: &std::path::Path| {
        let out = Command::new(BIN)
            .args([
                "serve",
                "--dir",
                pool.to_str().unwrap(),
                "--capacity",
                "64m",
            ])
            .arg("--model")
            .arg(tiny_config(&dir))
            .arg("--socket")
            .arg(socket)
            .output()
            .unwrap();
        (
            out.status.code(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    };
    let (code, err) = serve(&dir.file("missing/kvtier.sock"));
    assert_eq!(code, Some(2), "{err}");
    assert!(
        err.contains("missing") && err.contains("create it, or give the service a socket path"),
        "{err}"
    );
    assert!(
        !pool.exists(),
        "a pool was made for a service that cannot start"
    );
    // A path longer than a Unix socket address holds: refused naming the
    // limit, before any pool is made, and by a client alike (both said
    // "path must be shorter than SUN_LEN", the service after making its pool).
    let long = dir.file(&"s".repeat(120));
    let (code, err) = serve(&long);
    assert_eq!(code, Some(2), "{err}");
    assert!(
        err.contains("at most 107") && err.contains("give a shorter one"),
        "{err}"
    );
    assert!(
        !pool.exists(),
        "a pool was made for a service that cannot start"
    );
    let Err(e) = ServiceClient::connect(&long, 0) else {
        panic!("connected to no service")
    };
    assert!(e.to_string().contains("at most 107"), "{e}");
}

/// A pool made over several files in its directory (`pool create --dir
/// --files 2`) is the one `serve --dir` opens: serve has no --files, and
/// refused it as "the pool has 2 device(s) but 1 were named".
#[test]
fn serve_opens_a_pool_directory_of_several_files() {
    let dir = TempDir::new("serve-files");
    let cfg = tiny_config(&dir);
    let out = Command::new(BIN)
        .args(["pool", "create", "--dir"])
        .arg(dir.file("pool"))
        .args(["--files", "2", "--capacity", &POOL.to_string(), "--model"])
        .arg(&cfg)
        .output()
        .unwrap();
    assert!(out.status.success(), "{out:?}");
    let s = Serve::start(&dir, POOL, 2, 16);
    let c = ServiceClient::connect(&s.sock, 0).unwrap();
    store_range(&c, 0, 16, |_| {}).unwrap();
    assert_eq!(load_range(&c, 0, 16).unwrap(), 0);
}

/// `--tp-size N`: the pool holds one TP rank's shard (the KV heads / N);
/// a size that neither splits nor evenly replicates the heads is refused.
#[test]
fn tp_size_serves_one_ranks_shard() {
    let dir = TempDir::new("serve-tp");
    // One head of 64 bf16 per token: 32-token blocks fill a 4 KiB object.
    let s = Serve::start_with(&dir, POOL, 2, 8, &["--tp-size", "2", "--block-size", "32"]);
    let c = ServiceClient::connect(&s.sock, 0).unwrap();
    let full = tiny_geometry();
    assert_eq!(c.geometry().kv_heads, full.kv_heads / 2);
    assert_eq!(c.geometry().head_dim, full.head_dim);
    assert_eq!(c.geometry().layers, full.layers);
    drop(c);
    drop(s);
    let out = Command::new(BIN)
        .args(["serve", "--dir"])
        .arg(dir.file("pool3"))
        .args(["--capacity", &POOL.to_string(), "--model"])
        .arg(tiny_config(&dir))
        .arg("--socket")
        .arg(dir.file("tp3.sock"))
        .args(["--tp-size", "3"])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{err}");
    assert!(
        err.contains("--tp-size 3") && err.contains("2 KV heads"),
        "{err}"
    );
    // 16-token blocks hold 4 KiB objects of the whole model but 2 KiB of a
    // rank's shard: the refusal says it is the shard's, and the fix.
    let out = Command::new(BIN)
        .args(["serve", "--dir"])
        .arg(dir.file("pool2"))
        .args(["--capacity", &POOL.to_string(), "--model"])
        .arg(tiny_config(&dir))
        .arg("--socket")
        .arg(dir.file("tp2.sock"))
        .args(["--tp-size", "2", "--block-size", "16"])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{err}");
    assert!(
        err.contains("one rank's shard")
            && err.contains("--tp-size 2")
            && err.contains("block_size that is a multiple of 32"),
        "{err}"
    );
}

/// A service out of file descriptors (EMFILE: a flood of connections, a
/// low LimitNOFILE) leaves a connection queued and its listener readable:
/// the accept loop must pause before trying again, not poll and fail at
/// once in a loop (a core spinning and a log line per failed accept, until
/// a descriptor frees: up to the hello timeout, 10 s, later).
#[test]
fn out_of_file_descriptors_does_not_spin_the_accept_loop() {
    let dir = TempDir::new("serve-emfile");
    let s = Serve::start(&dir, POOL, 2, 8);
    let pid = s.child.id() as libc::pid_t;
    let open = std::fs::read_dir(format!("/proc/{pid}/fd"))
        .unwrap()
        .count() as u64;
    let mut lim = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: prlimit on our own child, with valid pointers: its soft limit
    // leaves room for 4 more descriptors.
    unsafe {
        assert_eq!(
            libc::prlimit(pid, libc::RLIMIT_NOFILE, std::ptr::null(), &mut lim),
            0
        );
        lim.rlim_cur = open + 4;
        assert_eq!(
            libc::prlimit(pid, libc::RLIMIT_NOFILE, &lim, std::ptr::null_mut()),
            0
        );
    }
    // Silent connections take its last descriptors; the rest stay queued.
    let conns: Vec<UnixStream> = (0..12)
        .map(|_| UnixStream::connect(&s.sock).unwrap())
        .collect();
    s.wait_log("accept failed");
    std::thread::sleep(Duration::from_millis(500));
    let failed = s.log_text().matches("accept failed").count();
    assert!(
        failed <= 10,
        "{failed} failed accepts logged within about half a second: the accept loop spins"
    );
    assert!(
        s.log_text().contains("LimitNOFILE"),
        "the refusal names no fix: {:?}",
        s.log_text().lines().find(|l| l.contains("accept failed"))
    );
    drop(conns);
}

/// A client's shared memory is its own: the client that takes a slot next
/// must not share memory with the one that had it. The last one still maps
/// the memfd the service sent it (its process lives on after it
/// disconnected, or was dropped): it could read the next client's KV (a
/// member of --group reading another uid's prompts), or write into a load's
/// layer after the service verified it (bytes the next client then uses,
/// never detected).
#[test]
fn a_slot_given_to_the_next_client_is_not_shared_with_the_last() {
    let dir = TempDir::new("serve-slot-reuse");
    let s = Serve::start(&dir, POOL, 1, 8);
    let a = ServiceClient::connect(&s.sock, 0).unwrap();
    a.close().unwrap();
    s.wait_log("disconnected");
    let b = connect_retrying(&s.sock);
    let obj = b.geometry().object_bytes() as usize;
    let secret = vec![0x5au8; obj];
    b.write_object(0, 0, 0, &secret).unwrap();
    let mut seen = vec![0u8; obj];
    a.read_object(0, 0, 0, &mut seen).unwrap();
    assert!(
        seen != secret,
        "the slot's last client reads (and could write) the next client's KV memory"
    );
    // The engine reaches the new memory, not the pages it registered at
    // start (io_uring's fixed buffers pin those): the next client's stores
    // take its bytes and its loads land where it reads them, whatever the
    // last client writes into its old mapping meanwhile.
    for round in 0..2u64 {
        a.write_object(1, 0, 0, &vec![0xa5u8; obj]).unwrap();
        store_range(&b, 10 * round, 4, |_| {}).unwrap();
        assert_eq!(load_range(&b, 10 * round, 4).unwrap(), 0, "round {round}");
    }
    // And again for a third client of the same slot.
    b.close().unwrap();
    while s.log_text().matches("disconnected").count() < 2 {
        std::thread::sleep(Duration::from_millis(20));
    }
    let c = connect_retrying(&s.sock);
    assert_eq!(load_range(&c, 0, 4).unwrap(), 0);
    let mut seen = vec![0u8; obj];
    b.read_object(0, 0, 0, &mut seen).unwrap();
    c.write_object(0, 0, 0, &secret).unwrap();
    let mut again = vec![0u8; obj];
    b.read_object(0, 0, 0, &mut again).unwrap();
    assert_eq!(seen, again, "the second client sees the third's writes");
}

/// A service that stops answering (SIGSTOP here; a reader stuck on a dead
/// device alike) is a miss to an engine's scheduler, never a hang of its
/// scheduling loop: the own-pool lookup client times out after 2 s
/// (python/kvtier/_vllm_lookup.py); the service client's index calls
/// after 5 s (they waited forever), ending the connection, so the service
/// drops the client's pins once it runs again.
#[test]
fn a_stopped_service_is_a_miss_to_a_lookup_not_a_hang() {
    let dir = TempDir::new("serve-stopped");
    let s = Serve::start(&dir, POOL, 1, 8);
    let c = ServiceClient::connect_lookup_only(&s.sock).unwrap();
    let pid = nix::unistd::Pid::from_raw(s.child.id() as i32);
    nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGSTOP).unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    let t = std::thread::spawn(move || {
        let n = c.lookup_prefix(&keys(0..4));
        tx.send(n).unwrap();
        c
    });
    let answer = rx.recv_timeout(Duration::from_secs(10));
    nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGCONT).unwrap();
    let c = t.join().unwrap();
    assert_eq!(
        answer,
        Ok(0),
        "a lookup on a stopped service still waits after 10 s"
    );
    // That connection is over: its calls fail at once as gone (misses for
    // an adapter, which reconnects); a new one is served.
    let e = c.usage_json().unwrap_err();
    assert_eq!(e.kind(), kvtier::ErrorKind::Closed, "{e}");
    assert!(e.to_string().contains("did not answer"), "{e}");
    let c2 = ServiceClient::connect_lookup_only(&s.sock).unwrap();
    c2.usage_json().unwrap();
}

/// Pins held through the service: blocks of `c`'s pool pinned now.
fn pinned_blocks(c: &ServiceClient) -> u64 {
    let u: serde_json::Value = serde_json::from_str(&c.usage_json().unwrap()).unwrap();
    u["tier"]["pinned_blocks"].as_u64().unwrap()
}

/// An unpin drops only pins its client holds: not another client's pin on
/// the same key stored anew after the first pin's entry left the pool (a
/// remove, or a load that found the block damaged, takes the pins with
/// it). The service's per-client ledger is by key, the pool's pins by
/// entry, so the first client's unpin (or its disconnect) dropped the
/// second's pin, and the block could be evicted under the second's load.
#[test]
fn an_unpin_never_drops_another_clients_pin_on_a_key_stored_anew() {
    let dir = TempDir::new("serve-pin-ledger");
    let s = Serve::start(&dir, POOL, 1, 8);
    let w = ServiceClient::connect(&s.sock, 0).unwrap();
    let first = ServiceClient::connect_lookup_only(&s.sock).unwrap();
    let second = ServiceClient::connect_lookup_only(&s.sock).unwrap();
    store_range(&w, 0, 1, |_| {}).unwrap();
    assert_eq!(first.lookup_and_pin(&keys(0..1)), 1);
    assert_eq!(w.remove(&keys(0..1)).unwrap(), 1);
    store_range(&w, 0, 1, |_| {}).unwrap();
    assert_eq!(second.lookup_and_pin(&keys(0..1)), 1);
    assert_eq!(pinned_blocks(&w), 1);
    first.unpin(&keys(0..1));
    assert_eq!(
        pinned_blocks(&w),
        1,
        "the first client's unpin dropped the second client's pin"
    );
}

/// A lookup longer than one frame (a 1M-token prompt in 16-token blocks
/// is 65,536 keys) is counted in parts, not refused as a miss; pins and
/// unpins of as many keys alike.
#[test]
fn a_lookup_longer_than_one_frame_is_counted() {
    let dir = TempDir::new("serve-long-lookup");
    let s = Serve::start(&dir, POOL, 1, 8);
    let w = ServiceClient::connect(&s.sock, 0).unwrap();
    store_range(&w, 0, 4, |_| {}).unwrap();
    let many = keys(0..(kvtier::service::protocol::MAX_KEYS as u64 + 10));
    assert_eq!(w.lookup_prefix(&many), 4);
    assert_eq!(w.lookup_and_pin(&many), 4);
    assert_eq!(pinned_blocks(&w), 4);
    w.unpin(&many);
    assert_eq!(pinned_blocks(&w), 0);
    // A prefix that crosses a part boundary: every key of the first part
    // must be held for the second to count; here it is not.
    let mut crossing = keys(0..4);
    crossing.extend(keys(
        100..(kvtier::service::protocol::MAX_KEYS as u64 + 100),
    ));
    assert_eq!(w.lookup_prefix(&crossing), 4);
}

/// A client's shared memory can never lose a page under the service: the
/// service refuses the jobs of a client that did not seal its slice
/// against holes once mapped (a hole punched in reserved huge pages faults
/// SIGBUS in the service when none are free, ending every client's
/// service), and kvtier's client seals it, so a hole punched through any
/// descriptor of the file is refused by the kernel.
#[test]
fn a_slice_is_sealed_against_holes_before_any_job_uses_it() {
    let dir = TempDir::new("serve-seal");
    let s = Serve::start(&dir, POOL, 2, 8);
    // A client that never maps (nor seals) the file its welcome carried.
    let mut st = UnixStream::connect(&s.sock).unwrap();
    st.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    st.write_all(&hello()).unwrap();
    assert!(matches!(
        next_response(&mut st),
        protocol::Response::Welcome { .. }
    ));
    let load = Request::SubmitLoad {
        keys: keys(0..1),
        blocks: vec![0],
        layers: 0..1,
    }
    .encode(2)
    .unwrap();
    st.write_all(&load).unwrap();
    match next_response(&mut st) {
        protocol::Response::Refused(f) => {
            assert!(f.to_string().contains("F_SEAL_FUTURE_WRITE"), "{f}")
        }
        other => panic!("a job on an unsealed slice was answered with {other:?}"),
    }
    // kvtier's client: its mapping's file refuses a punched hole.
    let c = ServiceClient::connect(&s.sock, 0).unwrap();
    store_range(&c, 0, 1, |_| {}).unwrap();
    let maps = std::fs::read_to_string("/proc/self/maps").unwrap();
    let line = maps
        .lines()
        .find(|l| l.contains("kvtier-client-"))
        .expect("the client's shared mapping");
    let range = line.split_whitespace().next().unwrap();
    let file = match std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(format!("/proc/self/map_files/{range}"))
    {
        Ok(f) => f,
        Err(e) => {
            eprintln!("SKIP the hole half: /proc/self/map_files needs CAP_SYS_ADMIN ({e})");
            return;
        }
    };
    let r = nix::fcntl::fallocate(
        &file,
        nix::fcntl::FallocateFlags::FALLOC_FL_PUNCH_HOLE
            | nix::fcntl::FallocateFlags::FALLOC_FL_KEEP_SIZE,
        0,
        4096,
    );
    assert_eq!(r, Err(nix::errno::Errno::EPERM), "a hole was punched");
    assert_eq!(load_range(&c, 0, 1).unwrap(), 0);
}
