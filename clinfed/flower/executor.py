"""A node's executor: one long-lived process that answers every message of
every run at its SuperNode.

Flower's own executor (the SuperNode's SuperExec under ``--isolation
subprocess``) starts a fresh ``flwr-clientapp`` process for every message,
and each pays seconds of imports, reads the site's encoded data again and
builds the model again before any work. Under ``--isolation process`` the
executor is whoever the operator starts, and ``clinfed flower supernode``
starts this one beside the SuperNode: it asks the node's runtime API for
a ClientApp task, pulls the task's message with the task's token, answers
it here (torch, the site's encoded data and its model stay loaded:
:class:`~clinfed.flower.handler.SiteCache`), pushes the reply and the
task's output, and asks again. The reply is built from the message
itself: no model is handed to another process.

Who may use it: the runtime API's task queue answers only a caller holding
the node's SuperExec secret (Flower's HMAC authentication; the secret is a
0600 file in the node's state folder, made afresh at each start). The
executor runs clinfed's own ClientApp code only, never code from the run's
app bundle, and refuses a run of another app.

Where it writes: ``STATE/.executor/executor.log`` (0600): one line per
message with the executor's process id, what happened and how long it took,
never anything from a message. It ends with the node command that started
it (``--parent``), or on SIGTERM; the node command starts a new one if it
dies (:func:`clinfed.flower.node_service.run_node`), and a message it was
handling fails and is the server's to retry, on the same charge.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import time
import traceback
from pathlib import Path
from typing import Any

FOLDER = ".executor"
# The Flower releases this executor speaks the runtime API of: it uses the
# calls Flower's own flwr-clientapp makes, which are not a public API.
TESTED_FLOWER = ("1.41.0",)
CLIENT_APP_TASK = "flwr-clientapp"
# The app bundle `clinfed flower run` submits (clinfed/flower/app/pyproject.toml).
APP_ID = "clinfed/clinfed-app"
# How long an idle executor waits before asking for a task again: Flower's
# SuperExec asks once a second; a tenth costs a few loopback calls a second.
POLL_SECONDS = 0.1
ACQUIRE = "/flwr.proto.Runtime/AcquireTask"
log = logging.getLogger("clinfed.node")


def check_flower() -> None:
    """Refuse a Flower release this executor was not tested on."""
    import flwr

    from clinfed.core.errors import ClinfedError

    if flwr.__version__ not in TESTED_FLOWER:
        raise ClinfedError(
            f"the node's executor is tested on Flower {', '.join(TESTED_FLOWER)}, and this "
            f"is Flower {flwr.__version__}: install flwr=={TESTED_FLOWER[-1]}, or start the "
            "node with `no_worker` (a process per message, Flower's own executor)"
        )


def _client(address: str, interceptors: list) -> Any:
    from flwr.supercore.retry import make_simple_http_retry_invoker
    from flwr.supercore.runtime import RuntimeHttpClient

    return RuntimeHttpClient.from_server_address(
        server_address=address,
        insecure=True,  # the node's own runtime API, on the loopback interface
        root_certificates=None,
        interceptors=interceptors,
        retry_invoker=make_simple_http_retry_invoker(),
    )


def serve(address: str, secret: bytes, state: Path, parent: int) -> None:
    """Answer the node's ClientApp tasks until ``parent`` is gone."""
    from flwr.proto.runtime_pb2 import AcquireTaskRequest
    from flwr.supercore.interceptors import (
        RuntimeVersionHttpInterceptor,
        SuperExecAuthHttpInterceptor,
    )

    from clinfed.core.quiet import quiet_libraries
    from clinfed.core.scratch import private_scratch, process_alive
    from clinfed.flower.handler import SiteCache

    quiet_libraries()
    queue = _client(
        address,
        [
            RuntimeVersionHttpInterceptor(component_name="SuperExec"),
            SuperExecAuthHttpInterceptor(master_secret=secret, protected_methods={ACQUIRE}),
        ],
    )
    cache = SiteCache()
    handled = 0
    _say(f"serving {state}")
    try:
        with private_scratch():
            while process_alive(parent):
                task = queue.AcquireTask(AcquireTaskRequest(supported_task_types=[CLIENT_APP_TASK]))
                if task.HasField("task") and task.token:
                    handled += 1
                    _run_task(address, task.token, cache, handled)
                else:
                    time.sleep(POLL_SECONDS)
    finally:
        cache.drop()
        queue.close()
    _say(f"stopped after {handled} messages")


