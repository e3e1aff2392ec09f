"""Serving instances: prefill, decode and colocated loops around one model runner."""
