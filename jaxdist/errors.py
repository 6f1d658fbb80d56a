"""The one exception type for mistakes a user can make (config, mesh, data, files)."""


class ConfigError(ValueError):
    """A user-facing error: the message names the cause and the fix.

    The CLI prints it as one line and exits non-zero, without a traceback.
    """
