"""What verl and vLLM lack on a machine without an accelerator: verl's CPU platform, vLLM's CPU build as an RL rollout, its limits, verl's FSDP engine on CPU."""
