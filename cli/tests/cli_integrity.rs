//! The `kvtier` command as a careless user or an attacker would drive it:
//! it never destroys a file it was not told to, never panics or aborts on a
//! number or a file it is handed, reads no unbounded input, and stops
//! quietly when its output's reader goes away.

#[path = "../../tests/common/mod.rs"]
mod common;

use common::{repo_root, TempDir};
use std::os::unix::fs::symlink;
use std::os::unix::process::{CommandExt, ExitStatusExt};
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

fn kvtier() -> Command {
    Command::new(env!("CARGO_BIN_EXE_kvtier"))
}

/// Runs `cmd` with a deadline (a hang is a failure, not a stuck test) and
/// an address-space limit (an unbounded allocation fails fast instead of
/// taking the machine's memory).
fn run_bounded(mut cmd: Command, secs: u64) -> Output {
    // SAFETY: setrlimit is async-signal-safe; nothing else runs in the child.
    unsafe {
        cmd.pre_exec(|| {
            let lim = libc::rlimit {
                rlim_cur: 8 << 30,
                rlim_max: 8 << 30,
            };
            libc::setrlimit(libc::RLIMIT_AS, &lim);
            Ok(())
        });
    }
    let mut child = cmd
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let start = Instant::now();
    loop {
        if child.try_wait().unwrap().is_some() {
            return child.wait_with_output().unwrap();
        }
        if start.elapsed() > Duration::from_secs(secs) {
            let _ = child.kill();
            let out = child.wait_with_output().unwrap();
            panic!(
                "did not finish in {secs} s: {:?}\n{}",
                cmd,
                String::from_utf8_lossy(&out.stderr)
            );
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn text(out: &Output) -> String {
    String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr)
}

/// A refusal: exit status 2, an error on stderr, never a panic or signal.
fn assert_refused(out: &Output, want: &[&str]) {
    let t = text(out);
    assert!(!t.contains("panicked"), "panicked: {t}");
    assert_eq!(out.status.code(), Some(2), "{:?}: {t}", out.status);
    for w in want {
        assert!(t.contains(w), "want {w:?} in: {t}");
    }
}

/// An ext4-looking image: superblock magic 0xEF53 at byte 1080, data after.
fn fake_ext4(path: &Path, len: usize) -> Vec<u8> {
    let mut b: Vec<u8> = (0..len).map(|i| (i % 251) as u8).collect();
    b[1080] = 0x53;
    b[1081] = 0xEF;
    std::fs::write(path, &b).unwrap();
    b
}

fn files_in(dir: &Path) -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    v.sort();
    v
}

// ---------------------------------------------------------------------------
// Scratch files: created new, never forced, only they are removed.

/// A KV bench of one llama3-8b block in an 8 MiB pool file.
const SMALL_BENCH: &[&str] = &[
    "bench",
    "--contexts",
    "16",
    "--capacity",
    "8m",
    "--group-blocks",
    "1",
];

#[test]
fn bench_refuses_a_file_in_its_way_and_leaves_it_alone() {
    let dir = TempDir::new("cli-bench-foreign");
    let precious = dir.file("bench0.pool");
    let bytes = fake_ext4(&precious, 1 << 20);
    let out = run_bounded(
        {
            let mut c = kvtier();
            c.args(SMALL_BENCH).arg("--dir").arg(dir.path());
            c
        },
        120,
    );
    assert_eq!(
        std::fs::read(&precious).ok(),
        Some(bytes),
        "the file was changed or removed: {}",
        text(&out)
    );
    assert_refused(&out, &["bench0.pool", "already exists"]);
}

#[test]
fn bench_never_writes_through_a_planted_symlink() {
    let dir = TempDir::new("cli-bench-link");
    let victim_dir = TempDir::new("cli-bench-victim");
    let victim = victim_dir.file("image");
    // All zeros and exactly the pool file's size: nothing in it to refuse.
    std::fs::write(&victim, vec![0u8; 8 << 20]).unwrap();
    std::fs::File::options()
        .write(true)
        .open(&victim)
        .unwrap()
        .sync_all()
        .unwrap();
    symlink(&victim, dir.file("bench0.pool")).unwrap();
    let out = run_bounded(
        {
            let mut c = kvtier();
            c.args(SMALL_BENCH).arg("--dir").arg(dir.path());
            c
        },
        120,
    );
    assert_refused(&out, &["bench0.pool", "already exists"]);
    let after = std::fs::read(&victim).unwrap();
    assert!(
        after.len() == 8 << 20 && after.iter().all(|&b| b == 0),
        "the symlink's target was written"
    );
    assert!(
        std::fs::symlink_metadata(dir.file("bench0.pool")).is_ok(),
        "the planted symlink was removed"
    );
}

#[test]
fn bench_removes_only_the_files_it_created_when_it_fails() {
    let dir = TempDir::new("cli-bench-partial");
    let theirs = dir.file("bench1.pool");
    let bytes = fake_ext4(&theirs, 64 << 10);
    let out = run_bounded(
        {
            let mut c = kvtier();
            c.args(&SMALL_BENCH[..3])
                .args([
                    "--capacity",
                    "16m",
                    "--group-blocks",
                    "1",
                    "--devices",
                    "2",
                    "--dir",
                ])
                .arg(dir.path());
            c
        },
        120,
    );
    // bench0.pool was made by the run: gone. bench1.pool was not: intact.
    assert_eq!(
        files_in(dir.path()),
        vec!["bench1.pool".to_string()],
        "{}",
        text(&out)
    );
    assert_eq!(std::fs::read(&theirs).unwrap(), bytes);
    assert_refused(&out, &["bench1.pool", "already exists"]);
}

#[test]
fn bench_pattern_keeps_a_test_file_it_did_not_create() {
    let dir = TempDir::new("cli-bench-dat");
    let theirs = dir.file("kvtier-bench.dat");
    std::fs::write(&theirs, b"results I want to keep").unwrap();
    let out = run_bounded(
        {
            let mut c = kvtier();
            c.args([
                "bench",
                "--pattern",
                "read",
                "--size",
                "8m",
                "--runtime",
                "0",
                "--dir",
            ])
            .arg(dir.path());
            c
        },
        60,
    );
    assert_eq!(
        std::fs::read(&theirs).ok().as_deref(),
        Some(&b"results I want to keep"[..]),
        "{}",
        text(&out)
    );
    assert_refused(&out, &["kvtier-bench.dat", "already exists"]);
}

#[test]
fn replay_never_formats_a_planted_symlink_or_an_existing_file() {
    let dir = TempDir::new("cli-replay-link");
    let victim_dir = TempDir::new("cli-replay-victim");
    let victim = victim_dir.file("ext4.img");
    let bytes = fake_ext4(&victim, 4 << 20);
    symlink(&victim, dir.file("replay.pool")).unwrap();
    let replay = |dir: &Path| {
        let mut c = kvtier();
        c.args([
            "replay",
            "--input",
            "16",
            "--prefix",
            "32",
            "--layer-us",
            "10",
            "--dir",
        ])
        .arg(dir);
        run_bounded(c, 120)
    };
    let out = replay(dir.path());
    assert_refused(&out, &["replay.pool", "already exists"]);
    assert_eq!(
        std::fs::read(&victim).unwrap(),
        bytes,
        "the image was wiped"
    );
    assert!(std::fs::symlink_metadata(dir.file("replay.pool")).is_ok());

    // A plain file of the same name: refused and kept too.
    std::fs::remove_file(dir.file("replay.pool")).unwrap();
    std::fs::write(dir.file("replay.pool"), b"mine").unwrap();
    let out = replay(dir.path());
    assert_refused(&out, &["replay.pool", "already exists"]);
    assert_eq!(std::fs::read(dir.file("replay.pool")).unwrap(), b"mine");

    // Nothing in the way: it runs, and leaves nothing behind.
    std::fs::remove_file(dir.file("replay.pool")).unwrap();
    let out = replay(dir.path());
    assert!(out.status.success(), "{}", text(&out));
    assert!(
        files_in(dir.path()).is_empty(),
        "{:?}",
        files_in(dir.path())
    );
}

#[test]
fn ctrl_c_removes_the_scratch_file() {
    let dir = TempDir::new("cli-sigint");
    let mut child = kvtier();
    child
        .args([
            "bench",
            "--pattern",
            "read",
            "--size",
            "16m",
            "--runtime",
            "60",
            "--dir",
        ])
        .arg(dir.path())
        .stdout(Stdio::null())
        .stderr(Stdio::piped());
    // Ctrl-C reaches a command run from a terminal with SIGINT at its
    // default action; a test runner started in the background (a shell
    // without job control) hands its children SIGINT ignored, which kvtier
    // rightly leaves alone. Give the child a terminal's disposition.
    // SAFETY: only async-signal-safe calls between fork and exec.
    unsafe {
        child.pre_exec(|| {
            libc::signal(libc::SIGINT, libc::SIG_DFL);
            Ok(())
        });
    }
    let mut child = child.spawn().unwrap();
    let file = dir.file("kvtier-bench.dat");
    let start = Instant::now();
    // Wait until the file is laid out and the run is under way.
    while !(file.exists() && std::fs::metadata(&file).unwrap().len() == 16 << 20) {
        assert!(
            start.elapsed() < Duration::from_secs(60),
            "no test file appeared"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    std::thread::sleep(Duration::from_millis(300));
    // SAFETY: signalling our own child.
    unsafe { libc::kill(child.id() as i32, libc::SIGINT) };
    let status = child.wait().unwrap();
    assert_eq!(status.signal(), Some(libc::SIGINT), "{status:?}");
    assert!(!file.exists(), "the scratch file outlived Ctrl-C");
}

// ---------------------------------------------------------------------------
// Input files: regular, bounded, never read without end.

#[test]
fn model_from_a_device_or_fifo_is_refused_at_once() {
    let dir = TempDir::new("cli-model-dev");
    let fifo = dir.file("config.json");
    let c = std::ffi::CString::new(fifo.to_str().unwrap()).unwrap();
    // SAFETY: a NUL-terminated path.
    assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
    for (model, what) in [
        ("/dev/zero", "a character device"),
        ("/dev/urandom", "a character device"),
        (fifo.to_str().unwrap(), "a FIFO"),
    ] {
        let mut c = kvtier();
        c.args(["pool", "create", "--size", "64m", "--model", model, "--dev"])
            .arg(dir.file("p.pool"));
        let out = run_bounded(c, 20);
        assert_refused(&out, &[model, what, "not a regular file"]);
    }
    assert!(!dir.file("p.pool").exists());
}

#[test]
fn oversized_config_and_table_are_refused_unread() {
    let dir = TempDir::new("cli-big-input");
    let big = dir.file("config.json");
    // A sparse 1 GiB file: refused by its size before a byte is read.
    std::fs::File::create(&big)
        .unwrap()
        .set_len(1 << 30)
        .unwrap();
    let mut c = kvtier();
    c.args(["pool", "create", "--size", "64m", "--model"])
        .arg(&big)
        .arg("--dev")
        .arg(dir.file("p.pool"));
    let out = run_bounded(c, 20);
    assert_refused(&out, &["config.json", "1073741824 bytes", "more than"]);
    let mut c = kvtier();
    c.args(["replay", "--table"])
        .arg(&big)
        .arg("--dir")
        .arg(dir.path());
    let out = run_bounded(c, 20);
    assert_refused(&out, &["cannot read the slack table", "more than"]);
}

fn llama_table() -> serde_json::Value {
    let p = repo_root().join("tables/llama3-8b.h100.json");
    serde_json::from_str(&std::fs::read_to_string(p).unwrap()).unwrap()
}

#[test]
fn a_huge_table_grid_with_few_entries_is_refused_without_allocating_it() {
    let dir = TempDir::new("cli-grid");
    let mut t = llama_table();
    // 60000 x 60000 grid points named by ~1 MB of JSON; one entry.
    t["input_lengths"] = (1..=60000u64).collect::<Vec<_>>().into();
    t["prefix_lengths"] = (0..60000u64).collect::<Vec<_>>().into();
    let first = t["entries"][0].clone();
    t["entries"] = vec![first].into();
    let path = dir.file("grid.json");
    std::fs::write(&path, t.to_string()).unwrap();
    let mut c = kvtier();
    c.args(["replay", "--table"])
        .arg(&path)
        .arg("--dir")
        .arg(dir.path());
    let out = run_bounded(c, 60);
    assert_refused(&out, &["entries has no entry for grid point", "found 1"]);
    assert!(
        text(&out).len() < 1000,
        "long message: {}",
        text(&out).len()
    );
}

#[test]
fn error_messages_quote_input_briefly() {
    let dir = TempDir::new("cli-short-errors");
    // An entry off a long grid: the grid is not printed whole.
    let mut t = llama_table();
    t["input_lengths"] = (1..=5000u64).map(|x| x * 512).collect::<Vec<_>>().into();
    t["entries"][0]["input"] = 3.into();
    let path = dir.file("t.json");
    std::fs::write(&path, t.to_string()).unwrap();
    let mut c = kvtier();
    c.args(["replay", "--table"])
        .arg(&path)
        .arg("--dir")
        .arg(dir.path());
    let out = run_bounded(c, 60);
    assert_refused(&out, &["entries[0].input is 3", "more"]);
    assert!(text(&out).len() < 1000, "{} bytes", text(&out).len());

    // A config.json field that is a 20 KB array.
    let cfg = format!(
        r#"{{"num_hidden_layers": [{}], "num_key_value_heads": 8, "head_dim": 128,
            "num_attention_heads": 32, "torch_dtype": "bfloat16"}}"#,
        vec!["12345"; 4000].join(",")
    );
    let path = dir.file("config.json");
    std::fs::write(&path, cfg).unwrap();
    let mut c = kvtier();
    c.args(["pool", "create", "--size", "64m", "--model"])
        .arg(&path)
        .arg("--dev")
        .arg(dir.file("p.pool"));
    let out = run_bounded(c, 20);
    assert_refused(
        &out,
        &["\"num_hidden_layers\" is [12345,", "more characters"],
    );
    assert!(text(&out).len() < 1000, "{} bytes", text(&out).len());

    // A 20 KB preset name.
    let name = "x".repeat(20000);
    let mut c = kvtier();
    c.args(["pool", "create", "--size", "64m", "--model", &name, "--dev"])
        .arg(dir.file("p.pool"));
    let out = run_bounded(c, 20);
    assert_refused(&out, &["unknown model preset"]);
    assert!(text(&out).len() < 1000, "{} bytes", text(&out).len());
}

// ---------------------------------------------------------------------------
// Numbers.

#[test]
fn every_numeric_flag_is_range_checked() {
    let dir = TempDir::new("cli-numbers");
    let d = dir.path().to_str().unwrap().to_string();
    let pool = dir.file("p.pool");
    let pool = pool.to_str().unwrap();
    let cases: Vec<(Vec<&str>, &str)> = vec![
        (vec!["replay", "--time-scale", "inf"], "--time-scale"),
        (vec!["replay", "--time-scale", "1e300"], "--time-scale"),
        (vec!["replay", "--time-scale", "NaN"], "--time-scale"),
        (vec!["replay", "--time-scale=-1"], "--time-scale"),
        (vec!["replay", "--layer-us", "1e300"], "--layer-us"),
        (vec!["replay", "--layer-us", "nan"], "--layer-us"),
        (vec!["replay", "--layer-us=-5"], "--layer-us"),
        (
            vec!["replay", "--prefix", "18446744073709551615"],
            "--prefix",
        ),
        (vec!["replay", "--prefix", "0"], "--prefix"),
        (
            vec!["replay", "--pending-writes", "4294967296"],
            "--pending-writes",
        ),
        (vec!["replay", "--input", "1000000000000"], "--input"),
        (vec!["replay", "--block-size", "0"], "--block-size"),
        (
            vec!["bench", "--runtime", "inf", "--pattern", "read"],
            "--runtime",
        ),
        (
            vec!["bench", "--runtime", "NaN", "--pattern", "read"],
            "--runtime",
        ),
        (
            vec!["bench", "--runtime=-1", "--pattern", "read"],
            "--runtime",
        ),
        (vec!["bench", "--capacity", "1e30"], "--capacity"),
        (vec!["bench", "--devices", "0"], "--devices"),
        (vec!["bench", "--devices", "100000"], "--devices"),
        (vec!["bench", "--contexts", "1024,0"], "--contexts"),
        (
            vec!["bench", "--contexts", "18446744073709551615"],
            "--contexts",
        ),
        (vec!["bench", "--iodepth", "0"], "--iodepth"),
        (
            vec!["bench", "--rwmixread", "101", "--pattern", "randrw"],
            "--rwmixread",
        ),
        (
            vec!["bench", "--repeat", "0", "--pattern", "read"],
            "--repeat",
        ),
        (
            vec!["bench", "--size", "1e30", "--pattern", "read"],
            "--size",
        ),
        (
            vec!["bench", "--bs", "16777216t", "--pattern", "read"],
            "--bs",
        ),
        (vec!["bench", "--max-io", "0"], "--max-io"),
        (vec!["bench", "--group-blocks", "0"], "--group-blocks"),
        (
            vec!["pool", "create", "--dev", pool, "--size", "1e30"],
            "--size",
        ),
        (
            vec!["pool", "create", "--dev", pool, "--size", "16777216t"],
            "--size",
        ),
        (
            vec![
                "pool",
                "create",
                "--dev",
                pool,
                "--size",
                "99999999999999999999",
            ],
            "--size",
        ),
        (
            vec!["pool", "create", "--dev", pool, "--size", "2048"],
            "--size",
        ),
        (
            vec![
                "pool",
                "create",
                "--dev",
                pool,
                "--size",
                "64m",
                "--group-blocks",
                "4294967295",
            ],
            "--group-blocks",
        ),
        // A negative value after its flag (not `--flag=-1`): clap took it
        // for an option and said "unexpected argument '-1' found".
        (vec!["replay", "--layer-us", "-5"], "--layer-us"),
        (vec!["bench", "--devices", "-1"], "--devices"),
        (
            vec!["pool", "create", "--dev", pool, "--size", "-1g"],
            "--size",
        ),
        (
            vec!["pool", "create", "--dir", &d, "--capacity", "-1g"],
            "--capacity",
        ),
        (
            vec!["serve", "--socket", pool, "--clients", "-3"],
            "--clients",
        ),
    ];
    for (args, flag) in cases {
        let mut c = kvtier();
        c.args(&args);
        if args[0] != "pool" {
            c.args(["--dir", &d]);
        }
        let out = run_bounded(c, 30);
        let t = text(&out);
        assert!(!t.contains("panicked"), "{args:?} panicked: {t}");
        assert_eq!(out.status.code(), Some(2), "{args:?}: {t}");
        assert!(
            t.contains(flag),
            "{args:?}: the error does not name {flag}: {t}"
        );
        assert!(
            t.contains("range") || t.contains("is not in") || t.contains("larger than"),
            "{args:?}: the error gives no range: {t}"
        );
    }
    assert!(!Path::new(pool).exists());
    assert!(
        files_in(dir.path()).is_empty(),
        "{:?}",
        files_in(dir.path())
    );
}

// ---------------------------------------------------------------------------
// A reader that goes away.

/// Runs `args` with stdout a pipe whose read end is already closed, so the
/// first write fails with EPIPE.
fn with_closed_stdout(args: &[&str]) -> Output {
    let mut fds = [0; 2];
    // SAFETY: pipe2 fills two descriptors; we own both.
    assert_eq!(unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) }, 0);
    // SAFETY: closing the read end we own.
    unsafe { libc::close(fds[0]) };
    // SAFETY: fds[1] is an open descriptor nobody else owns.
    let write_end =
        unsafe { <std::os::fd::OwnedFd as std::os::fd::FromRawFd>::from_raw_fd(fds[1]) };
    let out = kvtier()
        .args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::from(write_end))
        .stderr(Stdio::piped())
        .output()
        .unwrap();
    out
}

