"""Properties over generated inputs (hypothesis): the wire codec round-trips,
aggregation does not depend on the order replies arrive, the secure sum
equals the plain one under any dropouts the threshold allows, the ledger
never under-counts what left a site and never passes its budget, a
calibrated noise multiplier keeps the plan at or under its target, and
every concept-extraction format reads back what it wrote.

Example counts are small (the suite runs on 2 cores); a failure prints the
smallest input hypothesis found, and ``--hypothesis-seed`` replays it."""

from __future__ import annotations

import math
from pathlib import Path

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from clinfed.core.errors import ProblemLog
from clinfed.federated.aggregation import Aggregator
from clinfed.federated.messages import (
    Message,
    Reply,
    decode_message,
    decode_reply,
    encode_message,
    encode_reply,
)
from clinfed.privacy.accountants import calibrate_noise, epsilon
from clinfed.privacy.accountants.base import Mechanism
from clinfed.privacy.ledger import Ledger
from clinfed.tasks.i2b2.adapter import I2b2Task
from clinfed.tasks.i2b2.convert import TARGETS, write_documents
from clinfed.tasks.i2b2.format import Concept, Document

from .test_secure import NAMES, SecureSites, engine, plain_mean

FEW = settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
# Each example runs a whole secure round (key agreement, Shamir, ChaCha20).
SLOW = settings(
    max_examples=6,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)

names = st.text("abcdefghij./_", min_size=1, max_size=12)
shapes = st.lists(st.integers(1, 4), min_size=0, max_size=3).map(tuple)
floats = st.floats(-1e6, 1e6, allow_nan=False, width=32)


@st.composite
def tensors(draw, dtypes=(torch.float32, torch.float16, torch.int64)):
    out = {}
    for name in draw(st.lists(names, max_size=4, unique=True)):
        shape = draw(shapes)
        values = draw(st.lists(floats, min_size=math.prod(shape), max_size=math.prod(shape)))
        dtype = draw(st.sampled_from(dtypes))
        out[name] = torch.tensor(values, dtype=torch.float64).reshape(shape).to(dtype)
    return out


def same_tensors(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(
        a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]) for k in a
    )


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**40), 2**40) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner),
    max_leaves=8,
)


@FEW
@given(
    download=tensors(),
    kind=st.sampled_from(["train", "evaluate", "secure"]),
    round_number=st.integers(1, 10_000),
    flags=st.tuples(st.booleans(), st.booleans(), st.booleans()),
    state=st.dictionaries(st.text(max_size=6), json_values, max_size=3),
    base=st.none() | st.integers(0, 100),
    expect=st.none() | st.text("0123456789abcdef", min_size=64, max_size=64),
    run=st.dictionaries(st.text(max_size=6), json_values, max_size=3),
)
def test_a_message_reads_back_as_it_was_sent(
    download, kind, round_number, flags, state, base, expect, run
):
    full, evaluate, predictions = flags
    sent = Message(kind, round_number, download, full, evaluate, predictions, state, None, base,
                   expect)  # fmt: skip
    message, run_back = decode_message(encode_message(sent, run))
    assert same_tensors(message.download, sent.download)
    assert (message.kind, message.round, message.full, message.evaluate) == (
        kind, round_number, full, evaluate,
    )  # fmt: skip
    assert message.write_predictions == predictions and message.strategy_state == state
    assert (message.base, message.expect, run_back) == (base, expect, run)


@FEW
@given(
    upload=tensors(),
    site=st.text("abcdefgh-", min_size=1, max_size=10),
    received=st.none() | st.text("0123456789abcdef", min_size=64, max_size=64),
    examples=st.integers(1, 10**6),
    bytes_up=st.integers(0, 10**9),
)
def test_a_reply_reads_back_as_it_was_sent(upload, site, received, examples, bytes_up):
    record = {"round": 3, "site": site, "examples": examples, "bytes_up": bytes_up}
    sent = Reply(site=site, upload=upload, record=record, received=received, private=False)
    reply = decode_reply(encode_reply(sent))
    assert same_tensors(reply.upload, sent.upload)
    assert (reply.site, reply.record, reply.received) == (site, record, received)
    assert reply.evaluation is None and reply.ledger is None and reply.secure is None


