//! The machine's CPU time from /proc/stat: how busy the CPUs were during a step, and how much
//! time the hypervisor took from this machine (steal) during the run.

/// The aggregate `cpu` line of /proc/stat, in clock ticks.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Stat {
    total: u64,
    idle: u64,
    steal: u64,
}

impl Stat {
    pub fn read() -> Option<Self> {
        Self::parse(&std::fs::read_to_string("/proc/stat").ok()?)
    }

    /// `cpu  user nice system idle iowait irq softirq steal guest guest_nice`
    fn parse(text: &str) -> Option<Self> {
        let line = text.lines().find(|l| l.starts_with("cpu "))?;
        let ticks: Vec<u64> = line
            .split_whitespace()
            .skip(1)
            .filter_map(|v| v.parse().ok())
            .collect();
        // guest time is counted in user time already.
        let total = ticks.iter().take(8).sum();
        Some(Self {
            total,
            idle: ticks.get(3)? + ticks.get(4).unwrap_or(&0),
            steal: *ticks.get(7).unwrap_or(&0),
        })
    }

    /// The ticks between `earlier` and this reading.
    pub fn since(&self, earlier: &Self) -> Self {
        Self {
            total: self.total.saturating_sub(earlier.total),
            idle: self.idle.saturating_sub(earlier.idle),
            steal: self.steal.saturating_sub(earlier.steal),
        }
    }

    /// The share of the CPUs' time that was busy (not idle, not waiting for I/O, not stolen).
    pub fn busy(&self) -> f64 {
        if self.total == 0 {
            return 0.0;
        }
        (self.total - self.idle - self.steal) as f64 / self.total as f64
    }

    /// The share of the CPUs' time the hypervisor gave to others.
    pub fn steal(&self) -> f64 {
        if self.total == 0 {
            return 0.0;
        }
        self.steal as f64 / self.total as f64
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn busy_and_stolen_shares_between_two_readings() {
        let a = Stat::parse("cpu  100 0 50 800 50 0 0 0 0 0\ncpu0 1 2 3\n").unwrap();
        let b = Stat::parse("cpu  200 0 100 900 50 0 0 50 0 0\n").unwrap();
        let d = b.since(&a);
        assert_eq!(d.total, 300);
        assert!((d.busy() - 0.5).abs() < 1e-9, "{}", d.busy());
        assert!((d.steal() - 50.0 / 300.0).abs() < 1e-9);
    }
}
