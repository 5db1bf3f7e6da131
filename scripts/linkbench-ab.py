#!/usr/bin/env python3
"""Alternating A/B of linkbench latency cases between two (or more) builds.

    cargo build --release -p tbrdma-benches --bin linkbench   # in each tree to compare
    sudo scripts/linkbench-ab.py ROUNDS ITERS CASE:SIZE[,CASE:SIZE...] LINKBENCH_A [LINKBENCH_B...]

With one build it simply measures the cases, alternated over the rounds.

Runs linkbench's own client and server children (`linkbench --child ...`, the processes a
`linkbench` run starts for each case) in a two-namespace lab over one veth cable, server on
CPU 1 and client on CPU 0, taken down at the end. Every round runs every case once per build,
the builds' order reversed every other round, so that the host's drift (on the 2-vCPU VMs it
moves whole runs by up to 2x) hits all of them alike. Prints, per case and build, the median of
the rounds' round-trip p50 and mean, the median of the per-round ratios to the first build, and
for an engine case the median of its paired ratios to its own floor (linkbench's PAIRED line).
The lab is made with $TBRDMA (default: this tree's target/release/tbrdma). Cases are linkbench's names: write-sockets, send-packet, udp-busy, frame-busy, ... A floor case
run under both builds is a control: its ratio shows what the host itself resolves.
"""

import os
import random
import re
import statistics
import subprocess
import sys
import time


def lab_address(netns):
    out = subprocess.run(
        ["ip", "-n", netns, "-4", "-o", "addr", "show", "scope", "global"],
        capture_output=True, text=True, check=True,
    ).stdout
    return out.split()[3].split("/")[0]


def run_case(binary, lab, case, size, iters):
    """One round trip measurement; returns (p50, mean, paired), or None: p50 and mean in
    microseconds, `paired` the engine's p50 over its floor's, block by block (a ratio, from
    linkbench's PAIRED line), or None for a floor case."""
    server_ns, client_ns = f"tbl-{lab}-r0", f"tbl-{lab}-r1"
    server_ip, client_ip = lab_address(server_ns), lab_address(client_ns)
    port = random.randint(20000, 29999)
    common = [f"case={case}", f"size={size}", f"server={server_ip}:{port}",
              "warmup=1000", f"iters={iters}", "seconds=2", "block=500"]
    server = subprocess.Popen(
        [binary, "--child", f"netns={server_ns}", "role=server", f"ip={server_ip}", "cpu=1"]
        + common,
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    time.sleep(0.3)
    client = subprocess.run(
        [binary, "--child", f"netns={client_ns}", "role=client", f"ip={client_ip}", "cpu=0"]
        + common,
        capture_output=True, text=True)
    server.wait(timeout=60)
    m = re.search(r"p50=(\d+).*mean=(\d+)", client.stdout)
    if not m:
        return None
    paired = re.search(r"ratio_p50=([0-9.]+)", client.stdout)
    return (int(m.group(1)) / 1000, int(m.group(2)) / 1000,
            float(paired.group(1)) if paired else None)


def main():
    if len(sys.argv) < 5:
        sys.exit(__doc__)
    rounds, iters = int(sys.argv[1]), sys.argv[2]
    cases = [c.split(":") for c in sys.argv[3].split(",")]
    builds = [os.path.realpath(b) for b in sys.argv[4:]]
    repo = os.path.dirname(os.path.dirname(os.path.realpath(__file__)))
    tbrdma = os.environ.get("TBRDMA") or os.path.join(repo, "target/release/tbrdma")
    lab = f"lab{os.getpid()}"
    subprocess.run([tbrdma, "lab", "up", "2", "--topology", "pair", "--name", lab],
                   check=True, stdout=subprocess.DEVNULL)
    results = {}
    try:
        for r in range(rounds):
            for case, size in cases:
                for b in builds if r % 2 == 0 else builds[::-1]:
                    got = run_case(b, lab, case, size, iters)
                    if got is None:
                        print(f"failed: {b} {case} {size}", file=sys.stderr)
                        continue
                    results.setdefault((case, size, b), {})[r] = got
    finally:
        subprocess.run([tbrdma, "lab", "down", "--name", lab], stdout=subprocess.DEVNULL)
    for case, size in cases:
        base = results.get((case, size, builds[0]), {})
        for b in builds:
            got = results.get((case, size, b), {})
            if not got:
                continue
            p50 = [v[0] for v in got.values()]
            mean = [v[1] for v in got.values()]
            ratios = [got[r][0] / base[r][0] for r in got if r in base]
            paired = [v[2] for v in got.values() if v[2] is not None]
            to_floor = (f", over its floor {statistics.median(paired):.3f}"
                        f" ({' '.join(f'{x:.2f}' for x in paired)})" if paired else "")
            print(f"{case:14} {size:>6} {b}: p50 {statistics.median(p50):6.2f} µs, "
                  f"mean {statistics.median(mean):6.2f} µs, ratio to the first "
                  f"{statistics.median(ratios):.3f} (p50s {' '.join(f'{x:.1f}' for x in p50)})"
                  f"{to_floor}")


if __name__ == "__main__":
    main()
