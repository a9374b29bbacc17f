//! `kvtier pool`: create, inspect and verify pools.

use crate::*;
use kvtier::pool::place;

/// Where a pool is: its backing files or block devices, or a pool directory
/// (the files kvtier makes there, as `TierBuilder::directory` names them).
#[derive(Args)]
pub(crate) struct PoolAt {
    /// A backing file or block device; repeat for several SSDs.
    #[arg(long = "dev", required_unless_present = "dir")]
    devs: Vec<PathBuf>,
    /// A pool directory instead of --dev: the files kvtier makes there
    /// (kvtier-0.pool, ...), the pool the library's and Python's
    /// TierBuilder.directory open.
    #[arg(long, conflicts_with = "devs")]
    dir: Option<PathBuf>,
    /// How many files the pool in --dir spreads over (a new pool: 1; one
    /// that is there: the kvtier-N.pool files it has).
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..=64))]
    files: Option<u32>,
}

impl PoolAt {
    fn paths(&self) -> Vec<PathBuf> {
        match &self.dir {
            Some(dir) => place::directory_files(
                dir,
                self.files
                    .unwrap_or_else(|| place::directory_files_found(dir).max(1)),
            ),
            None => self.devs.clone(),
        }
    }
}

#[derive(Subcommand)]
pub(crate) enum PoolCmd {
    /// Format a pool over backing files or block devices, or in a pool
    /// directory.
    Create {
        #[command(flatten)]
        at: PoolAt,
        /// Size of each backing file (e.g. 64g, 4 KiB to 1 PiB); block devices default to their whole size.
        #[arg(long, value_parser = parse_pool_size, conflicts_with = "dir")]
        size: Option<u64>,
        /// With --dir: the pool's total size (e.g. 64g), split equally over
        /// its files.
        #[arg(long, value_parser = parse_capacity, requires = "dir")]
        capacity: Option<u64>,
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
        /// Write every byte of the backing files once now (their size at the
        /// disk's write speed), so that first stores run at overwrite speed:
        /// a file system hands preallocated space out as unwritten extents,
        /// and filling them ran at ~0.6x on ext4. Block devices are never
        /// prewritten.
        #[arg(long)]
        prewrite: bool,
    },
    /// Show a pool's geometry, devices and usage.
    Info {
        #[command(flatten)]
        at: PoolAt,
        /// Print the report as JSON.
        #[arg(long)]
        json: bool,
    },
    /// Verify every header and block checksum; exits 1 on damage (or on
    /// blocks that carry no checksum to verify).
    Check {
        #[command(flatten)]
        at: PoolAt,
        /// Print the report as JSON.
        #[arg(long)]
        json: bool,
        /// Drop every damaged or unreadable block (its header is cleared) so
        /// the pool is clean again; says how many. Needs the pool to itself.
        #[arg(long)]
        repair: bool,
    },
}

/// Runs one `kvtier pool` command; the exit code.
impl PoolCmd {
    /// Whether this command sizes a pool by its total `--capacity` (a pool
    /// directory) rather than each file's `--size`.
    pub(crate) fn sizes_by_capacity(&self) -> bool {
        matches!(self, PoolCmd::Create { at, .. } if at.dir.is_some())
    }
}

