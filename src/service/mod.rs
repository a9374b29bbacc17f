//! `kvtier serve`: one process per node owns the pool, and every engine
//! process on the node shares it through a Unix socket.
//!
//! - `protocol`: the frames, defined once, every length bounded.
//! - `arena`: the service's KV memory, one sealed memfd slice per client.
//! - [`server`]: [`Service`], the accept loop, the per-client threads and
//!   the event dispatcher around one [`crate::TierHandle`].
//! - [`client`]: [`ServiceClient`], the handle API ([`crate::TierApi`])
//!   over the socket; `builder`: `TierBuilder::service(PATH)`, which opens one.
//! - [`staged_client`]: [`StagedServiceClient`], the same API for KV memory
//!   in the client's GPU memory: `crate::staged`'s path with the service's
//!   loads and stores underneath and the client's slice as its staging
//!   (`TierBuilder::service(PATH).memory(..)`).
//! - `board`: a client's job table and the waits on it, one for both.
//! - `sys`: the raw calls (memfd, mmap, `SCM_RIGHTS`, `SO_PEERCRED`).
//!
//! Lookups, pins and unpins are answered from the index without touching
//! the data path; loads and stores go through the one handle, so the
//! service's read-first / write-deferred policy orders every client's jobs.

internal_room! {
    arena;
    protocol;
}
mod board;
mod builder;
pub mod client;
pub mod server;
pub mod staged_client;
mod sys;

pub use builder::{ServiceBuilder, StagedServiceBuilder};
pub use client::ServiceClient;
pub use server::{block_termination_signals, stop_on_signals, Service, ServiceConfig, Stopper};
pub use staged_client::StagedServiceClient;
pub use sys::{group_id, SharedMapping};
