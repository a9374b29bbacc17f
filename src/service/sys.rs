//! The service's raw calls, behind safe types: sealed memfds, the arena's
//! address-space reservation and the fixed mappings inside it, a client's
//! mapping of its file, file descriptors over a Unix socket (`SCM_RIGHTS`),
//! and the peer's credentials (`SO_PEERCRED`).

use crate::error::{Error, Result};
use nix::sys::socket::{self, sockopt, ControlMessage, ControlMessageOwned, MsgFlags};
use std::io::{IoSlice, IoSliceMut};
use std::os::fd::{AsFd, AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::net::UnixStream;

fn last_os(what: &str) -> Error {
    Error::io(what, std::io::Error::last_os_error())
}

/// A memfd of fixed size, sealed so that nobody (the client it is given to
/// included) can shrink or grow it: a mapping of it can never fault past
/// its end (SIGBUS in the service). With `huge`, in reserved 2 MiB pages
/// (hugetlbfs: `bytes` a multiple of 2 MiB; mapping it fails where too few
/// are free).
pub fn sealed_memfd(name: &str, bytes: u64, huge: bool) -> Result<OwnedFd> {
    let cname = std::ffi::CString::new(name).map_err(|_| Error::invalid("memfd name has a NUL"))?;
    let flags = libc::MFD_CLOEXEC
        | libc::MFD_ALLOW_SEALING
        | if huge {
            libc::MFD_HUGETLB | libc::MFD_HUGE_2MB
        } else {
            0
        };
    // SAFETY: a valid C string; the flags are constants.
    let fd = unsafe { libc::memfd_create(cname.as_ptr(), flags) };
    if fd < 0 {
        return Err(last_os("memfd_create for a client's shared KV memory"));
    }
    // SAFETY: fd was just returned to us and is owned by nobody else.
    let fd = unsafe { OwnedFd::from_raw_fd(fd) };
    // SAFETY: ftruncate on our own fd.
    if unsafe { libc::ftruncate(fd.as_raw_fd(), bytes as libc::off_t) } != 0 {
        return Err(last_os("sizing a client's shared KV memory (ftruncate)"));
    }
    // Not F_SEAL_SEAL: the client adds F_SEAL_FUTURE_WRITE once it has
    // mapped the file (`seal_after_mapping`), and then seals the seals.
    let seals = libc::F_SEAL_SHRINK | libc::F_SEAL_GROW;
    // SAFETY: fcntl on our own fd with an int argument.
    if unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_ADD_SEALS, seals) } != 0 {
        return Err(last_os("sealing a client's shared KV memory"));
    }
    Ok(fd)
}

/// Seal a shared memory file its client has mapped: no hole can be punched
/// in it from now on (F_SEAL_FUTURE_WRITE refuses fallocate's PUNCH_HOLE,
/// write(2) and new writable mappings; the mappings made stay writable),
/// so a page the service touches can never vanish under it (a hole in
/// reserved huge pages faults SIGBUS when none are free), and no seal can
/// be added or taken after.
pub fn seal_after_mapping(fd: &OwnedFd) -> Result<()> {
    let seals = libc::F_SEAL_FUTURE_WRITE | libc::F_SEAL_SEAL;
    // SAFETY: fcntl on a valid fd with an int argument.
    if unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_ADD_SEALS, seals) } != 0 {
        return Err(last_os(
            "sealing the KV memory shared with the kvtier service (F_SEAL_FUTURE_WRITE)",
        ));
    }
    Ok(())
}

/// Whether `fd` carries F_SEAL_FUTURE_WRITE (its client sealed it).
pub fn sealed_against_holes(fd: &OwnedFd) -> bool {
    // SAFETY: fcntl F_GET_SEALS on a valid fd.
    let seals = unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_GET_SEALS) };
    seals >= 0 && seals & libc::F_SEAL_FUTURE_WRITE != 0
}

/// Fault in every page of `len` bytes at `addr` (a mapping of ours) for
/// writing; an error (a hole no page can fill) instead of a SIGBUS later.
pub fn populate_for_write(addr: u64, len: u64) -> Result<()> {
    // SAFETY: madvise on a range the caller mapped; POPULATE_WRITE only
    // faults pages in (it never changes their contents).
    if unsafe {
        libc::madvise(
            addr as *mut libc::c_void,
            len as usize,
            libc::MADV_POPULATE_WRITE,
        )
    } != 0
    {
        return Err(last_os("faulting in a client's shared KV memory"));
    }
    Ok(())
}

