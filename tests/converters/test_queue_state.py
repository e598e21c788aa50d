"""verl's async-mode TransferQueue state is vetted by an exact allow-list before verl's plain
pickle.load (converters.pickles.queue_state; the resume check in recipes.dapo.checkpoints.resume)."""

import io
import os
import pickle
from collections import OrderedDict

import pytest
import torch

from backend.shared.errors import CheckpointError
from converters.pickles.queue_state import check_legacy_storage, check_queue_state
from converters.pickles.safe_pickle import UnsafeCheckpointError
from recipes.dapo.checkpoints import resume

tq = pytest.importorskip("transfer_queue.controller")

pytestmark = pytest.mark.no_mcore  # the 0.16.1 set only (pyproject.toml)


def genuine(root):
    """Files as transfer_queue writes them (pickle.dump of its state dicts, protocol 5): its
    dataclasses, tensors of every dtype a batch carries, torch dtypes, strings and numbers."""
    (root / "simple_storage").mkdir(parents=True)
    meta = {
        "rm_scores": tq.FieldMeta(torch.float32, (3,), False),
        "prompts": tq.FieldMeta(torch.int64, (5,), True),
    }
    status = tq.DataPartitionStatus.__new__(tq.DataPartitionStatus)
    status.__dict__.update({"partition_id": "train", "fields": meta, "mask": torch.zeros(4, dtype=torch.uint8),
                            "global_steps": {"uid-1": 3}, "lengths": torch.tensor([1, 2], dtype=torch.int16)})  # fmt: skip
    state = {
        "controller_id": "c0",
        "partitions": {"train": status},
        "index_manager": {"allocated_indexes": {1, 2}},
    }
    with open(root / "controller_state.pkl", "wb") as f:
        pickle.dump(state, f, protocol=pickle.HIGHEST_PROTOCOL)
    samples = {i: {"input_ids": torch.arange(6), "rollout_log_probs": torch.randn(6),
                   "routed_experts": torch.randint(0, 128, (6, 4, 8), dtype=torch.uint8),
                   "bf16": torch.randn(3).to(torch.bfloat16), "mask": torch.ones(6, dtype=torch.bool),
                   "view": torch.arange(10.0)[2:5], "data_source": "math_dapo", "score": 1.0}
               for i in range(3)}  # fmt: skip
    with open(root / "simple_storage" / "su_0.pkl", "wb") as f:
        pickle.dump(
            {"samples": samples, "order": OrderedDict(a=1)}, f, protocol=pickle.HIGHEST_PROTOCOL
        )
    return root


class Payload:
    """What a crafted file does: run a command on load (here: touch a marker)."""

    def __init__(self, marker="/dev/null"):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_genuine_queue_state_passes(tmp_path):
    """Bug caught: an allow-list too narrow for what transfer_queue writes (the async modes
    could then never resume)."""
    assert check_queue_state(genuine(tmp_path / "transfer_queue")) == 2


def test_a_crafted_pickle_is_refused_naming_what_it_calls_and_nothing_runs(tmp_path):
    root = genuine(tmp_path / "transfer_queue")
    marker = tmp_path / "ran"
    with open(root / "simple_storage" / "su_0.pkl", "wb") as f:
        pickle.dump({"samples": [Payload(marker)]}, f)
    with pytest.raises(
        UnsafeCheckpointError,
        match=r"su_0.pkl is not verl's async trainer state .*: it references posix.system; refusing",
    ):
        check_queue_state(root)
    assert not marker.exists()


def test_code_hidden_in_a_tensors_storage_bytes_is_refused(tmp_path):
    """Bug caught: vetting the outer pickle only; torch.storage._load_from_bytes runs
    torch.load(weights_only=False) on its bytes, so they are a second pickle to vet."""
    evil = io.BytesIO()
    for record in (0x1950A86A20F9469CFC6C, 1001, {"little_endian": True}):
        pickle.dump(record, evil)
    pickle.dump(Payload(), evil)
    with pytest.raises(
        Exception, match="storage stream naming posix.system|references posix.system"
    ):
        check_legacy_storage(evil.getvalue())
    root = tmp_path / "transfer_queue"
    root.mkdir()

    class Smuggled:
        def __reduce__(self):
            return (torch.storage._load_from_bytes, (evil.getvalue(),))

    (root / "controller_state.pkl").write_bytes(pickle.dumps({"x": Smuggled()}))
    with pytest.raises(UnsafeCheckpointError, match="storage stream naming posix.system"):
        check_queue_state(root)


def test_a_storage_whose_bytes_disagree_with_its_size_is_refused():
    """Bug caught: a short storage passed on to torch, which reads past it or fails late."""
    buf = io.BytesIO()  # what a tensor's pickle embeds: its typed storage, legacy torch.save
    torch.save(
        torch.arange(8, dtype=torch.int64).storage(), buf, _use_new_zipfile_serialization=False
    )
    check_legacy_storage(buf.getvalue())  # genuine
    with pytest.raises(Exception, match="bytes do not match its size"):
        check_legacy_storage(buf.getvalue()[:-8])


def test_a_truncated_file_is_a_checkpoint_error_not_a_crash(tmp_path):
    root = genuine(tmp_path / "transfer_queue")
    path = root / "controller_state.pkl"
    path.write_bytes(path.read_bytes()[:200])
    with pytest.raises(CheckpointError, match="controller_state.pkl is damaged"):
        check_queue_state(root)


def test_resume_checks_the_queue_state_only_where_verl_would_unpickle_it(tmp_path):
    step = tmp_path / "global_step_2"
    root = genuine(step / resume.QUEUE_STATE)
    (root / "controller_state.pkl").write_bytes(pickle.dumps(Payload()))
    resume.check_step_dir(step)  # the sync trainer never reads it
    for mode in ("colocate_async", "separate_async"):
        with pytest.raises(UnsafeCheckpointError, match="references posix.system"):
            resume.check_step_dir(step, trainer_mode=mode)
