"""GPU tests for autosel.ops.triton_launch: calls after the first take the direct launch (in C, never Triton's path),
give the reference's answer, get a kernel of their own when Triton would specialize differently, and can be captured
in a CUDA graph."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU to launch Triton kernels")

EPS = 1e-6


def _kernels():
    from autosel.ops import triton_kernels

    return triton_kernels


def _ref_rmsnorm(x, weight):
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + EPS)).to(x.dtype) * weight


def _rows(tokens, width, *, offset=0):
    """[tokens, width] bf16 starting `offset` elements into a buffer (offset 1: 2 bytes off 16-byte alignment)."""
    buffer = torch.randn(tokens * width + offset, device="cuda").to(torch.bfloat16)
    return buffer[offset:].view(tokens, width)


def test_repeated_calls_take_the_direct_launch_and_match_the_reference():
    tk = _kernels()
    launcher = tk._launch_rmsnorm_kernel
    assert launcher.enabled
    weight = torch.randn(4096, device="cuda").to(torch.bfloat16)
    tk.rmsnorm(_rows(37, 4096), weight, EPS)
    kept = len(launcher.kept)
    for _ in range(3):  # new data each time, the same specialization: no new kernel, right answers
        x = _rows(37, 4096)
        torch.testing.assert_close(tk.rmsnorm(x, weight, EPS), _ref_rmsnorm(x, weight), rtol=2e-2, atol=2e-2)
    assert len(launcher.kept) == kept >= 1


@pytest.mark.parametrize("width, offset", [(4096, 1), (4100, 0), (4100, 1)], ids=["misaligned", "odd", "both"])
def test_a_call_triton_specializes_differently_gets_its_own_kernel(width, offset):
    """After an aligned call at 4096 columns, a misaligned input or a width not divisible by 16 must not run the
    kernel compiled for aligned, divisible arguments (its vector loads would read the wrong addresses)."""
    tk = _kernels()
    launcher = tk._launch_rmsnorm_kernel
    weight = torch.randn(width, device="cuda").to(torch.bfloat16)
    tk.rmsnorm(_rows(37, 4096), weight[:4096].contiguous(), EPS)
    before = set(launcher.kept)
    for _ in range(2):  # the first compiles (or loads) the kernel, the second launches it directly
        x = _rows(37, width, offset=offset)
        torch.testing.assert_close(tk.rmsnorm(x, weight, EPS), _ref_rmsnorm(x, weight), rtol=2e-2, atol=2e-2)
    assert set(launcher.kept) - before, "the differently specialized call reused a kept kernel"


class _NotTritonsPath:
    """Stands in for a launcher's Triton function: a call that reaches Triton's path fails the test."""

    def __getitem__(self, grid):
        raise AssertionError("a call with a kept kernel went through Triton's own launch")


def _in_place(fn, *args, written):
    """Call an in-place kernel on copies of args and return the copies it writes (by position)."""
    copies = [a.clone() if isinstance(a, torch.Tensor) else a for a in args]
    fn(*copies)
    return tuple(copies[i] for i in written)


def _every_kernel_call(tk, tokens):
    """(FastLaunch, its call, the torch backend's answer) for each of autosel's Triton kernels that FastLaunch
    launches; every call takes fresh copies of its inputs."""
    from autosel.ops import torch_impl

    x, gate_up = _rows(tokens, 4096), _rows(tokens, 2 * 1408)
    weight = torch.randn(4096, device="cuda").to(torch.bfloat16)
    rope_args = (torch.arange(tokens, device="cuda") % 64, _rows(tokens, 8 * 128), _rows(tokens, 2 * 128), 128,
                 torch.randn(64, 128, device="cuda"), True)
    calls = [(tk._launch_rmsnorm_kernel, "rmsnorm", (x, weight, EPS), None),
             (tk._launch_rmsnorm_kernel, "fused_add_rmsnorm", (x, x, weight, EPS), (0, 1)),
             (tk._launch_act_and_mul, "silu_and_mul", (gate_up,), None),
             (tk._launch_act_and_mul, "gelu_and_mul", (gate_up,), None),
             (tk._launch_rope, "rope", rope_args, (1, 2))]

    def run(module, name, args, written):
        fn = getattr(module, name)
        return fn(*args) if written is None else _in_place(fn, *args, written=written)

    return [(launcher, name, lambda n=name, a=args, w=written: run(tk, n, a, w),
             lambda n=name, a=args, w=written: run(torch_impl, n, a, w))
            for launcher, name, args, written in calls]


@pytest.mark.parametrize("tokens", [1, 16, 37, 600])
def test_every_kernel_launches_from_c_after_its_first_call(tokens, monkeypatch):
    """1 token: Triton makes n_rows a constant, so the launcher must leave it out; 16: divisible; 37: neither; 600:
    rmsnorm's and rope's plans past a few hundred rows."""
    tk = _kernels()
    for launcher, name, call, reference in _every_kernel_call(tk, tokens):
        call()  # the first call of this specialization: compiled or loaded through Triton, then kept
        assert launcher.enabled, f"{name}: the direct launch was switched off"
        with monkeypatch.context() as patch:
            patch.setattr(launcher, "fn", _NotTritonsPath())
            torch.testing.assert_close(call(), reference(), rtol=2e-2, atol=2e-2, msg=name)


def test_a_launch_hook_sends_calls_through_triton(monkeypatch):
    """A profiler's launch hook (proton sets one) must see every launch of every kernel: the C launcher, from
    prepared arguments or from the tensors, would skip it."""
    from triton import knobs

    tk = _kernels()
    calls = _every_kernel_call(tk, 8)
    for _, _, call, _ in calls:
        call()  # planned, compiled or loaded, and kept
    seen = []
    hooks = knobs.runtime.launch_enter_hook
    if hasattr(hooks, "add"):  # Triton 3.6 and later: a HookChain, empty unless a profiler adds to it
        monkeypatch.setattr(hooks, "calls", [seen.append])  # the chain's own list comes back after the test
    else:
        monkeypatch.setattr(knobs.runtime, "launch_enter_hook", seen.append)
    for _, name, call, _ in calls:
        before = len(seen)
        call()
        assert len(seen) == before + 1, f"{name}: the launch hook did not see the launch"


def test_direct_launches_are_captured_in_a_cuda_graph():
    tk = _kernels()
    x, residual = _rows(64, 4096), _rows(64, 4096)
    weight = torch.randn(4096, device="cuda").to(torch.bfloat16)
    gate_up = _rows(64, 2 * 14336)
    tk.fused_add_rmsnorm(x.clone(), residual.clone(), weight, EPS)  # compile or load outside the capture
    tk.silu_and_mul(gate_up)
    torch.cuda.synchronize()
    static_x, static_res = x.clone(), residual.clone()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        tk.fused_add_rmsnorm(static_x, static_res, weight, EPS)
        activated = tk.silu_and_mul(gate_up)
    for _ in range(2):
        static_x.copy_(x)
        static_res.copy_(residual)
        graph.replay()
        torch.cuda.synchronize()
        summed = (x.float() + residual.float()).to(torch.bfloat16)
        torch.testing.assert_close(static_res, summed)
        torch.testing.assert_close(static_x, _ref_rmsnorm(summed, weight), rtol=2e-2, atol=2e-2)
        a, b = gate_up.float().chunk(2, dim=-1)
        torch.testing.assert_close(activated, (torch.nn.functional.silu(a) * b).to(torch.bfloat16),
                                   rtol=2e-2, atol=2e-2)


# --------------------------------------------------------------------------------------------------
# The launch from a kernel's tensors in C (triton_launch.c's norm, act_and_mul, rope), where torch has the DLPack C
# exchange API.


def _direct(tk):
    if tk._DIRECT is None:
        pytest.skip("this torch has no DLPack C exchange API: the kernels take the Python path")


class _Recorded:
    """Stands in for a FastLaunch: records every call that reaches it (the Python path) and passes it on."""

    def __init__(self, launcher):
        self.launcher, self.calls = launcher, []

    def __getattr__(self, name):
        return getattr(self.launcher, name)

    def __call__(self, *args):
        self.calls.append(args)
        return self.launcher(*args)


def _record_python_launches(tk, monkeypatch) -> dict:
    """Every FastLaunch of tk recorded, by the kernel's name: a call that reaches one took the Python path."""
    names = {"rmsnorm": "_launch_rmsnorm_kernel", "act": "_launch_act_and_mul", "rope": "_launch_rope"}
    recorded = {kind: _Recorded(getattr(tk, name)) for kind, name in names.items()}
    for kind, name in names.items():
        monkeypatch.setattr(tk, name, recorded[kind])
    return recorded


@pytest.mark.parametrize("tokens", [1, 16, 37])
def test_every_kernel_launches_from_its_tensors_in_c_after_its_first_call(tokens, monkeypatch):
    tk = _kernels()
    _direct(tk)
    for _, name, call, reference in _every_kernel_call(tk, tokens):
        call()  # the first call of this specialization: planned, compiled or loaded, and kept on the Python path
        with monkeypatch.context() as patch:
            recorded = _record_python_launches(tk, patch)
            torch.testing.assert_close(call(), reference(), rtol=2e-2, atol=2e-2, msg=name)
            assert not any(r.calls for r in recorded.values()), f"{name}: a planned, kept call took the Python path"


def _norm_call(tk, fused, x, residual, weight):
    """The op's outputs, on copies: (out,) for rmsnorm, (x, residual) for fused add + rmsnorm."""
    from autosel.ops import torch_impl

    def run(module, x, residual):
        if not fused:
            return (module.rmsnorm(x, weight, EPS),)
        xc, rc = x.clone(), residual.clone()
        module.fused_add_rmsnorm(xc, rc, weight, EPS)
        return xc, rc

    # The torch backend takes 2-D rows only (it refuses other shapes with a ValueError), Triton's any rows: the
    # reference runs on the rows and is compared in x's shape.
    rows = [t.reshape(-1, x.shape[-1]) for t in (x, residual)]
    return run(tk, x, residual), tuple(t.reshape(x.shape) for t in run(torch_impl, *rows))


@pytest.mark.parametrize("fused", [False, True], ids=["rmsnorm", "fused_add_rmsnorm"])
@pytest.mark.parametrize("shape", [(4096,), (2, 19, 4096), (16, 4100), (3, 1, 5, 4096)])
def test_norms_of_any_rows_launch_from_c(shape, fused, monkeypatch):
    tk = _kernels()
    _direct(tk)
    x = torch.randn(*shape, device="cuda").to(torch.bfloat16)
    residual = torch.randn_like(x)
    # An nn.Parameter that requires grad, as a model's weight is: DLPack's __dlpack__ refuses such a tensor.
    weight = torch.nn.Parameter(torch.randn(shape[-1], device="cuda").to(torch.bfloat16))
    _norm_call(tk, fused, x, residual, weight)
    recorded = _record_python_launches(tk, monkeypatch)
    for _ in range(2):
        ours, reference = _norm_call(tk, fused, x, residual, weight)
        for got, want in zip(ours, reference, strict=True):
            torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)
    assert recorded["rmsnorm"].calls == []


