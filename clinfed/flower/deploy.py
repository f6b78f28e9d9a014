"""Command lines, certificates and keys for a Flower deployment.

``clinfed flower`` runs Flower's own binaries (``flower-superlink``,
``flower-supernode``, ``flwr``) with clinfed's settings; this module builds
their argument lists and environment, so the CLI stays thin and tests start
the same processes a hospital would.

Offline by construction: the update check is off (``FLWR_DISABLE_UPDATE_CHECK``),
the SuperLink never installs an app's dependencies at run time, and the
Flower App is the installed clinfed (``app/pyproject.toml`` names its
components), so every node must run the same clinfed version.

TLS is the default: a SuperLink needs ``--certs DIR`` (``ca.crt``,
``server.pem``, ``server.key`` as ``clinfed flower certs`` writes them), a
SuperNode and ``flwr run`` the CA certificate. ``--insecure`` turns TLS off
and must be asked for.
"""

from __future__ import annotations

import datetime
import ipaddress
import os
import sys
from pathlib import Path
from typing import Any

from clinfed.core.errors import ClinfedError
from clinfed.runners.pipeline import RunConfig

APP_DIR = Path(__file__).parent / "app"
CONNECTION = "clinfed"
DEFAULT_PORT = 8000  # SuperLink: Fleet, Control and Runtime APIs on one HTTP port
SUPEREXEC_POLL_SECONDS = 0.1


def _bin(name: str) -> str:
    """A Flower executable beside this Python's (the same environment)."""
    candidate = Path(sys.executable).parent / name
    return str(candidate) if candidate.exists() else name


def environment(flwr_home: Path | None = None) -> dict[str, str]:
    """The environment for every Flower process: no update check; own home."""
    env = dict(os.environ)
    env["FLWR_DISABLE_UPDATE_CHECK"] = "1"
    # SuperLink and SuperNode start helpers (flower-superexec, flwr-serverapp,
    # flwr-clientapp) by name: this environment's must come first.
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    # A SuperExec (the SuperNode's, which starts a ClientApp per message, and
    # the SuperLink's) asks for new work once a second by default: on
    # average half a second of every message's wall time spent waiting.
    # A tenth of a second costs a few loopback requests a second.
    env.setdefault("FLWR_SUPEREXEC_TASK_POLL_INTERVAL", str(SUPEREXEC_POLL_SECONDS))
    if flwr_home is not None:
        env["FLWR_HOME"] = str(flwr_home)
    return env


def _tls(certs: Path | None, insecure: bool, what: str) -> None:
    if certs is None and not insecure:
        raise ClinfedError(f"{what} needs TLS files (`certs` / `root_cert`) or `insecure`")
    if certs is not None and insecure:
        raise ClinfedError(f"{what}: `insecure` and TLS files exclude each other")


def superlink_command(
    certs: Path | None = None,
    insecure: bool = False,
    host: str = "127.0.0.1",
    port: int = DEFAULT_PORT,
    database: Path | None = None,
    node_auth: bool = False,
) -> list[str]:
    """``flower-superlink`` for a clinfed federation.

    Parameters
    ----------
    certs
        Folder with ``ca.crt``, ``server.pem`` and ``server.key``.
    host, port
        Where the SuperLink's HTTP APIs listen.
    database
        SQLite file for the SuperLink's state (``None``: in memory).
    node_auth
        Accept only SuperNodes whose public keys were registered
        (``clinfed flower register``).
    """
    _tls(certs, insecure, "flower superlink")
    command = [_bin("flower-superlink"), "--disable-runtime-dependency-installation"]
    command += ["--host", host, "--port", str(port)]
    if insecure:
        command.append("--insecure")
    else:
        for flag, name in (("--ssl-certfile", "server.pem"), ("--ssl-keyfile", "server.key")):
            command += [flag, str(_existing(certs / name))]
        command += ["--ssl-ca-certfile", str(_existing(certs / "ca.crt"))]
    if database is not None:
        command += ["--database", str(database)]
    if node_auth:
        command.append("--enable-supernode-auth")
    return command


