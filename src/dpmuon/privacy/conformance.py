"""What user code must do for per-example clipping to bound one example's influence, checked by
behaviour before anything is released or charged (the privatizer calls these; driver, façade and
DPTrainer all release through it).

- `check_first_micro_batch` (a public stand-in of the first micro-batch of a privatizer's first
  release, `public_stand_in`: the check must not depend on the lot's values): `loss_fn`
  returns one finite-somewhere loss per row, shape [B]; no module holding trainable parameters is
  computed once and broadcast over the rows; no example's loss depends on another example,
  neither through the gradient (a module or the loss mixing rows: batch-norm statistics, a mean
  over the micro-batch) nor through the values (a loss divided by the micro-batch's token count,
  Hugging Face's `num_items_in_batch`; a weight by position).
- `check_user_code` (make_private, before the mechanism exists): the same on the training set's
  first examples, and no example's loss depends on the others through the way they are collated
  (a loss normalized by the padded width).
- `StateGuard` (every release): no buffer, tensor attribute or parameter of the model is written
  while the release runs — a buffer written from private examples (running statistics) is
  published with the model outside the guarantee, and a cache kept across calls shapes later
  releases. Buffers and attributes are restored on any refusal.

Each refusal is one UserError line naming the loss or the module.
"""

from __future__ import annotations

import warnings
from collections import Counter
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.autograd.graph import GradientEdge, get_gradient_edge
from torch.utils._pytree import tree_map

from ..errors import UserError, one_line

LossFn = Callable[[nn.Module, Any], torch.Tensor]

# A recomputed loss equals its in-batch value to this relative error: float32 reductions over
# other batch shapes differ by ~1e-6; half-precision forwards (bf16/fp16 activations, autocast)
# round each activation to 2^-8, and kernels chosen per shape then move a loss by up to ~1%.
RTOL_FLOAT32 = 1e-4
RTOL_HALF = 3e-2
# An example's loss and gradient alone with its padding cut off, against the same as collated:
# float32 kernels of other shapes differ by ~1e-7 relative; a forward rounded to bf16 or TF32
# (autocast) by ~1e-3, which rows in widths would turn into other examples' influence.
RTOL_CUT = 1e-5
# A gradient that does not depend on other rows is exactly 0 there; this only absorbs a stray
# rounding of a zero product.
GRADIENT_LEAK = 1e-6

PER_EXAMPLE_HINT = "e.g. dpmuon.models.per_example_lm_loss: each example's NLL over its own supervised tokens"


def loss_name(loss_fn: LossFn) -> str:
    return getattr(loss_fn, "__qualname__", None) or type(loss_fn).__name__


def micro_batch_rows(batch: Any) -> int:
    """The micro-batch's number of rows: the leading size most of its tensors share."""
    sizes = Counter(t.shape[0] for t in _tensors(batch) if t.dim() >= 1)
    return sizes.most_common(1)[0][0] if sizes else 0


def select_rows(batch: Any, rows: Sequence[int], size: int) -> Any:
    """The batch restricted to `rows` (repeats and order kept): every tensor whose leading size is
    the batch's `size` is indexed, all else kept as is. The columns stay as collated, so padding
    widths do not change."""
    if isinstance(batch, torch.Tensor):
        return batch[torch.as_tensor(rows, device=batch.device)] if batch.dim() >= 1 and batch.shape[0] == size else batch
    if isinstance(batch, Mapping):
        return {k: select_rows(v, rows, size) for k, v in batch.items()}
    if isinstance(batch, (list, tuple)):
        return type(batch)(select_rows(v, rows, size) for v in batch)
    return batch


def _tensors(value: Any) -> Iterator[torch.Tensor]:
    """The tensors in a (nested) batch or module output: Mappings (HF ModelOutput too), lists, tuples."""
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, Mapping):
        for v in value.values():
            yield from _tensors(v)
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from _tensors(v)


