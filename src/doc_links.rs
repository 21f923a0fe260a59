//! The documentation's relative links resolve: every `[text](target)` in `README.md`,
//! `ARCHITECTURE.md`, `CHANGELOG.md` and `docs/*.md` names a file or directory of the repository,
//! and its `#anchor`, when the target is Markdown, is the slug of one of that file's headings, as
//! GitHub makes them; and every document under `docs/` is linked from the index `docs/README.md`.
//! Unit tests (not a script) so `cargo test`, and with it CI, runs them.
//!
//! Links inside fenced code blocks and inline code are not links and are skipped; so are links
//! with a scheme (`https:`, `mailto:`), which would need the network.

use std::collections::HashSet;
use std::path::{Path, PathBuf};

/// The Markdown files whose links are checked, relative to the repository root.
fn checked_files(root: &Path) -> Vec<PathBuf> {
    let mut files: Vec<PathBuf> =
        ["README.md", "ARCHITECTURE.md", "CHANGELOG.md"].iter().map(|name| root.join(name)).collect();
    let mut docs: Vec<PathBuf> = std::fs::read_dir(root.join("docs"))
        .expect("docs/ is readable")
        .map(|entry| entry.expect("a docs/ entry").path())
        .filter(|path| path.extension().is_some_and(|ext| ext == "md"))
        .collect();
    docs.sort();
    files.extend(docs);
    files
}

/// The lines of `text` outside fenced code blocks, with their 1-based numbers.
fn prose_lines(text: &str) -> Vec<(usize, &str)> {
    let mut in_fence = false;
    let mut lines = Vec::new();
    for (index, line) in text.lines().enumerate() {
        let trimmed = line.trim_start();
        if trimmed.starts_with("```") || trimmed.starts_with("~~~") {
            in_fence = !in_fence;
            continue;
        }
        if !in_fence {
            lines.push((index + 1, line));
        }
    }
    lines
}

/// `line` with its inline code spans (`` `…` ``) removed.
fn without_code_spans(line: &str) -> String {
    let mut out = String::new();
    let mut in_code = false;
    for character in line.chars() {
        if character == '`' {
            in_code = !in_code;
        } else if !in_code {
            out.push(character);
        }
    }
    out
}

/// GitHub's anchor for a heading's text: lower case, punctuation other than `-` and `_` dropped
/// (inline code keeps its text, links their text), each space a `-`.
fn slug(heading: &str) -> String {
    let text = heading.replace('`', "");
    // A link in a heading contributes its text: drop the `(target)` after `]`.
    let mut plain = String::new();
    let mut rest = text.as_str();
    while let Some(open) = rest.find("](") {
        plain.push_str(&rest[..open]);
        rest = &rest[open + 2..];
        rest = rest.find(')').map_or("", |close| &rest[close + 1..]);
    }
    plain.push_str(rest);
    plain
        .to_lowercase()
        .chars()
        .filter(|c| c.is_alphanumeric() || *c == ' ' || *c == '-' || *c == '_')
        .map(|c| if c == ' ' { '-' } else { c })
        .collect()
}

/// Every anchor a Markdown text offers: its headings' slugs, the second of two equal ones
/// suffixed `-1`, the third `-2`, as GitHub does.
fn anchors(text: &str) -> HashSet<String> {
    let mut found = HashSet::new();
    for (_, line) in prose_lines(text) {
        let Some(heading) = line.strip_prefix('#') else { continue };
        let heading = heading.trim_start_matches('#');
        if !heading.starts_with(' ') {
            continue;
        }
        let base = slug(heading.trim().trim_end_matches('#').trim());
        let mut candidate = base.clone();
        let mut n = 0;
        while found.contains(&candidate) {
            n += 1;
            candidate = format!("{base}-{n}");
        }
        found.insert(candidate);
    }
    found
}

/// The `(target)` of every inline link `[text](target)` in the prose of `text`, with its line.
fn links(text: &str) -> Vec<(usize, String)> {
    let mut found = Vec::new();
    for (number, line) in prose_lines(text) {
        let line = without_code_spans(line);
        let mut rest = line.as_str();
        while let Some(open) = rest.find("](") {
            rest = &rest[open + 2..];
            let Some(close) = rest.find(')') else { break };
            found.push((number, rest[..close].trim().to_string()));
            rest = &rest[close + 1..];
        }
    }
    found
}

