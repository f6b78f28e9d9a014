"""The rules between settings: what no single setting's bounds can say.

:meth:`RunConfig.validate <clinfed.settings.RunConfig.validate>` applies
them, before anything is read or written. Each rule names the settings it
concerns; the command line words them as flags.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from clinfed.core.errors import ClinfedError
from clinfed.settings.concerns import EPSILON_CEILING, PUBLIC_INPUTS, flag


def check_run(config: Any, check_data: bool = True) -> None:
    """Every rule (``check_data=False``: the data is elsewhere, at Flower
    nodes, and no folder is looked at)."""
    from clinfed.federated.strategies import STRATEGIES
    from clinfed.tasks import TASKS

    if config.task not in TASKS:
        raise ClinfedError(f"`task` must be one of {', '.join(TASKS)}, not {config.task!r}")
    if config.strategy not in STRATEGIES:
        raise ClinfedError(
            f"`strategy` must be one of {', '.join(STRATEGIES)}, not {config.strategy!r}"
        )
    config.check_values()  # each setting within its declared bounds
    strategy = STRATEGIES[config.strategy]
    strategy.make_options(config.strategy_options, config.strategy)  # raises on bad options
    strategy.check_config(config)
    _check_task_and_sites(config, TASKS[config.task], strategy)
    _check_privacy(config, strategy)
    _check_inputs(config, strategy, check_data)


def _check_task_and_sites(config: Any, task: Any, strategy: Any) -> None:
    if config.labels is not None and not task.accepts_fixed_labels:
        raise ClinfedError(f"`labels` (a fixed label list) does not apply to `task` {config.task}")
    if config.partition != "sites" and config.sites < 1:
        raise ClinfedError(f"`partition` {config.partition} needs `sites` N")
    if config.partition == "sites" and config.sites:
        raise ClinfedError("`sites` N needs `partition` iid or dirichlet")
    if not strategy.shares_model and config.partition != "sites":
        raise ClinfedError(
            f"`strategy` {config.strategy} evaluates each site's own model on its own data: "
            "use `partition` sites"
        )
    if config.privacy_unit not in task.units:
        raise ClinfedError(
            f"`privacy_unit` {config.privacy_unit}: `task` {config.task} offers "
            f"{', '.join(task.units)}"
        )


def _check_privacy(config: Any, strategy: Any) -> None:
    if config.secure_aggregation:
        if strategy.pooled or not strategy.uploads:
            raise ClinfedError(
                f"`secure_aggregation`: `strategy` {config.strategy} sends no updates to sum"
            )
        if config.audit_holdout:
            raise ClinfedError(
                "`audit_holdout` attacks each site's own update, which secure aggregation "
                "keeps from everyone: choose one"
            )
    if not config.dp:
        return
    if config.precision != "fp32":
        raise ClinfedError(
            f"`precision` {config.precision} under DP: per-example gradient norms and "
            "clipping must be exact (fp32), or the clipping bound the accounting assumes "
            "does not hold"
        )
    target = config.target_epsilon
    if target is not None and target > EPSILON_CEILING and not config.accept_large_epsilon:
        raise ClinfedError(
            f"`target_epsilon` {target:g} is above {EPSILON_CEILING:g}: a bound "
            "that large protects nobody in practice; give `accept_large_epsilon` to run it "
            "anyway"
        )
    if not (config.max_grad_norm > 0 and math.isfinite(config.max_grad_norm)):
        raise ClinfedError("`max_grad_norm` must be a positive finite number under DP")
    if strategy.pooled:
        raise ClinfedError(
            f"DP-SGD runs at the sites of a federated strategy, not `strategy` {config.strategy}"
        )


def _check_inputs(config: Any, strategy: Any, check_data: bool) -> None:
    if config.public_check and (strategy.pooled or not strategy.shares_model):
        raise ClinfedError(
            f"`public_check` needs a strategy with one shared model, not `strategy` "
            f"{config.strategy}: the server scores the global model"
        )
    if not check_data:
        return
    from clinfed.core.runs import read_user_file

    for name in ("types", "public_types"):
        value = getattr(config, name, None)
        if isinstance(value, str) and value.endswith(".toml"):
            # Read before the run folder is claimed: a FIFO never blocks.
            read_user_file(value, f"{flag(name)} {value}")
    if config.public_check and not Path(config.public_check).is_dir():
        raise ClinfedError(f"`public_check` {config.public_check}: not a folder")
    if not Path(config.data).is_dir():
        raise ClinfedError(f"`data` {config.data}: not a folder")
    from clinfed.core.provenance import check_public_input, check_start_is_public

    for name in PUBLIC_INPUTS:
        if getattr(config, name):
            check_public_input(flag(name), getattr(config, name), config.data)
    from clinfed.modeling.models import saved_run_model

    saved = saved_run_model(config.model)
    if saved is not None:
        try:
            start = json.loads((saved / "model.json").read_text()).get("public_start")
        except (OSError, ValueError, AttributeError):
            raise ClinfedError(
                f"`model` {config.model}: {saved / 'model.json'} is not a clinfed model record"
            ) from None
        check_start_is_public(start, config.model, config.data)
    if config.out:
        from clinfed.core.runs import ensure_outside

        # Run outputs (predictions, copies) would land inside the corpus.
        ensure_outside(config.out, config.data)
