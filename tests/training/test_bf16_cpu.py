"""Private steps of every DP optimizer under bf16 autocast on CPU (what `trainer.precision=bf16`
does on GPU): the forward runs in bf16, while clipping, noise, the released gradient and the
optimizer state stay fp32, every example's clipped contribution stays within its thresholds,
ε is the plan's, and training makes the progress the fp32 run makes."""

from __future__ import annotations

import functools

import pytest
import torch
from conftest import VOCAB, tiny_gpt2
from helpers_threads import one_thread  # noqa: F401  (autouse: one torch thread for these tiny models)
from helpers_train import compose_config, require_real_data, seed_file_override
from omegaconf import OmegaConf

from dpmuon.config.roster import optimizer_names
from dpmuon.eval.runs import read_run_rows
from dpmuon.models import IGNORE_INDEX, hidden_matrices, per_example_lm_loss
from dpmuon.optim import OptimizerInputs, build_optimizer
from dpmuon.privacy import GaussianNoise, PrivacyAccountant, Privatizer, SecretStream, build_engine, build_partition
from dpmuon.privacy.accountant import ReleaseSlack, epsilon_after
from dpmuon.training.loop import run
from dpmuon.training.runtime import autocast_factory

DP_OPTIMIZERS = optimizer_names(private=True)
SIGMA, SAMPLE_RATE, DELTA, CLIP = 0.3, 0.05, 1e-5, 1.0
LOT, MICRO_BATCH, STEPS = 32, 16, 6


