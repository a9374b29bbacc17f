//! The `kvtier` command: pools, benchmarks, and the debug tools tests use.

use clap::{Args, Parser, Subcommand};
use kvtier::bench::{self, BenchConfig};
use kvtier::cli::{f64_in, size_in};
use kvtier::engine::uring::UringConfig;
use kvtier::host::size::human_bytes;
use kvtier::model::{self, DType, KvGeometry};
use kvtier::pool::{DeviceSpec, Key, OpenExpect, Pool, PoolConfig, DEFAULT_GROUP_BLOCKS};
use kvtier::tier::{Tier, TierConfig};
use kvtier::{HostKvCache, HostLayout, Result};
use std::io::Write;
use std::path::PathBuf;
use std::sync::Arc;

/// Writes a line to stdout; a reader that went away (`| head -1`) ends the
/// command quietly through `main` (see `kvtier::cli::out`).
macro_rules! outln {
    ($($arg:tt)*) => {
        kvtier::cli::out(&format!("{}\n", format_args!($($arg)*)))?
    };
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
    Pool(PoolCmd),
    /// Store and retrieve model-shaped KV caches through the tier and report bandwidth.
    Bench(BenchArgs),
    /// Play a prefill's per-layer compute times against real I/O under a
    /// scheduling policy and report the bubble time.
    Replay(ReplayArgs),
    /// Say what this machine can run and why not: GPU and CUDA driver, IOMMU,
    /// vfio/uio, NVMe controllers, io_uring, O_DIRECT on the pool directory,
    /// and the engine kvtier would pick.
    Doctor {
        /// Print the report as JSON.
        #[arg(long)]
        json: bool,
        /// The pool directory to check (created if missing).
        #[arg(long, default_value = "./kvtier-data")]
        dir: PathBuf,
    },
    /// NVMe controllers for the userspace engine: list them, or bind one to
    /// vfio-pci/uio_pci_generic for the run of a command.
    #[command(subcommand)]
    Nvme(NvmeCmd),
    /// Tools for tests (crash injection).
    #[command(subcommand, hide = true)]
    Debug(DebugCmd),
}

#[derive(Subcommand)]
enum NvmeCmd {
    /// NVMe controllers: address, vendor:device, driver, namespaces'
    /// block devices and whether they are mounted or hold a filesystem.
    List,
    /// Bind one controller to a userspace driver, run COMMAND with
    /// KVTIER_NVME_DEVICE=ADDR, give the controller back to its driver when
    /// COMMAND exits (also on Ctrl-C/SIGTERM) and exit with its status.
    /// Refuses a controller whose namespaces are mounted, swap, held or hold
    /// a filesystem or partition table, unless --force.
    Bind {
        /// Full PCI address, DDDD:BB:DD.F (see `kvtier nvme list`).
        addr: String,
        /// vfio-pci (needs an IOMMU) or uio_pci_generic.
        #[arg(long, default_value = "vfio-pci")]
        driver: String,
        /// Bind even a non-NVMe function or one whose namespaces are in use
        /// or hold data (their users lose them; kvtier may overwrite it).
        #[arg(long)]
        force: bool,
        /// The command to run while the controller is bound.
        #[arg(last = true, required = true, value_name = "COMMAND")]
        command: Vec<String>,
    },
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
                    "unknown --dtype {:?}; use bfloat16, float16, float32, float8_e4m3fn or float8_e5m2",
                    kvtier::cli::excerpt(d, 40)
                ))
            })?),
            None => None,
        };
        model::resolve_named(&self.model, self.block_size, dtype)
    }
}

