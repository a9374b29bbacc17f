//! `TierBuilder`'s pool policy: a directory kvtier manages, a total
//! capacity split over its files, open-or-create (open a pool that is
//! there, create one only where nothing is or a kvtier create did not
//! finish, never over data kvtier did not write without
//! `CreateMode::Always`), and a create killed with SIGKILL at random points
//! leaving the old pool or none, which the same build then finishes.

mod common;

use common::*;
use kvtier::error::{ErrorKind, Fix};
use kvtier::handle::{EngineChoice, TierBuilder, TierHandle};
use kvtier::pool::place::{min_capacity, CreateMode};
use kvtier::pool::{Key, OpenExpect, Pool, DEFAULT_GROUP_BLOCKS};
use kvtier::{Error, HostKvCache, HostLayout};
use std::path::Path;
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

const MEM_BLOCKS: u32 = 16;

fn cache() -> Arc<HostKvCache> {
    Arc::new(HostKvCache::new(tiny_geometry(), MEM_BLOCKS, HostLayout::PerLayer).unwrap())
}

/// The builder every test (and the crash child) uses on `dir`.
fn builder(dir: &Path, files: u32, capacity: u64, cache: &Arc<HostKvCache>) -> TierBuilder {
    TierBuilder::default()
        .directory(dir)
        .directory_files(files)
        .capacity(capacity)
        .geometry(tiny_geometry())
        .model_name("tiny")
        .engine(EngineChoice::Uring)
        .host_cache(cache.clone())
}

fn keys(r: std::ops::Range<u64>) -> Vec<Key> {
    r.map(Key::from_u64).collect()
}

fn store(h: &TierHandle, cache: &HostKvCache, ks: std::ops::Range<u64>) {
    let mem: Vec<u32> = (0..ks.end - ks.start).map(|i| i as u32).collect();
    for (k, &b) in ks.clone().zip(&mem) {
        cache.fill_block(b, seed_of(k));
    }
    let r = h.wait(h.submit_store(&keys(ks), &mem).unwrap()).unwrap();
    assert!(r.all_ok(), "{:?}", r.failures().collect::<Vec<_>>());
}

/// Loads `ks` into zeroed memory and checks every byte.
fn assert_loads(h: &TierHandle, cache: &HostKvCache, ks: std::ops::Range<u64>) {
    let n = (ks.end - ks.start) as usize;
    cache.clear();
    assert_eq!(h.lookup_and_pin(&keys(ks.clone())), n, "every key is there");
    let mem: Vec<u32> = (0..n as u32).collect();
    let job = h
        .submit_load(&keys(ks.clone()), &mem, 0..tiny_geometry().layers)
        .unwrap();
    assert!(h.wait(job).unwrap().all_ok());
    h.unpin(&keys(ks.clone()));
    for (k, &b) in ks.zip(&mem) {
        assert!(cache.block_matches(b, seed_of(k), 0..tiny_geometry().layers));
    }
}

fn min_cap(files: usize) -> u64 {
    min_capacity(&tiny_geometry(), DEFAULT_GROUP_BLOCKS, files)
}

