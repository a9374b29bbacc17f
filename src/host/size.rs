//! Byte sizes for people: the one formatter every message, report and table uses.

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

#[cfg(test)]
mod tests {
    use super::*;

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
