//! fio as the reference: the same workload kvtier's raw engine runs, described
//! in fio's own vocabulary (`--pattern randread --bs 80k --iodepth 32 ...`), run
//! by fio on the same file, and parsed into the same [`IoResult`] shape so the
//! two can be printed side by side and as kvtier/fio ratios.
//!
//! fio runs with its io_uring engine at its best: `direct=1`, registered
//! (fixed) buffers and files, no polling, one job unless asked otherwise, and
//! `randrepeat=0`/`norandommap` so random offsets are drawn the way kvtier's
//! bench draws them (uniform, `bs`-aligned, with repeats).

use kvtier::error::{Error, Result};
use std::collections::HashMap;
use std::os::unix::fs::{FileTypeExt, MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::process::Command;

/// An I/O pattern, named as fio's `--rw` names it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Pattern {
    Read,
    Write,
    RandRead,
    RandWrite,
    RandRw,
}

impl Pattern {
    pub const ALL: [Pattern; 5] = [
        Pattern::Read,
        Pattern::Write,
        Pattern::RandRead,
        Pattern::RandWrite,
        Pattern::RandRw,
    ];

    /// fio's names (`read`, `write`, `randread`, `randwrite`, `randrw`), case
    /// insensitive; `seqread`/`seqwrite` and dashed or underscored spellings
    /// (`rand-read`, `rand_rw`) are accepted too.
    pub fn parse(s: &str) -> Option<Pattern> {
        let s: String = s
            .trim()
            .chars()
            .filter(|c| *c != '-' && *c != '_')
            .collect::<String>()
            .to_ascii_lowercase();
        match s.as_str() {
            "read" | "seqread" => Some(Pattern::Read),
            "write" | "seqwrite" => Some(Pattern::Write),
            "randread" => Some(Pattern::RandRead),
            "randwrite" => Some(Pattern::RandWrite),
            "randrw" | "randreadwrite" => Some(Pattern::RandRw),
            _ => None,
        }
    }

    /// The value of fio's `--rw`.
    pub fn fio_name(self) -> &'static str {
        match self {
            Pattern::Read => "read",
            Pattern::Write => "write",
            Pattern::RandRead => "randread",
            Pattern::RandWrite => "randwrite",
            Pattern::RandRw => "randrw",
        }
    }

    pub fn is_random(self) -> bool {
        matches!(
            self,
            Pattern::RandRead | Pattern::RandWrite | Pattern::RandRw
        )
    }

    pub fn reads(self) -> bool {
        matches!(self, Pattern::Read | Pattern::RandRead | Pattern::RandRw)
    }

    pub fn writes(self) -> bool {
        matches!(self, Pattern::Write | Pattern::RandWrite | Pattern::RandRw)
    }
}

impl std::fmt::Display for Pattern {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.fio_name())
    }
}

/// One workload, in fio's terms.
#[derive(Clone, Debug, serde::Serialize)]
pub struct Workload {
    pub pattern: Pattern,
    /// Bytes per I/O.
    pub bs: u64,
    /// I/Os in flight.
    pub iodepth: u32,
    /// Bytes of the file the I/O covers, from `offset`.
    pub size: u64,
    /// Where in the file the covered bytes start (fio's `--offset`; 4 KiB
    /// aligned, direct I/O): a region of a larger file, such as the slots
    /// of one context in a pool file.
    pub offset: u64,
    /// Time-based run length; 0 means "transfer `size` bytes once".
    pub runtime_secs: f64,
    #[serde(serialize_with = "kvtier::json::path_lossy")]
    pub file: PathBuf,
    /// Percent of I/Os that are reads, for `randrw` (fio's `rwmixread`; 50 by default).
    pub rwmix_read: u32,
    /// Jobs (processes) doing the workload at once; 1 by default.
    pub numjobs: u32,
    /// Replay the reads listed in this fio iolog (version 2: "FILE read
    /// OFFSET LENGTH" lines) in its order, `iodepth` at a time, instead of
    /// the pattern's own offsets (`--read_iolog`); `size` and `offset` then
    /// mean nothing to fio.
    pub replay: Option<PathBuf>,
    /// Flush the file once at the end of the writes, and count that flush
    /// in the run's time (fio's `--end_fsync=1`; kvtier's engine: one
    /// FLUSH IOCB): what makes the bytes written durable.
    pub end_fsync: bool,
}

/// What one run moved, how fast, and at what host cost: the shape both
/// kvtier's raw bench and fio fill in.
#[derive(Clone, Debug, Default, serde::Serialize)]
pub struct IoResult {
    pub read_bytes: u64,
    pub write_bytes: u64,
    pub read_ios: u64,
    pub write_ios: u64,
    /// Wall-clock seconds of the run.
    pub secs: f64,
    /// Bytes per second.
    pub read_bw: f64,
    /// Bytes per second.
    pub write_bw: f64,
    /// CPU time used by the I/O process(es), seconds.
    pub cpu_usr_secs: f64,
    pub cpu_sys_secs: f64,
    pub lat_mean_us_read: f64,
    pub lat_p99_us_read: f64,
    pub lat_mean_us_write: f64,
    pub lat_p99_us_write: f64,
    /// Seconds of the end flush (`Workload::end_fsync`), included in
    /// `secs` (kvtier's engine; fio does not report it apart).
    pub end_flush_secs: f64,
}

