"""The engine's optimizer: one interface, two implementations chosen by device.

- cpu (tests, laptops): McoreActor's AdamW on fp32 parameters, gradients summed over the
  ranks holding copies (backend.grads) then divided by the DP size, global-norm clipping.
- cuda / npu: megatron-core DDP + distributed optimizer (bf16 parameters, fp32 main grads,
  fp32 master weights and Adam state sharded over DP / expert-DP): the layout parallel/'s
  memory model assumes. megatron-core hard-codes CUDA tensors there, so it cannot run on CPU;
  this path is exercised on a cluster only.

Both average gradients over DP, which is what verl's losses expect (token-mean multiplies by
dp_size), and both use McoreActor's warm-up: lr * min(1, (k + 1) / warmup) at update k.
"""

from dataclasses import dataclass

import torch

from backend.distributed import ProcessGroups


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
    return min(1.0, (update + 1) / warmup) if warmup > 0 else 1.0


class LocalOptimizer:
    """cpu: McoreActor's optimizer and scheduler, our TP/DP/EP gradient sync and clipping."""

    def __init__(self, model: torch.nn.Module, groups: ProcessGroups, s: OptimSettings):
        from backend.actor import McoreActor, OptimConfig

        cfg = OptimConfig(
            lr=s.lr,
            weight_decay=s.weight_decay,
            betas=s.betas,
            eps=s.eps,
            grad_clip=s.clip_grad,
            warmup_steps=s.warmup_steps,
        )
        self.actor, self.model, self.groups, self.settings = (
            McoreActor(model, groups, cfg),
            model,
            groups,
            s,
        )

    def zero_grad(self) -> None:
        self.actor.optimizer.zero_grad(set_to_none=True)

    def step(self) -> float:
        from backend.grads import clip_grads, sync_grads

        sync_grads(self.model, self.groups)
        dp = self.groups.size("dp")
        if dp > 1:
            for param in self.model.parameters():
                if param.grad is not None:
                    param.grad.div_(dp)
        norm = clip_grads(self.model, self.groups, self.settings.clip_grad)
        self.actor.optimizer.step()
        return norm

    def lr_step(self) -> float:
        self.actor.scheduler.step()
        return self.lr

    @property
    def lr(self) -> float:
        return self.actor.scheduler.get_last_lr()[0]

    def state_dict(self) -> dict:
        return {
            "optimizer": self.actor.optimizer.state_dict(),
            "scheduler": self.actor.scheduler.state_dict(),
        }

    def load_state_dict(self, state: dict) -> None:
        self.actor.optimizer.load_state_dict(state["optimizer"])
        self.actor.scheduler.load_state_dict(state["scheduler"])

    def reload_model_params(self) -> None:
        """Parameters were replaced in place: nothing else holds a copy here."""

    def to(self, device: str, model: bool, optimizer: bool, grad: bool) -> None:
        if device != "cpu":
            raise ValueError(f"the cpu engine cannot move to {device!r}")


class DistOptimizer:
    """cuda / npu: megatron-core DistributedDataParallel + distributed optimizer."""

    def __init__(self, model: torch.nn.Module, groups: ProcessGroups, s: OptimSettings):
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

        ddp = DistributedDataParallelConfig(
            grad_reduce_in_fp32=True, overlap_grad_reduce=False, use_distributed_optimizer=True
        )
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
        self._set_lr()

    def _set_lr(self) -> None:
        for group in self.optimizer.param_groups:
            group["lr"] = self.lr

    def zero_grad(self) -> None:
        self.model.zero_grad_buffer()
        self.optimizer.zero_grad()

    def step(self) -> float:
        from megatron.core.distributed import finalize_model_grads

        finalize_model_grads([self.model])  # DP/expert-DP reduce-scatter, TP-partial norm grads
        ok, norm, _ = self.optimizer.step()  # clips by the global norm, all-gathers the params
        if not ok:
            raise RuntimeError(
                "megatron-core optimizer step reported failure (non-finite gradients)"
            )
        return float(norm)

    def lr_step(self) -> float:
        self.updates += 1
        self._set_lr()
        return self.lr

    @property
    def lr(self) -> float:
        return self.settings.lr * warmup_factor(self.updates, self.settings.warmup_steps)

    def _chained(self) -> list:
        return getattr(self.optimizer, "chained_optimizers", [self.optimizer])

    def state_dict(self) -> dict:
        return {
            "optimizer": self.optimizer.state_dict(),
            "updates": self.updates,
            "param_state": [o.get_parameter_state_dp_reshardable() for o in self._chained()],
        }

    def load_state_dict(self, state: dict) -> None:
        self.optimizer.load_state_dict(state["optimizer"])
        for opt, param_state in zip(self._chained(), state["param_state"], strict=True):
            opt.load_parameter_state_from_dp_reshardable(param_state)
        self.updates = state["updates"]
        self._set_lr()

    def reload_model_params(self) -> None:
        """Parameters were replaced in place: refresh the fp32 master copies from them."""
        self.optimizer.reload_model_params()

    def to(self, device: str, model: bool, optimizer: bool, grad: bool) -> None:
        from verl.utils import megatron_utils as mu

        if device == "cpu":
            if model:
                mu.offload_megatron_model_to_cpu([self.model])
            if optimizer:
                mu.offload_megatron_optimizer(self.optimizer)
            return
        if model:
            mu.load_megatron_model_to_gpu([self.model], load_grad=grad)
        if optimizer:
            mu.load_megatron_optimizer(self.optimizer)


def make_optimizer(device: str, model: torch.nn.Module, groups: ProcessGroups, s: OptimSettings):
    return (LocalOptimizer if device == "cpu" else DistOptimizer)(model, groups, s)
