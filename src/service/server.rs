//! The service: one [`TierHandle`] shared by every client on a Unix socket.
//!
//! Threads: the caller's runs the accept loop ([`Service::run`]); each
//! client has a reader (its requests, answered in order) and a writer (its
//! answers and events, from a bounded queue: a client that stops reading is
//! dropped, never waited for); one dispatcher routes the handle's events to
//! the clients whose jobs they are and collects every result.
//!
//! What a client may touch: its own slice of the arena (block numbers are
//! bounded to it and translated; a number outside it drops the client, as a
//! bad frame does), its own pins (an unpin of a key it did not pin does
//! nothing), its own jobs. When a client goes, its pins are dropped at once;
//! its jobs run to the end (a store then is whole or absent, as after any
//! crash), and its slice is cleared and reused once they have.

use super::arena::Arena;
use super::protocol::{self, ClientKind, Request, Response};
use super::sys;
use crate::error::{Error, ErrorKind, Failure, Result};
use crate::handle::{Event, JobId, TierApi, TierBuilder, TierHandle};
use crate::model::KvGeometry;
use crate::pool::Key;
use nix::sys::eventfd::{EfdFlags, EventFd};
use std::collections::{HashMap, VecDeque};
use std::os::fd::AsFd;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, AtomicUsize, Ordering};
use std::sync::mpsc::{sync_channel, SyncSender, TrySendError};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

/// How the service listens and shares memory.
#[non_exhaustive]
#[derive(Clone, Debug)]
pub struct ServiceConfig {
    /// The Unix socket's path.
    pub socket: PathBuf,
    /// A group whose members may connect too (socket mode 0660); without
    /// one, only this process's uid (and root) may (mode 0600).
    pub group: Option<u32>,
    /// Clients with memory connected at once, at most.
    pub clients: u32,
    /// Lookup-only clients (engines' schedulers) connected at once, at
    /// most; they take no memory, only a thread and a socket each.
    pub lookup_clients: u32,
    /// KV memory blocks each client shares with the service.
    pub client_blocks: u32,
    /// Frames queued for a client that does not read them before it is dropped.
    pub client_queue: usize,
}

impl ServiceConfig {
    /// A service on `socket` with 8 clients of 256 blocks.
    pub fn new(socket: impl Into<PathBuf>) -> ServiceConfig {
        ServiceConfig {
            socket: socket.into(),
            group: None,
            clients: 8,
            lookup_clients: 64,
            client_blocks: 256,
            client_queue: 1 << 16,
        }
    }
}

with_setters!(ServiceConfig {
    /// Let members of group `group` connect (socket mode 0660).
    with_group => group: Option<u32>,
    /// At most `clients` clients with memory at once.
    with_clients => clients: u32,
    /// At most `lookup_clients` lookup-only clients at once.
    with_lookup_clients => lookup_clients: u32,
    /// `client_blocks` blocks of shared KV memory per client.
    with_client_blocks => client_blocks: u32,
    /// Drop a client once `client_queue` frames wait for it.
    with_client_queue => client_queue: usize,
});

