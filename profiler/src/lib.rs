//! `kvtier-profile`: the offline slack profiler, run once per model and GPU.
//!
//! It takes a model (kvtier preset or config.json), a GPU (preset or peaks),
//! a grid of input and prefix lengths and decode contexts, and storage
//! numbers (measured with kvtier's engine on a pool directory, or assumed),
//! and writes `tables/<model>.<gpu>.json`: a slack table (schema and every
//! field: `kvtier::slack`). Compute times come from one of
//! - `--compute analytic` (`analytic.rs`): FLOPs and bytes against the GPU's peaks;
//! - `--compute trace FILE` (`trace.rs`): per-layer times measured elsewhere;
//! - `--compute torch` (`torch.rs`, `torch_harness.py`): timed on this machine's GPU.
//!
//! The derived columns (read time, slack, SM budget, IOCB counts) follow from
//! the compute times by `kvtier::slack`'s rules, the same the loader checks.

pub mod analytic;
pub mod shape;
pub mod storage;
pub mod torch;
pub mod trace;

use analytic::{Analytic, Gpu};
use clap::Parser;
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use kvtier::model::DType;
use kvtier::slack::{Mode, Provenance, SlackTable, TableHeader};
use kvtier::{Error, Result};
use shape::{Shape, ShapeOverrides};
use std::path::{Path, PathBuf};
use trace::Trace;

/// The default grid: 8 input lengths 512..64K, 8 prefix lengths 0..128K,
/// 8 decode contexts 1K..128K.
pub const DEFAULT_INPUTS: [u64; 8] = [512, 1024, 2048, 4096, 8192, 16384, 32768, 65536];
pub const DEFAULT_PREFIXES: [u64; 8] = [0, 2048, 4096, 8192, 16384, 32768, 65536, 131072];
pub const DEFAULT_CONTEXTS: [u64; 8] = [1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072];

#[derive(Parser, Debug, Clone)]
#[command(
    name = "kvtier-profile",
    version,
    about = "Profile a model on a GPU into a slack table (tables/<model>.<gpu>.json) for kvtier's scheduler"
)]
pub struct Args {
    /// Model: a kvtier preset (llama3-8b, llama3-70b, qwen3-32b, glm4-9b, ...) or a Hugging Face config.json.
    #[arg(long)]
    pub model: String,
    /// The model's name in the table and its file name (default: the preset, or the config's name).
    #[arg(long)]
    pub name: Option<String>,
    /// Tokens per KV block (the serving engine's block size).
    #[arg(long, default_value_t = 16)]
    pub block_size: u32,
    /// KV dtype, if not the model's (e.g. fp8).
    #[arg(long, value_parser = parse_dtype)]
    pub dtype: Option<DType>,
    /// Hidden size, if not the preset's or config's.
    #[arg(long)]
    pub hidden_size: Option<u32>,
    /// MLP intermediate size, if not the preset's or config's.
    #[arg(long)]
    pub intermediate_size: Option<u32>,
    /// Query heads, if not the preset's or config's.
    #[arg(long)]
    pub attention_heads: Option<u32>,

    /// GPU: h100 (H100 SXM: 132 SMs, 989 TFLOPS, 3350 GB/s) or h200 (132, 989, 4800); any other name with --sms, --bf16-tflops and --hbm-gbs.
    #[arg(long)]
    pub gpu: String,
    /// Streaming multiprocessors (overrides the preset).
    #[arg(long)]
    pub sms: Option<u32>,
    /// Dense bf16 peak TFLOPS (overrides the preset).
    #[arg(long)]
    pub bf16_tflops: Option<f64>,
    /// HBM bandwidth, GB/s (overrides the preset).
    #[arg(long)]
    pub hbm_gbs: Option<f64>,

    /// Where compute times come from: analytic | trace FILE | torch.
    #[arg(long, num_args = 1..=2, value_names = ["MODE", "FILE"], default_value = "analytic")]
    pub compute: Vec<String>,
    /// Input lengths (new tokens) of the grid, e.g. 512,1k,4k (k = 1024). Default: 8 values 512..64K (trace: the trace's).
    #[arg(long, value_delimiter = ',', value_parser = parse_tokens)]
    pub inputs: Option<Vec<u64>>,
    /// Prefix lengths (cached tokens) of the grid. Default: 8 values 0..128K (trace: the trace's).
    #[arg(long, value_delimiter = ',', value_parser = parse_tokens)]
    pub prefixes: Option<Vec<u64>>,
    /// Decode context lengths. Default: 8 values 1K..128K (trace: the trace's).
    #[arg(long, value_delimiter = ',', value_parser = parse_tokens)]
    pub contexts: Option<Vec<u64>>,
    /// Analytic: fraction of peak the matmuls reach.
    #[arg(long, default_value_t = 0.6)]
    pub matmul_efficiency: f64,
    /// Analytic: fraction of peak attention reaches.
    #[arg(long, default_value_t = 0.4)]
    pub attention_efficiency: f64,
    /// Analytic: fixed time per layer (kernel launches and tails), µs.
    #[arg(long, default_value_t = 20.0)]
    pub layer_overhead_us: f64,

