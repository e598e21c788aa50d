"""verl's rule-based reward, computed in the agent-loop worker that produced the response.

verl 0.9.1's agent loop scores every finished sample through a reward worker, a Ray actor of
its own (`AgentLoopWorker._compute_score`: the sample packed into a DataProto, pickled, sent,
scored by `RewardLoopWorker.compute_score`, the result sent back). For a rule-based score
(the DAPO recipe's math_dapo, a few microseconds of string work) the hop is the cost: on the
2-core CPU run the reward process alone held 0.13 cores during generation, beside the
agent loop's packing and the Ray calls (docs/first_run.md, "The reused run").

The hook verl offers is its agent-loop manager class
(`rollout.agent.agent_loop_manager_class`, read by `TaskRunnerV1.init_agent_loop_manager`).
`InProcessRewardManager` is verl's `AgentLoopManagerTQ` whose workers are handed, where verl
hands them reward actors, an `InProcessReward`: it answers `compute_score.remote(data)` with
verl's own `RewardLoopWorker.compute_score`, made once in the worker's process. The score is
verl's code on verl's DataProto; only the process changes. With it, `reward.num_workers=0`:
verl then makes no reward actor. A reward model (`reward.reward_model.enable`) is refused in
one line: its scores come from a server the reward actors call.

`check_verl` refuses in one line at import unless verl is 0.9.1 with the `_compute_score`
this relies on (tests/recipes/test_in_process_reward.py runs verl's `_compute_score` with it
against verl's `RewardLoopWorker`).
"""

import hashlib
import inspect

import verl
from verl.experimental.agent_loop.agent_loop import AgentLoopWorker
from verl.trainer.ppo.v1.agent_loop_tq import AgentLoopManagerTQ

VERL_VERSION = "0.9.1"
# sha256 of inspect.getsource(AgentLoopWorker._compute_score) in verl 0.9.1: it picks a handle
# with random.choice and awaits `handle.compute_score.remote(data)`
SCORE_SHA256 = "cf4b57719ad3c1b236e49fb99dddc4f6cf05bc0fb125e1475ce5c2534af2b742"
PATH = "recipes.dapo.engine.in_process_reward.InProcessRewardManager"


def score_digest() -> str:
    return hashlib.sha256(inspect.getsource(AgentLoopWorker._compute_score).encode()).hexdigest()


def check_verl() -> None:
    """Refuse in one line unless verl's `_compute_score` is the one InProcessReward answers."""
    if verl.__version__ != VERL_VERSION or score_digest() != SCORE_SHA256:
        raise RuntimeError(
            f"InProcessReward answers verl {VERL_VERSION}'s AgentLoopWorker._compute_score; verl "
            f"{verl.__version__}'s differs: install verl=={VERL_VERSION} or drop "
            "rollout.agent.agent_loop_manager_class"
        )


class _Remote:
    """`handle.compute_score.remote(data)`, awaited by verl: the local worker's coroutine."""

    def __init__(self, owner: "InProcessReward"):
        self.owner = owner

    def remote(self, data):
        return self.owner.worker().compute_score(data)


class InProcessReward:
    """Where verl's agent loop expects a reward actor's handle: verl's `RewardLoopWorker`,
    built in this process at the first score (the config travels, the worker does not)."""

    def __init__(self, config):
        self.config = config
        self._worker = None

    def __getstate__(self) -> dict:
        return {"config": self.config, "_worker": None}

    def worker(self):
        if self._worker is None:
            from verl.experimental.reward_loop.reward_loop import RewardLoopWorker

            self._worker = RewardLoopWorker(self.config, reward_router_address=None)
        return self._worker

    @property
    def compute_score(self) -> _Remote:
        return _Remote(self)


class InProcessRewardManager(AgentLoopManagerTQ):
    """verl's TransferQueue agent-loop manager; its workers score in their own process."""

    def __init__(self, config, llm_client, teacher_client=None, reward_loop_worker_handles=None):
        if config.reward.reward_model.enable:
            raise ValueError(
                "InProcessRewardManager scores rule-based rewards only; with "
                "reward.reward_model.enable drop rollout.agent.agent_loop_manager_class"
            )
        super().__init__(config, llm_client, teacher_client, [InProcessReward(config)])


check_verl()
