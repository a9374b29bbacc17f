//! `--compute torch`: run `profiler/torch_harness.py` on this machine's GPU
//! and read the trace it writes (see `trace.rs` for the format).
//!
//! The harness builds the model's decoder layers from its Hugging Face config
//! (the model's config.json, or one written from the preset) with random bf16
//! weights, and times the grid's passes as CUDA-graph replays (GPU time, not
//! Python's launch rate) within a time budget; it exits with status 3 and
//! says why when torch, transformers or CUDA is missing.

use crate::shape::Shape;
use crate::trace::Trace;
use kvtier::{Error, Result};
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

/// The harness's file name, wherever it lives.
pub const HARNESS_FILE: &str = "torch_harness.py";

/// The environment variable naming the harness when `--harness` does not.
pub const HARNESS_ENV: &str = "KVTIER_TORCH_HARNESS";

/// The harness in the sources this binary was built from (which need not
/// exist where the binary runs).
pub fn default_harness() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join(HARNESS_FILE)
}

/// The places the harness is looked for without `--harness` or
/// `$KVTIER_TORCH_HARNESS`, in order: next to the executable, the current
/// directory's `profiler/torch_harness.py` (a checkout), then the sources the
/// binary was built from.
pub fn harness_candidates(exe: Option<&Path>, cwd: Option<&Path>) -> Vec<PathBuf> {
    let mut v = Vec::new();
    if let Some(dir) = exe.and_then(Path::parent) {
        v.push(dir.join(HARNESS_FILE));
    }
    if let Some(cwd) = cwd {
        v.push(cwd.join("profiler").join(HARNESS_FILE));
    }
    v.push(default_harness());
    v
}

/// The harness to run: `explicit` (`--harness`), else `env`
/// (`$KVTIER_TORCH_HARNESS`), each of which must exist; else the first of
/// [`harness_candidates`] that exists. The error names every place tried.
pub fn resolve_harness_in(
    explicit: Option<&Path>,
    env: Option<&Path>,
    candidates: &[PathBuf],
) -> Result<PathBuf> {
    if let Some(p) = explicit {
        return if p.is_file() {
            Ok(p.to_path_buf())
        } else {
            Err(Error::invalid(format!(
                "--compute torch: --harness {} does not exist; give the path of profiler/{HARNESS_FILE}",
                p.display()
            )))
        };
    }
    if let Some(p) = env.filter(|p| !p.as_os_str().is_empty()) {
        return if p.is_file() {
            Ok(p.to_path_buf())
        } else {
            Err(Error::invalid(format!(
                "--compute torch: ${HARNESS_ENV} names {}, which does not exist",
                p.display()
            )))
        };
    }
    if let Some(p) = candidates.iter().find(|p| p.is_file()) {
        return Ok(p.clone());
    }
    let tried: Vec<String> = candidates.iter().map(|p| p.display().to_string()).collect();
    Err(Error::invalid(format!(
        "--compute torch: cannot find {HARNESS_FILE}; tried --harness (not given), ${HARNESS_ENV} (not set), {}; pass --harness PATH or set ${HARNESS_ENV}",
        tried.join(", ")
    )))
}

/// [`resolve_harness_in`] with this process's environment, executable and
/// current directory.
pub fn resolve_harness(explicit: Option<&Path>) -> Result<PathBuf> {
    let env = std::env::var_os(HARNESS_ENV).map(PathBuf::from);
    let exe = std::env::current_exe().ok();
    let cwd = std::env::current_dir().ok();
    resolve_harness_in(
        explicit,
        env.as_deref(),
        &harness_candidates(exe.as_deref(), cwd.as_deref()),
    )
}

/// What to run and on which grid.
pub struct TorchRun<'a> {
    pub python: &'a str,
    pub harness: &'a Path,
    pub shape: &'a Shape,
    pub inputs: &'a [u64],
    pub prefixes: &'a [u64],
    pub contexts: &'a [u64],
    /// Seconds the harness may take in all (0: no limit); it leaves out what
    /// it estimates will not fit and marks the trace partial.
    pub budget_s: f64,
    /// Scratch directory for the config and the trace.
    pub work_dir: &'a Path,
    /// Extra arguments passed to the harness as they are (after ours, so
    /// they win).
    pub extra_args: &'a [String],
}

