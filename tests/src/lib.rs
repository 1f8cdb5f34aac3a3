//! The privileged test harness: every test builds its own pod (netns + cgroup), a "remote" netns
//! that owns the destination addresses, and its own bpffs/state directories, and removes all of
//! it when the guards drop. Traffic only ever goes to loopback or to these namespaces.

pub mod accel;
pub mod accepted;
pub mod cni_neighbours;
pub mod dashboard;
pub mod flood;
pub mod guards;
pub mod haproxy;
pub mod injected;
pub mod istio_goldens;
pub mod istio_validation;
pub mod kernel;
pub mod pause;
pub mod pinned_maps;
pub mod probe;
pub mod prometheus;
pub mod promtool;
pub mod socket_lb;
pub mod sockopt_survey;
pub mod topology;
pub mod wait;

use std::path::{Path, PathBuf};

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

/// A fact of this kernel and build that costs seconds to learn, learned once per test run rather
/// than once per test binary: kept in `$CAPTURE_TEST_CACHE` (which `cargo xtask test` and the
/// kernel matrix set to a directory of the run's own) under `key` with the kernel release and the
/// build's name; without the variable, `learn` runs every time it is asked.
pub fn once_per_run<T>(key: &str, learn: impl FnOnce() -> T) -> T
where
    T: serde::Serialize + serde::de::DeserializeOwned,
{
    let Some(dir) = std::env::var_os("CAPTURE_TEST_CACHE") else {
        return learn();
    };
    let release = std::fs::read_to_string("/proc/sys/kernel/osrelease").unwrap_or_default();
    let path = Path::new(&dir).join(format!(
        "{key}-{}-{}.json",
        capture_user::ebpf::loader::build_name(),
        release.trim()
    ));
    if let Some(known) = std::fs::read(&path)
        .ok()
        .and_then(|bytes| serde_json::from_slice(&bytes).ok())
    {
        return known;
    }
    let learned = learn();
    // Written whole, then renamed: a binary running beside this one reads all of it or nothing.
    let partial = path.with_extension(format!("{}.partial", std::process::id()));
    let written = std::fs::create_dir_all(&dir)
        .and_then(|()| std::fs::write(&partial, serde_json::to_vec(&learned).expect("JSON")))
        .and_then(|()| std::fs::rename(&partial, &path));
    if let Err(e) = written {
        eprintln!("cannot keep {} for the run: {e}", path.display());
    }
    learned
}

/// The test's probe binary (tests/src/bin/capture-probe).
#[must_use]
pub fn probe_bin() -> PathBuf {
    built_binary("capture-probe", "CAPTURE_PROBE_BIN")
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

/// The node agent's image archive, which `cargo xtask test` builds (`cargo xtask image`) into
/// `target/image/`. `$CAPTURE_IMAGE_ARCHIVE` overrides it.
pub fn image_archive() -> PathBuf {
    let archive = image_archive_path();
    assert!(
        archive.is_file(),
        "{} is not built; run `cargo xtask test` or `cargo xtask image`, or set CAPTURE_IMAGE_ARCHIVE",
        archive.display()
    );
    archive
}

fn image_archive_path() -> PathBuf {
    std::env::var_os("CAPTURE_IMAGE_ARCHIVE").map_or_else(
        || target_and_profile().0.join("image/capture.oci.tar"),
        PathBuf::from,
    )
}

/// The name the archive's image carries (`localhost/capture:<version>`, the version as its
/// `capture version` says), which a manifest's `localhost/capture:<release>` stands for in the
/// tests (`daemonset::node_agent`).
/// None where no archive is built (a test that reads the manifest's arguments alone needs none).
pub fn image_name() -> Option<String> {
    static NAME: std::sync::OnceLock<Option<String>> = std::sync::OnceLock::new();
    NAME.get_or_init(|| {
        let archive = image_archive_path();
        if !archive.is_file() {
            return None;
        }
        let images = capture_oci::read_archive(&archive)
            .unwrap_or_else(|e| panic!("reading {}: {e}", archive.display()));
        let first = images
            .first()
            .unwrap_or_else(|| panic!("no image in {}", archive.display()));
        Some(first.name.clone())
    })
    .clone()
}

/// The release `cargo xtask test` writes (`cargo xtask release`) for the tests to check.
#[must_use]
pub fn release_dir() -> PathBuf {
    let dir = target_and_profile().0.join("dist/release");
    assert!(
        dir.join("SHA256SUMS").is_file(),
        "{} holds no release; run `cargo xtask test` or `cargo xtask release --out {0}`",
        dir.display()
    );
    dir
}

/// The `capture` binary of the next-layout variant (`--features capture-user/layout-next`), which
/// `cargo xtask test` builds into `target/variant`: another build whose pod-config and counter
/// maps differ, for the upgrade and rollback tests. `$CAPTURE_VARIANT_BIN` overrides it.
pub fn variant_capture_bin() -> PathBuf {
    other_build("variant", "CAPTURE_VARIANT_BIN")
}

/// The `capture` binary of the previous release, built from the git history by `cargo xtask
/// test` into `target/previous`. `$CAPTURE_PREVIOUS_BIN` overrides it.
pub fn previous_release_capture_bin() -> PathBuf {
    other_build("previous", "CAPTURE_PREVIOUS_BIN")
}

/// The target directory and the profile of the running test (`target/<profile>/deps/<test>`).
fn target_and_profile() -> (PathBuf, std::ffi::OsString) {
    let exe = std::env::current_exe().expect("current_exe");
    let profile_dir = exe
        .parent()
        .and_then(Path::parent)
        .expect("profile directory");
    let profile = profile_dir.file_name().expect("profile name").to_owned();
    let target = profile_dir
        .parent()
        .expect("target directory")
        .to_path_buf();
    (target, profile)
}

fn other_build(dir: &str, env: &str) -> PathBuf {
    if let Some(p) = std::env::var_os(env) {
        return p.into();
    }
    let (target, profile) = target_and_profile();
    let bin = target.join(dir).join(profile).join("capture");
    assert!(
        bin.is_file(),
        "{} is not built; run `cargo xtask test` (it builds it) or set {env}",
        bin.display()
    );
    bin
}

pub mod agent;
pub mod cases;
pub mod cni;
pub mod containerd;
pub mod daemonset;
pub mod enter;
pub mod explain;
