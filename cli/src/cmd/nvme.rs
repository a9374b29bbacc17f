//! `kvtier nvme`: list NVMe controllers, or bind one to a userspace driver for the run of
//! a command.

use crate::*;

#[derive(Subcommand)]
pub(crate) enum NvmeCmd {
    /// NVMe controllers: address, vendor:device, driver, namespaces'
    /// block devices and whether they are mounted or hold a filesystem.
    List,
    /// Bind one controller to a userspace driver, run COMMAND with
    /// KVTIER_NVME_DEVICE=ADDR, give the controller back to its driver when
    /// COMMAND exits (also on Ctrl-C/SIGTERM) and exit with its status.
    /// Refuses a controller whose namespaces are mounted, swap, held or hold
    /// a filesystem or partition table, unless --force.
    Bind {
        /// Full PCI address, DDDD:BB:DD.F (see `kvtier nvme list`).
        addr: String,
        /// vfio-pci (needs an IOMMU) or uio_pci_generic.
        #[arg(long, default_value = "vfio-pci")]
        driver: String,
        /// Bind even a non-NVMe function or one whose namespaces are in use
        /// or hold data (their users lose them; kvtier may overwrite it).
        #[arg(long)]
        force: bool,
        /// The command to run while the controller is bound.
        #[arg(last = true, required = true, value_name = "COMMAND")]
        command: Vec<String>,
    },
}

/// Runs one `kvtier nvme` command; the exit code.
pub(crate) fn run(cmd: NvmeCmd) -> Result<i32> {
    match cmd {
        NvmeCmd::List => kvtier_cli::nvme_cli::list(),
        NvmeCmd::Bind {
            addr,
            driver,
            force,
            command,
        } => kvtier_cli::nvme_cli::bind_and_run(
            &addr,
            kvtier::nvme::bind::BindDriver::parse(&driver)?,
            force,
            &command,
        ),
    }
}
