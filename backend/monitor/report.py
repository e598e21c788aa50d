"""The routing-balance report: a versioned JSON file, written and read here only.

Layout (schema_version 1):
  schema, schema_version,
  meta: model, plan {tp, ep, pp, cp, dp, etp, edp, world}, num_layers, num_experts, top_k,
        phases, window_steps, steps, first_step, last_step, created, and caller extras,
  phases.<name>: cumulative [L][E] counts, metrics (of the cumulative counts),
                 windows [{start_step, end_step, complete, counts [L][E]}],
  steps: [{step (optimizer update), trainer_step (when the caller named it),
          phases.<name>: {overall {...}, layers {curve: [L]}}, aux_loss {...},
          mismatch {moe/routing_agreement/layer_NN, .../mean, .../min,
                    actor/rollout_logprob_abs_diff/{mean,p99,max}} when measured}],
  warnings: [{kind, step, text, [level], ...}] (alerts.RunWarning; absent in older files):
            the engine's warnings count steps in optimizer updates (with their trainer_step),
            the launcher's alarms (level "alarm") in trainer steps.
meta may also hold run (the experiment's name) and trainer_steps (the last trainer step).
Counts are per global expert, so runs with different EP degrees compare directly.
NaN (a metric of an empty layer) is stored as null: the file stays strict JSON.
"""

import json
import math
import os
import tempfile
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

import numpy as np
import torch

from backend.monitor.history import LoadHistory
from backend.monitor.metrics import layer_metrics, overall_metrics

SCHEMA = "mcore-moe-dapo/routing-balance"
SCHEMA_VERSION = 1


class ReportError(ValueError):
    """A report file is missing, malformed, or does not fit the requested comparison."""


