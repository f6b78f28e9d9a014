"""Whole jobs, each built from a RunConfig by :mod:`~clinfed.runners.factories`:
training with every site in this process (``pipeline``), the server and a
node of a federation whose sites are elsewhere (``federation``, ``node``),
the public warm start, a sweep, the forecast, the public clip norm, the
membership audit, inference, export and the demo. The transports
(``clinfed.flower``) and the surfaces (``clinfed.commands``, the API) call
these; nothing below imports them."""