impl IoResult {
    /// Read plus write bandwidth, bytes per second.
    pub fn total_bw(&self) -> f64 {
        self.read_bw + self.write_bw
    }

    /// Host CPU time (user + system) per I/O, microseconds; 0 when no I/O was done.
    pub fn cpu_us_per_io(&self) -> f64 {
        let ios = self.read_ios + self.write_ios;
        if ios == 0 {
            return 0.0;
        }
        (self.cpu_usr_secs + self.cpu_sys_secs) * 1e6 / ios as f64
    }
}

/// `fio --version` (e.g. `fio-3.33`) if fio is installed and runs.
pub fn fio_available() -> Option<String> {
    let out = Command::new("fio").arg("--version").output().ok()?;
    if !out.status.success() {
        return None;
    }
    let v = String::from_utf8_lossy(&out.stdout).trim().to_string();
    (!v.is_empty()).then_some(v)
}

/// A byte count as fio reads it (fio's default `kb_base=1024`: `80k` is 81920).
fn fio_size(bytes: u64) -> String {
    const UNITS: [(u64, &str); 4] = [
        (1 << 40, "t"),
        (1 << 30, "g"),
        (1 << 20, "m"),
        (1 << 10, "k"),
    ];
    for (unit, suffix) in UNITS {
        if bytes >= unit && bytes % unit == 0 {
            return format!("{}{suffix}", bytes / unit);
        }
    }
    bytes.to_string()
}

/// A run time as fio reads it: whole seconds plainly, anything else in ms.
fn fio_runtime(secs: f64) -> String {
    if secs.fract() == 0.0 {
        format!("{}", secs as u64)
    } else {
        format!("{}ms", ((secs * 1000.0).round() as u64).max(1))
    }
}

/// The arguments of the fio command line used, without the program name
/// (`Command::new("fio").args(fio_args(w))`; print it as `fio ` + the
/// arguments joined by spaces, or with [`fio_command_line`]).
///
/// `--allow_file_create=0` is added only when `w.file` exists when this is called.
pub fn fio_args(w: &Workload) -> Vec<String> {
    let mut a = vec![
        format!("--name=kvtier-{}", w.pattern.fio_name()),
        format!("--filename={}", w.file.display()),
        "--ioengine=io_uring".to_string(),
        "--direct=1".to_string(),
        format!("--rw={}", w.pattern.fio_name()),
    ];
    if w.pattern == Pattern::RandRw {
        a.push(format!("--rwmixread={}", w.rwmix_read.min(100)));
    }
    a.push(format!("--bs={}", fio_size(w.bs)));
    a.push(format!("--iodepth={}", w.iodepth));
    match &w.replay {
        Some(log) => {
            a.push(format!("--read_iolog={}", log.display()));
            // As fast as the device serves them: the log has no times.
            a.push("--replay_no_stall=1".to_string());
        }
        None => {
            if w.offset > 0 {
                a.push(format!("--offset={}", w.offset));
            }
            a.push(format!("--size={}", fio_size(w.size)));
        }
    }
    a.push(format!("--numjobs={}", w.numjobs.max(1)));
    if w.end_fsync {
        // fio fsyncs inside the job, before it takes its run time: the
        // bandwidth it reports includes the flush.
        a.push("--end_fsync=1".to_string());
    }
    if w.runtime_secs > 0.0 {
        a.push("--time_based".to_string());
        a.push(format!("--runtime={}", fio_runtime(w.runtime_secs)));
    }
    if !w.pattern.writes() {
        // A reference that only reads may run on a file holding data (a
        // pool file): fio opens it read-only and refuses any write.
        a.push("--readonly".to_string());
    }
    a.push("--randrepeat=0".to_string());
    if w.pattern.is_random() {
        a.push("--norandommap".to_string());
    }
    a.push("--fixedbufs".to_string());
    if w.replay.is_none() {
        // fio cannot register the files an iolog opens.
        a.push("--registerfiles".to_string());
    }
    a.push("--hipri=0".to_string());
    // Percentiles of the total latency (submission to completion), which is
    // what kvtier's side times; fio's default percentiles leave out the time
    // an I/O spends being submitted.
    a.push("--lat_percentiles=1".to_string());
    // kvtier's buffers are huge-page backed (memory::DmaBuffer); give fio the
    // same footing when the system has huge pages reserved for it, so the
    // reference is the device's best and not fio's 4 KiB-page DMA segments.
    if kvtier::memory::hugetlb_free_bytes() >= buffer_bytes(w.bs, w.iodepth, w.numjobs) {
        a.push("--mem=shmhuge".to_string());
    }
    if w.file.exists() {
        a.push("--allow_file_create=0".to_string());
    }
    a.push("--group_reporting".to_string());
    a.push("--output-format=json".to_string());
    a
}

