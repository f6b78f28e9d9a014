"""pFedDC adapted to clinical text: personalized prompts on a frozen encoder.

After pFedDC (arXiv 2506.21144). Every site's model is the same frozen
encoder with a :class:`~clinfed.prompts.DualPrompt` in front of it. A site
trains its global prompt ``P_g``, its local prompt ``P_l``, the fusion
block and its task head; it uploads and receives only ``P_g``, which the
server averages. ``P_l``, the fusion block and the head stay at the site
and persist from round to round (``RUN/sites/`` in the simulator, the
node's state folder on Flower).

The head is local. Only ``P_g`` may travel (that is what keeps the upload
under 1% of FedAvg's), and the head is where a site's own label usage
(how its annotators mark problems, tests and treatments; which codes it
assigns) is learned best. The price: the "global prompt alone" evaluation
still uses each site's own head, with ``P_g`` in place of the fused prompt.

Under DP every trained part (P_g, P_l, fusion, head) is one DP-SGD
parameter set, clipped jointly and noised (DESIGN.md 4); the uploaded P_g is
post-processing.
"""

from __future__ import annotations

from clinfed.blocks import GLOBAL_PROMPT, HEAD, LOCAL_PROMPT
from clinfed.federated.plan import Plan, names_in
from clinfed.federated.strategies.base import Strategy


class PFedDC(Strategy):
    name = "pfeddc"
    shares_model = False  # each site keeps its own local prompt, fusion and head

    def plan(self, round_number: int, site: str, names: list[str]) -> Plan:
        trained = names_in(names, {GLOBAL_PROMPT, LOCAL_PROMPT, HEAD})
        shared = names_in(names, {GLOBAL_PROMPT})
        if not shared:
            raise ValueError("pfeddc needs a model with prompts (clinfed.models.add_prompts)")
        return Plan(trained, shared, shared)
