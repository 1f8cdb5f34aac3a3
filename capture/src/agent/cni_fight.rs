//! Telling a neighbour that rewrites the CNI configuration over and over from one that rewrites
//! it once, and not fighting the first.
//!
//! Network plugins rewrite their configuration when they start or upgrade (AWS VPC CNI and Calico
//! write their conflist whole at each start): capture-cni is chained again at once. Some rewrite
//! it on every change in the directory: Cilium with `cni.exclusive=true` renames every other
//! file to `*.cilium_bak` and writes its own conflist again whenever anything there changes
//! (`cleanupOtherCNI` and `watchForDirectoryChanges` in cilium's `daemon/cmd/cni`), so each
//! re-chaining undoes itself within a moment. istio-cni's installer meets this with a throttle
//! and a warning (`installationThrottle`, `cni/pkg/install/install.go`); here the wait before
//! each re-chaining doubles while the configuration keeps dropping capture-cni, up to
//! [`MAX_WAIT`], and the fight is named (log, `capture status`, a metric, an alert) with its fix.
//! Pods created while capture-cni is not chained start uncaptured; the reconcile captures them in
//! place (docs/using/runtime-reconcile.md).

use std::{
    collections::VecDeque,
    path::Path,
    time::{Duration, Instant},
};

pub use crate::install::chain_report::{ChainReport, Fight, Neighbour};

/// Re-chainings closer together than this belong to one run of rewrites.
pub const WINDOW: Duration = Duration::from_secs(30);
/// How many re-chainings within [`WINDOW`] make a fight.
pub const FIGHT_AFTER: usize = 3;
/// The longest wait between two re-chainings in a fight.
pub const MAX_WAIT: Duration = Duration::from_mins(1);
/// How long capture-cni must stay chained for a fight to be over.
pub const QUIET: Duration = Duration::from_secs(90);

/// The re-chainings of the last [`WINDOW`], and the fight they make.
#[derive(Debug, Default)]
pub struct Throttle {
    recent: VecDeque<Instant>,
    last: Option<Instant>,
    fight: Option<Fight>,
}

impl Throttle {
    fn prune(&mut self, now: Instant) {
        while self
            .recent
            .front()
            .is_some_and(|t| now.duration_since(*t) > WINDOW)
        {
            self.recent.pop_front();
        }
    }

    /// How long to wait, from `now`, before chaining capture-cni again: at once unless it was
    /// chained again within [`WINDOW`], then twice as long for each re-chaining of the window,
    /// or, in a fight, of the fight, up to [`MAX_WAIT`].
    #[must_use]
    pub fn wait(&mut self, now: Instant) -> Duration {
        self.prune(now);
        let Some(last) = self.last else {
            return Duration::ZERO;
        };
        let count = match &self.fight {
            Some(fight) => usize::try_from(fight.rechains).unwrap_or(usize::MAX),
            None if self.recent.is_empty() => return Duration::ZERO,
            None => self.recent.len(),
        };
        let doublings = u32::try_from(count.saturating_sub(1)).unwrap_or(u32::MAX);
        let backoff = 2u64
            .checked_pow(doublings)
            .map_or(MAX_WAIT, Duration::from_secs)
            .min(MAX_WAIT);
        (last + backoff).saturating_duration_since(now)
    }

    /// capture-cni was chained again into `file` at `now`; a fight that this one begins.
    pub fn rechained(
        &mut self,
        now: Instant,
        now_unix: u64,
        file: &Path,
        neighbour: impl FnOnce() -> Neighbour,
    ) -> Option<&Fight> {
        self.prune(now);
        self.recent.push_back(now);
        self.last = Some(now);
        if let Some(fight) = &mut self.fight {
            fight.rechains += 1;
            return None;
        }
        if self.recent.len() < FIGHT_AFTER {
            return None;
        }
        let neighbour = neighbour();
        self.fight = Some(Fight {
            file: file.to_path_buf(),
            neighbour,
            since_unix: now_unix,
            rechains: self.recent.len() as u64,
            fix: neighbour.fix(file),
        });
        self.fight.as_ref()
    }

