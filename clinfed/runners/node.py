"""A SuperNode's side of a Flower run: its own configuration and the site
runner it builds for each message.

A node is configured by its operator, not by the server (``--node-config``):

``data``
    The site's data folder in the task's real format.
``state``
    The site's state folder. It holds the site's privacy ledger,
    ``ledger/<site>-<fingerprint>.jsonl``: one per dataset, keyed by a
    SHA-256 over the data folder's files (names, sizes, contents), not by
    anything the server chooses, so every run on the same data charges the
    same ledger (``fingerprints.json`` beside it caches file hashes by size
    and modification time). Per run (``STATE/<run name>/``) it holds the
    site's copies of the model (``copy.rNNNN.safetensors``), the evaluation
    meter and the site's predictions. ``encoded/`` keeps the site's encoded
    data between messages (protected health information: folders 0700,
    files 0600; see :mod:`clinfed.runners.node_cache`). It survives restarts of
    the node.
``site``
    The site's name, when the data folder holds several sites (otherwise
    the one site found there).
``max-epsilon``
    The most epsilon this site's data may spend over every run (the
    ledger's cap); each run is also held to its own target. Required for
    training under DP.
``max-delta``
    The largest delta the site accepts (default ``1 / (10 n)``, ``n`` its
    training units: under add/remove its released noisy count, never the
    exact one); a run asking for more is refused, without a count in the
    refusal.
``privacy-unit``
    The weakest privacy unit the site accepts (``example`` < ``document``
    < ``patient``; default ``example``); a run asking for a weaker one is
    refused.
``max-grad-norm``, ``max-length``
    The largest clipping norm and window (tokens) the site accepts; a run
    asking for more is refused (default: no cap on the norm, windows of
    512 tokens: the window decides how many rows a note gives, so the
    server must not be able to vary it at will).
``annotated-types``
    The entity types this site annotates (``problem,test``), for partial
    labels under DP: the site declares them; the server's run settings
    never do, and they are never read from the data under DP (one
    annotation would move every sentence's loss). Without it, partial
    labels are off at this site under DP.
``split-key``
    Keys the site's held-out split when its data folder has no split of
    its own (default ``0``): the site's, never the server's. Change it and
    other documents are held out.
``max-evaluations``
    The most evaluations of this dataset's held-out split over every run
    (default 200): what the site releases by evaluating (summed counts,
    the held-out size) is declared, not noised (held-out units are outside
    epsilon, and the report says so), so the number of times a server may
    ask is capped.
``model``, ``model-sha256``
    The encoder this site trains: ``minilm`` or ``tiny`` (bundled, public)
    or a checkpoint folder, pinned by the SHA-256 of its files
    (``model-sha256``, as ``clinfed data fingerprint`` prints it; required
    for a folder). The server's run names the model too, but a site never
    reads a folder the server names: a run naming a folder is refused unless
    the node config names one (the node's is used), and a bundled name must
    be the node's (default: whichever bundled one the run names).
``allow-no-dp``
    Whether the site trains in runs without DP or with reproducible (not
    private) noise (default false: it refuses them).
``share-ledger``
    Whether the site reports its ledger lines to the server for the run's
    privacy report (default true). The ledger that counts stays at the site.
``device``
    Where this node computes: ``auto`` (CUDA when available, the default),
    ``cpu``, ``cuda`` or ``cuda:N``. The node's choice: the server's run
    settings never name a node's device.
``threads``
    Torch threads for this node's work (default: all cores).
``dp-pass-units``
    Under DP, at most this many units in one forward/backward pass (default
    0: no cap), to fit this node's GPU memory; the step is the same.
``require-secure-aggregation``
    Whether the site trains only in runs with secure aggregation (default
    false): its update then never reaches the server alone. A training
    message of such a run that asks for a plain upload is refused too.
``secure-min-sites``
    The fewest sites this site masks its update among under secure
    aggregation (default 3): a group of fewer keys is refused (the
    threshold is a majority of the group, as always). What remains: the
    sites' public keys are not signed, so a server that adds keys of its
    own to the group can still pose as other sites (see the threat model
    in docs/privacy.md).

Nothing here imports Flower: :class:`NodeSite` builds its runner with
:func:`clinfed.federated.assembly.build_site`, as the in-process runner does.
"""

