//! The README says what the code does: its example is `examples/logits_to_loss.rs`'s (which CI
//! runs), and the README that crates.io shows (`README.crates-io.md`, the package's `readme`) is
//! the repository's with every link into the repository turned into a plain path, since
//! crates.io cannot resolve them. `TOPR_BLESS=1 cargo test --test readme` rewrites it.

use std::path::Path;

fn read(path: &str) -> String {
    std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join(path)).unwrap_or_else(|e| panic!("{path}: {e}"))
}

/// The lines of `examples/logits_to_loss.rs` between its `README: start` and `README: end`
/// markers, dedented by the first line's indentation.
fn example_section() -> String {
    let src = read("examples/logits_to_loss.rs");
    let lines: Vec<&str> = src.lines().collect();
    let start = lines.iter().position(|l| l.contains("// README: start")).expect("start marker") + 1;
    let end = lines.iter().position(|l| l.contains("// README: end")).expect("end marker");
    let indent = lines[start].len() - lines[start].trim_start().len();
    lines[start..end].iter().map(|l| l.get(indent..).unwrap_or("").trim_end()).collect::<Vec<_>>().join("\n")
}

#[test]
fn the_readme_example_is_the_example_that_runs() {
    let readme = read("README.md");
    let block = format!("```rust\n{}\n```", example_section());
    assert!(readme.contains(&block), "README.md must hold, verbatim, the example's section:\n{block}");
}

/// `[text](target)` with a relative target becomes `text (in the repository: `target`)`;
/// absolute links and anchors stay.
fn without_repository_links(md: &str) -> String {
    let mut out = String::new();
    let mut rest = md;
    while let Some(open) = rest.find('[') {
        let (before, from) = rest.split_at(open);
        out.push_str(before);
        let parsed = from.find("](").and_then(|mid| {
            let close = from[mid..].find(')')? + mid;
            let (text, target) = (&from[1..mid], &from[mid + 2..close]);
            (!text.contains('\n') && !target.contains(' ')).then_some((text, target, close))
        });
        match parsed {
            Some((text, target, close)) if !(target.contains("://") || target.starts_with('#')) => {
                out.push_str(&format!("{text} (in the repository: `{target}`)"));
                rest = &from[close + 1..];
            }
            _ => {
                out.push('[');
                rest = &from[1..];
            }
        }
    }
    out.push_str(rest);
    out
}

#[test]
fn the_crates_io_readme_is_the_readme_without_repository_links() {
    let want = format!(
        "<!-- Generated from README.md by tests/readme.rs (TOPR_BLESS=1 cargo test --test readme): edit README.md. -->\n{}",
        without_repository_links(&read("README.md"))
    );
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("README.crates-io.md");
    if std::env::var("TOPR_BLESS").as_deref() == Ok("1") {
        std::fs::write(&path, &want).unwrap();
    }
    let got = std::fs::read_to_string(&path).unwrap_or_default();
    assert!(got == want, "README.crates-io.md is out of date: run `TOPR_BLESS=1 cargo test --test readme`");
    assert!(!want.contains("](docs/") && !want.contains("](examples/"), "a repository link is left");
}

#[test]
fn repository_links_become_plain_paths() {
    let md = "See [the guide](docs/guide.md), [docs.rs](https://docs.rs/topr-loss), [licence](#license), [a] b.";
    assert_eq!(
        without_repository_links(md),
        "See the guide (in the repository: `docs/guide.md`), [docs.rs](https://docs.rs/topr-loss), [licence](#license), [a] b."
    );
}
