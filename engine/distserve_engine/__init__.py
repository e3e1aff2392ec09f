"""DistServe data plane: a torch inference engine with a paged KV cache.

The engine runs Llama-family and OPT models for batched serving. Its KV cache is
paged so that one sequence's KV can leave one instance (prefill) and enter another
(decode). It never imports the control plane (`distserve`).
"""

__all__ = ["__version__"]
__version__ = "0.1.0"
