"""Checks that only mean something on a GPU: the mechanism and the optimizers on CUDA, in bf16.

Marked `gpu` (outside the default suite); `scripts/gpu_check.sh` runs them. They run on the
device named by $DPMUON_TEST_DEVICE (default cuda, skipped without one), so that
`gpu_check.sh --cpu` can rehearse them on the CPU at toy size.
"""

from __future__ import annotations

import contextlib
import os

import pytest
import torch
from conftest import random_gpt2
from helpers_constant_work import lots_of_one_shape, operation_records
from helpers_tokenizers import CharTokenizer

from dpmuon.models import IGNORE_INDEX, hidden_matrices, per_example_lm_loss
from dpmuon.optim import AdamSettings, MuonBCSettings, MuonSettings, OptimizerInputs, SGDSettings
from dpmuon.privacy import GaussianNoise, PrivacyAccountant, Privatizer, SecretStream, build_engine, build_partition
from dpmuon.training.evaluation import decode

pytestmark = pytest.mark.gpu

DEVICE = torch.device(os.environ.get("DPMUON_TEST_DEVICE", "cuda"))
ON_GPU = DEVICE.type == "cuda"
# GPT-2's full vocabulary and a wider body on the GPU; a toy model for the CPU rehearsal.
SHAPE = dict(vocab_size=50258, n_layer=2, n_embd=256, n_head=4) if ON_GPU else dict(vocab_size=97, n_layer=2, n_embd=32, n_head=2)
VOCAB = SHAPE["vocab_size"]
ADAM = {"lr": 1e-3, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.0}
OPTIMIZERS = {
    "dp_sgd": (SGDSettings, {"lr": 1.0}),
    "dp_adam": (AdamSettings, ADAM),
    "dp_muon": (MuonSettings, {"lr": 1e-3, "momentum": 0.95, "adam": ADAM}),
    "dp_muonbc": (MuonBCSettings, {"lr": 1e-3, "momentum": 0.95, "adam": ADAM, "bias_correction": {"probe_scale": 1.0, "num_probes": 1}}),
}


@pytest.fixture(autouse=True)
def _device_available():
    if ON_GPU and not torch.cuda.is_available():
        pytest.skip("no CUDA device (set DPMUON_TEST_DEVICE=cpu to rehearse these checks on the CPU)")


def model_on_device(tie: bool = True, seed: int = 0):
    return random_gpt2(**SHAPE, n_positions=64, tie_embeddings=tie, seed=seed).to(DEVICE)


