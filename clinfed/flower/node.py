"""A SuperNode's side of a Flower run: its own configuration and the site
runner it builds for each message.

A node is configured by its operator, not by the server (``--node-config``):

``data``
    The site's data folder in the task's real format.
``state``
    The site's state folder. Per run (``STATE/<run name>/``) it holds the
    privacy ledger (``privacy/<site>.jsonl``), the site's copies of the model
    (``copy.rNNNN.safetensors``) and the site's predictions. It survives
    restarts of the node, so a node that comes back keeps its ledger.
``site``
    The site's name, when the data folder holds several sites (otherwise
    the one site found there).
``max-epsilon``
    The most epsilon this site will spend on the run, whatever the server's
    run config asks (the lower of the two is enforced).
``max-delta``
    The largest delta the site accepts (default ``1 / (10 n)``, ``n`` its
    training examples); a run asking for more is refused.
``allow-no-dp``
    Whether the site trains in runs without DP (default false: it refuses
    them).
``share-ledger``
    Whether the site reports its ledger lines to the server for the run's
    privacy report (default true). The ledger that counts stays at the site.
``threads``
    Torch threads for this node's work (default: all cores).

Nothing here imports Flower: :func:`build_site` returns the same
:class:`~clinfed.federated.site.SiteRunner` the in-process transport uses.
"""

from __future__ import annotations

import os
import re
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import datasets
import torch

from clinfed.errors import ClinfedError, ProblemLog
from clinfed.federated.site import SiteRunner
from clinfed.models import load_tokenizer
from clinfed.pipeline import (
    RunConfig,
    local_settings,
    make_model,
    make_strategy,
    make_task,
    privacy_policy,
)
from clinfed.privacy.site import SitePrivacy


@dataclass(frozen=True)
class NodeConfig:
    """A SuperNode's own settings (see the module docstring)."""

    data: Path
    state: Path
    site: str | None = None
    max_epsilon: float | None = None
    share_ledger: bool = True
    threads: int = 0
    max_delta: float | None = None
    allow_no_dp: bool = False

    @classmethod
    def parse(cls, values: Mapping[str, Any]) -> NodeConfig:
        """From Flower's ``context.node_config`` (keys as in ``--node-config``)."""
        known = {
            "data",
            "state",
            "site",
            "max-epsilon",
            "max-delta",
            "allow-no-dp",
            "share-ledger",
            "threads",
        }
        unknown = sorted(set(values) - known)
        if unknown:
            raise ClinfedError(
                f"--node-config: unknown key {unknown[0]!r} (known: {', '.join(sorted(known))})"
            )
        for key in ("data", "state"):
            if not values.get(key):
                raise ClinfedError(f"--node-config needs {key}=FOLDER")
        data = Path(str(values["data"]))
        if not data.is_dir():
            raise ClinfedError(f"--node-config data={data}: not a folder")
        max_epsilon = values.get("max-epsilon")
        if max_epsilon is not None and not float(max_epsilon) > 0:
            raise ClinfedError("--node-config max-epsilon must be positive")
        max_delta = values.get("max-delta")
        if max_delta is not None and not 0 < float(max_delta) < 1:
            raise ClinfedError("--node-config max-delta must be in (0, 1)")
        return cls(
            data=data,
            state=Path(str(values["state"])),
            site=str(values["site"]) if values.get("site") else None,
            max_epsilon=float(max_epsilon) if max_epsilon is not None else None,
            share_ledger=bool(values.get("share-ledger", True)),
            threads=int(values.get("threads", 0)),
            max_delta=float(max_delta) if max_delta is not None else None,
            allow_no_dp=bool(values.get("allow-no-dp", False)),
        )


RUN_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,99}$")


def safe_run_name(name: str) -> str:
    """A run name the server sends, checked before it names a folder at the
    site: letters, digits, ``.``, ``_``, ``-``; no separator, no ``..``."""
    if not isinstance(name, str) or not RUN_NAME.match(name) or ".." in name:
        raise ClinfedError(
            f"run name {name!r} refused: a run name names a folder at the site and may hold "
            "only letters, digits, '.', '_' and '-' (no path separators, no '..')"
        )
    return name


def _of_site(records: Any, site: str) -> Any:
    """The records (documents or an admissions table) of one site."""
    if isinstance(records, datasets.Dataset):
        return records.filter(lambda s: s == site, input_columns="site")
    return [r for r in records if r.site == site]


class NodeSite:
    """The site runner of one node for one run, and the temporary folder its
    tokenized data lives in (removed by :meth:`close`)."""

    def __init__(self, config: RunConfig, node: NodeConfig, run_name: str):
        torch.set_num_threads(node.threads or config.threads or os.cpu_count() or 1)
        # The site's own policy, whatever the server's run config says.
        if not config.dp and not node.allow_no_dp:
            raise ClinfedError(
                "this site trains under DP only (node config allow-no-dp is false); the run "
                "asks for training without DP: refused"
            )
        folder = node.state / safe_run_name(run_name)
        # Tokenized notes are protected: they live in a temporary folder at
        # the site, removed when the message is done.
        self._tmp = tempfile.TemporaryDirectory(prefix="clinfed-site-")
        cache_dir = self._tmp.name
        try:
            task = make_task(config, cache_dir)
            corpus = task.load(node.data, ProblemLog(config.on_error))
            sites = corpus.sites
            if node.site is None and len(sites) != 1:
                raise ClinfedError(
                    f"{node.data}: holds sites {', '.join(sites)}; name this node's with "
                    "--node-config site=NAME"
                )
            name = node.site or sites[0]
            if name not in sites:
                raise ClinfedError(f"{node.data}: no site {name!r} (found {', '.join(sites)})")
            tokenizer = load_tokenizer(config.model)
            train_records = _of_site(corpus.train, name)
            test_records = _of_site(corpus.test, name)
            train = task.encode(train_records, tokenizer, config.max_length, cache_dir)
            test = task.encode(test_records, tokenizer, config.max_length, cache_dir)
            if len(train) == 0:
                raise ClinfedError(f"{node.data}: no training examples for site {name}")
            cap = node.max_delta if node.max_delta is not None else 1 / (10 * len(train))
            if config.dp and config.delta > cap:
                raise ClinfedError(
                    f"the run asks for delta {config.delta:g}, above this site's cap {cap:.3g} "
                    f"(node config max-delta; default 1/(10 n), n = {len(train)}): refused"
                )
            model = make_model(config, task)
            strategy = make_strategy(config, task, tokenizer, cache_dir)
            privacy = None
            if config.dp:
                policy = privacy_policy(config, {name: len(train)}, folder / "privacy", strategy)
                if node.max_epsilon is not None:
                    budget = policy.budget
                    policy.budget = (
                        node.max_epsilon if budget is None else min(budget, node.max_epsilon)
                    )
                privacy = SitePrivacy(policy, name)
            self.runner = SiteRunner(
                name,
                task,
                model,
                {k: v.detach().clone() for k, v in model.state_dict().items()},
                strategy,
                train,
                test,
                test_records,
                local_settings(config),
                config.seed,
                folder,
                privacy,
                config.eval_batch_size,
                predictions_dir=folder / "predictions",
            )
        except BaseException:
            self._tmp.cleanup()
            raise
        self.share_ledger = node.share_ledger

    def close(self) -> None:
        self._tmp.cleanup()
