//! `TierBuilder::service(PATH)`: the builder's road to the node's shared
//! pool. It ends in a [`ServiceClient`], which answers the same
//! [`TierApi`] as the in-process [`crate::TierHandle`] that `build()` makes
//! without it.

use super::client::ServiceClient;
use crate::error::{Error, Result};
use crate::handle::TierBuilder;
use crate::model::{KvGeometry, NamedGeometry};
use std::path::PathBuf;

#[cfg(doc)]
use crate::handle::TierApi;

impl TierBuilder {
    /// The pool of the `kvtier serve` service listening on `socket`,
    /// shared with every other engine process of the node, instead of a
    /// pool of this process's own. The service decides the pool (where it
    /// is, its capacity, engine, policy and namespace) and the KV memory
    /// (the slice it shares with this process): a builder that also set any
    /// of those is refused at `build()`, naming the calls. A geometry
    /// (`geometry(..)`, `model(..)`) is what this process expects the
    /// service to serve, checked at `build()`.
    ///
    /// ```no_run
    /// # use kvtier::{TierApi, TierBuilder};
    /// # fn main() -> kvtier::Result<()> {
    /// let tier = TierBuilder::default()
    ///     .service("/run/kvtier/kvtier.sock")
    ///     .blocks(256)
    ///     .build()?;
    /// let tier: &dyn TierApi = &tier; // as an in-process TierHandle
    /// # Ok(()) }
    /// ```
    pub fn service(self, socket: impl Into<PathBuf>) -> ServiceBuilder {
        ServiceBuilder {
            socket: socket.into(),
            blocks: 0,
            lookup_only: false,
            geometry: self.asked_geometry(),
            conflicts: self.own_pool_calls(),
        }
    }
}

/// A [`TierBuilder`] pointed at the node's service: how much memory to
/// share with it, and what geometry to expect.
#[derive(Debug)]
pub struct ServiceBuilder {
    socket: PathBuf,
    blocks: u32,
    lookup_only: bool,
    geometry: Option<KvGeometry>,
    /// Calls made before `service(..)` that the service decides.
    conflicts: Vec<&'static str>,
}

impl ServiceBuilder {
    /// Blocks of KV memory the service shares with this process (default
    /// 0: as many as it gives a client, its `--client-blocks`).
    pub fn blocks(mut self, blocks: u32) -> Self {
        self.blocks = blocks;
        self
    }

    /// Lookups, pins and unpins only (an engine's scheduler): the service
    /// shares no memory with this client and gives it no client slot;
    /// loads and stores are refused. Not with `blocks(..)`.
    pub fn lookup_only(mut self) -> Self {
        self.lookup_only = true;
        self
    }

    /// The KV geometry this process expects; `build()` refuses a service
    /// that serves another.
    pub fn geometry(mut self, geometry: KvGeometry) -> Self {
        self.geometry = Some(geometry);
        self
    }

    /// [`Self::geometry`] of a resolved model. The name is not compared:
    /// the service's pool has its own, and keys from engines of different
    /// models differ (the adapters hash the model's identity into them).
    pub fn model(self, model: NamedGeometry) -> Self {
        self.geometry(model.geometry)
    }

    /// Connect, share the memory, check the geometry.
    pub fn build(self) -> Result<ServiceClient> {
        if !self.conflicts.is_empty() {
            return Err(Error::invalid(format!(
                "{} set up a pool of this process's own, but service({}) uses the node's kvtier service, which decides its pool, engine, policy, namespace and the KV memory it shares: drop {}, or drop service(..) to open a pool of this process's own",
                self.conflicts.join(", "),
                self.socket.display(),
                if self.conflicts.len() == 1 { "it" } else { "them" },
            )));
        }
        let client = if self.lookup_only {
            if self.blocks != 0 {
                return Err(Error::invalid(format!(
                    "blocks({}) with lookup_only(): a lookup-only client of the kvtier service shares no memory; drop one of them",
                    self.blocks
                )));
            }
            ServiceClient::connect_lookup_only(&self.socket)?
        } else {
            ServiceClient::connect(&self.socket, self.blocks)?
        };
        if let Some(want) = self.geometry.filter(|g| g != client.geometry()) {
            let served = client.geometry().describe();
            let _ = client.close();
            return Err(Error::invalid(format!(
                "the kvtier service at {} serves {served}, but this process asked for {}: start the service with this model (kvtier serve --model ...), or point this process at the service of its model",
                self.socket.display(),
                want.describe(),
            )));
        }
        Ok(client)
    }
}
