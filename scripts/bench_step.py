"""Training-step throughput and peak memory: non-private vs the Opacus and fast engines.

Every configuration runs full steps — the privatizer's release over the lot, split into
micro-batches, then the optimizer step — for {non-private, opacus, fast} × {flat, per_matrix}
× {dp_adam, dp_muon, dp_muonbc} × VARIANTS. A private configuration is compared with its
non-private twin (DP-Adam with Adam, DP-Muon and DP-MuonBC with Muon) measured in the same run,
on the same lot. The variants say what of the guarantee a private row keeps: `default` is what
a private run of the driver does (constant-time lots: B_max rows in the width buckets chosen
from the length histogram; the exact grid release), `one-width` pads every row to max_length
instead (privacy.width_buckets=1; make_private and DPTrainer without an attention mask), `as-drawn` turns
constant-time lots off, `no-noise` also skips the noise (timing only), so the step from one
column of the last table to the next is what that part costs. B_max is the default plan's for
PLAN_STEPS steps at ε = 8; B_max/(Nq) is printed beside it. The widths come from the lengths of
the data set (E2E's whole training set, or the synthetic lot's) scaled to N = lot/q, with the
default release's noise allowed for in the bounds (no noise is drawn: timing only).

`--pipeline` times the driver's own loop instead (`python -m dpmuon.train`, training only: the
summary's train_seconds), private with constant-time lots (in width buckets, and at one width)
and without, vs the same run with the non-private optimizer, for the settings in PIPELINES.

Throughput: all configurations live in one process and take turns, one round per repeat (in a
rotated order), so a busy neighbour or thermal drift hits them alike; medians are reported
(a ratio to non-private is the median of the per-round ratios).
Peak memory: each configuration runs once more in a fresh subprocess, because a process's peak
RSS only grows and allocators keep freed memory: CUDA → torch.cuda.max_memory_allocated; CPU →
peak RSS of that process above its footprint before the model was built (labelled as RSS).

    python scripts/bench_step.py --threads 1                       # tiny model, CPU (~5 min, 2 cores)
    python scripts/bench_step.py --threads 1 --model llama-tiny    # the same size as a Llama (RMSNorm, GQA, SwiGLU)
    python scripts/bench_step.py --threads 1 --model llama-tiny --lora-r 8 --engines fast --clip-modes per_matrix  # LoRA adapters only
    python scripts/bench_step.py --threads 2 --model smollm2       # pretrained SmolLM2-135M from models/smollm2
    python scripts/bench_step.py --model gpt2-small --device cuda --lot 256 --micro-batch 32 --seq-len 128
    DPMUON_DATA_DIR=… python scripts/bench_step.py --pipeline smoke tiny-lot256 --repeats 3 --threads 2
    DPMUON_DATA_DIR=… DPMUON_TOKENIZER=… python scripts/bench_step.py --data e2e --json bench.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import torch
from hydra.utils import get_class
from omegaconf import DictConfig, OmegaConf

from dpmuon.config import compose_config
from dpmuon.config.roster import optimizer_roster
from dpmuon.data import EncodedExample, load_tokenizer
from dpmuon.jsontext import to_json
from dpmuon.models import IGNORE_INDEX, LoraOptions, Shape, add_lora, build_random_lm, hidden_matrices, load_pretrained, per_example_lm_loss
from dpmuon.optim import OptimizerInputs, build_optimizer
from dpmuon.paths import REPO_ROOT
from dpmuon.privacy.lot_bound import length_histogram
from dpmuon.privacy.mechanism import MechanismSettings, build_mechanism, lot_limit
from dpmuon.privacy.subnormals import start_flushing_threads
from dpmuon.training.batching import bucketed_micro_batches, lot_micro_batches
from dpmuon.training.data import prepare_data
from dpmuon.training.loop import privacy_settings
from dpmuon.training.run_files import code_version
from dpmuon.training.runtime import keep_freed_memory
from dpmuon.training.secret import user_mechanism_secret

VOCAB = 50258  # GPT-2's tokenizer plus the added pad token
# name → (architecture, shape) of a random-init model over GPT-2's vocabulary.
RANDOM_MODELS = {
    "tiny": ("gpt2", Shape(VOCAB, n_layer=4, n_embd=128, n_head=4, n_positions=256)),
    "gpt2-small": ("gpt2", Shape(VOCAB, n_layer=12, n_embd=768, n_head=12, n_positions=1024)),
    "llama-tiny": ("llama", Shape(VOCAB, n_layer=4, n_embd=128, n_head=4, n_positions=256, n_kv_head=2, intermediate_size=344)),
}
# name → local directory of a pretrained model (`make models/smollm2`); its vocabulary is its own.
LOCAL_MODELS = {"smollm2": REPO_ROOT / "models" / "smollm2"}
MODELS = sorted(RANDOM_MODELS) + sorted(LOCAL_MODELS)
# The roster's DP optimizers (conf/optimizer/*.yaml), each beside its non-private counterpart: the
# non-private optimizer whose settings class its own is or extends (DP-MuonBC's is Muon). DP-SGD
# has none (its optimizer step is a plain SGD update, nothing to compare). Hyperparameters and
# privacy settings come from the driver's composed config (compose_config; the dataset stays the
# default, E2E: its rates are the optimizers' rates, and synthetic lots are shaped like its
# lots), as in a training run.
CLASSES = {e.name: get_class(e.target) for e in optimizer_roster()}
NON_PRIVATE_TWIN = {
    e.name: t.name for e in optimizer_roster() if e.private for t in optimizer_roster() if not t.private and issubclass(CLASSES[e.name], CLASSES[t.name])
}
OPTIMIZERS = list(NON_PRIVATE_TWIN)
# conf/privacy calibrates σ from a target ε; here σ is fixed: noise is drawn as in a real run and
# its size does not change the cost. q only enters the plan (N = lot / q) and the accountant.
NOISE_MULTIPLIER = 1.0
SAMPLE_RATE = 0.01
PLAN_STEPS = 1000  # a plan's length sets B_max (the truncation charge grows with it): E2E's 10 epochs at lot 1024 are 410


# What a private configuration keeps of the guarantee: the default run's (constant-time lots:
# B_max rows of one fixed width; the exact grid release), and rows that switch one more part off
# each, so the cost of each is the step from one column to the next.
VARIANTS = {
    "default": "constant-time lots in width buckets, grid release (what a private driver run does)",
    "one-width": "constant-time lots, every row max_length wide (privacy.width_buckets=1), grid release",
    "as-drawn": "lots as drawn (privacy.constant_time=false), grid release",
    "no-noise": "lots as drawn, no noise drawn or added (timing only: not a release)",
}


@dataclass(frozen=True)
class Config:
    engine: str  # "non-private" | "opacus" | "fast"
    clip_mode: str  # "flat" | "per_matrix" ("-" for non-private)
    optimizer: str  # dp_adam | dp_muon | dp_muonbc, or the non-private adam | muon
    variant: str = "-"  # a key of VARIANTS ("-" for non-private)

    @property
    def label(self) -> str:
        return f"{self.engine}/{self.clip_mode}/{self.optimizer}/{self.variant}"

    @property
    def constant_time(self) -> bool:
        return self.variant in ("default", "one-width")

    @property
    def private(self) -> bool:
        return self.engine != "non-private"

    @property
    def twin(self) -> Config:
        return Config("non-private", "-", NON_PRIVATE_TWIN[self.optimizer]) if self.private else self

    @classmethod
    def parse(cls, label: str) -> Config:
        return cls(*label.split("/"))

    @property
    def overrides(self) -> list[str]:
        """The driver's Hydra overrides for this configuration: conf/optimizer/<optimizer>.yaml and,
        if private, conf/privacy/<clip_mode>.yaml with the engine and the bench's fixed σ (noise is
        drawn as in a real run; nothing here is a real release, and its values do not affect time)."""
        if not self.private:
            return [f"optimizer={self.optimizer}"]
        return [
            f"optimizer={self.optimizer}",
            f"privacy={self.clip_mode}",
            f"privacy.engine={self.engine}",
            f"privacy.noise_multiplier={NOISE_MULTIPLIER}",
        ]


def configurations(engines: list[str], clip_modes: list[str], optimizers: list[str], variants: list[str]) -> list[Config]:
    private = [Config(e, c, o, v) for e in engines for c in clip_modes for o in optimizers for v in variants]
    twins = sorted({c.twin for c in private}, key=lambda c: c.optimizer)
    return twins + private


# -- lots -------------------------------------------------------------------------------------


def synthetic_lot(size: int, seq_len: int, seed: int, vocab: int = VOCAB) -> list[EncodedExample]:
    """Random sequences shaped like table-to-text lots: lengths in [T/2, T], a prompt (about half
    of each sequence) without loss."""
    g = torch.Generator().manual_seed(seed)
    examples = []
    for _ in range(size):
        length = int(torch.randint(seq_len // 2, seq_len + 1, (1,), generator=g))
        ids = torch.randint(0, vocab - 1, (length,), generator=g)
        labels = ids.clone()
        labels[: length // 2] = IGNORE_INDEX
        examples.append(EncodedExample(input_ids=ids.tolist(), labels=labels.tolist()))
    return examples


def e2e_train(model_name: str) -> tuple[list[EncodedExample], int, int]:
    """E2E's training set, loaded and encoded as the trainer does (conf/dataset/e2e.yaml), the pad
    id and dataset.max_length."""
    # The tokenizer follows the model: a local model's own, else GPT-2's ($DPMUON_TOKENIZER).
    tokenizer = load_tokenizer(str(local_model_dir(model_name)) if model_name in LOCAL_MODELS else None)
    # prepare_data also encodes validation and test sets, which the bench does not use: one each.
    cfg = compose_config("data.max_valid_examples=1", "data.max_test_sources=1")
    width = int(cfg.dataset.max_length)
    return prepare_data(cfg.dataset, cfg.data, tokenizer, width, log=lambda message: None).train, tokenizer.pad_token_id, width


def e2e_lot(size: int, seed: int, model_name: str) -> tuple[list[EncodedExample], int, list[int]]:
    """`size` E2E training examples (`e2e_train`), the pad id and the lengths of the whole training set."""
    train, pad_id, _ = e2e_train(model_name)
    picks = torch.randperm(len(train), generator=torch.Generator().manual_seed(seed))[:size]
    return [train[i] for i in picks.tolist()], pad_id, [len(example.input_ids) for example in train]


@dataclass
class Lots:
    """One lot as each kind of run batches it: as drawn (sorted, each micro-batch padded to its
    own longest example), constant-time at one width (B_max rows of full-width micro-batches) and
    constant-time in width buckets (B_max rows in `widths`)."""

    as_drawn: list[dict[str, torch.Tensor]]
    one_width: list[dict[str, torch.Tensor]]
    bucketed: list[dict[str, torch.Tensor]]
    max_lot_size: int
    widths: tuple[tuple[int, int], ...]

    def of(self, config: Config) -> list[dict[str, torch.Tensor]]:
        return {"default": self.bucketed, "one-width": self.one_width}.get(config.variant, self.as_drawn)

    def tokens(self) -> dict[str, int]:
        """Token positions a step runs through, padding included, per way of batching: forward and
        backward cost about this, so it is the physical budget of constant-time lots in widths (the
        widths' row bounds make it larger than B_max/(Nq) alone)."""
        area = lambda batches: sum(b["input_ids"].numel() for b in batches)  # noqa: E731
        return {"as-drawn": area(self.as_drawn), "one-width": area(self.one_width), "default": area(self.bucketed)}

    def to(self, device: torch.device) -> Lots:
        move = lambda batches: [{k: v.to(device) for k, v in b.items()} for b in batches]  # noqa: E731
        return Lots(move(self.as_drawn), move(self.one_width), move(self.bucketed), self.max_lot_size, self.widths)


def batch_lot(examples: list[EncodedExample], pad_id: int, micro_batch: int, width: int, lengths: list[int]) -> Lots:
    """The lot batched each way; the buckets from the histogram of `lengths` scaled to the bench's N."""
    rows, widths = constant_time_shape(len(examples), lengths, width)
    lot = range(len(examples))
    one_width = lot_micro_batches(examples, lot, micro_batch, pad_id, fixed_width=width, fixed_rows=True, pad_to=rows)
    bucketed = bucketed_micro_batches(examples, list(lot), widths, micro_batch * width, pad_id)
    return Lots(list(lot_micro_batches(examples, lot, micro_batch, pad_id)), list(one_width), list(bucketed), rows, widths)


# -- one configuration ------------------------------------------------------------------------


def local_model_dir(name: str) -> Path:
    path = LOCAL_MODELS[name]
    if not (path / "config.json").is_file():
        raise SystemExit(f"--model {name} needs {path} (make {path.relative_to(path.parents[1])})")
    return path


def build_bench_model(name: str, lora_r: int | None = None) -> torch.nn.Module:
    """The named model; with `lora_r`, frozen under rank-r LoRA adapters on every projection."""
    if name in LOCAL_MODELS:
        model = load_pretrained(str(local_model_dir(name)), dropout=0.0)
    else:
        arch, shape = RANDOM_MODELS[name]
        model = build_random_lm(arch, shape, seed=0)
    return model if lora_r is None else add_lora(model, LoraOptions(r=lora_r, alpha=float(lora_r)))


def vocab_size(name: str) -> int:
    if name in LOCAL_MODELS:
        from transformers import AutoConfig

        return int(AutoConfig.from_pretrained(local_model_dir(name)).vocab_size)
    return RANDOM_MODELS[name][1].vocab_size


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def bench_settings(cfg: DictConfig, lot_size: int, constant_time: bool) -> MechanismSettings:
    """The run's privacy settings for timing only: σ and q fixed (not calibrated to the target ε),
    lots of `lot_size` over PLAN_STEPS steps (which set B_max; the bench gives every configuration
    the same lot)."""
    return replace(privacy_settings(cfg), expected_lot_size=lot_size, epochs=None, steps=PLAN_STEPS, constant_time=constant_time)


def constant_time_shape(lot_size: int, lengths: list[int], width: int) -> tuple[int, tuple[tuple[int, int], ...]]:
    """(B_max, the width buckets) of the default plan for lots of `lot_size` and N = lot/q examples
    of these lengths' distribution: its histogram scaled to N, the default release's σ in the bounds."""
    cfg = compose_config(*Config("fast", "per_matrix", OPTIMIZERS[0], "default").overrides)
    settings = bench_settings(cfg, lot_size, constant_time=True)
    dataset_size = round(lot_size / SAMPLE_RATE)
    counts = length_histogram(lengths, width) * (dataset_size / len(lengths))
    release = {"noise_multiplier": float(settings.length_noise_multiplier), "counts": counts.tolist()}
    widths, _, _ = lot_limit(settings, dataset_size, release)
    return lot_limit(settings, dataset_size)[1], widths


class Runner:
    """A model, its release (privatizer or non-private) and its optimizer, built as the trainer
    builds them from a composed config, ready to step."""

    def __init__(self, cfg: DictConfig, model_name: str, lot_size: int, device: torch.device, lora_r: int | None = None, variant: str = "default"):
        self.device = device
        self.model = build_bench_model(model_name, lora_r).to(device).train()
        matrices = hidden_matrices(self.model)
        named = {n: p for n, p in self.model.named_parameters() if p.requires_grad}
        # The trainer's mechanism over N = lot/q examples; no ledger: nothing here is a real release.
        mechanism = build_mechanism(
            self.model,
            round(lot_size / SAMPLE_RATE),
            bench_settings(cfg, lot_size, constant_time=variant in ("default", "one-width")),
            hidden_matrices=matrices,
            user_secret=user_mechanism_secret(cfg),
            run_dir=None,
            dataset_name="bench",
            log=lambda message: None,
        )
        self.release = mechanism.release
        if variant == "no-noise":  # std 0: the release skips the draw and the grid (timing only)
            self.release.block_stds = [0.0] * len(self.release.block_stds)
            self.release._noise_sizes = []
        self.optimizer = build_optimizer(
            OmegaConf.to_container(cfg.optimizer, resolve=True),
            OptimizerInputs(
                params=named,
                hidden_matrices=matrices,
                release_noise_std=mechanism.release_noise_std(),
                generator=torch.Generator(device=device).manual_seed(0),
            ),
        )

    def step(self, batches: list[dict[str, torch.Tensor]]) -> tuple[float, float]:
        """One training step; (release seconds, optimizer seconds)."""
        synchronize(self.device)
        start = time.perf_counter()
        self.release.release(batches, per_example_lm_loss)
        synchronize(self.device)
        released = time.perf_counter()
        self.optimizer.step()
        self.optimizer.zero_grad()
        synchronize(self.device)
        return released - start, time.perf_counter() - released


def measure_throughput(configs: list[Config], args, lots: Lots, device) -> tuple[dict[Config, dict[str, list[float]]], dict[Config, Runner]]:
    runners = {c: Runner(compose_config(*c.overrides), args.model, args.lot, device, args.lora_r, c.variant) for c in configs}
    times = {c: {"release_s": [], "optimizer_s": []} for c in configs}
    for config, runner in runners.items():
        runner.step(lots.of(config))  # warm-up: optimizer state, allocator, kernel selection
    for repeat in range(args.repeats):
        shift = repeat % len(configs)
        for config in configs[shift:] + configs[:shift]:
            release_s, optimizer_s = runners[config].step(lots.of(config))
            times[config]["release_s"].append(release_s)
            times[config]["optimizer_s"].append(optimizer_s)
        print(f"  repeat {repeat + 1}/{args.repeats} done", file=sys.stderr, flush=True)
    return times, runners


# -- peak memory (in a fresh process per configuration) -----------------------------------------


def _rss_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def _reset_peak_rss() -> None:
    """Set this process's peak RSS (VmHWM) to its current RSS. Where the kernel refuses, the peak
    keeps what came before (the imports' transient peak, or an earlier step's): an overestimate."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        pass


def peak_memory_mib(config: Config, args, lots: Lots, device) -> tuple[float, float]:
    """Peak memory of building the configuration and running two steps (the first also
    allocates the optimizer state and runs the release's one-off checks), in this process; and the
    peak of the second step alone (what every later step reaches), both above the same baseline."""
    cfg = compose_config(*config.overrides)  # before the baseline: composing is not the step's memory
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    else:
        baseline = _rss_kib("VmRSS")
        _reset_peak_rss()
    runner = Runner(cfg, args.model, args.lot, device, args.lora_r, config.variant)
    runner.step(lots.of(config))
    if cuda:
        first = torch.cuda.max_memory_allocated(device) / 2**20
        torch.cuda.reset_peak_memory_stats(device)
        runner.step(lots.of(config))
        later = torch.cuda.max_memory_allocated(device) / 2**20
    else:
        first = (_rss_kib("VmHWM") - baseline) / 1024
        _reset_peak_rss()
        runner.step(lots.of(config))
        later = (_rss_kib("VmHWM") - baseline) / 1024
    return max(first, later), later


def peak_memory_in_subprocess(config: Config, args, lot_path: Path) -> tuple[float, float]:
    command = [
        sys.executable,
        __file__,
        "--memory-probe",
        config.label,
        "--lot-file",
        str(lot_path),
        "--model",
        args.model,
        "--lot",
        str(args.lot),
        "--device",
        args.device,
        "--threads",
        str(args.threads),
        *(["--lora-r", str(args.lora_r)] if args.lora_r else []),
        *(["--keep-freed-memory"] if args.keep_freed_memory else []),
    ]
    # A fixed mmap threshold makes glibc return every freed block ≥ 1 MiB to the OS, so the
    # peak RSS tracks the peak of live tensors instead of what the allocator kept cached
    # (with --keep-freed-memory the probe raises it again: its peak is what that option costs).
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": str(1 << 20)}
    done = subprocess.run(command, capture_output=True, text=True, check=False, env=env)
    if done.returncode != 0:
        raise RuntimeError(f"memory probe of {config.label} failed:\n{done.stderr[-2000:]}")
    whole, later = done.stdout.strip().splitlines()[-1].split()
    return float(whole), float(later)


# -- report -----------------------------------------------------------------------------------


def summarize(configs, times, peaks, lot: int) -> list[dict[str, Any]]:
    rows = {}
    for config in configs:
        release_s = statistics.median(times[config]["release_s"])
        optimizer_s = statistics.median(times[config]["optimizer_s"])
        rows[config] = {
            "config": config.label,
            **asdict(config),
            "examples_per_s": lot / (release_s + optimizer_s),
            "release_s": release_s,
            "optimizer_s": optimizer_s,
            "optimizer_share": optimizer_s / (release_s + optimizer_s),
            "peak_mib": peaks[config][0] if config in peaks else None,
            # The one-off work of a first step (the release's checks on a public stand-in of the
            # first micro-batch, the optimizer state) is in peak_mib; every later step peaks here.
            "peak_mib_later_steps": peaks[config][1] if config in peaks else None,
        }
    for config, row in rows.items():
        twin = rows[config.twin]
        # Median of the per-round ratios: a configuration and its twin share each round, so a
        # neighbour's load spike shifts both sides of a ratio alike.
        per_round = [
            (t_release + t_optimizer) / (c_release + c_optimizer)
            for t_release, t_optimizer, c_release, c_optimizer in zip(
                times[config.twin]["release_s"],
                times[config.twin]["optimizer_s"],
                times[config]["release_s"],
                times[config]["optimizer_s"],
            )
        ]
        row["throughput_vs_non_private"] = statistics.median(per_round)
        # Every round's ratio, so that a reader can see whether a target sits inside the spread.
        row["throughput_vs_non_private_rounds"] = per_round
        row["memory_vs_non_private"] = None if row["peak_mib"] is None else row["peak_mib"] / twin["peak_mib"]
        row["later_steps_memory_vs_non_private"] = None if row["peak_mib"] is None else row["peak_mib_later_steps"] / twin["peak_mib_later_steps"]
    return list(rows.values())


# -- where a private step's time goes ---------------------------------------------------------

PHASES = ("forward", "backward", "norms", "bookkeeping", "lot_total", "noise", "ledger")


def phase_seconds(runner: Runner, batches) -> dict[str, float]:
    """One step under the profiler: seconds inside each `dpmuon.<phase>` region of the release
    (forward / backward / norms / bookkeeping per micro-batch, summed; lot_total, noise and the
    ledger per step), the rest of the release, and the optimizer step (Newton–Schulz for Muon).
    The profiler's own overhead inflates every phase a little."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        release_s, optimizer_s = runner.step(batches)
    inside = {e.key.removeprefix("dpmuon."): e.cpu_time_total / 1e6 for e in prof.key_averages() if e.key.startswith("dpmuon.")}
    out = {phase: inside.get(phase, 0.0) for phase in PHASES}
    out["other release"] = max(0.0, release_s - sum(out.values()))
    out["optimizer"] = optimizer_s
    # Inside `norms`: each module type's share (the engine names them dpmuon.norms/<type><weight shape>).
    out["norms by module"] = {key.removeprefix("norms/"): s for key, s in sorted(inside.items(), key=lambda kv: -kv[1]) if key.startswith("norms/")}
    return out


def print_phases(phases: dict[Config, dict[str, Any]]) -> None:
    names = [*PHASES, "other release", "optimizer"]
    print(f"{'configuration':34} " + " ".join(f"{n:>13}" for n in names))
    for config, seconds in phases.items():
        total = sum(seconds[n] for n in names)
        print(f"{config.label:34} " + " ".join(f"{seconds[n]:6.2f}s {100 * seconds[n] / total:4.0f}%" for n in names))
    print("\nper-example norms by module (share of the norms phase):")
    for config, seconds in phases.items():
        parts = seconds["norms by module"]
        shown = ", ".join(f"{name} {100 * s / max(seconds['norms'], 1e-12):.0f}%" for name, s in list(parts.items())[:4])
        print(f"  {config.label:32} {shown}")


def print_table(rows: list[dict[str, Any]], memory_label: str) -> None:
    memory = f"{memory_label:>14} {'× np':>6} {'later':>6} {'× np':>6}"  # later: every step after the first
    header = f"{'configuration':34} {'ex/s':>8} {'× np':>6} {'release s':>10} {'optim s':>8} {'optim %':>8} {memory}"
    print(header)
    print("-" * len(header))
    for row in rows:
        peak = "-" if row["peak_mib"] is None else f"{row['peak_mib']:.0f}"
        ratio = "-" if row["memory_vs_non_private"] is None else f"{row['memory_vs_non_private']:.2f}"
        later = "-" if row["peak_mib_later_steps"] is None else f"{row['peak_mib_later_steps']:.0f}"
        later_ratio = "-" if row["later_steps_memory_vs_non_private"] is None else f"{row['later_steps_memory_vs_non_private']:.2f}"
        print(
            f"{row['config']:34} {row['examples_per_s']:8.2f} {row['throughput_vs_non_private']:6.2f} "
            f"{row['release_s']:10.3f} {row['optimizer_s']:8.3f} {100 * row['optimizer_share']:7.1f}% {peak:>14} {ratio:>6} {later:>6} {later_ratio:>6}"
        )


def print_guarantee_costs(rows: list[dict[str, Any]], max_lot_size: int, lot: int, tokens: dict[str, int]) -> None:
    """× non-private of each private configuration with each part of the guarantee kept: the
    step from one column to the next is what that part costs; beside it, the tokens each way of
    batching runs through, × as drawn."""
    by_config: dict[str, dict[str, float]] = {}
    for row in rows:
        if row["variant"] in VARIANTS:
            by_config.setdefault(f"{row['engine']}/{row['clip_mode']}/{row['optimizer']}", {})[row["variant"]] = row["throughput_vs_non_private"]
    variants = [v for v in VARIANTS if any(v in r for r in by_config.values())]
    drawn = tokens["as-drawn"]
    areas = ", ".join(f"{v} {n:,} ({n / drawn:.3f}×)" for v, n in tokens.items())
    print(f"× non-private by what of the guarantee is kept (B_max/(Nq) = {max_lot_size}/{lot} = {max_lot_size / lot:.3f}; positions run through: {areas}):")
    print(f"{'configuration':28} " + " ".join(f"{v:>10}" for v in variants))
    for config, ratios in by_config.items():
        print(f"{config:28} " + " ".join(f"{ratios[v]:10.3f}" if v in ratios else f"{'-':>10}" for v in variants))


# -- the driver's own loop (--pipeline) ---------------------------------------------------------

# name → the driver's overrides of a pipeline setting: the smoke run, and the tiny model at lot 256.
PIPELINES = {
    "smoke": ("experiment=smoke",),
    "tiny-lot256": ("model=tiny", "privacy.expected_lot_size=256", "trainer.steps=3", "trainer.micro_batch_size=32", "trainer.checkpoint_every=3"),
}
# Training only: no validation, test NLL or decoding; diagnostics published so that the summary
# records train_seconds (the loop's own clock, without start-up and data loading).
TRAINING_ONLY = ("eval.test=false", "eval.validation=false", "trainer.eval_every=0", "logging.progress=false", "logging.nonprivate_diagnostics=publish")
PIPELINE_RUNS = {  # name → overrides; each private run beside its non-private twin
    "adam": ("optimizer=adam",),
    "dp_adam": ("optimizer=dp_adam",),
    "dp_adam/one-width": ("optimizer=dp_adam", "privacy.width_buckets=1"),
    "dp_adam/as-drawn": ("optimizer=dp_adam", "privacy.constant_time=false"),
    "muon": ("optimizer=muon",),
    "dp_muon": ("optimizer=dp_muon",),
    "dp_muon/one-width": ("optimizer=dp_muon", "privacy.width_buckets=1"),
    "dp_muon/as-drawn": ("optimizer=dp_muon", "privacy.constant_time=false"),
}


def train_seconds(setting: str, run: str, threads: int, work: Path) -> tuple[float, int | None]:
    """The run's train_seconds and its B_max (None: lots as drawn)."""
    run_dir = work / f"{setting}-{run.replace('/', '-')}-{time.monotonic_ns()}"
    command = [sys.executable, "-m", "dpmuon.train", *PIPELINES[setting], *PIPELINE_RUNS[run], *TRAINING_ONLY]
    command += [f"trainer.num_threads={threads}", f"hydra.run.dir={run_dir}"]
    done = subprocess.run(command, cwd=REPO_ROOT, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} failed:\n{done.stderr[-2000:]}")
    summary = json.loads((run_dir / "summary.json").read_text())
    return float(summary["train_seconds"]), summary.get("max_lot_size")


def pipeline(args) -> dict[str, Any]:
    """Median train_seconds of each run of each setting, rounds rotated; private ÷ non-private."""
    out: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for setting in args.pipeline:
            runs = list(PIPELINE_RUNS)
            seconds: dict[str, list[float]] = {run: [] for run in runs}
            rows: dict[str, int | None] = {}
            for repeat in range(args.repeats):
                shift = repeat % len(runs)
                for run in runs[shift:] + runs[:shift]:
                    took, rows[run] = train_seconds(setting, run, args.threads, Path(tmp))
                    seconds[run].append(took)
                print(f"  {setting}: repeat {repeat + 1}/{args.repeats} done", file=sys.stderr, flush=True)
            medians = {run: statistics.median(t) for run, t in seconds.items()}
            twin = {run: "adam" if "adam" in run else "muon" for run in runs}
            ratio = {run: medians[twin[run]] / medians[run] for run in runs}
            out[setting] = {
                run: {"train_seconds": medians[run], "all": seconds[run], "max_lot_size": rows[run], "throughput_vs_non_private": ratio[run]} for run in runs
            }
            lot = int(compose_config(*PIPELINES[setting]).privacy.expected_lot_size)
            print(f"{setting}: training seconds (median of {args.repeats}), × non-private (expected lot {lot})")
            for run in runs:
                bound = f"  B_max/(Nq) = {rows[run]}/{lot} = {rows[run] / lot:.3f}" if rows[run] else ""
                print(f"  {run:18} {medians[run]:8.2f} s  {out[setting][run]['throughput_vs_non_private']:.3f}{bound}")
    return out


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=MODELS, default="tiny")
    parser.add_argument("--lot", type=int, default=16, help="examples per step")
    parser.add_argument("--micro-batch", type=int, default=8, help="examples per physical micro-batch")
    parser.add_argument("--seq-len", type=int, default=64, help="longest synthetic sequence (tokens)")
    parser.add_argument("--data", choices=["synthetic", "e2e"], default="synthetic")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads(), help="torch CPU threads")
    parser.add_argument("--engines", nargs="+", default=["opacus", "fast"])
    parser.add_argument("--clip-modes", nargs="+", default=["flat", "per_matrix"])
    parser.add_argument("--optimizers", nargs="+", default=OPTIMIZERS, choices=OPTIMIZERS)
    variants_help = "what of the guarantee each private row keeps: " + "; ".join(f"{k}: {v}" for k, v in VARIANTS.items())
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS), help=variants_help)
    parser.add_argument("--memory", choices=["subprocess", "none"], default="subprocess")
    parser.add_argument("--memory-jobs", type=int, default=2, help="memory probes run at once")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--lora-r", type=int, help="train rank-r LoRA adapters on every projection of the frozen model (default: full fine-tuning)")
    parser.add_argument("--json", type=Path, help="also write the rows and settings here")
    parser.add_argument("--phases", action="store_true", help="also profile one step per private configuration: time per phase")
    parser.add_argument("--keep-freed-memory", action="store_true", help="CPU: keep freed memory for reuse, as trainer.keep_freed_memory=true")
    parser.add_argument("--pipeline", nargs="+", choices=list(PIPELINES), help="instead: time `python -m dpmuon.train` (training only), private vs non-private")
    parser.add_argument("--memory-probe", help=argparse.SUPPRESS)  # internal: one configuration's peak
    parser.add_argument("--lot-file", type=Path, help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cpu":  # as the driver: a constant-time release flushes subnormals on every thread
        start_flushing_threads(args.threads)
    else:
        torch.set_num_threads(args.threads)
    if device.type == "cpu" and args.keep_freed_memory:
        keep_freed_memory()  # trainer.keep_freed_memory=true: every row with it
    if args.memory_probe:
        print(*peak_memory_mib(Config.parse(args.memory_probe), args, torch.load(args.lot_file, weights_only=False), device))
        return
    if args.pipeline:
        found = pipeline(args)
        if args.json:
            meta = {"settings": {k: v for k, v in vars(args).items() if k in ("pipeline", "repeats", "threads")}, "torch": torch.__version__}
            meta |= {"git_commit": code_version(), "command": " ".join(["python", "scripts/bench_step.py", *sys.argv[1:]])}
            args.json.write_text(to_json({**meta, "pipelines": found, "runs": {k: list(v) for k, v in PIPELINE_RUNS.items()}}, indent=2))
        return
    if args.data == "e2e":
        examples, pad_id, lengths = e2e_lot(args.lot, args.seed, args.model)
    else:
        vocab = vocab_size(args.model)
        examples, pad_id = synthetic_lot(args.lot, args.seq_len, args.seed, vocab), vocab - 1
        lengths = [len(example.input_ids) for example in examples]
    # The lot as the trainer batches it: sorted by length; as drawn, each micro-batch right-padded
    # to its own longest sequence; constant-time, B_max rows at the run's fixed width or in buckets.
    width = args.seq_len if args.data == "synthetic" else int(compose_config().dataset.max_length)
    lots = batch_lot(examples, pad_id, args.micro_batch, width, lengths)
    configs = configurations(args.engines, args.clip_modes, args.optimizers, args.variants)
    tokens = sum(int(b["attention_mask"].sum()) for b in lots.as_drawn)
    print(
        f"model {args.model}{f' + LoRA r={args.lora_r}' if args.lora_r else ''}, {args.data} lot {args.lot} in micro-batches of {args.micro_batch} "
        f"({tokens / args.lot:.1f} tokens/example; constant-time: {lots.max_lot_size} rows × {width} tokens, "
        f"or in widths {', '.join(f'{r}×{w}' for w, r in lots.widths)}; "
        f"B_max/(Nq) = {lots.max_lot_size / args.lot:.3f}), device {device}, {torch.get_num_threads()} threads, "
        f"{args.repeats} repeats, {len(configs)} configurations",
        file=sys.stderr,
        flush=True,
    )
    lots = lots.to(device)
    times, runners = measure_throughput(configs, args, lots, device)
    phases = {c: phase_seconds(runners[c], lots.of(c)) for c in configs if c.private} if args.phases else {}
    del runners
    peaks: dict[Config, tuple[float, float]] = {}  # (the whole peak, the second step's)
    if args.memory == "subprocess":
        with tempfile.TemporaryDirectory() as tmp:
            lot_path = Path(tmp) / "lot.pt"
            torch.save(lots, lot_path)
            # Probes run side by side (each in its own process, so their peaks stay apart).
            with ThreadPoolExecutor(max_workers=args.memory_jobs) as pool:
                found = pool.map(lambda config: peak_memory_in_subprocess(config, args, lot_path), configs)
                peaks = dict(zip(configs, found))
    rows = summarize(configs, times, peaks, args.lot)
    memory_label = "peak MiB" if device.type == "cuda" else "peak RSS MiB"
    print_table(rows, memory_label)
    print()
    print_guarantee_costs(rows, lots.max_lot_size, args.lot, lots.tokens())
    if phases:
        print()
        print_phases(phases)
    if args.json:
        settings = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items() if k not in ("memory_probe", "lot_file")}
        meta = {
            "settings": settings,
            "threads": torch.get_num_threads(),
            "memory": memory_label,
            "torch": torch.__version__,
            "git_commit": code_version(),
            "command": " ".join(["python", "scripts/bench_step.py", *sys.argv[1:]]),
        }
        meta["max_lot_size"] = lots.max_lot_size
        meta["widths"] = [list(bucket) for bucket in lots.widths]
        meta["padded_tokens"] = lots.tokens()
        args.json.write_text(to_json({**meta, "rows": rows, "phases": {c.label: p for c, p in phases.items()}}, indent=2))


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
