"""Muon as post-processing: agreement with torch.optim.Muon, noise bookkeeping, SNR, BC gating."""

from __future__ import annotations

import math

import pytest
import torch

from dpmuon.optim import MomentumRule, Muon, estimate_snr, update_scale_factor


def linear_weights(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(shape, generator=g)) for shape in [(8, 16), (16, 8), (12, 12), (12, 12)]]


def gradient_stream(params, steps: int, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    return [[torch.randn(p.shape, generator=g) for p in params] for _ in range(steps)]


def run(optimizer, params, grads):
    for step_grads in grads:
        for p, gr in zip(params, step_grads):
            p.grad = gr.clone()
        optimizer.step()


def test_matches_torch_muon_with_ema_nesterov_quintic_reference_scale():
    ours, theirs = linear_weights(), linear_weights()
    grads = gradient_stream(ours, steps=6)
    run(
        Muon(
            ours,
            lr=0.02,
            momentum=0.95,
            momentum_kind="ema",
            nesterov=True,
            ns_coefficients="quintic",
            update_scale="reference",
            weight_decay=0.1,
            ns_dtype=torch.bfloat16,
        ),
        ours,
        grads,
    )
    run(torch.optim.Muon(theirs, lr=0.02, momentum=0.95, nesterov=True, weight_decay=0.1, adjust_lr_fn="original"), theirs, grads)
    for a, b in zip(ours, theirs):
        assert torch.allclose(a, b, atol=1e-6, rtol=0), (a - b).abs().max()


def test_matches_torch_muon_with_adam_rms_scale():
    ours, theirs = linear_weights(2), linear_weights(2)
    grads = gradient_stream(ours, steps=3, seed=5)
    run(Muon(ours, lr=0.01, momentum_kind="ema", nesterov=True, update_scale="adam_rms", ns_dtype=torch.bfloat16), ours, grads)
    run(torch.optim.Muon(theirs, lr=0.01, weight_decay=0.0, adjust_lr_fn="match_rms_adamw"), theirs, grads)
    for a, b in zip(ours, theirs):
        assert torch.allclose(a, b, atol=1e-6, rtol=0)


def test_heavy_ball_buffer_is_a_plain_sum():
    p = torch.nn.Parameter(torch.zeros(4, 6))
    opt = Muon([p], lr=0.0, momentum=0.5)
    grads = gradient_stream([p], steps=3)
    run(opt, [p], grads)
    expected = grads[0][0] * 0.25 + grads[1][0] * 0.5 + grads[2][0]
    assert torch.allclose(opt.state[p]["momentum_buffer"], expected)


def test_update_scale_reads_conv1d_layout():
    # Conv1D stores (in, out): a (64, 256) Conv1D weight has fan_out 256, fan_in 64.
    assert update_scale_factor("reference", torch.Size([64, 256]), "in_out") == pytest.approx(2.0)
    assert update_scale_factor("reference", torch.Size([64, 256]), "out_in") == pytest.approx(1.0)
    assert update_scale_factor("adam_rms", torch.Size([64, 256])) == pytest.approx(0.2 * 16)
    assert update_scale_factor("none", torch.Size([64, 256])) == 1.0
    with pytest.raises(ValueError):
        update_scale_factor("spectral", torch.Size([2, 2]))


@pytest.mark.parametrize("kind", ["heavy_ball", "ema"])
@pytest.mark.parametrize("nesterov", [False, True])
def test_public_noise_bookkeeping_matches_empirical_variance(kind, nesterov):
    """Feed pure-noise gradients of std s_g; the variance of what NS sees must match the recursion."""
    s_g, beta = 0.3, 0.9
    p = torch.nn.Parameter(torch.zeros(300, 300))
    opt = Muon([p], lr=0.0, momentum=beta, momentum_kind=kind, nesterov=nesterov, release_noise_std={p: s_g})
    rule = MomentumRule.create(beta, kind, nesterov)
    g = torch.Generator().manual_seed(0)
    for t in range(1, 13):
        update, std = opt._momentum_update(p, s_g * torch.randn(p.shape, generator=g), rule)
        if t in (1, 2, 12):
            assert float(update.var()) == pytest.approx(std**2, rel=0.03), t
    # Long-run heavy-ball variance approaches s_g²/(1−β²) (EMA: (1−β)² times that).
    limit = s_g**2 / (1 - beta**2) * (1 if kind == "heavy_ball" else (1 - beta) ** 2)
    assert opt.state[p]["buffer_noise_var"] < limit


def test_snr_estimate_is_unbiased_for_signal_energy():
    g = torch.Generator().manual_seed(0)
    M0 = torch.randn(40, 60, generator=g)
    s = 2.0
    true_snr = float(M0.pow(2).sum()) / (s**2 * M0.numel())
    draws = [estimate_snr(M0 + s * torch.randn(M0.shape, generator=g), s) for _ in range(200)]
    assert sum(draws) / len(draws) == pytest.approx(true_snr, rel=0.05)
    assert estimate_snr(M0, 0.0) == math.inf
    assert estimate_snr(torch.zeros(10, 10), 1.0) == -1.0  # not clamped: ‖0‖² − s²mn < 0


def test_low_snr_estimates_average_to_the_true_snr():
    """At SNR 0.01 about half the estimates are negative; clamping them at 0 biased the mean
    to ~0.06. Unclamped, the mean is unbiased."""
    g = torch.Generator().manual_seed(1)
    s = 1.0
    M0 = torch.full((32, 32), 0.1)  # ‖M0‖² / (s²mn) = 0.01
    draws = [estimate_snr(M0 + s * torch.randn(M0.shape, generator=g), s) for _ in range(2000)]
    assert min(draws) < 0
    assert sum(draws) / len(draws) == pytest.approx(0.01, abs=0.004)


def _one_step(bias_correction: bool, noise_std: float, min_snr=None, seed=3):
    p = torch.nn.Parameter(torch.zeros(16, 24))
    opt = Muon([p], lr=0.1, bias_correction=bias_correction, min_snr=min_snr, release_noise_std={p: noise_std}, generator=torch.Generator().manual_seed(7))
    p.grad = torch.randn(p.shape, generator=torch.Generator().manual_seed(seed))
    opt.step()
    return p.detach().clone(), opt.snr[p]


def test_bias_correction_is_a_no_op_without_noise():
    assert torch.equal(_one_step(True, 0.0)[0], _one_step(False, 0.0)[0])


def test_bias_correction_changes_noisy_updates_unless_gated_by_snr():
    plain, snr = _one_step(False, 0.5)
    corrected, _ = _one_step(True, 0.5)
    assert not torch.allclose(plain, corrected)
    gated, _ = _one_step(True, 0.5, min_snr=snr + 1.0)  # SNR below the gate → no correction
    assert torch.equal(gated, plain)
    open_gate, _ = _one_step(True, 0.5, min_snr=max(snr - 1.0, 0.0) if snr > 1e-9 else -1.0)
    assert torch.equal(open_gate, corrected)


def test_diagnostics_report_the_snr_only_of_noisy_releases():
    p, q = torch.nn.Parameter(torch.zeros(16, 24)), torch.nn.Parameter(torch.zeros(8, 8))
    opt = Muon([p, q], lr=0.1, release_noise_std={p: 0.5, q: 0.0})
    p.grad, q.grad = torch.randn(p.shape), torch.randn(q.shape)
    opt.step()
    assert set(opt.diagnostics()["snr"]) == {p}  # q's release has no noise: its SNR is infinite, not logged
    opt = Muon([q], lr=0.1, release_noise_std={q: 0.0})
    q.grad = torch.randn(q.shape)
    opt.step()
    assert opt.diagnostics() == {}


def test_rejects_non_matrices():
    with pytest.raises(ValueError, match="matrices"):
        Muon([torch.nn.Parameter(torch.zeros(5))])


def test_dp_muonbc_reports_its_step_length_ratio_and_match_norm_makes_it_one():
    for match_norm, expect_longer in ((False, True), (True, False)):
        p = torch.nn.Parameter(torch.zeros(16, 24))
        opt = Muon([p], lr=0.1, bias_correction=True, match_norm=match_norm, release_noise_std={p: 1.0}, generator=torch.Generator().manual_seed(0))
        p.grad = torch.randn(p.shape, generator=torch.Generator().manual_seed(1))  # pure noise: SNR ≈ 0
        opt.step()
        (ratio,) = opt.diagnostics()["update_norm_ratio"].values()
        assert (ratio > 1.1) if expect_longer else ratio == pytest.approx(1.0, abs=1e-5)


def test_bias_correction_noise_std_step_uses_one_releases_std():
    """noise_std=step corrects with the per-step std, weaker than the buffer's after a few steps."""
    updates = {}
    for mode in ("buffer", "step"):
        p = torch.nn.Parameter(torch.zeros(12, 12))
        opt = Muon([p], lr=0.1, bias_correction=True, noise_std=mode, release_noise_std={p: 0.5}, generator=torch.Generator().manual_seed(0))
        for step in range(4):
            p.grad = torch.randn(p.shape, generator=torch.Generator().manual_seed(step))
            opt.step()
        updates[mode] = opt.diagnostics()["update_norm_ratio"][p]
    assert updates["step"] < updates["buffer"]
    with pytest.raises(ValueError, match="buffer, step"):
        Muon([torch.nn.Parameter(torch.zeros(4, 4))], bias_correction=True, noise_std="per_step")
