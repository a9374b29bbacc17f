//! `kvtier-profile`: see the crate docs (`lib.rs`) and `kvtier::slack` for the table.

use clap::Parser;
use kvtier_profiler::{command_line, run, summary, Args};

fn main() {
    let argv: Vec<String> = std::env::args().collect();
    let args = Args::parse();
    match run(&args, &command_line(&argv)) {
        Ok(out) => {
            print!("{}", summary(&out.table));
            println!("wrote {}", out.path.display());
        }
        Err(e) => {
            eprintln!(
                "kvtier-profile: error: {}",
                kvtier::host::printable(&e.to_string())
            );
            std::process::exit(1);
        }
    }
}
