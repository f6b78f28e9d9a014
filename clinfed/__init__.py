"""clinfed: federated training of clinical NLP models with privacy accounting.

The Python API (:mod:`clinfed.api`): :func:`synthesize`, :func:`warm_start`,
:func:`train`, :func:`evaluate`, :func:`predict`, :func:`report`,
:func:`audit`, :func:`export` and :func:`plan`. Importing ``clinfed`` is
cheap; torch and the rest load on the first call.
"""

from typing import Any

from clinfed.core.version import __version__

__all__ = [
    "synthesize", "warm_start", "train", "evaluate", "predict", "report", "audit", "export",
    "plan", "__version__",
]  # fmt: skip


def __getattr__(name: str) -> Any:
    if name in __all__:
        from clinfed import api

        return getattr(api, name)
    raise AttributeError(f"module 'clinfed' has no attribute {name!r}")


def __dir__() -> list[str]:
    """What ``dir(clinfed)`` and completion show: the API, loaded or not."""
    return sorted(set(__all__) | {name for name in globals() if name.startswith("__")})
