//! Userspace NVMe: spec layouts, queue pairs, controller bring-up (issue 4).