fn assert_quiet_sigpipe(out: &Output, what: &str) {
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!err.contains("panicked"), "{what}: {err}");
    assert_ne!(out.status.code(), Some(101), "{what}: {err}");
    assert_eq!(
        out.status.signal(),
        Some(libc::SIGPIPE),
        "{what}: {:?} {err}",
        out.status
    );
    assert!(
        !err.contains("error"),
        "{what}: a closed stdout is not an error to report: {err}"
    );
}

#[test]
fn a_closed_stdout_ends_every_command_quietly() {
    let dir = TempDir::new("cli-epipe");
    let pool = dir.file("p.pool");
    let pool_s = pool.to_str().unwrap();
    let out = with_closed_stdout(&[
        "pool",
        "create",
        "--dev",
        pool_s,
        "--size",
        "8m",
        "--group-blocks",
        "1",
    ]);
    assert_quiet_sigpipe(&out, "pool create");
    assert!(pool.exists(), "the pool was made before the output");
    for args in [
        vec!["pool", "info", "--dev", pool_s],
        vec!["pool", "info", "--dev", pool_s, "--json"],
        vec!["pool", "check", "--dev", pool_s],
        vec!["pool", "check", "--dev", pool_s, "--json"],
        vec!["doctor", "--dir", dir.path().to_str().unwrap()],
        vec!["doctor", "--json", "--dir", dir.path().to_str().unwrap()],
        vec!["nvme", "list"],
    ] {
        let out = with_closed_stdout(&args);
        assert_quiet_sigpipe(&out, &format!("{args:?}"));
    }
    // A benchmark whose report finds no reader: its scratch file is
    // still removed.
    let bench_dir = TempDir::new("cli-epipe-bench");
    let out = with_closed_stdout(&[
        "bench",
        "--pattern",
        "read",
        "--size",
        "8m",
        "--runtime",
        "0",
        "--dir",
        bench_dir.path().to_str().unwrap(),
    ]);
    assert_quiet_sigpipe(&out, "bench --pattern");
    assert!(files_in(bench_dir.path()).is_empty());
}

