"""The settings of a run, declared once.

Every setting is a dataclass field with its help text and its bounds, in one
dataclass per concern (data, model, local training, federation, privacy,
machine); each strategy declares its own options dataclass in its own file
(``clinfed.federated.strategies``). From this one schema come:

* the ``clinfed train`` / ``sweep`` / ``flower run`` flags, grouped into
  ``--help`` panels by concern (``clinfed.commands.options``);
* ``--config FILE`` (TOML, or a run's own ``config.json``): keys named like
  the fields, at the top level or in a table per concern;
* ``RUN/config.json`` (written by :meth:`RunConfig.to_dict`, read back by
  :meth:`RunConfig.from_values`);
* the run config a Flower run carries to the ServerApp and every node.

One name per setting: the flag is the field name with dashes. Unknown keys
are refused with the nearest valid name; values are type-checked strictly
(``rounds = 1.5`` and ``rounds = true`` are errors, not 1); floats must be
finite unless the field says ``inf`` means something.
"""

from __future__ import annotations

import difflib
import math
import re
import types
import typing
from collections.abc import Mapping
from dataclasses import MISSING, Field, asdict, dataclass, field, fields, make_dataclass, replace
from pathlib import Path
from typing import Any

from clinfed.errors import ClinfedError
from clinfed.schema import setting

# Above this target epsilon a run needs --accept-large-epsilon.
EPSILON_CEILING = 50.0


# ------------------------------------------------------------------ concerns
@dataclass
class RunSettings:
    """Where the run lives."""

    out: str = setting("", "New run folder (refused if it holds files).", flag_only=True)
    resume: bool = setting(
        False, "Continue the run in --out from its last committed round.", flag_only=True
    )


@dataclass
class _DataBase:
    """Task and data settings every task shares."""

    task: str = setting("i2b2", "Task: i2b2 (concept extraction) or mimic3 (ICD-9 coding).")
    data: str = setting(
        "",
        "Corpus folder (train/ and test/, or one folder to split).",
        simulator_only=True,
    )
    on_error: str = setting(
        "strict",
        "strict: report every problem and stop (exit 2); skip: report and leave the bad item out.",
        choices=("strict", "skip"),
    )
    max_length: int | None = setting(
        None, "Encoder window in tokens (default: the task's).", minimum=8, maximum=512
    )


def _with_task_options(base: type) -> type:
    """``base`` plus every registered task's options (declared in the task's
    own folder, ``tasks/<name>/options.py``), as one concern: flags, config
    keys and ``config.json`` keep one flat name per setting."""
    from clinfed.tasks import task_options

    extra, owners = [], {f.name: "the run" for f in fields(base)}
    for task, options in task_options().items():
        hints = typing.get_type_hints(options)
        for f in fields(options):
            if f.name in owners:
                raise TypeError(f"task {task}: option {f.name} is already {owners[f.name]}'s")
            owners[f.name] = task
            copy = (
                field(default=f.default, metadata=f.metadata)
                if f.default is not MISSING
                else field(default_factory=f.default_factory, metadata=f.metadata)
            )
            extra.append((f.name, hints[f.name], copy))
    made = make_dataclass("DataSettings", extra, bases=(base,))
    made.__module__ = __name__
    made.__doc__ = "Task and data: what is read and how it becomes examples."
    return made


DataSettings = _with_task_options(_DataBase)


