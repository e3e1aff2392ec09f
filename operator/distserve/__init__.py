"""DistServe control plane: spec, planner, Kubernetes operator, command line (no torch)."""

__version__ = "0.1.0"
