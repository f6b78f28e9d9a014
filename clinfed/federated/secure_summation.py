"""Secure aggregation as the engine's summation: the server side of
:mod:`clinfed.federated.secure`, run over any transport.

A training message asks the site to keep its upload and reply with keys
(stage 1); each reply joins the round's :class:`~clinfed.federated.secure.SecureRound`.
Once every training reply is in, :meth:`SecureRoundSum.close` runs stages
2-4 (shares, masked inputs, unmasking) as further exchanges over the same
transport; the mean is the unmasked sum, never one site's upload.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from typing import Any

from clinfed.federated import payload
from clinfed.federated.messages import Message
from clinfed.federated.secure import SecureRound
from clinfed.federated.summation import Closed, PlainRoundSum, RoundContext

# What a training message asks of a site under secure aggregation.
TRAIN_REQUEST = {"stage": "train"}


class SecureRoundSum:
    """One round's secure sum (uploads of sites that ignore the request are
    averaged in the clear, as a plain round would)."""

    def __init__(self, session: SecureRound, plain: PlainRoundSum, global_state):
        self.session, self.plain, self.global_state = session, plain, global_state

    def add(self, address: str, reply: Any, weight: int) -> str | None:
        if reply.secure is not None:
            return self.session.join(address, reply.secure)
        return self.plain.add(address, reply, weight)

    def close(self, context: RoundContext) -> Closed:
        session = self.session
        if not session.members:
            return Closed()
        in_sum = self._stages(context)
        return Closed(
            dropped=set(session.members) - in_sum,
            failure=None if in_sum else "too few sites stayed to the end of secure aggregation",
        )

    def mean(self, global_state):
        if self.session.members:
            return self.session.mean, frozenset(self.session.sent)
        return self.plain.mean(global_state)

    def _stages(self, context: RoundContext) -> set[str]:
        """Stages 2-4 with the sites that joined; the addresses whose input
        is in the sum (empty: the round's updates are lost, too few sites
        stayed). A site that drops out is marked in its record; every byte
        of the stages is counted in ``bytes_up``."""
        session, round_number = self.session, context.round
        by_site = {r["client"]: r for r in context.records if "bytes_up" in r}
        extra: dict[str, int] = {}

        def stage(requests: dict[str, dict[str, Any]], take: Callable) -> set[str]:
            messages = {
                a: Message("secure", round_number, {}, False, False, secure=request)
                for a, request in requests.items()
            }
            done = set()
            for address, reply in context.exchange(messages):
                site = context.site_of(address)
                why = reply if isinstance(reply, str) else take(address, reply)
                if why is not None:
                    step = requests[address]["stage"]
                    context.log(f"round {round_number}: {site}: dropped out at {step} ({why})")
                    if site in by_site:
                        by_site[site]["secure_dropped"] = f"{step}: {why}"
                    continue
                extra[address] = (
                    extra.get(address, 0)
                    + len(json.dumps(reply.secure or {}).encode())
                    + (len(payload.encode(reply.upload)) if reply.upload else 0)
                )
                done.add(address)
            return done

        def shares(address: str, reply: Any) -> str | None:
            return session.take_shares(address, reply.secure)

        def masked(address: str, reply: Any) -> str | None:
            return session.add_masked(address, reply.upload)

        def unmasked(address: str, reply: Any) -> str | None:
            return session.take_unmask(address, reply.secure)

        joined = set(session.members)
        in_sum: set[str] = set()
        # One site alone would hand the server its own update: no stages.
        if len(joined) >= 2 and len(stage(session.share_requests(), shares)) >= session.t:
            in_sum = stage(session.mask_requests(), masked)
            if len(in_sum) >= session.t:
                stage(session.unmask_requests(), unmasked)
                try:
                    session.mean = session.result(self.global_state)
                except ValueError as exc:  # too few answers, or shares that do not combine
                    context.log(f"round {round_number}: secure aggregation: {exc}")
                    in_sum = set()
            else:
                in_sum = set()
        if not in_sum:
            context.log(
                f"round {round_number}: secure aggregation needs {max(session.t, 2)} of the "
                f"{len(joined)} sites that trained; too few stayed: no update this round"
            )
        for address, member in session.members.items():
            record = by_site.get(context.site_of(address))
            if record is not None:
                # What left the site: its keys and names, then the stages
                # (the plain upload never did).
                keys = json.dumps(member.keys | {"names": member.names}).encode()
                record["bytes_up"] = len(keys) + extra.get(address, 0)
                record["secure"] = address in in_sum
        return in_sum


class SecureSummation:
    """Secure aggregation (SecAgg over the round's sites) at threshold
    ``fraction`` of the sites that join (:func:`clinfed.federated.secure.threshold`)."""

    def __init__(self, fraction: float):
        self.fraction = fraction

    def prepare(self, message: Any) -> Any:
        if message.kind != "train":
            return message
        return dataclasses.replace(message, secure=dict(TRAIN_REQUEST))

    def open(self, aggregator, allowed, global_state) -> SecureRoundSum:
        shapes = {n: tuple(global_state[n].shape) for n in allowed}
        session = SecureRound(shapes, allowed, self.fraction)
        return SecureRoundSum(session, PlainRoundSum(aggregator), global_state)