#[derive(Subcommand)]
enum PoolCmd {
    /// Format a pool over backing files or block devices.
    Create {
        /// A backing file or block device; repeat for several SSDs.
        #[arg(long = "dev", required = true)]
        devs: Vec<PathBuf>,
        /// Size of each backing file (e.g. 64g, 4 KiB to 1 PiB); block devices default to their whole size.
        #[arg(long, value_parser = parse_pool_size)]
        size: Option<u64>,
        #[command(flatten)]
        model: ModelArgs,
        /// Blocks per extent group (a layer of G consecutive blocks is one I/O).
        #[arg(long, default_value_t = DEFAULT_GROUP_BLOCKS, value_parser = clap::value_parser!(u32).range(1..=4096))]
        group_blocks: u32,
        /// Key namespace (model, dtype, layout, TP rank); default from the model.
        #[arg(long)]
        namespace: Option<String>,
        /// Overwrite a device that holds a filesystem or other data.
        #[arg(long)]
        force: bool,
    },
    /// Show a pool's geometry, devices and usage.
    Info {
        #[arg(long = "dev", required = true)]
        devs: Vec<PathBuf>,
        #[arg(long)]
        json: bool,
    },
    /// Verify every header and block checksum; exits 1 on damage (or on
    /// blocks that carry no checksum to verify).
    Check {
        #[arg(long = "dev", required = true)]
        devs: Vec<PathBuf>,
        #[arg(long)]
        json: bool,
        /// Drop every damaged or unreadable block (its header is cleared) so
        /// the pool is clean again; says how many. Needs the pool to itself.
        #[arg(long)]
        repair: bool,
    },
}

#[derive(Args)]
struct BenchArgs {
    /// Directory for the pool files (and the --pattern test file).
    #[arg(long, default_value = "./kvtier-data")]
    dir: PathBuf,
    /// Engine: uring (pool files in --dir), or one that drives the NVMe
    /// controller --nvme from userspace with the pool on its namespace 1:
    /// nvme (CPU-polled queues), gpu (the CUDA I/O kernel), gpu-host (the
    /// kernel's logic on CPU threads, for testing without a GPU).
    #[arg(long, default_value = "uring", value_parser = ["uring", "nvme", "gpu", "gpu-host"])]
    engine: String,
    /// PCI address of the controller for --engine nvme/gpu/gpu-host, bound
    /// to vfio-pci or uio_pci_generic; defaults to $KVTIER_NVME_DEVICE,
    /// which `kvtier nvme bind ADDR -- kvtier bench ...` sets.
    #[arg(long)]
    nvme: Option<String>,
    /// Format an NVMe namespace that holds a filesystem or other data (its
    /// contents are lost). Pool files in --dir are always created new, so
    /// this never applies to them.
    #[arg(long)]
    force: bool,
    #[command(flatten)]
    model: ModelArgs,
    /// Context lengths in tokens, comma-separated; those that do not fit --capacity are skipped.
    #[arg(long, value_delimiter = ',', default_values_t = vec![4096u64, 16384, 65536, 131072],
          value_parser = clap::value_parser!(u64).range(1..=MAX_TOKENS))]
    contexts: Vec<u64>,
    /// Total pool size over all devices.
    #[arg(long, default_value = "12g", value_parser = parse_capacity)]
    capacity: u64,
    /// Pool files ("SSDs") to stripe over.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=64))]
    devices: u32,
    #[arg(long, default_value_t = DEFAULT_GROUP_BLOCKS, value_parser = clap::value_parser!(u32).range(1..=4096))]
    group_blocks: u32,
    /// In-flight I/Os per device (default 64 for the KV bench, 32 for --pattern).
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..=4096))]
    iodepth: Option<u32>,
    /// Use SQPOLL with this idle time in ms.
    #[arg(long, value_parser = clap::value_parser!(u32).range(0..=60_000))]
    sqpoll: Option<u32>,
    /// io_uring DEFER_TASKRUN + SINGLE_ISSUER (single device, no SQPOLL).
    #[arg(long)]
    defer_taskrun: bool,
    /// Largest coalesced I/O.
    #[arg(long, default_value = "4m", value_parser = parse_io_size)]
    max_io: u64,
    /// Engine memory in vLLM's cross-layer layout instead of per-layer tensors.
    #[arg(long)]
    cross_layer: bool,
    /// Skip the byte-for-byte check of retrieved data.
    #[arg(long)]
    no_verify: bool,
    /// Write every figure, with machine and settings, as JSON.
    #[arg(long)]
    json: Option<PathBuf>,
    /// Plot retrieve/store bandwidth against context length (SVG), with fio's lines when --against-fio.
    #[arg(long)]
    plot: Option<PathBuf>,
    /// Keep the pool files afterwards.
    #[arg(long)]
    keep: bool,
    /// Raw engine benchmark with fio's vocabulary: read, write, randread, randwrite, randrw.
    #[arg(long)]
    pattern: Option<String>,
    /// Block size for --pattern.
    #[arg(long, default_value = "80k", value_parser = parse_io_size)]
    bs: u64,
    /// File size for --pattern (the test file under --dir).
    #[arg(long, default_value = "4g", value_parser = parse_pool_size)]
    size: u64,
    /// Seconds per --pattern run (0: one pass over --size).
    #[arg(long, default_value = "10", value_parser = parse_runtime)]
    runtime: f64,
    /// Read percentage for randrw.
    #[arg(long, default_value_t = 50, value_parser = clap::value_parser!(u32).range(0..=100))]
    rwmixread: u32,
    /// Run fio (io_uring, direct=1) with the same workload on the same file and print kvtier/fio ratios.
    #[arg(long)]
    against_fio: bool,
    /// Read alone, write alone, then both at once on the same device.
    #[arg(long)]
    contention: bool,
    /// Run each --pattern measurement this many times (kvtier and fio
    /// alternating) and report the medians.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=1000))]
    repeat: u32,
}

