"""Shims for megatron-core code that assumes TransformerEngine (or Apex) is installed."""

from backend.platform.mcore_shims.shim import Shim


def _patch_te_general_gemm() -> None:
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


def _patch_torch_norm_sequence_parallel() -> None:
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    original = WrappedTorchNorm.__new__
    if getattr(original, "_allows_sequence_parallel", False):
        return

    def new(cls, config, hidden_size, *args, **kwargs):
        if not config.sequence_parallel:
            return original(cls, config, hidden_size, *args, **kwargs)
        # torch's norms are token-wise, so a sequence shard is fine; build with the check
        # off, then tag the weights so grad finalisation sums them over TP as mcore expects
        config.sequence_parallel = False
        try:
            norm = original(cls, config, hidden_size, *args, **kwargs)
        finally:
            config.sequence_parallel = True
        for param in norm.parameters():
            param.sequence_parallel = True
        return norm

    new._allows_sequence_parallel = True
    WrappedTorchNorm.__new__ = staticmethod(new)


def _patch_fp8_quantize_without_te() -> None:
    from megatron.core import fp8_utils

    try:
        fp8_utils._quantize_param_shard_impl([], [], [], None)
        return  # >= 0.13: no fp8 params is a no-op already
    except RuntimeError:
        pass
    original = fp8_utils._quantize_param_shard_impl

    def quantize(model_params, *args, **kwargs):
        if len(model_params) == 0:
            return None
        return original(model_params, *args, **kwargs)

    fp8_utils._quantize_param_shard_impl = quantize


TE_GENERAL_GEMM_PLACEHOLDER = Shim(
    name="te_general_gemm_placeholder",
    why="megatron-core 0.16 moe_utils reads te_general_gemm, bound only when "
    "TransformerEngine imports; without TE the router forward raises NameError. "
    "None selects its plain torch.mm path",
    devices=("cpu", "cuda", "npu"),
    releases=("0.16.1",),
    patch=_patch_te_general_gemm,
)
TORCH_NORM_SEQUENCE_PARALLEL = Shim(
    name="torch_norm_sequence_parallel",
    why="without Apex or TE, mcore's local norm is torch's RMSNorm wrapper, which refuses "
    "sequence parallelism (an assert), and mcore requires sequence parallelism for MoE "
    "with TP > 1; the norm is token-wise, so it is built with the check off and its "
    "weights tagged sequence_parallel",
    devices=("cpu", "cuda"),
    releases=("0.12.1", "0.16.1", "0.19.2"),
    patch=_patch_torch_norm_sequence_parallel,
)
FP8_QUANTIZE_WITHOUT_TE = Shim(
    name="fp8_quantize_without_te",
    why="megatron-core 0.12.1 without TransformerEngine raises in quantize_param_shard even "
    "with no fp8 params, which every distributed-optimizer step calls; an empty list is a "
    "no-op, as in 0.13+ (no-op on megatron-core >= 0.13)",
    devices=("cpu", "cuda", "npu"),
    releases=("0.12.1",),
    patch=_patch_fp8_quantize_without_te,
)
