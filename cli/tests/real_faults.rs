//! kvtier on real faulty storage, through the real io_uring engine and the
//! `kvtier` binary: small file systems that fill up (tmpfs with `size=`, an
//! ext2 image on a loop device, which cannot preallocate, so a forced pool
//! file on it is sparse), loop devices whose backing file shrinks under them,
//! and pool files changed between runs. Device-mapper (dm-error, dm-flakey)
//! would be the other source of real EIO; where the kernel has it not, the
//! EIO paths are covered by the fault double (tests/common/fault.rs).
//!
//! The mount and loop parts need root and the tools (`mount`, `losetup`,
//! `mkfs.ext2`); without them each says "SKIP: ..." and returns. Every mount
//! and loop device a test makes is undone by a guard, even when it fails.

#[path = "../../tests/common/mod.rs"]
mod common;

use common::*;
use kvtier::pool::{Key, OpenExpect, Pool};
use kvtier::tier::{KeyOutcome, Tier, TierConfig};
use kvtier::{HostKvCache, HostLayout};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;

fn sh(cmd: &str, args: &[&str]) -> Result<String, String> {
    let out = Command::new(cmd)
        .args(args)
        .output()
        .map_err(|e| format!("{cmd}: {e}"))?;
    if out.status.success() {
        Ok(String::from_utf8_lossy(&out.stdout).trim().to_string())
    } else {
        Err(format!(
            "{cmd} {}: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr).trim()
        ))
    }
}

fn is_root() -> bool {
    // SAFETY: geteuid has no preconditions.
    unsafe { libc::geteuid() == 0 }
}

/// A mount point, unmounted (lazily if busy) on drop; a loop device that
/// `mount -o loop` attached goes with it (autoclear).
struct Mount(PathBuf);

impl Drop for Mount {
    fn drop(&mut self) {
        let p = self.0.to_str().unwrap_or_default().to_string();
        if sh("umount", &[&p]).is_err() {
            let _ = sh("umount", &["-l", &p]);
        }
    }
}

/// A loop device over a file, detached on drop.
struct Loop(PathBuf);

impl Drop for Loop {
    fn drop(&mut self) {
        let _ = sh("losetup", &["-d", self.0.to_str().unwrap_or_default()]);
    }
}

/// A tmpfs of `bytes` at `dir/name`, or why not.
fn tmpfs(dir: &TempDir, name: &str, bytes: u64) -> Result<Mount, String> {
    if !is_root() {
        return Err("not root".into());
    }
    let mnt = dir.file(name);
    std::fs::create_dir_all(&mnt).map_err(|e| e.to_string())?;
    sh(
        "mount",
        &[
            "-t",
            "tmpfs",
            "-o",
            &format!("size={bytes}"),
            "tmpfs",
            mnt.to_str().unwrap(),
        ],
    )?;
    Ok(Mount(mnt))
}

/// An ext2 file system of `bytes` on a loop device at `dir/name`: ext2 has
/// no extents, so fallocate fails there and a forced pool file is sparse.
fn ext2(dir: &TempDir, name: &str, bytes: u64) -> Result<Mount, String> {
    if !is_root() {
        return Err("not root".into());
    }
    let img = dir.file(&format!("{name}.img"));
    std::fs::File::create(&img)
        .and_then(|f| f.set_len(bytes))
        .map_err(|e| e.to_string())?;
    sh("mkfs.ext2", &["-q", "-F", img.to_str().unwrap()])?;
    let mnt = dir.file(name);
    std::fs::create_dir_all(&mnt).map_err(|e| e.to_string())?;
    sh(
        "mount",
        &["-o", "loop", img.to_str().unwrap(), mnt.to_str().unwrap()],
    )?;
    Ok(Mount(mnt))
}

/// A loop block device over a new `bytes`-byte image `dir/name` (detached
/// when dropped).
fn loop_device(dir: &TempDir, name: &str, bytes: u64) -> Result<Loop, String> {
    if !is_root() {
        return Err("not root".into());
    }
    let img = dir.file(name);
    std::fs::File::create(&img)
        .and_then(|f| f.set_len(bytes))
        .map_err(|e| e.to_string())?;
    Ok(Loop(PathBuf::from(sh(
        "losetup",
        &["-f", "--show", img.to_str().unwrap()],
    )?)))
}

macro_rules! or_skip {
    ($e:expr, $what:expr) => {
        match $e {
            Ok(v) => v,
            Err(why) => {
                eprintln!("SKIP: {}: {why}", $what);
                return;
            }
        }
    };
}

fn kvtier(args: &[&str]) -> (i32, String) {
    run_cli(env!("CARGO_BIN_EXE_kvtier"), args)
}

/// `kvtier pool create` of the tiny model in groups of 8 blocks on `devs`,
/// each `size`, with `extra` flags.
fn create_tiny(devs: &[&Path], size: &str, cfg: &Path, extra: &[&str]) -> (i32, String) {
    let mut args = vec!["pool", "create"];
    for d in devs {
        args.extend(["--dev", d.to_str().unwrap()]);
    }
    let cfg = cfg.to_str().unwrap();
    args.extend(["--size", size, "--model", cfg, "--group-blocks", "8"]);
    args.extend(extra);
    kvtier(&args)
}

fn free_bytes(dir: &Path) -> u64 {
    let c = std::ffi::CString::new(dir.to_str().unwrap()).unwrap();
    // SAFETY: statvfs writes only into the struct it is given.
    unsafe {
        let mut s: libc::statvfs = std::mem::zeroed();
        assert_eq!(libc::statvfs(c.as_ptr(), &mut s), 0);
        s.f_bavail * s.f_frsize
    }
}