def _strict(value):
    """NaN / inf -> None, recursively, so json.dumps(allow_nan=False) accepts the object."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _strict(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_strict(v) for v in value]
    return value


def metrics_block(counts_LE: torch.Tensor, ep: int) -> dict:
    per_layer = layer_metrics(counts_LE, ep)
    return {
        "overall": overall_metrics(counts_LE, ep),
        "layers": {k: v.tolist() for k, v in per_layer.items()},
    }


def build_report(
    history: LoadHistory,
    plan: dict,
    model: str = "",
    top_k: int | None = None,
    warnings: list[dict] | None = None,
    **extra,
) -> dict:
    steps = [s["step"] for s in history.steps]
    meta = {
        "model": model,
        "plan": plan,
        "num_layers": history.num_layers,
        "num_experts": history.num_experts,
        "top_k": top_k,
        "phases": list(history.phases),
        "window_steps": history.window_steps,
        "steps": len(steps),
        "first_step": steps[0] if steps else None,
        "last_step": steps[-1] if steps else None,
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        **extra,
    }
    phases = {}
    for i, name in enumerate(history.phases):
        windows = [
            {
                "start_step": w.start_step,
                "end_step": w.end_step,
                "complete": w.complete,
                "counts": w.counts_PLE[i].tolist(),
            }
            for w in history.all_windows()
        ]
        cumulative = history.cumulative_PLE[i]
        phases[name] = {
            "cumulative": cumulative.tolist(),
            "metrics": metrics_block(cumulative, history.ep),
            "windows": windows,
        }
    return _strict(
        {
            "schema": SCHEMA,
            "schema_version": SCHEMA_VERSION,
            "meta": meta,
            "phases": phases,
            "steps": history.steps,
            "warnings": warnings or [],
        }
    )


def with_warnings(report: dict, warnings: list[dict]) -> dict:
    """`report` with `warnings` (RunWarning.as_dict entries, e.g. the launcher's alarms)
    added to its own, those it already holds once, all ordered by step."""
    held = list(report.get("warnings", []))
    held += [w for w in _strict(warnings) if w not in held]
    return {**report, "warnings": sorted(held, key=lambda w: w["step"])}


def save_report(report: dict, path: str | Path) -> Path:
    """Write atomically: a temp file in the same directory, then rename over `path`."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(report, f, allow_nan=False, separators=(",", ":"))
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


@dataclass
class Report:
    """A validated report, with its counts as tensors."""

    path: Path
    data: dict

    @property
    def meta(self) -> dict:
        return self.data["meta"]

    @property
    def shape(self) -> tuple[int, int]:
        return self.meta["num_layers"], self.meta["num_experts"]

    @property
    def ep(self) -> int:
        return int(self.meta["plan"].get("ep", 1))

    @property
    def warnings(self) -> list[dict]:
        return self.data.get("warnings", [])

    @property
    def label(self) -> str:
        return self.path.stem  # runs of one model share meta.model; file names differ

    def phase(self, name: str) -> dict:
        if name not in self.data["phases"]:
            raise ReportError(
                f"{self.path}: no phase {name!r}; it has "
                f"{', '.join(self.data['phases'])}: pass --phase with one of them"
            )
        return self.data["phases"][name]

    def cumulative(self, phase: str) -> torch.Tensor:
        return torch.tensor(self.phase(phase)["cumulative"], dtype=torch.int64)

    def windows(self, phase: str) -> list[dict]:
        return self.phase(phase)["windows"]

    def window(self, phase: str, which: str) -> tuple[str, torch.Tensor]:
        """('steps a-b', counts) for early / late / all / a window index (negative from the end)."""
        if which == "all":
            return "all steps", self.cumulative(phase)
        windows = self.windows(phase)
        complete = [w for w in windows if w["complete"]] or windows
        if not complete:
            raise ReportError(
                f"{self.path}: phase {phase!r} has no windows: was any step recorded?"
            )
        picks = {"early": complete[0], "late": complete[-1]}
        if which in picks:
            chosen = picks[which]
        else:
            try:
                chosen = windows[int(which)]
            except (ValueError, IndexError):
                raise ReportError(
                    f"window {which!r} not in {self.path} ({len(windows)} windows): "
                    "use early, late, all or an index"
                ) from None
        label = f"steps {chosen['start_step']}-{chosen['end_step']}"
        return label, torch.tensor(chosen["counts"], dtype=torch.int64)

    def agreement_L(self, first_step: int | None = None, last_step: int | None = None):
        """Mean per-layer routing agreement over the steps (in the span) that measured it,
        [L] float64, or None when none did."""
        rows = []
        for s in self.data["steps"]:
            if first_step is not None and not first_step <= s["step"] <= last_step:
                continue
            mismatch = s.get("mismatch") or {}
            keys = [f"moe/routing_agreement/layer_{i:02d}" for i in range(self.shape[0])]
            if all(k in mismatch for k in keys):
                rows.append([mismatch[k] for k in keys])
        return torch.tensor(rows, dtype=torch.float64).mean(0) if rows else None

    @property
    def on_trainer_steps(self) -> bool:
        """Whether every step names its trainer step (reports written since it was recorded)."""
        steps = self.data["steps"]
        return bool(steps) and all("trainer_step" in s for s in steps)

    @property
    def axis_label(self) -> str:
        return "trainer step" if self.on_trainer_steps else "optimizer update"

    def _axis(self, rows: list[tuple[dict, object]]) -> tuple[list[int], list[list]]:
        """Rows (step entry, value) -> x and the values at each x: by trainer step when the
        steps name it (the phases then share one axis), else by optimizer update."""
        key = "trainer_step" if self.on_trainer_steps else "step"
        grouped: dict[int, list] = {}
        for entry, value in rows:
            grouped.setdefault(entry[key], []).append(value)
        xs = sorted(grouped)
        return xs, [grouped[x] for x in xs]

    def trainer_curve(self, phase: str, name: str) -> tuple[list[int], np.ndarray]:
        """step_curve on `axis_label`'s axis: a trainer step's updates averaged ([X, L])."""
        rows = [(s, s["phases"][phase]["layers"][name]) for s in self.data["steps"]
                if phase in s["phases"]]  # fmt: skip
        xs, grouped = self._axis(rows)
        curve = [[_mean(layer) for layer in zip(*group, strict=True)] for group in grouped]
        return xs, np.asarray(curve, dtype=float).reshape(len(xs), self.shape[0])

    def series(self, block: str, keys: list[str]) -> tuple[list[int], dict[str, list[float]]]:
        """Scalars of the steps' `block` (aux_loss, mismatch) on `axis_label`'s axis (a trainer
        step's values averaged); NaN where a step lacks a key."""
        rows = [(s, s.get(block) or {}) for s in self.data["steps"] if s.get(block)]
        xs, grouped = self._axis(rows)
        return xs, {key: [_mean(v.get(key) for v in group) for group in grouped] for key in keys}

    def step_curve(self, phase: str, name: str) -> tuple[list[int], np.ndarray]:
        """Steps with tokens in `phase`, and the per-layer curve `name` at each ([S, L])."""
        rows = [
            (s["step"], s["phases"][phase]["layers"][name])
            for s in self.data["steps"]
            if phase in s["phases"]
        ]
        steps = [step for step, _ in rows]
        curve = [[math.nan if v is None else v for v in values] for _, values in rows]
        return steps, np.asarray(curve, dtype=float).reshape(len(rows), self.shape[0])


def _mean(values) -> float:
    """Mean of the values that are numbers (None / NaN skipped), NaN when there are none."""
    kept = [float(v) for v in values if v is not None and not math.isnan(v)]
    return sum(kept) / len(kept) if kept else math.nan


def _read_json(path: Path) -> dict:
    if not path.is_file():
        raise ReportError(f"{path}: no such report file: pass the JSON the monitor wrote")
    try:
        return json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ReportError(f"{path} is not valid JSON ({err}): was it truncated?") from None


def _check_shapes(path: Path, data: dict) -> None:
    meta = data.get("meta", {})
    num_layers, num_experts = meta.get("num_layers"), meta.get("num_experts")
    for name, phase in data.get("phases", {}).items():
        blocks = [phase.get("cumulative")] + [w.get("counts") for w in phase.get("windows", [])]
        for counts in blocks:
            if (
                not isinstance(counts, list)
                or len(counts) != num_layers
                or any(len(row) != num_experts for row in counts)
            ):
                raise ReportError(
                    f"{path}: phase {name!r} counts are not {num_layers} x "
                    f"{num_experts} as meta says: the file is damaged"
                )


def load_report(path: str | Path) -> Report:
    """Read and validate a report; one-line ReportError on any problem."""
    path = Path(path)
    data = _read_json(path)
    if not isinstance(data, dict) or data.get("schema") != SCHEMA:
        raise ReportError(f"{path} is not a routing-balance report (no schema {SCHEMA!r})")
    if data.get("schema_version") != SCHEMA_VERSION:
        raise ReportError(
            f"{path} has schema version {data.get('schema_version')}, this reader "
            f"needs {SCHEMA_VERSION}: render it with the matching release"
        )
    for key in ("meta", "phases", "steps"):
        if key not in data:
            raise ReportError(f"{path} lacks {key!r}: the file is damaged")
    _check_shapes(path, data)
    return Report(path, data)
