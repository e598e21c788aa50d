"""The micro-batch passes behind the engine's forward_backward_batch: verl's batch -> micro-
batches (recipes.dapo.engine.batches) -> megatron-core's schedule (backend.training.schedule) -> log-probs
and entropy (recipes.dapo.engine.logprobs) -> verl's loss -> verl's output dict; routes per micro-batch
(recipes.dapo.engine.replay_routes) and the routing counting pass of a global-batch aux loss."""

from contextlib import nullcontext
from dataclasses import dataclass
from functools import partial

import torch
import torch.distributed as dist
from verl.utils import tensordict_utils as tu
from verl.utils.py_functional import append_to_dict

from backend.instruments.router_instruments import RouterInstruments
from backend.model.forward import forward_logits
from backend.model.lean_head import forward_hidden
from backend.training.distributed import ProcessGroups
from backend.training.schedule import is_last_stage, run_micro_batches
from recipes.dapo.engine import batches
from recipes.dapo.engine.logprobs import head_from_hidden
from recipes.dapo.engine.replay_routes import all_stages_routes, micro_batch_routes
from recipes.dapo.engine.update_guards import EngineGuards


def _one_temperature(temperature_B: torch.Tensor) -> float:
    """A packed micro-batch is one row: its sequences must share one temperature."""
    if not torch.all(temperature_B == temperature_B.flatten()[0]):
        raise batches.BatchError(
            "mcore_ep.packed=True with per-sequence temperatures that differ within a "
            "micro-batch: use one sampling temperature, or packed=False"
        )
    return float(temperature_B.flatten()[0])


def _micro_batch_temperature(temperature, mb):
    """verl's temperature (a float, or one per row) for this micro-batch's rows."""
    if isinstance(temperature, torch.Tensor) and temperature.dim() and temperature.numel() > 1:
        temperature = temperature[mb.rows]
        if mb.cu_seqlens is not None:
            return _one_temperature(temperature)
        extra = mb.ids_BS.shape[0] - len(mb.rows)  # padding rows (batches.agree_over)
        if extra:
            temperature = torch.cat([temperature, temperature.new_ones(extra)])
    return temperature


@dataclass(frozen=True)
class Pass:
    """One forward(-backward) pass over a batch's micro-batches."""

    mbs: list
    routes: list[dict]  # per micro-batch: RouterInstruments.set_routes arguments
    loss_function: object
    forward_only: bool
    temperature: object
    entropy: bool


def assemble(outputs: list[dict | None], plans: list[list[int]], step_metrics: dict) -> dict:
    """verl's output dict; on pipeline stages before the last (no outputs; verl reads
    the last stage's tp-rank-0 ranks) only the step metrics."""
    if outputs[0] is None:
        metrics = {k: [v] for k, v in step_metrics.items()}
        return {"model_output": {}, "loss": [], "metrics": metrics}
    keys = outputs[0]["model_output"]
    model_output = {
        k: batches.restore_rows([o["model_output"][k] for o in outputs], plans) for k in keys
    }
    metrics: dict = {}
    for o in outputs:
        append_to_dict(metrics, o["metrics"])
    metrics.update({k: [v] for k, v in step_metrics.items()})
    return {
        "model_output": model_output,
        "loss": [o["loss"] for o in outputs],
        "metrics": metrics,
    }


