//! The userspace NVMe suite (`tests/nvme_sim.rs`, module `suite`) against a
//! real controller: QEMU's hw/nvme in a TCG guest (`scripts/qemu/run.sh`),
//! reached through uio (`kvtier::nvme::uio`: sysfs BAR0 + hugepages with
//! physical addresses from pagemap) or VFIO type1 behind an IOMMU
//! (`kvtier::nvme::vfio`: BAR0 through the device fd, DMA at chosen IOVAs).
//!
//! Build static for the guest:
//! `RUSTFLAGS="-C target-feature=+crt-static" cargo build --release --example nvme_guest --target x86_64-unknown-linux-gnu`
//!
//! usage: `nvme_guest [--mode uio|vfio] [--bw-secs S] [--bw-only] [PCI-ADDRESS]`. Without an
//! address it takes the only NVMe controller (class 0x010802). The controller
//! starts bound to the kernel's nvme driver; the `bind` tests hand it to
//! uio_pci_generic or vfio-pci with `kvtier::nvme::bind` (refusing while
//! /dev/nvme0n1 holds an ext4 signature, then binding, giving it back, and
//! binding again for the suite; the controller goes back to nvme at exit).
//! One line per test, then
//! `RESULT: PASS` (exit 0) or `RESULT: FAIL` (exit 1). With `--bw-secs S`
//! (S > 0) it also measures SGL and PRP read bandwidth at QD 32 for 16 KiB
//! objects scattered over four 4 KiB buffers and for 128 KiB objects.

#[path = "../tests/nvme_suite/mod.rs"]
mod suite;

use kvtier::engine::gpu::{GpuEngine, GpuEngineConfig, HostGioExecutor};
use kvtier::host::pci::{bound_driver, find_pci_class, pci_device_dir};
use kvtier::nvme::bind::{BindDriver, PciBinding};
use kvtier::nvme::ctrl::{
    Bar0, Controller, ControllerOptions, DataMode, DmaAlloc, DmaRegion, IoDir,
};
use kvtier::nvme::spec::{build_prps, Extent, SglDescriptor, Sqe};
use kvtier::nvme::uio::{open_bar0, HugeDma};
use kvtier::nvme::vfio::VfioDevice;
use kvtier::nvme::DataPtr;
use kvtier::nvme::{NvmeConfig, NvmeNamespace};
use std::os::unix::fs::FileExt;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::process::ExitCode;
use std::time::{Duration, Instant};

const NVME_CLASS: u32 = 0x010802;

struct Args {
    mode: String,
    addr: Option<String>,
    bw_secs: f64,
    bw_only: bool,
}

fn parse_args() -> Result<Args, String> {
    let mut a = Args {
        mode: "uio".into(),
        addr: None,
        bw_secs: 0.0,
        bw_only: false,
    };
    let mut it = std::env::args().skip(1);
    while let Some(arg) = it.next() {
        match arg.as_str() {
            "--mode" => a.mode = it.next().ok_or("--mode needs a value")?,
            "--bw-secs" => {
                a.bw_secs = it
                    .next()
                    .and_then(|s| s.parse().ok())
                    .ok_or("--bw-secs needs a number of seconds")?
            }
            "--bw-only" => a.bw_only = true,
            "-h" | "--help" => {
                return Err(
                    "usage: nvme_guest [--mode uio|vfio] [--bw-secs S] [--bw-only] [PCI-ADDRESS]"
                        .into(),
                )
            }
            s if s.starts_with('-') => return Err(format!("unknown option {s}")),
            s => a.addr = Some(s.to_string()),
        }
    }
    if a.mode != "uio" && a.mode != "vfio" {
        return Err(format!("mode '{}': uio or vfio", a.mode));
    }
    Ok(a)
}

/// Runs one test; a panic (the suite's assertions) is a failure.
fn case(results: &mut Vec<(String, bool)>, name: &str, f: impl FnOnce()) {
    let start = Instant::now();
    let ok = catch_unwind(AssertUnwindSafe(f)).is_ok();
    println!(
        "TEST {name:<28} {} ({:.0} ms)",
        if ok { "PASS" } else { "FAIL" },
        start.elapsed().as_secs_f64() * 1e3
    );
    results.push((name.to_string(), ok));
}

