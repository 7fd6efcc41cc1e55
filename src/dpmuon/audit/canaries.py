"""The audited training runs: canaries put in with probability 1/2, run end to end through the
mechanism (the loop's lot sampler → Privatizer.release → SGD), scored by the auditor; the
scenarios (`MODES`) and the deliberately broken mechanisms (`BREAKS`)."""

from __future__ import annotations

import time
from collections.abc import Iterator, Mapping
from dataclasses import asdict, dataclass
from typing import Any, Protocol

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from transformers import GPT2Config, GPT2LMHeadModel

from ..privacy.accountant import PrivacyAccountant, calibrate_noise_multiplier
from ..privacy.blocks import BlockPartition, build_partition
from ..privacy.noise import GaussianNoise
from ..privacy.privatizer import Privatizer
from ..privacy.sampling import PoissonLotSampler, build_lot_sampler
from .bound import OneRunBound, audit_ceiling, one_run_audit, sampled_release_log_likelihood_ratio

METHOD = "one-run audit (Steinke, Nasr & Jagielski 2023, (ε, δ) bound), white-box canaries, likelihood-ratio score over all releases"
# Each break is a deliberately wrong mechanism whose accountant is still told the calibrated σ,
# so it claims the same ε as the correct one.
BREAKS = ("none", "tenth_noise", "half_noise", "per_block_noise", "no_clip")
BREAK_LABELS = {
    "none": "correct",
    "tenth_noise": "broken: noise ÷ 10",
    "half_noise": "broken: noise ÷ 2",
    "per_block_noise": "broken: noise per block (÷ √K)",
    "no_clip": "broken: clipping off",
}
NOISE_DIVISORS = {"tenth_noise": 10.0, "half_noise": 2.0}
# The no_clip break's threshold as a multiple of C: far above any gradient the audit's models
# produce (Dirac canaries have norm 100 C; the tiny GPT-2's gradients are O(1) with C = 0.01).
UNCLIPPED_HEADROOM = 1e6



# --- the audited training run ----------------------------------------------------------------


@dataclass(frozen=True)
class AuditSetup:
    """Everything that fixes one audit; all of it is public (none depends on which canaries are in)."""

    name: str
    canaries: int
    ordinary: int  # non-canary training points
    expected_lot_size: int
    steps: int
    epsilon: float  # the claim: σ is calibrated to (ε, δ) for q and steps
    delta: float
    model: str = "dirac"  # "dirac" or "gpt2"
    blocks: int = 1  # dirac: the number of tables, each a block (gpt2: one block per tensor)
    ordinary_rows: int = 32  # the rows (dirac) or tokens (gpt2) the ordinary points share
    clip_norm: float = 0.1
    canary_norm: float = 10.0  # dirac: ‖canary gradient‖ in each block, ≫ every C_W
    lr: float = 1.0
    accountant: str = "prv"
    engine: str = "fast"
    confidence: float = 0.95
    guess_fractions: tuple[float, ...] = (0.02,)
    tails: str = "upper"
    # The score's likelihood ratio assumes noise σ / divisor: by Neyman–Pearson the most
    # powerful test against a mechanism with that much less noise than claimed (2: the
    # moderate breaks this audit is meant to catch). It is an assumption of the score only.
    score_noise_divisor: float = 2.0
    micro_batch_size: int = 4096
    breaks: tuple[str, ...] = BREAKS
    seed: int = 0

    def __post_init__(self):
        if self.model not in WORLDS:
            raise ValueError(f"unknown canary model {self.model!r}; valid: {', '.join(WORLDS)}")
        unknown = [b for b in self.breaks if b not in BREAKS]
        if unknown:
            raise ValueError(f"unknown break(s) {unknown}; valid: {', '.join(BREAKS)}")

    @property
    def dataset_size(self) -> int:
        """N: ordinary points plus one slot per canary (a blank when it is out)."""
        return self.ordinary + self.canaries

    @property
    def sample_rate(self) -> float:
        """q = L/N, exactly as the training loop's sampler derives it."""
        return self.expected_lot_size / self.dataset_size


class CanaryWorld(Protocol):
    """A model, its training set with canary slots, and the auditor's view of each release."""

    model: nn.Module

    def __len__(self) -> int: ...

    def batch(self, indices: torch.Tensor) -> dict[str, torch.Tensor]: ...

    def loss(self, model: nn.Module, batch: Mapping[str, Any]) -> torch.Tensor: ...

    def partition(self, clip_norm: float) -> BlockPartition: ...

    def canary_projections(self, claimed: BlockPartition, expected_lot_size: float) -> tuple[np.ndarray, np.ndarray]:
        """(⟨x, c_j⟩ / ‖c_j‖², ‖c_j‖) per canary j, for the release x = L · p.grad now on the
        model and c_j the canary's gradient clipped to the claimed thresholds."""
        ...


