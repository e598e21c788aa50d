"""A training step's machinery: process groups, the optimizer, megatron-core's schedules, the opt-in loss guards."""
