//! Several kvtier processes on one pool at once, and SIGKILL of
//! `kvtier pool create`: exactly one creator wins and leaves a valid pool;
//! the others fail with an error naming the file; a killed create leaves a
//! pool or no pool (never an old pool with zeroed data) and running the same
//! command again works; `pool check` racing a writer's death is refused or
//! clean, never "damaged".
//!
//! Iterations: modest by default; `KVTIER_CRASH_ITERS` overrides.

#[path = "../../tests/common/mod.rs"]
mod common;

use common::*;
use kvtier::pool::{Key, OpenExpect, Pool};
use kvtier::tier::{Tier, TierConfig};
use kvtier::{HostKvCache, HostLayout};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::sync::Arc;

/// `kvtier pool create` of the tiny model on `devs`, each `size` bytes.
fn create_cmd(devs: &[&Path], size: u64, cfg: &Path, extra: &[&str]) -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_kvtier"));
    c.args(["pool", "create"]);
    for d in devs {
        c.arg("--dev").arg(d);
    }
    c.args(["--size", &size.to_string(), "--model"])
        .arg(cfg)
        .args(["--block-size", "16", "--group-blocks", "8"])
        .args(extra)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    c
}

fn text(out: &Output) -> String {
    String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr)
}

fn finish(child: Child) -> Output {
    child.wait_with_output().unwrap()
}

/// Kvtier never panics or aborts, whatever it is racing (SIGKILL from the
/// test aside).
fn assert_no_panic(out: &Output, what: &str) {
    use std::os::unix::process::ExitStatusExt;
    let t = text(out);
    assert!(
        !t.contains("panicked") && (out.status.code().is_some() || out.status.signal() == Some(9)),
        "{what}: {t} ({:?})",
        out.status
    );
}

#[test]
fn concurrent_creates_of_one_new_file_leave_one_winner_and_a_valid_pool() {
    let dir = TempDir::new("create-race");
    let cfg = tiny_config(&dir);
    let size = 4 << 20;
    let mut losers = 0;
    for i in 0..crash_iterations(100) {
        let dev = dir.file(&format!("race{i}.pool"));
        let children: Vec<Child> = (0..3)
            .map(|_| create_cmd(&[&dev], size, &cfg, &[]).spawn().unwrap())
            .collect();
        let outs: Vec<Output> = children.into_iter().map(finish).collect();
        let mut winners = 0;
        for out in &outs {
            assert_no_panic(out, "a racing create");
            if out.status.success() {
                winners += 1;
            } else {
                losers += 1;
                let t = text(out);
                // Refused while another creates it, or after: it holds a
                // pool now. Either way the message names the file and why.
                assert!(
                    t.contains(dev.to_str().unwrap())
                        && (t.contains("in use") || t.contains("holds a kvtier pool")),
                    "iteration {i}: a losing create says: {t}"
                );
            }
        }
        assert_eq!(
            winners,
            1,
            "iteration {i}: {:?}",
            outs.iter().map(text).collect::<Vec<_>>()
        );
        let pool =
            Pool::open(std::slice::from_ref(&dev), &OpenExpect::default()).unwrap_or_else(|e| {
                panic!(
                    "iteration {i}: the winner's pool does not open: {e}; {:?}",
                    outs.iter().map(text).collect::<Vec<_>>()
                )
            });
        assert_eq!(pool.index().live(), 0);
        assert!(pool.check(|_, _| {}).unwrap().is_clean());
    }
    eprintln!("{losers} losing creates");
}

/// Keys 0..n stored in a one-device pool of the tiny model, `groups` groups of 8.
fn stored_pool(dir: &TempDir, groups: u64, n: u64) -> PathBuf {
    let geo = tiny_geometry();
    let pool = create_pool(dir, geo, 8, 1, groups);
    let path = pool.paths().remove(0);
    let mut tier = Tier::open(pool, TierConfig::default()).unwrap();
    let cache = Arc::new(HostKvCache::new(geo, n as u32, HostLayout::PerLayer).unwrap());
    tier.register_host_cache(cache.clone()).unwrap();
    for k in 0..n {
        cache.fill_block(k as u32, seed_of(k));
    }
    let ks: Vec<Key> = (0..n).map(Key::from_u64).collect();
    let mem: Vec<u32> = (0..n as u32).collect();
    let job = tier.submit_store(&ks, &mem).unwrap();
    assert!(tier.wait(job).unwrap().all_ok());
    path
}

