//! Storage numbers: measured with kvtier's own engine on a temporary file in
//! the pool directory (`--pool-dir`), or assumed (`--read-gbs/--write-gbs`,
//! else one PCIe Gen4 NVMe SSD).
//!
//! Measured: kvtier's io_uring engine through gio_uring IOCBs (the raw
//! benchmark of `kvtier bench --pattern`) on a file laid out in the directory:
//! 1 MiB sequential reads alone, then 1 MiB sequential writes alone, at queue
//! depth 16, 40% of `--storage-seconds` each; then the IOCB service time: the
//! mean submission-to-completion time of one object-sized random read at
//! queue depth 1, for the remaining 20%. The file is removed afterwards.

use kvtier::engine::uring::UringConfig;
use kvtier::slack::StorageInfo;
use kvtier::{Error, KvGeometry, Result};
use kvtier_cli::bench::fio::{prepare_file, IoResult, Pattern, Workload};
use kvtier_cli::bench::raw;
use std::path::Path;

/// The default assumption: one PCIe Gen4 x4 NVMe SSD's sequential bandwidth,
/// and a typical QD1 read latency of a few tens of KiB on such a drive.
pub const ASSUMED_READ_GBS: f64 = 7.0;
pub const ASSUMED_WRITE_GBS: f64 = 5.0;
pub const ASSUMED_IOCB_SERVICE_US: f64 = 80.0;

/// Bytes per I/O and queue depth of the bandwidth runs.
const BW_IO_BYTES: u64 = 1 << 20;
const BW_DEPTH: u32 = 16;

/// Assumed numbers; `None`s take the defaults above.
pub fn assumed(read_gbs: Option<f64>, write_gbs: Option<f64>, iocb_us: Option<f64>) -> StorageInfo {
    let (r, w, i) = (
        read_gbs.unwrap_or(ASSUMED_READ_GBS),
        write_gbs.unwrap_or(ASSUMED_WRITE_GBS),
        iocb_us.unwrap_or(ASSUMED_IOCB_SERVICE_US),
    );
    let default = read_gbs.is_none() && write_gbs.is_none() && iocb_us.is_none();
    StorageInfo {
        read_gbs: r,
        write_gbs: w,
        iocb_service_us: i,
        source: if default {
            format!("assumed: one PCIe Gen4 NVMe SSD, {r} GB/s read, {w} GB/s write, {i} us IOCB service")
        } else {
            format!("assumed: given on the command line, {r} GB/s read, {w} GB/s write, {i} us IOCB service")
        },
    }
}

