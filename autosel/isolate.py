"""Isolated checks: run one candidate's correctness check in a child process with a timeout, so a kernel
that segfaults, hangs, exits or leaves a sticky CUDA error is recorded as data instead of taking the tune down.

The child gets everything by name ("module:attr"), so the op's make_inputs and reference must be importable
module-level functions. It answers on a pipe of its own, not on stdout (a kernel may print anything there),
first "ready" once the interpreter and the op's own functions are loaded, then "ran" once the op's reference
alone has run on every shape (a child that dies before that is the reference's fault, the op's error), then the
check's result: the timeout counts from "ready", so it times the candidate, not the interpreter's start. Any
end of the child without a result is a rejection with its reason. After the check the child calls the
candidate CALLS_PER_SHAPE more times per shape, so a kernel that crashes only from its Nth call is caught here
too.
Candidates that pass are then checked again and timed in the parent, interleaved; docs/TUNING.md section 5
says what isolation does not cover.
"""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import tempfile
import time
from typing import Any, Callable, Iterator, Sequence

from autosel import checks
from autosel.errors import TuningError
from autosel.formatting import shape_text
from autosel.platforms import visible_gpu_name
from autosel.planned import kernel_of
from autosel.spec import KernelSpec, OpDefinition, resolve_target, target_of

CALLS_PER_SHAPE = 25  # calls per shape after the check, in the child
STARTUP_TIMEOUT_S = 300.0  # for the child's interpreter, torch and the op's functions, before the timeout starts


def _describe_exit(returncode: int, stderr: str) -> str:
    if returncode < 0:
        try:
            name = signal.Signals(-returncode).name
        except ValueError:
            name = f"signal {-returncode}"
        return f"crashed the process ({name})"
    tail = stderr.strip().splitlines()[-1] if stderr.strip() else "no message"
    if returncode == 0:
        return f"ended the process (exit status 0) before its check finished: {tail}"
    return f"crashed the process (exit status {returncode}: {tail})"


class _Channel:
    """JSON lines from the child's pipe, each read with a deadline."""

    def __init__(self, fd: int) -> None:
        self.fd, self.buffer = fd, b""

    def read(self, deadline: float) -> dict | None | str:
        """The next message; None when the child closed the pipe (it ended); "timeout" at the deadline."""
        while b"\n" not in self.buffer:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([self.fd], [], [], left)[0]:
                return "timeout"
            chunk = os.read(self.fd, 65536)
            if not chunk:
                return None
            self.buffer += chunk
        line, self.buffer = self.buffer.split(b"\n", 1)
        return json.loads(line)


