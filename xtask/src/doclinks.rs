//! The docs' relative links, checked by `cargo xtask lint`: every `[text](path)`,
//! `![alt](path)` and `[label]: path` of the markdown files at the root and under docs/ must name
//! a file or directory that exists, and a `#fragment` must name a heading of the page it points
//! to (GitHub's anchor for it). External links are not fetched: a lint must not depend on the
//! network.

use std::{
    collections::BTreeSet,
    fs,
    path::{Path, PathBuf},
};

use anyhow::{bail, Context as _, Result};

/// Checks every markdown file of the tree's root and of docs/ (recursively); fails naming each
/// broken link with its file and line.
pub fn check(root: &Path) -> Result<()> {
    let mut pages = markdown_in(root, false)?;
    pages.extend(markdown_in(&root.join("docs"), true)?);
    let mut broken = Vec::new();
    for page in &pages {
        let text =
            fs::read_to_string(page).with_context(|| format!("reading {}", page.display()))?;
        for link in links(&text) {
            if let Err(why) = resolve(page, &text, &link.target) {
                broken.push(format!(
                    "{}:{}: ({}) {why}",
                    page.strip_prefix(root).unwrap_or(page).display(),
                    link.line,
                    link.target
                ));
            }
        }
    }
    if !broken.is_empty() {
        bail!(
            "{} broken relative link(s) in the docs:\n  {}",
            broken.len(),
            broken.join("\n  ")
        );
    }
    Ok(())
}

fn markdown_in(dir: &Path, recursive: bool) -> Result<Vec<PathBuf>> {
    let mut found = Vec::new();
    for entry in fs::read_dir(dir).with_context(|| format!("listing {}", dir.display()))? {
        let path = entry?.path();
        if path.is_dir() {
            if recursive {
                found.extend(markdown_in(&path, true)?);
            }
        } else if path.extension().is_some_and(|e| e == "md") {
            found.push(path);
        }
    }
    found.sort();
    Ok(found)
}

#[derive(Debug, PartialEq, Eq)]
struct Link {
    line: usize,
    target: String,
}

/// The link targets of a markdown text that stay inside the repository, outside code blocks and
/// code spans.
fn links(text: &str) -> Vec<Link> {
    let mut found = Vec::new();
    let mut in_fence = false;
    for (index, line) in text.lines().enumerate() {
        if line.trim_start().starts_with("```") {
            in_fence = !in_fence;
            continue;
        }
        if in_fence {
            continue;
        }
        let prose = without_code_spans(line);
        let mut targets = inline_targets(&prose);
        targets.extend(reference_target(&prose));
        found.extend(
            targets
                .into_iter()
                .filter(|t| is_relative(t))
                .map(|target| Link {
                    line: index + 1,
                    target,
                }),
        );
    }
    found
}

fn without_code_spans(line: &str) -> String {
    let mut out = String::with_capacity(line.len());
    let mut in_code = false;
    for c in line.chars() {
        if c == '`' {
            in_code = !in_code;
        } else if !in_code {
            out.push(c);
        }
    }
    out
}

/// The targets of `[text](target)` and `[text](target "title")` on one line.
fn inline_targets(line: &str) -> Vec<String> {
    let mut targets = Vec::new();
    let mut rest = line;
    while let Some(at) = rest.find("](") {
        rest = &rest[at + 2..];
        let end = rest.find(')').unwrap_or(rest.len());
        let target = rest[..end].split_whitespace().next().unwrap_or("");
        targets.push(target.trim_matches(['<', '>']).to_string());
        rest = &rest[end..];
    }
    targets
}

/// The target of a reference definition, `[label]: target`.
fn reference_target(line: &str) -> Option<String> {
    let rest = line.trim_start().strip_prefix('[')?;
    let (_, after) = rest.split_once("]:")?;
    after.split_whitespace().next().map(str::to_string)
}

fn is_relative(target: &str) -> bool {
    !target.is_empty() && !target.contains("://") && !target.starts_with("mailto:")
}

