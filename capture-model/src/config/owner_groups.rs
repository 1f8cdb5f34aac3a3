//! Whose traffic is captured by primary group (`ISTIO_OUTBOUND_OWNER_GROUPS`,
//! `ISTIO_OUTBOUND_OWNER_GROUPS_EXCLUDE`): gids or names resolved through the node's group
//! database.

use super::{values::items, ConfigError, MeshDefaults, OwnerGroups, MAX_OWNER_GROUPS};

/// Numeric gids or group names (resolved through the node's group database).
pub(super) fn group_ids(value: &str) -> Result<Vec<u32>, ConfigError> {
    let err = |reason: String| ConfigError::OwnerGroups {
        value: value.into(),
        reason,
    };
    items(value)
        .map(|g| match g.parse::<u32>() {
            Ok(id) => Ok(id),
            Err(_) => nix::unistd::Group::from_name(g)
                .ok()
                .flatten()
                .map(|gr| gr.gid.as_raw())
                .ok_or_else(|| err(format!("{g:?} is neither a gid nor a known group name"))),
        })
        .collect()
}

pub(super) fn owner_groups(mesh: &MeshDefaults) -> Result<OwnerGroups, ConfigError> {
    let include = mesh.owner_groups.as_deref().unwrap_or("*");
    let exclude = mesh.owner_groups_exclude.as_deref().unwrap_or("");
    // `given` is the setting the groups come from, which a too-long list's error names.
    let (groups, given) = if include.trim() == "*" {
        let excluded = group_ids(exclude)?;
        if excluded.is_empty() {
            (OwnerGroups::All, include)
        } else {
            (OwnerGroups::AllBut(excluded), exclude)
        }
    } else {
        (OwnerGroups::Only(group_ids(include)?), include)
    };
    match &groups {
        OwnerGroups::Only(g) | OwnerGroups::AllBut(g) if g.len() > MAX_OWNER_GROUPS => {
            Err(ConfigError::OwnerGroups {
                value: given.into(),
                reason: format!(
                    "{} groups given; capture supports at most {MAX_OWNER_GROUPS}",
                    g.len()
                ),
            })
        }
        _ => Ok(groups),
    }
}
