"""Accountants, one file each, behind one interface (:class:`Accountant`).

By default every site releases its exact number of examples (the
aggregation weight, the sampling rate on its ledger lines), so clinfed
accounts under the replace-one relation, where the dataset size is public;
with ``--neighbours add-remove`` a site releases its count once under noise
(:mod:`clinfed.privacy.count`) and is accounted under add/remove.
``budget_accountant(relation)`` (PLD) is the accountant every budget check,
calibration and ledger line uses; ``reference_accountant(relation)`` (RDP,
a looser bound from another analysis) is shown beside it in reports.
``BUDGET`` and ``REFERENCE`` are the default relation's. A new accountant
is a file here and a line in :data:`ACCOUNTANTS`.
"""

from __future__ import annotations

from clinfed.privacy.accountants.base import RELATIONS, Accountant, Mechanism, check_delta
from clinfed.privacy.accountants.pld import PLDAccountant
from clinfed.privacy.accountants.rdp import RDPAccountant

ACCOUNTANTS: dict[str, type[Accountant]] = {"rdp": RDPAccountant, "pld": PLDAccountant}
# The neighbouring relation every figure clinfed reports is under.
RELATION = "replace-one"
# The accountant every budget check uses.
BUDGET = PLDAccountant(RELATION)
# A second analysis of the same composition, for reports.
REFERENCE = RDPAccountant(RELATION)


def budget_accountant(relation: str = RELATION) -> Accountant:
    """The accountant budgets are checked with, under ``relation``."""
    return BUDGET if relation == RELATION else PLDAccountant(relation)


def reference_accountant(relation: str = RELATION) -> Accountant:
    """The second analysis reports show, under ``relation``."""
    return REFERENCE if relation == RELATION else RDPAccountant(relation)


__all__ = [
    "ACCOUNTANTS",
    "BUDGET",
    "REFERENCE",
    "RELATION",
    "RELATIONS",
    "Accountant",
    "Mechanism",
    "budget_accountant",
    "check_delta",
    "reference_accountant",
]
