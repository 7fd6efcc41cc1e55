"""The release on FSDP2's row shards (2 gloo processes, a tiny tied GPT-2 under fully_shard) is the
single-process release of the same lots and key, bit for bit, each rank holding its rows of it."""

from __future__ import annotations

import sharded_reduce
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from conftest import tiny_gpt2, token_batch

from dpmuon.models import hidden_matrices, per_example_lm_loss
from dpmuon.optim import AdamSettings, MuonBCSettings, MuonSettings, OptimizerInputs
from dpmuon.optim import muon as muon_module
from dpmuon.outcomes import end_distributed_process
from dpmuon.privacy import DataParallel, GaussianNoise, PrivacyAccountant, Privatizer, SecretStream, build_partition
from dpmuon.privacy.ledger import PrivacyLedger
from dpmuon.privacy.sharded import RankFailedError
from dpmuon.row_shards import row_range

DATA = token_batch(24, seed=11)
LOTS = [[0, 3, 4, 9, 12, 15, 21], [1, 2, 8, 17], [5, 6, 7, 10, 11, 13, 14, 16, 18]]
WORLD = 2


def privatizer_for(model, parallel: DataParallel, ledger: PrivacyLedger | None = None) -> Privatizer:
    partition = build_partition([n for n, _ in model.named_parameters()], clip_norm=0.5, matrix_names=hidden_matrices(model))
    return Privatizer(
        model, partition, noise_multiplier=0.8, expected_lot_size=8, sample_rate=0.2, accountant=PrivacyAccountant(1e-5),
        noise=GaussianNoise(SecretStream(5)), parallel=parallel, ledger=ledger,
    )  # fmt: skip


def rank_batch(lot: list[int], rank: int) -> dict:
    """Rank r's examples of a lot (its DataParallel shard), as one micro-batch."""
    return {k: v[lot[rank::WORLD]] for k, v in DATA.items()}


def sharded_gpt2(world: int):
    """A tiny tied GPT-2 under FSDP2: each block a unit, the root (embeddings, the tied head) one."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    model = tiny_gpt2(tie=True)
    mesh = init_device_mesh("cpu", (world,))
    for block in model.transformer.h:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _worker(rank: int, init_file: str, out: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD)
    torch.set_num_threads(1)
    try:
        model = sharded_gpt2(WORLD)
        ledger = PrivacyLedger(f"{out}.ledger.jsonl", {"test": "sharded"}) if rank == 0 else None
        privatizer = privatizer_for(model, DataParallel(rank, WORLD), ledger)
        released, draws, lot_sizes = [], [], []
        for step, lot in enumerate(LOTS, start=1):
            stats = privatizer.release([rank_batch(lot, rank)], per_example_lm_loss, step=step)
            released.append({n: p.grad.to_local().clone() for n, p in model.named_parameters()})
            draws.append(privatizer.noise.stream.draws)
            lot_sizes.append(stats.lot_size)
        result = {"released": released, "draws": draws, "lot_sizes": lot_sizes}
        result["grad_kind"] = {n: (type(p.grad).__name__, tuple(p.grad.shape), tuple(p.grad.to_local().shape)) for n, p in model.named_parameters()}
        result["failed"] = failing_step(privatizer, rank, step=len(LOTS) + 1)
        result["kept"] = all(torch.equal(p.grad.to_local(), released[-1][n]) for n, p in model.named_parameters())
        result["steps"] = privatizer.accountant.steps
        if ledger is not None:
            result["ledger"] = [(r["step"], r["charged"]) for r in ledger.releases]
        torch.save(result, f"{out}.{rank}")
    finally:
        dist.destroy_process_group()
    end_distributed_process()


def single_process_release() -> dict:
    """One process, the same key and lots, each lot as the ranks' micro-batches in rank order."""
    model = tiny_gpt2(tie=True)
    privatizer = privatizer_for(model, DataParallel(0, 1))
    released, draws = [], []
    for lot in LOTS:
        privatizer.release([rank_batch(lot, rank) for rank in range(WORLD)], per_example_lm_loss)
        released.append({n: p.grad.clone() for n, p in model.named_parameters()})
        draws.append(privatizer.noise.stream.draws)
    return {"released": released, "draws": draws}


