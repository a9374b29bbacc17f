//! Small parsing helpers shared by the CLI and the benchmarks.

use kvtier::error::{Error, Fix, Result};
use kvtier::host::size::human_bytes;

/// `eprintln!` that never panics: a closed stderr (`kvtier ... 2>&1 | head`)
/// is no reason to stop, least of all half way through giving a device back.
macro_rules! note {
    ($($arg:tt)*) => {{
        use std::io::Write as _;
        let _ = writeln!(
            std::io::stderr(),
            "{}",
            kvtier::host::printable(&format!($($arg)*))
        );
    }};
}
pub(crate) use note;

/// Make `dir` (and its parents) for scratch pool files, or say clearly why
/// not: a path that exists but is no directory (a block device, a file) is
/// named as such, not reported as "File exists".
pub fn make_dir(dir: &std::path::Path) -> Result<()> {
    match std::fs::metadata(dir) {
        Ok(m) if m.is_dir() => Ok(()),
        Ok(m) => {
            let what = kvtier::host::file_kind(&m.file_type());
            Err(Error::invalid(format!(
                "--dir {}: it is {what}; name a directory to hold the pool files \
                 (a pool on a block device is made with `kvtier pool create --dev DEVICE`)",
                dir.display()
            )))
        }
        Err(_) => std::fs::create_dir_all(dir)
            .map_err(|e| Error::io(format!("creating directory {}", dir.display()), e)),
    }
}

/// Parse a size ([`kvtier::host::size::parse_size`]), the error naming it.
pub fn parse_size(s: &str) -> Result<u64> {
    parse_size_str(s).map_err(|why| Error::invalid(format!("size {:?}: {why}", excerpt(s, 40))))
}

/// [`parse_size`] with the reason alone (clap prefixes the value and flag).
fn parse_size_str(s: &str) -> std::result::Result<u64, String> {
    kvtier::host::size::parse_size(s).map_err(|e| e.to_string())
}

/// A clap value parser: a size within `[min, max]` bytes.
pub fn size_in(s: &str, min: u64, max: u64) -> std::result::Result<u64, String> {
    let range = || {
        format!(
            "give a size from {} to {} with a unit (k, m, g, t: e.g. {})",
            human_bytes(min),
            human_bytes(max),
            size_example(min, max)
        )
    };
    if s.trim_start().starts_with('-') {
        return Err(format!("is negative, out of range; {}", range()));
    }
    let v = parse_size_str(s).map_err(|why| format!("{why}; {}", range()))?;
    if v < min || v > max {
        return Err(format!("out of range; {}", range()));
    }
    Ok(v)
}

/// A round size within `[min, max]` for an error's example: 64g, or the
/// largest power-of-two unit size that fits.
fn size_example(min: u64, max: u64) -> String {
    let want = (64u64 << 30).clamp(min, max);
    for (unit, shift) in [("t", 40), ("g", 30), ("m", 20), ("k", 10)] {
        if want >= 1 << shift {
            let n = want >> shift;
            if n << shift >= min {
                return format!("{n}{unit}");
            }
        }
    }
    want.to_string()
}

/// A clap value parser: a finite number within `[min, max]` (NaN, infinities
/// and anything out of range are refused: they would reach durations and
/// allocations).
pub fn f64_in(s: &str, min: f64, max: f64) -> std::result::Result<f64, String> {
    let range = || format!("give a number from {min} to {max}");
    let v: f64 = s
        .trim()
        .parse()
        .map_err(|_| format!("not a number; {}", range()))?;
    if !v.is_finite() || v < min || v > max {
        return Err(format!("out of range; {}", range()));
    }
    Ok(v)
}

/// At most `max` characters of user input for an error message, with the
/// length of what was cut: a message quoting a 20 KB value helps nobody.
pub fn excerpt(s: &str, max: usize) -> String {
    kvtier::json::excerpt(s, max)
}

