//! The privileged test harness: every test builds its own pod (netns + cgroup), a "remote" netns
//! that owns the destination addresses, and its own bpffs/state directories, and removes all of
//! it when the guards drop. Traffic only ever goes to loopback or to these namespaces.

pub mod guards;
pub mod kernel;
pub mod probe;
pub mod promtool;
pub mod topology;

use std::path::PathBuf;

/// Panics unless running as root: these tests load BPF programs and create namespaces.
pub fn require_root() {
    // SAFETY: geteuid has no preconditions.
    assert_eq!(unsafe { libc::geteuid() }, 0, "the end-to-end tests need root (they load BPF programs and create netns); run `sudo cargo xtask test`");
}

/// A name unique to this process and call, for netns, cgroups and pin directories.
pub fn unique(prefix: &str) -> String {
    use std::sync::atomic::{AtomicU32, Ordering};
    static NEXT: AtomicU32 = AtomicU32::new(0);
    format!(
        "{prefix}-{}-{}",
        std::process::id(),
        NEXT.fetch_add(1, Ordering::Relaxed)
    )
}

/// A binary built next to the test executable (target/<profile>/NAME), or `$ENV` if set.
pub fn built_binary(name: &str, env: &str) -> PathBuf {
    if let Some(p) = std::env::var_os(env) {
        return p.into();
    }
    // Tests run from target/<profile>/deps/, binaries (the demo) from target/<profile>/.
    let exe = std::env::current_exe().expect("current_exe");
    let dir = exe.parent().expect("executable directory");
    let candidates = [
        dir.join(name),
        dir.parent().map(|d| d.join(name)).unwrap_or_default(),
    ];
    candidates.iter().find(|p| p.is_file()).cloned().unwrap_or_else(|| {
        panic!("{name} not built next to {}; run `cargo xtask test` (it builds every binary first) or set {env}", exe.display())
    })
}

pub mod bench;
pub mod cases;
pub mod cni;
pub mod enter;