def child_env(device: str) -> dict[str, str]:
    """The checking child's environment: this process's, with its import path, and on CUDA only the GPU that is
    current here (the one `tune --devices` gave this process, say), which the child sees as its device 0."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    torch = sys.modules.get("torch")
    if device == "cuda" and torch is not None and torch.cuda.is_initialized():
        env["CUDA_VISIBLE_DEVICES"] = visible_gpu_name(torch.cuda.current_device())
    return env


def probe(spec: KernelSpec, definition: OpDefinition, reference: Callable[..., Any], shapes: Sequence[dict], *,
          device: str, seed: int, timeout_s: float) -> str | None:
    """None if the candidate passed its check in a child process, else why not."""
    # A planned op's reference is a Planner around a plan class: the child builds its own from the class.
    names = {"make_inputs": target_of(definition.make_inputs),
             "reference": target_of(getattr(reference, "make_plan", reference))}
    unnamed = [k for k, v in names.items() if v is None]
    if unnamed:
        raise TuningError(f"op {definition.op!r} cannot be checked in isolation: its {' and '.join(unnamed)} "
                          "is not an importable module-level function; define it at module level or tune without "
                          "isolation")
    env = child_env(device)
    read_fd, write_fd = os.pipe()
    request = {"target": spec.target, "op": definition.op, "shapes": list(shapes), "device": device, "seed": seed,
               "rtol": definition.rtol, "atol": definition.atol, "channel": write_fd, "planned": definition.planned,
               **names}
    with tempfile.TemporaryFile() as stderr:
        try:
            child = subprocess.Popen([sys.executable, "-m", "autosel.isolate"], stdin=subprocess.PIPE,
                                     stdout=subprocess.DEVNULL, stderr=stderr, env=env, pass_fds=(write_fd,))
        finally:
            os.close(write_fd)  # the child holds the only write end: its end closes the pipe
        try:
            child.stdin.write(json.dumps(request).encode())
            child.stdin.close()
            reason, stage = _listen(_Channel(read_fd), timeout_s, definition.op)
        except BrokenPipeError:  # it ended before reading its request
            reason, stage = None, "start"
        finally:
            if child.poll() is None:
                child.kill()
            child.wait()
            os.close(read_fd)
        if reason is None:
            stderr.seek(0)
            ended = _describe_exit(child.returncode, stderr.read().decode(errors="replace"))
            if stage == "reference":  # before any candidate ran: blaming the candidate would reject every one
                raise TuningError(f"op {definition.op!r}: its reference ({names['reference']}) {ended} in the "
                                  "isolated check's process, before any candidate ran; fix the reference")
            return ended if stage == "check" else (f"its isolated check could not start ({ended}); check that the "
                                                   "op's make_inputs and reference import in a fresh interpreter")
    return reason or None


def _listen(channel: _Channel, timeout_s: float, op: str) -> tuple[str | None, str]:
    """(the child's answer: "" (passed) or a reason, None when it ended without one; the stage it reached: "start",
    "reference" (running the op's reference alone) or "check")."""
    ready = channel.read(time.monotonic() + STARTUP_TIMEOUT_S)
    if ready == "timeout":
        return (f"its isolated check did not start within {STARTUP_TIMEOUT_S:g} s (the child's interpreter, "
                "torch and the op's functions loading; killed)"), "start"
    if ready is None:
        return None, "start"
    ran = channel.read(time.monotonic() + timeout_s)
    if ran == "timeout":
        raise TuningError(f"op {op!r}: its reference gave no answer within {timeout_s:g} s in the isolated check's "
                          "process, before any candidate ran (killed); fix the reference")
    if ran is None:
        return None, "reference"
    answer = channel.read(time.monotonic() + timeout_s)
    if answer == "timeout":
        return f"hung: no answer from its check within {timeout_s:g} s (killed)", "check"
    if answer is not None and "op_error" in answer:  # the op's own reference or inputs failed: no candidate's fault
        raise TuningError(answer["op_error"])
    return (None if answer is None else answer["reason"] or ""), "check"


def _child() -> None:
    request = json.loads(sys.stdin.read())
    fd = request["channel"]

    def say(message: dict) -> None:
        os.write(fd, (json.dumps(message) + "\n").encode())

    definition = OpDefinition(request["op"], shapes=request["shapes"],
                              make_inputs=resolve_target(request["make_inputs"]),
                              rtol=request["rtol"], atol=request["atol"], planned=request["planned"])
    reference = kernel_of(definition, resolve_target(request["reference"]))
    say({"ready": True})
    _run_alone(reference, definition, request)  # a reference that crashes the process ends it here, blamed on it
    say({"reference": "ran"})
    try:
        fn = kernel_of(definition, resolve_target(request["target"]))
    except BaseException as exc:  # an import that exits is the candidate's failure too
        say({"reason": f"could not load {request['target']!r}: {type(exc).__name__}: {exc}"})
        return
    try:
        report = checks.check_candidate(fn, definition, reference, request["shapes"], device=request["device"],
                                 seed=request["seed"])
    except TuningError as exc:
        say({"op_error": str(exc)})
        return
    if report.reason is None:
        report.reason = _call_again(fn, definition, request)
    say({"reason": report.reason})


def _inputs_per_shape(definition: OpDefinition, request: dict) -> Iterator[tuple[dict, tuple]]:
    """Each shape with its inputs, seeded as check_candidate seeds them (the seed plus the shape's index)."""
    import torch

    for index, shape in enumerate(request["shapes"]):
        torch.manual_seed(request["seed"] + index)
        yield shape, definition.make_inputs(dict(shape), request["device"])


def _run_alone(reference: Callable[..., Any], definition: OpDefinition, request: dict) -> None:
    """Call the op's reference on every shape before the candidate runs, so that a reference that crashes the
    process is told apart from a candidate that does. One that raises is left to the check, which names it."""
    from autosel.timing import synchronize

    try:
        for _, args in _inputs_per_shape(definition, request):
            reference(*args)
            synchronize(request["device"])
    except (Exception, SystemExit):
        return


def _call_again(fn: Callable[..., Any], definition: OpDefinition, request: dict) -> str | None:
    """Call a candidate that passed CALLS_PER_SHAPE more times per shape: a crash from its Nth call ends here."""
    from autosel.timing import synchronize

    unsupported = getattr(fn, "unsupported", None)  # a planned op's Planner: shapes its backend cannot run
    for shape, inputs in _inputs_per_shape(definition, request):
        if unsupported is not None and unsupported(inputs[0]) is not None:  # skipped by the check too
            continue
        args = checks.clone_args(inputs)
        for call in range(CALLS_PER_SHAPE):
            try:
                fn(*args)
                synchronize(request["device"])
            except (Exception, SystemExit) as exc:
                return f"raised {type(exc).__name__} on call {call + 2} at {shape_text(shape)}: {exc}"
    return None


if __name__ == "__main__":
    _child()
