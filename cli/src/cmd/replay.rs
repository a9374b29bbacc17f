//! `kvtier replay`: a prefill's per-layer compute times against real I/O under a
//! scheduling policy, and the bubble time.

use crate::*;

#[derive(Args)]
pub(crate) struct ReplayArgs {
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
    /// Directory for the scratch pool file the prefix is read from (replay.pool, removed afterwards).
    #[arg(long, default_value = "./kvtier-data")]
    dir: PathBuf,
    /// Write every figure, with the settings, as JSON to this file.
    #[arg(long)]
    json: Option<PathBuf>,
    /// Sweep the hit rate at a fixed total context (input + prefix) and plot
    /// bubble time against it for each policy (SVG).
    #[arg(long)]
    sweep: Option<PathBuf>,
}

pub(crate) fn run_replay(a: ReplayArgs) -> Result<i32> {
    let mut inputs = vec![("--model", Path::new(&a.model.model))];
    if let Some(t) = &a.table {
        inputs.push(("--table", t.as_path()));
    }
    report_paths_ok(
        &[
            ("--json", &a.json, ReportKind::Json),
            ("--sweep", &a.sweep, ReportKind::Svg),
        ],
        &inputs,
    )?;
    if a.sweep.is_some() {
        return run_replay_sweep(a);
    }
    use kvtier::sched::Policy;
    use kvtier_cli::replay::ReplayRig;
    let plan = replay_plan(&a, a.input, a.prefix)?;
    let geometry = plan.geometry;
    let policies: Vec<Policy> = match a.policy.as_str() {
        "all" => vec![Policy::Slack, Policy::Naive, Policy::Sync],
        p => vec![Policy::parse(p).ok_or_else(|| {
            kvtier::Error::invalid(format!(
                "unknown --policy {:?}; use slack, naive, sync or all",
                kvtier_cli::cli::excerpt(p, 40)
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
fn auto_scale(read_us: f64, plan: &kvtier_cli::replay::ReplayPlan) -> Result<f64> {
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
fn replay_plan(a: &ReplayArgs, input: u64, prefix: u64) -> Result<kvtier_cli::replay::ReplayPlan> {
    let (g, mut plan) = match &a.table {
        Some(path) => kvtier_cli::replay::plan_from_table(
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
            let plan = kvtier_cli::replay::ReplayPlan {
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
    use kvtier::sched::Policy;
    use kvtier_cli::bench::plot::{plot_lines_svg, Series};
    use kvtier_cli::replay::ReplayRig;
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
        "--sweep",
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
