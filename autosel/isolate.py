"""Isolated checks: run one candidate's correctness check in a child process with a timeout, so a kernel
that segfaults, hangs or leaves a sticky CUDA error is recorded as data instead of taking the tune down.

The child gets everything by name ("module:attr"), so the op's make_inputs and reference must be importable
module-level functions. Candidates that pass are then checked again and timed in the parent, interleaved.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from typing import Any, Callable, Sequence

from autosel.errors import TuningError
from autosel.spec import KernelSpec, OpDefinition, resolve_target, target_of


def _describe_exit(returncode: int, stderr: str) -> str:
    if returncode < 0:
        try:
            name = signal.Signals(-returncode).name
        except ValueError:
            name = f"signal {-returncode}"
        return f"crashed the process ({name})"
    tail = stderr.strip().splitlines()[-1] if stderr.strip() else "no message"
    return f"crashed the process (exit status {returncode}: {tail})"


def probe(spec: KernelSpec, definition: OpDefinition, reference: Callable[..., Any], shapes: Sequence[dict], *,
          device: str, seed: int, timeout_s: float) -> str | None:
    """None if the candidate passed its check in a child process, else why not."""
    names = {"make_inputs": target_of(definition.make_inputs), "reference": target_of(reference)}
    unnamed = [k for k, v in names.items() if v is None]
    if unnamed:
        raise TuningError(f"op {definition.op!r} cannot be checked in isolation: its {' and '.join(unnamed)} "
                          "is not an importable module-level function; define it at module level or tune without "
                          "isolation")
    request = {"target": spec.target, "op": definition.op, "shapes": list(shapes), "device": device, "seed": seed,
               "rtol": definition.rtol, "atol": definition.atol, **names}
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    try:
        done = subprocess.run([sys.executable, "-m", "autosel.isolate"], input=json.dumps(request), env=env,
                              capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return f"hung: no answer from its check within {timeout_s:g} s (killed)"
    if done.returncode != 0:
        return _describe_exit(done.returncode, done.stderr)
    answer = json.loads(done.stdout.strip().splitlines()[-1])
    return answer["reason"]


def _child() -> None:
    from autosel.tuner import check_candidate

    request = json.loads(sys.stdin.read())
    definition = OpDefinition(request["op"], shapes=request["shapes"],
                              make_inputs=resolve_target(request["make_inputs"]),
                              rtol=request["rtol"], atol=request["atol"])
    try:
        fn = resolve_target(request["target"])
    except Exception as exc:
        print(json.dumps({"reason": f"could not load {request['target']!r}: {type(exc).__name__}: {exc}"}))
        return
    report = check_candidate(fn, definition, resolve_target(request["reference"]), request["shapes"],
                             device=request["device"], seed=request["seed"])
    print(json.dumps({"reason": report.reason}))


if __name__ == "__main__":
    _child()
