//! Small parsing helpers shared by the CLI and the benchmarks.

use crate::error::{Error, Result};

/// Parse a size like `4096`, `80k`, `512m`, `4g`, `1t`, `1.5g` (binary units).
pub fn parse_size(s: &str) -> Result<u64> {
    let t = s.trim().to_ascii_lowercase();
    let t = t
        .strip_suffix("ib")
        .or_else(|| t.strip_suffix('b'))
        .unwrap_or(&t);
    let (num, mult) = match t.chars().last() {
        Some('k') => (&t[..t.len() - 1], 1u64 << 10),
        Some('m') => (&t[..t.len() - 1], 1 << 20),
        Some('g') => (&t[..t.len() - 1], 1 << 30),
        Some('t') => (&t[..t.len() - 1], 1 << 40),
        _ => (t, 1),
    };
    let bad = || {
        Error::invalid(format!(
            "size {s:?} is not a number with an optional k/m/g/t suffix (e.g. 80k, 4g)"
        ))
    };
    if let Ok(n) = num.parse::<u64>() {
        return n.checked_mul(mult).ok_or_else(bad);
    }
    let f: f64 = num.parse().map_err(|_| bad())?;
    if !f.is_finite() || f < 0.0 {
        return Err(bad());
    }
    Ok((f * mult as f64) as u64)
}

/// Human bytes: 1.5 GiB, 32 KiB, 512 B.
pub fn human_bytes(b: u64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut v = b as f64;
    let mut u = 0;
    while v >= 1024.0 && u < UNITS.len() - 1 {
        v /= 1024.0;
        u += 1;
    }
    if u == 0 {
        format!("{b} B")
    } else if v.fract() == 0.0 {
        format!("{v:.0} {}", UNITS[u])
    } else {
        format!("{v:.2} {}", UNITS[u])
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes() {
        assert_eq!(parse_size("4096").unwrap(), 4096);
        assert_eq!(parse_size("80k").unwrap(), 80 << 10);
        assert_eq!(parse_size("4G").unwrap(), 4 << 30);
        assert_eq!(parse_size("512MiB").unwrap(), 512 << 20);
        assert_eq!(parse_size("1.5g").unwrap(), 3 << 29);
        let e = parse_size("lots").unwrap_err().to_string();
        assert!(e.contains("\"lots\"") && e.contains("suffix"), "{e}");
        assert_eq!(human_bytes(32768), "32 KiB");
        assert_eq!(human_bytes(3 << 29), "1.50 GiB");
    }
}
