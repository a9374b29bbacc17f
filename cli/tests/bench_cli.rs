//! `kvtier bench` end to end at toy sizes: the figures exist, add up, and
//! the reports (table, JSON, SVG) are written. Speed is not asserted here.

#[path = "../../tests/common/mod.rs"]
mod common;

use common::TempDir;
use std::process::Command;

fn bench(dir: &TempDir, args: &[&str]) -> (String, serde_json::Value) {
    let json = dir.file("out.json");
    let out = Command::new(env!("CARGO_BIN_EXE_kvtier"))
        .arg("bench")
        // Each store's steps on stderr (`tier::trace::StoreTrace`).
        .env("KVTIER_TRACE_STORES", "1")
        .arg("--dir")
        .arg(dir.path())
        .arg("--json")
        .arg(&json)
        .args(args)
        .output()
        .unwrap();
    let text =
        String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{text}");
    let v = serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    (text, v)
}

#[test]
fn kv_bench_reports_every_figure_and_plots() {
    let dir = TempDir::new("benchkv");
    let svg = dir.file("bw.svg");
    let (text, v) = bench(
        &dir,
        &[
            "--contexts",
            "1024,4096,999999",
            "--capacity",
            "600m",
            "--group-blocks",
            "16",
            "--plot",
            svg.to_str().unwrap(),
        ],
    );
    assert!(
        text.contains("store GiB/s") && text.contains("skipped 999999 tokens"),
        "{text}"
    );
    let results = v["results"].as_array().unwrap();
    assert_eq!(results.len(), 2);
    let r = &results[1];
    assert_eq!(r["tokens"], 4096);
    assert_eq!(r["blocks"], 256);
    assert_eq!(r["bytes"], 256u64 * 2 * 1024 * 1024);
    assert_eq!(r["verified"], true);
    // 256 blocks stored together in groups of 16: one I/O per group per layer.
    assert_eq!(r["ios_per_layer"], 16.0);
    for f in [
        "store_gib_s",
        "retrieve_gib_s",
        "store_cpu_us_per_object",
        "retrieve_cpu_us_per_object",
    ] {
        assert!(r[f].as_f64().unwrap() > 0.0, "{f}");
    }
    // The engine alone writing the same bytes, and the same run with its
    // one flush counted: never faster than without it.
    let (alone, durable) = (
        r["engine_write_gib_s"].as_f64().unwrap(),
        r["engine_write_durable_gib_s"].as_f64().unwrap(),
    );
    assert!(0.0 < durable && durable <= alone, "{alone} {durable}");
    assert!(text.contains("followed by one flush"), "{text}");
    // The engine alone wrote the same bytes to the store's slots before it
    // and after it (the second context's slots follow the first's), and
    // the load after both still verified every block.
    // The first context fits the fresh pool; the second evicts, so its
    // slots are not known before its store (said so).
    assert!(results[0]["engine_first_write_gib_s"].as_f64().unwrap() > 0.0);
    assert!(results[1]["engine_first_write_gib_s"].is_null());
    // The store's reference brackets it: the same write timed right before
    // it too, where its slots were known.
    let (before, before_durable) = (
        results[0]["engine_write_before_gib_s"].as_f64().unwrap(),
        results[0]["engine_write_before_durable_gib_s"]
            .as_f64()
            .unwrap(),
    );
    assert!(0.0 < before_durable && before_durable <= before);
    assert!(results[1]["engine_write_before_durable_gib_s"].is_null());
    assert!(text.contains("right before the store"), "{text}");
    assert!(
        text.contains("4096 tokens: no engine-alone write before the store"),
        "{text}"
    );
    assert!(!text.contains("took other slots"), "{text}");
    for r in results {
        assert_eq!(r["verified"], true);
    }
    // The store trace names every step of the protocol, data first and
    // the headers' flush last.
    let trace = &text[text.find("kvtier store").expect("a store trace")..];
    let at = |what: &str| {
        trace
            .find(what)
            .unwrap_or_else(|| panic!("{what}: {trace}"))
    };
    assert!(at("Data issue") < at("Data complete"));
    assert!(at("Data complete") < at("Flush(Data) complete"));
    assert!(at("Flush(Data) complete") < at("Headers issue"));
    assert!(at("Headers complete") < at("Flush(Headers) complete"));
    // The peak memory counts the 512 MiB KV cache, in the resident set or
    // in reserved huge pages (which RSS leaves out) where some were free.
    let peak = &v["peak_rss"];
    assert!(
        peak["kvtier_bytes"].as_u64().unwrap() + peak["hugetlb_bytes"].as_u64().unwrap()
            > 256 << 21,
        "{peak}"
    );
    assert!(v["machine"]["kernel"].as_str().unwrap().len() > 1);
    assert_eq!(v["config"]["geometry"]["layers"], 32);
    let svg_text = std::fs::read_to_string(&svg).unwrap();
    assert!(svg_text.contains("<svg") && svg_text.contains("retrieve"));
    assert!(
        !dir.file("bench0.pool").exists(),
        "pool files are removed unless --keep"
    );
}

