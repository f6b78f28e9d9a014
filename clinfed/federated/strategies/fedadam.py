"""FedAdam (Reddi et al., "Adaptive Federated Optimization", ICLR 2021).

Sites train and send the whole model as in FedAvg. The server treats the
difference between the sites' weighted mean and the current global model as
a pseudo-gradient and takes an Adam step on it::

    delta = mean_i(x_i) - x
    m = beta1 * m + (1 - beta1) * delta
    v = beta2 * v + (1 - beta2) * delta^2
    x = x + server_lr * m / (sqrt(v) + tau)

without bias correction, as in the paper. ``tau`` bounds the adaptivity: for
updates much smaller than ``tau`` the step is about ``server_lr / tau``
times FedAvg's. Only parameters some site sent move; ``m`` and ``v`` are
server state, saved as safetensors at every commit.

The server step uses only what sites released, so under DP it is
post-processing and costs nothing.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from clinfed.core.schema import setting
from clinfed.federated.plan import Plan, full_plan
from clinfed.federated.strategies.base import Strategy


@dataclass
class FedAdamOptions:
    server_lr: float = setting(
        1e-3, "FedAdam: the server's Adam step size.", above=0.0, maximum=1.0
    )
    server_beta1: float = setting(0.9, "FedAdam: first-moment decay.", minimum=0.0, below=1.0)
    server_beta2: float = setting(0.99, "FedAdam: second-moment decay.", minimum=0.0, below=1.0)
    server_tau: float = setting(1e-3, "FedAdam: adaptivity floor added to sqrt(v).", above=0.0)


class FedAdam(Strategy):
    name = "fedadam"
    summary = "sites train the whole model; the server steps with Adam on their mean update"
    options = FedAdamOptions

    def __init__(self, options: FedAdamOptions | None = None):
        super().__init__(options)
        self.m: dict[str, torch.Tensor] = {}
        self.v: dict[str, torch.Tensor] = {}

    def plan(self, round_number: int, site: str, names: list[str]) -> Plan:
        return full_plan(names)

    def apply(
        self,
        round_number: int,
        global_state: dict[str, torch.Tensor],
        aggregated: dict[str, torch.Tensor],
        sent: frozenset[str],
    ) -> dict[str, torch.Tensor]:
        o = self.opts
        new = dict(aggregated)
        for name in sorted(sent):
            x = global_state[name].double()
            delta = aggregated[name].double() - x
            m = self.m.get(name, torch.zeros_like(x))
            v = self.v.get(name, torch.zeros_like(x))
            m = o.server_beta1 * m + (1 - o.server_beta1) * delta
            v = o.server_beta2 * v + (1 - o.server_beta2) * delta * delta
            self.m[name], self.v[name] = m, v
            step = o.server_lr * m / (v.sqrt() + o.server_tau)
            new[name] = (x + step).to(global_state[name].dtype)
        return new

    def tensor_state(self) -> dict[str, torch.Tensor]:
        return {f"m.{k}": v for k, v in self.m.items()} | {f"v.{k}": v for k, v in self.v.items()}

    def load_tensor_state(self, tensors: dict[str, torch.Tensor]) -> None:
        self.m = {k[2:]: v for k, v in tensors.items() if k.startswith("m.")}
        self.v = {k[2:]: v for k, v in tensors.items() if k.startswith("v.")}
