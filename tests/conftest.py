"""Shared fixtures: a tiny random Qwen3-MoE checkpoint and a world-size-1 megatron setup."""

import pytest
import torch

from recipes.local.tiny_model import make_tiny_checkpoint, tiny_config


@pytest.fixture(scope="session")
def tiny_hf_dir(tmp_path_factory):
    """The tiny model saved by transformers (safetensors + config.json), seed 0."""
    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny_qwen3_moe"), seed=0)


@pytest.fixture(scope="session")
def tiny_hf_model(tiny_hf_dir):
    """transformers' reference model loaded from tiny_hf_dir, fp32, eager attention."""
    from transformers import Qwen3MoeForCausalLM

    model = Qwen3MoeForCausalLM.from_pretrained(
        tiny_hf_dir, dtype=torch.float32, attn_implementation="eager"
    )
    return model.eval()


@pytest.fixture(scope="session")
def world1():
    """ProcessGroups of a single CPU rank with megatron-core's parallel state set up."""
    from backend.device import prepare_device
    from backend.distributed import init_parallel

    return init_parallel(prepare_device("cpu"), seed=1234)


@pytest.fixture
def tiny_config_factory():
    return tiny_config


def pytest_report_header(config):
    import megatron.core
    import transformers

    return f"megatron-core {megatron.core.__version__} ({megatron.core.__file__}), transformers {transformers.__version__}"