@FEW
@given(data=st.data(), sites=st.integers(1, 6), shape=st.sampled_from([(3,), (2, 2), (5,)]))
def test_the_mean_does_not_depend_on_the_order_replies_arrive(data, sites, shape):
    current = {"w": torch.zeros(shape), "b": torch.zeros(2), "kept": torch.ones(3)}
    replies = []
    for _ in range(sites):
        sent = data.draw(st.lists(st.sampled_from(["w", "b"]), min_size=1, unique=True))
        upload = {}
        for name in sent:
            size = math.prod(current[name].shape)
            values = data.draw(st.lists(floats, min_size=size, max_size=size))
            upload[name] = torch.tensor(values).reshape(current[name].shape)
        replies.append((upload, data.draw(st.integers(1, 10_000))))
    order = data.draw(st.permutations(range(sites)))
    results = []
    for sequence in (range(sites), order):
        aggregator = Aggregator()
        for index in sequence:
            aggregator.add(*replies[index])
        results.append(aggregator.result(current))
    first, second = results
    for name in current:
        assert torch.allclose(first[name], second[name], rtol=1e-6, atol=1e-3), name
    # What no site sent keeps its value; what one site sent alone is its upload.
    assert torch.equal(first["kept"], current["kept"])
    senders = [u for u, _ in replies if "b" in u]
    if len(senders) == 1:
        assert torch.allclose(first["b"], senders[0]["b"])