def counting_lot(size: int, length: int = 12, seed: int = 0) -> list[dict[str, torch.Tensor]]:
    """Sequences that count up (mod VOCAB) from a random start, the first third unsupervised:
    learnable in a few steps, so that a loss that does not fall means a broken step."""
    start = torch.randint(0, VOCAB, (size, 1), generator=torch.Generator().manual_seed(seed))
    ids = (start + torch.arange(length)) % VOCAB
    labels = ids.clone()
    labels[:, : length // 3] = IGNORE_INDEX
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": labels}
    return [{k: v[i : i + MICRO_BATCH] for k, v in batch.items()} for i in range(0, size, MICRO_BATCH)]


@functools.cache
def optimizer_config(name: str) -> dict:
    """The optimizer's own config group (learning rates of the E2E recipe)."""
    return OmegaConf.to_container(compose_config(f"optimizer={name}").optimizer, resolve=True)


class RecordingNoise(GaussianNoise):
    """The privatizer's noise source, remembering the dtype of every sum it noises."""

    def __init__(self, stream):
        super().__init__(stream)
        self.dtypes: set[torch.dtype] = set()

    def grid_release(self, total, std):
        self.dtypes.add(total.dtype)
        return super().grid_release(total, std)


def private_training(optimizer: str, precision: str, engine: str = "fast", tie: bool = True):
    """STEPS private steps on a fixed lot; returns (model, privatizer, optimizer, noise, losses)."""
    model = tiny_gpt2(tie=tie, seed=3)
    matrices = hidden_matrices(model)
    named = {n: p for n, p in model.named_parameters() if p.requires_grad}
    partition = build_partition(list(named), clip_mode="per_matrix", clip_norm=CLIP, matrix_names=matrices)
    noise = RecordingNoise(SecretStream(7))
    privatizer = Privatizer(
        model, partition, noise_multiplier=SIGMA, expected_lot_size=LOT, sample_rate=SAMPLE_RATE,
        accountant=PrivacyAccountant(DELTA), noise=noise, engine=engine,
    )  # fmt: skip
    cfg = optimizer_config(optimizer)
    inputs = OptimizerInputs(named, matrices, privatizer.release_noise_std(), torch.Generator().manual_seed(5))
    opt = build_optimizer(cfg, inputs)
    autocast = autocast_factory(precision, torch.device("cpu"))

    def loss_fn(m, batch):
        with autocast():
            return per_example_lm_loss(m, batch)

    losses = []
    for step in range(1, STEPS + 1):
        losses.append(privatizer.release(counting_lot(LOT), loss_fn, step=step).train_loss)
        released = {n: p.grad for n, p in named.items()}
        assert all(g.dtype == torch.float32 for g in released.values())
        opt.step()
        opt.zero_grad(set_to_none=True)
    return model, privatizer, opt, noise, losses


def optimizer_state_dtypes(opt) -> set[torch.dtype]:
    return {v.dtype for state in opt.state.values() for v in state.values() if torch.is_tensor(v) and v.is_floating_point()}


@pytest.mark.parametrize("optimizer", DP_OPTIMIZERS)
def test_bf16_private_steps_keep_the_mechanism_in_fp32_and_learn_like_fp32(optimizer):
    *_, fp32_losses = private_training(optimizer, "fp32")
    model, privatizer, opt, noise, bf16_losses = private_training(optimizer, "bf16")

    assert noise.dtypes == {torch.float64}  # the grid release noises in float64 (privacy/grid.py)
    # DP-SGD (no momentum) keeps no state; the others keep theirs in fp32.
    assert optimizer_state_dtypes(opt) == (set() if optimizer == "dp_sgd" else {torch.float32})
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert privatizer.epsilon() == pytest.approx(epsilon_after(SIGMA, SAMPLE_RATE, STEPS, DELTA))
    # Both runs learn the counting task (at the recipe's learning rates, slowly: ~0.1 nats in
    # six steps), and bf16 makes the progress fp32 makes, step by step.
    fp32_progress, bf16_progress = fp32_losses[0] - fp32_losses[-1], bf16_losses[0] - bf16_losses[-1]
    assert fp32_progress > 0.04, fp32_losses
    assert bf16_progress == pytest.approx(fp32_progress, rel=0.1)
    assert bf16_losses == pytest.approx(fp32_losses, abs=0.01)


@pytest.mark.parametrize("engine", ["fast", "opacus"])
@pytest.mark.parametrize("tie", [True, False], ids=["tied", "untied"])
def test_bf16_clipped_contributions_are_fp32_and_within_their_thresholds(engine, tie):
    model = tiny_gpt2(tie=tie, seed=4)
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    # A threshold far below the gradient norms: every example is clipped in every block.
    partition = build_partition(names, clip_mode="per_matrix", clip_norm=1e-3, matrix_names=hidden_matrices(model))
    clipper = build_engine(engine, model, partition)
    autocast = autocast_factory("bf16", torch.device("cpu"))

    def loss_fn(m, batch):
        with autocast():
            return per_example_lm_loss(m, batch)

    batch = counting_lot(MICRO_BATCH)[0]
    for i in range(MICRO_BATCH):  # one example at a time: its clipped sum is its contribution
        single = {k: v[i : i + 1] for k, v in batch.items()}
        summed, losses, stats = clipper.clipped_sum(single, loss_fn)
        assert all(t.dtype == torch.float32 for t in summed.values())
        assert stats.clipped.tolist() == [1] * len(partition)
        for block in partition.blocks:
            norm = torch.sqrt(sum(summed[name].double().pow(2).sum() for name in block.params))
            assert norm <= block.threshold * (1 + 1e-5), (block.name, float(norm), block.threshold)
            assert norm >= block.threshold * (1 - 1e-2)  # clipped to the threshold, not far below it
    clipper.close()


@pytest.mark.parametrize("optimizer", DP_OPTIMIZERS)
def test_trainer_precision_bf16_on_cpu_spends_the_planned_epsilon_and_learns_like_fp32(tmp_path, optimizer):
    """The driver itself with trainer.precision=bf16 against trainer.precision=fp32 on the same
    lots and noise (real E2E subset, tiny model)."""
    require_real_data()
    overrides = [
        "experiment=smoke", f"optimizer={optimizer}", "model.n_layer=1", "model.n_embd=32", "model.n_head=2",
        "model.n_positions=128", "data.max_train_examples=300", "data.max_valid_examples=8", "eval.test=false",
        "privacy.expected_lot_size=32", "privacy.noise_multiplier=0.8", seed_file_override(11 << 100),
        "trainer.steps=5", "trainer.micro_batch_size=16", "trainer.eval_every=0", "trainer.checkpoint_every=0",
        "trainer.num_threads=1", "logging.progress=false", "logger=none",
        "privacy.width_buckets=1",  # bf16 keeps one width (tests/training/test_loop_batching.py): the same micro-batches in both
    ]  # fmt: skip
    runs = {}
    for precision in ("fp32", "bf16"):
        summary = run(compose_config(*overrides, f"trainer.precision={precision}"), tmp_path / precision)
        rows = [r for r in read_run_rows(tmp_path / precision, diagnostics=True) if r["step"] > 0]  # (step 0: the initial weights' validation NLL)
        state = torch.load(tmp_path / precision / "checkpoint.pt", map_location="cpu", weights_only=False)
        runs[precision] = summary, [r["train_loss"] for r in rows], state
    (fp32, fp32_losses, _), (bf16, bf16_losses, state) = runs["fp32"], runs["bf16"]

    slack = ReleaseSlack(**bf16["release_slack"])  # the grid release's float slack, charged per release
    assert bf16["epsilon"] == fp32["epsilon"] == pytest.approx(epsilon_after(0.8, bf16["sample_rate"], 5, bf16["delta"], "prv", slack))
    assert bf16["epsilon"] <= bf16["target_epsilon"]
    assert bf16_losses == pytest.approx(fp32_losses, rel=0.02)
    assert bf16_losses[-1] < bf16_losses[0]
    floating = {
        t.dtype for part in _states(state["optimizer"]) for s in part.values() for t in s.values()
        if torch.is_tensor(t) and t.is_floating_point()
    }  # fmt: skip
    assert floating == (set() if optimizer == "dp_sgd" else {torch.float32})


def _states(optimizer_state: dict) -> list[dict]:
    """Per-parameter states of a plain or a hybrid (per-part) optimizer state dict."""
    if "state" in optimizer_state:
        return [optimizer_state["state"]]
    return [part["state"] for part in optimizer_state.values()]
