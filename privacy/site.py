"""The privacy layer around one site's update (every transport uses it).

A private site runs, in this order: budget check against its own policy ->
write-ahead ledger line (fsynced before anything is computed for release)
-> the DP-SGD update -> the release filter of its record. A site over
budget releases nothing but a refusal.
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
        mechanisms = self.policy.round_mechanisms(self.site)
        # Write-ahead: checked and charged (under the ledger's lock) before
        # anything is computed for release.
        spent = ledger.charge(round_number, mechanisms)
        if spent is None:
            return {}, {
                "round": round_number,
                "client": self.site,
                "refused": "privacy budget",
                "epsilon": ledger.spent,
                "epsilon_if_trained": ledger.after(mechanisms),
            }
        upload, record = update(self.policy.settings(self.site))
        return upload, release_filter(record) | {"epsilon": spent}

    def report(self) -> dict[str, Any]:
        """What the site tells the server about its spend (its ledger lines)."""
        return {
            "lines": self.ledger.lines,
            "site": self.policy.describe_site(self.site),
            "budget": self.policy.budget,
            "policy": self.policy.describe_common(),
        }