def test_the_fsdp_release_is_the_single_process_release_bit_for_bit(tmp_path):
    context = mp.spawn(_worker, args=(str(tmp_path / "init"), str(tmp_path / "out")), nprocs=WORLD, join=False)
    for _ in range(60):  # bounded: a rank left waiting after the other failed would hang the test
        if context.join(timeout=5):
            break
    else:
        raise AssertionError("a rank is still waiting")
    torch.set_num_threads(1)
    single = single_process_release()
    ranks = [torch.load(tmp_path / f"out.{r}", weights_only=False) for r in range(WORLD)]
    for rank, result in enumerate(ranks):
        assert result["lot_sizes"] == [len(lot) for lot in LOTS] and result["steps"] == len(LOTS)
        # The noise was drawn once per step: the stream moved as the single process's did.
        assert result["draws"] == single["draws"]
        for step, grads in enumerate(result["released"]):
            for name, local in grads.items():
                whole = single["released"][step][name]
                assert torch.equal(local, whole[slice(*row_range(whole.shape[0], WORLD, rank))]), (rank, step, name)
        # p.grad is FSDP2's: a DTensor of the whole shape holding this rank's rows.
        for name, (kind, shape, local_shape) in result["grad_kind"].items():
            whole = single["released"][0][name]
            start, stop = row_range(whole.shape[0], WORLD, rank)
            assert kind == "DTensor" and shape == tuple(whole.shape) and local_shape == (stop - start, *whole.shape[1:]), name
    # One ledger line per step, written by rank 0, every release charged.
    assert ranks[0]["ledger"] == [(step, True) for step in range(1, len(LOTS) + 1)] and "ledger" not in ranks[1]
    # A step that failed on one rank stopped both, released, recorded and charged nothing.
    assert ranks[1]["failed"] == "OverflowError: a clipped sum too large for the grid"
    assert ranks[0]["failed"].startswith("RankFailedError: rank 1 failed in the sharded release") and "OverflowError" in ranks[0]["failed"]
    assert all(result["kept"] and result["steps"] == len(LOTS) for result in ranks)


def test_every_row_is_fully_reduced_in_rank_order(tmp_path):
    """Three ranks' totals of very different scales (so that the order of the float64 additions
    shows): each rank's rows are ((S₀ + S₁) + S₂) of exactly its rows, no row left out or added twice."""
    world = 3
    mp.spawn(sharded_reduce.worker, args=(str(tmp_path / "init"), str(tmp_path / "out"), world), nprocs=world, join=True)
    for i, m in enumerate(sharded_reduce.ROWS):
        totals = [sharded_reduce.rank_total(m, r) for r in range(world)]
        rows = torch.cat([torch.load(tmp_path / f"out.{r}")[i] for r in range(world)])
        assert torch.equal(rows, (totals[0] + totals[1]) + totals[2])
        assert not torch.equal(rows, totals[0] + (totals[1] + totals[2]))  # the order shows in these values


def failing_step(privatizer: Privatizer, rank: int, step: int) -> str:
    """A step whose grid overflows on rank 1 alone (its noise raises, rank 0's does not): what
    each rank raised. Had rank 1 stopped alone, rank 0 would wait in the next collective."""
    if rank == 1:
        privatizer.noise.grid_release_slice = lambda *args: (_ for _ in ()).throw(OverflowError("a clipped sum too large for the grid"))
    try:
        privatizer.release([rank_batch(LOTS[0], rank)], per_example_lm_loss, step=step)
    except (OverflowError, RankFailedError) as err:
        return f"{type(err).__name__}: {err}"
    return "released"


OPTIMIZERS = {
    "dp_muon": MuonSettings(lr=0.02, momentum=0.9, adam={"lr": 1e-3}),
    "dp_muonbc": MuonBCSettings(lr=0.02, momentum=0.9, adam={"lr": 1e-3}, bias_correction={"probe_scale": 1.0, "num_probes": 2}),
    "dp_adam": AdamSettings(lr=1e-3),
}
STEPS = 2  # optimizer steps compared with one process's


def optimizer_for(name: str, model, privatizer: Privatizer):
    inputs = OptimizerInputs(dict(model.named_parameters()), hidden_matrices(model), privatizer.release_noise_std(), torch.Generator().manual_seed(6))
    return OPTIMIZERS[name].build(inputs)