class DiracTables(nn.Module):
    """K one-column embedding tables; the output for row r is Σ_W E_W[r]."""

    def __init__(self, rows: int, blocks: int):
        super().__init__()
        self.tables = nn.ModuleList(nn.Embedding(rows, 1) for _ in range(blocks))
        for table in self.tables:
            nn.init.zeros_(table.weight)

    def forward(self, row: torch.Tensor) -> torch.Tensor:
        return sum(table(row).squeeze(-1) for table in self.tables)


class DiracCanaries:
    """Canary slot j reads row j of every table; ordinary point i reads a shared row m + (i mod R).

    Per-example loss −a_i · Σ_W E_W[row_i]. Linear on purpose: example i's gradient is −a_i in
    its row of each table whatever the weights, so a canary (a = canary_norm ≫ C_W) adds exactly
    −C_W in its row of block W every time it is sampled. A curved loss would shrink the canary
    gradient once the model fits it — below C_W at some step the trajectory decides. An excluded
    canary's slot has a = 0 (a blank); ordinary points have a ~ N(0, 1), mostly ≫ C_W: clipped,
    like most examples in DP fine-tuning.
    """

    def __init__(self, setup: AuditSetup, included: np.ndarray, generator: torch.Generator):
        m = setup.canaries
        self.canaries = m
        self.model = DiracTables(m + setup.ordinary_rows, setup.blocks)
        self.rows = torch.cat([torch.arange(m), m + torch.arange(setup.ordinary) % setup.ordinary_rows])
        slots = setup.canary_norm * torch.from_numpy(included).float()
        self.coefficients = torch.cat([slots, torch.randn(setup.ordinary, generator=generator)])

    def __len__(self) -> int:
        return len(self.rows)

    def batch(self, indices: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"row": self.rows[indices], "coefficient": self.coefficients[indices]}

    def loss(self, model: nn.Module, batch: Mapping[str, Any]) -> torch.Tensor:
        return -batch["coefficient"] * model(batch["row"])

    def partition(self, clip_norm: float) -> BlockPartition:
        """Every table a block, C_W = C/√K (the `split` rule): Δ = C."""
        names = [name for name, _ in self.model.named_parameters()]
        return build_partition(names, "per_matrix", clip_norm, "split", matrix_names=names)

    def canary_projections(self, claimed: BlockPartition, expected_lot_size: float) -> tuple[np.ndarray, np.ndarray]:
        # c_j is −C_W at row j of table W, so ‖c_j‖ = Δ and ⟨x, c_j⟩ = −Σ_W C_W x_W[j].
        along = sum(
            block.threshold * table.weight.grad[: self.canaries, 0].double()
            for block, table in zip(claimed.blocks, self.model.tables)
        )
        sensitivity = claimed.sensitivity
        projection = (-expected_lot_size / sensitivity**2 * along).numpy()
        return projection, np.full(self.canaries, sensitivity)


