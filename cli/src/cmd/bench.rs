//! `kvtier bench`: store and retrieve model-shaped KV caches through the tier (or raw
//! I/O with `--pattern`), against fio, and report bandwidth.

use crate::*;

#[derive(Args)]
pub(crate) struct BenchArgs {
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
    /// Total pool size over all devices [default: what the contexts that
    /// run (within --mem-budget) need together, at most 12g]. The pool is
    /// written once at creation (see --first-fill), so its size is disk
    /// space and time.
    #[arg(long, value_parser = parse_capacity)]
    capacity: Option<u64>,
    /// Pool files ("SSDs") to stripe over.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=64))]
    devices: u32,
    /// Blocks per extent group (a layer of G consecutive blocks is one I/O).
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
    /// Bytes of one load's reads in flight at once, where the window starts
    /// (TierConfig::load_inflight_bytes; the first layer has its own, smaller cap).
    #[arg(long, default_value = "32m", value_parser = parse_io_size)]
    load_inflight: u64,
    /// The most the in-flight window grows to while later layers arrive
    /// faster (TierConfig::load_inflight_max_bytes); equal to --load-inflight
    /// (the default) keeps the window fixed; e.g. 256m lets it adapt.
    #[arg(long, default_value = "32m", value_parser = parse_io_size)]
    load_inflight_max: u64,
    /// Bytes of a load's first layer in flight at once
    /// (TierConfig::first_layer_inflight_bytes; at most half the layer, so
    /// it lands in two parts and the first is hashed while the second reads).
    #[arg(long, default_value = "8m", value_parser = parse_io_size)]
    first_layer_inflight: u64,
    /// Where the KV memory is: host, or gpu (HBM of GPU 0, through pinned
    /// host staging: restore and store each beside the disk-alone and
    /// copy-alone ceilings of the same run; needs a CUDA GPU).
    #[arg(long, default_value = "host", value_parser = ["host", "gpu", "host-double"], hide_possible_values = true)]
    memory: String,
    /// Engine memory in vLLM's cross-layer layout instead of per-layer tensors.
    #[arg(long)]
    cross_layer: bool,
    /// With --memory gpu: each context's store and restore also through
    /// the node's service (`kvtier serve`, started in this process on a
    /// pool of its own in --dir) by a staged client, beside the in-process
    /// staged path's of the same run.
    #[arg(long)]
    service: bool,
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
    /// Store into freshly allocated pool files (their first fill: unwritten
    /// extents, converted by the file system at each write's completion)
    /// instead of files written once at creation (`pool create --prewrite`),
    /// whose stores are overwrites as in a pool that has filled once.
    #[arg(long)]
    first_fill: bool,
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
    /// Memory the --pattern I/Os take their buffers from in turn (e.g. 8g:
    /// like a KV cache's gigabytes), instead of iodepth x bs reused as fio
    /// does. On a VM, DMA from a large footprint can cost bandwidth that a
    /// small reused buffer hides.
    #[arg(long, value_parser = parse_pool_size)]
    buffers: Option<u64>,
    /// Read percentage for randrw.
    #[arg(long, default_value_t = 50, value_parser = clap::value_parser!(u32).range(0..=100))]
    rwmixread: u32,
    /// Run fio (io_uring, direct=1) with the same workload on the same file and print kvtier/fio ratios.
    #[arg(long)]
    against_fio: bool,
    /// Blocks per store job: a context is stored as jobs of this many
    /// blocks, all submitted at once (16: LMCache's 256-token chunks).
    #[arg(long, default_value_t = 4096, value_parser = clap::value_parser!(u32).range(1..=4096))]
    store_job_blocks: u32,
    /// Read alone, write alone, then both at once on the same device.
    #[arg(long)]
    contention: bool,
    /// Lookup latency instead: `lookup_prefix` and `lookup_and_pin` +
    /// `unpin` of 16 stored keys on a TierHandle, timed idle and while
    /// another thread loads the first --contexts context again and again,
    /// in --repeat alternating rounds (p50/p99/p99.9/max, busy/idle p99).
    #[arg(long)]
    lookups: bool,
    /// Calls timed per phase of --lookups (one about every 100 us).
    #[arg(long, default_value_t = 20_000, value_parser = clap::value_parser!(u64).range(100..=10_000_000))]
    lookup_samples: u64,
    /// Most host memory one context's KV cache may take (the run's peak RSS
    /// is about this plus fio's buffers): larger contexts are skipped, and
    /// the report says so. Default: no limit beyond the memory available.
    #[arg(long, value_parser = parse_pool_size)]
    mem_budget: Option<u64>,
    /// Run each measurement this many times (kvtier and fio alternating:
    /// each --pattern run, or each round of the KV bench on a fresh pool) and
    /// report the medians (of each round's kvtier/fio ratio for the KV bench).
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=1000))]
    repeat: u32,
}

