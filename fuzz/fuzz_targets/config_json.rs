//! `cargo +nightly fuzz run config_json fuzz/corpus/config_json`: see kvtier::fuzzing::config_json.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    let _ = kvtier::fuzzing::config_json(data);
});
