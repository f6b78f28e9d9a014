"""One site, assembled the same way for every transport.

Both runners build a site here and nowhere else: the in-process runner
(:mod:`clinfed.runners.pipeline`) for each of its sites, a Flower node
(:mod:`clinfed.runners.node`) for its one. What differs by where a site
lives is a :class:`SitePlace`; everything else comes from the run's
resolved settings. A site is built in two steps because the in-process
runner checks every site's privacy before it writes its run folder:

1. :func:`site_privacy`: the site's policy (calibrated from its released
   unit count), its ledger and the caps it holds a run to;
2. :func:`build_site`: its :class:`~clinfed.federated.site.SiteRunner`,
   which each runner passes through
   :func:`~clinfed.federated.secure_site.with_secure_aggregation` (a node
   lazily: secure aggregation's later stages need no data or model).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from clinfed.core.errors import ClinfedError
from clinfed.core.events import Reporter, silent
from clinfed.federated import site_policy
from clinfed.federated.client import LocalSettings
from clinfed.federated.site import SiteRunner
from clinfed.federated.strategies import Strategy
from clinfed.privacy.ledger import Ledger
from clinfed.privacy.site import SitePrivacy
from clinfed.tasks.base import Task


@dataclass(frozen=True)
class SitePlace:
    """Where a site lives, and the policy its operator holds runs to.

    Attributes
    ----------
    state_dir
        The site's state folder for this run (model copies, released
        updates, secure aggregation's secrets; ``privacy/`` under it).
    ledger
        A ledger that outlives the run (a node's: one per dataset); default
        ``state_dir/privacy/<site>.jsonl``. A released count is kept beside it.
    ledger_budget, ledger_mark
        The site's cap on its ledger over every run (a node's
        ``max-epsilon``) and its ledgers' high-water mark.
    run_name
        The run charging a ledger shared by runs.
    calibration_memo
        Noise multipliers calibrated before (a node calibrates per message).
    max_delta
        The largest delta the site accepts (default ``1 / (10 n)``).
    charge_count_now
        Charge the released count as the site is built: every reply of a
        node (a refusal too) may carry something derived from it. In
        process it is charged with round 1, before anything leaves.
    """

    state_dir: Path
    ledger: Path | None = None
    ledger_budget: float | None = None
    ledger_mark: Path | None = None
    run_name: str | None = None
    calibration_memo: Path | None = None
    max_delta: float | None = None
    charge_count_now: bool = False


def site_privacy(
    config: Any, task: Task, name: str, train: Any, strategy: Strategy, place: SitePlace
) -> SitePrivacy | None:
    """The site's privacy layer (``None``: it trains nothing under DP).

    Under DP: its policy from its released count, the delta cap checked
    (refused without a count in the refusal). A ledger that outlives the
    run is marked unprotected by a run with reproducible noise or without
    DP: this dataset has no guarantee from then on.
    """
    units = len(train) and task.count_units(train, config.privacy_unit)
    if not units:
        return None  # an evaluation site trains nothing: no DP-SGD to account
    if not config.dp:
        if place.ledger is not None:
            ledger = Ledger(
                place.ledger, name, config.delta, run=place.run_name, mark=place.ledger_mark
            )
            ledger.mark_unprotected("trained without DP")
        return None
    policy = site_policy.privacy_policy(
        config,
        task,
        {name: train},
        place.state_dir / "privacy",
        strategy,
        place.calibration_memo,
        ledger_paths={name: place.ledger} if place.ledger is not None else None,
        ledger_budget=place.ledger_budget,
        ledger_mark=place.ledger_mark,
        run=place.run_name,
    )
    privacy = SitePrivacy(policy, name)
    if config.reproducible_noise and place.ledger is not None:
        # A ledger that outlives the run: this dataset has no guarantee from
        # now on (a run's own ledger says so on each of its lines).
        privacy.ledger.mark_unprotected("reproducible noise (not private)")
    if place.charge_count_now and not policy.charge_count(name):
        raise ClinfedError(
            f"{name}: this site's privacy budget does not afford releasing its unit count: refused"
        )
    # Under add/remove the cap derives from the released count.
    check_delta_cap(config.delta, policy.sizes[name], place.max_delta)
    return privacy


def check_delta_cap(delta: float, units: int, cap: float | None = None) -> None:
    """Refuse a DP run whose delta exceeds what the site allows: ``cap``
    (a node's ``max-delta``), else ``1 / (10 n)`` for ``n`` privacy units (a
    delta near ``1/n`` allows releasing a unit outright). Under add/remove
    ``units`` is the site's released noisy count, never the exact one; the
    refusal states no count, nor a cap derived from one."""
    if not units:
        return
    limit = cap if cap is not None else 1 / (10 * units)
    if delta > limit:
        stated = f" {limit:.3g}" if cap is not None else " (default 1/(10 n))"
        raise ClinfedError(
            f"the run asks for delta {delta:g}, above this site's cap{stated} (node config "
            "max-delta): refused"
        )


def build_site(
    config: Any,
    name: str,
    task: Task,
    model: nn.Module,
    strategy: Strategy,
    data: tuple[Any, Any, Any],
    place: SitePlace,
    privacy: SitePrivacy | None,
    initial_state: dict[str, torch.Tensor] | None = None,
    report: Reporter = silent,
    **where: Any,
) -> SiteRunner:
    """One site's runner, built the same way for every transport.

    ``data``: the site's encoded training and held-out examples and the
    records the held-out ones come from. ``config`` is the run's resolved
    settings; the rounds, seed, local training and evaluation batch come
    from it alone. ``where`` holds the rest of what differs by where the
    site lives (see :class:`~clinfed.federated.site.SiteRunner`):
    ``audit_dir``, ``predictions_dir``, ``meter_path``, ``max_evaluations``.
    ``initial_state`` defaults to the model's weights now, on the CPU.
    """
    if initial_state is None:
        initial_state = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
    settings = LocalSettings(
        epochs=config.local_epochs,
        batch_size=config.batch_size,
        lr=config.lr,
        head_lr=config.head_lr,
        weight_decay=config.weight_decay,
        precision=config.precision,
        dp_pass_units=config.dp_pass_units,
        lr_decay=config.lr_decay,
        rounds=config.rounds,
    )
    train, test, test_records = data
    return SiteRunner(
        name,
        task,
        model,
        initial_state,
        strategy,
        train,
        test,
        test_records,
        settings,
        config.seed,
        place.state_dir,
        privacy,
        config.eval_batch_size,
        planned_rounds=config.rounds,
        report=report,
        run_name=place.run_name or "",
        **where,
    )
