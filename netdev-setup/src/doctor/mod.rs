//! `tbrdma doctor`: checks that each piece tbrdma relies on is in place, each ending in pass,
//! warn, fail or skip with a one-line fix. It only reads (and pings); it never changes
//! anything. A check that cannot run yet says so as `skip`, never as `pass`.

mod host;
mod links;

use std::fmt;
use std::path::PathBuf;

use serde::Serialize;

use crate::error::Result;
use crate::inventory::Inventory;

/// A check's outcome.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Status {
    /// Fine.
    Pass,
    /// Works, but slower or more fragile than it should be.
    Warn,
    /// tbrdma will not work until this is fixed.
    Fail,
    /// Could not be checked (here, or yet).
    Skip,
}

/// One check's result.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Check {
    /// What was checked.
    pub name: String,
    /// The outcome.
    pub status: Status,
    /// What was found.
    pub detail: String,
    /// One line that fixes it, when it is not a pass.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub fix: Option<String>,
}

impl Check {
    fn new(name: impl Into<String>, status: Status, detail: impl Into<String>) -> Self {
        Self {
            name: name.into(),
            status,
            detail: detail.into(),
            fix: None,
        }
    }

    fn fix(mut self, fix: impl Into<String>) -> Self {
        self.fix = Some(fix.into());
        self
    }
}

/// Where doctor looks.
#[derive(Debug, Clone)]
pub struct DoctorOptions {
    /// sysfs root.
    pub sysfs_root: PathBuf,
    /// procfs root.
    pub proc_root: PathBuf,
    /// Whether this is the running system (ping peers, probe io_uring, read limits).
    pub live: bool,
}

/// Every check's result.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Report {
    /// In the order they ran.
    pub checks: Vec<Check>,
    /// How many checks ended in each status, and whether none failed.
    pub summary: Summary,
}

/// Counts per status.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct Summary {
    /// No check failed.
    pub ok: bool,
    /// Passed.
    pub pass: usize,
    /// Warned.
    pub warn: usize,
    /// Failed.
    pub fail: usize,
    /// Skipped.
    pub skip: usize,
}

impl Summary {
    fn of(checks: &[Check]) -> Self {
        let count = |status| checks.iter().filter(|c| c.status == status).count();
        let fail = count(Status::Fail);
        Summary {
            ok: fail == 0,
            pass: count(Status::Pass),
            warn: count(Status::Warn),
            fail,
            skip: count(Status::Skip),
        }
    }
}

impl Report {
    /// True when no check failed.
    pub fn ok(&self) -> bool {
        self.summary.ok
    }
}

impl fmt::Display for Report {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for check in &self.checks {
            let label = match check.status {
                Status::Pass => "PASS",
                Status::Warn => "WARN",
                Status::Fail => "FAIL",
                Status::Skip => "SKIP",
            };
            writeln!(f, "{label}  {}: {}", check.name, check.detail)?;
            if let Some(fix) = &check.fix {
                writeln!(f, "      fix: {fix}")?;
            }
        }
        writeln!(
            f,
            "{} passed, {} warned, {} failed, {} skipped",
            self.summary.pass, self.summary.warn, self.summary.fail, self.summary.skip
        )
    }
}

/// Runs every check against `inventory`.
pub fn run(inventory: &Inventory, options: &DoctorOptions) -> Result<Report> {
    let mut checks = links::checks(inventory, options)?;
    checks.push(
        Check::new(
            "transport ping-pong",
            Status::Skip,
            "skipped: transport not built yet",
        )
        .fix("nothing to do yet; the ICMP reachability checks above cover the links"),
    );
    checks.extend(host::checks(inventory, options));
    let summary = Summary::of(&checks);
    Ok(Report { checks, summary })
}
