"""The routes vllm-ascend 0.23 returns (tests/data/vllm_ascend_0_23_routes.json: every field
from vLLM 0.23.0 / vllm-ascend v0.23.0 source lines) are what the engine's R3 path consumes:
numpy uint8 [prompt + response - 1, layers, top-k] (uint16 beyond 256 experts), as they come
from vLLM, as verl 0.9.1's agent loop output hands them on (int16) and as ours does (uint8,
recipes.dapo.engine.compact_routes), reach the routers unchanged and as uint8; a wrong shape or dtype
is refused in one line, never replayed."""

import json
import re
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from backend.model.router_replay import ReplayError, ReplayRouting
from recipes.dapo.engine import replay_routes
from recipes.dapo.engine.batches import BatchError, MicroBatch

pytestmark = pytest.mark.no_mcore  # the 0.16.1 set only (pyproject.toml)

FORMAT = json.loads(
    (Path(__file__).parents[1] / "data" / "vllm_ascend_0_23_routes.json").read_text()
)
MISSION = FORMAT["mission_model"]  # Qwen3-30B-A3B: 128 experts, 48 layers, top-8
PROMPTS, RESPONSES = (5, 9), (4, 3)  # two requests' prompt and response lengths


def vllm_routes(num_experts: int, layers: int, top_k: int, prompt: int, response: int, seed=0):
    """One request's routed_experts exactly as the format file says vLLM 0.23.0 returns them."""
    dtype = np.dtype(FORMAT["dtype"]["value"]["num_experts <= 256" if num_experts <= 256 else
                                               "num_experts > 256"])  # fmt: skip
    rows = prompt + response - 1  # the last sampled token is never fed: no row
    rng = np.random.default_rng(seed)
    ids = np.stack([rng.permutation(num_experts)[:top_k] for _ in range(rows * layers)])
    return ids.reshape(rows, layers, top_k).astype(dtype)  # logical ids 0 .. E - 1


def agent_loop_output(array: np.ndarray, prompt: int, response: int):
    """verl 0.9.1's agent loop output of one request carrying the rollout's routes."""
    from verl.experimental.agent_loop.agent_loop import AgentLoopOutput

    return AgentLoopOutput(prompt_ids=list(range(prompt)), response_ids=list(range(response)),
                           response_mask=[1] * response, routed_experts=array, num_turns=2,
                           metrics={})  # fmt: skip


def through(via: str, array: np.ndarray, prompt: int, response: int) -> torch.Tensor:
    """A request's routes as they leave the rollout side: vLLM's array itself; verl's agent
    loop output as it enters the TransferQueue (`as_dict`: int16, aligned to prompt +
    response rows); ours (recipes.dapo.engine.compact_routes: the same, back at the rollout's dtype)."""
    from recipes.dapo.engine.compact_routes import compact

    if via == "vllm":
        return torch.from_numpy(array)
    output = agent_loop_output(array, prompt, response)
    return (compact(output) if via == "ours" else output).as_dict()["routed_experts"]


def micro_batch(rows: list[torch.Tensor]) -> MicroBatch:
    lengths = [p + r for p, r in zip(PROMPTS, RESPONSES, strict=True)]
    ids_BS = torch.zeros(len(lengths), max(lengths), dtype=torch.long)
    valid_BS = torch.arange(ids_BS.shape[1])[None] < torch.tensor(lengths)[:, None]
    nested = torch.nested.as_nested_tensor(rows, layout=torch.jagged)
    return MicroBatch([0, 1], {"routed_experts": nested}, ids_BS, torch.tensor(lengths), valid_BS,
                      None)  # fmt: skip


def consumed(rows, num_experts, layers=range(0, MISSION["num_hidden_layers"])):
    """The engine's R3 path for the old-log-prob pass (recipes.dapo.engine.passes ->
    replay_routes.micro_batch_routes -> batches.micro_batch_routes)."""
    out = replay_routes.micro_batch_routes(
        micro_batch(rows), "old_log_prob", "R3", torch.device("cpu"), layers, num_experts
    )
    return out["replay"]


def test_the_format_file_names_its_sources():
    """Never a guess: each field carries the source lines it was read from."""
    for field in ("container", "shape", "dtype", "ids", "verl_0_9_1"):
        assert re.search(r"\.py:\d+", FORMAT[field]["source"]), field
    assert FORMAT["dtype"]["value"] == {
        "num_experts <= 256": "uint8",
        "num_experts > 256": "uint16",
    }


