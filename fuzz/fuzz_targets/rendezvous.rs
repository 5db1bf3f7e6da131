//! Whatever a client sends rank 0 after authenticating: the announcement parses (within its
//! bounds, and re-encodes to the same) or is refused; never a panic or unbounded reading.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| tbrdma_collectives::fuzzing::rendezvous_announce(data));
