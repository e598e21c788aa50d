"""Selective recompute (core attention + the experts' SwiGLU) leaves loss and gradients exact.

Tiny model, fp32, world 1: our modules (grouped experts, SDPA) and megatron-core's local
ones (SequentialMLP, DotProductAttention) with recompute none / selective / full."""

import pytest
import torch

from backend.model.build import BuildOptions, build_model, transformer_config
from backend.model.recompute import recompute_mode
from backend.qwen3_moe import load_qwen3_moe_spec
from converters.hf_io import read_state_dict
from converters.sharding import load_hf_into_model
from tests.backend.test_monitor_model import actor_step, batch

pytestmark = pytest.mark.mcore_compat
MODULES = {"ours": dict(experts="grouped", attention="sdpa"), "mcore": {}}


def _step(groups, hf_dir, recompute, modules):
    spec = load_qwen3_moe_spec(hf_dir)
    model = build_model(spec, groups, BuildOptions(recompute=recompute, **modules))
    load_hf_into_model(model, read_state_dict(hf_dir), spec)
    loss = actor_step(model, *batch())
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}, model


@pytest.mark.parametrize("modules", MODULES, ids=list(MODULES))
def test_selective_recompute_matches_none(world1, tiny_hf_dir, modules, monkeypatch):
    from megatron.core.tensor_parallel import CheckpointWithoutOutput

    loss, grads, _ = _step(world1, tiny_hf_dir, "none", MODULES[modules])
    replays, recompute = [], CheckpointWithoutOutput._recompute

    def counted(self, grad):
        replays.append(1)
        recompute(self, grad)

    monkeypatch.setattr(CheckpointWithoutOutput, "_recompute", counted)
    loss_s, grads_s, model = _step(world1, tiny_hf_dir, "selective", MODULES[modules])
    # the experts' SwiGLU re-ran once per layer in backward (ours), never (megatron's)
    assert len(replays) == (model.config.num_layers if modules == "ours" else 0)
    config = model.config
    assert config.recompute_granularity == "selective"
    assert config.recompute_modules == ["core_attn"]
    if modules == "ours":
        assert all(layer.mlp.experts.recompute_act for layer in model.decoder.layers)
    torch.testing.assert_close(loss_s, loss, rtol=0, atol=1e-6)
    assert grads_s.keys() == grads.keys()
    for name, grad in grads.items():
        torch.testing.assert_close(grads_s[name], grad, rtol=1e-5, atol=1e-7, msg=name)


def test_recompute_choices_and_legacy_bools(world1, tiny_hf_dir):
    assert [recompute_mode(v) for v in (False, True, None, "none", "Selective", "full")] == [
        "none", "full", "none", "none", "selective", "full",
    ]  # fmt: skip
    with pytest.raises(ValueError, match="recompute="):
        recompute_mode("core_attn")
    spec = load_qwen3_moe_spec(tiny_hf_dir)
    full = transformer_config(spec, world1, BuildOptions(recompute=True))
    assert (full.recompute_granularity, full.recompute_method) == ("full", "uniform")
    assert transformer_config(spec, world1, BuildOptions()).recompute_granularity is None


def test_engine_config_takes_the_choice():
    from recipes.dapo.engine.config import EngineConfigError, McoreEpEngineConfig

    for value in ("none", "selective", "full", True, False):
        assert McoreEpEngineConfig(recompute=value).recompute == value
    with pytest.raises(EngineConfigError, match="recompute='core_attn'"):
        McoreEpEngineConfig(recompute="core_attn")
