"""Spreads the jobs of a batch tune over GPUs: one worker per GPU, longest job first, one tuning DB.

The first GPU's worker is the tune's own process: it tunes there in its main thread while a second thread serves
the others, so a tune over one GPU starts no process and one over several pays no process start before its first
job. Every other worker is a spawned process started with CUDA_VISIBLE_DEVICES naming its GPU (ROCm's HIP
runtime reads it too), so it sees one device as device 0. Each tunes exactly as a single-process `autosel tune`
does: the same Tuner, seed, policy and lease (batch.run_job). GPUs of different kinds (platform keys) are
grouped: every job is done once per kind, by a worker of that kind, so each kind gets its own decisions. Every
worker writes into the one DB, whose WAL mode and per-(platform, op, mode) leases already let processes write at
once.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import os
import pickle
import signal
import sys
import threading
import time
from dataclasses import dataclass, replace
from multiprocessing.connection import wait
from typing import Callable, Iterator, Sequence

from autosel import config
from autosel.decisions import OP_LEVEL_BUCKET, Decision
from autosel.errors import DeviceError, Terminated
from autosel.jobs import TuneJob, TuneOutcome
from autosel.platforms import PlatformInfo, visible_gpu_name

log = logging.getLogger(__name__)

# A job never tuned on this platform is guessed at this many seconds per candidate and shape; the guess only
# orders such jobs against each other and against the stored tune_s of others.
GUESS_S_PER_CANDIDATE_SHAPE = 1.0


@dataclass(frozen=True)
class Worker:
    """One worker: its name in messages ("cuda:1"), the variables a spawned worker process starts with, and the
    platform it tunes for (jobs go only to workers of their own platform). in_process_device: this process's
    index of the GPU when the worker is this process itself (env unused); None: a spawned process."""

    name: str
    env: dict[str, str]
    platform: PlatformInfo
    in_process_device: int | None = None


def parse_devices(devices: str | Sequence[int], count: int) -> list[int]:
    """The GPU indices that "all", "0,2" or [0, 2] name among `count` visible GPUs, in order, each once."""
    if isinstance(devices, str):
        text = devices.strip().lower()
        if text == "all":
            return list(range(count))
        try:
            devices = [int(part) for part in text.split(",")]
        except ValueError:
            raise DeviceError(f"devices must be 'all' or GPU indices separated by commas such as '0,1', "
                              f"got {devices!r}") from None
    indices = list(dict.fromkeys(devices))
    wrong = [i for i in indices if not 0 <= i < count]
    if wrong:
        raise DeviceError(f"GPU {', '.join(map(str, wrong))} asked for, but this process sees {count} GPU(s)"
                          f"{f' (0 to {count - 1})' if count else ''}; pass indices among them, or 'all'")
    return indices


def gpu_workers(devices: str | Sequence[int]) -> list[Worker]:
    """One worker per GPU named by `devices` ("all", "0,1" or [0, 1]), each with its platform detected here; the
    first GPU's worker is this process."""
    import torch

    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if not count:
        seen = f" with CUDA_VISIBLE_DEVICES={visible!r}" if visible is not None else ""
        raise DeviceError(f"no GPU is visible to torch here{seen} (torch.cuda.is_available() is False), so there "
                          "are no GPUs to spread the tune over; leave out devices (--devices) to tune on this "
                          "machine's current device")
    indices = parse_devices(devices, count)  # among the GPUs this process sees
    return [Worker(f"cuda:{i}", {"CUDA_VISIBLE_DEVICES": visible_gpu_name(i)}, PlatformInfo.detect(device_index=i),
                   in_process_device=i if i == indices[0] else None) for i in indices]


def earlier_tune_s(db) -> dict[tuple[str, str, str], float]:
    """Per (op, mode, platform key), the tune_s of the newest op-level decision that has one (any versions), from
    one read of the DB."""
    newest: dict[tuple[str, str, str], Decision] = {}
    for d, _ in db.decisions():
        key = (d.op, d.mode, d.platform_key)
        if d.bucket == OP_LEVEL_BUCKET and d.tune_s > 0 and (key not in newest
                                                              or d.created_at > newest[key].created_at):
            newest[key] = d
    return {key: d.tune_s for key, d in newest.items()}