pub(crate) fn run(cmd: PoolCmd) -> Result<i32> {
    match cmd {
        PoolCmd::Create {
            at,
            size,
            capacity,
            model,
            group_blocks,
            namespace,
            force,
            prewrite,
        } => {
            let named = model.resolve()?;
            let geometry = named.geometry;
            let namespace =
                namespace.unwrap_or_else(|| model::default_namespace(&named.name, &geometry, 0));
            let devs = at.paths();
            // A pool directory: the library's split of the capacity over
            // its files, and the directory made.
            let size = match (&at.dir, capacity) {
                (None, _) => size,
                (Some(_), None) => {
                    return Err(kvtier::Error::invalid(
                        "--dir needs --capacity: the pool's total size, split over its --files",
                    ))
                }
                (Some(dir), Some(capacity)) => {
                    let per_file =
                        place::bytes_per_file(capacity, devs.len(), &geometry, group_blocks, dir)?;
                    kvtier_cli::cli::make_dir(dir)?;
                    Some(per_file)
                }
            };
            let mut last = std::time::Instant::now();
            // A progress line left open when creating fails: the error
            // goes on a line of its own.
            let mut open_line = false;
            let pool = Pool::create_with_progress(
                &PoolConfig::new(geometry, named.name.clone(), namespace)
                    .with_group_blocks(group_blocks)
                    .with_devices(
                        devs.iter()
                            .map(|p| DeviceSpec {
                                path: p.clone(),
                                size,
                            })
                            .collect(),
                    )
                    .with_force(force)
                    .with_prewrite(prewrite),
                &mut |done, total| {
                    if done == 0 || done == total || last.elapsed().as_millis() > 500 {
                        let _ = write!(
                            std::io::stderr(),
                            "\rprewriting {} of {}",
                            human_bytes(done),
                            human_bytes(total)
                        );
                        last = std::time::Instant::now();
                        open_line = true;
                    }
                    if done == total {
                        let _ = writeln!(std::io::stderr());
                        open_line = false;
                    }
                },
            )
            .inspect_err(|_| {
                if open_line {
                    let _ = writeln!(std::io::stderr());
                }
            })?;
            print_info(&pool)?;
            Ok(0)
        }
        PoolCmd::Info { at, json } => {
            let devs = at.paths();
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
        PoolCmd::Check { at, json, repair } => {
            let devs = at.paths();
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
                for s in &report.damaged_superblocks {
                    outln!("damaged superblock copy: {s} (the pool opened from a sound copy)");
                }
                for s in &report.damaged_headers {
                    outln!("damaged header: slot {s} (its block is not visible)");
                }
                for s in &report.unreadable_headers {
                    outln!("unreadable header: slot {s} (its block, if any, is lost)");
                }
                for s in &report.damaged_bad_tables {
                    outln!("damaged bad-slot table: {s} (no data is lost; the slots it listed are retired again as their writes fail)");
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
            // The verdict (the exit status carries it too); with --json it
            // goes to stderr so stdout stays one JSON document.
            let (verdict, code) = if let Some(n) = repaired {
                (
                    format!(
                        "repaired: rewrote {} damaged superblock copy(ies), dropped {n} damaged block(s), cleared {} damaged header(s), rewrote {} unreadable header sector(s) (retired where they still fail) and {} damaged bad-slot table(s); the pool now holds only blocks that verify",
                        report.damaged_superblocks.len(),
                        report.damaged_headers.len(),
                        report.unreadable_headers.len(),
                        report.damaged_bad_tables.len()
                    ),
                    0,
                )
            } else if report.is_clean() {
                ("pool is clean".to_string(), 0)
            } else if report.is_undamaged() {
                (
                    format!(
                        "pool is NOT VERIFIED: no damage found, but {} block(s) carry no checksum",
                        report.blocks_unverifiable
                    ),
                    1,
                )
            } else {
                (
                    format!(
                        "pool is DAMAGED: {} damaged superblock copy(ies), {} damaged header(s), {} unreadable header(s), {} damaged bad-slot table(s), {} block(s) with bad data, {} unreadable; `kvtier pool check --repair` rewrites the superblocks and tables and drops the rest",
                        report.damaged_superblocks.len(),
                        report.damaged_headers.len(),
                        report.unreadable_headers.len(),
                        report.damaged_bad_tables.len(),
                        report.bad_data.len(),
                        report.unreadable_data.len()
                    ),
                    1,
                )
            };
            if json {
                note(&verdict);
            } else {
                outln!("{verdict}");
            }
            Ok(code)
        }
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
        let unwritten = match d.unwritten_bytes {
            Some(u) if u > 0 => format!(
                "; {} never written: first stores into it run slower (unwritten extents), \
                 `pool create --prewrite` writes a new pool once",
                human_bytes(u)
            ),
            _ => String::new(),
        };
        outln!(
            "  device {n}: {} ({}{backing}, {} groups{unwritten})",
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
    if i.damaged_superblocks > 0 {
        outln!(
            "  WARNING: {} damaged superblock copy(ies) (opened from a sound one); run `kvtier pool check --repair`",
            i.damaged_superblocks
        );
    }
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
