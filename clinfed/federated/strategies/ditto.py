"""Ditto (Li, Hu, Beirami and Smith, "Ditto: Fair and Robust Federated
Learning through Personalization", ICML 2021).

Each round a site does two things with its data:

1. the global update, exactly as FedAvg: train the received global model
   ``w`` and send it;
2. the personal update: train its own model ``v`` on
   ``f(v) + lambda/2 * ||v - w||^2``, ``w`` the global model it received,
   and keep it.

``v`` never leaves the site (it lives with the site's copy of the model,
``personal`` tensors in the site runner). Each site is evaluated with its own
``v`` (the headline ``f1``), beside the global model (``global_f1``).

Under DP both trainings touch the site's data, and ``v`` shapes the
evaluation counts the site releases, so both run DP-SGD and both are
charged: two mechanisms per round (``trainings_per_round = 2``).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, replace

import torch
from torch import nn

from clinfed.core.schema import setting
from clinfed.federated.client import ClientResult, LocalWork, client_update
from clinfed.federated.plan import Plan, full_plan
from clinfed.federated.strategies.base import Strategy, proximal, swapped


@dataclass
class DittoOptions:
    ditto_lambda: float = setting(
        0.1,
        "Ditto: weight of lambda/2 ||v - w_global||^2 in a site's personal loss.",
        minimum=0.0,
        maximum=100.0,
    )


class Ditto(Strategy):
    name = "ditto"
    summary = "FedAvg for the global model, plus a personal model per site kept near it"
    options = DittoOptions
    trainings_per_round = 2

    def plan(self, round_number: int, site: str, names: list[str]) -> Plan:
        return full_plan(names)

    def local_update(self, work: LocalWork) -> ClientResult:
        model = work.model
        received = {k: v.detach().clone() for k, v in model.state_dict().items()}
        result = client_update(work)  # the global update, as FedAvg
        trained_global = {k: v.detach().clone() for k, v in model.state_dict().items()}
        model.load_state_dict(work.personal or received)
        names = [n for n, _ in model.named_parameters()]
        personal = replace(work, plan=Plan(frozenset(names), frozenset(), frozenset()))
        client_update(personal, lambda: proximal(model, self.opts.ditto_lambda, received))
        work.personal.clear()
        work.personal.update({k: v.detach().clone() for k, v in model.state_dict().items()})
        # The site's copy of the shared model is the global one it trained.
        model.load_state_dict(trained_global)
        return result

    def evaluations(
        self, model: nn.Module, personal: dict[str, torch.Tensor]
    ) -> dict[str, contextlib.AbstractContextManager]:
        own = swapped(model, personal) if personal else contextlib.nullcontext()
        return {"": own, "global": contextlib.nullcontext()}