#[test]
fn a_directory_is_created_split_and_reopened_with_its_blocks() {
    let dir = TempDir::new("builder-rt");
    let pool_dir = dir.file("kv").join("pool");
    let c = cache();
    // Nothing there (not even the directory): created, capacity split.
    let capacity = 3 * min_cap(1) + 12345;
    let h = builder(&pool_dir, 3, capacity, &c).build().unwrap();
    let per = (capacity / 3) & !4095;
    for i in 0..3 {
        let f = pool_dir.join(format!("kvtier-{i}.pool"));
        assert_eq!(std::fs::metadata(&f).unwrap().len(), per, "{}", f.display());
    }
    assert!(!pool_dir.join("kvtier-3.pool").exists());
    store(&h, &c, 10..20);
    h.close().unwrap();
    // The same build again opens it: the blocks are there, byte for byte.
    let h = builder(&pool_dir, 3, capacity, &c).build().unwrap();
    assert_loads(&h, &c, 10..20);
    h.close().unwrap();
    // Without capacity too (only a create needs one), and open-only.
    let h = builder(&pool_dir, 3, capacity, &c)
        .create_mode(CreateMode::Never)
        .build()
        .unwrap();
    assert_loads(&h, &c, 10..20);
    drop(h);
    let pool = Pool::open(
        &kvtier::pool::place::directory_files(&pool_dir, 3),
        &OpenExpect::default(),
    )
    .unwrap();
    assert_eq!(pool.info().namespace, "tiny/bfloat16/bs16/tp0");
    assert_eq!(pool.info().model, "tiny");
    drop(pool);
    // Another model's name (so namespace) or rank is refused, not served.
    for b in [
        builder(&pool_dir, 3, capacity, &c).model_name("other"),
        builder(&pool_dir, 3, capacity, &c).tp_rank(1),
    ] {
        let e = b.build().unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Usage, "{e}");
        assert!(e.to_string().contains("namespace"), "{e}");
    }
    // Memory of another shape than geometry(..) says: refused by name.
    let other = kvtier::KvGeometry {
        layers: 2,
        ..tiny_geometry()
    };
    let e = builder(&pool_dir, 3, capacity, &c)
        .geometry(other)
        .build()
        .unwrap_err();
    assert!(e.to_string().contains("geometry(..)"), "{e}");
    // The data survived all of that.
    let h = builder(&pool_dir, 3, capacity, &c).build().unwrap();
    assert_loads(&h, &c, 10..20);
    h.close().unwrap();
}

#[test]
fn capacity_is_needed_to_create_and_must_fit_the_smallest_pool() {
    let dir = TempDir::new("builder-cap");
    let c = cache();
    let pool_dir = dir.file("p");
    let e = TierBuilder::default()
        .directory(&pool_dir)
        .model_name("tiny")
        .host_cache(c.clone())
        .build()
        .unwrap_err();
    assert_eq!(
        e.fix(),
        Some(&Fix::GiveCapacity {
            at_least: min_cap(1)
        }),
        "{e}"
    );
    assert!(e.to_string().contains("capacity("), "{e}");
    let e = builder(&pool_dir, 2, min_cap(2) - 4096, &c)
        .build()
        .unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Usage);
    assert_eq!(
        e.fix(),
        Some(&Fix::GiveCapacity {
            at_least: min_cap(2)
        }),
        "{e}"
    );
    // Nothing was made for a refused create.
    assert!(!pool_dir.join("kvtier-0.pool").exists());
    // No name and no namespace: refused (the namespace keys the model).
    let e = TierBuilder::default()
        .directory(&pool_dir)
        .capacity(min_cap(1))
        .host_cache(c.clone())
        .build()
        .unwrap_err();
    assert!(e.to_string().contains("model_name"), "{e}");
    for bad in ["", "a\nb"] {
        let e = builder(&pool_dir, 1, min_cap(1), &c)
            .model_name(bad)
            .build()
            .unwrap_err();
        assert!(e.to_string().contains("printable"), "{e}");
    }
    builder(&pool_dir, 2, min_cap(2), &c)
        .build()
        .unwrap()
        .close()
        .unwrap();
    for i in 0..2 {
        let len = std::fs::metadata(pool_dir.join(format!("kvtier-{i}.pool")))
            .unwrap()
            .len();
        assert_eq!(len, min_cap(1));
    }
    for bad in [0, 65] {
        let e = builder(&pool_dir, bad, min_cap(2), &c).build().unwrap_err();
        assert!(e.to_string().contains("directory_files"), "{e}");
    }
}

