"""verl engine on our megatron-core Qwen3-MoE actor: backend "mcore_ep", devices cuda/npu/cpu.

Importing this module registers the engine with verl's EngineRegistry (verl imports it in
every worker through `actor_rollout_ref.model.external_lib=recipes.dapo.engine`). How the
BaseEngine calls verl's workers make map onto our code:

  __init__            prepare_device + init_parallel (megatron-core groups: tp, ep, etp, dp)
  initialize          build_model (local spec, grouped experts / SDPA) -> HF weights through converters.sharding
                      (each rank reads only its tensors) -> router instruments -> optimizer
  train_mode/eval_mode  verl's offload context + model.train()/eval()
  forward_backward_batch  nested batch -> padded or packed (mcore_ep.packed, THD) micro-batches
                      (recipes.dapo.batches) -> log-probs/entropy (recipes.dapo.heads:
                      backend.lean_head, chunked, the output projection fused, no [T, V/tp]
                      logits held) -> verl's loss_function -> backward
  train_batch/infer_batch  BaseEngine's (zero_grad, forward_backward_batch, optimizer_step)
  optimizer_step / lr_scheduler_step / optimizer_zero_grad  backend.optim
  get_per_tensor_param  HF-named full tensors, gathered over TP/EP in buckets
                      (mcore_ep.weight_sync_bucket_mb; converters.buckets)
  save/load_checkpoint  recipes.dapo.weights (layout in its docstring); saves written in the
                      background and sealed later with verl's checkpoint.async_save
                      (recipes.dapo.saving)
  to                  offload of params/grads/optimizer state: verl's megatron_utils functions,
                      on cpu too (see McoreEpEngine.to for what "cpu" means there)
  dp size/rank/group, is_mp_src_rank_with_outputs  megatron-core's attention DP group, tp rank 0
  guards              recipes.dapo.guards (mcore_ep.guards, off by default): the entropy floor's
                      bonus and the adaptive KL term added to verl's loss, coefficients per
                      optimizer step as guard/* metrics
  timing              backend.timing.StepTimer (mcore_ep.timing): per optimizer step
                      forward_backward, grad_reduce, optimizer; between steps, counted in the
                      next one: weight_sync, offload, onload, old_log_prob. The last
                      train_batch of a trainer step returns timing/* (see train_batch); a comm
                      share over 30% is logged and kept in the routing report's warnings
"""

import logging
import os
import shutil
from contextlib import nullcontext
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path

import torch
import torch.distributed as dist
from verl.utils import tensordict_utils as tu
from verl.utils.py_functional import append_to_dict
from verl.workers.engine import BaseEngine, EngineRegistry
from verl.workers.engine.base import BaseEngineCtx

from backend.comm_share import add_steps, comm_layout, comm_share_warning, max_over_ranks
from backend.dispatch_timing import MoEDispatchTimer
from backend.forward import forward_logits
from backend.instruments import RouterInstruments
from backend.lean_head import forward_hidden
from backend.optim import DP_REDUCTION, OptimSettings, make_optimizer
from backend.schedule import is_last_stage, run_micro_batches
from backend.timing import SECTIONS, StepTimer
from recipes.dapo import batches, saving, weights
from recipes.dapo.config import BACKEND
from recipes.dapo.guards import EngineGuards
from recipes.dapo.heads import head_from_hidden

logger = logging.getLogger(__name__)
DEVICES = ["cuda", "npu", "cpu"]
DISPATCH_SECTIONS = ("moe_dispatch", "moe_combine")
COMM_WARN_EVERY = 50  # optimizer steps between two comm-share warnings


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
class _Pass:
    """One forward(-backward) pass over a batch's micro-batches."""

    mbs: list
    routes: list[dict]  # per micro-batch: RouterInstruments.set_routes arguments
    loss_function: object
    forward_only: bool
    temperature: object
    entropy: bool


def engine_device() -> str:
    """The device verl picked this engine for (VERL_ENGINE_DEVICE wins, as in EngineRegistry)."""
    from verl.utils.device import get_device_name

    return os.getenv("VERL_ENGINE_DEVICE") or get_device_name()


