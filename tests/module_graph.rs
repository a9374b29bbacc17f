//! The crate's rooms import one way (docs/design.md, "Which module may import
//! which"): every `crate::X` path in a room names a room before it in
//! `ORDER`, so there is no import circle and no arrow back up (the CUDA
//! driver layer naming the tier, a model naming the pool). Read from the
//! sources, comments left out.

use std::collections::BTreeSet;
use std::path::Path;

/// Bottom up: a room may import only rooms before it.
const ORDER: &[&str] = &[
    "error",
    "checksum",
    "plan",
    "scratch",
    "host",
    "json",
    "model",
    "memory",
    "pool",
    "nvme",
    "ring",
    "p2p",
    "slack",
    "gpu",
    "engine",
    "submitter",
    "tier",
    "staged",
    "sched",
    "handle",
    "service",
    "fuzzing",
];

/// The code of a Rust source without its `//` comments (doc comments name
/// rooms above freely: that is prose, not an import).
fn code_of(text: &str) -> String {
    text.lines()
        .map(|l| match l.find("//") {
            // A `//` inside a string literal is rare in this crate; a line
            // whose code has a quote before the `//` keeps everything.
            Some(i) if !l[..i].contains('"') => &l[..i],
            _ => l,
        })
        .collect::<Vec<_>>()
        .join("\n")
}

/// The rooms `code` names as `crate::X` or inside `crate::{X, ...}`.
fn rooms_named(code: &str) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    let ident = |s: &str| -> String {
        s.trim_start()
            .chars()
            .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
            .collect()
    };
    for (i, _) in code.match_indices("crate::") {
        let rest = &code[i + "crate::".len()..];
        if let Some(group) = rest.strip_prefix('{') {
            let end = group.find('}').unwrap_or(group.len());
            for part in group[..end].split(',') {
                out.insert(ident(part));
            }
        } else {
            out.insert(ident(rest));
        }
    }
    out.retain(|r| !r.is_empty());
    out
}

fn walk(dir: &Path, files: &mut Vec<std::path::PathBuf>) {
    for e in std::fs::read_dir(dir).unwrap() {
        let p = e.unwrap().path();
        if p.is_dir() {
            walk(&p, files);
        } else if p.extension().is_some_and(|x| x == "rs") {
            files.push(p);
        }
    }
}

#[test]
fn rooms_import_only_rooms_below_them() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut files = Vec::new();
    walk(&src, &mut files);
    let rank = |room: &str| ORDER.iter().position(|r| *r == room);
    let mut wrong = Vec::new();
    for f in &files {
        let rel = f.strip_prefix(&src).unwrap();
        let first = rel
            .components()
            .next()
            .unwrap()
            .as_os_str()
            .to_string_lossy();
        let room = first.trim_end_matches(".rs").to_string();
        if room == "lib" {
            continue;
        }
        let Some(mine) = rank(&room) else {
            wrong.push(format!(
                "{}: room `{room}` is not in ORDER (add it where its imports put it)",
                rel.display()
            ));
            continue;
        };
        let code = code_of(&std::fs::read_to_string(f).unwrap());
        for other in rooms_named(&code) {
            if other == room {
                continue;
            }
            match rank(&other) {
                // `crate::Result` and other re-exports from lib.rs.
                None if other.chars().next().is_some_and(|c| c.is_uppercase()) => {}
                None => wrong.push(format!("{}: names unknown room `{other}`", rel.display())),
                Some(theirs) if theirs > mine => wrong.push(format!(
                    "{}: `{room}` imports `{other}`, which is above it",
                    rel.display()
                )),
                Some(_) => {}
            }
        }
    }
    assert!(
        wrong.is_empty(),
        "imports against the order:\n{}",
        wrong.join("\n")
    );
}

/// The check itself sees an arrow back up, in a path and in a group.
#[test]
fn the_check_finds_imports_and_skips_comments() {
    let code = code_of(
        "use crate::{error::Result, tier::Tier};\n// crate::handle in prose\nlet x = crate::pool::Key::from_u64(1);",
    );
    let named = rooms_named(&code);
    assert_eq!(
        named.into_iter().collect::<Vec<_>>(),
        vec!["error".to_string(), "pool".into(), "tier".into()]
    );
}