#[test]
fn a_failed_create_leaves_no_file_it_made() {
    let dir = TempDir::new("createfail");
    let cfg = tiny_config(&dir);
    let a = dir.file("a.pool");
    let foreign = dir.file("foreign");
    std::fs::write(&foreign, vec![3u8; 8192]).unwrap();
    // The second device is refused (it holds data) after the first was made.
    let (code, text) = create_tiny(&[&a, &foreign], "4m", &cfg, &[]);
    assert_eq!(code, 2, "{text}");
    assert!(
        text.contains("foreign") && text.contains("--force"),
        "{text}"
    );
    assert!(
        !a.exists(),
        "the file kvtier created for device 0 is removed"
    );
    assert_eq!(std::fs::read(&foreign).unwrap(), vec![3u8; 8192]);
    // Likewise when the second's directory is missing.
    let (code, text) = create_tiny(&[&a, &dir.file("nodir/b.pool")], "4m", &cfg, &[]);
    assert_eq!(code, 2, "{text}");
    assert!(text.contains("does not exist"), "{text}");
    assert!(
        !a.exists(),
        "the file kvtier created for device 0 is removed"
    );
}

#[test]
fn create_on_a_full_tmpfs_is_refused_and_leaves_nothing() {
    let dir = TempDir::new("tmpfsfull");
    let fs = or_skip!(tmpfs(&dir, "t", 8 << 20), "tmpfs");
    let cfg = tiny_config(&dir);
    let a = fs.0.join("a.pool");
    let (code, text) = create_tiny(&[&a], "64m", &cfg, &["--prewrite"]);
    assert_eq!(code, 2, "{text}");
    assert!(
        text.contains("a.pool") && text.contains("not enough free space"),
        "{text}"
    );
    assert!(!a.exists());
    assert!(free_bytes(&fs.0) >= 7 << 20, "no space is left taken");
    // A pool directory is sized by --capacity, and the fix names that flag.
    let pool_dir = fs.0.join("pool");
    let (code, text) = kvtier(&[
        "pool",
        "create",
        "--dir",
        pool_dir.to_str().unwrap(),
        "--capacity",
        "64m",
        "--model",
        cfg.to_str().unwrap(),
        "--group-blocks",
        "8",
    ]);
    assert_eq!(code, 2, "{text}");
    assert!(
        text.contains("not enough free space") && text.contains("smaller --capacity"),
        "{text}"
    );
    assert!(free_bytes(&fs.0) >= 7 << 20, "no space is left taken");
}

/// Each command that sizes a pool by its total `--capacity` names that
/// flag when the file system is too small for it, and says how much is
/// free there: `--size` is `pool create --dev`'s alone (with `--dir`
/// clap refuses it), and `bench` and `serve` have no such flag.
#[test]
fn out_of_space_names_the_flag_each_command_has_and_what_is_free() {
    let dir = TempDir::new("capflag");
    let fs = or_skip!(tmpfs(&dir, "t", 8 << 20), "tmpfs");
    let cfg = tiny_config(&dir);
    let cfg = cfg.to_str().unwrap();
    let at = |name: &str| fs.0.join(name).to_str().unwrap().to_string();
    let (pdir, bdir, sdir) = (at("p"), at("b"), at("s"));
    std::fs::create_dir_all(&bdir).unwrap();
    let sock = at("s.sock");
    let runs: [(&str, Vec<&str>); 3] = [
        (
            "pool create --dir",
            vec![
                "pool",
                "create",
                "--dir",
                &pdir,
                "--capacity",
                "64m",
                "--group-blocks",
                "8",
            ],
        ),
        (
            "bench",
            vec![
                "bench",
                "--dir",
                &bdir,
                "--capacity",
                "64m",
                "--contexts",
                "64",
                "--group-blocks",
                "8",
            ],
        ),
        (
            "serve",
            vec![
                "serve",
                "--dir",
                &sdir,
                "--capacity",
                "64m",
                "--socket",
                &sock,
            ],
        ),
    ];
    for (what, mut args) in runs {
        args.extend(["--model", cfg]);
        let (code, text) = kvtier(&args);
        assert_eq!(code, 2, "{what}: {text}");
        assert!(
            text.contains("not enough free space")
                && text.contains("give a smaller --capacity")
                && !text.contains("--size"),
            "{what}: the fix names the command's own flag: {text}"
        );
        assert!(
            text.contains(" MiB is free there"),
            "{what}: says what is free: {text}"
        );
        assert!(
            free_bytes(&fs.0) >= 7 << 20,
            "{what}: no space is left taken"
        );
    }
    // pool create --dev sizes each file: its fix is still --size.
    let (code, text) = create_tiny(&[&fs.0.join("a.pool")], "64m", Path::new(cfg), &[]);
    assert_eq!(code, 2, "{text}");
    assert!(text.contains("give a smaller --size"), "{text}");
}

/// `kvtier bench` without `--capacity` makes (and prewrites) the pool the
/// contexts that run need, not a fixed 12 GiB: on a 96 MiB file system the
/// 16- and 64-token contexts run, both held at once (a store that evicts
/// has no engine-alone reference), and the 1024-token one over the memory
/// budget is skipped for that, naming --mem-budget (not --capacity). Before, the
/// 12 GiB pool was refused for want of space, and on a disk with room it
/// cost 12 GiB of writing before the first figure.
#[test]
fn bench_without_capacity_sizes_its_pool_to_the_contexts_that_run() {
    let dir = TempDir::new("benchdefcap");
    let fs = or_skip!(tmpfs(&dir, "t", 96 << 20), "tmpfs");
    let json = dir.file("out.json");
    let (code, text) = kvtier(&[
        "bench",
        "--dir",
        fs.0.to_str().unwrap(),
        "--contexts",
        "16,64,1024",
        "--group-blocks",
        "4",
        "--mem-budget",
        "64m",
        "--json",
        json.to_str().unwrap(),
    ]);
    assert_eq!(code, 0, "{text}");
    let v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    // llama3-8b: 2 MiB blocks; 1 + 4 of them in two groups of 4 and the
    // superblock area.
    let capacity = v["config"]["capacity"].as_u64().unwrap();
    assert!(
        capacity < 24 << 20,
        "the pool holds the 16- and 64-token contexts: {capacity}"
    );
    assert_eq!(v["results"].as_array().unwrap().len(), 2, "{text}");
    assert!(!text.contains("the store evicts"), "{text}");
    assert!(
        text.contains("skipped 1024 tokens") && text.contains("raise --mem-budget"),
        "{text}"
    );
    assert!(!text.contains("raise --capacity"), "{text}");
    assert!(free_bytes(&fs.0) >= 95 << 20, "the pool file is removed");
}

