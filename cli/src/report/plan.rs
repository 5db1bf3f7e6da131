//! The standard sweep: which `tbrdma` runs a report is made of, in order, with their options.
//! Both ends derive the same list from the same [`Plan`], so the peer never takes a command
//! line from the network: it only follows step numbers of a list it built itself.

use serde::{Deserialize, Serialize};

/// What both ends agree on before the sweep (sent by the client, checked by the server).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Plan {
    /// The tbrdma version (the step lists of two versions may differ).
    pub version: String,
    /// Short sweep (`--quick`).
    pub quick: bool,
    /// Also stream over every cable to the peer (the hostfile has more than one).
    pub rails: bool,
    /// Both ends have a hostfile: the collective runs and the kernel floors are in.
    pub collectives: bool,
}

/// How a step runs on the two ends.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Shape {
    /// One end serves (`tbrdma pingpong`/`bw` without an address), the client connects.
    ClientServer,
    /// Both ends run the same command as ranks of the hostfile; rank 0 prints.
    Ranks,
}

/// One run of the sweep.
#[derive(Debug, Clone)]
pub struct Step {
    /// Short name, the key of its figures in report.json.
    pub name: String,
    /// The run's shape.
    pub shape: Shape,
    /// `tbrdma` arguments both ends share (the client adds the peer, both add link options).
    pub args: Vec<String>,
}

/// Standard model shapes for the tensor-parallel estimate: (name, hidden, layers).
pub const MODELS: [(&str, usize, usize); 3] = [
    ("Llama-3.1-8B", 4096, 32),
    ("Qwen2.5-32B", 5120, 64),
    ("Llama-3.1-70B", 8192, 80),
];

fn strings(v: &[&str]) -> Vec<String> {
    v.iter().map(|s| s.to_string()).collect()
}

fn sizes(from: usize, to: usize, factor: usize) -> Vec<String> {
    std::iter::successors(Some(from), |s| (*s < to).then_some(s * factor))
        .flat_map(|s| ["--size".to_string(), s.to_string()])
        .collect()
}

impl Plan {
    /// The steps of this plan, in the order both ends run them.
    pub fn steps(&self) -> Vec<Step> {
        let (lat_sizes, lat_iters, lat_warmup) = if self.quick {
            (sizes(8, 32768, 16), "200", "20")
        } else {
            (sizes(2, 1 << 20, 4), "1000", "100")
        };
        let (bw_sizes, bw_seconds) = if self.quick {
            (sizes(4096, 1 << 20, 16), "0.2")
        } else {
            (sizes(1024, 4 << 20, 4), "1")
        };
        let mut steps = Vec::new();
        for op in ["write", "send", "read"] {
            let mut args = strings(&[
                "pingpong", "--op", op, "--iters", lat_iters, "--warmup", lat_warmup,
            ]);
            args.extend(lat_sizes.clone());
            steps.push(Step {
                name: format!("latency_{op}"),
                shape: Shape::ClientServer,
                args,
            });
        }
        let mut bw = strings(&["bw", "--op", "write", "--duration", bw_seconds]);
        bw.extend(bw_sizes.clone());
        steps.push(Step {
            name: "bandwidth_1_rail".into(),
            shape: Shape::ClientServer,
            args: bw.clone(),
        });
        if self.rails {
            let mut rails = bw;
            rails.push("--rails".into());
            steps.push(Step {
                name: "bandwidth_all_rails".into(),
                shape: Shape::ClientServer,
                args: rails,
            });
        }
        if !self.collectives {
            return steps;
        }
        let (ar_max, ar_iters, ar_warmup) = if self.quick {
            ("1M", "5", "2")
        } else {
            ("16M", "20", "5")
        };
        let factor = if self.quick { "8" } else { "4" };
        // The UDP floors send each message as one datagram: 32 KiB at most.
        for (name, transport, max) in [
            ("allreduce_tbrdma", "tbrdma", ar_max),
            ("allreduce_tcp_ring", "tcp", ar_max),
            ("floor_udp_one_way", "udp-floor", "32K"),
            ("floor_udp_exchange", "udp-exchange", "32K"),
        ] {
            steps.push(Step {
                name: name.into(),
                shape: Shape::Ranks,
                args: strings(&[
                    "allreduce",
                    "--transport",
                    transport,
                    "-b",
                    "8",
                    "-e",
                    max,
                    "-f",
                    factor,
                    "-n",
                    ar_iters,
                    "-w",
                    ar_warmup,
                ]),
            });
        }
        let tokens = if self.quick { "3" } else { "20" };
        for (model, hidden, layers) in MODELS {
            steps.push(Step {
                name: format!("tp_{model}"),
                shape: Shape::Ranks,
                args: strings(&[
                    "tp-bench",
                    "--hidden",
                    &hidden.to_string(),
                    "--layers",
                    &layers.to_string(),
                    "--tokens",
                    tokens,
                ]),
            });
        }
        steps
    }
}
