"""The concerns a run's settings fall into, one dataclass each (see
:mod:`clinfed.settings`), and the names the command line and files share."""

from __future__ import annotations

import typing
from dataclasses import MISSING, dataclass, field, fields, make_dataclass

from clinfed.core.schema import setting

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
        None,
        "Model window in tokens (default: the task's; at most what the model reads: 512 for "
        "BERT-family encoders, the context of a decoder).",
        minimum=8,
        maximum=131_072,
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
    adapter: str | None = setting(
        None,
        "Default: none, or under DP the task's measured private plan (ICD coding: head; "
        "not for safl, fedfrozen or pfeddc, which choose what trains). "
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
        16.0, "lora: scale (the update is B A times alpha/rank).", above=0.0, maximum=4096.0
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
        "How the data is dealt to sites: sites (one per hospital, as the corpus says), iid, "
        "or dirichlet label skew (with --sites N).",
        choices=("sites", "iid", "dirichlet"),
        simulator_only=True,
    )
    sites: int = setting(
        0,
        "With --partition iid|dirichlet: this many synthetic sites.",
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
    # Bounded: the noise is sized to it, so a huge norm trains on noise alone
    # while the ledger charges as for a useful run.
    max_grad_norm: float = setting(
        1.0, "DP-SGD per-example clipping norm.", above=0.0, maximum=1000.0
    )
    neighbours: str = setting(
        "add-remove",
        "add-remove: each site releases its unit count once per ledger (per dataset at a "
        "node, per run in process) with Gaussian noise "
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
        "Under DP, at most this many units in one forward/backward pass, or carried together "
        "across the passes a note's sentences run in (0: on a GPU, as many as half its free "
        "memory holds; on the CPU no cap). A pass "
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
    """A setting as a library message names it (```public_data```): the
    command line words it as a flag, the API as a keyword
    (:func:`clinfed.core.errors.name_settings`)."""
    return f"`{name}`"


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
    "synthetic_data",
}
