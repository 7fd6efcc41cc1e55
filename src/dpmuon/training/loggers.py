"""Where a run's numbers go: always the run directory; optionally Weights & Biases."""

from __future__ import annotations

import os
import shutil
from collections.abc import Mapping
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from .. import run_folder
from .run_files import MetricsLog


class NullLogger:
    """For ranks > 0 under torchrun: rank 0 owns the run's files."""

    run_id: str | None = None

    def log(self, row: Mapping, publish: bool = True) -> None:
        pass

    def summary(self, summary: Mapping) -> None:
        pass

    def images(self, images: Mapping[str, Path]) -> None:
        pass

    def finish(self) -> None:
        pass


class LocalLogger(NullLogger):
    """metrics.jsonl in the run directory (crash-safe appends)."""

    def __init__(self, run_dir: Path):
        self.metrics = MetricsLog(Path(run_dir) / run_folder.METRICS)

    def log(self, row: Mapping, publish: bool = True) -> None:
        self.metrics.append(dict(row))


class WandbLogger(LocalLogger):
    """Also logs to W&B: config, per-step rows, summary and the run's curves.

    Offline (<run dir>/wandb/offline-run-*, upload with `wandb sync`) when no API key is configured.
    With `per_step=False` (non-private diagnostics not published) W&B sees only the rows the
    loop marks for publishing (evaluation points and the last step), collects no system metrics,
    captures no console, and its debug logs (a timestamped line per event) are removed when the
    run ends: W&B stamps every logged row with its wall time, and per-step times, like system
    load, track the lot size unless the steps are constant-time.
    """

    def __init__(self, run_dir: Path, cfg: Mapping, config: Mapping, run_id: str | None, name: str, per_step: bool = True):
        super().__init__(run_dir)
        import wandb

        mode = cfg.get("mode") or os.environ.get("WANDB_MODE")
        if mode is None:
            mode = "online" if (os.environ.get("WANDB_API_KEY") or _has_netrc_key()) else "offline"
        self._wandb = wandb
        self._run = wandb.init(
            project=cfg.get("project", "dpmuon"),
            entity=cfg.get("entity"),
            group=cfg.get("group"),
            tags=list(cfg.get("tags") or []),
            name=name,
            config=dict(config),
            dir=str(run_dir),
            mode=mode,
            id=run_id,
            resume="allow",
            settings=None if per_step else wandb.Settings(x_disable_stats=True, x_disable_meta=True, console="off"),
        )
        self.per_step = per_step
        self.run_id = self._run.id if self._run is not None else None
        settings = getattr(self._run, "settings", None)
        # W&B's own debug logs, and the links to them beside the run folders (not needed to sync).
        self._debug_logs = [] if per_step or settings is None else [
            Path(path) for path in (settings.log_symlink_user, settings.log_symlink_internal, settings.log_dir)
        ]  # fmt: skip

    def log(self, row: Mapping, publish: bool = True) -> None:
        super().log(row)
        if not (self.per_step or publish):
            return
        flat = {k: v for k, v in row.items() if not isinstance(v, dict)}
        for key, value in row.items():
            if isinstance(value, dict):
                flat.update({f"{key}/{k}": v for k, v in value.items()})
        self._wandb.log(flat, step=int(row["step"]))

    def summary(self, summary: Mapping) -> None:
        for key, value in summary.items():
            if isinstance(value, (int, float, str, bool)) or value is None:
                self._run.summary[key] = value

    def images(self, images: Mapping[str, Path]) -> None:
        self._wandb.log({name: self._wandb.Image(str(path)) for name, path in images.items()})

    def finish(self) -> None:
        self._wandb.finish()
        for path in self._debug_logs:
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path, ignore_errors=True)
            else:
                path.unlink(missing_ok=True)


def _has_netrc_key() -> bool:
    netrc = Path.home() / ".netrc"
    return netrc.exists() and "api.wandb.ai" in netrc.read_text(errors="ignore")


def public_config(cfg: DictConfig) -> dict:
    """The resolved config as it may be published (W&B): it holds no seed (see training/secret.py)."""
    return OmegaConf.to_container(cfg, resolve=True)


def build_logger(cfg: Mapping, run_dir: Path, config: Mapping, run_id: str | None, name: str, per_step: bool = True) -> LocalLogger:
    kind = cfg.get("name", "none")
    if kind == "none":
        return LocalLogger(run_dir)
    if kind == "wandb":
        return WandbLogger(run_dir, cfg, config, run_id, name, per_step)
    raise ValueError(f"unknown logger {kind!r}; valid: none, wandb")
