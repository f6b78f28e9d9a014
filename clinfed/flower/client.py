"""The ClientApp: a Flower message in, the site runner's work, a reply out.

Errors a site operator can fix (a bad node config, bad data, a setting its
policy refuses) are raised as :class:`~clinfed.errors.ClinfedError`; Flower
turns them into an error reply, which the server logs as that site's
failure. Messages name files and lines, never note text.
"""

from __future__ import annotations

from dataclasses import replace

from flwr.app import Context, Message
from flwr.clientapp import ClientApp

from clinfed.flower.node import NodeConfig, NodeSite
from clinfed.flower.records import read_message, reply_records
from clinfed.quiet import quiet_libraries
from clinfed.settings import RunConfig

quiet_libraries()
app = ClientApp()


def _handle(msg: Message, context: Context) -> Message:
    message, run = read_message(msg.content)
    config = RunConfig.from_values(run["config"], "the server's run config")
    node = NodeConfig.parse(dict(context.node_config))
    site = NodeSite(config, node, run["name"])
    try:
        reply = site.runner.handle(message)
    finally:
        site.close()
    if not site.share_ledger:
        reply = replace(reply, ledger=None)
    return Message(reply_records(reply), reply_to=msg)


@app.train()
def train(msg: Message, context: Context) -> Message:
    return _handle(msg, context)


@app.evaluate()
def evaluate(msg: Message, context: Context) -> Message:
    return _handle(msg, context)
