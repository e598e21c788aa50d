"""Resume is safe: nothing in a checkpoint directory runs code, verl's `data.pt` included, and
a refusal reaches the user as one line with exit 2 (recipes.dapo.checkpoints.resume; the launcher's
console, recipes.dapo.console.screen and tracebacks).

The allow-list for `data.pt` is what genuine ones pickle: saves made here with verl's own
dataloader pieces (torchdata's StatefulDataLoader, verl's create_rl_sampler and collate_fn);
tests/recipes/test_verl_cpu_trainer.py checks a real run's too."""

import io
import pickle
import pickletools
import subprocess
import sys
from collections import OrderedDict
from pathlib import Path

import pytest
import torch

from backend.shared.errors import CheckpointError
from converters.pickles.safe_pickle import TORCH_SAVE_ALLOWED, UnsafeCheckpointError
from recipes.dapo.checkpoints import files, resume
from recipes.dapo.cluster import ray_job
from recipes.dapo.console import tracebacks
from recipes.dapo.console.screen import open_console

REPO = Path(__file__).resolve().parents[2]


def pickled_globals(path: Path) -> set[tuple[str, str]]:
    """The (module, name) pairs a torch.save file's data.pkl references (read, not run)."""
    with open(path, "rb") as f:
        raw = torch._C.PyTorchFileReader(f).get_record("data.pkl")
    found, strings = set(), []
    for op, arg, _ in pickletools.genops(raw):
        if op.name in ("SHORT_BINUNICODE", "BINUNICODE", "UNICODE"):
            strings.append(arg)
        elif op.name == "GLOBAL":
            found.add(tuple(arg.split(" ", 1)))
        elif op.name == "STACK_GLOBAL":
            found.add((strings[-2], strings[-1]))
    return found


class _Rows(torch.utils.data.Dataset):
    def __len__(self):
        return 12

    def __getitem__(self, i):
        return {"input_ids": torch.tensor([i]), "data_source": "math_dapo", "index": i}


def verl_data_state(path: Path, shuffle: bool, workers: int, steps: int) -> Path:
    """A data.pt as verl's trainer saves it (`torch.save(train_dataloader.state_dict())`)."""
    from omegaconf import OmegaConf
    from torchdata.stateful_dataloader import StatefulDataLoader
    from verl.trainer.ppo.utils import create_rl_sampler
    from verl.utils.dataset.rl_dataset import collate_fn

    rows = _Rows()
    sampler = create_rl_sampler(OmegaConf.create({"shuffle": shuffle, "seed": 1}), rows)
    loader = StatefulDataLoader(
        rows, batch_size=1, num_workers=workers, drop_last=True, collate_fn=collate_fn,
        sampler=sampler,
    )  # fmt: skip
    batches = iter(loader)
    for _ in range(steps):
        next(batches)
    torch.save(loader.state_dict(), path)
    return path


@pytest.mark.parametrize("shuffle", [True, False])
@pytest.mark.parametrize("workers", [0, 2])
def test_genuine_dataloader_states_pass_and_pickle_exactly_the_allow_list(
    shuffle, workers, tmp_path
):
    seen = set()
    for steps in (0, 5):
        step_dir = tmp_path / f"global_step_{steps}"
        step_dir.mkdir()
        verl_data_state(step_dir / resume.DATA_STATE, shuffle, workers, steps)
        resume.check_data_state(step_dir)
        seen |= pickled_globals(step_dir / resume.DATA_STATE)
    # shuffled: the sampler's torch.Generator state is a uint8 tensor; in order: plain dicts
    assert seen == (TORCH_SAVE_ALLOWED if shuffle else set())


class _Exec:
    def __init__(self, code: str):
        self.code = code

    def __reduce__(self):
        return exec, (self.code,)


def crafted_data_state(path: Path, marker: Path) -> Path:
    """A genuine-looking dataloader state whose generator entry runs exec when unpickled."""
    state = {"_num_yielded": 3, "_sampler_iter_state": {"yielded": 3}}
    state["_sampler_iter_state"]["generator"] = _Exec(f"open({str(marker)!r}, 'w').write('ran')")
    torch.save(state, path)
    return path


def test_the_exec_payload_runs_under_verls_own_load(tmp_path):
    """The payload is live: verl's torch.load(weights_only=False) of it runs the code."""
    marker = tmp_path / "ran"
    torch.load(crafted_data_state(tmp_path / "data.pt", marker), weights_only=False)
    assert marker.read_text() == "ran"  # (its code only writes this file)


class _Storage:
    def __init__(self, location: str):
        self.location = location