/// Keys 0..n of the pool at `path`, each with exactly its bytes.
fn assert_keys_whole(path: &Path, n: u64, what: &str) {
    let pool = Pool::open(&[path.to_path_buf()], &OpenExpect::default()).unwrap();
    let geo = *pool.geometry();
    assert!(
        pool.check(|_, _| {}).unwrap().is_clean(),
        "{what}: the old pool checks clean"
    );
    assert_eq!(pool.index().live(), n, "{what}: every old key is live");
    let mut tier = Tier::open(pool, TierConfig::default()).unwrap();
    let cache = Arc::new(HostKvCache::new(geo, n as u32, HostLayout::PerLayer).unwrap());
    tier.register_host_cache(cache.clone()).unwrap();
    let ks: Vec<Key> = (0..n).map(Key::from_u64).collect();
    let mem: Vec<u32> = (0..n as u32).collect();
    let job = tier.submit_load(&ks, &mem, 0..geo.layers).unwrap();
    let r = tier.wait(job).unwrap();
    for k in 0..n {
        assert!(
            r.outcomes[k as usize].is_ok()
                && cache.block_matches(k as u32, seed_of(k), 0..geo.layers),
            "{what}: old key {k} came back other than stored: {:?}",
            r.outcomes[k as usize]
        );
    }
}