/// A line on stderr, the service's log (systemd's journal takes it).
fn log(msg: std::fmt::Arguments<'_>) {
    use std::io::Write;
    let _ = writeln!(std::io::stderr(), "kvtier serve: {msg}");
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// One connected client.
struct Client {
    id: u64,
    peer: sys::Peer,
    /// Its slice of the arena; `None` for a lookup-only client.
    slot: Option<u32>,
    /// Blocks it may name: 0..blocks of its slice.
    blocks: u32,
    out: SyncSender<Vec<u8>>,
    stream: UnixStream,
    /// Its pins: per key, the entries it pinned (by generation, oldest
    /// first) and how many times each. An unpin drops a pin on an entry it
    /// took, never one another client holds on a later entry of the same
    /// key. Bounded by the entries the pool has held, not by calls.
    pins: Mutex<HashMap<Key, VecDeque<(u64, u32)>>>,
    /// Its jobs not yet finished, each with its blocks if a store.
    jobs: Mutex<HashMap<JobId, u64>>,
    gone: AtomicBool,
    /// Its reader thread has answered its last request: no submit of its
    /// can be between the handle and `jobs` any more.
    reader_done: AtomicBool,
    released: AtomicBool,
    /// Its slice is sealed against holes and every page is in
    /// (`Shared::slice_ready`): checked once, before its first job.
    slice_ready: AtomicBool,
}

impl Client {
    fn who(&self) -> String {
        format!(
            "{}client {} (pid {}, uid {})",
            if self.slot.is_none() {
                "lookup-only "
            } else {
                ""
            },
            self.id,
            self.peer.pid,
            self.peer.uid
        )
    }

    /// Queue a frame; a client whose queue is full is dropped.
    fn send(&self, frame: Vec<u8>) {
        if self.gone.load(Ordering::SeqCst) {
            return;
        }
        match self.out.try_send(frame) {
            Ok(()) => {}
            Err(TrySendError::Full(_)) => {
                if !self.gone.swap(true, Ordering::SeqCst) {
                    log(format_args!(
                        "{} dropped: it does not read its answers and events (queue full)",
                        self.who()
                    ));
                }
                let _ = self.stream.shutdown(std::net::Shutdown::Both);
            }
            Err(TrySendError::Disconnected(_)) => {}
        }
    }
}

struct Shared {
    handle: TierHandle,
    arena: Arena,
    cfg: ServiceConfig,
    free_slots: Mutex<Vec<u32>>,
    /// Slices on their way from their last client to the next, out of
    /// `free_slots` until the engine reaches their new file.
    renewing: Mutex<Vec<Renewal>>,
    /// Slices retired (their memory could not be renewed): out for good.
    retired: AtomicU32,
    /// New loads and stores are refused (backpressure) so that the I/O in
    /// flight drains: a slice has waited `FENCE_AFTER` for an engine that
    /// maps memory only with nothing in flight (nvme, gpu), which steady
    /// load from other clients would deny it for good.
    fence: AtomicBool,
    /// Who owns each unfinished job. Held across a load's submit and the
    /// insert, so the dispatcher never sees a layer event it cannot place.
    owners: Mutex<HashMap<JobId, Arc<Client>>>,
    /// Results of stores that finished before their owner was recorded (a
    /// store's submit hashes its blocks outside the owners' lock, and a
    /// store of keys already stored finishes at once).
    orphans: Mutex<HashMap<JobId, crate::tier::JobResult>>,
    clients: Mutex<HashMap<u64, Arc<Client>>>,
    /// Lookup-only clients connected now.
    lookup_clients: AtomicU32,
    /// Connections whose hello has begun and is being read on a thread of
    /// its own, at most [`MAX_HELLO_THREADS`].
    hellos_reading: AtomicUsize,
    next_client: AtomicU64,
    stopping: AtomicBool,
    /// The dispatcher stops once this is set and the handle is closed.
    dispatcher_done: AtomicBool,
}

impl Shared {
    /// Give a gone client's slice back once none of its jobs runs. Not
    /// before its reader has ended: `gone` is also set by the dispatcher
    /// (a client whose queue is full) while the reader may be submitting a
    /// job not yet in `jobs`, whose I/O would then use the slice renewed
    /// under it (a store's bytes from the placeholder, a load's into the
    /// next client's memory).
    fn maybe_release(&self, c: &Client) {
        let jobs = lock(&c.jobs);
        if !c.reader_done.load(Ordering::SeqCst) || !jobs.is_empty() {
            return;
        }
        if c.released.swap(true, Ordering::SeqCst) {
            return;
        }
        drop(jobs);
        match c.slot {
            Some(slot) => self.renew_slot(slot),
            None => {
                self.lookup_clients.fetch_sub(1, Ordering::SeqCst);
            }
        }
    }

    /// A slice its client had (or may have been sent) goes to the next one
    /// in memory of its own: placeholder pages and then a new file over its
    /// addresses, the engine told of each. A slice that cannot be renewed
    /// is retired (the service serves one client fewer), never handed out
    /// with the last client's memory. Nothing to do once the service stops.
    fn renew_slot(&self, slot: u32) {
        if self.stopping.load(Ordering::SeqCst) {
            return;
        }
        match self.arena.vacate(slot) {
            Ok(()) => {
                lock(&self.renewing).push(Renewal {
                    slot,
                    stage: RenewalStage::Vacated,
                    since: Instant::now(),
                    said_waiting: false,
                });
                self.renew_pending();
            }
            Err(e) => self.retire(slot, &e),
        }
    }

    /// Take each slice on its way to a new client as far as it can go now
    /// (the dispatcher calls again): the engine told of the placeholder
    /// (io_uring at once; engines that map memory only when idle once no
    /// I/O is in flight), the new file mapped (in reserved huge pages once
    /// the last client's are back, or small pages after `HUGE_PAGES_WAIT`),
    /// the engine told of that, the slice free.
    fn renew_pending(&self) {
        let mut renewing = lock(&self.renewing);
        if self.stopping.load(Ordering::SeqCst) {
            renewing.clear();
            self.fence.store(false, Ordering::SeqCst);
            return;
        }
        renewing.retain_mut(|r| loop {
            let step = match r.stage {
                RenewalStage::Vacated | RenewalStage::Mapped => self
                    .handle
                    .remap_memory(&self.arena.ranges(r.slot))
                    .map(|done| done.then_some(r.stage)),
                RenewalStage::Remapped => self
                    .arena
                    .renew(r.slot, r.since.elapsed() >= HUGE_PAGES_WAIT)
                    .map(|huge| {
                        huge.map(|huge| {
                            if self.arena.huge_pages() && !huge {
                                log(format_args!(
                                    "client slot {}: its last client's reserved 2 MiB pages did not come back within {HUGE_PAGES_WAIT:?} (its process may still map them), so it is in 4 KiB pages now, which loads and stores run slower through: raise vm.nr_hugepages by {}",
                                    r.slot,
                                    self.arena.slot_file_bytes().div_ceil(2 << 20)
                                ));
                            }
                            r.stage
                        })
                    }),
            };
            match step {
                Ok(Some(RenewalStage::Vacated)) => r.stage = RenewalStage::Remapped,
                Ok(Some(RenewalStage::Remapped)) => r.stage = RenewalStage::Mapped,
                Ok(Some(RenewalStage::Mapped)) => {
                    lock(&self.free_slots).push(r.slot);
                    return false;
                }
                Ok(None) => {
                    // An engine that maps memory only when idle (nvme, gpu)
                    // under steady load from other clients may wait long.
                    if r.stage != RenewalStage::Remapped
                        && !r.said_waiting
                        && r.since.elapsed() >= IDLE_WAIT_SAID
                    {
                        r.said_waiting = true;
                        log(format_args!(
                            "client slot {}: its next client's memory waits for a moment with no I/O in flight (the {} engine maps memory only then), {:?} so far; the slot is given out once it comes",
                            r.slot,
                            self.handle.engine(),
                            r.since.elapsed()
                        ));
                    }
                    return true;
                }
                // A service stopping meanwhile closed the handle: no next client.
                Err(_) if self.stopping.load(Ordering::SeqCst) => return false,
                Err(e) => {
                    self.retire(r.slot, &e);
                    return false;
                }
            }
        });
        let fence = renewing
            .iter()
            .any(|r| r.stage != RenewalStage::Remapped && r.since.elapsed() >= FENCE_AFTER);
        if self.fence.swap(fence, Ordering::SeqCst) != fence {
            log(format_args!(
                "{}",
                if fence {
                    "holding new loads and stores (backpressure) until the I/O in flight drains, so the engine can map a client slot's new memory"
                } else {
                    "taking loads and stores again"
                }
            ));
        }
    }

    /// A slice that could not be given new memory leaves service for good.
    fn retire(&self, slot: u32, why: &Error) {
        self.retired.fetch_add(1, Ordering::SeqCst);
        log(format_args!(
            "client slot {slot} retired: its next client's memory could not be set up ({why}); this service now takes one client fewer"
        ));
    }

    /// Whether `c` may submit a job now (a store of `store_blocks`, a load
    /// 0): its slice ready, no fence, within its share; else the refusal
    /// (`Err`: drop it, see `slice_ready`).
    fn admit(&self, c: &Client, store_blocks: u64) -> std::result::Result<Option<Response>, Claim> {
        Ok(self
            .slice_ready(c)?
            .or_else(|| self.fenced())
            .or_else(|| self.over_share(c, store_blocks)))
    }

    /// The refusal of a new job while the fence stands (`fence`).
    fn fenced(&self) -> Option<Response> {
        self.fence.load(Ordering::SeqCst).then(|| {
            refused(Error::Backpressure(format!(
                "the kvtier service is giving a client slot new memory, which the {} engine maps only with no I/O in flight: submit again in a moment",
                self.handle.engine()
            )))
        })
    }

    /// Before `c`'s first job: its slice's file must be sealed against holes
    /// (its client adds F_SEAL_FUTURE_WRITE once mapped; kvtier's client
    /// does), and every page of it in, so that no page the engine or the
    /// checksums touch can vanish (a hole punched in reserved huge pages
    /// faults SIGBUS in the service when none are free, which would end
    /// every client's service). `Ok(Some)`: the refusal of an unsealed
    /// slice; `Err`: a slice with a hole no page can fill (drop it).
    fn slice_ready(&self, c: &Client) -> std::result::Result<Option<Response>, Claim> {
        let Some(slot) = c.slot else {
            return Ok(None);
        };
        if c.slice_ready.load(Ordering::Acquire) {
            return Ok(None);
        }
        let sealed = self
            .arena
            .file(slot)
            .is_ok_and(|fd| sys::sealed_against_holes(&fd));
        if !sealed {
            return Ok(Some(refused(Error::invalid(
                "this client's shared KV memory is not sealed: add F_SEAL_FUTURE_WRITE to the file the service sent once it is mapped (kvtier's client does), then submit again",
            ))));
        }
        for r in self.arena.ranges(slot) {
            sys::populate_for_write(r.addr, r.len)
                .map_err(|e| Claim(format!("its shared KV memory has a hole: {e}")))?;
        }
        c.slice_ready.store(true, Ordering::Release);
        Ok(None)
    }

    /// The refusal of a job that would take `c` past its share of what the
    /// tier holds for all clients (unfinished jobs, blocks of unfinished
    /// stores: `store_blocks` more with this one), so that one client's
    /// flood is its own backpressure, never another client's.
    fn over_share(&self, c: &Client, store_blocks: u64) -> Option<Response> {
        let shares = self.cfg.clients.max(1) as u64;
        let max_jobs = crate::handle::MAX_JOBS as u64 / shares;
        let max_blocks = self.handle.backlog_limit_blocks() / shares;
        let jobs = lock(&c.jobs);
        let held: u64 = jobs.values().sum();
        let why = if jobs.len() as u64 >= max_jobs {
            format!(
                "{} of its jobs are unfinished, its share of the service's {} ({} clients)",
                jobs.len(),
                crate::handle::MAX_JOBS,
                shares
            )
        } else if store_blocks > 0 && held + store_blocks > max_blocks.max(store_blocks) {
            format!("its unfinished stores hold {held} blocks and this one {store_blocks}, past its share ({max_blocks}) of the service's write backlog ({} clients)", shares)
        } else {
            return None;
        };
        Some(refused(Error::Backpressure(format!(
            "{why}: wait for some of its jobs (or flush_stores) and submit again"
        ))))
    }

    /// The arena's block numbers of `c`'s `blocks`; `None` for a
    /// lookup-only client, which has none.
    fn global_blocks(&self, c: &Client, blocks: &[u32]) -> Result<Option<Vec<u32>>> {
        let Some(slot) = c.slot else {
            return Ok(None);
        };
        if let Some(&b) = blocks.iter().find(|&&b| b >= c.blocks) {
            return Err(Error::invalid(format!(
                "memory block {b} is outside the {} blocks this client shares with the service",
                c.blocks
            )));
        }
        let base = slot * self.arena.slot_blocks();
        Ok(Some(blocks.iter().map(|&b| base + b).collect()))
    }
}

/// Something that stops a running [`Service`] (from a signal thread, a test).
#[derive(Clone)]
pub struct Stopper {
    fd: Arc<EventFd>,
}

impl Stopper {
    /// Stop accepting, finish acknowledged work, return from `run`.
    pub fn stop(&self) {
        let _ = self.fd.write(1);
    }
}

/// Block SIGTERM, SIGINT and SIGHUP in this thread and every thread it
/// starts later: call first thing in `main`, before the service starts its
/// threads, then [`stop_on_signals`].
pub fn block_termination_signals() -> Result<()> {
    termination_signals()
        .thread_block()
        .map_err(|e| Error::io("blocking SIGTERM, SIGINT and SIGHUP", e.into()))
}

/// SIGHUP too: a service in the foreground of a terminal or ssh session
/// that closes gets it, and it killed the service outright (jobs in
/// flight lost, the socket left behind). One ignored (`nohup`) is
/// discarded, never waited for, so it still does nothing.
fn termination_signals() -> nix::sys::signal::SigSet {
    let mut set = nix::sys::signal::SigSet::empty();
    set.add(nix::sys::signal::Signal::SIGTERM);
    set.add(nix::sys::signal::Signal::SIGINT);
    set.add(nix::sys::signal::Signal::SIGHUP);
    set
}

/// A thread that waits for SIGTERM, SIGINT or SIGHUP (blocked by
/// [`block_termination_signals`]) and stops the service.
pub fn stop_on_signals(stopper: Stopper) -> Result<()> {
    std::thread::Builder::new()
        .name("kvtier-serve-signals".into())
        .spawn(move || {
            if let Ok(sig) = termination_signals().wait() {
                log(format_args!("{sig} received"));
            }
            stopper.stop();
        })
        .map(|_| ())
        .map_err(|e| Error::io("starting the signal thread", e))
}

/// A started service: the pool open, the socket listening.
pub struct Service {
    shared: Arc<Shared>,
    listener: UnixListener,
    stop: Arc<EventFd>,
    dispatcher: std::thread::JoinHandle<()>,
}

/// Refuses a socket path whose directory is not there (or is no
/// directory), or that is too long for a socket, before the pool is opened: the bind failed only after the
/// builder had created a pool for a service that never ran.
fn socket_place_ok(socket: &Path) -> Result<()> {
    sys::socket_path_fits(socket)?;
    let parent = match socket.parent() {
        Some(p) if !p.as_os_str().is_empty() => p,
        _ => Path::new("."),
    };
    match std::fs::metadata(parent) {
        Ok(m) if m.is_dir() => Ok(()),
        Ok(_) => Err(Error::invalid(format!(
            "the socket {}: {} is not a directory; give the service a socket path in a directory",
            socket.display(),
            parent.display()
        ))),
        Err(e) => Err(Error::invalid(format!(
            "the socket {}: its directory {} cannot be used ({e}); create it, or give the service a socket path in a directory that exists",
            socket.display(),
            parent.display()
        ))),
    }
}

/// Whether something answers on the socket at `path`.
fn socket_in_use(path: &Path) -> bool {
    UnixStream::connect(path).is_ok()
}

impl Service {
    /// Open the pool `builder` describes with the service's KV memory
    /// (`cfg.clients` slices of `cfg.client_blocks` blocks of `geometry`,
    /// the pool's) and listen on `cfg.socket`. A stale socket file (nobody
    /// listening) is replaced; a live one is refused.
    pub fn start(
        builder: TierBuilder,
        geometry: KvGeometry,
        cfg: ServiceConfig,
    ) -> Result<Service> {
        sys::check_kernel()?;
        let arena = Arena::new(geometry, cfg.clients, cfg.client_blocks)?;
        socket_place_ok(&cfg.socket)?;
        if let Ok(meta) = std::fs::symlink_metadata(&cfg.socket) {
            use std::os::unix::fs::FileTypeExt;
            if !meta.file_type().is_socket() {
                return Err(Error::invalid(format!(
                    "{} exists and is not a socket: give the service a path of its own for its socket",
                    cfg.socket.display()
                )));
            }
            if socket_in_use(&cfg.socket) {
                return Err(Error::invalid(format!(
                    "another kvtier service is listening on {}: stop it, or give this one another socket path",
                    cfg.socket.display()
                )));
            }
            std::fs::remove_file(&cfg.socket).map_err(|e| {
                Error::io(
                    format!("removing the stale socket {}", cfg.socket.display()),
                    e,
                )
            })?;
        }
        // SAFETY: the arena lives in `Shared` next to the handle and is
        // dropped after it (the handle is closed first in `run`, and `Shared`
        // declares `handle` before `arena`, so a drop without `run` drops the
        // handle, which waits for its I/O, before the arena is unmapped).
        let handle = unsafe { builder.memory(arena.kv_memory()) }.build()?;
        let listener = sys::bind_private(&cfg.socket)?;
        if let Some(g) = cfg.group {
            sys::share_with_group(&cfg.socket, g)?;
        }
        let stop = Arc::new(
            EventFd::from_flags(EfdFlags::EFD_CLOEXEC | EfdFlags::EFD_NONBLOCK)
                .map_err(|e| Error::io("creating the service's stop eventfd", e.into()))?,
        );
        let comps = handle.completions()?;
        let shared = Arc::new(Shared {
            free_slots: Mutex::new((0..cfg.clients).rev().collect()),
            renewing: Mutex::new(Vec::new()),
            retired: AtomicU32::new(0),
            fence: AtomicBool::new(false),
            handle,
            arena,
            cfg,
            owners: Mutex::new(HashMap::new()),
            orphans: Mutex::new(HashMap::new()),
            clients: Mutex::new(HashMap::new()),
            lookup_clients: AtomicU32::new(0),
            hellos_reading: AtomicUsize::new(0),
            next_client: AtomicU64::new(1),
            stopping: AtomicBool::new(false),
            dispatcher_done: AtomicBool::new(false),
        });
        let s2 = shared.clone();
        let dispatcher = std::thread::Builder::new()
            .name("kvtier-serve-events".into())
            .spawn(move || dispatch(&s2, comps))
            .map_err(|e| Error::io("starting the service's event thread", e))?;
        log(format_args!(
            "serving {} on {} (engine {}: {}), {} clients of {} blocks",
            shared.handle.geometry().describe(),
            shared.cfg.socket.display(),
            shared.handle.engine(),
            shared.handle.engine_reason(),
            shared.cfg.clients,
            shared.cfg.client_blocks
        ));
        if shared.arena.huge_pages() {
            log(format_args!(
                "the shared KV memory is in reserved 2 MiB huge pages (hugetlbfs)"
            ));
        } else if sys::shmem_huge_pages() == Some(false) {
            let blocks = Arena::huge_page_blocks(shared.handle.geometry());
            let pages =
                (shared.arena.slot_file_bytes() * shared.arena.slots() as u64).div_ceil(2 << 20);
            log(format_args!(
                "the shared KV memory is in 4 KiB pages: shmem huge pages are off here (/sys/kernel/mm/transparent_hugepage/shmem_enabled) and too few reserved huge pages are free, so every 4 KiB page of a load or store is a DMA segment of its own (a 2 MiB huge page would be one) and transfers run slower than into an engine's own memory in huge pages (examples/service_bench measures both). Reserve them before starting the service: raise vm.nr_hugepages by {} (2 MiB pages; sysctl.conf keeps it){}; or `echo advise > /sys/kernel/mm/transparent_hugepage/shmem_enabled`",
                pages,
                if shared.arena.slot_blocks() as u64 % blocks == 0 {
                    String::new()
                } else {
                    format!(" with client blocks a multiple of {blocks}")
                }
            ));
        }
        Ok(Service {
            shared,
            listener,
            stop,
            dispatcher,
        })
    }

    /// What stops `run`.
    pub fn stopper(&self) -> Stopper {
        Stopper {
            fd: self.stop.clone(),
        }
    }

    /// The service's handle (lookups for monitoring; tests).
    pub fn handle(&self) -> &TierHandle {
        &self.shared.handle
    }

    /// Accept clients until stopped; then stop accepting, remove the
    /// socket, finish every acknowledged job (stores in the backlog
    /// included), disconnect the clients and close the pool.
    pub fn run(self) -> Result<()> {
        use nix::poll::{PollFd, PollFlags, PollTimeout};
        let mut readers = Vec::new();
        // Connections accepted whose hello has not arrived whole, oldest
        // first, with what of it has: they wait here, in this loop's poll
        // (read without blocking), not on a thread each.
        let mut waiting: std::collections::VecDeque<Waiting> = Default::default();
        // Accepts failing since the last one that worked (said once).
        let mut accept_failing = false;
        loop {
            let now = Instant::now();
            while waiting.front().is_some_and(|w| w.due <= now) {
                waiting.pop_front();
                log(format_args!(
                    "closed a connection that sent no hello within {HELLO_TIMEOUT:?}"
                ));
            }
            // A connection gets its thread once its hello is in (a peer
            // opening connections that each sent a byte made a thread apiece,
            // thousands, bounded only by its file descriptors). Only a first
            // frame too large for a hello is read further on its thread; past
            // the cap on those, waiting connections are not polled (what they
            // send keeps) until one ends.
            let hello_threads_full =
                self.shared.hellos_reading.load(Ordering::SeqCst) >= MAX_HELLO_THREADS;
            let (stopped, accept, ready) = {
                let mut pfds = vec![
                    PollFd::new(self.listener.as_fd(), PollFlags::POLLIN),
                    PollFd::new(self.stop.as_fd(), PollFlags::POLLIN),
                ];
                if !hello_threads_full {
                    pfds.extend(
                        waiting
                            .iter()
                            .map(|w| PollFd::new(w.stream.as_fd(), PollFlags::POLLIN)),
                    );
                }
                // Wake for the oldest waiting connection's deadline (and, while
                // the hello threads are all taken, soon to look again).
                let timeout = match waiting.front() {
                    Some(Waiting { due, .. }) => {
                        let mut ms = due.saturating_duration_since(now).as_millis() + 1;
                        if hello_threads_full {
                            ms = ms.min(HELLO_THREADS_RECHECK.as_millis());
                        }
                        PollTimeout::try_from(ms.min(60_000) as i32).unwrap_or(PollTimeout::MAX)
                    }
                    None => PollTimeout::NONE,
                };
                match nix::poll::poll(&mut pfds, timeout) {
                    Ok(_) | Err(nix::errno::Errno::EINTR) => {}
                    Err(e) => return Err(Error::io("waiting for clients", e.into())),
                }
                let fired = |p: &PollFd| p.revents().is_some_and(|r| !r.is_empty());
                (
                    fired(&pfds[1]),
                    fired(&pfds[0]),
                    pfds[2..]
                        .iter()
                        .enumerate()
                        .filter(|(_, p)| fired(p))
                        .map(|(i, _)| i)
                        .collect::<Vec<_>>(),
                )
            };
            if stopped {
                break;
            }
            // A connection whose hello has arrived (or which said something
            // else, or hung up) gets its thread, which reads the rest of a
            // frame too large for a hello within what is left of its time.
            for i in ready.into_iter().rev() {
                if !waiting[i].read_some() {
                    continue;
                }
                let Waiting { stream, due, head } =
                    waiting.remove(i).expect("an index of the poll set");
                let _ = stream.set_nonblocking(false);
                let s = self.shared.clone();
                s.hellos_reading.fetch_add(1, Ordering::SeqCst);
                match std::thread::Builder::new()
                    .name("kvtier-serve-client".into())
                    .spawn(move || serve_client(&s, stream, due, head))
                {
                    Ok(t) => readers.push(t),
                    Err(e) => {
                        self.shared.hellos_reading.fetch_sub(1, Ordering::SeqCst);
                        log(format_args!("could not start a client thread: {e}"))
                    }
                }
            }
            readers.retain(|t| !t.is_finished());
            if !accept {
                continue;
            }
            match self.listener.accept() {
                Ok((stream, _)) => {
                    if accept_failing {
                        accept_failing = false;
                        log(format_args!("accepting connections again"));
                    }
                    if waiting.len() >= MAX_WAITING_HELLOS {
                        waiting.pop_front();
                        log(format_args!(
                            "closed the oldest of {MAX_WAITING_HELLOS} connections waiting to say hello"
                        ));
                    }
                    if stream.set_nonblocking(true).is_ok() {
                        waiting.push_back(Waiting {
                            stream,
                            due: Instant::now() + HELLO_TIMEOUT,
                            head: Vec::new(),
                        });
                    }
                }
                Err(e) => {
                    // Out of file descriptors (EMFILE, ENFILE) or memory:
                    // the connection stays queued and the listener readable,
                    // so polling again at once spun here, a core and a log
                    // line per try, until a descriptor freed. Said once, and
                    // tried again after a pause.
                    if !accept_failing {
                        accept_failing = true;
                        log(format_args!(
                            "accept failed: {e}; new connections wait in the socket's queue, retried every {ACCEPT_RETRY:?} (out of file descriptors: raise the service's open-file limit, LimitNOFILE= in its systemd unit or ulimit -n, or lower --clients / --lookup-clients)"
                        ));
                    }
                    std::thread::sleep(ACCEPT_RETRY);
                }
            }
        }
        log(format_args!(
            "stopping: no new clients; finishing acknowledged work"
        ));
        self.shared.stopping.store(true, Ordering::SeqCst);
        let _ = std::fs::remove_file(&self.shared.cfg.socket);
        let closed = self.shared.handle.close();
        self.shared.dispatcher_done.store(true, Ordering::SeqCst);
        let _ = self.dispatcher.join();
        // Each reader sees the end of its input, and its writer sends what
        // is queued (the results of the work just finished) before it closes.
        // Again until every reader is done: one may have registered its
        // client just now (a hello that raced the stop).
        let deadline = std::time::Instant::now() + Duration::from_secs(30);
        while readers.iter().any(|t| !t.is_finished()) && std::time::Instant::now() < deadline {
            for c in lock(&self.shared.clients).values() {
                let _ = c.stream.shutdown(std::net::Shutdown::Read);
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        for t in readers.into_iter().filter(|t| t.is_finished()) {
            let _ = t.join();
        }
        match &closed {
            Ok(()) => log(format_args!("stopped: every acknowledged job finished")),
            Err(e) => log(format_args!("stopped with an error: {e}")),
        }
        closed
    }
}

/// Route events to their clients; collect every result.
fn dispatch(s: &Shared, comps: crate::handle::Completions) {
    let mut last_renewal = Instant::now();
    loop {
        if last_renewal.elapsed() >= RENEW_RETRY && !lock(&s.renewing).is_empty() {
            s.renew_pending();
            last_renewal = Instant::now();
        }
        let Some(ev) = comps.recv_timeout(Duration::from_millis(50)) else {
            if s.dispatcher_done.load(Ordering::SeqCst) {
                return;
            }
            continue;
        };
        match ev {
            Event::Layer { job, layer, error } => {
                let owner = lock(&s.owners).get(&job).cloned();
                if let Some(c) = owner {
                    c.send(Response::Layer { job, layer, error }.encode(0));
                }
            }
            Event::Finished { job, .. } => {
                let mut owners = lock(&s.owners);
                let owner = owners.remove(&job);
                let result = match s.handle.try_result(job) {
                    Ok(Some(r)) => r,
                    Ok(None) | Err(_) => continue,
                };
                match owner {
                    Some(c) => {
                        drop(owners);
                        finish(s, &c, result);
                    }
                    None => {
                        lock(&s.orphans).insert(job, result);
                    }
                }
            }
        }
    }
}

/// Hand `c` its job's result; free its slice if it has gone and this was its last job.
fn finish(s: &Shared, c: &Client, result: crate::tier::JobResult) {
    let job = result.job;
    c.send(Response::Finished(result).encode(0));
    lock(&c.jobs).remove(&job);
    s.maybe_release(c);
}

/// A slice between clients: where it is on its way to the next one.
struct Renewal {
    slot: u32,
    stage: RenewalStage,
    /// When its client let go of it.
    since: Instant,
    /// Said that the engine waits for a moment with no I/O in flight.
    said_waiting: bool,
}

/// A slice's way to its next client: placeholder pages mapped (`Vacated`),
/// the engine told (`Remapped`), a new file mapped (`Mapped`), the engine
/// told: free.
#[derive(Clone, Copy, PartialEq, Eq)]
enum RenewalStage {
    Vacated,
    Remapped,
    Mapped,
}

/// How long a renewed slice waits for reserved huge pages (its last
/// client's, once unmapped) before taking small pages.
const HUGE_PAGES_WAIT: Duration = Duration::from_secs(2);

/// How long a slice waits for its engine to map its memory before the log
/// says so.
const IDLE_WAIT_SAID: Duration = Duration::from_secs(10);

/// How long a slice waits for an idle engine before new jobs are held
/// (`Shared::fence`).
const FENCE_AFTER: Duration = Duration::from_secs(1);

/// The dispatcher's pause between turns of the slices being renewed.
const RENEW_RETRY: Duration = Duration::from_millis(20);

/// What ends a client's connection.
enum End {
    /// It hung up.
    Left,
    /// It broke the protocol or claimed memory it does not own.
    Dropped(String),
}

/// The pause before accepting again after an accept failed (out of file
/// descriptors): the listener stays readable, so retrying at once spins.
const ACCEPT_RETRY: Duration = Duration::from_millis(100);
/// How long a connection has from its accept to its whole hello.
const HELLO_TIMEOUT: Duration = Duration::from_secs(10);
/// Connections accepted and not yet saying hello, at most; past that the
/// oldest is closed (each costs a file descriptor, never a thread).
const MAX_WAITING_HELLOS: usize = 256;
/// Hellos read at once, each on its thread, at most (a whole hello arrives
/// in one write, so a client's hello thread ends at once; only a peer that
/// stalls inside its hello holds one, for the hello's time at most).
const MAX_HELLO_THREADS: usize = 32;
/// How soon the accept loop looks again while every hello thread is taken.
const HELLO_THREADS_RECHECK: Duration = Duration::from_millis(20);

/// Counts a hello thread done when dropped (whichever way its hello ends).
struct HelloRead<'a>(&'a AtomicUsize);

impl Drop for HelloRead<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
}

/// A connection accepted whose hello has not arrived whole.
struct Waiting {
    stream: UnixStream,
    /// The hello's deadline.
    due: Instant,
    /// The bytes of its first frame read so far.
    head: Vec<u8>,
}

/// The most of a first frame read in the accept loop: a hello is far
/// smaller (a larger frame is no hello of this version; its thread reads
/// the rest and refuses it).
const HELLO_HEAD_BYTES: usize = 4096;

impl Waiting {
    /// Reads what has arrived without blocking; true once the connection
    /// is ready for its thread: its first frame is whole (or longer than a
    /// hello), or it hung up or failed.
    fn read_some(&mut self) -> bool {
        use std::io::Read;
        loop {
            let want = match self.head.len() {
                n if n < protocol::HEADER_BYTES => protocol::HEADER_BYTES,
                _ => {
                    let len = u32::from_le_bytes(self.head[0..4].try_into().expect("4 bytes"));
                    protocol::HEADER_BYTES.saturating_add(len as usize)
                }
            };
            if self.head.len() >= want.min(HELLO_HEAD_BYTES) {
                return true;
            }
            let mut buf = [0u8; 512];
            let room = (want.min(HELLO_HEAD_BYTES) - self.head.len()).min(buf.len());
            match (&self.stream).read(&mut buf[..room]) {
                Ok(0) => return true,
                Ok(n) => self.head.extend_from_slice(&buf[..n]),
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => return false,
                Err(_) => return true,
            }
        }
    }
}

fn serve_client(s: &Arc<Shared>, stream: UnixStream, hello_due: Instant, head: Vec<u8>) {
    let hello_read = HelloRead(&s.hellos_reading);
    let peer = match sys::peer(&stream) {
        Ok(p) => p,
        Err(e) => {
            log(format_args!("refused a client: {e}"));
            return;
        }
    };
    let me = sys::my_uid();
    let allowed = peer.uid == me
        || peer.uid == 0
        || s.cfg
            .group
            .is_some_and(|g| peer.gid == g || sys::groups_of(peer.pid).contains(&g));
    if !allowed {
        log(format_args!(
            "refused pid {} uid {}: not this service's uid ({me}){}",
            peer.pid,
            peer.uid,
            match s.cfg.group {
                Some(g) => format!(" nor in group {g}"),
                None => String::new(),
            }
        ));
        return;
    }
    let id = s.next_client.fetch_add(1, Ordering::SeqCst);
    let refuse = |stream: &UnixStream, req: u64, f: Failure| {
        use std::io::Write;
        let _ = (&*stream).write_all(&Response::Refused(f).encode(req));
    };
    // The rest of the hello, by its deadline (a zero timeout would mean none).
    let left = hello_due.saturating_duration_since(Instant::now());
    let _ = stream.set_read_timeout(Some(left.max(Duration::from_millis(1))));
    use std::io::Read;
    let (req, blocks, kind) = match protocol::read_frame(&mut head.as_slice().chain(&stream)) {
        Ok(Some((h, body))) => match Request::decode(h.kind, &body) {
            Ok(Request::Hello { blocks, kind, .. }) => (h.req, blocks, kind),
            Ok(_) => {
                log(format_args!(
                    "dropped client {id} (pid {}): its first frame is not a hello",
                    peer.pid
                ));
                return;
            }
            Err(e) => {
                log(format_args!("dropped client {id} (pid {}): {e}", peer.pid));
                refuse(&stream, h.req, Failure::from(&e));
                return;
            }
        },
        Ok(None) => return,
        Err(e) => {
            log(format_args!("dropped client {id} (pid {}): {e}", peer.pid));
            return;
        }
    };
    drop(hello_read);
    let _ = stream.set_read_timeout(None);
    let slot_blocks = s.arena.slot_blocks();
    let blocks = match kind {
        ClientKind::LookupOnly => 0,
        ClientKind::Memory if blocks == 0 => slot_blocks,
        ClientKind::Memory => blocks,
    };
    if blocks > slot_blocks {
        refuse(
            &stream,
            req,
            Failure::new(
                ErrorKind::Usage,
                format!(
                    "{blocks} blocks asked; this service shares {slot_blocks} per client (its client_blocks setting): ask for at most that, or restart the service with more"
                ),
            ),
        );
        return;
    }
    if s.stopping.load(Ordering::SeqCst) {
        refuse(
            &stream,
            req,
            Failure::new(ErrorKind::Closed, "the kvtier service is stopping"),
        );
        return;
    }
    // What this client holds until it goes: a slice of the arena, or
    // (lookup-only) one of the lookup clients' places.
    let slot = match kind {
        ClientKind::Memory => {
            let Some(slot) = lock(&s.free_slots).pop() else {
                refuse(&stream, req, Failure::new(
                    ErrorKind::Backpressure,
                    format!(
                        "all {} client slots of this service are taken (its clients setting){}{}; retry once a client leaves",
                        s.cfg.clients,
                        match lock(&s.renewing).len() {
                            0 => String::new(),
                            n => format!(", {n} of them getting new memory for their next client (a moment)"),
                        },
                        match s.retired.load(Ordering::SeqCst) {
                            0 => String::new(),
                            n => format!(", {n} retired (their memory could not be renewed: see the service's log)"),
                        },
                    ),
                ));
                log(format_args!(
                    "refused pid {}: all {} client slots taken",
                    peer.pid, s.cfg.clients
                ));
                return;
            };
            Some(slot)
        }
        ClientKind::LookupOnly => {
            let max = s.cfg.lookup_clients;
            if s.lookup_clients
                .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| {
                    (n < max).then_some(n + 1)
                })
                .is_err()
            {
                refuse(&stream, req, Failure::new(
                    ErrorKind::Backpressure,
                    format!("all {max} lookup-only client places of this service are taken (its lookup_clients setting); retry once one leaves"),
                ));
                log(format_args!(
                    "refused pid {}: all {max} lookup-only client places taken",
                    peer.pid
                ));
                return;
            }
            None
        }
    };
    // The welcome may have reached it with the slice's file: a slice given
    // back is renewed as at a disconnect.
    let give_back = |slot: Option<u32>| match slot {
        Some(slot) => s.renew_slot(slot),
        None => {
            s.lookup_clients.fetch_sub(1, Ordering::SeqCst);
        }
    };
    // Its slice's pages in now, in the service's mapping, on this client's
    // thread, before its welcome: the check before its first job faults
    // the sealed slice in again, and then only walks pages that are there
    // instead of allocating them inside that job's time. Best effort: that
    // check reports a slice no page can fill.
    if let Some(slot) = slot {
        for r in s.arena.ranges(slot) {
            let _ = sys::populate_for_write(r.addr, r.len);
        }
    }
    let welcome = Response::Welcome {
        version: protocol::VERSION,
        geometry: *s.handle.geometry(),
        namespace: s.handle.namespace().to_string(),
        model_name: s.handle.model_name().to_string(),
        blocks,
        layer_stride: if slot.is_some() {
            s.arena.slot_stride()
        } else {
            0
        },
        file_bytes: if slot.is_some() {
            s.arena.slot_file_bytes()
        } else {
            0
        },
        engine: s.handle.engine().to_string(),
    }
    .encode(req);
    let sent = match slot {
        Some(slot) => s
            .arena
            .file(slot)
            .and_then(|fd| sys::send_with_fd(&stream, &welcome, &fd)),
        None => {
            use std::io::Write;
            (&stream)
                .write_all(&welcome)
                .map_err(|e| Error::io("sending a lookup-only client its welcome", e))
        }
    };
    if let Err(e) = sent {
        log(format_args!("client {id} (pid {}): {e}", peer.pid));
        give_back(slot);
        return;
    }
    let (tx, rx) = sync_channel::<Vec<u8>>(s.cfg.client_queue);
    // A client that stops reading cannot hold a writer (or the shutdown) for long.
    let _ = stream.set_write_timeout(Some(Duration::from_secs(10)));
    let Ok(write_half) = stream.try_clone() else {
        give_back(slot);
        return;
    };
    let Ok(shut) = stream.try_clone() else {
        give_back(slot);
        return;
    };
    let c = Arc::new(Client {
        id,
        peer,
        slot,
        blocks,
        out: tx,
        stream: shut,
        pins: Mutex::new(HashMap::new()),
        jobs: Mutex::new(HashMap::new()),
        gone: AtomicBool::new(false),
        reader_done: AtomicBool::new(false),
        released: AtomicBool::new(false),
        slice_ready: AtomicBool::new(false),
    });
    lock(&s.clients).insert(id, c.clone());
    match slot {
        Some(slot) => log(format_args!(
            "{} connected: slot {slot}, {blocks} blocks",
            c.who()
        )),
        None => log(format_args!("{} connected", c.who())),
    }
    let writer = std::thread::Builder::new()
        .name("kvtier-serve-writer".into())
        .spawn(move || {
            use std::io::Write;
            let mut w = &write_half;
            for f in rx {
                if w.write_all(&f).is_err() {
                    let _ = write_half.shutdown(std::net::Shutdown::Both);
                    return;
                }
            }
        });
    let end = read_requests(s, &c, &stream);
    match &end {
        End::Left => log(format_args!("{} disconnected", c.who())),
        End::Dropped(why) => log(format_args!("{} dropped: {why}", c.who())),
    }
    let stopping = s.stopping.load(Ordering::SeqCst);
    if !stopping {
        // It left or was dropped: nothing more goes to it.
        c.gone.store(true, Ordering::SeqCst);
        let _ = stream.shutdown(std::net::Shutdown::Both);
    }
    // Its pins go now, counted (one entry per key and generation: a key
    // pinned 100 million times made as many entries, 4.8 GB, and held the
    // index as long); its jobs finish on their own and free the slice.
    let pins: Vec<(Key, u64, u32)> = lock(&c.pins)
        .drain()
        .flat_map(|(k, gens)| gens.into_iter().map(move |(g, n)| (k, g, n)))
        .collect();
    if !pins.is_empty() {
        s.handle.unpin_entries(&pins);
    }
    lock(&s.clients).remove(&id);
    c.gone.store(true, Ordering::SeqCst);
    c.reader_done.store(true, Ordering::SeqCst);
    s.maybe_release(&c);
    drop(c);
    // The writer ends once the last frame for this client is queued (its
    // jobs' owners hold the sender) or a write fails. While the service
    // stops, every job has finished: it sends the results still queued,
    // and the service waits for that; otherwise it is not waited for.
    if let (true, Ok(w)) = (stopping, writer) {
        let _ = w.join();
        let _ = stream.shutdown(std::net::Shutdown::Both);
    }
}

