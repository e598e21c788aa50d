"""The bad inputs tried on every CLI: one list, from which both the test
(tests/test_bad_inputs.py runs each row) and the table in docs/bad_inputs.md are made
(`.venv/bin/python -m tests.support.bad_inputs > docs/bad_inputs.md`; a test checks it is current).

Each row: the CLI, what is wrong, how the input is made (`setup(ctx)` returns the argv), the
exit code, and the one line printed (stderr; stdout for a finding, exit 1, or for a leftover
that a successful run removes, exit 0), with the paths
of the run written as {tmp} (the row's scratch dir), {hf} (the tiny HF model), {mcore} (its
dist checkpoint, made by hf-to-mcore) and {pid} (this process).
"""

import functools
import importlib.util
import json
import os
import pickle
import shutil
import subprocess
import sys
from pathlib import Path

from tests.support.bad_input_case import Case, Ctx
from tests.support.bad_inputs_model import BROKEN_MODEL_DIR, LOCAL_MODEL


def _m2h(ckpt, ctx: Ctx, *flags) -> list:
    return ["mcore-to-hf", ckpt, ctx.tmp / "out", "--template", ctx.hf, *flags]


def _dotted_metadata(ctx: Ctx) -> Path:
    from tests.converters.test_safe_checkpoints import _call

    ckpt = ctx.copy(ctx.mcore, "m")
    (ckpt / ".metadata").write_bytes(
        _call("torch.distributed.checkpoint.filesystem", "os.mkdir", str(ctx.tmp / "pwned"))
    )
    return ckpt


def _chunk_offset(ctx: Ctx) -> int:
    chunks = json.loads((ctx.mcore / "manifest.json").read_text())["files"]["__0_0.distcp"][
        "chunks"
    ]
    return max(chunks, key=lambda c: c[1])[
        0
    ]  # the biggest chunk (a tensor)'s first byte: its zip header


def _mkdir(path: Path) -> Path:
    path.mkdir()
    return path


def _truncate(path: Path, keep: int) -> Path:
    path.write_bytes(path.read_bytes()[:keep])
    return path


def _v1_manifest(ctx: Ctx) -> Path:
    ckpt = ctx.copy(ctx.mcore, "m")
    body = json.loads((ckpt / "manifest.json").read_text())
    del body["files"]
    (ckpt / "manifest.json").write_text(json.dumps({**body, "version": 1}))
    return ckpt


def _hold_lock(ctx: Ctx, argv: list) -> list:
    """A writer (this process) holds {tmp}/out while the CLI (argv) tries to write it."""
    from backend.shared.atomic_outputs import output_lock
    from converters.errors import ConversionError

    lock = output_lock((ctx.tmp / "out").absolute(), ConversionError)
    lock.__enter__()
    ctx.release = lambda: lock.__exit__(None, None, None)
    return argv


def _locked(ctx: Ctx) -> list:
    return _hold_lock(ctx, ["hf-to-mcore", ctx.hf, ctx.tmp / "out", "--force"])


def dead_pid() -> int:
    """The pid of a process that has exited (and been reaped): no process has it now."""
    done = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"],
        capture_output=True,
        text=True,
        check=True,
    )
    return int(done.stdout)


