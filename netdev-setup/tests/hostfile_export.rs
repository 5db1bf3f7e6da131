//! The hostfile as other frameworks read it: mlx.launch's hostfile (the addresses each host's
//! ring neighbour connects to) and each host's environment file, sourced by `sh` to prove it
//! is valid and sets what NCCL/RCCL, torchrun and vLLM read. No root needed.

use std::process::Command;

use tbrdma_netdev::hostfile::Hostfile;
use tbrdma_netdev::hostfile::export::{environment, mlx_hostfile};

mod common;

/// Hosts `uuids` cabled along `edges`, `rails` cables each (as discovery would record them).
fn cluster(uuids: &[&str], edges: &[(usize, usize)], rails: u32) -> Hostfile {
    Hostfile::from_records(&common::records::records(uuids, edges, rails)).expect("a cluster")
}

fn ips(entry: &serde_json::Value) -> Vec<String> {
    entry["ips"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_str().unwrap().to_owned())
        .collect()
}

#[test]
fn mlx_hostfile_of_a_two_cable_pair_lists_each_hosts_cable_addresses() {
    let hf = cluster(&["aaaa", "bbbb"], &[(0, 1)], 2);
    let mlx = mlx_hostfile(&hf);
    let hosts = mlx.as_array().expect("the list form");
    assert_eq!(hosts.len(), 2);
    for (rank, entry) in hosts.iter().enumerate() {
        assert_eq!(entry["ssh"], hf.ranks[rank].host);
        let mut want: Vec<_> = hf.ranks[rank].links.iter().collect();
        want.sort_by_key(|l| l.rail);
        let want: Vec<String> = want.iter().map(|l| l.address.to_string()).collect();
        assert_eq!(
            ips(entry),
            want,
            "rank {rank}: one address per rail, rail order"
        );
    }
}

#[test]
fn mlx_hostfile_of_a_ring_gives_the_addresses_the_previous_rank_connects_to() {
    let hf = cluster(
        &["a1", "b2", "c3", "d4"],
        &[(0, 1), (1, 2), (2, 3), (3, 0)],
        1,
    );
    let mlx = mlx_hostfile(&hf);
    let hosts = mlx.as_array().unwrap();
    assert_eq!(hosts.len(), 4);
    for (rank, entry) in hosts.iter().enumerate() {
        let previous = (rank + 3) % 4;
        // Rank `previous` reaches these addresses over its cable to `rank`.
        let seen_from_previous: Vec<String> = hf.ranks[previous]
            .links
            .iter()
            .filter(|l| l.peer == rank)
            .map(|l| l.peer_address.to_string())
            .collect();
        assert_eq!(ips(entry), seen_from_previous, "rank {rank}");
    }
}

/// Sources `env` in sh and prints the named variables, one per line.
fn source(env: &str, vars: &[&str]) -> Vec<String> {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("env.sh");
    std::fs::write(&file, env).unwrap();
    let echo: Vec<String> = vars
        .iter()
        .map(|v| format!("printf '%s\\n' \"${v}\""))
        .collect();
    let out = Command::new("sh")
        .arg("-c")
        .arg(format!(". '{}' && {}", file.display(), echo.join(" && ")))
        .env_clear()
        .output()
        .expect("sh");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(String::from)
        .collect()
}

#[test]
fn each_hosts_environment_points_nccl_torchrun_and_vllm_at_its_cables() {
    let hf = cluster(&["aaaa", "bbbb"], &[(0, 1)], 2);
    let vars = [
        "NCCL_NET_PLUGIN",
        "NCCL_NET",
        "TBRDMA_IFACES",
        "NCCL_SOCKET_IFNAME",
        "GLOO_SOCKET_IFNAME",
        "MASTER_ADDR",
        "MASTER_PORT",
        "WORLD_SIZE",
        "NODE_RANK",
        "VLLM_HOST_IP",
    ];
    for rank in 0..2 {
        let got = source(&environment(&hf, rank).unwrap(), &vars);
        let me = &hf.ranks[rank];
        let rail0 = me.links.iter().find(|l| l.rail == 0).unwrap();
        let addresses: Vec<String> = me.links.iter().map(|l| l.address.to_string()).collect();
        let master = if rank == 0 {
            rail0.address
        } else {
            rail0.peer_address
        };
        assert_eq!(
            got,
            [
                "tbrdma".to_string(),
                "tbrdma".into(),
                addresses.join(","),
                format!("={}", rail0.interface),
                rail0.interface.clone(),
                master.to_string(),
                "29500".into(),
                "2".into(),
                rank.to_string(),
                rail0.address.to_string(),
            ],
            "rank {rank}"
        );
    }
}

#[test]
fn a_host_not_cabled_to_rank_zero_is_told_so_and_a_bad_rank_is_an_error() {
    // A chain 0 - 1 - 2: rank 2 has no cable to rank 0.
    let hf = cluster(&["a", "b", "c"], &[(0, 1), (1, 2)], 1);
    let rank = hf
        .ranks
        .iter()
        .position(|r| r.links.iter().all(|l| l.peer != 0) && r.rank != 0)
        .unwrap();
    let env = environment(&hf, rank).unwrap();
    assert!(env.contains("No cable to rank 0"), "{env}");
    assert!(!env.contains("MASTER_ADDR="), "{env}");
    let got = source(&env, &["NODE_RANK", "WORLD_SIZE"]);
    assert_eq!(got, [rank.to_string(), "3".into()]);
    let err = environment(&hf, 7).unwrap_err().to_string();
    assert!(err.contains("rank 7"), "{err}");
}
