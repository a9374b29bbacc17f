//! `cargo +nightly fuzz run superblock fuzz/corpus/superblock`: see kvtier::fuzzing::superblock.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    let _ = kvtier::fuzzing::superblock(data);
});
