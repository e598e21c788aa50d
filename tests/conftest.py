"""Shared fixtures: the tiny and the mini random Qwen3-MoE checkpoints and a world-size-1
megatron setup; the no_mcore mark's order and check."""

import os
import sys

import pytest
import torch

from recipes.local.task.hf_checkpoints import make_checkpoint, make_tiny_checkpoint, tiny_config


@pytest.fixture(scope="session")
def tiny_hf_dir(tmp_path_factory):
    """The tiny model saved by transformers (safetensors + config.json), seed 0."""
    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny_qwen3_moe"), seed=0)


@pytest.fixture(scope="session")
def tiny_hf_model(tiny_hf_dir):
    """transformers' reference model loaded from tiny_hf_dir, fp32, eager attention."""
    from transformers import Qwen3MoeForCausalLM

    model = Qwen3MoeForCausalLM.from_pretrained(
        tiny_hf_dir, dtype=torch.float32, attn_implementation="eager"
    )
    return model.eval()


@pytest.fixture(scope="session")
def mini_hf_dir(tmp_path_factory):
    """The mini model (128 experts, top-8: parallel.models.MINI_QWEN3_MOE) saved, seed 0."""
    return make_checkpoint(tmp_path_factory.mktemp("mini_qwen3_moe"), "mini", seed=0)


@pytest.fixture(scope="session")
def mini_run(tmp_path_factory):
    """Two steps of the main job on the mini model at ep 2 after its warm-up, checkpoints after
    each (tests/recipes/test_verl_cpu_trainer.py's launch; the ours side of tests/recipes/test_ab_engines.py)."""
    from tests.recipes.test_verl_cpu_trainer import MINI_EP2, MINI_OVERRIDES, launch

    out = tmp_path_factory.mktemp("cpu_dapo")
    proc = launch(out, *MINI_EP2, "--steps", "2",
                  overrides=("trainer.save_freq=1", *MINI_OVERRIDES))  # fmt: skip
    assert proc.returncode == 0
    return out, proc


@pytest.fixture(scope="module")
def dev_shm_unchanged():
    """The module's runs leave nothing in /dev/shm: every multiprocessing segment and
    semaphore they made is gone when it ends (the run's reaper, a node's --stop)."""
    from recipes.dapo.cluster.reaper import LEAKED

    def leak_kinds() -> set[str]:
        return {n for n in os.listdir("/dev/shm") if n.startswith(LEAKED)}

    before = leak_kinds()
    yield
    left = leak_kinds() - before
    assert not left, f"left in /dev/shm: {sorted(left)}"


@pytest.fixture(scope="session")
def world1():
    """ProcessGroups of a single CPU rank with megatron-core's parallel state set up."""
    from backend.platform.device import prepare_device
    from backend.training.distributed import init_parallel

    return init_parallel(prepare_device("cpu"), seed=1234)


@pytest.fixture
def tiny_config_factory():
    return tiny_config


def pytest_report_header(config):
    """Versions read without importing megatron-core (the no_mcore check below needs that)."""
    from importlib import metadata, util

    where = util.find_spec("megatron.core").origin
    return (
        f"megatron-core {metadata.version('megatron-core')} ({where}), "
        f"transformers {metadata.version('transformers')}"
    )


MCORE = "megatron.core"
_mcore_before = pytest.StashKey[bool]()


def pytest_collection_modifyitems(config, items):
    """no_mcore tests first (stable: modules stay whole): until one of them imports
    megatron-core, none has, so the check below sees every one that does."""
    if MCORE in sys.modules:
        raise pytest.UsageError(
            "collecting the tests imported megatron-core, so the no_mcore check cannot see a "
            "test that imports it: import it inside the tests (the release without importing "
            "it: tests/support/mcore_release.py)"
        )
    items.sort(key=lambda item: item.get_closest_marker("no_mcore") is None)


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    item.stash[_mcore_before] = MCORE in sys.modules


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item, nextitem):
    result = yield
    loaded = not item.stash.get(_mcore_before, True) and MCORE in sys.modules
    if loaded and item.get_closest_marker("no_mcore"):
        pytest.fail(
            f"{item.nodeid} is marked no_mcore but imported megatron-core: remove the mark "
            "(scripts/test.sh then runs it on both releases)",
            pytrace=False,
        )
    return result
