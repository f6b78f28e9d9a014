"""The site runner: what one site does with a message, in every transport.

A site receives a :class:`~clinfed.federated.engine.Message`, rebuilds the
model it is told to start from (its own copy with the download overlaid,
or the whole model the server sent), evaluates it if asked (summable counts,
never examples), trains if asked (select -> plan -> the strategy's local
procedure, inside the privacy layer under DP), keeps its copy for the next
round and replies with the planned upload and its record.

Evaluation is metered: a site evaluates each global round's model once
(``evaluations.json`` in ``state_dir`` keeps a hash of what it evaluated),
never a round older than one it already evaluated, never past the run's
planned rounds. Asked again for the same round it answers only if the
weights are the very same (the same counts, nothing new); other weights are
refused. Evaluation counts are released unaccounted (declared in the
report): per round, one set of summed counts on the site's held-out
examples.

The site's copy of the model lives in ``state_dir`` as
``copy.rNNNN.safetensors``, ``NNNN`` the global round it received (its own
training on top, for what it trained), with the tensors it keeps for itself
(``personal/...``: Ditto's personal model). A message of round ``R`` carries
global round ``R-1``; the site starts from its latest copy of a round
``<= R-2`` (a copy written in a round that was never committed is never
used). A partial download of a shared model needs the copy of round
``R-2`` exactly, or the site refuses it and the server sends the whole
model next time.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
import time
from pathlib import Path
from typing import Any

import datasets
import torch
from safetensors import safe_open
from safetensors.torch import save
from torch import nn

from clinfed.core import payload
from clinfed.core.errors import ClinfedError
from clinfed.core.events import Reporter, SiteEvalStart, SiteEvalStep, SiteStart, SiteStep, silent
from clinfed.core.runs import atomic_write_bytes, atomic_write_json
from clinfed.federated.client import LocalSettings, LocalWork, site_generator
from clinfed.federated.state import load_tensors, save_tensors
from clinfed.federated.strategies import Strategy
from clinfed.modeling.adapters import shared_names, shared_state
from clinfed.modeling.blocks import block_of, num_layers, parameter_blocks
from clinfed.modeling.training import predict
from clinfed.privacy.randomness import reproducible, secret
from clinfed.privacy.site import SitePrivacy
from clinfed.tasks.base import Task

log = logging.getLogger("clinfed.site")

COPY = re.compile(r"^copy\.r(\d{4,})\.safetensors$")
RELEASED = re.compile(r"^released\.r(\d{4,})\.safetensors$")
PERSONAL = "personal/"
KEPT_COPIES = 2


class SiteRunner:
    """One site: its data, its copy of the model, its privacy ledger.

    Parameters
    ----------
    name
        The site's name (as in its records and the server's log).
    model
        The model object the site trains; the in-process transport shares
        one between all sites (weights are loaded into it, never copied).
    initial_state
        The run's seeded starting weights (a site with a model of its own
        starts from them).
    train, test, test_records
        The site's encoded training and held-out examples, and the records
        the held-out examples come from (for counting).
    state_dir
        The site's state folder (its model copies).
    privacy
        The site's privacy layer (``None``: no DP).
    predictions_dir
        Where the final evaluation writes predictions in the task's format
        (``None``: kept in ``final_outputs`` for the caller to write).
    meter_path, max_evaluations, run_name
        The evaluation meter's file (default ``state_dir/evaluations.json``),
        the most evaluations it allows over every run it serves, and this
        run's name in it.
    """

    def __init__(
        self,
        name: str,
        task: Task,
        model: nn.Module,
        initial_state: dict[str, torch.Tensor],
        strategy: Strategy,
        train: datasets.Dataset,
        test: datasets.Dataset,
        test_records: Any,
        settings: LocalSettings,
        seed: int,
        state_dir: Path,
        privacy: SitePrivacy | None = None,
        eval_batch_size: int = 64,
        predictions_dir: Path | None = None,
        report: Reporter = silent,
        planned_rounds: int | None = None,
        audit_dir: Path | None = None,
        meter_path: Path | None = None,
        max_evaluations: int | None = None,
        run_name: str = "",
    ):
        self.name, self.task, self.model, self.strategy = name, task, model, strategy
        self.initial_state = initial_state
        self.train, self.test, self.test_records = train, test, test_records
        self.settings, self.seed = settings, seed
        self.state_dir, self.privacy = Path(state_dir), privacy
        self.eval_batch_size, self.predictions_dir = eval_batch_size, predictions_dir
        self.report = report
        self.planned_rounds = planned_rounds
        # The evaluation meter: per run by default; a node's is per dataset.
        self.meter_path = Path(meter_path) if meter_path else self.state_dir / "evaluations.json"
        self.max_evaluations, self.run_name = max_evaluations, run_name
        # An auditing run keeps each site's latest update as the server saw
        # it (the global model it received with the upload overlaid).
        self.audit_dir = audit_dir
        self._audit_copy: tuple[int, dict[str, torch.Tensor]] | None = None
        # What this round trained, kept when it is released (replays).
        self._trained: tuple | None = None
        self.names = shared_names(model)
        self.shared = set(shared_state(model))
        self.personal: dict[str, torch.Tensor] = {}
        self.final_outputs: list | None = None

    # ------------------------------------------------------------- messages
    def handle(self, message: Any, release: bool = True) -> Any:
        """One message in, one reply out (see the module docstring).

        ``release``: mark the round's privacy charge released before the
        reply is returned (it leaves the site now). The in-process
        transport passes ``False`` and calls :meth:`release` once the
        round's results are about to be written."""
        from clinfed.federated.messages import Reply

        rebuilt = self._start_from(message.round, message.download, message.full, message.base)
        # What it rebuilt, as proof (a shared model only; checked by the server).
        proof = payload.digest(shared_state(self.model)) if self.strategy.shares_model else None
        # The server must name the model it means (its digest), unless it sent
        # the whole of it: a site never trains or evaluates weights of its own
        # building (a local checkpoint, say) that the server did not commit to.
        expected = message.expect if message.expect is not None or message.full else ""
        if proof is not None and (not rebuilt or expected not in (None, proof)):
            # Not the global model the server means: neither evaluated nor
            # trained (no privacy spent); the server sends the whole model next.
            log.warning(
                "site %s: round %d: %s; the server sends the whole model next round",
                self.name,
                message.round,
                f"no copy of global round {message.base} to update"
                if not rebuilt
                else f"the copy rebuilt is not global round {message.round - 1}",
            )
            ledger = self.privacy.report() if self.privacy is not None else None
            return Reply(
                site=self.name,
                ledger=ledger,
                received=proof if rebuilt else "",
                private=self.privacy is not None,
            )
        evaluation = None
        if message.evaluate and self._meter(message.round - 1):
            evaluation = self.evaluate(message.write_predictions)
        upload: dict[str, torch.Tensor] = {}
        record = None
        replay = None
        if message.kind == "train":
            self.report(SiteStart(round=message.round, site=self.name))
            received = (
                {k: v.detach().clone() for k, v in self.model.state_dict().items()}
                if self.audit_dir is not None
                else None
            )
            replay = self._released_reply(message.round, message.expect)
            if replay is not None:
                # This round's update left the site before (the server died
                # after it replied): the same bytes again, nothing charged.
                upload, record = replay
                if self.privacy is not None:
                    self.privacy.resend(message.round)
            else:
                upload, record = self.train_round(message.round, message.strategy_state)
                self._trained = (message.round, message.expect, upload, record)
            if received is not None and upload:
                # Written once the round is released (see release()): an
                # audit copy is a copy of what left the site.
                self._audit_copy = (message.round, received | upload)
        # The copy is on disk before anything leaves the site: the next
        # round's partial download overlays it (a replayed round's copy was
        # written by the attempt that trained).
        if replay is None or not self._has_copy(message.round - 1):
            self._save_copy(message.round - 1)
        if release and message.kind == "train":
            self.release(message.round)
        ledger = self.privacy.report() if self.privacy is not None else None
        return Reply(
            site=self.name,
            upload=upload,
            record=record,
            evaluation=evaluation,
            ledger=ledger,
            received=proof,
            private=self.privacy is not None,
        )

    def release(self, round_number: int) -> dict[str, Any] | None:
        """Write-ahead: the round's charge is marked released (fsynced)
        before its results leave; returns the ledger's digest after it."""
        digest = None
        if self._trained is not None and self._trained[0] == round_number:
            # Kept before the release line: a replay of a released round
            # is answered with these bytes, never trained (charged) again.
            self._keep_released(*self._trained)
            self._trained = None
        if self.privacy is not None:
            self.privacy.release(round_number)
            digest = self.privacy.ledger.digest()
        if self._audit_copy is not None and self._audit_copy[0] == round_number:
            save_tensors(self.audit_dir / f"{self.name}.safetensors", self._audit_copy[1])
            self._audit_copy = None
        return digest

    # ------------------------------------------------------------- replays
    def _released_path(self, round_number: int) -> Path:
        return self.state_dir / f"released.r{round_number:04d}.safetensors"

    def _keep_released(
        self, round_number: int, expect: str | None, upload: dict, record: dict
    ) -> None:
        """Keep what round ``round_number`` releases (0600, like the data;
        deleted once a later round shows the round was committed)."""
        if not record or "refused" in record or record.get("evaluation_only"):
            return
        metadata = {"record": json.dumps(record), "expect": expect or ""}
        tensors = {k: v.detach().contiguous().cpu() for k, v in upload.items()}
        atomic_write_bytes(self._released_path(round_number), save(tensors, metadata=metadata))

    def _released_reply(self, round_number: int, expect: str | None) -> tuple | None:
        """The upload and record this site released for ``round_number``
        from the same global model, if it did; drops what earlier,
        committed rounds released."""
        for path in self.state_dir.glob("released.r*.safetensors"):
            kept = RELEASED.match(path.name)
            if kept and int(kept.group(1)) < round_number:
                path.unlink(missing_ok=True)
        path = self._released_path(round_number)
        if not path.is_file():
            return None
        with safe_open(str(path), "pt") as fh:
            metadata = fh.metadata() or {}
            upload = {k: fh.get_tensor(k) for k in fh.keys()}  # noqa: SIM118
        if metadata.get("expect", "") != (expect or ""):
            return None  # another global model: not the same round's question
        return upload, json.loads(metadata["record"])

    def _has_copy(self, received_round: int) -> bool:
        return (self.state_dir / f"copy.r{received_round:04d}.safetensors").is_file()

    # ---------------------------------------------------------------- meter
    def _weights_hash(self) -> str:
        digest = hashlib.sha256()
        tensors = dict(self.model.state_dict()) | {
            PERSONAL + k: v for k, v in self.personal.items()
        }
        for name in sorted(tensors):
            digest.update(name.encode())
            digest.update(
                tensors[name]
                .detach()
                .cpu()
                .contiguous()
                .reshape(-1)
                .view(torch.uint8)
                .numpy()
                .tobytes()
            )
        return digest.hexdigest()

    def _meter(self, global_round: int) -> bool:
        """Whether the site may evaluate the model it holds as global round
        ``global_round`` (see the module docstring); records it if so.

        The meter (``meter_path``) may serve one dataset across runs (a
        Flower node keeps one per dataset beside its ledger): runs are kept
        apart by name, and ``max_evaluations`` caps every evaluation of the
        dataset together, whatever the runs are called."""
        path = self.meter_path
        try:
            raw = json.loads(path.read_text())
            runs = raw["runs"] if "runs" in raw else {"": raw}  # one run's meter, older
            meter = {run: {int(k): str(v) for k, v in done.items()} for run, done in runs.items()}
        except FileNotFoundError:
            meter = {}
        except (ValueError, AttributeError, TypeError, KeyError):
            raise ClinfedError(
                f"{path}: not an evaluation meter; the site cannot trust it"
            ) from None
        done = meter.get(self.run_name, {})
        weights = self._weights_hash()
        refusal = None
        total = sum(len(rounds) for rounds in meter.values())
        if global_round in done:
            if done[global_round] != weights:
                refusal = f"round {global_round} was evaluated already, with other weights"
        elif done and global_round < max(done):
            refusal = f"round {global_round} is older than round {max(done)}, evaluated already"
        elif self.planned_rounds is not None and global_round > self.planned_rounds:
            refusal = f"round {global_round} is past the run's {self.planned_rounds} rounds"
        elif self.max_evaluations is not None and total >= self.max_evaluations:
            refusal = (
                f"this dataset was evaluated {total} times, its cap (node config max-evaluations)"
            )
        if refusal is not None:
            log.warning("site %s: evaluation refused: %s", self.name, refusal)
            return False
        if done.get(global_round) != weights:
            meter[self.run_name] = done | {global_round: weights}
            runs = {run: {str(k): v for k, v in rounds.items()} for run, rounds in meter.items()}
            atomic_write_json(path, {"runs": runs})
        return True

    # ---------------------------------------------------------------- state
    def _copies(self) -> dict[int, Path]:
        found = {}
        if self.state_dir.is_dir():
            for path in self.state_dir.iterdir():
                match = COPY.match(path.name)
                if match:
                    found[int(match.group(1))] = path
        return found

    def _start_from(
        self,
        round_number: int,
        download: dict[str, torch.Tensor],
        full: bool,
        base: int | None = None,
    ) -> bool:
        """Load the model the message means; False when a partial download
        has no copy of its base round to overlay (restarted or lagging)."""
        usable = {r: p for r, p in self._copies().items() if r <= round_number - 2}
        if base is None:
            base = round_number - 2
        # A partial download overlays the copy of exactly ``base``; round 0
        # is the starting model, built here from the run's seed.
        base_round = base if base in usable else max(usable, default=None)
        saved = load_tensors(usable[base_round]) if base_round is not None else {}
        self.personal = {k[len(PERSONAL) :]: v for k, v in saved.items() if k.startswith(PERSONAL)}
        state = {k: v for k, v in saved.items() if not k.startswith(PERSONAL)}
        if full:
            self._load(download, strict=True)
            return True
        if self.strategy.shares_model and base == 0:
            # Global round 0 is the starting model itself (a copy of round 0
            # also holds the site's own training of round 1).
            state = {}
        elif self.strategy.shares_model and base_round != base:
            return False
        self._load(state or self.initial_state, strict=True)
        self._load(download, strict=False)
        return True

    def _load(self, tensors: dict[str, torch.Tensor], strict: bool) -> None:
        own = self.model.state_dict()
        unknown = sorted(set(tensors) - set(own))
        if unknown:
            raise ClinfedError(
                f"site {self.name}: received parameters this model lacks: {', '.join(unknown[:3])}"
            )
        for name, value in tensors.items():
            if tuple(value.shape) != tuple(own[name].shape):
                raise ClinfedError(
                    f"site {self.name}: received {name} with shape {tuple(value.shape)}"
                )
        missing = sorted(self.shared - set(tensors))
        if strict and missing:
            raise ClinfedError(f"site {self.name}: incomplete model ({missing[0]} missing)")
        with torch.no_grad():
            for name, value in tensors.items():
                own[name].copy_(value)

    def _save_copy(self, received_round: int) -> None:
        tensors = {k: v for k, v in self.model.state_dict().items()}
        tensors |= {PERSONAL + k: v for k, v in self.personal.items()}
        save_tensors(self.state_dir / f"copy.r{received_round:04d}.safetensors", tensors)
        copies = self._copies()
        for old in sorted(copies)[:-KEPT_COPIES]:
            copies[old].unlink(missing_ok=True)

    def finish(self) -> None:
        """After the run's last exchange: a copy that only repeats the global
        model (a shared model, no tensors of the site's own) is dropped; a
        site with a model or tensors of its own keeps its latest copy."""
        for path in self.state_dir.glob("released.r*.safetensors"):
            path.unlink(missing_ok=True)
        copies = self._copies()
        if not copies:
            return
        keep = set() if self.strategy.shares_model and not self.personal else {max(copies)}
        for tag, path in copies.items():
            if tag not in keep:
                path.unlink(missing_ok=True)

    # ------------------------------------------------------------- the work
    def evaluate(self, write_predictions: bool = False) -> dict[str, Any] | None:
        """Counts (never examples) of each model the strategy evaluates."""
        if len(self.test) == 0:
            return None
        started = time.perf_counter()
        counts = {}
        variants = self.strategy.evaluations(self.model, self.personal)
        total = len(self.test) * len(variants)
        self.report(SiteEvalStart(site=self.name, total=total))

        def step(done: int) -> None:
            self.report(SiteEvalStep(site=self.name, done=done, total=total))

        for variant, context in variants.items():
            with context:
                outputs = predict(self.model, self.task, self.test, self.eval_batch_size, step)
            counts[variant] = self.task.evaluation_counts(self.test_records, self.test, outputs)
            if variant == "" and write_predictions:
                if self.predictions_dir is not None:
                    # Predictions carry the notes' spans: they stay at the site.
                    self.task.write_predictions(
                        self.test_records, self.test, outputs, self.predictions_dir
                    )
                else:
                    self.final_outputs = outputs
        evaluation = {"counts": counts, "examples": len(self.test)}
        if self.privacy is None:
            # A timing tracks the held-out notes' lengths: not released under DP.
            evaluation["seconds"] = round(time.perf_counter() - started, 3)
        return evaluation

    def train_round(
        self, round_number: int, strategy_state: dict[str, Any]
    ) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        """Train one round; return the upload and the site's record. Under DP
        the privacy layer checks the budget and writes the ledger first. A
        site without training examples is an evaluation site: it says so and
        trains nothing."""
        if len(self.train) == 0:
            return {}, {"round": round_number, "site": self.name, "evaluation_only": True}
        self.strategy.load_state_dict(strategy_state, None)

        def update(dp: Any) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
            generator = site_generator(self.seed, round_number, self.name)
            randomness = None
            if dp is not None:
                # Secret unless the run asked for reproducible (not private) noise.
                randomness = reproducible(generator) if dp.reproducible else secret()
            chosen = self.strategy.select(
                round_number,
                self.name,
                self.model,
                self.task,
                self.train,
                rng=randomness.sampling if randomness is not None else None,
                unit=dp.unit if dp is not None else "example",
            )
            plan = self.strategy.plan(round_number, self.name, self.names)
            work = LocalWork(
                self.model,
                self.task,
                self.train,
                plan,
                self.settings,
                generator,
                dp,
                self.personal,
                randomness,
                on_step=lambda done, total: self.report(
                    SiteStep(site=self.name, done=done, total=total)
                ),
                round_number=round_number,
            )
            result = self.strategy.local_update(work)
            bytes_up = len(payload.encode(result.upload)) if plan.uploaded else 0
            record = result.record(round_number, self.name, bytes_up) | chosen
            # What the upload holds, by block (the report's "what each site
            # sent" over every layer): public, it follows from the plan.
            blocks = {block_of(n) for n in plan.uploaded}
            record["sent_blocks"] = sorted(str(b) for b in blocks)
            # ... and how much of each block: an adapter or bias terms send a
            # small part of a layer, never "the whole block".
            record["sent_share"] = self._sent_share(result.upload)
            record["num_layers"] = num_layers(parameter_blocks(self.names))
            if result.clipping is not None:
                record["clipping"] = result.clipping
            return result.upload, record

        if self.privacy is None:
            return update(None)
        return self.privacy.run(round_number, update)

    def _sent_share(self, upload: dict[str, torch.Tensor]) -> dict[str, float]:
        """Per block, the share of the block's numbers the upload holds."""
        total: dict[str, int] = {}
        for name, param in self.model.named_parameters():
            key = str(block_of(name))
            total[key] = total.get(key, 0) + param.numel()
        sent: dict[str, int] = {}
        for name, tensor in upload.items():
            key = str(block_of(name))
            sent[key] = sent.get(key, 0) + tensor.numel()
        return {k: round(min(1.0, n / total[k]), 6) for k, n in sorted(sent.items()) if k in total}
