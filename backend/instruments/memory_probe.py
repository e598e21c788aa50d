"""A trainer rank's memory, read from the process itself at fixed points of every update.

For side-by-side runs of two engines (ours and verl's FSDP): the same probe goes into both
engines' rank processes without touching either, through torch's global optimizer hooks
(`register_optimizer_step_pre_hook` / `..._post_hook` fire on every `Optimizer.step` of the
process, whichever engine owns the optimizer). At each point it appends one JSON line to
`<dir>/<pid>.jsonl`:

- `first_forward`: the first module forward of the process (imports done, model built);
- `pre_step`: after a mini-batch's forward and backward, gradients present; `hwm_mib` is the
  process's peak RSS since the previous point (the kernel's VmHWM, reset at every point
  through /proc/self/clear_refs), so it holds the old-log-prob pass and the activations;
- `post_step`: after the optimizer's step (its states exist from the first one on).

A process with several optimizers (megatron-core chains one for the dense parameters and one
for the experts) gets a point per optimizer's step, each counting what all of them hold.

Each line has RSS split by /proc/self/status (anonymous, file-backed: the kernel's counters, a
read of microseconds; smaps_rollup walks every mapping, 10-100 ms a read, which fell on every
optimizer step and cost the engine with two optimizers 11% of its update against 2-4% for one
with a single optimizer, docs/ab_profile.md), glibc's heap and
the free memory it retains (mallinfo2) and, at the step points, the bytes of what the
optimizers hold: parameters, gradients (`.grad`, or megatron's `.main_grad` buffer) and
optimizer states, each storage counted once (views into one flat buffer share it). Installed
only where MEMORY_PROBE_ENV names a directory.
"""

import ctypes
import json
import os
import time
import weakref
from pathlib import Path

import torch

MEMORY_PROBE_ENV = "MCORE_MEMORY_PROBE_DIR"
MIB = 1 << 20


def read_rss(pid: int | str = "self") -> dict[str, float]:
    """/proc/<pid>/status's resident set in MiB: rss, anon (RssAnon), file (RssFile)."""
    kb = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, rest = line.partition(":")
        if key in ("VmRSS", "RssAnon", "RssFile"):
            kb[key] = int(rest.split()[0])
    return {"rss_mib": kb["VmRSS"] / 1024, "anon_mib": kb["RssAnon"] / 1024,
            "file_mib": kb["RssFile"] / 1024}  # fmt: skip


def malloc_heap_mib() -> dict[str, float]:
    """glibc's heaps (mallinfo2): `heap_mib` in its arenas and mapped blocks, `heap_free_mib`
    free chunks it keeps rather than returning them to the OS (freed tensors retained in
    fragmented heaps count here). {} where glibc lacks mallinfo2 (< 2.33, musl)."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        mallinfo2 = libc.mallinfo2
    except (OSError, AttributeError):
        return {}
    mallinfo2.restype = _Mallinfo2
    info = mallinfo2()
    return {"heap_mib": (info.arena + info.hblkhd) / MIB, "heap_free_mib": info.fordblks / MIB}


class _Mallinfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
        "fordblks", "keepcost")]  # fmt: skip


def peak_rss_mib(reset: bool) -> float:
    """VmHWM (peak RSS) in MiB since the last reset; `reset` starts a new window."""
    hwm = next(
        int(line.split()[1]) / 1024
        for line in Path("/proc/self/status").read_text().splitlines()
        if line.startswith("VmHWM:")
    )
    if reset:
        Path("/proc/self/clear_refs").write_text("5")  # 5: reset the peak RSS to the current
    return hwm


def _local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's (FSDP2's) local shard; any other tensor itself."""
    return t.to_local() if hasattr(t, "to_local") else t


def storage_bytes(tensors) -> int:
    """Bytes of the distinct storages behind `tensors` (a view counts its whole buffer once)."""
    seen: dict[int, int] = {}
    for t in tensors:
        if isinstance(t, torch.Tensor):
            storage = _local(t).untyped_storage()
            seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


def optimizer_bytes(*optimizers: torch.optim.Optimizer) -> dict[str, float]:
    """MiB of the optimizers' parameters, their gradients and the optimizers' states."""
    params = [p for opt in optimizers for group in opt.param_groups for p in group["params"]]
    grads = [g for p in params for g in (p.grad, getattr(p, "main_grad", None)) if g is not None]
    states = [v for opt in optimizers for state in opt.state.values() for v in state.values()]
    return {
        "params_mib": storage_bytes(params) / MIB,
        "grads_mib": storage_bytes(grads) / MIB,
        "optimizer_states_mib": storage_bytes(states) / MIB,
    }


class MemoryProbe:
    """Appends a JSON line per fixed point to `<out>/<pid>.jsonl` (see the module's text)."""

    def __init__(self, out: Path):
        out.mkdir(parents=True, exist_ok=True)
        self.path = out / f"{os.getpid()}.jsonl"
        self.steps = 0
        self._handles, self._pending = [], []
        self._optimizers = weakref.WeakSet()

    def install(self) -> "MemoryProbe":
        from torch.nn.modules.module import register_module_forward_pre_hook
        from torch.optim.optimizer import (
            register_optimizer_step_post_hook,
            register_optimizer_step_pre_hook,
        )

        self._first = register_module_forward_pre_hook(self._on_first_forward)
        self._handles += [
            register_optimizer_step_pre_hook(lambda opt, *_: self._on_step("pre_step", opt)),
            register_optimizer_step_post_hook(lambda opt, *_: self._on_step("post_step", opt)),
        ]
        return self

    def remove(self) -> None:
        for handle in [self._first, *self._handles]:
            handle.remove()

    def _on_first_forward(self, module, args) -> None:
        self._first.remove()  # once: every later forward costs nothing
        self._pending.append(self.row("first_forward"))

    def _on_step(self, point: str, optimizer) -> None:
        # every optimizer seen, counted together: megatron-core chains one for the dense
        # parameters and one for the experts, each stepping on its own
        self._optimizers.add(optimizer)
        self.steps += point == "pre_step"
        held = optimizer_bytes(*self._optimizers)
        self._pending.append(
            self.row(point, step=self.steps, optimizers=len(self._optimizers), **held)
        )
        # written from the first step on: processes that never step (rollout, reward) leave
        # no file
        with open(self.path, "a") as sink:
            sink.writelines(json.dumps(row) + "\n" for row in self._pending)
        self._pending.clear()

    @staticmethod
    def row(point: str, **fields) -> dict:
        row = {"point": point, "t": time.time(), **read_rss(), **malloc_heap_mib()}
        return {**row, "hwm_mib": peak_rss_mib(reset=True), **fields}


def install_from_env() -> MemoryProbe | None:
    """The probe, installed where MEMORY_PROBE_ENV names a directory; else None."""
    out = os.environ.get(MEMORY_PROBE_ENV)
    return MemoryProbe(Path(out)).install() if out else None
