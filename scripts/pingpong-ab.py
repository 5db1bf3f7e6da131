#!/usr/bin/env python3
"""Alternating A/B of `tbrdma pingpong` (the tool users run) between two builds.

    sudo [ENGINE=packet] scripts/pingpong-ab.py ROUNDS OP SIZE ITERS TBRDMA_A TBRDMA_B

Makes a two-namespace lab over one veth cable (with TBRDMA_A), and in every round runs
`pingpong --op OP -s SIZE -n ITERS --warmup 1000` once per build, server pinned to CPU 1 and
client to CPU 0, the builds' order reversed every other round (the host's drift then hits both
alike); takes the lab down at the end. ENGINE picks `--engine` (default: pingpong's own,
sockets): an A/B of a change to the packet engine needs ENGINE=packet. Prints, per build, the
median of the rounds' one-way `t_typical` (median) and `t_avg`, and the median of the
per-round ratios B/A.
"""

import statistics
import subprocess
import sys
import time

ENGINE = subprocess.os.environ.get("ENGINE")  # --engine, when set


def run(binary, lab, server_ip, op, size, iters):
    """One pingpong run; returns (t_typical, t_avg) in microseconds, or None."""
    args = ["pingpong", "--op", op, "-s", size, "-n", iters, "--warmup", "1000"]
    if ENGINE:
        args += ["--engine", ENGINE]
    server = subprocess.Popen(
        ["ip", "netns", "exec", f"tbl-{lab}-r0", "taskset", "-c", "1", binary] + args,
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    time.sleep(0.4)
    client = subprocess.run(
        ["ip", "netns", "exec", f"tbl-{lab}-r1", "taskset", "-c", "0", binary] + args
        + [server_ip], capture_output=True, text=True)
    server.wait(timeout=60)
    rows = [l.split() for l in client.stdout.splitlines() if l.split()[:1] == [size]]
    return (float(rows[-1][4]), float(rows[-1][5])) if rows else None


def main():
    if len(sys.argv) != 7:
        sys.exit(__doc__)
    rounds, op, size, iters = int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4]
    builds = sys.argv[5:7]
    lab = f"ppab{subprocess.os.getpid()}"
    subprocess.run([builds[0], "lab", "up", "2", "--topology", "pair", "--name", lab],
                   check=True, stdout=subprocess.DEVNULL)
    results = {b: {} for b in builds}
    try:
        out = subprocess.run(["ip", "-n", f"tbl-{lab}-r0", "-4", "-o", "addr", "show",
                              "scope", "global"], capture_output=True, text=True,
                             check=True).stdout
        server_ip = out.split()[3].split("/")[0]
        for r in range(rounds):
            for b in builds if r % 2 == 0 else builds[::-1]:
                got = run(b, lab, server_ip, op, size, iters)
                if got is None:
                    print(f"failed: {b} round {r}", file=sys.stderr)
                else:
                    results[b][r] = got
    finally:
        subprocess.run([builds[0], "lab", "down", "--name", lab], stdout=subprocess.DEVNULL)
    a, b = (results[x] for x in builds)
    both = [r for r in a if r in b]
    for name, got in zip(builds, (a, b)):
        print(f"{op} {size} {name}: t_typical {statistics.median(v[0] for v in got.values()):.2f}"
              f" µs, t_avg {statistics.median(v[1] for v in got.values()):.2f} µs")
    if both:
        print(f"ratio B/A over {len(both)} rounds: t_typical "
              f"{statistics.median(b[r][0] / a[r][0] for r in both):.3f}, t_avg "
              f"{statistics.median(b[r][1] / a[r][1] for r in both):.3f}; per round "
              + " ".join(f"{b[r][0] / a[r][0]:.2f}" for r in both))


if __name__ == "__main__":
    main()
