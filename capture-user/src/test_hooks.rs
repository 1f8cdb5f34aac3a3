//! Faults the tests inject into builds with the `test-hooks` feature; release builds compile
//! them away.

/// `CAPTURE_DIE_AT=<point>` has the process abort at that point, as a SIGKILL there would: how
/// the tests reach an operation that died half-way without racing a kill against it.
#[cfg(feature = "test-hooks")]
pub fn die_for_testing(point: &str) {
    if std::env::var("CAPTURE_DIE_AT").is_ok_and(|p| p == point) {
        eprintln!("capture: dying at {point} (CAPTURE_DIE_AT)");
        std::process::abort();
    }
}

#[cfg(not(feature = "test-hooks"))]
pub fn die_for_testing(_point: &str) {}
