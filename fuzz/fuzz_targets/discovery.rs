//! Any datagram from a host's cable neighbour during discovery, with and without a cluster
//! secret: it merges within the bounds or is refused; this host's own record never changes.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| tbrdma_netdev::hostfile::discover::fuzz_receive(data));
