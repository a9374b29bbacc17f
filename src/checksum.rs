//! crc32c (Castagnoli) of KV data: every block's per-layer checksums when
//! it is stored, and every byte a load brings back before its layer is
//! announced. Bulk data goes through carry-less-multiply folding
//! (`crc-fast`: PCLMULQDQ, VPCLMULQDQ/AVX-512, ARM PMULL, chosen at run
//! time), 2-2.5x the single-instruction crc32c loop on 32-64 KiB objects;
//! the values are the standard crc32c, tested against the `crc32c` crate.
//! Also the one stable hash of short names ([`fnv1a64`]): the pool's
//! namespace id in block headers and a model id's suffix both use it.

use crc_fast::{CrcAlgorithm, Digest};

/// crc32c of `data`.
#[inline]
pub fn crc32c(data: &[u8]) -> u32 {
    crc_fast::crc32_iscsi(data)
}

/// crc32c of the bytes whose crc32c is `crc` followed by `data`.
#[inline]
pub fn crc32c_append(crc: u32, data: &[u8]) -> u32 {
    if data.is_empty() {
        return crc;
    }
    // The running state of a reflected crc32c is its value before the
    // final xor with all ones.
    let mut d = Digest::new_with_init_state(CrcAlgorithm::Crc32Iscsi, (crc ^ u32::MAX) as u64);
    d.update(data);
    d.finalize() as u32
}

/// crc32c(A ‖ B) from crc32c(A) and crc32c(B), for B of one fixed length.
/// Appending B shifts A's checksum by a linear map that depends only on B's
/// length, so it is built once here: `crc32c_combine` rebuilds it on every
/// call (tens of microseconds), too slow for once per layer of every block.
#[derive(Clone, Copy, Debug)]
pub(crate) struct CrcConcat {
    cols: [u32; 32],
}

impl CrcConcat {
    pub fn new(len_b: u64) -> CrcConcat {
        let mut cols = [0u32; 32];
        for (i, c) in cols.iter_mut().enumerate() {
            *c = crc32c::crc32c_combine(1 << i, 0, len_b as usize);
        }
        CrcConcat { cols }
    }

    pub fn apply(&self, crc_a: u32, crc_b: u32) -> u32 {
        let mut out = crc_b;
        let mut a = crc_a;
        let mut i = 0;
        while a != 0 {
            if a & 1 != 0 {
                out ^= self.cols[i];
            }
            a >>= 1;
            i += 1;
        }
        out
    }
}

/// FNV-1a, 64 bits: a stable hash of a short name (the same on every
/// machine and build), for ids that are written down (a block header's
/// namespace, a model id). Not for data: that is [`crc32c()`].
pub fn fnv1a64(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, &b| {
        (h ^ b as u64).wrapping_mul(0x0000_0100_0000_01b3)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The published FNV-1a 64 vectors: ids written by older builds stay the same.
    #[test]
    fn fnv1a64_matches_the_reference_values() {
        assert_eq!(fnv1a64(b""), 0xcbf2_9ce4_8422_2325);
        assert_eq!(fnv1a64(b"a"), 0xaf63_dc4c_8601_ec8c);
        assert_eq!(fnv1a64(b"foobar"), 0x8594_4171_f739_67e8);
    }

    /// Every length around the folding's block sizes, at every alignment,
    /// appended in pieces: the same value as the crc32c crate.
    #[test]
    fn same_values_as_the_reference_crc32c() {
        let data: Vec<u8> = (0..70_000u32)
            .map(|i| (i.wrapping_mul(2654435761) >> 13) as u8)
            .collect();
        assert_eq!(crc32c(b"123456789"), 0xe306_9283);
        for len in (0..300).chain([4095, 4096, 4097, 32768, 65536, 65537]) {
            for off in [0, 1, 3, 8, 63] {
                let d = &data[off..off + len];
                assert_eq!(crc32c(d), ::crc32c::crc32c(d), "len {len} off {off}");
                let cut = len / 3;
                let two = crc32c_append(crc32c(&d[..cut]), &d[cut..]);
                assert_eq!(two, ::crc32c::crc32c(d), "append len {len} cut {cut}");
            }
        }
        assert_eq!(crc32c_append(0x1234_5678, &[]), 0x1234_5678);
    }
}
