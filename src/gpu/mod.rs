pub mod abi;
pub mod kernels;
