"""HF <-> megatron-core weight conversion for Qwen3-MoE."""