/// What is wrong with each relative link of `file` (a path under `root`), as `file:line: …`.
fn broken_links(root: &Path, file: &Path) -> Vec<String> {
    let text = std::fs::read_to_string(file).unwrap_or_else(|e| panic!("{}: {e}", file.display()));
    let shown = file.strip_prefix(root).unwrap_or(file).display().to_string();
    let directory = file.parent().unwrap_or(root);
    let mut problems = Vec::new();
    for (line, target) in links(&text) {
        if target.contains("://") || target.starts_with("mailto:") {
            continue;
        }
        let (path, anchor) = match target.split_once('#') {
            Some((path, anchor)) => (path, Some(anchor)),
            None => (target.as_str(), None),
        };
        let resolved = if path.is_empty() { file.to_path_buf() } else { directory.join(path) };
        if !resolved.exists() {
            problems.push(format!("{shown}:{line}: {target}: no such file"));
            continue;
        }
        let Some(anchor) = anchor else { continue };
        if resolved.extension().is_none_or(|ext| ext != "md") {
            continue;
        }
        let target_text = std::fs::read_to_string(&resolved).unwrap_or_default();
        if !anchors(&target_text).contains(anchor) {
            problems.push(format!("{shown}:{line}: {target}: no heading with the anchor #{anchor}"));
        }
    }
    problems
}

#[test]
fn every_relative_link_in_the_documentation_resolves() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let files = checked_files(root);
    let problems: Vec<String> = files.iter().flat_map(|file| broken_links(root, file)).collect();
    assert!(problems.is_empty(), "broken links:\n{}", problems.join("\n"));
}

/// docs/README.md is the index: every other document under docs/ is linked from it, so a new
/// document cannot be left where no reader finds it.
#[test]
fn every_document_under_docs_is_in_the_index() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let index = std::fs::read_to_string(root.join("docs/README.md")).expect("docs/README.md");
    let indexed: HashSet<String> =
        links(&index).into_iter().map(|(_, target)| target.split('#').next().unwrap_or("").to_string()).collect();
    let missing: Vec<String> = checked_files(root)
        .iter()
        .filter(|path| path.parent() == Some(root.join("docs").as_path()))
        .filter_map(|path| path.file_name().map(|name| name.to_string_lossy().into_owned()))
        .filter(|name| name != "README.md" && !indexed.contains(name))
        .collect();
    assert!(missing.is_empty(), "documents not linked from docs/README.md: {missing:?}");
}

/// The checker itself, on a repository of two files made here: it must find what is broken and
/// only that. Slugs expected as GitHub renders them (github-slugger: lower case, punctuation but
/// `-` and `_` dropped, spaces to `-`, repeats numbered).
#[test]
fn the_link_checker_finds_missing_files_and_anchors() {
    let root = tempfile::tempdir().expect("a temporary directory");
    let other = "# Other\n\n## Live migration: `--follow` and cut-over\n\n## Numbers\n\n## Numbers\n\n\
                 ```sh\n# not a heading\n```\n";
    std::fs::write(root.path().join("other.md"), other).expect("write other.md");
    let main = "# Main\n\n\
                [ok](other.md) [ok](other.md#live-migration---follow-and-cut-over) [ok](other.md#numbers-1)\n\
                [ok](#main) [ok](https://example.com/missing) `[code](missing.md)`\n\
                [bad](missing.md)\n\
                [bad](other.md#live-migration-follow-and-cut-over)\n\
                [bad](other.md#not-a-heading)\n\
                ```md\n[code](missing.md)\n```\n";
    let main_path = root.path().join("main.md");
    std::fs::write(&main_path, main).expect("write main.md");
    let problems = broken_links(root.path(), &main_path);
    assert_eq!(
        problems,
        [
            "main.md:5: missing.md: no such file",
            "main.md:6: other.md#live-migration-follow-and-cut-over: no heading with the anchor \
             #live-migration-follow-and-cut-over",
            "main.md:7: other.md#not-a-heading: no heading with the anchor #not-a-heading",
        ]
    );
}
