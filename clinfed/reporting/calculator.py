"""``clinfed privacy epsilon|noise``: the accountant with checked inputs."""

from __future__ import annotations

import math
from typing import Any

from clinfed.errors import ClinfedError
from clinfed.privacy.accountants import (
    ACCOUNTANT,
    MIN_NOISE_MULTIPLIER,
    REFERENCE_ACCOUNTANT,
    RELATION,
    Mechanism,
    calibrate_noise,
    epsilon,
    reference_epsilon,
)


def _finite(flag: str, value: float) -> None:
    if not math.isfinite(value):
        raise ClinfedError(f"{flag} must be a finite number, not {value}")


def _check(sample_rate: float, steps: int, delta: float) -> None:
    _finite("--sample-rate", sample_rate)
    _finite("--delta", delta)
    if not 0 < sample_rate <= 1:
        raise ClinfedError(f"--sample-rate must be in (0, 1], not {sample_rate}")
    if steps < 1:
        raise ClinfedError(f"--steps must be at least 1, not {steps}")
    if not 0 < delta < 1:
        raise ClinfedError(f"--delta must be in (0, 1), not {delta}")


def epsilon_for(sample_rate: float, noise: float, steps: int, delta: float) -> dict[str, Any]:
    """Epsilon (the budget figure, and the reference RDP bound beside it) of
    ``steps`` subsampled Gaussian steps."""
    _check(sample_rate, steps, delta)
    _finite("--noise-multiplier", noise)
    if not noise >= MIN_NOISE_MULTIPLIER:
        raise ClinfedError(
            f"--noise-multiplier must be at least {MIN_NOISE_MULTIPLIER} (below it one step "
            f"costs epsilon in the tens and the accountant runs out of memory), not {noise}"
        )
    mechanism = [Mechanism("dp-sgd", noise, sample_rate, steps)]
    return {
        "epsilon": epsilon(mechanism, delta),
        "epsilon_rdp": reference_epsilon(mechanism, delta),
        "delta": delta,
        "relation": RELATION,
        "accountant": ACCOUNTANT,
        "reference_accountant": REFERENCE_ACCOUNTANT,
    }


def noise_for(target: float, delta: float, sample_rate: float, steps: int) -> dict[str, Any]:
    """The smallest noise multiplier whose epsilon is at most ``target``."""
    _check(sample_rate, steps, delta)
    _finite("--target-epsilon", target)
    if not target > 0:
        raise ClinfedError(f"--target-epsilon must be positive, not {target}")

    def one_step(sigma: float) -> list[Mechanism]:
        return [Mechanism("dp-sgd", sigma, sample_rate, steps)]

    try:
        sigma = calibrate_noise(target, delta, one_step, rounds=1)
    except ValueError as err:
        raise ClinfedError(str(err)) from None
    return {
        "noise_multiplier": sigma,
        "epsilon": epsilon(one_step(sigma), delta),
        "delta": delta,
        "relation": RELATION,
        "accountant": ACCOUNTANT,
    }
