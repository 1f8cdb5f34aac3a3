//! CI's time budget and the table `cargo xtask ci` ends with.
//!
//! The budget is 45 minutes on the slowest machine CI may get, which is 20 minutes on the
//! reference machine (the fast one of 2026-12-03: its calibration figure is
//! `REFERENCE_CALIBRATION`; the slow machines of the landings before ran the same CI about 2.25
//! times longer). Each step has a share of those 20 minutes; on another machine the shares
//! scale with its calibration figure. A step past 80% of its share is named in a warning, so the
//! change that grows it sees it before CI runs out of time.

use std::{fmt::Write as _, time::Duration};

/// The calibration figure of the reference machine (seconds): the median of five runs there on
/// 2026-12-03, idle, with rustc 1.95.0 (3.77 to 3.98 s).
pub const REFERENCE_CALIBRATION: f64 = 3.8;

/// The whole run's budget on the reference machine (seconds).
pub const REFERENCE_BUDGET: f64 = 20.0 * 60.0;

/// The budget on the slowest machine CI may get (seconds): CI's hard limit is 90 minutes.
pub const SLOWEST_BUDGET: f64 = 45.0 * 60.0;

/// When a step's time is worth a warning, as a fraction of its share.
const WARN_AT: f64 = 0.8;

/// Each step's share of `REFERENCE_BUDGET`, in seconds on the reference machine: what each took
/// in the cold run at 8f09691 (2026-12-06, 1,449 s on a machine 1.28 times the reference: xtask
/// 43 s, calibration 10, setup 7 with the tools already there (46 to 70 from nothing), lint 205,
/// fuzz smoke 63, build 490 (the arm64 image's static binaries 150 of it), test 399 (the image
/// check's rebuild beside it, in the idle class), the image check's rest 0, kernel matrix 232,
/// scaled), with the budget's remaining 5% spread over them. That run used about 95% of the
/// budget, 98% with setup's cold minute: every step sits near its share, and the next change
/// that grows one makes it cheaper or takes the time from another (docs/working-on/ci.md).
pub const SHARES: &[(&str, f64)] = &[
    ("xtask", 35.0),
    ("calibration", 9.0),
    ("setup", 50.0),
    ("lint", 165.0),
    ("fuzz smoke", 51.0),
    ("build", 395.0),
    ("test", 320.0),
    ("image check", 5.0),
    ("kernel matrix", 170.0),
];

/// One step as it ran.
#[derive(Clone, Debug)]
pub struct StepTime {
    pub name: String,
    pub wall: Duration,
    /// The share of the machine's CPUs busy meanwhile (0..=1), if known.
    pub busy: Option<f64>,
    /// Ran beside the steps, not between them: its time is not part of the total.
    pub background: bool,
    pub failed: bool,
}

/// How this machine compares with the reference: above 1, slower.
pub fn slowness(calibration: f64) -> f64 {
    calibration / REFERENCE_CALIBRATION
}

fn share(name: &str) -> Option<f64> {
    SHARES.iter().find(|(n, _)| *n == name).map(|(_, s)| *s)
}

/// The steps past `WARN_AT` of their share (scaled by `slowness`), with their use of it.
pub fn over_share(steps: &[StepTime], slowness: f64) -> Vec<(String, f64)> {
    steps
        .iter()
        .filter(|s| !s.background)
        .filter_map(|s| {
            let used = s.wall.as_secs_f64() / (share(&s.name)? * slowness);
            (used >= WARN_AT).then(|| (s.name.clone(), used))
        })
        .collect()
}