fn read_requests(s: &Shared, c: &Arc<Client>, stream: &UnixStream) -> End {
    loop {
        // An idle client may wait as long as it likes between frames; a
        // frame once begun must arrive whole within BODY_TIMEOUT, its header
        // too (a peer stalled inside a header held its thread for good).
        if let Err(e) = sys::wait_readable(stream) {
            return End::Dropped(e.to_string());
        }
        let _ = stream.set_read_timeout(Some(BODY_TIMEOUT));
        let h = match protocol::read_header(&mut &*stream) {
            Ok(Some(h)) => h,
            Ok(None) => return End::Left,
            Err(e) if protocol::is_disconnect(&e) => return End::Left,
            Err(e) => return End::Dropped(e.to_string()),
        };
        let body = match protocol::read_body(&mut &*stream, &h) {
            Ok(b) => b,
            Err(e) if protocol::is_disconnect(&e) => return End::Left,
            Err(e) => return End::Dropped(e.to_string()),
        };
        if c.gone.load(Ordering::SeqCst) {
            return End::Left;
        }
        let req = match Request::decode(h.kind, &body) {
            Ok(r) => r,
            Err(e) => return End::Dropped(e.to_string()),
        };
        match answer(s, c, req, h.req) {
            Ok(Some(r)) => c.send(r.encode(h.req)),
            Ok(None) => {}
            Err(Claim(why)) => return End::Dropped(why),
        }
    }
}

