//! This process's memory mappings (`/proc/self/maps`): whether a range an
//! engine hands us is memory we may write. Loads write KV memory by DMA and
//! CPU copies; a read-only mapping (a tensor over a read-only buffer or
//! file) would fault in a copy or fail a DMA with EFAULT far from its cause.

/// The first of `regions` (address, length) that is not all mapped
/// readable and writable in this process, with why; `Ok` when all are (or
/// when `/proc/self/maps` cannot be read, where nothing can be told). The
/// maps are read once for all regions.
pub fn check_read_write(regions: &[(u64, u64)]) -> Result<(), (u64, u64, String)> {
    let Ok(maps) = std::fs::read_to_string("/proc/self/maps") else {
        return Ok(());
    };
    for &(addr, len) in regions {
        check_in(&maps, addr, len).map_err(|why| (addr, len, why))?;
    }
    Ok(())
}

fn check_in(maps: &str, addr: u64, len: u64) -> Result<(), String> {
    let Some(end) = addr.checked_add(len) else {
        return Err("it ends past the address space".into());
    };
    let mut at = addr;
    for line in maps.lines() {
        let mut f = line.split_ascii_whitespace();
        let (Some(range), Some(perms)) = (f.next(), f.next()) else {
            continue;
        };
        let Some((lo, hi)) = range.split_once('-') else {
            continue;
        };
        let (Ok(lo), Ok(hi)) = (u64::from_str_radix(lo, 16), u64::from_str_radix(hi, 16)) else {
            continue;
        };
        if hi <= at {
            continue;
        }
        if lo > at {
            return Err(format!("{at:#x} is not mapped"));
        }
        if !(perms.starts_with("rw")) {
            return Err(format!(
                "{lo:#x}-{hi:#x} is mapped {perms} (not readable and writable)"
            ));
        }
        at = hi;
        if at >= end {
            return Ok(());
        }
    }
    Err(format!("{at:#x} is not mapped"))
}

#[cfg(test)]
mod tests {
    use super::*;

    const MAPS: &str = "\
1000-3000 rw-p 00000000 00:00 0
3000-4000 r--p 00000000 00:00 0 /lib/x.so
5000-7000 rw-s 00000000 00:00 0 /dev/shm/y
7000-8000 rwxp 00000000 00:00 0
";

    #[test]
    fn ranges_must_be_mapped_read_write_throughout() {
        assert_eq!(check_in(MAPS, 0x1000, 0x2000), Ok(()));
        assert_eq!(
            check_in(MAPS, 0x5800, 0x2800),
            Ok(()),
            "adjacent mappings join"
        );
        let e = check_in(MAPS, 0x2000, 0x1800).unwrap_err();
        assert!(e.contains("0x3000-0x4000 is mapped r--p"), "{e}");
        let e = check_in(MAPS, 0x4000, 0x10).unwrap_err();
        assert!(e.contains("0x4000 is not mapped"), "{e}");
        let e = check_in(MAPS, 0x7800, 0x1000).unwrap_err();
        assert!(e.contains("0x8000 is not mapped"), "{e}");
        assert!(check_in(MAPS, u64::MAX, 2).is_err());
    }

    #[test]
    fn this_process_sees_its_own_memory() {
        let v = vec![0u8; 1 << 20];
        let w = vec![0u8; 4096];
        let live = [
            (v.as_ptr() as u64, v.len() as u64),
            (w.as_ptr() as u64, 4096),
        ];
        assert_eq!(check_read_write(&live), Ok(()));
        let ro: &'static [u8] = b"a string constant in a read-only section";
        let bad = (ro.as_ptr() as u64, ro.len() as u64);
        let e = check_read_write(&[live[0], bad, live[1]]).unwrap_err();
        assert_eq!((e.0, e.1), bad, "{}", e.2);
        assert!(
            check_read_write(&[(8, 8)]).is_err(),
            "page 0 is never mapped"
        );
    }
}
