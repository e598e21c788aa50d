"""The CPU rollout: weights only through verl's weight-update stream, exact log-probs and
routing, and its registration into verl's rollout registries (fails loudly if verl changes).
"""

import asyncio
import os
import shutil

import pytest
import torch

from tests.test_verl_engine import build_engine


@pytest.fixture(scope="module")
def task_hf_dir(tiny_hf_dir, tmp_path_factory):
    """The tiny model with the task's ChatML character tokenizer beside it."""
    from recipes.local.task import write_tokenizer

    out = tmp_path_factory.mktemp("tiny_task_hf")
    shutil.copytree(tiny_hf_dir, out, dirs_exist_ok=True)
    return write_tokenizer(out)


def server_for(path, **config):
    from recipes.local.rollout import CpuRolloutServer

    cfg = {"response_length": 4, "seed": 0, "enable_rollout_routing_replay": True, **config}
    return CpuRolloutServer(cfg, {"path": str(path)}, replica_rank=0)


def test_registered_in_verls_rollout_registries():
    from verl.workers.rollout.base import _ROLLOUT_REGISTRY, get_rollout_class
    from verl.workers.rollout.replica import get_rollout_replica_class

    import recipes.local.rollout as cpu

    # verl 0.9.1 keys its in-worker adapters by (name, mode) in a module dict
    assert ("vllm", "async") in _ROLLOUT_REGISTRY
    assert get_rollout_class("cpu", "async") is cpu.CpuServerAdapter
    assert get_rollout_replica_class("cpu") is cpu.CpuReplica


def test_weight_stream_gives_the_server_the_actors_logits(task_hf_dir, world1, monkeypatch):
    monkeypatch.setenv("VERL_ENGINE_DEVICE", "cpu")
    engine = build_engine(task_hf_dir)  # builds DDP hooks: outside no_grad
    with torch.no_grad():
        _stream_and_compare(engine, server_for(task_hf_dir))


def _stream_and_compare(engine, server):
    from backend.forward import forward_logits

    for p in engine.module.parameters():  # the actor moves away from the HF checkpoint
        p.add_(torch.randn_like(p) * 0.05)
    ids_BS = torch.tensor([[1, 9, 12, 9, 16, 2, 3, 1, 20, 22]])
    actor_BSV = forward_logits(engine.module, ids_BS)
    stale = (server.model(ids_BS).logits - actor_BSV).abs().max()
    assert stale > 1e-2  # the server still holds the checkpoint's weights

    stream, _ = engine.get_per_tensor_param()
    server.receive_weights(list(stream))
    assert server.finish_weights(global_steps=7) == 1
    assert (server.model(ids_BS).logits - actor_BSV).abs().max() < 1e-5
    assert server.global_steps == 7


def test_a_partial_weight_set_is_refused(task_hf_dir):
    server = server_for(task_hf_dir)
    before = {k: v.clone() for k, v in server.model.state_dict().items()}
    server.receive_weights([("model.norm.weight", torch.zeros(64))])
    with pytest.raises(ValueError, match="missing .* nothing was loaded"):
        server.finish_weights()
    for k, v in server.model.state_dict().items():
        assert torch.equal(v, before[k]), k


@torch.no_grad()
def test_generate_returns_exact_log_probs_and_routing(task_hf_dir):
    server = server_for(task_hf_dir)
    prompt = [1, 9, 12, 9, 16, 2, 3, 1, 20, 22]
    out = server.generate(prompt, {"temperature": 1.0, "logprobs": True}, request_id="r")
    full = torch.tensor([prompt + out.token_ids])
    log_p = torch.log_softmax(server.model(full).logits[0].double(), -1)
    expected = [float(log_p[len(prompt) - 1 + i, t]) for i, t in enumerate(out.token_ids)]
    assert out.log_probs == pytest.approx(expected, abs=1e-5)
    layers, top_k = server.model.config.num_hidden_layers, server.model.config.num_experts_per_tok
    assert out.routed_experts.shape == (len(prompt) + len(out.token_ids), layers, top_k)
    # the routing of every fed position equals a fresh forward's top-k (as sets)
    server._routing.clear()
    server.model(full[:, :-1])
    fresh = torch.stack(server._routing, dim=1).sort(-1).values
    got = torch.as_tensor(out.routed_experts[: full.shape[1] - 1]).long().sort(-1).values
    assert torch.equal(got, fresh)


def test_adapter_streams_on_every_rank_and_ships_from_the_first(task_hf_dir, monkeypatch):
    """Rank 1 of a 2-rank replica walks the (collective) stream but sends nothing."""
    from types import SimpleNamespace

    from recipes.local.rollout import CpuServerAdapter

    sent = []
    fake_server = SimpleNamespace(
        receive_weights=SimpleNamespace(remote=lambda b: _done(sent.append(("bucket", len(b))))),
        finish_weights=SimpleNamespace(remote=lambda step: _done(sent.append(("finish", step)))),
    )
    config = SimpleNamespace(tensor_model_parallel_size=2, data_parallel_size=1,
                             pipeline_model_parallel_size=1,
                             checkpoint_engine=SimpleNamespace(update_weights_bucket_megabytes=0))  # fmt: skip
    walked = []

    def stream():
        for i in range(3):
            walked.append(i)
            yield f"w{i}", torch.zeros(4)

    for rank, expect in ((0, [("bucket", 3), ("finish", 5)]), (1, [])):
        sent.clear(), walked.clear()
        monkeypatch.setitem(os.environ, "RANK", str(rank))
        monkeypatch.setattr(CpuServerAdapter, "__init__", lambda self, *a, **k: None)
        adapter = CpuServerAdapter()
        adapter.config, adapter.has_server = config, rank % 2 == 0
        adapter.bucket_bytes, adapter._server = 1 << 20, fake_server
        asyncio.run(adapter.update_weights(stream(), global_steps=5))
        assert walked == [0, 1, 2] and sent == expect


async def _async_none(_=None):
    return None


def _done(_):
    return _async_none()
