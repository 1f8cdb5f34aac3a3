//! Servers that come with a package setup installs only for a command: Debian's `prometheus`
//! ships `promtool` (the tests lint the agent's metrics with it) together with the Prometheus
//! server, and `containerd` ships the node's container runtime as a unit (the tests start their
//! own containerd, with directories of their own), and `haproxy` ships a load balancer as a unit
//! (the tests run HAProxy inside a pod with a configuration of their own); each postinst enables
//! and starts its server. `nftables` ships `nft` and a unit that loads /etc/nftables.conf, whose
//! first line is `flush ruleset`: started, it would erase the host's rules (kube-proxy's, a
//! firewall's). Debian leaves it disabled; setup makes sure nothing starts it.
//!
//! Where the postinst would start it:
//! - in a container without systemd (these machines, CI), invoke-rc.d asks policy-rc.d, which
//!   Docker's Debian images ship refusing every start (setup-check writes the same one into its
//!   clean root); without one and without an init, invoke-rc.d refuses by itself. Nothing starts.
//! - on a host that runs systemd, `deb-systemd-invoke start` would start it at once and the
//!   enabled unit at every boot: a Prometheus listening on every interface (port 9090), writing
//!   its database under /var/lib/prometheus, or a containerd serving /run/containerd and owning
//!   /var/lib/containerd. Setup masks the unit before installing the package,
//!   which the maintainer scripts respect (they only ever remove a mask they made themselves).

use std::path::Path;

use anyhow::{Context as _, Result};

/// Packages installed for a command, and the unit of the server each ships.
pub const UNWANTED_SERVICES: &[(&str, &str)] = &[
    ("prometheus", "prometheus.service"),
    ("containerd", "containerd.service"),
    ("haproxy", "haproxy.service"),
    ("nftables", "nftables.service"),
];

/// Masks the units of those of `packages` that ship an unwanted server, on a host running
/// systemd, before apt installs them.
pub fn keep_off(packages: &[&str]) -> Result<()> {
    if !Path::new("/run/systemd/system").is_dir() {
        return Ok(());
    }
    for unit in mask(Path::new("/etc/systemd/system"), packages)? {
        println!(
            "setup: masked {unit}: its package is installed for a command, not to run a server \
             (`systemctl unmask {unit}` undoes it)"
        );
    }
    Ok(())
}

/// Links the unwanted units of `packages` to /dev/null in `dir` (systemd's mask), leaving any
/// unit file or mask already there alone: then it is the administrator's. Returns the units
/// masked.
fn mask(dir: &Path, packages: &[&str]) -> Result<Vec<&'static str>> {
    let mut masked = Vec::new();
    for &(_, unit) in UNWANTED_SERVICES
        .iter()
        .filter(|(package, _)| packages.contains(package))
    {
        let link = dir.join(unit);
        if link.symlink_metadata().is_ok() {
            continue;
        }
        std::os::unix::fs::symlink("/dev/null", &link).with_context(|| {
            format!(
                "masking {unit} ({} -> /dev/null) so that installing its package starts no \
                 server; run `systemctl mask {unit}` yourself, then setup again",
                link.display()
            )
        })?;
        masked.push(unit);
    }
    Ok(masked)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn masks_only_units_of_listed_packages_and_keeps_existing_files() {
        let dir = std::env::temp_dir().join(format!("xtask-services-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        assert!(mask(&dir, &["iproute2"]).unwrap().is_empty());
        assert_eq!(
            mask(&dir, &["iproute2", "prometheus"]).unwrap(),
            ["prometheus.service"]
        );
        let link = dir.join("prometheus.service");
        assert_eq!(std::fs::read_link(&link).unwrap(), Path::new("/dev/null"));
        // Already masked (or configured): left as it is.
        assert!(mask(&dir, &["prometheus"]).unwrap().is_empty());
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