class GPT2Canaries:
    """A tiny GPT-2 (2 layers, width 16, head untied, dropout off); every tensor is its own block
    with the `by_size` thresholds, so the token embedding's C_W is a large share of Δ.

    Canary j is the two-token sequence (j, j); ordinary points are pairs of R other tokens. Only
    canary j reads token j, so its embedding row's gradient is canary j's alone (the untied
    head keeps every other example's logit gradients out of that row). The per-example loss is
    the next-token NLL, ×0 in an excluded canary's slot (a blank).
    """

    width, layers, heads = 16, 2, 2
    embedding = "transformer.wte.weight"

    def __init__(self, setup: AuditSetup, included: np.ndarray, generator: torch.Generator):
        m = setup.canaries
        self.canaries = m
        config = GPT2Config(
            vocab_size=m + setup.ordinary_rows, n_positions=2, n_embd=self.width, n_layer=self.layers, n_head=self.heads,
            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, tie_word_embeddings=False, bos_token_id=None, eos_token_id=None,
        )
        with torch.random.fork_rng():  # transformers initializes from the global generator
            torch.manual_seed(int(torch.randint(2**31, (), generator=generator)))
            self.model = GPT2LMHeadModel(config)
        canary_tokens = torch.arange(m).unsqueeze(1).expand(m, 2)
        ordinary_tokens = m + torch.randint(setup.ordinary_rows, (setup.ordinary, 2), generator=generator)
        self.tokens = torch.cat([canary_tokens, ordinary_tokens])
        self.weights = torch.cat([torch.from_numpy(included).float(), torch.ones(setup.ordinary)])

    def __len__(self) -> int:
        return len(self.tokens)

    def batch(self, indices: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"input_ids": self.tokens[indices], "weight": self.weights[indices]}

    def loss(self, model: nn.Module, batch: Mapping[str, Any]) -> torch.Tensor:
        return batch["weight"] * self._next_token_nll(model, batch["input_ids"], model.transformer.wte(batch["input_ids"]))

    @staticmethod
    def _next_token_nll(model: nn.Module, tokens: torch.Tensor, embeddings: torch.Tensor) -> torch.Tensor:
        # Batch-shaped position ids: the fast engine needs every hooked tensor batch-first.
        positions = torch.arange(tokens.shape[1]).expand_as(tokens)
        logits = model(inputs_embeds=embeddings, position_ids=positions).logits
        return F.cross_entropy(logits[:, 0], tokens[:, 1], reduction="none")

    def partition(self, clip_norm: float) -> BlockPartition:
        sizes = {name: p.numel() for name, p in self.model.named_parameters()}
        return build_partition(list(sizes), "per_matrix", clip_norm, "by_size", other_blocks="per_tensor", sizes=sizes)

    def canary_gradients(self) -> torch.Tensor:
        """[m, width] each canary's gradient on its embedding row at the current weights — all
        of its token-embedding gradient — recomputed white-box, for every canary in or out."""
        tokens = self.tokens[: self.canaries]
        embeddings = self.model.transformer.wte(tokens).detach().requires_grad_(True)
        (grad,) = torch.autograd.grad(self._next_token_nll(self.model, tokens, embeddings).sum(), embeddings)
        return grad.sum(1)  # both positions read the same row

    def canary_projections(self, claimed: BlockPartition, expected_lot_size: float) -> tuple[np.ndarray, np.ndarray]:
        threshold = claimed.blocks[claimed.block_index()[self.embedding]].threshold
        grads = self.canary_gradients().double()
        clipped = grads * (threshold / grads.norm(dim=1, keepdim=True)).clamp(max=1.0)
        released = expected_lot_size * self.model.transformer.wte.weight.grad[: self.canaries].double()
        norms = clipped.norm(dim=1)
        return ((released * clipped).sum(1) / norms.square()).numpy(), norms.numpy()


WORLDS = {"dirac": DiracCanaries, "gpt2": GPT2Canaries}


# One-run audits refute a claim only up to a ceiling: every guess right refutes ε ≈ log(r/3),
# but the δ term 2mδ·(…) grows with the m canaries, so the ceiling at a guessed fraction f of
# them levels off near log(fβ/δ) however large m is (4.3 at f = 0.02, 4.6 at 0.03; 8.1 at
# f = 0.9). A Gaussian mechanism's guesses are accurate only deep in the tail, so power against
# noise ÷ 2 needs a small f of many canaries and a score that uses every release; small q with
# many steps (each canary sampled qT = 1 times on average) beats fewer, larger steps at the same
# ε. Idealized simulation at ε = 2, 10⁵ canaries, f = 0.03, q = 0.002, 500 steps: the correct
# mechanism's bound ~0.3, noise ÷ √3 (the per-block break with K = 3) ~3.2, noise ÷ 2 ~4.4
# (ceiling 4.6); one full-batch step (q = 1) reaches only ~2.2–2.6 for noise ÷ 2. The claim ε = 8 needs
# nearly every canary guessed (f = 0.9, both tails), which only gross breaks allow.
def _dirac(
    name: str, canaries: int, sample_rate: float, steps: int, fraction: float, ordinary: int = 1000, epsilon: float = 2.0, **options
) -> AuditSetup:
    """A Dirac scenario at δ = 1e-5 with L = qN rounded, guessing about `fraction` of the canaries."""
    lot = round(sample_rate * (canaries + ordinary))
    return AuditSetup(name, canaries, ordinary, lot, steps, epsilon, 1e-5, guess_fractions=(fraction,), **options)


