"""The server side of a Flower run, apart from Flower's message types.

:class:`Coordinator` drives the rounds through a :class:`Transport` (Flower's
Grid in ``clinfed.flower.server``; anything with the same two methods in
tests): it decides what each node receives, checks every reply, averages
with the simulator's :class:`~clinfed.federated.aggregation.Aggregator` and
writes a run folder like the simulator's.

What the server knows is only what sites send: their uploads, their
per-round records (the simulator's site lines of ``metrics.jsonl``), the
evaluation counts of their held-out data and, if they choose, their ledger
lines (copied to ``RUN/privacy/`` marked ``reported_by_site``).

Sync: a node that replied to the previous round holds the previous global
model except for what the strategy's envelope says can have changed, so it
gets only that (``envelope.downloaded``); any other node (new, restarted,
or one that missed a round) gets the whole model.
"""

from __future__ import annotations

import json
import tempfile
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch
from safetensors.torch import save_file

from clinfed.errors import ClinfedError
from clinfed.federated import payload
from clinfed.federated.aggregation import Aggregator
from clinfed.models import load_tokenizer, save_model
from clinfed.pipeline import RunConfig, make_model, make_strategy, make_task
from clinfed.privacy.accountant import ACCOUNTANT, Mechanism
from clinfed.privacy.policy import PATIENT_CAVEAT, UNIT
from clinfed.runs import append_jsonl, atomic_write_json, create_run_folder, ensure_new_run_folder


@dataclass
class Reply:
    """What one node sent back: tensors and its report (plain JSON)."""

    upload: dict[str, torch.Tensor]
    report: dict[str, Any]


@dataclass(frozen=True)
class Instruction:
    """What one node is sent: tensors to overlay and the round's settings."""

    download: dict[str, torch.Tensor]
    settings: dict[str, Any]


class Transport(Protocol):
    def nodes(self) -> list[int]:
        """Node ids of the SuperNodes connected now."""

    def exchange(
        self, kind: str, round_number: int, instructions: Mapping[int, Instruction], timeout: float
    ) -> dict[int, Reply | str]:
        """Send each node its instruction (``kind``: ``train`` or ``evaluate``);
        return each node's reply, or why there is none (error, timeout)."""


@dataclass(frozen=True)
class Deployment:
    """How the server runs the federation (Flower run config, not RunConfig).

    Attributes
    ----------
    min_sites
        Replies a round needs to be aggregated.
    round_timeout
        Seconds a round waits for replies before going on without the rest.
    round_retries
        Times a round short of ``min_sites`` is sent again before the run stops.
    wait_for_sites
        Seconds to wait, before each round, for ``min_sites`` nodes to connect.
    """

    min_sites: int = 1
    round_timeout: float = 900.0
    round_retries: int = 1
    wait_for_sites: float = 300.0

    def validate(self) -> None:
        if self.min_sites < 1:
            raise ClinfedError("--min-sites must be at least 1")
        if self.round_timeout <= 0 or self.wait_for_sites < 0 or self.round_retries < 0:
            raise ClinfedError("--round-timeout must be positive, waits and retries not negative")


def check_upload(
    upload: Mapping[str, torch.Tensor],
    allowed: frozenset[str],
    global_state: Mapping[str, torch.Tensor],
) -> str | None:
    """Why an upload must not be averaged in (``None``: it may).

    Rejected: names outside the round's envelope, shapes or dtypes other than
    the global model's, and any NaN or Inf.
    """
    unexpected = sorted(set(upload) - allowed)
    if unexpected:
        return f"unexpected parameter {unexpected[0]} ({len(unexpected)} in all)"
    for name, value in upload.items():
        reference = global_state[name]
        if tuple(value.shape) != tuple(reference.shape):
            return f"{name}: shape {tuple(value.shape)}, expected {tuple(reference.shape)}"
        if value.dtype != reference.dtype:
            return f"{name}: dtype {value.dtype}, expected {reference.dtype}"
        if not bool(torch.isfinite(value).all()):
            return f"{name}: NaN or Inf"
    return None


def _check_record(report: Mapping[str, Any]) -> str | None:
    record = report.get("record")
    if not isinstance(record, dict) or not isinstance(report.get("site"), str):
        return "reply without a site record"
    if "refused" in record:
        return None
    examples = record.get("examples")
    if not isinstance(examples, int) or examples < 1:
        return "reply without a positive number of examples"
    return None