fn main() -> ExitCode {
    let args = match parse_args() {
        Ok(a) => a,
        Err(e) => {
            eprintln!("nvme_guest: {e}");
            println!("RESULT: FAIL");
            return ExitCode::FAILURE;
        }
    };
    match run(&args) {
        Ok(true) => {
            println!("RESULT: PASS");
            ExitCode::SUCCESS
        }
        Ok(false) => {
            println!("RESULT: FAIL");
            ExitCode::FAILURE
        }
        Err(e) => {
            eprintln!("nvme_guest: {e}");
            println!("RESULT: FAIL");
            ExitCode::FAILURE
        }
    }
}

fn run(args: &Args) -> kvtier::error::Result<bool> {
    let addr = match &args.addr {
        Some(a) => a.clone(),
        None => {
            let found = find_pci_class(NVME_CLASS)?;
            match found.as_slice() {
                [one] => one.clone(),
                [] => return Err(kvtier::error::Error::invalid("no NVMe controller found")),
                many => {
                    return Err(kvtier::error::Error::invalid(format!(
                        "several NVMe controllers ({many:?}): name one"
                    )))
                }
            }
        }
    };
    let driver = bound_driver(&pci_device_dir(&addr)?);
    println!(
        "nvme_guest: {addr}, mode {}, driver {}",
        args.mode,
        driver.as_deref().unwrap_or("none")
    );
    let mut results = Vec::new();
    let bind_driver = if args.mode == "vfio" {
        BindDriver::VfioPci
    } else {
        BindDriver::UioPciGeneric
    };
    let started_on_nvme = driver.as_deref() == Some("nvme");
    // Held while the suite runs; given back (and checked) at the end.
    let binding = if started_on_nvme && !args.bw_only {
        match bind_tests(&mut results, &addr, bind_driver) {
            Some(b) => b,
            None => return Ok(false),
        }
    } else {
        // Started on another driver (a run.sh without the nvme module), or
        // a backend without storage (--bw-only, null-co: a signature written
        // there reads back as zeros): just take it for the suite.
        PciBinding::bind(&addr, bind_driver, false)?
    };
    // Everything that maps the device (VFIO fds, BAR mappings, DMA) is gone
    // when suite_on returns: vfio-pci's unbind waits for its fds to close.
    let ok = if args.mode == "vfio" {
        let dev = VfioDevice::open(&addr)?;
        suite_on(args, &addr, results, dev.bar0(), || dev.dma(32 << 20))
    } else {
        suite_on(args, &addr, results, open_bar0(&addr)?, || HugeDma::new(8))
    };
    let mut end = Vec::new();
    case(&mut end, "bind restore_at_exit", || {
        binding.restore().expect("giving the controller back");
        if started_on_nvme {
            assert_eq!(driver_of(&addr).as_deref(), Some("nvme"));
            assert!(wait_for_namespace(), "{NAMESPACE} did not come back");
        }
    });
    Ok(ok && end[0].1)
}

const NAMESPACE: &str = "/dev/nvme0n1";
/// The kvtier CLI in the guest (run.sh adds it).
const KVTIER_BIN: &str = "/bin/kvtier";

