//! Scripts of forged and disturbed datagrams against an established pair with work in flight
//! (format: `tbrdma_proto::fuzzing::feed_endpoint`).
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| tbrdma_proto::fuzzing::feed_endpoint(data));
