"""Privacy loss distributions (Google's dp-accounting): a tighter figure than
RDP for the same composition, shown beside it in reports; never used for
budget checks."""

from __future__ import annotations

from collections.abc import Sequence

from clinfed.privacy.accountants.base import Accountant, Mechanism, check_delta


class PLDAccountant(Accountant):
    name = "pld"
    description = "PLD (dp-accounting privacy loss distribution, discretization 1e-3)"

    def __init__(self, discretization: float = 1e-3):
        self.discretization = discretization

    def epsilon(self, mechanisms: Sequence[Mechanism], delta: float) -> float:
        import dp_accounting
        from dp_accounting.pld import PLDAccountant as _PLD

        check_delta(delta)
        accountant = _PLD(value_discretization_interval=self.discretization)
        for m in mechanisms:
            if m.steps > 0:
                event = dp_accounting.PoissonSampledDpEvent(
                    m.sample_rate, dp_accounting.GaussianDpEvent(m.noise_multiplier)
                )
                accountant.compose(event, m.steps)
        return float(accountant.get_epsilon(delta))
