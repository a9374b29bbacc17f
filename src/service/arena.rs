//! The service's KV memory: one registered region made of per-client slices.
//!
//! A tier registers its KV memory once (its P2P table, io_uring's fixed
//! buffers pinned at registration), so the service cannot take each client's
//! own allocation as it connects. It reserves one address range instead and
//! fills it with `slots` slices of `slot_blocks` blocks, each slice a sealed
//! memfd of its own, mapped in place: the tier sees one block-major KV memory
//! of `slots * slot_blocks` blocks per layer, and a client maps only its own
//! slice's file, so it can neither see nor name another client's blocks
//! (the service translates its block numbers and bounds them to its slice).
//!
//! A slice's file is its client's for good: the client keeps its mapping
//! after it disconnects (or is dropped) for as long as its process lives,
//! so the next client of the slice gets a new file mapped over the same
//! addresses, never the last one's, and the engine is told each time that
//! new pages back them (`Tier::remap_memory`): first a placeholder
//! (`vacate`), so that neither the service nor the engine holds the old
//! file's pages (reserved huge pages go back to the system once the last
//! client unmaps them), then the new file (`renew`). The placeholder is one
//! small file, a layer's slice long, mapped over every layer of every
//! vacated slice: io_uring pins what it registers, so a placeholder of the
//! slice's whole size would cost that much memory while it lasts.
//!
//! Inside a slice's file layer `l` of block `b` is at
//! `l * slot_stride + 2 * b * object_bytes` (K, then V): per layer, a tensor
//! shaped `(slot_blocks, 2, block_size, kv_heads, head_dim)`, the layout of
//! vLLM's CPU KV cache.

use super::board::lock;
use super::sys::{sealed_memfd, Reservation};
use crate::memory::hugetlb_free_bytes;
use crate::error::{Error, Result};
use crate::host::size::human_bytes;
use crate::memory::{KvLayout, KvMemory, MemoryKind};
use crate::model::KvGeometry;
use crate::p2p::MemRegion;
use std::os::fd::OwnedFd;
use std::sync::Mutex;

const PAGE: u64 = 4096;
/// A reserved (hugetlbfs) page.
const HUGE_PAGE: u64 = 2 << 20;

/// The fewest blocks whose K and V objects fill whole pages of `page`
/// bytes (a client's layer is that many blocks, or a multiple).
fn blocks_per_page(geometry: &KvGeometry, page: u64) -> u64 {
    page / crate::model::gcd(page, 2 * geometry.object_bytes())
}

/// Where layer `l` of slice `s` starts in the reservation: layers of
/// `slots` slices of `slot_stride` bytes each, one after another.
fn slice_offset(slots: u32, slot_stride: u64, s: u32, l: u64) -> u64 {
    (l * slots as u64 + s as u64) * slot_stride
}

/// Refuses an arena of `total` bytes in small pages that the machine's
/// available memory cannot hold: the engine pins the arena when it
/// registers it (io_uring's fixed buffers), so every page is faulted in at
/// start, and `--clients 64 --client-blocks 65536` of an 8B model (8 TiB)
/// grew the service until the OOM killer ended it, and others with it.
fn fits_in_memory(geometry: &KvGeometry, slots: u32, slot_blocks: u32, total: u64) -> Result<()> {
    let Some(avail) = crate::host::mem_available() else {
        return Ok(());
    };
    if total <= avail {
        return Ok(());
    }
    let per_block = 2 * geometry.object_bytes() * geometry.layers as u64 * slots as u64;
    let step = blocks_per_page(geometry, PAGE);
    let most = (avail / per_block.max(1)) / step * step;
    Err(Error::invalid(format!(
        "the service's KV memory of {slots} clients x {slot_blocks} blocks is {} but this machine has {} of memory available, and it is all held (pinned) while the service runs: give fewer clients or client blocks (at most {most} blocks each for {slots} clients), or reserve huge pages for it",
        human_bytes(total),
        human_bytes(avail)
    )))
}

/// Every client slice, mapped into one reservation.
pub struct Arena {
    reservation: Reservation,
    /// Each slice's file now; `None` while a slice is between clients.
    files: Mutex<Vec<Option<OwnedFd>>>,
    /// What a vacated slice's layers map: one layer's slice of pages no
    /// client has, shared by every vacated slice and layer (nothing reads
    /// or writes it; it only stands in for the engine's registration).
    placeholder: OwnedFd,
    geometry: KvGeometry,
    slots: u32,
    slot_blocks: u32,
    huge: bool,
}

