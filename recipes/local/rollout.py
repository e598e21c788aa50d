"""verl's rollout on CPU: `actor_rollout_ref.rollout.name=cpu`, served by transformers.

Three pieces, in the places vLLM's take (verl/workers/rollout/vllm_rollout/):
- `CpuReplica` (a verl RolloutReplica, registered with RolloutReplicaRegistry): starts one
  `CpuRolloutServer` Ray actor per replica in the trainer process.
- `CpuRolloutServer`: Qwen3MoeForCausalLM in fp32; `generate` (token in, token out) samples
  one request at a time with a KV cache and returns each token's log-prob and, per position
  and layer, the top-k experts the router picked (verl's `routed_experts` layout:
  [prompt + response, layers, top_k]).
- `CpuServerAdapter` (verl's BaseRollout inside each actor worker): `update_weights` takes
  the engine's stream of HF-named full tensors (what vLLM's ServerAdapter gets) and ships
  it to its server in buckets; the server loads the weights only from that stream.

verl 0.9.1 has no register function for the in-process adapter: `get_rollout_class` reads
the module-level dict `_ROLLOUT_REGISTRY` (verl/workers/rollout/base.py:89), so `register`
adds one key there; tests/test_verl_cpu_stack.py fails if verl renames or reshapes it.
"""

import asyncio
import os
from collections.abc import Iterable

import ray
import torch
from verl.workers.rollout.base import BaseRollout
from verl.workers.rollout.replica import RolloutReplica, RolloutReplicaRegistry, TokenOutput

NAME = "cpu"
BUCKET_BYTES = 64 << 20


def _server_name(replica_rank: int, suffix: str = "") -> str:
    return f"{NAME}_rollout_server_{replica_rank}{suffix}"


def _get(config, key, default=None):
    return config.get(key, default) if hasattr(config, "get") else getattr(config, key, default)


class CpuRolloutServer:
    """One replica's model and sampler (a Ray actor; calls run one at a time, in order)."""

    def __init__(self, config, model_config, replica_rank: int):
        from transformers import AutoTokenizer, Qwen3MoeForCausalLM

        path = _get(model_config, "local_path") or _get(model_config, "path")
        self.model = Qwen3MoeForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        tokenizer = AutoTokenizer.from_pretrained(path)
        self.stop_ids = {tokenizer.eos_token_id}
        self.response_length = int(_get(config, "response_length"))
        self.record_experts = bool(_get(config, "enable_rollout_routing_replay", False))
        self.gen = torch.Generator().manual_seed(int(_get(config, "seed", 0)) + replica_rank)
        self.pending: dict[str, torch.Tensor] = {}
        self.global_steps = None
        self.weight_updates = 0
        self._routing: list[torch.Tensor] = []
        self._hooks = [
            layer.mlp.gate.register_forward_hook(self._record_routing)
            for layer in self.model.model.layers
        ]

    # ---- weights: only through verl's weight-update path --------------------------------

    def receive_weights(self, named: list[tuple[str, torch.Tensor]]) -> int:
        self.pending.update(named)
        return len(self.pending)

    def finish_weights(self, global_steps=None) -> int:
        """Load the whole received set (HF hub names) into the model; strict: all or nothing."""
        from backend.qwen3_moe import fuse_experts

        state, self.pending = fuse_experts(self.pending), {}
        expected = {k: v.shape for k, v in self.model.state_dict().items()}
        got = {k: v.shape for k, v in state.items()}
        if got != expected:  # load_state_dict would copy the matching part before raising
            missing, extra = (
                sorted(expected.keys() - got.keys()),
                sorted(got.keys() - expected.keys()),
            )
            wrong = sorted(k for k in expected.keys() & got.keys() if expected[k] != got[k])
            raise ValueError(
                f"weight update does not match the rollout model: missing {missing[:3]}, "
                f"unexpected {extra[:3]}, wrong shape {wrong[:3]}; nothing was loaded"
            )
        self.model.load_state_dict(state, strict=True)
        self.weight_updates += 1
        if global_steps is not None:
            self.global_steps = global_steps
        return self.weight_updates

    # ---- generation ---------------------------------------------------------------------

    def _record_routing(self, module, inputs, output) -> None:
        self._routing.append(output[2])  # router_indices [T, top_k]

    @torch.no_grad()
    def generate(self, prompt_ids, sampling_params: dict, request_id: str, **unused) -> TokenOutput:
        from transformers import DynamicCache

        temperature = float(sampling_params.get("temperature", 1.0))
        max_new = min(int(sampling_params.get("max_tokens") or self.response_length),
                      self.response_length)  # fmt: skip
        ids = torch.tensor([list(prompt_ids)], dtype=torch.long)
        cache, tokens, log_probs, routed = DynamicCache(), [], [], []
        for _ in range(max_new):
            self._routing.clear()
            logits_V = self.model(ids, past_key_values=cache, use_cache=True).logits[0, -1]
            routed.append(torch.stack(self._routing, dim=1))  # [T, layers, top_k]
            token, log_prob = self._sample(logits_V.double(), temperature)
            tokens.append(token)
            log_probs.append(log_prob)
            if token in self.stop_ids:
                break
            ids = torch.tensor([[token]])
        experts = torch.cat(routed)
        experts = torch.cat((experts, experts.new_zeros(1, *experts.shape[1:])))  # last: never fed
        return TokenOutput(
            token_ids=tokens,
            log_probs=log_probs if sampling_params.get("logprobs") else None,
            routed_experts=experts.to(torch.int16).numpy() if self.record_experts else None,
            stop_reason="completed",
            extra_fields={"global_steps": self.global_steps},
        )

    def _sample(self, logits_V: torch.Tensor, temperature: float) -> tuple[int, float]:
        """A token of softmax(logits / T) (greedy at T = 0) and its log-prob under that law."""
        if temperature <= 0:
            token = int(logits_V.argmax())
            return token, float(torch.log_softmax(logits_V, -1)[token])
        log_p_V = torch.log_softmax(logits_V / temperature, -1)
        token = int(torch.multinomial(log_p_V.exp(), 1, generator=self.gen))
        return token, float(log_p_V[token])

    # ---- what verl's replica and trainer call; nothing to free on CPU -------------------

    def wake_up(self, tags=None):
        return None

    def sleep(self):
        return None

    def clear_kv_cache(self):
        return None

    def release_kv_cache(self):
        return None

    def resume_kv_cache(self):
        return None

    def set_global_steps(self, global_steps: int):
        self.global_steps = global_steps

    def abort_all_requests(self, reset_prefix_cache: bool = True, reject_request: bool = False):
        return {"aborted_count": 0, "request_ids": []}

    def resume_generation(self):
        return None

    def start_profile(self, **kwargs):
        return None

    def stop_profile(self):
        return None

    def weight_update_count(self) -> int:
        return self.weight_updates


