//! The privileged test harness: every test builds its own pod (netns + cgroup), a "remote" netns
//! that owns the destination addresses, and its own bpffs/state directories, and removes all of
//! it when the guards drop. Traffic only ever goes to loopback or to these namespaces.

pub mod guards;
pub mod probe;
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
    let exe = std::env::current_exe().expect("current_exe");
    let profile_dir = exe
        .parent()
        .and_then(|d| d.parent())
        .expect("target/<profile>/deps/<test>");
    let path = profile_dir.join(name);
    assert!(
        path.exists(),
        "{} not built; run `cargo xtask test` (it builds every binary first) or set {env}",
        path.display()
    );
    path
}

pub mod cases;
