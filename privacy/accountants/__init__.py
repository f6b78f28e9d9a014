"""Accountants, one file each, behind one interface (:class:`Accountant`).

Every site releases its exact number of examples (the aggregation weight,
the sampling rate on its ledger lines), so clinfed accounts under the
replace-one relation, where the dataset size is public. ``BUDGET`` (PLD
under replace-one) is the accountant every budget check, calibration and
ledger line uses; ``REFERENCE`` (RDP under replace-one, a looser bound from
another analysis) is shown beside it in reports. A new accountant is a file
here and a line in :data:`ACCOUNTANTS`.
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

__all__ = [
    "ACCOUNTANTS",
    "BUDGET",
    "REFERENCE",
    "RELATION",
    "RELATIONS",
    "Accountant",
    "Mechanism",
    "check_delta",
]
