//! `tbrdma-netdev`: finds, configures and checks the USB4/Thunderbolt links, writes the cluster
//! hostfile, and builds the virtual lab of network namespaces that stands in for real cables.
//!
//! It never depends on the transport: setting up a link must work before tbrdma can run on it.
//! Detection reads; the planner decides; `apply`, the lab and `netns` are the only code that
//! changes the system, and they change it through netlink and single file writes.

#![forbid(unsafe_code)]

pub mod addressing;
pub mod cables;
pub mod cli;
pub mod detect;
pub mod doctor;
pub mod error;
pub mod hostfile;
pub mod inventory;
pub mod lab;
pub mod links_file;
pub mod names;
pub mod netlink;
pub mod netns;
pub mod ping;
pub mod setup;

pub use error::{NetdevError, Result};
