//! `--compute torch`: run `profiler/torch_harness.py` on this machine's GPU
//! and read the trace it writes (see `trace.rs` for the format).
//!
//! The harness builds the model's decoder layers from its Hugging Face config
//! (the model's config.json, or one written from the preset) with random bf16
//! weights, and times every layer of every grid point with CUDA events; it
//! exits with status 3 and says why when torch, transformers or CUDA is missing.

use crate::shape::Shape;
use crate::trace::Trace;
use kvtier::{Error, Result};
use std::path::{Path, PathBuf};
use std::process::Command;

/// The harness shipped next to the profiler's sources.
pub fn default_harness() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("torch_harness.py")
}

/// What to run and on which grid.
pub struct TorchRun<'a> {
    pub python: &'a str,
    pub harness: &'a Path,
    pub shape: &'a Shape,
    pub inputs: &'a [u64],
    pub prefixes: &'a [u64],
    pub contexts: &'a [u64],
    /// Scratch directory for the config and the trace.
    pub work_dir: &'a Path,
    /// Extra arguments passed to the harness as they are.
    pub extra_args: &'a [String],
}

fn list(v: &[u64]) -> String {
    v.iter().map(u64::to_string).collect::<Vec<_>>().join(",")
}

/// Runs the harness; its progress goes to this process's stderr.
pub fn run(r: &TorchRun) -> Result<Trace> {
    if !r.harness.is_file() {
        return Err(Error::invalid(format!(
            "--compute torch: the harness {} is missing; pass --harness PATH to profiler/torch_harness.py",
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
        .arg("--out")
        .arg(&trace)
        .args(r.extra_args);
    let out = cmd.output().map_err(|e| {
        Error::invalid(format!(
            "--compute torch needs {} (with torch, transformers and a CUDA GPU) but it cannot be run: {e}; install Python 3 or pass --python PATH",
            r.python
        ))
    })?;
    // The harness's progress lines, for the user.
    eprint!("{}", String::from_utf8_lossy(&out.stderr));
    if !out.status.success() {
        let stderr = String::from_utf8_lossy(&out.stderr);
        let last = stderr
            .lines()
            .rev()
            .find(|l| !l.trim().is_empty())
            .unwrap_or("(no message)");
        let why = if out.status.code() == Some(3) {
            "--compute torch needs torch, transformers and a CUDA GPU on this machine; use --compute analytic here, or run it where a GPU is"
        } else {
            "the torch harness failed"
        };
        return Err(Error::invalid(format!(
            "{why}: {} exited with {}: {last}",
            r.harness.display(),
            out.status
        )));
    }
    Trace::load(&trace, r.shape.geometry.layers)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::shape::ShapeOverrides;

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
            eprintln!("python3 absent: syntax check skipped");
            return;
        };
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
    }

    #[test]
    fn missing_python_is_explained() {
        let shape =
            Shape::resolve("llama3-8b", 16, None, None, &ShapeOverrides::default()).unwrap();
        let dir =
            std::env::temp_dir().join(format!("kvtier-profiler-torch-{}", std::process::id()));
        let h = default_harness();
        let r = TorchRun {
            python: "/nonexistent/python3",
            harness: &h,
            shape: &shape,
            inputs: &[16],
            prefixes: &[0],
            contexts: &[16],
            work_dir: &dir,
            extra_args: &[],
        };
        let msg = run(&r).expect_err("no such python").to_string();
        assert!(msg.contains("needs /nonexistent/python3"), "{msg}");
        let _ = std::fs::remove_dir_all(&dir);
    }
}
