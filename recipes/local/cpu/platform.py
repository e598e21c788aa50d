"""verl's platform for a machine without an accelerator: `VERL_PLATFORM=cpu`.

Registered with verl's PlatformRegistry when imported; the launcher names this module in
VERL_USE_EXTERNAL_MODULES, which verl imports in every process (verl/__init__.py) before
anything asks for the platform. Two places of verl 0.9.1 assume an accelerator:

- Ray resources: verl's worker groups count only "GPU"/"NPU" resources
  (single_controller/ray/base.py:228-241), so this platform names "GPU" and the launcher
  starts Ray with as many declared GPUs as ranks (`ray_init.num_gpus`). Nothing touches a GPU.
- The process group: verl initialises `cpu:gloo,{device}:{backend}`
  (utils/distributed.py:89), which torch refuses for device cpu ("Duplicate device type");
  verl skips that call when a default group exists (:90). `join_worker_process_group`
  creates the gloo group first, from the environment verl's worker group gives each rank
  (RANK, WORLD_SIZE, MASTER_ADDR/PORT); it runs when this module is imported in a worker.
"""

import os
from contextlib import contextmanager

import torch
from verl.plugin.platform import PlatformRegistry
from verl.plugin.platform.platform_base import PlatformBase

from backend.instruments import memory_probe

NAME = "cpu"
# the rollout engines' environment (verl sets it on its vLLM server actor; the engine core and
# workers inherit it). vLLM's CPU platform still compiles one helper with inductor under
# enforce_eager: the sampled token's log-prob rank (`batched_count_greater_than`, as the
# rollout returns log-probs). Its C++ compile took ~9 s of the first validation, the rollout
# waiting on it (first validation 33.7 -> 24.2 s); eagerly it is the same count.
ROLLOUT_ENV = {"TORCHDYNAMO_DISABLE": "1"}


class _CpuDeviceModule:
    """What verl calls on `torch.<device>`: torch.cpu's functions; memory statistics, cache
    and device-selection calls it lacks answer 0 / do nothing (there is no device memory)."""

    _fixed = {"get_device_name": lambda *_: "cpu", "is_available": lambda: True,
              "device_count": lambda: 1, "current_device": lambda: torch.device("cpu"),
              "manual_seed": torch.manual_seed, "manual_seed_all": torch.manual_seed,
              "mem_get_info": lambda *_: (0, 0)}  # fmt: skip

    def __getattr__(self, name: str):
        if name in self._fixed:
            return self._fixed[name]
        if hasattr(torch.cpu, name):
            return getattr(torch.cpu, name)
        return lambda *args, **kwargs: 0


@PlatformRegistry.register(platform=NAME)
class PlatformCPU(PlatformBase):
    @property
    def device_name(self) -> str:
        return "cpu"

    @property
    def vendor_name(self) -> str:
        return "cpu"

    @property
    def device_module(self):
        return _CpuDeviceModule()

    def is_available(self) -> bool:
        return True

    def is_platform_available(self, use_smi_check=False) -> bool:
        return os.environ.get("VERL_PLATFORM", "").strip().lower() == NAME

    def current_device(self) -> torch.device:
        # verl passes it as `device=` / `.to(...)`: an index would mean cuda:0
        return torch.device("cpu")

    def device_count(self) -> int:
        return 1

    def set_device(self, device_index: int) -> None:
        return None

    def synchronize(self, device_index=None) -> None:
        return None

    def manual_seed(self, seed: int) -> None:
        torch.manual_seed(seed)

    def manual_seed_all(self, seed: int) -> None:
        torch.manual_seed(seed)

    def set_allocator_settings(self, settings: str) -> None:
        return None

    def empty_cache(self) -> None:
        return None

    def get_device_capability(self, device_index: int = 0):
        return None, None

    def communication_backend_name(self) -> str:
        return "gloo"

    def visible_devices_envvar(self) -> str:
        return "CUDA_VISIBLE_DEVICES"

    @contextmanager
    def nvtx_range(self, msg: str):
        yield

    def profiler_start(self) -> None:
        return None

    def profiler_stop(self) -> None:
        return None

    def ray_resource_name(self) -> str:
        return "GPU"  # see the module docstring: declared, never used

    def ray_noset_envvars(self) -> list[str]:
        return []

    def rollout_env_vars(self) -> dict[str, str]:
        return dict(ROLLOUT_ENV)

    def is_ipc_supported(self) -> bool:
        return False

    def cudart(self):
        return None


def join_worker_process_group(timeout_s: float = 600.0) -> bool:
    """In a verl worker-group rank on this platform: create the default gloo group (see above)."""
    import torch.distributed as dist

    env = os.environ
    is_worker = env.get("WG_BACKEND") == "ray" and "RANK" in env and "MASTER_PORT" in env
    if env.get("VERL_PLATFORM", "").lower() != NAME or not is_worker or dist.is_initialized():
        return False
    from datetime import timedelta

    dist.init_process_group(
        "gloo",
        rank=int(env["RANK"]),
        world_size=int(env["WORLD_SIZE"]),
        timeout=timedelta(seconds=timeout_s),
    )
    return True


join_worker_process_group()

# the side by side's memory probe (scripts/bench/launches/ab_engines.py), in the ranks of either
# engine: only where its environment variable names a directory
memory_probe.install_from_env()
