//! Reading JSON documents users hand us (config.json, slack tables) with
//! errors that say where and what: one place for both readers.

use serde_json::{Map, Value};
use std::io::Read;
use std::path::Path;

/// At most `max` characters of `s` (user input quoted in an error message),
/// with how much was cut: a message quoting a 20 KB array helps nobody.
pub fn excerpt(s: &str, max: usize) -> String {
    let n = s.chars().count();
    if n <= max {
        return s.to_string();
    }
    let head: String = s.chars().take(max).collect();
    format!("{head}... ({} more characters)", n - max)
}

/// Serialize a path as its text, with any bytes that are not UTF-8 shown as
/// U+FFFD (serde's own path serializer fails on them, and a report must not
/// fail over a directory's name): `#[serde(serialize_with = "kvtier::json::path_lossy")]`.
pub fn path_lossy<S: serde::Serializer>(p: &Path, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_str(&p.to_string_lossy())
}

/// A JSON value for an error message, shortened by [`excerpt`].
pub(crate) fn value_excerpt(v: &Value) -> String {
    excerpt(&v.to_string(), 60)
}

/// A list of numbers for an error message: the first and last few when long.
pub(crate) fn list_excerpt(v: &[u64]) -> String {
    if v.len() <= 8 {
        return format!("{v:?}");
    }
    let head: Vec<String> = v[..4].iter().map(u64::to_string).collect();
    let tail: Vec<String> = v[v.len() - 2..].iter().map(u64::to_string).collect();
    format!(
        "[{}, ... {} more ..., {}]",
        head.join(", "),
        v.len() - 6,
        tail.join(", ")
    )
}

/// Reads a document a user named (config.json, a slack table), refusing
/// what could hang or exhaust memory: only a regular file of at most
/// `max_bytes` is read. The file is opened non-blocking, so a FIFO cannot
/// hang the open, and checked with fstat on the opened descriptor, so
/// `/dev/zero`, `/dev/urandom`, a FIFO or a socket is refused by kind
/// before a byte is read. Errors are the reason alone; the caller names
/// the file and the fix.
pub(crate) fn read_user_file(path: &Path, max_bytes: u64) -> Result<String, String> {
    use std::os::unix::fs::OpenOptionsExt;
    let file = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NONBLOCK | libc::O_CLOEXEC)
        .open(path)
        .map_err(|e| format!("cannot read it ({e})"))?;
    let meta = file
        .metadata()
        .map_err(|e| format!("cannot read it ({e})"))?;
    let ft = meta.file_type();
    if !ft.is_file() {
        let kind = crate::host::file_kind(&ft);
        return Err(format!("it is {kind}, not a regular file"));
    }
    let too_big = |len: u64| {
        format!(
            "it is {len} bytes, more than the {max_bytes} this kind of file can be; is it the right file?"
        )
    };
    if meta.len() > max_bytes {
        return Err(too_big(meta.len()));
    }
    // The file may grow while it is read: read one byte past the cap to see.
    let mut bytes = Vec::with_capacity(meta.len() as usize);
    file.take(max_bytes + 1)
        .read_to_end(&mut bytes)
        .map_err(|e| format!("cannot read it ({e})"))?;
    if bytes.len() as u64 > max_bytes {
        return Err(too_big(bytes.len() as u64));
    }
    let mut text = String::from_utf8(bytes).map_err(|e| {
        format!(
            "it is not UTF-8 text (invalid byte at offset {})",
            e.utf8_error().valid_up_to()
        )
    })?;
    // A byte-order mark (editors on Windows write one) is no part of the JSON.
    if text.starts_with('\u{feff}') {
        text.drain(..'\u{feff}'.len_utf8());
    }
    Ok(text)
}

/// What kind of JSON value `v` is, for messages ("an array", "null").
pub(crate) fn json_kind(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}

/// Parse `text` as a JSON object. The error (without the file name, which
/// the caller adds) gives serde_json's line and column once, then `fix`.
pub(crate) fn parse_object(
    text: &str,
    fix: &str,
    object_name: &str,
) -> Result<Map<String, Value>, String> {
    let value: Value = serde_json::from_str(text).map_err(|e| {
        // serde_json's Display ends in " at line L column C"; say it once, up front.
        let (line, column) = (e.line(), e.column());
        let full = e.to_string();
        let what = full
            .strip_suffix(&format!(" at line {line} column {column}"))
            .unwrap_or(&full);
        format!("not valid JSON at line {line}, column {column}: {what}; {fix}")
    })?;
    match value {
        Value::Object(map) => Ok(map),
        other => Err(format!(
            "the top level is {}, not a JSON object; {object_name}",
            json_kind(&other)
        )),
    }
}