class CpuReplica(RolloutReplica):
    """One server per replica, placed anywhere (it needs no accelerator)."""

    async def launch_servers(self):
        server = (
            ray.remote(CpuRolloutServer)
            .options(name=_server_name(self.replica_rank, self.name_suffix), num_cpus=0)
            .remote(self.config, self.model_config, self.replica_rank)
        )
        await server.weight_update_count.remote()  # constructed
        self.servers = [server]
        self._server_handle = server
        self._server_address = f"{NAME}-rollout-{self.replica_rank}"

    def rollout_worker_use_gpu(self) -> bool:
        return False


class CpuServerAdapter(BaseRollout):
    """In each actor rank: consumes the weight stream (every rank must), rank 0 of a replica
    ships it to the replica's server."""

    def __init__(self, config, model_config, device_mesh, replica_rank: int = -1):
        super().__init__(config, model_config, device_mesh)
        c = self.config
        size = c.tensor_model_parallel_size * c.data_parallel_size * c.pipeline_model_parallel_size
        rank = int(os.environ["RANK"])
        self.replica_rank = rank // size if replica_rank == -1 else replica_rank
        self.has_server = rank % size == 0
        self.bucket_bytes = (
            c.checkpoint_engine.update_weights_bucket_megabytes << 20
        ) or BUCKET_BYTES
        self._server = None

    @property
    def server(self):
        if self._server is None:
            self._server = ray.get_actor(_server_name(self.replica_rank))
        return self._server

    async def resume(self, tags: list[str]):
        if self.has_server:
            await self.server.wake_up.remote(tags=tags)

    async def release(self):
        if self.has_server:
            await self.server.sleep.remote()

    async def update_weights(self, weights, global_steps=None, wire_format="named_tensors", **kw):
        if wire_format != "named_tensors":
            raise ValueError(f"the cpu rollout takes full named tensors, not {wire_format!r}")
        bucket, size = [], 0
        async for name, tensor in _aiter(weights):
            if not self.has_server:
                continue  # the stream is collective: every rank walks it
            bucket.append((name, tensor.detach().to("cpu", copy=True)))
            size += tensor.numel() * tensor.element_size()
            if size >= self.bucket_bytes:
                await self.server.receive_weights.remote(bucket)
                bucket, size = [], 0
        if self.has_server:
            if bucket:
                await self.server.receive_weights.remote(bucket)
            await self.server.finish_weights.remote(global_steps)


async def _aiter(items) -> Iterable:
    if hasattr(items, "__aiter__"):
        async for item in items:
            yield item
    else:
        for item in items:
            yield item
            await asyncio.sleep(0)


def register() -> None:
    """Make `rollout.name=cpu` resolvable in this process (replica and in-worker adapter)."""
    from verl.workers.rollout import base

    RolloutReplicaRegistry.register(NAME, lambda: CpuReplica)
    base._ROLLOUT_REGISTRY[(NAME, "async")] = f"{__name__}.CpuServerAdapter"


register()