    /// capture-cni is chained at `now`: a fight it has stayed chained through [`QUIET`] is over.
    pub fn holds(&mut self, now: Instant) -> Option<Fight> {
        let quiet = self.last.is_some_and(|l| now.duration_since(l) >= QUIET);
        if quiet {
            self.prune(now);
            return self.fight.take();
        }
        None
    }

    #[must_use]
    pub fn fight(&self) -> Option<&Fight> {
        self.fight.as_ref()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A neighbour that drops capture-cni a quarter second after each re-chaining, for `run`:
    /// how many times capture chains it again, and whether it calls it a fight.
    fn against_a_rewriter(run: Duration) -> (usize, Option<Fight>) {
        let start = Instant::now();
        let mut throttle = Throttle::default();
        let (mut now, mut rechains, mut fight) = (start, 0, None);
        let file = Path::new("/etc/cni/net.d/05-cilium.conflist");
        while now.duration_since(start) < run {
            // Dropped: wait as the throttle says, then chain again.
            now += throttle.wait(now);
            if now.duration_since(start) >= run {
                break;
            }
            rechains += 1;
            if let Some(f) = throttle.rechained(now, 0, file, || Neighbour::CiliumExclusive) {
                fight = Some(f.clone());
            }
            now += Duration::from_millis(250);
        }
        (rechains, fight)
    }

    #[test]
    fn a_neighbour_that_rewrites_on_every_change_is_met_with_a_growing_wait_not_a_loop() {
        let (rechains, fight) = against_a_rewriter(Duration::from_secs(20));
        // 80 in 20 s without the throttle: 1, 2, 4 and 8 s apart here.
        assert!(
            (4..=6).contains(&rechains),
            "{rechains} re-chainings in 20 s"
        );
        let fight = fight.expect("a fight is named");
        assert_eq!(fight.neighbour, Neighbour::CiliumExclusive);
        assert!(fight.fix.contains("cni.exclusive=false"), "{}", fight.fix);
        let (in_ten_minutes, _) = against_a_rewriter(Duration::from_mins(10));
        assert!(
            in_ten_minutes <= 6 + 600 / 60,
            "{in_ten_minutes} re-chainings in ten minutes"
        );
    }

    #[test]
    fn a_rewrite_at_each_start_is_chained_again_at_once_and_is_no_fight() {
        let mut throttle = Throttle::default();
        let start = Instant::now();
        let file = Path::new("/etc/cni/net.d/10-aws.conflist");
        // aws-node or calico-node restarted three times, minutes apart.
        for minutes in [0, 5, 12] {
            let now = start + Duration::from_secs(60 * minutes);
            assert_eq!(throttle.wait(now), Duration::ZERO, "at {minutes} min");
            assert!(throttle
                .rechained(now, 0, file, || Neighbour::Unknown)
                .is_none());
        }
        // Twice within a second (a plugin that writes its file in two steps): still at once, then
        // a second's wait.
        let now = start + Duration::from_hours(1);
        assert_eq!(throttle.wait(now), Duration::ZERO);
        throttle.rechained(now, 0, file, || Neighbour::Unknown);
        assert_eq!(throttle.wait(now), Duration::from_secs(1));
        assert!(throttle.fight().is_none());
    }

    #[test]
    fn a_fight_ends_once_the_chain_holds() {
        let mut throttle = Throttle::default();
        let start = Instant::now();
        let file = Path::new("/etc/cni/net.d/05-cilium.conflist");
        let mut now = start;
        for _ in 0..FIGHT_AFTER {
            now += throttle.wait(now);
            throttle.rechained(now, 0, file, || Neighbour::Unknown);
        }
        assert!(throttle.fight().is_some());
        assert!(throttle.holds(now + Duration::from_secs(10)).is_none());
        let over = throttle
            .holds(now + QUIET)
            .expect("over after a quiet spell");
        assert_eq!(over.rechains, FIGHT_AFTER as u64);
        assert!(throttle.fight().is_none());
        assert_eq!(throttle.wait(now + QUIET + WINDOW), Duration::ZERO);
    }
}
