"""The aux-loss hook on transformers' Qwen3MoeForCausalLM: same values and router gradients as
on the megatron-core model with the same weights, and checkpointing adds the loss once."""

import pytest
import torch

from backend.aux_loss import hf_aux_loss
from tests.backend.test_aux_loss_hook import (
    BATCH,
    _tiny_mcore,
    aux_step,
    batch,
    config,
    one_thread,  # noqa: F401 (autouse fixture)
)

pytestmark = pytest.mark.mcore_compat

MCORE_ROUTER = "decoder.layers.{}.mlp.router.weight"
HF_GATE = "model.layers.{}.mlp.gate.weight"


@pytest.fixture
def hf_model(tiny_hf_dir):
    from transformers import Qwen3MoeForCausalLM

    return Qwen3MoeForCausalLM.from_pretrained(
        tiny_hf_dir, dtype=torch.float32, attn_implementation="eager"
    )


def hf_step(model, cfg, ids, attention, response, splits):
    """aux_step's sequence of calls on the HF model; (metrics, gate grads by layer)."""
    hook = hf_aux_loss(model, cfg)
    try:
        chunks = [
            (x, hook.valid_tokens(a, r))
            for x, a, r in zip(
                ids.split(splits), attention.split(splits), response.split(splits), strict=True
            )
        ]
        hook.start_step([valid for _, valid in chunks])
        if cfg.needs_counting_pass:
            with hook.counting():
                for x, valid in chunks:
                    hook.set_tokens(valid)
                    model(input_ids=x)
        for x, valid in chunks:
            hook.set_tokens(valid)
            (model(input_ids=x).logits.sum() * 0).backward()
        metrics = hook.end_step()
    finally:
        hook.remove()
        hook.tap.remove()
    grads = {layer: model.get_parameter(HF_GATE.format(layer)).grad.clone() for layer in range(2)}
    model.zero_grad(set_to_none=True)
    return metrics, grads


@pytest.mark.parametrize("kind", ["global_batch", "sequence"])
def test_hf_model_matches_mcore(hf_model, world1, tiny_hf_dir, kind):
    """The hook on transformers' model = on megatron-core's, gradients within the fp32 rtol
    1e-4 of the other gradient checks. Catches the HF side's router logits off by 1e-4
    relative (scaled by 1.0001), which the earlier rtol 1e-3 / atol 1e-7 let through."""
    data = batch(hf_model.config.vocab_size)
    mcore_metrics, mcore_grads = aux_step(
        _tiny_mcore(world1, tiny_hf_dir), world1, config(kind), *data, [3, 5]
    )
    metrics, grads = hf_step(hf_model, config(kind), *data, [3, 5])
    assert metrics.keys() == mcore_metrics.keys()
    for key, value in mcore_metrics.items():
        assert metrics[key] == pytest.approx(value, rel=1e-4), key
    for layer, grad in grads.items():
        torch.testing.assert_close(
            grad, mcore_grads[MCORE_ROUTER.format(layer)], rtol=1e-4, atol=1e-8
        )


@pytest.mark.parametrize("reentrant", [True, False], ids=["reentrant", "non_reentrant"])
def test_hf_checkpointing_adds_the_loss_once(hf_model, reentrant):
    data = batch(hf_model.config.vocab_size)
    expected = hf_step(hf_model, config("global_batch"), *data, [BATCH])
    hf_model.train()
    hf_model.gradient_checkpointing_enable({"use_reentrant": reentrant})
    metrics, grads = hf_step(hf_model, config("global_batch"), *data, [BATCH])
    assert metrics == pytest.approx(expected[0], rel=1e-6)
    for layer, grad in grads.items():
        torch.testing.assert_close(grad, expected[1][layer], rtol=1e-5, atol=1e-8)
