"""What a SuperNode does with a round: the site side of a Flower run.

Nothing here imports Flower: :class:`Site` takes plain tensors and settings
and returns plain tensors and records, so it is tested without processes.
The ClientApp (``clinfed.flower.client``) only unpacks messages into it.

A node is configured by its operator, not by the server (``--node-config``):

``data``
    The site's data folder in the task's real format.
``state``
    The site's state folder. Per run (``STATE/<run name>/``) it holds the
    privacy ledger (``privacy/<site>.jsonl``), the site's copy of the model
    (``model.safetensors``) and the site's predictions. It survives restarts
    of the node, so a node that comes back keeps its ledger.
``site``
    The site's name, when the data folder holds several sites (otherwise
    the one site found there).
``max-epsilon``
    The most epsilon this site will spend on the run, whatever the server's
    run config asks (the lower of the two is enforced).
``share-ledger``
    Whether the site reports its ledger lines to the server for the run's
    privacy report (default true). The ledger that counts stays at the site.
``threads``
    Torch threads for this node's work (default: all cores).
"""

from __future__ import annotations

import os
import tempfile
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import datasets
import torch
from safetensors.torch import load_file

from clinfed.errors import ClinfedError, ProblemLog
from clinfed.federated import payload
from clinfed.federated.client import client_update, site_generator
from clinfed.models import load_tokenizer
from clinfed.pipeline import (
    RunConfig,
    local_settings,
    make_model,
    make_strategy,
    make_task,
    privacy_policy,
)
from clinfed.privacy.policy import PrivacyPolicy
from clinfed.runs import atomic_write_bytes
from clinfed.training import predict


@dataclass(frozen=True)
class NodeConfig:
    """A SuperNode's own settings (see the module docstring)."""

    data: Path
    state: Path
    site: str | None = None
    max_epsilon: float | None = None
    share_ledger: bool = True
    threads: int = 0

    @classmethod
    def parse(cls, values: Mapping[str, Any]) -> NodeConfig:
        """From Flower's ``context.node_config`` (keys as in ``--node-config``)."""
        known = {"data", "state", "site", "max-epsilon", "share-ledger", "threads"}
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
        return cls(
            data=data,
            state=Path(str(values["state"])),
            site=str(values["site"]) if values.get("site") else None,
            max_epsilon=float(max_epsilon) if max_epsilon is not None else None,
            share_ledger=bool(values.get("share-ledger", True)),
            threads=int(values.get("threads", 0)),
        )


def _of_site(records: Any, site: str) -> Any:
    """The records (documents or an admissions table) of one site."""
    if isinstance(records, datasets.Dataset):
        return records.filter(lambda s: s == site, input_columns="site")
    return [r for r in records if r.site == site]


