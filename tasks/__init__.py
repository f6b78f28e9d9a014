"""Clinical task adapters: ``i2b2`` (concept extraction) and ``mimic3`` (ICD-9 coding).

A task is its folder (``tasks/<name>/``: ``adapter.py`` with its
:class:`~clinfed.tasks.base.Task` subclass, ``options.py`` with its settings,
its readers, metrics, synthesis, scoring and baselines) and one line in
:data:`REGISTRY`. Everything else (the run's schema, the command line, the
Python API, the report, Flower's checks) reaches it through :data:`TASKS`
and :func:`task_options`. Modules are imported when first used: the
schema reads a task's options without importing its model code.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterator, Mapping
from importlib import import_module
from typing import Any

# name -> (its Task subclass, its options dataclass), as "module:attribute".
REGISTRY: dict[str, tuple[str, str]] = {
    "i2b2": ("clinfed.tasks.i2b2.adapter:I2b2Task", "clinfed.tasks.i2b2.options:I2b2Options"),
    "mimic3": (
        "clinfed.tasks.mimic3.adapter:Mimic3Task",
        "clinfed.tasks.mimic3.options:Mimic3Options",
    ),
}


def _load(path: str) -> Any:
    module, attribute = path.split(":")
    return getattr(import_module(module), attribute)


class _Tasks(Mapping):
    """Task name -> Task subclass, each imported on first use."""

    def __getitem__(self, name: str) -> Any:
        if name not in REGISTRY:
            raise KeyError(name)
        return _load(REGISTRY[name][0])

    def __iter__(self) -> Iterator[str]:
        return iter(REGISTRY)

    def __len__(self) -> int:
        return len(REGISTRY)


TASKS: Mapping[str, Any] = _Tasks()


def task_options() -> dict[str, type]:
    """Each task's options dataclass (its settings), by task name."""
    return {name: _load(options) for name, (_, options) in REGISTRY.items()}


def task_baselines() -> dict[str, tuple[str, ...]]:
    """Each task's model-free baselines (``clinfed baseline --kind``), by
    task name, read from its options module (no model code imported)."""
    return {
        name: import_module(options.split(":")[0]).BASELINES
        for name, (_, options) in REGISTRY.items()
    }


def task_head(kind: str) -> type | None:
    """The model class a task brings for head ``kind`` (its ``head_class``),
    or ``None``: what :func:`clinfed.modeling.models.build_model` and
    ``load_saved_model`` look a head kind up with beyond their own."""
    for task in TASKS.values():
        if task.head == kind and getattr(task, "head_class", None) is not None:
            return task.head_class
    return None


def get_task(name: str, **options) -> Any:
    """A task adapter by name.

    ``options`` are the run's task settings (``seed``, ``codes``, ``top_k``,
    ``max_chunks``, ``cache_dir``...); each task takes the ones its
    constructor names, so one call serves every task.
    """
    from clinfed.core.errors import ClinfedError

    if name not in TASKS:
        raise ClinfedError(f"unknown task {name!r} (choose from {', '.join(TASKS)})")
    cls = TASKS[name]
    accepted = inspect.signature(cls.__init__).parameters
    return cls(**{k: v for k, v in options.items() if k in accepted})


def __getattr__(name: str) -> Any:
    # The interface, imported when asked for (it needs datasets and torch).
    if name in ("Corpus", "Task"):
        return getattr(import_module("clinfed.tasks.base"), name)
    raise AttributeError(name)


__all__ = [
    "Corpus", "REGISTRY", "TASKS", "Task", "get_task", "task_baselines", "task_head",
    "task_options",
]  # fmt: skip
