"""The forward/backward smoke run: HF -> mcore, parity line, loss falls, export reloads."""

import re

from recipes.local.smoke import PARITY_TOL, main


def test_smoke_run_learns_and_exports(tmp_path, capsys):
    """The parity it prints is within the fp32 tolerance, the loss falls, the export reloads.
    Catches an HF -> mcore load that leaves a weight at the model's own init (the routers
    skipped in converters.sharding.load_hf_into_model): it still learns, and the export of what
    it holds reloads with the same logits."""
    code = main(["--steps", "12", "--out", str(tmp_path)])
    out = capsys.readouterr().out
    parity = re.search(r"parity: max \|mcore - transformers\| logits = (\S+)", out)
    assert parity and float(parity[1]) < PARITY_TOL, out
    loss = re.search(r"loss (\S+) -> (\S+) over 12 steps", out)
    assert loss and float(loss[2]) < float(loss[1]), out
    assert (tmp_path / "export_hf" / "config.json").is_file()
    assert code == 0, out
