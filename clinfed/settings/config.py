"""The run's settings as one object: :class:`RunConfig`, the concerns
together with the chosen strategy's options."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import Field, asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from clinfed.core.errors import ClinfedError
from clinfed.settings.concerns import (
    CONCERNS,
    DataSettings,
    FederationSettings,
    MachineSettings,
    ModelSettings,
    PrivacySettings,
    RunSettings,
    TrainingSettings,
)
from clinfed.settings.values import check_bounds, check_value, flatten, load_file, unknown_key


@dataclass
class RunConfig(
    MachineSettings,
    PrivacySettings,
    FederationSettings,
    TrainingSettings,
    ModelSettings,
    DataSettings,
    RunSettings,
):
    """Everything that decides a run: the concern dataclasses above, plus the
    chosen strategy's options (``strategy_options``, validated by that
    strategy's own options dataclass). Written to ``RUN/config.json``."""

    strategy_options: dict[str, Any] = field(
        default_factory=dict, metadata={"help": "The chosen strategy's options."}
    )

    # ----------------------------------------------------------- building
    @classmethod
    def from_values(cls, values: Mapping[str, Any], source: str = "settings") -> RunConfig:
        """A config from keys named like the fields: flat, or nested in a
        table per concern (``[training] lr = 1e-4``), strategy options at the
        top level or under ``strategy_options``. ``source`` names the file in
        errors."""
        flat = flatten(values, source)
        known = schema_fields()
        options_known = strategy_option_fields()
        direct: dict[str, Any] = {}
        options: dict[str, Any] = dict(flat.pop("strategy_options", None) or {})
        for key, value in flat.items():
            name = key.replace("-", "_")
            if name in known:
                direct[name] = check_value(known[name], value, source)
            elif name in options_known:
                options[name] = value
            else:
                raise unknown_key(key, source, all_names())
        for key in list(options):
            name = key.replace("-", "_")
            if name not in options_known:
                raise unknown_key(key, source, all_names())
            options[name] = check_value(options_known[name], options.pop(key), source)
        return cls(**direct, strategy_options=options)

    @classmethod
    def of(cls, **values: Any) -> RunConfig:
        """:meth:`from_values` with keyword arguments (strategy options too)."""
        return cls.from_values(values, "settings")

    def to_dict(self) -> dict[str, Any]:
        """The settings nested by concern (``RUN/config.json``; accepted back
        by :meth:`from_values`). ``out`` and ``resume`` are where and how it
        ran, not what: they are left out."""
        # Standard JSON has no infinity: "inf" (read back by from_values).
        values = {
            k: "inf" if isinstance(v, float) and math.isinf(v) else v
            for k, v in asdict(self).items()
        }
        nested: dict[str, Any] = {}
        for concern, cls in CONCERNS.items():
            if concern == "run":
                continue
            nested[concern] = {f.name: values[f.name] for f in fields(cls)}
        nested["strategy_options"] = dict(self.strategy_options)
        return nested

    def replace(self, **changes: Any) -> RunConfig:
        return replace(self, **changes)

    # ---------------------------------------------------------- checking
    def validate(self, check_data: bool = True) -> None:
        """Reject impossible settings before anything is read or written
        (``check_data=False``: the data is elsewhere, at Flower nodes); the
        rules are :mod:`clinfed.settings.rules`."""
        from clinfed.settings.rules import check_run

        check_run(self, check_data)

    def check_values(self) -> None:
        """Each setting within the bounds its declaration states."""
        for f in schema_fields().values():
            check_bounds(f, getattr(self, f.name))

    @property
    def dp(self) -> bool:
        """Whether sites train under DP-SGD (``--target-epsilon inf`` is no DP)."""
        finite_target = self.target_epsilon is not None and not math.isinf(self.target_epsilon)
        return finite_target or self.noise_multiplier is not None

    def trained_parameters(self) -> str:
        """The plan's trained parameters (``--adapter``): as given, else under
        DP the task's measured private plan (``Task.dp_adapter``) where the
        strategy follows it, else every weight."""
        from clinfed.federated.strategies import STRATEGIES
        from clinfed.tasks import TASKS

        if self.adapter is not None:
            return self.adapter
        if self.dp and STRATEGIES[self.strategy].follows_task_plan:
            return TASKS[self.task].dp_adapter
        return "none"

    def resolved(self) -> RunConfig:
        """A copy with every unset setting filled from the task's defaults and
        the strategy's (its options completed from their own defaults)."""
        from clinfed.federated.strategies import STRATEGIES
        from clinfed.tasks import TASKS

        strategy = STRATEGIES[self.strategy]
        adapter = self.trained_parameters()
        defaults = {"adapter": adapter} | dict(TASKS[self.task].defaults)
        if self.dp and adapter == "none":
            # Every weight under DP trains at the task's measured private rates.
            defaults |= TASKS[self.task].dp_rates
        defaults |= dict(strategy.training_defaults)
        if adapter != "none":
            from clinfed.modeling.adapters import TRAINING_DEFAULTS

            defaults |= TRAINING_DEFAULTS
        if self.dp:
            # Under DP each site derives its batch from its own size
            # (clinfed.privacy.recipe) unless --batch-size is given.
            defaults.pop("batch_size", None)
        if self.local_epochs is None:
            from clinfed.privacy.recipe import dp_local_epochs

            defaults["local_epochs"] = dp_local_epochs(adapter) if self.dp else 1
        if self.lr_decay is None:
            from clinfed.privacy.recipe import DP_LR_DECAY

            defaults["lr_decay"] = DP_LR_DECAY if self.dp else "none"
        changes = {k: v for k, v in defaults.items() if getattr(self, k) is None}
        options = asdict(strategy.make_options(self.strategy_options, self.strategy))
        return replace(self, **changes, strategy_options=options)

    def options(self) -> Any:
        """The chosen strategy's options dataclass."""
        from clinfed.federated.strategies import STRATEGIES

        return STRATEGIES[self.strategy].make_options(self.strategy_options, self.strategy)


# --------------------------------------------------------------- helpers
def schema_fields() -> dict[str, Field]:
    """Every field of the concern dataclasses, by name."""
    return {f.name: f for f in fields(RunConfig) if f.name != "strategy_options"}


def concern_of(name: str) -> str:
    for concern, cls in CONCERNS.items():
        if any(f.name == name for f in fields(cls)):
            return concern
    return "strategy_options"


def strategy_option_fields() -> dict[str, Field]:
    """Every registered strategy's option fields, by name (a name shared by
    two strategies means the same setting, with the same default)."""
    from clinfed.federated.strategies import STRATEGIES

    found: dict[str, Field] = {}
    for strategy in STRATEGIES.values():
        for f in fields(strategy.options):
            found.setdefault(f.name, f)
    return found


def option_owners() -> dict[str, list[str]]:
    """Option name -> the strategies that take it."""
    from clinfed.federated.strategies import STRATEGIES

    owners: dict[str, list[str]] = {}
    for name, strategy in STRATEGIES.items():
        for f in fields(strategy.options):
            owners.setdefault(f.name, []).append(name)
    return owners


def all_names() -> list[str]:
    return [*schema_fields(), *strategy_option_fields()]


def read_run_config(run: Path) -> dict[str, Any]:
    """A run folder's settings, flat (strategy options beside the rest), for
    readers of finished runs (report, audit, sweep tables)."""
    path = Path(run) / "config.json"
    if not path.is_file():
        raise ClinfedError(f"{run}: no config.json (not a clinfed run folder?)")
    config = RunConfig.from_values(load_file(path), str(path))
    flat = asdict(config)
    options = flat.pop("strategy_options")
    return flat | options
