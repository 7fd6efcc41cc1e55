"""Device-agnostic code paths: every tensor the privatizer, the noise, the optimizers (DP-MuonBC's
probes included) and the decoder create follows the model's device and dtype.

On a CPU-only machine a forgotten `device=` is invisible: the tensor lands on the CPU, where the
model is too, and only a GPU run fails. So the test audits the factory calls themselves: while
the code paths run, a torch function mode records every tensor factory called directly from
dpmuon's own source without a device. Each such call must be one of the few that keep host-side
bookkeeping on purpose (listed with their reason below); any other is a bug on GPU.
"""

from __future__ import annotations

import contextlib
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from conftest import random_gpt2, tiny_gpt2, token_batch
from helpers_threads import one_thread  # noqa: F401  (autouse: one torch thread for these tiny models)
from helpers_tokenizers import CharTokenizer
from torch.overrides import TorchFunctionMode

import dpmuon
from dpmuon.data import EncodedExample
from dpmuon.models import IGNORE_INDEX, hidden_matrices, per_example_lm_loss
from dpmuon.optim import AdamSettings, MuonBCSettings, MuonSettings, OptimizerInputs, SGDSettings
from dpmuon.privacy import GaussianNoise, NonPrivateRelease, PrivacyAccountant, Privatizer, SecretStream, build_partition
from dpmuon.training.evaluation import decode, token_nll

SOURCE = Path(dpmuon.__file__).resolve().parent

# Factories that place their result on the default device unless told otherwise. (*_like and
# Tensor.new_* follow their argument; torch.tensor / as_tensor of a tensor keep its device.)
FACTORIES = {
    torch.zeros, torch.ones, torch.empty, torch.full, torch.rand, torch.randn, torch.randint,
    torch.randperm, torch.arange, torch.eye, torch.linspace, torch.tensor, torch.as_tensor,
}  # fmt: skip

# (file under src/dpmuon, function) → why a host tensor is intended there.
HOST_ON_PURPOSE = {
    ("privacy/privatizer.py", "_sum_clipped"): "per-block clip counts: host-side diagnostics, added to ClipStats' .cpu() counts",
    ("privacy/privatizer.py", "release"): "the non-private release's empty clip counts: host-side diagnostics",
    ("data/collate.py", "_padded"): "batches are padded on the host; callers move them to the model's device",
    ("privacy/conformance.py", "stand_in"): "the public stand-in batch is drawn by one CPU generator (the same values on every device), then moved",
}

ADAM = {"lr": 1e-3, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.0}
OPTIMIZER_CONFIGS = {
    "sgd": SGDSettings(lr=0.5, momentum=0.9),
    "adam": AdamSettings(**ADAM),
    "muon": MuonSettings(lr=1e-3, momentum=0.95, adam=ADAM),
    "muonbc": MuonBCSettings(lr=1e-3, momentum=0.95, adam=ADAM, bias_correction={"probe_scale": 1.0, "num_probes": 2}),
}


@dataclass(frozen=True)
class FactoryCall:
    file: str  # relative to the audited root
    function: str
    line: int
    factory: str


class FactoryAudit(TorchFunctionMode):
    """Records factory calls made directly from files under `root` without an explicit device."""

    def __init__(self, root: Path = SOURCE):
        super().__init__()
        self.root = root
        self.calls: list[FactoryCall] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in FACTORIES and kwargs.get("device") is None and not (args and torch.is_tensor(args[0])):
            caller = sys._getframe(1)  # the Python frame that called the factory
            path = Path(caller.f_code.co_filename).resolve()
            if path.is_relative_to(self.root):
                self.calls.append(FactoryCall(path.relative_to(self.root).as_posix(), caller.f_code.co_name, caller.f_lineno, func.__name__))
        return func(*args, **kwargs)

    def unexplained(self) -> list[FactoryCall]:
        return [call for call in self.calls if (call.file, call.function) not in HOST_ON_PURPOSE]


def private_setup(tie: bool, engine: str, clip_mode: str, secure: bool):
    model = tiny_gpt2(tie=tie, seed=1)
    matrices = hidden_matrices(model)
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    partition = build_partition(names, clip_mode=clip_mode, clip_norm=0.1, matrix_names=matrices)
    privatizer = Privatizer(
        model, partition, noise_multiplier=1.0, expected_lot_size=8, sample_rate=0.01,
        accountant=PrivacyAccountant(1e-5), noise=GaussianNoise(SecretStream(0), secure=secure),
        engine=engine,
    )  # fmt: skip
    return model, matrices, privatizer


def lot_with_a_broken_example() -> list[dict[str, torch.Tensor]]:
    """Two micro-batches; the second holds an example whose loss is NaN (the dropped-example path)."""
    return [token_batch(4, seed=1), {**token_batch(4, seed=2), "nan_row": torch.tensor([False, True, False, False])}]


