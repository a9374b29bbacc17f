//! `TierBuilder::service(PATH)`: the builder's road to the node's shared
//! pool. It ends in a [`ServiceClient`], which answers the same
//! [`TierApi`] as the in-process [`crate::TierHandle`] that `build()` makes
//! without it.

use super::client::ServiceClient;
use super::staged_client::{check_staged_memory, staging_for_slice, StagedServiceClient};
use crate::error::{Error, Result};
use crate::handle::TierBuilder;
use crate::memory::{HostKvCache, KvMemory};
use crate::model::{KvGeometry, NamedGeometry};
use crate::staged::StagingConfig;
use std::path::PathBuf;
use std::sync::Arc;

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

    /// Serve this process's own KV memory in GPU memory through the
    /// service: the slice the service shares becomes the staged path's
    /// staging (`crate::staged`), registered as pinned here; loads are
    /// copied into `mem` on this process's copy stream, stores gathered
    /// from it with GPU checksums. `build()` then gives a
    /// [`StagedServiceClient`], the same handle API with per-layer copy
    /// marks and counters as an in-process staged handle.
    ///
    /// # Safety
    /// As [`TierBuilder::memory`]: every byte `mem` describes stays
    /// allocated until the client is closed or its last clone dropped.
    pub unsafe fn memory(self, mem: KvMemory) -> StagedServiceBuilder {
        StagedServiceBuilder {
            base: self,
            memory: mem,
            double: None,
            host_double: false,
            staging: None,
        }
    }

    /// The staged path through the service with `cache` (host memory)
    /// standing in for the GPU's KV memory and the CPU doing the staging
    /// kernels' copies: the test double of [`Self::memory`].
    #[doc(hidden)]
    pub fn staged_host_double(self, cache: Arc<HostKvCache>) -> StagedServiceBuilder {
        StagedServiceBuilder {
            base: self,
            memory: cache.memory().clone(),
            double: Some(cache),
            host_double: true,
            staging: None,
        }
    }

    /// As [`Self::staged_host_double`] over host memory the caller owns
    /// (CPU tensors posing as the GPU's KV memory: the bindings' double).
    ///
    /// # Safety
    /// As [`Self::memory`]; `mem` must be host memory.
    #[doc(hidden)]
    pub unsafe fn staged_host_double_memory(self, mem: KvMemory) -> StagedServiceBuilder {
        StagedServiceBuilder {
            base: self,
            memory: mem,
            double: None,
            host_double: true,
            staging: None,
        }
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

/// A [`ServiceBuilder`] for KV memory of this process's own in GPU memory
/// (the staged path over the service's shared slice).
pub struct StagedServiceBuilder {
    base: ServiceBuilder,
    memory: KvMemory,
    double: Option<Arc<HostKvCache>>,
    /// Host memory standing in for GPU memory (the CPU double).
    host_double: bool,
    staging: Option<StagingConfig>,
}

impl std::fmt::Debug for StagedServiceBuilder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StagedServiceBuilder")
            .field("base", &self.base)
            .field("memory", &self.memory)
            .field("double", &self.double.is_some())
            .field("staging", &self.staging)
            .finish()
    }
}

impl StagedServiceBuilder {
    /// How the shared slice is cut into staging (default:
    /// [`super::staged_client::staging_for_slice`] of its blocks); it must
    /// fit the blocks the service shares. `load_blocks` or `store_blocks` 0:
    /// that default's (and with `store_blocks` 0, its store chunks too).
    pub fn staging(mut self, cfg: StagingConfig) -> Self {
        self.staging = Some(cfg);
        self
    }

    /// Blocks of staging the service shares with this process (default 0:
    /// as many as it gives a client).
    pub fn blocks(mut self, blocks: u32) -> Self {
        self.base.blocks = blocks;
        self
    }

    /// Connect, check the geometry and the memory, start the staged path.
    pub fn build(self) -> Result<StagedServiceClient> {
        if self.host_double {
            if self.memory.kind != crate::memory::MemoryKind::Host {
                return Err(Error::invalid(
                    "the staged double copies with the CPU: its stand-in KV memory must be host memory",
                ));
            }
        } else {
            check_staged_memory(&self.memory)?;
        }
        let socket = self.base.socket.clone();
        let base = ServiceBuilder {
            geometry: Some(self.base.geometry.unwrap_or(self.memory.geometry)),
            ..self.base
        };
        let client = base.build()?;
        let served_by = format!(
            "the kvtier service at {} serves the pool with it; this process's GPU KV memory goes through the staged path over the memory the service shares",
            socket.display()
        );
        let d = staging_for_slice(client.memory_blocks());
        let staging = self.staging.map(|s| {
            let or = |v: u32, d: u32| if v == 0 { d } else { v };
            let mut c = StagingConfig::new(
                s.layer_buffers,
                or(s.load_blocks, d.load_blocks),
                or(s.store_blocks, d.store_blocks),
            )
            .with_store_chunk_blocks(s.store_chunk_blocks);
            if s.store_blocks == 0 && s.store_chunk_blocks == 0 {
                c = c.with_store_chunk_blocks(d.store_chunk_blocks);
            }
            c
        });
        // SAFETY: the caller of `memory(..)` promised `memory` outlives the
        // client; the double's cache is kept alive by the client.
        unsafe { StagedServiceClient::open(client, self.memory, staging, self.double, served_by) }
    }
}
