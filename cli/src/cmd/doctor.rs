//! `kvtier doctor`: what this machine can run and why not (the report is
//! [`kvtier::doctor`]'s; this prints it).

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
    let report = kvtier::doctor::run(&a.dir)?;
    if a.json {
        outln!(
            "{}",
            serde_json::to_string_pretty(&report).expect("serializable")
        );
    } else {
        kvtier_cli::cli::out(&kvtier::doctor::render(&report))?;
    }
    Ok(0)
}
