//! Admin commands to a controller the kernel's nvme driver owns, through its
//! passthrough ioctl on `/dev/nvmeX` (needs CAP_SYS_ADMIN): what `kvtier doctor`
//! asks a controller kvtier does not drive itself.

use super::spec::{admin_opc, cns, IDENTIFY_DATA_LEN};
use std::fs;
use std::os::fd::AsRawFd;
use std::path::Path;

/// `struct nvme_passthru_cmd` of `<linux/nvme_ioctl.h>` (72 bytes).
#[repr(C)]
#[derive(Default)]
struct NvmePassthruCmd {
    opcode: u8,
    flags: u8,
    rsvd1: u16,
    nsid: u32,
    cdw2: u32,
    cdw3: u32,
    metadata: u64,
    addr: u64,
    metadata_len: u32,
    data_len: u32,
    cdw10: u32,
    cdw11: u32,
    cdw12: u32,
    cdw13: u32,
    cdw14: u32,
    cdw15: u32,
    timeout_ms: u32,
    result: u32,
}
const _: () = assert!(std::mem::size_of::<NvmePassthruCmd>() == 72);

mod ioctl {
    // NVME_IOCTL_ADMIN_CMD = _IOWR('N', 0x41, struct nvme_admin_cmd).
    nix::ioctl_readwrite!(nvme_admin_cmd, b'N', 0x41, super::NvmePassthruCmd);
}

/// Identify Controller (CNS 1) through NVME_IOCTL_ADMIN_CMD on `chardev` (`/dev/nvmeX`);
/// `Err` says what failed (open, the ioctl, or the command's NVMe status).
pub fn identify_controller(
    chardev: &Path,
) -> std::result::Result<Box<[u8; IDENTIFY_DATA_LEN]>, String> {
    let f = fs::File::open(chardev).map_err(|e| format!("open {}: {e}", chardev.display()))?;
    let mut data = Box::new([0u8; IDENTIFY_DATA_LEN]);
    let mut cmd = NvmePassthruCmd {
        opcode: admin_opc::IDENTIFY,
        addr: data.as_mut_ptr() as u64,
        data_len: data.len() as u32,
        cdw10: cns::CONTROLLER as u32,
        timeout_ms: 5000,
        ..Default::default()
    };
    // SAFETY: `f` is an open NVMe controller character device; `cmd` is a valid
    // nvme_passthru_cmd whose `addr`/`data_len` describe `data`, a 4096-byte buffer that
    // stays alive and unaliased until the ioctl returns (the kernel copies into it).
    let rc = unsafe { ioctl::nvme_admin_cmd(f.as_raw_fd(), &mut cmd) }
        .map_err(|e| format!("NVME_IOCTL_ADMIN_CMD Identify: {e}"))?;
    if rc != 0 {
        return Err(format!("Identify failed with NVMe status {rc:#x}"));
    }
    Ok(data)
}
