#!/usr/bin/env python3
"""How much machine code one side of a ping-pong touches per round trip, per build.

    cargo build --release -p tbrdma-cli        # in each tree to compare
    sudo scripts/hot-code-footprint.py [--engine E] [--size N] [--op write|send]
                                       [--functions K] [--jump-sites K] [--data K]
                                       [--layers] [--locked]
                                       TBRDMA [TBRDMA...]

For each `tbrdma` binary: the client of `tbrdma pingpong` runs under callgrind
(`--dump-instr=yes --collect-jumps=yes`), its server natively, in a two-namespace lab over one
veth cable (server on CPU 1, client on CPU 0), taken down at the end; once for 5 000 round
trips and once for 25 000. Counts per round trip are the difference of the two runs over
20 000 (start-up, warm-up and the end cancel out). An instruction is on the per-message path
when it ran at least once every two round trips. Prints, per binary: those instructions, the
distinct 64-byte cache lines and 4 KiB pages of code they lie in, the jumps taken and the
calls made per round trip, and with --functions K the K functions with the most such lines;
with --jump-sites K the K jump instructions taken most per round trip, each with the source
lines it was inlined from (the places where a rare branch laid in line makes the common path
jump: `tbrdma_proto::hint::cold_path` moves it out); with --data K the data side too (a lackey
trace of 1 200 round trips: distinct data lines and loads and stores per round trip, and the K
functions that touch the most lines first in a round trip; about a minute and 300 MB of
temporary file); with --layers the instructions, jumps and calls summed by layer (tool,
verbs, the engine's backends, the rest of the engine, the protocol, std and libc), each
function counted in the layer of its own path, with whatever was inlined into it; with
--locked the locked instructions (lock-prefixed, xchg with memory) and fences run per round
trip, by function: each drains the store buffer, a cost the instruction counts do not show.

Why: between two messages the kernel's network path runs on the same CPU and evicts the
engine's code and branch history, so every message fetches its path again, and each jump
taken or call made is a break in that fetch. The one build that was much faster, PGO, takes
60 % fewer jumps and makes 60 % fewer calls per round trip; builds that only touched fewer
lines were not faster (docs/performance.md, issue 16, "Code layout without a profile"). The
counts include the waits' idle polls, which a faster path makes more of. Exact and
repeatable, where wall-clock A/Bs on this project's 2-vCPU hosts resolve a few percent at
best; judge a change by both. Needs valgrind.
"""

import argparse
import bisect
import collections
import os
import re
import subprocess
import sys
import tempfile
import time

POSITION = re.compile(r"^(0x[0-9a-fA-F]+|[+-]\d+|\*)(?:\s+(\d+))?")
NAMED = re.compile(r"c?fn=\((\d+)\)(?: (.*))?")
# Round trips of the short run, and how many more the long one makes.
SHORT_RUN = 5000
ROUND_TRIPS_APART = 20000


class Profile:
    """What one callgrind run (`--dump-instr=yes --dump-line=no --collect-jumps=yes`) counted:
    instructions per address, the function of each address, and per function the jumps
    taken (unconditional ones and conditional ones followed) and the calls made."""

    def __init__(self, path):
        self.costs = collections.Counter()
        self.function_of = {}
        self.taken = collections.Counter()
        self.calls = collections.Counter()
        # Jumps taken per address of the jump instruction.
        self.jump_sites = collections.Counter()
        names = {}
        current = None
        last = 0
        call_cost_next = False
        jump_taken = None
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
                    self.calls[current] += int(line[6:].split()[0])
                    call_cost_next = True
                    continue
                if line.startswith(("jump=", "jcnd=")):
                    # "jcnd=FOLLOWED/EXECUTED TARGET": the target does not move `last`.
                    jump_taken = int(line[5:].split("/")[0].split()[0])
                    self.taken[current] += jump_taken
                    continue
                pos = POSITION.match(line)
                if not pos:
                    continue
                a = pos.group(1)
                addr = int(a, 16) if a.startswith("0x") else last if a == "*" else last + int(a)
                last = addr
                if jump_taken is not None:
                    # The position after a jump line is the jump instruction's own.
                    self.jump_sites[addr] += jump_taken
                    jump_taken = None
                if call_cost_next:
                    call_cost_next = False
                    continue
                if pos.group(2):
                    self.costs[addr] += int(pos.group(2))
                    self.function_of[addr] = current


