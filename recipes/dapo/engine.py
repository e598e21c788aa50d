"""verl engine on our megatron-core Qwen3-MoE actor: backend "mcore_ep", devices cuda/npu/cpu.

Importing this module registers the engine with verl's EngineRegistry (verl imports it in
every worker through `actor_rollout_ref.model.external_lib=recipes.dapo.engine`). How the
BaseEngine calls verl's workers make map onto our code:

  __init__            prepare_device + init_parallel (megatron-core groups: tp, ep, etp, dp)
  initialize          build_model (local spec, grouped experts / SDPA) -> HF weights through converters.sharding
                      (each rank reads only its tensors) -> router instruments -> optimizer
  train_mode/eval_mode  verl's offload context + model.train()/eval()
  forward_backward_batch  nested batch -> padded micro-batches (recipes.dapo.batches) ->
                      log-probs/entropy (recipes.dapo.heads: backend.lean_head, chunked, the
                      output projection fused, no [T, V/tp] logits held) -> verl's loss_function
                      -> backward
  train_batch/infer_batch  BaseEngine's (zero_grad, forward_backward_batch, optimizer_step)
  optimizer_step / lr_scheduler_step / optimizer_zero_grad  recipes.dapo.optim
  get_per_tensor_param  HF-named full tensors, gathered over TP/EP one at a time
  save/load_checkpoint  recipes.dapo.weights (layout in its docstring)
  to                  offload of params/grads/optimizer state: verl's megatron_utils functions,
                      on cpu too (see McoreEpEngine.to for what "cpu" means there)
  dp size/rank/group, is_mp_src_rank_with_outputs  megatron-core's attention DP group, tp rank 0
"""

import logging
import os
from functools import partial
from pathlib import Path

import torch
import torch.distributed as dist
from verl.utils import tensordict_utils as tu
from verl.utils.py_functional import append_to_dict
from verl.workers.engine import BaseEngine, EngineRegistry
from verl.workers.engine.base import BaseEngineCtx

from recipes.dapo import batches, weights
from recipes.dapo.config import BACKEND
from recipes.dapo.heads import head_outputs
from recipes.dapo.optim import OptimSettings, make_optimizer
from recipes.dapo.routing import Routing

