"""The built-in ops on this CPU: declarations are well formed, torch_compile agrees with the reference, and
`select_kernel` really chooses between the CPU-eligible backends."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from conftest import use_fresh_registry
import torch

from autosel import checks, selector, tuning
from autosel.ops import GROUPS
from autosel.planned import kernel_of
from autosel.platforms import PlatformInfo
from autosel.spec import KernelBackend as B

CPU = PlatformInfo("cpu", arch="x86_64", device_name="test cpu", multiprocessor_count=2)
SPECS = [spec for group in GROUPS for spec in group.SPECS]
DEFINITIONS = {d.op: d for group in GROUPS for d in group.DEFINITIONS}


def test_import_autosel_and_its_ops_imports_no_torch_triton_or_backend():
    code = ("import sys, autosel, autosel.ops; autosel.ops.register_builtin_ops(); "
            "print(sorted(m for m in ('torch', 'triton', 'flashinfer', 'sgl_kernel') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


@pytest.mark.parametrize("module", ["autosel.ops.compiled", "autosel.ops.triton_kernels"])
def test_loading_a_compiling_backend_pins_tritons_cache_dir_unless_it_is_set(module, tmp_path):
    # torch.compile's inductor would otherwise move it to its own directory mid-process (autosel/ops/common.py).
    code = f"import os, {module}, triton; print(os.environ.get('TRITON_CACHE_DIR'), triton.knobs.cache.dir)"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_CACHE_DIR"}
    pinned, default = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                                     env=env).stdout.split()
    assert pinned == default and pinned.endswith(os.path.join(".triton", "cache"))
    env["TRITON_CACHE_DIR"] = str(tmp_path)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env)
    assert out.stdout.split() == [str(tmp_path)] * 2


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: f"{s.op}-{s.backend.value}")
def test_every_spec_is_well_formed(spec):
    assert spec.op in DEFINITIONS and spec.op.count(".") == 1
    if spec.target.startswith("autosel."):
        import importlib.util

        assert importlib.util.find_spec(spec.target.partition(":")[0]) is not None


@pytest.mark.parametrize("op, eligible", [
    ("layernorm.rmsnorm", ["torch", "torch_compile"]),
    ("gemm.mm", ["torch", "torch_compile"]),
])
def test_cpu_eligibility(op, eligible):
    assert [s.backend.value for s in SPECS if s.op == op and s.is_available(CPU)] == eligible


def test_gpu_only_backends_say_why_on_cpu():
    reasons = {s.backend.value: s.unavailable_reason(CPU) for s in SPECS if s.op == "layernorm.rmsnorm"}
    assert reasons["triton"] == "needs cuda, device is cpu; or needs hip, device is cpu"
    assert reasons["flashinfer"] == "needs cuda, device is cpu"


# Planned ops (attention) are keyed by their batch, not a token count; their CPU batches are tiny correctness cases.
@pytest.mark.parametrize("op", sorted(op for op, definition in DEFINITIONS.items() if not definition.planned))
def test_every_cpu_token_bucket_has_a_representative_one_within_a_factor_of_two(op):
    # The CPU shapes left 2-8 tokens without a tuned bucket within a factor of two (the nearest-bucket rule's reach,
    # buckets.NEAREST_WITHIN), so a 3-token call ran the op-level winner, torch.compile, where torch was 1.2-1.5x
    # faster; the norms' GPU shapes had followed this rule since they were chosen.
    from autosel.buckets import token_bucket, token_bucket_up

    rounding = token_bucket_up if op == "gemm.mm" else token_bucket  # gemm.mm's bucket rounds its count up
    tuned = {rounding(shape.get("tokens", shape.get("m"))) for shape in DEFINITIONS[op].shapes_for(CPU)}
    uncovered = [1 << n for n in range(max(tuned).bit_length())
                 if not any(max(1 << n, t) <= 2 * min(1 << n, t) for t in tuned)]
    assert uncovered == [], f"{op}: token buckets {uncovered} have no representative shape within a factor of two"


@pytest.mark.parametrize("op", sorted(DEFINITIONS))
def test_shape_of_inverts_make_inputs(op):
    definition = DEFINITIONS[op]
    shape = definition.shapes_for(CPU)[-1]
    recorded = definition.shape_of(*definition.make_inputs(shape, "cpu"))
    assert {k: v for k, v in recorded.items() if k != "dtype"} == {
        k: (1 << (v - 1).bit_length() if k in ("tokens", "m") else v) for k, v in shape.items()}
    assert recorded["dtype"] == "bfloat16"


def _small(op: str) -> list[dict]:
    """Two small shapes per op, so torch.compile's first compile dominates the test, not the math."""
    shapes = DEFINITIONS[op].shapes_for(CPU)
    small = []
    for shape in shapes[:2]:
        shape = dict(shape)
        for key, cap in (("hidden", 256), ("intermediate", 256), ("n", 256), ("k", 256), ("tokens", 7), ("m", 7)):
            if key in shape:
                shape[key] = min(shape[key], cap)
        small.append(shape)
    return small