#[test]
fn prewrite_of_a_sparse_pool_on_a_full_filesystem_fails_cleanly() {
    let dir = TempDir::new("prewritefull");
    let fs = or_skip!(ext2(&dir, "e", 16 << 20), "ext2 on a loop device");
    let cfg = tiny_config(&dir);
    let a = fs.0.join("a.pool");
    let before = free_bytes(&fs.0);
    let (code, text) = create_tiny(&[&a], "64m", &cfg, &["--prewrite", "--force"]);
    assert_eq!(code, 2, "{text}");
    assert!(text.contains("a.pool"), "{text}");
    assert!(
        text.contains("free space") || text.contains("smaller --size"),
        "the error says how to fix it: {text}"
    );
    assert!(!a.exists(), "the half-written file kvtier made is removed");
    assert!(free_bytes(&fs.0) >= before - (1 << 20), "its space is back");
}

/// Stores into a sparse pool until its file system is full: the store that
/// finds no space fails (never acknowledged), every acknowledged key loads
/// its own bytes, and the reopened pool holds them all and checks clean.
#[test]
fn stores_into_a_sparse_pool_on_a_full_filesystem() {
    let dir = TempDir::new("storefull");
    let fs = or_skip!(ext2(&dir, "e", 8 << 20), "ext2 on a loop device");
    let geo = tiny_geometry();
    let path = fs.0.join("a.pool");
    // 64 groups of 8 blocks (18 MiB) on an 8 MiB file system.
    let pool = Pool::create(&pool_config(geo, 8, std::slice::from_ref(&path), 64).with_force(true))
        .unwrap();
    let mut tier = Tier::open(pool, TierConfig::default()).unwrap();
    let cache = Arc::new(HostKvCache::new(geo, 16, HostLayout::PerLayer).unwrap());
    tier.register_host_cache(cache.clone()).unwrap();
    let mut acked = Vec::new();
    let mut failures = 0;
    let mut message = String::new();
    // Jobs of 1 to 7 keys, so the one that meets the full file system has
    // some writes land and some refused: each key's outcome is its own.
    let mut k = 0u64;
    'store: for n in (1..8u64).cycle() {
        if k >= 512 {
            break;
        }
        let ks: Vec<u64> = (k..k + n).collect();
        k += n;
        for (i, &key) in ks.iter().enumerate() {
            cache.fill_block(i as u32, seed_of(key));
        }
        let keys: Vec<Key> = ks.iter().map(|&key| Key::from_u64(key)).collect();
        let job = tier
            .submit_store(&keys, &(0..n as u32).collect::<Vec<_>>())
            .unwrap();
        let r = tier.wait(job).unwrap();
        for (i, &key) in ks.iter().enumerate() {
            match &r.outcomes[i] {
                KeyOutcome::Done => acked.push(key),
                KeyOutcome::Failed(f) => {
                    failures += 1;
                    message = f.to_string();
                    if failures >= 12 {
                        break 'store;
                    }
                }
                o => panic!("key {key}: {o:?}"),
            }
        }
    }
    assert!(failures > 0, "the file system never filled");
    assert!(
        message.contains("No space left")
            && message.contains("a.pool")
            && message.contains("free space"),
        "{message}"
    );
    assert!(acked.len() > 10, "{} stored before it filled", acked.len());
    let check_loads = |tier: &mut Tier, acked: &[u64]| {
        for chunk in acked.chunks(8) {
            let keys: Vec<Key> = chunk.iter().map(|&k| Key::from_u64(k)).collect();
            let mem: Vec<u32> = (8..8 + chunk.len() as u32).collect();
            let job = tier.submit_load(&keys, &mem, 0..geo.layers).unwrap();
            let r = tier.wait(job).unwrap();
            for (i, &k) in chunk.iter().enumerate() {
                assert_eq!(r.outcomes[i], KeyOutcome::Done, "key {k}");
                assert!(
                    cache.block_matches(8 + i as u32, seed_of(k), 0..geo.layers),
                    "key {k} loads its own bytes"
                );
            }
        }
    };
    check_loads(&mut tier, &acked);
    drop(tier);
    let pool = Pool::open(std::slice::from_ref(&path), &OpenExpect::default()).unwrap();
    for &k in &acked {
        assert!(pool.index().get(&Key::from_u64(k)).is_some(), "key {k}");
    }
    assert_eq!(pool.index().live(), acked.len() as u64);
    drop(pool);
    let (code, text) = kvtier(&["pool", "check", "--dev", path.to_str().unwrap()]);
    assert_eq!(code, 0, "{text}");
    assert!(text.contains("pool is clean"), "{text}");
}