impl Arena {
    /// Map `slots` slices of `slot_blocks` blocks of `geometry`.
    pub fn new(geometry: KvGeometry, slots: u32, slot_blocks: u32) -> Result<Arena> {
        geometry.validate()?;
        if slots == 0 || slot_blocks == 0 {
            return Err(Error::invalid(
                "the service needs at least one client slot of at least one block (ServiceConfig: clients, client_blocks)",
            ));
        }
        let pair = 2 * geometry.object_bytes();
        let slot_stride = slot_blocks as u64 * pair;
        if slot_stride % PAGE != 0 {
            return Err(Error::invalid(format!(
                "a client's layer is {slot_stride} bytes ({slot_blocks} blocks of K and V), not whole pages, which the shared mappings need: make the service's client_blocks a multiple of {}",
                blocks_per_page(&geometry, PAGE)
            )));
        }
        let total = slot_stride
            .checked_mul(geometry.layers as u64)
            .and_then(|x| x.checked_mul(slots as u64))
            .ok_or_else(|| Error::invalid("the service's KV memory overflows 64 bits"))?;
        // Reserved huge pages where the system has them free for the whole
        // arena and every mapping is whole 2 MiB pages: each 2 MiB of a
        // load or store is then one DMA segment, as in an engine's own
        // memory, whatever shmem_enabled says (this VM's kernel: never, and
        // 4 KiB pages cost transfers up to a third of their speed). Mapping
        // can still fail when another process takes the pages first: then
        // the arena is built again in small pages.
        let huge = slot_stride % HUGE_PAGE == 0 && hugetlb_free_bytes() >= total;
        if !huge {
            // Small pages for certain: said before reserving the addresses
            // (past the address space that failed as a bare ENOMEM).
            fits_in_memory(&geometry, slots, slot_blocks, total)?;
        }
        let reservation = Reservation::new(total)?;
        let map_all = |huge| -> Result<Vec<OwnedFd>> {
            (0..slots)
                .map(|s| Self::map_slice(&reservation, geometry.layers, slots, slot_stride, s, huge))
                .collect()
        };
        let files = match huge.then(|| map_all(true)) {
            Some(Ok(files)) => Some(files),
            Some(Err(_)) => {
                reservation.unmap(0, total)?;
                // Small pages after all: the check the start skipped.
                fits_in_memory(&geometry, slots, slot_blocks, total)?;
                None
            }
            None => None,
        };
        let huge = files.is_some();
        let files = match files {
            Some(f) => f,
            None => map_all(false)?,
        };
        Ok(Arena {
            reservation,
            files: Mutex::new(files.into_iter().map(Some).collect()),
            placeholder: sealed_memfd("kvtier-vacated", slot_stride, false)?,
            geometry,
            slots,
            slot_blocks,
            huge,
        })
    }

    /// Make slice `s`'s file and map it, each layer at its `slice_offset`
    /// in the reservation (over whatever was mapped there).
    fn map_slice(
        reservation: &Reservation,
        layers: u32,
        slots: u32,
        slot_stride: u64,
        s: u32,
        huge: bool,
    ) -> Result<OwnedFd> {
        let fd = sealed_memfd(
            &format!("kvtier-client-{s}"),
            slot_stride * layers as u64,
            huge,
        )?;
        for l in 0..layers as u64 {
            reservation.map_fixed(
                slice_offset(slots, slot_stride, s, l),
                slot_stride,
                &fd,
                l * slot_stride,
            )?;
        }
        Ok(fd)
    }

    /// Let go of slice `s`'s file: the placeholder over each of its layers,
    /// and the service's descriptor closed. No job may use the slice. An
    /// error leaves the slice unusable: the caller retires it.
    pub fn vacate(&self, s: u32) -> Result<()> {
        for l in 0..self.geometry.layers as u64 {
            self.reservation.map_fixed(
                slice_offset(self.slots, self.slot_stride(), s, l),
                self.slot_stride(),
                &self.placeholder,
                0,
            )?;
        }
        // The service's own descriptor: the file lives on only in the last
        // client's mapping (and the engine's registration, until told).
        lock(&self.files)[s as usize] = None;
        Ok(())
    }

