"""The privacy library's errors: a bad setting, named by its field.

The library knows settings by their names and writes them in backticks
(```target_epsilon```); whoever shows the error to a person words the name
their way (the command line as ``--target-epsilon``, the Python API as
``target_epsilon``).
"""

from __future__ import annotations


class PrivacyError(Exception):
    """An error a user can fix (bad input, a refused budget); one line."""


class SettingError(PrivacyError):
    """A setting with a value the library refuses.

    The message names the setting in backticks (```noise_multiplier` must be
    positive```), as every library error names a setting; whoever shows it
    words the name their way (:func:`clinfed.core.errors.worded`).

    Attributes
    ----------
    setting
        The setting's name, with underscores (``noise_multiplier``).
    reason
        What is wrong, without the name (``must be positive, not -1``).
    """

    def __init__(self, setting: str, reason: str):
        self.setting, self.reason = setting, reason
        super().__init__(f"`{setting}` {reason}")
