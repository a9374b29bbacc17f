//! Direct I/O on the host: the one alignment kvtier issues every `O_DIRECT` buffer,
//! offset and length at, the buffer type that holds it, and the kernel's own word on the
//! alignment a file needs (statx `STATX_DIOALIGN`).

use std::alloc::{self, Layout};
use std::fmt;
use std::io;
use std::mem::MaybeUninit;
use std::os::fd::{AsFd, AsRawFd};
use std::ptr::NonNull;

/// Alignment (bytes) of every direct I/O buffer, offset and length kvtier issues.
pub const DIRECT_IO_ALIGN: usize = 4096;

/// A zeroed heap buffer aligned to [`DIRECT_IO_ALIGN`], its length a multiple of it: what
/// `O_DIRECT` and NVMe need.
pub struct AlignedBuf {
    ptr: NonNull<u8>,
    len: usize,
}

// SAFETY: AlignedBuf uniquely owns its allocation (like a Box<[u8]>); there is no shared
// or thread-local state, so moving it to another thread is sound.
unsafe impl Send for AlignedBuf {}
// SAFETY: shared access only hands out `&[u8]` / `*const u8`; mutation needs `&mut self`.
unsafe impl Sync for AlignedBuf {}

impl AlignedBuf {
    fn layout(len: usize) -> Layout {
        // Cannot fail for the lengths `zeroed` accepts: the alignment is a power of two and
        // a length that overflows isize when rounded is rejected here with a clear panic.
        Layout::from_size_align(len, DIRECT_IO_ALIGN).expect("AlignedBuf length overflows isize")
    }

    /// A zeroed buffer of `len` bytes.
    ///
    /// # Panics
    /// If `len` is 0 or not a multiple of [`DIRECT_IO_ALIGN`] (a programming error: every
    /// direct I/O length is). Allocation failure calls [`alloc::handle_alloc_error`].
    pub fn zeroed(len: usize) -> AlignedBuf {
        assert!(
            len != 0 && len % DIRECT_IO_ALIGN == 0,
            "AlignedBuf length {len} must be a non-zero multiple of {DIRECT_IO_ALIGN}"
        );
        let layout = Self::layout(len);
        // SAFETY: `layout` has a non-zero size (checked above).
        let raw = unsafe { alloc::alloc_zeroed(layout) };
        let Some(ptr) = NonNull::new(raw) else {
            alloc::handle_alloc_error(layout)
        };
        AlignedBuf { ptr, len }
    }

    /// Bytes in the buffer.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Always false: a buffer is never empty (see [`AlignedBuf::zeroed`]).
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The buffer's bytes.
    pub fn as_slice(&self) -> &[u8] {
        // SAFETY: `ptr` points to `len` initialised (zeroed at allocation) bytes owned by
        // self, alive for the borrow of self.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }

    /// The buffer's bytes, writable.
    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: as in `as_slice`, and `&mut self` makes this the only reference.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) }
    }

    /// Its address, for I/O submission.
    pub fn as_ptr(&self) -> *const u8 {
        self.ptr.as_ptr()
    }

    /// Its address, writable, for I/O submission.
    pub fn as_mut_ptr(&mut self) -> *mut u8 {
        self.ptr.as_ptr()
    }
}

impl Drop for AlignedBuf {
    fn drop(&mut self) {
        // SAFETY: `ptr` was allocated by `alloc_zeroed` with exactly this layout and is
        // freed only here, once.
        unsafe { alloc::dealloc(self.ptr.as_ptr(), Self::layout(self.len)) }
    }
}

impl fmt::Debug for AlignedBuf {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("AlignedBuf")
            .field("len", &self.len)
            .finish()
    }
}

/// The direct I/O alignments the kernel reports for an open file (statx
/// `STATX_DIOALIGN`, Linux 6.1+).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct DioAlign {
    /// Alignment of user memory buffers, bytes.
    pub memory: u32,
    /// Alignment of file offsets and lengths, bytes.
    pub offset: u32,
}

/// The direct I/O alignments of the open file `file`: `Ok(None)` when the kernel or the
/// filesystem does not report them (kernel < 6.1, or a filesystem without the field).
pub(crate) fn dio_align(file: impl AsFd) -> io::Result<Option<DioAlign>> {
    let mut stx = MaybeUninit::<libc::statx>::zeroed();
    // SAFETY: statx with AT_EMPTY_PATH and an empty C string stats the open fd and writes
    // at most one `struct statx` into `stx`, which is live and large enough.
    let rc = unsafe {
        libc::statx(
            file.as_fd().as_raw_fd(),
            c"".as_ptr(),
            libc::AT_EMPTY_PATH,
            libc::STATX_DIOALIGN,
            stx.as_mut_ptr(),
        )
    };
    if rc != 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: the struct was zero-initialised (a valid value for this plain-integer struct)
    // and then filled by a successful statx.
    let stx = unsafe { stx.assume_init() };
    if stx.stx_mask & libc::STATX_DIOALIGN == 0 {
        return Ok(None);
    }
    Ok(Some(DioAlign {
        memory: stx.stx_dio_mem_align,
        offset: stx.stx_dio_offset_align,
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn aligned_buf_is_aligned_and_zeroed() {
        for len in [4096, 8192, 1 << 20] {
            let mut buf = AlignedBuf::zeroed(len);
            assert_eq!(buf.len(), len);
            assert!(!buf.is_empty());
            assert_eq!(buf.as_ptr() as usize % DIRECT_IO_ALIGN, 0);
            assert!(buf.as_slice().iter().all(|&b| b == 0));
            buf.as_mut_slice()[len - 1] = 9;
            assert_eq!(buf.as_slice()[len - 1], 9);
            assert_eq!(buf.as_mut_ptr() as usize % DIRECT_IO_ALIGN, 0);
        }
        fn assert_send_sync<T: Send + Sync>() {}
        assert_send_sync::<AlignedBuf>();
    }

    #[test]
    #[should_panic(expected = "multiple of 4096")]
    fn aligned_buf_rejects_unaligned_length() {
        let _ = AlignedBuf::zeroed(1000);
    }

    #[test]
    #[should_panic(expected = "non-zero")]
    fn aligned_buf_rejects_zero_length() {
        let _ = AlignedBuf::zeroed(0);
    }

    #[test]
    fn dio_align_of_a_temp_file_is_a_power_of_two_or_unreported() {
        let path = std::env::temp_dir().join(format!("kvtier-dio-align-{}", std::process::id()));
        let file = std::fs::File::create(&path).unwrap();
        let got = dio_align(&file);
        std::fs::remove_file(&path).unwrap();
        match got.unwrap() {
            // A filesystem that reports it but cannot do direct I/O says 0.
            Some(a) if a.memory != 0 => {
                assert!(
                    a.memory.is_power_of_two() && a.offset.is_power_of_two(),
                    "{a:?}"
                );
                assert!(a.offset as usize <= DIRECT_IO_ALIGN, "{a:?}");
            }
            _ => {}
        }
    }
}
