//! kvtier's command line over the kvtier library: argument parsing helpers (`cli`),
//! the storage benchmark against fio (`bench`), the machine report (`doctor`), trace
//! replay (`replay`) and the
//! `nvme list`/`bind` commands (`nvme_cli`). The `kvtier` binary is `main.rs`.

pub mod bench;
pub mod cli;
pub mod doctor;
pub mod nvme_cli;
pub mod output;
pub mod replay;
