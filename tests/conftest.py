"""Suite-wide settings, read before any test module imports torch."""

from __future__ import annotations

import os

# Under `pytest -n N` every worker is one process per core: torch's default of one thread
# per core would put N threads on each core, and its spinning thread pool then runs a
# test two or more times slower than one thread does. Servers the tests start pin their
# own thread counts.
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ.setdefault("OMP_NUM_THREADS", "1")
