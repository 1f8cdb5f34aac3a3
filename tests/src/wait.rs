//! Waiting for what a test cannot be told about (a process ready, a map emptied, a file written):
//! one way to wait, whose failure says what was awaited, for how long, and what was last seen.

use std::{
    thread::sleep,
    time::{Duration, Instant},
};

/// How often a condition is looked at again: often enough that a test waits little past the
/// moment, seldom enough that the looking costs nothing.
const POLL: Duration = Duration::from_millis(50);

/// Asks `probe` until it answers `Ok` and gives that; panics when `patience` has passed,
/// naming `what` was awaited and the last thing `probe` said was in the way (its `Err`).
#[track_caller]
pub fn wait_until<T>(
    patience: Duration,
    what: &str,
    mut probe: impl FnMut() -> Result<T, String>,
) -> T {
    let deadline = Instant::now() + patience;
    loop {
        match probe() {
            Ok(done) => return done,
            Err(last) => assert!(
                Instant::now() < deadline,
                "waited {patience:?} for {what}; last: {last}"
            ),
        }
        sleep(POLL);
    }
}

/// As [`wait_until`] for a condition without anything to say while it does not hold.
#[track_caller]
pub fn wait_for(patience: Duration, what: &str, mut holds: impl FnMut() -> bool) {
    wait_until(patience, what, || {
        if holds() {
            Ok(())
        } else {
            Err("not yet".into())
        }
    });
}

/// Asks `probe` until it answers `Ok`, for at most `patience`; the last answer either way, for
/// waits whose outcome the caller judges itself (a best effort, or an assertion with more to say).
pub fn poll_until<T>(patience: Duration, mut probe: impl FnMut() -> Result<T, T>) -> Result<T, T> {
    let deadline = Instant::now() + patience;
    loop {
        match probe() {
            Ok(done) => return Ok(done),
            Err(last) if Instant::now() >= deadline => return Err(last),
            Err(_) => sleep(POLL),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn waits_until_the_probe_answers_and_says_what_it_waited_for() {
        let mut calls = 0;
        let got = wait_until(Duration::from_secs(5), "the third call", || {
            calls += 1;
            if calls == 3 {
                Ok(calls)
            } else {
                Err(format!("call {calls}"))
            }
        });
        assert_eq!(got, 3);
        let failed = std::panic::catch_unwind(|| {
            wait_until::<()>(Duration::from_millis(120), "nothing", || {
                Err("still nothing".into())
            });
        })
        .unwrap_err();
        let message = failed.downcast_ref::<String>().unwrap();
        assert!(
            message.contains("for nothing") && message.contains("last: still nothing"),
            "{message}"
        );
        assert_eq!(
            poll_until(Duration::from_millis(120), || Err::<u8, u8>(7)),
            Err(7)
        );
    }
}