/// Measures reads alone, writes alone and the IOCB service time on a file of
/// `size` bytes in `dir`, spending about `seconds` in all.
pub fn measure(
    dir: &Path,
    seconds: f64,
    size: u64,
    geometry: &KvGeometry,
    progress: &dyn Fn(&str),
) -> Result<StorageInfo> {
    if !(seconds > 0.0 && seconds.is_finite()) {
        return Err(Error::invalid(format!(
            "--storage-seconds {seconds} must be a positive number of seconds"
        )));
    }
    if size < BW_IO_BYTES * u64::from(BW_DEPTH) || size % BW_IO_BYTES != 0 {
        return Err(Error::invalid(format!(
            "--storage-size {size} must be a multiple of 1 MiB of at least {} MiB",
            BW_DEPTH
        )));
    }
    if !dir.is_dir() {
        return Err(Error::invalid(format!(
            "--pool-dir {}: not a directory; pass the directory the pool (or its SSD) is mounted on",
            dir.display()
        )));
    }
    let file = dir.join(format!(".kvtier-profile-{}.tmp", std::process::id()));
    // Created new and removed however the measurement ends; a file already
    // at that name (or a symlink planted there) is refused, not overwritten.
    let _scratch = kvtier::scratch::ScratchFile::create_new(&file, "kvtier-profile")?;
    progress(&format!(
        "laying out {} MiB in {}",
        size >> 20,
        dir.display()
    ));
    prepare_file(&file, size, false)?;
    let object = geometry.object_bytes();
    let run = |pattern: Pattern, bs: u64, iodepth: u32, secs: f64| -> Result<IoResult> {
        let w = Workload {
            pattern,
            bs,
            iodepth,
            size,
            offset: 0,
            replay: None,
            runtime_secs: secs,
            file: file.clone(),
            rwmix_read: 100,
            numjobs: 1,
            end_fsync: false,
        };
        Ok(raw::run(&w, 0, &UringConfig::default())?.0)
    };
    progress("reads alone");
    let read = run(Pattern::Read, BW_IO_BYTES, BW_DEPTH, seconds * 0.4)?;
    progress("writes alone");
    let write = run(Pattern::Write, BW_IO_BYTES, BW_DEPTH, seconds * 0.4)?;
    progress("IOCB service time");
    let lat = run(Pattern::RandRead, object, 1, seconds * 0.2)?;
    if read.read_bw <= 0.0 || write.write_bw <= 0.0 || lat.read_ios == 0 {
        return Err(Error::invalid(format!(
            "storage measurement on {} moved no data; raise --storage-seconds",
            dir.display()
        )));
    }
    let fs = kvtier_cli::bench::Machine::probe(dir).filesystem_of_dir;
    Ok(StorageInfo {
        read_gbs: round3(read.read_bw / 1e9),
        write_gbs: round3(write.write_bw / 1e9),
        iocb_service_us: round3(lat.lat_mean_us_read),
        source: format!(
            "measured on {} ({fs}): kvtier io_uring engine, 1 MiB sequential reads alone and writes alone at QD{BW_DEPTH}, {:.1} s each, over a {} MiB file; IOCB service = mean QD1 latency of one {object} B read",
            dir.display(),
            seconds * 0.4,
            size >> 20
        ),
    })
}

fn round3(x: f64) -> f64 {
    (x * 1000.0).round() / 1000.0
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::PathBuf;

    #[test]
    fn assumed_says_so() {
        let s = assumed(None, None, None);
        assert_eq!(
            (s.read_gbs, s.write_gbs, s.iocb_service_us),
            (7.0, 5.0, 80.0)
        );
        assert!(
            s.source.starts_with("assumed: one PCIe Gen4"),
            "{}",
            s.source
        );
        let s = assumed(Some(29.0), Some(12.0), None);
        assert_eq!((s.read_gbs, s.write_gbs), (29.0, 12.0));
        assert!(s.source.contains("command line"));
    }

    #[test]
    fn measures_with_kvtier_engine() {
        let base = std::env::var_os("KVTIER_TEST_DIR")
            .map(PathBuf::from)
            .unwrap_or_else(std::env::temp_dir);
        let dir = base.join(format!("kvtier-profiler-storage-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let g = kvtier::model::preset("llama3-8b", 16).unwrap();
        let r = measure(&dir, 0.3, 16 << 20, &g, &|_| {});
        let leftover = std::fs::read_dir(&dir).unwrap().count();
        std::fs::remove_dir_all(&dir).unwrap();
        match r {
            Ok(s) => {
                assert!(
                    s.read_gbs > 0.0 && s.write_gbs > 0.0 && s.iocb_service_us > 0.0,
                    "{s:?}"
                );
                assert!(s.source.starts_with("measured on "), "{}", s.source);
            }
            // A filesystem without O_DIRECT (tmpfs) cannot hold a pool either.
            Err(e) => eprintln!("storage measurement skipped: {e}"),
        }
        assert_eq!(leftover, 0, "the measurement file must be removed");
        let msg = measure(Path::new("/nonexistent-kvtier"), 1.0, 16 << 20, &g, &|_| {})
            .unwrap_err()
            .to_string();
        assert!(msg.contains("not a directory"), "{msg}");
    }
}
