"""The round engine: the server side of a federated run, for every transport.

One implementation drives the in-process transport (sites in turn in this
process) and the Flower transport (a SuperNode per hospital). Per round:

1. sample the sites that train (``fraction``); every other connected site
   is asked to evaluate only;
2. decide each site's download: exactly the tensors whose global value
   changed since the round the site's copy holds (``base``; a site first
   heard from holds round 0, the starting model every site builds from the
   run's seed, so round 1 sends nothing); the whole model to a site whose
   copy failed its proof (a site with a model of its own never gets more
   than the strategy's envelope); each message names the digest of the
   global round it means, and each reply proves the copy the site rebuilt;
3. send, and fold each reply in as it arrives (memory flat in the number
   of sites): check its record, its tensors (names inside the envelope,
   shapes, dtypes, finite values), aggregate through the strategy;
4. the evaluation of the previous round's global model arrives with the
   replies (summable counts; no examples leave a site): one record;
5. the strategy applies the mean (a server optimizer may step) and observes
   the new model; commit (weights fsynced, then ``state.json``).

After the last round one ``evaluate`` exchange scores the final model and
has each site write its predictions where it keeps them.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from clinfed.core import payload
from clinfed.core.errors import ClinfedError
from clinfed.core.events import Reporter, RoundEnd, SiteEnd, SiteRefused, Stopped, silent
from clinfed.core.runs import append_jsonl
from clinfed.federated import state
from clinfed.federated.messages import Message, Reply, Transport
from clinfed.federated.outputs import write_privacy, write_summary
from clinfed.federated.public_check import PublicCheck
from clinfed.federated.replies import check_record, check_upload, summed_evaluation
from clinfed.federated.strategies import Strategy
from clinfed.federated.summation import PlainSummation, RoundContext, Summation
from clinfed.tasks.base import Task

# Digests of this many recent global rounds are kept: a site that lags
# further gets the whole model.
KEPT_DIGESTS = 8
# The hold of a site whose copy failed its proof: it gets the whole model.
WHOLE = -1


@dataclass(frozen=True)
class Deployment:
    """How the server waits for sites (Flower; in-process sites never fail).

    Attributes
    ----------
    min_sites
        Training replies a round needs to be aggregated.
    round_timeout
        Seconds a round waits for replies before going on without the rest.
    round_retries
        Times a round short of ``min_sites`` is sent again before the run stops.
    wait_for_sites
        Seconds to wait, before each round, for ``min_sites`` sites to connect.
    """

    min_sites: int = 1
    round_timeout: float = 900.0
    round_retries: int = 1
    wait_for_sites: float = 300.0

    def validate(self) -> None:
        if self.min_sites < 1:
            raise ClinfedError("`min_sites` must be at least 1")
        if not (self.round_timeout > 0 and self.wait_for_sites >= 0 and self.round_retries >= 0):
            raise ClinfedError("`round_timeout` must be positive, waits and retries not negative")


def sample_sites(names: list[str], fraction: float, rng: np.random.Generator) -> list[str]:
    """The sites that train this round (at least one), in a stable order."""
    count = max(1, round(fraction * len(names)))
    if count >= len(names):
        return list(names)
    chosen = set(rng.choice(len(names), size=count, replace=False).tolist())
    return [n for i, n in enumerate(names) if i in chosen]


@dataclass
class _Replies:
    """What one exchange of a round gathered so far."""

    records: list[dict[str, Any]] = field(default_factory=list)
    evaluations: list[tuple[str, dict[str, Any]]] = field(default_factory=list)
    holds: dict[str, int] = field(default_factory=dict)  # site -> the round its copy holds
    trained: int = 0
    refused: int = 0


class RoundEngine:
    """Runs the rounds of one federated run into a run folder.

    Parameters
    ----------
    task
        For metrics from summed counts.
    strategy
        The server's strategy object.
    global_state
        The model every site starts from (the run's seeded model): its
        shared entries (:func:`clinfed.modeling.adapters.shared_state`).
    names
        The shared parameter names (what plans and envelopes speak of).
    out
        The run folder (created by the caller, with ``config.json``).
    rounds, fraction, seed
        The federation's settings.
    summation
        How each round's uploads are summed (default: in the clear).
    """

    def __init__(
        self,
        task: Task,
        strategy: Strategy,
        global_state: dict[str, torch.Tensor],
        names: list[str],
        out: Path,
        rounds: int,
        fraction: float = 1.0,
        seed: int = 0,
        deployment: Deployment | None = None,
        report: Reporter = silent,
        log: Callable[[str], None] = lambda line: None,
        full_bytes: int | None = None,
        summation: Summation | None = None,
        public_check: PublicCheck | None = None,
    ):
        self.task, self.strategy, self.names = task, strategy, names
        # --public-check: the server keeps a round's update only when it is
        # better on public text than chance (clinfed.federated.public_check).
        self.public_check = public_check
        self.global_state = {k: v.detach().clone() for k, v in global_state.items()}
        self.out, self.rounds, self.fraction = Path(out), rounds, fraction
        self.deployment = deployment or Deployment()
        self.report, self.log = report, log
        # How a round's uploads become its mean (in the clear, or a protocol
        # of its own: clinfed.federated.summation).
        self.summation = summation or PlainSummation()
        self.sampling = np.random.default_rng([seed, 1])
        self.first_round = 1
        self.holds: dict[str, int] = {}  # site -> global round its copy holds
        # What a site the engine has not heard from is taken to hold: the
        # run's starting model (round 0), which every site builds from the
        # run's seed and proves with its digest; None: the whole model.
        self.first_contact: int | None = 0
        # Per shared name, the round its global value last changed (0: the
        # starting model); per recent round, the global model's digest.
        self.changed: dict[str, int] = {n: 0 for n in self.global_state}
        self.digests: dict[str, str] = {"0": payload.digest(self.global_state)}
        self.site_of: dict[str, str] = {}  # address -> site name (learnt from replies)
        # Addresses of evaluation sites (no training data; learnt from replies).
        self.evaluators: set[str] = set()
        self.ledgers: dict[str, dict[str, Any]] = {}
        # Each site ledger's length and SHA-256 as last seen (committed with
        # every round; a resume refuses a ledger that lost part of it).
        self.ledger_digests: dict[str, dict[str, Any]] = {}
        self.pending_observed: dict[str, Any] = {}
        self.last_record: dict[str, Any] = {}
        self.stopped: str | None = None
        self._short = f"fewer than {self.deployment.min_sites} sites replied"
        # FedAvg's payload for this model: the yardstick for every strategy
        # (given when the shared model is not the whole one: adapters).
        self.full_bytes = full_bytes or len(payload.encode(self._params()))

    def _params(self) -> dict[str, torch.Tensor]:
        return {n: self.global_state[n] for n in self.names}

    # ---------------------------------------------------------- durability
    def resume(self) -> None:
        """Continue from the last commit of ``self.out`` (a run that died
        before its first commit starts over). Every check, and the repairs
        it states, ran before (:mod:`clinfed.runners.resume`)."""
        if not (self.out / state.STATE).exists():
            state.cut_metrics(self.out, 0)
            self.log(f"{self.out}: no round was committed; starting over from round 1")
            return
        committed = state.load(self.out)
        self.global_state = state.load_tensors(self.out / committed.checkpoint)
        self.sampling.bit_generator.state = committed.sampling
        self.strategy.load_state_dict(committed.strategy, self.global_state)
        if committed.strategy_tensors:
            self.strategy.load_tensor_state(
                state.load_tensors(self.out / committed.strategy_tensors)
            )
        self.holds = dict(committed.holds)
        self.ledger_digests = dict(committed.ledgers)
        self.changed = {n: 0 for n in self.global_state} | dict(committed.changed)
        self.digests = dict(committed.digests) or {
            str(committed.round): payload.digest(self.global_state)
        }
        self.pending_observed = dict(committed.strategy.get("_observed", {}))
        self.first_round = committed.round + 1
        if self.first_round > self.rounds:
            # A finished run: sites may have dropped their copies; the final
            # evaluation sends the whole model.
            self.holds, self.first_contact = {}, None
        state.cut_metrics(self.out, committed.metrics_bytes)

    def _commit(self, round_number: int) -> None:
        self._write_privacy()
        strategy_state = self.strategy.state_dict() | {"_observed": self.pending_observed}
        state.commit(
            self.out,
            round_number,
            self.global_state,
            strategy_state,
            self.strategy.tensor_state(),
            self.sampling.bit_generator.state,
            self.holds,
            self.ledger_digests,
            self.changed,
            self.digests,
        )

    def _metrics(self, record: dict[str, Any]) -> None:
        append_jsonl(self.out / "metrics.jsonl", record)

    # ----------------------------------------------------------- exchanges
    def _wait(self, transport: Transport) -> list[str]:
        deadline = time.monotonic() + self.deployment.wait_for_sites
        while True:
            addresses = sorted(transport.addresses())
            if len(addresses) >= self.deployment.min_sites or time.monotonic() >= deadline:
                return addresses
            time.sleep(1.0)

    def _messages(
        self, addresses: list[str], training: set[str], round_number: int, predictions: bool
    ) -> tuple[dict[str, Message], dict[str, int]]:
        envelope = self.strategy.envelope(round_number, self.names).downloaded
        sizes: dict[tuple[str, ...], int] = {}
        messages, bytes_down = {}, {}
        for address in addresses:
            site = self.site_of.get(address)
            held = self.holds.get(site) if site is not None else None
            if not self.strategy.shares_model:
                # A model of its own: never more than the shared part the
                # envelope names, and of it only what changed since it synced.
                full, base = False, held
                names = sorted(n for n in envelope if held is None or self.changed.get(n, 0) > held)
            elif site not in self.holds and self.first_contact is not None:
                # First contact: the site builds the starting model itself,
                # and gets what changed since (nothing in round 1).
                full, base = False, self.first_contact
                names = sorted(n for n in self.global_state if self.changed[n] > base)
            elif held is None or held < 0 or str(held) not in self.digests:
                # A copy that failed its proof, a site that lags too far, a
                # finished run evaluated again: the whole model.
                full, base, names = True, None, sorted(self.global_state)
            else:
                # Exactly what changed since the round its copy holds.
                full, base = False, held
                names = sorted(n for n in self.global_state if self.changed[n] > held)
            download = {n: self.global_state[n] for n in names}
            kind = "train" if address in training else "evaluate"
            if kind == "evaluate" and round_number == 1:
                continue  # nothing to evaluate yet, nothing to train
            key = tuple(names)
            if key not in sizes:
                # Bytes on the wire: the serialized download, measured once
                # per distinct set of tensors.
                sizes[key] = len(payload.encode(download)) if names else 0
            bytes_down[address] = sizes[key]
            messages[address] = self.summation.prepare(
                Message(
                    kind,
                    round_number,
                    download,
                    full,
                    evaluate=round_number > 1,
                    write_predictions=predictions,
                    strategy_state=self.strategy.state_dict(),
                    base=base,
                    expect=self.digests.get(str(round_number - 1)),
                )
            )
        return messages, bytes_down

    # --------------------------------------------------------------- round
    def run_round(self, transport: Transport, round_number: int) -> bool:
        """One round; False when it could not be completed (the run stops)."""
        for attempt in range(self.deployment.round_retries + 1):
            addresses = self._wait(transport)
            if not addresses:
                break
            trainers = [a for a in addresses if a not in self.evaluators]
            training = (
                set(sample_sites(trainers, self.fraction, self.sampling)) if trainers else set()
            )
            messages, bytes_down = self._messages(addresses, training, round_number, False)
            self.log(
                f"round {round_number}/{self.rounds}: sending to {len(training)} sites"
                + (f" (attempt {attempt + 1})" if attempt else "")
            )
            outcome = self._collect(transport, messages, bytes_down, round_number)
            if outcome is not None:
                return outcome
        self.stopped = f"stopped in round {round_number}: {self._short}"
        return False

    def _collect(
        self,
        transport: Transport,
        messages: dict[str, Message],
        bytes_down: dict[str, int],
        round_number: int,
    ) -> bool | None:
        """Send, fold replies in, write records; ``None``: too few replies (retry)."""
        allowed = self.strategy.envelope(round_number, self.names).uploaded
        summed = self.summation.open(
            self.strategy.aggregator(round_number), allowed, self.global_state
        )
        replies = _Replies()
        for address, reply in transport.exchange(messages, self.deployment.round_timeout):
            self._fold(address, reply, messages[address], bytes_down, allowed, summed, replies)
        records = replies.records
        closed = summed.close(
            RoundContext(
                round_number,
                lambda messages: transport.exchange(messages, self.deployment.round_timeout),
                lambda address: self.site_of.get(address, f"node {address}"),
                records,
                self.log,
            )
        )
        for address in closed.dropped:
            # Its copy holds its own training on top of the old round, and
            # the aggregate does not: not in sync.
            replies.holds.pop(self.site_of.get(address, ""), None)
        replies.trained -= len(closed.dropped)
        # Write-ahead: the sites mark their charges released before any of
        # this round's results are written (or did as their replies left).
        trainers = [r["site"] for r in records if "bytes_up" in r]
        self.ledger_digests |= transport.release(round_number, trainers)
        if replies.trained + replies.refused < self.deployment.min_sites or closed.failure:
            self._too_few(round_number, replies, closed.failure)
            return None
        if round_number > 1:
            self._evaluation_record(round_number - 1, replies.evaluations)
        for record in sorted(records, key=lambda r: r["site"]):
            self._metrics(record)
            if "bytes_up" in record:
                self.report(SiteEnd(record))
        if not replies.trained:
            # Nothing is committed: what the sites hold is still what the
            # last committed round left them (the final evaluation's base).
            self.stopped = (
                f"stopped before round {round_number}: no site can train within its privacy budget"
            )
            self.report(Stopped(round=round_number, reason=self.stopped))
            return False
        self.holds |= replies.holds
        self._apply(round_number, *summed.mean(self.global_state))
        return True

    def _fold(
        self,
        address: str,
        reply: Reply | str,
        message: Message,
        bytes_down: dict[str, int],
        allowed: frozenset[str],
        summed: Any,
        replies: _Replies,
    ) -> None:
        """One reply into the round: its ledger, its evaluation, and (checked)
        its update into the sum, or a record of why not."""
        round_number = message.round
        site = self.site_of.get(address, f"node {address}")
        if isinstance(reply, str):
            replies.records.append({"round": round_number, "site": site, "failed": reply})
            self.log(f"round {round_number}: {site}: no usable reply ({reply})")
            return
        self.site_of[address] = site = reply.site
        stale = self._stale(reply, round_number)
        if reply.ledger:
            self.ledgers[site] = reply.ledger
            if reply.ledger.get("digest"):
                self.ledger_digests[site] = reply.ledger["digest"]
        if reply.evaluation:
            replies.evaluations.append((site, reply.evaluation))
        if message.kind == "train" and (reply.record or {}).get("evaluation_only"):
            # An evaluation site: it holds data to evaluate on and none to
            # train on; from now on it is only asked to evaluate.
            self.evaluators.add(address)
        if message.kind == "evaluate" or address in self.evaluators:
            if stale is None:
                replies.holds[site] = round_number - 1
            else:
                self.holds[site] = WHOLE
            return
        reason = (
            stale or check_record(reply) or check_upload(reply.upload, allowed, self.global_state)
        )
        if reason is None:
            replies.holds[site] = round_number - 1
            record = dict(reply.record)
            if "refused" in record:
                replies.refused += 1
                replies.records.append(record)
                self.report(SiteRefused(record))
                return
            record["bytes_down"] = bytes_down[address]
            reason = summed.add(address, reply, record["examples"])
            if reason is None:
                replies.trained += 1
                replies.records.append(record)
                return
        replies.records.append({"round": round_number, "site": site, "rejected": reason})
        self.log(f"round {round_number}: {site}: update rejected ({reason})")
        if stale is not None:
            self.holds[site] = WHOLE  # the whole model next time

    def _too_few(self, round_number: int, replies: _Replies, failure: str | None) -> None:
        """A round short of sites (or whose secure sum failed): its records
        written, the reason kept for the retry or the stop."""
        for record in replies.records:
            self._metrics(record)
        rejected = sorted({r["rejected"] for r in replies.records if "rejected" in r})
        why = f" (updates rejected: {'; '.join(rejected)})" if rejected else ""
        if any("NaN or Inf" in reason for reason in rejected):
            why += "; training diverged: lower --lr or --head-lr"
        self._short = failure or f"fewer than {self.deployment.min_sites} sites replied{why}"
        self.log(
            f"round {round_number}: {failure}"
            if failure is not None
            else f"round {round_number}: {replies.trained + replies.refused} of the "
            f"{self.deployment.min_sites} sites needed replied"
        )

    def _apply(self, round_number: int, mean: dict[str, torch.Tensor], sent: Any) -> None:
        """The round's mean through the strategy (and the public check), then
        committed."""
        previous = self.global_state
        self.global_state = self.strategy.apply(round_number, self.global_state, mean, sent)
        check = None
        if self.public_check is not None:
            self.global_state, check = self.public_check.choose(previous, self.global_state)
        for name, value in self.global_state.items():
            if not torch.equal(value, previous[name]):
                self.changed[name] = round_number
        if check is not None and not check["kept"]:
            # Each site's copy holds its own training of this round, not the
            # model kept: what the sites trained goes out again next round.
            for name in sent:
                self.changed[name] = round_number
            self.log(
                f"round {round_number}: not better than chance on the public text; "
                "the last model is kept"
            )
        self.digests[str(round_number)] = payload.digest(self.global_state)
        for old in sorted(self.digests, key=int)[:-KEPT_DIGESTS]:
            del self.digests[old]
        self.pending_observed = self.strategy.observe(round_number, self.global_state)
        if check is not None:
            self.pending_observed["public_check"] = check
        self._commit(round_number)

    def _stale(self, reply: Reply, round_number: int) -> str | None:
        """Why the model a site rebuilt is not global round ``round_number - 1``
        (a stale or corrupt copy), or ``None``. A site that proves nothing
        (a model of its own) is taken at its word."""
        if reply.received is None or not self.strategy.shares_model:
            return None
        expected = self.digests.get(str(round_number - 1))
        if expected is None or reply.received == expected:
            return None
        return (
            f"its copy did not rebuild global round {round_number - 1} (stale or corrupt); "
            "it gets the whole model next round"
        )

    def _evaluation_record(
        self, round_number: int, evaluations: list[tuple[str, dict[str, Any]]]
    ) -> dict[str, Any]:
        """The global record of ``round_number`` from the sites' summed counts."""
        record = {"round": round_number} | summed_evaluation(self.task, evaluations)
        record |= self.pending_observed
        self._metrics(record)
        self.last_record = record
        self.report(RoundEnd(record))
        if "f1" in record:
            self.log(f"round {round_number}: f1 {record['f1']:.4f} on {len(evaluations)} sites")
        else:
            self.log(f"round {round_number}: not evaluated (no site evaluated it)")
        return record

    def _final_evaluation(
        self, transport: Transport, round_number: int
    ) -> list[tuple[str, dict[str, Any]]]:
        """Score the model of ``round_number`` everywhere; sites write predictions."""
        addresses = self._wait(transport)
        messages, _ = self._messages(addresses, set(), round_number + 1, True)
        evaluations = []
        for address, reply in transport.exchange(messages, self.deployment.round_timeout):
            if isinstance(reply, str):
                site = self.site_of.get(address, f"node {address}")
                self.log(f"final evaluation: {site}: no reply ({reply})")
                continue
            self.site_of[address] = reply.site
            stale = self._stale(reply, round_number + 1)
            if stale is not None:
                # Counts of another model than the final one: left out.
                self.log(f"final evaluation: {reply.site}: {stale}")
                continue
            if reply.ledger:
                self.ledgers[reply.site] = reply.ledger
            if reply.evaluation:
                evaluations.append((reply.site, reply.evaluation))
        return evaluations

    # ----------------------------------------------------------------- run
    def run(self, transport: Transport) -> dict[str, Any]:
        """Every round from the first uncommitted one, then the final
        evaluation; returns the summary (also ``RUN/summary.json``)."""
        self.deployment.validate()
        if self.first_round == 1:  # the model every site starts from
            self.strategy.observe(0, self.global_state)
        last = self.first_round - 1
        for round_number in range(self.first_round, self.rounds + 1):
            if not self.run_round(transport, round_number):
                break
            last = round_number
        evaluations = self._final_evaluation(transport, last)
        if self.stopped is None or not self.last_record:
            self._evaluation_record(last, evaluations)
        self._write_privacy()
        return self.summary()

    def summary(self) -> dict[str, Any]:
        """The run's summary (also ``RUN/summary.json``): the last record,
        communication totals and, under DP, each site's epsilon."""
        if self.stopped:
            self.log(self.stopped)
        return write_summary(
            self.out, self.last_record, self.full_bytes, self.ledgers, self.stopped
        )

    def _write_privacy(self) -> None:
        write_privacy(self.out, self.ledgers)
