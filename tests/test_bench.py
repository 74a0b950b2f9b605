"""autosel.bench.results, autosel.bench.page and the `autosel bench` commands that are not a benchmark of their own
file (the hot path, the page): result files carry their provenance, are never overwritten, and the repository's
benchmarks page is what its result files render."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from autosel.bench import page, results
from autosel.cli import main

ROOT = Path(__file__).parent.parent


class Platform:
    key = "cuda/sm_90/NVIDIA_H200/132"
    version_map = {"torch": "2.11.0"}


def test_a_result_file_has_its_provenance_and_a_second_run_gets_a_file_of_its_own(tmp_path):
    first = results.write_result("hot_path", {"tables": []}, folder=tmp_path, platform=Platform(), command="autosel x")
    second = results.write_result("hot_path", {"tables": []}, folder=tmp_path, platform=Platform(), command="autosel x")
    assert first != second and first.exists() and second.name.startswith(first.stem)
    record = json.loads(first.read_text())
    assert set(results.PROVENANCE) <= set(record)
    assert record["platform_key"] == Platform.key and record["versions"] == {"torch": "2.11.0"}
    assert record["command"] == "autosel x" and record["commit"] and record["autosel_version"]
    assert [r["file"] for r in results.read_results(tmp_path)] == sorted([first.name, second.name])


def test_a_working_copy_is_a_readable_record_of_its_own_until_the_result_file_replaces_it(tmp_path):
    # A long benchmark killed midway must leave what it measured; a second run must not write over the first's copy.
    first = results.WorkingCopy("attention_heldout", folder=tmp_path, platform=Platform(), command="autosel x")
    first.update({"rows": [1], "tables": []})
    second = results.WorkingCopy("attention_heldout", folder=tmp_path, platform=Platform(), command="autosel x")
    second.update({"rows": [2], "tables": []})
    assert first.path != second.path and first.path.name.endswith(".partial.json")
    assert sorted(r["results"]["rows"] for r in results.read_results(tmp_path)) == [[1], [2]]
    done = first.finish({"rows": [1, 3], "tables": []})
    assert not first.path.exists() and second.path.exists() and not list(tmp_path.glob("*.tmp"))
    assert json.loads(done.read_text())["results"]["rows"] == [1, 3]


def test_a_record_without_its_provenance_is_not_written(tmp_path):
    with pytest.raises(results.ResultFileError, match="this one has no commit, date"):
        results.write_record({"kind": "x", "command": "c", "autosel_version": "0", "platform_key": "cpu/x/X/2",
                              "versions": {}, "results": {}}, tmp_path)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("text, said", [("{", "not a readable result file"),
                                        ('{"kind": "x", "results": {}}', "no command, commit, autosel_version")])
def test_a_file_without_provenance_is_refused_by_name(tmp_path, text, said):
    (tmp_path / "bad.json").write_text(text)
    with pytest.raises(results.ResultFileError, match=said):
        results.read_results(tmp_path)


def test_the_command_line_names_autosel_however_it_was_started():
    assert results.command_line(["/venv/bin/autosel", "bench", "hot-path"]) == "autosel bench hot-path"
    assert results.command_line(["/x/autosel/__main__.py", "bench", "heldout", "--op", "a b"]) == \
        "autosel bench heldout --op 'a b'"
    assert results.command_line(["tools/hf_check.py", "--out", "x"]) == "python tools/hf_check.py --out x"


def _record(kind, key, date, subject=None, carried=None):
    body = {"tables": [{"title": "T", "columns": ["a", "b"], "rows": [[1, 2.5]]}], "notes": ["n"]}
    if subject:
        body["subject"] = subject
    record = {"kind": kind, "command": "autosel bench x", "commit": "abc", "autosel_version": "0.1.0",
              "platform_key": key, "versions": {"torch": "2"}, "date": date, "results": body, "file": f"{date}.json"}
    return {**record, "carried": carried} if carried else record


def test_the_page_shows_the_newest_run_per_platform_and_subject_and_what_never_ran():
    records = [_record("hot_path", "cpu/x86_64/X/2", "2026-01-01"), _record("hot_path", "cpu/x86_64/X/2", "2026-02-01"),
               _record("model_step", Platform.key, "2026-01-01", subject="llama"),
               _record("model_step", Platform.key, "2026-01-02", subject="qwen", carried="from the old page")]
    text = page.render(records)
    assert "2026-02-01.json" in text and "2026-01-01.json](" not in text.split("## A model step")[0]
    assert text.count("### NVIDIA H200, ") == 2 and "carried, not re-measured: from the old page" in text
    assert "| Hot path | never ran | never ran | CPU (2026-01-01), CPU (2026-02-01) |" in text
    assert "| Held-out quality | never ran | never ran | never ran |" in text
    assert "never timed on GPUs | never ran |" in text
    assert "| 1 | 2.500 |" in text


def test_the_status_says_what_never_ran_until_a_result_file_of_that_kind_exists():
    # The status table claimed nothing about the attention ops' held-out proof, which no GPU run had written.
    cpu = [_record("hot_path", "cpu/x86_64/X/2", "2026-01-01")]
    text = page.render(cpu)
    assert "| Paged attention on held-out batches | never ran | never ran | never ran |" in text
    assert "GPUs the result files come from: none." in text
    ran = page.render(cpu + [_record("attention_heldout", Platform.key, "2026-01-02")])
    assert "| Paged attention on held-out batches | NVIDIA H200 (2026-01-02) | never ran | never ran |" in ran
    assert "GPUs the result files come from: NVIDIA H200." in ran


def test_the_repositorys_benchmarks_page_is_what_its_result_files_render(monkeypatch):
    # CI's check, as build_tuning_db.py --check is for the shipped DBs: a figure edited by hand, or a result file
    # added without rendering, fails here.
    monkeypatch.chdir(ROOT)
    result = CliRunner().invoke(main, ["bench", "page", "--check"])
    assert result.exit_code == 0, result.output
    assert result.output == "docs/BENCHMARKS.md matches results/\n"


def test_page_check_fails_on_a_page_that_differs(tmp_path):
    (tmp_path / "results").mkdir()
    (tmp_path / "page.md").write_text("# edited by hand\n")
    result = CliRunner().invoke(main, ["bench", "page", "--check", "--results", str(tmp_path / "results"),
                                       "--out", str(tmp_path / "page.md")])
    assert result.exit_code == 1 and "is not what" in result.output and "run `autosel bench page`" in result.output


def test_bench_hot_path_writes_a_result_file_with_the_command_that_made_it(tmp_path):
    import subprocess
    import sys

    # In a process of its own: the benchmark registers a kernel of its own in the process-wide registry.
    result = subprocess.run([sys.executable, "-m", "autosel", "bench", "hot-path", "--repeats", "2", "--number", "10",
                             "--results", str(tmp_path)], capture_output=True, text=True, cwd=ROOT)
    assert result.returncode == 0, result.stderr
    [record] = results.read_results(tmp_path)
    assert record["command"] == f"autosel bench hot-path --repeats 2 --number 10 --results {tmp_path}"
    cases, added = record["results"]["tables"]
    assert len(cases["rows"]) == 13 and all(len(v) == 2 for v in record["results"]["samples_ns"].values())
    assert [row[0] for row in added["rows"]][0] == "rmsnorm bucket (tokens, hidden)"


def test_import_autosel_bench_imports_no_torch():
    import subprocess
    import sys

    code = "import sys, autosel.bench, autosel.bench.results, autosel.bench.page; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True).stdout
    assert out.strip() == "False"


def _decision(winner, shape_winners, scores):
    from types import SimpleNamespace as NS

    candidates = {b: NS(score=s, shapes=[NS(timing=NS(median_us=s))] * len(shape_winners)) for b, s in scores.items()}
    return NS(winner=winner, per_shape_winners=tuple(shape_winners), margin=0.05, candidate=candidates.get)


def test_stability_counts_identical_decisions_and_the_disagreements_inside_the_margin():
    from types import SimpleNamespace as NS

    from autosel.bench.stability import stability

    first = [NS(op="a", mode="eager", decision=_decision("x", [("s1", "x"), ("s2", "x")], {"x": 10.0, "y": 10.2})),
             NS(op="b", mode="eager", decision=_decision("x", [("s1", "x")], {"x": 10.0, "y": 20.0})),
             NS(op="c", mode="eager", decision=None)]
    second = [NS(op="a", mode="eager", decision=_decision("x", [("s1", "y"), ("s2", "x")], {})),
              NS(op="b", mode="eager", decision=_decision("y", [("s1", "y")], {})),
              NS(op="c", mode="eager", decision=None)]
    counts, notes = stability(first, second)
    assert counts == {"eager": {"decisions": 5, "agree": 2, "inside_margin": 1}}
    assert notes == ["a eager s1: x vs y (inside the margin)", "b eager *: x vs y", "b eager s1: x vs y"]


class FakeProcesses:
    """Stands in for the fresh processes autosel.bench.startup times: this checkout's first get_kernel takes 20 ms
    and imports 6 modules, the baseline's 3.9 s and sympy; every warm-up round takes 100 s, to show it is dropped."""

    def __init__(self, rounds_per_checkout):
        self.calls = {}
        self.per_round = rounds_per_checkout

    def _warm_up(self, key):
        self.calls[key] = self.calls.get(key, 0) + 1
        return self.calls[key] == 1

    def child(self, op, env):
        baseline = env["AUTOSEL_DB"].endswith("baseline.db")
        seconds = 100.0 if self._warm_up((op, baseline)) else (3.9 if baseline else 0.02)
        return {"import_torch_s": 4.0, "import_autosel_s": 0.05, "get_kernel_s": seconds, "winners": ["torch"],
                "imported": ["sympy", *"abcde"] if baseline else list("abcdef")}

    def wall_s(self, argv, env):
        baseline = env["AUTOSEL_DB"].endswith("baseline.db")
        show = argv[-1] == "show"
        if self._warm_up((show, baseline)):
            return 100.0
        return (13.0 if baseline else 5.3) if show else 5.0