@dataclass
class ModelSettings:
    """The encoder."""

    model: str = setting("minilm", "minilm (bundled), tiny (random, tests) or a checkpoint folder.")
    adapter: str = setting(
        "none",
        "none: plans move encoder weights; lora: the encoder stays frozen and only LoRA "
        "adapters and the head train and travel; bias: only the encoder's bias terms and the "
        "head (BitFit; with --gazetteer also the token-type table, the marks' rows); head: "
        "the head alone; labels: the head's per-label rows alone (ICD coding: its label "
        "queries and outputs, not the projection every code shares; "
        "concept extraction: the same as head). Any strategy but pfeddc.",
        choices=("none", "lora", "bias", "head", "labels"),
    )
    lora_rank: int = setting(8, "lora: rank of each adapter.", minimum=1, maximum=256)
    lora_alpha: float = setting(
        16.0, "lora: scale (the update is B A times alpha/rank).", above=0.0
    )
    lora_factors: str = setting(
        "b",
        "lora: b trains B alone from a seeded A shared by all (the average is exact, half "
        "travels); ab trains both and averages them separately (inexact).",
        choices=("b", "ab"),
    )
    gazetteer: str | None = setting(
        None,
        "A file of public names, one a line, or a folder of such .txt files (drug and "
        "disease names from public terminologies): the word pieces of listed names in a "
        "unit's own words get token-type id 1, an input the encoder learns to read. Kept "
        "with the model (RUN/model/gazetteer.txt) and recorded by SHA-256 in config.json "
        "and the report.",
        simulator_only=True,
    )
    gazetteer_marks: str = setting(
        "per-list",
        "per-list: each .txt file of the --gazetteer folder, in file-name order, its own "
        "token-type id (1, 2, ...; a drug list and a disease list say which kind of name a "
        "word is part of; measured +0.8 F1 at epsilon 8 over one mark); the encoder's "
        "token-type table grows a row a list past the first, a copy of its second. one: "
        "every listed name the same id, 1.",
        choices=("one", "per-list"),
        simulator_only=True,
    )
    public_data: str | None = setting(
        None,
        "A folder of public annotated text (any accepted format; for mimic3, MIMIC-III CSVs of "
        "other patients' admissions) the starting model trains on, whole and without DP, "
        "before round 1: no site's data, no privacy spent. Recorded in config.json and the "
        "report.",
        simulator_only=True,
    )
    public_types: str | None = setting(
        None,
        "The public text's entity types mapped onto the run's, in --types syntax "
        "(Disease=problem,Chemical=treatment).",
    )
    public_epochs: int = setting(
        1,
        "Passes over the public text before round 1.",
        minimum=1,
        maximum=100,
    )
    public_lr: float | None = setting(
        None,
        "The encoder's rate on the public text (default: the task's whole-model rate, "
        "whatever --lr and --adapter set for the private rounds).",
        above=0.0,
        maximum=1.0,
    )
    public_examples: int = setting(
        0,
        "At most this many public examples, drawn with the run's seed (0: all of them).",
        minimum=0,
        maximum=10_000_000,
    )
    public_check: str | None = setting(
        None,
        "A folder of public annotated text the server scores each round's proposed model on "
        "(concept extraction: types mapped with --public-types; ICD coding: MIMIC-III CSVs of "
        "other patients' admissions); the last model is kept unless the proposal is better "
        "there than chance (micro F1 rises, and a one-sided sign test at 5% on the decisions it "
        "changed, spans or codes per admission, passes). Reads no site's data: no privacy spent. "
        "Recorded in config.json and each round's record. On Flower the ServerApp reads the "
        "folder.",
    )


@dataclass
class TrainingSettings:
    """Local training: how a model learns from one site's examples."""

    epochs: int = setting(
        3, "centralized: passes over the pooled training data.", minimum=1, maximum=1_000
    )
    local_epochs: int | None = setting(
        None,
        "Passes over a site's data per round (default 1; under DP 3, the recipe's).",
        minimum=1,
        maximum=1_000,
    )
    batch_size: int | None = setting(
        None,
        "Examples per step (default: the task's; under DP each site's expected Poisson batch "
        "is its units / 16, 64 to 1024, with the rates scaled by sqrt(batch / task batch)); "
        "a public warm start always takes the task's.",
        minimum=1,
        maximum=65_536,
    )
    lr: float | None = setting(
        None, "AdamW rate of the encoder (default: the task's).", above=0.0, maximum=1.0
    )
    head_lr: float | None = setting(
        None,
        "Rate of the freshly initialised task head (default: the task's).",
        above=0.0,
        maximum=1.0,
    )
    weight_decay: float = setting(0.01, "AdamW weight decay.", minimum=0.0, maximum=1.0)
    lr_decay: str | None = setting(
        None,
        "Federated runs: none keeps the rates; linear takes them to zero over the run's "
        "planned local steps (round r's steps run from 1-(r-1)/R to 1-r/R of each rate); "
        "cooldown keeps them until the last round, then takes them to zero over its steps. "
        "Default: none, under DP too (the recipe's, measured).",
        choices=("none", "linear", "cooldown"),
    )
    lr_warmup: float = setting(
        0.1,
        "centralized: share of the steps with a linear learning-rate warm-up.",
        minimum=0.0,
        below=1.0,
    )
    seed: int = setting(
        0, "Seeds the model head, data order, dropout and splits.", minimum=0, maximum=2_147_483_647
    )