/// A pool file on an ext2 whose loop device then shrinks (the image
/// truncated, `losetup -c`): the file's tail now lies past the end of the
/// device, and every read or write of it fails with a real EIO from the
/// block layer. Loads of keys there fail (never return bytes), keys before
/// it load their own bytes, stores that hit the dead sectors fail and
/// retire those slots while others succeed, nothing hangs, and the pool
/// still opens and `pool check` names the damage.
#[test]
fn eio_from_a_device_that_lost_its_tail() {
    let dir = TempDir::new("eiotail");
    let lo = or_skip!(loop_device(&dir, "fs.img", 32 << 20), "loop devices");
    let img = dir.file("fs.img");
    or_skip!(
        sh(
            "mkfs.ext2",
            &["-q", "-F", "-b", "4096", lo.0.to_str().unwrap()]
        ),
        "mkfs.ext2"
    );
    let mnt = dir.file("m");
    std::fs::create_dir_all(&mnt).unwrap();
    or_skip!(
        sh("mount", &[lo.0.to_str().unwrap(), mnt.to_str().unwrap()]),
        "mount"
    );
    let m = Mount(mnt.clone());
    let geo = tiny_geometry();
    let path = m.0.join("a.pool");
    // 64 groups of 8 blocks (18 MiB), every byte written at creation so the
    // file's blocks are laid out now, front to back.
    let pool = Pool::create(
        &pool_config(geo, 8, std::slice::from_ref(&path), 64)
            .with_force(true)
            .with_prewrite(true),
    )
    .unwrap();
    let slots = pool.layout().total_slots();
    let mut tier = Tier::open(pool, TierConfig::default()).unwrap();
    let cache = Arc::new(HostKvCache::new(geo, 32, HostLayout::PerLayer).unwrap());
    tier.register_host_cache(cache.clone()).unwrap();
    let n = slots / 2;
    for chunk in (0..n).collect::<Vec<_>>().chunks(8) {
        let keys: Vec<Key> = chunk.iter().map(|&k| Key::from_u64(k)).collect();
        let mem: Vec<u32> = (0..chunk.len() as u32).collect();
        for (i, &k) in chunk.iter().enumerate() {
            cache.fill_block(i as u32, seed_of(k));
        }
        let job = tier.submit_store(&keys, &mem).unwrap();
        assert!(tier.wait(job).unwrap().all_ok());
    }
    // The device loses everything past 12 MiB.
    std::fs::OpenOptions::new()
        .write(true)
        .open(&img)
        .and_then(|f| f.set_len(12 << 20))
        .unwrap();
    sh("losetup", &["-c", lo.0.to_str().unwrap()]).unwrap();
    let (mut ok, mut failed) = (0, 0);
    for chunk in (0..n).collect::<Vec<_>>().chunks(8) {
        let keys: Vec<Key> = chunk.iter().map(|&k| Key::from_u64(k)).collect();
        let mem: Vec<u32> = (8..8 + chunk.len() as u32).collect();
        let job = tier.submit_load(&keys, &mem, 0..geo.layers).unwrap();
        let r = tier.wait(job).unwrap();
        for (i, &k) in chunk.iter().enumerate() {
            match &r.outcomes[i] {
                KeyOutcome::Done => {
                    ok += 1;
                    assert!(
                        cache.block_matches(8 + i as u32, seed_of(k), 0..geo.layers),
                        "key {k} was announced loaded with bytes it was not stored with"
                    );
                }
                KeyOutcome::Failed(f) | KeyOutcome::Corrupt(f) => {
                    failed += 1;
                    assert!(f.to_string().contains("a.pool"), "{f}");
                }
                o => panic!("key {k}: {o:?}"),
            }
        }
    }
    eprintln!("after the loss: {ok} keys loaded, {failed} failed");
    assert!(failed > 0, "no load reached the lost sectors");
    // Stores go on: those landing on dead sectors fail, the rest are kept.
    let mut stored = Vec::new();
    let mut store_failed = 0;
    let mut dead = std::collections::HashSet::new();
    for k in n..n + slots {
        cache.fill_block(0, seed_of(k));
        let job = tier.submit_store(&[Key::from_u64(k)], &[0]).unwrap();
        match &tier.wait(job).unwrap().outcomes[0] {
            KeyOutcome::Done => stored.push(k),
            KeyOutcome::Failed(f) => {
                store_failed += 1;
                assert!(f.to_string().contains("a.pool"), "{f}");
                let io = f.io.as_ref().expect("an I/O failure");
                assert!(
                    dead.insert(io.offset),
                    "store {k} failed where an earlier one did (never retired): {f}"
                );
            }
            o => panic!("key {k}: {o:?}"),
        }
    }
    eprintln!(
        "stores after the loss: {} kept, {store_failed} failed",
        stored.len()
    );
    // Each dead slot failed one store and was retired: from now on every
    // store lands on live sectors (the pool does not wedge on a dead slot,
    // every later store failing the same way).
    for k in n + slots..n + slots + 64 {
        cache.fill_block(0, seed_of(k));
        let job = tier.submit_store(&[Key::from_u64(k)], &[0]).unwrap();
        let r = tier.wait(job).unwrap();
        assert_eq!(r.outcomes[0], KeyOutcome::Done, "key {k}");
        stored.push(k);
    }
    for &k in stored.iter().rev().take(8) {
        let job = tier
            .submit_load(&[Key::from_u64(k)], &[9], 0..geo.layers)
            .unwrap();
        let r = tier.wait(job).unwrap();
        assert_eq!(r.outcomes[0], KeyOutcome::Done, "key {k}");
        assert!(cache.block_matches(9, seed_of(k), 0..geo.layers), "key {k}");
    }
    drop(tier);
    let (code, text) = kvtier(&["pool", "check", "--dev", path.to_str().unwrap()]);
    // Every dead slot was retired or its key dropped: what is left checks
    // out, and the retired capacity is named.
    assert!(code == 0 || code == 1, "{text}");
    assert!(
        text.contains("slot(s) retired after write errors"),
        "{text}"
    );
    let pool = Pool::open(std::slice::from_ref(&path), &OpenExpect::default());
    assert!(pool.is_ok(), "the pool still opens: {:?}", pool.err());
    drop(pool);
    // A repair rewrites what cannot be read and retires what still fails:
    // afterwards the pool checks clean, as the repair said it would.
    let (code, text) = kvtier(&["pool", "check", "--repair", "--dev", path.to_str().unwrap()]);
    assert_eq!(code, 0, "{text}");
    let (code, text) = kvtier(&["pool", "check", "--dev", path.to_str().unwrap()]);
    assert_eq!(code, 0, "{text}");
    assert!(text.contains("pool is clean"), "{text}");
    drop(m);
    drop(lo);
}

