"""Secure aggregation at a site: a wrapper around its runner.

The server's half is a :class:`~clinfed.federated.summation.Summation`
(:mod:`clinfed.federated.secure_summation`); this is the site's half, in the
way Flower's SecAgg+ is a client mod: the site runner and the transports
know nothing of it. Wrapped, a site

* refuses a training message that asks for a plain upload (the run
  promised the server never sees one site's update);
* keeps its trained update in its state folder and replies with its keys
  instead (stage 1, :func:`clinfed.federated.secure.hold_upload`);
* answers the later stages (kind ``secure``) from that folder alone: they
  need neither the site's data nor its model, so the runner is built only
  when a message needs it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

from clinfed.core.errors import ClinfedError
from clinfed.federated import secure


class SecureAggregationSite:
    """A site under secure aggregation.

    Parameters
    ----------
    runner
        The site's runner, or a function that builds it (called once, on
        the first message that trains or evaluates).
    state_dir
        The site's state folder: the round's secrets live under it.
    min_group
        The fewest sites whose masked inputs the site lets the server sum
        (its own policy: the sites it expects).
    """

    def __init__(self, runner: Any, state_dir: Path, min_group: int = 2):
        self._runner = runner if not callable(runner) else None
        self._build: Callable[[], Any] | None = runner if callable(runner) else None
        self.state_dir, self.min_group = Path(state_dir), min_group

    @property
    def runner(self) -> Any:
        if self._runner is None:
            assert self._build is not None
            self._runner = self._build()
        return self._runner

    def handle(self, message: Any, release: bool = True) -> Any:
        """The site's reply; see the module docstring."""
        from clinfed.federated.messages import Reply

        if message.kind == "secure":
            name = secure.site_name(self.state_dir, message.round)
            tensors, part = secure.site_stage(
                self.state_dir, message.round, message.secure or {}, self.min_group
            )
            return Reply(site=name, upload=tensors, secure=part)
        if message.kind == "train" and message.secure is None:
            raise ClinfedError(
                "the run uses secure aggregation but this training message asks for a plain "
                "upload: refused"
            )
        reply = self.runner.handle(message, release)
        record = reply.record or {}
        if message.kind != "train" or not reply.upload or "refused" in record:
            return reply
        # The upload stays here; it leaves only masked, in a later stage.
        part = secure.hold_upload(
            self.state_dir, reply.site, message.round, reply.upload, record["examples"]
        )
        return replace(reply, upload={}, secure=part)

    def release(self, round_number: int) -> dict[str, Any] | None:
        return self.runner.release(round_number)

    def finish(self) -> None:
        """The run is over: the runner's last evaluation, and every secret
        the site held for secure aggregation dropped."""
        self.runner.finish()
        secure.forget(self.state_dir)

    def __getattr__(self, name: str) -> Any:
        # Everything else (privacy, final_outputs, ...) is the runner's.
        if name.startswith("_"):
            raise AttributeError(name)
        return getattr(self.runner, name)


def with_secure_aggregation(config: Any, runner: Any, state_dir: Path, min_group: int = 2) -> Any:
    """``runner`` as the run has it: wrapped when ``config`` asks for secure
    aggregation, else itself (built now, when given as a function)."""
    if config.secure_aggregation:
        return SecureAggregationSite(runner, state_dir, min_group)
    return runner() if callable(runner) else runner
