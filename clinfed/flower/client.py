"""The ClientApp: a Flower message in, :class:`~clinfed.flower.site.Site` work, a reply out.

Errors a site operator can fix (a bad node config, bad data) are raised as
:class:`~clinfed.errors.ClinfedError`; Flower turns them into an error
reply, which the server logs as that site's failure. Messages name files
and lines, never note text.
"""

from __future__ import annotations

from flwr.app import Context, Message
from flwr.clientapp import ClientApp

from clinfed.errors import ClinfedError
from clinfed.federated.strategies import STRATEGIES
from clinfed.flower.records import from_records, to_records
from clinfed.flower.site import NodeConfig, Site
from clinfed.pipeline import RunConfig
from clinfed.quiet import quiet_libraries

quiet_libraries()
app = ClientApp()


def _handle(msg: Message, context: Context, train: bool) -> Message:
    download, settings = from_records(msg.content)
    config = RunConfig(**settings["run_config"])
    node = NodeConfig.parse(dict(context.node_config))
    site = Site(config, node, settings["run_name"])
    try:
        shares_model = STRATEGIES[config.strategy].shares_model
        if shares_model and not settings["full"] and not site.model_path.exists():
            # (A site with a model of its own starts from the run's seeded
            # initial model, which it builds itself.)
            raise ClinfedError(
                f"{site.model_path}: the site's model copy is missing; the server "
                "sends the whole model next round"
            )
        site.receive(download)
        report: dict = {"site": site.name}
        if settings["evaluate"]:
            report["eval"] = site.evaluate(write_predictions=not train)
        upload = {}
        if train:
            upload, report["record"] = site.train_round(
                settings["round"], settings["strategy_state"]
            )
        report["ledger"] = site.ledger_report()
    finally:
        site.close()
    return Message(to_records(upload, report), reply_to=msg)


@app.train()
def train(msg: Message, context: Context) -> Message:
    return _handle(msg, context, train=True)


@app.evaluate()
def evaluate(msg: Message, context: Context) -> Message:
    return _handle(msg, context, train=False)
