"""The shim that runs megatron-core's torch.compile'd fused kernels eagerly (no inductor on
npu), and `compiled_functions`, which lists the ones still compile-wrapped."""

import inspect
import sys

from backend.platform.mcore_shims.shim import Shim


def _noop_decorator(func):
    return func


def _compile_wrapped(value):
    """The function torch.compile wrapped, if `value` is such a wrapper (else None)."""
    if inspect.isfunction(value):
        return vars(value).get("_torchdynamo_orig_callable")
    return None


def _megatron_owners():
    """(module name, owner) for every imported megatron-core module and the classes it
    defines: where module functions and methods (e.g. the router's and experts' fused
    helpers) live."""
    for name, module in list(sys.modules.items()):
        if not name.startswith("megatron.core.") or module is None:
            continue
        for owner in [module] + [
            v for v in vars(module).values() if isinstance(v, type) and v.__module__ == name
        ]:
            yield name, owner


def _patch_jit_fuser_off() -> None:
    from megatron.core import jit

    # modules imported from now on decorate with a no-op (0.16 has disable_jit_fuser for this)
    jit.jit_fuser = _noop_decorator
    # ones already imported (MindSpeed's adaptor imports megatron first) hold torch.compile
    # wrappers, compiled lazily on the first call: put the original functions back
    for _, owner in _megatron_owners():
        for attr, value in list(vars(owner).items()):
            original = _compile_wrapped(value)
            if original is not None:
                setattr(owner, attr, original)


def compiled_functions() -> list[str]:
    """megatron-core functions currently wrapped by torch.compile (what the shim above undoes)."""
    return [
        f"{name}.{attr}"
        for name, owner in _megatron_owners()
        for attr, value in vars(owner).items()
        if _compile_wrapped(value) is not None
    ]


JIT_FUSER_WITHOUT_INDUCTOR = Shim(
    name="jit_fuser_without_inductor",
    why="megatron-core sets jit_fuser = torch.compile at import and decorates its fused "
    "kernels with it (fusions/fused_bias_swiglu.py: weighted_swiglu, bias_swiglu, ...), so "
    "the MoE experts' weighted SwiGLU would be compiled by inductor, which torch_npu does "
    "not target; megatron-core has no flag for it (0.16's disable_jit_fuser only affects "
    "modules imported later), so npu runs the same functions eagerly",
    devices=("npu",),
    releases=("0.12.1", "0.16.1", "0.19.2"),
    patch=_patch_jit_fuser_off,
)