def supernode_command(
    superlink: str,
    data: Path,
    state: Path,
    site: str | None = None,
    max_epsilon: float | None = None,
    root_cert: Path | None = None,
    insecure: bool = False,
    key: Path | None = None,
    port: int = 9094,
    share_ledger: bool = True,
    threads: int = 0,
    max_delta: float | None = None,
    allow_no_dp: bool = False,
    privacy_unit: str = "example",
    max_grad_norm: float | None = None,
    max_length: int | None = None,
    require_secure_aggregation: bool = False,
) -> list[str]:
    """``flower-supernode`` for one site; its node config names the site's
    data and state folders and its policy (see ``clinfed.runners.node``)."""
    _tls(root_cert, insecure, "flower supernode")
    if not Path(data).is_dir():
        raise ClinfedError(f"`data` {data}: not a folder")
    values = {"data": str(Path(data).resolve()), "state": str(Path(state).resolve())}
    if site:
        values["site"] = site
    node_config = " ".join(f"{k}={_toml(v)}" for k, v in values.items())
    if max_epsilon is not None:
        node_config += f" max-epsilon={float(max_epsilon)!r}"
    if max_delta is not None:
        node_config += f" max-delta={float(max_delta)!r}"
    if allow_no_dp:
        node_config += " allow-no-dp=true"
    if privacy_unit != "example":
        node_config += f" privacy-unit={_toml(privacy_unit)}"
    if max_grad_norm is not None:
        node_config += f" max-grad-norm={float(max_grad_norm)!r}"
    if max_length is not None:
        node_config += f" max-length={int(max_length)}"
    if require_secure_aggregation:
        node_config += " require-secure-aggregation=true"
    node_config += f" share-ledger={'true' if share_ledger else 'false'} threads={int(threads)}"
    command = [_bin("flower-supernode"), "--superlink", superlink, "--port", str(port)]
    command += ["--node-config", node_config]
    if insecure:
        command.append("--insecure")
    else:
        command += ["--root-certificates", str(_existing(root_cert))]
    if key is not None:
        command += ["--auth-supernode-private-key", str(_existing(key))]
    return command


def _toml(value: str) -> str:
    return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'


def _existing(path: Path | None) -> Path:
    if path is None or not Path(path).is_file():
        raise ClinfedError(f"{path}: no such file")
    return Path(path).resolve()


def write_connection(
    flwr_home: Path, superlink: str, root_cert: Path | None, insecure: bool
) -> None:
    """The ``flwr`` CLI's connection to the SuperLink (``FLWR_HOME/config.toml``)."""
    _tls(root_cert, insecure, "flower run")
    flwr_home.mkdir(parents=True, exist_ok=True)
    lines = ["[superlink]", f'default = "{CONNECTION}"', "", f"[superlink.{CONNECTION}]"]
    lines.append(f"address = {_toml(superlink)}")
    if insecure:
        lines.append("insecure = true")
    else:
        lines.append(f"root-certificates = {_toml(str(_existing(root_cert)))}")
    (flwr_home / "config.toml").write_text("\n".join(lines) + "\n")


def flower_run_config(settings: dict[str, Any], out: Path, resume: bool = False) -> RunConfig:
    """A resolved :class:`RunConfig` for a Flower run from settings named
    like ``clinfed train``'s (the same schema, ``clinfed.settings``);
    ``out`` is the run folder on the SuperLink's machine. Settings with no
    Flower form (the data folder, how the simulator splits it) are refused.
    """
    from clinfed.federated.strategies import STRATEGIES
    from clinfed.settings import schema_fields
    from clinfed.tasks import TASKS

    fields = schema_fields()
    config = RunConfig.from_values(settings)
    for name in settings:
        key = name.replace("-", "_")
        if key == "public_data":
            # Under adapters a warm start moves weights that never travel: every
            # node must load the same starting model from disk.
            raise ClinfedError(
                f"{name}: on Flower, train the starting model once with clinfed warm-start "
                "and name its folder as the run's `model` and in every node's config "
                "(model and model-sha256, which pins it)"
            )
        if key in ("gazetteer", "gazetteer_marks"):
            # The list, and the marks it gives, belong to the model: each node
            # loads them from the model folder its own config pins, never from
            # a path the server names.
            raise ClinfedError(
                f"{name}: on Flower, make the starting model with clinfed warm-start "
                "`gazetteer` (its folder keeps the list) and name that folder as the run's "
                "`model` and in every node's config (model and model-sha256, which pins it "
                "and its list)"
            )
        if key in fields and fields[key].metadata.get("simulator_only"):
            raise ClinfedError(
                f"{name}: not a Flower setting (each SuperNode is a site with its own data)"
            )
    if "task" not in settings:
        raise ClinfedError("a Flower run needs `task`")
    if config.fraction != 1.0:
        raise ClinfedError("`fraction`: not a Flower setting yet (every connected node trains)")
    config = config.replace(out=str(Path(out).resolve()), resume=resume)
    if config.public_check:
        # The ServerApp reads it (the server judges each round), from its own folder.
        config = config.replace(public_check=str(Path(config.public_check).resolve()))
    if config.task in TASKS:
        TASKS[config.task].check_deployment(config)
    if config.strategy in STRATEGIES and STRATEGIES[config.strategy].pooled:
        raise ClinfedError(f"`strategy` {config.strategy} pools the data: it has no Flower form")
    config.validate(check_data=False)
    return config.resolved()


def read_labels(path: Path) -> list[str]:
    """A code list: a run's ``labels.json`` or one code per line."""
    import json

    from clinfed.core.runs import read_user_file

    text = read_user_file(path, f"`labels` {path}")
    if path.suffix == ".json":
        try:
            codes = json.loads(text)["labels"]
        except (ValueError, KeyError, TypeError):
            raise ClinfedError(f'{path}: not a labels.json (no "labels" list)') from None
    else:
        codes = [line.strip() for line in text.splitlines() if line.strip()]
    if not codes or not all(isinstance(c, str) for c in codes):
        raise ClinfedError(f"{path}: no codes")
    if len(set(codes)) != len(codes):
        raise ClinfedError(f"{path}: a code appears twice")
    return codes