@SLOW
@given(data=st.data(), count=st.integers(3, 6))
def test_the_secure_sum_equals_the_plain_sum_under_any_dropouts_the_threshold_allows(
    tmp_path_factory, data, count
):
    folder = tmp_path_factory.mktemp("secure")
    examples = {f"s{i}": data.draw(st.integers(1, 50), label=f"s{i}") for i in range(count)}
    # The threshold is a majority: up to count - (count // 2 + 1) sites may
    # drop out after sharing their keys, at the mask stage or before
    # unmasking.
    allowed = count - (count // 2 + 1)
    dropped = data.draw(
        st.lists(st.sampled_from(sorted(examples)), min_size=1, max_size=allowed, unique=True)
    )
    stages = {site: data.draw(st.sampled_from(["mask", "unmask"])) for site in dropped}

    def fail(site, message):
        stage = (message.secure or {}).get("stage")
        if message.kind != "secure" or site not in stages:
            return None
        if stage == "unmask" or stage == stages[site]:
            return "no reply within 5 s"
        return None

    run = engine(folder / "run")
    run.run(SecureSites(folder / "sites", examples, fail))
    # A site that dropped before masking is left out; one that sent its
    # masked input and then went quiet is in the sum.
    summed = {s: n for s, n in examples.items() if stages.get(s) != "mask"}
    expected = plain_mean(summed)
    for name in NAMES:
        assert torch.allclose(run.global_state[name], expected[name], atol=1e-5), name


class LedgerMachine(RuleBasedStateMachine):
    """Charges, releases, abandoned attempts and re-reads in any order: what
    left the site is always accounted, and the ledger stays in budget."""

    BUDGET = 6.0
    DELTA = 1e-5

    @initialize(folder=st.builds(lambda: Path(__import__("tempfile").mkdtemp())))
    def start(self, folder):
        self.path = folder / "ledger.jsonl"
        self.ledger = self._open()
        self.pending: dict[int, list[Mechanism]] = {}
        self.released: list[Mechanism] = []
        self.round = 1

    def _open(self) -> Ledger:
        return Ledger(self.path, "site1", self.DELTA, budget=self.BUDGET, run="run1")

    @rule(
        sigma=st.floats(0.6, 4.0),
        rate=st.floats(0.01, 0.5),
        steps=st.integers(1, 40),
        fresh=st.booleans(),
    )
    def charge(self, sigma, rate, steps, fresh):
        number = self.round + 1 if fresh or self.round in self.pending else self.round
        if number in self.pending:
            return
        mechanisms = [Mechanism("dp-sgd", sigma, rate, steps)]
        if self.ledger.charge(number, mechanisms) is not None:
            self.pending[number] = mechanisms
        self.round = number

    @precondition(lambda self: self.pending)
    @rule(data=st.data())
    def release(self, data):
        number = data.draw(st.sampled_from(sorted(self.pending)))
        self.ledger.release(number)
        self.released += self.pending.pop(number)

    @precondition(lambda self: self.pending)
    @rule(data=st.data())
    def abandon(self, data):
        # The computation failed before anything left: the charge stays on
        # the ledger for a re-run to reuse, and counts meanwhile.
        number = data.draw(st.sampled_from(sorted(self.pending)))
        self.ledger.abandon(number)
        del self.pending[number]

    @invariant()
    def everything_released_is_accounted_and_the_budget_holds(self):
        if not hasattr(self, "ledger"):
            return
        read = self._open()
        spent = read.spent
        assert spent >= epsilon(self.released, self.DELTA) - 1e-9
        assert spent <= self.BUDGET * 1.001


LedgerMachine.TestCase.settings = settings(
    max_examples=8, stateful_step_count=8, deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)  # fmt: skip
test_the_ledger_never_under_counts_and_never_passes_its_budget = LedgerMachine.TestCase


@settings(max_examples=6, deadline=None)
@given(
    target=st.floats(0.5, 16.0),
    rate=st.floats(0.005, 0.3),
    steps=st.integers(1, 60),
    rounds=st.integers(1, 5),
    relation=st.sampled_from(["add-remove", "replace-one"]),
)
def test_a_calibrated_noise_multiplier_plans_at_or_under_its_target(
    target, rate, steps, rounds, relation
):
    from clinfed.privacy.accountants import budget_accountant

    accountant = budget_accountant(relation)
    sigma = calibrate_noise(
        target, 1e-5, lambda s: [Mechanism("dp-sgd", s, rate, steps)], rounds,
        accountant=accountant,
    )  # fmt: skip
    planned = accountant.epsilon([Mechanism("dp-sgd", sigma, rate, steps)] * rounds, 1e-5)
    assert planned <= target * (1 + 1e-9)


words = st.text("abcdefghijklmnopqrstuvwxyzABCDEFGHIJ0123456789", min_size=1, max_size=8)


@st.composite
def documents(draw):
    docs = []
    for number in range(draw(st.integers(1, 3))):
        lines = draw(st.lists(st.lists(words, min_size=1, max_size=6), min_size=1, max_size=4))
        concepts = []
        for line_number, tokens in enumerate(lines, start=1):
            at = 0
            while at < len(tokens) and draw(st.booleans()):
                first = draw(st.integers(at, len(tokens) - 1))
                last = draw(st.integers(first, len(tokens) - 1))
                kind = draw(st.sampled_from(["problem", "test", "treatment"]))
                text = " ".join(tokens[first : last + 1]).lower()
                concepts.append(Concept((line_number, first), (line_number, last), kind, text))
                at = last + 1
        docs.append(Document(f"note{number}", "site1", lines, concepts, con_path=Path("x")))
    return docs


@settings(
    max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(docs=documents(), target=st.sampled_from(TARGETS))
def test_every_format_reads_back_what_it_wrote(tmp_path_factory, docs, target):
    folder = tmp_path_factory.mktemp("written") / "corpus"
    write_documents(docs, folder, target)
    read = I2b2Task(format=target).read_documents(folder, ProblemLog())

    def content(documents):
        return sorted(
            (d.lines, sorted((c.start, c.end, c.type) for c in d.concepts)) for d in documents
        )

    assert content(read) == content(docs)