/// The oldest kernel the service runs on: it faults a client's slice in
/// with MADV_POPULATE_WRITE (5.14) and re-registers io_uring fixed buffers
/// in place with IORING_REGISTER_BUFFERS_UPDATE (5.13); on an older one
/// every client would be dropped at its first job and every slot retired at
/// its first disconnect, so the service refuses to start.
pub const MIN_KERNEL: (u32, u32) = (5, 14);

/// Refuses a kernel older than [`MIN_KERNEL`] (an unreadable release is
/// let through: the calls then say what fails).
pub fn check_kernel() -> Result<()> {
    let Ok(release) = std::fs::read_to_string("/proc/sys/kernel/osrelease") else {
        return Ok(());
    };
    match crate::host::kernel_version(&release) {
        Some(v) if v < MIN_KERNEL => Err(Error::Unsupported(format!(
            "kvtier serve needs Linux {}.{} or newer (MADV_POPULATE_WRITE, io_uring buffer updates); this kernel is {}: run the service on a newer kernel, or give each engine a pool of its own",
            MIN_KERNEL.0,
            MIN_KERNEL.1,
            release.trim()
        ))),
        _ => Ok(()),
    }
}

/// Whether `fd` is a memfd of exactly `bytes` that nobody can resize.
pub fn check_sealed(fd: &OwnedFd, bytes: u64) -> Result<()> {
    // SAFETY: fcntl F_GET_SEALS on a valid fd.
    let seals = unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_GET_SEALS) };
    let need = libc::F_SEAL_SHRINK | libc::F_SEAL_GROW;
    if seals < 0 || seals & need != need {
        return Err(Error::invalid(
            "the shared memory file the kvtier service sent is not a sealed memfd; is the socket a kvtier service?",
        ));
    }
    let size = std::fs::File::from(fd.try_clone().map_err(|e| Error::io("dup", e))?)
        .metadata()
        .map_err(|e| Error::io("fstat of the shared memory file", e))?
        .len();
    if size != bytes {
        return Err(Error::invalid(format!(
            "the shared memory file is {size} bytes, the service said {bytes}"
        )));
    }
    Ok(())
}

/// A range of address space reserved (no access, no memory) for the
/// arena's fixed mappings; unmapped on drop.
pub struct Reservation {
    base: *mut libc::c_void,
    len: usize,
}

// SAFETY: a plain address range; who reads or writes it is the users' contract.
unsafe impl Send for Reservation {}
// SAFETY: as above.
unsafe impl Sync for Reservation {}

impl Reservation {
    /// Reserve `len` bytes, 2 MiB aligned (so that huge pages can back
    /// the mappings inside).
    pub fn new(len: u64) -> Result<Reservation> {
        const ALIGN: usize = 2 << 20;
        let len = usize::try_from(len).map_err(|_| Error::invalid("arena too large"))?;
        let total = len
            .checked_add(ALIGN)
            .ok_or_else(|| Error::invalid("arena too large"))?;
        // SAFETY: an anonymous PROT_NONE mapping at an address of the kernel's choice.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                total,
                libc::PROT_NONE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE,
                -1,
                0,
            )
        };
        if p == libc::MAP_FAILED {
            return Err(last_os(
                "reserving address space for the service's KV arena",
            ));
        }
        let addr = p as usize;
        let aligned = addr.next_multiple_of(ALIGN);
        // SAFETY: trimming the head and tail of the mapping made above.
        unsafe {
            if aligned > addr {
                libc::munmap(p, aligned - addr);
            }
            let tail = total - (aligned - addr) - len;
            if tail > 0 {
                libc::munmap((aligned + len) as *mut libc::c_void, tail);
            }
        }
        Ok(Reservation {
            base: aligned as *mut libc::c_void,
            len,
        })
    }

    /// The reservation's first address.
    pub fn addr(&self) -> u64 {
        self.base as u64
    }

    /// Map `len` bytes of `fd` from `file_offset` read-write and shared at
    /// `offset` into the reservation (page-aligned, inside it).
    pub fn map_fixed(&self, offset: u64, len: u64, fd: &OwnedFd, file_offset: u64) -> Result<()> {
        let page = 4096u64;
        if offset % page != 0 || file_offset % page != 0 || len % page != 0 {
            return Err(Error::invalid(format!(
                "arena mapping at {offset}+{len} (file offset {file_offset}) is not page-aligned"
            )));
        }
        if offset.checked_add(len).is_none_or(|e| e > self.len as u64) {
            return Err(Error::invalid("arena mapping past the reservation"));
        }
        let at = (self.base as u64 + offset) as *mut libc::c_void;
        // SAFETY: MAP_FIXED inside our own reservation, replacing only
        // PROT_NONE pages or an earlier mapping of the same slice that no
        // job uses (a slice renewed for its next client); fd is a valid memfd.
        let p = unsafe {
            libc::mmap(
                at,
                len as usize,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED | libc::MAP_FIXED,
                fd.as_raw_fd(),
                file_offset as libc::off_t,
            )
        };
        if p == libc::MAP_FAILED {
            return Err(last_os(
                "mapping a client's KV memory into the service's arena",
            ));
        }
        // Huge pages where the kernel allows shmem THP (fewer DMA segments);
        // a refusal only costs segments (hugetlbfs pages refuse: they are huge).
        // SAFETY: advice on the mapping just made.
        unsafe { libc::madvise(at, len as usize, libc::MADV_HUGEPAGE) };
        Ok(())
    }

    /// Give `len` bytes at `offset` back to PROT_NONE address space (a
    /// mapping replaced before any I/O used it).
    pub fn unmap(&self, offset: u64, len: u64) -> Result<()> {
        if offset.checked_add(len).is_none_or(|e| e > self.len as u64) {
            return Err(Error::invalid("arena unmapping past the reservation"));
        }
        let at = (self.base as u64 + offset) as *mut libc::c_void;
        // SAFETY: MAP_FIXED over our own reservation, replacing a mapping
        // no I/O uses yet (the arena is being built).
        let p = unsafe {
            libc::mmap(
                at,
                len as usize,
                libc::PROT_NONE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE | libc::MAP_FIXED,
                -1,
                0,
            )
        };
        if p == libc::MAP_FAILED {
            return Err(last_os(
                "returning the service's KV arena to reserved space",
            ));
        }
        Ok(())
    }
}