fn resolve(page: &Path, page_text: &str, target: &str) -> Result<(), String> {
    let (path, fragment) = match target.split_once('#') {
        Some((path, fragment)) => (path, Some(fragment)),
        None => (target, None),
    };
    let (file, text) = if path.is_empty() {
        (page.to_path_buf(), Some(page_text.to_string()))
    } else {
        let file = page.parent().unwrap_or(Path::new(".")).join(path);
        if !file.exists() {
            return Err(format!("{} does not exist", file.display()));
        }
        (file.clone(), fs::read_to_string(&file).ok())
    };
    let Some(fragment) = fragment else {
        return Ok(());
    };
    if file.extension().is_none_or(|e| e != "md") {
        return Ok(());
    }
    let anchors = anchors(text.as_deref().unwrap_or(""));
    if anchors.contains(fragment) {
        Ok(())
    } else {
        Err(format!(
            "{} has no heading with the anchor #{fragment}",
            file.display()
        ))
    }
}

/// GitHub's anchors for a page's headings: lower case, punctuation dropped, spaces to hyphens, a
/// repeated anchor numbered from -1.
fn anchors(text: &str) -> BTreeSet<String> {
    let mut seen = BTreeSet::new();
    let mut in_fence = false;
    for line in text.lines() {
        if line.trim_start().starts_with("```") {
            in_fence = !in_fence;
            continue;
        }
        let Some(heading) = line.strip_prefix('#').filter(|_| !in_fence) else {
            continue;
        };
        let slug = slug(heading.trim_start_matches('#').trim());
        let mut anchor = slug.clone();
        let mut n = 0;
        while seen.contains(&anchor) {
            n += 1;
            anchor = format!("{slug}-{n}");
        }
        seen.insert(anchor);
    }
    seen
}

fn slug(heading: &str) -> String {
    heading
        .chars()
        .filter_map(|c| match c {
            ' ' => Some('-'),
            '-' | '_' => Some(c),
            c if c.is_alphanumeric() => Some(c),
            _ => None,
        })
        .flat_map(char::to_lowercase)
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn links_skip_code_and_external_targets() {
        let text = "see [a](a.md) and [b](https://x.example/b)\n```\n[c](c.md)\n```\n`[d](d.md)` [e](e.md#f \"t\")\n[g]: docs/g.md\n";
        let found: Vec<_> = links(text)
            .into_iter()
            .map(|l| (l.line, l.target))
            .collect();
        assert_eq!(
            found,
            [
                (1, "a.md".to_string()),
                (5, "e.md#f".to_string()),
                (6, "docs/g.md".to_string())
            ]
        );
    }

    #[test]
    fn anchors_follow_github() {
        let text = "# Semantics: Istio's rules → capture\n## Where the result differs from iptables\n## Notes\n## Notes\n```\n# not a heading\n```\n";
        let found = anchors(text);
        for want in [
            "semantics-istios-rules--capture",
            "where-the-result-differs-from-iptables",
            "notes",
            "notes-1",
        ] {
            assert!(found.contains(want), "{want} missing from {found:?}");
        }
        assert!(!found.contains("not-a-heading"));
    }

    #[test]
    fn a_missing_file_or_heading_is_broken() {
        let dir = std::env::temp_dir().join(format!("doclinks-{}", std::process::id()));
        fs::create_dir_all(dir.join("docs")).unwrap();
        fs::write(
            dir.join("README.md"),
            "[ok](docs/a.md#top) [bad](docs/b.md)\n",
        )
        .unwrap();
        fs::write(
            dir.join("docs/a.md"),
            "# Top\n[self](#top) [gone](#nowhere)\n",
        )
        .unwrap();
        let err = check(&dir).unwrap_err().to_string();
        let _ = fs::remove_dir_all(&dir);
        assert!(err.contains("2 broken"), "{err}");
        assert!(err.contains("README.md:1: (docs/b.md)"), "{err}");
        assert!(err.contains("a.md:2: (#nowhere)"), "{err}");
    }
}