from __future__ import annotations

import re
import typing
from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path
from typing import Any

import datasets

from clinfed.core.device import resolve_device, use_threads
from clinfed.core.errors import ClinfedError, ProblemLog
from clinfed.core.provenance import data_fingerprint
from clinfed.core.schema import setting, strict_bool
from clinfed.core.scratch import temporary_folder
from clinfed.federated.assembly import SitePlace, build_site, site_privacy
from clinfed.federated.secure_site import with_secure_aggregation
from clinfed.modeling.models import MINILM, TINY, checkpoint_dir, load_tokenizer
from clinfed.runners.factories import make_model, make_strategy, make_task
from clinfed.runners.node_cache import (
    Encoded,
    EncodedCache,
    cache_key,
    restore_task_state,
    task_state,
)
from clinfed.settings import RunConfig
from clinfed.tasks.base import SPLIT_KEY

BUNDLED = (MINILM, TINY)

# Privacy units, weakest first.
UNIT_STRENGTH = ("example", "document", "patient")


@dataclass(frozen=True)
class NodeConfig:
    """A SuperNode's own settings (see the module docstring): one field per
    ``--node-config`` key (the field name with dashes), read by
    :meth:`parse` and bounded as every setting is (:func:`clinfed.core.schema.setting`)."""

    data: Path = setting(None, "The site's data folder.")
    state: Path = setting(None, "The site's state folder (ledgers, copies, meter).")
    site: str | None = setting(None, "The site's name when the data holds several.")
    max_epsilon: float | None = setting(None, "Epsilon over every run (the ledger's cap).", above=0)
    share_ledger: bool = setting(True, "Report ledger lines to the server.")
    threads: int = setting(0, "Torch threads (0: all cores).", minimum=0)
    max_delta: float | None = setting(None, "The largest delta accepted.", above=0, below=1)
    allow_no_dp: bool = setting(False, "Train in runs without DP.")
    max_grad_norm: float | None = setting(None, "The largest clipping norm accepted.", above=0)
    max_length: int = setting(512, "The largest window accepted (tokens).", minimum=8)
    privacy_unit: str = setting("example", "The weakest unit accepted.", choices=UNIT_STRENGTH)
    require_secure_aggregation: bool = setting(False, "Train only under secure aggregation.")
    annotated_types: tuple[str, ...] | None = setting(None, "The types this site annotates.")
    split_key: str = setting(SPLIT_KEY, "Keys the held-out split.")
    max_evaluations: int = setting(200, "Evaluations of the held-out split, ever.", minimum=0)
    model: str | None = setting(None, "The encoder: minilm, tiny or a checkpoint folder.")
    model_sha256: str | None = setting(None, "SHA-256 of the model folder's files.")
    secure_min_sites: int = setting(3, "The fewest sites to mask among.", minimum=2)
    device: str = setting("auto", "auto, cpu, cuda or cuda:N.")
    dp_pass_units: int = setting(0, "Units in one DP pass (0: no cap).", minimum=0)

    @classmethod
    def parse(cls, values: Mapping[str, Any]) -> NodeConfig:
        """From Flower's ``context.node_config`` (keys as in ``--node-config``)."""
        declared = {f.name.replace("_", "-"): f for f in fields(cls)}
        unknown = sorted(set(values) - set(declared))
        if unknown:
            raise ClinfedError(
                f"`node_config`: unknown key {unknown[0]!r} (known: {', '.join(sorted(declared))})"
            )
        for key in ("data", "state"):
            if not values.get(key):
                raise ClinfedError(f"`node_config` needs {key}=FOLDER")
        hints = typing.get_type_hints(cls)
        read = {
            f.name: _node_value(key, f, hints[f.name], values[key])
            for key, f in declared.items()
            # An empty value is the default, except an empty list of types
            # and a boolean (refused: it says neither true nor false).
            if values.get(key) is not None
            and (values[key] != "" or key == "annotated-types" or hints[f.name] is bool)
        }
        node = cls(**read)
        if not node.data.is_dir():
            raise ClinfedError(f"`node_config` data={node.data}: not a folder")
        if node.model is not None and node.model not in BUNDLED and not node.model_sha256:
            raise ClinfedError(
                "`node_config` model names a checkpoint folder: pin it with model-sha256 "
                "(clinfed data fingerprint FOLDER prints it)"
            )
        return node

    def model_for(self, config: RunConfig) -> str:
        """The model this site trains in ``config``'s run: its own, never a
        folder the server names (see the module docstring)."""
        if self.model is None:
            if config.model not in BUNDLED:
                raise ClinfedError(
                    "the run names a model folder; this site loads only a model its node "
                    "config names (model, model-sha256): refused"
                )
            return config.model
        if config.model in BUNDLED and config.model != self.model:
            raise ClinfedError(
                f"the run trains {config.model}; this site trains only the model its node "
                "config names: refused"
            )
        if self.model_sha256 is not None:
            found = data_fingerprint(checkpoint_dir(self.model), self.state / "model-files.json")
            if found != self.model_sha256:
                raise ClinfedError(
                    "the model folder the node config names does not match its model-sha256: "
                    "refused (the operator re-pins it after checking the folder)"
                )
        return self.model

    def check(self, config: RunConfig) -> RunConfig:
        """Refuse a run this site's policy forbids (before any data is read);
        the run config the site then uses: the server's, less the paths only
        the server reads (its run folder, its public check), which the node
        never opens."""
        refuse_server_named_inputs(config)
        config = config.replace(**SERVER_SIDE)
        # The same checks as ``clinfed train``, but none that touches a path:
        # whether a server-named path exists at the node is itself a leak.
        config.validate(check_data=False)
        if not config.dp and not self.allow_no_dp:
            raise ClinfedError(
                "this site trains under DP only (node config allow-no-dp is false); the run "
                "asks for training without DP: refused"
            )
        if config.dp and config.reproducible_noise and not self.allow_no_dp:
            raise ClinfedError(
                "the run asks for reproducible noise, which is not private; this site trains "
                "under DP only (node config allow-no-dp is false): refused"
            )
        if config.dp and self.max_epsilon is None:
            raise ClinfedError(
                "this site has no privacy budget of its own: its operator sets "
                "`max_epsilon` (node config max-epsilon) before it trains under DP"
            )
        if config.dp and UNIT_STRENGTH.index(config.privacy_unit) < UNIT_STRENGTH.index(
            self.privacy_unit
        ):
            raise ClinfedError(
                f"the run protects one {config.privacy_unit}; this site requires at least one "
                f"{self.privacy_unit} (node config privacy-unit): refused"
            )
        if self.require_secure_aggregation and not config.secure_aggregation:
            raise ClinfedError(
                "this site sends its updates only through secure aggregation (node config "
                "require-secure-aggregation); the run does not use it: refused"
            )
        if self.max_grad_norm is not None and config.max_grad_norm > self.max_grad_norm:
            raise ClinfedError(
                f"the run asks for clipping norm {config.max_grad_norm:g}, above this site's "
                f"cap {self.max_grad_norm:g} (node config max-grad-norm): refused"
            )
        if config.max_length > self.max_length:
            raise ClinfedError(
                f"the run asks for windows of {config.max_length} tokens, above this site's "
                f"cap {self.max_length} (node config max-length): refused"
            )
        return config


