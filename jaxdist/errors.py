"""The exceptions a user reads as one line: a mistake they can fix (config, mesh, data, files),
and a run that stopped on purpose."""


class ConfigError(ValueError):
    """A user-facing error: the message names the cause and the fix.

    The CLI prints it as one line and exits non-zero, without a traceback.
    """


class TrainingStopped(RuntimeError):
    """The run stopped on purpose (a non-finite step under policy `stop`, a checkpoint that
    cannot be written or read back); the message says why.

    The CLI prints it as one line and exits 1; every checkpoint already committed stays.
    """
