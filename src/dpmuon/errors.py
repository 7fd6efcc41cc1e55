"""Errors a user can fix: printed as one line by the command-line entry points, no traceback."""

from __future__ import annotations

from typing import Any


class UserError(Exception):
    """Bad configuration, impossible privacy settings, missing inputs."""


class ConfigError(UserError):
    """A configured value that cannot be used: `<key>=<value>: <what is wrong>; valid: <...>`."""

    def __init__(self, key: str, value: Any, problem: str, valid: str):
        self.key, self.problem, self.valid = key, problem, valid
        super().__init__(f"{key}={shown_value(value)}: {one_line(problem)}; valid: {valid}")


def shown_value(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    return str(value)


def one_line(text: str) -> str:
    """The first line of a (library) message, so an error stays one line; a first line that
    announces a list ("… from one of:") is joined with the lines it announces."""
    lines = [line.strip() for line in str(text).strip().splitlines() if line.strip()]
    if not lines:
        return "invalid"
    return " ".join(lines) if lines[0].endswith(":") else lines[0]
