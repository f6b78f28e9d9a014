"""The in-process transport: every site in this process, one after another.

Sites share one model object (weights are loaded into it, never copied per
site) and one optimizer is alive at a time, so memory does not grow with
the number of sites. Messages and replies still go through their wire
form, the codec Flower uses too (:mod:`clinfed.federated.messages`): each is
encoded and read back, so a site gets exactly what a remote site would, the
server reads exactly what a remote site would send, and the bytes counted
are the bytes sent.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping

from clinfed.federated.messages import (
    Message,
    Reply,
    decode_message,
    decode_reply,
    encode_message,
    encode_reply,
)
from clinfed.federated.site import SiteRunner


class InProcessTransport:
    """Delivers each message to the :class:`SiteRunner` of that site."""

    def __init__(self, runners: Mapping[str, SiteRunner]):
        self.runners = dict(runners)

    def addresses(self) -> list[str]:
        return sorted(self.runners)

    def exchange(
        self, messages: Mapping[str, Message], timeout: float
    ) -> Iterator[tuple[str, Reply | str]]:
        del timeout  # a site in this process answers or raises
        for address in sorted(messages):
            sent, _ = decode_message(encode_message(messages[address]))
            # Nothing leaves a site here until the engine writes the round:
            # the release is marked then (:meth:`release`).
            reply = self.runners[address].handle(sent, release=False)
            yield address, decode_reply(encode_reply(reply))

    def release(self, round_number: int, sites: list[str]) -> dict[str, dict]:
        """The engine is about to write round ``round_number``'s results:
        each site that trained marks its charge released first (a crash
        before this point re-runs the round on the same charge). Returns
        each ledger's digest after it."""
        digests = {}
        for site in sites:
            digest = self.runners[site].release(round_number)
            if digest is not None:
                digests[site] = digest
        return digests