fn list(v: &[u64]) -> String {
    v.iter().map(u64::to_string).collect::<Vec<_>>().join(",")
}

/// Runs the harness; its progress goes to this process's stderr as it comes.
pub fn run(r: &TorchRun) -> Result<Trace> {
    if !r.harness.is_file() {
        return Err(Error::invalid(format!(
            "--compute torch: the harness {} is missing; pass --harness PATH to profiler/{HARNESS_FILE}",
            r.harness.display()
        )));
    }
    std::fs::create_dir_all(r.work_dir)
        .map_err(|e| Error::io(format!("creating {}", r.work_dir.display()), e))?;
    let config = r.work_dir.join(format!("{}.config.json", r.shape.name));
    let trace = r.work_dir.join(format!("{}.trace.json", r.shape.name));
    let text = serde_json::to_string_pretty(&r.shape.hf_config()?).expect("config serializes");
    std::fs::write(&config, text)
        .map_err(|e| Error::io(format!("writing {}", config.display()), e))?;
    let _ = std::fs::remove_file(&trace);
    let mut cmd = Command::new(r.python);
    cmd.arg(r.harness)
        .arg("--config")
        .arg(&config)
        .arg("--name")
        .arg(&r.shape.name)
        .arg("--inputs")
        .arg(list(r.inputs))
        .arg("--prefixes")
        .arg(list(r.prefixes))
        .arg("--contexts")
        .arg(list(r.contexts))
        .arg(format!("--budget-s={}", r.budget_s))
        .arg("--out")
        .arg(&trace)
        .args(r.extra_args)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped());
    let mut child = cmd.spawn().map_err(|e| {
        Error::invalid(format!(
            "--compute torch needs {} (with torch, transformers and a CUDA GPU) but it cannot be run: {e}; install Python 3 or pass --python PATH",
            r.python
        ))
    })?;
    // The harness's progress lines, for the user, as they come; the last
    // one says why when it fails.
    let mut last = String::new();
    if let Some(err) = child.stderr.take() {
        for line in BufReader::new(err).lines() {
            let Ok(line) = line else { break };
            eprintln!("{line}");
            if !line.trim().is_empty() {
                last = line;
            }
        }
    }
    let status = child
        .wait()
        .map_err(|e| Error::io(format!("waiting for {}", r.harness.display()), e))?;
    if !status.success() {
        if last.is_empty() {
            last = "(no message)".into();
        }
        let why = if status.code() == Some(3) {
            "--compute torch needs torch, transformers and a CUDA GPU on this machine; use --compute analytic here, or run it where a GPU is"
        } else {
            "the torch harness failed"
        };
        return Err(Error::invalid(format!(
            "{why}: {} exited with {status}: {last}",
            r.harness.display(),
        )));
    }
    Trace::load(&trace, r.shape.geometry.layers)
}

/// For tests: a Python that imports torch and transformers ($KVTIER_TORCH_PYTHON,
/// else the CPU venv ~/.cache/kvtier-torch-cpu, else python3), or `None`, said
/// on stderr as a skip.
#[cfg(test)]
pub(crate) fn torch_python(test: &str) -> Option<String> {
    static FOUND: std::sync::OnceLock<Option<String>> = std::sync::OnceLock::new();
    let found = FOUND.get_or_init(find_torch_python).clone();
    if found.is_none() {
        eprintln!(
            "SKIPPED {test}: no Python with torch and transformers (set KVTIER_TORCH_PYTHON, or make the CPU venv ~/.cache/kvtier-torch-cpu)"
        );
    }
    found
}

