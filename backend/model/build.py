"""Build a megatron-core GPTModel from a validated HF spec.

What the model is (shape, norms, router, layer spec, RoPE) comes from its family's folder
(backend.model.families: backend/<model_type>/); what this module adds is how it is built here:
process groups, dtype and device, token dispatcher, fusions, recompute, our fast modules.
"""

from dataclasses import dataclass, replace
from functools import partial

import torch

from backend.model.families import family_of
from backend.model.recompute import MEGATRON_SELECTIVE_MODULES, recompute_mode
from backend.platform.compat import check_plan_supported
from backend.platform.device import has_transformer_engine
from backend.training.distributed import ProcessGroups


@dataclass(frozen=True)
class BuildOptions:
    device: str = "cpu"
    dtype: torch.dtype = torch.float32
    # "auto": TransformerEngine spec when TE imports, megatron-core's local spec otherwise
    spec: str = "auto"
    # mcore's alltoall dispatcher creates CUDA streams; allgather is the CPU choice
    dispatcher: str | None = None
    # local spec only: "grouped" (backend.model.experts) / "sequential" (mcore's SequentialMLP) experts,
    # "sdpa" (backend.model.attention) / "local" (mcore's DotProductAttention) attention. "auto":
    # ours on cuda and npu (grouped GEMM, flash / fused attention kernels), megatron-core's on
    # CPU (the reference the tests compare ours with)
    experts: str = "auto"
    attention: str = "auto"
    grouped_gemm: str = "auto"  # backend.model.grouped_gemm kernel: auto | grouped_mm | npu | loop
    # "none" | "selective" | "full" (backend.model.recompute); True / False mean "full" / "none"
    recompute: str | bool = "none"
    init_method_std: float = 0.02
    # False skips random init (weights are loaded anyway; 80% of a meta build's time)
    init_weights: bool = True

    def resolved_recompute(self) -> str:
        return recompute_mode(self.recompute)

    def resolved_spec(self) -> str:
        if self.spec == "auto":
            return "te" if has_transformer_engine() else "local"
        if self.spec not in ("te", "local"):
            raise ValueError(f"unknown layer spec {self.spec!r}: choose auto, te or local")
        return self.spec

    def resolved_dispatcher(self) -> str:
        return self.dispatcher or ("allgather" if self.device == "cpu" else "alltoall")

    def resolved_experts(self) -> str:
        return _choose("experts", self.experts, ("grouped", "sequential"), self.device != "cpu")

    def resolved_attention(self) -> str:
        return _choose("attention", self.attention, ("sdpa", "local"), self.device != "cpu")


def _choose(what: str, value: str, choices: tuple[str, str], fast: bool) -> str:
    """'auto' -> choices[0] (ours) where `fast`, else choices[1] (megatron-core's)."""
    if value == "auto":
        return choices[0] if fast else choices[1]
    if value not in choices:
        raise ValueError(f"unknown {what} {value!r}: choose auto, {choices[0]} or {choices[1]}")
    return value


def transformer_config(spec, groups: ProcessGroups, opts: BuildOptions):
    """megatron-core TransformerConfig for this spec on these process groups."""
    from megatron.core.transformer import TransformerConfig

    tp = groups.size("tp")
    recompute = {
        "none": {},
        "full": dict(
            recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1
        ),
        # moe_act: GroupedExperts recomputes its SwiGLU itself (backend.model.recompute)
        "selective": dict(
            recompute_granularity="selective", recompute_modules=list(MEGATRON_SELECTIVE_MODULES)
        ),
    }[opts.resolved_recompute()]
    return TransformerConfig(
        **family_of(spec).transformer_config_kwargs(spec),
        moe_router_dtype="fp32",
        # balancing is ours to add explicitly (backend aux-loss hook), never inherited
        moe_router_load_balancing_type="none",
        moe_aux_loss_coeff=0.0,
        moe_token_dispatcher_type=opts.resolved_dispatcher(),
        moe_grouped_gemm=False,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=groups.size("pp"),
        context_parallel_size=groups.size("cp"),
        expert_model_parallel_size=groups.size("ep"),
        expert_tensor_parallel_size=groups.size("etp"),
        sequence_parallel=tp > 1,  # required by mcore for MoE with TP
        params_dtype=opts.dtype,
        pipeline_dtype=opts.dtype,
        bf16=opts.dtype == torch.bfloat16,
        use_cpu_initialization=opts.device == "cpu",
        init_method_std=opts.init_method_std,
        perform_initialization=opts.init_weights,
        bias_dropout_fusion=False,
        # fused SwiGLU keeps one activation instead of three on accelerators (jit kernel)
        bias_activation_fusion=opts.device != "cpu",
        apply_rope_fusion=False,
        masked_softmax_fusion=False,
        gradient_accumulation_fusion=False,
        persist_layer_norm=False,
        **recompute,
    )


def with_fast_modules(spec, opts: BuildOptions, groups: ProcessGroups):
    """A local layer spec with our grouped experts / SDPA attention swapped in as `opts` asks."""
    from backend.model.attention import SDPAttention
    from backend.model.experts import GroupedExperts

    layer = spec.submodules
    if opts.resolved_attention() == "sdpa":
        attention = replace(layer.self_attention.submodules, core_attention=SDPAttention)
        layer = replace(layer, self_attention=replace(layer.self_attention, submodules=attention))
    if opts.resolved_experts() == "grouped":
        params = {
            "groups": groups,
            "gemm": opts.grouped_gemm,
            "recompute_act": opts.resolved_recompute() == "selective",
        }
        layer = replace(layer, mlp=with_experts(layer.mlp, GroupedExperts, params))
    return replace(spec, submodules=layer)


