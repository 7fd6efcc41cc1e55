"""The one exception type the data layer raises for problems a user can fix."""

from __future__ import annotations

from os import PathLike


class DataError(ValueError):
    """A data file is missing, malformed or of an unexpected kind.

    Messages are meant to be shown to users as they are: they name the file, the line when
    there is one, what was found and what was expected or what to run.
    """

    @classmethod
    def in_file(cls, path: str | PathLike[str], problem: str, line: int | None = None) -> DataError:
        """Build an error located at `path` (and 1-based `line`, when known)."""
        where = f"{path}, line {line}" if line is not None else f"{path}"
        return cls(f"{where}: {problem}")