#[cfg(test)]
fn find_torch_python() -> Option<String> {
    let mut candidates: Vec<String> = Vec::new();
    if let Some(p) = std::env::var_os("KVTIER_TORCH_PYTHON") {
        candidates.push(p.to_string_lossy().into_owned());
    }
    if let Some(home) = std::env::var_os("HOME") {
        let venv = Path::new(&home).join(".cache/kvtier-torch-cpu/bin/python");
        if venv.is_file() {
            candidates.push(venv.to_string_lossy().into_owned());
        }
    }
    candidates.push("python3".into());
    for py in candidates {
        let ok = Command::new(&py)
            .args(["-c", "import torch, transformers"])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .is_ok_and(|s| s.success());
        if ok {
            return Some(py);
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::shape::ShapeOverrides;

    fn scratch(tag: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!(
            "kvtier-profiler-torch-{tag}-{}-{}",
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
    fn harness_is_valid_python() {
        let h = default_harness();
        assert!(h.is_file(), "{}", h.display());
        let Ok(out) = Command::new("python3")
            .arg("-c")
            .arg("import ast,sys; ast.parse(open(sys.argv[1]).read())")
            .arg(&h)
            .output()
        else {
            eprintln!("SKIPPED harness_is_valid_python: python3 absent");
            return;
        };
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
    }

    #[test]
    fn harness_is_found_at_run_time() {
        let dir = scratch("find");
        let here = dir.join(HARNESS_FILE);
        std::fs::write(&here, "").unwrap();
        let gone = dir.join("nowhere").join(HARNESS_FILE);
        // --harness wins, and must exist.
        assert_eq!(
            resolve_harness_in(Some(&here), Some(&gone), std::slice::from_ref(&gone)).unwrap(),
            here
        );
        let msg = resolve_harness_in(Some(&gone), Some(&here), std::slice::from_ref(&here))
            .unwrap_err()
            .to_string();
        assert!(
            msg.contains("--harness") && msg.contains("does not exist"),
            "{msg}"
        );
        // Then $KVTIER_TORCH_HARNESS, which must exist too.
        assert_eq!(
            resolve_harness_in(None, Some(&here), std::slice::from_ref(&gone)).unwrap(),
            here
        );
        let msg = resolve_harness_in(None, Some(&gone), std::slice::from_ref(&here))
            .unwrap_err()
            .to_string();
        assert!(msg.contains("$KVTIER_TORCH_HARNESS names"), "{msg}");
        // Then the first candidate that exists; none: every place is named.
        assert_eq!(
            resolve_harness_in(None, None, &[gone.clone(), here.clone()]).unwrap(),
            here
        );
        let other = dir.join("other").join(HARNESS_FILE);
        let msg = resolve_harness_in(None, None, &[gone.clone(), other.clone()])
            .unwrap_err()
            .to_string();
        for p in [&gone, &other] {
            assert!(msg.contains(&p.display().to_string()), "{msg}");
        }
        assert!(msg.contains("$KVTIER_TORCH_HARNESS (not set)"), "{msg}");
        // The candidates: next to the executable, ./profiler, the sources.
        let c = harness_candidates(
            Some(Path::new("/opt/bin/kvtier-profile")),
            Some(Path::new("/w")),
        );
        assert_eq!(
            c,
            vec![
                PathBuf::from("/opt/bin/torch_harness.py"),
                PathBuf::from("/w/profiler/torch_harness.py"),
                default_harness()
            ]
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn missing_python_is_explained() {
        let shape =
            Shape::resolve("llama3-8b", 16, None, None, &ShapeOverrides::default()).unwrap();
        let dir = scratch("nopython");
        let h = default_harness();
        let r = TorchRun {
            python: "/nonexistent/python3",
            harness: &h,
            shape: &shape,
            inputs: &[16],
            prefixes: &[0],
            contexts: &[16],
            budget_s: 60.0,
            work_dir: &dir,
            extra_args: &[],
        };
        let msg = run(&r).expect_err("no such python").to_string();
        assert!(msg.contains("needs /nonexistent/python3"), "{msg}");
        let _ = std::fs::remove_dir_all(&dir);
    }

    /// The harness's pure-Python parts (argument handling, the budget
    /// planner, the spread) with any python3: they import no torch.
    #[test]
    fn harness_logic_without_torch() {
        let script = r#"
import sys
sys.path.insert(0, sys.argv[1])
import torch_harness as h

# --check needs no grid; a run without one is refused with status 2.
a = h.parse_args(["--check"])
assert a.check and a.repeats == 5 and a.warmup == 2 and a.budget_s == 420.0, a
try:
    h.parse_args(["--inputs", "16"])
    raise AssertionError("accepted a run without a grid")
except SystemExit as e:
    assert e.code == 2, e.code
for bad in (["--check", "--repeats", "0"], ["--check", "--budget-s", "-1"],
            ["--check", "--device", "cpu", "--timing", "graph"], ["--check", "--assume-rates", "1"]):
    try:
        h.parse_args(bad)
        raise AssertionError(f"accepted {bad}")
    except SystemExit as e:
        assert e.code == 2, (bad, e.code)
assert h.parse_args(["--check", "--assume-rates", "500,2000"]).assume_rates == (5e14, 2e12)
assert h.int_list("2048,0,512,0") == [0, 512, 2048]

# The planner: cost grows with input and prefix; drop rows/columns until it fits.
cost = lambda i, p: (i + p) / 1000.0
dec = lambda c: c / 100000.0
I, P, C, est, fits = h.plan_grid([1000, 2000, 64000], [0, 1000, 128000], [1000, 128000], cost, dec, 0)
assert (I, P, C, fits) == ([1000, 2000, 64000], [0, 1000, 128000], [1000, 128000], True)
I, P, C, est, fits = h.plan_grid([1000, 2000, 64000], [0, 1000, 128000], [1000, 128000], cost, dec, 20)
assert fits and est <= 20 and I == [1000, 2000] and P == [0, 1000] and C == [1000, 128000], (I, P, C, est)
I, P, C, est, fits = h.plan_grid([64000], [128000], [1000], cost, dec, 20)
assert not fits and I == [64000], (I, P, fits)

# Costs: a long prefill is timed on fewer layers than a decode step.
g = h.Geometry(4096, 32, 8, 128, 14336, 8)
r = h.Rates(650e12, 2.8e12, 1.5e-3, 0.15)
assert h.pass_layers(r, g, 1, 1023) == 8 and h.pass_layers(r, g, 65536, 131072) == 1
f, v = h.point_cost(r, g, "graph", 2, 5, 512, 0)
f2, v2 = h.point_cost(r, g, "graph", 2, 5, 8192, 32768)
assert 0 < v < v2 < 60, (v, v2)

s = h.spread([5.0, 1.0, 3.0, 2.0, 4.0])
assert s == {"min": 1.0, "p10": 1.4, "median": 3.0, "p90": 4.6, "max": 5.0}, s
print("ok")
"#;
        let dir = default_harness().parent().unwrap().to_path_buf();
        let Ok(out) = Command::new("python3")
            .arg("-c")
            .arg(script)
            .arg(&dir)
            .output()
        else {
            eprintln!("SKIPPED harness_logic_without_torch: python3 absent");
            return;
        };
        assert!(
            out.status.success() && String::from_utf8_lossy(&out.stdout).contains("ok"),
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }

    /// `--check` by itself, on the CPU, where torch is importable.
    #[test]
    fn harness_check_runs_alone_on_cpu() {
        let Some(py) = torch_python("harness_check_runs_alone_on_cpu") else {
            return;
        };
        let out = Command::new(&py)
            .arg(default_harness())
            .args(["--check", "--device", "cpu"])
            .output()
            .unwrap();
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(
            out.status.success() && stdout.starts_with("ok: torch "),
            "{stdout}{}",
            String::from_utf8_lossy(&out.stderr)
        );
        assert!(stdout.contains("matches a float32 reference"), "{stdout}");
        assert!(stdout.contains("cpu timing"), "{stdout}");
        // Without --device cpu, a machine without CUDA is status 3 (what
        // kvtier-profile reports as "needs ... a CUDA GPU").
        let out = Command::new(&py)
            .arg(default_harness())
            .arg("--check")
            .output()
            .unwrap();
        let has_cuda = Command::new(&py)
            .args([
                "-c",
                "import torch,sys; sys.exit(0 if torch.cuda.is_available() else 1)",
            ])
            .status()
            .is_ok_and(|s| s.success());
        if !has_cuda {
            assert_eq!(out.status.code(), Some(3));
            assert!(String::from_utf8_lossy(&out.stderr).contains("sees no CUDA GPU"));
        }
    }
}