def kinds(workers: Sequence[Worker]) -> list[PlatformInfo]:
    """One platform per kind of GPU among the workers (their platform keys), in the workers' order: what a tune
    over them plans its jobs for."""
    return list({w.platform.key: w.platform for w in workers}.values())


def estimate_s(job: TuneJob, earlier: dict[tuple[str, str, str], float]) -> float:
    """How long the job will take: its earlier tune_s on its platform (earlier_tune_s), else a guess from its
    candidates and shapes."""
    return earlier.get((job.op, job.mode, job.platform_key)) or (
        GUESS_S_PER_CANDIDATE_SHAPE * len(job.eligible) * len(job.shapes))


def longest_first(jobs: Sequence[TuneJob], db) -> list[int]:
    """The indices of `jobs`, longest estimate first (ties in the given order): the order workers take them, so
    that a long job does not start last and keep one GPU busy while the others idle."""
    earlier = earlier_tune_s(db)
    estimates = [estimate_s(job, earlier) for job in jobs]
    return sorted(range(len(jobs)), key=lambda i: -estimates[i])


def run_jobs(jobs: Sequence[TuneJob], workers: Sequence[Worker], *, run: Callable[..., TuneOutcome],
             open_db: Callable[[config.Settings], object], settings: config.Settings, budget_s: float,
             force: bool = False, isolate_timeout_s: float | None = None,
             on_event: Callable[[object, str], None] | None = None) -> list[TuneOutcome]:
    """Tune each job on a worker of its platform; the outcomes, in the order of `jobs`.

    run: what tunes one job in a worker (batch.run_job), a module-level function so that a spawned worker
    receives it by name; open_db: the tuning DB for `settings`, opened once per process (tuning.database). Both
    are handed in so that this module, which only carries jobs to workers, never imports the deciding above it.

    The jobs wait longest first in their platform's queue and a worker takes the next when it is free: the one
    that is this process (Worker.in_process_device) at once, spawned ones once they are up. Every worker's
    TuneEvents come back as on_event(event, worker name), one call at a time. A job that fails is a "failed"
    outcome, as in a single-process tune; so is one whose worker process died, and one that no worker of its
    platform is left for. A kernel that crashes this process ends the tune, as a tune without devices does
    (isolate_timeout_s checks candidates in child processes first).
    """
    here = [w for w in workers if w.in_process_device is not None]
    if len(here) > 1:
        raise ValueError(f"only one worker can be this process, got {', '.join(w.name for w in here)}")
    outcomes: dict[int, TuneOutcome] = {}
    payloads: dict[int, bytes] = {}
    keys = {w.platform.key for w in workers}
    for index, job in enumerate(jobs):
        if job.platform_key not in keys:
            outcomes[index] = _failed(job, f"no worker is a {job.platform_key}")
            continue
        try:
            payloads[index] = pickle.dumps(job)
        except Exception as exc:  # a lambda in the op's definition cannot reach another process
            outcomes[index] = _failed(job, f"cannot be sent to a worker process ({type(exc).__name__}: {exc}); "
                                      "declare the op's shapes, make_inputs and bucket as module-level functions, "
                                      "or tune without devices")
    if not payloads:
        return [outcomes[i] for i in range(len(jobs))]
    order = [i for i in longest_first(jobs, open_db(settings)) if i in payloads]
    context = multiprocessing.get_context("spawn")  # a fresh interpreter, started with the worker's variables
    queues = {key: context.Queue() for key in keys}
    for i in order:
        queues[jobs[i].platform_key].put((i, payloads[i]))
    for w in workers:
        queues[w.platform.key].put(None)  # one stop sign per worker, after the jobs
    options = (run, open_db, settings, budget_s, force, isolate_timeout_s)
    processes, pipes, failure, one_at_a_time = {}, {}, [], threading.Lock()

    def stop(exc: BaseException) -> None:  # on_event raised, say: every worker's next send fails, none blocks
        failure.append(exc)
        for pipe in pipes.values():
            pipe.close()

    def deliver(event, name: str) -> None:  # from the serving thread and, for its own jobs, this one
        if on_event is not None:
            with one_at_a_time:
                try:
                    on_event(event, name)
                except BaseException as exc:
                    stop(exc)
                    raise

    def serve() -> None:
        try:
            _serve(jobs, outcomes, {w.name: w.platform.key for w in workers}, processes, pipes, deliver)
        except BaseException as exc:
            stop(exc)

    try:
        for w in workers:
            # A pipe per worker: send() is written before it returns, so what a worker said before it crashed
            # is still read, and the end of the pipe says it exited.
            pipes[w.name], child_end = context.Pipe(duplex=False)
            if w.in_process_device is not None:
                processes[w.name], here_end = _ThisProcess(), child_end
                continue
            processes[w.name] = context.Process(target=_work_spawned, name=f"autosel-tune-{w.name}", daemon=True,
                                                args=(w.name, queues[w.platform.key], child_end, *options))
            with _environment(w.env):
                processes[w.name].start()
            child_end.close()
        if here:
            server = threading.Thread(target=serve, name="autosel-tune-serve", daemon=True)
            server.start()
            try:
                _work_here(here[0], queues[here[0].platform.key], here_end, *options,
                           on_event=lambda event: deliver(event, here[0].name))
            except BaseException:
                if not failure:  # else the send failed because serving did: that is the error to raise
                    raise
            finally:
                here_end.close()  # the server reads the end of this worker
            server.join()
        else:
            serve()
        if failure:
            raise failure[0]
        for p in processes.values():
            p.join(timeout=10)
    finally:
        for p in processes.values():
            if p.is_alive():
                p.terminate()
    return [outcomes[i] for i in range(len(jobs))]


