//! The read-first / write-deferred scheduler and `kvtier replay`, functionally
//! (timings are reported by `kvtier replay`, never asserted here).

#[path = "../../tests/common/mod.rs"]
mod common;

use common::*;
use kvtier::pool::Key;
use kvtier::sched::{Policy, Scheduler, StoreState, Window};
use kvtier::tier::{Tier, TierConfig};
use kvtier::{HostKvCache, HostLayout};
use kvtier_cli::replay::{ReplayPlan, ReplayRig};
use std::sync::Arc;

fn rig(dir: &TempDir, policy: Policy, limit: u64) -> (Scheduler, Arc<HostKvCache>) {
    let geo = tiny_geometry();
    let pool = create_pool(dir, geo, 8, 1, 8);
    let mut tier = Tier::open(pool, TierConfig::default()).unwrap();
    let cache = Arc::new(HostKvCache::new(geo, 32, HostLayout::PerLayer).unwrap());
    tier.register_host_cache(cache.clone()).unwrap();
    (Scheduler::new(tier, policy, limit), cache)
}

fn keys(r: std::ops::Range<u64>) -> Vec<Key> {
    r.map(Key::from_u64).collect()
}

#[test]
fn slack_policy_holds_writes_while_reads_are_in_flight() {
    let dir = TempDir::new("sched-slack");
    let (mut s, cache) = rig(&dir, Policy::Slack, 64);
    for b in 0..8 {
        cache.fill_block(b, seed_of(b as u64));
    }
    let job = s
        .tier_mut()
        .submit_store(&keys(0..8), &(0..8).collect::<Vec<_>>())
        .unwrap();
    assert!(s.tier_mut().wait(job).unwrap().all_ok());
    let load = s
        .submit_load(&keys(0..8), &(8..16).collect::<Vec<_>>(), 0..4)
        .unwrap();
    let (_, st) = s.submit_store(&keys(100..104), &[20, 21, 22, 23]).unwrap();
    assert!(matches!(st, StoreState::Deferred));
    assert_eq!(s.backlog_blocks(), 4);
    if s.tier().loads_in_flight() > 0 {
        assert_eq!(
            s.release_writes(Window { write_iocbs: 8 }).unwrap(),
            0,
            "no write while a read is in flight"
        );
    }
    s.tier_mut().wait(load).unwrap();
    assert_eq!(s.release_writes(Window { write_iocbs: 8 }).unwrap(), 1);
    assert_eq!(s.backlog_blocks(), 0);
    let done = s.wait_stores().unwrap();
    assert_eq!(done.len(), 1);
    assert!(done[0].1.all_ok());
    assert!(s.tier().contains(&Key::from_u64(100)));
}

#[test]
fn a_full_backlog_refuses_and_stores_nothing() {
    let dir = TempDir::new("sched-full");
    let (mut s, _cache) = rig(&dir, Policy::Slack, 6);
    s.submit_store(&keys(0..4), &[0, 1, 2, 3]).unwrap();
    let err = s
        .submit_store(&keys(4..8), &[4, 5, 6, 7])
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("write backlog full") && err.contains("not accepted"),
        "{err}"
    );
    s.flush_writes().unwrap();
    let done = s.wait_stores().unwrap();
    assert_eq!(done.len(), 1);
    assert!(
        !s.tier().contains(&Key::from_u64(5)),
        "the refused store left nothing behind"
    );
    assert!(s.tier().contains(&Key::from_u64(0)));
}

#[test]
fn naive_issues_at_once_and_sync_waits_for_flush() {
    let dir = TempDir::new("sched-naive");
    let (mut s, _cache) = rig(&dir, Policy::Naive, 0);
    let (_, st) = s.submit_store(&keys(0..2), &[0, 1]).unwrap();
    assert!(
        matches!(st, StoreState::Issued(_)),
        "naive ignores the backlog"
    );
    assert_eq!(s.wait_stores().unwrap().len(), 1);
    let dir = TempDir::new("sched-sync");
    let (mut s, _cache) = rig(&dir, Policy::Sync, 8);
    s.submit_store(&keys(0..2), &[0, 1]).unwrap();
    assert_eq!(
        s.release_writes(Window { write_iocbs: 9 }).unwrap(),
        0,
        "sync writes only at flush"
    );
    s.flush_writes().unwrap();
    assert_eq!(s.wait_stores().unwrap().len(), 1);
}

