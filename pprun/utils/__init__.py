"""Utilities below every other part of pprun (engine, executors, workers, transport).

Nothing here imports another ``pprun`` package: ``step_trace`` (per-step timings),
``polling`` (sockets polled before a blocking read), ``startup`` (the garbage collector after
start-up).
"""