def _node_value(key: str, f: Any, hint: Any, value: Any) -> Any:
    """One node setting as its field's type, then within its bounds.

    Booleans are read strictly: true/false (a TOML boolean or the words,
    any case) or 1/0; anything else is refused by the key's name (a quoted
    "false" read as a truthy string would open what the operator closed).
    """
    from clinfed.settings import check_bounds

    kinds = [a for a in typing.get_args(hint) if a is not type(None)] or [hint]
    kind, where = kinds[0], f"`node_config` {key}"
    if kind is bool:
        return strict_bool(value, where)
    try:
        if kind is Path:
            return Path(str(value))
        if typing.get_origin(kind) is tuple:  # a list: comma-separated
            return tuple(t.strip() for t in str(value).split(",") if t.strip())
        read = kind(value) if kind in (int, float) else str(value)
    except ValueError:
        raise ClinfedError(f"{where}: expected {kind.__name__}, got {value!r}") from None
    if key == "model-sha256":
        read = read.lower()
    check_bounds(f, read, where)
    return read


# Settings only the server reads (its run folder, the public text it scores
# each round on): a node replaces them with nothing before it builds its site.
SERVER_SIDE = {"out": "", "public_check": None}

# Settings that name a file inline when they end so (``--types x.toml``).
FILE_VALUED = ("types", "public_types")