@dataclass
class FederationSettings:
    """The federation: who trains, how often, with which strategy."""

    strategy: str = setting(
        "fedavg",
        "Training strategy (see clinfed strategies): federated by default, each hospital's "
        "notes staying at the hospital; centralized pools them (no DP).",
    )
    rounds: int = setting(5, "Federated rounds.", minimum=1, maximum=10_000)
    fraction: float = setting(
        1.0, "Share of the sites sampled to train each round.", above=0.0, maximum=1.0
    )
    partition: str = setting(
        "sites",
        "Clients: sites (one per hospital, as the corpus says), iid, or dirichlet label skew "
        "(with --clients).",
        choices=("sites", "iid", "dirichlet"),
        simulator_only=True,
    )
    clients: int = setting(
        0,
        "With --partition iid|dirichlet: this many clients.",
        minimum=0,
        simulator_only=True,
        maximum=10_000,
    )
    alpha: float = setting(
        0.5, "Dirichlet concentration (small: skewed).", above=0.0, simulator_only=True
    )
    secure_aggregation: bool = setting(
        False,
        "SecAgg+: the server learns only the sum of the sites' updates, never one site's "
        "(four exchanges a round instead of one; uploads in 64-bit fixed point).",
    )
    secure_threshold: float = setting(
        0.5,
        "Secure aggregation: share of a round's training sites needed to finish it (at least "
        "a majority and two); the rest may drop out.",
        above=0.0,
        maximum=1.0,
    )


@dataclass
class PrivacySettings:
    """DP-SGD at every site (off unless a target epsilon or a noise is given)."""

    target_epsilon: float | None = setting(
        None,
        "DP-SGD at every site, each site's noise calibrated so the planned rounds end at or "
        "just under this epsilon; sites refuse rounds past it ('inf': no DP).",
        above=0.0,
        allow_inf=True,
    )
    accept_large_epsilon: bool = setting(
        False,
        f"Allow --target-epsilon above {EPSILON_CEILING:g}: a bound that large says nothing "
        "a patient would call privacy; without this flag such a target is refused.",
    )
    delta: float = setting(1e-5, "DP delta (below 1 / site examples).", above=0.0, below=1.0)
    noise_multiplier: float | None = setting(
        None,
        "DP-SGD with this noise multiplier at every site instead of calibrating one "
        "(at least 0.1).",
        minimum=0.1,
    )
    max_grad_norm: float = setting(1.0, "DP-SGD per-example clipping norm.", above=0.0)
    neighbours: str = setting(
        "add-remove",
        "add-remove: each site releases its unit count once per dataset with Gaussian noise "
        "(std 20, accounted) and everything derives from it, so neighbours differ in one unit "
        "added or removed (less noise for the same epsilon: measured 3-4 F1 points at epsilon "
        "8). replace-one: each site releases its exact unit count (aggregation weight, "
        "sampling rate), so neighbouring datasets differ in one replaced unit.",
        choices=("replace-one", "add-remove"),
    )
    clipping: str = setting(
        "auto",
        "DP-SGD per-example clipping: bk (book-keeping: one backward pass), hooks, ghost, or "
        "auto (bk wherever its layer rules cover the trainable parameters, else ghost when "
        "embeddings train and units are single rows, else hooks).",
        choices=("auto", "bk", "hooks", "ghost"),
    )
    privacy_unit: str = setting(
        "example",
        "What the DP guarantee protects: example (an i2b2 sentence, its windows folded; a "
        "MIMIC-III admission), document (a whole note), or patient (every admission of a "
        "MIMIC-III SUBJECT_ID). Units are sampled and clipped whole.",
        choices=("example", "document", "patient"),
    )
    audit_holdout: float = setting(
        0.0,
        "Set aside this share of each site's training units before training, as the "
        "non-members of `clinfed audit` (recorded in RUN/audit/; each site's last update is "
        "kept there too).",
        minimum=0.0,
        below=1.0,
        simulator_only=True,
    )
    reproducible_noise: bool = setting(
        False,
        "Derive DP noise and sampling from the public seed instead of OS entropy (tests and "
        "runner comparisons only): the run is marked NOT private everywhere.",
    )


