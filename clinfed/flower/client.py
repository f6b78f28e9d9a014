"""The ClientApp: a Flower message in, the site's reply out.

A node started by ``clinfed flower supernode`` answers its messages in its
long-lived executor (:mod:`clinfed.flower.executor`), which keeps torch,
the site's encoded data and its model between messages. This ClientApp is
what Flower's own executor runs, a fresh process for every message, on a
node started with ``no_worker`` (or by ``flower-supernode`` directly): the
same work (:mod:`clinfed.flower.handler`), built for this message alone.

Errors a site operator can fix (a bad node config, bad data, a setting its
policy refuses) are :class:`~clinfed.core.errors.ClinfedError`: the node logs
the reason on one line and replies with it as a Flower error, which the
server logs as that site's failure. Messages name files and lines, never
note text.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Mapping
from typing import Any

from flwr.app import Context, Error, Message, RecordDict
from flwr.clientapp import ClientApp
from flwr.common.constant import ErrorCode

from clinfed.core.errors import USER_ERRORS

app = ClientApp()
log = logging.getLogger("clinfed.node")


_PATH = re.compile(r"(?<![\w.~])(?:~|\.{1,2})?/[^\s:'\",;()]*")


def redact_paths(error: object) -> str:
    """An error's text with every file system path replaced by ``<path>``."""
    return _PATH.sub("<path>", str(error))


def refusal(msg: Message, exc: BaseException) -> Message:
    """The reply to a message the site refused (its policy or its data
    said no): the reason on one line in the node's log, and in the reply
    the server logs with the site's paths left out (a refusal must not map
    the node's file system for it)."""
    log.warning("refused: %s", exc)
    reason = f"refused: {redact_paths(exc)}"
    return Message(
        error=Error(code=ErrorCode.CLIENT_APP_RAISED_EXCEPTION, reason=reason), reply_to=msg
    )


def _handle(msg: Message, context: Context) -> Message:
    try:
        content = answer(msg.content, dict(context.node_config))
    except USER_ERRORS as exc:
        return refusal(msg, exc)
    return Message(content, reply_to=msg)


def answer(content: RecordDict, node_values: Mapping[str, Any]) -> RecordDict:
    """The reply records to one message's ``content`` at a node with
    ``node_values`` (its node config), built for this message alone."""
    from clinfed.core.quiet import quiet_libraries
    from clinfed.core.scratch import private_scratch
    from clinfed.flower.handler import answer

    quiet_libraries()
    # Tokenized notes live in this message's private scratch folder.
    with private_scratch():
        return answer(content, node_values)


@app.train()
def train(msg: Message, context: Context) -> Message:
    return _handle(msg, context)


@app.evaluate()
def evaluate(msg: Message, context: Context) -> Message:
    return _handle(msg, context)


@app.query()
def query(msg: Message, context: Context) -> Message:
    """Secure aggregation's stages (:mod:`clinfed.federated.secure`)."""
    return _handle(msg, context)