MODES: dict[str, tuple[AuditSetup, ...]] = {
    "quick": (
        _dirac("dirac-fast", 30_000, 0.005, 200, 0.02, blocks=3),
        _dirac("dirac-opacus", 2000, 0.01, 100, 0.2, ordinary=500, blocks=2, engine="opacus", breaks=("none", "tenth_noise", "no_clip")),
    ),
    "full": (
        *(_dirac("dirac-fast", 100_000, 0.002, 500, 0.03, blocks=3, seed=seed) for seed in range(5)),
        _dirac("dirac-opacus", 30_000, 0.005, 200, 0.02, blocks=3, engine="opacus", micro_batch_size=512),
        _dirac(
            "dirac-opacus-eps8", 20_000, 0.5, 30, 0.9, ordinary=500, epsilon=8.0, engine="opacus", tails="both",
            micro_batch_size=1024, breaks=("none", "tenth_noise", "no_clip"),
        ),
        AuditSetup(
            "gpt2-fast", canaries=2000, ordinary=1000, expected_lot_size=30, steps=100, epsilon=2.0, delta=1e-5, model="gpt2",
            clip_norm=0.01, guess_fractions=(0.2,), micro_batch_size=256, breaks=("none", "tenth_noise", "no_clip"),
        ),
    ),
}


class ScaledGaussianNoise(GaussianNoise):
    """N(0, scale²) draws in place of N(0, 1): how a broken mechanism adds noise other than
    the block stds the privatizer computed (and the accountant was told about)."""

    def __init__(self, scale: float, generator: torch.Generator):
        super().__init__(generator)
        self.scale = scale

    def standard_normal(self, shape: torch.Size, device: torch.device, dtype=torch.float32) -> torch.Tensor:
        return self.scale * super().standard_normal(shape, device, dtype)


def per_block_stds(partition: BlockPartition, noise_multiplier: float) -> list[float]:
    """The per-block miscalibration: std_W = σ·C_W, as if each block were a mechanism of its own
    with sensitivity C_W and the whole budget — short of the joint σ·Δ by Δ/C_W (√K for equal
    thresholds), since one example moves all K blocks at once."""
    return [noise_multiplier * block.threshold for block in partition.blocks]


def break_settings(breakage: str, partition: BlockPartition) -> tuple[float, float]:
    """(threshold multiplier, noise scale) that turn the correct privatizer into the break.

    The noise scale multiplies the N(0, 1) draws, so the release std is scale · σ·Δ while the
    privatizer (and the accountant) still work with σ. no_clip raises every threshold far above
    any gradient and scales the noise down by the same factor: still σ·C, calibrated to the
    claimed sensitivity, but the canaries' contributions are no longer bounded by it.
    """
    if breakage == "none":
        return 1.0, 1.0
    if breakage in NOISE_DIVISORS:
        return 1.0, 1 / NOISE_DIVISORS[breakage]
    if breakage == "per_block_noise":
        # std σ·C_W where the privatizer draws σ·Δ: a noise scale C_W/Δ, one number for all blocks
        # only if their thresholds are equal.
        scales = {std / partition.sensitivity for std in per_block_stds(partition, 1.0)}
        if len(scales) != 1:
            raise ValueError("the per-block break is realized by one noise scale: it needs equal block thresholds")
        return 1.0, scales.pop()
    if breakage == "no_clip":
        return UNCLIPPED_HEADROOM, 1 / UNCLIPPED_HEADROOM
    raise ValueError(f"unknown break {breakage!r}; valid: {', '.join(BREAKS)}")


def build_mechanism(world: CanaryWorld, setup: AuditSetup, noise_multiplier: float, breakage: str, generator: torch.Generator) -> Privatizer:
    """The privatizer under audit; `breakage` picks a deliberately broken variant (BREAKS)."""
    threshold_factor, noise_scale = break_settings(breakage, world.partition(setup.clip_norm))
    return Privatizer(
        model=world.model,
        partition=world.partition(setup.clip_norm * threshold_factor),
        noise_multiplier=noise_multiplier,
        expected_lot_size=setup.expected_lot_size,
        sample_rate=setup.sample_rate,
        accountant=PrivacyAccountant(setup.delta, setup.accountant),
        noise=ScaledGaussianNoise(noise_scale, generator),
        engine=setup.engine,
    )


def build_sampler(world: CanaryWorld, setup: AuditSetup, generator: torch.Generator) -> PoissonLotSampler:
    """The training loop's lot sampler, built by the loop's own call from N and L."""
    return build_lot_sampler("poisson", len(world), setup.expected_lot_size, generator)


@dataclass(frozen=True)
class Seeds:
    """Independent streams: canary inclusion, data, lot sampling, release noise."""

    inclusion: int
    data: int
    sampling: int
    noise: int

    @classmethod
    def spawn(cls, seed: int) -> Seeds:
        return cls(*(int(s) for s in np.random.SeedSequence(seed).generate_state(4)))


def draw_inclusion(canaries: int, seed: int) -> np.ndarray:
    """Each canary in with probability 1/2, independently: the S of the one-run theorem."""
    return np.random.default_rng(seed).random(canaries) < 0.5


