"""User-facing errors.

A `UserError` is a mistake in what the user gave us (a config value, a file, a command-line flag). The CLI prints
its message as one sentence and exits with status 2, without a traceback. Everything else is a bug and keeps its
traceback.
"""

from __future__ import annotations


class UserError(Exception):
    """A mistake in the user's input; the message says what is wrong and what to do."""


class ConfigError(UserError):
    """A config file or override names an unknown key, has a wrong type or an out-of-range value."""


class LayoutError(UserError):
    """Durations, resolutions, text lengths or sequence lengths that do not fit the long-video layout."""
