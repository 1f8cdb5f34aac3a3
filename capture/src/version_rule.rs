// The version a build says it is, shared by build.rs (which `include!`s this file) and the
// crate's tests: `<package>` for a build of the commit tagged `v<package>`, else
// `<package>-dev.<first 12 hex digits of the commit>`, which no release can carry.

/// `tags`: the tags that point at the commit, one per line (`git tag --points-at HEAD`).
#[must_use]
pub fn version_of(package: &str, commit: &str, tags: Option<&str>) -> String {
    let release_tag = format!("v{package}");
    if tags.is_some_and(|tags| tags.lines().any(|t| t.trim() == release_tag)) {
        package.to_string()
    } else {
        format!("{package}-dev.{}", &commit[..commit.len().min(12)])
    }
}