def _run_task(address: str, token: str, cache: Any, number: int) -> None:
    """One task: its message pulled, answered here, the reply and the
    task's outcome pushed."""
    from flwr.common.constant import SubStatus
    from flwr.supercore.heartbeat import HeartbeatSender, make_task_heartbeat_fn_http
    from flwr.supercore.interceptors import (
        RuntimeTokenHttpInterceptor,
        RuntimeVersionHttpInterceptor,
    )
    from flwr.supernode.runtime.run_clientapp import (
        pull_task_input,
        push_message,
        push_task_output,
    )

    client = _client(
        address,
        [
            RuntimeVersionHttpInterceptor(component_name="flwr-clientapp"),
            RuntimeTokenHttpInterceptor(token),
        ],
    )
    heartbeat = HeartbeatSender(make_task_heartbeat_fn_http(client))
    heartbeat.start()
    started = time.perf_counter()
    context, status, details, outcome = None, SubStatus.FAILED, "not answered", "failed"
    try:
        message, context, run, _ = pull_task_input(client)
        reply, outcome = _reply(message, context, run, cache)
        push_message(client, reply, context)
        status, details = SubStatus.COMPLETED, ""
    except Exception as exc:  # noqa: BLE001 - logged by place; the server retries
        outcome = f"failed ({_where(exc)})"
    finally:
        push_task_output(client=client, context=context, sub_status=status, details=details)
        heartbeat.stop()
        client.close()
    _say(f"message {number} {outcome} in {time.perf_counter() - started:.2f} s")


def _reply(message: Any, context: Any, run: Any, cache: Any) -> tuple[Any, str]:
    """The reply to one message and a word for the log."""
    from flwr.app import Error, Message
    from flwr.common.constant import ErrorCode

    from clinfed.core.errors import USER_ERRORS
    from clinfed.flower.client import refusal
    from clinfed.flower.handler import answer

    if run.fab_id != APP_ID:
        reason = f"this node runs clinfed's app only, not {run.fab_id!r}"
        error = Error(code=ErrorCode.LOAD_CLIENT_APP_EXCEPTION, reason=reason)
        return Message(error=error, reply_to=message), "refused (another app)"
    try:
        content = answer(message.content, dict(context.node_config), cache)
    except USER_ERRORS as exc:
        return refusal(message, exc), "refused"
    except Exception as exc:  # noqa: BLE001 - reported by place, never by its text
        # Where, not what: an unexpected error's message could quote data.
        reason = f"{type(exc).__name__} at {_where(exc)} in the node's executor"
        error = Error(code=ErrorCode.CLIENT_APP_RAISED_EXCEPTION, reason=reason)
        return Message(error=error, reply_to=message), f"failed ({reason})"
    return Message(content, reply_to=message), "answered"


def _where(exc: BaseException) -> str:
    frames = traceback.extract_tb(exc.__traceback__)
    if not frames:
        return type(exc).__name__
    return f"{Path(frames[-1].filename).name}:{frames[-1].lineno}"


def _say(event: str) -> None:
    """One line of the executor's log: time, process id, what happened
    (fixed wording and numbers; never anything from a message)."""
    stamp = time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime())
    print(f"{stamp} executor {os.getpid()}: {event}", file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="A clinfed node's executor.")
    parser.add_argument("--runtime-api-address", required=True)
    parser.add_argument("--secret-file", type=Path, required=True)
    parser.add_argument("--state", type=Path, required=True)
    parser.add_argument("--parent", type=int, required=True)
    args = parser.parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    check_flower()
    serve(args.runtime_api_address, args.secret_file.read_bytes(), args.state, args.parent)


if __name__ == "__main__":
    main()
