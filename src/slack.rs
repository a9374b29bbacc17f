//! Slack tables: loading and lookup (issue 6).
