"""clinfed flower certs | key | superlink | supernode | register | run."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import click
import typer

from clinfed.commands.common import (
    SETTINGS_FILE,
    _print_json,
    app,
    err,
    out,
)
from clinfed.commands.options import settings_parameters, with_parameters
from clinfed.core.errors import ClinfedError

# --------------------------------------------------------------- flower
flower_app = typer.Typer(
    help="Multi-hospital deployment on Flower: a SuperLink, one SuperNode per site.",
    no_args_is_help=True,
)
app.add_typer(flower_app, name="flower")
INSECURE = typer.Option(
    False, "--insecure", help="No TLS (plain HTTP). Only for a test on one machine."
)
ROOT_CERT = typer.Option(
    None, "--root-cert", help="CA certificate (ca.crt) that signed the SuperLink's certificate."
)
SUPERLINK = typer.Option(
    "127.0.0.1:8000", "--superlink", help="The SuperLink's address, HOST:PORT."
)


def _exec(command: list[str], env: dict[str, str], log_to_stderr: bool = False) -> int:
    """Run a Flower process in the foreground; Ctrl-C stops it.
    ``log_to_stderr``: its output goes to stderr (stdout is kept for JSON)."""
    import subprocess
    import sys

    err.print(f"running: {' '.join(command)}", highlight=False, soft_wrap=True)
    try:
        stdout = sys.stderr if log_to_stderr else None
        return subprocess.run(command, env=env, stdout=stdout).returncode
    except KeyboardInterrupt:
        return 130


@flower_app.command("certs")
def flower_certs(
    out_dir: Path = typer.Option(..., "--out", help="Folder for ca.crt, server.pem and keys."),
    host: list[str] = typer.Option(
        ["127.0.0.1", "localhost"], "--host", help="Names or IPs the SuperLink is reached at."
    ),
    days: int = typer.Option(365, "--days", help="Validity in days."),
) -> None:
    """Make a private CA and a SuperLink certificate (for pilots and tests)."""
    from clinfed.flower.deploy import make_certificates

    written = make_certificates(out_dir, host, days)
    out.print(f"wrote {', '.join(sorted(written))} to {out_dir}")


@flower_app.command("key")
def flower_key(
    out_dir: Path = typer.Option(..., "--out", help="Folder for the key pair."),
    name: str = typer.Option(..., "--name", help="File name (the site's name, say)."),
) -> None:
    """Make a SuperNode authentication key pair (register the .pub with the SuperLink)."""
    from clinfed.flower.deploy import make_node_key

    private, public = make_node_key(out_dir, name)
    out.print(f"private key {private} (stays at the site); public key {public}")


@flower_app.command("superlink")
def flower_superlink(
    certs: Path = typer.Option(
        None, "--certs", help="Folder with ca.crt, server.pem, server.key (clinfed flower certs)."
    ),
    insecure: bool = INSECURE,
    host: str = typer.Option("127.0.0.1", "--host", help="Address to listen on."),
    port: int = typer.Option(8000, "--port", help="Port of the SuperLink's HTTP APIs."),
    database: Path = typer.Option(None, "--database", help="SQLite state file (default: memory)."),
    node_auth: bool = typer.Option(
        False, "--node-auth", help="Accept only registered SuperNodes (clinfed flower register)."
    ),
    home: Path = typer.Option(None, "--home", help="Flower's home folder (default ~/.flwr)."),
) -> None:
    """Start the SuperLink (the server's end; runs the ServerApp of each submitted run)."""
    from clinfed.flower.deploy import environment, superlink_command

    command = superlink_command(certs, insecure, host, port, database, node_auth)
    raise typer.Exit(_exec(command, environment(home)))


# The node's own policy: what it accepts, whatever the server's run asks.
NODE_MAX_EPSILON = typer.Option(
    None,
    "--max-epsilon",
    help="Most epsilon this site's data may spend over every run (required for DP).",
)
NODE_MAX_DELTA = typer.Option(
    None, "--max-delta", help="Largest delta this site accepts (default 1/(10 n))."
)
NODE_ALLOW_NO_DP = typer.Option(
    False,
    "--allow-no-dp",
    help="Also train in runs without DP or with reproducible noise (refused by default).",
)
NODE_PRIVACY_UNIT = typer.Option(
    "example",
    "--privacy-unit",
    help="Weakest unit accepted: example < document < patient.",
    click_type=click.Choice(["example", "document", "patient"]),
    metavar="UNIT",
)
NODE_MAX_GRAD_NORM = typer.Option(
    None, "--max-grad-norm", help="Largest clipping norm accepted (default: any)."
)
NODE_MAX_LENGTH = typer.Option(
    None, "--max-length", help="Longest window in tokens accepted (default: any)."
)
NODE_SECURE = typer.Option(
    False,
    "--require-secure-aggregation",
    help="Train only in runs whose updates are summed by secure aggregation.",
)
NODE_NO_WORKER = typer.Option(
    False,
    "--no-worker",
    help="A process per message (Flower's own executor), no long-lived executor "
    "keeping the model and data.",
)


@flower_app.command("supernode")
def flower_supernode(
    superlink: str = SUPERLINK,
    data: Path = typer.Option(..., "--data", help="This site's data folder (task format)."),
    state: Path = typer.Option(
        ..., "--state", help="This site's state folder: ledger, model copy, predictions."
    ),
    site: str = typer.Option(None, "--site", help="Site name, if the data holds several."),
    max_epsilon: float = NODE_MAX_EPSILON,
    root_cert: Path = ROOT_CERT,
    insecure: bool = INSECURE,
    key: Path = typer.Option(None, "--key", help="Private key for SuperNode authentication."),
    port: int = typer.Option(9094, "--port", help="Local port of the node's own runtime API."),
    keep_ledger: bool = typer.Option(
        False, "--keep-ledger", help="Keep ledger lines from the server's report (shared: default)."
    ),
    threads: int = typer.Option(0, "--threads", help="CPU threads (0: all cores)."),
    max_delta: float = NODE_MAX_DELTA,
    allow_no_dp: bool = NODE_ALLOW_NO_DP,
    privacy_unit: str = NODE_PRIVACY_UNIT,
    max_grad_norm: float = NODE_MAX_GRAD_NORM,
    max_length: int = NODE_MAX_LENGTH,
    no_worker: bool = NODE_NO_WORKER,
    require_secure_aggregation: bool = NODE_SECURE,
) -> None:
    """Start a SuperNode for one site and its executor (trains when the
    SuperLink asks, within this site's own policy)."""
    from clinfed.flower.deploy import environment, supernode_command
    from clinfed.flower.node_service import run_node

    command = supernode_command(
        superlink, data, state, site, max_epsilon, root_cert, insecure, key, port,
        not keep_ledger, threads, max_delta, allow_no_dp, privacy_unit, max_grad_norm,
        max_length, require_secure_aggregation,
    )  # fmt: skip
    state.mkdir(parents=True, exist_ok=True)
    env = environment(state / "flwr")

    def say(message: str) -> None:  # the node command's own words, never a note's
        err.print(message, highlight=False, soft_wrap=True)

    raise typer.Exit(run_node(command, env, state, port, executor=not no_worker, say=say))


@flower_app.command("register")
def flower_register(
    public_key: Path = typer.Argument(..., help="A SuperNode's .pub (clinfed flower key)."),
    superlink: str = SUPERLINK,
    root_cert: Path = ROOT_CERT,
    insecure: bool = INSECURE,
) -> None:
    """Register a SuperNode's public key with a SuperLink started with --node-auth."""
    import tempfile

    from clinfed.flower.deploy import environment, register_command, write_connection

    with tempfile.TemporaryDirectory(prefix="clinfed-flwr-") as home:
        write_connection(Path(home), superlink, root_cert, insecure)
        raise typer.Exit(_exec(register_command(public_key), environment(Path(home))))


def flower_run(
    config_file: Path = SETTINGS_FILE,
    superlink: str = SUPERLINK,
    root_cert: Path = ROOT_CERT,
    insecure: bool = INSECURE,
    min_sites: int = typer.Option(
        1, "--min-sites", help="Replies a round needs; fewer: retried, then the run stops."
    ),
    round_timeout: float = typer.Option(
        900.0, "--round-timeout", help="Seconds a round waits for replies."
    ),
    round_retries: int = typer.Option(
        1, "--round-retries", help="Times a round short of --min-sites is sent again."
    ),
    wait_for_sites: float = typer.Option(
        300.0, "--wait-for-sites", help="Seconds to wait for --min-sites nodes to connect."
    ),
    as_json: bool = typer.Option(
        False, "--json", help="Print the run's summary as JSON (Flower's log goes to stderr)."
    ),
    **settings: Any,
) -> None:
    """Submit a training run to a SuperLink and follow its log until it ends
    (``--resume``: continue a run whose ServerApp died, from its last commit)."""
    import tempfile

    from clinfed.commands.options import given, merge
    from clinfed.flower.deploy import (
        environment,
        flower_run_config,
        run_command,
        run_overrides,
        write_connection,
    )

    values = merge(config_file, given(settings))
    out_dir = values.pop("out", None)
    resume = bool(values.pop("resume", False))
    if not out_dir:
        raise ClinfedError("--out is required (the run folder on the SuperLink's machine)")
    config = flower_run_config(values, Path(out_dir), resume=resume)
    with tempfile.TemporaryDirectory(prefix="clinfed-flwr-") as home:
        overrides = Path(home) / "run.toml"
        overrides.write_text(
            run_overrides(config, min_sites, round_timeout, round_retries, wait_for_sites)
        )
        write_connection(Path(home), superlink, root_cert, insecure)
        code = _exec(run_command(overrides), environment(Path(home)), log_to_stderr=as_json)
    summary_path = Path(config.out) / "summary.json"
    if as_json:
        summary = json.loads(summary_path.read_text()) if summary_path.is_file() else {}
        _print_json(summary)
        raise typer.Exit(1 if code == 0 and "stopped" in summary else code)
    if code == 0 and (Path(config.out) / "metrics.jsonl").is_file():
        from clinfed.commands.train import _round_table

        _round_table(Path(config.out))
        if summary_path.is_file() and "stopped" in json.loads(summary_path.read_text()):
            err.print(f"[yellow]{json.loads(summary_path.read_text())['stopped']}[/]")
            code = 1
    raise typer.Exit(code)


with_parameters(flower_run, settings_parameters(simulator=False))
flower_app.command("run")(flower_run)
