//! The crate graph against docs/working-on/development.md's layer map, checked by `cargo xtask
//! lint`: the map's block of `crate -> dependencies` lines must say exactly which workspace crates
//! each workspace crate depends on (normal dependencies), as `cargo metadata` reports them. Cargo
//! enforces the layers; this keeps the page that explains them true.

use std::{
    collections::{BTreeMap, BTreeSet},
    path::Path,
    process::Command,
};

use anyhow::{bail, Context as _, Result};

/// The page, and the line that opens the block the check reads (the fence follows it).
const PAGE: &str = "docs/working-on/development.md";
const MARKER: &str = "<!-- crate graph: checked by `cargo xtask lint` (xtask/src/layers.rs) -->";

type Graph = BTreeMap<String, BTreeSet<String>>;

pub fn check(root: &Path) -> Result<()> {
    let page =
        std::fs::read_to_string(root.join(PAGE)).with_context(|| format!("reading {PAGE}"))?;
    let documented = documented(&page)?;
    let actual = actual(root)?;
    if documented != actual {
        let show = |g: &Graph| {
            g.iter()
                .map(|(c, d)| {
                    format!(
                        "{c} -> {}",
                        d.iter().cloned().collect::<Vec<_>>().join(", ")
                    )
                })
                .collect::<Vec<_>>()
                .join("\n  ")
        };
        bail!(
            "{PAGE}'s crate graph is not the workspace's; write this block under its marker:\n  {}\n(it says:\n  {})",
            show(&actual),
            show(&documented)
        );
    }
    Ok(())
}

/// The block after the marker: ```` ``` ````, then `crate -> a, b` lines, then ```` ``` ````.
fn documented(page: &str) -> Result<Graph> {
    let after = page
        .split_once(MARKER)
        .with_context(|| format!("{PAGE} has no line {MARKER}"))?
        .1;
    let block = after
        .trim_start()
        .strip_prefix("```")
        .and_then(|b| b.split_once('\n'))
        .and_then(|(_, rest)| rest.split_once("```"))
        .with_context(|| format!("{PAGE}: no fenced block after the crate graph's marker"))?
        .0;
    let mut graph = Graph::new();
    for line in block.lines().filter(|l| !l.trim().is_empty()) {
        let (krate, deps) = line
            .split_once("->")
            .with_context(|| format!("{PAGE}: {line:?} is not `crate -> dependencies`"))?;
        let deps = deps
            .split(',')
            .map(str::trim)
            .filter(|d| !d.is_empty())
            .map(String::from)
            .collect();
        graph.insert(krate.trim().to_string(), deps);
    }
    Ok(graph)
}

/// Each workspace crate's normal dependencies on workspace crates.
fn actual(root: &Path) -> Result<Graph> {
    let json = crate::output(
        Command::new(env!("CARGO"))
            .args(["metadata", "--format-version", "1", "--no-deps"])
            .current_dir(root),
    )?;
    let meta: serde_json::Value = serde_json::from_str(&json).context("cargo metadata's JSON")?;
    let packages = meta["packages"]
        .as_array()
        .context("cargo metadata: no packages")?;
    let names: BTreeSet<&str> = packages.iter().filter_map(|p| p["name"].as_str()).collect();
    let mut graph = Graph::new();
    for p in packages {
        let deps = p["dependencies"]
            .as_array()
            .into_iter()
            .flatten()
            .filter(|d| d["kind"].is_null())
            .filter_map(|d| d["name"].as_str())
            .filter(|n| names.contains(n))
            .map(String::from)
            .collect();
        graph.insert(p["name"].as_str().unwrap_or_default().to_string(), deps);
    }
    Ok(graph)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_block_after_the_marker_is_read_as_edges() {
        let page = format!("x\n{MARKER}\n\n```\na -> b, c\nb ->\n```\nafter -> not read\n");
        let graph = documented(&page).expect("a graph");
        assert_eq!(graph.len(), 2);
        assert_eq!(
            graph["a"],
            BTreeSet::from(["b".to_string(), "c".to_string()])
        );
        assert!(graph["b"].is_empty());
        assert!(documented("no marker").is_err());
    }
}
