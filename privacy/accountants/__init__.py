"""Accountants, one file each, behind one interface (:class:`Accountant`).

``rdp`` is the one budgets are checked with (the ledger, the policy, the
calibration); ``pld`` is reported beside it. A new accountant is a file
here and a line in :data:`ACCOUNTANTS`.
"""

from __future__ import annotations

from clinfed.privacy.accountants.base import Accountant, Mechanism, check_delta
from clinfed.privacy.accountants.pld import PLDAccountant
from clinfed.privacy.accountants.rdp import RDPAccountant

ACCOUNTANTS: dict[str, type[Accountant]] = {"rdp": RDPAccountant, "pld": PLDAccountant}
# The accountant every budget check uses.
BUDGET = RDPAccountant()

__all__ = ["ACCOUNTANTS", "BUDGET", "Accountant", "Mechanism", "check_delta"]
