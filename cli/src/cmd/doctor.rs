//! `kvtier doctor`: what this machine can run and why not (the report is
//! [`kvtier_cli::doctor`]'s; this prints it).

use crate::*;

#[derive(Args)]
pub(crate) struct DoctorArgs {
    /// Print the report as JSON.
    #[arg(long)]
    json: bool,
    /// The pool directory to check (created if missing).
    #[arg(long, default_value = "./kvtier-data")]
    dir: PathBuf,
}

/// Runs `kvtier doctor`; the exit code.
pub(crate) fn run(a: DoctorArgs) -> Result<i32> {
    let report = kvtier_cli::doctor::run(&a.dir)?;
    if a.json {
        outln!(
            "{}",
            serde_json::to_string_pretty(&report).expect("serializable")
        );
    } else {
        kvtier_cli::cli::out(&kvtier_cli::doctor::render(&report))?;
    }
    Ok(0)
}
