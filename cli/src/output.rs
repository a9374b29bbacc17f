//! Report files the commands write when asked (`--json`, `--plot`, `--sweep`,
//! the profiler's `--out`). A path is checked before the work starts, so a
//! long run never ends in a refusal, and kvtier replaces an existing file only
//! when it can tell the file is one of its reports of the same kind (empty,
//! JSON whose top level carries kvtier's report marker or a slack table's
//! schema, an SVG for a plot) and it is not an input of the same run (a
//! replay's `--table`): a pool, a model's config.json, a user's JSON that
//! happens to have a field named like one of ours, or anything else named by
//! mistake is refused, never truncated.
//! A report is written whole to a temporary file beside it and renamed over
//! the path, so a full disk or a kill leaves the old file or the new one,
//! never half of one; a pipe or character device is written as a stream, and a
//! FIFO nobody reads is refused rather than waited on.

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

    /// Whether `text` (the whole file, at most `RECOGNISE_BYTES`) is one of
    /// kvtier's: a JSON object whose top level carries the marker kvtier
    /// writes into its reports (a string naming kvtier), or a slack table's
    /// schema (`kvtier-slack/N`), not any JSON (a model's config.json, or a
    /// user's file with a field that happens to be called "machine"); an SVG
    /// document for a plot.
    fn recognises(self, text: &[u8]) -> bool {
        match self {
            ReportKind::Json => {
                let Ok(serde_json::Value::Object(top)) =
                    serde_json::from_slice::<serde_json::Value>(text)
                else {
                    return false;
                };
                let starts = |key: &str, prefix: &str| {
                    top.get(key)
                        .and_then(|v| v.as_str())
                        .is_some_and(|s| s.starts_with(prefix))
                };
                starts(REPORT_MARKER_KEY, "kvtier") || starts("schema", "kvtier-slack/")
            }
            ReportKind::Svg => {
                let t = text.trim_ascii();
                (t.starts_with(b"<svg") || t.starts_with(b"<?xml")) && t.ends_with(b"</svg>")
            }
        }
    }
}

/// The field kvtier puts first in every JSON report object it writes (its
/// value names kvtier and its version), so that a later run knows the file
/// for one of its own.
pub const REPORT_MARKER: &str = "\"kvtier_report\"";
const REPORT_MARKER_KEY: &str = "kvtier_report";

/// `json` (an object or array as serde_json writes it) as a marked report:
/// the marker first in a top-level object; anything else (replay's list of
/// results) becomes `{"kvtier_report": ..., "results": JSON}`.
pub fn mark_json_report(json: &str, what: &str) -> String {
    let what = serde_json::Value::from(what);
    match json.strip_prefix('{') {
        Some(rest) if !rest.trim_start().starts_with('}') => {
            format!("{{\n  {REPORT_MARKER}: {what},{rest}")
        }
        Some(_) => format!("{{\n  {REPORT_MARKER}: {what}\n}}"),
        None => {
            let body = json.replace('\n', "\n  ");
            format!("{{\n  {REPORT_MARKER}: {what},\n  \"results\": {body}\n}}")
        }
    }
}