/// How long a frame's body may take after its header: a client stalled
/// inside a frame is dropped rather than holding its thread and slot.
const BODY_TIMEOUT: Duration = Duration::from_secs(5);

/// A request for memory the client does not own: it is dropped.
struct Claim(String);

fn refused(e: Error) -> Response {
    Response::Refused(Failure::from(&e))
}

/// A load or store asked by a client that shares no memory: refused, the
/// client stays (its lookups and pins are what it is for).
fn lookup_only_refusal(what: &str) -> Response {
    Response::Refused(Failure::new(
        ErrorKind::Usage,
        format!(
            "this connection to the kvtier service is lookup-only (it shares no KV memory with the service), so it cannot {what}: connect as a client with memory (TierBuilder::service(PATH) without lookup_only) to load and store"
        ),
    ))
}

/// The answer to `req` (id `req_id`), or `None` when it was already sent.
fn answer(
    s: &Shared,
    c: &Arc<Client>,
    req: Request,
    req_id: u64,
) -> std::result::Result<Option<Response>, Claim> {
    Ok(Some(match req {
        Request::Hello { .. } => {
            return Err(Claim("a second hello on one connection".into()));
        }
        Request::Lookup(keys) => Response::Count(s.handle.lookup_prefix(&keys) as u64),
        Request::LookupAndPin(keys) => {
            let gens = s.handle.lookup_and_pin_entries(&keys);
            let mut pins = lock(&c.pins);
            for (k, g) in keys.iter().zip(&gens) {
                let gens = pins.entry(*k).or_default();
                match gens.back_mut() {
                    Some((last, n)) if last == g => *n = n.saturating_add(1),
                    _ => gens.push_back((*g, 1)),
                }
            }
            Response::Count(gens.len() as u64)
        }
        Request::Unpin(keys) => {
            let mut mine = Vec::with_capacity(keys.len());
            {
                let mut pins = lock(&c.pins);
                for k in keys {
                    if let Some(gens) = pins.get_mut(&k) {
                        if let Some((g, n)) = gens.front_mut() {
                            mine.push((k, *g, 1));
                            *n -= 1;
                            if *n == 0 {
                                gens.pop_front();
                            }
                        }
                        if gens.is_empty() {
                            pins.remove(&k);
                        }
                    }
                }
            }
            s.handle.unpin_entries(&mine);
            Response::Ok
        }
        Request::Remove(keys) => match s.handle.remove(&keys) {
            Ok(n) => Response::Count(n as u64),
            Err(e) => refused(e),
        },
        Request::SubmitLoad {
            keys,
            blocks,
            layers,
        } => {
            let Some(g) = s
                .global_blocks(c, &blocks)
                .map_err(|e| Claim(e.to_string()))?
            else {
                return Ok(Some(lookup_only_refusal("load")));
            };
            if let Some(refusal) = s.admit(c, 0)? {
                return Ok(Some(refusal));
            }
            let mut owners = lock(&s.owners);
            match s.handle.submit_load(&keys, &g, layers) {
                Ok(job) => {
                    owners.insert(job, c.clone());
                    lock(&c.jobs).insert(job, 0);
                    Response::Job(job)
                }
                Err(e) => refused(e),
            }
        }
        Request::SubmitStore { .. } | Request::SubmitStoreCrcs { .. } => {
            let (keys, blocks, crcs) = match req {
                Request::SubmitStoreCrcs { keys, blocks, crcs } => (keys, blocks, Some(crcs)),
                Request::SubmitStore { keys, blocks } => (keys, blocks, None),
                _ => unreachable!("matched above"),
            };
            let Some(g) = s
                .global_blocks(c, &blocks)
                .map_err(|e| Claim(e.to_string()))?
            else {
                return Ok(Some(lookup_only_refusal("store")));
            };
            if let Some(refusal) = s.admit(c, keys.len() as u64)? {
                return Ok(Some(refusal));
            }
            // Not under the owners' lock: the submit hashes the blocks, and
            // other clients' events must not wait for that.
            let submitted = match &crcs {
                Some(crcs) => s.handle.submit_store_with_crcs(&keys, &g, crcs),
                None => s.handle.submit_store(&keys, &g),
            };
            match submitted {
                Ok(job) => {
                    lock(&c.jobs).insert(job, keys.len() as u64);
                    let mut owners = lock(&s.owners);
                    let early = lock(&s.orphans).remove(&job);
                    match early {
                        // The answer goes out before the result: queue it first.
                        Some(r) => {
                            drop(owners);
                            c.send(Response::Job(job).encode(req_id));
                            finish(s, c, r);
                            return Ok(None);
                        }
                        None => {
                            owners.insert(job, c.clone());
                        }
                    }
                    Response::Job(job)
                }
                Err(e) => refused(e),
            }
        }
        Request::FlushStores => match s.handle.flush_stores() {
            Ok(()) => Response::Ok,
            Err(e) => refused(e),
        },
        Request::Usage => match TierApi::usage_json(&s.handle) {
            Ok(j) => Response::Usage(j),
            Err(e) => refused(e),
        },
    }))
}