def per_round_trip(short, long_):
    """A count of a Profile per round trip: the difference of the short and the long run."""
    return {k: (n - short.get(k, 0)) / ROUND_TRIPS_APART for k, n in long_.items()}


def symbols_of(binary):
    """The binary's defined symbols as (address in the file, nm's type letter, demangled
    name)."""
    out = subprocess.run(["nm", "-C", "--defined-only", binary], capture_output=True,
                         text=True, check=True).stdout
    for line in out.splitlines():
        parts = line.split(" ", 2)
        if len(parts) == 3:
            yield int(parts[0], 16), parts[1], parts[2]


def load_base(binary, profile):
    """Where valgrind loaded the (position-independent) binary: the offset that most of its
    functions' lowest executed address has from the function's symbol."""
    symbols = {}
    for addr, _, name in symbols_of(binary):
        symbols.setdefault(name, addr)
    lowest = {}
    for addr, name in profile.function_of.items():
        if name in symbols and addr < lowest.get(name, 1 << 64):
            lowest[name] = addr
    offsets = collections.Counter(a - symbols[n] for n, a in lowest.items())
    return offsets.most_common(1)[0][0] if offsets else 0


LOCKED = re.compile(r"^\s*([0-9a-f]+):\s+(lock |xchg\s.*\(|[lms]fence)")


def print_locked(binary, profile, runs):
    """The instructions that order memory across cores, run per round trip, by function:
    lock-prefixed ones (a mutex's compare-and-swap, an `Arc`'s count), `xchg` with memory
    (a mutex's unlock) and fences. Each waits for the core's store buffer to drain: some 5-10 ns
    on this project's VMs, a cost no instruction count shows (docs/performance.md, stop 48)."""
    base = load_base(binary, profile)
    out = subprocess.run(["objdump", "-d", "--no-show-raw-insn", binary], capture_output=True,
                         text=True, check=True).stdout
    per = collections.Counter()
    for line in out.splitlines():
        m = LOCKED.match(line)
        if m:
            a = int(m.group(1), 16) + base
            if runs.get(a, 0) > 0:
                per[profile.function_of.get(a) or "?"] += runs[a]
    print(f"  locked instructions and fences per round trip: {sum(per.values()):.1f}")
    for name, n in per.most_common():
        if n >= 0.05:
            print(f"    {n:5.1f}  {name[:100]}")


def print_jump_sites(binary, profile, sites, count):
    """The `count` jump instructions taken most per round trip, each with the chain of source
    lines it was inlined from (`addr2line -i`)."""
    base = load_base(binary, profile)
    top = sorted(((n, a) for a, n in sites.items() if n >= 0.5), reverse=True)[:count]
    if not top:
        return
    # One addr2line per address: `-i` prints a chain of variable length and does not mark
    # where one address's ends.
    frames = []
    for n, a in top:
        lines = subprocess.run(["addr2line", "-i", "-f", "-C", "-e", binary, hex(a - base)],
                               capture_output=True, text=True).stdout.splitlines()
        pairs = list(zip(lines[0::2], lines[1::2]))
        frames.append((n, a, pairs))
    print(f"  jumps taken per round trip, by site (of {sum(sites.values()):.0f}):")
    for n, a, pairs in frames:
        where = " <- ".join(f"{os.path.basename(w.split(' ')[0])}" for _, w in pairs[:3])
        func = pairs[-1][0][:60] if pairs else "?"
        print(f"  {n:5.1f}  {hex(a - base)}  {where}  [{func}]")


# Layers by the path of the function that holds the code (code inlined into a function of
# another layer counts there: `state::transmit` holds much of the protocol's transmit path).
LAYERS = [
    ("tool (pingpong, floors)", ("tbrdma::", "<tbrdma::", "tbrdma_floors::", "<tbrdma_floors::")),
    ("verbs", ("tbrdma_verbs::", "<tbrdma_verbs::")),
    ("engine: backends", ("tbrdma_engine::io::", "<tbrdma_engine::io::")),
    ("engine: state, progress", ("tbrdma_engine::", "<tbrdma_engine::")),
    ("protocol (and CRC)", ("tbrdma_proto::", "<tbrdma_proto::", "tbrdma_crc::")),
]


def layer_of(function):
    for name, prefixes in LAYERS:
        if function and function.startswith(prefixes):
            return name
    return "std, libc, vDSO"