    /// Measure the storage on this directory (where the pool lives) with kvtier's engine.
    #[arg(long)]
    pub pool_dir: Option<PathBuf>,
    /// Seconds the storage measurement takes in all.
    #[arg(long, default_value_t = 3.0)]
    pub storage_seconds: f64,
    /// Size of the measurement file (e.g. 256m).
    #[arg(long, default_value = "256m", value_parser = parse_bytes)]
    pub storage_size: u64,
    /// Assumed read bandwidth, GB/s (without --pool-dir; default 7, one PCIe Gen4 SSD).
    #[arg(long)]
    pub read_gbs: Option<f64>,
    /// Assumed write bandwidth, GB/s (without --pool-dir; default 5).
    #[arg(long)]
    pub write_gbs: Option<f64>,
    /// Assumed IOCB service time, µs (without --pool-dir; default 80).
    #[arg(long)]
    pub iocb_service_us: Option<f64>,

    /// Torch: the Python interpreter.
    #[arg(long, default_value = "python3")]
    pub python: String,
    /// Torch: the harness (default: $KVTIER_TORCH_HARNESS, else torch_harness.py next to this
    /// executable, else ./profiler/torch_harness.py, else the one in the sources it was built from).
    #[arg(long)]
    pub harness: Option<PathBuf>,
    /// Torch: seconds the harness may take in all (0: no limit). It estimates every grid point's
    /// cost, leaves out the largest inputs/prefixes/contexts that would not fit (saying so up
    /// front), and if it still runs short writes a partial trace: the table then covers the
    /// largest complete grid measured, and its provenance says PARTIAL.
    #[arg(long, default_value_t = 420.0)]
    pub budget_s: f64,
    /// Torch: an extra harness argument, e.g. --torch-arg=--repeats=3 (repeatable).
    #[arg(long = "torch-arg", allow_hyphen_values = true)]
    pub torch_args: Vec<String>,

    /// Output directory (the file is <model>.<gpu>.json) or a .json path.
    #[arg(long, default_value = "tables/")]
    pub out: PathBuf,
    /// No progress bar.
    #[arg(long)]
    pub quiet: bool,
}

fn parse_dtype(s: &str) -> std::result::Result<DType, String> {
    DType::parse(s).ok_or_else(|| {
        format!(
            "unknown dtype {s:?}; use one of {}",
            DType::ALL.map(DType::name).join(", ")
        )
    })
}

/// A token count: digits with an optional k/m suffix (binary: 64k = 65536).
fn parse_tokens(s: &str) -> std::result::Result<u64, String> {
    kvtier_cli::cli::parse_size(s)
        .map_err(|_| format!("{s:?} is not a token count (e.g. 4096, 64k)"))
}

fn parse_bytes(s: &str) -> std::result::Result<u64, String> {
    kvtier_cli::cli::parse_size(s).map_err(|e| e.to_string())
}

/// Where the compute times come from.
#[derive(Clone, Debug, PartialEq)]
pub enum Compute {
    Analytic,
    Trace(PathBuf),
    Torch,
}

impl Compute {
    pub fn parse(v: &[String]) -> Result<Compute> {
        match v {
            [m] if m == "analytic" => Ok(Compute::Analytic),
            [m] if m == "torch" => Ok(Compute::Torch),
            [m, f] if m == "trace" => Ok(Compute::Trace(PathBuf::from(f))),
            [m] if m == "trace" => Err(Error::invalid(
                "--compute trace needs the trace file: --compute trace FILE",
            )),
            _ => Err(Error::invalid(format!(
                "--compute {}: use analytic, trace FILE or torch",
                v.join(" ")
            ))),
        }
    }
}

/// The GPU from its preset and the overrides.
pub fn resolve_gpu(a: &Args) -> Result<Gpu> {
    let mut gpu = match Gpu::preset(&a.gpu) {
        Some(g) => g,
        None => match (a.sms, a.bf16_tflops, a.hbm_gbs) {
            (Some(sms), Some(tf), Some(hbm)) => Gpu {
                key: a.gpu.to_ascii_lowercase(),
                name: a.gpu.clone(),
                sms,
                bf16_tflops: tf,
                hbm_gbs: hbm,
            },
            _ => {
                return Err(Error::invalid(format!(
                    "--gpu {}: not a preset (h100, h200); for another GPU give --sms, --bf16-tflops and --hbm-gbs",
                    a.gpu
                )))
            }
        },
    };
    if let Some(v) = a.sms {
        gpu.sms = v;
    }
    if let Some(v) = a.bf16_tflops {
        gpu.bf16_tflops = v;
    }
    if let Some(v) = a.hbm_gbs {
        gpu.hbm_gbs = v;
    }
    let positive = |x: f64| x > 0.0 && x.is_finite();
    if gpu.sms == 0 || !positive(gpu.bf16_tflops) || !positive(gpu.hbm_gbs) {
        return Err(Error::invalid(format!(
            "GPU {}: SMs, TFLOPS and HBM bandwidth must be positive",
            gpu.name
        )));
    }
    Ok(gpu)
}

