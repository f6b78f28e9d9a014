"""The settings of a run, declared once.

Every setting is a dataclass field with its help text and its bounds, in one
dataclass per concern (data, model, local training, federation, privacy,
machine); each strategy declares its own options dataclass in its own file
(``clinfed.federated.strategies``). From this one schema come:

* the ``clinfed train`` / ``sweep`` / ``flower run`` flags, grouped into
  ``--help`` panels by concern (``clinfed.commands.options``);
* ``--config FILE`` (TOML, or a run's own ``config.json``): keys named like
  the fields, at the top level or in a table per concern;
* ``RUN/config.json`` (written by :meth:`RunConfig.to_dict`, read back by
  :meth:`RunConfig.from_values`);
* the run config a Flower run carries to the ServerApp and every node.

One name per setting: the flag is the field name with dashes. Unknown keys
are refused with the nearest valid name; values are type-checked strictly
(``rounds = 1.5`` and ``rounds = true`` are errors, not 1); floats must be
finite unless the field says ``inf`` means something.

The package by job: :mod:`~clinfed.settings.concerns` (the dataclasses),
:mod:`~clinfed.settings.config` (:class:`RunConfig`),
:mod:`~clinfed.settings.rules` (what settings require of each other) and
:mod:`~clinfed.settings.values` (reading values and files).
"""

from clinfed.settings.concerns import (
    CONCERNS,
    EPSILON_CEILING,
    METADATA_KEYS,
    PANELS,
    PUBLIC_INPUTS,
    flag,
)
from clinfed.settings.config import (
    RunConfig,
    all_names,
    concern_of,
    option_owners,
    read_run_config,
    schema_fields,
    strategy_option_fields,
)
from clinfed.settings.values import (
    check_bounds,
    check_value,
    default_of,
    field_type,
    flatten,
    load_file,
    unknown_key,
    where,
)

__all__ = [
    "CONCERNS",
    "EPSILON_CEILING",
    "METADATA_KEYS",
    "PANELS",
    "PUBLIC_INPUTS",
    "RunConfig",
    "all_names",
    "check_bounds",
    "check_value",
    "concern_of",
    "default_of",
    "field_type",
    "flag",
    "flatten",
    "load_file",
    "option_owners",
    "read_run_config",
    "schema_fields",
    "strategy_option_fields",
    "unknown_key",
    "where",
]
