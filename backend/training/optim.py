"""The optimizer: megatron-core DDP + distributed optimizer, on every device.

One path for cpu (gloo, fp32: tests and CI) and cuda / npu (bf16 parameters, fp32 main grads,
fp32 master weights and Adam state sharded over DP / expert-DP: the layout parallel/'s memory
model assumes). On cpu megatron-core's CUDA-only spots are passed by the named shims in
backend.platform.mcore_shims (`optimizer_*`, `dist_optim_*`, `clip_grads_cpu`, `local_l2_norm_on_cpu`).

- gradients: DDP averages over DP (DP_REDUCTION = "mean": megatron's default scaling 1/dp,
  experts included: they are summed over expert-DP, see backend.model.build.tag_expert_replicas for
  ep == 1, etp != tp), which is what verl's losses expect (token-mean multiplies by dp_size);
  finalize_model_grads adds the TP sums of sequence-parallel and q/k-norm weights;
- schedule, written once here (warmup_factor): linear warm-up over the first updates; weight
  decay is the configured one times megatron's per-group `wd_mult` (0 for biases and 1-D
  params: megatron's no-decay rule, which its own OptimizerParamScheduler would apply);
- checkpoint: megatron-core's sharded optimizer checkpoint (dist_checkpointing, the cluster's
  format), plus the schedule's update counter in JSON;
- offload: verl's megatron_utils offload / load functions, on cpu too (cpu to cpu).
"""

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from backend.training.distributed import ProcessGroups

STATE_DIR = "dist_ckpt"  # under the checkpoint's optim/
SCHEDULE = "schedule.json"
# how DDP reduces gradients over DP (megatron-core's default): the step's gradient is the DP
# mean; backend.instruments.router_instruments.RouterInstruments derives the aux loss's gradient scale from it
DP_REDUCTION = "mean"


@dataclass(frozen=True)
class OptimSettings:
    lr: float
    weight_decay: float
    betas: tuple[float, float]
    clip_grad: float
    warmup_steps: int
    eps: float = 1e-8

    @classmethod
    def from_verl(cls, cfg) -> "OptimSettings":
        """From verl's OptimizerConfig (lr, weight_decay, betas, clip_grad, warm-up)."""
        warmup = (
            cfg.lr_warmup_steps
            if (cfg.lr_warmup_steps or -1) > 0
            else int(cfg.lr_warmup_steps_ratio * max(cfg.total_training_steps or 0, 0))
        )
        clip = cfg.grad_clip if getattr(cfg, "grad_clip", None) is not None else cfg.clip_grad
        return cls(
            lr=cfg.lr,
            weight_decay=cfg.weight_decay,
            betas=tuple(cfg.betas),
            clip_grad=clip,
            warmup_steps=warmup,
        )


def warmup_factor(update: int, warmup: int) -> float:
    """The lr multiplier at update k (0-based) of a W-step warm-up: min(1, (k + 1) / W), and 1
    without warm-up (W <= 0)."""
    return min(1.0, (update + 1) / warmup) if warmup > 0 else 1.0