/// Write `text` to stdout, flushed, its control characters (from
/// superblocks, configs, arguments) escaped ([`kvtier::host::printable`]). A
/// closed pipe (`kvtier ... | head -1`) is an error [`is_broken_pipe`]
/// recognises, so the command can stop quietly once its own cleanup has
/// run, instead of panicking in `println!`.
pub fn out(text: &str) -> Result<()> {
    use std::io::Write;
    let text = kvtier::host::printable(text);
    let mut o = std::io::stdout().lock();
    o.write_all(text.as_bytes())
        .and_then(|()| o.flush())
        .map_err(|e| Error::io(STDOUT, e))
}

const STDOUT: &str = "writing to stdout";

/// An error as the command line says it: the library names a fix by its
/// meaning ([`kvtier::error::Fix`]); here it is named by this program's flags
/// and commands.
pub fn error_text(e: &Error) -> String {
    match e.fix() {
        Some(fix) => format!("{}; {}", e.without_fix(), fix_text(fix)),
        None => e.to_string(),
    }
}

/// A fix in the command line's words.
pub fn fix_text(fix: &Fix) -> String {
    match fix {
        Fix::Overwrite => "pass --force to overwrite it (its contents will be lost)".into(),
        Fix::AllowSparse => "pass --force to create it sparse anyway".into(),
        Fix::Truncate { to, or_size } => {
            format!("pass --force to truncate it to {to} bytes, or give --size {or_size}")
        }
        Fix::GiveSize {
            multiple_of,
            at_least,
        } => format!("give --size (a multiple of {multiple_of} bytes, at least {at_least} bytes)"),
        Fix::AlignSize { example } => format!("give a --size that is, e.g. {example} bytes"),
        Fix::SmallerSize => "give a smaller --size (a pool directory: a smaller --capacity)".into(),
        Fix::LargerSize => "give a larger --size".into(),
        Fix::Recreate => "recreate the pool with `kvtier pool create --force` (every block \
                          stored in it is lost)"
            .into(),
        Fix::RerunCreate => "run that `kvtier pool create` again (it needs no --force)".into(),
        Fix::CreatePool => "create one with `kvtier pool create`".into(),
        Fix::NameDType => "pass --dtype".into(),
        Fix::UsePrp => "use --data-mode prp or auto".into(),
        Fix::BindController { addr } => format!(
            "hand it to a userspace driver for the run: kvtier nvme bind {addr} --driver \
             vfio-pci -- kvtier ..."
        ),
        Fix::ForceBind => "pass --force to bind it anyway".into(),
        Fix::ProfileSlackTable { block_size } => format!(
            "use the table made for this model, or make one with kvtier-profile --model ... \
             --block-size {block_size}"
        ),
        Fix::OtherDirectory => "pick another --dir".into(),
        Fix::RestoreOrRecreate => {
            "restore the missing or replaced file(s), or recreate the pool with \
                                   `kvtier pool create --force` (every block stored in it is lost)"
                .into()
        }
        Fix::GiveCapacity { at_least } => {
            format!("give a capacity of at least {}", human_bytes(*at_least))
        }
        other => other.to_string(),
    }
}

/// Whether `e` is stdout's reader having gone away.
pub fn is_broken_pipe(e: &Error) -> bool {
    matches!(e, Error::Io { context, source }
        if context == STDOUT && source.kind() == std::io::ErrorKind::BrokenPipe)
}

/// `--flag -1g` written as `--flag=-1g`, for each value that looks like a
/// negative number or size right after a long option; `None` if there is
/// none. Clap takes `-1g` for an option of its own and said only
/// "unexpected argument '-1' found", naming neither the flag nor what is
/// wrong; parsed again this way, the flag's own parser refuses the value
/// by name and range.
pub fn join_negative_values(args: &[std::ffi::OsString]) -> Option<Vec<std::ffi::OsString>> {
    let negative = |a: &std::ffi::OsString| {
        let b = a.as_encoded_bytes();
        b.len() >= 2 && b[0] == b'-' && (b[1].is_ascii_digit() || b[1] == b'.')
    };
    let flag = |a: &std::ffi::OsString| {
        let b = a.as_encoded_bytes();
        b.len() > 2 && b.starts_with(b"--") && !b.contains(&b'=')
    };
    let mut out = Vec::with_capacity(args.len());
    let mut joined = false;
    let mut i = 0;
    while i < args.len() {
        if i >= 1 && i + 1 < args.len() && flag(&args[i]) && negative(&args[i + 1]) {
            let mut f = args[i].clone();
            f.push("=");
            f.push(&args[i + 1]);
            out.push(f);
            joined = true;
            i += 2;
        } else {
            out.push(args[i].clone());
            i += 1;
        }
    }
    joined.then_some(out)
}

