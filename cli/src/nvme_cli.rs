//! `kvtier nvme list` and `kvtier nvme bind ADDR -- COMMAND`: the host side
//! of the userspace NVMe engine (binding through [`kvtier::nvme::bind`]).

use kvtier::error::{Error, Result};
use kvtier::host::signature::Signature;
use kvtier::nvme::bind::{list_controllers, BindDriver, PciBinding};
use nix::sys::signal::{kill, pthread_sigmask, SigSet, SigmaskHow, Signal};
use nix::unistd::Pid;
use std::os::unix::process::CommandExt;
use std::process::{Command, ExitStatus};

/// Prints the NVMe controllers, their drivers and block devices.
pub fn list() -> Result<i32> {
    use std::fmt::Write;
    let ctrls = list_controllers()?;
    if ctrls.is_empty() {
        crate::cli::out("no NVMe controllers (no PCI function of class 0x0108xx)\n")?;
        return Ok(0);
    }
    // One write at the end: a reader that goes away (`| head -1`) is then
    // one error the caller handles, not a panic in println!.
    let mut text = String::new();
    for c in &ctrls {
        let _ = writeln!(
            text,
            "{}  {}  class {:#08x}  driver {}",
            c.addr,
            c.id,
            c.class,
            c.driver.as_deref().unwrap_or("none")
        );
        if c.driver.as_deref() == Some("nvme") && c.block_devices.is_empty() {
            let _ = writeln!(text, "    no namespaces (yet)");
        }
        for b in &c.block_devices {
            let what = match &b.signature {
                Some(Signature::Empty) => "empty".to_string(),
                Some(s) => s.to_string(),
                None => "unreadable".to_string(),
            };
            let state = if b.problems.is_empty() {
                "free: can be bound".to_string()
            } else {
                b.problems.join("; ")
            };
            let _ = writeln!(text, "    /dev/{:<12} {what}; {state}", b.name);
        }
    }
    crate::cli::out(&text)?;
    Ok(0)
}

/// The exit code a shell gives a child that ended with `status`.
fn exit_code(status: ExitStatus) -> i32 {
    use std::os::unix::process::ExitStatusExt;
    status
        .code()
        .or_else(|| status.signal().map(|s| 128 + s))
        .unwrap_or(1)
}

