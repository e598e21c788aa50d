"""The memory probe reads a rank's memory from the process at its optimizer's steps."""

import json
import subprocess
import sys
from pathlib import Path

import torch

from backend.instruments.memory_probe import MemoryProbe, optimizer_bytes, storage_bytes

MIB = 1 << 20
REPO = Path(__file__).resolve().parents[2]


def _lines(tmp_path):
    (path,) = tmp_path.glob("*.jsonl")
    return [json.loads(line) for line in path.read_text().splitlines()]


def train_two_steps(out: str) -> None:
    """Two AdamW steps of a 2-layer model, each after a pass that touches 64 MiB and frees it
    before the step, under the probe (run in a fresh interpreter: an earlier test's freed heap
    could hold the pass without new pages)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.Linear(256, 256))
    optimizer = torch.optim.AdamW(model.parameters())
    probe = MemoryProbe(Path(out)).install()
    try:
        for _ in range(2):
            scratch = torch.ones(16 << 20)  # 64 MiB of activations, touched
            model(torch.randn(8, 256) + scratch[:256]).sum().backward()
            del scratch
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    finally:
        probe.remove()


def test_points_and_what_the_optimizer_holds(tmp_path):
    """Bugs caught: a missed point, optimizer states not counted (or counted before the first
    step made them), gradients missing, a peak window that does not see a pass's activations."""
    code = f"from tests.backend.test_memory_probe import train_two_steps; train_two_steps({str(tmp_path)!r})"
    subprocess.run([sys.executable, "-c", code], cwd=REPO, check=True, timeout=120)
    lines = _lines(tmp_path)
    points = ["first_forward", "pre_step", "post_step", "pre_step", "post_step"]
    assert [r["point"] for r in lines] == points
    params_mib = 2 * (256 * 256 + 256) * 4 / MIB
    pre, post = lines[1], lines[2]
    assert pre["params_mib"] == params_mib and pre["grads_mib"] == params_mib
    assert pre["optimizer_states_mib"] == 0  # AdamW makes its states at its first step
    # exp_avg and exp_avg_sq per parameter, and a 0-d `step` tensor each
    assert abs(post["optimizer_states_mib"] - 2 * params_mib) < 1e-3
    assert post["grads_mib"] == params_mib and lines[4]["step"] == 2
    # the window ending at the second backward holds the 64 MiB pass above the last step's RSS
    assert lines[3]["hwm_mib"] - lines[2]["rss_mib"] > 60
    assert all(r["rss_mib"] >= r["anon_mib"] > 0 and r["file_mib"] > 0 for r in lines)
    assert all(r["heap_mib"] >= r["heap_free_mib"] >= 0 for r in lines)  # glibc's mallinfo2


def test_a_process_that_never_steps_leaves_no_file(tmp_path):
    """The probe sits in every process of the CPU run (rollout, reward...): only trainers
    write."""
    model = torch.nn.Linear(4, 4)
    probe = MemoryProbe(tmp_path).install()
    try:
        model(torch.randn(2, 4))
    finally:
        probe.remove()
    assert list(tmp_path.iterdir()) == []


def test_views_into_one_flat_buffer_count_it_once():
    """megatron-core's DDP keeps gradients in one flat buffer (`param.main_grad` views, and
    `.grad` set to the same view before the step): counted once, not once per view or per
    attribute."""
    params = [torch.nn.Parameter(torch.zeros(100)), torch.nn.Parameter(torch.zeros(50, 2))]
    buffer = torch.zeros(400)  # larger than the views: the buffer's bytes are what is held
    params[0].main_grad = buffer[:100]
    params[1].main_grad = buffer[100:200].view(50, 2)
    params[1].grad = params[1].main_grad
    optimizer = torch.optim.SGD(params, lr=0.1)
    held = optimizer_bytes(optimizer)
    assert held["grads_mib"] * MIB == 400 * 4
    assert held["params_mib"] * MIB == 200 * 4
    assert storage_bytes([buffer[:10], buffer[10:20], buffer]) == 400 * 4


def test_chained_optimizers_are_counted_together(tmp_path):
    """megatron-core steps one optimizer for the dense parameters and one for the experts:
    bug caught, each point counting only the optimizer that just stepped (the experts' 12 of
    a rank's 17 MiB at mini, ep 2)."""
    dense, experts = torch.nn.Linear(64, 64), torch.nn.Linear(64, 256)
    optimizers = [torch.optim.AdamW(dense.parameters()), torch.optim.AdamW(experts.parameters())]
    probe = MemoryProbe(tmp_path).install()
    try:
        experts(dense(torch.randn(4, 64))).sum().backward()
        for optimizer in optimizers:
            optimizer.step()
    finally:
        probe.remove()
    last = _lines(tmp_path)[-1]
    both = sum(p.numel() * 4 for m in (dense, experts) for p in m.parameters()) / MIB
    assert last["point"] == "post_step" and last["optimizers"] == 2
    assert last["params_mib"] == both and last["grads_mib"] == both
    assert abs(last["optimizer_states_mib"] - 2 * both) < 1e-3


def test_glibcs_retained_free_memory_is_seen():
    """Freed tensors that glibc keeps in its heaps (RSS that no tensor holds) show as
    heap_free_mib: the part of a rank's memory that fragmentation, not the engine, keeps."""
    from backend.instruments.memory_probe import malloc_heap_mib

    small = [torch.ones(1000) for _ in range(50_000)]  # 4 KB each: from the heap, not mmap
    before = malloc_heap_mib()["heap_free_mib"]
    del small[::2]  # every other one freed: holes between live blocks stay in the heap
    assert malloc_heap_mib()["heap_free_mib"] - before > 50


def test_a_point_costs_far_less_than_walking_the_mappings(tmp_path):
    """Bug caught: a probe whose every point walked /proc/self/smaps_rollup (10-100 ms in a
    rank): it fell on every optimizer step, so the engine with two chained optimizers (ours)
    paid 11% of its update against 2-4% for FSDP's one, a bias in the side by side itself.
    Timed against that walk in this same process, so the machine's speed cancels."""
    import time

    def seconds(fn, n=20):
        start = time.perf_counter()
        for _ in range(n):
            fn()
        return (time.perf_counter() - start) / n

    probe = MemoryProbe(tmp_path)
    walk = seconds(lambda: Path("/proc/self/smaps_rollup").read_text())
    point = seconds(lambda: probe.row("pre_step"))
    assert point < walk / 3, f"a point took {point * 1e3:.2f} ms, the walk {walk * 1e3:.2f} ms"
    row = probe.row("pre_step")
    assert row["rss_mib"] >= row["anon_mib"] + row["file_mib"] - 1 and row["anon_mib"] > 0
