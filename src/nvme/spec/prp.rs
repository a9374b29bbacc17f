//! PRP building: the PRP entries and PRP lists of a transfer over memory extents.

use super::*;

/// A DMA extent (device-visible address and byte length) to describe with PRPs.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Extent {
    /// Start address.
    pub addr: u64,
    /// Bytes.
    pub len: u64,
}

impl From<SglDescriptor> for Extent {
    fn from(d: SglDescriptor) -> Extent {
        Extent {
            addr: d.addr,
            len: d.len as u64,
        }
    }
}

impl From<&SglDescriptor> for Extent {
    fn from(d: &SglDescriptor) -> Extent {
        Extent::from(*d)
    }
}

impl From<&Extent> for Extent {
    fn from(e: &Extent) -> Extent {
        *e
    }
}

/// Why memory cannot be described with PRPs (or the PRP list does not fit).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PrpError {
    /// The memory page size is not a power of two of at least 4 KiB.
    #[error("PRP: memory page size {0} is not a power of two of at least 4096")]
    PageSize(u64),
    /// A transfer of no bytes.
    #[error("PRP: a transfer of 0 bytes has no data pointer")]
    Empty,
    /// An extent of no bytes.
    #[error("PRP: extent {index} has length 0")]
    EmptyExtent {
        /// Which extent.
        index: usize,
    },
    /// An extent past the end of the address space.
    #[error("PRP: extent {index} at {addr:#x} + {len} bytes wraps the address space")]
    Overflow {
        /// Which extent.
        index: usize,
        /// Its start.
        addr: u64,
        /// Its bytes.
        len: u64,
    },
    /// The first extent is not dword aligned.
    #[error("PRP: the first extent starts at {addr:#x}, which is not 4-byte aligned")]
    UnalignedFirst {
        /// Its start.
        addr: u64,
    },
    /// An extent after the first starts off a page boundary.
    #[error("PRP: extent {index} starts at {addr:#x}, not on a {page}-byte page boundary; only the first extent may start mid-page (use an SGL for scattered memory)")]
    UnalignedStart {
        /// Which extent.
        index: usize,
        /// Its start.
        addr: u64,
        /// Memory page size.
        page: u64,
    },
    /// An extent before the last ends off a page boundary.
    #[error("PRP: extent {index} ends at {end:#x}, not on a {page}-byte page boundary; only the last extent may end mid-page (use an SGL for scattered memory)")]
    UnalignedEnd {
        /// Which extent.
        index: usize,
        /// Its end.
        end: u64,
        /// Memory page size.
        page: u64,
    },
    /// The PRP list memory is not page aligned.
    #[error("PRP: the PRP list at {addr:#x} is not aligned to the {page}-byte page")]
    ListUnaligned {
        /// The list's address.
        addr: u64,
        /// Memory page size.
        page: u64,
    },
    /// The PRP list pages given are too few.
    #[error("PRP: {entries} list entries need {pages} list page(s) of {page} bytes, but the list buffer holds {have} entries")]
    ListTooSmall {
        /// List entries needed.
        entries: usize,
        /// List pages needed.
        pages: usize,
        /// Memory page size.
        page: u64,
        /// List pages given.
        have: usize,
    },
}

fn check_page(page: u64) -> Result<(), PrpError> {
    if page < 4096 || !page.is_power_of_two() {
        return Err(PrpError::PageSize(page));
    }
    Ok(())
}

/// Validates `extents` against PRP's rules and counts the PRP entries (one
/// per memory page touched). The first extent may start at any dword-aligned
/// offset; every later one must start on a page boundary, and every one but
/// the last must end on one.
pub fn prp_entry_count<I>(extents: I, page: u64) -> Result<usize, PrpError>
where
    I: IntoIterator,
    I::Item: Into<Extent>,
{
    check_page(page)?;
    let extents: Vec<Extent> = extents.into_iter().map(Into::into).collect();
    validate_extents(&extents, page)?;
    Ok(count_entries(&extents, page))
}

fn validate_extents(extents: &[Extent], page: u64) -> Result<(), PrpError> {
    if extents.is_empty() {
        return Err(PrpError::Empty);
    }
    let last = extents.len() - 1;
    for (index, e) in extents.iter().enumerate() {
        if e.len == 0 {
            return Err(PrpError::EmptyExtent { index });
        }
        let end = e.addr.checked_add(e.len).ok_or(PrpError::Overflow {
            index,
            addr: e.addr,
            len: e.len,
        })?;
        if index == 0 {
            if e.addr % 4 != 0 {
                return Err(PrpError::UnalignedFirst { addr: e.addr });
            }
        } else if e.addr % page != 0 {
            return Err(PrpError::UnalignedStart {
                index,
                addr: e.addr,
                page,
            });
        }
        if index != last && end % page != 0 {
            return Err(PrpError::UnalignedEnd { index, end, page });
        }
    }
    Ok(())
}

