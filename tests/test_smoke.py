"""The forward/backward smoke run: HF -> mcore, parity line, loss falls, export reloads."""

from recipes.local.smoke import main


def test_smoke_run_learns_and_exports(tmp_path, capsys):
    assert main(["--steps", "12", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "parity: max |mcore - transformers| logits" in out
    assert (tmp_path / "export_hf" / "config.json").is_file()