/// SIGKILL `kvtier pool create` (plain and `--prewrite`) at random moments,
/// over a new file and (with `--force`) over a populated pool. Afterwards the
/// file holds the old pool with every key whole, the new empty pool, or no
/// pool (refused with an error saying so), and the same command run again
/// makes the pool; without `--force` it may only refuse because the killed
/// command had already finished the pool.
#[test]
fn sigkill_during_create_leaves_a_pool_or_none_and_the_command_works_again() {
    let dir = TempDir::new("create-kill");
    let cfg = tiny_config(&dir);
    let keys = 48;
    let old = stored_pool(&dir, 96, keys);
    let pristine = std::fs::read(&old).unwrap();
    let size = pristine.len() as u64;
    let dev = dir.file("new.pool");
    let mut rng = Rng(0xC0FF_EE00_1234_5678);
    let per_case = crash_iterations(6);
    let mut seen = std::collections::BTreeMap::<String, usize>::new();
    for prewrite in [false, true] {
        for over_pool in [false, true] {
            let mut extra = vec![];
            if prewrite {
                extra.push("--prewrite");
            }
            if over_pool {
                extra.push("--force");
            }
            let path = if over_pool { &old } else { &dev };
            let reset = || {
                if over_pool {
                    std::fs::write(&old, &pristine).unwrap();
                } else {
                    let _ = std::fs::remove_file(&dev);
                }
            };
            // How long the whole command takes here: kills land within it.
            reset();
            let t0 = std::time::Instant::now();
            let out = finish(create_cmd(&[path], size, &cfg, &extra).spawn().unwrap());
            assert!(out.status.success(), "{}", text(&out));
            let full = t0.elapsed();
            for i in 0..per_case {
                let what = format!("prewrite {prewrite}, over a pool {over_pool}, kill {i}");
                reset();
                let mut child = create_cmd(&[path], size, &cfg, &extra).spawn().unwrap();
                let at = full.mul_f64(rng.below(1000) as f64 / 1000.0);
                std::thread::sleep(at);
                let _ = child.kill();
                let out = finish(child);
                assert_no_panic(&out, &what);
                let finished = out.status.success();
                let state = match Pool::open(std::slice::from_ref(path), &OpenExpect::default()) {
                    Ok(p) if over_pool && p.index().live() == keys => {
                        drop(p);
                        assert_keys_whole(path, keys, &what);
                        "old pool"
                    }
                    Ok(p) => {
                        assert_eq!(p.index().live(), 0, "{what}: a new pool is empty");
                        assert!(p.check(|_, _| {}).unwrap().is_clean(), "{what}");
                        "new pool"
                    }
                    Err(e) => {
                        assert!(!finished, "{what}: create said done, yet: {e}");
                        let e = e.to_string();
                        assert!(
                            e.contains(path.to_str().unwrap())
                                && ((e.contains("not a kvtier pool")
                                    && e.contains("did not finish")
                                    && e.contains("again"))
                                    || e.contains("all zero")
                                    || e.contains("does not exist")
                                    || e.contains("it is empty")),
                            "{what}: no pool, but the error does not say so: {e}"
                        );
                        "no pool"
                    }
                };
                *seen.entry(state.to_string()).or_default() += 1;
                // The same command again; where the kill left no pool,
                // without --force: what was there was given up already, and
                // the file says a kvtier create did not finish on it.
                let again_args: Vec<&str> = if state == "no pool" {
                    extra.iter().copied().filter(|a| *a != "--force").collect()
                } else {
                    extra.clone()
                };
                let again = finish(
                    create_cmd(&[path], size, &cfg, &again_args)
                        .spawn()
                        .unwrap(),
                );
                let t = text(&again);
                if state == "new pool" && !over_pool {
                    assert!(
                        again.status.success()
                            || (t.contains("holds a kvtier pool") && t.contains("--force")),
                        "{what}: running it again: {t}"
                    );
                } else {
                    assert!(
                        again.status.success(),
                        "{what} ({state}): running it again: {t}"
                    );
                }
                let p = Pool::open(std::slice::from_ref(path), &OpenExpect::default())
                    .unwrap_or_else(|e| panic!("{what}: after running it again: {e}"));
                assert_eq!(p.index().live(), 0, "{what}");
                assert!(p.check(|_, _| {}).unwrap().is_clean(), "{what}");
            }
        }
    }
    eprintln!("after the kills: {seen:?}");
    assert!(seen.get("no pool").copied().unwrap_or(0) > 0, "{seen:?}");
}

/// The crash writer's entry point when this binary is re-run as the child.
#[test]
fn crash_writer_child() {
    common::crash::child_main()
}