@pytest.mark.compile
@pytest.mark.parametrize("op", sorted(DEFINITIONS))
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_torch_compile_agrees_with_the_reference(op, dtype):
    definition = DEFINITIONS[op]
    reference = kernel_of(definition, next(s for s in SPECS if s.op == op and s.backend == B.TORCH).load())
    compiled = kernel_of(definition, next(s for s in SPECS if s.op == op and s.backend == B.TORCH_COMPILE).load())
    for index, shape in enumerate(_small(op)):
        torch.manual_seed(index)
        args = definition.make_inputs(dict(shape, dtype=dtype), "cpu")
        ref_args, got_args = checks.clone_args(args), checks.clone_args(args)
        expected = checks.outputs_of(reference(*ref_args), ref_args)
        outcome = checks.compare(checks.outputs_of(compiled(*got_args), got_args), expected)
        assert outcome.ok, f"{op} {shape}: {outcome.reason}"


@pytest.mark.compile
def test_select_kernel_tunes_a_builtin_op_between_cpu_backends(monkeypatch):
    use_fresh_registry(monkeypatch, CPU, builtin=True)
    monkeypatch.setenv("AUTOSEL_BUDGET_S", "20")
    spec = selector.select_kernel("activation.silu_and_mul")
    decision, layer = tuning.database().decisions("activation.silu_and_mul")[0]
    assert spec.backend.value == decision.winner and layer.kind == "user"
    measured = {c.backend: c for c in decision.candidates}
    assert set(measured) == {"torch", "torch_compile"}
    for candidate in measured.values():
        assert candidate.status in ("ok", "dropped"), candidate.reason
        assert all(s.max_abs_err is not None for s in candidate.shapes)
    assert measured["torch"].shapes[0].timing.median_us > 0


def test_the_built_in_bucket_keys():
    import torch

    from autosel.ops.common import rows_bucket
    from autosel.ops.embeddings import rope_bucket
    from autosel.ops.gemm import mm_bucket

    assert rows_bucket(torch.empty(100, 4096), torch.empty(4096), 1e-6) == (128, 4096)
    assert rows_bucket(torch.empty(2, 50, 4096)) == (128, 4096)  # [batch, seq, hidden]: 100 tokens
    assert rows_bucket(torch.empty(1, 4096)) == (1, 4096) and rows_bucket(torch.empty(0, 64)) == (1, 64)
    assert rows_bucket(torch.empty(2048, 8192)) == (2048, 8192)  # a power of two is its own bucket
    assert rope_bucket(torch.arange(3), torch.empty(3, 4096), torch.empty(3, 1024), 128, None, False) == (4, 4096, False)
    assert mm_bucket(torch.empty(17, 4096), torch.empty(6144, 4096)) == (32, "6144x4096")  # up: a tile's step
    assert mm_bucket(torch.empty(16, 4096), torch.empty(6144, 4096)) == (16, "6144x4096")
    assert mm_bucket(torch.empty(2, 12, 4096), torch.empty(6144, 4096)) == (32, "6144x4096")