fn uring_cfg(a: &BenchArgs, default_depth: u32) -> UringConfig {
    UringConfig::default()
        .with_queue_depth(a.iodepth.unwrap_or(default_depth))
        .with_sqpoll_idle_ms(a.sqpoll)
        .with_fixed_buffers(true)
        .with_defer_taskrun(a.defer_taskrun)
}

pub(crate) fn run_bench(a: BenchArgs) -> Result<i32> {
    // Before any work: a run of minutes must not end in a refusal to write.
    report_paths_ok(
        &[
            ("--json", &a.json, ReportKind::Json),
            ("--plot", &a.plot, ReportKind::Svg),
        ],
        &[("--model", Path::new(&a.model.model))],
    )?;
    if a.service && a.memory == "host" {
        return Err(kvtier::Error::invalid(
            "--service compares the staged path through the node's service with the in-process one, for KV memory in GPU memory: add --memory gpu, or drop --service",
        ));
    }
    if a.pattern.is_some() || a.contention {
        return run_raw_bench(&a);
    }
    if a.lookups {
        return run_lookup_bench(&a);
    }
    let named = a.model.resolve()?;
    // Checked before any pool is created and prewritten (seconds per GiB).
    let object = named.geometry.object_bytes();
    if a.max_io < object {
        return Err(kvtier::Error::invalid(format!(
            "--max-io {} is smaller than one KV object of {} ({object} B); pass at least {object}",
            a.max_io, named.name
        )));
    }
    let cfg = BenchConfig {
        dir: a.dir.clone(),
        model: named.name,
        geometry: named.geometry,
        contexts: a.contexts.clone(),
        capacity: a.capacity.unwrap_or_else(|| {
            bench::default_capacity(
                &a.contexts,
                &named.geometry,
                // The HBM bench holds no context in host memory.
                a.mem_budget.filter(|_| a.memory == "host"),
                a.devices,
                a.group_blocks,
            )
        }),
        devices: a.devices,
        group_blocks: a.group_blocks,
        tier: TierConfig::default()
            .with_uring(uring_cfg(&a, 64))
            .with_max_io_bytes(a.max_io)
            .with_load_inflight_bytes(a.load_inflight)
            .with_load_inflight_max_bytes(a.load_inflight_max)
            .with_first_layer_inflight_bytes(a.first_layer_inflight),
        verify: !a.no_verify,
        cross_layer: a.cross_layer,
        store_job_blocks: a.store_job_blocks,
        nvme: userspace_target(&a)?,
        force: a.force,
        keep: a.keep,
        prewrite: !a.first_fill,
        mem_budget: a.mem_budget,
        fio_bracket: a.against_fio,
    };
    if cfg.nvme.is_some() && a.against_fio {
        return Err(kvtier::Error::invalid(
            "--against-fio needs the pool on files; fio cannot reach a controller bound to a userspace driver (drop --against-fio, or use --engine uring)",
        ));
    }
    if a.memory != "host" {
        return run_hbm_bench(&a, &cfg);
    }
    let bar = Progress::new();
    let mut rounds = Vec::new();
    for i in 0..a.repeat.max(1) {
        let say = |msg: &str| {
            if a.repeat > 1 {
                bar.say(&format!("round {}/{}: {msg}", i + 1, a.repeat));
            } else {
                bar.say(msg)
            }
        };
        // bench::run removes the pool files it created (unless --keep), and
        // only those, whichever way it returns.
        let mut report = bench::run(&cfg, say)?;
        if a.against_fio {
            say("fio: sequential and random read references on the same directory");
            report.fio = Some(bench::fio_references(&cfg, &say)?);
        }
        rounds.push(report);
    }
    bar.finish();
    if rounds.len() == 1 {
        let report = rounds.pop().expect("one round");
        kvtier_cli::cli::out(&bench::render(&report))?;
        if let Some(path) = &a.plot {
            bench::plot(&report, path)?;
            note(&format!("wrote {}", path.display()));
        }
        write_json(&a.json, &report)?;
        return Ok(0);
    }
    let repeated = bench::RepeatedReport::new(rounds);
    kvtier_cli::cli::out(&bench::render_repeated(&repeated))?;
    if let Some(path) = &a.plot {
        // The plot shows the median round's figures: the middle round by
        // its first context's store bandwidth.
        let mut order: Vec<&bench::BenchReport> = repeated.rounds.iter().collect();
        order.sort_by(|x, y| {
            let f = |r: &bench::BenchReport| r.results.first().map_or(0.0, |c| c.store_gib_s);
            f(x).total_cmp(&f(y))
        });
        bench::plot(order[order.len() / 2], path)?;
        note(&format!("wrote {}", path.display()));
    }
    write_json(&a.json, &repeated)?;
    Ok(0)
}

