"""The image workflow of examples/image/Dockerfile, step by step, without docker: a fresh virtual environment,
autosel installed from a copy of this checkout (not editable), a DB added and named by AUTOSEL_DB_PATH,
`autosel check` as the build's gate, and selection with AUTOSEL_TUNE=off that times nothing."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from autosel.db import TuningDB
from autosel.db.tools import connect, migrate, read_decisions

ROOT = Path(__file__).resolve().parent.parent
DOCKERFILE = ROOT / "examples" / "image" / "Dockerfile"
CPU_TEXT = next(ROOT.glob("tuning_db/cpu-*.jsonl"))
OPS = "layernorm.rmsnorm,layernorm.fused_add_rmsnorm,activation.silu_and_mul,activation.gelu_and_mul,embeddings.rope,gemm.mm"

pytestmark = pytest.mark.image


def _why_no_wheel_can_be_built() -> str | None:
    """Why this interpreter cannot build autosel's wheel without the network, or None. The venv below sees this
    interpreter's packages, so this is the interpreter to ask (the guard used to ask this one while the venv saw
    the base interpreter's)."""
    import importlib.util

    if importlib.util.find_spec("setuptools") is None:
        return "setuptools is not installed, and installing autosel without the network needs it"
    # setuptools builds wheels itself from 70.1 on; before, only with the `wheel` package.
    if importlib.util.find_spec("setuptools.command.bdist_wheel") is None and importlib.util.find_spec("wheel") is None:
        return ("setuptools is older than 70.1 and `wheel` is not installed, so no wheel can be built without the "
                "network")
    return None


def _site_packages_of_this_interpreter(venv: Path) -> None:
    """Make `venv` see this interpreter's packages (torch, pip, setuptools), as --system-site-packages would if
    this interpreter were no venv itself: from inside a venv that option shows the base interpreter's packages,
    where the README's fresh venv found a setuptools without bdist_wheel (4 errors)."""
    import site

    (target,) = (venv / "lib").glob("python*/site-packages")
    (target / "outer_site_packages.pth").write_text("".join(f"{folder}\n" for folder in site.getsitepackages()))


@pytest.fixture(scope="module")
def venv(tmp_path_factory):
    """A fresh venv (reusing the installed torch) with autosel installed from a copy of the checkout."""
    if (why := _why_no_wheel_can_be_built()) is not None:
        pytest.skip(why)
    where = tmp_path_factory.mktemp("image")
    source = where / "src"
    for name in ("autosel", "tuning_db"):
        shutil.copytree(ROOT / name, source / name, ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, source / name)
    # --without-pip: the venv's own bundled setuptools (65 on Python 3.11) cannot build a wheel without `wheel`;
    # this interpreter's pip and setuptools, seen through the .pth file, install into the venv all the same.
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(where / "venv")], check=True)
    _site_packages_of_this_interpreter(where / "venv")
    python = where / "venv" / "bin" / "python"
    subprocess.run([str(python), "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", "--no-index",
                    str(source)], check=True, cwd=where, env=_env(where))
    shutil.rmtree(source)  # what runs from here on is the installed copy, nothing of a checkout
    return where


def _env(where: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("AUTOSEL_") and k != "PYTHONPATH"}
    return {**env, "AUTOSEL_DB": str(where / "user" / "tuning.db"), **extra}


def _run(where: Path, *args: str, **extra: str) -> subprocess.CompletedProcess:
    return subprocess.run([str(where / "venv" / "bin" / args[0]), *args[1:]], capture_output=True, text=True,
                          cwd=where, env=_env(where, **extra), timeout=300)


def _this_machine_is_the_shipped_cpu_type(where: Path) -> None:
    probe = _run(where, "python", "-c", "from autosel.platforms import current_platform; print(current_platform().key)")
    key = read_decisions(CPU_TEXT)[0].platform_key
    if probe.stdout.strip() != key:
        pytest.skip(f"the shipped CPU DB is for {key} (CI's machine type); this machine is {probe.stdout.strip()}")