def test_a_gemm_bucket_decides_for_its_own_weight_only():
    # From (16, 4096 x 4096) the nearest-bucket rule carried triton to 5120 x 3072 and four other weights, where
    # it ran 1.15-1.9x cuBLAS's time (H200, commit c134b65): a weight is a name in the key, so only tokens move.
    import torch

    from autosel.dispatch import BucketTable
    from autosel.ops.gemm import mm_bucket

    table = BucketTable("gemm.mm", "graph", "torch", {(16, "4096x4096"): "triton", (32, "4096x4096"): "torch"})
    weight = torch.empty(4096, 4096)
    assert table.route(mm_bucket(torch.empty(5, 4096), weight)) == "triton"  # a factor of two in tokens
    assert table.route(mm_bucket(torch.empty(4, 4096), weight)) == "torch"  # farther: the op-level winner
    assert table.route(mm_bucket(torch.empty(17, 4096), weight)) == "torch"  # past the 16-row tile
    assert table.route(mm_bucket(torch.empty(64, 4096), weight)) == "torch"  # nearest 32 (ties go down)
    assert table.route(mm_bucket(torch.empty(16, 3072), torch.empty(5120, 3072))) == "torch"
    assert table.route(mm_bucket(torch.empty(16, 4096), torch.empty(4096 + 64, 4096))) == "torch"


# Regression: AUTOSEL_RECORD read a [2, 7, 4096] `a` of gemm.mm as m=2, k=7, not the bucket's m=16, k=4096.
@pytest.mark.parametrize("a_shape", [(14, 4096), (2, 7, 4096), (1, 2, 7, 4096)])
def test_mm_records_the_shape_its_dispatcher_buckets(a_shape, tmp_path, monkeypatch):
    import json

    from autosel import dispatch
    from autosel.ops.gemm import mm_bucket, mm_shape

    a, b = torch.empty(a_shape, dtype=torch.bfloat16), torch.empty(64, 4096, dtype=torch.bfloat16)
    path = tmp_path / "record.jsonl"
    dispatch.recording("gemm.mm", lambda a, b: None, path, "eager", mm_shape)(a, b)
    written = json.loads(path.read_text())["shape"]
    assert (written["m"], written["n"], written["k"]) == (16, 64, 4096)
    assert mm_bucket(a, b) == (16, "64x4096")


def test_token_buckets_round_to_the_nearest_power_of_two_and_gemms_round_up():
    import torch

    from autosel.buckets import token_bucket_up
    from autosel.ops.common import rows_bucket, token_bucket
    from autosel.ops.embeddings import rope_bucket
    from autosel.ops.gemm import mm_bucket

    assert [token_bucket(t) for t in (0, 1, 2, 3, 5, 6, 1300, 1500, 3000, 4096)] == [
        1, 1, 2, 4, 4, 8, 1024, 2048, 4096, 4096]
    for t in range(1, 300):
        x = torch.empty(t, 8)
        assert rows_bucket(x)[0] == rope_bucket(None, x, None)[0] == token_bucket(t)
        assert mm_bucket(x, torch.empty(4, 8))[0] == token_bucket_up(t) == 1 << max(t - 1, 0).bit_length()


def test_every_norm_token_bucket_has_a_tuned_one_within_a_factor_of_two():
    # The 4-token bucket had none (tuned: 1, 16, 64, ...), so 3-token calls ran the op-level winner: in graph mode
    # on the H200 triton, 15% behind the vendors at 3 x 6144. 4 x 7168 is now timed in place of 64 x 7168.
    from autosel.ops.common import token_bucket

    gpu = PlatformInfo("cuda", arch="sm_90", device_name="test gpu", multiprocessor_count=132)
    tuned = {token_bucket(s["tokens"]) for s in DEFINITIONS["layernorm.rmsnorm"].shapes_for(gpu)}
    assert DEFINITIONS["layernorm.fused_add_rmsnorm"].shapes_for(gpu) == DEFINITIONS["layernorm.rmsnorm"].shapes_for(gpu)
    # 64 x 7168 was swapped for 4 x 7168, and 8192 x 4096 for 8192 x 5120; 4096 x 7168 was added (the eager
    # crossover): a tuned shape more costs the two norms about 1.9 s of an H200 tune (commit b68e9eb).
    assert len(DEFINITIONS["layernorm.rmsnorm"].shapes_for(gpu)) == 13
    assert [1 << b for b in range(15) if not any(t in (1 << b, 2 << b, 1 << max(b - 1, 0)) for t in tuned)] == []