/// `--repeat`: every round on its own fresh (prewritten) pool, then the
/// medians of each figure; `--first-fill` stores into never-written space.
#[test]
fn kv_bench_repeats_rounds_and_reports_medians() {
    let dir = TempDir::new("benchrep");
    let (text, v) = bench(
        &dir,
        &["--contexts", "1024", "--capacity", "300m", "--repeat", "3"],
    );
    assert!(text.contains("medians of 3 rounds"), "{text}");
    assert!(text.contains("prewriting the pool files"), "{text}");
    let rounds = v["rounds"].as_array().unwrap();
    assert_eq!(rounds.len(), 3);
    let stores: Vec<f64> = rounds
        .iter()
        .map(|r| r["results"][0]["store_gib_s"].as_f64().unwrap())
        .collect();
    let mut sorted = stores.clone();
    sorted.sort_by(f64::total_cmp);
    let m = &v["medians"][0];
    assert_eq!(m["tokens"], 1024);
    assert_eq!(m["store_gib_s"].as_f64().unwrap(), sorted[1], "{stores:?}");
    assert!(m["store_vs_fio_write"].is_null(), "no fio asked for");
    assert!(m["store_vs_engine_write"].as_f64().unwrap() > 0.0, "{text}");
    assert!(
        m["retrieve_vs_engine_read"].as_f64().unwrap() > 0.0,
        "{text}"
    );
    assert!(text.contains("the engine alone writing"), "{text}");
    assert!(
        text.contains("retrieve") && text.contains("the engine alone reading"),
        "{text}"
    );
    assert_eq!(v["rounds"][0]["config"]["prewrite"], true);

    let (text, v) = bench(
        &dir,
        &["--contexts", "1024", "--capacity", "300m", "--first-fill"],
    );
    assert!(!text.contains("prewriting"), "{text}");
    assert_eq!(v["config"]["prewrite"], false);
    assert_eq!(v["results"][0]["verified"], true);
}

#[test]
fn raw_pattern_and_contention_runs() {
    let dir = TempDir::new("benchraw");
    let (text, v) = bench(
        &dir,
        &[
            "--pattern",
            "randrw",
            "--bs",
            "64k",
            "--iodepth",
            "8",
            "--size",
            "64m",
            "--runtime",
            "0.5",
        ],
    );
    let k = &v["runs"][0]["kvtier"];
    assert!(
        k["read_ios"].as_u64().unwrap() > 0 && k["write_ios"].as_u64().unwrap() > 0,
        "{text}"
    );
    assert_eq!(
        v["runs"][0]["engine"]["stats"]["ios"].as_u64().unwrap(),
        k["read_ios"].as_u64().unwrap() + k["write_ios"].as_u64().unwrap()
    );
    let (text, v) = bench(
        &dir,
        &[
            "--contention",
            "--bs",
            "1m",
            "--iodepth",
            "4",
            "--size",
            "128m",
            "--runtime",
            "0.5",
        ],
    );
    assert_eq!(v["runs"].as_array().unwrap().len(), 3, "{text}");
    assert!(text.contains("contention: read alone"), "{text}");
    let both = &v["runs"][2]["kvtier"];
    assert!(both["read_bytes"].as_u64().unwrap() > 0 && both["write_bytes"].as_u64().unwrap() > 0);
}