CONVERTERS = [
    Case(
        "converters",
        "source dir does not exist",
        lambda c: ["hf-to-mcore", c.tmp / "nope", c.tmp / "o"],
        2,
        "error: no config.json at {tmp}/nope: pass an HF checkpoint directory or its config.json",
    ),
    Case(
        "converters",
        "output exists, no --force",
        lambda c: ["hf-to-mcore", c.hf, c.mcore],
        2,
        "error: output {mcore} exists: pass --force to replace it or choose another path",
    ),
    Case(
        "converters",
        "a second writer into the same output",
        _locked,
        2,
        "error: {tmp}/out is being written by another process (pid {pid}, lock {tmp}/.out.lock): "
        "wait for it to finish or choose another output",
    ),
    Case(
        "converters",
        "--tp 3 (2 kv heads)",
        lambda c: ["hf-to-mcore", c.hf, c.tmp / "o", "--tp", "3"],
        2,
        "error: plan tp=3 ep=1 pp=1 etp=1: tp=3 does not divide num_key_value_heads=2: legal tp for this model: 1, 2",
    ),
    Case(
        "converters",
        "--ep 3 (8 experts)",
        lambda c: ["hf-to-mcore", c.hf, c.tmp / "o", "--ep", "3"],
        2,
        "error: plan tp=1 ep=3 pp=1 etp=1: ep=3 does not divide num_experts=8: legal ep for this model: 1, 2, 4, 8",
    ),
    Case(
        "converters",
        "--tp 0",
        lambda c: ["hf-to-mcore", c.hf, c.tmp / "o", "--tp", "0"],
        2,
        "error: python -m converters hf-to-mcore: argument --tp: '0' is not a positive integer; "
        "see python -m converters hf-to-mcore --help",
    ),
    Case(
        "converters",
        "truncated safetensors shard",
        lambda c: [
            "hf-to-mcore",
            _truncate(c.copy(c.hf, "h") / "model.safetensors", 5000).parent,
            c.tmp / "o",
        ],
        2,
        "error: model.safetensors is unreadable or truncated ({detail}): re-download it",
    ),
    Case(
        "converters",
        "config.json of another model type",
        lambda c: [
            "hf-to-mcore",
            c.edit_json(c.copy(c.hf, "h") / "config.json", model_type="llama").parent,
            c.tmp / "o",
        ],
        2,
        "error: model_type is 'llama', expected 'qwen3_moe': this backend builds Qwen3-MoE models only",
    ),
    Case(
        "converters",
        "--target-config with other experts",
        lambda c: [
            "hf-to-mcore",
            c.hf,
            c.tmp / "o",
            "--target-config",
            c.edit_json(c.copy(c.hf, "h") / "config.json", num_experts=16),
        ],
        2,
        "error: num_experts: checkpoint has 8, --target-config {tmp}/h/config.json has 16; "
        "convert the checkpoint that matches the config or fix the config",
    ),
    Case(
        "converters",
        "checkpoint without manifest.json",
        lambda c: _m2h(c.copy(c.mcore, "m", "manifest.json"), c),
        2,
        "error: no manifest.json in {tmp}/m: nothing to check its bytes against; pass --no-manifest-check to trust "
        "it as is, or run `python -m converters manifest {tmp}/m` on a good copy",
    ),
    Case(
        "converters",
        "manifest of an older converter (no file hashes)",
        lambda c: _m2h(_v1_manifest(c), c),
        2,
        "error: {tmp}/m/manifest.json has no file hashes (written by an older converter): re-create it with "
        "`python -m converters manifest {tmp}/m` on a good copy, or pass --no-manifest-check",
    ),
    Case(
        "converters",
        "16 flipped bytes in a .distcp",
        lambda c: _m2h(
            c.flip(c.copy(c.mcore, "m") / "__0_0.distcp", _chunk_offset(c) + 900).parent, c
        ),
        2,
        "error: {tmp}/m/__0_0.distcp bytes {range} differ from manifest.json: the checkpoint was damaged or "
        "changed after it was written; restore it from a good copy",
    ),
    Case(
        "converters",
        "common.pt changed",
        lambda c: _m2h(c.flip(c.copy(c.mcore, "m") / "common.pt", 100, 1).parent, c),
        2,
        "error: {tmp}/m/common.pt differs from manifest.json: the checkpoint was damaged or changed after it was "
        "written; restore it from a good copy",
    ),
    Case(
        "converters",
        "crafted .metadata, manifest checked",
        lambda c: _m2h(_dotted_metadata(c), c),
        2,
        "error: {tmp}/m/.metadata differs from manifest.json: the checkpoint was damaged or changed after it was "
        "written; restore it from a good copy",
    ),
    Case(
        "converters",
        "crafted .metadata (dotted name), --no-manifest-check",
        lambda c: _m2h(_dotted_metadata(c), c, "--no-manifest-check"),
        2,
        "error: {tmp}/m/.metadata references torch.distributed.checkpoint.filesystem.os.mkdir, which a torch_dist "
        "checkpoint never holds: refusing to load it (nothing in it was run); re-save the checkpoint or restore it "
        "from a trusted copy",
    ),
    Case(
        "converters",
        "damaged chunk header, --no-manifest-check",
        lambda c: _m2h(
            c.flip(c.copy(c.mcore, "m") / "__0_0.distcp", _chunk_offset(c)).parent,
            c,
            "--no-manifest-check",
        ),
        2,
        "error: {tmp}/m/__0_0.distcp holds a damaged chunk of {key} at byte {offset} ({kind}): "
        "re-save or re-copy the checkpoint",
    ),
    Case(
        "converters",
        "deleted .distcp, --no-manifest-check",
        lambda c: _m2h(c.copy(c.mcore, "m", "*.distcp"), c, "--no-manifest-check"),
        2,
        "error: {tmp}/m/__0_0.distcp is missing: the checkpoint is incomplete; re-save or re-copy it",
    ),
    Case(
        "converters",
        "a changed _extra_state item (never read for the weights)",
        lambda c: _m2h(c.flip(c.copy(c.mcore, "m") / "__0_0.distcp", 40).parent, c),
        2,
        "error: {tmp}/m/__0_0.distcp bytes {range} differ from manifest.json: the checkpoint was damaged or "
        "changed after it was written; restore it from a good copy",
    ),
    Case(
        "converters",
        "truncated .metadata, --no-manifest-check",
        lambda c: _m2h(
            _truncate(c.copy(c.mcore, "m") / ".metadata", 300).parent, c, "--no-manifest-check"
        ),
        2,
        "error: {tmp}/m/.metadata is unreadable (UnpicklingError: {detail}): the save did not finish; re-save the checkpoint",
    ),
    Case(
        "converters",
        "sharded_backend is not torch_dist",
        lambda c: _m2h(
            c.edit_json(c.copy(c.mcore, "m") / "metadata.json", sharded_backend="zarr").parent,
            c,
            "--no-manifest-check",
        ),
        2,
        "error: {tmp}/m has sharded_backend 'zarr' in metadata.json: only torch_dist is read; re-save with "
        "megatron-core's default (torch_dist) strategy",
    ),
    Case(
        "converters",
        "--template without config.json",
        lambda c: ["mcore-to-hf", c.mcore, c.tmp / "o", "--template", c.tmp],
        2,
        "error: --template {tmp} has no config.json: pass the original HF model dir",
    ),
    Case(
        "converters",
        "--template of another size",
        lambda c: [
            "mcore-to-hf",
            c.mcore,
            c.tmp / "o",
            "--template",
            c.edit_json(c.copy(c.hf, "h") / "config.json", num_experts=16).parent,
        ],
        2,
        "error: decoder.layers.mlp.router.weight: checkpoint has global shape (2, 8, 64), {tmp}/h implies "
        "(2, 16, 64); pass the config the checkpoint was trained with",
    ),
    Case(
        "converters",
        "--max-shard-size not a size",
        lambda c: _m2h(c.mcore, c, "--max-shard-size", "big"),
        2,
        "error: python -m converters mcore-to-hf: argument --max-shard-size: 'big' is not a size: write e.g. 4GB, "
        "500MB; see python -m converters mcore-to-hf --help",
    ),
    Case(
        "converters",
        "verify a path that does not exist",
        lambda c: ["verify", c.tmp / "nope", c.hf],
        2,
        "error: {tmp}/nope does not exist: pass an HF dir or a dist checkpoint dir",
    ),
    Case(
        "converters",
        "verify one dir without manifest",
        lambda c: ["verify", c.hf],
        2,
        "error: no manifest.json in {hf}: only converter outputs carry one; compare two checkpoints instead",
    ),
    Case(
        "converters",
        "verify finds a changed file (a finding)",
        lambda c: ["verify", c.flip(c.copy(c.mcore, "m") / "common.pt", 100, 1).parent],
        1,
        "{tmp}/m/common.pt: sha256 differs from manifest.json",
        stream="out",
    ),
    Case(
        "converters",
        "verify a crafted .metadata whose manifest agrees (a finding)",
        lambda c: _verify_crafted(c, ".metadata"),
        1,
        "{tmp}/m/.metadata references torch.distributed.checkpoint.metadata.os.mkdir, which a "
        "torch_dist checkpoint never holds: refusing to load it (nothing in it was run); re-save "
        "the checkpoint or restore it from a trusted copy",
        stream="out",
    ),
    Case(
        "converters",
        "verify a crafted common.pt whose manifest agrees (a finding)",
        lambda c: _verify_crafted(c, "common.pt"),
        1,
        "{tmp}/m/common.pt is not plain tensor data (references posix.system): refusing to load "
        "it (nothing in it was run); re-save the checkpoint or restore it from a trusted copy",
        stream="out",
    ),
    Case(
        "converters",
        "manifest over an existing one",
        lambda c: ["manifest", c.mcore],
        2,
        "error: {mcore}/manifest.json exists: pass --force to replace it, or verify against it",
    ),
]