/// `kvtier pool check` (and `--repair`, and `info`) started over and over
/// while a writer stores and is SIGKILLed: each is refused naming the writer
/// while it lives, and clean after; never "damaged", never a panic or hang.
#[test]
fn pool_check_racing_a_writer_and_its_sigkill_is_refused_or_clean() {
    use std::io::{BufRead, BufReader};
    let dir = TempDir::new("check-race");
    let geo = tiny_geometry();
    let pool = create_pool(&dir, geo, 8, 1, 256);
    let devs = pool.paths();
    drop(pool);
    let dev = devs[0].to_str().unwrap().to_string();
    let mut rng = Rng(0x0DDB_A11C_0FFE_E000);
    let (mut refused, mut clean) = (0, 0);
    for i in 0..crash_iterations(6) {
        let mut writer = common::crash::writer_command(&devs, (i as u64 + 1) << 32, 8, 400)
            .spawn()
            .unwrap();
        let pid = writer.id();
        let stdout = writer.stdout.take().unwrap();
        let mut lines = BufReader::new(stdout).lines().map_while(|l| l.ok());
        if !lines.any(|l| l.starts_with("ACK")) {
            use std::io::Read;
            let _ = writer.kill();
            let mut e = String::new();
            let _ = writer.stderr.take().unwrap().read_to_string(&mut e);
            panic!("iteration {i}: the writer acknowledged nothing: {e}");
        }
        let drain = std::thread::spawn(move || lines.count());
        // Past the 300 ms an open waits for a live holder before refusing
        // (a holder may be a forked child's passing copy of a descriptor),
        // so that some checks meet the writer alive.
        let kill_after = std::time::Duration::from_millis(rng.below(1200));
        let killer = std::thread::spawn(move || {
            std::thread::sleep(kill_after);
            writer.kill().unwrap();
            writer.wait().unwrap();
        });
        let mut after_kill = 0;
        let t0 = std::time::Instant::now();
        while after_kill < 2 {
            let done = killer.is_finished();
            let args: &[&str] = match rng.below(3) {
                0 => &["pool", "check"],
                1 => &["pool", "check", "--repair"],
                _ => &["pool", "info"],
            };
            let out = Command::new(env!("CARGO_BIN_EXE_kvtier"))
                .args(args)
                .args(["--dev", &dev])
                .output()
                .unwrap();
            assert_no_panic(&out, &format!("{args:?}"));
            let t = text(&out);
            match out.status.code() {
                Some(0) => {
                    assert!(!t.contains("DAMAGED"), "{args:?}: {t}");
                    clean += 1;
                }
                Some(2) if !done => {
                    assert!(
                        t.contains("in use") && t.contains(&format!("pid {pid}")),
                        "{args:?} while the writer lives: {t}"
                    );
                    refused += 1;
                }
                _ => panic!(
                    "iteration {i}: {args:?} (writer {}): {t}",
                    if done { "killed" } else { "alive" }
                ),
            }
            after_kill += done as usize;
            assert!(
                t0.elapsed() < std::time::Duration::from_secs(60),
                "no end in sight"
            );
        }
        killer.join().unwrap();
        drain.join().unwrap();
    }
    eprintln!("{refused} refused while the writer lived, {clean} clean");
    assert!(refused > 0 && clean > 0);
}

/// Two writers starting at once on one two-device pool, naming its devices
/// in opposite orders: exactly one serves it; the other is refused naming
/// the holder. (Locking in the order named let each take one device and
/// both be refused.)
#[test]
fn two_writers_naming_the_devices_in_opposite_orders_leave_one_serving() {
    use std::io::{BufRead, BufReader, Read};
    let dir = TempDir::new("two-writers");
    let pool = create_pool(&dir, tiny_geometry(), 8, 2, 16);
    let devs = pool.paths();
    drop(pool);
    let rev: Vec<PathBuf> = devs.iter().rev().cloned().collect();
    let mut both_refused = 0;
    for i in 0..crash_iterations(60) {
        let mut kids: Vec<Child> = [&devs, &rev]
            .iter()
            .enumerate()
            .map(|(j, d)| {
                common::crash::writer_command(d, ((i * 2 + j) as u64 + 1) << 32, 8, 8)
                    .spawn()
                    .unwrap()
            })
            .collect();
        let mut serving = 0;
        let mut errors = Vec::new();
        for k in &mut kids {
            let out = k.stdout.take().unwrap();
            let ready = BufReader::new(out)
                .lines()
                .map_while(|l| l.ok())
                .any(|l| l.ends_with("READY"));
            if ready {
                serving += 1;
            } else {
                let mut e = String::new();
                k.stderr.take().unwrap().read_to_string(&mut e).unwrap();
                errors.push(e);
            }
        }
        for mut k in kids {
            let _ = k.kill();
            let _ = k.wait();
        }
        for e in &errors {
            assert!(e.contains("in use") && e.contains("pid "), "{e}");
        }
        both_refused += (serving == 0) as usize;
        assert!(serving <= 1, "iteration {i}: two writers on one pool");
    }
    assert_eq!(both_refused, 0, "both writers were refused");
}

