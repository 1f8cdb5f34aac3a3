//! What dpkg says of a package: installed, or not (and then what it said instead).
//!
//! dpkg keeps a status line for every package it has ever heard of, installed or not, so "dpkg
//! knows it" and "it is installed" are different answers: a package that was only ever a
//! candidate reads `unknown ok not-installed`, a removed one `deinstall ok config-files`.

use std::{collections::BTreeMap, path::Path, process::Command};

use anyhow::{Context as _, Result};

/// True when dpkg's `${Status}` ("want flag state") says the package's files are in place and
/// configured: `install ok installed`, or the same held at its version (`hold ok installed`).
/// Every other state (not-installed, config-files, half-installed, unpacked, half-configured,
/// triggers-awaited, a `reinstreq` flag, or no status at all) means apt must install it.
pub fn is_installed(status: &str) -> bool {
    matches!(
        status.split_whitespace().collect::<Vec<_>>()[..],
        ["install" | "hold", "ok", "installed"]
    )
}

/// The dpkg status of each of `packages` (None for a package dpkg does not know), read from the
/// database in `admindir` (the system's when None).
pub fn statuses<'a>(
    packages: &[&'a str],
    admindir: Option<&Path>,
) -> Result<BTreeMap<&'a str, Option<String>>> {
    let mut cmd = Command::new("dpkg-query");
    if let Some(dir) = admindir {
        cmd.arg(format!("--admindir={}", dir.display()));
    }
    // dpkg-query exits 1 when any package is unknown and still lists the known ones; only a
    // failure to run it at all is an error.
    let out = cmd
        .args(["-W", "-f=${Package}\t${Status}\n"])
        .args(packages)
        .output()
        .context("running dpkg-query: setup installs packages with dpkg and apt (install dpkg and apt, or run on Debian)")?;
    let listed = String::from_utf8_lossy(&out.stdout);
    Ok(packages
        .iter()
        .map(|&package| {
            // A multi-arch package may be listed once per architecture: installed for one counts.
            let mut status: Option<String> = None;
            for (name, line_status) in listed.lines().filter_map(|l| l.split_once('\t')) {
                if name == package && !status.as_deref().is_some_and(is_installed) {
                    status = Some(line_status.to_string());
                }
            }
            (package, status)
        })
        .collect())
}

/// Those of `packages` that are not installed, in the order given.
pub fn missing<'a>(packages: &[&'a str], admindir: Option<&Path>) -> Result<Vec<&'a str>> {
    // dpkg-query without package names lists every package.
    if packages.is_empty() {
        return Ok(Vec::new());
    }
    let statuses = statuses(packages, admindir)?;
    Ok(packages
        .iter()
        .copied()
        .filter(|p| !statuses[p].as_deref().is_some_and(is_installed))
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_configured_packages_count_as_installed() {
        for (status, installed) in [
            ("install ok installed", true),
            ("hold ok installed", true),
            // Known to dpkg, never installed: the state that hid kmod.
            ("unknown ok not-installed", false),
            ("deinstall ok config-files", false),
            ("purge ok not-installed", false),
            ("install ok half-installed", false),
            ("install reinstreq half-installed", false),
            ("install ok unpacked", false),
            ("install ok half-configured", false),
            ("install ok triggers-awaited", false),
            ("deinstall ok installed", false),
            ("", false),
        ] {
            assert_eq!(is_installed(status), installed, "{status:?}");
        }
    }

    /// A throwaway dpkg database (named after its test) holding `status` as its status file.
    fn admindir(name: &str, status: &str) -> std::path::PathBuf {
        let dir = std::env::temp_dir().join(format!("xtask-dpkg-{name}-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join("status"), status).unwrap();
        dir
    }

    fn entry(package: &str, status: &str) -> String {
        format!(
            "Package: {package}\nStatus: {status}\nPriority: optional\nSection: admin\n\
             Architecture: amd64\nVersion: 1.0\nMaintainer: nobody\nDescription: test entry\n\n"
        )
    }

    #[test]
    fn an_empty_database_misses_every_package() {
        let dir = admindir("empty", "");
        let missing = missing(&["kmod", "iproute2"], Some(&dir)).unwrap();
        std::fs::remove_dir_all(&dir).unwrap();
        assert_eq!(missing, ["kmod", "iproute2"]);
    }

    #[test]
    fn a_package_dpkg_knows_but_never_installed_is_missing() {
        let database = [
            entry("kmod", "unknown ok not-installed"),
            entry("iproute2", "install ok installed"),
            entry("xz-utils", "deinstall ok config-files"),
            entry("qemu-system-x86", "install reinstreq half-installed"),
        ]
        .concat();
        let dir = admindir("known", &database);
        let packages = [
            "kmod",
            "iproute2",
            "xz-utils",
            "qemu-system-x86",
            "busybox-static",
        ];
        let statuses = statuses(&packages, Some(&dir)).unwrap();
        let missing = missing(&packages, Some(&dir)).unwrap();
        std::fs::remove_dir_all(&dir).unwrap();
        assert_eq!(
            statuses["kmod"].as_deref(),
            Some("unknown ok not-installed")
        );
        assert_eq!(statuses["busybox-static"], None);
        assert_eq!(
            missing,
            ["kmod", "xz-utils", "qemu-system-x86", "busybox-static"]
        );
    }
}
