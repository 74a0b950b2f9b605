"""Call 20-3 (docs/H200.md, "Stop 20"): python3 tools/two_workers_one_gpu_probe.py OUT.db

A whole tune (every built-in op, both modes, --force, budget 20 s) through tune_ops(devices=...) with two workers
on the one GPU: this process and a spawned one (CUDA_VISIBLE_DEVICES=0). Prints when the spawned worker was up,
who tuned what when, and the wall time. The workers share the GPU, so the times are an upper bound for two GPUs
and the decisions are not a stability figure."""
import logging, sys, time

if __name__ == "__main__":
    t0 = time.monotonic()
    logging.basicConfig(level=logging.WARNING, format="%(relativeCreated)6.0f ms %(name)s: %(message)s")
    logging.getLogger("autosel.parallel").setLevel(logging.DEBUG)
    from autosel import config, parallel, tuning
    from autosel.platforms import PlatformInfo

    platform = PlatformInfo.detect(device_index=0)
    parallel.gpu_workers = lambda devices: [parallel.Worker("cuda:0", {}, platform, in_process_device=0),
                                            parallel.Worker("cuda:0b", {"CUDA_VISIBLE_DEVICES": "0"}, platform)]
    seen = []
    def on_event(e):
        if e.kind in ("started", "chosen"):
            seen.append((round(time.monotonic() - t0, 1), e.device, e.kind, e.op, e.mode))
    out = tuning.tune_ops(force=True, budget_s=20, devices="all", on_event=on_event,
                          settings=config.read_settings({"AUTOSEL_DB": sys.argv[1]}))
    print(*seen, sep="\n")
    print([o.status for o in out], f"wall in the script {time.monotonic() - t0:.1f} s")
