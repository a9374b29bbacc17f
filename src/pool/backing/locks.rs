//! Who holds a device: the `flock` every open device carries, its holders from
//! /proc/locks, and the error that names them.

use super::*;

/// How long an open waits for a lock (or an exclusive block-device claim) whose holder
/// has already exited: the kernel releases a dead process's files when its io_uring
/// rings are torn down, which may be tens of milliseconds after the exit.
pub(super) const RELEASE_GRACE: std::time::Duration = std::time::Duration::from_millis(1500);
/// How long an open waits for a lock a live process (this one included) holds before
/// refusing (see `lock_device`).
pub(super) const LIVE_GRACE: std::time::Duration = std::time::Duration::from_millis(300);

/// A process holding a `flock` on a file: its pid and whether the lock is exclusive.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct LockHolder {
    pub(crate) pid: i32,
    pub(crate) exclusive: bool,
}

/// Who holds a `flock` on the file with metadata `meta`, from /proc/locks (the only place
/// the kernel names the owner of a flock). Empty when /proc/locks is unreadable.
pub(crate) fn lock_holders(meta: &fs::Metadata) -> Vec<LockHolder> {
    let Ok(text) = fs::read_to_string("/proc/locks") else {
        return Vec::new();
    };
    parse_lock_holders(
        &text,
        dev_major(meta.dev()),
        dev_minor(meta.dev()),
        meta.ino(),
    )
}

/// /proc/locks lines look like `1: FLOCK  ADVISORY  WRITE 1234 08:01:5678 0 EOF`
/// (device major:minor in hex, inode in decimal); `1: -> FLOCK ...` lines are waiters.
pub(super) fn parse_lock_holders(text: &str, major: u64, minor: u64, ino: u64) -> Vec<LockHolder> {
    let mut out = Vec::new();
    for line in text.lines() {
        let f: Vec<&str> = line.split_whitespace().collect();
        if f.len() < 6 || f[1] != "FLOCK" {
            continue;
        }
        let mut id = f[5].splitn(3, ':');
        let (Some(maj), Some(min), Some(i)) = (id.next(), id.next(), id.next()) else {
            continue;
        };
        let same = u64::from_str_radix(maj, 16) == Ok(major)
            && u64::from_str_radix(min, 16) == Ok(minor)
            && i.parse::<u64>() == Ok(ino);
        if !same {
            continue;
        }
        if let Ok(pid) = f[4].parse::<i32>() {
            out.push(LockHolder {
                pid,
                exclusive: f[3] == "WRITE",
            });
        }
    }
    out
}

/// Is `pid` a running process (not gone, not a zombie)?
pub(super) fn process_alive(pid: i32) -> bool {
    if pid <= 0 {
        return false;
    }
    match fs::read_to_string(format!("/proc/{pid}/stat")) {
        // The state is the first field after the parenthesised command name.
        Ok(stat) => stat
            .rsplit_once(") ")
            .and_then(|(_, rest)| rest.chars().next())
            .is_some_and(|state| state != 'Z' && state != 'X'),
        Err(_) => false,
    }
}

pub(super) fn describe_holders(holders: &[LockHolder]) -> String {
    let me = std::process::id() as i32;
    let mut pids: Vec<String> = Vec::new();
    for h in holders {
        let what = if h.pid == me {
            format!("this process (pid {})", h.pid)
        } else if process_alive(h.pid) {
            format!("pid {}", h.pid)
        } else {
            format!("pid {}, which has exited", h.pid)
        };
        if !pids.contains(&what) {
            pids.push(what);
        }
    }
    pids.join(", ")
}

/// The error for a device another kvtier process (or this one) holds.
pub(super) fn in_use_error(path: &Path, access: Access, holders: &[LockHolder]) -> Error {
    let me = std::process::id() as i32;
    let writers: Vec<LockHolder> = holders.iter().copied().filter(|h| h.exclusive).collect();
    let who = if holders.is_empty() {
        "another process".to_string()
    } else {
        describe_holders(if writers.is_empty() {
            holders
        } else {
            &writers
        })
    };
    let reason = if holders.iter().any(|h| h.pid == me) {
        format!(
            "it is in use: already open in {who}; a pool may be opened once at a time: drop \
             the other Pool (or Tier) first"
        )
    } else if access == Access::Shared || !writers.is_empty() {
        format!(
            "it is in use: {who} has it open for writing (serving, creating or repairing the \
             pool); stop that process first. Two processes on one pool would return each \
             other's bytes"
        )
    } else {
        format!(
            "it is in use: {who} has it open for reading (`kvtier pool info` or `check`); \
             wait for it to finish"
        )
    };
    backing_error(path, reason)
}

/// Whether an open that began waiting at `started` for a conflicting claim held by
/// `holders` should give up now and name them: once [`LIVE_GRACE`] has passed while any
/// holder is alive. A live holder's claim may be only a copy of its descriptor that a
/// child forked by another of its threads holds for the moment between fork and exec
/// (/proc/locks names the process that took a lock, not the one holding the copy): a
/// test harness or a server closing the pool while another thread spawned a command
/// made the next open fail as "in use by pid N" although N had closed it. Such a copy
/// goes within milliseconds; holders that have all exited get [`RELEASE_GRACE`].
pub(super) fn refuse_live_holders(holders: &[LockHolder], started: std::time::Instant) -> bool {
    started.elapsed() >= LIVE_GRACE && holders.iter().any(|h| process_alive(h.pid))
}

/// Take the lock that goes with `access` on an open backing device. A conflicting lock
/// whose holders have all exited is waited out for [`RELEASE_GRACE`]; one held by a live
/// process (or by this one) is refused after [`LIVE_GRACE`], naming it.
pub(super) fn lock_device(path: &Path, file: &File, access: Access) -> Result<()> {
    let op = match access {
        Access::Exclusive => libc::LOCK_EX,
        Access::Shared => libc::LOCK_SH,
    } | libc::LOCK_NB;
    let started = std::time::Instant::now();
    loop {
        // SAFETY: flock takes an open descriptor and flags; `file` is open for the call.
        let rc = unsafe { libc::flock(file.as_raw_fd(), op) };
        if rc == 0 {
            return Ok(());
        }
        let e = io::Error::last_os_error();
        match e.raw_os_error() {
            Some(libc::EINTR) => continue,
            Some(libc::EWOULDBLOCK) => {}
            _ => return Err(Error::io(format!("locking {}", path.display()), e)),
        }
        let meta = file
            .metadata()
            .context(|| format!("stat {}", path.display()))?;
        let holders = lock_holders(&meta);
        if started.elapsed() >= RELEASE_GRACE || refuse_live_holders(&holders, started) {
            return Err(in_use_error(path, access, &holders));
        }
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
}
