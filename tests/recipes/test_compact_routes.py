"""R3's routes stay one byte an id from the rollout to the engine (recipes.dapo.engine.compact_routes):
verl 0.9.1's agent loop output widens vLLM's uint8 routes to int16 on their way into the
TransferQueue; ours is verl's single-turn loop whose output narrows them back, every other
field as verl's. The launch side: tests/recipes/test_verl_cpu_trainer.py (the engine's
`moe/rollout_routes/id_bytes`)."""

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf

pytestmark = pytest.mark.no_mcore  # the 0.16.1 set only (pyproject.toml)

PROMPT, RESPONSE = 6, 5


def output(routes):
    from verl.experimental.agent_loop.agent_loop import AgentLoopOutput

    return AgentLoopOutput(prompt_ids=list(range(PROMPT)), response_ids=list(range(RESPONSE)),
                           response_mask=[1] * RESPONSE, routed_experts=routes, num_turns=2,
                           metrics={}, reward_score=1.0)  # fmt: skip


def mission_routes(dtype=np.uint8, experts=128):
    """vLLM's routes of one request at Qwen3-30B-A3B's shape: [prompt + response - 1, 48, 8]."""
    rng = np.random.default_rng(0)
    return rng.integers(0, experts, (PROMPT + RESPONSE - 1, 48, 8)).astype(dtype)


def same(a: dict, b: dict) -> bool:
    if a.keys() != b.keys():
        return False
    return all(torch.equal(a[k], b[k]) if torch.is_tensor(a[k]) else a[k] == b[k] for k in a)


def test_the_output_is_verls_but_its_routes_stay_uint8():
    """Catches routes widened to int16 (twice the bytes through the queue, Ray and the
    trainer's batch), ids changed by the narrowing, or any other field lost on the way
    (a field verl set, dropped from `model_fields_set`, would vanish from as_dict)."""
    from recipes.dapo.engine.compact_routes import CompactRoutesOutput, compact

    verl_out = output(mission_routes())
    ours = compact(verl_out)
    assert (
        isinstance(ours, CompactRoutesOutput) and ours.model_fields_set == verl_out.model_fields_set
    )
    theirs, mine = verl_out.as_dict(), ours.as_dict()
    assert theirs["routed_experts"].dtype == torch.int16
    assert mine["routed_experts"].dtype == torch.uint8
    assert torch.equal(mine["routed_experts"].long(), theirs["routed_experts"].long())
    assert mine["routed_experts"].shape == (PROMPT + RESPONSE, 48, 8)  # verl's alignment
    assert same({k: v for k, v in mine.items() if k != "routed_experts"},
                {k: v for k, v in theirs.items() if k != "routed_experts"})  # fmt: skip


def test_wider_ids_and_no_routes_are_left_as_verl_has_them():
    """uint16 routes (> 256 experts) cannot be narrowed: verl's int16 stays; an output
    without routes (R3 off, validation) is verl's exactly."""
    from recipes.dapo.engine.compact_routes import compact

    wide = output(mission_routes(np.uint16, experts=512))
    assert compact(wide).as_dict()["routed_experts"].dtype == torch.int16
    bare = output(None)
    assert same(compact(bare).as_dict(), bare.as_dict())


def test_verl_finds_our_loop_through_its_config_file_and_the_run_names_it():
    """The agent-loop config file verl loads (rollout.agent.agent_loop_config_path) names the
    loop the run's default_agent_loop asks for, and its target is verl's single-turn loop
    underneath: catches a renamed loop (verl asserts at the first prompt) or a target path
    that no longer imports."""
    import hydra.utils
    from verl.experimental.agent_loop.single_turn_agent_loop import SingleTurnAgentLoop

    from recipes.dapo.engine.compact_routes import CompactRoutesAgentLoop
    from recipes.dapo.job import overrides

    (entry,) = OmegaConf.load(overrides.AGENT_LOOPS)
    assert entry.name == overrides.AGENT_LOOP
    cls = hydra.utils.get_class(entry._target_)
    assert cls is CompactRoutesAgentLoop and issubclass(cls, SingleTurnAgentLoop)


@pytest.mark.parametrize("argv", [["--model", "tiny"], ["--device", "npu"], ["--device", "cuda"]])
def test_every_run_rolls_out_through_our_loop(argv, tmp_path):
    """The local run and both clusters' runs name our loop and verl's config file for it (an
    absolute path: the agent-loop workers resolve it on their own nodes)."""
    from recipes.dapo.job import overrides
    from tests.recipes.test_trainer_modes import cli, resolved

    local = ["--ckpt-dir", str(tmp_path)] if "--model" in argv else []
    kv = cli(resolved([*argv, *local]))
    r = "actor_rollout_ref.rollout.agent"
    assert kv[f"{r}.default_agent_loop"] == overrides.AGENT_LOOP
    assert kv[f"{r}.agent_loop_config_path"] == str(overrides.AGENT_LOOPS)
    assert overrides.AGENT_LOOPS.is_absolute() and overrides.AGENT_LOOPS.is_file()


def test_requests_ask_for_tokens_only_and_one_output_only_in_sync():
    """The loop's vLLM request: no detokenizing in every mode; one output at the end only in
    the sync trainer (verl's pause in the async modes waits on each request's first output,
    vllm_async_server.py:970, which one-output-at-the-end would hold to its end). Catches the
    caller's dict changed in place (verl reuses it for every sample of the batch)."""
    from vllm.sampling_params import RequestOutputKind, SamplingParams

    from recipes.dapo.engine.compact_routes import tokens_only

    given = {"temperature": 1.0, "top_p": 1.0, "logprobs": 0}
    sync, async_ = tokens_only(given, final_only=True), tokens_only(given, final_only=False)
    assert given == {"temperature": 1.0, "top_p": 1.0, "logprobs": 0}
    assert sync == {**given, "detokenize": False, "output_kind": RequestOutputKind.FINAL_ONLY}
    assert async_ == {**given, "detokenize": False}
    params = SamplingParams(max_tokens=4, **sync)  # what verl's server builds from it
    assert params.output_kind is RequestOutputKind.FINAL_ONLY and not params.detokenize


@pytest.mark.parametrize("mode, final_only", [("sync", True), ("colocate_async", False)])
def test_the_loop_asks_by_the_trainer_mode(mode, final_only, monkeypatch):
    """CompactRoutesAgentLoop.run hands verl's loop the tokens-only request of its trainer
    mode and narrows what comes back."""
    import asyncio

    from verl.experimental.agent_loop.single_turn_agent_loop import SingleTurnAgentLoop

    from recipes.dapo.engine.compact_routes import CompactRoutesAgentLoop, CompactRoutesOutput

    asked = {}

    async def verls_run(self, sampling_params, priority=0, **kwargs):
        asked.update(sampling_params)
        return output(mission_routes())

    monkeypatch.setattr(SingleTurnAgentLoop, "run", verls_run)
    loop = object.__new__(CompactRoutesAgentLoop)
    loop.config = OmegaConf.create({"trainer": {"v1": {"trainer_mode": mode}}})
    out = asyncio.run(loop.run({"temperature": 1.0}, raw_prompt=[]))
    assert isinstance(out, CompactRoutesOutput) and asked["detokenize"] is False
    assert out.as_dict()["routed_experts"].dtype == torch.uint8
    assert ("output_kind" in asked) is final_only