/// The memory fio takes for its I/O buffers (`iodepth` x `bs` per job, and
/// some for its alignment), which `--mem=shmhuge` takes from the reserved
/// huge pages.
pub fn buffer_bytes(bs: u64, iodepth: u32, numjobs: u32) -> u64 {
    bs.saturating_mul(iodepth as u64)
        .saturating_mul(numjobs.max(1) as u64)
        .saturating_add(4 << 20)
}

/// The full fio command line, as a shell would take it.
pub fn fio_command_line(w: &Workload) -> String {
    let mut s = String::from("fio");
    for arg in fio_args(w) {
        s.push(' ');
        if arg
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || "-_=./,:+%@".contains(c))
        {
            s.push_str(&arg);
        } else {
            s.push('\'');
            s.push_str(&arg.replace('\'', r"'\''"));
            s.push('\'');
        }
    }
    s
}

fn check_workload(w: &Workload) -> Result<()> {
    if w.bs == 0 || w.bs % 512 != 0 {
        return Err(Error::invalid(format!(
            "fio: --bs {} must be a non-zero multiple of 512 (direct I/O)",
            w.bs
        )));
    }
    if w.iodepth == 0 {
        return Err(Error::invalid("fio: --iodepth must be at least 1"));
    }
    if w.size < w.bs {
        return Err(Error::invalid(format!(
            "fio: --size {} is smaller than one --bs {} block",
            w.size, w.bs
        )));
    }
    if w.offset % 4096 != 0 {
        return Err(Error::invalid(format!(
            "fio: offset {} is not a multiple of 4096 (direct I/O)",
            w.offset
        )));
    }
    if w.rwmix_read > 100 {
        return Err(Error::invalid(format!(
            "fio: rwmixread {} is not a percentage",
            w.rwmix_read
        )));
    }
    if !w.runtime_secs.is_finite() || w.runtime_secs < 0.0 {
        return Err(Error::invalid(format!(
            "fio: --runtime {} must be a non-negative number of seconds",
            w.runtime_secs
        )));
    }
    Ok(())
}

/// Run fio with the workload (io_uring, direct=1, fixed buffers and
/// registered files) and parse its JSON report.
pub fn run_fio(w: &Workload) -> Result<IoResult> {
    check_workload(w)?;
    let version = fio_available().ok_or_else(|| {
        Error::invalid(
            "fio is not installed or does not run (`fio --version` failed); \
             install fio (apt-get install fio) to compare against it",
        )
    })?;
    let args = fio_args(w);
    let out = Command::new("fio")
        .args(&args)
        .output()
        .map_err(|e| Error::io(format!("running {}", fio_command_line(w)), e))?;
    let stdout = String::from_utf8_lossy(&out.stdout);
    if !out.status.success() {
        let stderr = String::from_utf8_lossy(&out.stderr);
        let stderr = stderr.trim();
        return Err(Error::io(
            format!("{} ({version}) {}", fio_command_line(w), out.status),
            std::io::Error::other(if stderr.is_empty() {
                "fio printed nothing on stderr".to_string()
            } else {
                stderr.to_string()
            }),
        ));
    }
    parse_fio_json(&stdout, &version)
}

#[derive(serde::Deserialize, Default)]
#[serde(default)]
struct FioReport {
    jobs: Vec<FioJob>,
}

#[derive(serde::Deserialize, Default)]
#[serde(default)]
struct FioJob {
    jobname: String,
    error: i32,
    read: FioSide,
    write: FioSide,
    /// Milliseconds, summed over the jobs of a group.
    job_runtime: f64,
    /// Percent of `job_runtime`.
    usr_cpu: f64,
    sys_cpu: f64,
}

#[derive(serde::Deserialize, Default)]
#[serde(default)]
struct FioSide {
    io_bytes: u64,
    bw_bytes: Option<f64>,
    /// KiB/s; only used when `bw_bytes` is missing.
    bw: f64,
    /// Milliseconds.
    runtime: f64,
    total_ios: u64,
    clat_ns: FioLat,
    lat_ns: FioLat,
}

#[derive(serde::Deserialize, Default)]
#[serde(default)]
struct FioLat {
    mean: f64,
    percentile: HashMap<String, f64>,
}

impl FioSide {
    fn bw(&self) -> f64 {
        self.bw_bytes.unwrap_or(self.bw * 1024.0)
    }

    fn p99_us(&self) -> f64 {
        let p = |l: &FioLat| l.percentile.get("99.000000").copied();
        p(&self.lat_ns).or_else(|| p(&self.clat_ns)).unwrap_or(0.0) / 1000.0
    }
}

