"""Library chatter (load reports, per-map progress bars) drowns clinfed's own
output: the CLI and the Flower apps silence it the same way."""

from __future__ import annotations

import logging
import warnings


def quiet_libraries() -> None:
    import datasets
    import transformers

    datasets.disable_progress_bars()
    datasets.logging.set_verbosity_error()
    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    logging.getLogger("torch").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", category=FutureWarning)
