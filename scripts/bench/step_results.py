"""The figures of one system in step_bench.py's JSON: its speed from the timed steps, its
comparison with hf-grouped_mm from the same run, or the record of its failure."""

import statistics
import traceback
from pathlib import Path

REFERENCE = "hf-grouped_mm"


def speed(times: list[float], ctx: dict) -> dict:
    ms = statistics.fmean(times)
    tflops = ctx["shape"]["flops_per_step"] / (ms / 1e3) / 1e12
    peak = ctx["peak_tflops"]
    return dict(
        ms_per_step=round(ms, 3),
        ms_median=round(statistics.median(times), 3),
        ms_min=round(min(times), 3),
        ms_max=round(max(times), 3),
        ms_std=round(statistics.pstdev(times), 3),
        tokens_per_s=round(ctx["shape"]["tokens"] / (ms / 1e3), 1),
        model_tflops=float(f"{tflops:.4g}"),
        mfu=float(f"{tflops / peak:.4g}") if peak else None,
    )


def compare_to_reference(results: list[dict]) -> None:
    """Add vs_hf_grouped_mm (speedup, peak memory ratio) to each timed result."""
    ref = next((r for r in results if r["system"] == REFERENCE and "ms_per_step" in r), None)
    for r in results:
        if ref is None or "ms_per_step" not in r:
            continue
        mem = (
            (r["peak_mem_gib"] / ref["peak_mem_gib"])
            if ref["peak_mem_gib"] and r["peak_mem_gib"]
            else None
        )
        r["vs_hf_grouped_mm"] = dict(
            speedup=round(ref["ms_per_step"] / r["ms_per_step"], 3),
            peak_mem_ratio=round(mem, 3) if mem is not None else None,
        )


def error_result(name: str, err: BaseException) -> dict:
    frame = traceback.extract_tb(err.__traceback__)[-1] if err.__traceback__ else None
    where = f"{Path(frame.filename).name}:{frame.lineno} in {frame.name}" if frame else None
    return dict(system=name, error=f"{type(err).__name__}: {err}".strip()[:2000], where=where)
