"""Flush-to-zero while a lot's gradients are computed, on every CPU thread that computes them.

On x86 an operation with a subnormal input (below 1.2e-38 in fp32) can take a microcode assist of
~100 cycles: `scripts/bench_subnormals.py` measured the LM head's GEMMs 2.4-2.9x slower with 1% of
the output gradients subnormal (results/bench/subnormals.json). A step's time would then depend on its examples' values, which
constant-time lots (fixed shapes) do not hide. Flush-to-zero (MXCSR's FTZ and DAZ bits, set by
`torch.set_flush_denormal`) reads and writes such values as zero at full speed.

The flag belongs to a thread, and a thread takes its creator's flag when it is created, so torch's
intra-op workers flush only if a flushing thread started them: `start_flushing_threads` does that
before the pool exists and leaves the caller as it was. The caller flushes only inside `flushing()`
(the privatizer's per-example pass): the accounting and the release's float64 grid arithmetic also
run on the calling thread, and they are analysed with IEEE gradual underflow. Both states are checked by behaviour
(a product of subnormal bit patterns, read back as integers), never assumed.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

# torch splits an elementwise op between threads in chunks of at least this many elements
# (at::internal::GRAIN_SIZE); a probe this size per thread gives every thread a share.
_PER_THREAD = 1 << 16


def _subnormals(*shape: int) -> torch.Tensor:
    """2⁻¹⁴⁹ everywhere, made by its bits (arithmetic would already flush it)."""
    return torch.ones(*shape, dtype=torch.int32).view(torch.float32)


def _product_of_subnormals(n: int) -> torch.Tensor:
    """2⁻¹⁴⁹ × 1, n times, as int32 bits: all zero where every thread that computed it flushes
    (read as integers: a comparison of floats would read a subnormal as zero too)."""
    return (_subnormals(n) * 1.0).view(torch.int32)


def _gemm_of_subnormals() -> torch.Tensor:
    """The same through the BLAS, whose threads a build may keep apart from torch's own: a
    [256 × 256] product that it splits between its threads (each row a sum of 256 subnormals)."""
    return (_subnormals(256, 256) @ torch.ones(256, 256)).view(torch.int32)


def caller_flushes() -> bool:
    """Whether the calling thread reads subnormals as zero (a product too small to be split)."""
    return not bool(_product_of_subnormals(8).any())


def workers_flush() -> bool:
    """Whether every thread of torch's intra-op pool reads subnormals as zero: the caller flushes
    for the check, and a product that every thread takes a share of must come out all zero."""
    with flushing():
        return not (bool(_product_of_subnormals(_PER_THREAD * torch.get_num_threads()).any()) or bool(_gemm_of_subnormals().any()))


def flush_supported() -> bool:
    """Whether this CPU has the flag (x86 with SSE3); elsewhere torch.set_flush_denormal is a no-op."""
    was = caller_flushes()
    supported = torch.set_flush_denormal(True)
    torch.set_flush_denormal(was)
    return supported


def start_flushing_threads(threads: int | None = None) -> bool:
    """Set torch's thread count (None: keep it) and start its intra-op threads from a flushing
    caller, so that each of them flushes; the caller is left as it was. To take effect it must run
    before any parallel torch work (the pool is started once). Returns `workers_flush()`."""
    with flushing():
        if threads:
            torch.set_num_threads(threads)
        _product_of_subnormals(_PER_THREAD * torch.get_num_threads())  # a parallel region: the pool starts here
        _gemm_of_subnormals()  # and the BLAS's, where it has its own
    return workers_flush()


@contextmanager
def flushing() -> Iterator[None]:
    """The calling thread flushes subnormals inside the block and is restored after it."""
    was = caller_flushes()
    torch.set_flush_denormal(True)
    try:
        yield
    finally:
        torch.set_flush_denormal(was)
