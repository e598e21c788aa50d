"""Parameter counts of a Qwen3-MoE model: whole model, active per token, and per device."""

from dataclasses import dataclass

from backend.hf_config import Qwen3MoeSpec
from parallel.plan import ModelFit


@dataclass(frozen=True)
class ParamCounts:
    """Parameters of the HF model (unpadded vocab unless `vocab` is given)."""

    embedding: int
    lm_head: int
    final_norm: int
    attention: int  # one layer: q, k, v, o projections and the q/k norms
    layer_norms: int  # one layer: input and post-attention RMSNorm
    router: int  # one layer
    expert: int  # one expert: gate, up and down projections
    num_layers: int
    num_experts: int
    top_k: int

    @property
    def dense_per_layer(self) -> int:
        return self.attention + self.layer_norms + self.router

    @property
    def total(self) -> int:
        layers = self.num_layers * (self.dense_per_layer + self.num_experts * self.expert)
        return self.embedding + self.lm_head + self.final_norm + layers

    @property
    def active(self) -> int:
        """Parameters one token uses: everything but the experts it is not routed to."""
        return self.total - self.num_layers * (self.num_experts - self.top_k) * self.expert

    @property
    def non_embedding(self) -> int:
        return self.total - self.embedding - self.lm_head


def param_counts(spec: Qwen3MoeSpec, vocab: int | None = None) -> ParamCounts:
    h, hd = spec.hidden_size, spec.head_dim
    q, kv = spec.num_heads * hd, spec.num_kv_heads * hd
    vocab = vocab or spec.vocab_size
    return ParamCounts(
        embedding=vocab * h,
        lm_head=vocab * h,
        final_norm=h,
        attention=h * (q + 2 * kv) + q * h + 2 * hd,
        layer_norms=2 * h,
        router=spec.num_experts * h,
        expert=3 * h * spec.moe_ffn_hidden_size,
        num_layers=spec.num_layers,
        num_experts=spec.num_experts,
        top_k=spec.top_k,
    )


def hf_param_counts(model) -> tuple[int, int]:
    """(total, active) parameters of a built transformers Qwen3MoeForCausalLM.

    Expert weights are the parameters under `.mlp.experts.`; a token uses top_k of them.
    """
    cfg = model.config
    total = sum(p.numel() for p in model.parameters())
    experts = sum(p.numel() for n, p in model.named_parameters() if ".mlp.experts." in n)
    num_experts = getattr(cfg, "num_experts", None) or cfg.num_local_experts
    active = total - experts + experts * cfg.num_experts_per_tok // num_experts
    return total, active


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
    spec, layers = fit.spec, fit.stage_layers[stage]
    projections = counts.attention - 2 * spec.head_dim  # q/k norms are replicated across tp
    # megatron's router weight is not tensor-parallel
    per_layer = projections // plan.tp + 2 * spec.head_dim + counts.layer_norms + counts.router
    dense = layers * per_layer
    if stage == 0:
        dense += counts.embedding // plan.tp
    if stage == plan.pp - 1:
        dense += counts.lm_head // plan.tp + counts.final_norm
    expert = layers * fit.experts_per_rank * counts.expert // plan.etp
    return DeviceParams(dense=dense, expert=expert)