impl Drop for Reservation {
    fn drop(&mut self) {
        // SAFETY: the whole reservation, mappings inside included; nobody
        // uses it any more (the arena outlives the tier that did I/O into it).
        unsafe { libc::munmap(self.base, self.len) };
    }
}

/// A client's shared mapping of the file the service sent.
pub struct SharedMapping {
    base: *mut u8,
    len: usize,
}

// SAFETY: raw shared memory; concurrent use is governed by the handle's
// memory contract (no writes to a block while a job uses it).
unsafe impl Send for SharedMapping {}
// SAFETY: as above.
unsafe impl Sync for SharedMapping {}

impl SharedMapping {
    /// Map all `len` bytes of `fd` read-write and shared.
    pub fn new(fd: &OwnedFd, len: u64) -> Result<SharedMapping> {
        let len = usize::try_from(len).map_err(|_| Error::invalid("shared memory too large"))?;
        // SAFETY: a new shared mapping of a sealed memfd of exactly `len`
        // bytes (checked by the caller), at an address of the kernel's choice.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                fd.as_raw_fd(),
                0,
            )
        };
        if p == libc::MAP_FAILED {
            return Err(last_os(
                "mapping the KV memory shared with the kvtier service",
            ));
        }
        Ok(SharedMapping {
            base: p as *mut u8,
            len,
        })
    }

    /// The first address.
    pub fn addr(&self) -> u64 {
        self.base as u64
    }

    /// Bytes mapped.
    pub fn len(&self) -> u64 {
        self.len as u64
    }

    /// Whether nothing is mapped.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Copy `out.len()` bytes from `offset` (bounds-checked).
    pub fn read(&self, offset: u64, out: &mut [u8]) -> Result<()> {
        self.check(offset, out.len())?;
        // SAFETY: in bounds (checked); the bytes are plain memory.
        unsafe {
            std::ptr::copy_nonoverlapping(
                self.base.add(offset as usize),
                out.as_mut_ptr(),
                out.len(),
            )
        };
        Ok(())
    }

    /// Copy `data` to `offset` (bounds-checked).
    pub fn write(&self, offset: u64, data: &[u8]) -> Result<()> {
        self.check(offset, data.len())?;
        // SAFETY: in bounds (checked); the bytes are plain memory.
        unsafe {
            std::ptr::copy_nonoverlapping(data.as_ptr(), self.base.add(offset as usize), data.len())
        };
        Ok(())
    }

    fn check(&self, offset: u64, n: usize) -> Result<()> {
        if offset
            .checked_add(n as u64)
            .is_none_or(|e| e > self.len as u64)
        {
            return Err(Error::invalid(format!(
                "{n} bytes at {offset} are past the {} bytes of shared KV memory",
                self.len
            )));
        }
        Ok(())
    }
}

