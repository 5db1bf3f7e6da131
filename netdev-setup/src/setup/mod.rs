//! `tbrdma setup`: plan the changes that make this host's links ready for tbrdma, then apply
//! them. Planning ([`plan`]) only reads; applying ([`apply`]) only carries out a plan.

pub mod apply;
pub mod persist;
pub mod plan;
pub mod relay;
pub mod step;
pub mod tuning;

pub use apply::{Roots, apply};
pub use persist::Persist;
pub use plan::{Plan, SetupOptions, plan};
pub use step::Step;