Log = Callable[[str], None]


def _selection(config: RunConfig) -> dict[str, Any] | None:
    if config.strategy.startswith("safl") and config.selection == "private":
        return Mechanism("safl-selection", config.selection_noise, 1.0, 1).as_dict()
    return None


@dataclass
class _Round:
    accepted: list[tuple[int, Reply]] = field(default_factory=list)
    refused: list[tuple[int, Reply]] = field(default_factory=list)
    problems: list[dict[str, Any]] = field(default_factory=list)

    @property
    def responded(self) -> int:
        return len(self.accepted) + len(self.refused)


class Coordinator:
    """Runs the rounds of one Flower run into a run folder."""

    def __init__(self, config: RunConfig, deployment: Deployment, log: Log = print):
        self.config, self.deployment, self.log = config, deployment, log
        self.out = Path(config.out)
        self.run_name = self.out.name
        self.task = make_task(config, "")
        self.model = make_model(config, self.task)
        self.global_state = {k: v.detach().clone() for k, v in self.model.state_dict().items()}
        self.names = [n for n, _ in self.model.named_parameters()]
        self.synced: dict[int, int] = {}  # node id -> last round whose reply was averaged in
        self.node_sites: dict[int, str] = {}
        self.ledgers: dict[str, dict[str, Any]] = {}
        self.pending_observed: dict[str, Any] = {}
        self.stopped: str | None = None

    # ------------------------------------------------------------- helpers
    def _metrics(self, record: dict[str, Any]) -> None:
        append_jsonl(self.out / "metrics.jsonl", record)

    def _wait_for_nodes(self, transport: Transport) -> list[int]:
        deadline = time.monotonic() + self.deployment.wait_for_sites
        while True:
            nodes = sorted(transport.nodes())
            if len(nodes) >= self.deployment.min_sites or time.monotonic() >= deadline:
                return nodes
            time.sleep(1.0)

    def _instructions(
        self, nodes: list[int], round_number: int, downloaded: frozenset[str], extra: dict
    ) -> dict[int, Instruction]:
        instructions = {}
        for node in nodes:
            in_sync = self.synced.get(node) == round_number - 1
            # A site with a model of its own (local, pfeddc) never takes more
            # than the shared part: the rest of the server's copy is not its.
            in_sync = in_sync or not self.shares_model
            names = downloaded if in_sync else frozenset(self.global_state)
            settings = {
                "run_name": self.run_name,
                "run_config": asdict(self.config),
                "round": round_number,
                "full": not in_sync,
                "evaluate": round_number > 1,
            } | extra
            instructions[node] = Instruction(
                {n: self.global_state[n] for n in sorted(names)}, settings
            )
        return instructions

    def _sort_replies(
        self, replies: dict[int, Reply | str], round_number: int, allowed: frozenset[str]
    ) -> _Round:
        result = _Round()
        for node, reply in sorted(replies.items()):
            if isinstance(reply, str):
                site = self.node_sites.get(node, f"node {node}")
                result.problems.append({"round": round_number, "client": site, "failed": reply})
                self.log(f"round {round_number}: {site}: no usable reply ({reply})")
                continue
            self.node_sites[node] = reply.report.get("site", f"node {node}")
            site = self.node_sites[node]
            reason = _check_record(reply.report) or check_upload(
                reply.upload, allowed, self.global_state
            )
            if reason is not None:
                result.problems.append({"round": round_number, "client": site, "rejected": reason})
                self.log(f"round {round_number}: {site}: update rejected ({reason})")
                continue
            if reply.report.get("ledger"):
                self.ledgers[site] = reply.report["ledger"]
            if "refused" in reply.report["record"]:
                result.refused.append((node, reply))
            else:
                result.accepted.append((node, reply))
        return result

    def _evaluation(self, replies: list[tuple[int, Reply]], round_number: int) -> dict[str, Any]:
        """The global model's metrics from the sites' summed counts."""
        total: dict[str, list[float]] = {}
        per_site, seconds, sites = {}, 0.0, 0
        for _, reply in sorted(replies, key=lambda r: r[1].report["site"]):
            evaluation = reply.report.get("eval") or {}
            counts = evaluation.get("counts")
            if not counts:
                continue
            sites += 1
            seconds = max(seconds, evaluation.get("seconds", 0.0))
            per_site[reply.report["site"]] = self.task.metrics_from_counts(counts)["f1"]
            for key, values in counts.items():
                if key in total:
                    total[key] = [a + b for a, b in zip(total[key], values)]
                else:
                    total[key] = list(values)
        metrics = self.task.metrics_from_counts(total) if total else {"f1": 0.0}
        return (
            {"round": round_number}
            | metrics
            | {"eval_seconds": seconds, "evaluated_sites": sites, "per_site_f1": per_site}
            | self.pending_observed
        )

    def _commit(self, round_number: int, strategy) -> None:
        name = f"checkpoints/round-{round_number:04d}.safetensors"
        path = self.out / name
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.tmp")
        save_file({k: v.contiguous() for k, v in self.global_state.items()}, str(tmp))
        tmp.replace(path)
        atomic_write_json(
            self.out / "state.json",
            {"round": round_number, "checkpoint": name, "strategy": strategy.state_dict()},
        )
        for old in (self.out / "checkpoints").glob("round-*.safetensors"):
            if old.name != path.name:
                old.unlink()

    # ----------------------------------------------------------------- run
    def start(self) -> None:
        """Create the run folder (refused if it holds files)."""
        self.deployment.validate()
        ensure_new_run_folder(self.out)
        create_run_folder(self.out)
        atomic_write_json(
            self.out / "config.json",
            asdict(self.config) | {"runner": "flower", "deployment": asdict(self.deployment)},
        )
        atomic_write_json(self.out / "labels.json", {"labels": self.task.labels})

    def run(self, transport: Transport) -> dict[str, Any]:
        """All rounds, the final evaluation, the model and summary; returns the summary."""
        config = self.config
        tokenizer = load_tokenizer(config.model)
        with tempfile.TemporaryDirectory(prefix="clinfed-server-") as cache:
            # (SAFL's strategy object carries the public probe set; the
            # server never profiles with it.)
            strategy = make_strategy(config, self.task, tokenizer, cache)
        self.shares_model = strategy.shares_model
        strategy.observe(0, self.global_state)
        traffic_up = traffic_down = site_rounds = 0
        last_eval: dict[str, Any] = {}
        for round_number in range(1, config.rounds + 1):
            envelope = strategy.envelope(round_number, self.names)
            result = None
            for attempt in range(self.deployment.round_retries + 1):
                nodes = self._wait_for_nodes(transport)
                if not nodes:
                    break
                state = {"strategy_state": strategy.state_dict()}
                instructions = self._instructions(nodes, round_number, envelope.downloaded, state)
                self.log(
                    f"round {round_number}/{config.rounds}: sending to {len(nodes)} nodes"
                    + (f" (attempt {attempt + 1})" if attempt else "")
                )
                replies = transport.exchange(
                    "train", round_number, instructions, self.deployment.round_timeout
                )
                result = self._sort_replies(replies, round_number, envelope.uploaded)
                for problem in result.problems:
                    self._metrics(problem)
                if result.responded >= self.deployment.min_sites:
                    break
                self.log(
                    f"round {round_number}: {result.responded} of the "
                    f"{self.deployment.min_sites} sites needed replied"
                )
            if result is None or result.responded < self.deployment.min_sites:
                got = 0 if result is None else result.responded
                self.stopped = (
                    f"stopped in round {round_number}: {got} sites replied, "
                    f"--min-sites is {self.deployment.min_sites}"
                )
                break
            if round_number > 1:
                last_eval = self._evaluation(result.accepted + result.refused, round_number - 1)
                self._metrics(last_eval)
            aggregator = Aggregator()
            # Nodes in sync all got the same tensors: serialize each distinct
            # download once to measure it, not once per node.
            sizes: dict[tuple[str, ...], int] = {}
            bytes_down = {}
            for node, _ in result.accepted + result.refused:
                download = instructions[node].download
                key = tuple(download)
                if key not in sizes:
                    sizes[key] = len(payload.encode(download))
                bytes_down[node] = sizes[key]
            for _node, reply in sorted(result.refused, key=lambda r: r[1].report["site"]):
                self._metrics(reply.report["record"])
                self.log(f"round {round_number}: {reply.report['site']}: refused (privacy budget)")
            for node, reply in sorted(result.accepted, key=lambda r: r[1].report["site"]):
                record = dict(reply.report["record"])
                record["bytes_down"] = bytes_down[node]
                self._metrics(record)
                traffic_up += record["bytes_up"]
                traffic_down += record["bytes_down"]
                site_rounds += 1
                if reply.upload:
                    aggregator.add(reply.upload, record["examples"])
                self.synced[node] = round_number
            if not result.accepted:
                self.stopped = (
                    f"stopped before round {round_number}: no site can train "
                    "within its privacy budget"
                )
                break
            self.global_state = aggregator.result(self.global_state)
            self.pending_observed = strategy.observe(round_number, self.global_state)
            self._commit(round_number, strategy)
            self.log(
                f"round {round_number}: averaged {len(result.accepted)} sites "
                f"({', '.join(r.report['site'] for _, r in result.accepted)})"
            )
        final_round = config.rounds if self.stopped is None else None
        if final_round is not None:
            last_eval = self._final_evaluation(transport, strategy, final_round)
        self.model.load_state_dict(self.global_state)
        save_model(
            self.model,
            self.out / "model",
            self.task.meta() | {"max_length": config.max_length, "encoder": config.model},
            tokenizer,
        )
        self._write_privacy()
        full_bytes = len(payload.encode(dict(self.model.named_parameters())))
        summary = last_eval | {
            "runner": "flower",
            "mb_up": traffic_up / 1e6,
            "mb_down": traffic_down / 1e6,
            "fedavg_mb_up": full_bytes * site_rounds / 1e6,
            "ratio_to_fedavg_up": traffic_up / (full_bytes * site_rounds) if site_rounds else 0.0,
        }
        if self.stopped:
            summary["stopped"] = self.stopped
            self.log(self.stopped)
        if self.ledgers:
            summary["epsilon"] = {
                site: (ledger["lines"][-1]["epsilon"] if ledger["lines"] else 0.0)
                for site, ledger in sorted(self.ledgers.items())
            }
            summary["epsilon_reported_by_sites"] = True
            summary["delta"] = config.delta
        atomic_write_json(self.out / "summary.json", summary)
        return summary

    def _final_evaluation(self, transport: Transport, strategy, round_number: int) -> dict:
        envelope = strategy.envelope(round_number + 1, self.names)
        nodes = self._wait_for_nodes(transport)
        instructions = self._instructions(nodes, round_number + 1, envelope.downloaded, {})
        for instruction in instructions.values():
            instruction.settings["evaluate"] = True
        replies = transport.exchange(
            "evaluate", round_number + 1, instructions, self.deployment.round_timeout
        )
        good = []
        for node, reply in sorted(replies.items()):
            if isinstance(reply, str):
                site = self.node_sites.get(node, f"node {node}")
                self.log(f"final evaluation: {site}: no reply ({reply})")
                continue
            self.node_sites[node] = reply.report.get("site", f"node {node}")
            if reply.report.get("ledger"):
                self.ledgers[self.node_sites[node]] = reply.report["ledger"]
            good.append((node, reply))
        record = self._evaluation(good, round_number)
        self._metrics(record)
        self.log(
            f"round {round_number}: f1 {record['f1']:.4f} on {record['evaluated_sites']} sites"
        )
        return record

    def _write_privacy(self) -> None:
        """Ledgers as the sites reported them, marked so; the policy as far
        as the sites described it."""
        if not self.config.dp:
            return
        folder = self.out / "privacy"
        folder.mkdir(parents=True, exist_ok=True)
        sites = {}
        for site, ledger in sorted(self.ledgers.items()):
            lines = [line | {"reported_by_site": True} for line in ledger["lines"]]
            text = "".join(json.dumps(line, sort_keys=True) + "\n" for line in lines)
            (folder / f"{site}.jsonl").write_text(text)
            sites[site] = ledger["site"] | {"budget": ledger.get("budget")}
        atomic_write_json(
            folder / "policy.json",
            {
                "unit": UNIT,
                "patient_caveat": PATIENT_CAVEAT,
                "accountant": ACCOUNTANT,
                "delta": self.config.delta,
                "target_epsilon": self.config.target_epsilon,
                "max_grad_norm": self.config.max_grad_norm,
                "clipping": self.config.clipping,
                "planned_rounds": self.config.rounds,
                "selection": _selection(self.config),
                "sites": sites,
                "reported_by_sites": True,
                "warnings": [],
            },
        )
