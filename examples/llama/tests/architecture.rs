//! The shape of the code, checked: no import circle between the modules of either crate (the
//! loss library and the Llama crate), and no function in the Llama crate longer than about 60
//! lines but the ones listed with the reason they stay longer.
//!
//! A module's imports are the `crate::…` and `super::…` paths its code names (comments and
//! `#[cfg(test)]` modules aside), resolved to the longest module path that exists. The check
//! runs on the source files, so it needs no build of anything else.

mod common;

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// Functions that stay longer than [`MAX_LINES`], and why (none today).
const LONGER: [(&str, &str); 0] = [];

/// About 60 lines: a function of 60 lines of code with its signature and closing brace.
const MAX_LINES: usize = 66;

fn crate_src(rel: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join(rel)
}

/// Every `.rs` file under `root`, as (module path, text), `lib.rs`/`main.rs` as the root `""`.
fn modules(root: &Path) -> BTreeMap<String, String> {
    let mut out = BTreeMap::new();
    for rel in common::files_under(root) {
        if rel.extension().is_none_or(|x| x != "rs") {
            continue;
        }
        let mut parts: Vec<String> = rel.with_extension("").iter().map(|s| s.to_string_lossy().into_owned()).collect();
        if parts.last().is_some_and(|l| l == "mod") {
            parts.pop();
        }
        if parts.len() == 1 && (parts[0] == "lib" || parts[0] == "main") {
            parts.clear();
        }
        out.insert(parts.join("::"), std::fs::read_to_string(root.join(&rel)).unwrap());
    }
    out
}

/// The code of a file without comments and without its `#[cfg(test)]` module.
fn code(text: &str) -> String {
    let text = match text.find("#[cfg(test)]\nmod tests") {
        Some(i) => &text[..i],
        None => text,
    };
    text.lines().filter(|l| !l.trim_start().starts_with("//")).collect::<Vec<_>>().join("\n")
}

/// The module paths `text` names after `prefix` (`crate::a::b`, and each item of
/// `crate::{a, b::c}`).
fn named_paths(text: &str, prefix: &str) -> Vec<String> {
    let mut out = vec![];
    let ident = |c: char| c.is_ascii_alphanumeric() || c == '_' || c == ':';
    let mut rest = text;
    while let Some(i) = rest.find(prefix) {
        let before = rest[..i].chars().next_back();
        rest = &rest[i + prefix.len()..];
        if before.is_some_and(|c| c.is_ascii_alphanumeric() || c == '_') {
            continue;
        }
        if let Some(group) = rest.strip_prefix('{') {
            let end = group.find('}').unwrap_or(group.len());
            out.extend(group[..end].split(',').map(|s| s.trim().split("::").next().unwrap_or("").to_string()));
        } else {
            let end = rest.find(|c: char| !ident(c)).unwrap_or(rest.len());
            out.push(rest[..end].trim_end_matches(':').to_string());
        }
    }
    out.into_iter().filter(|p| !p.is_empty()).collect()
}

/// The import graph of the crate under `root`, module to modules.
fn graph(root: &Path) -> BTreeMap<String, BTreeSet<String>> {
    let mods = modules(root);
    let resolve = |path: &str| -> Option<String> {
        let parts: Vec<&str> = path.split("::").collect();
        (1..=parts.len()).rev().map(|n| parts[..n].join("::")).find(|m| mods.contains_key(m))
    };
    let mut edges: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for (m, text) in &mods {
        let text = code(text);
        let parent = m.rsplit_once("::").map_or("", |(p, _)| p);
        let mut paths = named_paths(&text, "crate::");
        for p in named_paths(&text, "super::") {
            paths.push(if parent.is_empty() { p } else { format!("{parent}::{p}") });
        }
        for p in paths {
            if let Some(to) = resolve(&p).filter(|to| to != m && !m.is_empty() && !to.is_empty()) {
                edges.entry(m.clone()).or_default().insert(to);
            }
        }
    }
    edges
}

/// The circles of `edges` (strongly connected components of more than one module).
fn circles(edges: &BTreeMap<String, BTreeSet<String>>) -> Vec<Vec<String>> {
    let nodes: BTreeSet<&String> = edges.keys().chain(edges.values().flatten()).collect();
    let reach = |from: &String| -> BTreeSet<String> {
        let mut seen = BTreeSet::new();
        let mut todo = vec![from.clone()];
        while let Some(n) = todo.pop() {
            for m in edges.get(&n).into_iter().flatten() {
                if seen.insert(m.clone()) {
                    todo.push(m.clone());
                }
            }
        }
        seen
    };
    let reaches: BTreeMap<&String, BTreeSet<String>> = nodes.iter().map(|n| (*n, reach(n))).collect();
    let mut out: Vec<Vec<String>> = vec![];
    for n in &nodes {
        let circle: Vec<String> = nodes
            .iter()
            .filter(|m| reaches[*n].contains(**m) && reaches[*m].contains(*n))
            .map(|m| (*m).clone())
            .collect();
        if circle.len() > 1 && !out.contains(&circle) {
            out.push(circle);
        }
    }
    out
}

