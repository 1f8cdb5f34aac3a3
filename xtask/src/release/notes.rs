//! The release note: the CHANGELOG's section for the version, under what identifies the build.

use anyhow::{bail, Result};

use crate::image::Built;

/// The note for `version`: the CHANGELOG's `## [<version>]` section, or, for a development
/// build (`<version>-dev.<commit>`), its `## [Unreleased]` section, said to be unreleased.
pub fn release_notes(changelog: &str, version: &str, built: &Built) -> Result<String> {
    let (heading, section) = match version.split_once("-dev.") {
        Some(_) => ("Unreleased", section(changelog, "Unreleased")),
        None => (version, section(changelog, version)),
    };
    let Some(section) = section else {
        bail!(
            "CHANGELOG.md has no `## [{heading}]` section for the release note of {version}: \
             add one"
        );
    };
    let mut note = format!("# capture {version}\n\n");
    if heading == "Unreleased" {
        note.push_str(
            "A development build: what follows is the CHANGELOG's Unreleased section.\n\n",
        );
    }
    note.push_str(&format!(
        "- Image: `{}`, digest `{}`, for {}\n- Verify: `sha256sum -c SHA256SUMS`; the SBOM is \
         `capture-{version}.cdx.json` (docs/using/install.md)\n\n",
        built.name,
        built.digest,
        built
            .platforms
            .iter()
            .map(|p| p.arch.platform())
            .collect::<Vec<_>>()
            .join(", ")
    ));
    note.push_str(section.trim());
    note.push('\n');
    Ok(note)
}

/// The text under `## [<name>]` (to the next `## ` heading), if the changelog has that section.
fn section<'a>(changelog: &'a str, name: &str) -> Option<&'a str> {
    let heading = format!("## [{name}]");
    let start = changelog
        .match_indices(&heading)
        .find(|(at, _)| *at == 0 || changelog[..*at].ends_with('\n'))
        .map(|(at, _)| at)?;
    let body = &changelog[start..];
    let body = &body[body.find('\n').map_or(body.len(), |n| n + 1)..];
    let end = body
        .match_indices("\n## ")
        .next()
        .map_or(body.len(), |(at, _)| at);
    Some(&body[..end])
}

#[cfg(test)]
mod tests {
    use super::*;

    const CHANGELOG: &str = "# Changelog\n\nintro\n\n## [Unreleased]\n\n- next thing\n\n\
                             ## [0.2.0] - 2026-12-05\n\n### Added\n\n- a thing\n\n\
                             ## [0.1.0] - 2026-12-01\n\n- first\n";

    fn built(version: &str) -> Built {
        Built {
            name: format!("localhost/capture:{version}"),
            version: version.into(),
            digest: "sha256:ab".into(),
            archive: "a.tar".into(),
            platforms: Vec::new(),
        }
    }

    #[test]
    fn a_release_takes_its_own_section_and_nothing_after_it() {
        let note = release_notes(CHANGELOG, "0.2.0", &built("0.2.0")).unwrap();
        assert!(note.starts_with("# capture 0.2.0\n"), "{note}");
        assert!(
            note.contains("- a thing") && note.contains("sha256:ab"),
            "{note}"
        );
        assert!(
            !note.contains("first") && !note.contains("next thing"),
            "{note}"
        );
    }

    #[test]
    fn a_development_build_takes_unreleased_and_says_so() {
        let version = "0.2.0-dev.0123456789ab";
        let note = release_notes(CHANGELOG, version, &built(version)).unwrap();
        assert!(
            note.contains("development build") && note.contains("- next thing"),
            "{note}"
        );
        assert!(!note.contains("- a thing"), "{note}");
    }

    #[test]
    fn a_version_without_a_section_is_refused_by_name() {
        let err = release_notes(CHANGELOG, "0.3.0", &built("0.3.0")).unwrap_err();
        assert!(err.to_string().contains("## [0.3.0]"), "{err}");
    }
}
