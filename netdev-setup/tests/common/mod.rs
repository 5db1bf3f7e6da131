//! Helpers shared by the integration tests.
#![allow(dead_code)]

pub mod fake_sysfs;
pub mod lab_guard;
pub mod records;