def _verify_crafted(ctx: Ctx, name: str) -> list:
    """A checkpoint whose `name` is crafted, its manifest entry rewritten to agree (a plain
    sha256 list anyone can recompute)."""
    import torch

    from converters.manifest import hash_file
    from tests.converters.test_safe_checkpoints import _call, _System

    ckpt = ctx.copy(ctx.mcore, "m")
    if name == ".metadata":
        payload = _call("torch.distributed.checkpoint.metadata", "os.mkdir", str(ctx.tmp / "pwned"))
        (ckpt / name).write_bytes(payload)
    else:
        torch.save(_System(f"mkdir {ctx.tmp / 'pwned'}"), ckpt / name)
    manifest = json.loads((ckpt / "manifest.json").read_text())
    manifest["files"][name] = hash_file(ckpt / name)
    (ckpt / "manifest.json").write_text(json.dumps(manifest))
    return ["verify", ckpt]


class _Exec:
    """Runs `exec(code)` when unpickled, as torch.load(weights_only=False) would."""

    def __init__(self, code: str):
        self.code = code

    def __reduce__(self):
        return exec, (self.code,)


def _resume_run(ctx: Ctx, data_state: str = "genuine", model: str = "intact") -> list:
    """{tmp}/run: a local run's directory whose checkpoints/global_step_2 the launcher resumes
    (verl's layout; the actor's model is the tiny model's dist checkpoint)."""
    import torch

    from recipes.local.run import prepare

    prepare(ctx.tmp / "run")  # the tiny model and data an earlier launch made
    step = ctx.tmp / "run" / "checkpoints" / "global_step_2"
    model_dir = step / "actor" / "model" / "dist_ckpt"
    shutil.copytree(ctx.mcore, model_dir)
    (step.parent / "latest_checkpointed_iteration.txt").write_text("2")
    state = {"_num_yielded": 16, "_sampler_iter_state": {"yielded": 16}}  # as verl's, in short
    if data_state == "exec payload":
        state["_sampler_iter_state"]["generator"] = _Exec(
            f"open({str(ctx.tmp / 'pwned')!r}, 'w').write('ran')"
        )
    if data_state == "plain pickle":
        (step / "data.pt").write_bytes(pickle.dumps(_Exec("print('ran')")))
    else:
        torch.save(state, step / "data.pt")
    from tests.converters.test_safe_checkpoints import _call, _System

    if model == "crafted .metadata":
        payload = _call(
            "torch.distributed.checkpoint.filesystem", "os.mkdir", str(ctx.tmp / "pwned")
        )
        (model_dir / ".metadata").write_bytes(payload)
    elif model == "crafted common.pt":
        torch.save(_System(f"mkdir {ctx.tmp / 'pwned'}"), model_dir / "common.pt")
    elif model == "changed tensor bytes":
        ctx.flip(model_dir / "__0_0.distcp", _chunk_offset(ctx) + 900)
    argv = [
        "--device",
        "cpu",
        "--model",
        "tiny",
        "--resume",
        "--steps",
        "3",
        "--ckpt-dir",
        ctx.tmp / "run",
    ]
    if model == "half written":  # as a run stopped before its writes were finalized leaves it
        for name in (".metadata", "manifest.json"):
            (model_dir / name).unlink()
        argv += ["--", "trainer.resume_mode=resume_path", f"trainer.resume_from_path={step}"]
    return argv