def test_gated_activations_and_rope_of_3d_tensors_launch_from_c(monkeypatch):
    from autosel.ops import torch_impl

    tk = _kernels()
    _direct(tk)
    gate_up = torch.randn(2, 9, 2 * 1408, device="cuda").to(torch.bfloat16)
    positions = torch.arange(9, device="cuda", dtype=torch.int32) % 64
    query = torch.randn(9, 8, 128, device="cuda").to(torch.bfloat16)
    key = torch.randn(9, 2, 128, device="cuda").to(torch.bfloat16)
    cache = torch.randn(64, 128, device="cuda")

    def rope(module):
        q, k = query.clone(), key.clone()
        module.rope(positions, q, k, 128, cache, False)
        return q, k

    tk.silu_and_mul(gate_up), tk.gelu_and_mul(gate_up), rope(tk)
    recorded = _record_python_launches(tk, monkeypatch)
    rows = gate_up.reshape(-1, gate_up.shape[-1])  # the torch reference takes 2-D rows only
    for name in ("silu_and_mul", "gelu_and_mul"):
        want = getattr(torch_impl, name)(rows).reshape(*gate_up.shape[:-1], -1)
        torch.testing.assert_close(getattr(tk, name)(gate_up), want, rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(rope(tk), rope(torch_impl), rtol=2e-2, atol=2e-2)
    assert not any(r.calls for r in recorded.values())


def test_calls_c_cannot_take_go_the_python_way_and_fail_as_before(monkeypatch):
    tk = _kernels()
    _direct(tk)
    weight = torch.randn(4096, device="cuda").to(torch.bfloat16)
    strided = _rows(8, 8192)[:, ::2]  # no unit column stride: rmsnorm and silu_and_mul copy it
    tk.rmsnorm(strided, weight, EPS), tk.silu_and_mul(strided)
    recorded = _record_python_launches(tk, monkeypatch)
    torch.testing.assert_close(tk.rmsnorm(strided, weight, EPS), _ref_rmsnorm(strided, weight), rtol=2e-2, atol=2e-2)
    a, b = strided.float().chunk(2, dim=-1)
    torch.testing.assert_close(tk.silu_and_mul(strided), (torch.nn.functional.silu(a) * b).to(torch.bfloat16),
                               rtol=2e-2, atol=2e-2)
    assert len(recorded["rmsnorm"].calls) == len(recorded["act"].calls) == 1
    expanded = _rows(1, 4096).expand(8, 4096)
    with pytest.raises(ValueError, match="overlap"):
        tk.fused_add_rmsnorm(expanded, _rows(8, 4096), weight, EPS)
    with pytest.raises(ValueError, match="residual has"):
        tk.fused_add_rmsnorm(_rows(8, 4096), _rows(4, 4096), weight, EPS)
    with pytest.raises(ValueError, match="1-D"):
        tk.rmsnorm(_rows(8, 4096), weight[0], EPS)
    with pytest.raises(ValueError, match="even"):
        tk.silu_and_mul(_rows(8, 4095))
    positions = torch.arange(8, device="cuda")
    with pytest.raises(ValueError, match="int64 or int32"):
        tk.rope(positions.float(), _rows(8, 1024), _rows(8, 256), 128, torch.randn(64, 128, device="cuda"), True)


def test_launches_from_c_are_captured_on_the_capturing_stream(monkeypatch):
    tk = _kernels()
    _direct(tk)
    x, residual = _rows(24, 4096), _rows(24, 4096)
    weight = torch.randn(4096, device="cuda").to(torch.bfloat16)
    gate_up = _rows(24, 2 * 1408)
    expected_x, expected_res = x.clone(), residual.clone()
    tk.fused_add_rmsnorm(expected_x, expected_res, weight, EPS)  # planned and kept outside the capture
    expected_act = tk.silu_and_mul(gate_up)
    torch.cuda.synchronize()
    recorded = _record_python_launches(tk, monkeypatch)
    static_x, static_res = x.clone(), residual.clone()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        tk.fused_add_rmsnorm(static_x, static_res, weight, EPS)
        activated = tk.silu_and_mul(gate_up)
    static_x.copy_(x)
    static_res.copy_(residual)
    graph.replay()
    torch.cuda.synchronize()
    assert not any(r.calls for r in recorded.values())
    assert torch.equal(static_x, expected_x) and torch.equal(static_res, expected_res)
    assert torch.equal(activated, expected_act)


def test_rows_sliced_out_of_wider_buffers_launch_from_c_with_their_own_row_stride(monkeypatch):
    """Engines pass rows of wider buffers (a residual stream's slice, q and k out of one qkv projection): a row
    stride taken as the width would read the wrong rows, which contiguous inputs cannot show."""
    from autosel.ops import torch_impl

    tk = _kernels()
    _direct(tk)
    x, residual = _rows(12, 8192)[:, :4096], _rows(12, 6144)[:, 1024:5120]
    weight = torch.randn(4096, device="cuda").to(torch.bfloat16)
    qkv = _rows(12, (8 + 2 + 2) * 128)
    positions = torch.arange(12, device="cuda")
    cache = torch.randn(64, 128, device="cuda")

    def run(module):
        xc, rc, q, k = x.clone(), residual.clone(), qkv[:, :1024].clone(), qkv[:, 1024:1280].clone()
        # the in-place ops on views of the buffers' copies, as an engine calls them
        xb, rb, qkvb = _rows(12, 8192), _rows(12, 6144), qkv.clone()
        xb[:, :4096].copy_(xc), rb[:, 1024:5120].copy_(rc)
        module.fused_add_rmsnorm(xb[:, :4096], rb[:, 1024:5120], weight, EPS)
        module.rope(positions, qkvb[:, :1024], qkvb[:, 1024:1280], 128, cache, True)
        return module.rmsnorm(x, weight, EPS), xb[:, :4096], rb[:, 1024:5120], qkvb[:, :1280]

    run(tk)  # planned and kept on the Python path
    recorded = _record_python_launches(tk, monkeypatch)
    for got, want in zip(run(tk), run(torch_impl), strict=True):
        torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)
    assert not any(r.calls for r in recorded.values())