// ---------------------------------------------------------------------------
// Namespaces of config.json models.

fn write_config(dir: &Path, name_or_path: Option<&str>, rope_theta: f64) -> PathBuf {
    let sub = dir.join(format!(
        "{}-{rope_theta}",
        name_or_path.unwrap_or("none").replace('/', "_")
    ));
    std::fs::create_dir_all(&sub).unwrap();
    let mut v = serde_json::json!({
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": 4096,
        "num_attention_heads": 32,
        "num_hidden_layers": 32,
        "num_key_value_heads": 8,
        "rope_theta": rope_theta,
        "torch_dtype": "bfloat16",
    });
    if let Some(n) = name_or_path {
        v["_name_or_path"] = n.into();
    }
    let p = sub.join("config.json");
    std::fs::write(&p, v.to_string()).unwrap();
    p
}

fn namespace_of(dir: &TempDir, config: &Path, tag: &str) -> (String, String) {
    let pool = dir.file(&format!("{tag}.pool"));
    let out = kvtier()
        .args([
            "pool",
            "create",
            "--size",
            "8m",
            "--group-blocks",
            "1",
            "--model",
        ])
        .arg(config)
        .arg("--dev")
        .arg(&pool)
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", text(&out));
    let out = kvtier()
        .args(["pool", "info", "--json", "--dev"])
        .arg(&pool)
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", text(&out));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    (
        v["namespace"].as_str().unwrap().to_string(),
        v["model"].as_str().unwrap().to_string(),
    )
}