/// Parse fio's `--output-format=json` report (stdout of a run, which may have
/// lines such as "note: ..." before the JSON) into an [`IoResult`];
/// `version` names fio in errors.
pub fn parse_fio_json(stdout: &str, version: &str) -> Result<IoResult> {
    let bad = |why: String| {
        Error::io(
            format!("parsing the JSON output of {version}"),
            std::io::Error::new(std::io::ErrorKind::InvalidData, why),
        )
    };
    let start = stdout.find('{').ok_or_else(|| {
        bad(format!(
            "no JSON object in fio's output: {:?}",
            stdout.chars().take(300).collect::<String>()
        ))
    })?;
    // Take the first JSON value and ignore anything fio prints after it.
    let report: FioReport = serde_json::Deserializer::from_str(&stdout[start..])
        .into_iter::<FioReport>()
        .next()
        .ok_or_else(|| bad("empty JSON output".to_string()))?
        .map_err(|e| bad(e.to_string()))?;
    let job = report
        .jobs
        .first()
        .ok_or_else(|| bad("the report has no jobs".to_string()))?;
    if job.error != 0 {
        return Err(Error::io(
            format!("{version} job {:?} failed", job.jobname),
            std::io::Error::from_raw_os_error(job.error),
        ));
    }
    let (r, wr) = (&job.read, &job.write);
    let runtime_ms = if r.runtime.max(wr.runtime) > 0.0 {
        r.runtime.max(wr.runtime)
    } else {
        job.job_runtime
    };
    let job_secs = job.job_runtime / 1000.0;
    Ok(IoResult {
        read_bytes: r.io_bytes,
        write_bytes: wr.io_bytes,
        read_ios: r.total_ios,
        write_ios: wr.total_ios,
        secs: runtime_ms / 1000.0,
        read_bw: r.bw(),
        write_bw: wr.bw(),
        cpu_usr_secs: job.usr_cpu / 100.0 * job_secs,
        cpu_sys_secs: job.sys_cpu / 100.0 * job_secs,
        lat_mean_us_read: r.lat_ns.mean / 1000.0,
        lat_p99_us_read: r.p99_us(),
        lat_mean_us_write: wr.lat_ns.mean / 1000.0,
        lat_p99_us_write: wr.p99_us(),
        end_flush_secs: 0.0,
    })
}

/// A 4 KiB-aligned heap buffer for O_DIRECT writes.
struct AlignedBuf {
    ptr: std::ptr::NonNull<u8>,
    layout: std::alloc::Layout,
}

impl AlignedBuf {
    fn new(len: usize) -> AlignedBuf {
        let layout = std::alloc::Layout::from_size_align(len, 4096).expect("valid layout");
        // SAFETY: `len` is non-zero (callers pass 1 MiB).
        let raw = unsafe { std::alloc::alloc_zeroed(layout) };
        let ptr =
            std::ptr::NonNull::new(raw).unwrap_or_else(|| std::alloc::handle_alloc_error(layout));
        AlignedBuf { ptr, layout }
    }

    fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: we own `layout.size()` initialised bytes at `ptr`.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.layout.size()) }
    }
}

impl Drop for AlignedBuf {
    fn drop(&mut self) {
        // SAFETY: allocated in `new` with this layout.
        unsafe { std::alloc::dealloc(self.ptr.as_ptr(), self.layout) }
    }
}