/// `kvtier bench --memory gpu` (and the hidden `host-double`, its plumbing
/// on the CPU test double of the copies).
fn run_hbm_bench(a: &BenchArgs, cfg: &BenchConfig) -> Result<i32> {
    use kvtier_cli::bench::hbm::{self, BenchMemory};
    let which = match a.memory.as_str() {
        "gpu" => BenchMemory::Gpu,
        _ => BenchMemory::HostDouble,
    };
    if a.pattern.is_some() || a.contention || a.against_fio || a.plot.is_some() {
        return Err(kvtier::Error::invalid(
            "--memory gpu measures its own ceilings; drop --pattern, --contention, --against-fio and --plot",
        ));
    }
    let bar = Progress::new();
    let report = hbm::run(cfg, which, a.service, |msg| bar.say(msg))?;
    bar.finish();
    kvtier_cli::cli::out(&hbm::render(&report))?;
    write_json(&a.json, &report)?;
    Ok(0)
}

/// `kvtier bench --lookups`.
fn run_lookup_bench(a: &BenchArgs) -> Result<i32> {
    use kvtier_cli::bench::lookup::{self, LookupConfig};
    if a.engine != "uring" || a.memory != "host" || a.against_fio || a.plot.is_some() {
        return Err(kvtier::Error::invalid(
            "--lookups runs on pool files with the uring engine and host memory, without fio or a plot; drop --engine, --memory, --against-fio and --plot",
        ));
    }
    let named = a.model.resolve()?;
    let cfg = LookupConfig {
        dir: a.dir.clone(),
        model: named.name,
        geometry: named.geometry,
        tokens: a.contexts[0],
        group_blocks: a.group_blocks,
        tier: TierConfig::default()
            .with_uring(uring_cfg(a, 64))
            .with_max_io_bytes(a.max_io.max(named.geometry.object_bytes())),
        lookup_keys: 16,
        samples: a.lookup_samples as usize,
        rounds: a.repeat,
        keep: a.keep,
    };
    let bar = Progress::new();
    let report = lookup::run(&cfg, |msg| bar.say(msg))?;
    bar.finish();
    kvtier_cli::cli::out(&lookup::render(&report))?;
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

fn run_raw_bench(a: &BenchArgs) -> Result<i32> {
    use kvtier_cli::bench::fio::{Pattern, Workload};
    let pattern = match &a.pattern {
        Some(p) => Pattern::parse(p).ok_or_else(|| {
            kvtier::Error::invalid(format!(
                "unknown --pattern {:?}; use read, write, randread, randwrite or randrw",
                kvtier_cli::cli::excerpt(p, 40)
            ))
        })?,
        None => Pattern::Read,
    };
    kvtier_cli::cli::make_dir(&a.dir)?;
    let w = Workload {
        pattern,
        bs: a.bs,
        iodepth: a.iodepth.unwrap_or(32),
        size: a.size,
        offset: 0,
        replay: None,
        runtime_secs: a.runtime,
        file: a.dir.join("kvtier-bench.dat"),
        rwmix_read: a.rwmixread,
        numjobs: 1,
        end_fsync: false,
    };
    let bar = Progress::new();
    let report = bench::raw_suite(
        &w,
        a.contention,
        a.against_fio,
        a.repeat,
        &uring_cfg(a, 32),
        a.buffers.unwrap_or(0),
        a.keep,
        &bar_fn(&bar),
    )?;
    bar.finish();
    kvtier_cli::cli::out(&bench::render_raw(&report))?;
    write_json(&a.json, &report)?;
    Ok(0)
}
