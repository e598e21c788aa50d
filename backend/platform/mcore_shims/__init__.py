"""The few patches megatron-core needs where its code assumes CUDA or TransformerEngine.

Every shim is named, says why it exists, lists the devices it is for and the tested
megatron-core releases that need it, and is idempotent. `apply_shims(device)` runs the ones
for that device; the device layer calls it before any model code imports megatron. One
module per area: cuda_device (torch.cuda calls), cuda_literals (tensors built on 'cuda' by
name), without_te (TransformerEngine / Apex assumed), dist_optimizer, grad_norms,
dist_checkpointing, jit_fuser (torch.compile'd kernels). Official flags are used instead of
shims wherever megatron-core has one (see backend.model.build):

- RNG: model_parallel_cuda_manual_seed(..., inference_rng_tracker=True) (no CUDA RNG state),
- dispatcher: moe_token_dispatcher_type="allgather" on CPU (alltoall creates CUDA streams),
- use_cpu_initialization=True on CPU.

The distributed optimizer (DistributedDataParallel + get_megatron_optimizer) runs on CPU in
fp32 with the `dist_optim_*` / `optimizer_*` shims; bf16 stays on accelerators.

Measured on megatron-core 0.12.1, 0.16.1 and 0.19.2 with torch 2.13 (CPU); each shim's
`releases` were read in those releases' sources.
"""

from backend.platform.mcore_shims.cuda_device import (
    CUDA_CURRENT_DEVICE_IS_CPU,
    CUDA_CURRENT_STREAM_IS_NONE,
    CUDA_RNG_STATE_IS_EMPTY,
    CUDA_SYNCHRONIZE_IS_NOOP,
)
from backend.platform.mcore_shims.cuda_literals import (
    OPTIMIZER_CUDA_LITERALS_ARE_CPU,
    SCHEDULE_CUDA_LITERALS_ARE_CPU,
)
from backend.platform.mcore_shims.dist_checkpointing import (
    DIST_CKPT_NUMPY_PRODUCT,
    DIST_CKPT_WRITE_ITEM_FORMAT,
)
from backend.platform.mcore_shims.dist_optimizer import (
    DIST_OPTIM_FP32_CPU_PARAMS,
    DIST_OPTIM_LOAD_ADAM_STEP,
)
from backend.platform.mcore_shims.grad_norms import CLIP_GRADS_CPU, LOCAL_L2_NORM_ON_CPU
from backend.platform.mcore_shims.jit_fuser import JIT_FUSER_WITHOUT_INDUCTOR, compiled_functions
from backend.platform.mcore_shims.shim import TESTED_RELEASES, Shim
from backend.platform.mcore_shims.without_te import (
    FP8_QUANTIZE_WITHOUT_TE,
    TE_GENERAL_GEMM_PLACEHOLDER,
    TORCH_NORM_SEQUENCE_PARALLEL,
)

__all__ = ["SHIMS", "TESTED_RELEASES", "Shim", "apply_shims", "compiled_functions"]

# in the order they are applied
SHIMS: tuple[Shim, ...] = (
    CUDA_CURRENT_DEVICE_IS_CPU,
    TE_GENERAL_GEMM_PLACEHOLDER,
    TORCH_NORM_SEQUENCE_PARALLEL,
    CUDA_RNG_STATE_IS_EMPTY,
    CUDA_SYNCHRONIZE_IS_NOOP,
    CUDA_CURRENT_STREAM_IS_NONE,
    JIT_FUSER_WITHOUT_INDUCTOR,
    DIST_CKPT_WRITE_ITEM_FORMAT,
    OPTIMIZER_CUDA_LITERALS_ARE_CPU,
    SCHEDULE_CUDA_LITERALS_ARE_CPU,
    DIST_OPTIM_FP32_CPU_PARAMS,
    CLIP_GRADS_CPU,
    LOCAL_L2_NORM_ON_CPU,
    FP8_QUANTIZE_WITHOUT_TE,
    DIST_CKPT_NUMPY_PRODUCT,
    DIST_OPTIM_LOAD_ADAM_STEP,
)

_applied: set[str] = set()


def apply_shims(device: str) -> list[str]:
    """Apply the shims meant for `device` (in order); return the names now active."""
    for shim in SHIMS:
        if device in shim.devices and shim.name not in _applied:
            shim.patch()
            _applied.add(shim.name)
    return sorted(_applied)
