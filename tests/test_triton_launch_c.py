"""Tests for triton_launch.c's launches of autosel's Triton kernels from their tensors (norm, act_and_mul, rope) on
the CPU: built to take CPU tensors and to call a stand-in driver that records each launch (tests/fake_libcuda.c), the
C path must launch exactly what triton_kernels' Python path would launch, with the same kernel, grid, block and
arguments, and leave every other call to that path.

The real launches need a GPU: tests/gpu/test_triton_launch_gpu.py."""

from __future__ import annotations

import ctypes
import importlib.util
import math
import os
import re
import shutil
import struct
import subprocess
import sysconfig
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import numpy
import pytest
import torch

from autosel.ops import triton_kernels as tk
from autosel.ops import triton_launch

if not hasattr(torch.Tensor, "__dlpack_c_exchange_api__"):
    pytest.skip("this torch has no DLPack C exchange API, so triton_kernels never takes the C path",
                allow_module_level=True)

BF16, F16, F32 = torch.bfloat16, torch.float16, torch.float32
EPS = 1e-6
LAUNCHERS = ("_launch_rmsnorm_kernel", "_launch_act_and_mul", "_launch_rope")
N_NULLS = 2  # Triton's scratch pointers after the arguments (two from Triton 3.5), passed as nulls
_MASKS = {"p": 2**64 - 1, "l": 2**64 - 1, "i": 2**32 - 1, "f": 2**32 - 1, "b": 2**8 - 1}  # the bytes each passes


class _StandInKernel(ctypes.Structure):
    """fake_libcuda.c's Kernel: a kept entry's function handle is this struct's address."""

    _fields_ = [("n_params", ctypes.c_int)]


def _compile(compiler: str, source: Path, output: Path, *flags: str) -> None:
    """A shared library (or Python extension, given Python's include dir) from one C file."""
    subprocess.run([compiler, "-shared", "-fPIC", "-O1", *flags, str(source), "-o", str(output)], check=True)


@pytest.fixture(scope="module")
def driver(tmp_path_factory):
    """The stand-in libcuda, read through ctypes, and triton_launch.c built to launch CPU tensors through it."""
    compiler = os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")
    if compiler is None:
        pytest.skip("no C compiler to build triton_launch.c and the stand-in driver with")
    folder = tmp_path_factory.mktemp("triton_launch_c")
    library = folder / "libfake_cuda.so"
    _compile(compiler, Path(__file__).with_name("fake_libcuda.c"), library)
    source = folder / "triton_launch.c"
    source.write_text(f'#define AUTOSEL_DL_DEVICE 1\n#define AUTOSEL_LIBCUDA "{library}"\n'
                      + Path(triton_launch.__file__).with_name("triton_launch.c").read_text())
    built = folder / ("autosel_triton_launch" + sysconfig.get_config_var("EXT_SUFFIX"))
    _compile(compiler, source, built, f"-I{sysconfig.get_paths()['include']}")
    spec = importlib.util.spec_from_file_location("autosel_triton_launch", built)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    if not module.reads_dlpack():
        pytest.skip("this torch's DLPack C exchange API is not the version triton_launch.c reads")
    return SimpleNamespace(module=module, lib=ctypes.CDLL(str(library)))  # the library the module opens


def _kind(arg) -> str:
    """How Triton's signature passes an argument, in triton_launch.c's letters ('-': an int equal to 1, a constant)."""
    if isinstance(arg, torch.Tensor):
        return "p"
    if type(arg) is bool:
        return "b"
    if type(arg) is float:
        return "f"
    if type(arg) is int:
        return "-" if arg == 1 else "i" if -2**31 <= arg < 2**31 else "l"
    raise TypeError(f"no kernel argument of type {type(arg).__name__}")


def _param(kind: str, raw: int, out: torch.Tensor | None):
    """A parameter as compared: the bytes its kind passes; an address inside the op's fresh output as an offset into
    it (each run allocates its own), any other address as is (both runs get the same input tensors)."""
    raw &= _MASKS[kind]
    if kind == "p" and out is not None and out.data_ptr() <= raw < out.data_ptr() + out.nbytes:
        return ("out", raw - out.data_ptr())
    return raw


