//! Every relative link in the repository's Markdown files (README, CHANGELOG, docs/ and the
//! crates' own notes) points at a file that exists, and a link to a heading (`file.md#heading`,
//! or `#heading` within a file) at a heading that file has, by GitHub's rule for heading anchors:
//! lower case, punctuation dropped, spaces turned into hyphens. And every repository path named
//! in a code span (`scripts/env.sh`) exists, and every Rust path (`generate::Shrink`) names words
//! of the sources.

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

/// The text outside fenced code blocks (links there are examples, not links). A fence opens with
/// three or more backticks or tildes and closes with the same character.
fn prose(md: &str) -> String {
    let mut fence: Option<char> = None;
    let mut out = String::new();
    for line in md.lines() {
        let trimmed = line.trim_start();
        let opener = ['`', '~'].into_iter().find(|c| trimmed.starts_with(&c.to_string().repeat(3)));
        match (fence, opener) {
            (None, Some(c)) => fence = Some(c),
            (Some(open), Some(c)) if open == c => fence = None,
            (None, None) => {
                out.push_str(line);
                out.push('\n');
            }
            _ => {}
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

/// The targets of the `[text](target)` links in `md`'s prose, and of its reference definitions
/// (`[label]: target`, what `[text][label]` links to).
fn link_targets(md: &str) -> Vec<String> {
    let text = prose(md);
    let mut out = vec![];
    for line in text.lines() {
        let line = line.trim_start();
        // A definition is the whole line: the target, then at most a quoted title.
        if let Some((label, rest)) = line.strip_prefix('[').and_then(|l| l.split_once("]:")) {
            let mut words = rest.trim().splitn(2, char::is_whitespace);
            let target = words.next().unwrap_or_default();
            let title = words.next().unwrap_or_default().trim();
            // Not a footnote (`[^1]: text`), and the label one bracket pair.
            let label_ok = !label.is_empty() && !label.starts_with('^') && !label.contains(['[', ']']);
            if label_ok && !target.is_empty() && (title.is_empty() || title.starts_with(['"', '\'', '('])) {
                out.push(target.trim_start_matches('<').trim_end_matches('>').to_string());
            }
        }
    }
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

/// The `code spans` of the text outside fenced code blocks, line by line.
fn code_spans(md: &str) -> Vec<String> {
    prose(md).lines().flat_map(|l| l.split('`').skip(1).step_by(2).map(str::to_string).collect::<Vec<_>>()).collect()
}

/// A repository path named in a code span (`scripts/env.sh`, `src/topr.rs::topr_loss`): a span
/// of path characters with a `/` whose first folder is one of the repository's. `src/…` and
/// `tests/…` may be the Llama crate's or the c10d crate's, as the text around them says.
fn repository_paths(md: &str) -> Vec<String> {
    const FOLDERS: [&str; 9] = ["src", "tests", "docs", "examples", "scripts", "dist", "benches", ".ci", "csrc"];
    code_spans(md)
        .into_iter()
        .filter_map(|s| {
            let path = s.trim().split("::").next()?.trim_end_matches('/').to_string();
            let plain = path.chars().all(|c| c.is_ascii_alphanumeric() || "_.-/".contains(c));
            (plain && path.contains('/') && FOLDERS.contains(&path.split('/').next()?)).then_some(path)
        })
        .collect()
}

#[test]
fn every_repository_path_in_a_code_span_exists() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut files = vec![];
    markdown_files(root, &mut files);
    let (mut checked, mut missing) = (0, vec![]);
    // The changelog names files that a version removed.
    for file in files.iter().filter(|f| !f.ends_with("CHANGELOG.md")) {
        for path in repository_paths(&std::fs::read_to_string(file).unwrap()) {
            checked += 1;
            let bases = [root, &root.join("examples/llama"), &root.join("dist"), file.parent().unwrap()];
            if !bases.iter().any(|b| b.join(&path).exists()) {
                missing.push(format!("{}: {path}", file.strip_prefix(root).unwrap().display()));
            }
        }
    }
    assert!(checked > 100, "only {checked} paths found: is the scan broken?");
    assert!(missing.is_empty(), "paths in code spans that do not exist:\n{}", missing.join("\n"));
}

/// The Rust sources of the workspace (build outputs, models and hidden folders aside), as one text.
fn rust_sources(dir: &Path, out: &mut String) {
    let Ok(entries) = std::fs::read_dir(dir) else { return };
    for entry in entries.flatten() {
        let (path, name) = (entry.path(), entry.file_name().to_string_lossy().into_owned());
        if path.is_dir() && !name.starts_with('.') && !["target", "models", "runs", "docs"].contains(&name.as_str()) {
            rust_sources(&path, out);
        } else if name.ends_with(".rs") {
            out.push_str(&std::fs::read_to_string(&path).unwrap());
        }
    }
}

/// Every Rust path in a code span of the README and docs/ (`generate::Shrink`,
/// `topr_llama::verify`) names things the sources have: each segment is a word of some Rust
/// file, so that a renamed or removed item cannot stay documented. C++ names (`c10d::…`,
/// `gloo::…`) and items the performance history names as replaced are left out.
#[test]
fn every_rust_path_in_a_code_span_names_words_of_the_sources() {
    const FOREIGN: [&str; 10] =
        ["torch", "at", "c10", "c10d", "std", "gloo", "rendezvous", "mkldnn", "aten", "transformers"];
    const REPLACED: [&str; 1] = ["generate::Release"];
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut sources = String::new();
    rust_sources(root, &mut sources);
    let words: std::collections::HashSet<&str> =
        sources.split(|c: char| !(c.is_ascii_alphanumeric() || c == '_')).collect();
    let mut files = vec![root.join("README.md")];
    markdown_files(&root.join("docs"), &mut files);
    files.retain(|f| f.parent() == Some(root) || f.parent() == Some(&root.join("docs")));
    let (mut checked, mut unknown) = (0, vec![]);
    for file in &files {
        let md = std::fs::read_to_string(file).unwrap();
        for span in code_spans(&md) {
            let path = span.trim().trim_end_matches("()");
            let segments: Vec<&str> = path.split("::").collect();
            let rust = segments.len() > 1
                && segments.iter().all(|s| !s.is_empty() && s.chars().all(|c| c.is_ascii_alphanumeric() || c == '_'));
            if !rust || FOREIGN.contains(&segments[0]) || REPLACED.contains(&path) {
                continue;
            }
            checked += 1;
            if let Some(s) = segments.iter().find(|s| !words.contains(*s)) {
                unknown.push(format!("{}: {path} ({s})", file.strip_prefix(root).unwrap().display()));
            }
        }
    }
    assert!(checked > 100, "only {checked} Rust paths found: is the scan broken?");
    assert!(unknown.is_empty(), "Rust paths naming what no source has:\n{}", unknown.join("\n"));
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
    // Tilde fences (a backtick line inside one does not close it), reference definitions.
    assert_eq!(
        link_targets("~~~\n```\n[c](nope.md)\n~~~\n[d][r] and [e](e.md)\n  [r]: <docs/r.md#z> \"title\"\n"),
        ["docs/r.md#z", "e.md"]
    );
    assert_eq!(anchors("~~~sh\n# a comment\n~~~\n# Real\n"), ["real"]);
    // Not a definition: more than a target and a title on the line.
    assert!(link_targets("[127.0.0.1]:26781. This is typically caused by\n").is_empty());
    // Nor a footnote, nor a line whose first bracket closes before the colon's.
    assert!(link_targets("[^1]: word\n").is_empty());
    assert_eq!(link_targets("[a](x.md) see [b]: foo\n"), ["x.md"]);
}