/// Lay out a file of exactly `size` bytes, every byte written (not sparse,
/// so reads hit real extents), with O_DIRECT 1 MiB writes of incompressible,
/// non-repeating data; prints nothing. With `reuse`, a regular file that
/// already has exactly `size` bytes, all allocated, is left as it is.
///
/// A block device is never written: it is accepted if it holds at least
/// `size` bytes. On a filesystem without O_DIRECT (tmpfs) the file is
/// written through the page cache and synced instead.
pub fn prepare_file(path: &Path, size: u64, reuse: bool) -> Result<()> {
    const CHUNK: usize = 1 << 20;
    const SECTOR: u64 = 4096;
    if size == 0 {
        return Err(Error::invalid(format!(
            "cannot lay out {} with 0 bytes",
            path.display()
        )));
    }
    match std::fs::metadata(path) {
        Ok(m) if m.file_type().is_block_device() => {
            let dev = std::fs::File::open(path)
                .map_err(|e| Error::io(format!("opening {}", path.display()), e))?;
            let len = std::io::Seek::seek(&mut &dev, std::io::SeekFrom::End(0))
                .map_err(|e| Error::io(format!("sizing {}", path.display()), e))?;
            return if len >= size {
                Ok(())
            } else {
                Err(Error::Backing {
                    path: path.to_path_buf(),
                    reason: format!("holds {len} bytes, fewer than the {size} asked for"),
                })
            };
        }
        Ok(m) if !m.is_file() => {
            return Err(Error::Backing {
                path: path.to_path_buf(),
                reason: "is neither a regular file nor a block device".to_string(),
            });
        }
        Ok(m) if reuse && m.len() == size && m.blocks() * 512 >= size => return Ok(()),
        _ => {}
    }

    let open = |direct: bool| {
        let mut o = std::fs::OpenOptions::new();
        o.write(true).create(true).truncate(false);
        // Never write through a symlink planted at the test file's name.
        let nofollow = libc::O_NOFOLLOW;
        o.custom_flags(if direct {
            libc::O_DIRECT | nofollow
        } else {
            nofollow
        });
        o.open(path)
    };
    let (file, direct) = match open(true) {
        Ok(f) => (f, true),
        Err(e) if e.raw_os_error() == Some(libc::EINVAL) => (
            open(false).map_err(|e| Error::io(format!("creating {}", path.display()), e))?,
            false,
        ),
        Err(e) => {
            return Err(Error::io(
                format!("creating {} with O_DIRECT", path.display()),
                e,
            ))
        }
    };
    file.set_len(size)
        .map_err(|e| Error::io(format!("sizing {} to {size} bytes", path.display()), e))?;

    let mut buf = AlignedBuf::new(CHUNK);
    // splitmix64 noise: incompressible, and each 4 KiB sector is stamped with
    // its own offset below so no two sectors of the file are equal (no
    // dedup or compression can make the reads cheaper than real ones).
    let mut state = 0x6b76_7469_6572_u64 ^ size;
    for word in buf.as_mut_slice().chunks_exact_mut(8) {
        state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = state;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        word.copy_from_slice(&(z ^ (z >> 31)).to_le_bytes());
    }
    let direct_end = if direct { size / SECTOR * SECTOR } else { size };
    let mut offset = 0u64;
    while offset < size {
        let len = (size - offset).min(CHUNK as u64) as usize;
        let data = buf.as_mut_slice();
        for (i, sector) in data[..len].chunks_mut(SECTOR as usize).enumerate() {
            let stamp = offset + i as u64 * SECTOR;
            let n = sector.len().min(8);
            sector[..n].copy_from_slice(&stamp.to_le_bytes()[..n]);
        }
        let aligned = direct_end.saturating_sub(offset).min(len as u64) as usize;
        if aligned > 0 {
            write_all_at(&file, &data[..aligned], offset, path)?;
        }
        if aligned < len {
            // The unaligned tail of a file whose size is not a multiple of
            // 4 KiB: O_DIRECT cannot write it, the page cache can.
            let buffered = std::fs::OpenOptions::new()
                .write(true)
                .open(path)
                .map_err(|e| Error::io(format!("opening {}", path.display()), e))?;
            write_all_at(
                &buffered,
                &data[aligned..len],
                offset + aligned as u64,
                path,
            )?;
            buffered
                .sync_all()
                .map_err(|e| Error::io(format!("syncing {}", path.display()), e))?;
        }
        offset += len as u64;
    }
    file.sync_all()
        .map_err(|e| Error::io(format!("syncing {}", path.display()), e))
}