def with_experts(mlp, module, params: dict):
    """The MoE layer's spec with its experts built by `module(..., **params)`.

    megatron-core <= 0.16 describes the layer as a ModuleSpec whose experts are a ModuleSpec;
    0.19 as functools.partial(MoELayer, submodules=...) whose experts are called as builders
    (`experts(num_local_experts, config, pg_collection=, name=)`)."""
    from megatron.core.transformer.spec_utils import ModuleSpec

    if isinstance(mlp, ModuleSpec):
        moe = replace(mlp.submodules, experts=ModuleSpec(module=module, params=params))
        return replace(mlp, submodules=moe)
    moe = replace(mlp.keywords["submodules"], experts=partial(module, **params))
    return partial(mlp.func, *mlp.args, **{**mlp.keywords, "submodules": moe})


def build_model(spec, groups: ProcessGroups, opts: BuildOptions | None = None):
    """One pipeline stage of the spec's GPTModel (the whole model when pp == 1)."""
    from megatron.core.models.gpt import GPTModel

    opts = opts or BuildOptions()
    check_plan_supported(groups.size("tp"), groups.size("ep"), groups.size("etp"))
    family = family_of(spec)
    config = transformer_config(spec, groups, opts)
    pp_rank, pp_size = groups.rank("pp"), groups.size("pp")
    # micro-batches differ in length: pipeline stages send each tensor's shape first. Set
    # after construction: TransformerConfig refuses it with the allgather dispatcher (CPU),
    # whose all-gather over TP x EP needs equal token counts there; the flag changes only
    # pipeline sends, and TP slices are equal under sequence parallelism
    config.variable_seq_lengths = pp_size > 1
    model = GPTModel(
        config=config,
        transformer_layer_spec=family.layer_spec(spec, opts, groups),
        pre_process=pp_rank == 0,
        post_process=pp_rank == pp_size - 1,
        parallel_output=True,
        **family.gpt_model_kwargs(spec),
    )
    tag_experts(model)
    tag_expert_replicas(model, groups)
    if config.sequence_parallel:
        mark_sequence_parallel_norms(model)
    if opts.device != "cpu":
        model = model.to(torch.device(opts.device, torch.accelerator.current_device_index()))
    return model


def is_expert(param: torch.Tensor) -> bool:
    """An expert weight: tagged `is_expert` by tag_experts, or by megatron-core
    `allreduce=False` (expert-parallel replicas)."""
    return getattr(param, "is_expert", False) or not getattr(param, "allreduce", True)


def tag_experts(model: torch.nn.Module) -> int:
    """Mark every expert weight `is_expert` (those of each MoELayer's experts module).

    megatron-core's own mark, `allreduce=False`, is only set where expert replicas are not the
    dense ones' (`tag_expert_replicas`); generic code asks `is_expert(param)` (above), not
    parameter names. Returns how many parameters were tagged.
    """
    experts = _expert_params(model)
    for param in experts:
        param.is_expert = True
    return len(experts)


def _expert_params(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    """The parameters of every MoE layer's experts module."""
    from megatron.core.transformer.moe.moe_layer import MoELayer

    layers = [m for m in model.modules() if isinstance(m, MoELayer)]
    return [param for layer in layers for param in layer.experts.parameters()]


def tag_expert_replicas(model: torch.nn.Module, groups: ProcessGroups) -> int:
    """Mark expert weights `allreduce=False` wherever their replicas are not the dense ones'.

    megatron-core's DDP reduces a parameter over the dense DP(xCP) group unless it is tagged
    `allreduce=False`, which puts it in the expert buffers (reduced over expert-DP) and the
    expert optimizer (sharded over expert-DP). Its expert linears (and backend.model.experts, which
    copies the rule) tag only when ep > 1. With ep == 1 and etp != tp (tp=2, etp=1: every TP
    rank holds all experts and, with sequence parallelism, routes only its own slice of the
    tokens) each TP rank's expert gradient is a partial sum that must be summed over
    expert-DP, yet the dense group does not contain those ranks: the experts were updated
    with their local partial gradients only and drifted apart across TP. Tagging them sends
    them through expert-DP as for ep > 1. Returns how many parameters were tagged.
    """
    if groups.size("edp") == groups.size("dp") * groups.size("cp"):
        return 0  # ep == 1, etp == tp: the same replicas (ep > 1: megatron-core tagged them)
    experts = _expert_params(model)
    for param in experts:
        param.allreduce = False
    return len(experts)


# norms over the hidden size, applied to the sequence shard each TP rank holds under sequence
# parallelism (q/k norms are per head: grad finalisation recognises them by name)
SEQUENCE_PARALLEL_NORMS = ("input_layernorm", "pre_mlp_layernorm", "final_layernorm")


def mark_sequence_parallel_norms(model: torch.nn.Module) -> None:
    """Tag the hidden-size norms' weights `sequence_parallel`, whatever class built them.

    Each TP rank computes their gradient from its own slice of the tokens, so it must be summed
    over TP (megatron's finalize_model_grads, and tests/support/reference_actor.py, do so for tagged
    parameters). TE's norms and our CPU/GPU shim tag them; a device's own norm need not
    (MindSpeed replaces megatron's on Ascend), and an untagged one lets TP ranks drift apart
    silently.
    """
    for name, module in model.named_modules():
        if name.rsplit(".", 1)[-1] in SEQUENCE_PARALLEL_NORMS:
            for param in module.parameters():
                param.sequence_parallel = True
