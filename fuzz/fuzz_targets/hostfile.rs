//! Hostfiles and host records, as a file or a discovery neighbour would hand them over: a
//! hostfile's text parses or is refused, and any list of records builds a hostfile or is
//! refused, within bounded time and memory (a loop or a panic is a finding).
#![no_main]

use libfuzzer_sys::fuzz_target;
use tbrdma_netdev::hostfile::{HostRecord, Hostfile};

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    if let Ok(hostfile) = Hostfile::parse(text) {
        // What parses writes back to text that parses to the same.
        assert_eq!(Hostfile::parse(&hostfile.to_json()).as_ref(), Ok(&hostfile));
    }
    if let Ok(records) = serde_json::from_str::<Vec<HostRecord>>(text) {
        if let Ok(hostfile) = Hostfile::from_records(&records) {
            let again = Hostfile::parse(&hostfile.to_json()).expect("a built hostfile parses");
            assert_eq!(again, hostfile);
        }
    }
});