@dataclass
class MachineSettings:
    """This machine: none of these change results."""

    threads: int = setting(
        0, "CPU threads (0: all cores).", minimum=0, maximum=1_024, resumable=True
    )
    device: str = setting(
        "auto",
        "Where this process computes: auto (CUDA when available), cpu, cuda or cuda:N. On "
        "Flower each node decides its own (node config device); the server never does.",
        simulator_only=True,
        resumable=True,
    )
    precision: str = setting(
        "fp32",
        "fp32, or bf16 autocast for training without DP. Under DP only fp32: per-example "
        "gradient norms and clipping must be exact, or the clipping bound the accounting "
        "assumes does not hold.",
        choices=("fp32", "bf16"),
    )
    dp_pass_units: int = setting(
        0,
        "Under DP, at most this many units in one forward/backward pass (0: on a GPU, as many "
        "as half its free memory holds; on the CPU no cap). A pass "
        "holds a gradient of every trainable weight per unit (about 90 MB each for the whole "
        "of MiniLM), so a large batch is cut into more passes to fit the GPU's memory; the "
        "step, and so the privacy, is the same. On Flower each node sets its own "
        "(node config dp-pass-units).",
        minimum=0,
        maximum=65_536,
        simulator_only=True,
        resumable=True,
    )
    cache_dir: str | None = setting(
        None,
        "Keep tokenized data here for reuse (it holds note content: protect it like the "
        "data). Default: a temporary folder, deleted after the run.",
        simulator_only=True,
        resumable=True,
    )
    eval_batch_size: int = setting(
        64, "Examples per evaluation step.", minimum=1, resumable=True, maximum=65_536
    )
    report_to: str = setting(
        "none",
        "Experiment tracking: tensorboard (event files in RUN/tensorboard/), mlflow (its "
        "tracking URI, RUN/mlruns by default) or none. Per round: F1, MB sent, epsilon.",
        choices=("none", "tensorboard", "mlflow"),
        resumable=True,
    )


CONCERNS: dict[str, type] = {
    "run": RunSettings,
    "data": DataSettings,
    "model": ModelSettings,
    "training": TrainingSettings,
    "federation": FederationSettings,
    "privacy": PrivacySettings,
    "machine": MachineSettings,
}
PANELS = {
    "run": "Run",
    "data": "Task and data",
    "model": "Model",
    "training": "Local training",
    "federation": "Federation",
    "strategy_options": "Strategy options",
    "privacy": "Privacy (DP-SGD)",
    "machine": "Machine",
}
# Settings that name public inputs: never the private data (see validate).
PUBLIC_INPUTS = ("public_data", "public_check", "gazetteer")


def flag(name: str) -> str:
    """A setting's command-line flag."""
    return "--" + name.replace("_", "-")


# Keys a run's config.json carries beside the settings (ignored on reading).
METADATA_KEYS = {
    "public_start",
    "public_check_text",
    "gazetteer_list",
    "clinfed_version",
    "runner",
    "deployment",
    "versions",
    "command",
    "written",
    "data_fingerprint",
}