/// A pool file truncated while the tier serves it: keys whose blocks are
/// gone fail their loads (short reads), never come back as loaded; grown
/// back with zeros, they fail their checksums (or vanish with their
/// headers) instead; keys before the cut load their own bytes throughout.
/// Reopened truncated, the pool is refused with what to do about it.
#[test]
fn a_pool_file_truncated_under_a_serving_tier() {
    let dir = TempDir::new("truncserve");
    let geo = tiny_geometry();
    let pool = create_pool(&dir, geo, 8, 1, 4); // 32 slots
    let path = pool.paths()[0].clone();
    let layout = pool.layout().clone();
    let full = std::fs::metadata(&path).unwrap().len();
    let mut tier = Tier::open(pool, TierConfig::default()).unwrap();
    let cache = Arc::new(HostKvCache::new(geo, 64, HostLayout::PerLayer).unwrap());
    tier.register_host_cache(cache.clone()).unwrap();
    let keys: Vec<Key> = (0..32).map(Key::from_u64).collect();
    for i in 0..32 {
        cache.fill_block(i, seed_of(i as u64));
    }
    let job = tier
        .submit_store(&keys, &(0..32).collect::<Vec<_>>())
        .unwrap();
    assert!(tier.wait(job).unwrap().all_ok());
    // Cut the file after its second group's headers.
    let (_, cut) = layout.header_offset(8);
    let cut = cut + 4096 * 8;
    let f = std::fs::OpenOptions::new().write(true).open(&path).unwrap();
    f.set_len(cut).unwrap();
    let load_all = |tier: &mut Tier| -> (usize, usize) {
        let (mut ok, mut bad) = (0, 0);
        for (i, k) in keys.iter().enumerate() {
            if !tier.contains(k) {
                bad += 1;
                continue;
            }
            let job = tier.submit_load(&[*k], &[40], 0..geo.layers).unwrap();
            match &tier.wait(job).unwrap().outcomes[0] {
                KeyOutcome::Done => {
                    assert!(
                        cache.block_matches(40, seed_of(i as u64), 0..geo.layers),
                        "key {i} loaded Done with bytes it was not stored with"
                    );
                    ok += 1;
                }
                KeyOutcome::Failed(_) | KeyOutcome::Corrupt(_) => bad += 1,
                o => panic!("key {i}: {o:?}"),
            }
        }
        (ok, bad)
    };
    let (ok, bad) = load_all(&mut tier);
    assert!(ok >= 8 && bad >= 16, "{ok} loaded, {bad} failed");
    // Grown back: the lost blocks read as zeros now.
    f.set_len(full).unwrap();
    let (ok2, bad2) = load_all(&mut tier);
    assert!(ok2 <= ok && bad2 >= bad, "{ok2} loaded, {bad2} failed");
    drop(tier);
    f.set_len(cut).unwrap();
    let (code, text) = kvtier(&["pool", "info", "--dev", path.to_str().unwrap()]);
    assert_eq!(code, 2, "{text}");
    assert!(
        text.contains("truncated") && text.contains("truncate -s") && text.contains("--force"),
        "{text}"
    );
}

fn open_err(paths: &[PathBuf]) -> String {
    match Pool::open(paths, &OpenExpect::default()) {
        Ok(_) => panic!("{paths:?} opened"),
        Err(e) => e.to_string(),
    }
}

/// The devices of a pool named in another order, one left out, one from
/// another pool, one replaced by a copy of its sibling or renamed over by
/// another pool's: each refused naming the device and the fix, or (in any
/// order) opened with every key loading its own bytes.
#[test]
fn devices_swapped_missing_foreign_or_duplicated() {
    let da = TempDir::new("swap-a");
    let db = TempDir::new("swap-b");
    let geo = tiny_geometry();
    let a = create_pool(&da, geo, 8, 2, 2);
    let pa = a.paths();
    drop(a);
    let pb = create_pool(&db, geo, 8, 2, 2).paths();
    // Keys on both devices of pool A.
    {
        let pool = Pool::open(&pa, &OpenExpect::default()).unwrap();
        let mut tier = Tier::open(pool, TierConfig::default()).unwrap();
        let cache = Arc::new(HostKvCache::new(geo, 32, HostLayout::PerLayer).unwrap());
        tier.register_host_cache(cache.clone()).unwrap();
        for i in 0..24 {
            cache.fill_block(i, seed_of(i as u64));
        }
        let keys: Vec<Key> = (0..24).map(Key::from_u64).collect();
        let job = tier
            .submit_store(&keys, &(0..24).collect::<Vec<_>>())
            .unwrap();
        assert!(tier.wait(job).unwrap().all_ok());
    }
    // Swapped: the same pool, every key its own bytes.
    let swapped = vec![pa[1].clone(), pa[0].clone()];
    let pool = Pool::open(&swapped, &OpenExpect::default()).unwrap();
    let mut tier = Tier::open(pool, TierConfig::default()).unwrap();
    let cache = Arc::new(HostKvCache::new(geo, 32, HostLayout::PerLayer).unwrap());
    tier.register_host_cache(cache.clone()).unwrap();
    let keys: Vec<Key> = (0..24).map(Key::from_u64).collect();
    let job = tier
        .submit_load(&keys, &(0..24).collect::<Vec<_>>(), 0..geo.layers)
        .unwrap();
    assert!(tier.wait(job).unwrap().all_ok());
    for i in 0..24 {
        assert!(
            cache.block_matches(i, seed_of(i as u64), 0..geo.layers),
            "key {i}"
        );
    }
    drop(tier);
    // One left out.
    let err = open_err(&pa[..1]);
    assert!(
        err.contains("2 device(s) but 1 were named") && err.contains("name every device"),
        "{err}"
    );
    // One from another pool.
    let err = open_err(&[pa[0].clone(), pb[1].clone()]);
    assert!(
        err.contains("belongs to pool") && err.contains("name the devices of one pool"),
        "{err}"
    );
    // Device 1 replaced by a copy of device 0.
    std::fs::copy(&pa[0], &pa[1]).unwrap();
    let err = open_err(&pa);
    assert!(err.contains("device index 0 named twice"), "{err}");
    // Device 0 renamed over by the other pool's device 0.
    std::fs::rename(&pb[0], &pa[0]).unwrap();
    let err = open_err(&pa);
    assert!(err.contains("belongs to pool"), "{err}");
    // The CLI says the same, with its exit code for bad input.
    let (code, text) = kvtier(&[
        "pool",
        "check",
        "--dev",
        pa[0].to_str().unwrap(),
        "--dev",
        pa[1].to_str().unwrap(),
    ]);
    assert_eq!(code, 2, "{text}");
    assert!(text.contains("belongs to pool"), "{text}");
}

