//! Which ranks a lab cables together.

use std::fmt;

use serde::{Deserialize, Serialize};

use crate::error::{NetdevError, Result};

/// How the lab's ranks are cabled.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum LabTopology {
    /// Two ranks, one or more cables between them.
    Pair,
    /// Every rank cabled to every other.
    Mesh,
    /// Rank k cabled to k+1 and k-1 (mod N).
    Ring,
}

impl fmt::Display for LabTopology {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            LabTopology::Pair => "pair",
            LabTopology::Mesh => "mesh",
            LabTopology::Ring => "ring",
        })
    }
}

impl LabTopology {
    /// The pairs of ranks (lower first) that get cables, after checking `ranks` suits.
    pub fn neighbour_pairs(self, ranks: usize) -> Result<Vec<(usize, usize)>> {
        let bad = |problem: String, fix: &str| Err(NetdevError::bad_input(problem, fix));
        match self {
            LabTopology::Pair if ranks != 2 => bad(
                format!("a pair has 2 ranks, not {ranks}"),
                "use `lab up 2`, or --topology mesh|ring",
            ),
            LabTopology::Mesh | LabTopology::Ring if ranks < 2 => bad(
                format!("a lab needs at least 2 ranks, not {ranks}"),
                "use `lab up 2` or more",
            ),
            LabTopology::Ring if ranks == 2 => bad(
                "a ring of 2 is a pair".into(),
                "use --topology pair (with --rails 2 for two cables)",
            ),
            _ if ranks > 64 => bad(
                format!("{ranks} ranks is more than the lab supports"),
                "use at most 64",
            ),
            LabTopology::Pair => Ok(vec![(0, 1)]),
            LabTopology::Mesh => Ok((0..ranks)
                .flat_map(|a| (a + 1..ranks).map(move |b| (a, b)))
                .collect()),
            LabTopology::Ring => {
                let mut pairs: Vec<(usize, usize)> = (0..ranks)
                    .map(|a| {
                        let b = (a + 1) % ranks;
                        (a.min(b), a.max(b))
                    })
                    .collect();
                pairs.sort();
                pairs.dedup();
                Ok(pairs)
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::LabTopology;

    #[test]
    fn pairs_per_topology() {
        assert_eq!(LabTopology::Pair.neighbour_pairs(2).unwrap(), [(0, 1)]);
        assert_eq!(
            LabTopology::Mesh.neighbour_pairs(3).unwrap(),
            [(0, 1), (0, 2), (1, 2)]
        );
        assert_eq!(
            LabTopology::Ring.neighbour_pairs(4).unwrap(),
            [(0, 1), (0, 3), (1, 2), (2, 3)]
        );
        assert_eq!(LabTopology::Ring.neighbour_pairs(3).unwrap().len(), 3);
        assert!(LabTopology::Pair.neighbour_pairs(3).is_err());
        assert!(LabTopology::Ring.neighbour_pairs(2).is_err());
        assert!(LabTopology::Mesh.neighbour_pairs(1).is_err());
    }
}
