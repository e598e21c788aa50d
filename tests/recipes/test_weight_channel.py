"""The gloo weight channel (recipes.dapo.engine.weight_channel) through verl's own protocol: prepare
on every rank, the topology from the class, init, send/receive, finalize. Ranks are threads
of one process here; in a run they are the actor's and the rollout's Ray workers."""

import asyncio
import threading

import pytest
import torch

pytest.importorskip("verl")
from verl.checkpoint_engine.base import CheckpointEngineRegistry  # noqa: E402

from recipes.dapo.engine import weight_channel


def _weights(seed: int = 0) -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [
        ("model.embed_tokens.weight", torch.randn(32, 16, generator=g)),
        ("model.layers.0.mlp.gate.weight", torch.randn(128, 16, generator=g).to(torch.bfloat16)),
        (
            "model.layers.0.mlp.experts.0.down_proj.weight",
            torch.randn(200, 64, generator=g),
        ),  # > a bucket
        ("model.layers.0.input_layernorm.weight", torch.randn(16, generator=g).half()),
        ("lm_head.weight", torch.randn(32, 16, generator=g)),
        ("counts", torch.arange(7, dtype=torch.int64)),
    ]


def _run(n_actor: int, n_rollout: int, weights, bucket_bytes: int = 4096, timeout_s: float = 60.0):
    """Every rank's result: actor ranks -> how many tensors their generator yielded,
    rollout ranks -> the (name, tensor) pairs received."""
    engine_cls = CheckpointEngineRegistry.get(weight_channel.NAME)
    actors = [
        engine_cls(bucket_bytes, is_master=(r == 0), timeout_s=timeout_s) for r in range(n_actor)
    ]
    rollouts = [engine_cls(bucket_bytes, timeout_s=timeout_s) for _ in range(n_rollout)]
    metadata = [e.prepare() for e in actors + rollouts]
    actor_kw, rollout_kw = engine_cls.build_topology(n_actor, n_rollout, metadata)
    results: dict = {}

    def rank(key, engine, kwargs, body):
        try:
            engine.init_process_group(**kwargs)
            results[key] = asyncio.run(body(engine))
            engine.finalize()
        except BaseException as e:  # noqa: BLE001 - reported by the test
            results[key] = e

    def send(engine):
        seen = []

        def gen():
            for name, t in weights:
                seen.append(name)
                yield name, t

        async def body(e):
            sent = await e.send_weights(gen())
            return len(seen), sent

        return body

    async def receive(engine):
        return [(n, t.clone()) async for n, t in engine.receive_weights()]

    threads = []
    for i, e in enumerate(actors):
        kw = {k: v[i] for k, v in actor_kw.items()}
        threads.append(threading.Thread(target=rank, args=(("actor", i), e, kw, send(e))))
    for i, e in enumerate(rollouts):
        kw = {k: v[i] for k, v in rollout_kw.items()}
        threads.append(threading.Thread(target=rank, args=(("rollout", i), e, kw, receive)))
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout_s)
    for key, value in results.items():
        if isinstance(value, BaseException):
            raise AssertionError(f"{key}: {value!r}") from value
    return results


def test_every_rollout_worker_receives_the_weights_bit_for_bit_in_order():
    """Bug caught: a bucket boundary that drops, reorders or re-types a tensor (the one larger
    than a bucket, a bf16 router, an int buffer), or a receiver yielding a view of a buffer the
    next bucket overwrites (the clone after the loop would then see the last bucket's bytes)."""
    weights = _weights()
    results = _run(n_actor=2, n_rollout=2, weights=weights)
    for i in range(2):
        got = results[("rollout", i)]
        assert [n for n, _ in got] == [n for n, _ in weights]
        for (_, want), (_, t) in zip(weights, got, strict=True):
            assert t.dtype == want.dtype and t.shape == want.shape
            assert torch.equal(t.view(torch.uint8), want.contiguous().view(torch.uint8))


def test_actor_ranks_that_sit_out_still_run_the_collective_gather_to_its_end():
    """Bug caught: a rank that returns at once leaves its TP/EP peers waiting in the gather
    that builds the full tensors (get_per_tensor_param is collective over the actor group)."""
    weights = _weights(1)
    results = _run(n_actor=3, n_rollout=1, weights=weights)
    assert [results[("actor", i)][0] for i in range(3)] == [len(weights)] * 3
    # the sender reports what went over the wire (verl logs it with the step), the others nothing
    sent = results[("actor", 0)][1]
    nbytes = sum(t.numel() * t.element_size() for _, t in weights)
    assert (sent["weight_sync/gloo/tensors"], sent["weight_sync/gloo/mib"]) == (
        len(weights),
        nbytes / 2**20,
    )
    assert results[("actor", 1)][1] == {} == results[("actor", 2)][1]


def test_the_mission_shape_128_experts_goes_through_in_small_buckets():
    """The 128-expert, top-8 layer's tensors (router [128, H], 128 experts' projections), as
    the mini model's sync sends them, through 16 KiB buckets."""
    g = torch.Generator().manual_seed(2)
    hidden, ffn = 128, 32
    weights = [("model.layers.0.mlp.gate.weight", torch.randn(128, hidden, generator=g))]
    for e in range(128):
        p = f"model.layers.0.mlp.experts.{e}"
        weights += [
            (f"{p}.gate_proj.weight", torch.randn(ffn, hidden, generator=g).to(torch.bfloat16)),
            (f"{p}.down_proj.weight", torch.randn(hidden, ffn, generator=g).to(torch.bfloat16)),
        ]
    got = _run(n_actor=1, n_rollout=1, weights=weights, bucket_bytes=16 << 10)[("rollout", 0)]
    assert len(got) == 1 + 2 * 128
    assert all(torch.equal(a, b) for (_, a), (_, b) in zip(weights, got, strict=True))


def test_a_header_naming_no_torch_dtype_is_refused():
    """Bug caught: getattr on torch with a name off the wire (any attribute, not a dtype)."""
    assert weight_channel._dtype("torch.bfloat16") is torch.bfloat16
    with pytest.raises(ValueError, match="'torch.load' is not a torch dtype"):
        weight_channel._dtype("torch.load")


def test_the_topology_needs_the_sender_endpoint():
    engine_cls = weight_channel.GlooCheckpointEngine
    with pytest.raises(RuntimeError, match="did not host the rendezvous"):
        engine_cls.build_topology(1, 1, [{"endpoint": None}, {"endpoint": None}])
