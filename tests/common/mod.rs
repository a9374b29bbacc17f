//! Shared helpers for the integration tests: temp dirs, small geometries, pools.
#![allow(dead_code)]

pub mod crash;
pub mod fault;
pub mod gio_host;

use kvtier::pool::{DeviceSpec, Pool, PoolConfig};
use kvtier::{DType, KvGeometry};
use std::path::{Path, PathBuf};

/// The tests' one random generator (splitmix64): deterministic, so a
/// failure reproduces from its seed; tests need no crate for it.
#[derive(Clone, Debug)]
pub struct Rng(pub u64);

impl Rng {
    pub fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    /// Uniform in 0..n (n > 0).
    pub fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
    /// True `permille` times in a thousand.
    pub fn chance(&mut self, permille: u32) -> bool {
        self.below(1000) < permille as u64
    }
}

/// A directory removed on drop.
pub use kvtier::scratch::TestDir as TempDir;

/// 4 layers x 2 kv heads x 64 head dim x bf16, block 16: 4 KiB objects, 32 KiB blocks.
pub fn tiny_geometry() -> KvGeometry {
    KvGeometry {
        layers: 4,
        kv_heads: 2,
        head_dim: 64,
        dtype: DType::BF16,
        block_size: 16,
    }
}

/// Iterations of a kill-at-random-points test: `default`, or
/// `KVTIER_CRASH_ITERS` when set (to run more by hand).
pub fn crash_iterations(default: usize) -> usize {
    std::env::var("KVTIER_CRASH_ITERS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(default)
}

/// A config.json of `tiny_geometry` (with `--block-size 16`) in `dir`.
pub fn tiny_config(dir: &TempDir) -> PathBuf {
    let cfg = dir.file("config.json");
    std::fs::write(
        &cfg,
        r#"{"num_hidden_layers": 4, "hidden_size": 128, "num_attention_heads": 2,
            "num_key_value_heads": 2, "torch_dtype": "bfloat16"}"#,
    )
    .unwrap();
    cfg
}

/// Runs the `kvtier` binary at `bin` (the CLI tests pass
/// `env!("CARGO_BIN_EXE_kvtier")`) with `args`: its exit code (-1 when a
/// signal ended it) and its stdout then stderr.
pub fn run_cli(bin: &str, args: &[&str]) -> (i32, String) {
    let out = std::process::Command::new(bin).args(args).output().unwrap();
    let text =
        String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr);
    (out.status.code().unwrap_or(-1), text)
}

/// Bytes of a device that holds `groups` extent groups of `g` blocks.
pub fn device_bytes(geo: &KvGeometry, g: u32, groups: u64) -> u64 {
    kvtier::pool::layout::DATA_OFFSET
        + groups * kvtier::pool::layout::PoolLayout::group_bytes_for(geo, g)
}

/// The io_uring engine over `pool`'s devices, default settings (what a
/// test double of a device wraps, or a custom engine starts from).
pub fn uring_of(pool: &Pool) -> kvtier::Result<Box<dyn kvtier::engine::IoEngine>> {
    use kvtier::engine::uring::{UringDevice, UringEngine};
    let devs: Vec<UringDevice> = pool
        .device_fds()?
        .into_iter()
        .map(|(fd, name)| UringDevice { fd, name })
        .collect();
    Ok(Box::new(UringEngine::new(&devs, Default::default())?))
}

pub fn pool_config(geo: KvGeometry, g: u32, devs: &[PathBuf], groups_per_dev: u64) -> PoolConfig {
    PoolConfig::new(geo, "test", "test/ns")
        .with_group_blocks(g)
        .with_devices(
            devs.iter()
                .map(|p| DeviceSpec {
                    path: p.clone(),
                    size: Some(device_bytes(&geo, g, groups_per_dev)),
                })
                .collect(),
        )
}

pub fn create_pool(
    dir: &TempDir,
    geo: KvGeometry,
    g: u32,
    ndev: usize,
    groups_per_dev: u64,
) -> Pool {
    let devs: Vec<PathBuf> = (0..ndev)
        .map(|i| dir.file(&format!("ssd{i}.pool")))
        .collect();
    Pool::create(&pool_config(geo, g, &devs, groups_per_dev)).unwrap()
}

/// A deterministic seed per key, so a block's expected bytes follow from its key.
pub fn seed_of(key: u64) -> u64 {
    key.wrapping_mul(0x2545_F491_4F6C_DD1D) ^ 0xA5A5
}

/// The repository's root: this file is shared by the library's tests and the CLI
/// crate's (cli/tests), whose manifest directory is one level down.
pub fn repo_root() -> PathBuf {
    let manifest = Path::new(env!("CARGO_MANIFEST_DIR"));
    if manifest.join("kernels").is_dir() {
        manifest.to_path_buf()
    } else {
        manifest.parent().expect("cli/ has a parent").to_path_buf()
    }
}

/// The crate's kernels/ directory (CUDA sources and the C twins of our layouts).
pub fn kernels_dir() -> PathBuf {
    repo_root().join("kernels")
}

/// The first compiler of `candidates` that runs, honouring `env_var` first.
pub fn find_compiler(env_var: &str, candidates: &[&str]) -> Option<String> {
    let from_env = std::env::var(env_var).ok().filter(|c| !c.trim().is_empty());
    from_env
        .into_iter()
        .chain(candidates.iter().map(|c| c.to_string()))
        .find(|c| {
            std::process::Command::new(c)
                .arg("--version")
                .output()
                .is_ok_and(|o| o.status.success())
        })
}

/// Compile `file` for syntax and static asserts only, warnings as errors,
/// with kernels/ on the include path (the C twins of our layouts).
pub fn syntax_check(compiler: &str, std_flag: &str, file: &Path) -> std::process::Output {
    std::process::Command::new(compiler)
        .arg(std_flag)
        .args([
            "-fsyntax-only",
            "-Wall",
            "-Wextra",
            "-Werror",
            "-pedantic-errors",
        ])
        .arg("-I")
        .arg(kernels_dir())
        .arg(file)
        .output()
        .unwrap_or_else(|e| panic!("could not run {compiler}: {e}"))
}