#[derive(Args)]
struct ReplayArgs {
    /// Slack table (tables/<model>.<gpu>.json); without one, every layer computes for --layer-us.
    #[arg(long)]
    table: Option<PathBuf>,
    /// Check the table against --model (otherwise the table's own model is used).
    #[arg(long)]
    model_given: bool,
    #[command(flatten)]
    model: ModelArgs,
    /// New tokens of the request.
    #[arg(long, default_value_t = 4096, value_parser = clap::value_parser!(u64).range(0..=MAX_TOKENS))]
    input: u64,
    /// Cached prefix tokens, loaded from the pool.
    #[arg(long, default_value_t = 16384, value_parser = clap::value_parser!(u64).range(1..=MAX_TOKENS))]
    prefix: u64,
    /// slack, naive, sync, or all (read alone, then each policy with writes pending).
    #[arg(long, default_value = "all")]
    policy: String,
    /// Multiply compute times; `auto` makes total compute equal the measured read-alone time.
    #[arg(long, default_value = "auto", value_parser = parse_time_scale)]
    time_scale: TimeScale,
    /// Compute time per layer without a table, in microseconds.
    #[arg(long, default_value = "1000", value_parser = parse_layer_us)]
    layer_us: f64,
    /// Blocks of new KV waiting to be written when the prefill starts (default: the input's blocks).
    #[arg(long, value_parser = clap::value_parser!(u64).range(0..=MAX_TOKENS))]
    pending_writes: Option<u64>,
    #[arg(long, default_value = "./kvtier-data")]
    dir: PathBuf,
    #[arg(long)]
    json: Option<PathBuf>,
    /// Sweep the hit rate at a fixed total context (input + prefix) and plot
    /// bubble time against it for each policy (SVG).
    #[arg(long)]
    sweep: Option<PathBuf>,
}

#[derive(Subcommand)]
enum DebugCmd {
    /// Store blocks forever, printing "ACK <key>..." after each durable store job.
    CrashWriter {
        #[arg(long = "dev", required = true)]
        devs: Vec<PathBuf>,
        /// First key; keys count up from here.
        #[arg(long)]
        start_key: u64,
        #[arg(long, default_value_t = 8, value_parser = clap::value_parser!(u32).range(1..=4096))]
        blocks_per_job: u32,
        /// Stop after this many keys (then sleep until killed).
        #[arg(long, default_value_t = u64::MAX)]
        max_keys: u64,
    },
}

