//! `tbrdma doctor`: checks that each piece tbrdma relies on is in place, each ending in pass,
//! warn, fail or skip with a one-line fix. It only reads (and pings); it never changes
//! anything. A check that cannot run yet says so as `skip`, never as `pass`.
//!
//! Checks that need the transport or the NCCL plugin (which this crate must not depend on, see
//! docs/architecture.md) come from a [`Probes`] the caller passes in: the `tbrdma` CLI runs a
//! ping-pong over each link and loads the plugin. Without one they are skipped, saying so.

mod host;
mod links;

use std::fmt;
use std::net::Ipv4Addr;
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
    /// A check's result with no fix.
    pub fn new(name: impl Into<String>, status: Status, detail: impl Into<String>) -> Self {
        Self {
            name: name.into(),
            status,
            detail: detail.into(),
            fix: None,
        }
    }

    /// Adds the one line that fixes it.
    pub fn fix(mut self, fix: impl Into<String>) -> Self {
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
    /// Run the NCCL/RCCL plugin checks ([`Probes::nccl`]).
    pub nccl: bool,
}

/// A link whose address is in place, as the transport probe sees it.
#[derive(Debug, Clone, PartialEq)]
pub struct LinkUnderTest {
    /// Interface name.
    pub interface: String,
    /// This end's address.
    pub local: Ipv4Addr,
    /// The other end's address.
    pub peer: Ipv4Addr,
    /// The host at the other end.
    pub peer_name: String,
    /// Round trips of ICMP echo measured just before (the kernel's floor), when it answered.
    pub icmp_rtt_us: Option<f64>,
    /// The Thunderbolt link rate (lanes × lane speed) in Gbit/s, when sysfs says.
    pub link_gbps: Option<f64>,
    /// Busy-poll sysctls that are not set as `tbrdma setup` sets them (empty: all set).
    pub busy_poll_off: Vec<String>,
}

/// Checks that need crates this one does not depend on, supplied by the caller.
pub trait Probes {
    /// Transport checks over the links (ping-pong latency, bandwidth), in the order printed.
    /// All links at once, since the peer may test its cables in another order.
    fn links(&self, links: &[LinkUnderTest]) -> Vec<Check>;
    /// NCCL/RCCL plugin checks (found, loads, exports its tables, `init` succeeds).
    fn nccl(&self) -> Vec<Check>;
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

/// Runs every check against `inventory`; `probes` adds the transport and plugin checks.
pub fn run(
    inventory: &Inventory,
    options: &DoctorOptions,
    probes: Option<&dyn Probes>,
) -> Result<Report> {
    let (mut checks, mut under_test) = links::checks(inventory, options)?;
    let busy_poll_off = host::busy_poll_off(&options.proc_root);
    for link in &mut under_test {
        link.busy_poll_off = busy_poll_off.clone();
        link.link_gbps = host::link_gbps(&options.sysfs_root, &link.interface);
    }
    match probes {
        Some(probes) if !under_test.is_empty() => checks.extend(probes.links(&under_test)),
        Some(_) => {}
        None => checks.push(Check::new(
            "transport ping-pong",
            Status::Skip,
            "not run: this doctor was built without the transport (run the `tbrdma` CLI)",
        )),
    }
    checks.extend(host::checks(inventory, options));
    if options.nccl {
        match probes {
            Some(probes) => checks.extend(probes.nccl()),
            None => checks.push(Check::new(
                "NCCL plugin",
                Status::Skip,
                "not run: this doctor was built without the plugin checks (run the `tbrdma` CLI)",
            )),
        }
    }
    let summary = Summary::of(&checks);
    Ok(Report { checks, summary })
}