class Site:
    """One site of one Flower run: data, model copy, ledger.

    Built afresh for every message (Flower starts a ClientApp process per
    message); everything that must outlive a message is in the state folder.
    """

    def __init__(self, config: RunConfig, node: NodeConfig, run_name: str):
        self.config, self.node = config, node
        self.folder = node.state / run_name
        self.model_path = self.folder / "model.safetensors"
        torch.set_num_threads(node.threads or config.threads or os.cpu_count() or 1)
        # Tokenized notes are protected: they live in a temporary folder at
        # the site, removed when the message is done.
        self._tmp = tempfile.TemporaryDirectory(prefix="clinfed-site-")
        self.cache_dir = self._tmp.name
        self.task = make_task(config, self.cache_dir)
        corpus = self.task.load(node.data, ProblemLog(config.on_error))
        sites = corpus.sites
        if node.site is None and len(sites) != 1:
            raise ClinfedError(
                f"{node.data}: holds sites {', '.join(sites)}; name this node's with "
                "--node-config site=NAME"
            )
        self.name = node.site or sites[0]
        if self.name not in sites:
            raise ClinfedError(f"{node.data}: no site {self.name!r} (found {', '.join(sites)})")
        self.tokenizer = load_tokenizer(config.model)
        self.train_records = _of_site(corpus.train, self.name)
        self.test_records = _of_site(corpus.test, self.name)
        self.train = self.task.encode(
            self.train_records, self.tokenizer, config.max_length, self.cache_dir
        )
        self.test = self.task.encode(
            self.test_records, self.tokenizer, config.max_length, self.cache_dir
        )
        if len(self.train) == 0:
            raise ClinfedError(f"{node.data}: no training examples for site {self.name}")
        self.model = make_model(config, self.task)
        if self.model_path.exists():
            self.model.load_state_dict(load_file(str(self.model_path)))
        self.names = [n for n, _ in self.model.named_parameters()]
        self.policy: PrivacyPolicy | None = None
        if node.max_epsilon is not None and not config.dp:
            # A node with a budget trains under DP or not at all.
            raise ClinfedError(
                f"this site has max-epsilon {node.max_epsilon:g}; the run asks for training "
                "without DP: refused"
            )
        if config.dp:
            self.policy = privacy_policy(
                config, {self.name: len(self.train)}, self.folder / "privacy"
            )
            budget = self.policy.budget
            if node.max_epsilon is not None:
                budget = node.max_epsilon if budget is None else min(budget, node.max_epsilon)
            self.policy.budget = budget

    def close(self) -> None:
        self._tmp.cleanup()

    # ------------------------------------------------------------ the round
    def receive(self, download: Mapping[str, torch.Tensor]) -> None:
        """Overlay the global tensors the server sent on the site's copy."""
        state = self.model.state_dict()
        unknown = sorted(set(download) - set(state))
        if unknown:
            raise ClinfedError(f"server sent parameters this model lacks: {unknown[:3]}")
        for name, value in download.items():
            if value.shape != state[name].shape:
                raise ClinfedError(f"server sent {name} with shape {tuple(value.shape)}")
            state[name].copy_(value)

    def evaluate(self, write_predictions: bool = False) -> dict[str, Any]:
        """Counts (never examples) of the current model on the site's held-out data."""
        started = time.perf_counter()
        if len(self.test) == 0:
            return {"counts": None, "examples": 0, "seconds": 0.0}
        outputs = predict(self.model, self.task, self.test, self.config.eval_batch_size)
        counts = self.task.evaluation_counts(self.test_records, self.test, outputs)
        if write_predictions:
            # Predictions carry the notes' spans: they stay at the site.
            self.task.write_predictions(
                self.test_records, self.test, outputs, self.folder / "predictions"
            )
        return {
            "counts": counts,
            "examples": len(self.test),
            "seconds": round(time.perf_counter() - started, 3),
        }

    def train_round(
        self, round_number: int, strategy_state: dict[str, Any]
    ) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        """Train one round on the site's data; return the upload and the
        site's record (the simulator's per-site ``metrics.jsonl`` line).

        Under DP the ledger is checked and written first (write-ahead): a
        site over budget returns no upload and a ``refused`` record, whatever
        the server asked.
        """
        config = self.config
        privacy: dict[str, Any] = {}
        dp = None
        if self.policy is not None:
            ledger = self.policy.ledger(self.name)
            mechanisms = self.policy.round_mechanisms(self.name)
            if not ledger.affords(mechanisms):
                return {}, {
                    "round": round_number,
                    "client": self.name,
                    "refused": "privacy budget",
                    "epsilon": ledger.spent,
                    "epsilon_if_trained": ledger.after(mechanisms),
                }
            privacy = {"epsilon": ledger.record(round_number, mechanisms)}
            dp = self.policy.settings(self.name)
        strategy = make_strategy(config, self.task, self.tokenizer, self.cache_dir)
        strategy.load_state_dict(strategy_state, None)
        chosen = strategy.select(round_number, self.name, self.model, self.task, self.train)
        plan = strategy.plan(round_number, self.name, self.names)
        generator = site_generator(config.seed, round_number, self.name)
        result = client_update(
            self.model, self.task, self.train, plan, local_settings(config), generator, dp
        )
        if result.clipping is not None:
            privacy["clipping"] = result.clipping
        # The copy is on disk before anything leaves the site: the next
        # round's partial download overlays it.
        state = {k: v.detach().clone() for k, v in self.model.state_dict().items()}
        atomic_write_bytes(self.model_path, payload.encode(state))
        upload = result.upload
        bytes_up = len(payload.encode(upload)) if plan.uploaded else 0
        record = result.record(round_number, self.name, bytes_up) | chosen | privacy
        return upload, record

    def ledger_report(self) -> dict[str, Any] | None:
        """What the site chooses to tell the server about its privacy spend."""
        if self.policy is None or not self.node.share_ledger:
            return None
        ledger = self.policy.ledger(self.name)
        site = self.policy.describe()["sites"][self.name]
        return {"lines": ledger.lines, "site": site, "budget": self.policy.budget}