def check_losses(losses: Any, rows: int, name: str, some_finite: bool = True) -> None:
    """loss_fn's output: a floating tensor of shape [rows], finite for at least one row (unless not `some_finite`)."""
    if not isinstance(losses, torch.Tensor) or not losses.is_floating_point():
        got = f"a {losses.dtype} tensor" if isinstance(losses, torch.Tensor) else type(losses).__name__
        raise UserError(f"loss_fn {name} returned {got}; it must return the per-example losses, a float tensor of shape [{rows}] ({PER_EXAMPLE_HINT})")
    if tuple(losses.shape) != (rows,):
        raise UserError(
            f"loss_fn {name} returned a tensor of shape {tuple(losses.shape)} for a micro-batch of {rows} rows; it must return the "
            f"per-example losses, shape [{rows}], not their mean or sum ({PER_EXAMPLE_HINT})"
        )
    if some_finite and not bool(torch.isfinite(losses.detach()).any()):
        raise UserError(
            f"loss_fn {name} returned a non-finite loss (NaN/inf) for every one of the {rows} rows of the first micro-batch: the "
            "release would be noise alone; fix the loss (an example with no supervised token must get 0, not 0/0) — nothing was charged"
        )


@dataclass
class Call:
    """One module call of the traced forward: its differentiable tensor inputs and outputs."""

    name: str
    module: nn.Module
    inputs: list[torch.Tensor]
    outputs: list[torch.Tensor]
    # Where autograd delivers each tensor's gradient, taken at the call: a tensor changed in place
    # later (a residual `h += …`) then still means the value this call saw or made.
    input_edges: list[GradientEdge | None]
    output_edges: list[GradientEdge | None]