/// `--buffers`: the raw run's I/Os walk that much memory (one pass over the
/// file here moves every byte once), under contention too; more than the
/// limit is refused by name.
#[test]
fn raw_pattern_walks_a_larger_buffer() {
    let dir = TempDir::new("benchbuf");
    let (text, v) = bench(
        &dir,
        &[
            "--pattern",
            "write",
            "--bs",
            "64k",
            "--iodepth",
            "4",
            "--size",
            "16m",
            "--runtime",
            "0",
            "--buffers",
            "8m",
        ],
    );
    assert_eq!(v["buffer_bytes"], 8u64 << 20, "{text}");
    assert!(text.contains("walk 8 MiB of buffers"), "{text}");
    let k = &v["runs"][0]["kvtier"];
    assert_eq!(k["write_bytes"], 16u64 << 20, "{text}");
    assert_eq!(k["write_ios"], 256, "{text}");
    let (text, v) = bench(
        &dir,
        &[
            "--contention",
            "--bs",
            "64k",
            "--iodepth",
            "4",
            "--size",
            "32m",
            "--runtime",
            "0.3",
            "--buffers",
            "4m",
        ],
    );
    let both = &v["runs"][2]["kvtier"];
    assert!(
        both["read_bytes"].as_u64().unwrap() > 0 && both["write_bytes"].as_u64().unwrap() > 0,
        "{text}"
    );
    let out = Command::new(env!("CARGO_BIN_EXE_kvtier"))
        .args([
            "bench",
            "--pattern",
            "read",
            "--size",
            "8m",
            "--buffers",
            "1p",
            "--dir",
        ])
        .arg(dir.path())
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && err.contains("--buffers"), "{err}");
}

#[test]
fn bad_bench_arguments_are_named() {
    let dir = TempDir::new("benchbad");
    // Refused (the error on stderr), leaving nothing in --dir.
    let refused = |args: &[&str]| -> String {
        let out = Command::new(env!("CARGO_BIN_EXE_kvtier"))
            .arg("bench")
            .args(args)
            .arg("--dir")
            .arg(dir.path())
            .output()
            .unwrap();
        assert!(!out.status.success(), "{args:?} was not refused");
        assert_eq!(
            std::fs::read_dir(dir.path()).unwrap().count(),
            0,
            "{args:?}"
        );
        String::from_utf8_lossy(&out.stderr).into_owned()
    };
    let err = refused(&["--pattern", "sideways"]);
    assert!(err.contains("unknown --pattern \"sideways\""), "{err}");
    let err = refused(&["--pattern", "read", "--bs", "1000", "--size", "1m"]);
    assert!(err.contains("--bs 1000"), "{err}");
    // Refused before a pool is made and prewritten.
    let err = refused(&["--max-io", "4096", "--capacity", "1g"]);
    assert!(
        err.contains("--max-io 4096") && err.contains("32768") && !err.contains("prewriting"),
        "{err}"
    );
    // A capacity too small for one extent group names the bench's flag.
    let err = refused(&["--capacity", "64m"]);
    assert!(
        err.contains("raise --capacity") && !err.contains("--size"),
        "{err}"
    );

    // A report path that holds something other than a report is refused
    // before any work, and left as it was.
    let other = TempDir::new("benchbad-other");
    let precious = other.file("held.pool");
    std::fs::write(&precious, b"KVTIERSB not a report").unwrap();
    // The smallest KV bench: one 16-token context on a 64 MiB pool.
    fn tiny<'a>(head: &[&'a str]) -> Vec<&'a str> {
        [
            head,
            &[
                "--contexts",
                "16",
                "--capacity",
                "64m",
                "--group-blocks",
                "4",
            ],
        ]
        .concat()
    }
    for flag in ["--json", "--plot"] {
        let err = refused(&tiny(&[flag, precious.to_str().unwrap()]));
        assert!(
            err.contains(flag)
                && err.contains("held.pool")
                && err.contains("remove it or name another file"),
            "{err}"
        );
        assert_eq!(std::fs::read(&precious).unwrap(), b"KVTIERSB not a report");
    }
    let err = refused(&tiny(&["--plot", "/dev/full"]));
    assert!(
        err.contains("--plot") && err.contains("No space left"),
        "{err}"
    );
    let err = refused(&["--plot", other.path().to_str().unwrap(), "--contexts", "16"]);
    assert!(err.contains("not a regular file"), "{err}");
    let same = other.file("same.out");
    let err = refused(&[
        "--plot",
        same.to_str().unwrap(),
        "--json",
        same.to_str().unwrap(),
    ]);
    assert!(err.contains("same file"), "{err}");
}

