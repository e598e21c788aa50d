"""Parallel plans for the Qwen3-MoE actor: legality, megatron-core rank layout, memory, CLI."""

from parallel.plan import ModelFit, ParallelPlan, PlanError, check_against_model
from parallel.rank_layout import RankLayout

__all__ = ["ModelFit", "ParallelPlan", "PlanError", "RankLayout", "check_against_model"]
