"""Clinical task adapters: ``i2b2`` (concept extraction) and ``mimic3`` (ICD-9 coding).

Add a task by implementing :class:`clinfed.tasks.base.Task` in
``tasks/<name>/adapter.py`` and adding it to :data:`TASKS`.
"""

from __future__ import annotations

import inspect

from clinfed.errors import ClinfedError
from clinfed.tasks.base import Corpus, Task
from clinfed.tasks.i2b2.adapter import I2b2Task
from clinfed.tasks.mimic3.adapter import Mimic3Task

TASKS: dict[str, type[Task]] = {"i2b2": I2b2Task, "mimic3": Mimic3Task}


def get_task(name: str, **options) -> Task:
    """A task adapter by name.

    ``options`` are the run's task settings (``seed``, ``codes``, ``top_k``,
    ``max_chunks``, ``cache_dir``...); each task takes the ones its
    constructor names, so one call serves every task.
    """
    if name not in TASKS:
        raise ClinfedError(f"unknown task {name!r} (choose from {', '.join(TASKS)})")
    cls = TASKS[name]
    accepted = inspect.signature(cls.__init__).parameters
    return cls(**{k: v for k, v in options.items() if k in accepted})


__all__ = ["Corpus", "Task", "TASKS", "get_task"]
