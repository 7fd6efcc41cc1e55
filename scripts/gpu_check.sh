#!/usr/bin/env bash
# The GPU check, one command (≤ 9.5 minutes on one H100/H200-class GPU, no network):
#
#   scripts/gpu_check.sh [--cpu] [--wheels DIR] OUT_DIR
#
#   1. environment  torch, CUDA, the GPU, the commit → environment.json; stops without a GPU
#   2. install      dpmuon from this checkout (pip, no index: nothing is downloaded); with
#                   --wheels, dependencies the machine lacks come from DIR (results/gpu/README.md)
#   3. gpu_tests    every test marked `gpu` (tests/test_cuda.py: engines, privatizer, optimizers
#                   and decoding on CUDA in bf16)
#   4. smoke        20 private steps of each DP optimizer (experiment=e2e, a GPT-2-small-shaped
#                   random-init model, bf16, expected lot 256), then test NLL and beam decoding
#                   of 64 test sources; tables of the four runs
#   5. bench        scripts/bench_step.py --model gpt2-small --device cuda, lot 256, micro-batches
#                   of 32 (non-private and the fast engine; DP-Adam and DP-MuonBC, each with
#                   constant-time lots, lots as drawn, and no noise: what each part costs, the
#                   noise drawn ahead on the host) and --phases (the release's noise per step)
#   6. fsdp         where the machine has two GPUs: the same 10 private DP-Muon steps on both,
#                   under torchrun with trainer.strategy=ddp and =fsdp (NCCL); fsdp.json says
#                   whether they reached the same weights, and each one's median step time
#
# Everything lands in OUT_DIR: environment.json, status.tsv (stage, exit code, seconds),
# gpu_check.log, pytest_gpu.{log,xml}, smoke/ (the runs), smoke.{md,json}, tables/e2e/…,
# bench_mb{32,64}.{txt,json}, fsdp/ (the two runs), fsdp.json. Each stage runs under a time
# limit; a failed or timed-out stage is recorded and the next one still runs; the exit code is 1
# if any stage failed.
#
# --cpu is the dry run: the same stages on the CPU at toy size (tiny model, lot 16, 3 steps),
# so that the script itself is tested without a GPU (tests/test_gpu_check.py).
#
# Needs the E2E data and the GPT-2 tokenizer: $DPMUON_DATA_DIR and $DPMUON_TOKENIZER (or
# data/raw/ and the hub, which a machine without network does not have). $PYTHON picks the
# interpreter (default: .venv/bin/python if present, else python3).
set -uo pipefail

usage() {
    echo "usage: scripts/gpu_check.sh [--cpu] [--wheels DIR] OUT_DIR" >&2
    exit 2
}

CPU=0
WHEELS=""
OUT=""
RUN_STAGE=""  # internal: the script re-runs itself for one stage, under a time limit
while (($#)); do
    case "$1" in
        --cpu) CPU=1 ;;
        --wheels) [[ $# -ge 2 ]] || usage; WHEELS="$(cd "$2" && pwd)" || exit 2; shift ;;
        --run-stage) [[ $# -ge 2 ]] || usage; RUN_STAGE="$2"; shift ;;
        -h | --help) awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"; exit 0 ;;
        -*) echo "unknown option $1" >&2; usage ;;
        *) [[ -z $OUT ]] || usage; OUT="$1" ;;
    esac
    shift
done
[[ -n $OUT ]] || usage

REPO="$(cd "$(dirname "$0")/.." && pwd)"
mkdir -p "$OUT" || exit 2
OUT="$(cd "$OUT" && pwd)"
cd "$REPO" || exit 2
if [[ -z ${PYTHON:-} ]]; then
    if [[ -x .venv/bin/python ]]; then PYTHON="$REPO/.venv/bin/python"; else PYTHON=python3; fi
fi
export WANDB_MODE=disabled TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1

