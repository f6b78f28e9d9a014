"""The ServerApp: Flower's Grid as the coordinator's transport."""

from __future__ import annotations

import json
import time
from collections.abc import Mapping

from flwr.app import Context, Message
from flwr.serverapp import Grid, ServerApp

from clinfed.errors import ClinfedError
from clinfed.flower.coordinator import Coordinator, Deployment, Instruction, Reply
from clinfed.flower.records import from_records, to_records
from clinfed.pipeline import RunConfig
from clinfed.quiet import quiet_libraries

POLL_SECONDS = 0.5


class GridTransport:
    """Sends instructions as Flower messages and collects the replies."""

    def __init__(self, grid: Grid):
        self.grid = grid

    def nodes(self) -> list[int]:
        return sorted(self.grid.get_node_ids())

    def exchange(
        self, kind: str, round_number: int, instructions: Mapping[int, Instruction], timeout: float
    ) -> dict[int, Reply | str]:
        messages = [
            Message(
                to_records(instruction.download, instruction.settings),
                dst_node_id=node,
                message_type=kind,
                group_id=str(round_number),
                ttl=timeout,
            )
            for node, instruction in instructions.items()
        ]
        ids = list(self.grid.push_messages(messages))
        node_of = {mid: msg.metadata.dst_node_id for mid, msg in zip(ids, messages)}
        results: dict[int, Reply | str] = {}
        pending = set(ids)
        deadline = time.monotonic() + timeout
        while pending and time.monotonic() < deadline:
            for reply in self.grid.pull_messages(list(pending)):
                mid = reply.metadata.reply_to_message_id
                if mid not in pending:
                    continue
                pending.discard(mid)
                node = node_of[mid]
                if reply.has_error():
                    results[node] = f"error {reply.error.code}: {reply.error.reason}"
                    continue
                try:
                    tensors, report = from_records(reply.content)
                except (KeyError, ValueError, TypeError) as exc:
                    results[node] = f"malformed reply ({exc})"
                    continue
                results[node] = Reply(tensors, report)
            if pending:
                time.sleep(POLL_SECONDS)
        for mid in pending:
            results[node_of[mid]] = f"no reply within {timeout:.0f} s"
        return results


quiet_libraries()
app = ServerApp()


@app.main()
def main(grid: Grid, context: Context) -> None:
    values = context.run_config
    if not values.get("clinfed-config"):
        raise ClinfedError("run config clinfed-config is empty: submit with `clinfed flower run`")
    config = RunConfig(**json.loads(str(values["clinfed-config"])))
    deployment = Deployment(
        min_sites=int(values["min-sites"]),
        round_timeout=float(values["round-timeout"]),
        round_retries=int(values["round-retries"]),
        wait_for_sites=float(values["wait-for-sites"]),
    )
    coordinator = Coordinator(config, deployment, log=lambda message: print(message, flush=True))
    coordinator.start()
    summary = coordinator.run(GridTransport(grid))
    print(f"run folder {config.out}: f1 {summary.get('f1', 0.0):.4f}", flush=True)


__all__ = ["app"]