def run_overrides(
    config: RunConfig,
    min_sites: int,
    round_timeout: float,
    round_retries: int,
    wait_for_sites: float,
) -> str:
    """The Flower run config (TOML) that carries a clinfed run to the ServerApp."""
    import json

    values: dict[str, Any] = {
        "clinfed-config": json.dumps(
            config.to_dict() | {"run": {"out": config.out, "resume": config.resume}}
        ),
        "min-sites": int(min_sites),
        "round-timeout": float(round_timeout),
        "round-retries": int(round_retries),
        "wait-for-sites": float(wait_for_sites),
    }
    lines = []
    for key, value in values.items():
        rendered = _toml(value) if isinstance(value, str) else repr(value)
        lines.append(f'"{key}" = {rendered}')
    return "\n".join(lines) + "\n"


def run_command(overrides: Path, stream: bool = True) -> list[str]:
    """``flwr run`` of clinfed's Flower App on the configured connection."""
    command = [_bin("flwr"), "run", str(APP_DIR), CONNECTION, "--run-config", str(overrides)]
    return command + (["--stream"] if stream else [])


def register_command(public_key: Path) -> list[str]:
    """``flwr supernode register``: let a SuperNode's key in (node authentication)."""
    return [_bin("flwr"), "supernode", "register", str(_existing(public_key)), CONNECTION]


# ------------------------------------------------------------ key material
def make_certificates(folder: Path, hosts: list[str], days: int = 365) -> dict[str, Path]:
    """A private CA and a server certificate for ``hosts`` (names or IPs).

    Writes ``ca.crt``, ``ca.key``, ``server.pem`` and ``server.key`` into
    ``folder`` (keys readable by the owner only). For a pilot or a test; a
    hospital's PKI should issue production certificates.
    """
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    folder.mkdir(parents=True, exist_ok=True)
    now = datetime.datetime.now(datetime.timezone.utc)
    start, end = now - datetime.timedelta(minutes=5), now + datetime.timedelta(days=days)

    def name(common: str) -> x509.Name:
        return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common)])

    ca_key = ec.generate_private_key(ec.SECP384R1())
    ca_cert = (
        x509.CertificateBuilder()
        .subject_name(name("clinfed CA"))
        .issuer_name(name("clinfed CA"))
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(start)
        .not_valid_after(end)
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(ca_key, hashes.SHA384())
    )
    alt_names: list[x509.GeneralName] = []
    for host in hosts:
        try:
            alt_names.append(x509.IPAddress(ipaddress.ip_address(host)))
        except ValueError:
            alt_names.append(x509.DNSName(host))
    server_key = ec.generate_private_key(ec.SECP384R1())
    server_cert = (
        x509.CertificateBuilder()
        .subject_name(name(hosts[0]))
        .issuer_name(ca_cert.subject)
        .public_key(server_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(start)
        .not_valid_after(end)
        .add_extension(x509.SubjectAlternativeName(alt_names), critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .sign(ca_key, hashes.SHA384())
    )
    pem = serialization.Encoding.PEM
    private = serialization.PrivateFormat.PKCS8
    plain = serialization.NoEncryption()
    paths = {
        "ca.crt": ca_cert.public_bytes(pem),
        "ca.key": ca_key.private_bytes(pem, private, plain),
        "server.pem": server_cert.public_bytes(pem),
        "server.key": server_key.private_bytes(pem, private, plain),
    }
    written = {}
    for file_name, content in paths.items():
        path = folder / file_name
        _write_file(path, content, private=file_name.endswith(".key"))
        written[file_name] = path
    return written


def _write_file(path: Path, content: bytes, private: bool) -> None:
    """Write ``content``; a private key is created readable by its owner
    only (mode 0600 from the start, never chmod-ed after the bytes are out)."""
    path.unlink(missing_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600 if private else 0o644)
    with os.fdopen(fd, "wb") as fh:
        fh.write(content)


def make_node_key(folder: Path, name: str) -> tuple[Path, Path]:
    """A SuperNode's authentication key pair (EC P-384, OpenSSH format):
    ``NAME`` (private, stays at the site) and ``NAME.pub`` (to register)."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    folder.mkdir(parents=True, exist_ok=True)
    key = ec.generate_private_key(ec.SECP384R1())
    private_path, public_path = folder / name, folder / f"{name}.pub"
    _write_file(
        private_path,
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.OpenSSH,
            serialization.NoEncryption(),
        ),
        private=True,
    )
    _write_file(
        public_path,
        key.public_key().public_bytes(
            serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH
        )
        + b"\n",
        private=False,
    )
    return private_path, public_path