@pytest.mark.parametrize(
    "via, arrives", [("vllm", torch.uint8), ("verl", torch.int16), ("ours", torch.uint8)]
)
def test_mission_routes_arrive_unchanged_as_uint8(via, arrives):
    """128 experts, 48 layers, top-8: uint8 [T, 48, 8]; replayed on every fed token, as uint8,
    id for id (catches a route shifted by a row, a layer or a slot, or widened on the way:
    verl's own agent loop output widens them to int16, ours keeps the rollout's uint8)."""
    e, n_layers, k = (
        MISSION["num_experts"],
        MISSION["num_hidden_layers"],
        MISSION["num_experts_per_tok"],
    )
    arrays = [
        vllm_routes(e, n_layers, k, p, r, seed=i)
        for i, (p, r) in enumerate(zip(PROMPTS, RESPONSES, strict=True))
    ]
    assert all(a.dtype == np.uint8 and a.shape == (p + r - 1, 48, 8)
               for a, p, r in zip(arrays, PROMPTS, RESPONSES, strict=True))  # fmt: skip
    rows = [through(via, a, p, r) for a, p, r in zip(arrays, PROMPTS, RESPONSES, strict=True)]
    assert {row.dtype for row in rows} == {arrives}
    routes = consumed(rows, e)
    assert routes.experts_BSLK.dtype == torch.uint8
    for b, a in enumerate(arrays):
        fed = a.shape[0]
        assert torch.equal(routes.experts_BSLK[b, :fed], torch.from_numpy(a))
        assert routes.use_BS[b, :fed].all() and not routes.use_BS[b, fed:].any()


def test_routes_past_256_experts_come_as_uint16_and_are_kept():
    """vLLM's uint16 (> 256 experts) straight from the rollout: torch has no min / max for
    uint16 (a crash in the id check before); they reach the routers as int16, unchanged."""
    a = vllm_routes(512, 2, 4, PROMPTS[0], RESPONSES[0])
    b = vllm_routes(512, 2, 4, PROMPTS[1], RESPONSES[1], seed=1)
    assert a.dtype == np.uint16 and a.max() > 255
    routes = consumed([torch.from_numpy(a), torch.from_numpy(b)], 512, layers=range(0, 2))
    assert routes.experts_BSLK.dtype == torch.int16
    assert torch.equal(routes.experts_BSLK[0, : a.shape[0]].long(), torch.from_numpy(a).long())


@pytest.mark.parametrize(
    "damage, words",
    [
        (lambda a: a.astype(np.float32), "routed_experts is torch.float32: expected integer"),
        (lambda a: a[:, :, 0], "rows are (8, 48): expected [positions, layers, top-k]"),
        (lambda a: a[:, :40], "covers 40 layers, the model has more"),
        (lambda a: a.astype(np.int16) + 128, "the model has 128 experts: are the routes"),
        (lambda a: a[:-2], "row 0 has 6 positions for 9 tokens"),
    ],
    ids=["float", "no-top-k-axis", "fewer-layers", "ids-out-of-range", "rows-short"],
)
def test_a_wrong_shape_or_dtype_is_refused_in_one_line(damage, words):
    """Both requests damaged alike (another model's routes, a float copy, a dropped axis)."""
    e, k = MISSION["num_experts"], MISSION["num_experts_per_tok"]
    arrays = [
        damage(vllm_routes(e, MISSION["num_hidden_layers"], k, p, r, seed=i))
        for i, (p, r) in enumerate(zip(PROMPTS, RESPONSES, strict=True))
    ]
    with pytest.raises(BatchError) as err:
        consumed([torch.from_numpy(np.ascontiguousarray(a)) for a in arrays], e)
    assert words in str(err.value) and "\n" not in str(err.value)


def test_another_models_top_k_is_refused_at_the_router():
    """Top-4 routes on a top-8 router would silently replay 4 experts a token."""
    config = SimpleNamespace(num_moe_experts=128, moe_router_topk=8, moe_router_pre_softmax=False,
                             moe_router_topk_scaling_factor=None)  # fmt: skip
    logits = torch.randn(3, 128)
    own = torch.zeros(3, 128, dtype=torch.bool).scatter(1, logits.topk(8).indices, True)
    router = SimpleNamespace(
        config=config, layer_number=1, routing=lambda lg: (lg.softmax(-1), own)
    )
    target = torch.from_numpy(vllm_routes(128, 1, 4, 2, 2)[:, 0]), torch.ones(3, dtype=torch.bool)
    tap = SimpleNamespace(replay_target=lambda layer, t: target, own_map_TE=None)
    with pytest.raises(
        ReplayError, match="routes hold 4 experts a token, layer 1's router picks top-8"
    ):
        ReplayRouting(router, tap)(logits)
    right = torch.from_numpy(vllm_routes(128, 1, 8, 2, 2)[:, 0]), target[1]
    tap.replay_target = lambda layer, t: right
    _, map_TE = ReplayRouting(router, tap)(logits)
    assert torch.equal(map_TE.nonzero()[:, 1].view(3, 8), right[0].long().sort(1).values)
