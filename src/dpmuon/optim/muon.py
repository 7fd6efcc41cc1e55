"""Muon (and its bias-corrected variant) as post-processing of the released gradient.

The optimizer reads p.grad — for a private run that is the released g̃ and nothing else — and
the public per-entry noise std of g̃ for each matrix (`release_noise_std`), which it carries
through the momentum recursion to know the noise std of every matrix it orthogonalizes.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterable, Mapping

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from .bias_correction import corrected_and_plain, draw_probes
from .choices import BC_NOISE_STDS, UPDATE_SCALES
from .momentum import MomentumRule, advance
from .newton_schulz import newton_schulz
from .sharded import gather_to_owners, scatter_from_owners

LAYOUTS = ("out_in", "in_out")


def update_scale_factor(rule: str, shape: torch.Size, layout: str = "out_in") -> float:
    """Learning-rate multiplier for an orthogonalized update of a (stored) matrix shape.

    "reference": sqrt(max(1, fan_out/fan_in)) as in reference Muon (HF Conv1D stores weights as
    (in, out), hence `layout`); "adam_rms": 0.2·sqrt(max(m, n)), which makes the update's RMS
    match a typical Adam update; "none": 1.
    """
    if layout not in LAYOUTS:
        raise ValueError(f"unknown matrix layout {layout!r}; expected one of {LAYOUTS}")
    rows, cols = shape[-2], shape[-1]
    fan_out, fan_in = (rows, cols) if layout == "out_in" else (cols, rows)
    if rule == "reference":
        return math.sqrt(max(1.0, fan_out / fan_in))
    if rule == "adam_rms":
        return 0.2 * math.sqrt(max(rows, cols))
    if rule == "none":
        return 1.0
    raise ValueError(f"unknown update scale {rule!r}; expected one of {UPDATE_SCALES}")


def estimate_snr(matrix: torch.Tensor, noise_std: float) -> float:
    """Signal-to-noise of a noisy matrix from released quantities only.

    ‖M‖_F² − s²·m·n is unbiased for the energy of the noise-free matrix, so the ratio to the
    noise energy s²·m·n estimates the SNR (inf without noise). It is not clamped: at low SNR it
    is often negative, and clamping at 0 would bias every average of it upwards; only the
    `min_snr` gate compares it with a threshold.
    """
    noise_energy = noise_std**2 * matrix.numel()
    if noise_energy == 0:
        return math.inf
    signal_energy = float(matrix.float().pow(2).sum()) - noise_energy
    return signal_energy / noise_energy


class Muon(torch.optim.Optimizer):
    """Momentum + Newton–Schulz orthogonalization for 2-D matrices; optional DP-MuonBC."""

    def __init__(
        self,
        params: Iterable[torch.Tensor],
        lr: float = 0.02,
        momentum: float = 0.95,
        momentum_kind: str = "heavy_ball",
        nesterov: bool = False,
        ns_steps: int = 5,
        ns_coefficients="quintic",
        ns_normalize: str = "frobenius",
        ns_dtype: torch.dtype | None = None,
        update_scale: str = "adam_rms",
        weight_decay: float = 0.0,
        bias_correction: bool = False,
        probe_scale: float = 1.0,
        num_probes: int = 1,
        min_snr: float | None = None,
        match_norm: bool = False,
        noise_std: str = "buffer",
        release_noise_std: Mapping[torch.Tensor, float] | None = None,
        layouts: Mapping[torch.Tensor, str] | None = None,
        generator: torch.Generator | None = None,
    ):
        if lr < 0:
            raise ValueError(f"learning rate must be >= 0, got {lr}")
        MomentumRule.create(momentum, momentum_kind, nesterov)  # validates early
        if noise_std not in BC_NOISE_STDS:
            raise ValueError(f"unknown bias-correction noise std {noise_std!r}; valid: {', '.join(BC_NOISE_STDS)}")
        defaults = dict(
            lr=lr,
            momentum=momentum,
            momentum_kind=momentum_kind,
            nesterov=nesterov,
            ns_steps=ns_steps,
            ns_coefficients=ns_coefficients,
            ns_normalize=ns_normalize,
            update_scale=update_scale,
            weight_decay=weight_decay,
            bias_correction=bias_correction,
            probe_scale=probe_scale,
            num_probes=num_probes,
            min_snr=min_snr,
            match_norm=match_norm,
            noise_std=noise_std,
        )
        super().__init__(params, defaults)
        for group in self.param_groups:
            for p in group["params"]:
                if p.ndim != 2:
                    raise ValueError(f"Muon only updates matrices; got a parameter of shape {tuple(p.shape)}")
                update_scale_factor(group["update_scale"], p.shape)  # validates early
        release_noise_std = release_noise_std or {}
        layouts = layouts or {}
        self._release_std = {p: float(release_noise_std.get(p, 0.0)) for g in self.param_groups for p in g["params"]}
        self._layout = {p: layouts.get(p, "out_in") for g in self.param_groups for p in g["params"]}
        self.ns_dtype = ns_dtype
        self.generator = generator
        # Last step's SNR estimate of the matrix fed to Newton–Schulz, per parameter.
        self.snr: dict[torch.Tensor, float] = {}
        # Last step's ‖F_BC(M)‖_F / ‖F(M)‖_F of each corrected matrix: how much longer the step is.
        self.norm_ratio: dict[torch.Tensor, float] = {}

    def diagnostics(self) -> dict[str, dict[torch.Tensor, float]]:
        """Per-parameter quantities of the last step, computed from the release only (public)."""
        # Without release noise (a non-private run) the SNR is infinite: nothing to report.
        snr = {p: v for p, v in self.snr.items() if math.isfinite(v)}
        found = {"snr": snr, "update_norm_ratio": dict(self.norm_ratio)}
        return {key: values for key, values in found.items() if values}

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            self._step_group(group)
        return loss

    def _step_group(self, group: dict) -> None:
        rule = MomentumRule.create(group["momentum"], group["momentum_kind"], group["nesterov"])
        params = [p for p in group["params"] if p.grad is not None]
        moved = [self._momentum_update(p, p.grad, rule) for p in params]
        if any(isinstance(p, DTensor) for p in params):
            # FSDP2's row shards: each matrix is orthogonalized whole, once, on its owner (optim/sharded.py).
            shards, rows = [u.to_local() for u, _ in moved], [p.shape[0] for p in params]
            mesh_group = params[0].device_mesh.get_group()
            wholes = gather_to_owners(shards, rows, mesh_group)
            ortho = scatter_from_owners(self._orthogonalized(group, params, wholes, [s for _, s in moved], mesh_group), shards, rows, mesh_group)
            targets = [p.to_local() for p in params]  # without autograd, the shard itself: updated in place
        else:
            ortho = self._orthogonalized(group, params, [u for u, _ in moved], [s for _, s in moved])
            targets = params
        for p, target, o in zip(params, targets, ortho):
            scale = update_scale_factor(group["update_scale"], p.shape, self._layout[p])
            if group["weight_decay"]:
                target.mul_(1 - group["lr"] * group["weight_decay"])
            target.add_(o.to(target.dtype), alpha=-group["lr"] * scale)

    def _orthogonalized(
        self, group: dict, params: list[torch.Tensor], matrices: list[torch.Tensor | None], stds: list[float], mesh_group=None
    ) -> list[torch.Tensor | None]:
        """F(M) (or F_BC(M)) of each matrix this rank holds whole (None: another rank's), with
        matrices of equal shape and correction mode orthogonalized in one batched call. Sharded
        (`mesh_group`), the SNRs and norm ratios are gathered from the owners, so every rank has
        them and decides alike, and each batch's probes are drawn whole on every rank: the
        generator then moves, and each matrix gets, what one process draws."""
        snr = {i: estimate_snr(m, s) for i, (m, s) in enumerate(zip(matrices, stds)) if m is not None}
        snr = _merged(snr, mesh_group)
        self.snr.update({p: snr[i] for i, p in enumerate(params)})
        pending: dict[tuple, list[int]] = defaultdict(list)
        noise_stds = [self._release_std[p] if group["noise_std"] == "step" else s for p, s in zip(params, stds)]
        for i, p in enumerate(params):
            correct = group["bias_correction"] and noise_stds[i] > 0 and (group["min_snr"] is None or snr[i] > group["min_snr"])
            pending[(tuple(p.shape), correct)].append(i)
        ns_kwargs = dict(steps=group["ns_steps"], coefficients=group["ns_coefficients"], normalize=group["ns_normalize"], dtype=self.ns_dtype)
        out: list[torch.Tensor | None] = [None] * len(params)
        ratios = {}
        for (shape, correct), items in pending.items():
            here = [j for j, i in enumerate(items) if matrices[i] is not None]
            probes = None
            if correct and group["num_probes"] > 0:
                device = params[items[0]].device
                probes = draw_probes((len(items), *shape), group["num_probes"], self.generator, torch.float32, device)[:, here]
            if not here:
                continue
            stacked = torch.stack([matrices[items[j]] for j in here])
            if correct:
                stds_here = torch.tensor([noise_stds[items[j]] for j in here], dtype=stacked.dtype, device=stacked.device)
                ortho, plain = corrected_and_plain(
                    stacked, stds_here.view(-1, 1, 1), probe_scale=group["probe_scale"], num_probes=group["num_probes"],
                    generator=self.generator, match_norm=group["match_norm"], probes=probes, **ns_kwargs,
                )  # fmt: skip
                ratios.update({items[j]: float(r) for j, r in zip(here, torch.linalg.matrix_norm(ortho) / torch.linalg.matrix_norm(plain))})
            else:
                ortho = newton_schulz(stacked, **ns_kwargs)
            for j, o in zip(here, ortho):
                out[items[j]] = o
        self.norm_ratio = {params[i]: r for i, r in _merged(ratios, mesh_group).items()}
        return out

    def _momentum_update(self, p: torch.Tensor, grad: torch.Tensor, rule: MomentumRule):
        """Advance the buffer of p; return the matrix to orthogonalize and its noise std."""
        state = self.state[p]
        if "momentum_buffer" not in state:
            state["momentum_buffer"] = torch.zeros_like(p, dtype=torch.float32)
            state["buffer_noise_var"] = 0.0
        buf = state["momentum_buffer"]
        grad = grad.float()
        grad_var = self._release_std[p] ** 2
        update_var = rule.update_variance(state["buffer_noise_var"], grad_var)
        state["buffer_noise_var"] = rule.buffer_variance(state["buffer_noise_var"], grad_var)
        return advance(buf, grad, rule), math.sqrt(update_var)


def _merged(found: dict[int, float], mesh_group) -> dict[int, float]:
    """The ranks' values by matrix index, merged on every rank (unchanged in one process)."""
    if mesh_group is None:
        return found
    everyone = [None] * dist.get_world_size(mesh_group)
    dist.all_gather_object(everyone, found, group=mesh_group)
    return {i: v for part in everyone for i, v in part.items()}