/// Contexts smaller than one --max-io I/O (a block or two), in a directory
/// whose name is not UTF-8: the run, its engine-alone comparison and the
/// JSON report all complete, and a second run replaces its own report.
#[test]
fn tiny_contexts_and_a_non_utf8_directory() {
    use std::os::unix::ffi::OsStrExt;
    let top = TempDir::new("benchtiny");
    let dir = top.path().join(std::ffi::OsStr::from_bytes(b"d\xff\xfe"));
    let json = top.file("tiny.json");
    for _ in 0..2 {
        let out = Command::new(env!("CARGO_BIN_EXE_kvtier"))
            .arg("bench")
            .arg("--dir")
            .arg(&dir)
            .args([
                "--contexts",
                "16,64",
                "--capacity",
                "64m",
                "--group-blocks",
                "4",
                "--json",
            ])
            .arg(&json)
            .output()
            .unwrap();
        let text = String::from_utf8_lossy(&out.stdout).into_owned()
            + &String::from_utf8_lossy(&out.stderr);
        assert!(out.status.success(), "{text}");
        assert!(text.contains("engine alone"), "{text}");
        let v: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
        let results = v["results"].as_array().unwrap();
        assert_eq!(results.len(), 2, "{v}");
        assert!(
            results[0]["engine_write_gib_s"].as_f64().unwrap() > 0.0,
            "{v}"
        );
        assert!(
            v["config"]["dir"].as_str().unwrap().contains('\u{fffd}'),
            "{v}"
        );
    }
}

#[test]
fn against_fio_reports_ratios_when_fio_is_installed() {
    if kvtier_cli::bench::fio::fio_available().is_none() {
        eprintln!("fio not installed: skipping the side-by-side run");
        return;
    }
    let dir = TempDir::new("benchfio");
    let (text, v) = bench(
        &dir,
        &[
            "--pattern",
            "randread",
            "--bs",
            "80k",
            "--iodepth",
            "8",
            "--size",
            "64m",
            "--runtime",
            "0.5",
            "--against-fio",
        ],
    );
    assert!(
        text.contains("kvtier/fio") && text.contains("CPU per I/O"),
        "{text}"
    );
    assert!(v["runs"][0]["fio"]["read_bw"].as_f64().unwrap() > 0.0);
    assert!(v["fio_version"].as_str().unwrap().starts_with("fio"));
}

/// `--mem-budget`: a context whose KV cache would take more host memory
/// than the budget is skipped, and the report says why and how to run it.
#[test]
fn contexts_over_the_memory_budget_are_skipped_and_named() {
    let dir = TempDir::new("benchbudget");
    let (text, v) = bench(
        &dir,
        &[
            "--contexts",
            "16,1024",
            "--capacity",
            "256m",
            "--group-blocks",
            "4",
            "--mem-budget",
            "64m",
            "--load-inflight",
            "8m",
        ],
    );
    assert_eq!(v["config"]["tier"]["load_inflight_bytes"], 8u64 << 20);
    let results = v["results"].as_array().unwrap();
    assert_eq!(results.len(), 1, "{text}");
    assert_eq!(results[0]["tokens"], 16);
    assert!(
        text.contains("skipped 1024 tokens")
            && text.contains("128 MiB of host memory")
            && text.contains("raise --mem-budget"),
        "{text}"
    );
    assert!(text.contains("peak RSS: kvtier"), "{text}");
}