class McoreOptimizer:
    """megatron-core DistributedDataParallel + distributed Adam over this stage's model chunk."""

    def __init__(self, model: torch.nn.Module, groups: ProcessGroups, s: OptimSettings):
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

        ddp = DistributedDataParallelConfig(
            grad_reduce_in_fp32=True, overlap_grad_reduce=False, use_distributed_optimizer=True
        )
        self.module = model
        self.model = DistributedDataParallel(config=model.config, ddp_config=ddp, module=model)
        cfg = OptimizerConfig(
            optimizer="adam",
            lr=s.lr,
            weight_decay=s.weight_decay,
            adam_beta1=s.betas[0],
            adam_beta2=s.betas[1],
            adam_eps=s.eps,
            clip_grad=s.clip_grad,
            bf16=model.config.bf16,
            params_dtype=model.config.params_dtype,
            use_distributed_optimizer=True,
        )
        self.optimizer = get_megatron_optimizer(cfg, [self.model])
        self.settings, self.updates = s, 0
        self._apply_schedule()

    # ---- schedule ----------------------------------------------------------------------

    def _apply_schedule(self) -> None:
        """What megatron's OptimizerParamScheduler does per group, with our warm-up."""
        for group in self.optimizer.param_groups:
            group["lr"] = self.lr * group.get("lr_mult", 1.0)
            group["weight_decay"] = self.settings.weight_decay * group.get("wd_mult", 1.0)

    @property
    def lr(self) -> float:
        return self.settings.lr * warmup_factor(self.updates, self.settings.warmup_steps)

    def lr_step(self) -> float:
        self.updates += 1
        self._apply_schedule()
        return self.lr

    # ---- step --------------------------------------------------------------------------

    def zero_grad(self) -> None:
        self.model.zero_grad_buffer()
        self.optimizer.zero_grad()

    def step(self) -> float:
        self.reduce_grads()
        return self.update()

    def reduce_grads(self) -> None:
        """The step's gradient communication (the engine times it as `grad_reduce`)."""
        from megatron.core.distributed import finalize_model_grads

        finalize_model_grads([self.model])  # DP/expert-DP reduce-scatter, TP-partial norm grads

    def update(self) -> float:
        """Clip and apply the reduced gradients; the global grad norm."""
        ok, norm, _ = self.optimizer.step()  # clips by the global norm, all-gathers the params
        if not ok:
            raise RuntimeError(
                "megatron-core optimizer step reported failure (non-finite gradients)"
            )
        return float(norm)

    def reload_model_params(self) -> None:
        """Parameters were replaced in place: refresh the fp32 master copies from them."""
        self.optimizer.reload_model_params()

    def chained(self) -> list:
        """The DistributedOptimizers (dense and expert parameters have one each)."""
        return getattr(self.optimizer, "chained_optimizers", [self.optimizer])

    # ---- checkpoint --------------------------------------------------------------------

    def _sharded(self, is_loading: bool) -> dict:
        from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

        if hasattr(DistributedOptimizer, "sharded_param_state_dp_reshardable"):
            # megatron-core >= 0.14: every rank writes its own buckets, no gather (reshards
            # over DP); its default (fully_sharded_model_space) is deprecated there
            kwargs = dict(metadata={"distrib_optim_sharding_type": "dp_reshardable"})
        else:
            # 0.12.1: each DP group's state gathered on its first rank (host memory: that
            # rank holds its (tp, ep) slice's whole optimizer state while saving). Its default
            # (fully_sharded_model_space) maps each optimizer shard to a model parameter's
            # ShardedTensor, which GroupedExperts' stacked weights lack (they are saved as
            # SequentialMLP's per-expert tensors); its bucket space trips on torch Adam's
            # scalar `step`
            kwargs = dict(sharding_type="dp_zero_gather_scatter")
        model_state = self.module.sharded_state_dict()
        return self.optimizer.sharded_state_dict(model_state, is_loading=is_loading, **kwargs)

    def sharded_for_save(self) -> dict:
        """The sharded state dict a save of `optim/dist_ckpt` writes (collective on 0.12.1:
        its DP gather)."""
        self._init_torch_adam_state()  # saved before any step: the zero state of a first step
        return self._sharded(is_loading=False)

    def write_schedule(self, out: Path) -> None:
        """The schedule's update counter, beside megatron's files (rank 0), so the directory's
        manifest covers it."""
        (out / STATE_DIR).mkdir(parents=True, exist_ok=True)
        (out / STATE_DIR / SCHEDULE).write_text(json.dumps({"updates": self.updates}))

    def load(self, src: Path) -> None:
        """Exactly what save() wrote: Adam moments, master weights, step counts, schedule."""
        from megatron.core import dist_checkpointing

        self._init_torch_adam_state()
        state = dist_checkpointing.load(self._sharded(is_loading=True), str(src / STATE_DIR))
        with torch.no_grad():  # fp32 main params are views of the (leaf) model params
            self.optimizer.load_state_dict(state)
        self._restore_torch_adam_step()
        self.updates = json.loads((src / STATE_DIR / SCHEDULE).read_text())["updates"]
        self._apply_schedule()

    def _torch_adams(self) -> list:
        adam = (torch.optim.Adam, torch.optim.AdamW)
        return [o for o in self.chained() if isinstance(getattr(o, "optimizer", None), adam)]

    def _init_torch_adam_state(self) -> None:
        """torch's Adam (cpu, or no Apex/TE) before its first step has no state, and megatron's
        state_dict() then fails reading its step; allocate it as a first step would (zeros, step
        0: torch's own lazy init), which a load overwrites. FusedAdam keeps its step in
        param_groups: not touched."""
        for opt in self._torch_adams():
            if len(opt.optimizer.state) == 0:
                opt.init_state_fn(opt.optimizer, opt.config)
                for state in opt.optimizer.state.values():
                    state.setdefault("step", torch.tensor(0.0))

    def _restore_torch_adam_step(self) -> None:
        """megatron restores torch Adam's step from param_groups, then (0.16.1, dp_reshardable)
        overwrites it with the template's per-param step: take param_groups' value again."""
        for opt in self._torch_adams():
            for group in opt.optimizer.param_groups:
                if "step" in group:
                    for param in group["params"]:
                        opt.optimizer.state[param]["step"] = torch.tensor(float(group["step"]))

    # ---- offload -----------------------------------------------------------------------

    def offload(self, model: bool, optimizer: bool) -> None:
        """verl's offload of the DDP buffers (params, grads) and optimizer state."""
        from verl.utils import megatron_utils as mu

        if model:
            self._host_buffers()
            mu.offload_megatron_model_to_cpu([self.model])
        if optimizer:
            mu.offload_megatron_optimizer(self.optimizer)

    def onload(self, model: bool, optimizer: bool, grad: bool) -> None:
        from verl.utils import megatron_utils as mu

        if model:
            mu.load_megatron_model_to_gpu([self.model], load_grad=grad)
        if optimizer:
            mu.load_megatron_optimizer(self.optimizer)

    def _host_buffers(self) -> None:
        """verl keeps offloaded params in a pinned host buffer it allocates once and reuses;
        torch has no pinned memory without an accelerator, so on cpu that buffer is made here
        (plain memory) and verl takes its reuse path."""
        if next(self.module.parameters()).device.type != "cpu":
            return
        for buffer in [*self.model.buffers, *self.model.expert_parallel_buffers]:
            data = buffer.param_data
            if getattr(data, "cpu_data", None) is None and data.storage().size() > 0:
                data.cpu_data = torch.empty_like(data)
                buffer.param_data_size = data.storage().size()

    def is_offloaded(self) -> bool:
        """The DDP parameter buffers are freed (their contents live in verl's host copy)."""
        return all(b.param_data.storage().size() == 0 for b in self.model.buffers)


def make_optimizer(model: torch.nn.Module, groups: ProcessGroups, s: OptimSettings):
    return McoreOptimizer(model, groups, s)
