//! The `kvtier` command: pools, benchmarks, and the debug tools tests use.

use clap::{Args, Parser, Subcommand};
use kvtier::engine::uring::UringConfig;
use kvtier::host::size::human_bytes;
use kvtier::model::{self, DType, KvGeometry};
use kvtier::pool::{DeviceSpec, OpenExpect, Pool, PoolConfig, DEFAULT_GROUP_BLOCKS};
use kvtier::tier::TierConfig;
use kvtier::Result;
use kvtier_cli::bench::{self, BenchConfig};
use kvtier_cli::cli::{f64_in, size_in};
use kvtier_cli::output::ReportKind;
use std::io::Write;
use std::path::{Path, PathBuf};

/// Writes a line to stdout; a reader that went away (`| head -1`) ends the
/// command quietly through `main` (see `kvtier_cli::cli::out`).
macro_rules! outln {
    ($($arg:tt)*) => {
        kvtier_cli::cli::out(&format!("{}\n", format_args!($($arg)*)))?
    };
}

/// One module per subcommand.
mod cmd {
    pub(crate) mod bench;
    pub(crate) mod doctor;
    pub(crate) mod nvme;
    pub(crate) mod pool;
    pub(crate) mod replay;
    pub(crate) mod serve;
}

// Ranges of the numeric flags: wide enough for any real use, narrow enough
// that no product, duration or allocation built from them overflows.
const KIB: u64 = 1 << 10;
const GIB: u64 = 1 << 30;
const PIB: u64 = 1 << 50;
/// Tokens: contexts of the longest-context models are a few million.
const MAX_TOKENS: u64 = 1 << 24;

fn parse_pool_size(s: &str) -> Result<u64, String> {
    size_in(s, 4 * KIB, PIB)
}
fn parse_capacity(s: &str) -> Result<u64, String> {
    size_in(s, 1 << 20, PIB)
}
fn parse_io_size(s: &str) -> Result<u64, String> {
    size_in(s, 1, GIB)
}
fn parse_runtime(s: &str) -> Result<f64, String> {
    f64_in(s, 0.0, 86_400.0).map_err(|e| format!("{e} seconds"))
}
fn parse_layer_us(s: &str) -> Result<f64, String> {
    f64_in(s, 0.0, 10_000_000.0).map_err(|e| format!("{e} microseconds"))
}

/// `--time-scale`: `auto`, or a factor.
#[derive(Clone, Copy, Debug)]
enum TimeScale {
    Auto,
    Fixed(f64),
}

fn parse_time_scale(s: &str) -> Result<TimeScale, String> {
    if s.trim() == "auto" {
        return Ok(TimeScale::Auto);
    }
    f64_in(s, 0.0, 10_000.0)
        .map(TimeScale::Fixed)
        .map_err(|e| format!("{e}, or auto"))
}

#[derive(Parser)]
#[command(
    name = "kvtier",
    version,
    about = "A GPU-centric NVMe SSD tier for LLM KV caches"
)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Create, inspect and verify pools.
    #[command(subcommand)]
    Pool(cmd::pool::PoolCmd),
    /// Store and retrieve model-shaped KV caches through the tier and report bandwidth.
    Bench(cmd::bench::BenchArgs),
    /// Play a prefill's per-layer compute times against real I/O under a
    /// scheduling policy and report the bubble time.
    Replay(cmd::replay::ReplayArgs),
    /// Say what this machine can run and why not: GPU and CUDA driver, IOMMU,
    /// vfio/uio, NVMe controllers, io_uring, O_DIRECT on the pool directory,
    /// and the engine kvtier would pick.
    Doctor(cmd::doctor::DoctorArgs),
    /// NVMe controllers for the userspace engine: list them, or bind one to
    /// vfio-pci/uio_pci_generic for the run of a command.
    #[command(subcommand)]
    Nvme(cmd::nvme::NvmeCmd),
    /// Serve one pool to every engine process on this node over a Unix
    /// socket (in the foreground; logs to stderr; SIGTERM, SIGINT or SIGHUP
    /// finishes acknowledged work and exits 0).
    Serve(cmd::serve::ServeArgs),
}