def test_the_fixtures_venv_sees_this_interpreters_setuptools_not_the_base_interpreters(tmp_path):
    # From inside the README's fresh venv, --system-site-packages showed the base interpreter's setuptools (65, no
    # bdist_wheel), while the skip guard asked the outer venv: 4 errors in `python -m pytest -q`.
    import setuptools

    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(tmp_path / "venv")], check=True)
    _site_packages_of_this_interpreter(tmp_path / "venv")
    seen = subprocess.run([str(tmp_path / "venv" / "bin" / "python"), "-c", "import setuptools; print("
                           "setuptools.__version__, setuptools.__file__)"], capture_output=True, text=True, check=True,
                          env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"})
    assert seen.stdout.split() == [setuptools.__version__, setuptools.__file__]


def test_the_dockerfile_has_the_steps_this_test_runs():
    text = DOCKERFILE.read_text(encoding="utf-8")
    for step in ("pip install --no-cache-dir /src/autosel", "ENV AUTOSEL_DB_PATH=/opt/tuning", "AUTOSEL_TUNE=off",
                 'RUN autosel check --require "${REQUIRE}" --platform "${TARGET_PLATFORM}" --buckets',
                 "ARG TUNING_DB=tuning_db/nvidia-h200-sm_90.db"):
        assert step in text
    assert (ROOT / "tuning_db" / "nvidia-h200-sm_90.db").exists()  # the DB the Dockerfile adds by default


def test_installed_autosel_reads_its_shipped_dbs_as_the_last_layer(venv):
    where = _run(venv, "python", "-c", "import autosel, autosel.db as d; print(autosel.__file__); print(d.package_folder())")
    module, folder = where.stdout.split()
    assert Path(module).is_relative_to(venv / "venv") and Path(folder).is_relative_to(venv / "venv")
    assert sorted(p.name for p in Path(folder).glob("*.*") if p.suffix in (".db", ".jsonl")) == sorted(
        p.name for p in (ROOT / "tuning_db").glob("*.*") if p.suffix in (".db", ".jsonl"))
    doctor = json.loads(_run(venv, "autosel", "doctor", "--json").stdout)
    assert [layer["path"] for layer in doctor["layers"] if layer["kind"] == "shipped"] == [
        str(Path(folder) / p.name) for p in sorted(ROOT.glob("tuning_db/*.db"))]


def test_check_passes_with_the_shipped_cpu_db_and_selection_times_nothing(venv):
    _this_machine_is_the_shipped_cpu_type(venv)
    tuning = venv / "opt" / "tuning"
    tuning.mkdir(parents=True)
    shutil.copy(CPU_TEXT.with_suffix(".db"), tuning)
    check = _run(venv, "autosel", "check", "--require", OPS, "--buckets", "--json",
                 AUTOSEL_DB_PATH=str(tuning), AUTOSEL_TUNE="off")
    assert check.returncode == 0, check.stdout + check.stderr
    report = json.loads(check.stdout)
    assert report["ok"] and {c["layer"] for c in report["checked"]} == {f"shipped {tuning / CPU_TEXT.stem}.db"}
    winners = {d.op: d.winner for d in read_decisions(CPU_TEXT) if d.bucket == "*"}
    select = ("import json, autosel; print(json.dumps({op: autosel.select_kernel(op).backend.value for op in "
              f"{sorted(winners)!r}}}))")
    chosen = _run(venv, "python", "-c", select, AUTOSEL_DB_PATH=str(tuning), AUTOSEL_TUNE="off")
    assert chosen.returncode == 0, chosen.stderr
    assert json.loads(chosen.stdout) == winners and "timed now" not in chosen.stderr
    assert not (venv / "user" / "tuning.db").exists() or not TuningDB.open(
        venv / "user" / "tuning.db", include_package=False, read_only=True).decisions()


def test_check_fails_for_an_empty_db_and_a_target_no_layer_covers(venv):
    empty = venv / "empty" / "tuning.db"
    empty.parent.mkdir()
    conn = connect(str(empty))  # an autosel DB with the schema and no rows, as an export of nothing would be
    migrate(conn)
    conn.close()
    target = "cuda/sm_100/NVIDIA_B200/148"  # no shipped DB holds this GPU: only the added DB could
    check = _run(venv, "autosel", "check", "--require", OPS, "--platform", target, AUTOSEL_DB_PATH=str(empty))
    warning, error = check.stderr.splitlines()
    assert check.returncode == 1 and warning == (f"Warning: shipped tuning DB {empty}: no decisions in it. Ship the DB "
                                                 "`autosel tune --db` wrote once every process writing it has "
                                                 "exited, or a file made by `autosel export --format sqlite`.")
    assert error.startswith(f"Error: 12 of 12 required (op, mode) pairs have no usable decision for {target}: "
                            f"layernorm.rmsnorm (eager): no usable eager decision for {target} (stored for: ")


def test_installed_autosel_carries_and_builds_its_triton_launcher(venv):
    # triton_launch.c is package data: without it an installed autosel launched every Triton call through Triton.
    pytest.importorskip("triton")
    probe = _run(venv, "python", "-c", "from autosel.ops import triton_launch as t; print(t.direct_module() is not None)",
                 TRITON_CACHE_DIR=str(venv / "triton-cache"))
    assert probe.stdout.strip() == "True", probe.stderr
