"""The ``unmask`` command line (see ``unmask.cli.main``)."""


class UsageError(Exception):
    """A bad command-line value or input file: printed as one line, exit status 2."""