/// The table: each step's wall time, how busy the CPUs were, its share here and how much of it
/// it used; then the total against the budget, and the calibration.
pub fn table(
    steps: &[StepTime],
    calibrations: &[Duration],
    steal: Option<f64>,
    total: Duration,
) -> String {
    let figures: Vec<f64> = calibrations.iter().map(Duration::as_secs_f64).collect();
    let calibration = if figures.is_empty() {
        REFERENCE_CALIBRATION
    } else {
        figures.iter().sum::<f64>() / figures.len() as f64
    };
    let slow = slowness(calibration);
    let mut out = String::new();
    let _ = writeln!(
        out,
        "{:<44} {:>8} {:>6} {:>9} {:>6}",
        "step", "wall s", "busy", "share s", "used"
    );
    for s in steps {
        let name = if s.background {
            format!("{} (beside the others)", s.name)
        } else {
            s.name.clone()
        };
        let busy = s
            .busy
            .map_or_else(|| "-".to_string(), |b| format!("{:.0}%", b * 100.0));
        let (share_here, used) = match share(&s.name) {
            Some(sh) if !s.background => {
                let here = sh * slow;
                (
                    format!("{here:.0}"),
                    format!("{:.0}%", s.wall.as_secs_f64() / here * 100.0),
                )
            }
            _ => ("-".to_string(), "-".to_string()),
        };
        let mark = if s.failed { "  FAILED" } else { "" };
        let _ = writeln!(
            out,
            "{name:<44} {:>8.0} {busy:>6} {share_here:>9} {used:>6}{mark}",
            s.wall.as_secs_f64()
        );
    }
    let budget_here = REFERENCE_BUDGET * slow;
    let _ = writeln!(
        out,
        "{:<44} {:>8.0} {:>6} {:>9.0} {:>5.0}%",
        "total",
        total.as_secs_f64(),
        "",
        budget_here,
        total.as_secs_f64() / budget_here * 100.0
    );
    let shown: Vec<String> = figures.iter().map(|f| format!("{f:.1} s")).collect();
    let _ = writeln!(
        out,
        "calibration: {} (rustc -O of a fixed program; the reference machine: {REFERENCE_CALIBRATION:.1} s): this machine is {slow:.2}x the reference",
        shown.join(" at the start, ")
            + if shown.len() > 1 { " at the end" } else { "" },
    );
    if let Some(steal) = steal {
        let _ = writeln!(
            out,
            "CPU time stolen by the hypervisor during the run: {:.0}%",
            steal * 100.0
        );
    }
    let _ = writeln!(
        out,
        "budget: {:.0} min on the reference machine, {:.0} min on the slowest; this run scaled to the reference: {:.1} min (to the slowest: {:.1} min)",
        REFERENCE_BUDGET / 60.0,
        SLOWEST_BUDGET / 60.0,
        total.as_secs_f64() / slow / 60.0,
        total.as_secs_f64() / slow * (SLOWEST_BUDGET / REFERENCE_BUDGET) / 60.0
    );
    for (name, used) in over_share(steps, slow) {
        let _ = writeln!(
            out,
            "warning: step `{name}` used {:.0}% of its share of CI's time (xtask/src/ci/budget.rs): make it cheaper, or take the time from another step's share",
            used * 100.0
        );
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn step(name: &str, secs: u64) -> StepTime {
        StepTime {
            name: name.into(),
            wall: Duration::from_secs(secs),
            busy: Some(0.5),
            background: false,
            failed: false,
        }
    }

    #[test]
    fn the_shares_add_up_to_the_budget() {
        let sum: f64 = SHARES.iter().map(|(_, s)| s).sum();
        assert!((sum - REFERENCE_BUDGET).abs() < 1.0, "{sum}");
    }

    #[test]
    fn a_step_past_four_fifths_of_its_share_is_named_on_a_machine_of_any_speed() {
        let lint = share("lint").unwrap();
        let steps = [
            step("lint", (lint * 0.85) as u64),
            step("test", 10),
            StepTime {
                background: true,
                ..step("setup-check", 10_000)
            },
        ];
        let warned = over_share(&steps, 1.0);
        assert_eq!(warned.len(), 1);
        assert_eq!(warned[0].0, "lint");
        // The same times on a machine twice as slow are within the shares.
        assert!(over_share(&steps, 2.0).is_empty());
        let text = table(
            &steps,
            &[Duration::from_secs_f64(REFERENCE_CALIBRATION)],
            None,
            Duration::from_secs(200),
        );
        assert!(text.contains("warning: step `lint`"), "{text}");
        assert!(text.contains("setup-check (beside the others)"), "{text}");
    }
}
