"""What a person sees of a run: the console and its filters, the step line, tracebacks, the alarm log, the health report."""
