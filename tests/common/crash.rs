//! The crash-test writer, a test helper rather than a command of the binary: a child
//! process (the test binary itself, re-run on one test with [`ENV`] set) that stores
//! jobs forever, acknowledging each durable job on stdout, for a parent to SIGKILL at a
//! random moment (tests/crash.rs) or to hold a pool open (tests/integrity.rs).
//!
//! A test file that spawns it declares the child's entry point:
//! `#[test] fn crash_writer_child() { common::crash::child_main() }`, which returns at
//! once in a normal run (without [`ENV`]).

use super::seed_of;
use kvtier::pool::{Key, OpenExpect, Pool};
use kvtier::tier::{Tier, TierConfig};
use kvtier::{HostKvCache, HostLayout};
use std::io::Write;
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::sync::Arc;

/// Set in the child's environment: `START;PER_JOB;MAX_KEYS;DEV[;DEV...]`.
pub const ENV: &str = "KVTIER_CRASH_WRITER";

/// The name of the child's entry test in every file that spawns it.
const CHILD_TEST: &str = "crash_writer_child";

/// The writer over `devs`: keys from `start_key` in jobs of `per_job` blocks, stopping
/// after `max_keys` keys (then holding the pool until killed). Stdout piped: lines
/// `READY`, `SUBMIT first last`, `EVICTED keys...`, `ACK keys...`.
pub fn writer_command(devs: &[PathBuf], start_key: u64, per_job: u32, max_keys: u64) -> Command {
    let mut spec = format!("{start_key};{per_job};{max_keys}");
    for d in devs {
        spec.push(';');
        spec.push_str(d.to_str().expect("test paths are UTF-8"));
    }
    let mut cmd = Command::new(std::env::current_exe().expect("the test binary"));
    cmd.args([CHILD_TEST, "--exact", "--nocapture", "--test-threads=1"])
        .env(ENV, spec)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    cmd
}

/// The child's entry point: runs the writer when [`ENV`] is set (never returns then),
/// else returns at once.
pub fn child_main() {
    let Ok(spec) = std::env::var(ENV) else {
        return;
    };
    let mut f = spec.split(';');
    let mut num = |what: &str| -> u64 {
        f.next()
            .and_then(|s| s.parse().ok())
            .unwrap_or_else(|| panic!("{ENV}: no {what} in {spec:?}"))
    };
    let start_key = num("start key");
    let per_job = u32::try_from(num("blocks per job")).expect("blocks per job fits u32");
    let max_keys = num("key count");
    let devs: Vec<PathBuf> = spec.split(';').skip(3).map(PathBuf::from).collect();
    if let Err(e) = write_forever(&devs, start_key, per_job, max_keys) {
        eprintln!("crash writer: {e}");
        std::process::exit(1);
    }
}

fn write_forever(
    devs: &[PathBuf],
    start_key: u64,
    per_job: u32,
    max_keys: u64,
) -> kvtier::Result<()> {
    let pool = Pool::open(devs, &OpenExpect::default())?;
    let geo = *pool.geometry();
    let mut tier = Tier::open(pool, TierConfig::default())?;
    let cache = Arc::new(HostKvCache::new(geo, per_job, HostLayout::PerLayer)?);
    tier.register_host_cache(cache.clone())?;
    let mem: Vec<u32> = (0..per_job).collect();
    let mut out = std::io::stdout().lock();
    let _ = writeln!(out, "READY");
    let _ = out.flush();
    let mut next = start_key;
    while next - start_key < max_keys {
        let Some(end) = next.checked_add(per_job as u64) else {
            break;
        };
        let keys: Vec<u64> = (next..end).collect();
        for (i, &k) in keys.iter().enumerate() {
            cache.fill_block(i as u32, seed_of(k));
        }
        let ks: Vec<Key> = keys.iter().map(|&k| Key::from_u64(k)).collect();
        let _ = writeln!(out, "SUBMIT {} {}", keys[0], keys[keys.len() - 1]);
        let _ = out.flush();
        let job = tier.submit_store(&ks, &mem)?;
        let r = tier.wait(job)?;
        let mut ev = String::from("EVICTED");
        for k in &r.evicted {
            ev += &format!(
                " {}",
                u64::from_le_bytes(k.as_bytes()[..8].try_into().expect("8-byte key"))
            );
        }
        let _ = writeln!(out, "{ev}");
        let mut line = String::from("ACK");
        for (k, o) in keys.iter().zip(&r.outcomes) {
            if o.is_ok() {
                line += &format!(" {k}");
            }
        }
        let _ = writeln!(out, "{line}");
        let _ = out.flush();
        next += per_job as u64;
    }
    loop {
        std::thread::sleep(std::time::Duration::from_secs(1));
    }
}
