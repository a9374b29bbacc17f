//! The read-first / write-deferred I/O scheduler (issue 6).