class _Tensor:
    """Pickles as torch.save pickles a uint8 tensor, with the hooks it is given."""

    def __init__(self, location: str = "cpu", hooks=()):
        self.storage, self.hooks = _Storage(location), OrderedDict(hooks)

    def __reduce__(self):
        return torch._utils._rebuild_tensor_v2, (self.storage, 0, (4,), (1,), False, self.hooks)


class _ArchivePickler(pickle.Pickler):
    def persistent_id(self, obj):
        if isinstance(obj, _Storage):  # torch.save's storage record: ByteStorage "0", 4 bytes
            return ("storage", torch.ByteStorage, "0", obj.location, 4)
        return None


def handmade_archive(path: Path, state) -> Path:
    """A torch.save-format archive holding `state` pickled as above."""
    body = io.BytesIO()
    _ArchivePickler(body, protocol=2).dump(state)
    writer = torch._C.PyTorchFileWriter(str(path))
    for name, data in (
        ("data.pkl", body.getvalue()),
        ("byteorder", b"little"),
        ("data/0", b"\0" * 4),
    ):
        writer.write_record(name, data, len(data))
    writer.write_end_of_file()
    return path


def test_a_handmade_archive_of_a_plain_tensor_passes(tmp_path):
    handmade_archive(tmp_path / resume.DATA_STATE, {"generator": _Tensor()})
    resume.check_data_state(tmp_path)
    state = torch.load(tmp_path / resume.DATA_STATE, weights_only=True)
    assert state["generator"].dtype == torch.uint8 and state["generator"].shape == (4,)


@pytest.mark.parametrize(
    "make, says",
    [
        (lambda p, m: crafted_data_state(p, m), "it references __builtin__.exec"),
        (lambda p, m: p.write_bytes(pickle.dumps(_Exec("x"))), "is not a torch.save zip archive"),
        (
            lambda p, m: torch.jit.save(torch.jit.script(torch.nn.Linear(1, 1)), str(p)),
            "is a TorchScript archive (torch.load would run it as code)",
        ),
        (lambda p, m: torch.save({"w": torch.ones(2)}, p), "it references torch.FloatStorage"),
        (
            lambda p, m: handmade_archive(p, {"g": _Tensor(hooks=[("h", OrderedDict)])}),
            "holds a tensor rebuilt with arguments other than a plain tensor's",
        ),
        (
            lambda p, m: handmade_archive(p, {"g": _Tensor(location="cuda:0")}),
            "holds a storage reference other than a CPU byte storage of the archive",
        ),
    ],
    ids=[
        "exec payload",
        "plain pickle",
        "TorchScript",
        "float tensor",
        "tensor with a hook",
        "storage elsewhere",
    ],  # fmt: skip
)
def test_data_state_other_than_plain_data_is_refused_without_running(make, says, tmp_path):
    marker = tmp_path / "ran"
    make(tmp_path / resume.DATA_STATE, marker)
    with pytest.raises(UnsafeCheckpointError) as err:
        resume.check_data_state(tmp_path)
    message = str(err.value)
    assert says in message and "\n" not in message and "weights_only" not in message
    assert "delete it to restart the data order" in message
    assert not marker.exists()


def _step_with(tmp_path: Path, marker: Path) -> Path:
    run = tmp_path / "run"
    step = run / "checkpoints" / "global_step_2"
    step.mkdir(parents=True)
    (step.parent / files.TRACKER).write_text("2")
    crafted_data_state(step / resume.DATA_STATE, marker)
    return run