def test_bench_startup_writes_its_result_file_and_drops_the_warm_up_round(tmp_path, monkeypatch):
    from autosel.bench import startup

    fake = FakeProcesses(6)
    monkeypatch.setattr(startup, "_child", fake.child)
    monkeypatch.setattr(startup, "_wall_s", fake.wall_s)
    baseline = tmp_path / "other-checkout"
    baseline.mkdir()
    out = tmp_path / "results"
    result = CliRunner().invoke(main, ["bench", "startup", "--op", "gemm.mm", "--rounds", "5", "--baseline",
                                       str(baseline), "--results", str(out)])
    assert result.exit_code == 0, result.output
    [record] = results.read_results(out)
    assert result.output.endswith(f"wrote {out / record['file']}\n")  # after the progress bar on stderr
    assert record["kind"] == "startup" and record["file"].startswith("startup-")
    assert record["command"] == f"autosel bench startup --op gemm.mm --rounds 5 --baseline {baseline} --results {out}"
    body = record["results"]
    assert body["ops"]["gemm.mm"]["first_get_kernel_ms_all"] == [20.0] * 5  # the warm-up's 100 s are not in it
    assert body["ops"]["gemm.mm"]["kind"] == "plain-torch winner" and body["show"]["beyond_import_torch_ms"] == 300.0
    assert body["baseline"]["checkout"] == str(baseline) and body["baseline"]["commit"] is None  # not a git checkout
    assert body["baseline"]["ops"]["gemm.mm"]["heavy_modules_imported"] == ["sympy"]
    assert [t["met"] for t in body["targets"].values()] == [True, True]
    assert sum(fake.calls.values()) == 6 * 2 * 3  # (5 rounds + the warm-up) x 2 checkouts x (op, show, torch)