/// Where the table goes: `<out>/<model>.<gpu>.json`, or `out` itself when it names a .json file.
pub fn out_path(out: &Path, model: &str, gpu_key: &str) -> PathBuf {
    if out.extension().is_some_and(|e| e == "json") {
        out.to_path_buf()
    } else {
        out.join(format!("{model}.{gpu_key}.json"))
    }
}

/// What a run made.
pub struct Outcome {
    pub path: PathBuf,
    pub table: SlackTable,
}

fn progress_bar(len: u64, quiet: bool, what: &str) -> ProgressBar {
    let bar = if quiet {
        ProgressBar::hidden()
    } else {
        ProgressBar::with_draw_target(Some(len), ProgressDrawTarget::stderr())
    };
    bar.set_style(
        ProgressStyle::with_template("{msg} [{bar:40}] {pos}/{len} {elapsed}")
            .expect("valid template")
            .progress_chars("=> "),
    );
    bar.set_message(what.to_string());
    bar
}

/// Runs the profiler and writes the table. `command_line` is recorded in the provenance.
pub fn run(a: &Args, command_line: &str) -> Result<Outcome> {
    let overrides = ShapeOverrides {
        hidden_size: a.hidden_size,
        intermediate_size: a.intermediate_size,
        attention_heads: a.attention_heads,
    };
    let shape = Shape::resolve(
        &a.model,
        a.block_size,
        a.dtype,
        a.name.as_deref(),
        &overrides,
    )?;
    let gpu = resolve_gpu(a)?;
    let compute = Compute::parse(&a.compute)?;
    for (flag, v) in [
        ("--matmul-efficiency", a.matmul_efficiency),
        ("--attention-efficiency", a.attention_efficiency),
    ] {
        if !(v > 0.0 && v <= 1.0) {
            return Err(Error::invalid(format!(
                "{flag} {v} must be a fraction of peak in (0, 1]"
            )));
        }
    }
    if a.layer_overhead_us.is_nan() || a.layer_overhead_us < 0.0 {
        return Err(Error::invalid("--layer-overhead-us must be ≥ 0"));
    }
    let path = out_path(&a.out, &shape.name, &gpu.key);
    let src = path.display().to_string();
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir)
            .map_err(|e| Error::io(format!("--out: creating {}", dir.display()), e))?;
    }
    // Before profiling (minutes on a GPU): never truncate what is not a table.
    // Nor an input of this run (a trace, or a config.json given as --model).
    let mut run_inputs = vec![("--model", Path::new(&a.model))];
    if let Compute::Trace(t) = &compute {
        run_inputs.push(("--compute trace", t.as_path()));
    }
    kvtier_cli::output::check_not_an_input("--out", &path, &run_inputs)?;
    kvtier_cli::output::check_report_path("--out", &path, kvtier_cli::output::ReportKind::Json)?;

    // Storage first: it is the step that can fail on a bad directory.
    let storage = match &a.pool_dir {
        Some(dir) => {
            if a.read_gbs.is_some() || a.write_gbs.is_some() || a.iocb_service_us.is_some() {
                return Err(Error::invalid(
                    "--pool-dir measures the storage; drop --read-gbs/--write-gbs/--iocb-service-us, or drop --pool-dir to assume them",
                ));
            }
            // Four steps: lay out, reads, writes, IOCB service; a step is
            // counted done when the next one starts.
            let bar = progress_bar(4, a.quiet, "storage");
            let started = std::cell::Cell::new(false);
            let s = storage::measure(
                dir,
                a.storage_seconds,
                a.storage_size,
                &shape.geometry,
                &|m| {
                    if started.replace(true) {
                        bar.inc(1);
                    }
                    bar.set_message(format!("storage: {m}"));
                },
            )?;
            bar.finish_and_clear();
            s
        }
        None => storage::assumed(a.read_gbs, a.write_gbs, a.iocb_service_us),
    };

    let model = Analytic {
        matmul_efficiency: a.matmul_efficiency,
        attention_efficiency: a.attention_efficiency,
        layer_overhead_us: a.layer_overhead_us,
    };
    let layers = shape.geometry.layers as usize;
    let (mode, estimated, method, inputs, prefixes, compute_us, decode) = match &compute {
        Compute::Analytic => {
            let inputs = a.inputs.clone().unwrap_or_else(|| DEFAULT_INPUTS.to_vec());
            let prefixes = a
                .prefixes
                .clone()
                .unwrap_or_else(|| DEFAULT_PREFIXES.to_vec());
            let contexts = a
                .contexts
                .clone()
                .unwrap_or_else(|| DEFAULT_CONTEXTS.to_vec());
            let bar = progress_bar(
                (inputs.len() * prefixes.len() + contexts.len()) as u64,
                a.quiet,
                "analytic",
            );
            let mut compute_us = Vec::new();
            for &i in &inputs {
                for &p in &prefixes {
                    compute_us.push(vec![model.prefill_layer_us(&shape, &gpu, i, p); layers]);
                    bar.inc(1);
                }
            }
            let decode: Vec<(u64, f64)> = contexts
                .iter()
                .map(|&c| {
                    bar.inc(1);
                    (c, model.decode_step_us(&shape, &gpu, c))
                })
                .collect();
            bar.finish_and_clear();
            (
                Mode::Analytic,
                true,
                model.describe(&gpu),
                inputs,
                prefixes,
                compute_us,
                decode,
            )
        }
        Compute::Trace(file) => {
            let t = Trace::load(file, shape.geometry.layers)?;
            let (i, p, c, d) = from_trace(&partial_grid(a, &t)?, &t)?;
            (Mode::Trace, false, t.describe("trace"), i, p, c, d)
        }
        Compute::Torch => {
            let inputs = a.inputs.clone().unwrap_or_else(|| DEFAULT_INPUTS.to_vec());
            let prefixes = a
                .prefixes
                .clone()
                .unwrap_or_else(|| DEFAULT_PREFIXES.to_vec());
            let contexts = a
                .contexts
                .clone()
                .unwrap_or_else(|| DEFAULT_CONTEXTS.to_vec());
            if !(a.budget_s >= 0.0 && a.budget_s.is_finite()) {
                return Err(Error::invalid(
                    "--budget-s must be a number of seconds ≥ 0 (0: no limit)",
                ));
            }
            let work = std::env::temp_dir().join(format!("kvtier-profile-{}", std::process::id()));
            let harness = torch::resolve_harness(a.harness.as_deref())?;
            let result = torch::run(&torch::TorchRun {
                python: &a.python,
                harness: &harness,
                shape: &shape,
                inputs: &inputs,
                prefixes: &prefixes,
                contexts: &contexts,
                budget_s: a.budget_s,
                work_dir: &work,
                extra_args: &a.torch_args,
            });
            let _ = std::fs::remove_dir_all(&work);
            let t = result?;
            let picked = Args {
                inputs: Some(inputs),
                prefixes: Some(prefixes),
                contexts: Some(contexts),
                ..a.clone()
            };
            let picked = partial_grid(&picked, &t)?;
            let (i, p, c, d) = from_trace(&picked, &t)?;
            let timing = match t.file.timing.as_deref() {
                Some("graph") => "CUDA-graph replays",
                Some("eager") => "eager, CUDA events per layer",
                Some("cpu") => "CPU wall clock, a harness test",
                _ => "CUDA events",
            };
            (
                Mode::Torch,
                false,
                t.describe_from("torch", &format!("{} ({timing})", harness.display())),
                i,
                p,
                c,
                d,
            )
        }
    };

    let (machine, kernel) = machine();
    let header = TableHeader {
        model: shape.model_info(),
        gpu: gpu.info(),
        storage,
        mode,
        estimated,
        provenance: Provenance {
            machine,
            kernel,
            kvtier_version: version(),
            date: today(),
            command: command_line.to_string(),
            method,
        },
    };
    let table = SlackTable::build(header, inputs, prefixes, &compute_us, &decode, &src)?;
    kvtier_cli::output::write_report(
        "--out",
        &path,
        kvtier_cli::output::ReportKind::Json,
        table.to_json_string().as_bytes(),
    )?;
    Ok(Outcome { path, table })
}

