"""Local mode: the whole loop on a tiny Qwen3-MoE on CPU."""
