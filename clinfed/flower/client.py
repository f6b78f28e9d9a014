"""The ClientApp: a Flower message in, the site's reply out.

Flower runs this in a fresh process for every message, so it imports
Flower and nothing heavy: the message goes to the node's worker
(:mod:`clinfed.flower.worker`), which keeps torch, the site's encoded data
and its model between messages. When no worker can be started, or the
node's configuration says ``worker=false``, the message is handled here
(:mod:`clinfed.flower.handler`): the same work, built for this message
alone.

Errors a site operator can fix (a bad node config, bad data, a setting its
policy refuses) are :class:`~clinfed.errors.ClinfedError`: the node logs
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

from clinfed.errors import USER_ERRORS
from clinfed.flower import worker
from clinfed.schema import strict_bool

app = ClientApp()
log = logging.getLogger("clinfed.node")


_PATH = re.compile(r"(?<![\w.~])(?:~|\.{1,2})?/[^\s:'\",;()]*")


def redact_paths(error: object) -> str:
    """An error's text with every file system path replaced by ``<path>``."""
    return _PATH.sub("<path>", str(error))


def _handle(msg: Message, context: Context) -> Message:
    try:
        content = answer(msg.content, dict(context.node_config))
    except USER_ERRORS as exc:
        # The site's own policy or data said no: the reason, on one line,
        # in the node's log and in the reply the server logs.
        # The server gets the reason with the site's paths left out: a
        # refusal must not map the node's file system for it.
        log.warning("refused: %s", exc)
        return Message(
            error=Error(
                code=ErrorCode.CLIENT_APP_RAISED_EXCEPTION, reason=f"refused: {redact_paths(exc)}"
            ),
            reply_to=msg,
        )
    return Message(content, reply_to=msg)


def answer(content: RecordDict, node_values: Mapping[str, Any]) -> RecordDict:
    """The reply records to one message's ``content`` at a node with
    ``node_values`` (its node config): from the node's long-lived worker,
    or handled here where the worker is off or unavailable."""
    if strict_bool(node_values.get("worker", True), "`node_config` worker"):
        try:
            return worker.ask(node_values, content)
        except worker.Unavailable as exc:
            log.warning("no worker (%s): this message is handled in the ClientApp", exc)
        except worker.Failed as exc:
            raise RuntimeError(str(exc)) from None
    from clinfed.flower.handler import answer
    from clinfed.quiet import quiet_libraries
    from clinfed.scratch import private_scratch

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