type Grid = (Vec<u64>, Vec<u64>, Vec<Vec<f64>>, Vec<(u64, f64)>);

/// For a partial trace (its run cut short by the harness's budget or
/// memory), `a` with the grid narrowed to the largest complete one among
/// the points asked for (or the trace's own), said on stderr; `a` as it is
/// for a complete trace.
fn partial_grid(a: &Args, t: &Trace) -> Result<Args> {
    if !t.partial() {
        return Ok(a.clone());
    }
    let inputs = a.inputs.clone().unwrap_or_else(|| t.inputs());
    let prefixes = a.prefixes.clone().unwrap_or_else(|| t.prefixes());
    let contexts = a.contexts.clone().unwrap_or_else(|| t.contexts());
    let why = t.file.note.as_deref().unwrap_or("no reason given");
    let (i, p) = t.complete_grid(&inputs, &prefixes).ok_or_else(|| {
        Error::invalid(format!(
            "{}: the trace is partial ({why}) and has none of the prefill points asked for",
            t.source
        ))
    })?;
    let have = t.contexts();
    let c: Vec<u64> = contexts
        .iter()
        .copied()
        .filter(|c| have.contains(c))
        .collect();
    if c.is_empty() {
        return Err(Error::invalid(format!(
            "{}: the trace is partial ({why}) and has none of the decode contexts asked for",
            t.source
        )));
    }
    if (i.len(), p.len(), c.len()) != (inputs.len(), prefixes.len(), contexts.len()) {
        eprintln!(
            "kvtier-profile: PARTIAL: {why}; the table covers inputs {i:?} x prefixes {p:?} and contexts {c:?} of inputs {inputs:?} x prefixes {prefixes:?} and contexts {contexts:?}"
        );
    }
    Ok(Args {
        inputs: Some(i),
        prefixes: Some(p),
        contexts: Some(c),
        ..a.clone()
    })
}

