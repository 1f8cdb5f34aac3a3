//! How the benchmark's cells are measured in its beds: rounds, in each one sample per cell and
//! bed, the beds' order rotating, so that the machine's drift weighs on every mode alike.

use std::{net::Ipv4Addr, time::Duration};

use super::{bed::Bed, roles::Workload, Cell, CellResult, Sample};

/// How the cells are measured in the beds: rounds of one sample per cell and bed.
pub(super) struct Schedule {
    pub(super) rounds: usize,
    /// Load before each sample, not measured.
    pub(super) warmup: Duration,
    /// Each sample's measured load.
    pub(super) duration: Duration,
    pub(super) one_cpu_for_one_client: bool,
    /// Each sample dials a remote address of its own (outbound), so that no sample finds the
    /// pod's ports toward it held in `TIME_WAIT` by earlier ones; otherwise they all dial the
    /// same one.
    pub(super) fresh_upstream_per_sample: bool,
}

impl Schedule {
    /// Measures the cells that are `ours` in every bed, in rounds, into `results` (one per cell,
    /// in the same order), and what churn left in each pod after the last round.
    pub(super) fn measure(
        &self,
        beds: &[Bed],
        cells: &[Cell],
        results: &mut [CellResult],
        ours: impl Fn(&Cell) -> bool,
    ) {
        let rounds = self.rounds;
        for round in 0..rounds {
            for (i, cell) in cells.iter().enumerate().filter(|(_, c)| ours(c)) {
                // Interleaved: the modes' order rotates every round and cell.
                for k in 0..beds.len() {
                    let bed = &beds[(round + i + k) % beds.len()];
                    let upstream = self
                        .fresh_upstream_per_sample
                        .then(|| fresh_upstream((round * cells.len() + i) * beds.len() + k));
                    let sample = bed.run(
                        cell,
                        upstream,
                        self.warmup,
                        self.duration,
                        self.one_cpu_for_one_client,
                    );
                    let load = &sample.load;
                    eprintln!(
                        "bench: round {round} {:<48} {:<8} {:>10.0} ops/s  p50 {:>6.0}us  cpu/op {:>6.1}us  pod {:>6.1}us",
                        cell.label(),
                        bed.mode.name(),
                        load.ops as f64 / load.seconds,
                        load.p50_us,
                        sample.cpu_us_per_op,
                        sample.pod_cpu_us_per_op
                    );
                    results[i].samples.push(Sample {
                        round,
                        mode: bed.mode,
                        load: sample.load,
                        cpu_us_per_op: sample.cpu_us_per_op,
                        pod_cpu_us_per_op: sample.pod_cpu_us_per_op,
                    });
                    if round + 1 == rounds && cell.workload == Workload::Crr {
                        results[i].aftermath.push((bed.mode, bed.aftermath()));
                    }
                }
            }
        }
    }
}

/// The `n`th of the remote addresses no pod dials unless told to, from 10.0.1.0 on (the remote
/// side owns 10.0.0.0/16; 10.0.0.x are the tests' usual destinations).
fn fresh_upstream(n: usize) -> Ipv4Addr {
    let first = u32::from(Ipv4Addr::new(10, 0, 1, 0));
    let address = u32::try_from(n).map_or(u32::MAX, |n| first.saturating_add(n));
    assert!(
        address < u32::from(Ipv4Addr::new(10, 1, 0, 0)),
        "more samples than the remote side has addresses"
    );
    Ipv4Addr::from(address)
}