#[test]
fn neither_crate_has_an_import_circle() {
    for root in ["src", "../../src"] {
        let edges = graph(&crate_src(root));
        assert!(edges.len() > 10, "{root}: the graph was not read ({} modules with imports)", edges.len());
        assert_eq!(circles(&edges), Vec::<Vec<String>>::new(), "import circles in {root}");
        // Nor between the top-level modules (a file's sub-modules count as the module).
        let top = |m: &String| m.split("::").next().unwrap_or("").to_string();
        let mut folded: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
        for (a, bs) in &edges {
            for b in bs.iter().filter(|b| top(b) != top(a)) {
                folded.entry(top(a)).or_default().insert(top(b));
            }
        }
        assert_eq!(circles(&folded), Vec::<Vec<String>>::new(), "top-level import circles in {root}");
    }
}

#[test]
fn the_circle_check_finds_a_circle() {
    let mut edges: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for (a, b) in [("a", "b"), ("b", "c"), ("c", "a"), ("c", "d")] {
        edges.entry(a.into()).or_default().insert(b.into());
    }
    assert_eq!(circles(&edges), vec![vec!["a".to_string(), "b".into(), "c".into()]]);
    assert_eq!(
        named_paths("use crate::{io::Lock, stage};\nx = crate::layout::LoopDir::new", "crate::"),
        ["io", "stage", "layout::LoopDir::new"]
    );
}

/// Each function of `text` (outside `#[cfg(test)]` modules): its name and its length in lines,
/// from its signature to its closing brace.
fn function_lengths(text: &str) -> Vec<(String, usize)> {
    let lines: Vec<&str> = code_lines(text);
    let mut out = vec![];
    for (i, l) in lines.iter().enumerate() {
        let t = l.trim_start();
        let indent = l.len() - t.len();
        let t = t.strip_prefix("pub(crate) ").or_else(|| t.strip_prefix("pub(super) ")).unwrap_or(t);
        let t = t.strip_prefix("pub ").unwrap_or(t);
        let t = t.strip_prefix("const ").unwrap_or(t);
        let Some(rest) = t.strip_prefix("fn ") else { continue };
        let name: String = rest.chars().take_while(|c| c.is_ascii_alphanumeric() || *c == '_').collect();
        let Some(open) = (i..lines.len()).find(|&j| lines[j].contains('{') || lines[j].trim_end().ends_with(';'))
        else {
            continue;
        };
        if lines[open].trim_end().ends_with(';') && !lines[open].contains('{') {
            continue; // a declaration (a trait's), not a body
        }
        let close = (open..lines.len())
            .find(|&j| lines[j].trim_start() == "}" && lines[j].len() - lines[j].trim_start().len() == indent)
            .or_else(|| lines[open].trim_end().ends_with('}').then_some(open));
        if let Some(close) = close {
            out.push((name, close - i + 1));
        }
    }
    out
}

/// The lines of `text` up to its `#[cfg(test)]` module.
fn code_lines(text: &str) -> Vec<&str> {
    let text = match text.find("#[cfg(test)]") {
        Some(i) => &text[..i],
        None => text,
    };
    text.lines().collect()
}

#[test]
fn no_function_of_the_llama_crate_is_much_longer_than_60_lines() {
    let root = crate_src("src");
    let mut long = vec![];
    for (m, text) in modules(&root) {
        let file = if m.is_empty() { "lib.rs".to_string() } else { format!("{}.rs", m.replace("::", "/")) };
        for (name, n) in function_lengths(&text) {
            let key = format!("{file}::{name}");
            if n > MAX_LINES && !LONGER.iter().any(|(k, _)| *k == key) {
                long.push(format!("{key}: {n} lines"));
            }
        }
    }
    assert!(
        long.is_empty(),
        "functions longer than {MAX_LINES} lines (split them, or list them in LONGER with the reason): {long:?}"
    );
    let listed = function_lengths("fn f() {\n    a();\n    b();\n}\nfn g() { x }\n");
    assert_eq!(listed, [("f".to_string(), 4), ("g".to_string(), 1)]);
}