@pytest.mark.parametrize("op", ["layernorm.rmsnorm", "layernorm.fused_add_rmsnorm", "activation.silu_and_mul",
                                "activation.gelu_and_mul", "embeddings.rope", "gemm.mm"])
def test_every_built_in_op_buckets_its_own_inputs(op):
    # The tuner computes each representative shape's bucket from the inputs it built: it must be a tuple of scalars.
    from autosel.ops import register_builtin_ops
    from autosel.registry import KernelRegistry
    from autosel.buckets import bucket_of

    reg = KernelRegistry()
    register_builtin_ops(reg)
    definition = reg.definition(op)
    buckets = [bucket_of(definition, definition.make_inputs(shape, "cpu")) for shape in definition.shapes_for(CPU)]
    assert len(buckets) == len(definition.shapes_for(CPU))
    assert all(isinstance(b[0], int) and b[0] & (b[0] - 1) == 0 for b in buckets)  # tokens: powers of two


def _fake_flashinfer(monkeypatch, *, internals: bool, cuda_norm: bool = True):
    """A stand-in for flashinfer 0.7 (CI has none) that records calls: its public wrappers and, with `internals`,
    the compiled functions behind them where 0.7 keeps them. Returns the adapters under test and the calls."""
    import importlib
    import types

    calls = []

    def record(name):
        return lambda *args, **kwargs: calls.append((name, args, kwargs)) or name

    def module(*names):
        return types.SimpleNamespace(**{name: record("compiled " + name) for name in names})

    fake = types.ModuleType("flashinfer")
    fake.__version__ = "0.7.4" if internals else "9.9"
    fake.norm = types.SimpleNamespace(rmsnorm=record("rmsnorm"), fused_add_rmsnorm=record("fused_add_rmsnorm"))
    fake.activation = types.SimpleNamespace(silu_and_mul=record("silu_and_mul"), gelu_and_mul=record("gelu_and_mul"))
    fake.rope = types.SimpleNamespace(apply_rope_with_cos_sin_cache_inplace=record("rope"))
    if internals:
        fake.norm._use_cuda_norm = lambda device: cuda_norm
        fake.norm.get_norm_module = lambda: module("rmsnorm", "fused_add_rmsnorm")
        fake.activation.gen_act_and_mul_module = lambda act: types.SimpleNamespace(
            build_and_load=lambda: module(f"{act}_and_mul"))
        fake.rope.get_rope_module = lambda: module("apply_rope_pos_ids_cos_sin_cache")
    monkeypatch.setitem(sys.modules, "flashinfer", fake)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.delitem(sys.modules, "autosel.ops.vendor_flashinfer", raising=False)
    return importlib.import_module("autosel.ops.vendor_flashinfer"), calls


def _call_every_adapter(adapters):
    x, r, w = torch.ones(2, 8), torch.ones(2, 8), torch.ones(8)
    positions, cache = torch.zeros(2, dtype=torch.int64), torch.ones(16, 4)
    query, key = torch.ones(2, 8), torch.ones(2, 4)
    out = adapters.rmsnorm(x, w, 1e-6)
    assert out.shape == x.shape
    assert adapters.fused_add_rmsnorm(x, r, w, 1e-6) is None
    assert adapters.silu_and_mul(x).shape == (2, 4) and adapters.gelu_and_mul(x).shape == (2, 4)
    assert adapters.rope(positions, query, key, 4, cache, True) is None
    return out


