//! Parsers for the command line's own value syntax (`KEY=VALUE`, id lists).

use crate::config::{values::items, ANN_EXCLUDE_OUTBOUND_PORTS};

/// Parses `KEY=VALUE` (the CLI's `--annotation`).
pub fn parse_annotation(arg: &str) -> Result<(String, String), String> {
    let (k, v) = arg.split_once('=').ok_or_else(|| {
        format!("{arg:?} is not KEY=VALUE (for example {ANN_EXCLUDE_OUTBOUND_PORTS}=5432)")
    })?;
    if k.trim().is_empty() {
        return Err(format!("{arg:?} has an empty annotation key"));
    }
    Ok((k.trim().to_string(), v.to_string()))
}

/// A comma-separated id list (`--proxy-uid 1337,1338`).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct IdList(pub Vec<u32>);

pub fn parse_id_list(arg: &str) -> Result<IdList, String> {
    items(arg)
        .map(|s| {
            s.parse::<u32>()
                .map_err(|_| format!("{s:?} is not a numeric uid/gid"))
        })
        .collect::<Result<_, _>>()
        .map(IdList)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn annotation_and_id_arguments() {
        assert_eq!(
            parse_annotation("a/b=c=d").unwrap(),
            ("a/b".into(), "c=d".into())
        );
        assert!(parse_annotation("novalue").is_err());
        assert_eq!(
            parse_id_list("1337, 1338").unwrap(),
            IdList(vec![1337, 1338])
        );
        assert!(parse_id_list("istio").is_err());
    }
}
