//! Reading JSON documents users hand us (config.json, slack tables) with
//! errors that say where and what: one place for both readers.

use serde_json::{Map, Value};

/// What kind of JSON value `v` is, for messages ("an array", "null").
pub fn json_kind(v: &Value) -> &'static str {
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
pub fn parse_object(
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
