"""R3's routes at one byte an expert id from the rollout to the engine.

vLLM returns `routed_experts` as uint8 up to 256 experts (uint16 beyond), and verl 0.9.1's
agent loop output widens them to int16 on their way into its TransferQueue
(`AgentLoopOutput.as_dict`, verl/experimental/agent_loop/agent_loop.py:129-141): twice the
bytes through the queue, Ray and the trainer's batch (1.9 GB instead of 0.96 a Qwen3-30B-A3B
training batch: the dry run's route line). verl's extension point for agent loops (a config
file of `name` + `_target_`, `rollout.agent.agent_loop_config_path`, and
`rollout.agent.default_agent_loop`: recipes.dapo.job.overrides.AGENT_LOOPS) runs `CompactRoutesAgentLoop`: verl's single-turn loop
whose output narrows the routes back to the rollout's own uint8 after verl's alignment. The
engine takes any integer dtype (recipes.dapo.engine.batches.micro_batch_routes).

The loop also asks vLLM for what verl reads and no more (`tokens_only`): verl's agent loop
and reward take the token ids, so the request is not detokenized, and in the sync trainer it
asks for the final output only (vLLM's default sends one a token, each awaited by verl's
server). On the 2-core CPU run the rollout server's CPU fell from 72 to 60 ms a group of 16
(docs/first_run.md).
"""

import torch
from omegaconf import OmegaConf
from verl.experimental.agent_loop.agent_loop import AgentLoopOutput
from verl.experimental.agent_loop.single_turn_agent_loop import SingleTurnAgentLoop


def is_uint8(routes) -> bool:
    """Whether the rollout returned one byte an id (numpy's or torch's uint8)."""
    return str(getattr(routes, "dtype", "")) in ("uint8", "torch.uint8")


class CompactRoutesOutput(AgentLoopOutput):
    """verl's agent loop output whose `as_dict` keeps the rollout's uint8 routes."""

    def as_dict(self) -> dict:
        out = super().as_dict()
        if is_uint8(self.routed_experts):  # verl widened them to int16: every id is < 256
            out["routed_experts"] = out["routed_experts"].to(torch.uint8)
        return out


class CompactRoutesAgentLoop(SingleTurnAgentLoop):
    """verl's single-turn agent loop; its output keeps the rollout's uint8 routes."""

    async def run(self, sampling_params: dict, priority: int = 0, **kwargs) -> AgentLoopOutput:
        sync = OmegaConf.select(self.config, "trainer.v1.trainer_mode") == "sync"
        request = tokens_only(sampling_params, final_only=sync)
        output = await super().run(request, priority=priority, **kwargs)
        return compact(output)


def tokens_only(sampling_params: dict, final_only: bool) -> dict:
    """vLLM's sampling parameters for a request whose text nobody reads: no detokenizing
    (verl's agent loop and reward take the token ids), and with `final_only` one output at
    the end instead of one a token."""
    from vllm.sampling_params import RequestOutputKind

    request = {**sampling_params, "detokenize": False}
    if final_only:
        request["output_kind"] = RequestOutputKind.FINAL_ONLY
    return request


def compact(output: AgentLoopOutput) -> CompactRoutesOutput:
    """The same output (its fields, and which of them were set) as a CompactRoutesOutput."""
    fields = {name: getattr(output, name) for name in type(output).model_fields}
    return CompactRoutesOutput.model_construct(_fields_set=set(output.model_fields_set), **fields)