def test_resume_with_a_crafted_data_state_stops_in_one_line_before_anything_starts(tmp_path):
    """The whole CLI, as a user runs it: exit 2, one line on stderr, the payload never ran and
    neither Ray nor verl's trainer was started (no launch log, no Ray session)."""
    marker = tmp_path / "ran"
    run = _step_with(tmp_path, marker)
    from recipes.local.run import prepare

    prepare(run)  # the tiny model and data an earlier launch left (so none are made now)
    proc = subprocess.run(
        [sys.executable, "-m", "recipes.launcher.launch", "--device", "cpu", "--resume",
         "--model", "tiny", "--ckpt-dir", str(run)],
        cwd=REPO, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.count("\n") == 1 and proc.stderr.startswith(
        f"error: {run / 'checkpoints/global_step_2/data.pt'} is not verl's dataloader state"
    ), proc.stderr
    assert not marker.exists()
    assert not (run / "logs").exists()
    assert "Started a local Ray instance" not in proc.stdout + proc.stderr


def test_the_resume_folder_is_the_one_verl_picks(tmp_path):
    """resume_dir follows verl's own lookup (find_latest_ckpt_path) for each resume_mode."""
    from verl.utils.checkpoint.checkpoint_manager import find_latest_ckpt_path

    ckpt = tmp_path / "ckpt"

    def groups(**trainer):
        return {"trainer": {"trainer.default_local_dir": str(ckpt), **trainer}}

    def agree() -> Path | None:
        ours = resume.resume_dir(groups(), tmp_path)
        theirs = find_latest_ckpt_path(str(ckpt))
        assert ours == (None if theirs is None else Path(theirs))
        return ours

    assert agree() is None  # no tracker
    ckpt.mkdir()
    (ckpt / files.TRACKER).write_text("4")
    assert agree() is None  # the step it names is gone
    (ckpt / "global_step_4").mkdir()
    assert agree() == ckpt / "global_step_4"
    assert resume.resume_dir(groups(**{"trainer.resume_mode": "disable"}), tmp_path) is None
    relative = groups(**{"trainer.resume_mode": "resume_path",
                         "trainer.resume_from_path": "ckpt/global_step_4"})  # fmt: skip
    assert resume.resume_dir(relative, tmp_path) == ckpt / "global_step_4"
    (ckpt / files.TRACKER).write_text("four")
    with pytest.raises(CheckpointError, match="holds 'four', not a step number"):
        resume.resume_dir(groups(), tmp_path)


# ---- a refusal inside the trainer: one line, the traceback in the run's log ------------------

# a training child's last words, as verl's driver prints them (abridged; the real ones:
# tests/recipes/test_verl_cpu_trainer.py and the engine-check row of tests/support/bad_inputs.py)
RAY_TRACEBACK = r"""
import sys
sys.stderr.write(
    "\x1b[36m(TaskRunnerV1 pid=1)\x1b[0m INFO: Resuming from global_step_2\n"
    "Error executing job with overrides: ['trainer.resume_mode=auto']\n"
    "Traceback (most recent call last):\n"
    "  File \"verl/trainer/main_ppo.py\", line 93, in run_ppo\n"
    "ray.exceptions.RayTaskError(ManifestError): ray::TaskRunnerV1.run() (pid=1)\n"
    "converters.manifest.ManifestError: /ckpt/__0_0.distcp: bytes 5-9 differ from manifest.json: "
    "restore it\n"
    "\nSet the environment variable HYDRA_FULL_ERROR=1 for a complete stack trace.\n"
)
sys.exit(1)
"""


def _console(run: Path, **kwargs):
    """The launcher's console of a launch into `run` (its log: logs/launch_000.log)."""
    return open_console(run, 0, kwargs.pop("verbose", False), None, None, **kwargs)


@pytest.mark.parametrize("verbose", [False, True])
def test_a_refusal_in_the_trainer_is_one_line_and_its_traceback_goes_to_the_log(
    verbose, tmp_path, capfd
):
    """The whole stream (--verbose) too holds the refusal's traceback back."""
    console = _console(tmp_path, verbose=verbose)
    with pytest.raises(CheckpointError) as err:
        ray_job.run_command([sys.executable, "-c", RAY_TRACEBACK], {}, console)
    log = tmp_path / "logs" / "launch_000.log"
    assert console.log_path == log and str(err.value) == (
        f"/ckpt/__0_0.distcp: bytes 5-9 differ from manifest.json: restore it "
        f"(the trainer's traceback: {log})"
    )
    out, err = capfd.readouterr()
    shown = out + err
    assert ("Resuming from" in shown) == verbose  # the child's output before its traceback
    for told in ("Traceback", "Error executing job", "ManifestError", "HYDRA_FULL_ERROR"):
        assert told not in shown, told
    assert "exited with status" not in shown  # no end of the log: the refusal says it all
    console.close()
    logged = log.read_text()
    assert "Traceback (most recent call last)" in logged and "ManifestError" in logged
    assert "Resuming from" in logged and "HYDRA_FULL_ERROR" in logged


# 31 frames of distinct functions (a recursion's would be folded by Python's traceback)
DEEP_CRASH = "".join(f"def f{i}():\n    f{i + 1}()\n" for i in range(30)) + (
    "def f30():\n    raise RuntimeError('not a checkpoint')\nf0()\n"
)


@pytest.mark.parametrize("verbose", [False, True])
def test_other_failures_keep_their_traceback_and_status(verbose, tmp_path, capfd):
    """Any other failure: its status, and on the console its output's end with the whole
    traceback, also one longer than the tail the console otherwise shows."""
    child = "import sys; print('out'); raise SystemExit('boom')"
    shallow = "raise RuntimeError('not a checkpoint')"
    for i, code in enumerate((child, shallow, DEEP_CRASH)):
        console = _console(tmp_path / str(i), verbose=verbose)
        assert ray_job.run_command([sys.executable, "-c", code], {}, console) == 1
        console.close()
        assert console.refusal is None
    out, err = capfd.readouterr()
    assert err == "" and out.count("Traceback (most recent call last)") == 2
    assert "out\n" in out and "boom\n" in out and "RuntimeError: not a checkpoint" in out
    deep = out[out.rindex("Traceback (most recent call last)") :]
    assert deep.count(", in f") == 31 and deep.count("\n") > 30  # all of it (tail: 25 lines)
    for i in range(3):
        logged = (tmp_path / str(i) / "logs" / "launch_000.log").read_text()
        assert ("not a checkpoint" in logged) == (i > 0) and ("boom" in logged) == (i == 0)


def test_debug_shows_the_refusals_traceback_on_the_console(tmp_path, capfd):
    console = _console(tmp_path, debug=True)
    with pytest.raises(CheckpointError):
        ray_job.run_command([sys.executable, "-c", RAY_TRACEBACK], {}, console)
    out = capfd.readouterr().out
    assert "Traceback (most recent call last)" in out
    assert "converters.manifest.ManifestError: /ckpt/__0_0.distcp" in out


class _Screen(io.StringIO):
    """A console screen that notes when a traceback reaches it."""

    def __init__(self, seen: Path):
        super().__init__()
        self.seen = seen

    def write(self, text: str) -> int:
        if "Traceback" in text:
            self.seen.touch()
        return super().write(text)


def test_a_traceback_the_child_survives_is_shown_while_it_runs(tmp_path, monkeypatch):
    """A held traceback is shown once the child has outlived it by HOLD_S: the child goes on
    only when its traceback has reached the console."""
    seen = tmp_path / "seen"
    monkeypatch.setattr(tracebacks, "HOLD_S", 0.0)
    monkeypatch.setattr(ray_job, "_wait", lambda child: _poll(child, 0.2))
    console = _console(tmp_path)
    console.out = _Screen(seen)
    child = (
        "import pathlib, sys, time\n"
        "print('Traceback (most recent call last):', file=sys.stderr, flush=True)\n"
        f"seen = pathlib.Path({str(seen)!r})\n"
        "for _ in range(200):\n"
        "    if seen.exists(): sys.exit(0)\n"
        "    time.sleep(0.05)\n"
        "sys.exit(5)\n"
    )
    assert ray_job.run_command([sys.executable, "-c", child], {}, console) == 0
    assert console.out.getvalue().count("Traceback (most recent call last):") == 1


def _poll(child, poll_s):
    try:
        return child.wait(timeout=poll_s)
    except subprocess.TimeoutExpired:
        return None


def test_refusal_names_cover_every_checkpoint_error():
    names = tracebacks.refusal_classes()
    for name in ("backend.shared.errors.CheckpointError", "converters.manifest.ManifestError",
                 "converters.pickles.safe_pickle.UnsafeCheckpointError"):  # fmt: skip
        assert name in names


def test_a_relaunch_after_a_kill_names_the_checkpoint_it_continues_from(tmp_path, capsys):
    """After a kill -9 between saves nothing is half written, and the console still says which
    checkpoint the run continues from, and that the async modes' queue state was checked with
    it. Bug caught: a resumed run the user cannot tell from a fresh start, or a queue state
    taken without its allow-list check (a crafted one stops the relaunch in one line)."""
    from converters.manifest import NAME
    from recipes.dapo.checkpoints.files import MODEL_DIR, TRACKER
    from recipes.launcher.launch import settle_resume

    ckpt = tmp_path / "checkpoints"
    step = ckpt / "global_step_4"
    (step / "actor" / MODEL_DIR).mkdir(parents=True)
    (step / "actor" / MODEL_DIR / NAME).write_text("{}")  # sealed
    (ckpt / TRACKER).write_text("4")
    groups = {"trainer": {"trainer.default_local_dir": str(ckpt),
                          "trainer.v1.trainer_mode": "colocate_async"}}  # fmt: skip
    settle_resume(groups)
    assert capsys.readouterr().out == f"resuming from {step}\n"
    (step / resume.QUEUE_STATE).mkdir()
    (step / resume.QUEUE_STATE / "meta.pkl").write_bytes(b"cos\nsystem\n(S'true'\ntR.")
    with pytest.raises(CheckpointError, match="meta.pkl"):
        settle_resume(groups)
    (step / resume.QUEUE_STATE / "meta.pkl").unlink()
    settle_resume(groups)
    assert capsys.readouterr().out == (
        f"resuming from {step}, with the prompts verl's queue held (transfer_queue/, checked)\n"
    )