@contextmanager
def _traced(model: nn.Module) -> Iterator[list[Call]]:
    names = {m: n for n, m in model.named_modules()}
    calls: list[Call] = []

    def record(module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
        inputs = [t for t in _tensors((args, kwargs)) if t.is_floating_point()]
        outputs = [t for t in _tensors(output) if t.is_floating_point()]
        calls.append(Call(names.get(module, type(module).__name__), module, inputs, outputs, _edges(inputs), _edges(outputs)))

    handles = [m.register_forward_hook(record, with_kwargs=True) for m in names]
    try:
        yield calls
    finally:
        for handle in handles:
            handle.remove()


def _edges(tensors: list[torch.Tensor]) -> list[GradientEdge | None]:
    return [get_gradient_edge(t) if t.requires_grad else None for t in tensors]


def _per_row(tensors: list[torch.Tensor], edges: list[GradientEdge | None], size: int) -> list[tuple[torch.Tensor, GradientEdge]]:
    """The differentiable tensors of a call laid out one row per example."""
    return [(t, e) for t, e in zip(tensors, edges) if e is not None and t.dim() >= 1 and t.shape[0] == size]


def check_first_micro_batch(model: nn.Module, batch: Any, loss_fn: LossFn) -> bool:
    """Refuse a loss_fn or model that would void per-example clipping (see the module docstring).

    Returns False when the micro-batch has no rows (check a later one). A micro-batch of one row
    is checked as that row twice: coupling needs two rows to show.
    """
    rows = micro_batch_rows(batch)
    if rows == 0:
        return False
    name = loss_name(loss_fn)
    probe, size = (batch, rows) if rows >= 2 else (select_rows(batch, [0, 0], rows), 2)
    with rng_kept(model):
        with torch.enable_grad(), _traced(model) as calls:
            losses = loss_fn(model, probe)
        check_losses(losses, size, name)
        _refuse_broadcast_modules(calls, size)
        with warnings.catch_warnings():
            # An engine's full backward hooks (Opacus'), disabled outside its own step, still warn
            # when these probes differentiate module outputs whose inputs need no gradient.
            warnings.filterwarnings("ignore", message="Full backward hook is firing")
            _refuse_gradient_coupling(losses, calls, size, name)
        half = any(t.dtype in (torch.float16, torch.bfloat16) for call in calls for t in call.outputs)
        del losses, calls  # free the traced graph before the value probes
        _refuse_value_coupling(model, probe, size, loss_fn, name, RTOL_HALF if half else RTOL_FLOAT32)
    return True


def public_stand_in(batch: Mapping[str, Any]) -> dict[str, Any]:
    """`batch` with every tensor, nested ones too, replaced by public values of its shape and
    dtype from a fixed seed: integers 0 or 1 (valid token ids, labels and masks for any
    vocabulary), floats in [0.5, 1.5), booleans True (every row a real example). The one-off
    checks of a release run on it, not on the lot: computed from no data, nothing they do (which
    rows they select, whether they pass) depends on the lot's values, a timing channel constant-
    time lots would otherwise leave open; its rows differ, so a module or loss that mixes examples
    still shows. (Values that are not tensors pass through.)"""
    generator = torch.Generator().manual_seed(0)

    def stand_in(value: Any) -> Any:
        if not isinstance(value, torch.Tensor) or value.dtype == torch.bool or value.is_complex():
            return torch.ones_like(value) if isinstance(value, torch.Tensor) else value
        drawn = torch.rand(value.shape, generator=generator, dtype=torch.float64)
        drawn = drawn + 0.5 if value.is_floating_point() else (drawn < 0.5)
        return drawn.to(dtype=value.dtype, device=value.device)

    return tree_map(stand_in, dict(batch))


def rng_kept(model: nn.Module):
    """The global RNG streams (dropout's) as they were before the check: a resumed run, which checks
    its first release again, then draws the same dropout masks as one never interrupted."""
    devices = sorted({p.device for p in model.parameters() if p.device.type != "cpu"}, key=str)
    return torch.random.fork_rng(devices=devices, device_type=devices[0].type if devices else "cuda")


def _refuse_broadcast_modules(calls: list[Call], size: int) -> None:
    """A module holding trainable parameters computed once for all rows (HF GPT-2's position
    embedding without position_ids) adds the rows' gradients before any hook could tell them apart."""
    for call in calls:
        trainable = any(p.requires_grad for p in call.module.parameters(recurse=False))
        if trainable and call.outputs and call.outputs[0].dim() >= 1 and call.outputs[0].shape[0] == 1:
            raise UserError(
                f"model module {call.name!r} ({type(call.module).__name__}) was computed once (output shape {tuple(call.outputs[0].shape)}) "
                f"and broadcast over the micro-batch's {size} rows, so its per-example gradients cannot be formed; give it batch-shaped "
                "inputs — for Hugging Face GPT-2, pass position_ids of shape [B, T] (dpmuon.models.position_ids_for(attention_mask), "
                "as dpmuon.models.per_example_lm_loss does)"
            )


def _split(losses: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows probed (every other finite row) and rows watched (the other finite rows)."""
    finite = torch.isfinite(losses.detach()).nonzero().flatten()
    return finite[0::2], finite[1::2]


def _leaks(grad: torch.Tensor | None, probed: torch.Tensor, watched: torch.Tensor) -> bool:
    if grad is None:
        return False
    flat = grad.detach().reshape(grad.shape[0], -1).abs()  # rows × the rest (a row may be one number)
    if flat.shape[1] == 0:
        return False
    leak, scale = flat[watched].max(), flat[probed].max()
    # Not `leak > …`: a NaN that reaches another example's rows (0·NaN in a backward) leaks too —
    # the engine would drop that example because of another one.
    return not bool(leak <= GRADIENT_LEAK * scale)


def _refuse_gradient_coupling(losses: torch.Tensor, calls: list[Call], size: int, name: str) -> None:
    """d(Σ of the probed rows' losses)/d(every row-major activation) must vanish on the other rows."""
    probed, watched = _split(losses)
    edges = [e for call in calls for _, e in _per_row(call.outputs, call.output_edges, size)]
    if len(watched) == 0 or not edges or not losses.requires_grad:
        return
    grads = torch.autograd.grad(losses[probed].sum(), edges, allow_unused=True, retain_graph=True)
    if not any(_leaks(g, probed, watched) for g in grads):
        return
    mixers = [call for call in calls if _mixes_rows(call, size, probed, watched)]
    innermost = [c for c in mixers if not any(o is not c and _is_inside(o.module, c.module) for o in mixers)]
    if innermost:
        call = innermost[0]
        raise UserError(
            f"model module {call.name or '(the model)'!r} ({type(call.module).__name__}) mixes the examples of a micro-batch: one "
            "example's activations move another's loss, so per-example clipping does not bound one example's influence; compute each "
            "row from its own inputs (batch-norm: eval mode, or LayerNorm / GroupNorm) — nothing was charged"
        )
    raise UserError(
        f"loss_fn {name} mixes the examples of a micro-batch: one example's loss depends on another example's outputs (e.g. a mean "
        f"over the micro-batch subtracted or divided by), so per-example clipping does not bound one example's influence; return each "
        f"example's own loss ({PER_EXAMPLE_HINT}) — nothing was charged"
    )


def _is_inside(inner: nn.Module, outer: nn.Module) -> bool:
    return any(m is inner for m in outer.modules())


def _mixes_rows(call: Call, size: int, probed: torch.Tensor, watched: torch.Tensor) -> bool:
    """Whether this module call's own Jacobian moves the probed rows' outputs by other rows' inputs."""
    outputs = _per_row(call.outputs, call.output_edges, size)
    inputs = [e for _, e in _per_row(call.inputs, call.input_edges, size)]
    if not outputs or not inputs:
        return False
    cotangents = []
    for t, _ in outputs:
        c = torch.zeros(t.shape, dtype=t.dtype, device=t.device)
        c[probed] = 1
        cotangents.append(c)
    grads = torch.autograd.grad([e for _, e in outputs], inputs, cotangents, allow_unused=True, retain_graph=True)
    return any(_leaks(g, probed, watched) for g in grads)


@contextmanager
def _eval_mode(model: nn.Module) -> Iterator[None]:
    """Every module in eval mode (dropout off: a row recomputed must see the same function), each
    restored to its own mode after."""
    modes = [(m, m.training) for m in model.modules()]
    model.eval()
    try:
        yield
    finally:
        for m, mode in modes:
            m.train(mode)


def _refuse_value_coupling(model: nn.Module, batch: Any, size: int, loss_fn: LossFn, name: str, rtol: float) -> None:
    """Each half of the rows, in reverse order, recomputed without the other half: every loss must
    come out as it did in the whole micro-batch (a loss divided by the micro-batch's token count
    or number of rows does not; neither does one weighted by its row's position)."""
    half = size // 2
    probes = [list(reversed(range(half))), list(reversed(range(half, size)))]
    with torch.no_grad(), _eval_mode(model):
        whole = loss_fn(model, batch).detach().double()
        for rows in probes:
            again = loss_fn(model, select_rows(batch, rows, size))
            expected = whole[torch.as_tensor(rows, device=whole.device)]
            if not isinstance(again, torch.Tensor) or tuple(again.shape) != (len(rows),):
                shape = tuple(again.shape) if isinstance(again, torch.Tensor) else type(again).__name__
                raise UserError(
                    f"loss_fn {name} returned {shape} for {len(rows)} of the micro-batch's rows; it must return shape [{len(rows)}] ({PER_EXAMPLE_HINT})"
                )
            _compare(again.detach().double(), expected, whole, rows, size, name, rtol)


def _compare(
    again: torch.Tensor,
    expected: torch.Tensor,
    whole: torch.Tensor,
    rows: list[int],
    size: int,
    name: str,
    rtol: float,
    how: str = "same tensors, rows selected",
) -> None:
    at = first_mismatch(again, expected, whole, rtol)
    if at is None:
        return
    raise UserError(
        f"loss_fn {name} couples the examples of a micro-batch: row {rows[at]}'s loss is {float(expected[at]):.6g} among {size} rows "
        f"and {float(again[at]):.6g} among {len(rows)} of them ({how}); a loss divided by the micro-batch's token count (Hugging "
        f"Face's num_items_in_batch), rows or padded width lets one example scale every other's gradient, which clipping does not "
        f"bound; divide each example by its own count ({PER_EXAMPLE_HINT}) — nothing was charged"
    )


def first_mismatch(again: torch.Tensor, expected: torch.Tensor, whole: torch.Tensor, rtol: float) -> int | None:
    """The first row whose recomputed loss is not its expected one (finite where that is, within
    `rtol` of it plus the largest finite loss of `whole`); None if every row's is."""
    finite = torch.isfinite(whole)
    scale = float(whole[finite].abs().max()) if bool(finite.any()) else 0.0
    same_finiteness = torch.isfinite(again) == torch.isfinite(expected)
    close = (again - expected).abs() <= rtol * (expected.abs() + scale)
    good = same_finiteness & (close | ~torch.isfinite(expected))
    return None if bool(good.all()) else int((~good).nonzero()[0])


def check_user_code(model: nn.Module, loss_fn: LossFn, collated: Callable[[list[int]], Any], count: int) -> None:
    """make_private's checks, before the mechanism exists, on examples 0..count−1 of the training
    set (the first of the set, not of a secret lot): `check_first_micro_batch` on them collated
    together, then each half collated on its own (its own padding width, its own token count),
    whose losses must come out as they did together. The row probes keep a micro-batch's columns
    as collated, so they cannot see a loss that depends on the width the others' lengths set (one
    normalized by the padded length, say), which varies from lot to lot when lots are processed as
    drawn. State a module writes here is undone (the release's StateGuard refuses it)."""
    name, half = loss_name(loss_fn), count // 2
    rtol = RTOL_HALF if any(p.dtype in (torch.float16, torch.bfloat16) for p in model.parameters()) else RTOL_FLOAT32
    with StateGuard(model).restored():
        check_first_micro_batch(model, collated(list(range(count))), loss_fn)
        if count < 2:  # one example a micro-batch: nothing else shares it
            return
        with rng_kept(model), torch.no_grad(), _eval_mode(model):
            whole = loss_fn(model, collated(list(range(count)))).detach().double()
            for rows in (list(range(half)), list(range(half, count))):
                again = loss_fn(model, collated(rows))
                check_losses(again, len(rows), name)
                expected = whole[rows[0] : rows[-1] + 1]
                _compare(again.detach().double(), expected, whole, rows, count, name, rtol, how="collated on their own")


def check_padding_cut(model: nn.Module, loss_fn: LossFn, whole: Any, alone: Sequence[Any]) -> None:
    """make_private's check before rows come in a few widths: each example's loss, and the gradient
    of their sum, the same on its own with its padding columns cut off (`alone[i]`: row i of
    `whole` cut to its length) as collated in `whole`. An example's width then depends on how many
    longer ones share its lot, so a model that attends to padding (one ignoring the attention mask
    in both directions), a loss normalized by the padded width, or a forward rounded by shape
    (autocast) would let the others move its gradient. In eval mode (the same function each time),
    then in the modes the releases will run in where their forward draws nothing random (two
    forwards under different seeds agree bit for bit: no dropout), so that a module whose
    train-mode branch alone mixes padding in is seen too."""
    name = loss_name(loss_fn)
    params = [p for p in model.parameters() if p.requires_grad]
    with StateGuard(model).restored(), rng_kept(model):
        with _eval_mode(model):
            what, mode = _moved_by_cut(model, loss_fn, whole, alone, params, name), "eval"
        if what is None and any(m.training for m in model.modules()) and _draws_nothing(model, loss_fn, whole):
            what, mode = _moved_by_cut(model, loss_fn, whole, alone, params, name), "train"
    if what is not None:
        raise UserError(
            f"width_buckets: {what} (loss_fn {name}, {mode} mode) changes when the first examples' trailing padding columns are cut "
            "off, so the width a row gets, which depends on the rest of the lot, would move its gradient; use a model that masks "
            "padding (attention_mask), a loss over each example's own tokens and float32 forwards, or pass width_buckets=1 (every "
            "row collate_fn's width) — nothing was charged"
        )


def _draws_nothing(model: nn.Module, loss_fn: LossFn, batch: Any) -> bool:
    """Whether the model's forward, in its modes as they are, draws no randomness: the losses of
    two forwards under different seeds are the same bits."""
    with torch.no_grad():
        torch.manual_seed(1)
        first = loss_fn(model, batch)
        torch.manual_seed(2)
        return _same_bits(first, loss_fn(model, batch))


def _moved_by_cut(model: nn.Module, loss_fn: LossFn, whole: Any, alone: Sequence[Any], params: list[nn.Parameter], name: str) -> str | None:
    """What cutting the rows' padding columns moves ("example i's loss", "the gradient of parameter
    p") beyond RTOL_CUT, or None."""
    losses = loss_fn(model, whole)
    expected = losses.detach().double()
    finite = torch.isfinite(expected)
    collated = torch.autograd.grad(losses[finite].sum(), params, allow_unused=True)
    again, cut = [], [torch.zeros_like(p) for p in params]
    for i, row in enumerate(alone):
        try:
            loss = loss_fn(model, row)
        except (RuntimeError, ValueError, IndexError) as err:  # a model whose shapes tie dim 1 to the width (norm over positions)
            raise UserError(
                f"width_buckets: loss_fn {name} failed on example {i} with its trailing padding columns cut off ({one_line(err)}); "
                "rows in a few widths need a model that takes any width up to collate_fn's; pass width_buckets=1 (every row "
                "collate_fn's width) — nothing was charged"
            ) from None
        check_losses(loss, 1, name, some_finite=False)  # a row's own non-finite loss is compared below
        again.append(loss.detach().double())
        if bool(finite[i]):
            for total, g in zip(cut, torch.autograd.grad(loss.sum(), params, allow_unused=True), strict=True):
                total += 0 if g is None else g
    at = first_mismatch(torch.cat(again), expected, expected, RTOL_CUT)
    if at is not None:
        return f"example {at}'s loss"
    moved = _moved_parameter(model, params, collated, cut)
    return None if moved is None else f"the gradient of parameter {moved!r}"


def _moved_parameter(model: nn.Module, params: list[nn.Parameter], collated: Sequence, cut: Sequence[torch.Tensor]) -> str | None:
    """The first parameter whose gradient with rows cut differs from collated beyond float32 rounding
    (RTOL_CUT of the whole gradient's norm), or None."""
    grads = [torch.zeros_like(p) if g is None else g for p, g in zip(params, collated, strict=True)]
    scale = float(torch.sqrt(sum((g.double() ** 2).sum() for g in grads))) if grads else 0.0
    names = {id(p): n for n, p in model.named_parameters()}
    for p, g, c in zip(params, grads, cut, strict=True):
        if float((g.double() - c.double()).norm()) > RTOL_CUT * scale:
            return names[id(p)]
    return None


class StateGuard:
    """Snapshot of the model's state taken before a release — buffers and tensors held as plain
    module attributes (values and identity; a cache a forward keeps shapes the later releases),
    parameters (identity and version): `check` refuses any written while it ran; `restore` puts the
    buffers and attributes back (a refused release leaves no trace of its examples in them)."""

    def __init__(self, model: nn.Module):
        self.model = model
        self.states = {(kind, name, id(m)): (m, t, t.detach().clone()) for kind, name, m, t in _module_state(model)}
        self.params = {(name, id(m)): (m, p, p._version) for name, m, p in _named_state(model, "_parameters")}

    def check(self) -> None:
        after = {(kind, name, id(m)): (m, t) for kind, name, m, t in _module_state(self.model)}
        for key in after.keys() - self.states.keys():
            self._refuse(key[1], after[key][0], key[0], "added")
        for key in self.states.keys() - after.keys():
            self._refuse(key[1], self.states[key][0], key[0], "removed")
        for key, (module, before, value) in self.states.items():
            now = after[key][1]
            if now is not before or not _same_bits(now, value):
                self._refuse(key[1], module, key[0], "wrote")
        after_params = {(name, id(m)): (m, p) for name, m, p in _named_state(self.model, "_parameters")}
        for key, (module, before, version) in self.params.items():
            now = after_params.get(key, (None, None))[1]
            if now is not before or now._version != version:
                self._refuse(key[0], module, "parameter", "wrote")

    @contextmanager
    def restored(self) -> Iterator[None]:
        """The state as it was when the guard was made, after the block, however it ends."""
        try:
            yield
        finally:
            self.restore()

    def restore(self) -> None:
        for kind, name, module, _ in list(_module_state(self.model)):
            if (kind, name, id(module)) not in self.states:
                _slot(module, kind).pop(name)
        for (kind, name, _), (module, before, value) in self.states.items():
            with torch.no_grad():
                before.copy_(value)
            _slot(module, kind)[name] = before

    def _refuse(self, name: str, module: nn.Module, kind: str, what: str) -> None:
        module_name = next((n for n, m in self.model.named_modules() if m is module), type(module).__name__)
        raise UserError(
            f"model module {module_name or '(the model)'!r} ({type(module).__name__}) {what} its {kind} {name!r} during the release's "
            "forward: state computed from private examples is published with the model (state_dict) or shapes later releases, "
            "outside the guarantee; keep the module from updating state in forward (norm layers: track_running_stats=False or "
            "eval mode; no caches kept across calls) — restored, nothing charged"
        )


BUFFER, ATTRIBUTE = "buffer", "tensor attribute"


def _slot(module: nn.Module, kind: str) -> dict:
    return module._buffers if kind == BUFFER else module.__dict__


def _module_state(model: nn.Module) -> Iterator[tuple[str, str, nn.Module, torch.Tensor]]:
    """(kind, local name, owning module, tensor) of every buffer and tensor-valued plain attribute."""
    for name, module, t in _named_state(model, "_buffers"):
        yield BUFFER, name, module, t
    for module in model.modules():
        for name, t in list(vars(module).items()):
            if isinstance(t, torch.Tensor):
                yield ATTRIBUTE, name, module, t


def _named_state(model: nn.Module, slot: str) -> Iterator[tuple[str, nn.Module, torch.Tensor]]:
    """(local name, owning module, tensor) of every buffer or parameter, once per owner."""
    for module in model.modules():
        for name, t in getattr(module, slot).items():
            if t is not None:
                yield name, module, t


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    # Bitwise, so that a NaN kept is equal and -0.0 written over 0.0 is not.
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    return torch.equal(a.detach().contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8))
