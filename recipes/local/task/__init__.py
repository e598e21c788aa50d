"""The local tasks and the models a local run builds: doubles, worked sums, the tiny and mini random Qwen3-MoE."""
