//! What this process holds in memory, from `/proc/self/status`: resident set (VmRSS) and
//! locked memory (VmLck, the pinned regions), and the rule that says whether it stayed flat.

use serde::{Deserialize, Serialize};

/// One reading, in KiB as the kernel reports them.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Memory {
    /// Resident set size.
    pub rss_kib: u64,
    /// Locked (pinned) memory.
    pub lck_kib: u64,
}

impl Memory {
    /// Reads this process's figures; zeros where the kernel does not say.
    pub fn now() -> Memory {
        let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
        parse_status(&status)
    }

    /// The larger of each figure.
    pub fn max(self, other: Memory) -> Memory {
        Memory {
            rss_kib: self.rss_kib.max(other.rss_kib),
            lck_kib: self.lck_kib.max(other.lck_kib),
        }
    }
}

fn parse_status(status: &str) -> Memory {
    let field = |name: &str| {
        status
            .lines()
            .find_map(|l| l.strip_prefix(name))
            .and_then(|rest| rest.trim().trim_end_matches("kB").trim().parse().ok())
            .unwrap_or(0)
    };
    Memory {
        rss_kib: field("VmRSS:"),
        lck_kib: field("VmLck:"),
    }
}

/// RSS growth allowed between the reading after the warm-up and the one at the end: 10 %
/// plus 8 MiB. Allocator caches, the fault layer's hold queue (up to 8 MiB per rail) and the
/// engine's retransmission state breathe by that much; a buffer leaked per operation or per
/// reconnect exceeds it within minutes.
pub const GROWTH_SLACK_KIB: u64 = 8 << 10;

/// Whether memory stayed flat from `warm` to `end`: RSS within 10 % + [`GROWTH_SLACK_KIB`];
/// locked memory within 1 %. Only registered regions are pinned, and a session holds the same
/// regions at both readings, so one region kept pinned after its session closed (a leak of
/// megabytes of unswappable memory per failure) must fail the run.
pub fn is_flat(warm: Memory, end: Memory) -> bool {
    end.rss_kib <= warm.rss_kib + warm.rss_kib / 10 + GROWTH_SLACK_KIB
        && end.lck_kib <= warm.lck_kib + warm.lck_kib / 100
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_rss_and_locked_memory_and_judges_growth() {
        let m = parse_status("Name:\tx\nVmLck:\t    2048 kB\nVmRSS:\t   10240 kB\n");
        assert_eq!(
            m,
            Memory {
                rss_kib: 10240,
                lck_kib: 2048
            }
        );
        assert!(Memory::now().rss_kib > 0);
        let warm = m;
        assert!(is_flat(warm, warm));
        let grown = Memory {
            rss_kib: 10240 + 1024 + (8 << 10) + 1,
            lck_kib: 2048,
        };
        assert!(!is_flat(warm, grown));
        // One more region pinned (here 1 MiB) is growth, however small against RSS.
        let locked_more = Memory {
            rss_kib: 10240,
            lck_kib: 2048 + 1024,
        };
        assert!(!is_flat(warm, locked_more));
    }
}