fn count_entries(extents: &[Extent], page: u64) -> usize {
    extents
        .iter()
        .map(|e| ((e.addr % page) + e.len).div_ceil(page) as usize)
        .sum()
}

/// The PRP entries of validated extents, in order: the first byte's address,
/// then the start of every further page.
fn entries(extents: &[Extent], page: u64) -> impl Iterator<Item = u64> + '_ {
    extents.iter().flat_map(move |e| {
        let first_page = e.addr & !(page - 1);
        let pages = ((e.addr % page) + e.len).div_ceil(page);
        (0..pages).map(move |i| {
            if i == 0 {
                e.addr
            } else {
                first_page + i * page
            }
        })
    })
}

/// PRP list pages needed for `entries` PRP entries in all (PRP1 included):
/// none for up to two; else the list holds `entries - 1`, `page / 8` per page,
/// the last slot of each full page but the last pointing at the next page.
pub const fn prp_list_pages_for_entries(entries: usize, page: u64) -> usize {
    if entries <= 2 {
        return 0;
    }
    let list = entries - 1;
    let per_page = (page / 8) as usize;
    if list <= per_page {
        1
    } else {
        (list - 1).div_ceil(per_page - 1)
    }
}

/// PRP list pages needed for a `len`-byte transfer that starts on a page
/// boundary (kvtier's DMA buffers do). A transfer starting mid-page touches
/// one page more: count it with [`prp_entry_count`] and
/// [`prp_list_pages_for_entries`].
pub const fn prp_list_pages_needed(len: u64, page: u64) -> usize {
    prp_list_pages_for_entries(len.div_ceil(page) as usize, page)
}

/// A command's PRPs, as built by [`build_prps`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Prps {
    /// PRP entry 1.
    pub prp1: u64,
    /// PRP entry 2 (a second page, or the PRP list).
    pub prp2: u64,
    /// PRP entries in all (PRP1 included): the memory pages touched.
    pub entries: usize,
    /// Slots of the list buffer written (entries and chain pointers); 0 when
    /// no list is needed.
    pub list_slots: usize,
}

impl Prps {
    /// As the command's data pointer.
    pub const fn data_ptr(&self) -> DataPtr {
        DataPtr::Prp {
            prp1: self.prp1,
            prp2: self.prp2,
        }
    }
}

/// Describes `extents` with PRP1, PRP2 and, past two pages, a PRP list
/// written into `list` (memory the controller reads at DMA address
/// `list_dma`, page-aligned and DMA-contiguous for as many pages as
/// [`prp_list_pages_for_entries`] says; `list` may be empty when at most two
/// pages are touched). When the list spans pages, the last slot of each full
/// page holds the DMA address of the next page, as the spec requires.
pub fn build_prps<I>(
    extents: I,
    page: u64,
    list: &mut [u64],
    list_dma: u64,
) -> Result<Prps, PrpError>
where
    I: IntoIterator,
    I::Item: Into<Extent>,
{
    check_page(page)?;
    let extents: Vec<Extent> = extents.into_iter().map(Into::into).collect();
    validate_extents(&extents, page)?;
    let n = count_entries(&extents, page);
    let mut it = entries(&extents, page);
    let prp1 = it
        .next()
        .expect("validated extents touch at least one page");
    if n <= 2 {
        let prp2 = it.next().unwrap_or(0);
        return Ok(Prps {
            prp1,
            prp2,
            entries: n,
            list_slots: 0,
        });
    }
    if list_dma % page != 0 {
        return Err(PrpError::ListUnaligned {
            addr: list_dma,
            page,
        });
    }
    let pages = prp_list_pages_for_entries(n, page);
    let per_page = (page / 8) as usize;
    // The n - 1 entries after PRP1, plus a chain pointer per extra page.
    let need = (n - 1) + (pages - 1);
    if list.len() < need {
        return Err(PrpError::ListTooSmall {
            entries: n - 1,
            pages,
            page,
            have: list.len(),
        });
    }
    let mut slot = 0usize;
    let mut remaining = n - 1;
    for entry in it {
        if slot % per_page == per_page - 1 && remaining > 1 {
            list[slot] = list_dma + (slot as u64 + 1) * 8;
            slot += 1;
        }
        list[slot] = entry;
        slot += 1;
        remaining -= 1;
    }
    debug_assert_eq!(slot, need);
    Ok(Prps {
        prp1,
        prp2: list_dma,
        entries: n,
        list_slots: slot,
    })
}
