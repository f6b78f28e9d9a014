"""Shared test fixtures: the real-format samples in tests/fixtures and
small synthetic corpora made once per session."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import datasets
import pytest
import transformers

REPO = Path(__file__).resolve().parents[1]
FIXTURES = Path(__file__).resolve().parent / "fixtures"  # see fixtures/SOURCES.md
CANARY = "ZQXCANARY7731"


class _OneNameOnly:
    """``tasks/`` and ``privacy/`` install as ``clinfed.tasks`` and
    ``clinfed.privacy``. The checkout's root is on ``sys.path`` in tests, so
    ``import privacy`` would load a second copy of the same code under
    another name (two ``Mechanism`` classes, two registries); refuse it."""

    blocked = ("tasks", "privacy")

    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in self.blocked:
            raise ImportError(f"{name}: import it as clinfed.{name}")
        return None


sys.meta_path.insert(0, _OneNameOnly())

datasets.disable_progress_bars()
transformers.logging.set_verbosity_error()


def pytest_xdist_auto_num_workers(config: pytest.Config) -> int:
    """``-n auto`` (the default addopts) runs one worker more than the cores:
    the Flower, worker and crash tests spend much of their time waiting on
    other processes (Flower's polls, process starts), and a spare worker
    fills it. Measured on 2 cores, fresh clones: 522 s and 561 s with three
    workers against 573 s and 625 s with two."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return (cores or 1) + 1


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests marked ``heavy`` first: the workers take the collection in
    order, so the longest start at once and the short ones fill around
    them, instead of one long test running alone at the end."""
    items.sort(key=lambda item: item.get_closest_marker("heavy") is None)


@pytest.fixture(scope="session", autouse=True)
def _private_scratch():
    """The whole session inside a private scratch folder, as every clinfed
    process runs: what tests build directly (a node's site, its encoded
    data) lands there and is removed at the end, never loose in $TMPDIR."""
    from clinfed.core.scratch import private_scratch

    with private_scratch():
        yield


def _fixture_dir(name: str) -> Path:
    path = FIXTURES / name
    if not path.is_dir():
        pytest.fail(f"missing fixtures: {path}")
    return path


@pytest.fixture(scope="session")
def cliner_dir() -> Path:
    return _fixture_dir("i2b2_cliner")


@pytest.fixture(scope="session")
def mimic_demo_dir() -> Path:
    return _fixture_dir("mimic3_demo")


@pytest.fixture(scope="session")
def i2b2_corpus(tmp_path_factory) -> Path:
    from clinfed.tasks.i2b2.synth import generate

    out = tmp_path_factory.mktemp("i2b2") / "data"
    generate(out, sites=3, docs=8, seed=1)
    return out


@pytest.fixture(scope="session")
def public_i2b2(tmp_path_factory) -> Path:
    """Public notes of other patients: a synthetic corpus of its own draw
    (a public input may hold no file of the private corpus)."""
    from clinfed.tasks.i2b2.synth import generate

    out = tmp_path_factory.mktemp("public-i2b2") / "data"
    generate(out, sites=2, docs=6, seed=2)
    return out


@pytest.fixture(scope="session")
def mimic_corpus(tmp_path_factory) -> Path:
    from clinfed.tasks.mimic3.synth import generate

    out = tmp_path_factory.mktemp("mimic3") / "data"
    generate(out, sites=2, docs=24, seed=1, canary=CANARY)
    return out


class Traffic:
    """What the in-process transport carried: per message, the round, kind,
    site, and the names of the tensors sent down and up."""

    def __init__(self) -> None:
        self.messages: list[dict] = []

    def of(self, round_number: int, kind: str = "train") -> list[dict]:
        return [m for m in self.messages if m["round"] == round_number and m["kind"] == kind]


@pytest.fixture
def traffic(monkeypatch) -> Traffic:
    """Record every message the in-process transport delivers."""
    from clinfed.federated.inprocess import InProcessTransport

    seen = Traffic()
    original = InProcessTransport.exchange

    def exchange(self, messages, timeout):
        for address, reply in original(self, messages, timeout):
            message = messages[address]
            seen.messages.append(
                {
                    "round": message.round,
                    "kind": message.kind,
                    "site": address,
                    "down": set(message.download),
                    "full": message.full,
                    "up": set(reply.upload) if not isinstance(reply, str) else set(),
                }
            )
            yield address, reply

    monkeypatch.setattr(InProcessTransport, "exchange", exchange)
    return seen


# The smallest run that still exercises a federation: the tiny random BERT,
# one round of FedAvg over windows of 32 tokens, one thread.
TINY_RUN = {
    "task": "i2b2",
    "strategy": "fedavg",
    "model": "tiny",
    "rounds": 1,
    "max_length": 32,
    "threads": 1,
    # One pass a round (the recipe's six under DP are measured elsewhere).
    "local_epochs": 1,
}


@pytest.fixture
def tiny_config(i2b2_corpus, tmp_path):
    """``tiny_config(out=None, data=None, **settings)``: a RunConfig for
    :data:`TINY_RUN` with ``settings`` on top (``out`` defaults to
    ``tmp_path/run``, ``data`` to the synthetic i2b2 corpus)."""
    from clinfed.settings import RunConfig

    def make(out=None, data=None, **settings):
        values = TINY_RUN | settings
        return RunConfig.of(
            data=str(data or i2b2_corpus), out=str(out or tmp_path / "run"), **values
        )

    return make


@pytest.fixture
def tiny_run(tiny_config):
    """``tiny_run(out=None, data=None, **settings)``: train
    :func:`tiny_config`'s run in process; returns its summary."""
    from clinfed.runners.pipeline import run_training

    def run(out=None, data=None, **settings):
        return run_training(tiny_config(out, data, **settings))

    return run
