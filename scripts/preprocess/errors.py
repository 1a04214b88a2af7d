"""How preprocessing fails, and the exit status each failure gives (docs/data.md lists them)."""

EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2


class UsageError(Exception):
    """A problem with the command line or its inputs, found before anything is written (exit 2)."""


class ReadError(Exception):
    """An input that failed while being read (a damaged compressed file, an I/O error): exit 1."""