/// The grid and times of a trace, restricted to `--inputs/--prefixes/--contexts` when given.
fn from_trace(a: &Args, t: &Trace) -> Result<Grid> {
    let inputs = a.inputs.clone().unwrap_or_else(|| t.inputs());
    let prefixes = a.prefixes.clone().unwrap_or_else(|| t.prefixes());
    let contexts = a.contexts.clone().unwrap_or_else(|| t.contexts());
    let mut compute_us = Vec::new();
    for &i in &inputs {
        for &p in &prefixes {
            compute_us.push(t.layer_us(i, p)?.to_vec());
        }
    }
    let decode = contexts
        .iter()
        .map(|&c| Ok((c, t.step_us(c)?)))
        .collect::<Result<Vec<_>>>()?;
    Ok((inputs, prefixes, compute_us, decode))
}

/// (machine, kernel) from /proc: "CPU model x N CPUs, M GiB RAM", kernel release.
pub fn machine() -> (String, String) {
    let probe = kvtier_cli::bench::Machine::probe(Path::new("."));
    let mem_gib = std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("MemTotal:"))
                .and_then(|l| l.split_whitespace().nth(1))
                .and_then(|kb| kb.parse::<u64>().ok())
        })
        .map(|kb| (kb as f64 / (1u64 << 20) as f64).round() as u64);
    let cpu = if probe.cpu_model.is_empty() {
        "unknown CPU".to_string()
    } else {
        probe.cpu_model
    };
    let mut m = format!("{cpu} x {} CPUs", probe.cpus);
    if let Some(g) = mem_gib {
        m.push_str(&format!(", {g} GiB RAM"));
    }
    let kernel = if probe.kernel.is_empty() {
        "unknown".to_string()
    } else {
        probe.kernel
    };
    (m, kernel)
}

/// This build's version, with the git commit of the sources when git can tell.
pub fn version() -> String {
    let v = env!("CARGO_PKG_VERSION");
    let git = |args: &[&str]| {
        std::process::Command::new("git")
            .arg("-C")
            .arg(env!("CARGO_MANIFEST_DIR"))
            .args(args)
            .output()
            .ok()
            .filter(|o| o.status.success())
            .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
    };
    match git(&["rev-parse", "--short", "HEAD"]) {
        Some(rev) if !rev.is_empty() => {
            let dirty = git(&["status", "--porcelain", "--untracked-files=no"])
                .is_some_and(|s| !s.is_empty());
            if dirty {
                format!("{v} (git {rev} with uncommitted changes)")
            } else {
                format!("{v} (git {rev})")
            }
        }
        _ => v.to_string(),
    }
}

/// Today's date (UTC), YYYY-MM-DD.
pub fn today() -> String {
    let secs = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    civil_date(secs / 86400)
}

