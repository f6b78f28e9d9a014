"""The federated round: plans, the client update, aggregation, strategies, runners.

One implementation of each, shared by every runner (DESIGN.md section 3):
``Strategy.plan`` says per round and site what is trained and what travels;
``client.client_update`` trains on one site's data and returns only the
planned tensors; ``aggregation.Aggregator`` averages each parameter over
the sites that sent it.
"""