#[test]
fn a_foreign_file_or_a_partial_pool_is_refused_without_always() {
    let dir = TempDir::new("builder-foreign");
    let c = cache();
    let pool_dir = dir.file("p");
    std::fs::create_dir_all(&pool_dir).unwrap();
    let foreign = pool_dir.join("kvtier-0.pool");
    let data = b"somebody else's bytes ".repeat(1 << 12);
    std::fs::write(&foreign, &data).unwrap();
    let e = builder(&pool_dir, 1, min_cap(1), &c).build().unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Usage, "{e}");
    assert!(e.to_string().contains("kvtier-0.pool"), "{e}");
    assert_eq!(std::fs::read(&foreign).unwrap(), data, "left as it was");
    let e = builder(&pool_dir, 1, min_cap(1), &c)
        .create_mode(CreateMode::Never)
        .build()
        .unwrap_err();
    assert!(e.to_string().contains("not a kvtier pool"), "{e}");
    assert_eq!(std::fs::read(&foreign).unwrap(), data, "left as it was");
    // The explicit force formats it.
    let h = builder(&pool_dir, 1, min_cap(1), &c)
        .create_mode(CreateMode::Always)
        .build()
        .unwrap();
    store(&h, &c, 0..4);
    h.close().unwrap();

    // A pool of two files, one replaced by zeros: named, not formatted.
    let two = dir.file("two");
    builder(&two, 2, min_cap(2), &c)
        .build()
        .unwrap()
        .close()
        .unwrap();
    let second = two.join("kvtier-1.pool");
    let len = std::fs::metadata(&second).unwrap().len();
    std::fs::write(&second, vec![0u8; len as usize]).unwrap();
    let e = builder(&two, 2, min_cap(2), &c).build().unwrap_err();
    assert_eq!(e.fix(), Some(&Fix::RestoreOrRecreate), "{e}");
    assert!(
        matches!(e.without_fix(), Error::Backing { path, .. } if *path == second),
        "{e}"
    );
    assert!(e.to_string().contains("CreateMode::Always"), "{e}");
    // One missing: refused too.
    std::fs::remove_file(&second).unwrap();
    let e = builder(&two, 2, min_cap(2), &c).build().unwrap_err();
    assert!(
        e.to_string().contains("1 of the pool's 2 files exist"),
        "{e}"
    );
    assert!(!second.exists(), "nothing was made");
    builder(&two, 2, min_cap(2), &c)
        .create_mode(CreateMode::Always)
        .build()
        .unwrap()
        .close()
        .unwrap();
}

/// Set in the crash child's environment: `DIR;CAPACITY;MODE`.
const CHILD_ENV: &str = "KVTIER_BUILDER_CREATE_CHILD";

/// The crash child: one build (with prewrite, so a create takes a while),
/// then says BUILT and holds the pool until killed.
#[test]
fn builder_create_child() {
    let Ok(spec) = std::env::var(CHILD_ENV) else {
        return;
    };
    let mut f = spec.split(';');
    let dir = f.next().unwrap().to_string();
    let capacity: u64 = f.next().unwrap().parse().unwrap();
    let mode = CreateMode::parse(f.next().unwrap()).unwrap();
    let c = cache();
    match builder(Path::new(&dir), 2, capacity, &c)
        .create_mode(mode)
        .prewrite(true)
        .build()
    {
        Ok(_h) => {
            println!("BUILT");
            std::thread::sleep(Duration::from_secs(600));
        }
        Err(e) => {
            println!("FAILED {e}");
            std::process::exit(1);
        }
    }
}

fn child(dir: &Path, capacity: u64, mode: &str) -> std::process::Child {
    Command::new(std::env::current_exe().unwrap())
        .args(["builder_create_child", "--exact", "--nocapture"])
        .env(
            CHILD_ENV,
            format!("{};{capacity};{mode}", dir.to_str().unwrap()),
        )
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap()
}

/// Runs the child until it says BUILT; how long that took.
fn time_child(dir: &Path, capacity: u64, mode: &str) -> Duration {
    use std::io::BufRead;
    let t = Instant::now();
    let mut ch = child(dir, capacity, mode);
    // The test harness speaks first ("running 1 test").
    let said: Vec<String> = std::io::BufReader::new(ch.stdout.take().unwrap())
        .lines()
        .map_while(|l| l.ok())
        .take_while(|l| l != "BUILT")
        .collect();
    let took = t.elapsed();
    let _ = ch.kill();
    let status = ch.wait().unwrap();
    assert!(status.code().is_none(), "the child failed: {said:?}");
    took
}