logger = logging.getLogger(__name__)
DEVICES = ["cuda", "npu", "cpu"]


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
        from backend.distributed import init_parallel
        from backend.hf_config import load_qwen3_moe_spec

        super().__init__()
        self.model_config, self.engine_config = model_config, engine_config
        self.optimizer_config, self.checkpoint_config = optimizer_config, checkpoint_config
        self.device = prepare_device(engine_device())
        plan = engine_config.plan()
        self.groups = init_parallel(self.device, seed=engine_config.seed, **plan)
        self.plan = {**plan, "dp": self.groups.size("dp"), "world": dist.get_world_size()}
        if any(self.groups.size(k) != v for k, v in plan.items()):
            raise ValueError(
                f"megatron-core is already set up with another plan than {plan}: "
                "actor and reference must use the same mcore_ep plan"
            )
        self.spec = load_qwen3_moe_spec(model_config.local_path)
        self.mode = None
        self.module = self.model = self.optim = self.routing = self.experts = None
        self._saved: list[Path] = []

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
                            experts=c.experts, attention=c.attention)
        self.module = build_model(self.spec, self.groups, opts)
        self.experts = opts.resolved_experts()
        weights.load_hf(self.module, self.model_config.local_path, self.spec, self.groups)
        self.routing = Routing(
            self.module, self.groups, self.spec, dict(c.aux_loss), dict(c.monitor)
        )
        if c.forward_only:
            self.model = self.module
        else:
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
        if self.optim:
            self.optim.offload(model=model, optimizer=optimizer)
        elif model:  # forward-only (reference) module, no DDP buffers
            self.module.to("cpu")

    def onload(self, model: bool = True, optimizer: bool = True, grad: bool = True) -> None:
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
        return self.groups.rank("tp") == 0 and self.groups.rank("cp") == 0

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
        self._set_batch_info(data)
        tp = self.groups.size("tp")
        plans = batches.plan_micro_batches(data, tp, self.groups.dp, self._torch_device)
        mbs = [batches.micro_batch(data, rows, tp, self._torch_device) for rows in plans]
        temperature = tu.get_non_tensor_data(data, "temperature", 1.0)
        entropy = bool(tu.get_non_tensor_data(data, "calculate_entropy", False))
        run = partial(
            self._micro_batch,
            loss_function=loss_function,
            forward_only=forward_only,
            temperature=temperature,
            entropy=entropy,
        )
        if forward_only:
            with self.routing.phase("ref" if self.engine_config.forward_only else "old_log_prob"):
                return self._assemble([run(mb) for mb in mbs], plans, {})
        self.routing.start_step(mbs)
        if self.routing.needs_counting_pass:
            self._counting_pass(mbs)
        with self.routing.phase("update"):
            outputs = [run(mb) for mb in mbs]
        return self._assemble(outputs, plans, self.routing.end_step())

    def _counting_pass(self, mbs) -> None:
        """Routing counts of the whole step before any backward (global_batch aux loss);
        the output layer is skipped (no logits: only the routers' counts are read)."""
        from backend.forward import forward_logits
        from backend.lean_head import output_layer_skipped

        with self.routing.counting(), torch.no_grad(), output_layer_skipped(self.model):
            for mb in mbs:
                self.routing.set_tokens(mb.valid_BS, mb.response_BS)
                forward_logits(self.model, mb.ids_BS)

    def _micro_batch(
        self, mb, loss_function, forward_only: bool, temperature, entropy: bool
    ) -> dict:
        if isinstance(temperature, torch.Tensor) and temperature.dim() and temperature.numel() > 1:
            temperature = temperature[mb.rows]
        self.routing.set_tokens(mb.valid_BS, mb.response_BS)
        outputs_BS = head_outputs(self.model, mb.ids_BS, temperature, entropy)
        outputs_BS["log_probs"] = outputs_BS["log_probs"].masked_fill(~mb.has_next_BS, 0.0)
        model_output = {k: batches.to_nested(v, mb.lengths_B) for k, v in outputs_BS.items()}
        result = {
            "model_output": {k: v.detach() for k, v in model_output.items()},
            "loss": 1.0,
            "metrics": {},
        }
        if loss_function is not None:
            loss, metrics = loss_function(
                model_output=model_output, data=mb.data, dp_group=self.groups.dp
            )
            if not forward_only:
                loss.backward()
            result.update(loss=float(loss.detach()), metrics=metrics)
        return result

    @staticmethod
    def _assemble(outputs: list[dict], plans: list[list[int]], step_metrics: dict) -> dict:
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

    def optimizer_zero_grad(self):
        self.optim.zero_grad()

    def optimizer_step(self):
        return self.optim.step()

    def lr_scheduler_step(self):
        return self.optim.lr_step()

    # ---- weights ---------------------------------------------------------------------

    def get_per_tensor_param(self, **kwargs):
        """(HF name, full tensor) generator for rollout sync; every rank must consume it."""
        if self.is_param_offload_enabled:
            self.onload(model=True, optimizer=False, grad=False)
        return weights.hf_tensors(self.module, self.groups, self.spec), None

    def save_checkpoint(
        self, local_path, hdfs_path=None, global_step=0, max_ckpt_to_keep=None, **kwargs
    ):
        if hdfs_path:
            raise ValueError(
                "mcore_ep writes local (shared-filesystem) checkpoints only: "
                "unset trainer.default_hdfs_dir"
            )
        root, rank = Path(local_path), dist.get_rank()
        contents = set(self.checkpoint_config.get("save_contents", ["model", "optimizer", "extra"]))
        with_optim = self.optim is not None and "optimizer" in contents
        self.onload(model=self.is_param_offload_enabled, optimizer=False, grad=False)
        config_json = Path(self.model_config.local_hf_config_path) / "config.json"
        weights.save_model(self.module, root / weights.MODEL_DIR, config_json, self.device)
        if rank == 0:
            weights.save_meta(root, global_step, self.plan, self.experts)
            self.routing.write_report(root / "moe_report.json", model=str(self.model_config.path))
        if with_optim:
            # params stay loaded: the sharded optimizer state refers to the model's shards
            self.onload(model=False, optimizer=self.is_optimizer_offload_enabled, grad=False)
            self.optim.save(root / weights.OPTIM_DIR)
            self.offload(model=False, optimizer=self.is_optimizer_offload_enabled)
        self.offload(model=self.is_param_offload_enabled, optimizer=False)
        sealed = [root / weights.MODEL_DIR] + ([root / weights.OPTIM_STATE] if with_optim else [])
        weights.seal(root, sealed)
        if rank == 0:
            self._saved.append(root)
            weights.prune(self._saved, max_ckpt_to_keep)

    def load_checkpoint(self, local_path, hdfs_path=None, del_local_after_load=True, **kwargs):
        root = Path(local_path)
        meta = weights.read_meta(root)
        contents = set(self.checkpoint_config.get("load_contents", ["model", "optimizer", "extra"]))
        with_optim = self.optim is not None and "optimizer" in contents
        saved = (meta["plan"], meta.get("experts", "sequential"))
        if with_optim and saved != (self.plan, self.experts):
            raise weights.CheckpointError(
                f"{root} holds optimizer state for plan {saved[0]} with {saved[1]} experts, this "
                f"run is {self.plan} with {self.experts} experts: resume with the same plan and "
                "experts setting, or export its weights (python -m converters mcore-to-hf) and "
                "start from them"
            )
        if with_optim:
            weights.check_optim_dir(root)
        weights.check_sealed(
            [root / weights.MODEL_DIR] + ([root / weights.OPTIM_STATE] if with_optim else [])
        )
        self.onload(
            model=self.is_param_offload_enabled,
            optimizer=with_optim and self.is_optimizer_offload_enabled,
            grad=False,
        )
        weights.load_model(self.module, root / weights.MODEL_DIR)
        if self.optim:
            self.optim.reload_model_params()
        if with_optim:
            self.optim.load(root / weights.OPTIM_DIR)
        # as verl's megatron engine: the loaded state goes back to the host until it is used
        self.offload(
            model=self.is_param_offload_enabled,
            optimizer=self.optim is not None and self.is_optimizer_offload_enabled,
        )
