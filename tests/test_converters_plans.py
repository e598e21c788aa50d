"""The converted checkpoint at TP2 / EP2 / PP2 / TP2xEP2 (gloo processes): megatron-core loads
it into the sharded model (logits match transformers), saves it back at that plan, and
mcore-to-hf turns each of those back into the original HF tensors bit for bit. With our
GroupedExperts + SDPAttention too: the checkpoints interchange with SequentialMLP's."""

import pytest
import torch

from converters.convert import convert_hf_to_mcore, convert_mcore_to_hf
from converters.hf_io import read_state_dict
from converters.manifest import write_manifest
from tests.multiproc import job_plan, run_ranks

pytestmark = [pytest.mark.slow, pytest.mark.mcore_compat]

# name: (tp, ep, pp, etp); 4 ranks each (data parallel fills the rest). TP2 splits the
# experts too (etp2): megatron-core 0.12.1 cannot run tp2 with ep1 etp1.
PLANS = {"tp2": (2, 1, 1, 2), "ep2": (1, 2, 1, 1), "pp2": (1, 1, 2, 1), "tp2xep2": (2, 2, 1, 1)}
WORLD = 4


def load_run_save(
    rank: int, hf_dir: str, ckpt: str, out_root: str, ids: torch.Tensor, fast: bool
) -> dict:
    """At every plan: load the converted checkpoint, run the batch, save back at that plan."""
    from pathlib import Path

    from backend.device import prepare_device

    device = prepare_device("cpu")
    import torch.distributed as dist
    from megatron.core import dist_checkpointing
    from megatron.core import parallel_state as ps

    from backend.distributed import init_parallel
    from backend.forward import forward_logits
    from backend.model import BuildOptions, build_model
    from backend.qwen3_moe import load_qwen3_moe_spec
    from tests.parallel_ranks import _gather_vocab

    spec, logits = load_qwen3_moe_spec(hf_dir), {}
    opts = BuildOptions(experts="grouped", attention="sdpa") if fast else BuildOptions()
    for name, (tp, ep, pp, etp) in PLANS.items():
        groups = init_parallel(device, job_plan(tp=tp, ep=ep, pp=pp, etp=etp))
        model = build_model(spec, groups, opts)
        model.load_state_dict(dist_checkpointing.load(model.sharded_state_dict(), ckpt))
        if pp == 1:
            with torch.no_grad():
                logits[name] = _gather_vocab(forward_logits(model.eval(), ids), groups)
        out = Path(out_root) / name
        if rank == 0:
            out.mkdir()
        dist.barrier()
        dist_checkpointing.save(model.sharded_state_dict(), str(out))
        ps.destroy_model_parallel()
    return logits


@pytest.mark.parametrize("fast", [False, True], ids=["mcore-local", "grouped-sdpa"])
def test_plans_load_the_checkpoint_and_save_back_bit_exact(
    tiny_hf_dir, tiny_hf_model, tmp_path, fast
):
    ckpt = convert_hf_to_mcore(tiny_hf_dir, tmp_path / "mcore")
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(5))
    results = run_ranks(load_run_save, WORLD, str(tiny_hf_dir), str(ckpt), str(tmp_path), ids, fast)
    with torch.no_grad():
        reference = tiny_hf_model(ids).logits
    original = read_state_dict(tiny_hf_dir)
    for name, (_, _, pp, _) in PLANS.items():
        if pp == 1:
            for rank_logits in results:
                torch.testing.assert_close(
                    rank_logits[name], reference, rtol=0, atol=1e-5, msg=name
                )
        write_manifest(tmp_path / name)  # megatron's save carries none: as our engine adds it
        back = convert_mcore_to_hf(tmp_path / name, tmp_path / f"{name}-hf", template=tiny_hf_dir)
        exported = read_state_dict(back)
        assert exported.keys() == original.keys(), name
        for key, tensor in original.items():
            assert torch.equal(exported[key], tensor), f"{name}: {key}"