def _serve(jobs, outcomes, kind_of, processes, pipes, on_event) -> None:
    """The parent's side: pass events on, collect outcomes, and fail a job whose worker died and the jobs no
    worker of their platform is left for."""
    gone, current, began = {}, {}, time.monotonic()  # gone: worker -> exit code; current: worker -> its job
    while len(outcomes) < len(jobs):
        left = {kind_of[name] for name in processes if name not in gone}
        for i, job in enumerate(jobs):
            if i not in outcomes and job.platform_key not in left:
                outcomes[i] = _failed(job, f"no worker for {job.platform_key} is left to tune it ({_exits(gone)}); "
                                           "see the workers' errors above")
        open_pipes = {pipes[name]: name for name in processes if name not in gone}
        for pipe in wait(list(open_pipes)):
            name = open_pipes[pipe]
            try:
                kind, *rest = pipe.recv()
            except EOFError:  # the worker exited, and everything it sent has been read
                processes[name].join()
                gone[name] = processes[name].exitcode
                if name in current:
                    i = current.pop(name)
                    outcomes[i] = replace(_failed(jobs[i], f"its worker {name} died (exit code {gone[name]}) while "
                                                           "tuning it; --isolate (isolate_timeout_s=) makes a crashing "
                                                           "candidate a rejection reason instead"), device=name)
                continue
            if kind == "ready":
                log.debug("worker %s is up, %.1f s after the workers started", name, time.monotonic() - began)
            elif kind == "took":
                current[name] = rest[0]
            elif kind == "event":
                on_event(rest[0], name)
            elif kind == "done":
                current.pop(name, None)
                outcome = _failed(jobs[rest[0]], rest[1]) if isinstance(rest[1], str) else rest[1]
                outcomes[rest[0]] = replace(outcome, device=name)


class _ThisProcess:
    """What _serve and run_jobs see of the worker that is the tune's own process: it is never a process to wait
    for or stop, and it ends by closing its pipe."""

    exitcode = 0

    def join(self, timeout: float | None = None) -> None:
        pass

    def is_alive(self) -> bool:
        return False


def _exits(gone: dict) -> str:
    return ", ".join(f"{name} exited with code {code}" for name, code in gone.items()) or "none started"


def _failed(job: TuneJob, detail: str) -> TuneOutcome:
    return TuneOutcome(job.op, job.mode, "failed", None, detail, platform_key=job.platform_key)


