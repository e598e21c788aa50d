"""What the installed torch offers, for tests of CPU-only kernels that the npu set's torch (2.7.1)
lacks. The Ascend code paths never use them: torch_npu's grouped matmul and fused attention."""

import pytest
import torch
import torch.nn.functional as F


def _cpu_flash_takes_gqa() -> bool:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    q, kv = torch.zeros(1, 2, 4, 8), torch.zeros(1, 1, 4, 8)
    try:
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            F.scaled_dot_product_attention(q, kv, kv, is_causal=True, enable_gqa=True)
    except RuntimeError:  # "No available kernel"
        return False
    return True


needs_grouped_mm = pytest.mark.skipif(
    not hasattr(torch, "_grouped_mm"),
    reason=f"torch {torch.__version__} has no torch._grouped_mm (Ascend uses torch_npu's "
    "grouped matmul; `auto` picks the loop on CPU)",
)
needs_cpu_flash_gqa = pytest.mark.skipif(
    not _cpu_flash_takes_gqa(),
    reason=f"torch {torch.__version__}'s CPU flash kernel refuses enable_gqa, so SDPA takes the "
    "math path and keeps the [b, h, s, s] scores the estimate (flash) leaves out; Ascend runs "
    "npu_fusion_attention",
)