def refuse_server_named_inputs(config: RunConfig) -> None:
    """Refuse every setting through which the server would name a file or
    folder the node reads (data, name lists, public text, type files, caches)
    or decide what only the node decides (its device, its memory), by the
    setting's name: the node never looks at the path, so a refusal says
    nothing about what exists on the hospital's machine."""
    from clinfed.settings import schema_fields

    defaults = RunConfig()
    for name, spec in schema_fields().items():
        if spec.metadata.get("simulator_only") and getattr(config, name) != getattr(defaults, name):
            raise ClinfedError(
                f"the run sets {name}: a node takes its data, model, name lists, public text "
                "and machine from its own node config, never from the server's run: refused"
            )
    for name in FILE_VALUED:
        value = getattr(config, name, None)
        if isinstance(value, str) and value.strip().lower().endswith(".toml"):
            # A site reads no file the server names (nor says whether it exists).
            raise ClinfedError(
                f"the run's {name} names a file; a site reads no file a server names: the "
                "run declares its types inline (Disease=problem,Chemical=treatment): refused"
            )


# The node's high-water mark of its ledgers: outside STATE/ledger/, so a
# ledger folder restored from an older backup is refused.
LEDGER_MARK = "ledger-marks.json"

# Encoders that ship with clinfed: public, nothing of a site's in them.

RUN_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,99}$")


def safe_run_name(name: str) -> str:
    """A run name the server sends, checked before it names a folder at the
    site: letters, digits, ``.``, ``_``, ``-``; no separator, no ``..``."""
    if not isinstance(name, str) or not RUN_NAME.match(name) or ".." in name:
        raise ClinfedError(
            f"run name {name!r} refused: a run name names a folder at the site and may hold "
            "only letters, digits, '.', '_' and '-' (no path separators, no '..')"
        )
    return name


def _encoded(
    config: RunConfig, node: NodeConfig, task: Any, tokenizer, cache_dir: str, data_fp: str
) -> Encoded:
    """The site's encoded data: from the node's cache (``STATE/encoded/``)
    when nothing it depends on changed, else read, checked, encoded and
    cached (:mod:`clinfed.runners.node_cache`)."""
    planned = list(task.labels)
    settings = asdict(config) | {
        "annotated_types": node.annotated_types,
        "split_key": node.split_key,
    }
    model_fp = data_fingerprint(checkpoint_dir(config.model), node.state / "model-files.json")
    key = cache_key(settings, node.site, data_fp, model_fp)
    cache = EncodedCache(node.state)
    found = cache.load(key)
    if found is not None:
        restore_task_state(task, found.task_state)
        if task.labels != planned:  # the key covers the label settings: never expected
            raise ClinfedError(f"{cache.root / key}: cached labels differ from the run's")
        return found
    corpus = task.load(node.data, ProblemLog(config.on_error))
    if task.labels != planned:
        # The server built the model for the planned labels; a site must
        # not train another head (types from its own data).
        raise ClinfedError(
            f"{node.data}: the labels its data gives ({len(task.labels)}) are not the "
            f"run's ({len(planned)}); the run must declare them (`types` for i2b2)"
        )
    sites = corpus.sites
    if node.site is None and len(sites) != 1:
        raise ClinfedError(
            f"{node.data}: holds sites {', '.join(sites)}; name this node's with "
            "`node_config` site=NAME"
        )
    name = node.site or sites[0]
    if name not in sites:
        raise ClinfedError(f"{node.data}: no site {name!r} (found {', '.join(sites)})")
    test_records = _of_site(corpus.test, name)
    train = task.encode(_of_site(corpus.train, name), tokenizer, config.max_length, cache_dir)
    test = task.encode(test_records, tokenizer, config.max_length, cache_dir)
    if len(train) == 0 and len(test) == 0:
        raise ClinfedError(f"{node.data}: no training or held-out examples for site {name}")
    encoded = Encoded(name, train, test, test_records, task_state(task))
    cache.save(key, encoded)
    return encoded