/// `--lookups`: lookup and pin+unpin latency idle and while loads run, per
/// round, with busy/idle p99 ratios; every stored key is found throughout
/// (the run fails otherwise); the pool file is removed. No figure is
/// asserted beyond being there.
#[test]
fn lookup_latency_bench_reports_idle_and_busy_rounds() {
    let dir = TempDir::new("benchlookups");
    let (text, v) = bench(
        &dir,
        &[
            "--lookups",
            "--contexts",
            "512",
            "--lookup-samples",
            "200",
            "--repeat",
            "2",
            "--group-blocks",
            "4",
        ],
    );
    assert!(
        text.contains("p99 busy/idle") && text.contains("median over 2 round(s)"),
        "{text}"
    );
    let rounds = v["rounds"].as_array().unwrap();
    assert_eq!(rounds.len(), 2);
    for r in rounds {
        for phase in ["idle", "busy"] {
            for call in ["lookup", "pin_unpin"] {
                let l = &r[phase][call];
                assert_eq!(l["samples"], 200, "{phase} {call}");
                let (p50, p99, max) = (
                    l["p50_us"].as_f64().unwrap(),
                    l["p99_us"].as_f64().unwrap(),
                    l["max_us"].as_f64().unwrap(),
                );
                assert!(0.0 < p50 && p50 <= p99 && p99 <= max, "{phase} {call}: {l}");
            }
        }
        assert!(r["busy"]["loads"].as_u64().unwrap() >= 1, "{r}");
        assert!(r["busy"]["load_gib_s"].as_f64().unwrap() > 0.0);
    }
    assert!(v["median_lookup_p99_ratio"].as_f64().unwrap() > 0.0);
    assert_eq!(v["config"]["tokens"], 512);
    assert!(
        !dir.file("lookup0.pool").exists(),
        "the pool file is removed"
    );
    // Only on pool files with the uring engine, without fio.
    let out = Command::new(env!("CARGO_BIN_EXE_kvtier"))
        .args(["bench", "--lookups", "--against-fio", "--dir"])
        .arg(dir.path())
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("--lookups") && err.contains("--against-fio"),
        "{err}"
    );
}

/// The userspace engines need a controller, named or from
/// $KVTIER_NVME_DEVICE, that exists and is bound to a userspace driver;
/// fio cannot be the reference there; --nvme means nothing to uring.
#[test]
fn userspace_engine_arguments_are_named() {
    let dir = TempDir::new("benchnvme");
    let run = |args: &[&str]| {
        let out = Command::new(env!("CARGO_BIN_EXE_kvtier"))
            .arg("bench")
            .args(args)
            .arg("--dir")
            .arg(dir.path())
            .env_remove("KVTIER_NVME_DEVICE")
            .output()
            .unwrap();
        assert!(!out.status.success(), "{args:?} should fail");
        String::from_utf8_lossy(&out.stderr).into_owned()
    };
    let err = run(&["--engine", "nvme"]);
    assert!(err.contains("--engine nvme needs --nvme ADDR"), "{err}");
    let err = run(&["--engine", "gpu-host", "--nvme", "0000:ff:1f.7"]);
    assert!(err.contains("there is no PCI device 0000:ff:1f.7"), "{err}");
    let err = run(&[
        "--engine",
        "nvme",
        "--nvme",
        "0000:ff:1f.7",
        "--against-fio",
    ]);
    assert!(
        err.contains("--against-fio needs the pool on files"),
        "{err}"
    );
    let err = run(&["--nvme", "0000:ff:1f.7"]);
    assert!(err.contains("the uring engine uses pool files"), "{err}");
    let err = run(&["--engine", "nvme", "--nvme", "not-an-address"]);
    assert!(err.contains("not a PCI address"), "{err}");
}

/// `--memory gpu` without a GPU: a clear error naming the fix, no pool
/// files left behind. (On a GPU machine, scripts/gpu/pass8.sh runs it.)
#[test]
fn bench_memory_gpu_without_a_gpu_names_the_fix() {
    if kvtier_cli::bench::hbm::gpu_unavailable().is_none() {
        eprintln!("bench_memory_gpu_without_a_gpu_names_the_fix: SKIPPED (this machine has a GPU)");
        return;
    }
    let dir = TempDir::new("bench-hbm-nogpu");
    let out = Command::new(env!("CARGO_BIN_EXE_kvtier"))
        .args(["bench", "--memory", "gpu", "--contexts", "1024", "--dir"])
        .arg(dir.path())
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(
        err.contains("needs a CUDA GPU") || err.contains("install-nvcc"),
        "{err}"
    );
    assert!(
        err.contains("drop --memory gpu") || err.contains("rebuild"),
        "{err}"
    );
    assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 0);
}

