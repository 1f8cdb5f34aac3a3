//! The import-cycle check of `cargo xtask lint`: in every crate of the tree, the modules' `crate::`
//! paths must point one way. Each source file is a module; a `crate::a::b::Item` in file F is an
//! arrow from F to the file of the longest module prefix (`a/b.rs`, `a/b/mod.rs`, or `a.rs` when
//! `b` is an item). Any set of files that reach each other through such arrows is reported with
//! the paths that make it, and fails the lint.
//!
//! Test code (files named `tests.rs` or `*_tests.rs`, and what follows a file's top-level
//! `#[cfg(test)]`) and comments are left out: tests may reach anywhere, and doc links are not
//! imports. `super::` and `self::` paths are not read: a module's own children are its to use.

use std::{
    collections::{BTreeMap, BTreeSet},
    path::{Path, PathBuf},
};

use anyhow::{bail, Result};

/// The crates' source roots: each `src` (lib.rs or main.rs) and each `src/bin/NAME/` directory.
fn crate_roots(workspace: &Path) -> Vec<PathBuf> {
    let mut roots = Vec::new();
    for dir in [
        "capture-common",
        "capture-ebpf",
        "capture-oci",
        "capture-sys",
        "capture-model",
        "capture-user",
        "capture",
        "capture-cni",
        "tests",
        "capture-bench",
        "xtask",
        "fuzz",
    ] {
        let src = workspace.join(dir).join("src");
        if src.is_dir() {
            roots.push(src.clone());
        }
        if let Ok(bins) = std::fs::read_dir(src.join("bin")) {
            roots.extend(bins.flatten().map(|e| e.path()).filter(|p| p.is_dir()));
        }
    }
    roots
}

/// Every module file under `root` (not into `bin/` of a library root), by module path.
fn modules(root: &Path) -> BTreeMap<Vec<String>, PathBuf> {
    let mut found = BTreeMap::new();
    let mut stack = vec![root.to_path_buf()];
    while let Some(dir) = stack.pop() {
        let Ok(entries) = std::fs::read_dir(&dir) else {
            continue;
        };
        for path in entries.flatten().map(|e| e.path()) {
            if path.is_dir() {
                if !(dir == root && path.file_name().is_some_and(|n| n == "bin")) {
                    stack.push(path);
                }
                continue;
            }
            if path.extension().is_none_or(|e| e != "rs") {
                continue;
            }
            let relative = path.strip_prefix(root).expect("under the root");
            let mut segments: Vec<String> = relative
                .with_extension("")
                .iter()
                .map(|s| s.to_string_lossy().into_owned())
                .collect();
            if matches!(
                segments.last().map(String::as_str),
                Some("mod" | "lib" | "main")
            ) {
                segments.pop();
            }
            found.insert(segments, path);
        }
    }
    found
}

fn is_test_file(path: &Path) -> bool {
    let name = path.file_stem().unwrap_or_default().to_string_lossy();
    name == "tests" || name.ends_with("_tests")
}

/// The file's code without comments and without its test module.
fn code(text: &str) -> String {
    let mut out = String::new();
    for line in text.lines() {
        if line.starts_with("#[cfg(test)]") {
            break;
        }
        let line = line.split("//").next().unwrap_or_default();
        out.push_str(line);
        out.push('\n');
    }
    out
}

fn is_ident(c: char) -> bool {
    c.is_alphanumeric() || c == '_'
}

/// The paths after each `crate::` in `code`, with `{a, b::{c}}` groups spread out.
fn crate_paths(code: &str) -> Vec<Vec<String>> {
    rooted_paths(code, "crate::")
}

/// The paths after each `root` (`crate::`, `super::`) in `code` not preceded by another path
/// segment.
fn rooted_paths(code: &str, root: &str) -> Vec<Vec<String>> {
    let mut paths = Vec::new();
    let mut rest = code;
    while let Some(at) = rest.find(root) {
        let before = rest[..at].trim_end();
        let preceded = before.chars().next_back().is_some_and(is_ident) && !before.ends_with("use")
            || before.ends_with("::");
        rest = &rest[at + root.len()..];
        if !preceded {
            tree(&mut rest, &mut Vec::new(), &mut paths);
        }
    }
    paths
}

/// The module paths `file` (module `module`) names, from the crate root: its `crate::` paths, and
/// its `super::` paths resolved from its parent (`super::super::` further up).
fn named_paths(code: &str, module: &[String]) -> Vec<Vec<String>> {
    let mut all = crate_paths(code);
    for path in rooted_paths(code, "super::") {
        let ups = 1 + path.iter().take_while(|s| *s == "super").count();
        if ups > module.len() {
            continue;
        }
        let mut full = module[..module.len() - ups].to_vec();
        full.extend(path.into_iter().skip(ups - 1));
        all.push(full);
    }
    all
}

/// Reads one path tree from `s` (`a::b`, `a::{b, c::d}`), pushing each full path.
fn tree(s: &mut &str, prefix: &mut Vec<String>, out: &mut Vec<Vec<String>>) {
    let depth = prefix.len();
    loop {
        *s = s.trim_start();
        if let Some(group) = s.strip_prefix('{') {
            *s = group;
            loop {
                *s = s.trim_start();
                if let Some(after) = s.strip_prefix('}') {
                    *s = after;
                    break;
                }
                tree(s, prefix, out);
                *s = s.trim_start();
                if let Some(after) = s.strip_prefix(',') {
                    *s = after;
                } else {
                    *s = s.strip_prefix('}').unwrap_or(s);
                    break;
                }
            }
            prefix.truncate(depth);
            return;
        }
        let len = s.find(|c: char| !is_ident(c)).unwrap_or(s.len());
        if len == 0 {
            break;
        }
        prefix.push(s[..len].to_string());
        *s = &s[len..];
        match s.strip_prefix("::") {
            Some(after) => *s = after,
            None => break,
        }
    }
    if prefix.len() > depth {
        out.push(prefix.clone());
    }
    prefix.truncate(depth);
}

