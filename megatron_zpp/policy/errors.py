"""``ConfigError``: a configuration the user gave that cannot run, as opposed to a bug.

Raised for a bad flag value, policy, policy file or flag combination, with a message that names the value and
the valid choices. ``pretrain_gpt.py`` prints it as one line, from rank 0 only, and every rank exits with 2
(argparse's status for a usage error); any other exception is a bug and keeps its traceback. It lives in the
policy layer, the lowest one that validates user input, so that every layer above can raise it.
"""

from __future__ import annotations


class ConfigError(ValueError):
    """A user's configuration error; the message is one line naming the value and the valid choices.

    A ``ValueError``, as before it existed, so callers that catch ``ValueError`` still do. Raise it only where
    the cause is the configuration (the same on every rank, as every rank is given the same command line), never
    for a failure of the code or the machine.
    """


class ConfigFileNotFoundError(ConfigError, FileNotFoundError):
    """A file a flag names does not exist: a configuration error, and still a ``FileNotFoundError`` for callers
    that catch that."""
