//! What the running kernel offers, for tests that cover a feature some kernels lack. Such a test
//! skips where the feature is missing and says why: it prints the reason and, when
//! `CAPTURE_SKIP_LOG` is set (the kernel matrix, `cargo xtask vm`), appends
//! `TEST<TAB>FEATURE<TAB>REASON` to that file, so that a skip on a kernel that should have the
//! feature fails the matrix.

use std::{io::Write as _, sync::OnceLock};

use capture_user::ebpf::loader::{kernel_features, KernelFeatures};

/// A kernel feature some tests depend on; the name is what the skip log and the matrix use.
#[derive(Clone, Copy, Debug)]
pub enum Feature {
    /// sock_ops may ask for the netns cookie (Linux 5.15+).
    SockOpsNetnsCookie,
}

impl Feature {
    #[must_use]
    pub fn name(self) -> &'static str {
        match self {
            Self::SockOpsNetnsCookie => "sock_ops_netns_cookie",
        }
    }
}

fn features() -> KernelFeatures {
    static FEATURES: OnceLock<KernelFeatures> = OnceLock::new();
    *FEATURES.get_or_init(|| {
        kernel_features().unwrap_or_else(|e| panic!("the kernel programs load on this kernel: {e}"))
    })
}

/// Whether the kernel has `feature`; if not, records the skip with `reason` and returns false.
#[must_use]
pub fn has_or_skip(feature: Feature, reason: &str) -> bool {
    let present = match feature {
        Feature::SockOpsNetnsCookie => features().sock_ops_netns_cookie,
    };
    if !present {
        let test = std::thread::current()
            .name()
            .unwrap_or("unnamed test")
            .to_string();
        eprintln!("skipped {test}: {} is missing: {reason}", feature.name());
        if let Some(path) = std::env::var_os("CAPTURE_SKIP_LOG") {
            let mut log = std::fs::OpenOptions::new()
                .create(true)
                .append(true)
                .open(&path)
                .unwrap_or_else(|e| panic!("opening CAPTURE_SKIP_LOG {path:?}: {e}"));
            writeln!(log, "{test}\t{}\t{reason}", feature.name()).expect("writing the skip log");
        }
    }
    present
}