def print_layers(runs, taken, calls, function_of):
    """Instructions run, jumps taken and calls made per round trip, summed by layer."""
    executed = collections.Counter()
    for a, n in runs.items():
        executed[layer_of(function_of.get(a))] += n
    jumps, made = collections.Counter(), collections.Counter()
    for f, n in taken.items():
        jumps[layer_of(f)] += n
    for f, n in calls.items():
        made[layer_of(f)] += n
    print("  by layer, per round trip:")
    for name in [n for n, _ in LAYERS] + ["std, libc, vDSO"]:
        print(f"    {executed[name]:6.0f} run {jumps[name]:6.1f} jumps {made[name]:5.1f} calls  "
              f"{name}")


# The data footprint: round trips of the lackey run, and the window of them counted.
DATA_RUN = 1200
DATA_WINDOW = range(600, 1100)
# Addresses from here up are the main thread's stack, and a position-independent executable
# is loaded at PIE_BASE (valgrind's fixed layout on amd64 Linux; lackey prints run-time
# addresses, where callgrind's are the file's).
STACK_FROM = 0x1FF0000000
PIE_BASE = 0x108000
# A round trip starts where the tool's client starts one.
ROUND_TRIP_SYMBOL = "<tbrdma::perf::pingpong::Turns as tbrdma_floors::pairing::Pinger>::round_trip"


def print_data_footprint(binary, lab, args, work, count):
    """Data side: every load and store of the client for DATA_RUN round trips
    (`valgrind --tool=lackey --trace-mem=yes`), cut into round trips where the tool's
    `round_trip` starts. Prints the distinct 64-byte lines of data (stack and the rest) and the
    memory accesses per round trip of DATA_WINDOW, and the `count` functions that touch the
    most lines first in a round trip (first touches: after the kernel's path has run, those
    are the ones that may miss)."""
    symbols = sorted((addr + PIE_BASE, name) for addr, kind, name in symbols_of(binary)
                     if kind in "tTwW")
    starts = [a for a, _ in symbols]
    marks = [a for a, name in symbols if name == ROUND_TRIP_SYMBOL]
    if not marks:
        print(f"  no {ROUND_TRIP_SYMBOL} in {binary}: no data footprint")
        return
    trace = os.path.join(work, "lackey.txt")
    client_under_valgrind(binary, lab, args, DATA_RUN,
                          ["--tool=lackey", "--trace-mem=yes", f"--log-file={trace}"])

    # The executable's code ends where its last section that holds code does.
    sections = subprocess.run(["readelf", "-SW", binary], capture_output=True, text=True,
                              check=True).stdout
    code_end = PIE_BASE + max(
        int(m.group(1), 16) + int(m.group(2), 16)
        for m in re.finditer(r"PROGBITS\s+([0-9a-f]+)\s+[0-9a-f]+\s+([0-9a-f]+)\s+\S+\s+\S*X",
                             sections))

    def function_at(addr):
        if addr >= code_end:
            return "(outside the executable: libc, the vDSO)"
        i = bisect.bisect_right(starts, addr) - 1
        return symbols[i][1] if i >= 0 else "?"

    mark = f"I  {marks[0]:08x},"
    round_trip, last_instruction = -1, 0
    seen, first_touch, accesses = set(), collections.Counter(), 0
    lines = collections.Counter()
    with open(trace) as f:
        for line in f:
            if line.startswith(mark):
                round_trip += 1
                seen = set()
                if round_trip >= DATA_WINDOW.stop:
                    break
                continue
            if round_trip < DATA_WINDOW.start:
                continue
            kind = line[:2]
            if kind == "I ":
                last_instruction = int(line[3:line.index(",")], 16)
            elif kind in (" L", " S", " M"):
                addr = int(line[3:line.index(",")], 16)
                accesses += 1
                if addr >> 6 not in seen:
                    seen.add(addr >> 6)
                    where = "stack" if addr >= STACK_FROM else "heap and static"
                    lines[where] += 1
                    first_touch[(function_at(last_instruction), where)] += 1
    os.remove(trace)
    if round_trip < DATA_WINDOW.stop:
        print(f"  the trace has {round_trip + 1} round trips, not {DATA_WINDOW.stop}: is the "
              f"binary loaded at {PIE_BASE:#x}? no data footprint")
        return
    n = len(DATA_WINDOW)
    print(f"  data per round trip: {sum(lines.values()) / n:.0f} lines "
          f"({lines['stack'] / n:.0f} of stack, {lines['heap and static'] / n:.0f} heap and "
          f"static), {accesses / n:.0f} loads and stores")
    for (name, where), k in first_touch.most_common(count):
        print(f"  {k / n:5.1f} {where:15s} {name[:100]}")