/// The `--memory gpu` bench's code on the CPU double of the copies (host
/// memory standing in for HBM): every figure is there, restored bytes are
/// verified, and each staged figure comes with its two ceilings.
#[test]
fn bench_memory_host_double_reports_ceilings() {
    let dir = TempDir::new("bench-hbm-double");
    let (text, v) = bench(
        &dir,
        &[
            "--memory",
            "host-double",
            "--contexts",
            "1024,999999",
            "--capacity",
            "600m",
            "--group-blocks",
            "16",
        ],
    );
    assert!(
        text.contains("host double") && text.contains("skipped: 999999"),
        "{text}"
    );
    let r = &v["results"][0];
    assert_eq!(r["tokens"], 1024);
    assert_eq!(r["verified"], true);
    for f in [
        "restore_gib_s",
        "disk_read_gib_s",
        "h2d_gib_s",
        "store_gib_s",
        "disk_write_gib_s",
        "d2h_gib_s",
    ] {
        assert!(r[f].as_f64().unwrap() > 0.0, "{f}: {r}");
    }
    let ratio = r["restore_gib_s"].as_f64().unwrap()
        / r["disk_read_gib_s"]
            .as_f64()
            .unwrap()
            .min(r["h2d_gib_s"].as_f64().unwrap());
    assert!((ratio - r["restore_vs_ceiling"].as_f64().unwrap()).abs() < 1e-9);
}

/// `--service`: each context's store and restore also go through the node's
/// service, started in the bench's process on a pool of its own, by a staged
/// client over the same (double) KV memory; restored bytes are verified,
/// each figure comes with its ratios to the in-process path and the
/// ceilings of the same run, and nothing the service made is left in --dir.
#[test]
fn bench_memory_host_double_through_the_service() {
    let dir = TempDir::new("bench-hbm-service");
    let (text, v) = bench(
        &dir,
        &[
            "--memory",
            "host-double",
            "--service",
            "--contexts",
            "256,1024",
            "--capacity",
            "600m",
            "--group-blocks",
            "16",
        ],
    );
    assert!(text.contains("through the node's service"), "{text}");
    assert!(v["service_staging"]["layer_buffers"].as_u64().unwrap() > 0);
    assert!(v["service_first_jobs_ms"].as_f64().unwrap() > 0.0);
    for (i, tokens) in [256, 1024].into_iter().enumerate() {
        let r = &v["results"][i];
        assert_eq!(r["tokens"], tokens);
        let s = &r["service"];
        assert_eq!(s["verified"], true, "{r}");
        for f in ["restore_gib_s", "store_gib_s", "restore_first_layer_ms"] {
            assert!(s[f].as_f64().unwrap() > 0.0, "{f}: {r}");
        }
        let f = |o: &serde_json::Value, k: &str| o[k].as_f64().unwrap();
        let vs = f(s, "store_gib_s") / f(r, "store_gib_s");
        assert!((vs - f(s, "store_vs_in_process")).abs() < 1e-9, "{r}");
        let ceiling = f(r, "disk_read_gib_s").min(f(r, "h2d_gib_s"));
        assert!((f(s, "restore_gib_s") / ceiling - f(s, "restore_vs_ceiling")).abs() < 1e-9);
    }
    // What the bench leaves: its JSON only (the pool, the service's pool,
    // its socket and directory are gone).
    let left: Vec<_> = std::fs::read_dir(dir.path())
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    assert_eq!(left, ["out.json"]);
}

/// `--service` is the GPU bench's (the in-process staged path against the
/// service's): without `--memory gpu` it is refused before anything is made.
#[test]
fn bench_service_needs_the_gpu_bench() {
    let dir = TempDir::new("bench-service-host");
    let out = Command::new(env!("CARGO_BIN_EXE_kvtier"))
        .args(["bench", "--service", "--contexts", "16", "--dir"])
        .arg(dir.path())
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(
        err.contains("--memory gpu") && err.contains("drop --service"),
        "{err}"
    );
    assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 0);
}

