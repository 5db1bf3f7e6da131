//! What the NCCL plugin decodes from a peer (its listen handle, a CTS, a message number in an
//! immediate value): decoding never panics, and what decodes re-encodes to the same.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| nccl_net_tbrdma::fuzzing::control(data));
