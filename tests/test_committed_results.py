"""The committed results are what the committed run files say: regenerating each table from
results/<dataset>/runs (and the regime map's from results/bc_regime) must reproduce the
committed table files byte for byte."""

from pathlib import Path

import pytest

from dpmuon.eval.cli import tables_main
from dpmuon.paths import REPO_ROOT

RESULTS = REPO_ROOT / "results"
TABLE_FILES = ("table.md", "table.csv", "table.tex")
COMMITTED = sorted(p.parent for p in RESULTS.glob("*/runs") if (p.parent / "table.md").exists())


@pytest.mark.skipif(not COMMITTED, reason="no committed results/<dataset>/ with runs and tables")
@pytest.mark.parametrize("dataset_dir", COMMITTED, ids=lambda p: p.name)
def test_committed_tables_regenerate_exactly_from_committed_runs(dataset_dir: Path, tmp_path: Path):
    assert tables_main([str(dataset_dir / "runs"), "--out", str(tmp_path)]) == 0
    regenerated = tmp_path / dataset_dir.name
    for name in TABLE_FILES:
        committed = dataset_dir / name
        assert committed.exists(), f"{committed} is missing"
        assert (regenerated / name).read_text() == committed.read_text(), f"{committed} differs from a fresh make_tables.py run"


def test_the_smollm2_lora_table_regenerates_exactly_from_its_runs(tmp_path: Path):
    committed = RESULTS / "smollm2_lora"
    assert tables_main([str(committed / "runs"), "--out", str(tmp_path)]) == 0
    for name in TABLE_FILES:
        assert (tmp_path / "e2e" / name).read_text() == (committed / "e2e" / name).read_text(), name


BC_REGIME = RESULTS / "bc_regime"


@pytest.mark.skipif(not (BC_REGIME / "regime.md").exists(), reason="no committed results/bc_regime/ tables")
def test_committed_regime_tables_regenerate_exactly_from_committed_runs(tmp_path: Path):
    from studies.bc_regime_report import write_report

    write_report(BC_REGIME, tmp_path)
    for name in ("regime.md", "regime.csv"):
        assert (tmp_path / name).read_text() == (BC_REGIME / name).read_text(), f"{BC_REGIME / name} differs from a fresh report"


FAIR = BC_REGIME / "fair"


@pytest.mark.skipif(not (FAIR / "fair.md").exists(), reason="no committed results/bc_regime/fair/ table yet")
def test_committed_fair_comparison_regenerates_exactly_from_committed_runs(tmp_path: Path):
    from studies.bc_fair_report import write_report

    write_report(FAIR, tmp_path)
    assert (tmp_path / "fair.md").read_text() == (FAIR / "fair.md").read_text(), f"{FAIR / 'fair.md'} differs from a fresh report"


SMOLLM2_FAIR = RESULTS / "smollm2_fair"


@pytest.mark.skipif(not (SMOLLM2_FAIR / "fair.md").exists(), reason="no committed results/smollm2_fair/ report yet")
def test_committed_smollm2_study_report_regenerates_exactly_from_committed_runs(tmp_path: Path):
    from studies.smollm2_fair_report import write_report

    write_report(SMOLLM2_FAIR, tmp_path)
    assert (tmp_path / "fair.md").read_text() == (SMOLLM2_FAIR / "fair.md").read_text(), f"{SMOLLM2_FAIR / 'fair.md'} differs from a fresh report"