class _ModeCtx(BaseEngineCtx):
    def __enter__(self):
        self._entering = True
        try:
            super().__enter__()
        finally:
            self._entering = False
        optim = self.engine.optim
        if optim is not None and optim.is_offloaded():
            # an explicit to("cpu") on an engine without param offload configured (verl
            # pairs its own calls only with offload on): compute needs the parameters back
            self.engine.onload(model=True, optimizer=False, grad=True)
        self.engine.model.train(self.mode == "train")

    def _context_switch(self, device):
        # verl names the compute device "cpu" on cpu, so on entry say "onload" explicitly
        if self._entering and self.engine.device == "cpu" and not self.disable_auto_offload:
            parts = dict(model=self.engine.is_param_offload_enabled, optimizer=False, grad=False)
            if self.mode == "train":
                parts.update(
                    optimizer=self.engine.is_optimizer_offload_enabled,
                    grad=self.engine.is_param_offload_enabled,
                )
            self.engine.onload(**parts)
            return
        super()._context_switch(device)

    def __exit__(self, exc_type, exc_value, traceback):
        if self.mode == "train" and self.engine.optim and (self.zero_grad_on_exit or exc_type):
            self.engine.optimizer_zero_grad()
        super().__exit__(exc_type, exc_value, traceback)


@EngineRegistry.register(model_type="language_model", backend=BACKEND, device=DEVICES)
class McoreEpEngine(BaseEngine):
    def __init__(self, model_config, engine_config, optimizer_config, checkpoint_config):
        from backend.device import prepare_device
        from backend.distributed import init_parallel, job_world
        from backend.families import load_spec
        from parallel.plan import check_against_model

        super().__init__()
        self.model_config, self.engine_config = model_config, engine_config
        self.optimizer_config, self.checkpoint_config = optimizer_config, checkpoint_config
        self.device = prepare_device(engine_device())
        self.plan = engine_config.plan(job_world())
        self.spec = load_spec(model_config.local_path)
        check_against_model(self.plan, self.spec)  # before any group exists: one-line errors
        self.groups = init_parallel(self.device, self.plan, seed=engine_config.seed)
        self.writer = saving.CheckpointWriter(self.groups.dp, self._torch_device)
        self.mode = None
        self.module = self.model = self.optim = self.routing = self.experts = None
        self._saved: list[Path] = []
        self._sync_headers: dict = {}  # weight sync's per-stage tensor list (pp > 1)
        self.timer, self.dispatch_timer = StepTimer(enabled=False), None
        self._timing: dict[str, float] = {}  # this trainer step's optimizer steps so far
        self._comm_warned_at: int | None = None
        self._layout = None  # backend.timing.CommLayout, once timing is on
        self.guards = EngineGuards(None)  # the opt-in loss guards (mcore_ep.guards)

    # ---- setup -----------------------------------------------------------------------

    @property
    def _torch_device(self) -> torch.device:
        if self.device == "cpu":
            return torch.device("cpu")
        return torch.device(self.device, torch.accelerator.current_device_index())

    def initialize(self):
        from backend.model import BuildOptions, build_model

        c = self.engine_config
        dtype = torch.float32 if self.device == "cpu" else getattr(torch, c.dtype)
        # local spec (the converters' name table covers it; TE names are not mapped yet) with
        # our grouped-GEMM experts / SDPA attention where BuildOptions picks them
        opts = BuildOptions(device=self.device, dtype=dtype, spec="local", recompute=c.recompute,
                            experts=c.experts, attention=c.resolved_attention)  # fmt: skip
        self.module = build_model(self.spec, self.groups, opts)
        self.experts = opts.resolved_experts()
        weights.load_hf(self.module, self.model_config.local_path, self.spec, self.groups)
        self.routing = RouterInstruments(
            self.module, self.groups, self.spec, dict(c.aux_loss), dict(c.monitor),
            dp_reduction=DP_REDUCTION, replay=c.router_replay,
        )  # fmt: skip
        if c.forward_only:
            self.model = self.module
        else:
            self.guards = EngineGuards(dict(c.guards))
            settings = OptimSettings.from_verl(self.optimizer_config)
            self.optim = make_optimizer(self.module, self.groups, settings)
            self.model = self.optim.model
        if self.is_param_offload_enabled or self.is_optimizer_offload_enabled:
            self.to(
                "cpu",
                model=self.is_param_offload_enabled,
                optimizer=self.is_optimizer_offload_enabled,
                grad=self.is_param_offload_enabled,
            )
        self._start_timing()

    def _start_timing(self) -> None:
        """The step timer: the trained engine's only (a forward-only one never steps)."""
        c = self.engine_config
        on = c.timing and not c.forward_only
        self.timer = StepTimer(self._torch_device, enabled=on)
        if on:  # the comm-share warning's advice: nodes spanned or not
            self._layout = comm_layout(self.groups)
        if on and c.timing_dispatch:
            self.dispatch_timer = MoEDispatchTimer(self.module, self.timer)

    @property
    def is_param_offload_enabled(self) -> bool:
        return self.engine_config.param_offload

    @property
    def is_optimizer_offload_enabled(self) -> bool:
        return self.engine_config.optimizer_offload and not self.engine_config.forward_only

    def train_mode(self, **kwargs):
        return _ModeCtx(self, "train", **kwargs)

    def eval_mode(self, **kwargs):
        return _ModeCtx(self, "eval", **kwargs)

    def to(self, device: str, model: bool = True, optimizer: bool = True, grad: bool = True):
        """'cpu' offloads; the engine's device loads. On a cpu engine both are "cpu": there
        "cpu" offloads too (verl's explicit calls), and whatever computes loads first (the
        train/eval contexts, get_per_tensor_param, checkpoints) through onload()."""
        super().to(device, model=model, optimizer=optimizer, grad=grad)
        if device not in ("cpu", self.device):
            raise ValueError(
                f"this engine runs on {self.device}: move it to 'cpu' or {self.device!r}"
            )
        if device == "cpu":
            self.offload(model=model, optimizer=optimizer)
        else:
            self.onload(model=model, optimizer=optimizer, grad=grad)

    def offload(self, model: bool = True, optimizer: bool = True) -> None:
        with self.timer.between_steps("offload"):
            if self.optim:
                self.optim.offload(model=model, optimizer=optimizer)
            elif model:  # forward-only (reference) module, no DDP buffers
                self.module.to("cpu")

    def onload(self, model: bool = True, optimizer: bool = True, grad: bool = True) -> None:
        with self.timer.between_steps("onload"):
            if self.optim:
                self.optim.onload(model=model, optimizer=optimizer, grad=grad)
            elif model:
                self.module.to(self._torch_device)

    # ---- parallel layout -------------------------------------------------------------

    def get_data_parallel_size(self):
        return self.groups.size("dp")

    def get_data_parallel_rank(self):
        return self.groups.rank("dp")

    def get_data_parallel_group(self):
        return self.groups.dp

    def is_mp_src_rank_with_outputs(self):
        ranks = self.groups.rank("tp"), self.groups.rank("cp")
        return ranks == (0, 0) and self._last_stage

    # ---- forward / backward ----------------------------------------------------------

    def _set_batch_info(self, data) -> None:
        """Global response-token count and DP size, as verl's token-mean losses expect."""
        tu.assign_non_tensor(data, dp_size=self.get_data_parallel_size())
        if "loss_mask" not in data.keys():
            return
        mask = data["loss_mask"]
        tokens = (mask.values() if mask.is_nested else mask).sum().to(self._torch_device)
        if self.get_data_parallel_size() > 1:
            dist.all_reduce(tokens, group=self.groups.dp)
        tu.assign_non_tensor(data, batch_num_tokens=int(tokens.item()))

    def forward_backward_batch(self, data, loss_function, forward_only=False):
        if forward_only:
            with self.timer.between_steps("old_log_prob"):
                return self._forward_backward(data, loss_function, forward_only)
        with self.timer.section("forward_backward"):
            return self._forward_backward(data, loss_function, forward_only)

    def _forward_backward(self, data, loss_function, forward_only: bool):
        self._set_batch_info(data)
        tp, packed, step = self.groups.size("tp"), self.engine_config.packed, self._ladder
        plans = batches.plan_micro_batches(data, tp, self.groups.dp, self._torch_device,
                                           packed, step)  # fmt: skip
        make = partial(batches.packed_micro_batch, step=step) if packed else batches.micro_batch
        mbs = [make(data, rows, tp, self._torch_device) for rows in plans]
        if self._tokens_gathered_over_ep:
            mbs = batches.agree_over(mbs, self.groups.ep)
        phase = self._phase(forward_only)
        routes = [self._routes(mb, phase) for mb in mbs]
        temperature = tu.get_non_tensor_data(data, "temperature", 1.0)
        entropy = bool(tu.get_non_tensor_data(data, "calculate_entropy", False))
        entropy |= not forward_only and self.guards.needs_entropy  # the entropy floor's bonus
        this_pass = _Pass(mbs, routes, loss_function, forward_only, temperature, entropy)
        if forward_only:
            with self.routing.phase(phase):
                outputs = self._run(this_pass)
            self.routing.set_routes()
            out = self._assemble(outputs, plans, {})
            if phase == "old_log_prob":
                self._old_log_prob_metrics(out, data)
            return out
        self.routing.start_step(mbs)
        if self.routing.needs_counting_pass:
            self._counting_pass(mbs, routes)
        with self.routing.phase("update"):
            outputs = self._run(this_pass)
        return self._assemble(outputs, plans, self.routing.end_step())

    @property
    def _ladder(self) -> int:
        """The packed-length ladder's step (mcore_ep.packed_length_step; npu: 512)."""
        from backend.packing import ladder_step

        return ladder_step(self.device, self.engine_config.packed_length_step)

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

    def _run(self, p: "_Pass") -> list[dict | None]:
        """The micro-batches through megatron-core's schedule (backend.schedule); per
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
                routes_BSLK = self._all_stages_routes(routes_BSLK)
                if outputs[i] is not None:
                    outputs[i]["model_output"]["routed_experts"] = batches.routes_to_nested(
                        routes_BSLK, p.mbs[i]
                    )
        return outputs

    def _all_stages_routes(self, routes_BSLK: torch.Tensor) -> torch.Tensor | None:
        """R2's recorded routes of this stage's layers (route_dtype: uint8 for <= 256
        experts) -> every layer's on the last stage, the one whose outputs verl reads
        (gathered there over PP); None on the other stages."""
        pp = self.groups.size("pp")
        if pp == 1:
            return routes_BSLK
        last = dist.get_global_rank(self.groups.pp, pp - 1)
        parts = [torch.empty_like(routes_BSLK) for _ in range(pp)] if self._last_stage else None
        dist.gather(routes_BSLK.contiguous(), parts, dst=last, group=self.groups.pp)
        return torch.cat(parts, dim=2) if self._last_stage else None

    def _micro_batch_result(self, mb, outputs_BS: dict, p: "_Pass"):
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

    # ---- routing replay and train-vs-rollout mismatch --------------------------------

    def _phase(self, forward_only: bool) -> str:
        if not forward_only:
            return "update"
        return "ref" if self.engine_config.forward_only else "old_log_prob"

    def _routes(self, mb, phase: str) -> dict:
        """set_routes arguments of a micro-batch: what to force, compare with and record.

        R3: old-log-prob pass and update force the rollout's routes (every token the rollout
        fed to its model: prompt and response but each row's last). R2: the old-log-prob pass
        records the router's own routes (returned as `routed_experts`, which verl's trainer
        hands back to the update), the update forces them. Padding keeps the router's own
        choice. The rollout's routes are the reference, on response tokens, of the agreement
        metric (old-log-prob pass: the rollout's weights) and of the update's route match
        (the experts the update used); never in the ref pass."""
        mode, keys = self.engine_config.router_replay, mb.data.keys()
        if phase == "ref":
            return {}
        has_routes = "routed_experts" in keys
        if mode in ("R2", "R3") and phase == "update" and not has_routes:
            raise ValueError(
                f"router_replay={mode}: the update batch has no routed_experts "
                + (
                    "(R2: the old-log-prob pass records them; is it skipped?)"
                    if mode == "R2"
                    else "(R3: set actor_rollout_ref.rollout.enable_rollout_routing_replay=True)"
                )
            )
        if phase == "old_log_prob" and mode == "R2" and has_routes:
            raise ValueError(
                "router_replay=R2 records its own routes in the old-log-prob pass, but the "
                "batch already has the rollout's routed_experts: use R3, or turn "
                "enable_rollout_routing_replay off"
            )
        if phase == "old_log_prob" and mode == "R3" and not has_routes:
            raise ValueError(
                "router_replay=R3 needs the rollout's routed_experts: set "
                "actor_rollout_ref.rollout.enable_rollout_routing_replay=True"
            )
        if not has_routes:
            return {"record": mode == "R2"}
        recorded = mode == "R2"  # R2's update: our own routes of every token
        routes = batches.micro_batch_routes(
            mb.data["routed_experts"], mb, self._torch_device, not recorded, self._layers,
            self.spec.num_experts,
        )  # fmt: skip
        out = {"replay": routes if mode != "disabled" else None}
        if not recorded:  # the rollout's routes: agreement (old log-probs), route match (update)
            counted_BS = routes.use_BS if mb.response_BS is None else routes.use_BS & mb.response_BS
            out["reference"] = replace(routes, use_BS=counted_BS)
        return out

    def _old_log_prob_metrics(self, out: dict, data) -> None:
        """Agreement and log-prob mismatch of this pass: returned in its metrics and kept
        for the next update step's (verl reads only the update's metrics)."""
        from recipes.dapo.mismatch import rollout_logprob_abs_diff

        metrics = self.routing.take_agreement()
        if self._last_stage and "rollout_log_probs" in data.keys():
            metrics.update(
                rollout_logprob_abs_diff(out["model_output"]["log_probs"], data, self.groups.dp)
            )
        metrics = self._from_last_stage(metrics)
        self.routing.pending = dict(metrics)
        out["metrics"].update({k: [v] for k, v in metrics.items()})

    def _from_last_stage(self, metrics: dict[str, float]) -> dict[str, float]:
        """The last stage's metrics on every stage (the monitor's report is written by rank 0)."""
        pp = self.groups.size("pp")
        if pp == 1:
            return metrics
        box = [metrics]  # our own floats, not a user file
        dist.broadcast_object_list(box, src=dist.get_global_rank(self.groups.pp, pp - 1),
                                   group=self.groups.pp)  # fmt: skip
        return box[0]

    def _counting_pass(self, mbs, routes) -> None:
        """Routing counts of the whole step before any backward (global_batch aux loss);
        the output layer is skipped (no logits: only the routers' counts are read)."""
        from backend.lean_head import output_layer_skipped

        def step(i: int):
            self._enter(mbs[i], routes[i])
            out = forward_logits(self.model, mbs[i].ids_BS, packed=mbs[i].packed)
            return (None, out) if self._last_stage else (out, out)

        skipped = output_layer_skipped(self.model) if self._last_stage else nullcontext()
        with self.routing.counting(), torch.no_grad(), skipped:
            run_micro_batches(self.model, len(mbs), step, True, tuple(mbs[0].ids_BS.shape))

    @staticmethod
    def _assemble(outputs: list[dict | None], plans: list[list[int]], step_metrics: dict) -> dict:
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

    # ---- optimizer -------------------------------------------------------------------

    def train_batch(self, data, loss_function):
        """BaseEngine's step, timed (every rank calls it).

        timing/* are summed over a trainer step's optimizer steps and returned once, with its
        last one (verl's `update_lr_scheduler` flag; without the flag, with every step): verl
        reduces an actor metric over the updates by np.min when its key contains "min", as
        "timing" does, so a value per update would log the smallest update."""
        self.writer.poll()  # a save written in the background: sealed once every rank is done
        self.timer.step_begin()
        outputs = super().train_batch(data, loss_function)
        guarded = self.guards.end_step(self.groups.dp, self._torch_device)
        outputs["metrics"].update({k: [v] for k, v in guarded.items()})
        self._timing = add_steps(self._timing, self.timer.step_end())
        if tu.get_non_tensor_data(data, "update_lr_scheduler", True):
            self.routing.end_trainer_step()
            outputs["metrics"].update({k: [v] for k, v in self._step_timing().items()})
        return outputs

    def _step_timing(self) -> dict[str, float]:
        """The trainer step's timing/*: every section the engine times (0 if it did not run),
        the maximum over ranks; warns when the communication share is over 30%."""
        step, self._timing = self._timing, {}
        if not self.timer.enabled:
            return {}
        sections = [s for s in SECTIONS if self.dispatch_timer or s not in DISPATCH_SECTIONS]
        metrics = {f"timing/{s}_s": 0.0 for s in sections} | {"timing/unclosed_sections": 0.0}
        metrics.update(step)
        if dist.get_world_size() > 1:
            metrics = max_over_ranks(metrics, self._torch_device)
        if not metrics["timing/unclosed_sections"]:
            del metrics["timing/unclosed_sections"]
        self._warn_comm_share(metrics)
        return metrics

    def _warn_comm_share(self, metrics: dict[str, float]) -> None:
        step, last = self.timer.steps, self._comm_warned_at
        if last is not None and step - last < COMM_WARN_EVERY:
            return
        warning = comm_share_warning(step, metrics, layout=self._layout)
        if warning is not None:
            self._comm_warned_at = step
            self.routing.add_warning(warning)

    def optimizer_zero_grad(self):
        self.optim.zero_grad()

    def optimizer_step(self):
        with self.timer.section("grad_reduce"):
            self.optim.reduce_grads()
        with self.timer.section("optimizer"):
            return self.optim.update()

    def lr_scheduler_step(self):
        return self.optim.lr_step()

    # ---- weights ---------------------------------------------------------------------

    def get_per_tensor_param(self, **kwargs):
        """(HF name, full tensor) generator for rollout sync; every rank must consume it."""
        if self.is_param_offload_enabled:
            self.onload(model=True, optimizer=False, grad=False)
        bucket = int(self.engine_config.weight_sync_bucket_mb * 2**20)
        tensors = weights.hf_tensors(self.module, self.groups, self.spec, self._sync_headers,
                                     bucket)  # fmt: skip
        return self.timer.timed_items("weight_sync", tensors), None

    def save_checkpoint(
        self, local_path, hdfs_path=None, global_step=0, max_ckpt_to_keep=None, **kwargs
    ):
        """recipes.dapo.saving: the previous save is sealed first; this one is written in the
        background with `checkpoint.async_save` (sealed later, at a train_batch), except at
        the run's last step, which returns sealed."""
        if hdfs_path:
            raise ValueError(
                "mcore_ep writes local (shared-filesystem) checkpoints only: "
                "unset trainer.default_hdfs_dir"
            )
        self.writer.finish()
        root, rank = Path(local_path), dist.get_rank()
        contents = set(self.checkpoint_config.get("save_contents", ["model", "optimizer", "extra"]))
        with_optim = self.optim is not None and "optimizer" in contents
        in_background = self._async_save and not self._last_step(global_step)
        weights.clear_for_save(root)
        self.onload(model=self.is_param_offload_enabled, optimizer=False, grad=False)
        model_dir = root / weights.MODEL_DIR
        self.writer.write("model", self.module.sharded_state_dict(), model_dir, in_background)
        if rank == 0:
            config_json = Path(self.model_config.local_hf_config_path) / "config.json"
            shutil.copyfile(config_json, model_dir / weights.HF_CONFIG)
            weights.save_meta(root, global_step, self.plan.record(), self.experts)
            self.routing.write_report(root / "moe_report.json", model=str(self.model_config.path))
        if with_optim:
            # params stay loaded: the sharded optimizer state refers to the model's shards
            self.onload(model=False, optimizer=self.is_optimizer_offload_enabled, grad=False)
            state_dir = root / weights.OPTIM_STATE
            self.writer.write("optim", self.optim.sharded_for_save(), state_dir, in_background)
            if rank == 0:
                self.optim.write_schedule(root / weights.OPTIM_DIR)
        dirs = [model_dir] + ([root / weights.OPTIM_STATE] if with_optim else [])
        tracker = saving.tracker_of(root) if self._async_save else None
        sealed = partial(self._sealed, keep=max_ckpt_to_keep)
        self.writer.commit(saving.PendingSave(root, dirs, tracker, global_step, on_sealed=[sealed]))
        # offloaded only once the writer has its copy: until then the plan's write items are
        # views of the device shards (copied to the host when the writer starts), whose
        # storage a param offload frees
        optimizer = with_optim and self.is_optimizer_offload_enabled
        self.offload(model=self.is_param_offload_enabled, optimizer=optimizer)
        if not in_background:
            self.writer.finish()

    @property
    def _async_save(self) -> bool:
        """verl's `checkpoint.async_save`: its trainer then leaves the tracker to the engine."""
        return bool(self.checkpoint_config.get("async_save", False))

    def _last_step(self, global_step: int) -> bool:
        """The run's last save (verl saves at its last step; nothing polls the writer after
        it): counted in trainer steps (verl's total_training_steps), not optimizer updates,
        which a resumed run's steps without an update (trainer.critic_warmup) leave behind."""
        total = getattr(self.optimizer_config, "total_training_steps", None) or 0
        return self.optim is None or (total > 0 and int(global_step) >= total)

    def _sealed(self, root: Path, keep: int | None) -> None:
        self._saved.append(root)
        weights.prune(self._saved, keep)

    def _log_loaded(self, root: Path, meta: dict) -> None:
        """One line on rank 0 of what the load left in the engine: the checkpoint's global step
        (meta.json), the optimizer's update count and its weights' norm (rank 0's shards), so
        a resumed run shows it starts from the checkpoint, not from the HF weights."""
        if dist.get_rank() != 0:
            return
        norm = weights.weights_norm(self.module)
        update = self.optim.updates if self.optim else None
        logger.warning(
            "mcore_ep: resumed from %s: global step %s, optimizer update %s, weights norm "
            "%.9e (rank 0's parameters)", root, meta.get("global_step"), update, norm,
        )  # fmt: skip

    def load_checkpoint(self, local_path, hdfs_path=None, del_local_after_load=True, **kwargs):
        self.writer.finish()
        root = Path(local_path)
        meta = weights.read_meta(root)
        contents = set(self.checkpoint_config.get("load_contents", ["model", "optimizer", "extra"]))
        with_optim = self.optim is not None and "optimizer" in contents
        saved = (meta["plan"], meta.get("experts", "sequential"))
        if with_optim and saved != (self.plan.record(), self.experts):
            raise weights.CheckpointError(
                f"{root} holds optimizer state for plan {saved[0]} with {saved[1]} experts, this "
                f"run is {self.plan.record()} with {self.experts} experts: resume with the same plan and "
                "experts setting, or export its weights (python -m converters mcore-to-hf) and "
                "start from them"
            )
        dirs = [root / weights.MODEL_DIR] + ([root / weights.OPTIM_STATE] if with_optim else [])
        if with_optim:
            weights.check_optim_dir(root)
        weights.check_complete(dirs)
        # verl's global_step_N/actor: data.pt beside it is verl's, unpickled after this returns
        weights.check_sealed(dirs, step_dir=root.parent)
        self.onload(
            model=self.is_param_offload_enabled,
            optimizer=with_optim and self.is_optimizer_offload_enabled,
            grad=False,
        )
        weights.load_model(self.module, root / weights.MODEL_DIR)
        self.routing.trainer_steps = int(meta.get("global_step", 0))  # the report's step axis
        if self.optim:
            self.optim.reload_model_params()
        if with_optim:
            self.optim.load(root / weights.OPTIM_DIR)
        self._log_loaded(root, meta)
        # as verl's megatron engine: the loaded state goes back to the host until it is used
        self.offload(
            model=self.is_param_offload_enabled,
            optimizer=self.optim is not None and self.is_optimizer_offload_enabled,
        )
