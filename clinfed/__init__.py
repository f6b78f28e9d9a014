"""clinfed: federated training of clinical NLP models with privacy accounting.

The Python API (:mod:`clinfed.api`): :func:`train`, :func:`evaluate`,
:func:`predict`, :func:`report` and :func:`synthesize`. Importing
``clinfed`` is cheap; torch and the rest load on the first call.
"""

from typing import Any

__version__ = "0.1.0"
__all__ = ["train", "evaluate", "predict", "report", "synthesize", "__version__"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from clinfed import api

        return getattr(api, name)
    raise AttributeError(f"module 'clinfed' has no attribute {name!r}")
