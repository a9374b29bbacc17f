//! Byte sizes for people: the one formatter every message, report and table uses,
//! and the one parser of sizes people write ("4g", "512MiB", "1.5t").

const UNITS: [&str; 7] = ["B", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB"];

/// Human bytes: "512 B", "32 KiB", "1.50 GiB" (binary units, two decimals when the size
/// is not a whole number of the unit).
pub fn human_bytes(b: u64) -> String {
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

/// Exact human bytes: the largest binary unit that divides `b` ("2 MiB", "640 KiB",
/// "1000 B"). For sizes checked against alignments, where a rounded figure would hide
/// the remainder that makes them wrong.
pub(crate) fn exact_bytes(b: u64) -> String {
    (1..UNITS.len())
        .rev()
        .map(|u| (u, 1u64 << (10 * u)))
        .find(|&(_, unit)| b >= unit && b % unit == 0)
        .map(|(u, unit)| format!("{} {}", b / unit, UNITS[u]))
        .unwrap_or_else(|| format!("{b} B"))
}

/// Why a written size is not one.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SizeError {
    /// Not a number with an optional unit.
    NotASize,
    /// 16 EiB or more: past what a u64 counts.
    TooLarge,
}

impl std::fmt::Display for SizeError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            SizeError::NotASize => {
                "is not a number with an optional k/m/g/t/p suffix (e.g. 80k, 4g)"
            }
            SizeError::TooLarge => "is larger than 16 EiB",
        })
    }
}

/// Parse a size like `4096`, `80k`, `512m`, `4g`, `1t`, `1.5g`, `2GiB` (binary
/// units, case-insensitive, an optional `b`/`ib`). A size of 2^64 bytes or more
/// is an error, never saturated; a fraction of a byte is dropped.
pub fn parse_size(s: &str) -> Result<u64, SizeError> {
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
        // The ranges sizes are checked against reach 1 PiB: it must be writable too.
        Some('p') => (&t[..t.len() - 1], 1 << 50),
        _ => (t, 1),
    };
    let num = num.trim();
    if let Ok(n) = num.parse::<u64>() {
        return n.checked_mul(mult).ok_or(SizeError::TooLarge);
    }
    if num.bytes().all(|b| b.is_ascii_digit()) && !num.is_empty() {
        return Err(SizeError::TooLarge);
    }
    let f: f64 = num.parse().map_err(|_| SizeError::NotASize)?;
    if !f.is_finite() || f < 0.0 {
        return Err(SizeError::NotASize);
    }
    let bytes = f * mult as f64;
    // 2^64 itself rounds to u64::MAX in a cast: refuse it and anything above.
    if bytes >= 18_446_744_073_709_551_616.0 {
        return Err(SizeError::TooLarge);
    }
    Ok(bytes as u64)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parse() {
        assert_eq!(parse_size("4096"), Ok(4096));
        assert_eq!(parse_size("80k"), Ok(80 << 10));
        assert_eq!(parse_size(" 4G "), Ok(4 << 30));
        assert_eq!(parse_size("512MiB"), Ok(512 << 20));
        assert_eq!(parse_size("1.5g"), Ok(3 << 29));
        assert_eq!(parse_size("1e3"), Ok(1000));
        assert_eq!(parse_size("1p"), Ok(1 << 50));
        assert_eq!(parse_size("16777215t"), Ok(16777215 << 40));
        for bad in ["lots", "", "g", "-1", "inf", "NaN", "-inf"] {
            assert_eq!(parse_size(bad), Err(SizeError::NotASize), "{bad:?}");
        }
        for huge in ["1e30", "16777216t", "99999999999999999999", "16384p"] {
            assert_eq!(parse_size(huge), Err(SizeError::TooLarge), "{huge}");
        }
    }

    #[test]
    fn human() {
        assert_eq!(human_bytes(0), "0 B");
        assert_eq!(human_bytes(512), "512 B");
        assert_eq!(human_bytes(32768), "32 KiB");
        assert_eq!(human_bytes(1024 * 1024), "1 MiB");
        assert_eq!(human_bytes(3 * 1024 * 1024 / 2), "1.50 MiB");
        assert_eq!(human_bytes(3 << 29), "1.50 GiB");
        assert_eq!(human_bytes(8 << 30), "8 GiB");
        assert_eq!(human_bytes(u64::MAX), "16 EiB");
    }

    #[test]
    fn exact() {
        assert_eq!(exact_bytes(2 << 20), "2 MiB");
        assert_eq!(exact_bytes(640 << 10), "640 KiB");
        assert_eq!(exact_bytes(1536), "1536 B");
        assert_eq!(exact_bytes(1000), "1000 B");
        assert_eq!(exact_bytes(0), "0 B");
        assert_eq!(exact_bytes(3 << 40), "3 TiB");
        assert_eq!(exact_bytes(1 << 60), "1 EiB");
    }
}