/// Days since 1970-01-01 to YYYY-MM-DD (proleptic Gregorian; Howard Hinnant's algorithm).
fn civil_date(days: u64) -> String {
    let z = days as i64 + 719468;
    let era = z.div_euclid(146097);
    let doe = z.rem_euclid(146097);
    let yoe = (doe - doe / 1460 + doe / 36524 - doe / 146096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    format!("{year:04}-{month:02}-{day:02}")
}

/// The command line as a shell would take it back, program named `kvtier-profile`.
pub fn command_line(args: &[String]) -> String {
    let quote = |s: &str| {
        if !s.is_empty()
            && s.chars()
                .all(|c| c.is_ascii_alphanumeric() || "-_./,=:+@%".contains(c))
        {
            s.to_string()
        } else {
            format!("'{}'", s.replace('\'', "'\\''"))
        }
    };
    std::iter::once("kvtier-profile".to_string())
        .chain(args.iter().skip(1).map(|s| quote(s)))
        .collect::<Vec<_>>()
        .join(" ")
}

/// A short human summary: total prefill compute and bubble (read time the
/// compute cannot hide), ms, over the grid.
pub fn summary(t: &SlackTable) -> String {
    let mut s = format!(
        "{} on {} ({} mode{}), storage: {}\n",
        t.model().name,
        t.gpu().name,
        t.mode().name(),
        if t.estimated() { ", estimated" } else { "" },
        t.storage().source
    );
    s.push_str("prefill compute / bubble, ms (rows: input tokens; columns: prefix tokens)\n");
    s.push_str(&format!("{:>8}", "input"));
    for p in t.prefix_lengths() {
        s.push_str(&format!(" {:>15}", p));
    }
    s.push('\n');
    for (i, &input) in t.input_lengths().iter().enumerate() {
        s.push_str(&format!("{input:>8}"));
        for p in 0..t.prefix_lengths().len() {
            let e = t.entry(i, p);
            let compute: f64 = e.layers.iter().map(|l| l.compute_us).sum();
            let bubble: f64 = e.layers.iter().map(|l| (-l.slack_us).max(0.0)).sum();
            s.push_str(&format!(
                " {:>15}",
                format!("{:.1}/{:.1}", compute / 1e3, bubble / 1e3)
            ));
        }
        s.push('\n');
    }
    s.push_str("decode step ms (write IOCBs that fit): ");
    let rows: Vec<String> = t
        .file()
        .decode
        .iter()
        .map(|d| format!("{}: {:.2} ({})", d.context, d.step_us / 1e3, d.write_iocbs))
        .collect();
    s.push_str(&rows.join(", "));
    s.push('\n');
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(extra: &[&str]) -> Args {
        let mut v = vec!["kvtier-profile"];
        v.extend_from_slice(extra);
        Args::try_parse_from(v).unwrap()
    }

    fn scratch(tag: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!(
            "kvtier-profiler-{tag}-{}-{}",
            std::process::id(),
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .unwrap()
                .as_nanos()
        ));
        std::fs::create_dir_all(&d).unwrap();
        d
    }

    #[test]
    fn cli_parses() {
        let a = args(&["--model", "llama3-8b", "--gpu", "h100"]);
        assert_eq!(Compute::parse(&a.compute).unwrap(), Compute::Analytic);
        assert_eq!(a.out, PathBuf::from("tables/"));
        let a = args(&[
            "--model",
            "llama3-8b",
            "--gpu",
            "h200",
            "--compute",
            "trace",
            "t.json",
            "--inputs",
            "1k,4K,16384",
            "--prefixes",
            "0,128k",
        ]);
        assert_eq!(
            Compute::parse(&a.compute).unwrap(),
            Compute::Trace("t.json".into())
        );
        assert_eq!(a.inputs.unwrap(), vec![1024, 4096, 16384]);
        assert_eq!(a.prefixes.unwrap(), vec![0, 131072]);
        let a = args(&["--model", "x", "--gpu", "h100", "--compute", "trace"]);
        assert!(Compute::parse(&a.compute)
            .unwrap_err()
            .to_string()
            .contains("trace FILE"));
        let a = args(&["--model", "x", "--gpu", "h100", "--compute", "guess"]);
        assert!(Compute::parse(&a.compute).is_err());
        assert!(Args::try_parse_from([
            "kvtier-profile",
            "--model",
            "x",
            "--gpu",
            "h1",
            "--inputs",
            "lots"
        ])
        .is_err());
        let a = args(&["--model", "x", "--gpu", "b200"]);
        assert!(resolve_gpu(&a).unwrap_err().to_string().contains("--sms"));
        let a = args(&[
            "--model",
            "x",
            "--gpu",
            "b200",
            "--sms",
            "148",
            "--bf16-tflops",
            "2250",
            "--hbm-gbs",
            "8000",
        ]);
        assert_eq!(resolve_gpu(&a).unwrap().sms, 148);
        let a = args(&["--model", "x", "--gpu", "h100", "--hbm-gbs", "2000"]);
        let g = resolve_gpu(&a).unwrap();
        assert_eq!((g.name.as_str(), g.hbm_gbs), ("H100-SXM", 2000.0));
    }

    #[test]
    fn dates_and_command_lines() {
        assert_eq!(civil_date(0), "1970-01-01");
        assert_eq!(civil_date(19_000), "2022-01-08");
        assert_eq!(civil_date(20_089), "2025-01-01");
        assert_eq!(civil_date(11_016), "2000-02-29");
        assert_eq!(today().len(), 10);
        let c = command_line(&[
            "/x/target/release/kvtier-profile".into(),
            "--model".into(),
            "my model.json".into(),
        ]);
        assert_eq!(c, "kvtier-profile --model 'my model.json'");
        assert_eq!(
            out_path(Path::new("tables/"), "m", "h100"),
            PathBuf::from("tables/m.h100.json")
        );
        assert_eq!(
            out_path(Path::new("x/t.json"), "m", "h100"),
            PathBuf::from("x/t.json")
        );
    }

    #[test]
    fn analytic_default_grid_writes_a_loadable_table() {
        let dir = scratch("analytic");
        let a = args(&[
            "--model",
            "llama3-8b",
            "--gpu",
            "h100",
            "--quiet",
            "--out",
            dir.to_str().unwrap(),
        ]);
        let t0 = std::time::Instant::now();
        let out = run(&a, "kvtier-profile --model llama3-8b --gpu h100").unwrap();
        assert!(t0.elapsed().as_secs() < 10);
        assert_eq!(out.path, dir.join("llama3-8b.h100.json"));
        let t = SlackTable::load(&out.path).unwrap();
        t.check_geometry(&kvtier::model::preset("llama3-8b", 16).unwrap())
            .unwrap();
        assert_eq!((t.input_lengths().len(), t.prefix_lengths().len()), (8, 8));
        assert_eq!(t.mode(), Mode::Analytic);
        assert!(t.estimated());
        assert!(t.storage().source.starts_with("assumed"));
        assert_eq!(
            t.provenance().command,
            "kvtier-profile --model llama3-8b --gpu h100"
        );
        assert!(t.provenance().method.starts_with("analytic"));
        assert_eq!(t.file().decode.len(), 8);
        // Reads of a long prefix under a short input cannot hide: a bubble.
        assert!(t.layer(512, 131072, 0).unwrap().slack_us < 0.0);
        // No prefix: nothing to read, all slack.
        let s = t.layer(65536, 0, 5).unwrap();
        assert_eq!((s.read_us, s.read_iocbs), (0.0, 0));
        assert!(s.slack_us > 0.0 && s.write_iocbs > 0);
        assert!(summary(&t).contains("prefill compute / bubble"));
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn trace_mode_uses_the_trace() {
        let dir = scratch("trace");
        let layers = 40; // glm4-9b
        let row = |i: u64, p: u64| {
            let times: Vec<f64> = (0..layers)
                .map(|l| (i + p) as f64 / 100.0 + l as f64)
                .collect();
            serde_json::json!({"input": i, "prefix": p, "layer_us": times})
        };
        let trace = serde_json::json!({
            "schema": "kvtier-trace/1", "layers": layers, "device": "test GPU",
            "prefill": [row(1024, 0), row(1024, 4096), row(4096, 0), row(4096, 4096)],
            "decode": [{"context": 2048, "step_us": 9000.0}]
        });
        let file = dir.join("trace.json");
        std::fs::write(&file, trace.to_string()).unwrap();
        let out_file = dir.join("glm.json");
        let a = args(&[
            "--model",
            "glm4-9b",
            "--gpu",
            "h200",
            "--quiet",
            "--compute",
            "trace",
            file.to_str().unwrap(),
            "--out",
            out_file.to_str().unwrap(),
            "--read-gbs",
            "20",
            "--write-gbs",
            "10",
        ]);
        let out = run(&a, "cmd").unwrap();
        let t = SlackTable::load(&out.path).unwrap();
        assert_eq!(t.mode(), Mode::Trace);
        assert!(!t.estimated());
        assert_eq!(t.input_lengths(), &[1024, 4096]);
        assert_eq!(t.prefix_lengths(), &[0, 4096]);
        assert_eq!(
            t.entry(1, 1).layers[3].compute_us,
            kvtier::slack::round_us(81.92 + 3.0)
        );
        assert_eq!(t.storage().read_gbs, 20.0);
        assert!(t.provenance().method.contains("test GPU"));
        // A grid point the trace lacks is named.
        let a = args(&[
            "--model",
            "glm4-9b",
            "--gpu",
            "h200",
            "--quiet",
            "--compute",
            "trace",
            file.to_str().unwrap(),
            "--out",
            out_file.to_str().unwrap(),
            "--prefixes",
            "0,2048",
        ]);
        let msg = run(&a, "cmd").err().unwrap().to_string();
        assert!(
            msg.contains("no prefill row for grid point (input 1024, prefix 2048)"),
            "{msg}"
        );
        // Another model's trace is refused.
        let a = args(&[
            "--model",
            "llama3-8b",
            "--gpu",
            "h200",
            "--quiet",
            "--compute",
            "trace",
            file.to_str().unwrap(),
            "--out",
            out_file.to_str().unwrap(),
        ]);
        let msg = run(&a, "cmd").err().unwrap().to_string();
        assert!(msg.contains("layers is 40 but the model has 32"), "{msg}");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn torch_mode_runs_the_harness_or_says_why_not() {
        let dir = scratch("torch");
        // A stand-in harness (run by sh) that writes the trace the real one would.
        let fake = dir.join("fake_harness.sh");
        std::fs::write(
            &fake,
            r#"out=""; while [ $# -gt 0 ]; do [ "$1" = --out ] && out="$2"; shift; done
l=""; for i in $(seq 1 32); do l="$l${l:+,}100"; done
echo "{\"schema\":\"kvtier-trace/1\",\"layers\":32,\"device\":\"fake\",\"prefill\":[{\"input\":16,\"prefix\":0,\"layer_us\":[$l]}],\"decode\":[{\"context\":16,\"layer_us\":[$l]}]}" > "$out"
"#,
        )
        .unwrap();
        let out_file = dir.join("t.json");
        let common = [
            "--model",
            "llama3-8b",
            "--gpu",
            "h100",
            "--quiet",
            "--compute",
            "torch",
            "--inputs",
            "16",
            "--prefixes",
            "0",
            "--contexts",
            "16",
        ];
        let mut v = common.to_vec();
        v.extend([
            "--python",
            "sh",
            "--harness",
            fake.to_str().unwrap(),
            "--out",
            out_file.to_str().unwrap(),
        ]);
        let out = run(&args(&v), "cmd").unwrap();
        let t = SlackTable::load(&out.path).unwrap();
        assert_eq!(t.mode(), Mode::Torch);
        assert_eq!(t.entry(0, 0).layers[0].compute_us, 100.0);
        assert_eq!(t.file().decode[0].step_us, 3200.0);
        // What kvtier-profile hands the harness: the grid, --budget-s, then
        // the --torch-arg extras (last, so that they win).
        let argv = dir.join("argv.txt");
        let recorder = dir.join("recorder.sh");
        std::fs::write(
            &recorder,
            format!(
                "printf '%s\\n' \"$@\" > {}\nexec sh {} \"$@\"\n",
                argv.display(),
                fake.display()
            ),
        )
        .unwrap();
        let mut v = common.to_vec();
        v.extend([
            "--python",
            "sh",
            "--harness",
            recorder.to_str().unwrap(),
            "--budget-s",
            "90",
            "--torch-arg=--repeats=3",
            "--out",
            out_file.to_str().unwrap(),
        ]);
        let out = run(&args(&v), "cmd").unwrap();
        assert!(out.table.provenance().method.contains("recorder.sh"));
        let seen = std::fs::read_to_string(&argv).unwrap();
        let seen: Vec<&str> = seen.lines().collect();
        let at = |a: &str| seen.iter().position(|s| *s == a);
        assert!(at("--budget-s=90").is_some(), "{seen:?}");
        assert!(
            at("--repeats=3").unwrap() > at("--budget-s=90").unwrap(),
            "{seen:?}"
        );
        // A --harness that is not there is named, not replaced by another.
        let mut v = common.to_vec();
        v.extend(["--harness", "/nonexistent/torch_harness.py"]);
        let msg = run(&args(&v), "cmd").err().unwrap().to_string();
        assert!(
            msg.contains("--harness /nonexistent/torch_harness.py does not exist"),
            "{msg}"
        );
        // The real harness: without torch or CUDA here it must say so.
        let mut v = common.to_vec();
        v.extend(["--out", out_file.to_str().unwrap()]);
        match run(&args(&v), "cmd") {
            Ok(o) => assert_eq!(o.table.mode(), Mode::Torch), // a GPU machine with torch
            Err(e) => {
                let msg = e.to_string();
                assert!(msg.contains("--compute torch needs"), "{msg}");
            }
        }
        std::fs::remove_dir_all(&dir).unwrap();
    }

    /// The real harness end to end on the CPU (a tiny two-layer Llama),
    /// where torch is importable: a table, then a partial one when the
    /// budget cannot fit the largest input.
    #[test]
    fn torch_mode_on_the_cpu_with_a_tiny_model() {
        let Some(py) = torch::torch_python("torch_mode_on_the_cpu_with_a_tiny_model") else {
            return;
        };
        let dir = scratch("torch-cpu");
        let config = dir.join("config.json");
        std::fs::write(
            &config,
            r#"{"model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
                "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
                "num_hidden_layers": 2, "vocab_size": 256, "rms_norm_eps": 1e-5,
                "rope_theta": 10000.0, "max_position_embeddings": 16384, "torch_dtype": "bfloat16"}"#,
        )
        .unwrap();
        let out_file = dir.join("tiny.json");
        let base = [
            "--model",
            config.to_str().unwrap(),
            "--name",
            "tiny",
            "--block-size",
            "64",
            "--gpu",
            "h100",
            "--quiet",
            "--compute",
            "torch",
            "--python",
            py.as_str(),
            "--torch-arg=--device=cpu",
            "--torch-arg=--repeats=3",
            "--torch-arg=--warmup=1",
            "--prefixes",
            "0,64",
            "--contexts",
            "64,256",
            "--out",
            out_file.to_str().unwrap(),
        ];
        let mut v = base.to_vec();
        v.extend(["--inputs", "16,32"]);
        let out = run(&args(&v), "cmd").unwrap();
        let t = SlackTable::load(&out.path).unwrap();
        assert_eq!(t.mode(), Mode::Torch);
        assert_eq!(
            (t.input_lengths(), t.prefix_lengths()),
            (&[16, 32][..], &[0, 64][..])
        );
        let m = &t.provenance().method;
        assert!(
            m.contains("CPU wall clock") && m.contains("median of 3 after 1 warmup"),
            "{m}"
        );
        assert!(!m.contains("PARTIAL"), "{m}");
        assert!(t.entry(1, 1).layers[1].compute_us > 0.0);
        // Rates assumed slow enough that input 8192 cannot fit 60 s: it is
        // left out up front, and the table says so.
        let mut v = base.to_vec();
        v.extend([
            "--inputs",
            "16,8192",
            "--budget-s",
            "60",
            "--torch-arg=--assume-rates=0.001,10",
        ]);
        let out = run(&args(&v), "cmd").unwrap();
        let t = SlackTable::load(&out.path).unwrap();
        assert_eq!(
            (t.input_lengths(), t.prefix_lengths()),
            (&[16][..], &[0, 64][..])
        );
        let m = &t.provenance().method;
        assert!(m.contains("PARTIAL") && m.contains("input 8192"), "{m}");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn pool_dir_and_assumed_numbers_exclude_each_other() {
        let a = args(&[
            "--model",
            "llama3-8b",
            "--gpu",
            "h100",
            "--pool-dir",
            "/tmp",
            "--read-gbs",
            "3",
            "--out",
            "/nonexistent/x.json",
        ]);
        let msg = run(&a, "cmd").err().unwrap().to_string();
        assert!(msg.contains("--pool-dir measures the storage"), "{msg}");
    }
}