def _raw(arg) -> int:
    """An argument's bits as the driver gets them: a tensor's address, a float's fp32 bits, an int's value."""
    if isinstance(arg, torch.Tensor):
        return arg.data_ptr()
    return struct.unpack("<I", struct.pack("<f", arg))[0] if type(arg) is float else int(arg)


@dataclass(frozen=True)
class _Launch:
    """A kernel launch as the driver gets it."""

    kernel: int
    grid: tuple
    threads: int
    params: tuple


class _Recorder:
    """Stands in for one of triton_kernels' FastLaunch objects: records each call and keeps a stand-in kernel under
    the key FastLaunch would keep the compiled one under, in the entry format triton_launch.c launches from."""

    def __init__(self, module):
        self.module, self.kept, self.calls = module, {}, []

    def __call__(self, grid, args, constexprs, num_warps):
        self.calls.append((grid, args, constexprs, num_warps))
        key = self.module.key((0, num_warps, constexprs), args)  # device 0: the stand-in driver's current device
        if key not in self.kept:
            kinds = "".join(_kind(a) for a in args)
            kernel = _StandInKernel(len(kinds.replace("-", "")) + N_NULLS)
            self.kept[key] = (ctypes.addressof(kernel), 32 * num_warps, 0, kinds.encode(), N_NULLS, kernel)

    def launch_of(self, call, out) -> _Launch:
        """The launch FastLaunch makes for a recorded call once its kernel is kept."""
        grid, args, constexprs, num_warps = call
        kernel, threads, _, kinds, _, _ = self.kept[self.module.key((0, num_warps, constexprs), args)]
        params = [_param(k, _raw(a), out) for k, a in zip(kinds.decode(), args) if k != "-"]
        return _Launch(kernel, (*grid, 1, 1, 1)[:3], threads, (*params, *[0] * N_NULLS))


@dataclass(frozen=True)
class _Outcome:
    """What one call of an op did."""

    error: tuple | None  # (type, message) of what it raised
    python_launch: _Launch | None  # what FastLaunch would launch for the Python path's call, where it made one
    c_launch: _Launch | None  # what the stand-in driver got from the C path

    def __str__(self) -> str:
        if self.error is not None:
            return f"raised {self.error[0].__name__}: {self.error[1]}"
        launch = self.python_launch or self.c_launch
        return f"launched {launch}" if launch else "launched nothing"


def _declines(*args) -> bool:
    """A C path's answer for a call it leaves to the Python path."""
    return False


class _Paths:
    """Runs a triton_kernels call through its Python path alone, or through the stand-in-built C path first; each run
    records what was launched and how. For the first, _DIRECT declines every call, but is there: the Python path
    records its plans (_remember) only where there is a C path to read them."""

    def __init__(self, monkeypatch, driver):
        self.monkeypatch, self.driver = monkeypatch, driver
        self.recorders = [_Recorder(driver.module) for _ in LAUNCHERS]
        for name, recorder in zip(LAUNCHERS, self.recorders):
            monkeypatch.setattr(tk, name, recorder)
        for name in ("_NORM_PLANS", "_ACT_PLANS", "_ROPE_PLANS"):
            monkeypatch.setattr(tk, name, {})
        self.no_c_path = SimpleNamespace(norm=_declines, act_and_mul=_declines, rope=_declines)

    def python(self, op, *args) -> _Outcome:
        self.monkeypatch.setattr(tk, "_DIRECT", self.no_c_path)
        return self._run(op, args)

    def c(self, op, *args) -> _Outcome:
        self.monkeypatch.setattr(tk, "_DIRECT", self.driver.module)
        return self._run(op, args)

    def _run(self, op, args) -> _Outcome:
        counter = ctypes.c_int.in_dll(self.driver.lib, "launches")
        launches_before = counter.value
        for recorder in self.recorders:
            recorder.calls.clear()
        try:
            result, error = op(*args), None
        except Exception as exc:
            result, error = None, (type(exc), str(exc))
        out = result if isinstance(result, torch.Tensor) else None
        calls = [(recorder, call) for recorder in self.recorders for call in recorder.calls]
        assert len(calls) <= 1 and counter.value - launches_before <= 1, "one call of an op launches one kernel"
        return _Outcome(error, calls[0][0].launch_of(calls[0][1], out) if calls else None,
                        self._driver_launch(out) if counter.value > launches_before else None)

    def _driver_launch(self, out) -> _Launch:
        lib = self.driver.lib
        kernel = ctypes.c_uint64.in_dll(lib, "kernel").value
        kinds = next(entry[3].decode() for recorder in self.recorders for entry in recorder.kept.values()
                     if entry[0] == kernel).replace("-", "") + "p" * N_NULLS
        raw = (ctypes.c_uint64 * len(kinds)).in_dll(lib, "params")
        return _Launch(kernel, tuple((ctypes.c_uint * 3).in_dll(lib, "grid")),
                       (ctypes.c_uint * 3).in_dll(lib, "block")[0],
                       tuple(_param(k, value, out) for k, value in zip(kinds, raw)))


