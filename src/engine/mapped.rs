//! Registered memory as a controller sees it, shared by the engines that
//! hand the device addresses (nvme, gpu): the P2P table's regions mapped
//! through the controller's allocator ([`DmaAlloc::map_host`]: IOMMU
//! mappings, or locked pages and their frames), and each entry's device
//! extents looked up in them.
//!
//! [`DmaAlloc::map_host`]: crate::nvme::ctrl::DmaAlloc::map_host

use crate::error::{Error, Result};
use crate::nvme::ctrl::HostMapping;
use crate::nvme::spec::Extent;
use crate::p2p::{MemRegion, P2pTable};

/// The mappings of one table's regions for one DMA address space.
#[derive(Default)]
pub(crate) struct MappedTable {
    /// Sorted by host address.
    mappings: Vec<(MemRegion, HostMapping)>,
}

impl MappedTable {
    /// Maps every region of `table` with `map`. Built whole and only then
    /// swapped in by the engine, so a failure leaves the mappings in use
    /// untouched (re-registration maps the memory a second time for a
    /// moment; it is rare, and never half-done).
    pub fn build(
        table: &P2pTable,
        mut map: impl FnMut(&MemRegion) -> Result<HostMapping>,
    ) -> Result<MappedTable> {
        let mut mappings = Vec::with_capacity(table.regions().len());
        for r in table.regions() {
            mappings.push((*r, map(r)?));
        }
        mappings.sort_by_key(|(r, _)| r.addr);
        Ok(MappedTable { mappings })
    }

    /// Appends the device extents of host `addr..addr + len` to `out`
    /// (merged among themselves); false if it lies outside every mapping.
    pub fn translate(&self, addr: u64, len: u64, out: &mut Vec<Extent>) -> bool {
        let at = self.mappings.partition_point(|(r, _)| r.addr <= addr);
        at > 0 && self.mappings[at - 1].1.translate(addr, len, out)
    }
}

/// Engines swap their view of memory only with nothing in flight.
/// `IoEngine::remap_memory` for an engine whose mappings (IOMMU, physical
/// addresses, a GPU's view of pinned host memory) name the pages pinned
/// at registration: register `table` again once nothing is in flight
/// (`Ok(false)` until then).
pub(crate) fn remap_when_idle<E: super::IoEngine + ?Sized>(
    engine: &mut E,
    table: Option<std::sync::Arc<crate::p2p::P2pTable>>,
) -> Result<bool> {
    if engine.in_flight() > 0 {
        return Ok(false);
    }
    match table {
        Some(table) => engine.register_memory(table).map(|()| true),
        None => Ok(true),
    }
}

pub(crate) fn refuse_if_in_flight(in_flight: usize) -> Result<()> {
    if in_flight > 0 {
        return Err(Error::invalid(
            "cannot register memory with I/O in flight; wait for every job first",
        ));
    }
    Ok(())
}
