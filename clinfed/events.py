"""The progress events every runner reports: one callback type for all.

A runner (the in-process pipeline, the round engine, a site) calls
``report(event, info)`` as it goes: the CLI draws progress bars from it,
``--report-to`` logs from it, and a library caller may pass its own.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

Reporter = Callable[[str, dict[str, Any]], None]


def silent(event: str, info: dict[str, Any]) -> None:
    """The reporter that drops every event (the default)."""
    del event, info
