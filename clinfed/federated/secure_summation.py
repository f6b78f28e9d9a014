"""Secure aggregation as the engine's summation: the server side of
:mod:`clinfed.federated.secure`, run over any transport.

A training message asks the site to keep its upload and reply with keys
(stage 1); each reply joins the round's :class:`SecureRound`.
Once every training reply is in, :meth:`SecureRoundSum.close` runs stages
2-4 (shares, masked inputs, unmasking) as further exchanges over the same
transport; the mean is the unmasked sum, never one site's upload.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from clinfed.core import payload
from clinfed.federated.messages import Message
from clinfed.federated.secure import SCALE, WEIGHTS, _mask_key, _unb64, add_mask, threshold
from clinfed.federated.summation import Closed, PlainRoundSum, RoundContext


@dataclass
class _Member:
    address: str
    index: int
    keys: dict[str, str]
    names: list[str]
    shares: dict[str, str] = field(default_factory=dict)  # to index -> ciphertext


class SecureRound:
    """The server's side of one round's secure aggregation.

    It holds public keys, relayed ciphertext, a running masked sum per name
    (memory flat in the number of sites) and, at the end, the unmasked sum:
    never one site's upload.

    Parameters
    ----------
    shapes
        The global model's shape of each name a site may send.
    allowed
        The names the round's envelope accepts.
    fraction
        The threshold as a share of the sites that join (see :func:`threshold`).
    """

    def __init__(
        self, shapes: Mapping[str, tuple[int, ...]], allowed: frozenset[str], fraction: float
    ):
        self.shapes, self.allowed, self.fraction = dict(shapes), allowed, fraction
        self.members: dict[str, _Member] = {}  # address -> member (stage 1)
        self.shared: list[str] = []  # addresses whose shares arrived (stage 2)
        self.masked: list[str] = []  # addresses whose masked input was added (stage 3)
        self.names: list[str] = []
        self.t = 0
        self._sums: dict[str, np.ndarray] = {}
        self._unmask: list[dict[str, str]] = []
        self.sent: frozenset[str] = frozenset()
        self.mean: dict[str, torch.Tensor] = {}

    # stage 1 -------------------------------------------------------------
    def join(self, address: str, secure: Any) -> str | None:
        """A training reply's keys and names; why it cannot join, or ``None``."""
        try:
            keys = {k: secure[k] for k in ("encrypt", "mask")}
            names = list(secure["names"])
            for value in keys.values():
                _unb64(value)
        except (KeyError, TypeError, ValueError):
            return "secure aggregation: reply without its public keys"
        unexpected = sorted(set(names) - self.allowed)
        if unexpected:
            return f"unexpected parameter {unexpected[0]} ({len(unexpected)} in all)"
        self.members[address] = _Member(address, 0, keys, sorted(set(names)))
        return None

    def share_requests(self) -> dict[str, dict[str, Any]]:
        """Stage 2: every member gets its index and all members' keys."""
        for index, address in enumerate(sorted(self.members), start=1):
            self.members[address].index = index
        self.t = threshold(len(self.members), self.fraction)
        keys = {str(m.index): m.keys for m in self.members.values()}
        return {
            a: {"stage": "share", "index": m.index, "threshold": self.t, "keys": keys}
            for a, m in self.members.items()
        }

    # stage 2 -------------------------------------------------------------
    def take_shares(self, address: str, secure: Any) -> str | None:
        member = self.members[address]
        expected = {str(m.index) for m in self.members.values()} - {str(member.index)}
        shares = secure.get("shares") if isinstance(secure, dict) else None
        if not isinstance(shares, dict) or set(shares) != expected:
            return "secure aggregation: shares missing or addressed to unknown sites"
        member.shares = {str(k): str(v) for k, v in shares.items()}
        self.shared.append(address)
        return None

    def mask_requests(self) -> dict[str, dict[str, Any]]:
        """Stage 3: the members whose shares arrived, the round's names and
        each member's incoming ciphertext."""
        group = [self.members[a] for a in sorted(self.shared)]
        indices = [m.index for m in group]
        self.names = sorted({n for m in group for n in m.names})
        self._sums = {n: np.zeros(math.prod(self.shapes[n]), np.uint64) for n in self.names}
        self._sums[WEIGHTS] = np.zeros(len(self.names), np.uint64)
        requests = {}
        for member in group:
            incoming = {
                str(other.index): other.shares[str(member.index)]
                for other in group
                if other is not member
            }
            requests[member.address] = {
                "stage": "mask",
                "members": indices,
                "names": self.names,
                "shapes": {n: list(self.shapes[n]) for n in self.names},
                "shares": incoming,
            }
        return requests

    # stage 3 -------------------------------------------------------------
    def add_masked(self, address: str, upload: Mapping[str, torch.Tensor]) -> str | None:
        """Fold one masked input into the running sums (never kept alone)."""
        if set(upload) != set(self._sums):
            return "secure aggregation: masked input with other names than the round's"
        for name, value in upload.items():
            expected = (len(self.names),) if name == WEIGHTS else tuple(self.shapes[name])
            if tuple(value.shape) != expected or value.dtype != torch.int64:
                return f"secure aggregation: {name}: not int64 of shape {expected}"
        for name, value in upload.items():
            self._sums[name] += value.contiguous().numpy().ravel().view(np.uint64)
        self.masked.append(address)
        return None

    def unmask_requests(self) -> dict[str, dict[str, Any]]:
        """Stage 4: survivors (masked input in) and dropouts (shares only)."""
        survivors = sorted(self.members[a].index for a in self.masked)
        dropped = sorted(self.members[a].index for a in self.shared if a not in self.masked)
        return {
            a: {"stage": "unmask", "survivors": survivors, "dropped": dropped} for a in self.masked
        }

    # stage 4 -------------------------------------------------------------
    def take_unmask(self, address: str, secure: Any) -> str | None:
        shares = secure.get("shares") if isinstance(secure, dict) else None
        expected = {str(self.members[a].index) for a in self.shared}
        if not isinstance(shares, dict) or set(shares) != expected:
            return "secure aggregation: unmasking shares missing"
        self._unmask.append({str(k): str(v) for k, v in shares.items()})
        return None

    def result(self, current: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Remove the masks; the weighted mean per name (``current`` where
        no site sent a name). Raises ValueError when the shares do not
        rebuild the secrets."""
        from flwr.common.secure_aggregation.crypto.shamir import combine_shares
        from flwr.common.secure_aggregation.crypto.symmetric_encryption import (
            generate_shared_key,
        )
        from flwr.supercore.primitives.asymmetric import (
            bytes_to_private_key,
            bytes_to_public_key,
        )

        if len(self._unmask) < self.t:
            raise ValueError(f"{len(self._unmask)} unmasking answers, {self.t} needed")
        by_index = {self.members[a].index: self.members[a] for a in self.shared}
        survivors = {self.members[a].index for a in self.masked}
        order = [*self.names, WEIGHTS]
        vectors = [self._sums[n] for n in order]
        for index in sorted(by_index):
            shares = [_unb64(answer[str(index)]) for answer in self._unmask[: self.t]]
            secret = combine_shares(shares)
            if index in survivors:
                add_mask(vectors, secret, -1)  # the member's self-mask
                continue
            # A dropout's mask key: remove its pairwise masks from each survivor.
            private = bytes_to_private_key(secret)
            for other in sorted(survivors):
                public = bytes_to_public_key(_unb64(by_index[other].keys["mask"]))
                key = _mask_key(generate_shared_key(private, public))
                # The survivor added +PRG when its index is the smaller one.
                add_mask(vectors, key, -1 if other < index else +1)
        weights = self._sums[WEIGHTS].view(np.int64)
        new = {}
        for name, value in current.items():
            new[name] = value.clone()
        sent = set()
        for position, name in enumerate(self.names):
            weight = int(weights[position])
            if weight <= 0:
                continue
            total = self._sums[name].view(np.int64).astype(np.float64)
            mean = (total / (weight * SCALE)).reshape(self.shapes[name])
            new[name] = torch.from_numpy(mean).to(current[name].dtype)
            sent.add(name)
        self.sent = frozenset(sent)
        return new


# ------------------------------------------------------------- a site


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
        by_site = {r["site"]: r for r in context.records if "bytes_up" in r}
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
