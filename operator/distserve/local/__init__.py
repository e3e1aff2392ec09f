"""The local launcher: runs a plan's router and instances on this machine (`distserve up`).

Only this package of the control plane starts the engine, and only as separate
processes (`python -m distserve_engine.server`), so importing it needs no torch.
"""