fn main() {
    let cli = Cli::parse();
    let code = match run(cli) {
        Ok(code) => code,
        Err(e) if kvtier::cli::is_broken_pipe(&e) => die_of_sigpipe(),
        Err(e) => {
            let _ = writeln!(std::io::stderr(), "kvtier: error: {e}");
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

fn run(cli: Cli) -> Result<i32> {
    match cli.cmd {
        Cmd::Pool(PoolCmd::Create {
            devs,
            size,
            model,
            group_blocks,
            namespace,
            force,
        }) => {
            let named = model.resolve()?;
            let geometry = named.geometry;
            let namespace = namespace.unwrap_or_else(|| {
                format!(
                    "{}/{}/bs{}/tp0",
                    named.name,
                    geometry.dtype.name(),
                    geometry.block_size
                )
            });
            let pool = Pool::create(&PoolConfig {
                geometry,
                model: named.name.clone(),
                namespace,
                group_blocks,
                devices: devs
                    .iter()
                    .map(|p| DeviceSpec {
                        path: p.clone(),
                        size,
                    })
                    .collect(),
                force,
            })?;
            print_info(&pool)?;
            Ok(0)
        }
        Cmd::Pool(PoolCmd::Info { devs, json }) => {
            let pool = Pool::open_read_only(&devs, &OpenExpect::default())?;
            if json {
                outln!(
                    "{}",
                    serde_json::to_string_pretty(&pool.info()).expect("serializable")
                );
            } else {
                print_info(&pool)?;
            }
            Ok(0)
        }
        Cmd::Pool(PoolCmd::Check { devs, json, repair }) => {
            let mut pool = if repair {
                Pool::open(&devs, &OpenExpect::default())?
            } else {
                Pool::open_read_only(&devs, &OpenExpect::default())?
            };
            let mut last = std::time::Instant::now();
            let report = pool.check(|done, total| {
                if last.elapsed().as_millis() > 500 || done == total {
                    let _ = write!(std::io::stderr(), "\rchecking groups {done}/{total}");
                    last = std::time::Instant::now();
                }
            })?;
            let _ = writeln!(std::io::stderr());
            let repaired = if repair && !report.is_undamaged() {
                Some(pool.repair(&report)?)
            } else {
                None
            };
            if json {
                outln!(
                    "{}",
                    serde_json::to_string_pretty(&report).expect("serializable")
                );
            } else {
                outln!(
                    "{} live block(s) checked, {} ok, {} unverifiable, {} read",
                    report.blocks_checked,
                    report.blocks_ok,
                    report.blocks_unverifiable,
                    human_bytes(report.bytes_read)
                );
                for s in &report.damaged_headers {
                    outln!("damaged header: slot {s} (its block is not visible)");
                }
                for s in &report.unreadable_headers {
                    outln!("unreadable header: slot {s} (its block, if any, is lost)");
                }
                for (s, k) in &report.bad_data {
                    outln!("bad data: slot {s} key {k} does not match its checksum");
                }
                for (s, k) in &report.unreadable_data {
                    outln!("unreadable data: slot {s} key {k} cannot be read");
                }
                if report.bad_slots > 0 {
                    outln!(
                        "{} slot(s) retired after write errors (capacity lost, no data)",
                        report.bad_slots
                    );
                }
                if report.blocks_unverifiable > 0 {
                    outln!(
                        "{} block(s) were stored from memory the host could not read (GPU memory) and carry no data checksum: they cannot be verified",
                        report.blocks_unverifiable
                    );
                }
            }
            if let Some(n) = repaired {
                outln!(
                    "repaired: dropped {n} damaged block(s) and cleared {} damaged header(s); the pool now holds only blocks that verify",
                    report.damaged_headers.len()
                );
                return Ok(0);
            }
            if report.is_clean() {
                outln!("pool is clean");
                Ok(0)
            } else if report.is_undamaged() {
                outln!(
                    "pool is NOT VERIFIED: no damage found, but {} block(s) carry no checksum",
                    report.blocks_unverifiable
                );
                Ok(1)
            } else {
                outln!(
                    "pool is DAMAGED: {} damaged header(s), {} unreadable header(s), {} block(s) with bad data, {} unreadable; `kvtier pool check --repair` drops them",
                    report.damaged_headers.len(),
                    report.unreadable_headers.len(),
                    report.bad_data.len(),
                    report.unreadable_data.len()
                );
                Ok(1)
            }
        }
        Cmd::Bench(a) => run_bench(a),
        Cmd::Replay(a) => run_replay(a),
        Cmd::Doctor { json, dir } => {
            let report = kvtier::doctor::run(&dir)?;
            if json {
                outln!(
                    "{}",
                    serde_json::to_string_pretty(&report).expect("serializable")
                );
            } else {
                kvtier::cli::out(&kvtier::doctor::render(&report))?;
            }
            Ok(0)
        }
        Cmd::Nvme(NvmeCmd::List) => kvtier::nvme_cli::list(),
        Cmd::Nvme(NvmeCmd::Bind {
            addr,
            driver,
            force,
            command,
        }) => kvtier::nvme_cli::bind_and_run(
            &addr,
            kvtier::nvme::bind::BindDriver::parse(&driver)?,
            force,
            &command,
        ),
        Cmd::Debug(DebugCmd::CrashWriter {
            devs,
            start_key,
            blocks_per_job,
            max_keys,
        }) => crash_writer(&devs, start_key, blocks_per_job, max_keys),
    }
}

fn print_info(pool: &Pool) -> Result<()> {
    let i = pool.info();
    outln!(
        "pool {}  model {}  namespace {}",
        i.uuid,
        i.model,
        i.namespace
    );
    outln!("  geometry: {}", i.geometry.describe());
    outln!(
        "  extent groups of {} blocks ({} each)",
        i.group_blocks,
        human_bytes(i.group_bytes)
    );
    for (n, d) in i.devices.iter().enumerate() {
        let backing = if d.backing_size > d.size {
            format!(" of its {}", human_bytes(d.backing_size))
        } else {
            String::new()
        };
        outln!(
            "  device {n}: {} ({}{backing}, {} groups)",
            d.path.display(),
            human_bytes(d.size),
            d.groups
        );
    }
    outln!(
        "  blocks: {} total, {} live, {} free, {} pinned; {} of {} used",
        i.total_slots,
        i.live_blocks,
        i.free_slots,
        i.pinned_blocks,
        human_bytes(i.used_bytes),
        human_bytes(i.capacity_bytes)
    );
    if i.damaged_headers > 0 {
        outln!(
            "  WARNING: {} damaged header(s); run `kvtier pool check`",
            i.damaged_headers
        );
    }
    if i.unreadable_headers > 0 {
        outln!(
            "  WARNING: {} header sector(s) could not be read; their blocks are lost",
            i.unreadable_headers
        );
    }
    if i.bad_slots > 0 {
        outln!("  {} slot(s) retired after write errors", i.bad_slots);
    }
    Ok(())
}

fn uring_cfg(a: &BenchArgs, default_depth: u32) -> UringConfig {
    UringConfig {
        queue_depth: a.iodepth.unwrap_or(default_depth),
        sqpoll_idle_ms: a.sqpoll,
        fixed_buffers: true,
        defer_taskrun: a.defer_taskrun,
    }
}

fn run_bench(a: BenchArgs) -> Result<i32> {
    if a.pattern.is_some() || a.contention {
        return run_raw_bench(&a);
    }
    let named = a.model.resolve()?;
    let cfg = BenchConfig {
        dir: a.dir.clone(),
        model: named.name,
        geometry: named.geometry,
        contexts: a.contexts.clone(),
        capacity: a.capacity,
        devices: a.devices,
        group_blocks: a.group_blocks,
        tier: TierConfig {
            uring: uring_cfg(&a, 64),
            max_io_bytes: a.max_io,
            ..TierConfig::default()
        },
        verify: !a.no_verify,
        cross_layer: a.cross_layer,
        store_job_blocks: 4096,
        nvme: userspace_target(&a)?,
        force: a.force,
        keep: a.keep,
    };
    if cfg.nvme.is_some() && a.against_fio {
        return Err(kvtier::Error::invalid(
            "--against-fio needs the pool on files; fio cannot reach a controller bound to a userspace driver (drop --against-fio, or use --engine uring)",
        ));
    }
    let bar = Progress::new();
    // bench::run removes the pool files it created (unless --keep), and
    // only those, whichever way it returns.
    let mut report = bench::run(&cfg, |msg| bar.say(msg))?;
    if a.against_fio {
        bar.say("fio: sequential and random read references on the same directory");
        report.fio = Some(bench::fio_references(&cfg, &bar_fn(&bar))?);
    }
    bar.finish();
    kvtier::cli::out(&bench::render(&report))?;
    if let Some(path) = &a.plot {
        bench::plot(&report, path)?;
        note(&format!("wrote {}", path.display()));
    }
    write_json(&a.json, &report)?;
    Ok(0)
}

/// The controller and engine of `--engine nvme|gpu|gpu-host --nvme ADDR`.
fn userspace_target(
    a: &BenchArgs,
) -> Result<Option<(String, kvtier::engine::open::UserspaceEngine)>> {
    use kvtier::engine::open::UserspaceEngine;
    let engine = match a.engine.as_str() {
        "uring" => {
            if a.nvme.is_some() {
                return Err(kvtier::Error::invalid(
                    "--nvme names a controller for --engine nvme, gpu or gpu-host; the uring engine uses pool files in --dir",
                ));
            }
            return Ok(None);
        }
        "nvme" => UserspaceEngine::Nvme,
        "gpu" => UserspaceEngine::Gpu,
        _ => UserspaceEngine::GpuHost,
    };
    let addr = a
        .nvme
        .clone()
        .or_else(|| std::env::var("KVTIER_NVME_DEVICE").ok())
        .ok_or_else(|| {
        kvtier::Error::invalid(format!(
            "--engine {} needs --nvme ADDR (the PCI address of an NVMe controller bound to vfio-pci or uio_pci_generic; `kvtier nvme list` shows them)",
            a.engine
        ))
    })?;
    Ok(Some((addr, engine)))
}

fn bar_fn(bar: &Progress) -> impl Fn(&str) + '_ {
    move |m: &str| bar.say(m)
}

fn write_json<T: serde::Serialize>(path: &Option<PathBuf>, report: &T) -> Result<()> {
    if let Some(path) = path {
        let text = serde_json::to_string_pretty(report).expect("serializable");
        std::fs::write(path, text)
            .map_err(|e| kvtier::Error::io(format!("writing {}", path.display()), e))?;
        note(&format!("wrote {}", path.display()));
    }
    Ok(())
}

/// A line on stderr; a closed stderr is no reason to fail (or panic).
fn note(msg: &str) {
    let _ = writeln!(std::io::stderr(), "{msg}");
}

fn run_raw_bench(a: &BenchArgs) -> Result<i32> {
    use kvtier::bench::fio::{Pattern, Workload};
    let pattern = match &a.pattern {
        Some(p) => Pattern::parse(p).ok_or_else(|| {
            kvtier::Error::invalid(format!(
                "unknown --pattern {:?}; use read, write, randread, randwrite or randrw",
                kvtier::cli::excerpt(p, 40)
            ))
        })?,
        None => Pattern::Read,
    };
    std::fs::create_dir_all(&a.dir)
        .map_err(|e| kvtier::Error::io(format!("creating {}", a.dir.display()), e))?;
    let w = Workload {
        pattern,
        bs: a.bs,
        iodepth: a.iodepth.unwrap_or(32),
        size: a.size,
        runtime_secs: a.runtime,
        file: a.dir.join("kvtier-bench.dat"),
        rwmix_read: a.rwmixread,
        numjobs: 1,
    };
    let bar = Progress::new();
    let report = bench::raw_suite(
        &w,
        a.contention,
        a.against_fio,
        a.repeat,
        &uring_cfg(a, 32),
        a.keep,
        &bar_fn(&bar),
    )?;
    bar.finish();
    kvtier::cli::out(&bench::render_raw(&report))?;
    write_json(&a.json, &report)?;
    Ok(0)
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

fn run_replay(a: ReplayArgs) -> Result<i32> {
    if a.sweep.is_some() {
        return run_replay_sweep(a);
    }
    use kvtier::replay::ReplayRig;
    use kvtier::sched::Policy;
    let plan = replay_plan(&a, a.input, a.prefix)?;
    let geometry = plan.geometry;
    let policies: Vec<Policy> = match a.policy.as_str() {
        "all" => vec![Policy::Slack, Policy::Naive, Policy::Sync],
        p => vec![Policy::parse(p).ok_or_else(|| {
            kvtier::Error::invalid(format!(
                "unknown --policy {:?}; use slack, naive, sync or all",
                kvtier::cli::excerpt(p, 40)
            ))
        })?],
    };
    let bar = Progress::new();
    bar.say(&format!(
        "storing a {}-token prefix ({} blocks) and {} blocks of pending writes' memory",
        a.prefix,
        geometry.tokens_to_blocks(a.prefix),
        plan.pending_write_blocks
    ));
    let mut rig = ReplayRig::new(&a.dir, plan.clone(), TierConfig::default())?;
    // Read alone (no writes pending, no compute): the reference bandwidth.
    rig.set_time_scale(0.0);
    bar.say("read alone");
    let alone = rig.run(Policy::Slack, false)?;
    let scale = match a.time_scale {
        TimeScale::Auto => auto_scale(alone.total_us, &plan)?,
        TimeScale::Fixed(s) => s,
    };
    rig.set_time_scale(scale);
    let mut results = vec![("read alone".to_string(), alone.clone())];
    for p in policies {
        bar.say(&format!(
            "{p:?} with {} blocks of writes pending",
            plan.pending_write_blocks
        ));
        let r = rig.run(p, true)?;
        results.push((format!("{p:?}").to_lowercase(), r));
    }
    bar.finish();
    outln!(
        "replay: {} layers, input {} tokens, prefix {} tokens ({}), compute x{scale:.4} ({:.1} ms per prefill)",
        geometry.layers,
        a.input,
        a.prefix,
        human_bytes(geometry.tokens_to_blocks(a.prefix) * geometry.block_bytes()),
        plan.layer_compute_us.iter().sum::<f64>() * scale / 1e3
    );
    outln!(
        "{:<11} {:>10} {:>11} {:>12} {:>13} {:>14} {:>14}",
        "policy",
        "read GiB/s",
        "vs alone",
        "bubble ms",
        "prefill ms",
        "writes done ms",
        "writes in reads"
    );
    for (name, r) in &results {
        outln!(
            "{:<11} {:>10.2} {:>10.2}x {:>12.2} {:>13.2} {:>14.2} {:>14}",
            name,
            r.read_gib_s,
            r.read_gib_s / alone.read_gib_s,
            r.bubble_us / 1e3,
            r.total_us / 1e3,
            r.writes_done_us / 1e3,
            r.writes_during_reads
        );
    }
    let get = |n: &str| results.iter().find(|(k, _)| k == n).map(|(_, r)| r);
    if let (Some(s), Some(n)) = (get("slack"), get("naive")) {
        outln!(
            "slack/naive bubble: {:.2}; slack keeps {:.0}% of read-alone bandwidth, naive {:.0}%",
            s.bubble_us / n.bubble_us.max(1e-9),
            100.0 * s.read_gib_s / alone.read_gib_s,
            100.0 * n.read_gib_s / alone.read_gib_s
        );
    }
    if plan.recompute_us > 0.0 {
        outln!(
            "recomputing the prefix instead: {:.2} ms (scaled)",
            plan.recompute_us * scale / 1e3
        );
    }
    write_json(&a.json, &results)?;
    Ok(0)
}

/// `--time-scale auto`: the factor that makes the prefill's compute equal
/// the measured read time; refused when it would be absurd (a table or
/// --layer-us of all but zero compute), which no replay can be run at.
fn auto_scale(read_us: f64, plan: &kvtier::replay::ReplayPlan) -> Result<f64> {
    let compute: f64 = plan.layer_compute_us.iter().sum();
    if compute <= 0.0 {
        // Nothing to scale: every layer computes for zero time.
        return Ok(1.0);
    }
    let scale = read_us / compute;
    if !(scale.is_finite() && scale <= 1e6) {
        return Err(kvtier::Error::invalid(format!(
            "--time-scale auto would multiply compute by {scale:e} to match the read time ({read_us:.1} us for {compute:e} us of compute); give --time-scale a factor, or a table / --layer-us with real compute times"
        )));
    }
    Ok(scale)
}

/// The replay plan for (input, prefix): from the table, or flat times.
fn replay_plan(a: &ReplayArgs, input: u64, prefix: u64) -> Result<kvtier::replay::ReplayPlan> {
    let (g, mut plan) = match &a.table {
        Some(path) => kvtier::replay::plan_from_table(
            path,
            a.model_given
                .then(|| a.model.geometry())
                .transpose()?
                .as_ref(),
            input,
            prefix,
        )?,
        None => {
            let g = a.model.geometry()?;
            let plan = kvtier::replay::ReplayPlan {
                geometry: g,
                input_tokens: input,
                prefix_tokens: prefix,
                layer_compute_us: vec![a.layer_us; g.layers as usize],
                layer_write_iocbs: vec![1; g.layers as usize],
                decode_step_us: a.layer_us * g.layers as f64 / 8.0,
                decode_write_iocbs: 1,
                recompute_us: 0.0,
                time_scale: 1.0,
                pending_write_blocks: 0,
            };
            (g, plan)
        }
    };
    plan.pending_write_blocks = a
        .pending_writes
        .unwrap_or_else(|| g.tokens_to_blocks(input));
    Ok(plan)
}

/// `kvtier replay --sweep FILE.svg`: bubble time against hit rate.
fn run_replay_sweep(a: ReplayArgs) -> Result<i32> {
    use kvtier::bench::plot::{plot_lines_svg, Series};
    use kvtier::replay::ReplayRig;
    use kvtier::sched::Policy;
    let total = a.input + a.prefix;
    let rates = [0.5, 0.75, 0.875, 0.9375, 0.96875];
    let bar = Progress::new();
    // One compute scale for the whole sweep (the GPU does not get faster
    // with the hit rate): compute equals the read time at the middle rate.
    let mid = replay_plan(
        &a,
        total - (total as f64 * 0.875) as u64,
        (total as f64 * 0.875) as u64,
    )?;
    let scale = match a.time_scale {
        TimeScale::Auto => {
            bar.say("measuring the read time at 87.5% hits for the compute scale");
            let mut rig = ReplayRig::new(&a.dir, mid.clone(), TierConfig::default())?;
            rig.set_time_scale(0.0);
            let alone = rig.run(Policy::Slack, false)?;
            auto_scale(alone.total_us, &mid)?
        }
        TimeScale::Fixed(s) => s,
    };
    let policies = [Policy::Slack, Policy::Naive, Policy::Sync];
    let mut series: Vec<Series> = policies
        .iter()
        .map(|p| Series {
            label: format!("{p:?}").to_lowercase(),
            points: Vec::new(),
        })
        .collect();
    let mut rows = Vec::new();
    outln!(
        "{:>9} {:>9} {:>9} {:>12} {:>12} {:>12}",
        "hit rate",
        "prefix",
        "input",
        "slack ms",
        "naive ms",
        "sync ms"
    );
    for &h in &rates {
        let prefix = ((total as f64 * h) as u64).max(1);
        let input = total - prefix;
        let mut plan = replay_plan(&a, input, prefix)?;
        plan.time_scale = scale;
        bar.say(&format!(
            "hit rate {:.2}%: prefix {prefix}, input {input}",
            h * 100.0
        ));
        let mut rig = ReplayRig::new(&a.dir, plan, TierConfig::default())?;
        let mut bubbles = Vec::new();
        for (i, p) in policies.iter().enumerate() {
            let r = rig.run(*p, true)?;
            series[i].points.push((h * 100.0, r.bubble_us / 1e3));
            bubbles.push(r.bubble_us / 1e3);
            rows.push((h, *p, r));
        }
        outln!(
            "{:>8.2}% {:>9} {:>9} {:>12.2} {:>12.2} {:>12.2}",
            h * 100.0,
            prefix,
            input,
            bubbles[0],
            bubbles[1],
            bubbles[2]
        );
    }
    bar.finish();
    let path = a.sweep.as_ref().expect("checked");
    plot_lines_svg(
        path,
        &format!("bubble time against hit rate ({total} tokens, compute x{scale:.3})"),
        "prefix cache hit rate (%)",
        "bubble time per prefill (ms)",
        &series,
    )?;
    note(&format!("wrote {}", path.display()));
    write_json(&a.json, &rows)?;
    Ok(0)
}

/// The child side of the crash test: store forever, acknowledging each
/// durable job on stdout; the parent SIGKILLs it at a random moment.
fn crash_writer(devs: &[PathBuf], start_key: u64, per_job: u32, max_keys: u64) -> Result<i32> {
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
            cache.fill_block(i as u32, crash_seed(k));
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

/// The pattern seed of a crash-test key (tests/crash.rs uses the same).
fn crash_seed(key: u64) -> u64 {
    key.wrapping_mul(0x2545_F491_4F6C_DD1D) ^ 0xA5A5
}
