"""What a node does with one Flower message: the records in, the site
runner's work, the reply records out.

Used by the ClientApp when it handles a message itself, and by the node's
executor (:mod:`clinfed.flower.executor`), which keeps one :class:`SiteCache`
so that the imports, the encoded data and the model are built once per
run, not once per message.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import replace
from typing import Any

from flwr.app import RecordDict

from clinfed.core.device import use_threads
from clinfed.core.provenance import data_fingerprint
from clinfed.flower.records import read_message, reply_records
from clinfed.runners.node import NodeConfig, NodeSite
from clinfed.settings import RunConfig


class SiteCache:
    """The site a node built for its latest run, kept between messages.

    It is used again only while nothing it was built from has changed: the
    run's name and settings, the node's own configuration and the data
    folder's contents (fingerprint). Anything else builds the site again,
    with every check a fresh build makes. The ledger needs no such care:
    it checks its file against its seal before every charge.
    """

    def __init__(self) -> None:
        self.key: tuple | None = None
        self.site: NodeSite | None = None

    def get(self, config: RunConfig, node: NodeConfig, run: Mapping[str, Any]) -> NodeSite:
        data_fp = data_fingerprint(node.data, node.state / "ledger" / "fingerprints.json")
        key = (
            str(run["name"]),
            json.dumps(run["config"], sort_keys=True, default=str),
            repr(node),
            data_fp,
        )
        if self.site is not None and key == self.key:
            return self.site
        self.drop()
        self.site = NodeSite(config, node, str(run["name"]))
        self.key = key
        return self.site

    def drop(self) -> None:
        if self.site is not None:
            self.site.close()
        self.site, self.key = None, None


def answer(
    content: RecordDict, node_values: Mapping[str, Any], cache: SiteCache | None = None
) -> RecordDict:
    """The reply records to one message's records.

    Raises :class:`~clinfed.core.errors.ClinfedError` when the site's policy or
    data refuses the message.
    """
    message, run = read_message(content)
    config = RunConfig.from_values(run["config"], "the server's run config")
    node = NodeConfig.parse(dict(node_values))
    if cache is None:
        site = NodeSite(config, node, run["name"])
        try:
            reply = site.handle(message)
        finally:
            site.close()
    else:
        site = cache.get(config, node, run)
        # The thread count is the node's (or the run's), whatever the
        # executor last used.
        use_threads(node.threads, config.threads)
        try:
            reply = site.handle(message)
        except BaseException:
            cache.drop()  # a failed message may leave the site half-updated
            raise
    if not site.share_ledger:
        reply = replace(reply, ledger=None)
    return reply_records(reply)