def loss_with_nan_rows(model, batch):
    losses = per_example_lm_loss(model, batch)
    rows = batch.get("nan_row")
    return losses if rows is None else torch.where(rows.to(losses.device), losses * float("nan"), losses)


def exercise_private_steps(tie: bool, engine: str, clip_mode: str, secure: bool) -> None:
    model, matrices, privatizer = private_setup(tie, engine, clip_mode, secure)
    named = dict(model.named_parameters())
    for settings in OPTIMIZER_CONFIGS.values():
        optimizer = settings.build(OptimizerInputs(named, matrices, privatizer.release_noise_std(), torch.Generator()))
        for _step in range(2):  # the first step also creates the optimizer state
            privatizer.release(lot_with_a_broken_example(), loss_with_nan_rows, step=None)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    privatizer.close()


@pytest.mark.parametrize(
    ("tie", "engine", "clip_mode", "secure"),
    [(True, "fast", "per_matrix", False), (False, "fast", "flat", True), (True, "opacus", "per_matrix", False), (False, "opacus", "flat", False)],
    ids=["tied-fast-per_matrix", "untied-fast-flat-secure", "tied-opacus-per_matrix", "untied-opacus-flat"],
)
def test_private_steps_and_optimizers_create_no_tensor_without_a_device(tie, engine, clip_mode, secure):
    with FactoryAudit() as audit:
        exercise_private_steps(tie, engine, clip_mode, secure)
    assert audit.calls, "the audit saw no factory call at all: it is not hooked in"
    assert audit.unexplained() == []


def test_non_private_release_creates_no_tensor_without_a_device():
    model = tiny_gpt2(seed=2)
    release = NonPrivateRelease(model)
    with FactoryAudit() as audit:
        release.release([token_batch(4, seed=3)], per_example_lm_loss)
    assert audit.unexplained() == []


def test_decoding_and_held_out_nll_create_no_tensor_without_a_device():
    model = random_gpt2(vocab_size=258, n_layer=1, n_embd=16, n_head=2, n_positions=48, eos_token_id=256, seed=1)
    examples = [EncodedExample(list(range(1, 9)), [IGNORE_INDEX] * 4 + list(range(5, 9))) for _ in range(3)]
    cpu = torch.device("cpu")
    with FactoryAudit() as audit:
        for decoding in ("beam", "greedy"):
            cfg = {"decoding": decoding, "num_beams": 2, "max_new_tokens": 6, "batch_size": 2}
            decode(model, CharTokenizer(), ["ab", "a longer source"], cfg, cpu, contextlib.nullcontext)
        token_nll(model, examples, CharTokenizer.pad_token_id, 2, cpu, contextlib.nullcontext)
    assert audit.unexplained() == []


def test_the_audit_catches_a_missing_device_in_package_code():
    """A factory call compiled as if it sat in dpmuon's source, once without and once with a device."""
    namespace: dict = {"torch": torch}
    code = "def forgetful(like):\n    return torch.zeros(3)\ndef careful(like):\n    return torch.zeros(3, device=like.device)\n"
    exec(compile(code, str(SOURCE / "privacy" / "example.py"), "exec"), namespace)
    with FactoryAudit() as audit:
        namespace["careful"](torch.ones(1))
        namespace["forgetful"](torch.ones(1))
    assert audit.unexplained() == [FactoryCall("privacy/example.py", "forgetful", 2, "zeros")]


@pytest.mark.parametrize("kind", sorted(OPTIMIZER_CONFIGS))
def test_bf16_weights_get_bf16_released_gradients_and_fp32_muon_buffers(kind):
    """A model held in bf16 (not just autocast): the release is cast to the parameters' dtype, the
    mechanism's sums and Muon's buffers stay fp32."""
    model, matrices, privatizer = private_setup(tie=True, engine="fast", clip_mode="per_matrix", secure=False)
    model.to(torch.bfloat16)
    named = dict(model.named_parameters())
    optimizer = OPTIMIZER_CONFIGS[kind].build(OptimizerInputs(named, matrices, privatizer.release_noise_std(), torch.Generator()))
    before = {n: p.detach().clone() for n, p in named.items()}
    privatizer.release([token_batch(4, seed=5)], per_example_lm_loss)
    assert {(p.grad.dtype, p.grad.device) for p in named.values()} == {(torch.bfloat16, torch.device("cpu"))}
    optimizer.step()
    assert all(p.dtype == torch.bfloat16 for p in named.values())
    assert any(not torch.equal(before[n], p) for n, p in named.items())
    muon = getattr(optimizer, "parts", {}).get("muon")
    if muon is not None:
        buffers = [muon.state[p]["momentum_buffer"] for p in muon.param_groups[0]["params"]]
        assert buffers and all(b.dtype == torch.float32 for b in buffers)