def lab_address(netns):
    out = subprocess.run(["ip", "-n", netns, "-4", "-o", "addr", "show", "scope", "global"],
                         capture_output=True, text=True, check=True).stdout
    return out.split()[3].split("/")[0]


def client_under_callgrind(binary, lab, args, round_trips, out):
    client_under_valgrind(binary, lab, args, round_trips,
                          ["--tool=callgrind", "--dump-instr=yes", "--dump-line=no",
                           "--collect-jumps=yes", f"--callgrind-out-file={out}"])


def client_under_valgrind(binary, lab, args, round_trips, tool):
    server_ns, client_ns = f"tbl-{lab}-r0", f"tbl-{lab}-r1"
    ip = lab_address(server_ns)
    common = ["pingpong", "--engine", args.engine, "-s", str(args.size), "-n",
              str(round_trips), "--warmup", "100", "--op", args.op]
    server = subprocess.Popen(
        ["ip", "netns", "exec", server_ns, "taskset", "-c", "1", binary] + common
        + ["--bind", ip], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    time.sleep(0.3)
    subprocess.run(
        ["ip", "netns", "exec", client_ns, "taskset", "-c", "0", "valgrind"] + tool
        + [binary] + common + [ip],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=True)
    server.wait(timeout=120)


def main():
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--engine", default="packet")
    parser.add_argument("--size", type=int, default=8)
    parser.add_argument("--op", default="write", choices=["write", "send"])
    parser.add_argument("--functions", type=int, default=0)
    parser.add_argument("--jump-sites", type=int, default=0,
                        help="print the K jump instructions taken most per round trip, with "
                        "their source lines (innermost inlined frame first)")
    parser.add_argument("--data", type=int, default=0,
                        help="also trace the client's loads and stores (valgrind lackey): the "
                        "data lines per round trip, and the K functions that touch most first")
    parser.add_argument("--layers", action="store_true",
                        help="also print instructions, jumps and calls per round trip by "
                        "layer (tool, verbs, engine, backends, protocol, std and libc)")
    parser.add_argument("--locked", action="store_true",
                        help="also print the locked instructions (lock-prefixed, xchg with "
                        "memory) and fences run per round trip, by function")
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
                client_under_callgrind(binary, lab, args, SHORT_RUN, short)
                client_under_callgrind(binary, lab, args, SHORT_RUN + ROUND_TRIPS_APART, long_)
                before, after = Profile(short), Profile(long_)
                runs = per_round_trip(before.costs, after.costs)
                hot = [a for a, n in runs.items() if n >= 0.5]
                lines = {a >> 6 for a in hot}
                pages = {a >> 12 for a in hot}
                taken = per_round_trip(before.taken, after.taken)
                calls = per_round_trip(before.calls, after.calls)
                print(f"{binary}: {sum(runs.values()):.0f} instructions run, {len(hot)} distinct "
                      f"in {len(lines)} lines "
                      f"({len(lines) * 64} bytes) and {len(pages)} pages of code, "
                      f"{sum(taken.values()):.0f} jumps taken and {sum(calls.values()):.0f} "
                      "calls per round trip")
                if args.functions:
                    per = collections.defaultdict(set)
                    executed = collections.Counter()
                    for a in hot:
                        per[after.function_of.get(a) or "?"].add(a >> 6)
                    for a, n in runs.items():
                        executed[after.function_of.get(a) or "?"] += n
                    for name, ls in sorted(per.items(), key=lambda kv: -len(kv[1]))[
                            :args.functions]:
                        print(f"  {len(ls):4d} lines {executed[name]:6.0f} run "
                              f"{taken.get(name, 0):5.1f} jumps "
                              f"{calls.get(name, 0):5.1f} calls  {(name or '?')[:100]}")
                if args.layers:
                    print_layers(runs, taken, calls, after.function_of)
                if args.locked:
                    print_locked(binary, after, runs)
                if args.jump_sites:
                    sites = per_round_trip(before.jump_sites, after.jump_sites)
                    print_jump_sites(binary, after, sites, args.jump_sites)
                if args.data:
                    print_data_footprint(binary, lab, args, work, args.data)
    finally:
        subprocess.run([binaries[0], "lab", "down", "--name", lab], stdout=subprocess.DEVNULL)


if __name__ == "__main__":
    sys.exit(main())