@dataclass
class RunConfig(
    MachineSettings,
    PrivacySettings,
    FederationSettings,
    TrainingSettings,
    ModelSettings,
    DataSettings,
    RunSettings,
):
    """Everything that decides a run: the concern dataclasses above, plus the
    chosen strategy's options (``strategy_options``, validated by that
    strategy's own options dataclass). Written to ``RUN/config.json``."""

    strategy_options: dict[str, Any] = field(
        default_factory=dict, metadata={"help": "The chosen strategy's options."}
    )

    # ----------------------------------------------------------- building
    @classmethod
    def from_values(cls, values: Mapping[str, Any], source: str = "settings") -> RunConfig:
        """A config from keys named like the fields: flat, or nested in a
        table per concern (``[training] lr = 1e-4``), strategy options at the
        top level or under ``strategy_options``. ``source`` names the file in
        errors."""
        flat = flatten(values, source)
        known = schema_fields()
        options_known = strategy_option_fields()
        direct: dict[str, Any] = {}
        options: dict[str, Any] = dict(flat.pop("strategy_options", None) or {})
        for key, value in flat.items():
            name = key.replace("-", "_")
            if name in known:
                direct[name] = check_value(known[name], value, source)
            elif name in options_known:
                options[name] = value
            else:
                raise unknown_key(key, source)
        for key in list(options):
            name = key.replace("-", "_")
            if name not in options_known:
                raise unknown_key(key, source)
            options[name] = check_value(options_known[name], options.pop(key), source)
        return cls(**direct, strategy_options=options)

    @classmethod
    def of(cls, **values: Any) -> RunConfig:
        """:meth:`from_values` with keyword arguments (strategy options too)."""
        return cls.from_values(values, "settings")

    def to_dict(self) -> dict[str, Any]:
        """The settings nested by concern (``RUN/config.json``; accepted back
        by :meth:`from_values`). ``out`` and ``resume`` are where and how it
        ran, not what: they are left out."""
        # Standard JSON has no infinity: "inf" (read back by from_values).
        values = {
            k: "inf" if isinstance(v, float) and math.isinf(v) else v
            for k, v in asdict(self).items()
        }
        nested: dict[str, Any] = {}
        for concern, cls in CONCERNS.items():
            if concern == "run":
                continue
            nested[concern] = {f.name: values[f.name] for f in fields(cls)}
        nested["strategy_options"] = dict(self.strategy_options)
        return nested

    def replace(self, **changes: Any) -> RunConfig:
        return replace(self, **changes)

    # ---------------------------------------------------------- checking
    def validate(self, check_data: bool = True) -> None:
        """Reject impossible settings before anything is read or written
        (``check_data=False``: the data is elsewhere, at Flower nodes)."""
        from clinfed.federated.strategies import STRATEGIES
        from clinfed.tasks import TASKS

        if self.task not in TASKS:
            raise ClinfedError(f"--task must be one of {', '.join(TASKS)}, not {self.task!r}")
        if self.strategy not in STRATEGIES:
            raise ClinfedError(
                f"--strategy must be one of {', '.join(STRATEGIES)}, not {self.strategy!r}"
            )
        for f in schema_fields().values():
            check_bounds(f, getattr(self, f.name))
        strategy = STRATEGIES[self.strategy]
        strategy.make_options(self.strategy_options, self.strategy)  # raises on bad options
        strategy.check_config(self)
        task = TASKS[self.task]
        if self.labels is not None and not task.accepts_fixed_labels:
            raise ClinfedError(
                f"--labels (a fixed label list) does not apply to --task {self.task}"
            )
        if self.partition != "sites" and self.clients < 1:
            raise ClinfedError(f"--partition {self.partition} needs --clients N")
        if self.partition == "sites" and self.clients:
            raise ClinfedError("--clients N needs --partition iid or dirichlet")
        if not strategy.shares_model and self.partition != "sites":
            raise ClinfedError(
                f"--strategy {self.strategy} evaluates each site's own model on its own data: "
                "use --partition sites"
            )
        if self.secure_aggregation:
            if strategy.pooled or not strategy.uploads:
                raise ClinfedError(
                    f"--secure-aggregation: --strategy {self.strategy} sends no updates to sum"
                )
            if self.audit_holdout:
                raise ClinfedError(
                    "--audit-holdout attacks each site's own update, which secure aggregation "
                    "keeps from everyone: choose one"
                )
        if self.privacy_unit not in task.units:
            raise ClinfedError(
                f"--privacy-unit {self.privacy_unit}: --task {self.task} offers "
                f"{', '.join(task.units)}"
            )
        if self.dp and self.precision != "fp32":
            raise ClinfedError(
                f"--precision {self.precision} under DP: per-example gradient norms and "
                "clipping must be exact (fp32), or the clipping bound the accounting assumes "
                "does not hold"
            )
        if self.public_check:
            if strategy.pooled or not strategy.shares_model:
                raise ClinfedError(
                    f"--public-check needs a strategy with one shared model, not --strategy "
                    f"{self.strategy}: the server scores the global model"
                )
            if check_data and not Path(self.public_check).is_dir():
                raise ClinfedError(f"--public-check {self.public_check}: not a folder")
        if (
            self.dp
            and self.target_epsilon is not None
            and self.target_epsilon > EPSILON_CEILING
            and not self.accept_large_epsilon
        ):
            raise ClinfedError(
                f"--target-epsilon {self.target_epsilon:g} is above {EPSILON_CEILING:g}: a bound "
                "that large protects nobody in practice; give --accept-large-epsilon to run it "
                "anyway"
            )
        if self.dp:
            if not (self.max_grad_norm > 0 and math.isfinite(self.max_grad_norm)):
                raise ClinfedError("--max-grad-norm must be a positive finite number under DP")
            if strategy.pooled:
                raise ClinfedError(
                    "DP-SGD runs at the sites of a federated strategy, not "
                    f"--strategy {self.strategy}"
                )
        if check_data and not Path(self.data).is_dir():
            raise ClinfedError(f"--data {self.data}: not a folder")
        if check_data:
            from clinfed.provenance import check_public_input

            for name in PUBLIC_INPUTS:
                if getattr(self, name):
                    check_public_input(flag(name), getattr(self, name), self.data)
        if check_data and self.out:
            from clinfed.runs import ensure_outside

            # Run outputs (predictions, copies) would land inside the corpus.
            ensure_outside(self.out, self.data)

    @property
    def dp(self) -> bool:
        """Whether sites train under DP-SGD (``--target-epsilon inf`` is no DP)."""
        finite_target = self.target_epsilon is not None and not math.isinf(self.target_epsilon)
        return finite_target or self.noise_multiplier is not None

    def resolved(self) -> RunConfig:
        """A copy with every unset setting filled from the task's defaults and
        the strategy's (its options completed from their own defaults)."""
        from clinfed.federated.strategies import STRATEGIES
        from clinfed.tasks import TASKS

        strategy = STRATEGIES[self.strategy]
        defaults = dict(TASKS[self.task].defaults)
        if self.dp and self.adapter == "none":
            # Every weight under DP trains at the task's measured private rates.
            defaults |= TASKS[self.task].dp_rates
        defaults |= dict(strategy.training_defaults)
        if self.adapter != "none":
            from clinfed.adapters import TRAINING_DEFAULTS

            defaults |= TRAINING_DEFAULTS
        if self.dp:
            # Under DP each site derives its batch from its own size
            # (clinfed.privacy.recipe) unless --batch-size is given.
            defaults.pop("batch_size", None)
        if self.local_epochs is None:
            from clinfed.privacy.recipe import dp_local_epochs

            defaults["local_epochs"] = dp_local_epochs(self.adapter) if self.dp else 1
        if self.lr_decay is None:
            from clinfed.privacy.recipe import DP_LR_DECAY

            defaults["lr_decay"] = DP_LR_DECAY if self.dp else "none"
        changes = {k: v for k, v in defaults.items() if getattr(self, k) is None}
        options = asdict(strategy.make_options(self.strategy_options, self.strategy))
        return replace(self, **changes, strategy_options=options)

    def options(self) -> Any:
        """The chosen strategy's options dataclass."""
        from clinfed.federated.strategies import STRATEGIES

        return STRATEGIES[self.strategy].make_options(self.strategy_options, self.strategy)


