"""What a run needs from its process: one log voice, the device, the autocast precision, memory
that is reused rather than faulted in again each step, and signals that stop it cleanly at a step
boundary."""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import os
import signal
import sys

import torch
from tqdm.auto import tqdm

from ..errors import UserError
from ..outcomes import RUN_LOG, Interrupted
from ..privacy.distributed import DataParallel


def ranks_from_slurm_tasks() -> None:
    """Under hydra/launcher=slurm with tasks_per_node=N (one node), each of a job's N tasks is one
    rank, as torchrun's processes are: submitit exports torch's variables (RANK, WORLD_SIZE,
    LOCAL_RANK, MASTER_ADDR, MASTER_PORT) from SLURM's. Called before anything reads RANK; nothing
    changes where torchrun set them already, or the job has one task."""
    if "WORLD_SIZE" in os.environ or os.environ.get("SUBMITIT_EXECUTOR") != "slurm" or int(os.environ.get("SLURM_NTASKS", "1")) < 2:
        return
    from submitit.helpers import TorchDistributedEnvironment

    # Each rank takes GPU LOCAL_RANK (resolve_device); a MASTER_PORT the job set is the one it reads, and written back.
    TorchDistributedEnvironment().export(set_cuda_visible_devices=False, overwrite=True)


def log(message: str) -> None:
    """A [dpmuon] line on stderr (around any progress bar) and in the run's train.log."""
    if int(os.environ.get("RANK", "0")) == 0:  # one voice under torchrun
        tqdm.write(f"[dpmuon] {message}", file=sys.stderr)
        RUN_LOG.info(message)


def resolve_device(name: str) -> torch.device:
    if name not in ("auto", "cpu", "cuda"):
        raise UserError(f"unknown trainer.device {name!r}; valid: auto, cpu, cuda")
    if name == "cuda" and not torch.cuda.is_available():
        raise UserError("trainer.device=cuda but no CUDA device is available")
    if name == "cpu" or not torch.cuda.is_available():
        return torch.device("cpu")
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))  # torchrun: one GPU per process
    torch.cuda.set_device(local_rank)
    return torch.device("cuda", local_rank)


# glibc's mallopt parameters: blocks above M_MMAP_THRESHOLD are mmapped and unmapped on free;
# free heap above M_TRIM_THRESHOLD at the top is given back to the OS.
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3


def keep_freed_memory() -> bool:
    """Have glibc keep freed memory for reuse instead of giving large blocks back to the OS.

    On the CPU, torch allocates each large tensor of a step afresh (a micro-batch's logits, its
    activations, the float64 sums), and glibc unmaps a freed block above its mmap threshold, so
    every step faults all of that memory in again, page by page and zeroed by the kernel. With both
    thresholds at their largest, freed blocks are reused (docs/performance.md: 1.4-1.5x the
    examples per second for 1.4-1.8x the peak RSS). Process-wide and for good; False where the C
    library has no mallopt (not glibc)."""
    try:
        mallopt = ctypes.CDLL(ctypes.util.find_library("c")).mallopt
    except (OSError, AttributeError, TypeError):
        return False
    largest = ctypes.c_int(2**31 - 1)
    return bool(mallopt(M_MMAP_THRESHOLD, largest)) and bool(mallopt(M_TRIM_THRESHOLD, largest))


def resolve_precision(precision: str, device: torch.device) -> str:
    """`auto` is bf16 autocast on GPU and fp32 on CPU."""
    if precision == "auto":
        return "bf16" if device.type == "cuda" else "fp32"
    return precision


def autocast_factory(precision: str, device: torch.device):
    """bf16 autocast for the model's forward; clipping, noise and optimizer stay fp32."""
    precision = resolve_precision(precision, device)
    if precision == "fp32":
        return contextlib.nullcontext
    if precision == "bf16":
        return lambda: torch.autocast(device_type=device.type, dtype=torch.bfloat16)
    raise UserError(f"unknown trainer.precision {precision!r}; valid: auto, fp32, bf16")


class StopRequest:
    """SIGINT/SIGTERM finish the current step, checkpoint and exit; a second signal aborts the
    step (raises `Interrupted`: the driver says so and how to resume from the last checkpoint)."""

    def __init__(self):
        self.signum: int | None = None
        self._previous = {}

    def __enter__(self):
        for sig in (signal.SIGINT, signal.SIGTERM):
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum, frame):
        if self.signum is not None:
            raise Interrupted(signum)
        self.signum = signum
        log(f"received {signal.Signals(signum).name}: finishing this step, then checkpointing")

    def requested(self, parallel: DataParallel) -> bool:
        """Stop if any rank was signalled, so that all ranks stop at the same step."""
        if parallel.world_size == 1:
            return self.signum is not None
        flag = torch.tensor([1.0 if self.signum is not None else 0.0])
        parallel.all_reduce_sum([flag])
        return bool(flag.item() > 0)

    def __exit__(self, *exc):
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