@contextlib.contextmanager
def _environment(env: dict[str, str]) -> Iterator[None]:
    """os.environ with `env` set while a worker starts: a spawned child starts with the parent's environment,
    so its CUDA_VISIBLE_DEVICES is in place before anything in it imports torch."""
    saved = {name: os.environ.get(name) for name in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def _work(name: str, jobs, parent, run: Callable[..., TuneOutcome], open_db: Callable[[config.Settings], object],
          settings: config.Settings, budget_s: float, force: bool, isolate_timeout_s: float | None,
          platform: PlatformInfo | None = None,
          on_event: Callable[[object], None] | None = None) -> None:
    """A worker: take jobs until the parent sends None; tune each as `autosel tune` does on one GPU. The worker
    that is the tune's own process is given its platform and passes its events on itself (no pickling, no
    waking the serving thread while it times); a spawned worker detects its platform and sends its events."""
    from autosel import platforms

    platform = platform or platforms.current_platform()
    on_event = on_event or (lambda event: parent.send(("event", event)))
    db = open_db(settings)
    parent.send(("ready",))
    while (item := jobs.get()) is not None:
        index, payload = item
        parent.send(("took", index))
        parent.send(("done", index, _tune_one(name, payload, platform, db, on_event, run, budget_s=budget_s,
                                             force=force, isolate_timeout_s=isolate_timeout_s)))


TERMINATION_SIGNALS = ("SIGTERM", "SIGHUP")  # what a container runtime's stop and a closed terminal send


@contextlib.contextmanager
def termination_raises() -> Iterator[None]:
    """Inside, SIGTERM and SIGHUP raise Terminated in the main thread, as Ctrl-C raises KeyboardInterrupt, so that
    every `finally` on the way out runs: the isolation child is killed and the tuning lease released. Their
    default action ended the process at once and left the child running the candidate (reparented to init) and
    the lease held until it expired. A second signal while the first unwinds is ignored, so the clean-up is not
    cut short; a signal ignored on entry (nohup) stays ignored. Outside the main thread nothing changes (Python
    sets signal handlers there only)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    raised: list[int] = []

    def handler(signum: int, frame) -> None:
        if not raised:
            raised.append(signum)
            raise Terminated(signum)

    saved = {}
    for name in TERMINATION_SIGNALS:
        number = getattr(signal, name, None)  # Windows has no SIGHUP
        if number is not None and signal.getsignal(number) is not signal.SIG_IGN:
            saved[number] = signal.signal(number, handler)
    try:
        yield
    finally:
        for number, previous in saved.items():
            signal.signal(number, previous)


def _work_spawned(*args) -> None:
    """A spawned worker's process. Ctrl-C reaches every process of the terminal's group: the worker then exits
    with code 130 and no traceback (one per GPU would bury the message of the tune's own process, which stops
    the tune); a job it was tuning is failed, naming that exit code. SIGTERM (the parent stopping its workers)
    and SIGHUP end it with 128 + the signal's number, after its clean-up (termination_raises)."""
    try:
        with termination_raises():
            _work(*args)
    except Terminated as exc:
        sys.exit(128 + exc.signum)
    except KeyboardInterrupt:
        sys.exit(130)


def _work_here(worker: Worker, jobs, parent, *options, on_event: Callable[[object], None]) -> None:
    """The worker that is this process, in this thread, with its GPU as the current device meanwhile."""
    if worker.platform.torch_device != "cuda":
        _work(worker.name, jobs, parent, *options, platform=worker.platform, on_event=on_event)
        return
    import torch

    with torch.cuda.device(worker.in_process_device):
        _work(worker.name, jobs, parent, *options, platform=worker.platform, on_event=on_event)


def _tune_one(name: str, payload: bytes, platform: PlatformInfo, db, on_event, run: Callable[..., TuneOutcome],
              **options) -> TuneOutcome | str:
    """The job's outcome, or why it could not be read here (the parent makes that its failed outcome)."""
    try:
        job = pickle.loads(payload)
    except Exception as exc:  # a module the op's definition names is not importable in the worker
        log.exception("worker %s: a job could not be read", name)
        return f"could not be read on {name}: {type(exc).__name__}: {exc}"
    if job.platform_key != platform.key:  # the worker's own detection disagrees with the parent's: never mix kinds
        return _failed(job, f"worker {name} is a {platform.key}, not a {job.platform_key}")
    return run(job, platform=platform, db=db, on_event=on_event, **options)  # a failure is its outcome