# Sizes: the GPU check proper, or its toy-size rehearsal on the CPU.
if ((CPU)); then
    DEVICE=cpu
    TEST_DEVICE=cpu
    SMOKE_MODEL=(model=tiny_bpe8k model.n_layer=1 model.n_embd=32 model.n_head=2 model.n_positions=128)
    SMOKE=(privacy.expected_lot_size=16 trainer.steps=3 trainer.micro_batch_size=8 data.max_train_examples=2000
        data.max_valid_examples=16 data.max_test_sources=4 eval.num_beams=2 eval.max_new_tokens=16 trainer.num_threads=1)
    BENCH=(--model tiny --device cpu --lot 16 --seq-len 32 --repeats 1 --threads 1 --memory-jobs 1 --optimizers dp_muonbc)
    MICRO_BATCHES=(4 8)
    FSDP=(privacy.expected_lot_size=16 trainer.steps=3 trainer.micro_batch_size=8 data.max_train_examples=2000
        data.max_valid_examples=16 data.max_test_sources=2 eval.num_beams=1 eval.max_new_tokens=4 trainer.num_threads=1)
    # Generous: a CPU shared with other work can be several times slower than a quiet one.
    BUDGET_TESTS=300 BUDGET_SMOKE=600 BUDGET_BENCH=600 BUDGET_FSDP=600
else
    DEVICE=cuda
    TEST_DEVICE=cuda
    SMOKE_MODEL=(model=gpt2_small_random)
    SMOKE=(privacy.expected_lot_size=256 trainer.steps=20 trainer.micro_batch_size=32 data.max_valid_examples=256
        data.max_test_sources=64 logging.epsilon_every=5)
    # DP-Muon's cost lies between DP-Adam's and DP-MuonBC's: two optimizers bound all three.
    BENCH=(--model gpt2-small --device cuda --lot 256 --seq-len 64 --repeats 2 --memory-jobs 2 --optimizers dp_adam dp_muonbc)
    MICRO_BATCHES=(32)
    FSDP=(privacy.expected_lot_size=256 trainer.steps=10 trainer.micro_batch_size=32 data.max_valid_examples=64
        data.max_test_sources=8 eval.num_beams=1 eval.max_new_tokens=16)
    # Stage budgets (seconds), from the first run on an H200 (results/gpu/h200_2026-12-04): tests
    # 25 s, a smoke run 70–90 s (4 of them), the bench about 45 s a repeat at micro-batch 32. With
    # installing (26 s) the check stays under 9 minutes 30.
    BUDGET_TESTS=60 BUDGET_SMOKE=360 BUDGET_BENCH=150 BUDGET_FSDP=240
fi

LOG="$OUT/gpu_check.log"
STATUS="$OUT/status.tsv"

log() { echo "[gpu_check] $*" | tee -a "$LOG" >&2; }

# stage NAME BUDGET_S: run the function NAME in a fresh copy of this script under a time limit
# (timeout signals the whole process group), output to the log, result to status.tsv.
stage() {
    local name="$1" budget="$2" start rc
    local mode=()
    ((CPU)) && mode=(--cpu)
    log "stage $name (≤ ${budget}s)"
    start=$SECONDS
    timeout --signal=TERM --kill-after=30 "$budget" bash "$0" "${mode[@]}" --run-stage "$name" "$OUT" >>"$LOG" 2>&1
    rc=$?
    printf '%s\t%s\t%s\n' "$name" "$rc" "$((SECONDS - start))" >>"$STATUS"
    if ((rc == 124)); then log "stage $name ran out of its ${budget}s"; fi
    if ((rc != 0)); then
        log "stage $name FAILED (exit $rc); see $LOG"
        FAILED=1
    fi
    return 0
}