/// A pool on a block device (a loop device) that shrinks under a serving
/// tier: reads past the new end come back short and writes there are
/// refused; loads of keys there fail, keys before it load their own bytes,
/// stores keep working on what is left, and a reopen is refused naming the
/// size the device must have again.
#[test]
fn a_block_device_that_shrinks_under_a_serving_tier() {
    let dir = TempDir::new("bdevshrink");
    let lo = or_skip!(loop_device(&dir, "disk.img", 16 << 20), "loop devices");
    let img = dir.file("disk.img");
    let geo = tiny_geometry();
    let cfg = kvtier::pool::PoolConfig::new(geo, "test", "test/ns")
        .with_group_blocks(8)
        .with_devices(vec![kvtier::pool::DeviceSpec {
            path: lo.0.clone(),
            size: None,
        }]);
    let pool = Pool::create(&cfg).unwrap();
    let slots = pool.layout().total_slots();
    let mut tier = Tier::open(pool, TierConfig::default()).unwrap();
    let cache = Arc::new(HostKvCache::new(geo, 16, HostLayout::PerLayer).unwrap());
    tier.register_host_cache(cache.clone()).unwrap();
    let n = slots.min(48);
    for k in 0..n {
        cache.fill_block(0, seed_of(k));
        let job = tier.submit_store(&[Key::from_u64(k)], &[0]).unwrap();
        assert!(tier.wait(job).unwrap().all_ok());
    }
    std::fs::OpenOptions::new()
        .write(true)
        .open(&img)
        .and_then(|f| f.set_len(2 << 20))
        .unwrap();
    sh("losetup", &["-c", lo.0.to_str().unwrap()]).unwrap();
    let (mut ok, mut failed) = (0, 0);
    for k in 0..n {
        let job = tier
            .submit_load(&[Key::from_u64(k)], &[8], 0..geo.layers)
            .unwrap();
        match &tier.wait(job).unwrap().outcomes[0] {
            KeyOutcome::Done => {
                assert!(cache.block_matches(8, seed_of(k), 0..geo.layers), "key {k}");
                ok += 1;
            }
            KeyOutcome::Failed(f) | KeyOutcome::Corrupt(f) => {
                assert!(f.to_string().contains(lo.0.to_str().unwrap()), "{f}");
                failed += 1;
            }
            o => panic!("key {k}: {o:?}"),
        }
    }
    eprintln!("after the shrink: {ok} loaded, {failed} failed");
    assert!(ok > 0 && failed > 0, "{ok} loaded, {failed} failed");
    let mut stored = 0;
    for k in 1000..1000 + slots + 16 {
        cache.fill_block(0, seed_of(k));
        let job = tier.submit_store(&[Key::from_u64(k)], &[0]).unwrap();
        let r = tier.wait(job).unwrap();
        if let Some((_, f)) = r.failures().next() {
            let f = f.to_string();
            assert!(
                f.contains("shrank under the pool") && f.contains("grow it back"),
                "{f}"
            );
        }
        if r.all_ok() {
            stored += 1;
            let job = tier
                .submit_load(&[Key::from_u64(k)], &[9], 0..geo.layers)
                .unwrap();
            assert_eq!(tier.wait(job).unwrap().outcomes[0], KeyOutcome::Done);
            assert!(cache.block_matches(9, seed_of(k), 0..geo.layers), "key {k}");
        }
    }
    eprintln!("stores after the shrink: {stored} of {}", slots + 16);
    // The slots past the end were retired as they failed, so the stores go
    // on in what is left (they all failed while every free slot lay past it).
    assert!(stored >= 16, "{stored} stored");
    drop(tier);
    let err = open_err(std::slice::from_ref(&lo.0));
    assert!(
        err.contains("truncated") && err.contains(&(16u64 << 20).to_string()),
        "{err}"
    );
    drop(lo);
}

