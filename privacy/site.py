"""The privacy layer around one site's update (every transport uses it).

A private site runs, in this order: budget check against its own policy ->
write-ahead charge on its ledger (fsynced before anything is computed for
release) -> the DP-SGD update -> the release filter of its record ->
:meth:`SitePrivacy.release` (fsynced before the reply leaves; in-process,
before the round's results are written anywhere). A site over budget
releases nothing but a refusal.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from clinfed.privacy.dpsgd import DPSettings
from clinfed.privacy.policy import PrivacyPolicy

# Computed on private examples and not covered by the accounting, so never
# released under DP: the training loss, the number of tokens trained on, and
# the site's wall time (both track the sizes of the sampled batches).
NOT_RELEASED = ("train_loss", "train_tokens", "wall_s")

Update = Callable[[DPSettings | None], tuple[dict[str, torch.Tensor], dict[str, Any]]]


def release_filter(record: dict[str, Any]) -> dict[str, Any]:
    """A site record as it may leave a private site."""
    return {k: v for k, v in record.items() if k not in NOT_RELEASED}


class SitePrivacy:
    """One site's DP policy and ledger, applied around its updates."""

    def __init__(self, policy: PrivacyPolicy, site: str):
        self.policy, self.site = policy, site

    @property
    def ledger(self):
        return self.policy.ledger(self.site)

    def run(
        self, round_number: int, update: Update
    ) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        ledger = self.ledger
        # Under add/remove the released count is kept and charged once, the
        # same way at a node and in process, before anything carries it.
        counted = self.policy.charge_count(self.site)
        mechanisms = self.policy.round_mechanisms(self.site, round_number)
        # Write-ahead: checked and charged (under the ledger's lock) before
        # anything is computed for release.
        if not counted or ledger.charge(round_number, mechanisms) is None:
            return {}, {
                "round": round_number,
                "site": self.site,
                "refused": "privacy budget",
                "epsilon": ledger.run_spent,
                "epsilon_if_trained": ledger.after(mechanisms),
            }
        try:
            upload, record = update(self.policy.settings(self.site))
        except BaseException:
            ledger.abandon(round_number)  # nothing left the site: a re-run reuses the charge
            raise
        ledger.settle(round_number)
        return upload, release_filter(record) | {"epsilon": ledger.run_spent}

    def resend(self, round_number: int) -> None:
        """A replay of round ``round_number``'s released update leaves again:
        nothing new is computed, so nothing new is charged. If the crash came
        between keeping the update and its release line, the round's
        unreleased charge is claimed again, for :meth:`release` to mark."""
        ledger = self.ledger
        if ledger.unreleased(round_number):
            ledger.charge(round_number, self.policy.round_mechanisms(self.site, round_number))
            ledger.settle(round_number)

    def release(self, round_number: int) -> None:
        """Mark this round's charge released: call it just before anything
        computed in the round leaves the site."""
        self.ledger.release(round_number)

    def report(self) -> dict[str, Any]:
        """What the site tells the server about its spend: this run's
        charges (``epsilon`` this run's, ``ledger_epsilon`` the site's
        total over every run), and its ledger's digest."""
        ledger = self.ledger
        lines = [
            {k: v for k, v in line.items() if k != "run_epsilon"}
            | {
                "epsilon": line.get("run_epsilon", line["epsilon"]),
                "ledger_epsilon": line["epsilon"],
            }
            for line in ledger.run_lines()
        ]
        return {
            "lines": lines,
            "digest": ledger.digest(),
            "site": self.policy.describe_site(self.site),
            "budget": self.policy.budget,
            "policy": self.policy.describe_common(),
        }
