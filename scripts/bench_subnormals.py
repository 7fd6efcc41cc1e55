"""What subnormal floats cost a CPU step: the LM head's two GEMMs on fp32 output gradients whose
entries are normal, 1% subnormal or all subnormal, with flush-to-zero (torch.set_flush_denormal)
off, set after torch's thread pool exists, set before it, or as a constant-time release sets it
(dpmuon.privacy.subnormals: the pool started flushing, the calling thread flushing inside the lot).

Constant-time lots fix a step's shapes, not its values. On x86 an arithmetic instruction whose
input is subnormal (below 1.2e-38 in fp32) can take a microcode assist of ~100 cycles, so a step
whose gradients hold many subnormals runs slower than one whose gradients do not — a timing
channel on the lot's content that the padding does not close. Each mode runs in its own process:
the flag is per thread, and torch's worker threads inherit it only when they are created.

    python scripts/bench_subnormals.py --threads 2 --json results/bench/subnormals.json
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

from dpmuon.jsontext import to_json
from dpmuon.training.run_files import code_version

MODES = ("off", "set-late", "set-first", "dpmuon")
VALUES = ("normal", "1% subnormal", "all subnormal")

# One process per mode: prints {values: {"book-keeping": s, "input gradient": s}} as JSON.
CHILD = """
import contextlib, statistics, sys, time, torch
mode, threads, repeats = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
if mode == "set-first":
    torch.set_flush_denormal(True)  # before the pool exists: every worker thread inherits it
if mode == "dpmuon":
    from dpmuon.privacy.subnormals import flushing, start_flushing_threads
    start_flushing_threads(threads)  # what the driver does first (the caller is left not flushing)
else:
    torch.set_num_threads(threads)
rows, vocab, width = 32 * 26, 50257, 128  # a micro-batch's labelled positions at the tiny model's head
gen = torch.Generator().manual_seed(0)
normal = torch.rand(rows, vocab, generator=gen) * 1e-3
# Subnormal fp32 values by their bits (arithmetic would flush them under set-first).
subnormal = torch.randint(1, 2**23, (rows, vocab), dtype=torch.int32, generator=gen).view(torch.float32)
mixed = torch.where(torch.rand(rows, vocab, generator=gen) < 0.01, subnormal, normal)
x, weight = torch.randn(rows, width, generator=gen), torch.randn(vocab, width, generator=gen)
(normal @ weight).sum()  # the pool now exists
if mode == "set-late":
    torch.set_flush_denormal(True)  # the calling thread only
def seconds(f):
    f()
    times = []
    for _ in range(repeats):
        start = time.perf_counter(); f(); times.append(time.perf_counter() - start)
    return statistics.median(times)
out = {}
with flushing() if mode == "dpmuon" else contextlib.nullcontext():  # the privatizer's per-example pass
    for name, g in (("normal", normal), ("1% subnormal", mixed), ("all subnormal", subnormal)):
        out[name] = {"book-keeping": seconds(lambda: g.T @ x), "input gradient": seconds(lambda: g @ weight)}
from dpmuon.jsontext import to_json  # imported last: nothing before the flag may start torch's pool
print(to_json(out))
"""


def measure(mode: str, threads: int, repeats: int) -> dict:
    done = subprocess.run([sys.executable, "-c", CHILD, mode, str(threads), str(repeats)], capture_output=True, text=True, check=True)
    return json.loads(done.stdout)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=2, help="timed calls per GEMM (median); an all-subnormal call takes seconds")
    parser.add_argument("--json", type=Path, help="write the results here")
    args = parser.parse_args(argv)
    found = {mode: measure(mode, args.threads, args.repeats) for mode in MODES}
    print(f"seconds per GEMM (median of {args.repeats}), {args.threads} threads; × the normal values' time")
    for mode, by_values in found.items():
        for values, by_gemm in by_values.items():
            cells = "  ".join(f"{gemm} {s:7.3f} s ({s / found[mode]['normal'][gemm]:6.1f}×)" for gemm, s in by_gemm.items())
            print(f"  flush-to-zero {mode:9}  {values:13}  {cells}")
    if args.json:
        meta = {"command": "python scripts/bench_subnormals.py " + " ".join(argv if argv is not None else sys.argv[1:]), "git_commit": code_version()}
        args.json.write_text(to_json({**meta, "threads": args.threads, "repeats": args.repeats, "seconds": found}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