# --------------------------------------------------------------- helpers
def schema_fields() -> dict[str, Field]:
    """Every field of the concern dataclasses, by name."""
    return {f.name: f for f in fields(RunConfig) if f.name != "strategy_options"}


def concern_of(name: str) -> str:
    for concern, cls in CONCERNS.items():
        if any(f.name == name for f in fields(cls)):
            return concern
    return "strategy_options"


def strategy_option_fields() -> dict[str, Field]:
    """Every registered strategy's option fields, by name (a name shared by
    two strategies means the same setting, with the same default)."""
    from clinfed.federated.strategies import STRATEGIES

    found: dict[str, Field] = {}
    for strategy in STRATEGIES.values():
        for f in fields(strategy.options):
            found.setdefault(f.name, f)
    return found


def option_owners() -> dict[str, list[str]]:
    """Option name -> the strategies that take it."""
    from clinfed.federated.strategies import STRATEGIES

    owners: dict[str, list[str]] = {}
    for name, strategy in STRATEGIES.items():
        for f in fields(strategy.options):
            owners.setdefault(f.name, []).append(name)
    return owners


def all_names() -> list[str]:
    return [*schema_fields(), *strategy_option_fields()]


# Per settings file read, the line each key stands on (errors name it).
_KEY_LINES: dict[str, dict[str, int]] = {}
_KEY = re.compile(r"""^\s*["']?([A-Za-z0-9_-]+)["']?\s*=""")


