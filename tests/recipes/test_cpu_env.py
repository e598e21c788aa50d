"""The CPU job's environment settings in processes that act the way the run's do: the allocator
settings (recipes.dapo.cluster.ray_job.CPU_ENV, and beyond world 4
recipes.local.cpu_overrides.MANY_RANKS_ENV), each test under CPU_ENV and, as its control,
without the one setting, so that it fails if the setting stops acting; and the rollout's
(recipes.local.cpu.platform.ROLLOUT_ENV).

Found on a 20-step run at world 8 (8 actor ranks, two vLLM engines of TP 4, 24 GiB): without
them the processes grew every step and Ray's memory monitor killed the rollout at step 18.
"""

import json
import os
import subprocess
import sys

import pytest

from recipes.dapo.cluster.ray_job import CPU_ENV
from recipes.local.cpu_overrides import MANY_RANKS_ENV

pytestmark = pytest.mark.no_mcore

# a step's tensors: sizes between 200 KiB and 4 MiB freed in a mixed order, beside a few small
# ones that outlive the step (metrics, caches); after a 32 MiB block is freed, as a weight
# update's bucket is. Prints the RSS growth in MiB.
FRAGMENTING_STEPS = """
import random, torch
def rss():
    return [int(l.split()[1]) for l in open('/proc/self/status') if l.startswith('VmRSS')][0] // 1024
random.seed(0)
torch.empty(32 << 20, dtype=torch.uint8).fill_(1)
base, live, keep = rss(), [], []
for step in range(40):
    for _ in range(50):
        live.append(torch.empty(random.randint(200 << 10, 4 << 20), dtype=torch.uint8).fill_(1))
        if len(live) > 12:
            live.pop(random.randrange(len(live)))
    keep.append(torch.ones(random.randint(1, 30000)))
    live.clear()
print(rss() - base)
"""

# vLLM's CPU linears in bf16 (F.linear on oneDNN) at every batch size a rollout meets:
# prints how many anonymous mappings (oneDNN's JIT kernels among them) were added.
BATCH_SIZES_BF16 = """
import torch, torch.nn.functional as F
def maps():
    return sum(1 for l in open('/proc/self/maps') if len(l.split()) == 5)
w = torch.randn(384, 128, dtype=torch.bfloat16)
F.linear(torch.randn(4, 128, dtype=torch.bfloat16), w)
base = maps()
for m in range(1, 301):
    F.linear(torch.randn(m, 128, dtype=torch.bfloat16), w)
print(maps() - base)
"""


def _run(code: str, drop: str | None = None) -> int:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MALLOC_", "ONEDNN_"))}
    env.update({k: v for k, v in {**CPU_ENV, **MANY_RANKS_ENV}.items() if k != drop})
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          timeout=120, check=True)  # fmt: skip
    return int(done.stdout.split()[-1])


def test_freed_tensors_go_back_to_the_system():
    """Bug caught: glibc's mmap threshold left to rise with the largest freed block (up to 32
    MiB), so freed step tensors stay in fragmented heaps: vLLM's TP workers and the actor
    ranks grew every step at world 8 (beyond world 4 only: it slows an fp32 update ~45%)."""
    held = _run(FRAGMENTING_STEPS)
    control = _run(FRAGMENTING_STEPS, drop="MALLOC_MMAP_THRESHOLD_")
    assert held < 20, f"RSS grew {held} MiB over 40 steps under MANY_RANKS_ENV"
    assert control > 40, f"the control grew only {control} MiB: the pattern no longer fragments"


def test_one_batch_size_after_another_keeps_onednn_bounded():
    """Bug caught: oneDNN's primitive cache (1024 kernels by default) kept a JIT-compiled
    kernel for every batch size the rollout met: each vLLM TP worker grew ~18 MB a step at
    world 8 (960 -> 1317 MiB over 20 steps), the largest growth left after the allocator's."""
    held = _run(BATCH_SIZES_BF16)
    control = _run(BATCH_SIZES_BF16, drop="ONEDNN_PRIMITIVE_CACHE_CAPACITY")
    assert held < 60, f"{held} mappings added over 300 batch sizes under CPU_ENV"
    assert control > 300, f"the control added only {control} mappings: oneDNN caches no longer"


# vLLM's one inductor-compiled helper under enforce_eager (the sampled token's log-prob rank),
# called as its sampler calls it; prints the counts and the frames dynamo compiled
COMPILED_HELPER = """
import torch
from torch._dynamo.utils import counters
from vllm.v1.sample.ops.logprobs import batched_count_greater_than
x, v = torch.tensor([[0.1, 0.5, 0.9], [0.3, 0.2, 0.1]]), torch.tensor([[0.5], [0.2]])
print(batched_count_greater_than(x, v).tolist(), counters["frames"]["total"])
"""


@pytest.mark.vllm
def test_the_rollout_runs_vllms_compiled_helper_eagerly():
    """Bug caught: a C++ compile of vLLM's log-prob rank helper (~9 s, the rollout waiting on
    it) in every run's first validation. The environment comes from the CPU platform's
    `rollout_env_vars`, verl's hook for its rollout servers; the helper then counts eagerly."""
    platform = "import json; from recipes.local.cpu.platform import PlatformCPU; "
    platform += "print(json.dumps(PlatformCPU().rollout_env_vars()))"
    env = json.loads(_python(platform, os.environ).splitlines()[-1])
    assert env == {"TORCHDYNAMO_DISABLE": "1"}
    assert _python(COMPILED_HELPER, {**os.environ, **env}).splitlines()[-1] == "[2, 2] 0"


def _python(code: str, env) -> str:
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          timeout=120, check=True).stdout  # fmt: skip