#[test]
fn config_json_models_get_their_own_namespace() {
    let dir = TempDir::new("cli-namespace");
    let a = write_config(dir.path(), Some("meta-llama/Meta-Llama-3-8B"), 500000.0);
    let b = write_config(dir.path(), Some("someone/llama3-finetune"), 500000.0);
    let c = write_config(dir.path(), None, 500000.0);
    let d = write_config(dir.path(), None, 10000.0);
    let (ns_a, model_a) = namespace_of(&dir, &a, "a");
    let (ns_b, _) = namespace_of(&dir, &b, "b");
    let (ns_c, model_c) = namespace_of(&dir, &c, "c");
    let (ns_d, _) = namespace_of(&dir, &d, "d");
    assert!(
        ns_a.starts_with("meta-llama/Meta-Llama-3-8B@") && ns_a.ends_with("/bfloat16/bs16/tp0"),
        "{ns_a}"
    );
    assert!(
        model_a.starts_with("meta-llama/Meta-Llama-3-8B@"),
        "{model_a}"
    );
    assert!(model_c.starts_with("llama-LlamaForCausalLM@"), "{model_c}");
    // Four configs, all named config.json: four namespaces, none "config".
    let all = [&ns_a, &ns_b, &ns_c, &ns_d];
    for (i, x) in all.iter().enumerate() {
        assert!(!x.starts_with("config/"), "{x}");
        for y in &all[i + 1..] {
            assert_ne!(x, y);
        }
    }
    // The same config again: the same namespace (a pool is found again).
    let (ns_a2, _) = namespace_of(&dir, &a, "a2");
    assert_eq!(ns_a, ns_a2);
    // Presets keep their plain names.
    let out = kvtier()
        .args(["pool", "create", "--size", "8m", "--group-blocks", "1"])
        .args(["--model", "llama3-8b", "--dev"])
        .arg(dir.file("preset.pool"))
        .output()
        .unwrap();
    assert!(
        text(&out).contains("namespace llama3-8b/bfloat16/bs16/tp0"),
        "{}",
        text(&out)
    );
}
