//! apt run with a configuration of its own under target/: its own package lists, cache and
//! (where it resolves packages) an empty dpkg status, so that the machine's package lists and
//! installed set are never read or written. The archive is the machine's own (`apt_sources.rs`).

use std::{
    fs,
    path::{Path, PathBuf},
    process::Command,
};

use anyhow::Result;

/// A private apt configuration rooted at a directory.
pub struct PrivateApt {
    dir: PathBuf,
    /// A sources.list of its own (written by the caller) instead of the machine's sources.
    own_sources: bool,
    /// Resolve and download for this Debian architecture, as on a machine that has no package
    /// installed.
    architecture: Option<String>,
}

impl PrivateApt {
    /// apt reading `dir`/sources.list, which the caller writes.
    pub fn own_sources(dir: &Path) -> Result<Self> {
        Self::create(dir, true, None)
    }

    /// `own_sources`, resolving for a machine of `architecture` with nothing installed.
    pub fn own_sources_for(dir: &Path, architecture: &str) -> Result<Self> {
        Self::create(dir, true, Some(architecture.to_string()))
    }

    /// apt resolving for a machine of `architecture` with nothing installed, from the machine's
    /// sources.
    pub fn foreign(dir: &Path, architecture: &str) -> Result<Self> {
        Self::create(dir, false, Some(architecture.to_string()))
    }

    fn create(dir: &Path, own_sources: bool, architecture: Option<String>) -> Result<Self> {
        for sub in ["lists/partial", "cache/archives/partial", "state"] {
            fs::create_dir_all(dir.join(sub))?;
        }
        if architecture.is_some() {
            fs::write(dir.join("status"), "")?;
        }
        Ok(Self {
            // apt reads a relative directory as relative to its parent setting (Dir::State…).
            dir: std::path::absolute(dir)?,
            own_sources,
            architecture,
        })
    }

    pub fn sources_list(&self) -> PathBuf {
        self.dir.join("sources.list")
    }

    /// Where `apt-get install --download-only` leaves the packages.
    pub fn archives(&self) -> PathBuf {
        self.dir.join("cache/archives")
    }

    /// `apt-get` or `apt-cache` with this configuration.
    pub fn command(&self, tool: &str) -> Command {
        let mut cmd = Command::new(tool);
        let dir = |sub: &str| self.dir.join(sub).display().to_string();
        let mut options = vec![
            ("Dir::State::Lists", dir("lists")),
            ("Dir::Cache", dir("cache")),
            // The unprivileged _apt user cannot write into target/; downloading as root is
            // expected.
            ("APT::Sandbox::User", "root".to_string()),
        ];
        if self.own_sources {
            options.push(("Dir::Etc::sourcelist", dir("sources.list")));
            options.push(("Dir::Etc::sourceparts", "-".to_string()));
        }
        if let Some(arch) = &self.architecture {
            options.extend([
                ("Dir::State", dir("state")),
                ("Dir::State::status", dir("status")),
                ("APT::Architecture", arch.clone()),
                ("APT::Architectures", arch.clone()),
                // Nothing is installed: the machine's dpkg lock is not apt's to take here.
                ("Debug::NoLocking", "1".to_string()),
            ]);
        }
        for (key, value) in options {
            cmd.arg("-o").arg(format!("{key}={value}"));
        }
        cmd
    }
}