@pytest.mark.skipif(torch.cuda.is_available(), reason="forces a backend that only a CPU cannot run")
def test_bench_startup_patch_process_resolves_every_op_a_transformers_patch_calls(tmp_path):
    # A real fresh process on the shipped CPU DB: the patch figure is the five ops patch_model resolves, not one.
    from autosel.bench import startup
    from autosel.integrations.transformers import OPS

    env = startup._env(Path(startup.__file__).resolve().parents[2], tmp_path / "user.db")
    taken = startup._child(startup.PATCH, env)
    assert taken["get_kernel_s"] > 0 and set(taken["winners"]) <= {"torch", "torch_compile", "triton"}
    assert "autosel.integrations.transformers" not in taken["imported"]  # autosel's own modules are left out
    env["AUTOSEL_BACKEND"] = f"{list(OPS.values())[-1]}=triton"  # the last op the patch resolves, unusable on CPU
    with pytest.raises(RuntimeError, match=f"forces 'triton' for op '{list(OPS.values())[-1]}'"):
        startup._child(startup.PATCH, env)  # so every op, to the last, is resolved in the patch's process


@pytest.mark.parametrize("args, code, said", [(["--op", "no.such*"], 1, "no op matches --op 'no.such*'"),
                                              (["--rounds", "4"], 2, "4 is not in the range x>=5")])
def test_bench_startup_refuses_before_timing_anything(tmp_path, monkeypatch, args, code, said):
    from autosel.bench import startup

    monkeypatch.setattr(startup, "_child", lambda op, env: pytest.fail("timed something"))
    result = CliRunner().invoke(main, ["bench", "startup", *args, "--results", str(tmp_path)])
    assert result.exit_code == code and said in result.output
    assert list(tmp_path.iterdir()) == []