/// Refuse a report path that names one of the run's inputs (`(flag, path)`,
/// e.g. replay's `--table`): a slack table is a kvtier report too, and
/// replacing it with the run's results would destroy what the run read.
pub fn check_not_an_input(flag: &str, path: &Path, inputs: &[(&str, &Path)]) -> Result<()> {
    use std::os::unix::fs::MetadataExt;
    let Ok(out) = std::fs::metadata(path) else {
        return Ok(());
    };
    for (input_flag, input) in inputs {
        if std::fs::metadata(input).is_ok_and(|m| m.dev() == out.dev() && m.ino() == out.ino()) {
            return Err(Error::invalid(format!(
                "{flag} {} is the same file as {input_flag} {}, an input of this run; \
                 name another file for the report",
                path.display(),
                input.display()
            )));
        }
    }
    Ok(())
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
    let ft = meta.file_type();
    if is_stream(&ft) {
        // A terminal, /dev/stdout, /dev/null, a pipe: written as a stream.
        return Ok(());
    }
    if !meta.is_file() {
        return Err(Error::invalid(format!(
            "{flag} {shown} is not a regular file ({}); name a file for {}",
            kvtier::host::file_kind(&ft),
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

/// Character devices, FIFOs and sockets take a report as a stream.
fn is_stream(ft: &std::fs::FileType) -> bool {
    use std::os::unix::fs::FileTypeExt;
    ft.is_char_device() || ft.is_fifo() || ft.is_socket()
}

/// Write `bytes` as the report at `path` (given as `flag`): checked again
/// (something may have appeared there during the run), written to a
/// temporary file in the same directory with the old file's permissions,
/// synced, and renamed over `path`. A symbolic link to a report is
/// followed (its target is replaced); a file that cannot be replaced by a
/// rename (a bind-mounted file) is rewritten in place; a character device
/// or a pipe is written to.
pub fn write_report(flag: &str, path: &Path, kind: ReportKind, bytes: &[u8]) -> Result<()> {
    use std::os::unix::fs::OpenOptionsExt;
    check_report_path(flag, path, kind)?;
    let failed = |e| Error::io(format!("{flag}: writing {}", path.display()), e);
    let old = std::fs::metadata(path).ok();
    if old.as_ref().is_some_and(|m| is_stream(&m.file_type())) {
        // Opened without waiting: a FIFO nobody reads would block the open
        // for ever (ENXIO instead); then written blocking, as a stream.
        let mut f = match std::fs::OpenOptions::new()
            .write(true)
            .custom_flags(libc::O_NONBLOCK)
            .open(path)
        {
            Ok(f) => f,
            Err(e) if e.raw_os_error() == Some(libc::ENXIO) => {
                return Err(Error::invalid(format!(
                    "{flag} {} is a FIFO that nothing reads; start its reader first, or \
                     name a file",
                    path.display()
                )))
            }
            Err(e) => return Err(failed(e)),
        };
        set_blocking(&f).map_err(failed)?;
        return f.write_all(bytes).map_err(failed);
    }
    let target = std::fs::canonicalize(path).unwrap_or_else(|_| path.to_path_buf());
    let name = target
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_else(|| "report".into());
    let nonce = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.subsec_nanos());
    let tmp = parent_dir(&target).join(format!(
        ".{name}.kvtier-{}-{nonce:08x}.tmp",
        std::process::id()
    ));
    let mode = old.as_ref().map_or(0o644, |m| {
        use std::os::unix::fs::PermissionsExt;
        m.permissions().mode() & 0o7777
    });
    let mut file = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(mode)
        .open(&tmp)
        .map_err(failed)?;
    // From here the temporary file is ours to remove.
    let written = file
        .write_all(bytes)
        .and_then(|()| file.sync_all())
        .and_then(|()| {
            std::fs::set_permissions(&tmp, std::os::unix::fs::PermissionsExt::from_mode(mode))
        })
        .and_then(|()| match std::fs::rename(&tmp, &target) {
            // A bind-mounted file (a container's volume) cannot be replaced:
            // rewrite it in place, as it was checked to be a report.
            Err(e) if matches!(e.raw_os_error(), Some(libc::EXDEV) | Some(libc::EBUSY)) => {
                std::fs::write(&target, bytes)?;
                std::fs::remove_file(&tmp)
            }
            other => other,
        });
    if let Err(e) = written {
        let _ = std::fs::remove_file(&tmp);
        return Err(failed(e));
    }
    Ok(())
}

/// Clear O_NONBLOCK on `f`.
fn set_blocking(f: &std::fs::File) -> std::io::Result<()> {
    use std::os::fd::AsRawFd;
    // SAFETY: fcntl on a descriptor `f` keeps open for the call.
    let flags = unsafe { libc::fcntl(f.as_raw_fd(), libc::F_GETFL) };
    if flags < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: as above, with the flags just read less O_NONBLOCK.
    if unsafe { libc::fcntl(f.as_raw_fd(), libc::F_SETFL, flags & !libc::O_NONBLOCK) } < 0 {
        return Err(std::io::Error::last_os_error());
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
        let report = |n: u32| mark_json_report(&format!("{{\n  \"a\": {n}\n}}"), "kvtier test");
        write_report("--json", &json, ReportKind::Json, report(1).as_bytes()).unwrap();
        write_report("--json", &json, ReportKind::Json, report(2).as_bytes()).unwrap();
        assert_eq!(std::fs::read_to_string(&json).unwrap(), report(2));
        assert!(report(2).starts_with("{\n  \"kvtier_report\": \"kvtier test\",\n  \"a\": 2"));
        // Any other JSON (a model's config.json named by mistake) is kept.
        let config = dir.path().join("config.json");
        std::fs::write(&config, b"{\"num_hidden_layers\": 32}").unwrap();
        assert!(write_report("--json", &config, ReportKind::Json, b"{}").is_err());
        assert_eq!(
            std::fs::read(&config).unwrap(),
            b"{\"num_hidden_layers\": 32}"
        );
        // A user's JSON with a field named like one of ours, or the marker
        // somewhere but the top level, is not a report.
        for other in [
            "{\"machine\": {}}",
            "[[\"slack\", {\"bubble_us\": 1.0}]]",
            "{\"a\": {\"kvtier_report\": \"kvtier 0.1\"}}",
            "{\"kvtier_report\": 1}",
        ] {
            std::fs::write(&config, other).unwrap();
            assert!(
                check_report_path("--json", &config, ReportKind::Json).is_err(),
                "{other}"
            );
        }
        // A slack table (the profiler's --out) and replay's marked list are.
        for ours in [
            "{\"schema\": \"kvtier-slack/1\", \"provenance\": {\"machine\": \"x\"}}".to_string(),
            mark_json_report("[\n  1,\n  2\n]", "kvtier 0.1"),
        ] {
            std::fs::write(&config, &ours).unwrap();
            check_report_path("--json", &config, ReportKind::Json).unwrap();
        }
        let list: serde_json::Value =
            serde_json::from_str(&mark_json_report("[\n  1\n]", "kvtier 0.1")).unwrap();
        assert_eq!(list["results"][0], 1);
        // An input of the same run is refused, even when it is a report.
        assert!(check_not_an_input("--json", &config, &[("--table", &config)]).is_err());
        check_not_an_input("--json", &json, &[("--table", &config)]).unwrap();
        // The old file's permissions carry over.
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&json, std::fs::Permissions::from_mode(0o600)).unwrap();
        write_report("--json", &json, ReportKind::Json, report(3).as_bytes()).unwrap();
        assert_eq!(
            std::fs::metadata(&json).unwrap().permissions().mode() & 0o777,
            0o600
        );

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
        // A character device is written as a stream; a full one says so.
        check_report_path("--json", Path::new("/dev/null"), ReportKind::Json).unwrap();
        write_report("--json", Path::new("/dev/null"), ReportKind::Json, b"{}").unwrap();
        let e =
            write_report("--json", Path::new("/dev/full"), ReportKind::Json, b"{}").unwrap_err();
        assert!(e.to_string().contains("No space left"), "{e}");
        let e = check_report_path("--json", &dir.path().join("no/r.json"), ReportKind::Json)
            .unwrap_err();
        assert!(e.to_string().contains("create it first"), "{e}");

        // A FIFO nobody reads is refused at once, not waited on.
        let fifo = dir.path().join("fifo");
        let c = std::ffi::CString::new(fifo.as_os_str().as_encoded_bytes()).unwrap();
        // SAFETY: mkfifo with a NUL-terminated path.
        assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
        check_report_path("--json", &fifo, ReportKind::Json).unwrap();
        let e = write_report("--json", &fifo, ReportKind::Json, b"{}").unwrap_err();
        assert!(e.to_string().contains("nothing reads"), "{e}");
        // With a reader it is written as a stream.
        let reader = {
            let fifo = fifo.clone();
            std::thread::spawn(move || std::fs::read(&fifo).unwrap())
        };
        let mut wrote = Err(Error::invalid("never tried"));
        for _ in 0..2000 {
            wrote = write_report("--json", &fifo, ReportKind::Json, b"{\"x\": 1}");
            if wrote.is_ok() {
                break;
            }
            std::thread::sleep(std::time::Duration::from_millis(5));
        }
        wrote.unwrap();
        assert_eq!(reader.join().unwrap(), b"{\"x\": 1}");
        std::fs::remove_file(&fifo).unwrap();

        // A link to a report writes through to it; no temporary file is left.
        let link = dir.path().join("link.json");
        std::os::unix::fs::symlink(&json, &link).unwrap();
        write_report("--json", &link, ReportKind::Json, report(4).as_bytes()).unwrap();
        assert_eq!(std::fs::read_to_string(&json).unwrap(), report(4));
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