install() {
    local installed
    if [[ -n $WHEELS ]]; then
        # Only the listed files, no resolver: the project's other dependencies (wandb, datasets)
        # are never imported by the check and need not be there.
        "$PYTHON" -m pip install --no-index --no-deps --no-build-isolation "$WHEELS"/* || return 1
    fi
    installed="$("$PYTHON" -c 'import dpmuon, pathlib; print(pathlib.Path(dpmuon.__file__).resolve().parent)' 2>/dev/null)"
    if [[ $installed == "$REPO/src/dpmuon" ]]; then
        echo "dpmuon is already installed from this checkout"
    elif ! "$PYTHON" -m pip install --no-index --no-deps --no-build-isolation -e "$REPO"; then
        # An old setuptools cannot build this pyproject: the checkout's sources work as they are.
        echo "pip could not install dpmuon; using $REPO/src through PYTHONPATH"
        export PYTHONPATH="$REPO/src${PYTHONPATH:+:$PYTHONPATH}"
    fi
    # What the stages import; a missing dependency is named here rather than mid-run.
    "$PYTHON" -c 'import dpmuon.train, dpmuon.training.loop, dpmuon.eval.cli, opacus, rouge_score, sacrebleu, pytest' || {
        echo "a dependency is missing: bring it as a wheel (--wheels DIR; see results/gpu/README.md)"
        return 1
    }
}

environment() {
    "$PYTHON" - "$OUT/environment.json" "$CPU" <<'EOF'
import json, platform, subprocess, sys
import torch
out, cpu = sys.argv[1], sys.argv[2] == "1"
def command(*args):
    try:
        return subprocess.run(args, capture_output=True, text=True, check=False).stdout.strip()
    except OSError:
        return None
info = {
    "mode": "cpu dry run" if cpu else "gpu",
    "git_commit": command("git", "rev-parse", "HEAD"),
    "git_dirty": bool(command("git", "status", "--porcelain")),
    "python": platform.python_version(),
    "torch": torch.__version__,
    "cuda_available": torch.cuda.is_available(),
    "cuda": torch.version.cuda,
    "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
    "nvidia_smi": command("nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"),
    "cpu_threads": torch.get_num_threads(),
}
with open(out, "w") as f:
    json.dump(info, f, indent=2)
print(json.dumps(info))
EOF
}

gpu_tests() {
    local files
    mapfile -t files < <(grep -rl --include="test_*.py" "pytest.mark.gpu" tests | sort)
    ((${#files[@]})) || { echo "no test file uses the gpu marker"; return 1; }
    DPMUON_TEST_DEVICE="$TEST_DEVICE" "$PYTHON" -m pytest -m gpu -p no:cacheprovider -q -rs \
        --junitxml="$OUT/pytest_gpu.xml" "${files[@]}" 2>&1 | tee "$OUT/pytest_gpu.log"
}

smoke() {
    local private
    private="$("$PYTHON" -m dpmuon.config.roster --private)" || return 1  # every DP optimizer of conf/optimizer/
    "$PYTHON" -m dpmuon.train -m experiment=e2e optimizer="$private" "${SMOKE_MODEL[@]}" \
        "${SMOKE[@]}" trainer.device="$DEVICE" trainer.precision=bf16 trainer.eval_every=0 trainer.checkpoint_every=0 \
        trainer.keep_checkpoint=false logging.progress=false logger=none hydra.sweep.dir="$OUT/smoke" || return 1
    "$PYTHON" scripts/make_tables.py "$OUT/smoke" --out "$OUT/tables" || return 1
    smoke_report
}

# smoke.{json,md}: per optimizer the steps, ε, first and last train loss and the median step time.
smoke_report() {
    "$PYTHON" - "$OUT" <<'EOF'
import json, statistics, sys
from pathlib import Path
from dpmuon.eval.runs import find_runs
out = Path(sys.argv[1])
rows = []
for run in find_runs([out / "smoke"]):
    summary = run.summary
    metrics = run.load_metrics(diagnostics=True)  # train loss and step times: diagnostics.jsonl unless published
    losses = [m["train_loss"] for m in metrics if m.get("train_loss") is not None]
    seconds = [m["step_seconds"] for m in metrics if m.get("step_seconds") is not None]
    rows.append({
        "optimizer": summary["optimizer"], "model": summary["model"], "steps": summary["steps"],
        "epsilon": summary["epsilon"], "expected_lot_size": summary["expected_lot_size"],
        "train_loss_first": losses[0] if losses else None, "train_loss_last": losses[-1] if losses else None,
        "median_step_seconds": statistics.median(seconds) if seconds else None,
        "test_nll": summary["test_nll"], "bleu": summary["bleu"], "test_sources": summary["test_sources"],
    })
(out / "smoke.json").write_text(json.dumps(rows, indent=2))
def cell(value):
    return "-" if value is None else f"{value:.4g}" if isinstance(value, float) else str(value)
lines = ["| " + " | ".join(rows[0]) + " |", "|" + " --- |" * len(rows[0])] if rows else []
lines += ["| " + " | ".join(cell(v) for v in row.values()) + " |" for row in rows]
(out / "smoke.md").write_text("\n".join(lines) + "\n")
print("\n".join(lines))
if len(rows) != 4 or any(r["train_loss_last"] is None for r in rows):
    sys.exit("expected four finished smoke runs")
EOF
}

bench() {
    local mb rc=0
    for mb in "${MICRO_BATCHES[@]}"; do
        "$PYTHON" scripts/bench_step.py "${BENCH[@]}" --micro-batch "$mb" --engines fast --clip-modes per_matrix --phases \
            --json "$OUT/bench_mb$mb.json" 2>&1 | tee "$OUT/bench_mb$mb.txt" || rc=1
    done
    return "$rc"
}

# fsdp: the same private run under DDP and under FSDP on two devices (the dry run: two gloo
# processes), from one mechanism seed, so both draw the same lots and noise: with two ranks both
# add the ranks' float64 sums as S0 + S1, so the weights must agree bit for bit.
fsdp() {
    local devices strategy seed_dir rc=0
    if ((CPU)); then devices=2; else devices="$("$PYTHON" -c 'import torch; print(torch.cuda.device_count())')" || return 1; fi
    if ((devices < 2)); then
        echo '{"skipped": "fewer than two GPUs"}' >"$OUT/fsdp.json"
        echo "one GPU: no FSDP run"
        return 0
    fi
    # The shared seed stays out of OUT (whose files are kept) and is removed when the runs end.
    seed_dir="$(mktemp -d)" || return 1
    (umask 077 && "$PYTHON" -c 'import secrets; print(secrets.randbits(128))' >"$seed_dir/mechanism_seed") || rc=1
    for strategy in ddp fsdp; do
        ((rc)) || "$PYTHON" -m torch.distributed.run --standalone --nproc_per_node=2 -m dpmuon.train experiment=e2e \
            optimizer=dp_muon "${SMOKE_MODEL[@]}" "${FSDP[@]}" trainer.device="$DEVICE" trainer.strategy="$strategy" \
            trainer.eval_every=0 trainer.checkpoint_every=0 trainer.keep_checkpoint=false \
            privacy.mechanism_seed_file="$seed_dir/mechanism_seed" logging.progress=false logger=none \
            hydra.run.dir="$OUT/fsdp/$strategy" || rc=1
    done
    rm -rf "$seed_dir"
    ((rc == 0)) || return 1
    "$PYTHON" - "$OUT" <<'EOF'
import json, statistics, sys
from pathlib import Path
from dpmuon.eval.runs import find_runs
out = Path(sys.argv[1])
runs = {run.summary["strategy"]: run for run in find_runs([out / "fsdp"])}
report = {"same_final_weights": len({run.summary["final_weights_sha256"] for run in runs.values()}) == 1}
for strategy, run in sorted(runs.items()):
    seconds = [m["step_seconds"] for m in run.load_metrics(diagnostics=True) if m.get("step_seconds") is not None]
    report[strategy] = {"epsilon": run.summary["epsilon"], "test_nll": run.summary["test_nll"],
                        "median_step_seconds": statistics.median(seconds) if seconds else None}
(out / "fsdp.json").write_text(json.dumps(report, indent=2))
print(json.dumps(report))
if sorted(runs) != ["ddp", "fsdp"] or not report["same_final_weights"]:
    sys.exit("the FSDP run did not reach the DDP run's weights")
EOF
}

if [[ -n $RUN_STAGE ]]; then
    case "$RUN_STAGE" in
        environment | gpu_tests | smoke | bench | fsdp) "$RUN_STAGE"; exit ;;
        *) echo "unknown stage $RUN_STAGE" >&2; exit 2 ;;
    esac
fi

printf 'stage\texit_code\tseconds\n' >"$STATUS"
FAILED=0
log "output folder: $OUT ($([[ $CPU == 1 ]] && echo 'CPU dry run' || echo GPU))"
# The environment first (it needs only torch): without a GPU the real check stops here.
stage environment 30
if ((!CPU)) && ! grep -q '"cuda_available": true' "$OUT/environment.json" 2>/dev/null; then
    log "no CUDA device: run with --cpu for the dry run"
    exit 1
fi
# Installing runs in this shell (pip without an index is quick), so that a PYTHONPATH fallback
# reaches the stages after it.
start=$SECONDS
install >>"$LOG" 2>&1
rc=$?
printf 'install\t%s\t%s\n' "$rc" "$((SECONDS - start))" >>"$STATUS"
if ((rc != 0)); then
    log "install FAILED (exit $rc): cannot continue; see $LOG"
    exit 1
fi
stage gpu_tests "$BUDGET_TESTS"
stage smoke "$BUDGET_SMOKE"
stage bench "$BUDGET_BENCH"
stage fsdp "$BUDGET_FSDP"
log "done in ${SECONDS}s; stages: $(tail -n +2 "$STATUS" | awk '{printf "%s=%s ", $1, $2}')"
exit "$FAILED"
