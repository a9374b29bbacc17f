//! Report files the commands write when asked (`--json`, `--plot`, `--sweep`,
//! the profiler's `--out`). A path is checked before the work starts, so a
//! long run never ends in a refusal, and kvtier replaces an existing file only
//! when it can tell the file is a report of the same kind (empty, JSON for a
//! JSON report, an SVG for a plot): a pool, a data file or anything else named
//! by mistake is refused, never truncated. A report is written whole to a
//! temporary file beside it and renamed over the path, so a full disk or a
//! kill leaves the old file or the new one, never half of one.

use kvtier::{Error, Result};
use std::io::{Read, Write};
use std::path::{Path, PathBuf};

/// What a report file holds, for recognising one that may be replaced.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ReportKind {
    Json,
    Svg,
}

impl ReportKind {
    fn what(self) -> &'static str {
        match self {
            ReportKind::Json => "a JSON report",
            ReportKind::Svg => "an SVG plot",
        }
    }

    /// Whether `head` (the whole file, at most `RECOGNISE_BYTES`) is one.
    fn recognises(self, text: &[u8]) -> bool {
        match self {
            ReportKind::Json => serde_json::from_slice::<serde_json::Value>(text).is_ok(),
            ReportKind::Svg => {
                let t = text.trim_ascii();
                (t.starts_with(b"<svg") || t.starts_with(b"<?xml")) && t.ends_with(b"</svg>")
            }
        }
    }
}

/// Reports kvtier writes are kilobytes to a few megabytes; a larger file is
/// not one of them (and is not read whole to find out).
const RECOGNISE_BYTES: u64 = 64 << 20;

/// Check that `path` (given as `flag`) may receive a report of `kind`: its
/// directory exists, and it is absent, empty, or already such a report.
pub fn check_report_path(flag: &str, path: &Path, kind: ReportKind) -> Result<()> {
    let shown = path.display();
    let meta = match std::fs::metadata(path) {
        Ok(m) => m,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            if std::fs::symlink_metadata(path).is_ok() {
                return Err(Error::invalid(format!(
                    "{flag} {shown} is a symbolic link to nothing; remove it or name another file"
                )));
            }
            let dir = parent_dir(path);
            return match std::fs::metadata(&dir) {
                Ok(m) if m.is_dir() => Ok(()),
                Ok(_) => Err(Error::invalid(format!(
                    "{flag} {shown}: {} is not a directory; name a file in a directory",
                    dir.display()
                ))),
                Err(e) => Err(Error::io(
                    format!(
                        "{flag} {shown}: its directory {} (create it first, or name a file in an existing directory)",
                        dir.display()
                    ),
                    e,
                )),
            };
        }
        Err(e) => return Err(Error::io(format!("{flag} {shown}"), e)),
    };
    if !meta.is_file() {
        return Err(Error::invalid(format!(
            "{flag} {shown} is not a regular file ({}); name a file for {}",
            kvtier::host::file_kind(&meta.file_type()),
            kind.what()
        )));
    }
    if meta.len() == 0 {
        return Ok(());
    }
    let refuse = |why: &str| {
        Error::invalid(format!(
            "{flag} {shown} exists and {why} ({} bytes); kvtier replaces a file only when it is {} already: remove it or name another file",
            meta.len(),
            kind.what()
        ))
    };
    if meta.len() > RECOGNISE_BYTES {
        return Err(refuse(&format!("is larger than any {}", kind.what())));
    }
    let mut text = Vec::with_capacity(meta.len() as usize);
    std::fs::File::open(path)
        .and_then(|f| f.take(RECOGNISE_BYTES + 1).read_to_end(&mut text))
        .map_err(|e| Error::io(format!("{flag} {shown}: reading what it holds"), e))?;
    if kind.recognises(&text) {
        Ok(())
    } else {
        Err(refuse(&format!("is not {}", kind.what())))
    }
}