def test_flashinfer_adapters_call_the_compiled_functions_with_pdl_off(monkeypatch):
    adapters, calls = _fake_flashinfer(monkeypatch, internals=True)
    out = _call_every_adapter(adapters)
    assert [(name, len(args), args[-1]) for name, args, kwargs in calls] == [
        ("compiled rmsnorm", 5, False), ("compiled fused_add_rmsnorm", 5, False), ("compiled silu_and_mul", 3, False),
        ("compiled gelu_and_mul", 3, False), ("compiled apply_rope_pos_ids_cos_sin_cache", 7, False)]
    assert calls[0][1][0] is out  # rmsnorm writes into the tensor it returns
    q, k, q_out, k_out = calls[4][1][:4]
    assert q.shape == (2, 2, 4) and k.shape == (2, 1, 4) and q_out is q and k_out is k  # in place, [T, heads, D]
    with pytest.raises(ValueError, match="float32"):
        adapters.rope(torch.zeros(2, dtype=torch.int64), torch.ones(2, 8), torch.ones(2, 4), 4,
                      torch.ones(16, 4, dtype=torch.bfloat16), True)


def test_flashinfer_adapters_fall_back_to_the_public_wrappers_with_a_warning(monkeypatch):
    # A flashinfer whose internals moved still runs, through its public wrappers, PDL still off.
    adapters, calls = _fake_flashinfer(monkeypatch, internals=False)
    with pytest.warns(UserWarning) as warned:
        _call_every_adapter(adapters)
    assert [str(w.message).split("'s compiled function is not where")[0] for w in warned] == [
        f"flashinfer 9.9: {name}" for name in ("rmsnorm", "fused_add_rmsnorm", "silu_and_mul", "gelu_and_mul",
                                                "apply_rope_pos_ids_cos_sin_cache")]
    assert [(name, kwargs.get("enable_pdl")) for name, args, kwargs in calls] == [
        ("rmsnorm", False), ("fused_add_rmsnorm", False), ("silu_and_mul", False), ("gelu_and_mul", False),
        ("rope", None)]
    assert calls[4][1][1].shape == (2, 8) and calls[4][1][3] == 4 and calls[4][1][5] is True  # 2D query, neox