impl Drop for SharedMapping {
    fn drop(&mut self) {
        // SAFETY: our own mapping; its users hold the Arc that owns us.
        unsafe { libc::munmap(self.base as *mut libc::c_void, self.len) };
    }
}

/// Send `bytes` with `fd` attached to the first of them.
pub fn send_with_fd(s: &UnixStream, bytes: &[u8], fd: &OwnedFd) -> Result<()> {
    let fds = [fd.as_raw_fd()];
    let cmsg = [ControlMessage::ScmRights(&fds)];
    let mut sent = 0;
    while sent < bytes.len() {
        let iov = [IoSlice::new(&bytes[sent..])];
        let c: &[ControlMessage] = if sent == 0 { &cmsg } else { &[] };
        match socket::sendmsg::<()>(s.as_raw_fd(), &iov, c, MsgFlags::MSG_NOSIGNAL, None) {
            Ok(n) => sent += n,
            Err(nix::errno::Errno::EINTR) => {}
            Err(e) => return Err(Error::io("sending a client its shared memory", e.into())),
        }
    }
    Ok(())
}

/// Read exactly `buf.len()` bytes, taking a file descriptor that rides
/// with them (at most one; others are closed).
pub fn recv_with_fd(s: &UnixStream, buf: &mut [u8]) -> Result<Option<OwnedFd>> {
    let mut got = 0;
    let mut fd: Option<OwnedFd> = None;
    while got < buf.len() {
        let mut space = nix::cmsg_space!([RawFd; 4]);
        let mut iov = [IoSliceMut::new(&mut buf[got..])];
        let msg = match socket::recvmsg::<()>(
            s.as_raw_fd(),
            &mut iov,
            Some(&mut space),
            MsgFlags::MSG_CMSG_CLOEXEC,
        ) {
            Ok(m) => m,
            Err(nix::errno::Errno::EINTR) => continue,
            Err(e) => return Err(Error::io("reading the kvtier service's welcome", e.into())),
        };
        let n = msg.bytes;
        if let Ok(cmsgs) = msg.cmsgs() {
            for c in cmsgs {
                if let ControlMessageOwned::ScmRights(fds) = c {
                    for raw in fds {
                        // SAFETY: the kernel just installed this fd for us.
                        let owned = unsafe { OwnedFd::from_raw_fd(raw) };
                        if fd.is_none() {
                            fd = Some(owned);
                        }
                    }
                }
            }
        }
        if n == 0 {
            return Err(Error::Closed(
                "the kvtier service closed the connection during the hello: it admits only its own user and the members of its group (its log names the refused uid)".into(),
            ));
        }
        got += n;
    }
    Ok(fd)
}

/// Who is on the other end of `s`.
#[derive(Clone, Copy, Debug)]
pub struct Peer {
    /// Process id.
    pub pid: i32,
    /// User id.
    pub uid: u32,
    /// Primary group id.
    pub gid: u32,
}

/// The peer's credentials (`SO_PEERCRED`: taken by the kernel at connect).
pub fn peer(s: &UnixStream) -> Result<Peer> {
    let c = socket::getsockopt(&s.as_fd(), sockopt::PeerCredentials)
        .map_err(|e| Error::io("reading the client's credentials (SO_PEERCRED)", e.into()))?;
    Ok(Peer {
        pid: c.pid(),
        uid: c.uid(),
        gid: c.gid(),
    })
}

/// Waits, as long as it takes, until `s` has bytes to read or its peer has
/// gone (a read then returns at once).
pub fn wait_readable(s: &UnixStream) -> Result<()> {
    use nix::poll::{PollFd, PollFlags, PollTimeout};
    loop {
        let mut pfd = [PollFd::new(s.as_fd(), PollFlags::POLLIN)];
        match nix::poll::poll(&mut pfd, PollTimeout::NONE) {
            Ok(_) => return Ok(()),
            Err(nix::errno::Errno::EINTR) => {}
            Err(e) => return Err(Error::io("waiting for a client's next request", e.into())),
        }
    }
}

/// The supplementary groups of process `pid` (empty when unreadable).
pub fn groups_of(pid: i32) -> Vec<u32> {
    let Ok(status) = std::fs::read_to_string(format!("/proc/{pid}/status")) else {
        return Vec::new();
    };
    status
        .lines()
        .find_map(|l| l.strip_prefix("Groups:"))
        .map(|g| {
            g.split_whitespace()
                .filter_map(|x| x.parse().ok())
                .collect()
        })
        .unwrap_or_default()
}

/// This process's effective uid.
pub fn my_uid() -> u32 {
    nix::unistd::geteuid().as_raw()
}

