"""Per actor rank, where its memory goes: the memory probe's lines reduced to one row a rank.

A launch run with MEMORY_PROBE_ENV set (backend/instruments/memory_probe.py) leaves
`<pid>.jsonl` for every process that stepped an optimizer. For each actor rank (the pids the
side by side sampled), in MiB:

- `at_first_forward`: RSS at the rank's first forward: interpreter, imports and code, the
  built model and whatever the engine made before running it;
- `params`, `grads`, `optimizer_states`: what the optimizer holds, at the last step;
- `base_less_params`: `at_first_forward - params` (imports, code, runtime);
- `between_steps`: RSS after the last optimizer step (anonymous / file-backed in `anon` and
  `file`), what the rank keeps from one step to the next;
- `kept_beyond_states`: `between_steps - at_first_forward - grads - optimizer_states`: what
  the rank holds after stepping that neither the model nor the optimizer explains (allocator
  caches, buffers kept for the next step, copies);
- `heap_free`: of `between_steps`, free memory glibc's heaps keep (mallinfo2's fordblks:
  freed tensors not returned to the OS); `kept_in_use` is `kept_beyond_states - heap_free`;
- `pass_peak`: the largest rise of peak RSS over the RSS at the point before it, among the
  windows ending in an update's backward (the old-log-prob pass, forward and backward);
- `peak`: the largest peak RSS the probe saw.
"""

import json
from pathlib import Path

ROWS = ("at_first_forward", "params", "base_less_params", "grads", "optimizer_states",
        "between_steps", "anon", "file", "kept_beyond_states", "heap_free", "kept_in_use",
        "pass_peak", "peak")  # fmt: skip


def read_probe(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def rank_breakdown(lines: list[dict]) -> dict | None:
    """One rank's row (see the module's text); None without a completed optimizer step."""
    first = next((r for r in lines if r["point"] == "first_forward"), None)
    posts = [r for r in lines if r["point"] == "post_step"]
    if first is None or not posts:
        return None
    last = posts[-1]
    rises = [
        cur["hwm_mib"] - prev["rss_mib"]
        for prev, cur in zip(lines, lines[1:], strict=False)
        if cur["point"] == "pre_step"
    ]
    row = {
        "at_first_forward": first["rss_mib"],
        "params": last["params_mib"],
        "grads": last["grads_mib"],
        "optimizer_states": last["optimizer_states_mib"],
        "between_steps": last["rss_mib"],
        "anon": last["anon_mib"],
        "file": last["file_mib"],
        "pass_peak": max(rises),
        "peak": max(r["hwm_mib"] for r in lines),
        "optimizer_steps": len(posts),
    }
    row["base_less_params"] = row["at_first_forward"] - row["params"]
    row["kept_beyond_states"] = (
        row["between_steps"] - row["at_first_forward"] - row["grads"] - row["optimizer_states"]
    )
    row["heap_free"] = last.get("heap_free_mib")  # None: a probe without mallinfo2
    row["kept_in_use"] = (
        None if row["heap_free"] is None else row["kept_beyond_states"] - row["heap_free"]
    )
    return row


def breakdown(probe_dir: Path, pids) -> list[dict]:
    """Rows of the ranks among `pids` that left probe lines, in pid order."""
    rows = []
    for pid in sorted(pids, key=int):
        path = probe_dir / f"{pid}.jsonl"
        row = rank_breakdown(read_probe(path)) if path.is_file() else None
        if row is not None:
            rows.append({"pid": int(pid), **row})
    return rows


def memory_table(results: dict) -> str:
    """Markdown: a column per engine and rank, a row per item, for every model/world."""
    out = []
    for key, row in results.items():
        columns = [(f"{label} rank {i}", r) for engine, label in (("fsdp", "FSDP"), ("mcore_ep", "ours"))
                   for i, r in enumerate(row.get(engine, {}).get("memory", []))]  # fmt: skip
        if not columns:
            continue
        names = [name for name, _ in columns]
        out += [f"\n{key}, MiB per actor rank:", "", f"| | {' | '.join(names)} |",
                "|---|" + "---|" * len(columns)]  # fmt: skip
        for item in ROWS:
            cells = ("-" if r.get(item) is None else f"{r[item]:.0f}" for _, r in columns)
            out.append(f"| {item} | " + " | ".join(cells) + " |")
    return "\n".join(out)