/// Refuse to allocate more host memory than the machine has available: the
/// KV caches are faulted in up front, so an impossible size would end in
/// the OOM killer rather than an error.
pub fn check_host_memory(bytes: u64, what: &str, fix: &str) -> Result<()> {
    let Some(avail) = kvtier::host::mem_available() else {
        return Ok(());
    };
    if bytes > avail {
        return Err(Error::invalid(format!(
            "{what} needs {} of host memory but {} is available; {fix}",
            human_bytes(bytes),
            human_bytes(avail)
        )));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn negative_values_are_joined_to_their_flag() {
        let os = |v: &[&str]| v.iter().map(std::ffi::OsString::from).collect::<Vec<_>>();
        assert_eq!(
            join_negative_values(&os(&["kvtier", "pool", "--capacity", "-1g", "--force"])),
            Some(os(&["kvtier", "pool", "--capacity=-1g", "--force"]))
        );
        assert_eq!(
            join_negative_values(&os(&["kvtier", "--files", "-.5"])),
            Some(os(&["kvtier", "--files=-.5"]))
        );
        for unchanged in [
            &["kvtier", "--capacity", "1g"][..],
            &["kvtier", "--capacity=-1g"],
            &["kvtier", "-h"],
            &["kvtier", "--dir", "-x"],
            &["kvtier", "--capacity"],
        ] {
            assert_eq!(join_negative_values(&os(unchanged)), None, "{unchanged:?}");
        }
    }

    #[test]
    fn sizes() {
        assert_eq!(parse_size("4096").unwrap(), 4096);
        assert_eq!(parse_size("80k").unwrap(), 80 << 10);
        assert_eq!(parse_size("4G").unwrap(), 4 << 30);
        assert_eq!(parse_size("512MiB").unwrap(), 512 << 20);
        assert_eq!(parse_size("1.5g").unwrap(), 3 << 29);
        let e = parse_size("lots").unwrap_err().to_string();
        assert!(e.contains("\"lots\"") && e.contains("suffix"), "{e}");
        for huge in ["1e30", "16777216t", "99999999999999999999", "17179869184g"] {
            let e = parse_size(huge).unwrap_err().to_string();
            assert!(e.contains("larger than 16 EiB"), "{huge}: {e}");
        }
        assert_eq!(parse_size("16777215t").unwrap(), 16777215 << 40);
        assert_eq!(parse_size("1p").unwrap(), 1 << 50);
        assert_eq!(parse_size("1PiB").unwrap(), 1 << 50);
        assert!(
            size_in("1p", 4096, 1 << 50).is_ok(),
            "the top of a named range"
        );
        assert!(parse_size("16384p")
            .unwrap_err()
            .to_string()
            .contains("16 EiB"));
        assert!(size_in("1e30", 4096, 1 << 50).is_err());
        assert!(size_in("2p", 4096, 1 << 50).is_err());
        assert_eq!(size_in("64g", 4096, 1 << 50).unwrap(), 64 << 30);
        // The example in the error is inside the range it states.
        for (min, max, example) in [
            (1, 1 << 30, "1g"),
            (4096, 1 << 50, "64g"),
            (1 << 20, 16 << 20, "16m"),
        ] {
            let e = size_in("0", min, max).unwrap_err();
            assert!(e.contains(&format!("e.g. {example})")), "{e}");
            assert_eq!(size_in(example, min, max).map(|_| ()), Ok(()), "{e}");
        }
        assert!(size_in("2048", 4096, 1 << 50)
            .unwrap_err()
            .contains("4 KiB to 1 PiB"));
        for bad in ["inf", "NaN", "-1", "1e300", "-inf"] {
            assert!(f64_in(bad, 0.0, 1e4).is_err(), "{bad}");
        }
        assert_eq!(f64_in("2.5", 0.0, 1e4).unwrap(), 2.5);
    }
}
