#!/usr/bin/env python3
"""How much machine code one side of a ping-pong touches per round trip, per build.

    cargo build --release -p tbrdma-cli        # in each tree to compare
    sudo scripts/hot-code-footprint.py [--engine E] [--size N] [--op write|send]
                                       [--functions K] TBRDMA [TBRDMA...]

For each `tbrdma` binary: the client of `tbrdma pingpong` runs under callgrind
(`--dump-instr=yes`), its server natively, in a two-namespace lab over one veth cable (server
on CPU 1, client on CPU 0), taken down at the end; once for 5 000 round trips and once for
25 000. An instruction is on the per-message path when, in the difference of the two runs
(start-up, warm-up and the end cancel out), it ran at least once every two round trips. Prints, per
binary: those instructions, the distinct 64-byte cache lines and 4 KiB pages of code they lie
in, and with --functions K the K functions with the most such lines.

Why: between two messages the kernel's network path runs on the same CPU and evicts the
engine's code from the first-level caches, so every message fetches its path's code again
(docs/performance.md, issue 16, "Where one side's time goes now"). Builds that touch fewer
lines were faster where instruction counts said nothing (fat LTO, PGO). Exact and repeatable,
where wall-clock A/Bs on this project's 2-vCPU hosts resolve a few percent at best; judge a
change by both. Needs valgrind.
"""

import argparse
import collections
import os
import re
import subprocess
import sys
import tempfile
import time

POSITION = re.compile(r"^(0x[0-9a-fA-F]+|[+-]\d+|\*)(?:\s+(\d+))?")
NAMED = re.compile(r"c?fn=\((\d+)\)(?: (.*))?")


def instruction_costs(path):
    """Instructions executed per instruction address, and the function of each address, from a
    callgrind output written with `--dump-instr=yes --dump-line=no`."""
    costs = collections.Counter()
    function_of = {}
    names = {}
    current = None
    last = 0
    call_cost_next = False
    with open(path) as f:
        for line in f:
            named = NAMED.match(line)
            if named:
                if named.group(2):
                    names[named.group(1)] = named.group(2).strip()
                if line.startswith("fn="):
                    current = names.get(named.group(1))
                continue
            if line.startswith("calls="):
                # The next cost line is the call's inclusive cost, not this address's own.
                call_cost_next = True
                continue
            pos = POSITION.match(line)
            if not pos:
                continue
            a = pos.group(1)
            addr = int(a, 16) if a.startswith("0x") else last if a == "*" else last + int(a)
            last = addr
            if call_cost_next:
                call_cost_next = False
                continue
            if pos.group(2):
                costs[addr] += int(pos.group(2))
                function_of[addr] = current
    return costs, function_of


def lab_address(netns):
    out = subprocess.run(["ip", "-n", netns, "-4", "-o", "addr", "show", "scope", "global"],
                         capture_output=True, text=True, check=True).stdout
    return out.split()[3].split("/")[0]


def client_under_callgrind(binary, lab, args, round_trips, out):
    server_ns, client_ns = f"tbl-{lab}-r0", f"tbl-{lab}-r1"
    ip = lab_address(server_ns)
    common = ["pingpong", "--engine", args.engine, "-s", str(args.size), "-n",
              str(round_trips), "--warmup", "100", "--op", args.op]
    server = subprocess.Popen(
        ["ip", "netns", "exec", server_ns, "taskset", "-c", "1", binary] + common
        + ["--bind", ip], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    time.sleep(0.3)
    subprocess.run(
        ["ip", "netns", "exec", client_ns, "taskset", "-c", "0", "valgrind",
         "--tool=callgrind", "--dump-instr=yes", "--dump-line=no",
         f"--callgrind-out-file={out}", binary] + common + [ip],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=True)
    server.wait(timeout=120)


def main():
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--engine", default="packet")
    parser.add_argument("--size", type=int, default=8)
    parser.add_argument("--op", default="write", choices=["write", "send"])
    parser.add_argument("--functions", type=int, default=0)
    parser.add_argument("binaries", nargs="+")
    args = parser.parse_args()
    binaries = [os.path.realpath(b) for b in args.binaries]
    lab = f"fp{os.getpid()}"
    subprocess.run([binaries[0], "lab", "up", "2", "--topology", "pair", "--name", lab],
                   check=True, stdout=subprocess.DEVNULL)
    try:
        with tempfile.TemporaryDirectory() as work:
            for binary in binaries:
                short, long_ = (os.path.join(work, f"{n}.out") for n in ("short", "long"))
                client_under_callgrind(binary, lab, args, 5000, short)
                client_under_callgrind(binary, lab, args, 25000, long_)
                before, _ = instruction_costs(short)
                after, function_of = instruction_costs(long_)
                hot = [a for a, n in after.items() if (n - before.get(a, 0)) / 20000 >= 0.5]
                lines = {a >> 6 for a in hot}
                pages = {a >> 12 for a in hot}
                print(f"{binary}: {len(hot)} instructions in {len(lines)} lines "
                      f"({len(lines) * 64} bytes) and {len(pages)} pages of code per round trip")
                if args.functions:
                    per = collections.defaultdict(set)
                    for a in hot:
                        per[function_of.get(a) or "?"].add(a >> 6)
                    for name, ls in sorted(per.items(), key=lambda kv: -len(kv[1]))[
                            :args.functions]:
                        print(f"  {len(ls):4d} lines  {name[:110]}")
    finally:
        subprocess.run([binaries[0], "lab", "down", "--name", lab], stdout=subprocess.DEVNULL)


if __name__ == "__main__":
    sys.exit(main())
