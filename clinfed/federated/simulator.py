"""In-process simulation: many sites, one after another, in one process.

One model object serves every site (weights are loaded into it, never
copied per site), one optimizer is alive at a time, and aggregation keeps a
running sum, so memory does not grow with the number of sites. Sites that
keep a model of their own (``local``, ``pfeddc``) keep it on disk in
``RUN/sites/CLIENT.rNNNN.safetensors`` (the round that wrote it), receiving
only what the strategy's envelope shares from the global state.

Durability: after each round the global weights go to
``RUN/checkpoints/round-NNNN.safetensors`` and then ``RUN/state.json`` (the
commit point: round number, checkpoint name, each site's own model file,
the client-sampling generator's state, strategy state) is replaced
atomically. ``--resume`` starts from the last committed round, drops any
``metrics.jsonl`` lines of the round that was in flight, and restores the
sampling generator; every site's own randomness is derived from (seed,
round, site), so a resumed run ends
bit-identical to an uninterrupted one on CPU.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import datasets
import numpy as np
import torch
from safetensors.torch import load_file, save_file
from torch import nn

from clinfed.errors import ClinfedError
from clinfed.federated import payload
from clinfed.federated.aggregation import Aggregator
from clinfed.federated.client import LocalSettings, client_update, site_generator
from clinfed.federated.strategies import Strategy
from clinfed.privacy.policy import PrivacyPolicy
from clinfed.runs import append_jsonl, atomic_write_json, atomic_write_text, read_jsonl
from clinfed.tasks.base import Task
from clinfed.training import predict

STATE = "state.json"
Reporter = Callable[[str, dict[str, Any]], None]


@dataclass
class Federation:
    """Everything a simulated run needs, prepared by the pipeline."""

    task: Task
    model: nn.Module
    strategy: Strategy
    train: datasets.Dataset
    test: datasets.Dataset
    test_records: Any
    clients: dict[str, np.ndarray]  # client -> training example indices
    settings: LocalSettings
    rounds: int
    fraction: float
    seed: int
    eval_batch_size: int = 64
    privacy: PrivacyPolicy | None = None  # DP-SGD, ledgers and budgets; None: no DP


def _save_weights(state: dict[str, torch.Tensor], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    save_file({k: v.contiguous() for k, v in state.items()}, str(tmp))
    tmp.replace(path)


def _rng_state(sampling: np.random.Generator) -> dict[str, Any]:
    # Site-side randomness is derived per (seed, round, site) by
    # client.site_generator; only the server's client sampling has a state.
    return {"sampling": sampling.bit_generator.state}


def _restore_rng(state: dict[str, Any], sampling: np.random.Generator) -> None:
    sampling.bit_generator.state = state["sampling"]


def sample_clients(names: list[str], fraction: float, rng: np.random.Generator) -> list[str]:
    """The clients that train this round (at least one), in a stable order."""
    count = max(1, round(fraction * len(names)))
    if count >= len(names):
        return list(names)
    chosen = set(rng.choice(len(names), size=count, replace=False).tolist())
    return [n for i, n in enumerate(names) if i in chosen]


class Simulator:
    """Runs the rounds of a :class:`Federation` into a run folder."""

    def __init__(self, fed: Federation, out: Path, report: Reporter):
        self.fed, self.out, self.report = fed, out, report
        self.names = [n for n, _ in fed.model.named_parameters()]
        self.sampling_rng = np.random.default_rng([fed.seed, 1])
        self.global_state = {k: v.detach().clone() for k, v in fed.model.state_dict().items()}
        self.first_round = 1
        # Sites with a model of their own: the file of each as of the last
        # committed round, and the files written in the round in flight.
        self.site_files: dict[str, str] = {}
        self.pending_files: dict[str, str] = {}
        self.outputs: list = []  # test-set outputs and metrics of the last evaluation
        self.last_metrics: dict[str, Any] = {}
        self.stopped: str | None = None  # why the run ended before its last round

    # ---------------------------------------------------------- durability
    def resume(self) -> None:
        """Continue from the last committed round of ``self.out``."""
        path = self.out / STATE
        if not path.is_file():
            raise ClinfedError(f"{self.out}: nothing to resume (no {STATE})")
        state = json.loads(path.read_text())
        self.global_state = load_file(str(self.out / state["checkpoint"]))
        _restore_rng(state["rng"], self.sampling_rng)
        self.fed.strategy.load_state_dict(state["strategy"], self.global_state)
        self.site_files = dict(state.get("sites", {}))
        self.first_round = state["round"] + 1
        metrics = self.out / "metrics.jsonl"
        if metrics.exists():  # drop what the interrupted round had written
            kept = [r for r in read_jsonl(metrics) if r["round"] <= state["round"]]
            atomic_write_text(metrics, "".join(json.dumps(r, sort_keys=True) + "\n" for r in kept))

    def _commit(self, round_number: int) -> None:
        name = f"checkpoints/round-{round_number:04d}.safetensors"
        _save_weights(self.global_state, self.out / name)
        atomic_write_json(
            self.out / STATE,
            {
                "round": round_number,
                "checkpoint": name,
                "rng": _rng_state(self.sampling_rng),
                "strategy": self.fed.strategy.state_dict(),
                "sites": self.site_files | self.pending_files,
            },
        )
        self.site_files |= self.pending_files
        self.pending_files = {}
        for old in (self.out / "checkpoints").glob("round-*.safetensors"):
            if old.name != Path(name).name:
                old.unlink()
        # A site file superseded by the commit is no longer anyone's state.
        kept = set(self.site_files.values())
        for old in (self.out / "sites").glob("*.safetensors"):
            if old.name not in kept:
                old.unlink()

    # --------------------------------------------------------------- round
    def _site_start(self, client: str, round_number: int) -> dict[str, torch.Tensor]:
        """The weights a client starts ``round_number`` from (or is evaluated
        with after the round before): the global model, or the site's own
        with the shared part (the envelope's downloads) taken from it."""
        if self.fed.strategy.shares_model:
            return self.global_state
        name = self.pending_files.get(client) or self.site_files.get(client)
        own = load_file(str(self.out / "sites" / name)) if name else dict(self.global_state)
        for shared in self.fed.strategy.envelope(round_number, self.names).downloaded:
            own[shared] = self.global_state[shared]
        return own

    def run_round(self, round_number: int) -> dict[str, Any] | None:
        """One round; ``None`` when every sampled site refused to train."""
        fed = self.fed
        clients = sample_clients(sorted(fed.clients), fed.fraction, self.sampling_rng)
        aggregator = Aggregator()
        trained = 0
        for client in clients:
            privacy: dict[str, Any] = {}
            if fed.privacy is not None:
                # Write-ahead: the site checks its budget and records the
                # round's cost before it computes anything it will release.
                ledger = fed.privacy.ledger(client)
                mechanisms = fed.privacy.round_mechanisms(client)
                if not ledger.affords(mechanisms):
                    refusal = {
                        "round": round_number,
                        "client": client,
                        "refused": "privacy budget",
                        "epsilon": ledger.spent,
                        "epsilon_if_trained": ledger.after(mechanisms),
                    }
                    append_jsonl(self.out / "metrics.jsonl", refusal)
                    self.report("site_refused", refusal)
                    continue
                privacy = {"epsilon": ledger.record(round_number, mechanisms)}
            trained += 1
            self.report("site_start", {"round": round_number, "client": client})
            fed.model.load_state_dict(self._site_start(client, round_number))
            local = fed.train.select(fed.clients[client])
            chosen = fed.strategy.select(round_number, client, fed.model, fed.task, local)
            plan = fed.strategy.plan(round_number, client, self.names)
            down = payload.encode({n: self.global_state[n] for n in sorted(plan.downloaded)})
            dp = fed.privacy.settings(client) if fed.privacy is not None else None
            generator = site_generator(fed.seed, round_number, client)
            result = client_update(fed.model, fed.task, local, plan, fed.settings, generator, dp)
            if result.clipping is not None:
                privacy["clipping"] = result.clipping
            up = payload.encode(result.upload)
            if result.upload:
                # The server averages exactly what came over the wire.
                aggregator.add(payload.decode(up), result.num_examples)
            if not fed.strategy.shares_model:
                own = f"{client}.r{round_number:04d}.safetensors"
                _save_weights(
                    {k: v.detach().clone() for k, v in fed.model.state_dict().items()},
                    self.out / "sites" / own,
                )
                self.pending_files[client] = own
            record = result.record(round_number, client, len(up) if plan.uploaded else 0)
            record["bytes_down"] = len(down) if plan.downloaded else 0
            record |= chosen | privacy
            append_jsonl(self.out / "metrics.jsonl", record)
            self.report("site_end", record)
        if not trained:
            return None
        self.global_state = aggregator.result(self.global_state)
        observed = fed.strategy.observe(round_number, self.global_state)
        return self.evaluate(round_number) | observed

    def evaluate(self, round_number: int) -> dict[str, Any]:
        """Global evaluation record of a round (``round``, ``f1``, ...)."""
        fed = self.fed
        started = time.perf_counter()
        if fed.strategy.shares_model:
            fed.model.load_state_dict(self.global_state)
            outputs = predict(fed.model, fed.task, fed.test, fed.eval_batch_size)
        else:  # each site's own model on its own held-out examples
            outputs = self._personal_outputs(round_number)
        metrics = fed.task.evaluate(fed.test_records, fed.test, outputs)
        self.outputs = outputs
        record = {
            "round": round_number,
            "f1": metrics["f1"],
            "eval_seconds": round(time.perf_counter() - started, 3),
        }
        record |= {k: v for k, v in metrics.items() if k not in ("f1", "scores")}
        prompt = getattr(fed.model, "prompt", None)
        if prompt is not None and prompt.local_prompt is not None:
            # pfeddc: the global prompt alone (each site's own head), beside
            # the personalized figure above.
            prompt.global_only = True
            try:
                alone = fed.task.evaluate(
                    fed.test_records, fed.test, self._personal_outputs(round_number)
                )
            finally:
                prompt.global_only = False
            record["global_prompt_f1"] = alone["f1"]
            record["global_prompt_per_site_f1"] = alone.get("per_site_f1")
        self.last_metrics = metrics
        return record

    def _personal_outputs(self, round_number: int) -> list:
        """Test outputs of each site's own model on its own held-out examples."""
        fed = self.fed
        outputs: list = [None] * len(fed.test)
        sites = np.asarray(fed.test["site"])
        for site in sorted(set(sites.tolist())):
            idx = np.flatnonzero(sites == site)
            fed.model.load_state_dict(self._site_start(site, round_number + 1))
            for i, out in zip(
                idx, predict(fed.model, fed.task, fed.test.select(idx), fed.eval_batch_size)
            ):
                outputs[i] = out
        return outputs

    def run(self) -> dict[str, Any]:
        record: dict[str, Any] = {}
        if self.first_round == 1:  # let the strategy see the model every site starts from
            self.fed.strategy.observe(0, self.global_state)
        for round_number in range(self.first_round, self.fed.rounds + 1):
            result = self.run_round(round_number)
            if result is None:
                self.stopped = (
                    f"stopped before round {round_number}: no site can train "
                    "within its privacy budget"
                )
                self.report("stopped", {"round": round_number, "reason": self.stopped})
                break
            record = result
            append_jsonl(self.out / "metrics.jsonl", record)
            self._commit(round_number)
            self.report("round_end", record)
        if not record:  # resumed a finished (or stopped) run: evaluate the final state
            record = self.evaluate(max(self.first_round - 1, 0))
        self.fed.model.load_state_dict(self.global_state)
        return record
