"""Oracle alignment: how well does Newton–Schulz of the noisy buffer point where the noise-free
buffer points?

Next to each Muon matrix's real momentum buffer M (fed with the released gradient g̃), this
tracks the noise-free buffer M₀ — the same recursion fed with the clipped sum / B before noise
— and logs per matrix: the true SNR ‖M₀‖²/(s²mn) (s: the public per-entry noise std of the
update), and the Frobenius cosines cos⟨F(M), F(M₀)⟩ and cos⟨F_BC(M), F(M₀)⟩ for the plain and
the bias-corrected orthogonalization, whichever of them the optimizer steps with. A single
draw's cosine mixes the correction's bias with its probes' variance, so beside it:
`oracle_cos_bc_mean`, the cosine of the map averaged over PROBE_PAIRS fresh probe pairs, and the
signals ⟨F_x, F(M₀)⟩/‖F(M₀)‖² of F(M) and of that average (how much of the noise-free direction
each step carries, whatever its length).

M₀ is a function of the private data without noise: these numbers are not covered by the
guarantee (logging.oracle_alignment, only with non-private diagnostics on). Nothing here
reaches the optimizer: the real buffer is mirrored, not read, and DP-MuonBC's probes for the
corrected alignment come from this component's own generator. The mirrors are saved with the
run's secret mechanism state (M₀ is the private signal without noise: never in checkpoint.pt,
which people share), so a resumed run continues them where they stood.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping

import torch

from ..optim.bias_correction import corrected_and_plain
from ..optim.momentum import MomentumRule, advance
from ..optim.newton_schulz import newton_schulz

PROBE_PAIRS = 16  # of the probe-averaged corrected map


def frobenius_cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    denominator = float(a.norm() * b.norm())
    return float((a * b).sum()) / denominator if denominator > 0 else math.nan


class OracleAlignment:
    """Mirrors a Muon optimizer's buffers with and without noise.

    The privatizer hands each step's noise-free release to `observe`; `step`, called after the
    release and before the optimizer steps, advances both buffers and returns the metrics.
    """

    def __init__(self, muon: torch.optim.Optimizer, names: Mapping[torch.Tensor, str], release_noise_std: Mapping[str, float], seed: int = 0):
        self.groups = muon.param_groups
        self.names = names
        self.release_std = release_noise_std
        self.generator = torch.Generator().manual_seed(seed)  # never the optimizer's probe stream
        self.noisy: dict[torch.Tensor, torch.Tensor] = {}
        self.clean: dict[torch.Tensor, torch.Tensor] = {}
        self.noise_var: dict[torch.Tensor, float] = {}
        self._noise_free: Mapping[str, torch.Tensor] = {}

    def observe(self, noise_free: Mapping[str, torch.Tensor]) -> None:
        """The clipped sum / B of this step, before noise (from the privatizer)."""
        self._noise_free = noise_free

    def step(self) -> dict:
        """Advance both buffers of every matrix (p.grad holds the release) and return the metrics
        row fields."""
        noise_free, self._noise_free = self._noise_free, {}
        snr, plain, corrected, corrected_mean, signal_plain, signal_bc = {}, {}, {}, {}, {}, {}
        for group in self.groups:
            rule = MomentumRule.create(group["momentum"], group["momentum_kind"], group["nesterov"])
            ns = dict(steps=group["ns_steps"], coefficients=group["ns_coefficients"], normalize=group["ns_normalize"])
            for p in group["params"]:
                if p.grad is None:
                    continue
                name = self.names[p]
                update, update_clean, std = self._advance(p, noise_free[name], rule)
                target = newton_schulz(update_clean, **ns)
                snr[name] = float(update_clean.pow(2).sum()) / (std**2 * update_clean.numel()) if std > 0 else math.inf
                bc_std = self.release_std[name] if group.get("noise_std") == "step" else std
                correction = dict(probe_scale=group["probe_scale"], generator=self.generator, match_norm=group.get("match_norm", False), **ns)
                bc, f = corrected_and_plain(update, bc_std, num_probes=max(1, group["num_probes"]), **correction)
                bc_mean, _ = corrected_and_plain(update, bc_std, num_probes=PROBE_PAIRS, **correction)
                plain[name] = frobenius_cosine(f, target)
                corrected[name] = frobenius_cosine(bc, target)
                corrected_mean[name] = frobenius_cosine(bc_mean, target)
                signal_plain[name], signal_bc[name] = (float((x * target).sum() / target.pow(2).sum()) for x in (f, bc_mean))
        if not snr:
            return {}
        return {
            "oracle_snr": snr,
            "oracle_snr_median": statistics.median(snr.values()),
            "oracle_cos_plain": plain,
            "oracle_cos_plain_median": statistics.median(plain.values()),
            "oracle_cos_bc": corrected,
            "oracle_cos_bc_median": statistics.median(corrected.values()),
            "oracle_cos_bc_mean": corrected_mean,
            "oracle_cos_bc_mean_median": statistics.median(corrected_mean.values()),
            "oracle_signal_plain": signal_plain,
            "oracle_signal_plain_median": statistics.median(signal_plain.values()),
            "oracle_signal_bc": signal_bc,
            "oracle_signal_bc_median": statistics.median(signal_bc.values()),
        }

    def state_dict(self) -> dict:
        """Both mirrors, their noise variances and the probe generator, by parameter name."""
        return {
            "noisy": {self.names[p]: b for p, b in self.noisy.items()},
            "clean": {self.names[p]: b for p, b in self.clean.items()},
            "noise_var": {self.names[p]: v for p, v in self.noise_var.items()},
            "generator": self.generator.get_state(),
        }

    def load_state_dict(self, state: dict) -> None:
        param = {name: p for p, name in self.names.items()}
        self.noisy = {param[n]: b.to(param[n].device) for n, b in state["noisy"].items()}
        self.clean = {param[n]: b.to(param[n].device) for n, b in state["clean"].items()}
        self.noise_var = {param[n]: float(v) for n, v in state["noise_var"].items()}
        self.generator.set_state(state["generator"])

    def _advance(self, p: torch.Tensor, noise_free: torch.Tensor, rule: MomentumRule):
        if p not in self.noisy:
            self.noisy[p] = torch.zeros_like(p, dtype=torch.float32)
            self.clean[p] = torch.zeros_like(p, dtype=torch.float32)
            self.noise_var[p] = 0.0
        grad_var = self.release_std[self.names[p]] ** 2
        update_var = rule.update_variance(self.noise_var[p], grad_var)
        self.noise_var[p] = rule.buffer_variance(self.noise_var[p], grad_var)
        update = advance(self.noisy[p], p.grad.float(), rule).clone()
        update_clean = advance(self.clean[p], noise_free.float().to(p.device), rule).clone()
        return update, update_clean, math.sqrt(update_var)