#[test]
fn replay_runs_every_policy_and_accounts_every_layer() {
    let dir = TempDir::new("replay");
    let geo = tiny_geometry();
    let plan = ReplayPlan {
        geometry: geo,
        input_tokens: 64,
        prefix_tokens: 256,
        layer_compute_us: vec![200.0; geo.layers as usize],
        layer_write_iocbs: vec![1; geo.layers as usize],
        decode_step_us: 100.0,
        decode_write_iocbs: 1,
        recompute_us: 0.0,
        time_scale: 1.0,
        pending_write_blocks: 4,
    };
    let mut rig = ReplayRig::new(dir.path(), plan, TierConfig::default()).unwrap();
    for p in [Policy::Slack, Policy::Naive, Policy::Sync] {
        let r = rig.run(p, true).unwrap();
        assert_eq!(r.layer_bubble_us.len(), geo.layers as usize);
        assert!(
            r.total_us >= r.compute_us,
            "{p:?}: the prefill cannot beat its compute"
        );
        assert!(r.writes_done_us >= r.total_us || p != Policy::Sync);
        assert!(r.read_gib_s > 0.0);
        if p == Policy::Slack {
            assert_eq!(r.writes_during_reads, 0, "slack never writes during reads");
        }
    }
    let wrong = ReplayPlan {
        geometry: geo,
        input_tokens: 64,
        prefix_tokens: 256,
        layer_compute_us: vec![1.0; 3],
        layer_write_iocbs: vec![1; 3],
        decode_step_us: 1.0,
        decode_write_iocbs: 1,
        recompute_us: 0.0,
        time_scale: 1.0,
        pending_write_blocks: 0,
    };
    let err = ReplayRig::new(&dir.file("x"), wrong, TierConfig::default())
        .err()
        .unwrap()
        .to_string();
    assert!(err.contains("3 layer times for a 4-layer model"), "{err}");
}

fn kvtier(args: &[&str]) -> (bool, String) {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_kvtier"))
        .args(args)
        .output()
        .unwrap();
    let text =
        String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr);
    (out.status.success(), text)
}

#[test]
fn replay_cli_reports_every_policy_sweeps_and_names_bad_tables() {
    let dir = TempDir::new("replay-cli");
    let d = dir.path().to_str().unwrap();
    let json = dir.file("r.json");
    let (ok, text) = kvtier(&[
        "replay",
        "--input",
        "256",
        "--prefix",
        "1024",
        "--layer-us",
        "50",
        "--dir",
        d,
        "--json",
        json.to_str().unwrap(),
    ]);
    assert!(ok, "{text}");
    for name in ["read alone", "slack", "naive", "sync", "slack/naive bubble"] {
        assert!(text.contains(name), "{name} missing: {text}");
    }
    let v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    // A marked report (so a later run may replace it), the rows under "results".
    assert!(
        v["kvtier_report"].as_str().unwrap().starts_with("kvtier"),
        "{v}"
    );
    assert_eq!(v["results"].as_array().unwrap().len(), 4);
    let svg = dir.file("sweep.svg");
    let (ok, text) = kvtier(&[
        "replay",
        "--input",
        "256",
        "--prefix",
        "768",
        "--layer-us",
        "20",
        "--dir",
        d,
        "--sweep",
        svg.to_str().unwrap(),
    ]);
    assert!(ok, "{text}");
    let svg_text = std::fs::read_to_string(&svg).unwrap();
    assert!(
        svg_text.contains("<svg") && svg_text.contains("slack") && svg_text.contains("hit rate")
    );
    // A table with a broken field is refused with the field named.
    let table = std::fs::read_to_string(repo_root().join("tables/llama3-8b.h100.json")).unwrap();
    let bad = dir.file("bad.json");
    std::fs::write(
        &bad,
        table.replacen(
            "\"schema\": \"kvtier-slack/1\"",
            "\"schema\": \"kvtier-slack/9\"",
            1,
        ),
    )
    .unwrap();
    let (ok, text) = kvtier(&["replay", "--table", bad.to_str().unwrap(), "--dir", d]);
    assert!(!ok);
    assert!(
        text.contains("bad.json") && text.contains("schema"),
        "{text}"
    );
}