def _engine_check(ctx: Ctx) -> str:
    """The training child: the engine's load-time check (rank 0 of a world of 1) on the step
    verl would resume, raising as it does in verl's actor worker."""
    step = ctx.tmp / "run" / "checkpoints" / "global_step_2"
    return (
        "import warnings; warnings.simplefilter('ignore')\n"
        "from pathlib import Path\n"
        "import torch.distributed as dist\n"
        f"dist.init_process_group('gloo', init_method='file://{ctx.tmp / 'pg'}', rank=0, "
        "world_size=1)\n"
        "from recipes.dapo.checkpoints import files\n"
        "from recipes.dapo.engine import weights\n"
        f"step = Path({str(step)!r})\n"
        "weights.check_sealed([step / 'actor' / files.MODEL_DIR], step_dir=step)\n"
    )


def _unscorable(ctx: Ctx) -> list:
    from tests.scripts.test_prepare_data import write_dataset

    path = write_dataset(ctx.tmp / "t.parquet", prompts=3, source="gsm8k")
    return ["--device", "cuda", "--dry-run", "--train-file", path]


PLANNER = [
    Case(
        "parallel",
        "--ep 3 on 4x8",
        lambda c: ["--ep", "3", "--nodes", "4"],
        2,
        "error: ep=3 does not divide num_experts=128: legal ep for this model: 1, 2, 4, 8, 16, 32, 64, 128",
    ),
    Case(
        "parallel",
        "--pp 5 on 4x8",
        lambda c: ["--pp", "5", "--nodes", "4"],
        2,
        "error: pp=5 does not divide num_hidden_layers=48: legal pp for this model: 1, 2, 3, 4, 6, 8, 12, 16, 24, 48 "
        "(or set first/last stage layers)",
    ),
    Case(
        "parallel",
        "--tp 8 (4 kv heads)",
        lambda c: ["--tp", "8"],
        2,
        "error: tp=8 does not divide num_key_value_heads=4: legal tp for this model: 1, 2, 4",
    ),
    Case(
        "parallel",
        "--ep 64 on 4x8 (the world is too small)",
        lambda c: ["--ep", "64", "--nodes", "4"],
        2,
        "error: etp*ep*pp=64 does not divide world=32 (4 nodes x 8): etp*ep*edp*pp must equal world; "
        "legal etp*ep*pp: 1, 2, 4, 8, 16, 32",
    ),
    Case(
        "parallel", "--tp 0", lambda c: ["--tp", "0"], 2, "error: tp=0 must be a positive integer"
    ),
    Case(
        "parallel",
        "--vpp without pp",
        lambda c: ["--vpp", "2"],
        2,
        "error: vpp=2 needs pp > 1: interleaving splits pipeline stages; drop --vpp or raise --pp",
    ),
    Case(
        "parallel",
        "--micro-batch-tokens 0",
        lambda c: ["--micro-batch-tokens", "0"],
        2,
        "error: --micro-batch-tokens=0 must be positive",
    ),
    Case(
        "parallel",
        "--model without config.json",
        lambda c: ["--model", c.tmp],
        2,
        "error: no config.json at {tmp}/config.json: pass an HF checkpoint directory or its config.json",
    ),
    Case(
        "parallel",
        "a plan that does NOT fit (a finding), even with full recompute (auto's last try)",
        lambda c: ["--ep", "8", "--nodes", "4", "--micro-batch-tokens", "65536"],
        1,
        "  update peak 120% of 64 GiB: does NOT fit (limit 90%)",
        stream="out",
    ),
    Case(
        "launcher",
        "--ep 3 on 4x8",
        lambda c: ["--device", "cuda", "--dry-run", "--ep", "3"],
        2,
        "error: ep=3 does not divide num_experts=128: legal ep for this model: 1, 2, 4, 8, 16, 32, 64, 128",
    ),
    Case(
        "launcher",
        "--pp 5",
        lambda c: ["--device", "cuda", "--dry-run", "--pp", "5"],
        2,
        "error: pp=5 does not divide num_hidden_layers=48: legal pp for this model: 1, 2, 3, 4, 6, 8, 12, 16, 24, 48 (or set first/last stage layers)",
    ),
    Case(
        "launcher",
        "--cp 2",
        lambda c: ["--device", "cuda", "--dry-run", "--cp", "2"],
        2,
        "error: cp=2: the mcore_ep actor runs cp=1; scale with --tp, --pp and --ep (python -m parallel --auto)",
    ),
    Case(
        "launcher",
        "--tp 0",
        lambda c: ["--device", "cuda", "--tp", "0"],
        2,
        "error: scripts/train_mcore.sh: argument --tp: '0' is not a positive integer; see scripts/train_mcore.sh --help",
    ),
    Case(
        "launcher",
        "unknown --device",
        lambda c: ["--device", "tpu"],
        2,
        "error: scripts/train_mcore.sh: argument --device: invalid choice: 'tpu' (choose from 'npu', 'cuda', 'cpu'); "
        "see scripts/train_mcore.sh --help",
    ),
    Case(
        "launcher",
        "local run: --nodes without --ray-address (the embedded run takes no nodes)",
        lambda c: ["--device", "cpu", "--dry-run", "--nodes", "2", "--ckpt-dir", c.tmp / "out"],
        2,
        "error: --nodes and --devices-per-node describe a running Ray cluster, which the embedded "
        "run does not use (its ranks are this machine's processes, as many as --tp, --ep and "
        "--pp need): drop them, or add --ray-address HEAD_IP:PORT",
    ),
    Case(
        "launcher",
        "local-only flags on a cluster dry run",
        lambda c: ["--device", "cuda", "--dry-run", "--steps", "3", "--resume"],
        2,
        "error: --steps, --resume configure the local CPU run, not a cuda cluster run: drop them (pass verl "
        "overrides after --, e.g. -- trainer.total_training_steps=N)",
    ),
    Case(
        "launcher",
        "dry run with a missing --train-file and no --val-file",
        lambda c: ["--device", "cuda", "--dry-run", "--train-file", c.tmp / "nope.parquet"],
        2,
        "error: DAPO-Math-17k {tmp}/nope.parquet: missing: download it with `wget -O {tmp}/nope.parquet {url}`",
    ),
    Case(
        "launcher",
        "real run without files",
        lambda c: ["--device", "cuda"],
        2,
        "error: a cluster run needs --model, --train-file, --val-file, --ckpt-dir: pass the model dir, data files "
        "and a checkpoint dir on the shared filesystem",
    ),
    Case(
        "launcher",
        "--model without config.json",
        lambda c: ["--device", "cuda", "--dry-run", "--model", c.tmp],
        2,
        "error: --model {tmp} has no config.json: pass the HF checkpoint dir of Qwen3-30B-A3B",
    ),
    Case(
        "launcher",
        "local run: --tp 8 (the mini model's 4 kv heads; Ray not started, nothing written)",
        lambda c: ["--device", "cpu", "--tp", "8", "--ckpt-dir", c.tmp / "out"],
        2,
        "error: tp=8 does not divide num_key_value_heads=4: legal tp for this model: 1, 2, 4",
    ),
    Case(
        "launcher",
        "local run: a rollout TP vLLM cannot split the mini model's heads by",
        lambda c: [
            "--device",
            "cpu",
            "--dry-run",
            "--ckpt-dir",
            c.tmp / "out",
            "--",
            "actor_rollout_ref.rollout.tensor_model_parallel_size=3",
        ],  # fmt: skip
        2,
        "error: {tmp}/out/sft_hf: rollout TP 3 does not divide its 32 attention heads or is no "
        "multiple or divisor of its 4 KV heads, as vLLM needs: set "
        "actor_rollout_ref.rollout.tensor_model_parallel_size to one that is",
    ),
    Case(
        "launcher",
        "local run: a rollout TP that is no number",
        lambda c: [
            "--device",
            "cpu",
            "--dry-run",
            "--ckpt-dir",
            c.tmp / "out",
            "--",
            "actor_rollout_ref.rollout.tensor_model_parallel_size=abc",
        ],  # fmt: skip
        2,
        "error: actor_rollout_ref.rollout.tensor_model_parallel_size=abc: give a positive integer "
        "(the CPU run's default: 1 up to world 4, world / 2 beyond)",
    ),
    Case(
        "launcher",
        "local run: --ep 5 (128 experts)",
        lambda c: ["--device", "cpu", "--ep", "5", "--ckpt-dir", c.tmp / "out"],
        2,
        "error: ep=5 does not divide num_experts=128: legal ep for this model: 1, 2, 4, 8, 16, 32, "
        "64, 128",
    ),
    Case(
        "launcher",
        "local run: --etp 3 (expert slices of 32)",
        lambda c: ["--device", "cpu", "--etp", "3", "--ckpt-dir", c.tmp / "out"],
        2,
        "error: etp=3 does not divide moe_intermediate_size=32: legal etp for this model: 1, 2",
    ),
    Case(
        "launcher",
        "local run: --pp 3 (4 layers)",
        lambda c: ["--device", "cpu", "--pp", "3", "--ckpt-dir", c.tmp / "out"],
        2,
        "error: pp=3 does not divide num_hidden_layers=4: legal pp for this model: 1, 2, 4 (or set "
        "first/last stage layers)",
    ),
    Case(
        "launcher",
        "local run: --cp 2",
        lambda c: ["--device", "cpu", "--cp", "2", "--ckpt-dir", c.tmp / "out"],
        2,
        "error: cp=2: the mcore_ep actor runs cp=1; scale with --tp, --pp and --ep (python -m "
        "parallel --auto)",
    ),
    Case(
        "launcher",
        "--steps 0 (not a 35-step run)",
        lambda c: ["--device", "cpu", "--steps", "0", "--ckpt-dir", c.tmp / "out"],
        2,
        "error: scripts/train_mcore.sh: argument --steps: '0' is not a positive integer; see "
        "scripts/train_mcore.sh --help",
    ),
    Case(
        "launcher",
        "--steps -1",
        lambda c: ["--device", "cpu", "--steps", "-1", "--ckpt-dir", c.tmp / "out"],
        2,
        "error: scripts/train_mcore.sh: argument --steps: '-1' is not a positive integer; see "
        "scripts/train_mcore.sh --help",
    ),
    Case(
        "launcher",
        "--resume with nothing to resume (an empty directory)",
        lambda c: ["--device", "cpu", "--resume", "--ckpt-dir", _mkdir(c.tmp / "run")],
        2,
        "error: --resume: {tmp}/run/checkpoints holds no checkpoint to continue: drop --resume "
        "to start a new run in {tmp}/run, or pass the --ckpt-dir of the run to continue",
    ),
    Case(
        "launcher",
        "local run: a pass-through override verl's config has no key for",
        lambda c: ["--device", "cpu", "--ckpt-dir", c.tmp / "out", "--", "not_a_key=1"],
        2,
        "error: -- not_a_key=1: verl's config (ppo_trainer) has no key not_a_key: the nearest is "
        "data.video_key; a new key is added with +not_a_key=1",
    ),
    Case(
        "launcher",
        "cluster run: a misspelt pass-through override",
        lambda c: ["--device", "cuda", "--dry-run", "--", "trainer.totl_epochs=2"],
        2,
        "error: -- trainer.totl_epochs=2: verl's config (ppo_trainer) has no key "
        "trainer.totl_epochs: the nearest is trainer.total_epochs; a new key is added with "
        "+trainer.totl_epochs=2",
    ),
    Case(
        "launcher",
        "deleting a key verl's config lacks",
        lambda c: ["--device", "cuda", "--dry-run", "--", "~trainer.total_epoch"],
        2,
        "error: -- ~trainer.total_epoch: verl's config (ppo_trainer) has no key "
        "trainer.total_epoch: the nearest is trainer.total_epochs",
    ),
    Case(
        "launcher",
        "adding (+) a key verl's config has",
        lambda c: ["--device", "cuda", "--dry-run", "--", "+trainer.total_epochs=2"],
        2,
        "error: -- +trainer.total_epochs=2: verl's config (ppo_trainer) already has "
        "trainer.total_epochs: set it without the +, as trainer.total_epochs=2",
    ),
    Case(
        "launcher",
        "a data_source verl's scorer does not know (gsm8k: verl's is openai/gsm8k)",
        _unscorable,
        2,
        "error: DAPO-Math-17k {tmp}/t.parquet: data_source 'gsm8k' (1 of 1 distinct values) has "
        "no scorer in verl's default_compute_score (verl.utils.reward_score): use a data_source "
        "it scores (math_dapo for DAPO-Math, aime* for AIME) or set reward.custom_reward_function",
    ),
    Case(
        "launcher",
        "--resume: data.pt runs exec when unpickled (nothing runs, nothing starts)",
        lambda c: _resume_run(c, data_state="exec payload"),
        2,
        "error: {tmp}/run/checkpoints/global_step_2/data.pt is not verl's dataloader state (plain "
        "containers and tensors): it references __builtin__.exec; refusing to load it (nothing "
        "in it was run): restore it from a trusted copy, or delete it to restart the data order "
        "from the first batch (verl then starts its dataloader afresh)",
    ),
    Case(
        "launcher",
        "--resume: data.pt is a plain pickle, not torch.save's archive",
        lambda c: _resume_run(c, data_state="plain pickle"),
        2,
        "error: {tmp}/run/checkpoints/global_step_2/data.pt is not verl's dataloader state (plain "
        "containers and tensors): it is not a torch.save zip archive (torch.load would unpickle "
        "it whole); refusing to load it (nothing in it was run): restore it from a trusted copy, "
        "or delete it to restart the data order from the first batch (verl then starts its "
        "dataloader afresh)",
    ),
    Case(
        "launcher",
        "--resume: a crafted .metadata in the actor's checkpoint",
        lambda c: _resume_run(c, model="crafted .metadata"),
        2,
        "error: {tmp}/run/checkpoints/global_step_2/actor/model/dist_ckpt/.metadata references "
        "torch.distributed.checkpoint.filesystem.os.mkdir, which a torch_dist checkpoint never "
        "holds: refusing to load it (nothing in it was run); re-save the checkpoint or restore "
        "it from a trusted copy",
    ),
    Case(
        "launcher",
        "--resume: a crafted common.pt in the actor's checkpoint (no advice to unpickle it)",
        lambda c: _resume_run(c, model="crafted common.pt"),
        2,
        "error: {tmp}/run/checkpoints/global_step_2/actor/model/dist_ckpt/common.pt is not plain "
        "tensor data (references posix.system): refusing to load it (nothing in it was run); "
        "re-save the checkpoint or restore it from a trusted copy",
    ),
    Case(
        "launcher",
        "--resume from a half-written checkpoint named by trainer.resume_from_path",
        lambda c: _resume_run(c, model="half written"),
        2,
        "error: {tmp}/run/checkpoints/global_step_2/actor/model/dist_ckpt was not completely "
        "written (no manifest.json: the run stopped while saving it): resume from a complete "
        "checkpoint (trainer.resume_mode=auto picks the newest) or from an earlier "
        "global_step_N (trainer.resume_from_path)",
    ),
    Case(
        "launcher",
        "--resume: tensor bytes changed after the save (the engine refuses them in the trainer)",
        lambda c: _resume_run(c, model="changed tensor bytes"),
        2,
        "error: {tmp}/run/checkpoints/global_step_2/actor/model/dist_ckpt/__0_0.distcp: bytes "
        "{range} differ from manifest.json: the checkpoint was damaged or changed after it was "
        "written; restore it from a good copy (the trainer's traceback: {tmp}/run/logs/"
        "launch_000.log)",
        child=_engine_check,
    ),
]


