"""Errors a user can fix: printed as one line by the command-line entry points, no traceback."""


class UserError(Exception):
    """Bad configuration, impossible privacy settings, missing inputs."""