/// A block device set read-only under a serving tier (`blockdev --setro`):
/// stores fail naming the device, nothing is retired for it, loads go on,
/// and once it is writable again stores succeed in the same slots.
#[test]
fn a_block_device_set_read_only_under_a_serving_tier() {
    let dir = TempDir::new("bdevro");
    let lo = or_skip!(loop_device(&dir, "disk.img", 8 << 20), "loop devices");
    let dev = lo.0.to_str().unwrap().to_string();
    let geo = tiny_geometry();
    let cfg = kvtier::pool::PoolConfig::new(geo, "test", "test/ns")
        .with_group_blocks(8)
        .with_devices(vec![kvtier::pool::DeviceSpec {
            path: lo.0.clone(),
            size: None,
        }]);
    let pool = Pool::create(&cfg).unwrap();
    let mut tier = Tier::open(pool, TierConfig::default()).unwrap();
    let cache = Arc::new(HostKvCache::new(geo, 16, HostLayout::PerLayer).unwrap());
    tier.register_host_cache(cache.clone()).unwrap();
    for k in 0..8 {
        cache.fill_block(k as u32, seed_of(k));
    }
    let keys: Vec<Key> = (0..8).map(Key::from_u64).collect();
    let job = tier.submit_store(&keys[..4], &[0, 1, 2, 3]).unwrap();
    assert!(tier.wait(job).unwrap().all_ok());
    /// Sets the device writable again even if the test fails.
    struct Rw(String);
    impl Drop for Rw {
        fn drop(&mut self) {
            let _ = sh("blockdev", &["--setrw", &self.0]);
        }
    }
    or_skip!(sh("blockdev", &["--setro", &dev]), "blockdev --setro");
    let rw = Rw(dev.clone());
    let job = tier.submit_store(&keys[4..], &[4, 5, 6, 7]).unwrap();
    let r = tier.wait(job).unwrap();
    let (_, f) = r
        .failures()
        .next()
        .expect("a store to a read-only device failed");
    assert!(
        f.to_string().contains(&dev) && f.to_string().contains("make it writable again"),
        "{f}"
    );
    assert_eq!(tier.lookup_prefix(&keys[4..]), 0, "nothing acknowledged");
    let job = tier
        .submit_load(&keys[..4], &[8, 9, 10, 11], 0..geo.layers)
        .unwrap();
    assert!(tier.wait(job).unwrap().all_ok());
    for i in 0..4 {
        assert!(cache.block_matches(8 + i, seed_of(i as u64), 0..geo.layers));
    }
    drop(rw);
    let bad_before = tier.pool().index().bad_slots();
    assert_eq!(bad_before, 0, "a read-only device retires nothing");
    let job = tier.submit_store(&keys[4..], &[4, 5, 6, 7]).unwrap();
    assert!(tier.wait(job).unwrap().all_ok(), "writable again: stored");
    drop(tier);
    drop(lo);
}

/// `--dir` naming something that is not a directory (a block or character
/// device, a file) is refused as such, and nothing is made beside it.
#[test]
fn dir_flags_naming_a_non_directory_are_refused_as_such() {
    let dir = TempDir::new("notadir");
    let file = dir.file("plain");
    std::fs::write(&file, b"keep me").unwrap();
    for (args, what) in [
        (
            vec![
                "bench",
                "--dir",
                file.to_str().unwrap(),
                "--capacity",
                "64m",
            ],
            "a regular file",
        ),
        (
            vec!["bench", "--dir", "/dev/null", "--capacity", "64m"],
            "a character device",
        ),
        (
            vec!["replay", "--dir", file.to_str().unwrap()],
            "a regular file",
        ),
    ] {
        let (code, text) = kvtier(&args);
        assert_eq!(code, 2, "{args:?}: {text}");
        assert!(
            text.contains(&format!("it is {what}")) && text.contains("name a directory"),
            "{args:?}: {text}"
        );
    }
    assert_eq!(std::fs::read(&file).unwrap(), b"keep me");
    assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 1);
}

/// Things that are no pool device, named to every `pool` subcommand: each
/// refused at once (a FIFO is never opened, so nothing blocks) naming what
/// it is and what a device must be, and left as it was.
#[test]
fn fifos_sockets_char_devices_and_directories_are_no_pool_devices() {
    let dir = TempDir::new("notdev");
    let fifo = dir.file("fifo");
    let c = std::ffi::CString::new(fifo.to_str().unwrap()).unwrap();
    // SAFETY: mkfifo reads a NUL-terminated path that outlives the call.
    assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
    let sock = dir.file("sock");
    let _listener = std::os::unix::net::UnixListener::bind(&sock).unwrap();
    let link = dir.file("link-to-fifo");
    std::os::unix::fs::symlink(&fifo, &link).unwrap();
    let cfg = tiny_config(&dir);
    let subdir = dir.file("sub");
    std::fs::create_dir(&subdir).unwrap();
    let cases = [
        (fifo.to_str().unwrap(), "a FIFO"),
        (sock.to_str().unwrap(), "a socket"),
        (link.to_str().unwrap(), "a FIFO"),
        ("/dev/zero", "a character device"),
        ("/dev/null", "a character device"),
        ("/dev/full", "a character device"),
        (subdir.to_str().unwrap(), "a directory"),
    ];
    for (dev, what) in cases {
        for args in [
            vec!["pool", "info", "--dev", dev],
            vec!["pool", "check", "--dev", dev],
            vec!["pool", "check", "--repair", "--dev", dev],
            vec![
                "pool",
                "create",
                "--dev",
                dev,
                "--size",
                "4m",
                "--model",
                cfg.to_str().unwrap(),
                "--force",
            ],
        ] {
            let t = std::time::Instant::now();
            let (code, text) = kvtier(&args);
            assert_eq!(code, 2, "{args:?}: {text}");
            assert!(
                text.contains(dev)
                    && text.contains(&format!("it is {what}"))
                    && text.contains("must be a regular file or a block device"),
                "{args:?}: {text}"
            );
            assert!(
                t.elapsed().as_secs() < 10,
                "{args:?} took {:?}",
                t.elapsed()
            );
        }
    }
    let ft = std::fs::symlink_metadata(&fifo).unwrap().file_type();
    use std::os::unix::fs::FileTypeExt;
    assert!(ft.is_fifo());
    assert_eq!(std::fs::read_dir(&subdir).unwrap().count(), 0);
}

