//! Checksums of registered host memory: what a store records for a block
//! and what a load's landed bytes are compared with. Both the load path and
//! the store path hash through here (one way: neither imports the other).

use crate::p2p::P2pTable;

/// The bytes of one P2P-table entry (an object of a memory block).
fn entry_bytes(table: &P2pTable, seg: u32) -> &[u8] {
    let d = table.entry(seg).expect("in table");
    // SAFETY: the descriptor addresses registered host memory the caller
    // keeps alive (register_memory's contract), and no I/O writes it now: a
    // store reads it, or the load that wrote it has completed.
    unsafe { std::slice::from_raw_parts(d.addr as *const u8, d.len as usize) }
}

/// crc32c of each P2P-table entry of `segs`, on two threads when there is
/// much to hash: reads that land together (the last ones of a layer) are
/// hashed while the layer's announcement waits.
pub(super) fn hash_entries(table: &P2pTable, segs: Vec<u32>, split: bool) -> Vec<u32> {
    // Below this many bytes (one typical read) a second thread costs more
    // than it saves.
    const SPLIT_BYTES: u64 = 8 << 20;
    let bytes: u64 = segs
        .iter()
        .map(|&s| table.entry(s).map_or(0, |d| d.len as u64))
        .sum();
    let hash = |part: &[u32]| -> Vec<u32> {
        part.iter()
            .map(|&s| crate::checksum::crc32c(entry_bytes(table, s)))
            .collect()
    };
    let cpus = std::thread::available_parallelism().map_or(1, |n| n.get());
    if !split || bytes < SPLIT_BYTES || cpus < 2 || segs.len() < 2 {
        return hash(&segs);
    }
    let (a, b) = segs.split_at(segs.len() / 2);
    std::thread::scope(|s| {
        let other = s.spawn(|| hash(b));
        let mut got = hash(a);
        got.extend(other.join().expect("a checksum thread panicked"));
        got
    })
}

/// The bytes of one object of a memory block.
fn object_bytes(table: &P2pTable, mem_block: u32, layer: u32, kv: u32) -> &[u8] {
    entry_bytes(table, table.index(mem_block, layer, kv))
}

/// crc32c of layer `layer` of a memory block: its K object, then its V object.
pub(super) fn layer_crc(table: &P2pTable, mem_block: u32, layer: u32) -> u32 {
    (0..2).fold(0, |crc, kv| {
        crate::checksum::crc32c_append(crc, object_bytes(table, mem_block, layer, kv))
    })
}

/// One crc32c per layer of a block in host memory (what its header records).
pub(super) fn layer_crcs(table: &P2pTable, mem_block: u32, layers: u32) -> Vec<u32> {
    (0..layers)
        .map(|l| layer_crc(table, mem_block, l))
        .collect()
}
