//! The containerd tests' pause process: a pod sandbox's PID 1, which waits for SIGTERM or SIGINT
//! and reaps children meanwhile.

use std::io::Write as _;

use nix::sys::{
    signal::{SigSet, Signal},
    wait::{waitpid, WaitPidFlag, WaitStatus},
};

/// Prints `ready`, then waits. As PID 1 a process gets no signal it has no handler for, so the
/// signals that end it are blocked and taken with sigwait instead. Returns only an error.
pub fn pause() -> Result<std::convert::Infallible, String> {
    let mut set = SigSet::empty();
    for sig in [Signal::SIGTERM, Signal::SIGINT, Signal::SIGCHLD] {
        set.add(sig);
    }
    set.thread_block()
        .map_err(|e| format!("blocking signals: {e}"))?;
    println!("ready");
    let _ = std::io::stdout().flush();
    loop {
        match set.wait() {
            Ok(Signal::SIGCHLD) => {
                while let Ok(status) = waitpid(None, Some(WaitPidFlag::WNOHANG)) {
                    if status == WaitStatus::StillAlive {
                        break;
                    }
                }
            }
            Ok(_) => std::process::exit(0),
            Err(e) => return Err(format!("sigwait: {e}")),
        }
    }
}