/// A pool that fills its file system, and then one whose file system is
/// mounted read-only, opened by the library's builder with its automatic
/// engine (what Python, `kvtier serve` and the vLLM connector use): the
/// full one opens and serves its blocks (its files were allocated when it
/// was made, so no store needs new space), a new one beside it is refused
/// for want of space, and the read-only one is refused
/// naming the read-only file system and the remount, not "no engine can
/// serve this pool" (the engine decision's O_DIRECT probe wrote a temporary
/// file into the pool directory, which a full or read-only file system
/// refuses, so neither pool could be opened again).
#[test]
fn a_pool_that_fills_its_file_system_or_is_read_only_opens_with_the_automatic_engine() {
    use kvtier::handle::{EngineChoice, TierBuilder};
    let dir = TempDir::new("fullreopen");
    let size = 16u64 << 20;
    let fs = or_skip!(tmpfs(&dir, "t", size), "tmpfs");
    let geo = tiny_geometry();
    let pool_dir = fs.0.join("pool");
    let cache = Arc::new(HostKvCache::new(geo, 8, HostLayout::PerLayer).unwrap());
    let build = || {
        TierBuilder::default()
            .directory(&pool_dir)
            .capacity(size)
            .group_blocks(8)
            .geometry(geo)
            .model_name("tiny")
            .engine(EngineChoice::Auto)
            .host_cache(cache.clone())
            .build()
    };
    let keys: Vec<Key> = (0..8).map(Key::from_u64).collect();
    let mem: Vec<u32> = (0..8).collect();
    {
        let h = build().unwrap();
        for (i, &b) in mem.iter().enumerate() {
            cache.fill_block(b, seed_of(i as u64));
        }
        assert!(h
            .wait(h.submit_store(&keys, &mem).unwrap())
            .unwrap()
            .all_ok());
    }
    assert!(
        free_bytes(&fs.0) < 4096,
        "the pool fills its file system: {} bytes free",
        free_bytes(&fs.0)
    );
    let load_all = |h: &kvtier::handle::TierHandle| {
        cache.clear();
        let job = h.submit_load(&keys, &mem, 0..geo.layers).unwrap();
        assert!(h.wait(job).unwrap().all_ok());
        for (i, &b) in mem.iter().enumerate() {
            assert!(cache.block_matches(b, seed_of(i as u64), 0..geo.layers));
        }
    };
    {
        let h = build().unwrap_or_else(|e| panic!("a full pool reopens: {e}"));
        load_all(&h);
        // Stores overwrite the pool's own allocated space.
        for (i, &b) in mem.iter().enumerate() {
            cache.fill_block(b, seed_of(100 + i as u64));
        }
        let more: Vec<Key> = (100..108).map(Key::from_u64).collect();
        assert!(h
            .wait(h.submit_store(&more, &mem).unwrap())
            .unwrap()
            .all_ok());
    }
    // A new pool beside it finds no space: said as the pool's create says
    // it, not as "no engine can serve this pool" (the O_DIRECT probe file
    // could not be written there either, which says nothing of O_DIRECT).
    let e = match TierBuilder::default()
        .directory(fs.0.join("another"))
        .capacity(size / 2)
        .group_blocks(8)
        .geometry(geo)
        .model_name("tiny")
        .engine(EngineChoice::Auto)
        .host_cache(cache.clone())
        .build()
    {
        Ok(_) => panic!("a pool was made on a full file system"),
        Err(e) => e.to_string(),
    };
    assert!(
        e.contains("not enough free space") && !e.contains("no engine"),
        "{e}"
    );
    or_skip!(
        sh("mount", &["-o", "remount,ro", fs.0.to_str().unwrap()]),
        "remount read-only"
    );
    let e = match build() {
        Ok(_) => panic!("a pool on a read-only file system opened for writing"),
        Err(e) => e.to_string(),
    };
    assert!(
        e.contains("read-only") && e.contains("remount") && !e.contains("no engine"),
        "{e}"
    );
    // Checking it only reads, and the doctor's O_DIRECT probe reads the
    // pool's file as the builder's does.
    let (code, text) = kvtier(&["pool", "check", "--dir", pool_dir.to_str().unwrap()]);
    assert_eq!(code, 0, "{text}");
    let (_, text) = kvtier(&["doctor", "--dir", pool_dir.to_str().unwrap()]);
    let line = text
        .lines()
        .find(|l| l.contains("O_DIRECT  "))
        .unwrap_or(&text);
    assert!(
        line.contains("works") && line.contains("read from the pool's"),
        "{text}"
    );
}

/// A pool file marked immutable (or append-only) refuses even root: the
/// error says so and names `chattr`, where it said "permission denied; run
/// as a user who may write it" to root, who may.
#[test]
fn an_immutable_pool_file_is_named_as_such() {
    let dir = TempDir::new("immutable");
    let cfg = tiny_config(&dir);
    let a = dir.file("a.pool");
    let (code, text) = create_tiny(&[&a], "4m", &cfg, &[]);
    assert_eq!(code, 0, "{text}");
    /// Clears the attribute again, so the directory can be removed.
    struct Attr(PathBuf);
    impl Drop for Attr {
        fn drop(&mut self) {
            let _ = sh("chattr", &["-i", "-a", self.0.to_str().unwrap()]);
        }
    }
    if !is_root() {
        eprintln!("SKIP: chattr +i: not root");
        return;
    }
    let _attr = Attr(a.clone());
    for flag in ["+i", "+a"] {
        or_skip!(sh("chattr", &[flag, a.to_str().unwrap()]), "chattr");
        let (code, text) = kvtier(&["pool", "check", "--repair", "--dev", a.to_str().unwrap()]);
        assert_eq!(code, 2, "{text}");
        assert!(
            text.contains("a.pool") && text.contains("immutable") && text.contains("chattr -i -a"),
            "{flag}: {text}"
        );
        // Read-only inspection still works.
        let (code, text) = kvtier(&["pool", "check", "--dev", a.to_str().unwrap()]);
        assert_eq!(code, 0, "{text}");
        let _ = sh("chattr", &["-i", "-a", a.to_str().unwrap()]);
    }
}
