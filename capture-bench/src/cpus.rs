//! Which CPUs a run's processes may use.
//!
//! With one client, the load generator and the proxy hand every request back and forth: whether
//! the scheduler keeps them on one CPU or wakes the other one for each hand-off moved a mode's
//! rate by half from one sample to the next on a 2-core machine, far more than capture's cost.
//! One-client runs therefore keep every process of the run (load generator, proxy, upstream) on
//! one CPU, the same in every mode; the other runs use every CPU the benchmark may.

use std::{fs, mem};

/// A set of CPUs, as `sched_setaffinity` takes it.
#[derive(Clone, Copy)]
pub struct Cpus(libc::cpu_set_t);

impl Cpus {
    /// The CPUs this process may run on.
    pub fn allowed() -> Self {
        // SAFETY: an all-zero cpu_set_t is a valid empty set; the kernel fills it.
        let mut set: libc::cpu_set_t = unsafe { mem::zeroed() };
        // SAFETY: `set` is a cpu_set_t of the size given.
        let rc = unsafe { libc::sched_getaffinity(0, size_of_val(&set), &raw mut set) };
        assert_eq!(
            rc,
            0,
            "sched_getaffinity: {}",
            std::io::Error::last_os_error()
        );
        Self(set)
    }

    /// The last CPU of this set alone, if the set holds more than one (with one CPU there is no
    /// placement to choose).
    pub fn last_alone(&self) -> Option<Self> {
        let members: Vec<usize> = (0..libc::CPU_SETSIZE as usize)
            // SAFETY: `i` is below CPU_SETSIZE.
            .filter(|&i| unsafe { libc::CPU_ISSET(i, &self.0) })
            .collect();
        let (&last, rest) = members.split_last()?;
        if rest.is_empty() {
            return None;
        }
        // SAFETY: an all-zero cpu_set_t is a valid empty set.
        let mut one: libc::cpu_set_t = unsafe { mem::zeroed() };
        // SAFETY: `last` is below CPU_SETSIZE.
        unsafe { libc::CPU_SET(last, &mut one) };
        Some(Self(one))
    }

    /// Confines the calling thread (and the threads and processes it starts later).
    pub fn confine_self(&self) {
        self.confine_task(0);
    }

    /// Confines every thread of process `pid` (threads it starts later inherit the set).
    pub fn confine_process(&self, pid: u32) {
        let tasks = fs::read_dir(format!("/proc/{pid}/task"))
            .unwrap_or_else(|e| panic!("the threads of process {pid}: {e}"));
        for task in tasks.flatten() {
            if let Some(tid) = task.file_name().to_str().and_then(|t| t.parse().ok()) {
                self.confine_task(tid);
            }
        }
    }

    fn confine_task(&self, tid: libc::pid_t) {
        // SAFETY: `self.0` is a cpu_set_t of the size given.
        let rc = unsafe { libc::sched_setaffinity(tid, size_of_val(&self.0), &raw const self.0) };
        // A thread that has just exited is no longer there to confine.
        let err = std::io::Error::last_os_error();
        assert!(
            rc == 0 || err.raw_os_error() == Some(libc::ESRCH),
            "sched_setaffinity({tid}): {err}"
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn count(cpus: &Cpus) -> usize {
        // SAFETY: a read of a valid cpu_set_t.
        unsafe { libc::CPU_COUNT(&cpus.0) as usize }
    }

    #[test]
    fn a_confined_thread_runs_on_the_last_cpu_alone_until_set_free() {
        // In a thread of its own: confinement is per thread, and the test harness's stay free.
        std::thread::spawn(|| {
            let all = Cpus::allowed();
            let Some(one) = all.last_alone() else {
                assert_eq!(count(&all), 1, "no single CPU out of several");
                return;
            };
            assert_eq!(count(&one), 1);
            one.confine_self();
            assert_eq!(count(&Cpus::allowed()), 1);
            let status = fs::read_to_string("/proc/thread-self/status").expect("thread status");
            let list = status
                .lines()
                .find(|l| l.starts_with("Cpus_allowed_list:"))
                .expect("Cpus_allowed_list");
            assert!(!list.contains(['-', ',']), "{list}");
            all.confine_process(std::process::id());
            assert_eq!(count(&Cpus::allowed()), count(&all));
        })
        .join()
        .expect("the confined thread");
    }
}
