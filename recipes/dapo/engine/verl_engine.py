"""verl engine on our megatron-core Qwen3-MoE actor: backend "mcore_ep", devices cuda/npu/cpu.

Importing this module registers the engine with verl's EngineRegistry (verl imports it in
every worker through `actor_rollout_ref.model.external_lib=recipes.dapo.engine.verl_engine`). This module
is verl's adapter: the engine's lifecycle, and the BaseEngine calls handed to the modules that
do the work. How the BaseEngine calls verl's workers make map onto our code:

  __init__            prepare_device + init_parallel (megatron-core groups: tp, ep, etp, dp)
  initialize          build_model (local spec, grouped experts / SDPA) -> HF weights through converters.sharding
                      (each rank reads only its tensors) -> router instruments -> optimizer
  train_mode/eval_mode  verl's offload context + model.train()/eval()
  forward_backward_batch  recipes.dapo.engine.passes (MicroBatchRunner): nested batch -> padded or
                      packed (mcore_ep.packed, THD) micro-batches (recipes.dapo.engine.batches) ->
                      log-probs/entropy (recipes.dapo.engine.logprobs: backend.model.lean_head, chunked, the
                      output projection fused, no [T, V/tp] logits held) -> verl's loss_function
                      -> backward; each micro-batch's routes: recipes.dapo.engine.replay_routes
  train_batch/infer_batch  BaseEngine's (zero_grad, forward_backward_batch, optimizer_step)
  optimizer_step / lr_scheduler_step / optimizer_zero_grad  backend.training.optim
  get_per_tensor_param  HF-named full tensors, gathered over TP/EP in buckets
                      (mcore_ep.weight_sync_bucket_mb; converters.buckets)
  save/load_checkpoint  recipes.dapo.engine.checkpoint_io (CheckpointIO; layout: recipes.dapo.checkpoints.files,
                      weights and meta.json: recipes.dapo.engine.weights); saves written in the
                      background and sealed later with verl's checkpoint.async_save
                      (recipes.dapo.checkpoints.async_save)
  to                  offload of params/grads/optimizer state: verl's megatron_utils functions,
                      on cpu too (see McoreEpEngine.to for what "cpu" means there)
  dp size/rank/group, is_mp_src_rank_with_outputs  megatron-core's attention DP group, tp rank 0
  guards              recipes.dapo.engine.update_guards (mcore_ep.guards, off by default): the entropy floor's
                      bonus and the adaptive KL term added to verl's loss, coefficients per
                      optimizer step as guard/* metrics
  timing              backend.instruments.timing.StepTimer (mcore_ep.timing): per optimizer step
                      forward_backward, grad_reduce, optimizer; between steps, counted in the
                      next one: weight_sync, offload, onload, old_log_prob. The last
                      train_batch of a trainer step returns timing/* (see train_batch;
                      recipes.dapo.engine.step_metrics); a comm share over 30% is logged and kept in
                      the routing report's warnings
  metrics             recipes.dapo.engine.step_metrics: timing/*, and the old-log-prob pass's route
                      agreement and log-prob mismatch
"""

import contextlib
import os
from pathlib import Path

import torch
from verl.utils import tensordict_utils as tu
from verl.workers.engine import BaseEngine, EngineRegistry
from verl.workers.engine.base import BaseEngineCtx

from backend.instruments.comm_bytes import CommBytes
from backend.instruments.router_instruments import RouterInstruments
from backend.instruments.timing import StepTimer
from backend.platform.host_heap import trim_host_heap
from backend.training.optim import DP_REDUCTION, OptimSettings, make_optimizer
from backend.training.schedule import is_last_stage
from recipes.dapo.checkpoints import async_save
from recipes.dapo.engine import weights
from recipes.dapo.engine.checkpoint_io import CheckpointIO
from recipes.dapo.engine.config import BACKEND
from recipes.dapo.engine.passes import MicroBatchRunner
from recipes.dapo.engine.replay_routes import phase_of
from recipes.dapo.engine.step_metrics import StepMetrics, as_lists
from recipes.dapo.engine.update_guards import EngineGuards

