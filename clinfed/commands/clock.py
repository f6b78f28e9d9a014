"""When the command started: wall times printed at the end count from here
(imports and loading included), not from when training began. Imported
first by :mod:`clinfed.commands`, so its clock starts with the process."""

import time

STARTED = time.perf_counter()
