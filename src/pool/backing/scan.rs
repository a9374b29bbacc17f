//! Is there anyone's data past a device's head? A head of zeros says nothing about what
//! follows; the scan reads data extents (or samples them) before kvtier formats over it.

use super::*;

/// Bytes of a device past its head that [`data_beyond_head`] reads at most: all of it when
/// the data there is smaller, else evenly spread 1 MiB samples plus the last MiB (where
/// GPT backups and md 0.90/1.0 superblocks live).
pub(super) const DATA_SCAN_BUDGET: u64 = 64 << 20;
pub(super) const DATA_SCAN_CHUNK: u64 = 1 << 20;

/// The next data extent of a regular file at or after `from` (SEEK_DATA / SEEK_HOLE), or
/// the whole rest when the filesystem cannot say.
pub(super) fn next_data_extent(file: &File, from: u64, len: u64) -> Option<(u64, u64)> {
    let fd = file.as_raw_fd();
    let at = libc::off_t::try_from(from).ok()?;
    // SAFETY: lseek only moves the offset of an open descriptor (kvtier reads and writes
    // it positionally, so the offset is not used elsewhere).
    let start = unsafe { libc::lseek(fd, at, libc::SEEK_DATA) };
    if start < 0 {
        return match io::Error::last_os_error().raw_os_error() {
            Some(libc::ENXIO) => None,
            _ => Some((from, len)),
        };
    }
    // SAFETY: as above.
    let end = unsafe { libc::lseek(fd, start, libc::SEEK_HOLE) };
    let end = if end < 0 { len } else { (end as u64).min(len) };
    let start = start as u64;
    (start < end).then_some((start, end))
}

/// Does `file` (not in O_DIRECT mode) hold non-zero bytes in `[SIGNATURE_PROBE_BYTES,
/// len)`? A head of zeros says nothing about what follows: a disk image, a database file
/// or a filesystem that keeps its first sectors empty is still someone's data. Holes of
/// regular files are skipped; beyond [`DATA_SCAN_BUDGET`] of data the scan samples.
pub(super) fn data_beyond_head(
    file: &File,
    kind: BackingKind,
    len: u64,
) -> io::Result<Option<u64>> {
    let head = SIGNATURE_PROBE_BYTES as u64;
    if len <= head {
        return Ok(None);
    }
    let mut extents = Vec::new();
    match kind {
        BackingKind::BlockDevice => extents.push((head, len)),
        BackingKind::File => {
            let mut at = head;
            while at < len && extents.len() < 4096 {
                let Some((start, end)) = next_data_extent(file, at, len) else {
                    break;
                };
                extents.push((start.max(at), end));
                at = end;
            }
            if at < len && extents.len() >= 4096 {
                extents.push((at, len));
            }
        }
    }
    let total: u64 = extents.iter().map(|(a, b)| b - a).sum();
    // Read every byte when it fits the budget, else one chunk every `stride` bytes.
    let stride = if total <= DATA_SCAN_BUDGET {
        DATA_SCAN_CHUNK
    } else {
        (total / (DATA_SCAN_BUDGET / DATA_SCAN_CHUNK)).max(DATA_SCAN_CHUNK)
    };
    let mut buf = vec![0u8; DATA_SCAN_CHUNK as usize];
    let mut read_chunk = |off: u64, n: u64| -> io::Result<Option<u64>> {
        let n = n as usize;
        let mut done = 0;
        while done < n {
            match file.read_at(&mut buf[done..n], off + done as u64) {
                Ok(0) => break,
                Ok(k) => done += k,
                Err(e) if e.kind() == ErrorKind::Interrupted => continue,
                Err(e) => return Err(e),
            }
        }
        Ok(buf[..done]
            .iter()
            .position(|&b| b != 0)
            .map(|p| off + p as u64))
    };
    for &(start, end) in &extents {
        let mut off = start;
        while off < end {
            let n = DATA_SCAN_CHUNK.min(end - off);
            if let Some(at) = read_chunk(off, n)? {
                return Ok(Some(at));
            }
            off = off.saturating_add(stride);
        }
    }
    let tail = len.saturating_sub(DATA_SCAN_CHUNK).max(head);
    read_chunk(tail, len - tail)
}
