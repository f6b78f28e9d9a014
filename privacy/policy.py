"""A run's privacy policy: each site's noise, budget, ledger and round cost.

Built once before the run folder exists (so a budget that cannot be met
fails before anything is written): with ``--target-epsilon`` it calibrates
each site's DP-SGD noise multiplier for the planned rounds (sites differ in
size, hence in sampling rate); with ``--noise-multiplier`` it uses that
noise everywhere and, if a target is also known, only enforces it.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from clinfed.privacy.accountants import (
    MIN_NOISE_MULTIPLIER,
    RELATION,
    Mechanism,
    budget_accountant,
    calibrate_noise,
    epsilon,
)
from clinfed.privacy.count import COUNT_MECHANISM, count_mechanism, count_path, keep_count
from clinfed.privacy.dpsgd import CLIPPINGS, DPSettings, round_mechanism
from clinfed.privacy.durable import atomic_write_json
from clinfed.privacy.errors import PrivacyError, SettingError
from clinfed.privacy.ledger import Ledger
from clinfed.privacy.randomness import NOT_PRIVATE
from clinfed.privacy.recipe import STEPS_PER_EPOCH, dp_batch_size, lr_scale

UNIT = "one training example (an i2b2 sentence, its windows folded; a MIMIC-III admission)"
RELATION_REASONS = {
    "replace-one": (
        "replace-one: each site's exact number of training examples is released (the "
        "aggregation weight and the sampling rate on its ledger lines), so neighbouring "
        "datasets have the same size and differ in one example"
    ),
    "add-remove": (
        "add/remove: each site releases its number of training units once per ledger (at a "
        "Flower node once per dataset; in process once per run), with "
        "Gaussian noise (std 20, accounted as the ledger's unit-count line), and derives its "
        "sampling rate, steps, noise, aggregation weight and default delta cap from that; no "
        "accounted release depends on the exact count, so neighbouring datasets differ in "
        "one unit added or removed (held-out sizes and units per note or patient are "
        "declared, released exactly)"
    ),
}
PATIENT_CAVEAT = (
    "The guarantee protects one unit. A note or patient with k units at a site is protected "
    "by group privacy only: (k epsilon, k e^((k-1) epsilon) delta), so delta grows fast with "
    "k. No site sends how many units its notes hold (a note's length would leave the site "
    "exactly), so the bound is listed below for several k; --privacy-unit document or "
    "patient protects a whole note or patient instead."
)
# The group sizes the report gives the group bound for (public: no site's k).
GROUP_SIZES = (2, 5, 10, 30)


def group_bound(epsilon: float, delta: float, k: int) -> tuple[float, float]:
    """(epsilon, delta) of a group of ``k`` units under (epsilon, delta)-DP
    (group privacy: k epsilon, k e^((k-1) epsilon) delta, delta capped at 1)."""
    exponent = (k - 1) * epsilon
    grown = 1.0 if exponent > 700 else min(1.0, k * math.exp(exponent) * delta)
    return k * epsilon, grown


def check_settings(
    target_epsilon: float | None,
    delta: float,
    noise_multiplier: float | None,
    max_grad_norm: float,
    clipping: str,
) -> None:
    """Reject impossible privacy settings with a one-line error."""
    if target_epsilon is not None and not target_epsilon > 0:
        raise SettingError("target_epsilon", f"must be positive, not {target_epsilon}")
    if not 0 < delta < 1:
        raise SettingError("delta", f"must be in (0, 1), not {delta}")
    if noise_multiplier is not None and not noise_multiplier >= MIN_NOISE_MULTIPLIER:
        raise SettingError(
            "noise_multiplier",
            f"must be at least {MIN_NOISE_MULTIPLIER} (below it one step costs epsilon in the "
            f"tens and the accountant runs out of memory), not {noise_multiplier}",
        )
    if not max_grad_norm > 0:
        raise SettingError("max_grad_norm", f"must be positive, not {max_grad_norm}")
    if clipping not in CLIPPINGS:
        raise SettingError("clipping", f"must be one of {', '.join(CLIPPINGS)}")


def _calibrated(
    target: float,
    delta: float,
    per_round: Any,
    rounds: int,
    memo: Path | None,
    relation: str = RELATION,
    once: list[Mechanism] | None = None,
) -> float:
    """``calibrate_noise``, remembered in ``memo`` by everything it depends
    on (the mechanisms' structure, target, delta, rounds, accountant)."""
    accountant, once = budget_accountant(relation), once or []

    def calibrate() -> float:
        return calibrate_noise(target, delta, per_round, rounds, accountant=accountant, once=once)

    if memo is None:
        return calibrate()
    described = {
        "target": target,
        "delta": delta,
        "rounds": rounds,
        "round_at_sigma_1": [m.as_dict() for m in per_round(1.0)],
        "accountant": accountant.description,
    }
    if once:
        described["once"] = [m.as_dict() for m in once]
    key = hashlib.sha256(json.dumps(described, sort_keys=True).encode()).hexdigest()
    try:
        known = json.loads(memo.read_text()) if memo.is_file() else {}
    except ValueError:
        known = {}
    sigma = known.get(key)
    if isinstance(sigma, float):
        planned = accountant.epsilon([*once, *(list(per_round(sigma)) * rounds)], delta)
        if planned <= target:
            return sigma
    sigma = calibrate()
    memo.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_json(memo, known | {key: sigma})
    return sigma


def _calibrated_site(
    site: str,
    n: int,
    batch: int,
    epochs: int,
    rounds: int,
    delta: float,
    target_epsilon: float,
    selection: Mechanism | None,
    trainings: int,
    memo: Path | None,
    relation: str,
) -> float:
    """The noise multiplier that spends ``target_epsilon`` over the planned
    rounds at a site of ``n`` units (its count's release included under
    add/remove)."""

    def per_round(sigma: float) -> list[Mechanism]:
        extra = [selection] if selection is not None else []
        return [round_mechanism(n, batch, epochs, sigma)] * trainings + extra

    once = [count_mechanism()] if relation == "add-remove" else []
    try:
        return _calibrated(target_epsilon, delta, per_round, rounds, memo, relation, once)
    except ValueError as err:
        raise PrivacyError(f"{site}: {err}") from None


def _batches(
    sizes: dict[str, int], batch_size: int | None, reference: int | None, steps_per_epoch: int
) -> tuple[dict[str, int], dict[str, float]]:
    """Each site's expected Poisson batch and the factor on its rates: the
    given batch at factor 1, or derived from the site's size and scaled
    from ``reference`` (the task's batch) as :mod:`clinfed.privacy.recipe` says."""
    if batch_size is not None:
        return dict.fromkeys(sizes, batch_size), dict.fromkeys(sizes, 1.0)
    batch_sizes = {site: dp_batch_size(n, steps_per_epoch) for site, n in sizes.items()}
    reference = reference or min(batch_sizes.values(), default=1)
    return batch_sizes, {site: lr_scale(b, reference) for site, b in batch_sizes.items()}


@dataclass
class PrivacyPolicy:
    """Per-site DP settings and ledgers of one run.

    Attributes
    ----------
    folder
        Where the ledgers live (``RUN/privacy/``; a node's state folder under Flower).
    sizes
        Training examples per site (decides each site's sampling rate).
    batch_sizes
        Expected Poisson batch per site: the run's ``--batch-size``, or
        derived from the site's size (:mod:`clinfed.privacy.recipe`).
    noise
        DP-SGD noise multiplier per site.
    budget
        Epsilon no site may exceed (``None``: recorded, not enforced).
    selection
        The per-round cost of a private layer selection, if any.
    """

    folder: Path
    sizes: dict[str, int]
    batch_sizes: dict[str, int]
    epochs: int
    rounds: int
    delta: float
    noise: dict[str, float]
    max_grad_norm: float
    clipping: str
    budget: float | None
    selection: Mechanism | None = None
    warnings: list[str] = field(default_factory=list)
    trainings: int = 1  # DP-SGD trainings per round (Ditto trains twice)
    reproducible: bool = False  # noise from the public seed: NOT private
    # A node's ledger outlives runs: its file, the run charging it, and the
    # site's own cap on the whole ledger (``budget`` then caps this run).
    ledger_paths: dict[str, Path] = field(default_factory=dict)
    run: str | None = None
    ledger_budget: float | None = None
    # A node's high-water mark of its ledgers (outside the ledger folder).
    ledger_mark: Path | None = None
    # The privacy unit: its name, what it is in words, and what groups its
    # units (document or patient; None when the unit is the whole group).
    # How many units a group holds is never recorded: it is exact and private.
    unit: str = "example"
    unit_text: str = UNIT
    group_of: str | None = None
    # With a derived batch, each site's factor on its rates (recipe.lr_scale).
    lr_scales: dict[str, float] = field(default_factory=dict)
    # The neighbouring relation; under add-remove ``sizes`` are the sites'
    # released noisy counts (clinfed.privacy.count), never the exact ones.
    relation: str = RELATION
    _ledgers: dict[str, Ledger] = field(default_factory=dict, repr=False)

    @classmethod
    def build(
        cls,
        folder: Path,
        sizes: dict[str, int],
        batch_size: int | None,
        epochs: int,
        rounds: int,
        delta: float,
        target_epsilon: float | None,
        noise_multiplier: float | None,
        max_grad_norm: float = 1.0,
        clipping: str = "auto",
        selection: Mechanism | None = None,
        trainings: int = 1,
        reproducible: bool = False,
        reference_batch: int | None = None,
        memo: Path | None = None,
        relation: str = RELATION,
        steps_per_epoch: int = STEPS_PER_EPOCH,
    ) -> PrivacyPolicy:
        """Calibrate (or take) each site's noise for the planned rounds.

        Under ``relation`` ``add-remove``, ``sizes`` must be the sites'
        released noisy counts: everything here derives from them, and each
        site's first charge covers the count's release too.

        ``batch_size`` ``None`` derives each site's batch from its size and
        scales its rates from ``reference_batch`` (the task's batch), as
        :mod:`clinfed.privacy.recipe` says (``steps_per_epoch``: the plan's).
        ``memo``: a JSON file of noise
        multipliers calibrated before (a Flower node calibrates for every
        message, and a calibration takes seconds); a remembered value is
        used only after checking it still meets the target.
        """
        check_settings(target_epsilon, delta, noise_multiplier, max_grad_norm, clipping)
        batch_sizes, lr_scales = _batches(sizes, batch_size, reference_batch, steps_per_epoch)
        if target_epsilon is None and noise_multiplier is None:
            raise PrivacyError("DP needs `target_epsilon` or `noise_multiplier`")
        warnings = [
            f"--delta {delta:g} is not below 1/n = {1 / n:.2g} for {site} ({n} examples): "
            "a delta that large allows releasing an example outright"
            for site, n in sorted(sizes.items())
            if delta >= 1 / n
        ]
        plan = (epochs, rounds, delta, target_epsilon, selection, trainings, memo, relation)
        noise = {
            site: noise_multiplier
            if noise_multiplier is not None
            else _calibrated_site(site, n, batch_sizes[site], *plan)
            for site, n in sizes.items()
        }
        policy = cls(
            Path(folder), dict(sizes), batch_sizes, epochs, rounds, delta, noise, max_grad_norm,
            clipping, target_epsilon, selection, warnings, trainings, reproducible,
            lr_scales=lr_scales, relation=relation,
        )  # fmt: skip
        if reproducible:
            policy.warnings.append(NOT_PRIVATE)
        if target_epsilon is not None and noise_multiplier is not None:
            for site in sizes:
                if policy.planned_epsilon(site) > target_epsilon:
                    policy.warnings.append(
                        f"{site}: --noise-multiplier {noise_multiplier} reaches epsilon "
                        f"{target_epsilon} before round {rounds}; later rounds will be refused"
                    )
        return policy

    def settings(self, site: str) -> DPSettings:
        return DPSettings(
            self.noise[site],
            self.max_grad_norm,
            self.clipping,
            self.reproducible,
            self.unit,
            self.batch_sizes[site],
            self.lr_scales.get(site, 1.0),
            self.sizes[site] if self.relation == "add-remove" else None,
        )

    def round_mechanisms(self, site: str, round_number: int | None = None) -> list[Mechanism]:
        """What one round costs ``site``: its DP-SGD and any private
        selection, and under add/remove the count's release with the site's
        first charge of the run (``round_number`` ``None``: a first round)."""
        sgd = round_mechanism(
            self.sizes[site], self.batch_sizes[site], self.epochs, self.noise[site]
        )
        extra = [self.selection] if self.selection is not None else []
        if self.relation == "add-remove" and not self._count_charged(site, round_number):
            extra.append(count_mechanism())
        return [sgd] * self.trainings + extra

    def _count_charged(self, site: str, round_number: int | None) -> bool:
        """Whether the count's release is on the site's ledger already: from
        another run on the same dataset, once per dataset at a node, or from
        an earlier round of this run (a re-run of the same round charges the
        same mechanisms again)."""
        if round_number is None:
            return False
        return any(
            line["mechanism"] == COUNT_MECHANISM
            and (line.get("run") != self.run or line["round"] < round_number)
            for line in self.ledger(site).lines
        )

    def ledger_path(self, site: str) -> Path:
        """The site's ledger file (a node's outlives the run)."""
        return self.ledger_paths.get(site, self.folder / f"{site}.jsonl")

    def keep_count(self, site: str) -> None:
        """Under add/remove: keep the site's released count beside its
        ledger before the first charge that covers it, so every later run
        and message releases the same one (clinfed.privacy.count)."""
        if self.relation != "add-remove":
            return
        kept = keep_count(count_path(self.ledger_path(site)), self.sizes[site])
        if kept != self.sizes[site]:
            raise PrivacyError(
                f"{count_path(self.ledger_path(site))}: another process kept this dataset's "
                "released count at the same moment; nothing left the site: try again"
            )

    def charge_count(self, site: str) -> bool:
        """Under add/remove: keep the released count and charge it on the
        dataset's ledger once (round 0), before any reply or record can carry
        it (a refused or evaluate-only reply carries it as much as a trained
        one). False when the budget does not afford it (nothing charged)."""
        if self.relation != "add-remove":
            return True
        self.keep_count(site)
        return self.ledger(site).charge_once(count_mechanism())

    def planned_epsilon(self, site: str) -> float:
        """Epsilon of the site's planned run (count, if released, included)."""
        first = self.round_mechanisms(site)
        later = [m for m in first if m.name != COUNT_MECHANISM]
        return epsilon([*first, *(later * (self.rounds - 1))], self.delta, self.relation)

    def ledger(self, site: str) -> Ledger:
        if site not in self._ledgers:
            path = self.ledger_path(site)
            one_run = site not in self.ledger_paths
            self._ledgers[site] = Ledger(
                path,
                site,
                self.delta,
                self.budget if one_run else self.ledger_budget,
                accountant=budget_accountant(self.relation),
                not_private=NOT_PRIVATE if self.reproducible else None,
                run=self.run,
                run_budget=None if one_run else self.budget,
                mark=None if one_run else self.ledger_mark,
            )
            ledger = self._ledgers[site]
            # Lines from before relations were recorded are replace-one (the only one then).
            found = {str(line.get("relation", RELATION)) for line in ledger.lines}
            other = sorted(found - {self.relation})
            if other:
                # Charges under one relation do not compose with the other's.
                del self._ledgers[site]
                raise PrivacyError(
                    f"{path}: this ledger accounts under {other[0]} neighbours; a run under "
                    f"{self.relation} cannot charge it (one relation per ledger)"
                )
        return self._ledgers[site]

    def describe(self) -> dict[str, Any]:
        """The policy as written to ``RUN/privacy/policy.json``."""
        return self.describe_common() | {
            "sites": {site: self.describe_site(site) for site in sorted(self.sizes)},
        }

    def describe_common(self) -> dict[str, Any]:
        """What every site's policy of a run shares."""
        return {
            "unit": self.unit_text,
            "privacy_unit": self.unit,
            "patient_caveat": PATIENT_CAVEAT if self.unit == "example" else None,
            "group_of": self.group_of if self.unit == "example" else None,
            "accountant": budget_accountant(self.relation).description,
            "relation": self.relation,
            "relation_reason": RELATION_REASONS[self.relation],
            "delta": self.delta,
            "target_epsilon": self.budget,
            "max_grad_norm": self.max_grad_norm,
            "clipping": self.clipping,
            "planned_rounds": self.rounds,
            "selection": self.selection.as_dict() if self.selection else None,
            "trainings_per_round": self.trainings,
            "noise": "reproducible from the public seed: NOT private"
            if self.reproducible
            else "secret: OS entropy at the site, Opacus secure_mode",
            "warnings": self.warnings,
        }

    def describe_site(self, site: str) -> dict[str, Any]:
        sgd = round_mechanism(
            self.sizes[site], self.batch_sizes[site], self.epochs, self.noise[site]
        )
        planned = self.planned_epsilon(site)
        described = {
            # Under add/remove: the released noisy count.
            "examples": self.sizes[site],
            "noise_multiplier": sgd.noise_multiplier,
            "batch_size": self.batch_sizes[site],
            "lr_scale": self.lr_scales.get(site, 1.0),
            "sample_rate": sgd.sample_rate,
            "steps_per_round": sgd.steps,
            "planned_epsilon": planned,
        }
        return described
