//! `cargo +nightly fuzz run slack_table fuzz/corpus/slack_table`: see kvtier::fuzzing::slack_table.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    let _ = kvtier::fuzzing::slack_table(data);
});
