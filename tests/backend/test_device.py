"""Device layer: clear one-line errors for missing stacks, and the CPU shims in place."""

import pytest
import torch

from backend.platform.device import DeviceError, prepare_device, resolve_device
from backend.platform.mcore_shims import SHIMS, TESTED_RELEASES, apply_shims
from backend.platform.optional import MissingDependencyError, available


@pytest.mark.skipif(available("torch_npu"), reason="torch_npu is installed here")
def test_npu_without_torch_npu_names_what_to_install():
    with pytest.raises(MissingDependencyError) as err:
        prepare_device("npu")
    message = str(err.value)
    assert "\n" not in message
    assert "device npu needs `torch_npu`" in message and "install the Ascend stack" in message


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is visible")
def test_cuda_without_gpu_and_unknown_device():
    with pytest.raises(DeviceError, match="torch sees no GPU"):
        prepare_device("cuda")
    with pytest.raises(DeviceError, match="unknown device 'tpu'"):
        resolve_device("tpu")
    assert resolve_device("auto") in ("cpu", "npu")


@pytest.mark.mcore_compat
def test_cpu_shims_are_named_and_make_mcore_device_calls_answer_cpu():
    active = apply_shims("cpu")
    assert active == sorted(s.name for s in SHIMS if "cpu" in s.devices)
    assert all(s.why for s in SHIMS)
    # every shim names the tested releases that need it: one no release needs goes
    assert all(s.releases and set(s.releases) <= set(TESTED_RELEASES) for s in SHIMS)
    assert len({s.name for s in SHIMS}) == len(SHIMS)
    if not torch.cuda.is_available():
        assert torch.cuda.current_device() == torch.device("cpu")
        assert torch.cuda.current_stream().wait_event(None) is None  # 0.19's grad buckets
        from megatron.core.transformer.moe import moe_utils

        assert hasattr(moe_utils, "te_general_gemm")
    assert apply_shims("cpu") == active  # idempotent