/// Waits up to 10 s for the kernel nvme driver to (re)create /dev/nvme0n1.
fn wait_for_namespace() -> bool {
    let start = Instant::now();
    while start.elapsed() < Duration::from_secs(10) {
        if std::fs::metadata(NAMESPACE).is_ok() {
            return true;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    false
}

/// Writes `head` at byte 0 of /dev/nvme0n1 through the kernel driver.
fn write_head(head: &[u8]) {
    let f = std::fs::OpenOptions::new()
        .write(true)
        .open(NAMESPACE)
        .expect("open /dev/nvme0n1");
    f.write_all_at(head, 0).expect("write /dev/nvme0n1");
    f.sync_all().expect("fsync /dev/nvme0n1");
}

fn driver_of(addr: &str) -> Option<String> {
    bound_driver(&pci_device_dir(addr).expect("address"))
}

/// The `bind` tests, on a controller the kernel nvme driver has: refusal of
/// a namespace with a filesystem, bind and give back, bind for the suite
/// (returned; None if that failed).
fn bind_tests(r: &mut Vec<(String, bool)>, addr: &str, driver: BindDriver) -> Option<PciBinding> {
    let name = driver.name();
    case(r, "bind refuses_filesystem", || {
        assert!(wait_for_namespace(), "{NAMESPACE} did not appear");
        // ext2/3/4: s_magic 0xEF53 at byte 1080 (probe_signature's check).
        let mut head = vec![0u8; 4096];
        head[1080..1082].copy_from_slice(&[0x53, 0xef]);
        write_head(&head);
        let err = PciBinding::bind(addr, driver, false)
            .expect_err("bind must refuse a namespace holding ext4");
        let e = err.to_string();
        println!("  refused: {e}");
        // The way past it is a structured fix, which the CLI says as --force.
        assert_eq!(err.fix(), Some(&kvtier::error::Fix::ForceBind), "{e}");
        assert!(
            e.contains("/dev/nvme0n1 holds an ext2/3/4 filesystem"),
            "{e}"
        );
        assert_eq!(driver_of(addr).as_deref(), Some("nvme"));
    });
    case(r, "bind and_restore", || {
        // Zero everything probe_signature looks at (earlier runs' data too).
        write_head(&vec![0u8; 256 << 10]);
        let b = PciBinding::bind(addr, driver, false).expect("bind an empty namespace");
        assert_eq!(b.original_driver(), Some("nvme"));
        assert_eq!(driver_of(addr).as_deref(), Some(name));
        assert!(
            std::fs::metadata(NAMESPACE).is_err(),
            "{NAMESPACE} still there after the nvme driver let go"
        );
        drop(b);
        assert_eq!(driver_of(addr).as_deref(), Some("nvme"));
        // The kernel driver really works again: its namespace comes back.
        assert!(wait_for_namespace(), "{NAMESPACE} did not come back");
        let override_text =
            std::fs::read_to_string(pci_device_dir(addr).unwrap().join("driver_override")).unwrap();
        assert_eq!(
            override_text.trim(),
            "(null)",
            "driver_override not cleared"
        );
    });
    // The CLI, when run.sh put it in the guest: `kvtier nvme bind` runs the
    // command with the controller bound, and gives it back when a SIGTERM
    // (passed on to the command) ends the run, exiting 128 + 15.
    if std::path::Path::new(KVTIER_BIN).exists() {
        case(r, "bind cli_sigterm_restores", || {
            let script = format!(
                "d=$(readlink /sys/bus/pci/devices/$KVTIER_NVME_DEVICE/driver); \
                 [ \"${{d##*/}}\" = {name} ] || exit 9; kill -TERM $PPID; exec sleep 5"
            );
            let start = Instant::now();
            let status = std::process::Command::new(KVTIER_BIN)
                .args([
                    "nvme", "bind", addr, "--driver", name, "--", "/bin/sh", "-c",
                ])
                .arg(&script)
                .status()
                .expect("running kvtier");
            assert_eq!(status.code(), Some(128 + 15), "kvtier nvme bind: {status}");
            assert!(
                start.elapsed() < Duration::from_secs(4),
                "the command was not stopped"
            );
            assert_eq!(driver_of(addr).as_deref(), Some("nvme"));
            assert!(wait_for_namespace(), "{NAMESPACE} did not come back");
        });
    }
    // The whole user path: the CLI binds the controller for one command, a
    // KV benchmark with the pool on the namespace through each userspace
    // engine, verified byte for byte, then gives the controller back.
    if std::path::Path::new(KVTIER_BIN).exists() {
        for engine in ["nvme", "gpu-host"] {
            case(r, &format!("cli_bench_{engine}"), || {
                let json = format!("/tmp/bench-{engine}.json");
                let out = std::process::Command::new(KVTIER_BIN)
                    .args(["nvme", "bind", addr, "--driver", name, "--", KVTIER_BIN])
                    .args(["bench", "--engine", engine, "--model", "llama3-8b"])
                    .args(["--contexts", "256,1024", "--force", "--dir", "/tmp/kv"])
                    .args(["--json", &json])
                    .output()
                    .expect("running kvtier");
                assert!(
                    out.status.success(),
                    "kvtier bench --engine {engine}: {}\n{}",
                    out.status,
                    String::from_utf8_lossy(&out.stderr)
                );
                let text = std::fs::read_to_string(&json).expect("bench JSON");
                let v: serde_json::Value = serde_json::from_str(&text).expect("JSON");
                let results = v["results"].as_array().expect("results");
                assert_eq!(results.len(), 2, "{text}");
                assert!(results.iter().all(|c| c["verified"] == true), "{text}");
                let described = v["engine"].as_str().unwrap_or_default();
                let want = if engine == "nvme" {
                    "nvme:"
                } else {
                    "gpu (host executor)"
                };
                assert!(described.contains(want), "{described}");
                for c in results {
                    println!(
                        "ENGINE cli_bench_{engine}: {} tokens: store {:.2} GiB/s, retrieve {:.2} GiB/s",
                        c["tokens"], c["store_gib_s"].as_f64().unwrap_or(0.0),
                        c["retrieve_gib_s"].as_f64().unwrap_or(0.0)
                    );
                }
                assert_eq!(driver_of(addr).as_deref(), Some("nvme"));
                assert!(wait_for_namespace(), "{NAMESPACE} did not come back");
            });
        }
    }
    let mut kept = None;
    case(r, "bind for_suite", || {
        let b = PciBinding::bind(addr, driver, false).expect("bind for the suite");
        assert_eq!(driver_of(addr).as_deref(), Some(name));
        kept = Some(b);
    });
    kept
}

/// Every test on the controller at `bar`, with DMA memory from allocators
/// `new_dma` makes (the nvme engine takes one of its own).
fn suite_on<B, A>(
    args: &Args,
    addr: &str,
    mut results: Vec<(String, bool)>,
    bar: B,
    new_dma: impl Fn() -> A,
) -> bool
where
    B: Bar0 + Clone + Send + Sync + 'static,
    A: DmaAlloc + Send + 'static,
{
    let mut dma = new_dma();
    let opts = ControllerOptions::default().with_name(format!("{addr} ({})", args.mode));
    let up = |dma: &mut A| {
        Controller::bring_up(bar.clone(), dma, opts.clone()).expect("controller bring-up")
    };

    let r = &mut results;
    case(r, "bring_up_and_identify", || {
        let c = up(&mut dma);
        let id = c.identify();
        println!(
            "  model '{}', VS {}, MDTS {} (max transfer {} KiB), SGLS {:#x}, NN {}, nsze {} x {} B, max queue entries {}, DSTRD {}",
            id.model,
            c.version(),
            id.mdts,
            c.max_transfer_bytes() / 1024,
            id.sgls,
            id.nn,
            c.namespace().nsze,
            c.lba_bytes(),
            c.cap().max_queue_entries(),
            c.cap().dstrd(),
        );
        suite::identify(&c);
    });
    if args.bw_only {
        // A backend without storage (null-co): only bring-up and bandwidth.
        println!("  (--bw-only: data-verifying tests skipped)");
    } else {
        functional(r, &mut dma, &up);
        engine_cases(r, &bar, &opts, &new_dma);
    }

    if args.bw_secs > 0.0 {
        let secs = Duration::from_secs_f64(args.bw_secs);
        case(r, "bandwidth", || {
            let mut c = up(&mut dma);
            for (name, obj, pieces) in [
                ("16 KiB scattered (4 x 4 KiB)", 16 << 10, 4),
                ("128 KiB contiguous", 128 << 10, 1),
            ] {
                for sgl in [true, false] {
                    let (bytes, cmds, t) = bandwidth(&mut c, &mut dma, obj, pieces, sgl, 32, secs);
                    println!(
                        "BW {name:<28} {} QD32: {:8.2} MiB/s, {:7} cmds, {:6.0} ns/cmd",
                        if sgl { "SGL" } else { "PRP" },
                        bytes as f64 / t.as_secs_f64() / (1 << 20) as f64,
                        cmds,
                        t.as_nanos() as f64 / cmds as f64,
                    );
                }
            }
        });
    }
    results.iter().all(|(_, ok)| *ok)
}

/// The suite functions that apply to a real controller, each on a freshly
/// brought-up controller.
fn functional<B: Bar0, A: DmaAlloc>(
    r: &mut Vec<(String, bool)>,
    dma: &mut A,
    up: &dyn Fn(&mut A) -> Controller<B>,
) {
    case(r, "prp_write_sgl_read", || {
        suite::prp_write_sgl_read(&mut up(&mut *dma), &mut *dma, 0)
    });
    case(r, "sgl_write_prp_read", || {
        suite::sgl_write_prp_read(&mut up(&mut *dma), &mut *dma, 4096)
    });
    case(r, "scattered_read_through_one_sgl", || {
        suite::scattered_sgl_read(&mut up(&mut *dma), &mut *dma, 64)
    });
    // Chains of 3+ segments: QEMU 7.2's nvme_map_sgl refuses Segment ->
    // Segment of equal lengths (it checks "Last Segment?" through a pointer
    // into the buffer it just overwrote); Controller::build_sgl alternates
    // segment lengths so the suite's chains pass here as they do elsewhere.
    case(r, "segment_chains", || {
        suite::sgl_segment_chain(&mut up(&mut *dma), &mut *dma, 128)
    });
    case(r, "segment_chain_3_unequal", || {
        segment_chain_unequal(&mut up(&mut *dma), &mut *dma, 192)
    });
    case(r, "split_at_mdts", || {
        suite::split_at_mdts(&mut up(&mut *dma), &mut *dma, 10_000)
    });
    case(r, "error_statuses", || {
        let mut c = up(&mut *dma);
        suite::short_sgl(&mut c, &mut *dma, 0);
        suite::bit_bucket(&mut c, 0);
        suite::psdt_reserved(&mut c, &mut *dma, 0);
        suite::lba_out_of_range(&mut c, &mut *dma);
        // The queue still works after errors.
        suite::sgl_write_prp_read(&mut c, &mut *dma, 256);
    });
    case(r, "flush_and_shutdown", || {
        suite::flush_and_shutdown(&mut up(&mut *dma), &mut *dma)
    });
    println!("  (skipped: dropped_command_times_out_naming_the_queue, simulator only)");
}

/// The nvme engine and the tier through it, each on a controller brought
/// up with the two I/O queues the engine needs and an allocator it owns.
fn engine_cases<B, A>(
    r: &mut Vec<(String, bool)>,
    bar: &B,
    opts: &ControllerOptions,
    new_dma: &dyn Fn() -> A,
) where
    B: Bar0 + Clone + Send + Sync + 'static,
    A: DmaAlloc + Send + 'static,
{
    let up2 = || {
        let mut dma = new_dma();
        let opts = opts.clone().with_io_queues(2);
        let c = Controller::bring_up(bar.clone(), &mut dma, opts).expect("controller bring-up");
        (c, dma)
    };
    for (name, mode) in [
        ("engine_scatter_gather_sgl", DataMode::Sgl),
        ("engine_scatter_gather_prp", DataMode::Prp),
    ] {
        case(r, name, || {
            let (c, dma) = up2();
            suite::engine_scatter_gather(c, dma, mode, 64 << 20)
        });
    }
    for (name, mode) in [
        ("tier_llama3_8b_sgl", DataMode::Auto),
        ("tier_llama3_8b_prp", DataMode::Prp),
    ] {
        case(r, name, || {
            let (c, dma) = up2();
            let line = suite::tier_llama3_8b(c, dma, mode);
            println!("ENGINE {name}: {line}");
        });
    }
    // The GPU engine with its I/O kernel compiled for the CPU: the kernel's
    // SQEs, SGLs/PRP lists and doorbell stores (into BAR0, as a GPU's would
    // be) against QEMU's controller.
    if HostGioExecutor::new().is_none() {
        println!("  (skipped: gpu_engine_*: built without the host build of the I/O kernel)");
        return;
    }
    for (name, prefer_sgl) in [
        ("gpu_engine_tier_sgl", true),
        ("gpu_engine_tier_prp", false),
    ] {
        case(r, name, || {
            let mut dma = new_dma();
            let opts = opts.clone().with_io_queues(2).with_extra_io_queues(1);
            let c = Controller::bring_up(bar.clone(), &mut dma, opts).expect("controller bring-up");
            let ns = NvmeNamespace::new(c, dma, &NvmeConfig::default()).expect("namespace");
            let line = suite::tier_llama3_8b_on(ns, &|ns| {
                let exec = Box::new(HostGioExecutor::new().expect("host kernel"));
                let cfg = GpuEngineConfig::default().with_prefer_sgl(prefer_sgl);
                Box::new(GpuEngine::new(vec![ns.clone()], exec, cfg).expect("GPU engine"))
            });
            println!("ENGINE {name}: {line}");
        });
    }
}

/// Reads `obj`-byte objects at random object-aligned LBAs of the first 512
/// MiB, each into `pieces` buffers scattered over a DMA area, keeping `qd`
/// commands in flight on I/O queue 1 for `secs`. Returns bytes read,
/// commands and the time taken. Panics on a failed command.
fn bandwidth<B: Bar0, A: DmaAlloc>(
    c: &mut Controller<B>,
    dma: &mut A,
    obj: usize,
    pieces: usize,
    sgl: bool,
    qd: usize,
    secs: Duration,
) -> (u64, u64, Duration) {
    let page = c.page_bytes() as usize;
    let piece = obj / pieces;
    let nsid = c.nsid();
    let lbas_per_obj = (obj / 512) as u64;
    let objects = ((512u64 << 20) / obj as u64).min(c.namespace().nsze / lbas_per_obj);
    // Every piece of every slot lives in its own page-aligned stretch, with a
    // gap after it, so a slot's pieces are never adjacent.
    let stride = (piece + page).next_multiple_of(page);
    let data: DmaRegion = dma
        .alloc(stride * pieces * qd, page)
        .expect("bandwidth buffers");
    let desc: DmaRegion = dma.alloc(page * qd, page).expect("descriptor pages");
    let q = c.io_queue(0).expect("I/O queue");
    let mut seed = 0x1234_5678_9abc_def1u64;
    let mut next_lba = move || {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        (seed % objects) * lbas_per_obj
    };
    let make = |slot: usize, lba: u64| -> Sqe {
        let extents: Vec<Extent> = (0..pieces)
            .map(|p| data.extent((slot * pieces + p) * stride, piece))
            .collect();
        let d = desc.sub(slot * page, page);
        let nlb = (lbas_per_obj - 1) as u16;
        let ptr = if sgl {
            if pieces == 1 {
                DataPtr::Sgl(SglDescriptor::data_block(extents[0].addr, piece as u32))
            } else {
                for (i, e) in extents.iter().enumerate() {
                    let db = SglDescriptor::data_block(e.addr, e.len as u32);
                    d.write(i * 16, bytemuck::bytes_of(&db));
                }
                DataPtr::Sgl(SglDescriptor::last_segment(d.dma(), pieces as u32))
            }
        } else {
            let mut list = vec![0u64; page / 8];
            let prps = build_prps(extents, page as u64, &mut list, d.dma()).expect("PRPs");
            d.write(0, bytemuck::cast_slice(&list[..prps.list_slots]));
            prps.data_ptr()
        };
        Sqe::read(0, nsid, lba, nlb, ptr)
    };
    let start = Instant::now();
    let (mut bytes, mut cmds) = (0u64, 0u64);
    for slot in 0..qd {
        q.submit(make(slot, next_lba()), slot as u64)
            .expect("submit");
    }
    q.ring();
    let mut stop = false;
    let mut inflight = qd;
    while inflight > 0 {
        let done = q.wait(Duration::from_secs(5)).expect("completion");
        if !stop && start.elapsed() >= secs {
            stop = true;
        }
        for comp in done {
            let slot = comp.result().expect("bandwidth read failed") as usize;
            bytes += obj as u64;
            cmds += 1;
            inflight -= 1;
            if !stop {
                q.submit(make(slot, next_lba()), slot as u64)
                    .expect("submit");
                inflight += 1;
            }
        }
        q.ring();
    }
    (bytes, cmds, start.elapsed())
}

/// A Segment (3 descriptors) -> Segment (4) -> Last Segment (2) chain, built
/// by hand: reads seven odd-length extents in one command and a write back
/// through the same shape, verified through PRP.
fn segment_chain_unequal<B: Bar0, A: DmaAlloc>(c: &mut Controller<B>, dma: &mut A, lba: u64) {
    let page = c.page_bytes() as usize;
    let lens = [512usize, 1536, 999, 1049, 2048, 3584, 6656];
    let total: usize = lens.iter().sum();
    let data = suite::pattern(total, lba + 11);
    let nlb = (total / 512 - 1) as u16;
    let nsid = c.nsid();
    let chain = |bufs: &[DmaRegion], desc: &DmaRegion| -> DataPtr {
        let db: Vec<SglDescriptor> = bufs
            .iter()
            .zip(lens)
            .map(|(b, l)| SglDescriptor::data_block(b.dma() + 3, l as u32))
            .collect();
        let (s0, s1, s2) = (desc.dma(), desc.dma() + 256, desc.dma() + 512);
        let seg0 = [db[0], db[1], SglDescriptor::segment(s1, 4)];
        let seg1 = [db[2], db[3], db[4], SglDescriptor::last_segment(s2, 2)];
        let seg2 = [db[5], db[6]];
        desc.write(0, bytemuck::cast_slice(&seg0));
        desc.write(256, bytemuck::cast_slice(&seg1));
        desc.write(512, bytemuck::cast_slice(&seg2));
        DataPtr::Sgl(SglDescriptor::segment(s0, 3))
    };
    let desc = dma.alloc(page, page).expect("descriptor page");
    // Write the pattern through PRP, read it through the chain.
    let w = dma.alloc(total, page).expect("buffer");
    w.write(0, &data);
    c.transfer(0, IoDir::Write, lba, &[w.extent(0, total)], DataMode::Prp)
        .expect("PRP write");
    let bufs: Vec<DmaRegion> = lens
        .iter()
        .map(|&l| {
            let b = dma.alloc(l + 8, page).expect("buffer");
            b.fill(0x5a);
            b
        })
        .collect();
    c.execute(0, Sqe::read(0, nsid, lba, nlb, chain(&bufs, &desc)))
        .expect("3-segment chain read");
    let mut at = 0;
    for (i, (b, l)) in bufs.iter().zip(lens).enumerate() {
        let all = b.to_vec();
        assert!(
            all[3..3 + l] == data[at..at + l],
            "3-segment chain read: extent {i} differs"
        );
        assert!(
            all[..3].iter().chain(&all[3 + l..]).all(|&x| x == 0x5a),
            "3-segment chain read: bytes around extent {i} written"
        );
        at += l;
    }
    // Write a second pattern through the chain, read it back through PRP.
    let data2 = suite::pattern(total, lba + 13);
    let mut at = 0;
    for (b, l) in bufs.iter().zip(lens) {
        b.write(3, &data2[at..at + l]);
        at += l;
    }
    c.execute(0, Sqe::write(0, nsid, lba, nlb, chain(&bufs, &desc)))
        .expect("3-segment chain write");
    let r = dma.alloc(total, page).expect("buffer");
    c.transfer(0, IoDir::Read, lba, &[r.extent(0, total)], DataMode::Prp)
        .expect("PRP read");
    assert!(
        r.to_vec() == data2,
        "PRP read of 3-segment-chain-written data differs"
    );
}