def _micro_batches(world: CanaryWorld, lot: list[int], size: int) -> Iterator[dict[str, torch.Tensor]]:
    indices = torch.as_tensor(lot, dtype=torch.long)
    for start in range(0, len(indices), size):
        yield world.batch(indices[start : start + size])


def train_and_score(setup: AuditSetup, included: np.ndarray, noise_multiplier: float, breakage: str, seeds: Seeds) -> tuple[np.ndarray, float]:
    """Train with the mechanism under audit; return (canary scores, the accountant's ε).

    Score: Σ over releases of the per-release log-likelihood ratio, computed from the claim
    alone — σ (÷ score_noise_divisor), q and the claimed thresholds — never from the mechanism's
    internals: the auditor tests what the accountant was told.
    """
    world: CanaryWorld = WORLDS[setup.model](setup, included, torch.Generator().manual_seed(seeds.data))
    claimed = world.partition(setup.clip_norm)
    assumed_noise_std = noise_multiplier / setup.score_noise_divisor * claimed.sensitivity
    privatizer = build_mechanism(world, setup, noise_multiplier, breakage, torch.Generator().manual_seed(seeds.noise))
    sampler = build_sampler(world, setup, torch.Generator().manual_seed(seeds.sampling))
    optimizer = torch.optim.SGD(world.model.parameters(), lr=setup.lr)  # post-processing of g̃
    scores = np.zeros(setup.canaries)
    try:
        for _ in range(setup.steps):
            privatizer.release(_micro_batches(world, sampler.next_lot(), setup.micro_batch_size), world.loss)
            projection, norm = world.canary_projections(claimed, setup.expected_lot_size)
            scores += sampled_release_log_likelihood_ratio(projection, norm / assumed_noise_std, setup.sample_rate)
            optimizer.step()
    finally:
        privatizer.close()
    return scores, privatizer.epsilon()


@dataclass(frozen=True)
class AuditResult:
    scenario: str
    seed: int
    mechanism: str  # "correct" or the break's label
    engine: str
    claimed_epsilon: float  # the accountant's ε after the run
    delta: float
    noise_multiplier: float  # the calibrated σ the accountant was told
    bound: OneRunBound
    ceiling: float  # the largest bound this design could report
    seconds: float
    method: str = METHOD

    @property
    def detected(self) -> bool:
        return self.bound.epsilon > self.claimed_epsilon

    @property
    def verdict(self) -> str:
        return "DETECTED: lb > ε" if self.detected else "PASS: lb ≤ ε"

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "detected": self.detected, "verdict": self.verdict}


def calibrated_noise_multiplier(setup: AuditSetup) -> float:
    return calibrate_noise_multiplier(setup.epsilon, setup.delta, setup.sample_rate, setup.steps, setup.accountant)


def audit_mechanism(setup: AuditSetup, breakage: str, noise_multiplier: float | None = None) -> AuditResult:
    """One audited training run of the correct (`none`) or a broken mechanism."""
    start = time.perf_counter()
    sigma = calibrated_noise_multiplier(setup) if noise_multiplier is None else noise_multiplier
    seeds = Seeds.spawn(setup.seed)
    included = draw_inclusion(setup.canaries, seeds.inclusion)
    scores, claimed = train_and_score(setup, included, sigma, breakage, seeds)
    bound = one_run_audit(scores, included, setup.delta, setup.confidence, setup.guess_fractions, setup.tails)
    return AuditResult(
        scenario=setup.name,
        seed=setup.seed,
        mechanism=BREAK_LABELS[breakage],
        engine=setup.engine,
        claimed_epsilon=claimed,
        delta=setup.delta,
        noise_multiplier=sigma,
        bound=bound,
        ceiling=audit_ceiling(setup.canaries, setup.delta, setup.confidence, setup.guess_fractions),
        seconds=time.perf_counter() - start,
    )


def run_audits(setup: AuditSetup, breakages: tuple[str, ...] | None = None) -> list[AuditResult]:
    """Audit each mechanism (default: the scenario's) on the same canaries, seeds and σ."""
    sigma = calibrated_noise_multiplier(setup)
    return [audit_mechanism(setup, breakage, sigma) for breakage in (setup.breaks if breakages is None else breakages)]


def expected_verdict(result: AuditResult) -> bool:
    """The correct mechanism must pass; a broken one must be caught wherever the design can."""
    if result.mechanism == BREAK_LABELS["none"]:
        return not result.detected
    return result.detected or result.ceiling <= result.claimed_epsilon
