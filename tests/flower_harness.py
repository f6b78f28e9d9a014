"""Start a SuperLink and SuperNodes on 127.0.0.1 for tests, clean up by PID.

Every process is started in its own session, so killing its process group
takes its children (a node's SuperNode and executor, a SuperLink's
SuperExec and ServerApps) with it.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

from clinfed.flower import deploy
from clinfed.runners.pipeline import RunConfig


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class LocalFederation:
    """A SuperLink and SuperNodes on this machine, with TLS unless ``certs`` is None."""

    def __init__(self, root: Path, certs: Path | None = None):
        self.root, self.certs = root, certs
        self.port = free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.home = root / "flwr-home"
        self.nodes: dict[str, subprocess.Popen] = {}
        self.processes: list[subprocess.Popen] = []
        self.superlink: subprocess.Popen | None = None
        self.lines: list[str] = []

    def _start(self, command: list[str], log: Path, env: dict[str, str]) -> subprocess.Popen:
        process = subprocess.Popen(
            command,
            env=env,
            stdout=log.open("ab"),
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        self.processes.append(process)
        return process

    def start_superlink(self, node_auth: bool = False, database: Path | None = None) -> None:
        """Start the SuperLink (again, on the same port, after :meth:`kill_superlink`)."""
        command = deploy.superlink_command(
            certs=self.certs,
            insecure=self.certs is None,
            port=self.port,
            node_auth=node_auth,
            database=database,
        )
        self.superlink = self._start(
            command, self.root / "superlink.log", deploy.environment(self.home)
        )
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            with socket.socket() as sock:
                if sock.connect_ex(("127.0.0.1", self.port)) == 0:
                    return
            time.sleep(0.3)
        raise RuntimeError("SuperLink did not start; see superlink.log")

    def start_node(
        self,
        site: str,
        data: Path,
        threads: int = 1,
        key: Path | None = None,
        allow_no_dp: bool = False,
        max_epsilon: float | None = None,
        no_worker: bool = False,
    ) -> None:
        """``clinfed flower supernode`` for ``site``: its SuperNode and its
        executor, as an operator starts them."""
        state = self.root / "state" / site
        command = [str(Path(sys.executable).parent / "clinfed"), "flower", "supernode"]
        command += ["--superlink", self.address, "--data", str(data), "--state", str(state)]
        command += ["--site", site, "--port", str(free_port()), "--threads", str(threads)]
        if self.certs is None:
            command.append("--insecure")
        else:
            command += ["--root-cert", str(self.certs / "ca.crt")]
        if key is not None:
            command += ["--key", str(key)]
        if allow_no_dp:
            command.append("--allow-no-dp")
        if max_epsilon is not None:
            command += ["--max-epsilon", str(max_epsilon)]
        if no_worker:
            command.append("--no-worker")
        env = deploy.environment(self.root / "node-homes" / site)
        self.nodes[site] = self._start(command, self.root / f"node-{site}.log", env)

    def executor_log(self, site: str) -> str:
        """What the site's executor logged (one line per message)."""
        path = self.root / "state" / site / ".executor" / "executor.log"
        return path.read_text() if path.exists() else ""

    def _cli_home(self) -> Path:
        deploy.write_connection(
            self.home / "cli",
            self.address,
            None if self.certs is None else self.certs / "ca.crt",
            self.certs is None,
        )
        return self.home / "cli"

    def flwr(self, command: list[str]) -> subprocess.CompletedProcess:
        """A ``flwr`` CLI command against this SuperLink."""
        env = deploy.environment(self._cli_home())
        return subprocess.run(command, env=env, capture_output=True, text=True, timeout=120)

    def kill_superlink(self) -> None:
        """SIGKILL the SuperLink and what it started (its ServerApp processes)."""
        assert self.superlink is not None
        os.killpg(self.superlink.pid, signal.SIGKILL)
        self.superlink.wait(timeout=30)
        self.superlink = None

    def kill_node(self, site: str) -> None:
        """SIGKILL a node and everything it started (a machine going down)."""
        process = self.nodes.pop(site)
        os.killpg(process.pid, signal.SIGKILL)
        process.wait(timeout=30)

    def submit(
        self,
        config: RunConfig,
        min_sites: int,
        round_timeout: float,
        wait: bool = True,
        on_line=None,
        retries: int = 0,
    ) -> subprocess.Popen:
        """``flwr run`` of a clinfed run; its output lines go to ``self.lines``."""
        self._cli_home()
        overrides = self.root / "run.toml"
        overrides.write_text(deploy.run_overrides(config, min_sites, round_timeout, retries, 120))
        process = subprocess.Popen(
            deploy.run_command(overrides),
            env=deploy.environment(self.home / "cli"),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
        self.processes.append(process)

        def follow() -> None:
            for line in process.stdout:
                self.lines.append(line.rstrip())
                if on_line is not None:
                    on_line(line)

        reader = threading.Thread(target=follow, daemon=True)
        reader.start()
        if wait:
            process.wait(timeout=900)
            reader.join(timeout=10)
        return process

    def close(self) -> None:
        for process in self.processes:
            if process.poll() is None:
                try:
                    os.killpg(process.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                process.wait(timeout=30)
