#!/usr/bin/env python3
"""`tbrdma bw` over lab cables slower than the host: one cable, `--rails` (two) and `--bidir`,
per engine and build, with the ratios the issue's targets name.

    cargo build --release -p tbrdma-cli                    # in each tree to compare
    sudo scripts/slow-cable-bw.py [--rates 4gbit,8gbit] [--rounds 3] [--engines sockets,packet]
                                  [--seconds 2] [--size 1048576] TBRDMA [TBRDMA...]

veth is bound by the CPUs that copy, never by a wire, and on a 2-vCPU host one cable already
keeps both CPUs busy, so `--rails` and `--bidir` cannot show anything there. A Thunderbolt
cable is slower than the host that feeds it. This script holds every cable of a two-rail lab
pair to RATE in each direction with a token bucket (`tc qdisc ... tbf rate RATE burst 1mb
latency 2ms`: about 2-3 MB of queue in front of the cable), or leaves it alone with
`--rates none`. The server runs on CPU 1 and the client on CPU 0; builds alternate within each
round, in reversed order every other round. It prints each run (MiB/s, what the client resent,
the queues' drops), then per rate, engine and build the median over rounds of one cable,
`--rails` and `--bidir`, and their ratios to one cable (issue 16's targets: `--rails` at least
1.8x, `--bidir` at least 1.6x). WRITEs of `--size` bytes (1 MiB, as the targets are stated).
The lab is taken down at the end.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

LAB = f"scb{os.getpid() % 100000}"


def sh(*args, check=True):
    return subprocess.run(args, check=check, capture_output=True, text=True)


def namespaces():
    return [f"tbl-{LAB}-r0", f"tbl-{LAB}-r1"]


def interfaces(ns):
    out = sh("ip", "-n", ns, "-o", "link").stdout
    return [
        line.split(": ")[1].split("@")[0]
        for line in out.splitlines()
        if ": tbl-" in line
    ]


def shape(rate):
    """Replaces every cable's root queue: a fresh token bucket (counters at zero), or none."""
    for ns in namespaces():
        for dev in interfaces(ns):
            sh("tc", "-n", ns, "qdisc", "del", "dev", dev, "root", check=False)
            if rate != "none":
                sh("tc", "-n", ns, "qdisc", "add", "dev", dev, "root", "tbf", "rate", rate,
                   "burst", "1mb", "latency", "2ms")


def drops():
    total = 0
    for ns in namespaces():
        out = sh("tc", "-n", ns, "-s", "qdisc", "show").stdout
        for part in out.split("(dropped ")[1:]:
            total += int(part.split(",")[0])
    return total


def address(ns):
    out = sh("ip", "-n", ns, "-4", "-o", "addr", "show", "scope", "global").stdout
    return sorted(line.split()[3].split("/")[0] for line in out.splitlines())[0]


def run(tbrdma, engine, mode, seconds, size, server_ip):
    common = ["bw", "--op", "write", "--size", str(size), "--duration", str(seconds),
              "--engine", engine, "--json"]
    if mode:
        common.append(mode)
    lab = [tbrdma, "lab", "exec", "--name", LAB]
    server = subprocess.Popen(
        lab + ["0", "--", "taskset", "-c", "1", tbrdma] + common + ["--bind", server_ip],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    time.sleep(0.5)
    client = subprocess.run(
        lab + ["1", "--", "taskset", "-c", "0", tbrdma] + common + [server_ip],
        capture_output=True, text=True)
    server.wait()
    lines = [line for line in client.stdout.splitlines() if line.startswith("{")]
    if client.returncode != 0 or not lines:
        sys.exit(f"{tbrdma} bw {common} failed: {client.stderr}")
    return json.loads(lines[-1])


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rates", default="4gbit,8gbit")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--engines", default="sockets,packet")
    parser.add_argument("--seconds", type=float, default=2)
    parser.add_argument("--size", type=int, default=1 << 20)
    parser.add_argument("builds", nargs="+")
    args = parser.parse_args()
    builds = [os.path.realpath(b) for b in args.builds]
    sh(builds[-1], "lab", "up", "2", "--topology", "pair", "--rails", "2", "--name", LAB)
    try:
        server_ip = address(namespaces()[0])
        results = {}
        for rate in args.rates.split(","):
            for engine in args.engines.split(","):
                for r in range(args.rounds):
                    order = builds if r % 2 == 0 else builds[::-1]
                    for mode in ["", "--rails", "--bidir"]:
                        for build in order:
                            shape(rate)
                            line = run(build, engine, mode, args.seconds, args.size, server_ip)
                            lost = drops()
                            rec = line.get("recovery", {})
                            mib = line["bw_avg_mib_s"]
                            results.setdefault((rate, engine, build, mode), []).append(mib)
                            print(f"{rate:6} {engine:8} {mode or 'one':8} {build}: {mib:8.1f} MiB/s,"
                                  f" resent {rec.get('retransmits', '?')}, timeouts"
                                  f" {rec.get('timeouts', '?')}, queue drops {lost}", flush=True)
        shape("none")
        print("\nmedians over rounds (MiB/s) and ratios to one cable:")
        for rate in args.rates.split(","):
            for engine in args.engines.split(","):
                for build in builds:
                    med = {m: statistics.median(results[(rate, engine, build, m)])
                           for m in ["", "--rails", "--bidir"]}
                    print(f"{rate:6} {engine:8} {build}: one {med['']:.0f}, rails"
                          f" {med['--rails']:.0f} ({med['--rails'] / med['']:.2f}x, target 1.8),"
                          f" bidir {med['--bidir']:.0f} ({med['--bidir'] / med['']:.2f}x, target"
                          f" 1.6)")
    finally:
        sh(builds[-1], "lab", "down", "--name", LAB, check=False)


if __name__ == "__main__":
    main()
