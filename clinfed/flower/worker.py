"""A node's worker: one long-lived process that handles the node's messages.

Flower starts a fresh ClientApp process for every message, and a process
that imports torch, transformers and datasets, reads the site's encoded
data and builds the model pays seconds before it does any work. So the
ClientApp imports Flower and this module only, and hands each message's
records to the node's worker, which keeps all of that between messages
(one site, for the node's latest run: :class:`~clinfed.flower.handler.SiteCache`).

Where it lives: ``STATE/.worker/`` (folder 0700) holds ``address.json``
(0600: the worker's port on 127.0.0.1, a random token and its process id),
``worker.log`` (0600: one line per message, never note text) and a lock
file. The worker holds the site's encoded notes in memory only.

Who may use it: a client must present the token, which only the node's
user can read; the worker listens on the loopback interface only and
serves only its own state folder.

When it starts and ends: the first message that finds no worker starts
one (and waits for it); it ends when the process that started that first
ClientApp (the SuperNode) is gone, after :data:`IDLE_SECONDS` without a
message, or on SIGTERM. A worker that dies is replaced by the next
message; a message it was handling fails and is the server's to retry.
The ClientApp handles a message itself when no worker can be started, or
when the node's configuration says ``worker=false``.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import hmac
import json
import logging
import os
import secrets
import socket
import struct
import subprocess
import sys
import time
import traceback
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from flwr.app import Array, ArrayRecord, ConfigRecord, RecordDict

from clinfed.errors import USER_ERRORS, ClinfedError, worded
from clinfed.scratch import process_alive

FOLDER = ".worker"
IDLE_SECONDS = 3600.0
START_SECONDS = 300.0
log = logging.getLogger("clinfed.node")


class Unavailable(Exception):
    """No worker could be reached or started: handle the message here."""


class Failed(Exception):
    """The worker took the message but did not answer it."""


# ------------------------------------------------------------------ wire
def _send(conn: socket.socket, data: bytes) -> None:
    conn.sendall(struct.pack(">Q", len(data)) + data)


def _receive(conn: socket.socket) -> bytes:
    (size,) = struct.unpack(">Q", _exactly(conn, 8))
    return _exactly(conn, size)


def _exactly(conn: socket.socket, size: int) -> bytes:
    chunks, left = [], size
    while left:
        chunk = conn.recv(min(left, 1 << 22))
        if not chunk:
            raise ConnectionError("connection closed")
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def _to_wire(content: RecordDict) -> tuple[dict[str, Any], bytes]:
    """Records as a JSON header and the arrays' bytes laid end to end.

    clinfed's records are array records and config records of JSON values;
    this moves them without a protobuf round trip, which for a 90 MB model
    costs over a second each way.
    """
    arrays: dict[str, list] = {}
    chunks: list[bytes] = []
    for record_name, record in content.array_records.items():
        arrays[record_name] = []
        for name, array in record.items():
            meta = [name, array.dtype, list(array.shape), array.stype, len(array.data)]
            arrays[record_name].append(meta)
            chunks.append(array.data)
    configs = {name: dict(record) for name, record in content.config_records.items()}
    return {"arrays": arrays, "configs": configs}, b"".join(chunks)


def _from_wire(header: Mapping[str, Any], data: bytes) -> RecordDict:
    records: dict[str, Any] = {}
    view, offset = memoryview(data), 0
    for record_name, entries in header["arrays"].items():
        record = ArrayRecord()
        for name, dtype, shape, stype, size in entries:
            chunk = bytes(view[offset : offset + size])
            offset += size
            record[name] = Array(dtype=dtype, shape=tuple(shape), stype=stype, data=chunk)
        records[record_name] = record
    if offset != len(data):
        raise ValueError("array bytes do not match the header")
    for record_name, values in header["configs"].items():
        records[record_name] = ConfigRecord(values)
    return RecordDict(records)


def _private_folder(state: Path) -> Path:
    folder = state / FOLDER
    folder.mkdir(parents=True, exist_ok=True)
    os.chmod(folder, 0o700)
    return folder


def _address(folder: Path) -> dict[str, Any] | None:
    try:
        return json.loads((folder / "address.json").read_text())
    except (OSError, ValueError):
        return None


def _connect(address: dict[str, Any] | None) -> socket.socket | None:
    if not address:
        return None
    try:
        # A SIGKILLed worker leaves its address behind; its port may since
        # be anyone's.
        if not process_alive(int(address["pid"])):
            return None
        return socket.create_connection(("127.0.0.1", int(address["port"])), timeout=10)
    except (OSError, KeyError, ValueError, TypeError):
        return None


# ---------------------------------------------------------------- client
def ask(
    node_values: Mapping[str, Any], content: RecordDict, parent: int | None = None
) -> RecordDict:
    """The reply records to ``content``, from this node's worker.

    ``parent``: the process whose end ends a worker started here (default:
    this process's parent, the SuperNode for a ClientApp).

    Raises
    ------
    Unavailable
        No worker could be reached or started (nothing was handled).
    ClinfedError
        The site refused the message (its policy or its data).
    Failed
        The worker took the message and died or failed on it.
    """
    if not node_values.get("state"):
        raise Unavailable("no state folder in the node config")
    state = Path(str(node_values["state"]))
    try:
        folder = _private_folder(state)
    except OSError as exc:
        raise Unavailable(f"state folder: {exc.strerror}") from None
    parent = os.getppid() if parent is None else parent
    address = _address(folder)
    conn = _connect(address)
    started = conn is None
    if started:
        conn, address = _start(folder, state, parent)
    records, body = _to_wire(content)

    def send(conn: socket.socket, address: dict[str, Any]) -> None:
        request = {"token": address["token"], "node": dict(node_values), "records": records}
        _send(conn, json.dumps(request, default=str).encode())
        _send(conn, body)

    try:
        send(conn, address)
    except OSError as exc:
        conn.close()
        if started:
            raise Unavailable(f"worker did not take the message: {exc}") from None
        # The worker we reached was dying (killed, or ending as idle): it took
        # nothing, so the message goes to a fresh one.
        conn, address = _start(folder, state, parent)
        try:
            send(conn, address)
        except OSError as exc:
            conn.close()
            raise Unavailable(f"worker did not take the message: {exc}") from None
    with conn:
        try:
            conn.settimeout(None)  # training takes as long as it takes
            header = json.loads(_receive(conn))
            payload = _receive(conn)
        except (OSError, ValueError) as exc:
            raise Failed(f"the node's worker failed during the message ({exc})") from None
    if header.get("refused"):
        raise ClinfedError(header["refused"])
    if header.get("failed"):
        raise Failed(header["failed"])
    return _from_wire(header["records"], payload)


def _start(folder: Path, state: Path, parent: int) -> tuple[socket.socket, dict[str, Any]]:
    """Start the node's worker (one at a time: under the folder's lock) and
    connect to it."""
    with open(folder / "lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        address = _address(folder)
        conn = _connect(address)  # another message may have started it
        if conn is not None:
            return conn, address
        logfile = os.open(folder / "worker.log", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        try:
            # Not in a session of its own: whoever stops the SuperNode's
            # process group stops the worker with it.
            process = subprocess.Popen(
                [sys.executable, "-m", "clinfed.flower.worker", "--state", str(state)]
                + ["--parent", str(parent)],
                stdin=subprocess.DEVNULL,
                stdout=logfile,
                stderr=logfile,
                close_fds=True,
            )
        except OSError as exc:
            raise Unavailable(f"could not start the worker: {exc.strerror}") from None
        finally:
            os.close(logfile)
        deadline = time.monotonic() + START_SECONDS
        while time.monotonic() < deadline:
            if process.poll() is not None:
                raise Unavailable(f"the worker exited at start (status {process.returncode})")
            address = _address(folder)
            if address and address.get("pid") == process.pid:
                conn = _connect(address)
                if conn is not None:
                    return conn, address
            time.sleep(0.1)
        process.kill()
        raise Unavailable(f"the worker did not start within {START_SECONDS:.0f} s")


# ---------------------------------------------------------------- server
def serve(state: Path, parent: int, idle: float = IDLE_SECONDS) -> None:
    """Answer this node's messages until ``parent`` is gone or ``idle``
    seconds pass without one."""
    from clinfed.flower.handler import SiteCache, answer
    from clinfed.quiet import quiet_libraries
    from clinfed.runs import atomic_write_json
    from clinfed.scratch import private_scratch

    quiet_libraries()
    folder = _private_folder(state)
    token = secrets.token_hex(32)
    server = socket.create_server(("127.0.0.1", 0))
    server.settimeout(1.0)
    address = {"port": server.getsockname()[1], "token": token, "pid": os.getpid()}
    atomic_write_json(folder / "address.json", address)
    os.chmod(folder / "address.json", 0o600)
    cache = SiteCache()
    last = time.monotonic()
    handled = 0
    _say(f"serving {state}")
    try:
        with private_scratch():
            while process_alive(parent) and time.monotonic() - last < idle:
                try:
                    conn, _ = server.accept()
                except TimeoutError:
                    continue
                with conn:
                    handled += _serve_one(conn, token, state, cache, answer, handled)
                last = time.monotonic()
    finally:
        cache.drop()
        server.close()
        if _address(folder) == address:
            with contextlib.suppress(OSError):
                (folder / "address.json").unlink()
    _say(f"stopped after {handled} messages")


def _say(event: str) -> None:
    """One line of the worker's log: time, process id, what happened (fixed
    wording and numbers; never anything from a message)."""
    stamp = time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime())
    print(f"{stamp} worker {os.getpid()}: {event}", file=sys.stderr, flush=True)


def _serve_one(conn, token: str, state: Path, cache, answer, handled: int) -> int:
    conn.settimeout(60)  # a client sends its message at once
    try:
        request = json.loads(_receive(conn))
        body = _receive(conn)
    except (OSError, ValueError):
        return 0
    if not isinstance(request, dict) or not hmac.compare_digest(
        str(request.get("token", "")), token
    ):
        return 0  # not our client: say nothing
    node_values = request.get("node") or {}
    header: dict[str, Any] = {}
    payload = b""
    started = time.perf_counter()
    if Path(str(node_values.get("state", ""))).resolve() != state.resolve():
        header["refused"] = "the node's worker serves another state folder"
    else:
        try:
            reply = answer(_from_wire(request["records"], body), node_values, cache)
            header["records"], payload = _to_wire(reply)
        except USER_ERRORS as exc:
            header["refused"] = worded(exc)
        except Exception as exc:  # noqa: BLE001 - reported to the client, not hidden
            # Where, not what: an unexpected error's message could quote
            # data, so neither the server nor the log gets it.
            frame = traceback.extract_tb(exc.__traceback__)[-1]
            where = f"{Path(frame.filename).name}:{frame.lineno}"
            header["failed"] = f"{type(exc).__name__} at {where} in the node's worker"
    seconds = time.perf_counter() - started
    outcome = "refused" if "refused" in header else "answered"
    if "failed" in header:
        outcome = f"failed ({header['failed']})"
    _say(f"message {handled + 1} {outcome} in {seconds:.1f} s")
    conn.settimeout(None)
    with contextlib.suppress(OSError):
        _send(conn, json.dumps(header).encode())
        _send(conn, payload)
    return 1


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="A clinfed node's worker.")
    parser.add_argument("--state", type=Path, required=True)
    parser.add_argument("--parent", type=int, required=True)
    parser.add_argument("--idle", type=float, default=IDLE_SECONDS)
    args = parser.parse_args(argv)
    serve(args.state, args.parent, args.idle)


if __name__ == "__main__":
    main()