fn write_all_at(file: &std::fs::File, data: &[u8], offset: u64, path: &Path) -> Result<()> {
    std::os::unix::fs::FileExt::write_all_at(file, data, offset).map_err(|e| {
        Error::io(
            format!(
                "writing {} bytes at offset {offset} of {}",
                data.len(),
                path.display()
            ),
            e,
        )
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A real `fio --rw=randrw --rwmixread=70 --bs=80k --iodepth=32` report
    /// (fio-3.33, io_uring, 64 MiB file, 1 s), trimmed of fields we do not
    /// read, after a note line of the kind fio prints before its JSON.
    const RANDRW_JSON: &str = r#"note: both iodepth >= 1 and synchronous I/O engine are selected, queue depth will be capped at 1
{
  "fio version": "fio-3.33",
  "timestamp": 1795311523,
  "timestamp_ms": 1795311523704,
  "time": "Sun Nov 22 01:38:43 2026",
  "jobs": [
    {
      "jobname": "kvtier",
      "groupid": 0,
      "error": 0,
      "eta": 2147483647,
      "elapsed": 2,
      "job options": {
        "name": "kvtier",
        "filename": "/tmp/fiot/f",
        "size": "64m",
        "rw": "randrw",
        "rwmixread": "70",
        "bs": "80k",
        "iodepth": "32",
        "ioengine": "io_uring",
        "direct": "1",
        "runtime": "1",
        "randrepeat": "0",
        "hipri": "0",
        "allow_file_create": "0"
      },
      "read": {
        "io_bytes": 816332800,
        "io_kbytes": 797200,
        "bw_bytes": 814703393,
        "bw": 795608,
        "iops": 9945.10978,
        "runtime": 1002,
        "total_ios": 9965,
        "short_ios": 0,
        "drop_ios": 0,
        "slat_ns": {
          "min": 2680,
          "max": 72520,
          "mean": 4393.530457,
          "stddev": 3366.679332,
          "N": 9965
        },
        "clat_ns": {
          "min": 489941,
          "max": 4365157,
          "mean": 2284359.624686,
          "stddev": 461636.336033,
          "N": 9965,
          "percentile": {
            "50.000000": 2310144,
            "90.000000": 2801664,
            "99.000000": 3457024,
            "99.900000": 3817472
          }
        },
        "lat_ns": {
          "min": 499611,
          "max": 4370117,
          "mean": 2288753.155143,
          "stddev": 460922.240011,
          "N": 9965
        }
      },
      "write": {
        "io_bytes": 336609280,
        "io_kbytes": 328720,
        "bw_bytes": 335937405,
        "bw": 328063,
        "iops": 4100.798403,
        "runtime": 1002,
        "total_ios": 4109,
        "short_ios": 0,
        "drop_ios": 0,
        "slat_ns": {
          "min": 3700,
          "max": 72510,
          "mean": 5997.992456,
          "stddev": 3463.146915,
          "N": 4109
        },
        "clat_ns": {
          "min": 320741,
          "max": 5380710,
          "mean": 2239575.839377,
          "stddev": 515724.639977,
          "N": 4109,
          "percentile": {
            "50.000000": 2277376,
            "90.000000": 2932736,
            "99.000000": 3424256,
            "99.900000": 4423680
          }
        },
        "lat_ns": {
          "min": 335451,
          "max": 5388630,
          "mean": 2245573.831833,
          "stddev": 515227.449942,
          "N": 4109
        }
      },
      "job_runtime": 1001,
      "usr_cpu": 1.198801,
      "sys_cpu": 7.192807,
      "ctx": 1284,
      "majf": 0,
      "minf": 8
    }
  ]
}
"#;

    /// A real randread report (same fio, bs=80k, iodepth=32), trimmed harder:
    /// fio leaves out `percentile` for a direction with no I/O.
    const RANDREAD_JSON: &str = r#"{
 "fio version": "fio-3.33",
 "jobs": [
  {
   "jobname": "kvtier",
   "error": 0,
   "read": {
    "io_bytes": 1203404800,
    "bw_bytes": 1201002794,
    "runtime": 1002,
    "total_ios": 14690,
    "clat_ns": {
     "min": 1080092, "max": 3656307, "mean": 2176451.706399, "stddev": 554335.405506, "N": 14690,
     "percentile": { "50.000000": 2441216, "99.000000": 3194880 }
    },
    "lat_ns": { "mean": 2181020.694146, "N": 14690 }
   },
   "write": {
    "io_bytes": 0, "bw_bytes": 0, "runtime": 0, "total_ios": 0,
    "clat_ns": { "min": 0, "max": 0, "mean": 0.0, "stddev": 0.0, "N": 0 },
    "lat_ns": { "mean": 0.0, "N": 0 }
   },
   "job_runtime": 1001,
   "usr_cpu": 0.2997,
   "sys_cpu": 7.592408
  }
 ]
}
fio: some trailing line"#;

    fn close(a: f64, b: f64) -> bool {
        (a - b).abs() <= 1e-9 * b.abs().max(1.0)
    }

    #[test]
    fn parses_real_randrw_report() {
        let r = parse_fio_json(RANDRW_JSON, "fio-3.33").unwrap();
        assert_eq!(r.read_bytes, 816_332_800);
        assert_eq!(r.write_bytes, 336_609_280);
        assert_eq!(r.read_ios, 9965);
        assert_eq!(r.write_ios, 4109);
        assert!(close(r.secs, 1.002));
        assert!(close(r.read_bw, 814_703_393.0));
        assert!(close(r.write_bw, 335_937_405.0));
        assert!(close(r.total_bw(), 814_703_393.0 + 335_937_405.0));
        assert!(close(r.cpu_usr_secs, 0.01198801 * 1.001));
        assert!(close(r.cpu_sys_secs, 0.07192807 * 1.001));
        assert!(close(r.lat_mean_us_read, 2288.753155143));
        assert!(close(r.lat_p99_us_read, 3457.024));
        assert!(close(r.lat_mean_us_write, 2245.573831833));
        assert!(close(r.lat_p99_us_write, 3424.256));
        let per_io = (0.01198801 + 0.07192807) * 1.001 * 1e6 / (9965.0 + 4109.0);
        assert!(close(r.cpu_us_per_io(), per_io));
    }

    #[test]
    fn parses_real_randread_report_with_no_writes() {
        let r = parse_fio_json(RANDREAD_JSON, "fio-3.33").unwrap();
        assert_eq!(r.read_ios, 14690);
        assert_eq!((r.write_bytes, r.write_ios), (0, 0));
        assert!(close(r.read_bw, 1_201_002_794.0));
        assert_eq!(r.write_bw, 0.0);
        assert!(close(r.lat_p99_us_read, 3194.88));
        assert_eq!(r.lat_p99_us_write, 0.0);
        assert!(close(r.cpu_sys_secs, 0.07592408 * 1.001));

        // With --lat_percentiles=1 the total latency's percentiles (what
        // kvtier's side times) win over the completion latency's.
        let total = RANDREAD_JSON.replace(
            r#""lat_ns": { "mean": 2181020.694146, "N": 14690 }"#,
            r#""lat_ns": { "mean": 2181020.694146, "N": 14690, "percentile": { "99.000000": 3203072 } }"#,
        );
        assert_ne!(total, RANDREAD_JSON);
        let r = parse_fio_json(&total, "fio-3.33").unwrap();
        assert!(close(r.lat_p99_us_read, 3203.072));
    }

    #[test]
    fn bad_json_names_fio_version() {
        for text in [
            "",
            "fio: engine io_uring not loadable",
            "{\"jobs\": [ {\"read\": ",
        ] {
            let e = parse_fio_json(text, "fio-9.99").unwrap_err().to_string();
            assert!(e.contains("fio-9.99"), "{e}");
        }
        let e = parse_fio_json("{\"jobs\": []}", "fio-9.99")
            .unwrap_err()
            .to_string();
        assert!(e.contains("fio-9.99") && e.contains("no jobs"), "{e}");
        let failed = r#"{"jobs": [{"jobname": "j", "error": 5}]}"#;
        let e = parse_fio_json(failed, "fio-9.99").unwrap_err().to_string();
        assert!(e.contains("failed"), "{e}");
    }

    #[test]
    fn patterns_round_trip() {
        for p in Pattern::ALL {
            assert_eq!(Pattern::parse(p.fio_name()), Some(p));
            assert_eq!(Pattern::parse(&p.fio_name().to_uppercase()), Some(p));
            assert!(p.reads() || p.writes());
            assert_eq!(
                serde_json::to_string(&p).unwrap(),
                format!("\"{}\"", p.fio_name())
            );
        }
        assert_eq!(Pattern::parse("rand-read"), Some(Pattern::RandRead));
        assert_eq!(Pattern::parse("seqwrite"), Some(Pattern::Write));
        assert_eq!(Pattern::parse("rw"), None);
        assert_eq!(Pattern::parse("trim"), None);
        assert!(Pattern::RandRw.reads() && Pattern::RandRw.writes());
        assert!(!Pattern::Read.is_random() && Pattern::RandWrite.is_random());
        assert!(!Pattern::RandRead.writes() && !Pattern::Write.reads());
    }

    fn workload(pattern: Pattern, file: PathBuf) -> Workload {
        Workload {
            pattern,
            bs: 80 << 10,
            iodepth: 32,
            size: 4 << 30,
            offset: 0,
            replay: None,
            runtime_secs: 10.0,
            file,
            rwmix_read: 70,
            numjobs: 1,
            end_fsync: false,
        }
    }

    #[test]
    fn args_say_what_kvtier_does() {
        let missing = PathBuf::from("/nonexistent/kvtier-bench.dat");
        let a = fio_args(&workload(Pattern::RandRead, missing.clone()));
        for want in [
            "--filename=/nonexistent/kvtier-bench.dat",
            "--ioengine=io_uring",
            "--direct=1",
            "--rw=randread",
            "--bs=80k",
            "--iodepth=32",
            "--size=4g",
            "--numjobs=1",
            "--time_based",
            "--runtime=10",
            "--output-format=json",
            "--group_reporting",
            "--randrepeat=0",
            "--norandommap",
            "--fixedbufs",
            "--registerfiles",
            "--hipri=0",
            "--lat_percentiles=1",
        ] {
            assert!(a.iter().any(|x| x == want), "{want} missing from {a:?}");
        }
        assert!(a[0].starts_with("--name="));
        assert!(!a.iter().any(|x| x.starts_with("--allow_file_create")));
        assert!(!a.iter().any(|x| x.starts_with("--rwmixread")));
        assert!(!a.iter().any(|x| x.starts_with("--end_fsync")));
        // A durable write: one fsync at the end, inside fio's run time.
        let mut w = workload(Pattern::Write, missing.clone());
        w.end_fsync = true;
        assert!(fio_args(&w).iter().any(|x| x == "--end_fsync=1"));

        // Sequential: no norandommap; one pass over `size` when runtime is 0;
        // an existing file is never created by fio.
        let mut w = workload(Pattern::Read, PathBuf::from("/"));
        w.runtime_secs = 0.0;
        w.bs = 1 << 20;
        w.size = 1_000_000_000;
        let a = fio_args(&w);
        assert!(a.iter().any(|x| x == "--allow_file_create=0"));
        assert!(a.iter().any(|x| x == "--bs=1m"));
        assert!(a.iter().any(|x| x == "--size=1000000000"));
        assert!(!a
            .iter()
            .any(|x| x == "--norandommap" || x == "--time_based"));
        assert!(!a.iter().any(|x| x.starts_with("--runtime")));

        let mut w = workload(Pattern::RandRw, missing);
        w.runtime_secs = 1.5;
        let a = fio_args(&w);
        assert!(a.iter().any(|x| x == "--rwmixread=70"));
        assert!(a.iter().any(|x| x == "--runtime=1500ms"));
        assert!(fio_command_line(&w).starts_with("fio --name=kvtier-randrw "));

        let w = workload(Pattern::Read, PathBuf::from("/tmp/with space/f"));
        assert!(fio_command_line(&w).contains("'--filename=/tmp/with space/f'"));

        // A region of a file; a workload that only reads opens it read-only,
        // one that writes does not (fio would refuse its writes).
        let mut w = workload(Pattern::Read, PathBuf::from("/"));
        assert!(!fio_args(&w).iter().any(|x| x.starts_with("--offset")));
        w.offset = 3 << 20;
        let a = fio_args(&w);
        assert!(a.iter().any(|x| x == "--offset=3145728"), "{a:?}");
        assert!(a.iter().any(|x| x == "--readonly"), "{a:?}");
        for p in [Pattern::Write, Pattern::RandWrite, Pattern::RandRw] {
            let w = workload(p, PathBuf::from("/"));
            assert!(!fio_args(&w).iter().any(|x| x == "--readonly"), "{p}");
        }
        assert!(fio_args(&workload(Pattern::RandRead, PathBuf::from("/")))
            .iter()
            .any(|x| x == "--readonly"));
    }

    #[test]
    fn rejects_unusable_workloads() {
        let mut w = workload(Pattern::Read, PathBuf::from("/nonexistent/f"));
        w.bs = 1000;
        assert!(run_fio(&w).is_err());
        let mut w = workload(Pattern::Read, PathBuf::from("/nonexistent/f"));
        w.iodepth = 0;
        assert!(run_fio(&w).is_err());
        let mut w = workload(Pattern::Read, PathBuf::from("/nonexistent/f"));
        w.offset = 512;
        let e = run_fio(&w).unwrap_err().to_string();
        assert!(e.contains("offset 512") && e.contains("4096"), "{e}");
    }

    #[test]
    fn prepare_file_writes_every_byte() {
        let dir = kvtier::scratch::TestDir::new("fio-test");
        let path = dir.file("prep.dat");
        let size = (3 << 20) + 4096 + 100; // a partial chunk and an unaligned tail
        prepare_file(&path, size, false).unwrap();
        let m = std::fs::metadata(&path).unwrap();
        assert_eq!(m.len(), size);
        assert!(m.blocks() * 512 >= size, "file is sparse");
        let data = std::fs::read(&path).unwrap();
        // Every sector is stamped with its offset, so none repeats.
        assert_eq!(&data[4096..4104], &4096u64.to_le_bytes());
        assert_eq!(&data[(3 << 20)..(3 << 20) + 8], &(3u64 << 20).to_le_bytes());
        assert_ne!(&data[8..4096], &data[4104..8192]);
        let mtime = m.modified().unwrap();
        std::thread::sleep(std::time::Duration::from_millis(20));
        prepare_file(&path, size, true).unwrap();
        assert_eq!(std::fs::metadata(&path).unwrap().modified().unwrap(), mtime);
        // A smaller size shrinks it to exactly that size.
        prepare_file(&path, 1 << 20, true).unwrap();
        assert_eq!(std::fs::metadata(&path).unwrap().len(), 1 << 20);
        std::fs::remove_file(&path).unwrap();
    }

    fn io_uring_works() -> bool {
        // struct io_uring_params is 120 bytes; all zero asks for defaults.
        let mut params = [0u64; 16];
        // SAFETY: io_uring_setup writes at most sizeof(io_uring_params) into `params`.
        let fd = unsafe { libc::syscall(libc::SYS_io_uring_setup, 1u32, params.as_mut_ptr()) };
        if fd < 0 {
            return false;
        }
        // SAFETY: `fd` is the ring we just created and own.
        unsafe { libc::close(fd as i32) };
        true
    }

    /// fio for real: 1 s of randread on a 64 MiB file, when fio is installed.
    #[test]
    fn runs_fio_for_real() {
        let Some(version) = fio_available() else {
            eprintln!("note: fio is not installed; skipping the fio run (apt-get install fio)");
            return;
        };
        let dir = kvtier::scratch::TestDir::new("fio-test");
        let path = dir.file("fio.dat");
        prepare_file(&path, 64 << 20, true).unwrap();
        let w = Workload {
            pattern: Pattern::RandRead,
            bs: 80 << 10,
            iodepth: 32,
            size: 64 << 20,
            offset: 0,
            replay: None,
            runtime_secs: 1.0,
            file: path.clone(),
            rwmix_read: 50,
            numjobs: 1,
            end_fsync: false,
        };
        // Filesystems without O_DIRECT (tmpfs) or sandboxes without
        // io_uring: fio itself cannot run this workload there.
        let direct = std::fs::OpenOptions::new()
            .read(true)
            .custom_flags(libc::O_DIRECT)
            .open(&path)
            .is_ok();
        if !direct || !io_uring_works() {
            eprintln!("note: no O_DIRECT ({direct}) or io_uring here; skipping the {version} run");
            std::fs::remove_file(&path).ok();
            return;
        }
        let r = run_fio(&w).unwrap();
        std::fs::remove_file(&path).ok();
        eprintln!("{version}: {r:?}");
        assert!(r.read_ios > 0 && r.write_ios == 0);
        assert_eq!(r.read_bytes, r.read_ios * (80 << 10));
        assert!(r.read_bw > 0.0 && r.secs > 0.5 && r.secs < 5.0);
        assert!(r.lat_mean_us_read > 0.0 && r.lat_p99_us_read >= r.lat_mean_us_read * 0.5);
        assert!(r.cpu_usr_secs + r.cpu_sys_secs > 0.0);

        // fio exiting non-zero: its stderr is in the error.
        let mut bad = w.clone();
        bad.file = PathBuf::from("/proc/kvtier-no-such-dir/fio.dat");
        let e = run_fio(&bad).unwrap_err().to_string();
        assert!(e.contains("fio: failed to create dir"), "{e}");
    }
}
