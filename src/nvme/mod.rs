//! Userspace NVMe: spec layouts, queue pairs, controller bring-up.
//!
//! - [`spec`]: the NVMe byte layouts (SQE, CQE, SGL descriptors, PRP lists,
//!   controller registers, Identify data, status codes), twin of
//!   `kernels/nvme_spec.h`. Pure data: no hardware access.
//! - [`queue`]: a CPU-polled queue pair (phase tags, command ids, batched
//!   doorbells, SQ head tracking, poll timeouts) over a [`queue::QueueMemory`]
//!   that a real controller (BAR0 + DMA memory) or a simulated one provides.

pub mod bind;
pub mod ctrl;
pub mod mmio;
pub mod namespace;
pub mod passthru;
pub mod queue;
// A simulated NVMe controller (a test double of the hardware): the `testing` feature.
#[cfg(any(test, feature = "testing"))]
pub mod sim;
pub mod spec;
pub mod uio;
pub mod vfio;

pub use namespace::{NvmeConfig, NvmeNamespace};
pub use queue::{Completion, QueueError, QueueMemory, QueuePair};
pub use spec::{
    Cqe, DataPtr, IdentifyController, IdentifyNamespace, PrpError, SglDescriptor, Sqe, Status,
};
