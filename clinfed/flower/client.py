"""The ClientApp: a Flower message in, the site runner's work, a reply out.

Errors a site operator can fix (a bad node config, bad data, a setting its
policy refuses) are :class:`~clinfed.errors.ClinfedError`: the node logs
the reason on one line and replies with it as a Flower error, which the
server logs as that site's failure. Messages name files and lines, never
note text.
"""

from __future__ import annotations

import logging
from dataclasses import replace

from flwr.app import Context, Error, Message
from flwr.clientapp import ClientApp
from flwr.common.constant import ErrorCode

from clinfed.errors import ClinfedError
from clinfed.flower.node import NodeConfig, NodeSite
from clinfed.flower.records import read_message, reply_records
from clinfed.quiet import quiet_libraries
from clinfed.scratch import private_scratch
from clinfed.settings import RunConfig

quiet_libraries()
app = ClientApp()
log = logging.getLogger("clinfed.node")


def _handle(msg: Message, context: Context) -> Message:
    try:
        # Tokenized notes live in this message's private scratch folder.
        with private_scratch():
            return _reply(msg, context)
    except ClinfedError as exc:
        # The site's own policy or data said no: the reason, on one line,
        # in the node's log and in the reply the server logs.
        log.warning("refused: %s", exc)
        return Message(
            error=Error(code=ErrorCode.CLIENT_APP_RAISED_EXCEPTION, reason=f"refused: {exc}"),
            reply_to=msg,
        )


def _reply(msg: Message, context: Context) -> Message:
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
