"""The converted checkpoint at TP2 / EP2 / PP2 / TP2xEP2 (gloo processes): megatron-core loads
it into the sharded model (logits match transformers), saves it back at that plan, and
mcore-to-hf turns each of those back into the original HF tensors bit for bit. With our
GroupedExperts + SDPAttention too: the checkpoints interchange with SequentialMLP's."""

from pathlib import Path

import pytest
import torch

from converters.convert import convert_hf_to_mcore, convert_mcore_to_hf
from converters.hf_io import read_state_dict
from converters.manifest import write_manifest
from tests.support.multiproc import job_plan, run_ranks

pytestmark = [pytest.mark.slow, pytest.mark.mcore_compat]

# name: (tp, ep, pp, etp); 4 ranks each (data parallel fills the rest). TP2 splits the
# experts too (etp2): megatron-core 0.12.1 cannot run tp2 with ep1 etp1.
PLANS = {"tp2": (2, 1, 1, 2), "ep2": (1, 2, 1, 1), "pp2": (1, 1, 2, 1), "tp2xep2": (2, 2, 1, 1)}
WORLD = 4


MODULES = {"mcore-local": False, "grouped-sdpa": True}  # name: our fast modules?


def load_run_save(rank: int, hf_dir: str, ckpt: str, out_root: str, ids: torch.Tensor) -> dict:
    """With either module set, at every plan: load the converted checkpoint, run the batch,
    save back at that plan (to out_root/<modules>-<plan>); the pp=1 plans' full logits."""
    from backend.model.build import BuildOptions
    from backend.platform.device import prepare_device
    from backend.qwen3_moe import load_qwen3_moe_spec

    device = prepare_device("cpu")
    spec, logits = load_qwen3_moe_spec(hf_dir), {}
    for modules, fast in MODULES.items():
        opts = BuildOptions(experts="grouped", attention="sdpa") if fast else BuildOptions()
        for plan, dims in PLANS.items():
            out = Path(out_root) / f"{modules}-{plan}"
            logits[out.name] = _load_run_save_at(device, spec, opts, dims, ckpt, out, ids, rank)
    return logits


def _load_run_save_at(device, spec, opts, dims, ckpt: str, out: Path, ids, rank: int):
    import torch.distributed as dist
    from megatron.core import dist_checkpointing
    from megatron.core import parallel_state as ps

    from backend.model.build import build_model
    from backend.model.forward import forward_logits
    from backend.training.distributed import init_parallel
    from tests.support.parallel_ranks import _gather_vocab

    tp, ep, pp, etp = dims
    groups = init_parallel(device, job_plan(tp=tp, ep=ep, pp=pp, etp=etp))
    model = build_model(spec, groups, opts)
    model.load_state_dict(dist_checkpointing.load(model.sharded_state_dict(), ckpt))
    logits = None
    if pp == 1:
        with torch.no_grad():
            logits = _gather_vocab(forward_logits(model.eval(), ids), groups)
    if rank == 0:
        out.mkdir()
    dist.barrier()
    dist_checkpointing.save(model.sharded_state_dict(), str(out))
    ps.destroy_model_parallel()
    return logits


def test_plans_load_the_checkpoint_and_save_back_bit_exact(tiny_hf_dir, tiny_hf_model, tmp_path):
    """megatron-core's modules and ours (grouped experts, SDPA), every plan, one spawn."""
    ckpt = convert_hf_to_mcore(tiny_hf_dir, tmp_path / "mcore")
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(5))
    results = run_ranks(load_run_save, WORLD, str(tiny_hf_dir), str(ckpt), str(tmp_path), ids)
    with torch.no_grad():
        reference = tiny_hf_model(ids).logits
    original = read_state_dict(tiny_hf_dir)
    for modules in MODULES:
        for plan, (_, _, pp, _) in PLANS.items():
            name = f"{modules}-{plan}"
            if pp == 1:
                for rank_logits in results:
                    torch.testing.assert_close(
                        rank_logits[name], reference, rtol=0, atol=1e-5, msg=name
                    )
            write_manifest(tmp_path / name)  # megatron's save carries none: as our engine adds it
            back = convert_mcore_to_hf(
                tmp_path / name, tmp_path / f"{name}-hf", template=tiny_hf_dir
            )
            exported = read_state_dict(back)
            assert exported.keys() == original.keys(), name
            for key, tensor in original.items():
                assert torch.equal(exported[key], tensor), f"{name}: {key}"