def _startup_samples(name, get_kernel_s, winners, imported):
    child = {"import_torch_s": 4.0, "import_autosel_s": 0.05, "get_kernel_s": get_kernel_s, "winners": winners,
             "imported": imported}
    return {(name, "gemm.mm"): [child] * 5, (name, "show"): [5.3] * 5, (name, "import_torch"): [5.0] * 5}


def test_the_page_renders_a_startup_record_with_its_targets_and_load():
    from autosel.bench import startup

    samples = {**_startup_samples("this", 0.2147, ["torch"], list("abcdef")),
               **_startup_samples("baseline", 3.8916, ["torch_compile"], ["sympy", "triton", "x"])}
    body = startup.summarize(samples, ops=["gemm.mm"], rounds=5, baseline={"checkout": "/co", "commit": "abc"})
    body.update(load_average=[10.99, 9.5, 8.0], cpus=2)
    body["tables"], body["notes"] = startup.tables(body), startup.notes(body)
    record = {**_record("startup", "cpu/x86_64/X/2", "2026-12-05"), "results": body}
    text = page.render([record])
    assert "| Cold start | never ran | never ran | CPU (2026-12-05) |" in text
    assert "| gemm.mm | plain-torch winner (torch) | 214.7 | 6 | 3,891.6 | 3 |" in text
    assert "| this checkout | 5,300.0 | 5,000.0 | 300.0 |" in text
    assert "| plain-torch first get_kernel <= 50 ms beyond import torch; import autosel | 214.7 | missed |" in text
    assert "| autosel show <= 1 s beyond import torch | 300.0 | met |" in text
    assert "- load average (1-minute first): [10.99, 9.5, 8.0]; 2 CPUs" in text
    assert "- baseline: /co at commit abc, timed in the same rounds" in text


def test_startup_targets_say_so_where_no_op_has_a_plain_torch_winner():
    from autosel.bench import startup

    body = startup.summarize(_startup_samples("this", 17.2, ["torch_compile"], ["sympy"]), ops=["gemm.mm"], rounds=5)
    assert body["ops"]["gemm.mm"]["kind"] == "torch.compile winner"
    target = "plain-torch first get_kernel <= 50 ms beyond import torch; import autosel"
    assert body["targets"][target] == "no op with plain-torch winners"
    assert [target, "no figure", "n/a"] in startup.tables(body)[2]["rows"]


def test_a_triton_winner_is_not_counted_as_a_plain_torch_one():
    # On the H200 the Triton winners' 3 s first get_kernel (triton and inductor imported) was reported as plain torch.
    from autosel.bench import startup

    body = startup.summarize(_startup_samples("this", 3.2, ["triton"], ["triton"]), ops=["gemm.mm"], rounds=5)
    assert body["ops"]["gemm.mm"]["kind"] == "Triton winner"
    assert body["targets"]["plain-torch first get_kernel <= 50 ms beyond import torch; import autosel"] == (
        "no op with plain-torch winners")
    assert [startup.winner_kind(w) for w in (["torch"], ["torch", "triton"], ["flashinfer"], [])] == [
        "plain-torch winner", "Triton winner", "vendor winner", "plain-torch winner"]


def test_a_result_file_takes_the_commit_its_caller_names(monkeypatch, tmp_path):
    # A tree copied to the GPU machine carried a stale .git: its result files named that commit, not the tree's.
    monkeypatch.setenv("AUTOSEL_COMMIT", "f82d984")
    assert results.source_commit() == "f82d984"
    assert results.source_commit(tmp_path) is None  # another checkout is asked itself; this folder is none
    monkeypatch.delenv("AUTOSEL_COMMIT")
    assert results.source_commit() != "f82d984"



def test_a_stability_run_of_some_ops_stands_beside_the_run_of_every_op(tmp_path):
    # The attention ops' two tunes replaced the every-op stability figures on the page: neither run had a subject.
    from autosel.bench import stability

    narrowed = stability.run(ops=("gemm.mm",), budget_s=0.2, keep=tmp_path)
    assert narrowed["subject"] == "gemm.mm" and narrowed["tune_s"][0] > 0
    records = [_record("tuning", Platform.key, "2026-01-01"), _record("tuning", Platform.key, "2026-01-02", "gemm.mm")]
    assert len(results.current(records)) == 2
