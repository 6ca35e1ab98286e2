//! Every relative link in the repository's Markdown files (README, CHANGELOG, docs/ and the
//! crates' own notes) points at a file that exists, and a link to a heading (`file.md#heading`,
//! or `#heading` within a file) at a heading that file has, by GitHub's rule for heading anchors:
//! lower case, punctuation dropped, spaces turned into hyphens.

use std::path::{Path, PathBuf};

/// The Markdown files below `dir`, outside build outputs, model folders and hidden folders.
fn markdown_files(dir: &Path, out: &mut Vec<PathBuf>) {
    let Ok(entries) = std::fs::read_dir(dir) else { return };
    for entry in entries.flatten() {
        let path = entry.path();
        let name = entry.file_name().to_string_lossy().into_owned();
        if path.is_dir() {
            if !(name.starts_with('.')
                || ["target", "models", "runs", "gpu-bundle", "node_modules"].contains(&name.as_str()))
            {
                markdown_files(&path, out);
            }
        } else if name.ends_with(".md") {
            out.push(path);
        }
    }
}

/// The text outside fenced code blocks (links there are examples, not links).
fn prose(md: &str) -> String {
    let mut fenced = false;
    let mut out = String::new();
    for line in md.lines() {
        if line.trim_start().starts_with("```") {
            fenced = !fenced;
            continue;
        }
        if !fenced {
            out.push_str(line);
            out.push('\n');
        }
    }
    out
}

/// GitHub's anchor of a heading's text.
fn anchor(heading: &str) -> String {
    heading
        .trim()
        .to_lowercase()
        .chars()
        .filter(|c| c.is_alphanumeric() || matches!(c, '-' | '_' | ' ') || ('\u{300}'..='\u{36f}').contains(c))
        .map(|c| if c == ' ' { '-' } else { c })
        .collect()
}

/// The anchors of a Markdown file's headings (a repeated heading's later ones get `-1`, `-2`, …).
fn anchors(md: &str) -> Vec<String> {
    let mut out: Vec<String> = vec![];
    for heading in prose(md).lines().filter_map(|l| l.strip_prefix('#')) {
        let base = anchor(heading.trim_start_matches('#').trim_end_matches('#'));
        let seen = out.iter().filter(|a| **a == base || a.strip_prefix(&base).is_some_and(is_suffix)).count();
        out.push(if seen == 0 { base } else { format!("{base}-{seen}") });
    }
    out
}

/// Whether `s` is a repeated heading's suffix (`-1`, `-2`, …).
fn is_suffix(s: &str) -> bool {
    s.strip_prefix('-').is_some_and(|n| !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit()))
}

/// The targets of the `[text](target)` links in `md`'s prose.
fn link_targets(md: &str) -> Vec<String> {
    let text = prose(md);
    let mut out = vec![];
    let mut rest = text.as_str();
    while let Some(at) = rest.find("](") {
        rest = &rest[at + 2..];
        if let Some(end) = rest.find(')') {
            let target = &rest[..end];
            if !target.contains(char::is_whitespace) {
                out.push(target.to_string());
            }
        }
    }
    out
}

#[test]
fn every_relative_link_in_the_markdown_resolves() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut files = vec![];
    markdown_files(root, &mut files);
    assert!(files.iter().any(|f| f.ends_with("docs/study.md")), "no docs found below {}", root.display());
    let mut broken = vec![];
    for file in &files {
        let md = std::fs::read_to_string(file).unwrap();
        for target in link_targets(&md) {
            if target.contains("://") || target.starts_with("mailto:") {
                continue;
            }
            let (path, heading) = target.split_once('#').unwrap_or((&target, ""));
            let linked = if path.is_empty() { file.clone() } else { file.parent().unwrap().join(path) };
            let rel = file.strip_prefix(root).unwrap().display().to_string();
            if !linked.exists() {
                broken.push(format!("{rel}: {target} (no such file)"));
            } else if !heading.is_empty() && linked.extension().is_some_and(|e| e == "md") {
                let text = std::fs::read_to_string(&linked).unwrap();
                if !anchors(&text).iter().any(|a| a == heading) {
                    broken.push(format!("{rel}: {target} (no such heading)"));
                }
            }
        }
    }
    assert!(broken.is_empty(), "broken links:\n{}", broken.join("\n"));
}

#[test]
fn anchors_follow_githubs_rule() {
    assert_eq!(
        anchor(" The real model over seeds: the grid (in progress)"),
        "the-real-model-over-seeds-the-grid-in-progress"
    );
    assert_eq!(anchor("Where the demo's time goes (2026-12-01)"), "where-the-demos-time-goes-2026-12-01");
    assert_eq!(anchors("# A\n## B\n```\n# not a heading\n```\n### A\n# A ##\n"), ["a", "b", "a-1", "a-2"]);
    assert_eq!(link_targets("see [a](docs/a.md#x) and [b](#y)\n```\n[c](nope.md)\n```\n"), ["docs/a.md#x", "#y"]);
}
