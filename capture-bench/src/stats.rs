//! The statistics the report gives: medians and ranges over rounds, and ratios per round.

use super::{roles::Workload, CellResult, Mode, Sample};

/// The value at quantile `q` (nearest rank) of `v`.
pub(super) fn percentile(mut v: Vec<f64>, q: f64) -> f64 {
    if v.is_empty() {
        return 0.0;
    }
    v.sort_by(f64::total_cmp);
    let rank = ((q * v.len() as f64).ceil() as usize).clamp(1, v.len());
    v[rank - 1]
}

pub(super) fn median(mut v: Vec<f64>) -> f64 {
    if v.is_empty() {
        return 0.0;
    }
    v.sort_by(f64::total_cmp);
    let n = v.len();
    if n % 2 == 1 {
        v[n / 2]
    } else {
        f64::midpoint(v[n / 2 - 1], v[n / 2])
    }
}

/// Per-mode medians of one cell.
#[derive(Clone, Copy, Default)]
pub struct Summary {
    pub rate: f64,
    pub rate_min: f64,
    pub rate_max: f64,
    pub p50: f64,
    pub p99: f64,
    pub p999: f64,
    pub cpu: f64,
    pub pod_cpu: f64,
    /// Failed operations per second.
    pub errors: f64,
}

#[must_use]
pub fn summarize(cell: &CellResult, mode: Mode) -> Summary {
    let s: Vec<_> = cell.samples.iter().filter(|s| s.mode == mode).collect();
    let rates: Vec<f64> = s.iter().map(|x| sample_rate(cell, x)).collect();
    Summary {
        rate: median(rates.clone()),
        rate_min: rates.iter().copied().fold(f64::INFINITY, f64::min),
        rate_max: rates.iter().copied().fold(0.0, f64::max),
        p50: median(s.iter().map(|x| x.load.p50_us).collect()),
        p99: median(s.iter().map(|x| x.load.p99_us).collect()),
        p999: median(s.iter().map(|x| x.load.p999_us).collect()),
        cpu: median(s.iter().map(|x| x.cpu_us_per_op).collect()),
        pod_cpu: median(s.iter().map(|x| x.pod_cpu_us_per_op).collect()),
        errors: median(
            s.iter()
                .filter(|x| x.load.seconds > 0.0)
                .map(|x| x.load.errors as f64 / x.load.seconds)
                .collect(),
        ),
    }
}

/// A mode's rate against the baseline's within each round, where the two ran seconds apart:
/// median, min and max of those per-round ratios. The machine's load drifts over minutes, which
/// moves whole rounds; a ratio taken within a round cancels that drift, where the ratio of two
/// medians taken over all rounds does not. `None` when no round has both modes.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Paired {
    pub median: f64,
    pub min: f64,
    pub max: f64,
    pub rounds: usize,
}

#[must_use]
pub fn paired(cell: &CellResult, mode: Mode, baseline: Mode) -> Option<Paired> {
    let rate_in = |round: usize, m: Mode| {
        cell.samples
            .iter()
            .find(|s| s.round == round && s.mode == m && s.load.seconds > 0.0)
            .map(|s| sample_rate(cell, s))
    };
    let mut rounds: Vec<usize> = cell.samples.iter().map(|s| s.round).collect();
    rounds.sort_unstable();
    rounds.dedup();
    let ratios: Vec<f64> = rounds
        .into_iter()
        .filter_map(|r| match (rate_in(r, mode), rate_in(r, baseline)) {
            (Some(a), Some(b)) if b > 0.0 => Some(a / b),
            _ => None,
        })
        .collect();
    (!ratios.is_empty()).then(|| Paired {
        median: median(ratios.clone()),
        min: ratios.iter().copied().fold(f64::INFINITY, f64::min),
        max: ratios.iter().copied().fold(0.0, f64::max),
        rounds: ratios.len(),
    })
}

fn sample_rate(cell: &CellResult, x: &Sample) -> f64 {
    let per_s = if cell.cell.workload == Workload::Stream {
        x.load.bytes as f64 / 1e6
    } else {
        x.load.ops as f64
    };
    per_s / x.load.seconds
}

/// `a / b`, 0 where `b` is.
#[must_use]
pub fn ratio(a: f64, b: f64) -> f64 {
    if b == 0.0 {
        0.0
    } else {
        a / b
    }
}

/// Median of the pods around the 10th and of the last tenth.
pub fn scale_points(l: &[f64]) -> (f64, f64) {
    if l.is_empty() {
        return (0.0, 0.0);
    }
    let around10 = l.iter().skip(5).take(10).copied().collect::<Vec<_>>();
    let tail = (l.len() / 10).max(1);
    (median(around10), median(l[l.len() - tail..].to_vec()))
}
