"""Parallel plans for the Qwen3-MoE actor: legality, megatron-core rank layout, memory, CLI."""

from parallel.layout import RankLayout
from parallel.plan import ModelFit, ParallelPlan, PlanError, check_against_model

__all__ = ["ModelFit", "ParallelPlan", "PlanError", "RankLayout", "check_against_model"]