#[derive(Args, Clone)]
struct ModelArgs {
    /// A preset (llama3-8b, llama3-70b, qwen3-32b, glm4-9b, ...) or a Hugging Face config.json.
    #[arg(long, default_value = "llama3-8b")]
    model: String,
    /// Tokens per KV block.
    #[arg(long, default_value_t = 16, value_parser = clap::value_parser!(u32).range(1..=1 << 20))]
    block_size: u32,
    /// Override the model's dtype (bfloat16, float16, float32, fp8).
    #[arg(long)]
    dtype: Option<String>,
}

impl ModelArgs {
    fn geometry(&self) -> Result<KvGeometry> {
        Ok(self.resolve()?.geometry)
    }

    /// The geometry and the model's name (a preset's, or for a config.json
    /// its own identity: never "config", the file's name).
    fn resolve(&self) -> Result<model::NamedGeometry> {
        let dtype = match &self.dtype {
            Some(d) => Some(DType::parse(d).ok_or_else(|| {
                kvtier::Error::invalid(format!(
                    "unknown --dtype {:?}; use bfloat16, float16, float32, fp8 (float8_e4m3fn) or fp8_e5m2 (float8_e5m2)",
                    kvtier_cli::cli::excerpt(d, 40)
                ))
            })?),
            None => None,
        };
        model::resolve_named(&self.model, self.block_size, dtype)
    }
}

/// The command line, parsed; a negative value after a flag (`--capacity
/// -1g`) is refused by that flag's parser, naming it.
fn parse_cli() -> std::result::Result<Cli, clap::Error> {
    let args: Vec<std::ffi::OsString> = std::env::args_os().collect();
    match Cli::try_parse_from(&args) {
        Err(e) if e.kind() == clap::error::ErrorKind::UnknownArgument => {
            match kvtier_cli::cli::join_negative_values(&args) {
                Some(joined) => Cli::try_parse_from(joined),
                None => Err(e),
            }
        }
        parsed => parsed,
    }
}

fn main() {
    let cli = match parse_cli() {
        Ok(cli) => cli,
        Err(e) => {
            // Clap quotes the arguments it refuses: escaped like every message.
            let text = e.render().to_string();
            let text = kvtier::host::printable(&text);
            let _ = if e.use_stderr() {
                write!(std::io::stderr(), "{text}")
            } else {
                write!(std::io::stdout(), "{text}")
            };
            std::process::exit(e.exit_code());
        }
    };
    let size_flag = cli.cmd.size_flag();
    let code = match run(cli) {
        Ok(code) => code,
        Err(e) if kvtier_cli::cli::is_broken_pipe(&e) => die_of_sigpipe(),
        Err(e) => {
            note(&format!(
                "kvtier: error: {}",
                kvtier_cli::cli::error_text(&e, size_flag)
            ));
            2
        }
    };
    std::process::exit(code);
}

/// Stdout's reader went away (`kvtier doctor | head -1`): end the way
/// coreutils do, silently, killed by SIGPIPE (a shell sees 141). `run` has
/// returned, so its scratch files are already removed.
fn die_of_sigpipe() -> ! {
    // SAFETY: restoring the default action and raising a signal.
    unsafe {
        libc::signal(libc::SIGPIPE, libc::SIG_DFL);
        libc::raise(libc::SIGPIPE);
    }
    std::process::exit(141)
}

impl Cmd {
    /// The flag that sizes the pool this command makes, for error fixes:
    /// `pool create --dev` sizes each file, the others the whole pool.
    fn size_flag(&self) -> &'static str {
        match self {
            Cmd::Pool(p) if !p.sizes_by_capacity() => "--size",
            _ => "--capacity",
        }
    }
}

