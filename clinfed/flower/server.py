"""The ServerApp: Flower's Grid as a transport for the round engine."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from flwr.app import Context
from flwr.app import Message as FlowerMessage
from flwr.serverapp import Grid, ServerApp

from clinfed.core.errors import ClinfedError
from clinfed.core.quiet import quiet_libraries
from clinfed.core.scratch import private_scratch
from clinfed.federated.engine import Deployment
from clinfed.federated.messages import Message, ReleasedAsReplies, Reply
from clinfed.flower.records import message_records, read_reply
from clinfed.settings import RunConfig

# How often the ServerApp asks the SuperLink for replies: a round ends when
# the last reply is read, so a poll of P seconds adds P/2 to every round on
# average (0.5 s cost SAFL's tiny round 0.25 of its 3 s over in-process); a
# pull is one small request.
POLL_SECONDS = 0.1
# Flower's message types for the engine's kinds (secure aggregation's
# stages are queries: no model comes down with them).
MESSAGE_TYPES = {"train": "train", "evaluate": "evaluate", "secure": "query"}


class GridTransport(ReleasedAsReplies):
    """Sends engine messages as Flower messages and collects the replies.

    Addresses are SuperNode ids (as text); ``run`` (the run's name and
    settings) travels with every message, so a node needs nothing else.
    """

    def __init__(self, grid: Grid, run: Mapping[str, Any]):
        self.grid, self.run = grid, dict(run)

    def addresses(self) -> list[str]:
        return sorted(str(n) for n in self.grid.get_node_ids())

    def exchange(
        self, messages: Mapping[str, Message], timeout: float
    ) -> Iterator[tuple[str, Reply | str]]:
        outgoing = [
            FlowerMessage(
                message_records(message, self.run),
                dst_node_id=int(address),
                message_type=MESSAGE_TYPES[message.kind],
                group_id=str(message.round),
                ttl=timeout,
            )
            for address, message in messages.items()
        ]
        ids = list(self.grid.push_messages(outgoing))
        address_of = {mid: str(m.metadata.dst_node_id) for mid, m in zip(ids, outgoing)}
        results: dict[str, Reply | str] = {}
        pending = set(ids)
        deadline = time.monotonic() + timeout
        while pending and time.monotonic() < deadline:
            for reply in self.grid.pull_messages(list(pending)):
                mid = reply.metadata.reply_to_message_id
                if mid not in pending:
                    continue
                pending.discard(mid)
                address = address_of[mid]
                if reply.has_error():
                    results[address] = f"error {reply.error.code}: {reply.error.reason}"
                    continue
                try:
                    results[address] = read_reply(reply.content)
                except (KeyError, ValueError, TypeError) as exc:
                    results[address] = f"malformed reply ({exc})"
            if pending:
                time.sleep(POLL_SECONDS)
        for mid in pending:
            results[address_of[mid]] = f"no reply within {timeout:.0f} s"

        # Replies are folded in site order, as in-process, whatever order
        # they arrived in.
        def order(item: tuple[str, Reply | str]) -> tuple[int, str]:
            reply = item[1]
            return (0, reply.site) if isinstance(reply, Reply) else (1, item[0])

        yield from sorted(results.items(), key=order)


def node_run(settings: Mapping[str, Any], out: str) -> dict[str, Any]:
    """What every node is told of a run: its name (the node's state folder
    for it) and its settings, less where the server keeps its run folder."""
    return {
        "name": Path(out).name,
        "config": {k: v for k, v in settings.items() if k != "run"},
    }


quiet_libraries()
app = ServerApp()


@app.main()
def main(grid: Grid, context: Context) -> None:
    from clinfed.runners.federation import run_federation

    values = context.run_config
    if not values.get("clinfed-config"):
        raise ClinfedError("run config clinfed-config is empty: submit with `clinfed flower run`")
    settings = json.loads(str(values["clinfed-config"]))
    config = RunConfig.from_values(settings, "run config")
    deployment = Deployment(
        min_sites=int(values["min-sites"]),
        round_timeout=float(values["round-timeout"]),
        round_retries=int(values["round-retries"]),
        wait_for_sites=float(values["wait-for-sites"]),
    )
    run = node_run(settings, config.out)
    with private_scratch():
        summary = run_federation(
            config,
            deployment,
            GridTransport(grid, run),
            log=lambda status: print(status, flush=True),
        )
    print(f"run folder {config.out}: f1 {summary.get('f1', 0.0):.4f}", flush=True)


__all__ = ["app", "GridTransport"]