/// The longest Unix socket path (`sockaddr_un::sun_path` holds 108 bytes
/// with the terminating NUL).
const SOCKET_PATH_MAX: usize = 107;

/// Refuses a socket path longer than a Unix socket address holds, naming
/// the limit: the bind or connect said only "path must be shorter than
/// SUN_LEN", and the service said it after making its pool.
pub fn socket_path_fits(path: &std::path::Path) -> Result<()> {
    let n = path.as_os_str().len();
    if n > SOCKET_PATH_MAX {
        return Err(Error::invalid(format!(
            "the socket path {} is {n} bytes; a Unix socket's path is at most {SOCKET_PATH_MAX}: give a shorter one (a directory nearer /, such as /run/kvtier/kvtier.sock, or a path relative to the working directory)",
            path.display()
        )));
    }
    Ok(())
}

/// Bind a listening socket at `path` that only its owner can connect to
/// until [`restrict_socket`] says otherwise: created under a umask of 0177.
pub fn bind_private(path: &std::path::Path) -> Result<std::os::unix::net::UnixListener> {
    // The umask is process-wide: the service binds before it starts threads.
    let old = nix::sys::stat::umask(nix::sys::stat::Mode::from_bits_truncate(0o177));
    let r = std::os::unix::net::UnixListener::bind(path);
    nix::sys::stat::umask(old);
    r.map_err(|e| match e.kind() {
        // The start checked the path was free: another service (or any
        // process) bound it in between.
        std::io::ErrorKind::AddrInUse => Error::invalid(format!(
            "another process bound the socket {} while this kvtier service started (another service on the same path?): stop it, or give this one another socket path",
            path.display()
        )),
        _ => Error::io(format!("binding the service socket {}", path.display()), e),
    })
}

/// Make the socket at `path` mode 0660 owned by group `gid`.
pub fn share_with_group(path: &std::path::Path, gid: u32) -> Result<()> {
    nix::unistd::chown(path, None, Some(nix::unistd::Gid::from_raw(gid))).map_err(|e| {
        Error::io(
            format!("giving {} to group {gid}", path.display()),
            e.into(),
        )
    })?;
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o660))
        .map_err(|e| Error::io(format!("chmod 0660 {}", path.display()), e))
}

/// The gid of group `name` (or a number).
pub fn group_id(name: &str) -> Result<u32> {
    if let Ok(n) = name.parse::<u32>() {
        return Ok(n);
    }
    match nix::unistd::Group::from_name(name) {
        Ok(Some(g)) => Ok(g.gid.as_raw()),
        Ok(None) => Err(Error::invalid(format!(
            "no group named {name:?}: create it (groupadd) or give its number"
        ))),
        Err(e) => Err(Error::io(format!("looking up group {name:?}"), e.into())),
    }
}

/// Whether shared memory (memfd) can get transparent huge pages here:
/// `shmem_enabled` is `always`, `within_size`, `advise` (the arena asks) or
/// `force`. `None` when the kernel does not say.
pub fn shmem_huge_pages() -> Option<bool> {
    let s = std::fs::read_to_string("/sys/kernel/mm/transparent_hugepage/shmem_enabled").ok()?;
    let chosen = s.split_whitespace().find(|w| w.starts_with('['))?;
    Some(!matches!(chosen, "[never]" | "[deny]"))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Distribution kernels' release strings, and which the service takes.
    #[test]
    fn kernel_versions_are_read_and_old_ones_refused() {
        use crate::host::kernel_version;
        assert_eq!(kernel_version("6.1.0-28-amd64\n"), Some((6, 1)));
        assert_eq!(kernel_version("5.10.0-32-cloud-amd64"), Some((5, 10)));
        assert_eq!(
            kernel_version("5.14.0-427.13.1.el9_4.x86_64"),
            Some((5, 14))
        );
        assert_eq!(kernel_version("garbage"), None);
        assert!((5, 10) < MIN_KERNEL && (5, 14) >= MIN_KERNEL && (6, 1) >= MIN_KERNEL);
        check_kernel().expect("this machine's kernel is new enough for the tests");
    }

    /// A socket path something bound since the service checked it is
    /// refused naming the path and the fix, not a bare "Address in use".
    #[test]
    fn a_socket_bound_meanwhile_is_named() {
        let dir = crate::scratch::TestDir::new("bind-race");
        let path = dir.file("s.sock");
        let _first = bind_private(&path).unwrap();
        let e = bind_private(&path).unwrap_err().to_string();
        assert!(
            e.contains("s.sock") && e.contains("another socket path"),
            "{e}"
        );
    }
}
