//! `cargo +nightly fuzz run block_headers fuzz/corpus/block_headers`: see kvtier::fuzzing::block_headers.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    let _ = kvtier::fuzzing::block_headers(data);
});