class MicroBatchRunner:
    """Runs verl's batches through the engine's model, one pass per forward_backward_batch.

    model: what runs (the DDP wrapper of a trained engine, the module of a forward-only one);
    module: the GPTModel inside it (its layers and config)."""

    def __init__(
        self,
        model,
        module,
        routing: RouterInstruments,
        guards: EngineGuards,
        groups: ProcessGroups,
        engine_config,
        num_experts: int,
        device: str,
        torch_device: torch.device,
    ):
        self.model, self.module, self.routing, self.guards = model, module, routing, guards
        self.groups, self.config, self.num_experts = groups, engine_config, num_experts
        self.device, self.torch_device = device, torch_device
        self.tokens_run = 0  # padded tokens of the passes since the last take_tokens

    def take_tokens(self) -> int:
        tokens, self.tokens_run = self.tokens_run, 0
        return tokens

    def forward_backward(self, data, loss_function, phase: str) -> dict:
        """One pass over verl's batch `data` in `phase` (recipes.dapo.engine.replay_routes.phase_of):
        verl's output dict."""
        self._set_batch_info(data)
        forward_only = phase != "update"
        tp, packed, step = self.groups.size("tp"), self.config.packed, self._ladder
        plans = batches.plan_micro_batches(data, tp, self.groups.dp, self.torch_device,
                                           packed, step)  # fmt: skip
        make = partial(batches.packed_micro_batch, step=step) if packed else batches.micro_batch
        mbs = [make(data, rows, tp, self.torch_device) for rows in plans]
        if self._tokens_gathered_over_ep:
            mbs = batches.agree_over(mbs, self.groups.ep)
        self.tokens_run += sum(mb.ids_BS.numel() for mb in mbs)
        mode = self.config.router_replay
        routes = [
            micro_batch_routes(mb, phase, mode, self.torch_device, self._layers, self.num_experts)
            for mb in mbs
        ]
        temperature = tu.get_non_tensor_data(data, "temperature", 1.0)
        entropy = bool(tu.get_non_tensor_data(data, "calculate_entropy", False))
        entropy |= not forward_only and self.guards.needs_entropy  # the entropy floor's bonus
        this_pass = Pass(mbs, routes, loss_function, forward_only, temperature, entropy)
        if forward_only:
            with self.routing.phase(phase):
                outputs = self._run(this_pass)
            self.routing.set_routes()
            return assemble(outputs, plans, {})
        self.routing.start_step(mbs)
        if self.routing.needs_counting_pass:
            self._counting_pass(mbs, routes)
        with self.routing.phase("update"):
            outputs = self._run(this_pass)
        return assemble(outputs, plans, self.routing.end_step())

    def _set_batch_info(self, data) -> None:
        """Global response-token count and DP size, as verl's token-mean losses expect."""
        tu.assign_non_tensor(data, dp_size=self.groups.size("dp"))
        mask = data["loss_mask"]
        tokens = (mask.values() if mask.is_nested else mask).sum().to(self.torch_device)
        if self.groups.size("dp") > 1:
            dist.all_reduce(tokens, group=self.groups.dp)
        tu.assign_non_tensor(data, batch_num_tokens=int(tokens.item()))

    @property
    def _ladder(self) -> int:
        """The packed-length ladder's step (mcore_ep.packed_length_step; npu: 512)."""
        from backend.model.packing import ladder_step

        return ladder_step(self.device, self.config.packed_length_step)

    @property
    def _tokens_gathered_over_ep(self) -> bool:
        """megatron's allgather dispatcher (CPU) with EP: micro-batches must agree in shape."""
        ep = self.groups.size("ep") > 1
        return ep and self.module.config.moe_token_dispatcher_type == "allgather"

    @property
    def _last_stage(self) -> bool:
        return is_last_stage(self.groups)

    @property
    def _layers(self) -> range:
        """The global indices of this pipeline stage's layers."""
        numbers = [layer.layer_number - 1 for layer in self.module.decoder.layers]
        return range(numbers[0], numbers[-1] + 1)

    def _enter(self, mb, routes: dict) -> None:
        """The router instruments' per-micro-batch state: token mask, routes to force."""
        self.routing.set_tokens(mb.valid_BS, mb.response_BS)
        self.routing.set_routes(**routes)

    def _run(self, p: Pass) -> list[dict | None]:
        """The micro-batches through megatron-core's schedule (backend.training.schedule); per
        micro-batch, the last stage's result (None on earlier stages)."""
        outputs: list[dict | None] = [None] * len(p.mbs)
        recorded: list[torch.Tensor | None] = [None] * len(p.mbs)

        def step(i: int):
            mb = p.mbs[i]
            self._enter(mb, p.routes[i])
            if self._last_stage:
                hidden = forward_hidden(self.model, mb.ids_BS, packed=mb.packed)
                temperature = _micro_batch_temperature(p.temperature, mb)
                outputs_BS = head_from_hidden(self.model, hidden, mb.ids_BS, temperature,
                                              p.entropy)  # fmt: skip
            else:
                hidden = forward_logits(self.model, mb.ids_BS, packed=mb.packed)
            if p.routes[i].get("record"):
                recorded[i] = self.routing.recorder.take_BSLK(mb.ids_BS.shape[0], self.groups)
            if not self._last_stage:
                return hidden, hidden
            outputs[i], loss = self._micro_batch_result(mb, outputs_BS, p)
            return loss, hidden

        def restore(i: int) -> None:  # micro-batch i's backward (and recompute) begins
            self._enter(p.mbs[i], p.routes[i])

        run_micro_batches(self.model, len(p.mbs), step, p.forward_only,
                          tuple(p.mbs[0].ids_BS.shape), on_backward=restore)  # fmt: skip
        for i, routes_BSLK in enumerate(recorded):
            if routes_BSLK is not None:
                routes_BSLK = all_stages_routes(routes_BSLK, self.groups, self._last_stage)
                if outputs[i] is not None:
                    outputs[i]["model_output"]["routed_experts"] = batches.routes_to_nested(
                        routes_BSLK, p.mbs[i]
                    )
        return outputs

    def _micro_batch_result(self, mb, outputs_BS: dict, p: Pass):
        """(result, loss) of a micro-batch on the last stage: verl's loss on its outputs."""
        outputs_BS["log_probs"] = outputs_BS["log_probs"].masked_fill(~mb.has_next_BS, 0.0)
        model_output = {k: mb.to_nested(v) for k, v in outputs_BS.items()}
        result = {
            "model_output": {k: v.detach() for k, v in model_output.items()},
            "loss": 1.0,
            "metrics": {},
        }
        if p.loss_function is None:
            return result, None
        loss, metrics = p.loss_function(
            model_output=model_output, data=mb.data, dp_group=self.groups.dp
        )
        if not p.forward_only and self.guards.on:  # verl's loss as it is, then the guards'
            loss = loss + self.guards.loss(model_output, mb.data, metrics)
        result.update(loss=float(loss.detach()), metrics=metrics)
        return result, loss

    def _counting_pass(self, mbs, routes) -> None:
        """Routing counts of the whole step before any backward (global_batch aux loss);
        the output layer is skipped (no logits: only the routers' counts are read)."""
        from backend.model.lean_head import output_layer_skipped

        def step(i: int):
            self._enter(mbs[i], routes[i])
            out = forward_logits(self.model, mbs[i].ids_BS, packed=mbs[i].packed)
            return (None, out) if self._last_stage else (out, out)

        skipped = output_layer_skipped(self.model) if self._last_stage else nullcontext()
        with self.routing.counting(), torch.no_grad(), skipped:
            run_micro_batches(self.model, len(mbs), step, True, tuple(mbs[0].ids_BS.shape))