/// The bench's scratch pool is created, formatted and used through the
/// descriptor it was created with: a symlink swapped in for it by another
/// user of the directory (here a thread, as fast as it can) receives
/// nothing. Before, the pool was created O_NOFOLLOW and then reopened by
/// name, and the link's target got a kvtier superblock (4 of 12 runs).
#[test]
fn a_symlink_swapped_in_for_the_scratch_pool_receives_nothing() {
    use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
    use std::sync::Arc;
    let dir = TempDir::new("benchswap");
    let other = TempDir::new("benchswap-victim");
    let victim = other.file("victim");
    std::fs::write(&victim, b"").unwrap();
    let name = dir.file("bench0.pool");
    let stop = Arc::new(AtomicBool::new(false));
    let swaps = Arc::new(AtomicU32::new(0));
    let swapper = {
        let (stop, swaps, name, victim, moved) = (
            stop.clone(),
            swaps.clone(),
            name.clone(),
            victim.clone(),
            dir.file("moved"),
        );
        std::thread::spawn(move || {
            while !stop.load(Ordering::Relaxed) {
                let is_file = std::fs::symlink_metadata(&name).is_ok_and(|m| m.is_file());
                if is_file && std::fs::rename(&name, &moved).is_ok() {
                    let _ = std::os::unix::fs::symlink(&victim, &name);
                    swaps.fetch_add(1, Ordering::Relaxed);
                }
                std::hint::spin_loop();
            }
        })
    };
    for run in 0..6 {
        let _ = std::fs::remove_file(&name);
        let _ = std::fs::remove_file(dir.file("moved"));
        let out = Command::new(env!("CARGO_BIN_EXE_kvtier"))
            .arg("bench")
            .arg("--dir")
            .arg(dir.path())
            .args([
                "--contexts",
                "16",
                "--capacity",
                "64m",
                "--group-blocks",
                "4",
            ])
            .output()
            .unwrap();
        let text = String::from_utf8_lossy(&out.stderr).into_owned();
        assert_eq!(
            std::fs::metadata(&victim).unwrap().len(),
            0,
            "run {run}: the link's target was written: {text}"
        );
    }
    stop.store(true, Ordering::Relaxed);
    swapper.join().unwrap();
    assert!(swaps.load(Ordering::Relaxed) > 0, "the race was run");
}

/// Report outputs replace only kvtier's own reports, and never an input of
/// the same run: replay's --json naming its --table (a slack table, a kvtier
/// file too) is refused, as is a user's JSON that happens to have a field
/// named "machine" (both were overwritten before), each left as it was.
#[test]
fn report_outputs_never_replace_an_input_or_a_users_json() {
    let dir = TempDir::new("reportin");
    let table = dir.file("table.json");
    std::fs::copy(
        common::repo_root().join("tables/llama3-8b.h100.json"),
        &table,
    )
    .unwrap();
    let before = std::fs::read(&table).unwrap();
    let t = table.to_str().unwrap();
    let data = dir.file("data");
    let out = Command::new(env!("CARGO_BIN_EXE_kvtier"))
        .args([
            "replay", "--table", t, "--json", t, "--input", "16", "--prefix", "16",
        ])
        .arg("--dir")
        .arg(&data)
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{err}");
    assert!(
        err.contains("--table") && err.contains("input of this run"),
        "{err}"
    );
    assert_eq!(std::fs::read(&table).unwrap(), before);

    let user = dir.file("user.json");
    std::fs::write(&user, b"{\"machine\": \"my notes\"}").unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_kvtier"))
        .args(["bench", "--contexts", "16", "--capacity", "64m", "--json"])
        .arg(&user)
        .arg("--dir")
        .arg(&data)
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{err}");
    assert!(
        err.contains("user.json") && err.contains("not a JSON report"),
        "{err}"
    );
    assert_eq!(
        std::fs::read(&user).unwrap(),
        b"{\"machine\": \"my notes\"}"
    );
}

/// A raw bench's numbers are checked before its file is laid out: a
/// --bs that is no multiple of 4096 and a --buffers beyond what a run may
/// use are refused before "laying out" (a 4 GiB layout took 18 s first).
#[test]
fn raw_bench_numbers_are_refused_before_the_layout() {
    let dir = TempDir::new("rawearly");
    for (args, want) in [
        (vec!["--bs", "1.5k"], "--bs 1536"),
        (vec!["--buffers", "1t"], "--buffers"),
    ] {
        let out = Command::new(env!("CARGO_BIN_EXE_kvtier"))
            .args(["bench", "--pattern", "read", "--size", "4g"])
            .args(&args)
            .arg("--dir")
            .arg(dir.path())
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{args:?}: {err}");
        assert!(err.contains(want), "{args:?}: {err}");
        assert!(
            !err.contains("laying out"),
            "{args:?} refused only after: {err}"
        );
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 0);
    }
}
