"""The operator's timing for tests: look often, drain at once (read when handlers import)."""

import os

os.environ.setdefault("DISTSERVE_MONITOR_INTERVAL_S", "0.5")
os.environ.setdefault("DISTSERVE_DRAIN_SECONDS", "0")
os.environ.setdefault("DISTSERVE_REPLAN_TICK_S", "0.5")
