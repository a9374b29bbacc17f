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
use std::time::Duration;

fn iterations(default: usize) -> usize {
    std::env::var("KVTIER_CRASH_ITERS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(default)
}

/// A config.json of `tiny_geometry` (with `--block-size 16`).
fn tiny_config(dir: &TempDir) -> PathBuf {
    let cfg = dir.file("config.json");
    std::fs::write(
        &cfg,
        r#"{"num_hidden_layers": 4, "hidden_size": 128, "num_attention_heads": 2,
            "num_key_value_heads": 2, "torch_dtype": "bfloat16"}"#,
    )
    .unwrap();
    cfg
}

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

/// Kvtier never panics, whatever it is racing.
fn assert_no_panic(out: &Output, what: &str) {
    let t = text(out);
    assert!(
        !t.contains("panicked") && out.status.code().is_some(),
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
    for i in 0..iterations(100) {
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
        let pool = Pool::open(&[dev.clone()], &OpenExpect::default()).unwrap_or_else(|e| {
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