/// A two-device create killed between its two superblock writes: one file
/// holds the new (empty) pool's superblock, the other still the mark of that
/// same create. Running the command again without --force works (the pool
/// never finished, so it never served a block); a file holding a *finished*
/// pool beside another create's mark is still refused.
#[test]
fn a_create_killed_between_its_superblocks_runs_again_without_force() {
    use std::os::unix::fs::FileExt;
    let dir = TempDir::new("create-half");
    let cfg = tiny_config(&dir);
    let (a, b) = (dir.file("a.pool"), dir.file("b.pool"));
    let size = 8 << 20;
    let out = finish(create_cmd(&[&a, &b], size, &cfg, &[]).spawn().unwrap());
    assert!(out.status.success(), "{}", text(&out));
    // What the kill leaves: b's superblock not yet written, its mark (with
    // the new pool's id, as format writes it) still there.
    let mut sb = [0u8; 32];
    std::fs::File::open(&a)
        .unwrap()
        .read_exact_at(&mut sb, 0)
        .unwrap();
    let mut mark = vec![0u8; 4096];
    mark[..8].copy_from_slice(&kvtier::host::signature::UNFINISHED_MAGIC);
    mark[8..24].copy_from_slice(&sb[16..32]);
    let f = std::fs::OpenOptions::new().write(true).open(&b).unwrap();
    f.write_all_at(&mark, 0).unwrap();
    f.sync_all().unwrap();
    let e = Pool::open(&[a.clone(), b.clone()], &OpenExpect::default())
        .err()
        .unwrap()
        .to_string();
    assert!(e.contains("did not finish") && e.contains("b.pool"), "{e}");
    let again = finish(create_cmd(&[&a, &b], size, &cfg, &[]).spawn().unwrap());
    assert!(again.status.success(), "running it again: {}", text(&again));
    let p = Pool::open(&[a.clone(), b.clone()], &OpenExpect::default()).unwrap();
    assert!(p.check(|_, _| {}).unwrap().is_clean());
    drop(p);
    // A finished pool (a's id no longer matches a mark from another create).
    mark[8..24].copy_from_slice(&[0x5a; 16]);
    f.write_all_at(&mark, 0).unwrap();
    let again = finish(create_cmd(&[&a, &b], size, &cfg, &[]).spawn().unwrap());
    let t = text(&again);
    assert!(
        !again.status.success() && t.contains("a.pool") && t.contains("--force"),
        "{t}"
    );
}

/// A pool closed while a child that another thread forked still holds a copy
/// of its descriptor (between that child's fork and its exec) opens again
/// from another process: the copy goes within milliseconds, so the open
/// waits it out instead of calling the closed pool "in use" by this process
/// (a test harness spawning commands on other threads saw that).
#[test]
fn a_pool_closed_while_a_forked_child_holds_its_descriptor_opens_elsewhere() {
    let dir = TempDir::new("fork-copy");
    let path = stored_pool(&dir, 4, 8);
    let pool = Pool::open(std::slice::from_ref(&path), &OpenExpect::default()).unwrap();
    // SAFETY: the child only sleeps and exits (async-signal-safe calls),
    // holding copies of this process's descriptors meanwhile.
    let pid = unsafe { libc::fork() };
    if pid == 0 {
        let ts = libc::timespec {
            tv_sec: 0,
            tv_nsec: 100_000_000,
        };
        // SAFETY: as above.
        unsafe {
            libc::nanosleep(&ts, std::ptr::null_mut());
            libc::_exit(0);
        }
    }
    assert!(pid > 0, "fork failed");
    drop(pool);
    let (code, out) = run_cli(
        env!("CARGO_BIN_EXE_kvtier"),
        &["pool", "info", "--dev", path.to_str().unwrap()],
    );
    let mut status = 0;
    // SAFETY: waits for the child forked above.
    unsafe { libc::waitpid(pid, &mut status, 0) };
    assert_eq!(code, 0, "{out}");
    // A holder that stays is still refused, naming it.
    let pool = Pool::open(std::slice::from_ref(&path), &OpenExpect::default()).unwrap();
    let (code, out) = run_cli(
        env!("CARGO_BIN_EXE_kvtier"),
        &["pool", "info", "--dev", path.to_str().unwrap()],
    );
    assert_ne!(code, 0, "{out}");
    assert!(
        out.contains("in use") && out.contains(&std::process::id().to_string()),
        "{out}"
    );
    drop(pool);
}