def _steps_worker(rank: int, init_file: str, out: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD)
    torch.set_num_threads(1)
    orthogonalized = []  # the matrices this rank orthogonalized: (step, shape)
    plain, corrected = muon_module.newton_schulz, muon_module.corrected_and_plain

    def counted_plain(matrices, **kwargs):
        orthogonalized.extend((len(stepped), tuple(m.shape)) for m in matrices)
        return plain(matrices, **kwargs)

    def counted_corrected(matrices, *args, **kwargs):
        orthogonalized.extend((len(stepped), tuple(m.shape)) for m in matrices)
        return corrected(matrices, *args, **kwargs)

    muon_module.newton_schulz, muon_module.corrected_and_plain = counted_plain, counted_corrected
    try:
        result = {}
        for name in OPTIMIZERS:
            orthogonalized.clear()
            model = sharded_gpt2(WORLD)
            privatizer = privatizer_for(model, DataParallel(rank, WORLD))
            optimizer = optimizer_for(name, model, privatizer)
            stepped, draws = [], []
            for lot in LOTS[:STEPS]:
                privatizer.release([rank_batch(lot, rank)], per_example_lm_loss)
                optimizer.step()
                optimizer.zero_grad()
                stepped.append({n: p.detach().to_local().clone() for n, p in model.named_parameters()})
            # A step of two micro-batches a rank: still one release and one Newton–Schulz per matrix.
            before = privatizer.noise.stream.draws
            lot = LOTS[2]
            privatizer.release([{k: v[lot[rank::WORLD][i::2]] for k, v in DATA.items()} for i in range(2)], per_example_lm_loss)
            draws = privatizer.noise.stream.draws - before
            optimizer.step()
            diagnostics = optimizer.diagnostics() if hasattr(optimizer, "diagnostics") else {}
            names = {p: n for n, p in model.named_parameters()}
            result[name] = {
                "stepped": stepped, "orthogonalized": list(orthogonalized), "draws": draws,
                "diagnostics": {key: {names[p]: v for p, v in values.items()} for key, values in diagnostics.items()},
            }  # fmt: skip
        torch.save(result, f"{out}.{rank}")
    finally:
        dist.destroy_process_group()
    end_distributed_process()


def single_process_steps(name: str) -> list[dict]:
    model = tiny_gpt2(tie=True)
    privatizer = privatizer_for(model, DataParallel(0, 1))
    optimizer = optimizer_for(name, model, privatizer)
    stepped = []
    for lot in LOTS[:STEPS]:
        privatizer.release([rank_batch(lot, rank) for rank in range(WORLD)], per_example_lm_loss)
        optimizer.step()
        optimizer.zero_grad()
        stepped.append({n: p.detach().clone() for n, p in model.named_parameters()})
    return stepped


def test_dp_muon_muonbc_and_adam_steps_on_shards_are_the_single_process_steps(tmp_path):
    """After each step every rank holds its rows of the single-process weights, bit for bit; and
    Newton–Schulz ran once per matrix and step — not zero times, not per rank or micro-batch —
    on whole matrices, with one release (one noise draw per noised tensor) per step."""
    mp.spawn(_steps_worker, args=(str(tmp_path / "init"), str(tmp_path / "out")), nprocs=WORLD, join=True)
    torch.set_num_threads(1)
    ranks = [torch.load(tmp_path / f"out.{r}", weights_only=False) for r in range(WORLD)]
    model = tiny_gpt2(tie=True)
    matrices = sorted(tuple(p.shape) for n, p in model.named_parameters() if n in hidden_matrices(model))
    noised = len(privatizer_for(model, DataParallel(0, 1))._noise_sizes)
    for name in OPTIMIZERS:
        single = single_process_steps(name)
        for rank, result in enumerate(ranks):
            for step, params in enumerate(result[name]["stepped"]):
                for param, local in params.items():
                    whole = single[step][param]
                    assert torch.equal(local, whole[slice(*row_range(whole.shape[0], WORLD, rank))]), (name, rank, step, param)
            assert result[name]["draws"] == noised
        done = [entry for result in ranks for entry in result[name]["orthogonalized"]]
        if name == "dp_adam":
            assert done == []
            continue
        for step in range(STEPS + 1):
            assert sorted(shape for s, shape in done if s == step) == matrices, (name, step)
        assert ranks[0][name]["diagnostics"] == ranks[1][name]["diagnostics"]  # gathered from the owners