/// Write `bytes` as the report at `path` (given as `flag`): checked again
/// (something may have appeared there during the run), written to a
/// temporary file in the same directory, synced, and renamed over `path`.
/// A symbolic link to a report is followed: its target is replaced.
pub fn write_report(flag: &str, path: &Path, kind: ReportKind, bytes: &[u8]) -> Result<()> {
    check_report_path(flag, path, kind)?;
    let target = std::fs::canonicalize(path).unwrap_or_else(|_| path.to_path_buf());
    let name = target
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_else(|| "report".into());
    let tmp = parent_dir(&target).join(format!(".{name}.kvtier-{}.tmp", std::process::id()));
    let written = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .open(&tmp)
        .and_then(|mut f| {
            f.write_all(bytes)?;
            f.sync_all()
        })
        .and_then(|()| std::fs::rename(&tmp, &target));
    if let Err(e) = written {
        let _ = std::fs::remove_file(&tmp);
        return Err(Error::io(format!("{flag}: writing {}", path.display()), e));
    }
    Ok(())
}

fn parent_dir(path: &Path) -> PathBuf {
    match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d.to_path_buf(),
        _ => PathBuf::from("."),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_report_may_replace_a_report_and_nothing_else() {
        let dir = kvtier::scratch::TestDir::new("output");
        let json = dir.path().join("r.json");
        // Absent, then empty: fine.
        check_report_path("--json", &json, ReportKind::Json).unwrap();
        std::fs::write(&json, "").unwrap();
        check_report_path("--json", &json, ReportKind::Json).unwrap();
        write_report("--json", &json, ReportKind::Json, b"{\"a\": 1}").unwrap();
        write_report("--json", &json, ReportKind::Json, b"{\"a\": 2}").unwrap();
        assert_eq!(std::fs::read(&json).unwrap(), b"{\"a\": 2}");

        // A pool-like file is refused and left as it was.
        let pool = dir.path().join("p.pool");
        std::fs::write(&pool, b"KVTIERSB\0\0\0binary").unwrap();
        for kind in [ReportKind::Json, ReportKind::Svg] {
            let e = write_report("--plot", &pool, kind, b"<svg></svg>").unwrap_err();
            let m = e.to_string();
            assert!(
                m.contains("--plot") && m.contains("p.pool") && m.contains("remove it"),
                "{m}"
            );
        }
        assert_eq!(std::fs::read(&pool).unwrap(), b"KVTIERSB\0\0\0binary");

        // An SVG is not a JSON report, and JSON is not a plot.
        let svg = dir.path().join("p.svg");
        write_report(
            "--plot",
            &svg,
            ReportKind::Svg,
            b"<svg width=\"1\">\n</svg>\n",
        )
        .unwrap();
        assert!(check_report_path("--json", &svg, ReportKind::Json).is_err());
        assert!(check_report_path("--plot", &json, ReportKind::Svg).is_err());

        // Not a regular file; a directory that is not there.
        let e = check_report_path("--json", dir.path(), ReportKind::Json).unwrap_err();
        assert!(e.to_string().contains("not a regular file"), "{e}");
        let e = check_report_path("--json", Path::new("/dev/full"), ReportKind::Json).unwrap_err();
        assert!(e.to_string().contains("not a regular file"), "{e}");
        let e = check_report_path("--json", &dir.path().join("no/r.json"), ReportKind::Json)
            .unwrap_err();
        assert!(e.to_string().contains("create it first"), "{e}");

        // A link to a report writes through to it; no temporary file is left.
        let link = dir.path().join("link.json");
        std::os::unix::fs::symlink(&json, &link).unwrap();
        write_report("--json", &link, ReportKind::Json, b"[3]").unwrap();
        assert_eq!(std::fs::read(&json).unwrap(), b"[3]");
        assert!(std::fs::symlink_metadata(&link)
            .unwrap()
            .file_type()
            .is_symlink());
        let left: Vec<_> = std::fs::read_dir(dir.path())
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .filter(|n| n.contains("kvtier-"))
            .collect();
        assert!(left.is_empty(), "{left:?}");
    }
}
