//! `kvtier serve`: one process per node owns a pool and serves every engine
//! process on the node over a Unix socket (the library's
//! [`kvtier::service`]; this is its front end).

use crate::*;
use kvtier::handle::{EngineChoice, TierBuilder};
use kvtier::service::{self, Service, ServiceConfig};

#[derive(Args)]
pub(crate) struct ServeArgs {
    /// The pool's directory: the pool there is opened, or created with
    /// --capacity when there is none.
    #[arg(long)]
    dir: PathBuf,
    /// The pool's size when it is created (e.g. 64g).
    #[arg(long, value_parser = parse_capacity)]
    capacity: Option<u64>,
    #[command(flatten)]
    model: ModelArgs,
    /// The Unix socket clients connect to.
    #[arg(long)]
    socket: PathBuf,
    /// A group whose members may connect too (socket mode 0660); without
    /// it only this user may (mode 0600).
    #[arg(long)]
    group: Option<String>,
    /// Clients with memory (engine workers) connected at once, at most.
    #[arg(long, default_value_t = 8, value_parser = clap::value_parser!(u32).range(1..=1024))]
    clients: u32,
    /// Lookup-only clients (engines' schedulers: no memory) connected at
    /// once, at most.
    #[arg(long, default_value_t = 64, value_parser = clap::value_parser!(u32).range(0..=4096))]
    lookup_clients: u32,
    /// KV memory blocks each client shares with the service (its load and
    /// store buffer).
    #[arg(long, default_value_t = 256, value_parser = clap::value_parser!(u32).range(1..=1 << 20))]
    client_blocks: u32,
    /// The engines' tensor-parallel size: each TP rank is a client and the
    /// pool holds one rank's shard of each block (the model's KV heads / N;
    /// a model with fewer KV heads than ranks keeps one per rank, as vLLM
    /// replicates them).
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=1024))]
    tp_size: u32,
    /// auto, uring, nvme, gpu or gpu-host.
    #[arg(long, default_value = "auto")]
    engine: String,
}

/// The builder for the pool in `dir`: the library opens the pool that is
/// there, or creates one of `capacity` bytes for the model.
fn pool_builder(dir: &Path, capacity: Option<u64>, named: &model::NamedGeometry) -> TierBuilder {
    let b = TierBuilder::default().directory(dir).model(named.clone());
    match capacity {
        Some(c) => b.capacity(c),
        None => b,
    }
}

/// The model as one of `tp_size` tensor-parallel ranks holds it: its KV
/// heads split over the ranks (vLLM's split: a model with fewer KV heads
/// than ranks has one per rank, replicated).
fn per_rank(mut named: model::NamedGeometry, tp_size: u32) -> Result<model::NamedGeometry> {
    let heads = named.geometry.kv_heads;
    if tp_size > 1 {
        if heads >= tp_size && heads % tp_size != 0 || heads < tp_size && tp_size % heads != 0 {
            return Err(kvtier::Error::invalid(format!(
                "--tp-size {tp_size} neither splits nor evenly replicates the {heads} KV heads of {}: give the engines' tensor_parallel_size, which vLLM also requires to divide (or be a multiple of) the KV heads",
                named.name
            )));
        }
        named.geometry.kv_heads = (heads / tp_size).max(1);
        // A rank's shard has fewer heads per token: its objects can fall
        // below the direct-I/O alignment the whole model meets.
        named.geometry.validate().map_err(|e| {
            kvtier::Error::invalid(format!(
                "one rank's shard of {} under --tp-size {tp_size} ({} of its {heads} KV heads per rank): {e}",
                named.name, named.geometry.kv_heads
            ))
        })?;
    }
    Ok(named)
}

/// Runs `kvtier serve` until SIGTERM, SIGINT or SIGHUP; the exit code.
pub(crate) fn run(a: ServeArgs) -> Result<i32> {
    // Before any thread starts: every thread inherits the mask, and only
    // the signal thread takes them.
    service::block_termination_signals()?;
    let named = per_rank(a.model.resolve()?, a.tp_size)?;
    let engine = EngineChoice::parse(&a.engine).ok_or_else(|| {
        kvtier::Error::invalid(format!(
            "unknown --engine {:?}; use auto, uring, nvme, gpu or gpu-host",
            kvtier_cli::cli::excerpt(&a.engine, 40)
        ))
    })?;
    let group = a.group.as_deref().map(service::group_id).transpose()?;
    let builder = pool_builder(&a.dir, a.capacity, &named).engine(engine);
    let cfg = ServiceConfig::new(&a.socket)
        .with_group(group)
        .with_clients(a.clients)
        .with_lookup_clients(a.lookup_clients)
        .with_client_blocks(a.client_blocks);
    let svc = Service::start(builder, named.geometry, cfg)?;
    service::stop_on_signals(svc.stopper())?;
    svc.run()?;
    Ok(0)
}