/// SIGKILL a build while it creates: over nothing (a first start, the
/// default mode), and over a pool holding blocks (`CreateMode::Always`).
/// Afterwards the directory holds the old pool with every block whole, or a
/// new empty pool, or no pool at all; the same build again always works;
/// and after a killed reformat the default build opens the old pool,
/// finishes the create, or refuses with a fix, never formatting silently.
#[test]
fn sigkill_during_a_create_leaves_the_old_pool_or_none_and_the_same_build_finishes_it() {
    let dir = TempDir::new("builder-kill");
    let c = cache();
    let capacity = 64 << 20;
    let mut rng = Rng(0x5EED_B11D_0000_0026);
    let per_case = crash_iterations(6);
    let mut seen = std::collections::BTreeMap::<String, usize>::new();
    for over_pool in [false, true] {
        let pool_dir = dir.file(if over_pool { "over" } else { "first" });
        let mode = if over_pool { "always" } else { "auto" };
        let reset = || {
            let _ = std::fs::remove_dir_all(&pool_dir);
            if over_pool {
                let h = builder(&pool_dir, 2, capacity, &c).build().unwrap();
                store(&h, &c, 100..108);
                h.close().unwrap();
            }
        };
        reset();
        let full = time_child(&pool_dir, capacity, mode);
        for i in 0..per_case {
            let what = format!("over a pool {over_pool}, kill {i}");
            reset();
            let mut ch = child(&pool_dir, capacity, mode);
            std::thread::sleep(full.mul_f64(rng.below(1000) as f64 / 1000.0));
            let _ = ch.kill();
            let _ = ch.wait();
            // What the kill left, opened as it is (open only).
            let state = match builder(&pool_dir, 2, capacity, &c)
                .create_mode(CreateMode::Never)
                .build()
            {
                Ok(h) if h.lookup_prefix(&keys(100..108)) == 8 => {
                    assert!(over_pool, "{what}: blocks nobody stored");
                    assert_loads(&h, &c, 100..108);
                    "old pool"
                }
                Ok(h) => {
                    assert_eq!(h.lookup_prefix(&keys(100..108)), 0, "{what}");
                    "new pool"
                }
                Err(e) => {
                    assert!(
                        matches!(e.kind(), ErrorKind::Usage | ErrorKind::Corrupt),
                        "{what}: {e}"
                    );
                    "no pool"
                }
            };
            *seen.entry(state.to_string()).or_default() += 1;
            if over_pool {
                // The default build (no force) after a killed reformat:
                // opens the old pool, or creates over what only the killed
                // create left, or refuses naming the fix; never formats
                // over a pool it cannot tell was given up.
                match builder(&pool_dir, 2, capacity, &c).build() {
                    Ok(h) if state == "old pool" => assert_loads(&h, &c, 100..108),
                    Ok(h) => assert_eq!(h.lookup_prefix(&keys(100..108)), 0, "{what}"),
                    Err(e) => {
                        assert_eq!(state, "no pool", "{what}: {e}");
                        assert!(e.fix().is_some(), "{what}: no fix named: {e}");
                        *seen.entry("refused without force".into()).or_default() += 1;
                    }
                }
            }
            // The same call again always works, and gives an empty pool.
            let h = builder(&pool_dir, 2, capacity, &c)
                .create_mode(CreateMode::parse(mode).unwrap())
                .build()
                .unwrap_or_else(|e| panic!("{what} ({state}): the same build again: {e}"));
            assert_eq!(h.lookup_prefix(&keys(100..108)), 0, "{what} ({state})");
            store(&h, &c, 0..4);
            assert_loads(&h, &c, 0..4);
            h.close().unwrap();
            let pool = Pool::open(
                &kvtier::pool::place::directory_files(&pool_dir, 2),
                &OpenExpect::default(),
            )
            .unwrap();
            assert!(pool.check(|_, _| {}).unwrap().is_clean(), "{what}");
        }
    }
    eprintln!("after the kills: {seen:?}");
}