def _report(ctx: Ctx, name: str = "a.json", **kw) -> Path:
    from tests.backend.test_monitor_report import BALANCED_LE, _write

    return _write(ctx.tmp / name, [BALANCED_LE], **kw)


def _damaged(ctx: Ctx, edit) -> Path:
    path = _report(ctx)
    data = json.loads(path.read_text())
    edit(data)
    path.write_text(json.dumps(data))
    return path


def _rendered(ctx: Ctx) -> list:
    from backend.monitor.cli import main

    report = _report(ctx)
    assert main(["render", str(report), "-o", str(ctx.tmp / "html")]) == 0
    return ["render", report, "-o", ctx.tmp / "html"]


def _left_by_killed_render(ctx: Ctx) -> list:
    """A render into {tmp}/html killed by SIGKILL left its temp dir; its process is gone."""
    stale = ctx.tmp / f".html.tmp-{dead_pid()}-0badc0de"
    stale.mkdir()
    (stale / "index.html").write_text("half")
    return ["render", _report(ctx), "-o", ctx.tmp / "html"]


MONITOR = [
    Case(
        "monitor",
        "report file missing",
        lambda c: ["render", c.tmp / "nope.json", "-o", c.tmp / "o"],
        2,
        "error: {tmp}/nope.json: no such report file: pass the JSON the monitor wrote",
    ),
    Case(
        "monitor",
        "truncated report",
        lambda c: ["render", _truncate(_report(c), 100), "-o", c.tmp / "o"],
        2,
        "error: {tmp}/a.json is not valid JSON ({detail}): was it truncated?",
    ),
    Case(
        "monitor",
        "newer schema version",
        lambda c: ["render", _damaged(c, lambda d: d.update(schema_version=99)), "-o", c.tmp / "o"],
        2,
        "error: {tmp}/a.json has schema version 99, this reader needs 1: render it with the matching release",
    ),
    Case(
        "monitor",
        "not a report",
        lambda c: ["render", _damaged(c, lambda d: d.pop("schema")), "-o", c.tmp / "o"],
        2,
        "error: {tmp}/a.json is not a routing-balance report (no schema 'mcore-moe-dapo/routing-balance')",
    ),
    Case(
        "monitor",
        "counts of the wrong shape",
        lambda c: [
            "render",
            _damaged(c, lambda d: d["phases"]["update"]["cumulative"].pop()),
            "-o",
            c.tmp / "o",
        ],
        2,
        "error: {tmp}/a.json: phase 'update' counts are not 4 x 16 as meta says: the file is damaged",
    ),
    Case(
        "monitor",
        "output exists, no --force",
        _rendered,
        2,
        "error: {tmp}/html exists: pass --force to replace it or choose another directory",
    ),
    Case(
        "monitor",
        "a second render into an output another process is writing",
        lambda c: _hold_lock(c, ["render", _report(c), "-o", c.tmp / "out", "--force"]),
        2,
        "error: {tmp}/out is being written by another process (pid {pid}, lock {tmp}/.out.lock): "
        "wait for it to finish or choose another output",
    ),
    Case(
        "monitor",
        "temp dir left by a killed render (its pid gone): removed by the next render (it succeeds)",
        _left_by_killed_render,
        0,
        "wrote {tmp}/html/index.html",
        stream="out",
    ),
    Case(
        "monitor",
        "output is a file",
        lambda c: ["render", _report(c), "-o", _report(c, "b.json")],
        2,
        "error: {tmp}/b.json is a file: pass a directory path for the output",
    ),
    Case(
        "monitor",
        "compare with one report and no windows",
        lambda c: ["compare", _report(c), "-o", c.tmp / "o"],
        2,
        "error: one report given: pass a second report, or --window early late",
    ),
    Case(
        "monitor",
        "compare three reports",
        lambda c: ["compare", *[_report(c)] * 3, "-o", c.tmp / "o"],
        2,
        "error: compare takes one or two reports, got 3",
    ),
    Case(
        "monitor",
        "window out of range",
        lambda c: ["compare", _report(c), "--window", "early", "9", "-o", c.tmp / "o"],
        2,
        "error: window '9' not in {tmp}/a.json (1 windows): use early, late, all or an index",
    ),
    Case(
        "monitor",
        "-o missing",
        lambda c: ["render", _report(c)],
        2,
        "error: python -m backend.monitor render: the following arguments are required: -o/--out; "
        "see python -m backend.monitor render --help",
    ),
]


