"""dev/carry_attention_results.py: a run of the former attention tools (their own JSON) becomes a result file with
its own command, commit and date; anything else is refused and nothing is written."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from autosel.bench.results import read_results

ROOT = Path(__file__).resolve().parents[1]
DATA = Path(__file__).parent / "data"


@pytest.fixture(scope="module")
def carry():
    path = ROOT / "dev" / "carry_attention_results.py"
    spec = importlib.util.spec_from_file_location("carry_attention_results", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("name, kind", [("attention_heldout_native.json", "attention_heldout"),
                                        ("attention_model_step_native.json", "attention_step")])
def test_a_run_of_the_former_tools_is_carried_with_its_own_command_commit_and_date(carry, tmp_path, name, kind):
    # The fixtures are the tools' own output on this CPU (tools/attention_heldout.py and attention_model_step.py at
    # b513b8c, --device cpu), the format a GPU run of theirs left under results/attention_h200/.
    from autosel.bench import page

    native = json.loads((DATA / name).read_text())
    assert carry.main([str(DATA / name), "--results", str(tmp_path)]) == 0
    [record] = read_results(tmp_path)
    assert record["kind"] == kind and record["carried_from"] == (DATA / name).as_posix()
    assert (record["command"], record["commit"], record["date"]) == (native["command"], native["commit"],
                                                                     native["date"])
    assert record["platform_key"] == "cpu/x86_64/Intel_R_Xeon_R_Processor/2"
    assert record["versions"]["torch"] == native["versions"]["torch"] and "flashinfer" not in record["versions"]
    assert record["results"]["rows"] == native["rows"]
    if kind == "attention_heldout":
        assert len(record["results"]["summary"]) == len(native["summary"]) == 2
        for theirs, mine in zip(native["summary"], record["results"]["summary"]):
            assert mine == {**mine, **theirs}, "the package's summary repeats every figure the tool computed"
    assert "carried, not re-measured: a run of tools/" in page.render([record])
    assert carry.main([str(DATA / name), "--results", str(tmp_path)]) == 0
    assert len(read_results(tmp_path)) == 2, "a second carry gets a file of its own"


@pytest.mark.parametrize("change, said", [
    (lambda n: n.pop("rows"), "neither tool's JSON"),
    (lambda n: n.update(platform="PlatformInfo(device_type=__import__('os').getcwd())"), "is not the PlatformInfo"),
])
def test_a_file_that_is_not_a_run_of_the_tools_is_refused_and_nothing_is_written(carry, tmp_path, capsys, change,
                                                                                 said):
    native = json.loads((DATA / "attention_heldout_native.json").read_text())
    change(native)
    (tmp_path / "native.json").write_text(json.dumps(native))
    assert carry.main([str(tmp_path / "native.json"), "--results", str(tmp_path / "results")]) == 1
    assert said in capsys.readouterr().err and not (tmp_path / "results").exists()
