"""Multi-hospital deployment on Flower: a SuperLink, one SuperNode per site.

``site`` (what a node does) and ``coordinator`` (what the server does) hold
the logic and import no Flower; ``server`` and ``client`` are the ServerApp
and ClientApp that carry it over Flower messages; ``deploy`` builds the
``flower-superlink`` / ``flower-supernode`` / ``flwr run`` command lines,
certificates and node keys for ``clinfed flower``.
"""