/// The module file a path names: its longest prefix that is a module.
fn target<'a>(modules: &'a BTreeMap<Vec<String>, PathBuf>, path: &[String]) -> Option<&'a PathBuf> {
    (0..=path.len()).rev().find_map(|n| modules.get(&path[..n]))
}

/// Groups of files that import each other (Tarjan's strongly connected components).
fn cycles(edges: &BTreeMap<PathBuf, BTreeSet<PathBuf>>) -> Vec<Vec<PathBuf>> {
    struct State<'a> {
        edges: &'a BTreeMap<PathBuf, BTreeSet<PathBuf>>,
        index: BTreeMap<&'a PathBuf, usize>,
        low: BTreeMap<&'a PathBuf, usize>,
        stack: Vec<&'a PathBuf>,
        on_stack: BTreeSet<&'a PathBuf>,
        found: Vec<Vec<PathBuf>>,
    }
    fn visit<'a>(st: &mut State<'a>, node: &'a PathBuf) {
        let n = st.index.len();
        st.index.insert(node, n);
        st.low.insert(node, n);
        st.stack.push(node);
        st.on_stack.insert(node);
        for next in st.edges.get(node).into_iter().flatten() {
            if !st.index.contains_key(next) {
                visit(st, next);
                let low = st.low[node].min(st.low[next]);
                st.low.insert(node, low);
            } else if st.on_stack.contains(next) {
                let low = st.low[node].min(st.index[next]);
                st.low.insert(node, low);
            }
        }
        if st.low[node] == st.index[node] {
            let mut group = Vec::new();
            while let Some(top) = st.stack.pop() {
                st.on_stack.remove(top);
                group.push(top.clone());
                if top == node {
                    break;
                }
            }
            if group.len() > 1 {
                group.sort();
                st.found.push(group);
            }
        }
    }
    let mut st = State {
        edges,
        index: BTreeMap::new(),
        low: BTreeMap::new(),
        stack: Vec::new(),
        on_stack: BTreeSet::new(),
        found: Vec::new(),
    };
    for node in edges.keys() {
        if !st.index.contains_key(node) {
            visit(&mut st, node);
        }
    }
    st.found
}

/// Fails, naming the files and the `crate::` paths between them, when any crate has a cycle.
pub fn check(workspace: &Path) -> Result<()> {
    let mut report = String::new();
    for root in crate_roots(workspace) {
        let modules = modules(&root);
        let mut edges: BTreeMap<PathBuf, BTreeSet<PathBuf>> = BTreeMap::new();
        let mut why: BTreeMap<(PathBuf, PathBuf), String> = BTreeMap::new();
        for (module, file) in modules.iter().filter(|(_, f)| !is_test_file(f)) {
            let text = std::fs::read_to_string(file)?;
            // A file's `super` is the module that declares it: for `a/mod.rs` (module `a`) the
            // crate root, for `a/b.rs` (module `a::b`) the module `a`.
            for path in named_paths(&code(&text), module) {
                let Some(to) = target(&modules, &path) else {
                    continue;
                };
                if to != file && !is_test_file(to) {
                    edges.entry(file.clone()).or_default().insert(to.clone());
                    why.entry((file.clone(), to.clone()))
                        .or_insert_with(|| format!("crate::{}", path.join("::")));
                }
            }
        }
        for group in cycles(&edges) {
            report.push_str("import cycle:\n");
            for from in &group {
                for to in edges[from].iter().filter(|t| group.contains(t)) {
                    report.push_str(&format!(
                        "  {} -> {} ({})\n",
                        from.strip_prefix(workspace).unwrap_or(from).display(),
                        to.strip_prefix(workspace).unwrap_or(to).display(),
                        why[&(from.clone(), to.clone())]
                    ));
                }
            }
        }
    }
    if !report.is_empty() {
        bail!("{report}imports must point one way: move what both sides need into a module below both");
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn paths(code: &str) -> Vec<String> {
        crate_paths(code)
            .into_iter()
            .map(|p| p.join("::"))
            .collect()
    }

    #[test]
    fn paths_are_read_with_their_groups() {
        assert_eq!(
            paths("use crate::{a::{b, c::D}, e};\nlet x = crate::f::g(1); my_crate::h;"),
            ["a::b", "a::c::D", "e", "f::g"]
        );
        assert_eq!(paths("use crate::a::{self, B};"), ["a::self", "a::B"]);
        assert_eq!(paths("use crate::{\n    a,\n    b::c,\n};"), ["a", "b::c"]);
    }

    #[test]
    fn comments_and_tests_are_not_code() {
        let text = "use crate::a; // see crate::b\n#[cfg(test)]\nmod tests { use crate::c; }\n";
        assert_eq!(paths(&code(text)), ["a"]);
    }

    #[test]
    fn a_cycle_is_found_and_a_chain_is_not() {
        let p = |s: &str| PathBuf::from(s);
        let mut edges: BTreeMap<PathBuf, BTreeSet<PathBuf>> = BTreeMap::new();
        edges.entry(p("a")).or_default().insert(p("b"));
        edges.entry(p("b")).or_default().insert(p("c"));
        assert!(cycles(&edges).is_empty());
        edges.entry(p("c")).or_default().insert(p("a"));
        assert_eq!(cycles(&edges), [vec![p("a"), p("b"), p("c")]]);
    }
}
