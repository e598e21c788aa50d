"""Instrumentation: the router tap and instruments, the step timer and its clocks, MoE dispatch timing, the comm share."""