def test_flashinfer_norms_stay_on_the_public_wrappers_where_flashinfer_runs_its_cute_kernels(monkeypatch):
    import warnings

    adapters, calls = _fake_flashinfer(monkeypatch, internals=True, cuda_norm=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _call_every_adapter(adapters)
    assert [name for name, args, kwargs in calls][:2] == ["rmsnorm", "fused_add_rmsnorm"]


def test_every_flashinfer_backend_goes_through_autosels_adapters():
    flashinfer_targets = {s.op: s.target for s in SPECS if s.backend == B.FLASHINFER}
    # Paged attention's flashinfer backends are autosel's own plan classes (autosel.ops.attention_flashinfer).
    assert all(t.startswith(("autosel.ops.vendor_flashinfer:", "autosel.ops.attention_flashinfer:"))
               for t in flashinfer_targets.values()), flashinfer_targets


@pytest.mark.parametrize("op", ["layernorm.rmsnorm", "layernorm.fused_add_rmsnorm", "activation.silu_and_mul",
                                "activation.gelu_and_mul", "embeddings.rope", "gemm.mm"])
def test_the_custom_op_compiled_code_calls_declares_what_the_kernel_reads_writes_and_returns(op):
    # torch.library.opcheck: the schema's mutated arguments, the fake output's shape and dtype against the kernel's.
    import torch

    from autosel.ops import torch_impl
    from autosel.registry import registry

    definition = registry.definition(op)
    kernel = getattr(torch_impl, op.split(".")[1])
    opaque = definition.traced_kernel("a_backend_compiled_code_cannot_trace", kernel)
    assert opaque is not kernel and definition.traced_kernel("torch", kernel) is kernel
    shape = definition.shapes_for(__import__("autosel.platforms").platforms.current_platform())[0]
    torch.library.opcheck(opaque, definition.make_inputs(dict(shape), "cpu"))
    if op in ("layernorm.rmsnorm", "activation.silu_and_mul"):  # a dense input that is not contiguous (column-major:
        x, *rest = definition.make_inputs(dict(shape, tokens=8), "cpu")  # the ops take 2-D x, signature x[T, H])
        torch.library.opcheck(opaque, (x.t().contiguous().t(), *rest))


def test_threads_making_one_kernels_custom_op_at_once_get_one():
    # Each defined the same op name, and torch refused all but the first ("Library object has been destroyed").
    import threading

    from autosel.ops import opaque

    def kernel(x, weight, eps):
        return x * weight

    ready, made = threading.Barrier(8), []

    def make():
        ready.wait(5)
        made.append(opaque.rmsnorm("a_backend", kernel))

    threads = [threading.Thread(target=make) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(10)
    assert len(made) == 8 and all(op is made[0] for op in made)


def test_the_torch_backends_rope_leaves_an_empty_batch_alone():
    # view(0, -1, head_size) cannot infer its -1: an idle rank's empty batch raised, on the CPU's default backend too.
    from autosel.ops import torch_impl

    query, key = torch.empty(0, 64), torch.empty(0, 32)
    assert torch_impl.rope(torch.empty(0, dtype=torch.int64), query, key, 16, torch.ones(8, 16), True) is None
    assert query.shape == (0, 64) and key.shape == (0, 32)


@pytest.mark.parametrize("call, message", [
    # An odd width broadcast [4, 1] against [4, 2] into a wrong result of the wrong shape:
    (lambda t: t.silu_and_mul(torch.randn(4, 3)), "x has last dim 3: a gated activation takes"),
    (lambda t: t.gelu_and_mul(torch.randn(4, 3)), "x has last dim 3: a gated activation takes"),
    # A weight of one element broadcast, where the other backends raise:
    (lambda t: t.rmsnorm(torch.randn(4, 8), torch.ones(1), 1e-6), r"weight has shape \(1,\), expected \(8,\)"),
    (lambda t: t.fused_add_rmsnorm(torch.randn(4, 8), torch.randn(4, 8), torch.ones(1), 1e-6),
     r"weight has shape \(1,\), expected \(8,\)"),
    # A residual of another row count failed inside x + residual (under torch.compile: a message about fake tensors):
    (lambda t: t.fused_add_rmsnorm(torch.randn(4, 8), torch.randn(5, 8), torch.ones(8), 1e-6),
     r"x has shape \(4, 8\) but residual has \(5, 8\)"),
    # A head size that does not divide the widths failed in view():
    (lambda t: t.rope(torch.arange(2), torch.randn(2, 64), torch.randn(2, 32), 24, torch.ones(8, 16), True),
     "query width 64 and key width 32 must be multiples of head_size 24"),
    # Integer rows came back truncated, an rmsnorm as zeros and ones:
    (lambda t: t.rmsnorm(torch.ones(4, 8, dtype=torch.int32), torch.ones(8), 1e-6), "x is torch.int32; the op takes"),
    (lambda t: t.silu_and_mul(torch.ones(4, 8, dtype=torch.int64)), "x is torch.int64; the op takes"),
    (lambda t: t.rope(torch.arange(2), torch.ones(2, 64, dtype=torch.int32), torch.randn(2, 32), 16,
                      torch.ones(8, 16), True), "query is torch.int32; the op takes floating-point tensors"),
    # Accepted although the signatures say x[T, H] and x[T, 2I] (the vendors' GPU kernels take 2-D rows only):
    (lambda t: t.rmsnorm(torch.randn(2, 4, 64), torch.ones(64), 1e-6),
     r"x has shape \(2, 4, 64\); the op takes x\[T, H\], 2-D: reshape it to \(-1, 64\) first"),
    (lambda t: t.fused_add_rmsnorm(torch.randn(2, 4, 64), torch.randn(2, 4, 64), torch.ones(64), 1e-6),
     r"x has shape \(2, 4, 64\); the op takes x\[T, H\]"),
    (lambda t: t.silu_and_mul(torch.randn(64)), r"x has shape \(64,\); the op takes x\[T, 2I\], 2-D"),
    # Float positions and a cache wider than head_size failed inside torch.compile's tracing (34 lines of fake
    # tensors); the torch backend truncated float positions or failed in a broadcast:
    (lambda t: t.rope(torch.arange(2.0), torch.randn(2, 64), torch.randn(2, 32), 16, torch.ones(8, 16), True),
     "positions must be int64 or int32, got torch.float32"),
    (lambda t: t.rope(torch.arange(2), torch.randn(2, 64), torch.randn(2, 32), 16, torch.ones(8, 32), True),
     "cos_sin_cache last dim 32 must be even and <= head_size 16"),
    (lambda t: t.rope(torch.arange(2), torch.randn(2, 64), torch.randn(2, 32), 16, torch.ones(8), True),
     r"cos_sin_cache must be 2-D \[positions, rotary_dim\], got shape \(8,\)"),
], ids=["silu-odd", "gelu-odd", "rmsnorm-weight", "fused-weight", "fused-residual", "rope-head-size", "rmsnorm-int",
        "silu-int", "rope-int", "rmsnorm-3d", "fused-3d", "silu-1d", "rope-float-positions", "rope-wide-cache",
        "rope-1d-cache"])
def test_the_torch_backend_refuses_what_it_used_to_broadcast_into_a_wrong_result(call, message):
    from autosel.ops import torch_impl

    with pytest.raises(ValueError, match=message):
        call(torch_impl)


@pytest.mark.parametrize("call, message", [
    (lambda t: t.rmsnorm([[1.0] * 8], torch.ones(8), 1e-6), "x is a list; the op takes torch tensors"),
    (lambda t: t.rmsnorm(torch.ones(4, 8), "w", 1e-6), "weight is a str; the op takes torch tensors"),
    (lambda t: t.fused_add_rmsnorm(torch.ones(4, 8), 0.0, torch.ones(8), 1e-6), "residual is a float; the op"),
    (lambda t: t.silu_and_mul([[1.0] * 8]), "x is a list; the op takes torch tensors"),
    (lambda t: t.rope([0, 1], torch.randn(2, 64), torch.randn(2, 32), 16, torch.ones(8, 16), True),
     "positions is a list; the op takes torch tensors"),
], ids=["rmsnorm-x", "rmsnorm-weight", "fused-residual", "silu-x", "rope-positions"])
def test_the_torch_backend_names_an_argument_that_is_no_tensor(call, message):
    # Each failed with Python's "'list' object has no attribute 'is_floating_point'" (or 'shape').
    from autosel.ops import torch_impl

    with pytest.raises(TypeError, match=message):
        call(torch_impl)


@pytest.mark.compile
def test_the_torch_compile_backend_raises_the_torch_backends_errors_not_its_tracings():
    # Both raised torch.compile's "Dynamo failed to run FX node with fake tensors" with the graph's nodes.
    from autosel.ops import compiled

    with pytest.raises(ValueError, match=r"x has shape \(4, 8\) but residual has \(5, 8\)"):
        compiled.fused_add_rmsnorm(torch.randn(4, 8), torch.randn(5, 8), torch.ones(8), 1e-6)
    with pytest.raises(ValueError, match="must be multiples of head_size 24"):
        compiled.rope(torch.arange(2), torch.randn(2, 64), torch.randn(2, 32), 24, torch.ones(8, 16), True)
    with pytest.raises(ValueError, match="positions must be int64 or int32, got torch.float32"):
        compiled.rope(torch.arange(2.0), torch.randn(2, 64), torch.randn(2, 32), 16, torch.ones(8, 16), True)
    with pytest.raises(ValueError, match="cos_sin_cache last dim 32 must be even and <= head_size 16"):
        compiled.rope(torch.arange(2), torch.randn(2, 64), torch.randn(2, 32), 16, torch.ones(8, 32), True)
    with pytest.raises(ValueError, match=r"x has shape \(2, 4, 64\); the op takes x\[T, H\]"):
        compiled.fused_add_rmsnorm(torch.randn(2, 4, 64), torch.randn(2, 4, 64), torch.ones(64), 1e-6)