    /// Give slice `s` memory no earlier client maps: a new file (zeroed,
    /// like any new file), mapped over the slice's addresses. In reserved
    /// 2 MiB pages where the arena is and enough are free; `Ok(None)` when
    /// they are not free yet and `small_ok` is false (the pages its last
    /// client had go back once that client unmaps them and the engine's
    /// registration lets go, which may lag: the caller asks again a little
    /// later), else in small pages. Returns whether in huge pages. No job
    /// may use the slice, and the engine must be told (`ranges`,
    /// `Tier::remap_memory`) before one does. An error leaves the slice
    /// unusable: the caller retires it.
    pub fn renew(&self, s: u32, small_ok: bool) -> Result<Option<bool>> {
        let (layers, slots, stride) = (self.geometry.layers, self.slots, self.slot_stride());
        let bytes = self.slot_file_bytes();
        let huge_fd = (self.huge && hugetlb_free_bytes() >= bytes)
            .then(|| Self::map_slice(&self.reservation, layers, slots, stride, s, true))
            .and_then(|r| r.ok());
        let huge = huge_fd.is_some();
        let fd = match huge_fd {
            Some(fd) => fd,
            None if self.huge && !small_ok => return Ok(None),
            None => Self::map_slice(&self.reservation, layers, slots, stride, s, false)?,
        };
        lock(&self.files)[s as usize] = Some(fd);
        Ok(Some(huge))
    }

    /// Slice `s`'s addresses in the tier's KV memory, a range per layer.
    pub fn ranges(&self, s: u32) -> Vec<MemRegion> {
        (0..self.geometry.layers as u64)
            .map(|l| MemRegion {
                addr: self.reservation.addr() + slice_offset(self.slots, self.slot_stride(), s, l),
                len: self.slot_stride(),
            })
            .collect()
    }

    /// Whether the slices are in reserved 2 MiB pages.
    pub fn huge_pages(&self) -> bool {
        self.huge
    }

    /// Blocks per client that make a client's layer whole 2 MiB pages (the
    /// condition for reserved huge pages).
    pub fn huge_page_blocks(geometry: &KvGeometry) -> u64 {
        blocks_per_page(geometry, HUGE_PAGE)
    }

    /// The tier's view: one block-major KV memory over every slice.
    pub fn kv_memory(&self) -> KvMemory {
        KvMemory {
            geometry: self.geometry,
            num_blocks: self.slots * self.slot_blocks,
            layout: KvLayout::BlockMajor {
                layer_bases: (0..self.geometry.layers as u64)
                    .map(|l| self.reservation.addr() + slice_offset(self.slots, self.slot_stride(), 0, l))
                    .collect(),
            },
            kind: MemoryKind::Host,
        }
    }

    /// Bytes of one layer of one slice.
    pub fn slot_stride(&self) -> u64 {
        2 * self.slot_blocks as u64 * self.geometry.object_bytes()
    }

    /// Bytes of a slice's file.
    pub fn slot_file_bytes(&self) -> u64 {
        self.slot_stride() * self.geometry.layers as u64
    }

    /// Blocks per slice.
    pub fn slot_blocks(&self) -> u32 {
        self.slot_blocks
    }

    /// Slices.
    pub fn slots(&self) -> u32 {
        self.slots
    }

    /// Slice `s`'s file, to send to its client (a descriptor of its own).
    pub fn file(&self, s: u32) -> Result<OwnedFd> {
        match &lock(&self.files)[s as usize] {
            Some(fd) => fd
                .try_clone()
                .map_err(|e| Error::io("duplicating a client's shared memory descriptor", e)),
            None => Err(Error::invalid(format!(
                "client slot {s} has no memory: it is between clients"
            ))),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// llama3-8b's 32 KiB objects: 32 blocks of K and V per 2 MiB page; a
    /// 4 KiB page is always whole (objects are 4 KiB multiples).
    #[test]
    fn blocks_per_page_fill_whole_pages() {
        let g = crate::model::preset("llama3-8b", 16).unwrap();
        assert_eq!(Arena::huge_page_blocks(&g), 32);
        assert_eq!(blocks_per_page(&g, PAGE), 1);
        let g = crate::model::preset("llama3-8b", 48).unwrap();
        // 96 KiB objects, 192 KiB a block's pair: 2 MiB / gcd(2 MiB, 192 KiB).
        assert_eq!(Arena::huge_page_blocks(&g), 32);
        assert_eq!(32 * 2 * g.object_bytes() % HUGE_PAGE, 0);
    }
}