def lot(size: int, length: int = 24, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (size, length), generator=g)
    labels = ids.clone()
    labels[:, : length // 2] = IGNORE_INDEX
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": labels}
    return {k: v.to(DEVICE) for k, v in batch.items()}


def bf16_loss(model, batch):
    with torch.autocast(device_type=DEVICE.type, dtype=torch.bfloat16):
        return per_example_lm_loss(model, batch)


def partition_of(model, clip_norm: float):
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    return build_partition(names, clip_mode="per_matrix", clip_norm=clip_norm, matrix_names=hidden_matrices(model))


@pytest.mark.parametrize("tie", [True, False], ids=["tied", "untied"])
def test_fast_engine_matches_opacus_on_the_device_in_bf16(tie):
    model = model_on_device(tie=tie, seed=1)
    partition = partition_of(model, clip_norm=0.05)
    batch = lot(8, seed=2)
    sums = {}
    for engine in ("fast", "opacus"):
        clipper = build_engine(engine, model, partition)
        summed, _, stats = clipper.clipped_sum(batch, bf16_loss)
        clipper.close()
        assert all(t.device.type == DEVICE.type and t.dtype == torch.float32 for t in summed.values())
        sums[engine] = summed
    for name, fast in sums["fast"].items():
        reference = sums["opacus"][name]
        # Both see the same bf16 forward; their fp32 arithmetic differs, and so does the rounding.
        assert (fast - reference).norm() <= 2e-2 * reference.norm() + 1e-7, name


def test_privatizer_on_the_device_releases_fp32_with_calibrated_noise():
    model = model_on_device(seed=3)
    partition = partition_of(model, clip_norm=1e-4)  # every example clipped: the signal is tiny
    sigma, lot_size = 2.0, 8
    privatizer = Privatizer(
        model, partition, noise_multiplier=sigma, expected_lot_size=lot_size, sample_rate=0.01,
        accountant=PrivacyAccountant(1e-5), noise=GaussianNoise(SecretStream(4)), engine="fast",
    )  # fmt: skip
    batch = lot(lot_size, seed=5)
    stats = privatizer.release([{k: v[:4] for k, v in batch.items()}, {k: v[4:] for k, v in batch.items()}], bf16_loss)
    assert stats.lot_size == lot_size and stats.nonfinite == 0
    released = torch.cat([p.grad.flatten() for p in privatizer.params.values()])
    assert released.device.type == DEVICE.type and released.dtype == torch.float32
    # The clipped sum has norm ≤ B·Δ, negligible next to noise of std σΔ/B on every entry.
    expected_std = sigma * partition.sensitivity / lot_size
    assert float(released.std()) == pytest.approx(expected_std, rel=0.02)
    privatizer.close()


def test_a_constant_time_release_on_the_device_runs_the_same_operations_whatever_the_lot_holds():
    """tests/privacy/test_constant_work.py on the device, in bf16: the GPU paths of the kernels
    (batched Grams, no row selection) must not branch on the values either."""
    partition = partition_of(model_on_device(seed=4), clip_norm=0.1)

    def privatizer():
        return Privatizer(
            model_on_device(seed=4), partition, noise_multiplier=1.0, expected_lot_size=4, sample_rate=0.1,
            accountant=PrivacyAccountant(1e-5), noise=GaussianNoise(SecretStream(6)), engine="fast", constant_time=True,
        )  # fmt: skip

    lots = [{k: v.to(DEVICE) for k, v in lot.items()} for lot in lots_of_one_shape()]
    records = operation_records(privatizer, lots, lambda model, batch: bf16_loss(model, batch) * batch["weight"])
    assert records[1] == records[0] and records[2] == records[0]


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_dp_optimizers_step_on_the_device_and_keep_fp32_state(name):
    model = model_on_device(seed=6)
    partition = partition_of(model, clip_norm=0.1)
    privatizer = Privatizer(
        model, partition, noise_multiplier=1.0, expected_lot_size=8, sample_rate=0.01,
        accountant=PrivacyAccountant(1e-5), noise=GaussianNoise(SecretStream(7)), engine="fast",
    )  # fmt: skip
    named = dict(model.named_parameters())
    kind, cfg = OPTIMIZERS[name]
    probes = torch.Generator(device=DEVICE).manual_seed(8)  # DP-MuonBC draws its probes on the device
    optimizer = kind(**cfg).build(OptimizerInputs(named, hidden_matrices(model), privatizer.release_noise_std(), probes))
    before = {n: p.detach().clone() for n, p in named.items()}
    for seed in (9, 10):
        privatizer.release([lot(8, seed=seed)], bf16_loss)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    assert all(torch.isfinite(p).all() and p.device.type == DEVICE.type for p in named.values())
    assert any(not torch.equal(before[n], p) for n, p in named.items())
    state = [v for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v) and v.is_floating_point()]
    assert all(v.dtype == torch.float32 and v.device.type == DEVICE.type for v in state if v.ndim > 0)
    privatizer.close()


def test_decoding_on_the_device_matches_the_cpu():
    model = random_gpt2(vocab_size=258, n_layer=2, n_embd=32, n_head=2, n_positions=64, eos_token_id=256, seed=11)
    sources = ["name : The Eagle", "x" * 30, "a b c"]
    cfg = {"decoding": "greedy", "num_beams": 1, "max_new_tokens": 12, "batch_size": 2}
    on_cpu = decode(model, CharTokenizer(), sources, cfg, torch.device("cpu"), contextlib.nullcontext)
    on_device = decode(model.to(DEVICE), CharTokenizer(), sources, cfg, DEVICE, contextlib.nullcontext)
    assert on_device == on_cpu
    beam = decode(model, CharTokenizer(), sources, {**cfg, "decoding": "beam", "num_beams": 3}, DEVICE, contextlib.nullcontext)
    assert len(beam) == len(sources)
