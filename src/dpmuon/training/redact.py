"""Keep a user-given mechanism seed out of everything a run writes or prints.

`privacy.mechanism_seed=<int>` regenerates every lot and every noise draw of a run, so its value
is as secret as the noise itself. Hydra records overrides in several files (the run's
`.hydra/{config,overrides,hydra}.yaml`, the sweep's `multirun.yaml`) and its launchers log
them; the driver scrubs those files as soon as the job starts and filters log records, and the
recorded command line is redacted the same way.
"""

from __future__ import annotations

import logging
import re
from pathlib import Path

SECRET_KEY = "mechanism_seed"
REDACTED = "redacted"  # a plain word: redacted overrides still parse (and a sweep keeps its length)
# `mechanism_seed=7` in overrides and command lines (sweeps: `=1,2,3`, `=range(1,4)`; Hydra's
# override_dirname continues with `,next.key=…`, so a value is integers only), `mechanism_seed: 7` in YAML.
_VALUE = r"(?:-?\d+|null|None|range\([^)]*\))"
_OVERRIDE = re.compile(rf"({SECRET_KEY}\s*=\s*)({_VALUE}(?:,{_VALUE})*)")
_YAML = re.compile(rf"^(\s*{SECRET_KEY}\s*:\s*)(\S.*)$", re.MULTILINE)


def redact(text: str) -> str:
    """The text with every mechanism-seed value replaced (YAML values by null)."""
    text = _OVERRIDE.sub(lambda m: m.group(1) + _redact_values(m.group(2)), text)
    return _YAML.sub(lambda m: m.group(1) + "null", text)


def _redact_values(values: str) -> str:
    return ",".join(v if v in ("null", "None") else REDACTED for v in re.findall(_VALUE, values))


def scrub_files(paths) -> None:
    """Rewrite each existing file with its mechanism-seed values redacted."""
    for path in map(Path, paths):
        if path.is_file():
            text = path.read_text(encoding="utf-8")
            clean = redact(text)
            if clean != text:
                path.write_text(clean, encoding="utf-8")


def hydra_files(run_dir: Path, sweep_dir: Path | None) -> list[Path]:
    files = [Path(run_dir) / ".hydra" / name for name in ("config.yaml", "overrides.yaml", "hydra.yaml")]
    return files + ([Path(sweep_dir) / "multirun.yaml"] if sweep_dir is not None else [])


class _RedactingRecordFactory:
    def __init__(self, factory):
        self.factory = factory

    def __call__(self, *args, **kwargs):
        record = self.factory(*args, **kwargs)
        message = record.getMessage()
        if SECRET_KEY in message:
            record.msg, record.args = redact(message), ()
        return record


def install_log_redaction() -> None:
    """Redact mechanism seeds in every log record of this process (e.g. Hydra's launch lines)."""
    factory = logging.getLogRecordFactory()
    if not isinstance(factory, _RedactingRecordFactory):
        logging.setLogRecordFactory(_RedactingRecordFactory(factory))