@pytest.fixture
def paths(monkeypatch, driver):
    return _Paths(monkeypatch, driver)


# --------------------------------------------------------------------------------------------------
# The cases: an op, its arguments, what must happen, and a valid call run first where the case alone would not get
# the C path a plan and a kept kernel (then C declining would prove nothing).

C = "C launches it"
PYTHON = "C declines; the Python path launches it (on a copy, or with arguments C does not key) or returns"


@dataclass(frozen=True)
class Raises:
    """C declines; the Python path raises this."""

    error: type
    match: str = ""


RMS, FUSED, SILU, GELU, ROPE = tk.rmsnorm, tk.fused_add_rmsnorm, tk.silu_and_mul, tk.gelu_and_mul, tk.rope


def _t(*shape, dtype=BF16) -> torch.Tensor:
    return torch.randn(shape).to(dtype)


def _misaligned(*shape) -> torch.Tensor:
    """Contiguous, starting 2 bytes past a 16-byte boundary (torch's CPU allocator aligns to 64)."""
    return _t(math.prod(shape) + 1)[1:].view(shape)


def _weight(width) -> torch.nn.Parameter:
    return torch.nn.Parameter(_t(width), requires_grad=True)


def _positions(n, dtype=torch.int64) -> torch.Tensor:
    return torch.randint(0, 32, (n,), dtype=dtype)


def _rope(q, k, *, head=64, positions=None, cache=None, neox=True) -> tuple:
    """rope's arguments: positions one per row of q by default, a 32-position fp32 cache of rotary_dim 64."""
    positions = _positions(q.shape[0]) if positions is None else positions
    return positions, q, k, head, torch.randn(32, 64) if cache is None else cache, neox


def _qkv(tokens=5) -> tuple:
    """query (4 heads) and key (1 head) sliced out of one [tokens, 6 heads] buffer, as an attention layer's qkv."""
    qkv = _t(tokens, 6 * 64)
    return qkv[:, :256], qkv[:, 256:320]


def _valid_rmsnorm():  # the primes: valid calls near the cases that follow them
    RMS(_t(4, 64), _t(64), EPS)


def _valid_fused():
    FUSED(_t(4, 64), _t(4, 64), _t(64), EPS)


def _valid_rope():
    ROPE(*_rope(*_qkv()))


def _case(case_id, op, make, expect=C, prime=None):
    """op(*make()) must do `expect`, after prime() (a valid call) where given."""
    return pytest.param(op, make, expect, prime, id=case_id)


