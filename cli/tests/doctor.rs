//! `kvtier doctor`: runs on any machine, says what it found, and picks an engine.
//! The GPU assertions hold only where there is no NVIDIA device node
//! (/dev/nvidiactl), so this test stays true on a GPU machine.

use kvtier_cli::doctor::Report;
use std::path::{Path, PathBuf};
use std::process::Command;

fn tmp_dir(name: &str) -> PathBuf {
    let d = Path::new(env!("CARGO_TARGET_TMPDIR"))
        .join(format!("kvtier-doctor-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    d
}

fn doctor(dir: &Path, json: bool) -> String {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_kvtier"));
    cmd.arg("doctor").arg("--dir").arg(dir);
    if json {
        cmd.arg("--json");
    }
    let out = cmd.output().expect("run kvtier doctor");
    assert!(
        out.status.success(),
        "kvtier doctor failed: {}\nstdout:\n{}\nstderr:\n{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).expect("utf-8 output")
}

fn no_gpu_here() -> bool {
    !Path::new("/dev/nvidiactl").exists()
}

#[test]
fn json_report_has_every_section_and_a_verdict() {
    let dir = tmp_dir("json");
    let text = doctor(&dir, true);
    let r: Report = serde_json::from_str(&text).expect("doctor --json is a Report");
    for name in [
        "gpu", "iommu", "vfio", "nvme", "io_uring", "pool_dir", "engine",
    ] {
        let s = r
            .section(name)
            .unwrap_or_else(|| panic!("no section {name} in {text}"));
        assert!(!s.items.is_empty(), "section {name} is empty");
        for i in &s.items {
            assert!(!i.value.trim().is_empty(), "{name}/{} has no value", i.key);
        }
    }
    assert!(
        ["gpu", "nvme", "uring", "none"].contains(&r.engine.as_str()),
        "engine {:?}",
        r.engine
    );
    assert!(!r.engine_reason.is_empty());

    // The pool directory was created, O_DIRECT on it was really tried, and the
    // temporary file is gone.
    assert!(dir.is_dir(), "--dir was not created");
    let pool = r.section("pool_dir").unwrap();
    let direct = pool.item("O_DIRECT").expect("O_DIRECT item");
    assert_eq!(
        direct.ok,
        Some(true),
        "O_DIRECT on {}: {direct:?}",
        dir.display()
    );
    let left: Vec<_> = std::fs::read_dir(&dir).unwrap().collect();
    assert!(left.is_empty(), "doctor left files behind: {left:?}");

    // A ring can be made everywhere the uring engine runs (and tests run).
    let ring = r
        .section("io_uring")
        .unwrap()
        .item("ring")
        .expect("ring item");
    assert_eq!(ring.ok, Some(true), "{ring:?}");

    // This version has neither the GPU nor the userspace NVMe engine, so the
    // verdict is uring, with the reasons the others are out.
    assert_eq!(r.engine, "uring", "{}", r.engine_reason);
    assert!(
        r.engine_reason.contains("gpu is out"),
        "{}",
        r.engine_reason
    );
    assert!(
        r.engine_reason.contains("nvme is out"),
        "{}",
        r.engine_reason
    );
    let engine = r.section("engine").unwrap();
    assert_eq!(engine.item("uring").unwrap().ok, Some(true));
    assert_eq!(engine.item("gpu").unwrap().ok, Some(false));
    assert_eq!(engine.item("nvme").unwrap().ok, Some(false));

    if no_gpu_here() {
        let gpu = r.section("gpu").unwrap();
        let kernel = gpu.item("kernel driver").expect("kernel driver item");
        assert_eq!(kernel.ok, Some(false), "{kernel:?}");
        // Without /dev/nvidiactl the driver either is not installed or sees no GPU.
        let driver = gpu.item("CUDA driver").expect("CUDA driver item");
        if driver.value == "not found" {
            assert_eq!(driver.ok, Some(false));
            assert!(
                engine.item("gpu").unwrap().note.contains("no CUDA driver"),
                "{:?}",
                engine.item("gpu")
            );
        } else {
            assert!(
                gpu.items.iter().all(|i| !i.key.starts_with("GPU ")),
                "a GPU without /dev/nvidiactl? {gpu:?}"
            );
        }
        // No GPU here: the verdict says why the GPU engine is out.
        assert!(
            r.engine_reason.contains("gpu is out"),
            "{}",
            r.engine_reason
        );
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn text_report_names_the_engine_and_why() {
    let dir = tmp_dir("text");
    let text = doctor(&dir, false);
    for heading in [
        "\ngpu\n",
        "\niommu\n",
        "\nnvme\n",
        "\nio_uring\n",
        "\npool_dir\n",
    ] {
        assert!(text.contains(heading), "no {heading:?} in\n{text}");
    }
    let engine_line = text
        .lines()
        .find(|l| l.starts_with("engine: "))
        .unwrap_or_else(|| panic!("no engine line in\n{text}"));
    assert!(engine_line.starts_with("engine: uring — "), "{engine_line}");
    assert!(text.contains("gpu is out:"), "{text}");
    assert!(text.contains("nvme is out:"), "{text}");
    assert!(text.contains("O_DIRECT"), "{text}");
    if no_gpu_here() {
        assert!(
            text.contains("no CUDA driver library")
                || text.contains("cuInit failed")
                || text.contains("the CUDA driver sees no GPU"),
            "{text}"
        );
    }
    std::fs::remove_dir_all(&dir).unwrap();
}
