"""Parameter counts of a model: whole model, active per token (its family's counts), and per device."""

from dataclasses import dataclass

from backend.model.families import ParamCounts, family, family_of
from parallel.plan import ModelFit

__all__ = ["DeviceParams", "ParamCounts", "device_params", "hf_param_counts", "param_counts"]


def param_counts(spec, vocab: int | None = None) -> ParamCounts:
    """Parameters of the HF model (unpadded vocab unless `vocab` is given)."""
    return family_of(spec).param_counts(spec, vocab)


def hf_param_counts(model) -> tuple[int, int]:
    """(total, active) parameters of a built transformers model of a known family."""
    return family(model.config.model_type).hf_param_counts(model)


@dataclass(frozen=True)
class DeviceParams:
    """Parameters one device of a pipeline stage holds."""

    dense: int  # replicated over dp: attention (tp-sharded), norms, router, embedding/head
    expert: int  # replicated over edp: this device's experts (etp-sharded)

    @property
    def total(self) -> int:
        return self.dense + self.expert


def device_params(fit: ModelFit, stage: int) -> DeviceParams:
    plan, counts = fit.plan, param_counts(fit.spec, fit.padded_vocab)
    layers, replicated = fit.stage_layers[stage], counts.attention_replicated
    projections = counts.attention - replicated  # q/k norms are replicated across tp
    # megatron's router weight is not tensor-parallel
    per_layer = projections // plan.tp + replicated + counts.layer_norms + counts.router
    dense = layers * per_layer
    if stage == 0:
        dense += counts.embedding // plan.tp
    if stage == plan.pp - 1:
        dense += counts.lm_head // plan.tp + counts.final_norm
    expert = layers * fit.experts_per_rank * counts.expert // plan.etp
    return DeviceParams(dense=dense, expert=expert)