@functools.cache
def resolve_script():
    """scripts/stacks/resolve.py (the CLI `python -m scripts.stacks.resolve`), loaded from its
    file as a module of its own (`stacks_resolve`), whose names the rows patch."""
    path = Path(__file__).resolve().parents[2] / "scripts" / "stacks" / "resolve.py"
    spec = importlib.util.spec_from_file_location("stacks_resolve", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# what pip 26.3 prints when the index does not answer (its own retries spent)
NO_INDEX = (
    "WARNING: Retrying (Retry(total=0, connect=None, read=None, redirect=None, status=None)) "
    "after connection broken by 'NewConnectionError(\"HTTPSConnection(host='pypi.org', "
    "port=443): Failed to establish a new connection: [Errno 101] Network is unreachable\")'"
    ": /simple/torch/\nERROR: No matching distribution found for torch==2.7.1\n"
)


def _index_down(ctx: Ctx) -> list:
    """Every pip run of resolve.py fails fetching, as with the network down; nothing waits."""
    resolve = resolve_script()
    saved = {n: getattr(resolve, n) for n in ("pip_for", "FETCH_WAIT_S")}
    saved_run = resolve.subprocess.run
    resolve.pip_for, resolve.FETCH_WAIT_S = (lambda python: ["pip"]), (0, 0)
    resolve.subprocess.run = lambda cmd, **kw: subprocess.CompletedProcess(cmd, 1, "", NO_INDEX)

    def release() -> None:
        for name, value in saved.items():
            setattr(resolve, name, value)
        resolve.subprocess.run = saved_run

    ctx.release = release
    return ["check", "npu"]


RESOLVE = [
    Case(
        "resolve",
        "the package index does not answer (every try of a metadata fetch fails)",
        _index_down,
        2,
        "error: npu (Python 3.10, aarch64): fetching torch==2.7.1's aarch64 metadata from the "
        "package index failed 3 times (connection broken by): check the network or the index "
        "(PIP_INDEX_URL), then rerun",
    ),
]


def _node_running(ctx: Ctx) -> list:
    """A head this script started with {tmp}/h is still running (its state file names this
    process, with its start time)."""
    import psutil

    root = ctx.tmp / "h"
    root.mkdir()
    state = {"pid": os.getpid(), "created": psutil.Process().create_time(), "role": "head",
             "device": "cpu", "address": "127.0.0.1:6380", "log": str(root / "log")}  # fmt: skip
    (root / "mcore_ray_head.json").write_text(json.dumps(state))
    return ["head", "--device", "cpu", "--temp-dir", root]


RAY_NODE = [
    Case(
        "ray_node",
        "no --device",
        lambda c: ["head", "--temp-dir", c.tmp / "h"],
        2,
        "error: pass --device npu, cuda or cpu (or --stop)",
    ),
    Case(
        "ray_node",
        "a worker without --address",
        lambda c: ["worker", "--device", "cpu", "--temp-dir", c.tmp / "w"],
        2,
        "error: a worker needs --address HEAD_IP:PORT (printed by ray_start_head.sh)",
    ),
    Case(
        "ray_node",
        "a node of this script already running with that temp dir",
        _node_running,
        2,
        "error: a Ray head started here with temp dir {tmp}/h is running (pid {pid}): stop it "
        "with --stop, or give this node another --temp-dir",
    ),
]

CASES = CONVERTERS + PLANNER + LOCAL_MODEL + BROKEN_MODEL_DIR + RAY_NODE + MONITOR + RESOLVE
HEADER = """# Bad inputs tried per CLI

Every row is a test (`tests/test_bad_inputs.py`, generated from `tests/support/bad_inputs.py`): the
exit code and the one line printed (on stderr; on stdout for the findings, exit 1, and for a
leftover a run cleans up, exit 0). Paths:
`{tmp}` the run's scratch dir, `{hf}` a tiny HF model, `{mcore}` its dist checkpoint; `{...}`
elsewhere stands for a detail of the run (a byte range, the library's own wording).
Exit codes: `backend/shared/cli_contract.py`.
"""


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def table() -> str:
    lines = [HEADER]
    for cli, title in (
        ("converters", "python -m converters"),
        ("parallel", "python -m parallel"),
        ("launcher", "bash scripts/train_mcore.sh"),
        ("ray_node", "bash scripts/ray_start_{head,worker}.sh"),
        ("monitor", "python -m backend.monitor"),
        ("resolve", "python -m scripts.stacks.resolve"),
    ):
        rows = [c for c in CASES if c.cli == cli]
        lines += [
            f"\n## `{title}` ({len(rows)} rows)\n",
            "| bad input | exit | message |",
            "| --- | --- | --- |",
        ]
        lines += [f"| {c.what} | {c.code} | `{_cell(c.message)}` |" for c in rows]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.stdout.write(table())