fn run(cli: Cli) -> Result<i32> {
    match cli.cmd {
        Cmd::Pool(c) => cmd::pool::run(c),
        Cmd::Bench(a) => cmd::bench::run_bench(a),
        Cmd::Replay(a) => cmd::replay::run_replay(a),
        Cmd::Doctor(a) => cmd::doctor::run(a),
        Cmd::Nvme(c) => cmd::nvme::run(c),
        Cmd::Serve(a) => cmd::serve::run(a),
    }
}

fn bar_fn(bar: &Progress) -> impl Fn(&str) + '_ {
    move |m: &str| bar.say(m)
}

/// Check each given report path (flag, path, kind) before the work starts:
/// distinct, none of them one of the run's `inputs` (flag, path), and each
/// free to receive its report.
fn report_paths_ok(
    paths: &[(&str, &Option<PathBuf>, ReportKind)],
    inputs: &[(&str, &Path)],
) -> Result<()> {
    let given: Vec<(&str, &PathBuf)> = paths
        .iter()
        .filter_map(|(flag, p, _)| p.as_ref().map(|p| (*flag, p)))
        .collect();
    for (i, (flag, p)) in given.iter().enumerate() {
        let same = |q: &PathBuf| {
            q == *p
                || matches!((std::fs::canonicalize(q), std::fs::canonicalize(p)), (Ok(a), Ok(b)) if a == b)
        };
        if let Some((other, _)) = given[i + 1..].iter().find(|(_, q)| same(q)) {
            return Err(kvtier::Error::invalid(format!(
                "{flag} and {other} name the same file {}; give each report its own file",
                p.display()
            )));
        }
    }
    for (flag, path, kind) in paths {
        if let Some(p) = path {
            kvtier_cli::output::check_not_an_input(flag, p, inputs)?;
            kvtier_cli::output::check_report_path(flag, p, *kind)?;
        }
    }
    Ok(())
}

fn write_json<T: serde::Serialize>(path: &Option<PathBuf>, report: &T) -> Result<()> {
    if let Some(path) = path {
        let text = serde_json::to_string_pretty(report).map_err(|e| {
            kvtier::Error::io(
                format!("--json {}: rendering the report", path.display()),
                std::io::Error::other(e),
            )
        })?;
        let text = kvtier_cli::output::mark_json_report(
            &text,
            concat!("kvtier ", env!("CARGO_PKG_VERSION")),
        );
        kvtier_cli::output::write_report("--json", path, ReportKind::Json, text.as_bytes())?;
        note(&format!("wrote {}", path.display()));
    }
    Ok(())
}

/// A line on stderr, its control characters escaped; a closed stderr is no
/// reason to fail (or panic).
fn note(msg: &str) {
    let _ = writeln!(std::io::stderr(), "{}", kvtier::host::printable(msg));
}

/// Progress for long work: a spinner with the current step on a terminal,
/// timestamped lines otherwise (CI logs).
struct Progress {
    bar: Option<indicatif::ProgressBar>,
    started: std::time::Instant,
}

impl Progress {
    fn new() -> Progress {
        use std::io::IsTerminal;
        let bar = std::io::stderr().is_terminal().then(|| {
            let b = indicatif::ProgressBar::new_spinner();
            b.set_style(
                indicatif::ProgressStyle::with_template("{spinner} [{elapsed_precise}] {msg}")
                    .expect("valid template"),
            );
            b.enable_steady_tick(std::time::Duration::from_millis(120));
            b
        });
        Progress {
            bar,
            started: std::time::Instant::now(),
        }
    }
    fn say(&self, msg: &str) {
        let msg = &*kvtier::host::printable_line(msg);
        match &self.bar {
            Some(b) => {
                b.println(format!(
                    "[{:6.1}s] {msg}",
                    self.started.elapsed().as_secs_f64()
                ));
                b.set_message(msg.to_string());
            }
            None => note(&format!(
                "[{:6.1}s] {msg}",
                self.started.elapsed().as_secs_f64()
            )),
        }
    }
    fn finish(&self) {
        if let Some(b) = &self.bar {
            b.finish_and_clear();
        }
    }
}
