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


def test_a_choice_autosel_cannot_make_fails_the_run_once_before_any_row(tmp_path, monkeypatch):
    # With AUTOSEL_TUNE=off and no usable decision every row logged the same multiple-backends error, and the result
    # file held only error rows.
    monkeypatch.setenv("AUTOSEL_TUNE", "off")
    result = CliRunner().invoke(main, ["bench", "attention-step", "--device", "cpu", "--layers", "1", "--rounds", "1",
                                       "--results", str(tmp_path / "results")])
    assert result.exit_code == 1, result.output
    assert result.output.strip().startswith("Error: autosel cannot choose a backend, so no row was run: op 'attention.decode' "
                                    "has multiple backends usable on device 'cpu' (['torch', 'torch_compile']);")
    assert result.output.count("Error:") == 1 and "Traceback" not in result.output
    assert not (tmp_path / "results").exists() or not list((tmp_path / "results").iterdir())
