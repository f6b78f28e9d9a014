"""Rényi DP of the Poisson-subsampled Gaussian (Mironov 2017; Mironov, Talwar
and Zhang 2019), through Opacus's RDP analysis. Every budget check uses it."""

from __future__ import annotations

from collections.abc import Sequence

from opacus.accountants.analysis import rdp as rdp_analysis

from clinfed.privacy.accountants.base import Accountant, Mechanism, check_delta

# Opacus's default order grid, extended: small epsilons need large orders.
ORDERS = [1 + x / 10.0 for x in range(1, 100)] + list(range(12, 64)) + [80, 128, 256, 512]


class RDPAccountant(Accountant):
    name = "rdp"
    description = "RDP (Opacus RDP analysis of the Poisson-subsampled Gaussian)"

    def epsilon(self, mechanisms: Sequence[Mechanism], delta: float) -> float:
        check_delta(delta)
        active = [m for m in mechanisms if m.steps > 0]
        if not active:
            return 0.0
        rdp = sum(
            rdp_analysis.compute_rdp(
                q=m.sample_rate, noise_multiplier=m.noise_multiplier, steps=m.steps, orders=ORDERS
            )
            for m in active
        )
        eps, _ = rdp_analysis.get_privacy_spent(orders=ORDERS, rdp=rdp, delta=delta)
        return float(eps)
