//! The dependency policy (deny.toml), checked by cargo-deny on every lint: the licences a crate
//! may carry, the sources it may come from, and duplicate versions reported.

use std::path::Path;

use anyhow::Result;

use crate::{cargo, run};

/// The checks lint runs: everything but advisories, whose database comes from the network.
const CHECKS: [&str; 3] = ["bans", "licenses", "sources"];

/// Checks the workspace's dependency graph against deny.toml.
pub fn check() -> Result<()> {
    run(cargo()
        .arg("deny")
        .args(policy_args(Path::new("deny.toml"))))
}

fn policy_args(config: &Path) -> Vec<String> {
    ["--locked".to_string(), "--config".to_string()]
        .into_iter()
        .chain([config.display().to_string(), "check".to_string()])
        .chain(CHECKS.iter().map(ToString::to_string))
        .collect()
}

#[cfg(test)]
mod tests {
    use std::process::Command;

    use super::*;

    /// A scratch workspace whose crate depends on a path crate under `licence`, checked against
    /// the project's deny.toml: cargo-deny's success, and what it said.
    fn check_scratch(licence: &str) -> (bool, String) {
        let dir = std::env::temp_dir().join(format!(
            "capture-deny-{}-{}",
            std::process::id(),
            licence.replace(['.', ' '], "_")
        ));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(dir.join("src")).unwrap();
        std::fs::create_dir_all(dir.join("dep/src")).unwrap();
        std::fs::write(
            dir.join("Cargo.toml"),
            "[package]\nname = \"scratch\"\nversion = \"0.1.0\"\nedition = \"2021\"\n\
             license = \"Apache-2.0\"\npublish = false\n\n[dependencies]\n\
             copyleft-dep = { path = \"dep\", version = \"0.1\" }\n",
        )
        .unwrap();
        std::fs::write(dir.join("src/lib.rs"), "").unwrap();
        std::fs::write(
            dir.join("dep/Cargo.toml"),
            format!(
                "[package]\nname = \"copyleft-dep\"\nversion = \"0.1.0\"\nedition = \"2021\"\n\
                 license = \"{licence}\"\npublish = false\n"
            ),
        )
        .unwrap();
        std::fs::write(dir.join("dep/src/lib.rs"), "").unwrap();
        let config = Path::new(env!("CARGO_MANIFEST_DIR")).join("../deny.toml");
        let mut args = policy_args(&config);
        args.retain(|a| a != "--locked");
        let out = Command::new("cargo")
            .arg("deny")
            .arg("--manifest-path")
            .arg(dir.join("Cargo.toml"))
            .args(args)
            .output()
            .expect("cargo deny (cargo xtask setup installs it)");
        let _ = std::fs::remove_dir_all(&dir);
        (
            out.status.success(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    }

    #[test]
    fn a_copyleft_dependency_fails_the_policy_naming_the_crate_and_licence() {
        let (ok, said) = check_scratch("GPL-3.0-only");
        assert!(!ok, "{said}");
        assert!(
            said.contains("copyleft-dep") && said.contains("GPL-3.0-only"),
            "{said}"
        );
        let (ok, said) = check_scratch("MIT");
        assert!(ok, "a permissive licence passes: {said}");
    }
}
