"""Differential privacy for clinfed: DP-SGD at the sites, a per-site RDP
ledger over what each site released, budgets and calibration, reports and an
empirical membership-inference audit.

Privacy unit: one training example (an i2b2 sentence window, a MIMIC-III
admission). See ``ARCHITECTURE.md`` and ``../shared/DESIGN.md`` section 4.
"""

from clinfed.privacy.accountants import ACCOUNTANT, Mechanism, calibrate_noise, epsilon
from clinfed.privacy.ledger import Ledger

__all__ = ["ACCOUNTANT", "Ledger", "Mechanism", "calibrate_noise", "epsilon"]
