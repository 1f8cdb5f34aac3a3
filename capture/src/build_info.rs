//! What this binary is built from, as build.rs found it: `capture version` prints it and the
//! agent exports it (`capture_build_info`), so a node's agent and a CLI can be told apart and
//! matched to a release, a commit and its kernel programs.

use serde::Serialize;

#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct BuildInfo {
    /// `<version>` for a build of the commit tagged `v<version>`, else `<version>-dev.<commit>`.
    pub version: &'static str,
    pub commit: &'static str,
    /// The kernel programs' object id (what `build` and the node's pins are named by).
    pub programs: String,
    /// The build's name on a node (`capture status`'s `build`, the pins' directory).
    pub build: String,
    /// The target triple it was compiled for.
    pub target: &'static str,
    pub rustc: &'static str,
}

/// This binary's.
#[must_use]
pub fn this() -> BuildInfo {
    BuildInfo {
        version: env!("CAPTURE_VERSION"),
        commit: env!("CAPTURE_COMMIT"),
        programs: crate::ebpf::loader::object_id(),
        build: crate::ebpf::loader::build_name(),
        target: env!("CAPTURE_TARGET"),
        rustc: env!("CAPTURE_RUSTC"),
    }
}

impl std::fmt::Display for BuildInfo {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        writeln!(f, "capture {}", self.version)?;
        writeln!(f, "commit:          {}", self.commit)?;
        writeln!(
            f,
            "kernel programs: {} (build {})",
            self.programs, self.build
        )?;
        writeln!(f, "target:          {}", self.target)?;
        writeln!(f, "rustc:           {}", self.rustc)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_version_is_a_release_or_says_its_commit() {
        let info = this();
        let package = env!("CARGO_PKG_VERSION");
        let dev = format!("{package}-dev.");
        assert!(
            info.version == package
                || (info.version.starts_with(&dev)
                    && info.commit.starts_with(&info.version[dev.len()..])),
            "{info:?}"
        );
        assert!(info.build.starts_with(package), "{info:?}");
        assert!(info.rustc.starts_with("rustc "), "{info:?}");
        assert!(info.to_string().contains(info.commit));
    }

    mod rule {
        include!("version_rule.rs");

        #[test]
        fn only_the_commit_tagged_with_the_release_is_the_release() {
            let commit = "0123456789abcdef0123456789abcdef01234567";
            assert_eq!(version_of("0.2.0", commit, Some("v0.2.0")), "0.2.0");
            assert_eq!(
                version_of(
                    "0.2.0",
                    commit,
                    Some(
                        "nightly
v0.2.0
"
                    )
                ),
                "0.2.0"
            );
            for tags in [None, Some("v0.1.0"), Some("0.2.0"), Some("v0.2.0-rc1")] {
                assert_eq!(
                    version_of("0.2.0", commit, tags),
                    "0.2.0-dev.0123456789ab",
                    "{tags:?}"
                );
            }
        }
    }
}
