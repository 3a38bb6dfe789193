"""Exceptions shared across roles. Torch-free."""


class UsageError(Exception):
    """Bad input from the user (config, CLI argument, file): reported as one line, exit code 2."""


class PeerTimeoutError(RuntimeError):
    """A rank waited on another rank longer than its timeout; the message names the silent peer."""


class RankFailedError(RuntimeError):
    """A rank of the world failed; the message names its rank and role."""
