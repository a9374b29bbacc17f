//! The README's Rust example is a file (`examples/quickstart.rs`); this runs
//! it as written, twice on one pool (the second run finds the pool there and
//! stores over its own keys), and checks the README shows that file, not
//! something that drifted from it.

mod common;

#[allow(dead_code)] // its main is the example's, for `cargo run --example quickstart`
#[path = "../examples/quickstart.rs"]
mod quickstart;

#[test]
fn the_readme_rust_quickstart_runs_as_written() {
    let dir = common::TempDir::new("quickstart");
    for _ in 0..2 {
        quickstart::run(&dir.file("pool")).unwrap();
    }
    assert!(dir.file("pool").join("kvtier-0.pool").exists());
}

#[test]
fn the_readme_shows_the_quickstart_file() {
    let code = std::fs::read_to_string(common::repo_root().join("examples/quickstart.rs")).unwrap();
    let readme = std::fs::read_to_string(common::repo_root().join("README.md")).unwrap();
    assert!(
        readme.contains(&format!("```rust\n{code}```")),
        "README.md must show examples/quickstart.rs as it is"
    );
}
