"""autosel.bench.attention_step (`autosel bench attention-step`): one tiny run on this CPU, its result file and the
page's table of it."""

from __future__ import annotations

from click.testing import CliRunner

from autosel.bench.results import read_results
from autosel.cli import main


def test_the_model_step_on_this_cpu_times_autosels_choice_on_one_decode_and_one_extend_row(tmp_path, monkeypatch):
    from autosel.bench import page

    monkeypatch.setenv("AUTOSEL_BACKEND", "torch")  # autosel's choice without a tune: the one backend timed here
    monkeypatch.setenv("AUTOSEL_TUNE", "off")
    result = CliRunner().invoke(main, ["bench", "attention-step", "--device", "cpu", "--layers", "1", "--rounds", "1",
                                       "--skip", "torch_compile,flashinfer,sgl_kernel,triton", "--results",
                                       str(tmp_path)])
    assert result.exit_code == 0, result.output
    [record] = read_results(tmp_path)
    assert record["kind"] == "attention_step"
    rows = record["results"]["rows"]
    assert [(r["op"], r["mode"], r["batch"], r["autosel"]) for r in rows] == \
        [("attention.decode", "eager", 2, "torch"), ("attention.extend", "eager", 1, "torch")]
    assert all(r["step_us"]["torch"] > 0 and not r["errors"] for r in rows)
    text = page.render([record])
    assert "## Paged attention in a model step" in text and "| decode | eager | 2 | 1024 | 1 | torch |" in text
