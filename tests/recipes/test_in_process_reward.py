"""The CPU run's reward scored in the agent-loop worker (recipes.dapo.engine.in_process_reward):
verl's own `AgentLoopWorker._compute_score` with it, against the same method handed verl's
`RewardLoopWorker` the way its Ray actor gets a sample (pickled), on the run's composed config."""

import asyncio
import pickle
from types import SimpleNamespace

import pytest

from tests.recipes.test_replay_polling import _run_config

# the sums task's reward (math_dapo on "Answer: N") with the dapo manager's overlong buffer:
# 48 response tokens at most, the last 8 of them penalised up to -1 (recipes.local.cpu_overrides)
MAX_RESPONSE, BUFFER = 48, 8


@pytest.fixture(scope="module")
def run_config(tmp_path_factory):
    from omegaconf import open_dict

    from recipes.local.task.doubles import write_tokenizer

    tmp = tmp_path_factory.mktemp("reward")
    cfg = _run_config(tmp)
    write_tokenizer(tmp / "tokenizer")
    with open_dict(cfg):
        cfg.actor_rollout_ref.model.path = str(tmp / "tokenizer")
        cfg.actor_rollout_ref.model.tokenizer_path = None
    return cfg


class _ViaVerlsWorker:
    """What verl hands its agent loop: a reward actor; the sample crosses a process (pickled)
    and verl's RewardLoopWorker, made in its actor's event loop, scores it."""

    def __init__(self, cfg, loop):
        from verl.experimental.reward_loop.reward_loop import RewardLoopWorker

        async def make():
            return RewardLoopWorker(cfg, reward_router_address=None)

        worker = loop.run_until_complete(make())
        self.compute_score = SimpleNamespace(
            remote=lambda data: worker.compute_score(pickle.loads(pickle.dumps(data)))
        )


def _scored(loop, handle, tokenizer, response: str, answer: str) -> tuple[float, dict]:
    """verl's _compute_score of one sample, in `loop` (an agent-loop worker runs one loop)."""
    from verl.experimental.agent_loop.agent_loop import (
        AgentLoopMetrics,
        AgentLoopOutput,
        AgentLoopWorker,
    )

    worker = AgentLoopWorker.__new__(AgentLoopWorker)  # what _compute_score reads of it
    worker.reward_loop_worker_handles, worker.processor, worker.tokenizer = (
        [handle],
        None,
        tokenizer,
    )
    worker.mm_processor_kwargs = None
    ids = tokenizer.encode(response, add_special_tokens=False)
    output = AgentLoopOutput(prompt_ids=tokenizer.encode("3+9=", add_special_tokens=False),
                             response_ids=ids, response_mask=[1] * len(ids),
                             metrics=AgentLoopMetrics())  # fmt: skip
    kwargs = {"data_source": "math_dapo", "reward_model": {"ground_truth": answer},
              "extra_info": {"split": "train", "index": 0}}  # fmt: skip
    loop.run_until_complete(AgentLoopWorker._compute_score(worker, [output], kwargs))
    return output.reward_score, output.extra_fields["reward_extra_info"]


def test_the_agent_loop_scores_as_verls_reward_worker(run_config):
    """Bug caught: a score other than verl's reward manager gives on the run's config (the
    overlong buffer lost, the ground truth read from elsewhere), or a handle verl's
    `_compute_score` cannot await."""
    from verl.utils import hf_tokenizer

    from recipes.dapo.engine.in_process_reward import InProcessReward

    tokenizer = hf_tokenizer(run_config.actor_rollout_ref.model.path)
    loop = asyncio.new_event_loop()
    ours, verls = InProcessReward(run_config), _ViaVerlsWorker(run_config, loop)
    long = "Answer: 12" + " " * (MAX_RESPONSE - BUFFER - len("Answer: 12") + 4)  # 4 into it
    cases = [("Answer: 12", "12", 1.0), ("Answer: 13", "12", -1.0), (long, "12", 1.0 - 4 / BUFFER)]
    for response, answer, expected in cases:
        score, info = _scored(loop, ours, tokenizer, response, answer)
        assert (score, info) == _scored(loop, verls, tokenizer, response, answer)
        assert score == pytest.approx(expected)
        assert info["acc"] == (expected > 0)  # DAPO's group filter reads acc
    loop.close()


def test_the_handle_travels_without_its_worker_and_builds_it_once(run_config):
    """Bug caught: the reward manager pickled into every agent-loop worker's arguments, or a
    new one built for every sample."""
    from recipes.dapo.engine.in_process_reward import InProcessReward

    handle = InProcessReward(run_config)
    first = handle.worker()
    assert handle.worker() is first
    assert pickle.loads(pickle.dumps(handle))._worker is None


def test_the_cpu_run_makes_no_reward_actor(tmp_path):
    """Bug caught: the manager named but verl still making its reward actors (a process
    importing verl, idle), or the manager dropped and the reward hop back."""
    from recipes.local.cpu_overrides import IN_PROCESS_REWARD

    cfg = _run_config(tmp_path)
    assert cfg.actor_rollout_ref.rollout.agent.agent_loop_manager_class == IN_PROCESS_REWARD
    assert cfg.reward.num_workers == 0


def test_a_reward_model_is_refused_in_one_line(run_config):
    from omegaconf import open_dict

    from recipes.dapo.engine.in_process_reward import InProcessRewardManager

    cfg = run_config.copy()
    with open_dict(cfg):
        cfg.reward.reward_model.enable = True
    with pytest.raises(ValueError, match=r"rule-based rewards only") as e:
        InProcessRewardManager(cfg, llm_client=None)
    assert "\n" not in str(e.value)


def test_a_changed_compute_score_is_refused_in_one_line(monkeypatch):
    """Bug caught: a verl whose agent loop calls its reward workers otherwise, answered
    silently."""
    from recipes.dapo.engine import in_process_reward

    monkeypatch.setattr(in_process_reward, "score_digest", lambda: "0" * 64)
    with pytest.raises(RuntimeError, match=r"verl 0\.9\.1's AgentLoopWorker\._compute_score"):
        in_process_reward.check_verl()