def where(source: str, key: str) -> str:
    """``source`` with the line ``key`` stands on, when ``source`` is a
    settings file that holds it (``run.toml:7``)."""
    line = _KEY_LINES.get(source, {}).get(key.replace("-", "_"))
    return f"{source}:{line}" if line else source


def unknown_key(key: str, source: str) -> ClinfedError:
    names = all_names()
    close = difflib.get_close_matches(key.replace("-", "_"), names, n=1, cutoff=0.6)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    return ClinfedError(f"{where(source, key)}: unknown setting {key!r}{hint}")


def flatten(values: Mapping[str, Any], source: str) -> dict[str, Any]:
    """Concern tables merged into one level; metadata keys dropped."""
    flat: dict[str, Any] = {}
    for key, value in values.items():
        if key in METADATA_KEYS:
            continue
        if key in CONCERNS and isinstance(value, Mapping):
            for inner, inner_value in value.items():
                if inner in flat:
                    raise ClinfedError(f"{source}: setting {inner!r} given twice")
                flat[inner] = inner_value
        elif key == "strategy_options":
            if not isinstance(value, Mapping):
                raise ClinfedError(f"{source}: strategy_options must be a table")
            flat.setdefault("strategy_options", {}).update(value)
        else:
            if key in flat:
                raise ClinfedError(f"{source}: setting {key!r} given twice")
            flat[key] = value
    return flat


def field_type(f: Field) -> tuple[type, bool]:
    """The base type of a field and whether ``None`` is allowed."""
    hint = typing.get_type_hints(_owner(f))[f.name]
    args = typing.get_args(hint)
    optional = type(None) in args
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        hint = next(a for a in args if a is not type(None))
    origin = typing.get_origin(hint)
    return (origin or hint), optional


def _owner(f: Field) -> type:
    from clinfed.federated.strategies import STRATEGIES

    for cls in (*CONCERNS.values(), *(s.options for s in STRATEGIES.values())):
        if any(g is f for g in fields(cls)):
            return cls
    raise KeyError(f.name)


def check_value(f: Field, value: Any, source: str) -> Any:
    """``value`` checked against the field's type (strictly: no bool for an
    int, no float for an int) and bounds; returned normalised."""
    kind, optional = field_type(f)
    flag = "--" + f.name.replace("_", "-")
    named = flag if source in ("flags", "settings") else f"{where(source, f.name)}: {f.name}"
    if value is None:
        if optional:
            return None
        raise ClinfedError(f"{named}: a value is required")
    if kind is bool:
        ok = isinstance(value, bool)
    elif kind is int:
        ok = isinstance(value, int) and not isinstance(value, bool)
    elif kind is float:
        if isinstance(value, str) and value.strip().lower() in ("inf", "+inf", "infinity"):
            value = math.inf
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        value = float(value) if ok else value
    elif kind is str:
        if isinstance(value, int) and not isinstance(value, bool) and f.metadata.get("int_ok"):
            value = str(value)
        ok = isinstance(value, str)
    elif kind is list:
        ok = isinstance(value, list) and all(isinstance(v, str) for v in value)
    else:  # pragma: no cover - the schema has no other types
        ok = True
    if not ok:
        expected = {
            bool: "true or false",
            int: "an integer",
            float: "a number",
            str: "text",
            list: "a list of text",
        }[kind]
        raise ClinfedError(f"{named}: expected {expected}, got {value!r}")
    check_bounds(f, value, named)
    return value