DEVICES = ["cuda", "npu", "cpu"]
_DEFAULT_CONTENTS = ["model", "optimizer", "extra"]  # verl's checkpoint.save/load_contents


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
        from backend.model.families import load_spec
        from backend.platform.device import prepare_device
        from backend.training.distributed import init_parallel, job_world
        from parallel.plan import check_against_model

        super().__init__()
        self.model_config, self.engine_config = model_config, engine_config
        self.optimizer_config, self.checkpoint_config = optimizer_config, checkpoint_config
        self.device = prepare_device(engine_device())
        self.plan = engine_config.plan(job_world())
        self.spec = load_spec(model_config.local_path)
        check_against_model(self.plan, self.spec)  # before any group exists: one-line errors
        self.groups = init_parallel(self.device, self.plan, seed=engine_config.seed)
        self.writer = async_save.CheckpointWriter(self.groups.dp, self._torch_device)
        self.mode = None
        self.module = self.model = self.optim = self.routing = self.experts = None
        self._sync_headers: dict = {}  # weight sync's per-stage tensor list (pp > 1)
        self.timer = StepTimer(enabled=False)  # replaced by initialize's (mcore_ep.timing)
        self.guards = EngineGuards(None)  # the opt-in loss guards (mcore_ep.guards)
        # set by initialize: the passes, the metrics, the checkpoint saves and loads
        self.passes: MicroBatchRunner | None = None
        self.metrics: StepMetrics | None = None
        self.comm: CommBytes | None = None
        self.checkpoints: CheckpointIO | None = None

    # ---- setup -----------------------------------------------------------------------

    @property
    def _torch_device(self) -> torch.device:
        if self.device == "cpu":
            return torch.device("cpu")
        return torch.device(self.device, torch.accelerator.current_device_index())

    def initialize(self):
        from backend.model.build import BuildOptions, build_model

        c = self.engine_config
        dtype = torch.float32 if self.device == "cpu" else getattr(torch, c.dtype)
        if self.device == "cpu" and c.cpu_threads:
            torch.set_num_threads(c.cpu_threads)  # the job env holds every process at 1
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
        device = self._torch_device
        self.passes = MicroBatchRunner(self.model, self.module, self.routing, self.guards,
                                       self.groups, c, self.spec.num_experts, self.device,
                                       device)  # fmt: skip
        self.checkpoints = CheckpointIO(
            self.writer, self.module, self.optim, self.routing, self.plan, self.experts,
            self.model_config,
            # looked up at each call: what self.onload/offload are then (a test spies on them)
            onload=lambda **parts: self.onload(**parts),
            offload=lambda **parts: self.offload(**parts),
            param_offload=self.is_param_offload_enabled,
            optimizer_offload=self.is_optimizer_offload_enabled,
        )  # fmt: skip
        self.metrics = StepMetrics.start(c, self.module, self.routing, self.groups, device)
        self.timer = self.metrics.timer
        self.comm = CommBytes.from_env(self.groups)  # opt-in: bytes per phase and group
        if c.resume_from and not c.forward_only:
            contents = set(self.checkpoint_config.get("load_contents", _DEFAULT_CONTENTS))
            self.checkpoints.check_early(Path(c.resume_from), contents)

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
            # verl offloads at the end of each phase (update, old log-probs): the pass's freed
            # activations go back to the OS while the rollout runs
            self._trim_heap("phase", "step")

    def _trim_heap(self, *modes: str) -> None:
        """On cpu, under one of `modes` of cpu_trim_heap: the C library's free heap pages back
        to the OS (backend.platform.host_heap)."""
        if self.device == "cpu" and self.engine_config.cpu_trim_heap in modes:
            trim_host_heap()

    @contextlib.contextmanager
    def weights_loaded(self):
        """The parameters readable inside (verl's offload frees the DDP buffers they view),
        offloaded again after if they were: decoupled PPO's host snapshots read them."""
        offloaded = self.optim is not None and self.optim.is_offloaded()
        if offloaded:
            self.onload(model=True, optimizer=False, grad=False)
        try:
            yield self.module
        finally:
            if offloaded:
                self.offload(model=True, optimizer=False)

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
        return ranks == (0, 0) and is_last_stage(self.groups)

    # ---- forward / backward ----------------------------------------------------------

    def forward_backward_batch(self, data, loss_function, forward_only=False):
        if forward_only:
            self._comm_take("other")
            with self.timer.between_steps("old_log_prob"):
                out = self._forward_backward(data, loss_function, forward_only)
            self._comm_take("old_log_prob")
            return out
        with self.timer.section("forward_backward"):
            return self._forward_backward(data, loss_function, forward_only)

    def _forward_backward(self, data, loss_function, forward_only: bool):
        phase = phase_of(forward_only, reference_engine=self.engine_config.forward_only)
        out = self.passes.forward_backward(data, loss_function, phase)
        if phase == "old_log_prob":
            self.metrics.old_log_prob(out, data)
        return out

    # ---- optimizer -------------------------------------------------------------------

    def train_batch(self, data, loss_function):
        """BaseEngine's step, timed (every rank calls it).

        timing/* are summed over a trainer step's optimizer steps and returned once, with its
        last one (verl's `update_lr_scheduler` flag; without the flag, with every step): verl
        reduces an actor metric over the updates by np.min when its key contains "min", as
        "timing" does, so a value per update would log the smallest update."""
        self.writer.poll()  # a save written in the background: sealed once every rank is done
        self._comm_take("other")
        self.timer.step_begin()
        outputs = super().train_batch(data, loss_function)
        self._trim_heap("step")  # the mini-batch's freed activations, before the next one
        guarded = self.guards.end_step(self.groups.dp, self._torch_device)
        outputs["metrics"].update(as_lists(guarded))
        self.metrics.end_optimizer_step()
        if tu.get_non_tensor_data(data, "update_lr_scheduler", True):
            self.routing.end_trainer_step()
            outputs["metrics"].update(as_lists(self.metrics.trainer_step_timing()))
        self._comm_take("update")
        return outputs

    def _comm_take(self, phase: str) -> None:
        if self.comm is not None:
            self.comm.take(phase, tokens=self.passes.take_tokens())

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
        self._comm_take("other")
        bucket = int(self.engine_config.weight_sync_bucket_mb * 2**20)
        tensors = weights.hf_tensors(self.module, self.groups, self.spec, self._sync_headers,
                                     bucket)  # fmt: skip
        return self._counted(self.timer.timed_items("weight_sync", tensors), "weight_sync"), None

    def _counted(self, items, phase: str):
        yield from items
        self._comm_take(phase)

    def save_checkpoint(
        self, local_path, hdfs_path=None, global_step=0, max_ckpt_to_keep=None, **kwargs
    ):
        """recipes.dapo.engine.checkpoint_io: the previous save is sealed first; this one is written in the
        background with `checkpoint.async_save` (sealed later, at a train_batch), except at
        the run's last step, which returns sealed."""
        if hdfs_path:
            raise ValueError(
                "mcore_ep writes local (shared-filesystem) checkpoints only: "
                "unset trainer.default_hdfs_dir"
            )
        config = self.checkpoint_config  # read at each save (a bench switches async_save)
        # verl gives the optimizer its trainer steps times parameter_sync_step
        updates = getattr(self.optimizer_config, "total_training_steps", None) or 0
        total = updates // self.engine_config.updates_per_step
        self._comm_take("other")
        self.checkpoints.save(
            Path(local_path), global_step, max_ckpt_to_keep,
            contents=set(config.get("save_contents", _DEFAULT_CONTENTS)),
            async_save=bool(config.get("async_save", False)),
            total_steps=total,
        )  # fmt: skip
        self._comm_take("save")

    def load_checkpoint(self, local_path, hdfs_path=None, del_local_after_load=True, **kwargs):
        contents = set(self.checkpoint_config.get("load_contents", _DEFAULT_CONTENTS))
        self.checkpoints.load(Path(local_path), contents)