/// Runs `command` to its end with SIGINT, SIGTERM and SIGHUP (blocked in
/// this thread by the caller, with SIGCHLD) forwarded to it; returns its
/// exit code. The child starts with an empty signal mask.
fn run_forwarding(command: &[String], env: &[(&str, &str)], signals: &SigSet) -> Result<i32> {
    let (prog, args) = command.split_first().ok_or_else(|| {
        Error::invalid("no command to run: `kvtier nvme bind ADDR -- COMMAND [ARGS...]`")
    })?;
    let mut cmd = Command::new(prog);
    cmd.args(args).envs(env.iter().copied());
    // std does not reset the signal mask of the child (seen: a command
    // started with SIGTERM blocked, so the SIGTERM passed on to it did
    // nothing): unblock everything between fork and exec.
    // SAFETY: sigprocmask is async-signal-safe; nothing else runs there.
    unsafe {
        cmd.pre_exec(|| {
            let mut empty = std::mem::MaybeUninit::<libc::sigset_t>::uninit();
            libc::sigemptyset(empty.as_mut_ptr());
            if libc::sigprocmask(libc::SIG_SETMASK, empty.as_ptr(), std::ptr::null_mut()) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    let mut child = cmd
        .spawn()
        .map_err(|e| Error::io(format!("running {prog}"), e))?;
    let pid = Pid::from_raw(child.id() as i32);
    loop {
        if let Some(status) = child
            .try_wait()
            .map_err(|e| Error::io(format!("waiting for {prog}"), e))?
        {
            return Ok(exit_code(status));
        }
        // A SIGCHLD from an exit after try_wait stays pending: no lost
        // wake-up while this is the only thread. With other threads the
        // kernel may hand SIGCHLD to one of them, so wait at most 200 ms.
        let timeout = libc::timespec {
            tv_sec: 0,
            tv_nsec: 200_000_000,
        };
        // SAFETY: a valid signal set and timeout; no siginfo wanted.
        let sig = unsafe { libc::sigtimedwait(signals.as_ref(), std::ptr::null_mut(), &timeout) };
        if sig > 0 && sig != libc::SIGCHLD {
            if let Ok(sig) = Signal::try_from(sig) {
                let _ = kill(pid, sig);
            }
        }
    }
}

/// `kvtier nvme bind`: binds `addr` to `driver`, runs `command` with
/// `KVTIER_NVME_DEVICE=addr`, gives the controller back to its driver when
/// the command ends (also on SIGINT/SIGTERM/SIGHUP, which are passed on to
/// the command), and returns the command's exit code.
pub fn bind_and_run(
    addr: &str,
    driver: BindDriver,
    force: bool,
    command: &[String],
) -> Result<i32> {
    if command.is_empty() {
        return Err(Error::invalid(
            "no command to run: `kvtier nvme bind ADDR -- COMMAND [ARGS...]` (the controller is \
             bound while the command runs, then given back)",
        ));
    }
    // Block the signals before binding: a Ctrl-C while the controller is
    // half-way between drivers must not kill us before the restore.
    let mut signals = SigSet::empty();
    for s in [
        Signal::SIGINT,
        Signal::SIGTERM,
        Signal::SIGHUP,
        Signal::SIGCHLD,
    ] {
        signals.add(s);
    }
    let mut old = SigSet::empty();
    pthread_sigmask(SigmaskHow::SIG_BLOCK, Some(&signals), Some(&mut old))?;
    let result = (|| {
        let binding = PciBinding::bind(addr, driver, force)?;
        for note in binding.forced() {
            crate::cli::note!("kvtier: warning (--force): {note}");
        }
        let addr = binding.addr().to_string();
        if binding.was_already_bound() {
            crate::cli::note!(
                "kvtier: {addr} is already bound to {}; leaving it so",
                driver.name()
            );
        } else {
            crate::cli::note!(
                "kvtier: {addr} bound to {} (was {})",
                driver.name(),
                binding.original_driver().unwrap_or("unbound")
            );
        }
        // A signal that came while binding: do not start the command.
        let pending = pending_signals();
        let interrupted = [Signal::SIGINT, Signal::SIGTERM, Signal::SIGHUP]
            .into_iter()
            .find(|s| pending.contains(s));
        let code = match interrupted {
            Some(sig) => Ok(128 + sig as i32),
            None => run_forwarding(command, &[("KVTIER_NVME_DEVICE", &addr)], &signals),
        };
        let original = binding.original_driver().unwrap_or("no driver").to_string();
        let restored = binding.restore();
        match &restored {
            Ok(()) => crate::cli::note!("kvtier: {addr} given back to {original}"),
            Err(e) => crate::cli::note!("kvtier: error: giving {addr} back to {original}: {e}"),
        }
        let code = code?;
        Ok(if restored.is_err() && code == 0 {
            2
        } else {
            code
        })
    })();
    pthread_sigmask(SigmaskHow::SIG_SETMASK, Some(&old), None)?;
    result
}

/// The signals pending for this thread (blocked, not yet taken).
fn pending_signals() -> Vec<Signal> {
    let mut raw = std::mem::MaybeUninit::<libc::sigset_t>::uninit();
    // SAFETY: sigpending fills the set it is given; on failure the set is
    // not read.
    if unsafe { libc::sigpending(raw.as_mut_ptr()) } != 0 {
        return Vec::new();
    }
    // SAFETY: initialised by the successful sigpending above.
    let raw = unsafe { raw.assume_init() };
    Signal::iterator()
        // SAFETY: a valid set and a valid signal number.
        .filter(|s| unsafe { libc::sigismember(&raw, *s as i32) } == 1)
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sh(script: &str) -> Vec<String> {
        vec!["/bin/sh".into(), "-c".into(), script.into()]
    }

    #[test]
    fn the_command_sees_the_device_and_its_status_comes_back() {
        let mut set = SigSet::empty();
        set.add(Signal::SIGCHLD);
        let mut old = SigSet::empty();
        pthread_sigmask(SigmaskHow::SIG_BLOCK, Some(&set), Some(&mut old)).unwrap();
        let env = [("KVTIER_NVME_DEVICE", "0000:00:04.0")];
        let code = run_forwarding(
            &sh("test \"$KVTIER_NVME_DEVICE\" = 0000:00:04.0 && exit 7"),
            &env,
            &set,
        );
        assert_eq!(code.unwrap(), 7);
        // Killed by a signal: 128 + its number, as a shell reports it.
        assert_eq!(
            run_forwarding(&sh("kill -KILL $$"), &env, &set).unwrap(),
            128 + 9
        );
        // The command starts with no signal blocked, whatever this thread blocks.
        let script =
            "case $(grep SigBlk /proc/$$/status) in *0000000000000000) exit 0;; *) exit 5;; esac";
        assert_eq!(run_forwarding(&sh(script), &env, &set).unwrap(), 0);
        let e = run_forwarding(&["/nonexistent/cmd".to_string()], &env, &set).unwrap_err();
        assert!(e.to_string().contains("running /nonexistent/cmd"), "{e}");
        pthread_sigmask(SigmaskHow::SIG_SETMASK, Some(&old), None).unwrap();
    }

    #[test]
    fn bind_without_a_command_is_refused_before_touching_anything() {
        let e = bind_and_run("0000:00:04.0", BindDriver::VfioPci, false, &[]).unwrap_err();
        assert!(e.to_string().contains("no command to run"), "{e}");
    }
}
