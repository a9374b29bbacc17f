//! Facts about the host kvtier runs on, read from the kernel's files and a few syscalls:
//! PCI functions in sysfs ([`pci`]), who uses a block device or file ([`mounts`]), what a
//! device holds ([`signature`]), direct I/O alignment and buffers ([`dio`]), which of a file's space was
//! never written ([`extents`]), and byte
//! sizes for people ([`size`]). The pool, the NVMe binder, the engines and `kvtier doctor` all
//! ask here, so each fact is read one way.

pub mod dio;
pub mod extents;
pub mod mounts;
pub mod pci;
pub mod signature;
pub mod size;
pub mod sysfs;
