"""With σ = 0 and thresholds that never bind, every DP optimizer step equals its non-private twin.

This pins the whole private path (engine → clipping → release scaling → optimizer) to plain
autograd, so any stray factor (lot size, clip, noise) shows up.
"""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_gpt2, token_batch

from dpmuon.models import hidden_matrices, per_example_lm_loss
from dpmuon.optim import AdamSettings, MuonBCSettings, MuonSettings, OptimizerInputs, SGDSettings
from dpmuon.privacy import NonPrivateRelease, PrivacyAccountant, Privatizer, build_partition

# Adam divides by √v + eps: where the true gradient is exactly 0 (GPT-2's attention key bias),
# round-off of 1e-13 vs 1e-9 would be amplified to a visible update; eps = 1e-6 keeps such
# coordinates at round-off while leaving real gradients (≥ 1e-5 here) normalized.
ADAM = {"lr": 1e-3, "betas": [0.9, 0.999], "eps": 1e-6, "weight_decay": 0.0}
CONFIGS = {
    "sgd": {"lr": 0.1, "momentum": 0.9},
    "adam": ADAM,
    "muon": {"lr": 0.01, "momentum": 0.95, "adam": ADAM},
    "muonbc": {"lr": 0.01, "momentum": 0.95, "adam": ADAM, "bias_correction": {"probe_scale": 1.0, "num_probes": 1}},
}
SETTINGS = {"sgd": SGDSettings, "adam": AdamSettings, "muon": MuonSettings, "muonbc": MuonBCSettings}
NON_PRIVATE_TWIN = {"sgd": "sgd", "adam": "adam", "muon": "muon", "muonbc": "muon"}


def train(model, release, name: str, batches):
    opt = SETTINGS[name](**CONFIGS[name]).build(
        OptimizerInputs(
            params=dict(model.named_parameters()),
            hidden_matrices=hidden_matrices(model),
            release_noise_std=release.release_noise_std(),
            generator=torch.Generator().manual_seed(0),
        )
    )
    for batch in batches:
        # The lot is split into two physical micro-batches: the mechanism must not notice.
        halves = [{k: v[:3] for k, v in batch.items()}, {k: v[3:] for k, v in batch.items()}]
        release.release(halves, per_example_lm_loss)
        opt.step()
        opt.zero_grad()


@pytest.mark.parametrize("name", list(CONFIGS))
@pytest.mark.parametrize("clip_mode", ["per_matrix", "flat"])
def test_private_step_with_zero_noise_and_no_clipping_equals_non_private(name, clip_mode):
    batches = [token_batch(6, seed=s) for s in range(3)]
    private_model, reference_model = tiny_gpt2(tie=True), tiny_gpt2(tie=True)
    partition = build_partition(
        [n for n, _ in private_model.named_parameters()], clip_mode=clip_mode, clip_norm=1e6, matrix_names=hidden_matrices(private_model)
    )
    privatizer = Privatizer(private_model, partition, noise_multiplier=0.0, expected_lot_size=6, sample_rate=1.0, accountant=PrivacyAccountant(1e-5))
    train(private_model, privatizer, name, batches)
    train(reference_model, NonPrivateRelease(reference_model), NON_PRIVATE_TWIN[name], batches)
    for (n, a), b in zip(private_model.named_parameters(), reference_model.parameters()):
        assert torch.allclose(a, b, atol=1e-6, rtol=1e-5), n
    # The models actually moved (the comparison is not vacuous).
    assert not torch.allclose(private_model.transformer.h[0].mlp.c_fc.weight, tiny_gpt2(tie=True).transformer.h[0].mlp.c_fc.weight)