def check_bounds(f: Field, value: Any, where: str | None = None) -> None:
    if value is None:
        return
    meta = f.metadata
    where = where or "--" + f.name.replace("_", "-")
    if isinstance(value, float):
        if math.isnan(value) or (math.isinf(value) and not meta.get("allow_inf")):
            raise ClinfedError(f"{where} must be a finite number, not {value}")
    choices = meta.get("choices")
    if choices is not None and value not in choices:
        raise ClinfedError(f"{where} must be one of {', '.join(map(str, choices))}, not {value!r}")
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        if "minimum" in meta and value < meta["minimum"]:
            raise ClinfedError(f"{where} must be at least {meta['minimum']}, not {value}")
        if "maximum" in meta and "above" in meta and not meta["above"] < value <= meta["maximum"]:
            raise ClinfedError(
                f"{where} must be in ({meta['above']:g}, {meta['maximum']:g}], not {value}"
            )
        if "below" in meta and "above" in meta and not meta["above"] < value < meta["below"]:
            raise ClinfedError(
                f"{where} must be in ({meta['above']:g}, {meta['below']:g}), not {value}"
            )
        if "maximum" in meta and value > meta["maximum"]:
            raise ClinfedError(f"{where} must be at most {meta['maximum']}, not {value}")
        if "above" in meta and not value > meta["above"]:
            if meta["above"] == 0:
                raise ClinfedError(f"{where} must be positive, not {value}")
            raise ClinfedError(f"{where} must be above {meta['above']}, not {value}")
        if "below" in meta and not value < meta["below"]:
            raise ClinfedError(f"{where} must be below {meta['below']}, not {value}")


def load_file(path: Path) -> dict[str, Any]:
    """Settings from a TOML file or a run's ``config.json``."""
    import json

    import tomllib

    path = Path(path)
    try:
        # utf-8-sig: a byte-order mark (some Windows editors write one) is
        # not a setting, as data files accept it too.
        text = path.read_text(encoding="utf-8-sig")
    except (OSError, UnicodeDecodeError) as exc:
        raise ClinfedError(f"{path}: cannot read ({exc.__class__.__name__})") from None
    try:
        data = json.loads(text) if path.suffix == ".json" else tomllib.loads(text)
    except json.JSONDecodeError as exc:
        raise ClinfedError(f"{path}:{exc.lineno}: not valid JSON ({exc.msg})") from None
    except tomllib.TOMLDecodeError as exc:
        # Python 3.11's message ends "(at line L, column C)": the line leads.
        found = re.search(r"\(at line (\d+), column \d+\)$", str(exc))
        at = f":{found.group(1)}" if found else ""
        reason = str(exc)[: found.start()].strip() if found else str(exc)
        raise ClinfedError(f"{path}{at}: not valid TOML ({reason})") from None
    if path.suffix != ".json":
        lines: dict[str, int] = {}
        for number, raw in enumerate(text.splitlines(), start=1):
            found = _KEY.match(raw)
            if found:
                lines.setdefault(found.group(1).replace("-", "_"), number)
        _KEY_LINES[str(path)] = lines
    if not isinstance(data, dict):
        raise ClinfedError(f"{path}: expected a table of settings")
    return data


def default_of(f: Field) -> Any:
    if f.default is not MISSING:
        return f.default
    if f.default_factory is not MISSING:  # type: ignore[misc]
        return f.default_factory()  # type: ignore[misc]
    return None


def read_run_config(run: Path) -> dict[str, Any]:
    """A run folder's settings, flat (strategy options beside the rest), for
    readers of finished runs (report, audit, sweep tables)."""
    path = Path(run) / "config.json"
    if not path.is_file():
        raise ClinfedError(f"{run}: no config.json (not a clinfed run folder?)")
    config = RunConfig.from_values(load_file(path), str(path))
    flat = asdict(config)
    options = flat.pop("strategy_options")
    return flat | options
