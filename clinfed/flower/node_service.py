"""``clinfed flower supernode``: a SuperNode and the node's executor, run
and ended together.

By default the SuperNode starts with ``--isolation process`` and a fresh
SuperExec secret (a 0600 file in ``STATE/.executor/``), and one executor
(:mod:`clinfed.flower.executor`) answers every message of every run; one
that dies is started again, and the node's state decides what it may
train (a message it was handling fails and the server retries it on the
same charge). With ``executor=False`` (``--no-worker``) Flower's own
executor starts a ClientApp process per message instead.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import signal
import subprocess
import sys
import time
from pathlib import Path

from clinfed.flower.executor import FOLDER

# How often the node command looks at its two processes.
WATCH_SECONDS = 0.5


def executor_folder(state: Path) -> Path:
    folder = Path(state) / FOLDER
    folder.mkdir(parents=True, exist_ok=True)
    os.chmod(folder, 0o700)
    return folder


def new_secret(state: Path) -> Path:
    """A fresh SuperExec secret, readable by the node's user only."""
    path = executor_folder(state) / "secret"
    with contextlib.suppress(FileNotFoundError):
        path.unlink()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as fh:
        fh.write(secrets.token_bytes(32))
    return path


def executor_command(port: int, secret: Path, state: Path) -> list[str]:
    return [
        sys.executable, "-m", "clinfed.flower.executor",
        "--runtime-api-address", f"127.0.0.1:{port}",
        "--secret-file", str(secret), "--state", str(state), "--parent", str(os.getpid()),
    ]  # fmt: skip


def run_node(
    supernode: list[str], env: dict[str, str], state: Path, port: int, executor: bool, say=print
) -> int:
    """Run the SuperNode (and, with ``executor``, the node's executor) until
    the SuperNode ends or this process is stopped; its exit status."""
    state = Path(state)
    if not executor:
        return _foreground(supernode, env)
    from clinfed.flower.executor import check_flower

    check_flower()
    secret = new_secret(state)
    command = supernode + ["--isolation", "process", "--superexec-auth-secret-file", str(secret)]
    say(f"running: {' '.join(command)}")
    log = executor_folder(state) / "executor.log"
    node = subprocess.Popen(command, env=env)
    worker = None
    stop = _stopper()
    try:
        while node.poll() is None and not stop:
            if worker is None or worker.poll() is not None:
                if worker is not None:
                    say(f"the node's executor ended (status {worker.returncode}): starting another")
                worker = _start_executor(port, secret, state, env, log)
            time.sleep(WATCH_SECONDS)
    except KeyboardInterrupt:
        stop.append(130)
    finally:
        for process in (worker, node):
            _end(process)
    return stop[0] if stop else node.returncode


def _start_executor(
    port: int, secret: Path, state: Path, env: dict[str, str], log: Path
) -> subprocess.Popen:
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    try:
        return subprocess.Popen(
            executor_command(port, secret, state),
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=fd,
            stderr=fd,
        )
    finally:
        os.close(fd)


def _stopper() -> list[int]:
    """A list that gets 143 on SIGTERM: the watch loop ends, both processes
    are stopped."""
    stop: list[int] = []
    signal.signal(signal.SIGTERM, lambda *_: stop.append(143))
    return stop


def _end(process: subprocess.Popen | None) -> None:
    if process is None or process.poll() is not None:
        return
    process.terminate()
    try:
        process.wait(timeout=20)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


def _foreground(command: list[str], env: dict[str, str]) -> int:
    try:
        return subprocess.run(command, env=env).returncode
    except KeyboardInterrupt:
        return 130