CASES = [
    _case("rmsnorm-2d", RMS, lambda: (_t(4, 64), _t(64), EPS)),
    _case("rmsnorm-3d", RMS, lambda: (_t(2, 3, 64), _t(64), EPS)),
    _case("rmsnorm-1d", RMS, lambda: (_t(64), _t(64), EPS)),
    _case("rmsnorm-size-1-dims", RMS, lambda: (_t(5, 1, 96)[..., :64], _t(64), EPS)),
    # Rows further apart than their width: contiguous cases alone passed with C's row stride taken as the width.
    _case("rmsnorm-rows-of-wider-buffer", RMS, lambda: (_t(4, 96)[:, :64], _t(64), EPS)),
    _case("rmsnorm-one-row-of-wider-buffer", RMS, lambda: (_t(4, 96)[1:2, :64], _t(64), EPS)),
    _case("rmsnorm-odd-width", RMS, lambda: (_t(4, 65), _t(65), EPS)),
    _case("rmsnorm-misaligned", RMS, lambda: (_misaligned(4, 64), _t(64), EPS)),
    _case("rmsnorm-fp32-x", RMS, lambda: (_t(4, 64, dtype=F32), _t(64), EPS)),
    # float16 has plans of its own: C's plan key tells it from bfloat16 as the Python path's does
    _case("rmsnorm-fp16", RMS, lambda: (_t(4, 64, dtype=F16), _t(64, dtype=F16), EPS)),
    # dense in another order: out, allocated in x's layout, is not rows a width apart, and C declines it
    _case("rmsnorm-dense-transposed", RMS, lambda: (_t(3, 2, 64).transpose(0, 1), _t(64), EPS), PYTHON),
    _case("rmsnorm-weight-parameter", RMS, lambda: (_t(4, 64), _weight(64), EPS)),
    _case("rmsnorm-expanded-rows", RMS, lambda: (_t(1, 64).expand(4, 64), _t(64), EPS)),  # read only: no race
    _case("rmsnorm-weight-strided", RMS, lambda: (_t(4, 64), _t(128)[::2], EPS), PYTHON),
    _case("rmsnorm-column-stride", RMS, lambda: (_t(4, 128)[:, ::2], _t(64), EPS), PYTHON),
    # C let width-1 tensors through whatever their last stride, where Python copies them or (in place) raises.
    _case("rmsnorm-width-1-column-stride", RMS, lambda: (_t(1, 4).t(), _t(1), EPS), PYTHON,
          prime=lambda: RMS(_t(4, 1), _t(1), EPS)),
    _case("rmsnorm-weight-0d", RMS, lambda: (_t(4, 64), _t(64)[0], EPS), Raises(ValueError, "1-D"),
          prime=_valid_rmsnorm),
    _case("rmsnorm-eps-int", RMS, lambda: (_t(4, 64), _t(64), 0), PYTHON, prime=_valid_rmsnorm),
    # a float subclass (a model config's numpy eps): both paths read it as float(eps); FastLaunch refused it before
    _case("rmsnorm-eps-numpy-float", RMS, lambda: (_t(4, 64), _t(64), numpy.float64(EPS)), C),
    _case("rmsnorm-0-rows", RMS, lambda: (_t(0, 64), _t(64), EPS), PYTHON),

    _case("fused-2d", FUSED, lambda: (_t(4, 64), _t(4, 64), _t(64), EPS)),
    _case("fused-3d", FUSED, lambda: (_t(2, 3, 64), _t(2, 3, 64), _t(64), EPS)),
    _case("fused-1d", FUSED, lambda: (_t(64), _t(64), _t(64), EPS)),
    _case("fused-size-1-dims", FUSED, lambda: (_t(5, 1, 96)[..., :64], _t(5, 1, 64), _t(64), EPS)),
    _case("fused-rows-of-wider-buffers", FUSED, lambda: (_t(4, 96)[:, :64], _t(4, 80)[:, :64], _t(64), EPS)),
    _case("fused-odd-width", FUSED, lambda: (_t(4, 65), _t(4, 65), _t(65), EPS)),
    _case("fused-misaligned", FUSED, lambda: (_misaligned(4, 64), _t(4, 64), _t(64), EPS)),
    _case("fused-fp16", FUSED, lambda: (_t(4, 64, dtype=F16), _t(4, 64, dtype=F16), _t(64, dtype=F16), EPS)),
    _case("fused-fp32-x-bf16-residual", FUSED, lambda: (_t(4, 64, dtype=F32), _t(4, 64), _t(64), EPS)),
    _case("fused-weight-parameter", FUSED, lambda: (_t(4, 64), _t(4, 64), _weight(64), EPS)),
    _case("fused-expanded-x", FUSED, lambda: (_t(1, 64).expand(4, 64), _t(4, 64), _t(64), EPS),
          Raises(ValueError, "overlap"), prime=_valid_fused),
    _case("fused-expanded-residual", FUSED, lambda: (_t(4, 64), _t(1, 64).expand(4, 64), _t(64), EPS),
          Raises(ValueError, "overlap"), prime=_valid_fused),
    _case("fused-column-stride", FUSED, lambda: (_t(4, 128)[:, ::2], _t(4, 64), _t(64), EPS),
          Raises(ValueError, "cannot be viewed"), prime=_valid_fused),
    _case("fused-shape-mismatch", FUSED, lambda: (_t(4, 64), _t(1, 64), _t(64), EPS), Raises(ValueError, "shape"),
          prime=_valid_fused),
    _case("fused-weight-0d", FUSED, lambda: (_t(4, 64), _t(4, 64), _t(64)[0], EPS), Raises(ValueError, "1-D"),
          prime=_valid_fused),
    # C took a None residual for rmsnorm's and launched the plain norm into x; fused_add_rmsnorm needs a residual.
    _case("fused-residual-none", FUSED, lambda: (_t(4, 64), None, _t(64), EPS), Raises(ValueError, "residual"),
          prime=_valid_rmsnorm),
    _case("fused-width-1-column-stride", FUSED, lambda: (_t(1, 4).t(), _t(4, 1), _t(1), EPS),
          Raises(ValueError, "cannot be viewed"), prime=lambda: FUSED(_t(4, 1), _t(4, 1), _t(1), EPS)),
    _case("fused-width-1-3d-last-stride", FUSED,
          lambda: (_t(40).as_strided((2, 3, 1), (3, 1, 7)), _t(2, 3, 1), _t(1), EPS),
          Raises(ValueError, "cannot be viewed"), prime=lambda: FUSED(_t(2, 3, 1), _t(2, 3, 1), _t(1), EPS)),
    _case("fused-eps-int", FUSED, lambda: (_t(4, 64), _t(4, 64), _t(64), 0), PYTHON,
          prime=_valid_fused),
    _case("fused-0-rows", FUSED, lambda: (_t(0, 64), _t(0, 64), _t(64), EPS), PYTHON),

    _case("silu-2d", SILU, lambda: (_t(4, 128),)),
    _case("gelu-2d", GELU, lambda: (_t(4, 128),)),
    _case("silu-programs-across-rows", SILU, lambda: (_t(515, 272),)),  # 70040 elements: 69 programs, the last of 408
    _case("gelu-programs-across-rows-3d", GELU, lambda: (_t(2, 300, 128),)),
    # 2^31 + 12288 output elements: the count passes as int64 and the plan takes int64 offsets (WIDE); x is one row
    # expanded, so nothing but the output (never written by the stand-in driver) is allocated
    _case("silu-past-int32", SILU, lambda: (_t(1, 8192).expand(2**31 // 4096 + 3, 8192),)),
    _case("silu-3d", SILU, lambda: (_t(2, 3, 128),)),
    _case("silu-1d", SILU, lambda: (_t(128),)),
    _case("silu-size-1-dims", SILU, lambda: (_t(5, 1, 192)[..., :128],)),
    _case("silu-rows-of-wider-buffer", SILU, lambda: (_t(4, 192)[:, :128],)),
    _case("gelu-rows-of-wider-buffer", GELU, lambda: (_t(4, 192)[:, :128],)),
    _case("silu-odd-half-width", SILU, lambda: (_t(4, 66),)),
    _case("silu-misaligned", SILU, lambda: (_misaligned(4, 128),)),
    _case("silu-fp32", SILU, lambda: (_t(4, 128, dtype=F32),)),
    _case("silu-expanded-rows", SILU, lambda: (_t(1, 128).expand(4, 128),)),  # read only: no race
    _case("silu-column-stride", SILU, lambda: (_t(4, 256)[:, ::2],), PYTHON),
    _case("silu-odd-width", SILU, lambda: (_t(4, 127),), Raises(ValueError, "even"), prime=lambda: SILU(_t(4, 128))),
    _case("silu-0-rows", SILU, lambda: (_t(0, 128),), PYTHON),

    _case("rope-2d", ROPE, lambda: _rope(_t(5, 256), _t(5, 64))),
    _case("rope-3d", ROPE, lambda: _rope(_t(5, 4, 64), _t(5, 1, 64))),
    _case("rope-key-in-blocks-of-its-own", ROPE, lambda: _rope(_t(5, 256), _t(5, 256))),  # 4 key heads fill one
    _case("rope-qkv-slices", ROPE, lambda: _rope(*_qkv())),
    _case("rope-qkv-slices-not-neox", ROPE, lambda: _rope(*_qkv(), neox=False)),
    _case("rope-int32-positions", ROPE, lambda: _rope(*_qkv(), positions=_positions(5, torch.int32))),
    _case("rope-rotary-dim-below-head-size", ROPE, lambda: _rope(*_qkv(), cache=torch.randn(32, 32))),
    _case("rope-one-token-of-wider-buffers", ROPE, lambda: _rope(_t(3, 512)[1:2, :256], _t(3, 512)[2:3, :64])),
    _case("rope-odd-head-size", ROPE, lambda: _rope(_t(5, 2 * 65), _t(5, 65), head=65)),
    _case("rope-misaligned", ROPE, lambda: _rope(_misaligned(5, 256), _t(5, 64))),
    _case("rope-float-positions", ROPE, lambda: _rope(*_qkv(), positions=torch.rand(5) * 32),
          Raises(ValueError, "int64 or int32"), prime=_valid_rope),
    _case("rope-is-neox-int", ROPE, lambda: _rope(*_qkv(), neox=1), PYTHON, prime=_valid_rope),
    # Python took a [1, 32, 64] cache's last dim as rotary_dim and its first as the number of positions.
    _case("rope-cache-3d", ROPE, lambda: _rope(*_qkv(), cache=torch.randn(1, 32, 64)),
          Raises(ValueError, "cos_sin_cache"), prime=_valid_rope),
    _case("rope-cache-rows-of-wider-buffer", ROPE, lambda: _rope(*_qkv(), cache=torch.randn(32, 128)[:, :64])),
    _case("rope-positions-strided", ROPE, lambda: _rope(*_qkv(), positions=_positions(10)[::2]), PYTHON),
    _case("rope-cache-column-stride", ROPE, lambda: _rope(*_qkv(), cache=torch.randn(32, 128)[:, ::2]), PYTHON),
    _case("rope-expanded-query", ROPE, lambda: _rope(_t(1, 256).expand(5, 256), _t(5, 64)),
          Raises(ValueError, "overlap"), prime=_valid_rope),
    _case("rope-tokens-mismatch", ROPE, lambda: _rope(_t(4, 256), _t(5, 64), positions=_positions(5)),
          Raises(ValueError, "cannot be viewed"), prime=_valid_rope),
    _case("rope-width-1-column-stride", ROPE, lambda: _rope(_t(1, 4).t(), _t(4, 1), head=1, cache=torch.randn(32, 0)),
          Raises(ValueError, "cannot be viewed"),
          prime=lambda: ROPE(*_rope(_t(4, 1), _t(4, 1), head=1, cache=torch.randn(32, 0)))),
    _case("rope-0-tokens", ROPE, lambda: _rope(_t(0, 256), _t(0, 64)), PYTHON),
]


def _check(paths, op, args, expect) -> None:
    """Runs op(*args) on the Python path, then on the C path, and checks the C path against `expect`."""
    python, c = paths.python(op, *args), paths.c(op, *args)
    if expect == C:
        assert python.error is None and python.python_launch is not None, "the case's Python path launches"
        assert c.python_launch is None and c.error is None, "the C path launched it, not the Python path"
        assert c.c_launch == python.python_launch
        return
    assert c.c_launch is None, f"C launched {c.c_launch}; the Python path {python}"
    assert c.error == python.error and (c.python_launch is None) == (python.python_launch is None), f"{c}; {python}"
    if isinstance(expect, Raises):
        assert python.error is not None and issubclass(python.error[0], expect.error), f"the Python path {python}"
        assert re.search(expect.match, python.error[1]), f"the Python path {python}"
    else:
        assert python.error is None, f"the Python path {python}"


@pytest.mark.parametrize("op, make, expect, prime", CASES)
def test_the_c_path_launches_what_the_python_path_would_launch_identically(paths, op, make, expect, prime):
    if prime is not None:
        assert paths.python(prime).python_launch is not None, "the prime call launches"
    _check(paths, op, make(), expect)


@pytest.fixture
def two_pass_plans(monkeypatch):
    """Norm plans that reduce any row over 32 bf16 elements in chunks of 16; plans are cached per shape, so the cache
    is cleared before and after."""
    monkeypatch.setattr(tk, "_MAX_ROW_BYTES", 64)
    monkeypatch.setattr(tk, "_CHUNK_COLS", 16)
    tk._rmsnorm_plan.cache_clear()
    yield
    tk._rmsnorm_plan.cache_clear()


@pytest.mark.parametrize("op, make", [
    (RMS, lambda: (_t(4, 96)[:, :50], _t(50), EPS)),
    (FUSED, lambda: (_t(4, 96)[:, :50], _t(4, 50), _t(50), EPS)),
], ids=["rmsnorm", "fused"])
def test_rows_reduced_in_chunks_launch_from_c_with_the_two_pass_plan(paths, two_pass_plans, op, make):
    _check(paths, op, make(), C)
    assert [plan[2][2] for plan in tk._NORM_PLANS.values()] == [False]  # (grid, warps, (.., .., ONE_PASS, ..), ..)


@pytest.mark.parametrize("op, make", [
    (RMS, lambda: (_t(300, 5120), _t(5120), EPS)),
    (FUSED, lambda: (_t(300, 5120), _t(300, 5120), _t(5120), EPS)),
], ids=["rmsnorm", "fused"])
def test_the_norms_launch_from_c_with_their_own_warps(paths, op, make):
    # 300 rows of 5120: one plan, 16 warps without the residual add and 8 with it (_rmsnorm_plan)
    _check(paths, op, make(), C)
    (plan,) = tk._NORM_PLANS.values()
    assert (plan[1], plan[3]) == (16, 8)
    assert paths.c(op, *make()).c_launch.threads == 32 * (8 if op is FUSED else 16)


def test_fused_rows_of_float16_and_bfloat16_launch_from_c_with_their_own_warps(paths):
    # 256 rows of 6144: 16 warps for bf16, 8 for fp16 (_rmsnorm_plan); C must find each dtype's own plan
    for dtype, warps in ((BF16, 16), (F16, 8)):
        make = lambda: (_t(256, 6144, dtype=dtype), _t(256, 6144, dtype=dtype), _t(6144, dtype=dtype), EPS)
        _check(paths, FUSED, make(), C)
        assert paths.c(FUSED, *make()).c_launch.threads == 32 * warps
    assert sorted(plan[3] for plan in tk._NORM_PLANS.values()) == [8, 16]


def test_a_plan_of_more_per_program_than_int64_holds_still_launches_a_block(paths):
    # (count + per - 1) / per overflowed int64 at such a plan (act_and_mul's count is elements, a program's too): 0
    # blocks, True returned, nothing launched, and the op handed back an unwritten output.
    x = _t(515, 272)
    python = paths.python(SILU, x)
    ((key, plan),) = tk._ACT_PLANS.items()
    tk._ACT_PLANS[key] = (*plan[:3], 2**63 - 1)
    c = paths.c(SILU, x)
    assert c.error is None and c.python_launch is None
    assert c.c_launch is not None and c.c_launch.grid == (1, *python.python_launch.grid[1:])