def _of_site(records: Any, site: str) -> Any:
    """The records (documents or an admissions table) of one site."""
    if isinstance(records, datasets.Dataset):
        return records.filter(lambda s: s == site, input_columns="site")
    return [r for r in records if r.site == site]


class NodeSite:
    """One node's site for one run: its runner (built on the first message
    that needs it, wrapped for secure aggregation when the run asks for
    it) and the temporary folder its tokenized data lives in (removed by
    :meth:`close`). The run's settings are checked against the node's
    policy as it is made, before anything is read."""

    def __init__(self, config: RunConfig, node: NodeConfig, run_name: str):
        # The site's own policy, whatever the server's run config says.
        self.config, self.node, self.run_name = node.check(config), node, run_name
        self.folder = node.state / safe_run_name(run_name)
        self.share_ledger = node.share_ledger
        self._tmp: Any = None
        self._runner: Any = None
        self.site = with_secure_aggregation(
            self.config, lambda: self.runner, self.folder, node.secure_min_sites
        )

    @property
    def runner(self) -> Any:
        """The site's :class:`~clinfed.federated.site.SiteRunner`, built once."""
        if self._runner is None:
            self._runner = self._build()
        return self._runner

    def handle(self, message: Any) -> Any:
        """The site's reply to one message (released as it leaves)."""
        return self.site.handle(message)

    def _build(self) -> Any:
        node = self.node
        use_threads(node.threads, self.config.threads)
        device = resolve_device(node.device)  # the node's; one it lacks: refused now
        # The site's own model: never a folder the server names.
        config = replace(
            self.config, model=node.model_for(self.config), dp_pass_units=node.dp_pass_units
        )
        # Tokenized notes are protected: they live in a temporary folder at
        # the site, removed when the message is done.
        self._tmp = temporary_folder("site")
        cache_dir = self._tmp.name
        try:
            task = make_task(config, cache_dir)
            # What the node declares of its data, never the server's.
            task.at_node(node.split_key, node.annotated_types)
            tokenizer = load_tokenizer(config.model)
            # The data's fingerprint names its ledger and its cached encoding.
            data_fp = data_fingerprint(node.data, node.state / "ledger" / "fingerprints.json")
            encoded = _encoded(config, node, task, tokenizer, cache_dir, data_fp)
            name = encoded.site
            model = make_model(config, task).to(device)
            strategy = make_strategy(config, task, tokenizer, cache_dir)
            # One ledger per dataset at this node, whatever the run is
            # called: capped by the node's own max-epsilon over every run,
            # and this run by its own target. Under add/remove the released
            # count is kept beside it (one draw per dataset).
            dataset = node.state / "ledger" / f"{name}-{data_fp[:16]}"
            place = SitePlace(
                self.folder,
                ledger=dataset.with_name(dataset.name + ".jsonl"),
                ledger_budget=node.max_epsilon,
                ledger_mark=node.state / LEDGER_MARK,
                run_name=self.run_name,
                # Calibrated once per setting, not per message (checked on reuse).
                calibration_memo=node.state / "calibration.json",
                max_delta=node.max_delta,
                charge_count_now=True,
            )
            privacy = site_privacy(config, task, name, encoded.train, strategy, place)
            return build_site(
                config,
                name,
                task,
                model,
                strategy,
                (encoded.train, encoded.test, encoded.test_records),
                place,
                privacy,
                predictions_dir=self.folder / "predictions",
                # One meter per dataset, beside its ledger, across runs.
                meter_path=dataset.with_name(dataset.name + ".evaluations.json"),
                max_evaluations=node.max_evaluations,
            )
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None
