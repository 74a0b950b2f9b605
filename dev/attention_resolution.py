"""How finely attention.decode's fastest backend changes from batch to batch, against how finely the representative
batches cover the batches a server sees: what a per-bucket decision can reach on held-out batches, and at what tune
cost. Reads result files and a tune's DB (no GPU), writes one result file of kind attention_resolution.

- Neighbour cost: for every two decode batches of the given held-out runs (one platform), batch B's time on the
  backend that was fastest on batch A, over B's own best, grouped by the distance between their buckets (the sum
  of log2 gaps over every number of the key, as a planned op routes to its nearest tuned bucket). It is what the
  best possible tune of a bucket at that distance costs B: a perfect reading of its neighbour.
- Coverage: how far a held-out-like sample (the held-out generator's batches, seeds 1000-1199, 32 each: not the
  seeds a held-out run is judged on) lies from the nearest representative bucket, now and with more representative
  batches picked greedily to bring the most of it within distance 1 (one number one power of two away).
- Estimate: the sample's geometric mean over the per-batch best if each batch ran its nearest bucket's perfect
  reading (the neighbour cost at its distance), and the warm tune seconds of that many representative batches (from
  the tune's stored evidence, tune_s per bucket).

    python dev/attention_resolution.py --tune-db results/attention-h100-runs/after/tune2.db \\
        results/attention-heldout-cuda-sm-90-nvidia-h100-80gb-hbm3-132-2026-12-05T15*.json
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import sys
from pathlib import Path
from types import SimpleNamespace

import torch

from attention_route_whatif import open_db  # dev/, the folder this script runs from
from autosel.bench.attention_heldout import LAYOUTS, bucket_of, decode_batches
from autosel.bench.results import provenance, write_record
from autosel.buckets import log_gaps
from autosel.ops import attention as att

SAMPLE_SEEDS = range(1000, 1200)
# Distance classes: 0 (the same bucket), then up to 1, 2, 3, 4 and beyond.
CLASSES = (0.0, 1.0, 2.0, 3.0, 4.0, math.inf)
EXTRA = (0, 8, 16, 32, 64, 128)  # more representative batches, greedily picked


def distance(a: tuple, b: tuple) -> float:
    """The sum of log2 gaps over the numbers of two decode bucket keys, as BucketTable.nearest ranks tuned buckets;
    infinite where the dtype differs."""
    gaps = log_gaps(a, b)
    return math.inf if gaps is None else sum(gaps)


def distance_class(d: float) -> int:
    return next(i for i, top in enumerate(CLASSES) if d <= top)


def neighbour_cost(rows: list[dict], mode: str) -> list[dict]:
    """Per distance class: pairs, and the geometric mean of B's time on A's fastest over B's best."""
    logs: dict[int, list[float]] = {i: [] for i in range(len(CLASSES))}
    for a, b in itertools.permutations(rows, 2):
        d = distance(tuple(a["bucket"]), tuple(b["bucket"]))
        ta, tb = a[f"{mode}_us"], b[f"{mode}_us"]
        if d == math.inf or not ta or not tb:
            continue
        fastest = min(ta, key=ta.get)
        if fastest in tb:
            logs[distance_class(d)].append(math.log(tb[fastest] / min(tb.values())))
    return [{"within": CLASSES[i], "pairs": len(v), "cost": round(math.exp(sum(v) / len(v)), 4) if v else None,
             "beyond_10pct": round(sum(x > math.log(1.1) for x in v) / len(v), 4) if v else None}
            for i, v in logs.items()]


def shape_bucket(shape: dict) -> tuple:
    seq = att.lengths(shape["batch"], shape["kv"], shape.get("spread", "uniform"))
    return att.decode_bucket(SimpleNamespace(
        batch_size=len(seq), total_kv=sum(seq), max_kv=max(seq), total_q=len(seq), num_q_heads=shape["q_heads"],
        num_kv_heads=shape["kv_heads"], head_dim=shape["head_dim"], page_size=shape["page_size"],
        dtype="torch." + shape.get("dtype", "bfloat16")))


def candidates() -> list[tuple[str, tuple]]:
    """Representative decode batches a tune could add: the held-out generator's layouts, batch 1-512 and mean KV
    128-32k in powers of two (1M KV tokens at most, as DECODE_SHAPES), equal, mixed or wide lengths."""
    out = []
    for name, (heads, kv_heads, head_dim, page) in LAYOUTS.items():
        for batch, kv, spread in itertools.product([2 ** i for i in range(10)], [2 ** i for i in range(7, 16)],
                                                   ("uniform", "mixed", "wide")):
            if batch * kv > 2 ** 20 or (batch == 1 and spread != "uniform"):
                continue
            shape = att._shape((heads, kv_heads, head_dim), page_size=page, batch=batch, kv=kv,
                               **({"spread": spread} if spread == "mixed" else {}))
            out.append((f"{name} batch {batch} kv {kv} {spread}", shape_bucket(shape)))
    return out


def coverage(sample: list[tuple], tuned: list[tuple], costs: list[dict]) -> list[dict]:
    """For each count of extra representative batches (EXTRA): the share of the sample at each distance class
    and the estimated geometric mean over the per-batch best."""
    cands = candidates()
    dist = torch.tensor([[distance(s, c) for s in sample] for _, c in cands])
    near = torch.tensor([min(distance(s, t) for t in tuned) for s in sample])
    log_cost = torch.tensor([math.log(c["cost"]) if c["cost"] else 0.0 for c in costs])
    beyond = torch.tensor([c["beyond_10pct"] or 0.0 for c in costs])
    bounds = torch.tensor(CLASSES[:-1])
    out, added = [], []
    for step in range(max(EXTRA) + 1):
        if step in EXTRA:
            cls = torch.bucketize(near, bounds)  # index of the first class whose bound is >= the distance
            share = [round(float((cls == i).float().mean()), 4) for i in range(len(CLASSES))]
            p = float(beyond[cls].mean())  # the chance that one batch runs more than 10% behind its best
            out.append({"extra": step, "share": share, "within_1": round(sum(share[:2]), 4),
                        "estimate": round(math.exp(float(log_cost[cls].mean())), 4), "beyond_10pct": round(p, 4),
                        "worst_within_10pct_of_32": round((1 - p) ** 32, 4), "added": list(added)})
        gain = (torch.minimum(dist, near) <= 1).sum(dim=1)
        pick = int(gain.argmax())
        near = torch.minimum(near, dist[pick])
        added.append(cands[pick][0])
    return out


def tune_seconds(db: str) -> dict:
    """Warm tune seconds of attention.decode per mode and per representative batch, from the evidence."""
    out = {}
    with open_db(db) as conn:
        for mode, evidence in conn.execute("select mode, evidence from decisions where op = 'attention.decode' and "
                                           "bucket = '*'"):
            ev = json.loads(evidence)
            shapes = len(ev["candidates"][0]["shapes"])
            out[mode] = {"tune_s": round(ev["tune_s"], 1), "batches": shapes,
                         "per_batch_s": round(ev["tune_s"] / shapes, 2)}
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("heldout", nargs="+", help="attention-heldout result files of one platform")
    parser.add_argument("--tune-db", required=True, help="a warm tune's DB, or its .db.xz (its evidence holds tune_s)")
    parser.add_argument("--results", default="results", help="folder of the result file written")
    args = parser.parse_args(argv)
    records = [json.loads(Path(f).read_text()) for f in args.heldout]
    platforms = {r["platform_key"] for r in records}
    if len(platforms) != 1:
        raise SystemExit(f"held-out runs of one platform please; these are of {sorted(platforms)}")
    rows = [r for rec in records for r in rec["results"]["rows"] if r["op"] == "attention.decode"]
    sample = [bucket_of("decode", b) for seed in SAMPLE_SEEDS for b in decode_batches(32, seed, 262144)]
    tuned = [shape_bucket(s) for s in att.DECODE_SHAPES.gpu]
    tune = tune_seconds(args.tune_db)
    per_batch_s = sum(m["per_batch_s"] for m in tune.values())
    body: dict = {"heldout": [Path(f).name for f in args.heldout], "decode_batches": len(rows),
                  "sample": len(sample), "sample_buckets": len(set(sample)), "representative": len(tuned),
                  "classes": list(CLASSES), "tune": tune,
                  "modes": {}}
    for mode in ("eager", "graph"):
        costs = neighbour_cost(rows, mode)
        body["modes"][mode] = {"neighbour_cost": costs, "coverage": coverage(sample, tuned, costs)}
    title = ("{mode} decode: held-out batch B on the fastest backend of batch A, over B's best, by the distance "
             "between their buckets (sum of log2 gaps)")
    tables = []
    for mode, m in body["modes"].items():
        tables.append({"title": title.format(mode=mode), "columns": ["distance", "pairs", "B's time over its best",
                                                               "pairs beyond 1.10"],
                       "rows": [["0" if c["within"] == 0 else f"<= {c['within']:g}" if c["within"] < math.inf
                                 else "> 4", c["pairs"], c["cost"], c["beyond_10pct"]] for c in m["neighbour_cost"]]})
        tables.append({"title": f"{mode} decode: the sample's distance to the nearest representative bucket, and the "
                                "estimate if each batch ran its nearest bucket's perfect reading",
                       "columns": ["representative batches", "at 0", "within 1", "estimate over the per-batch best",
                                   "chance 32 batches' worst is within 1.10", "warm decode tune (s, both modes)"],
                       "rows": [[len(tuned) + c["extra"], c["share"][0], c["within_1"], c["estimate"],
                                 c["worst_within_10pct_of_32"],
                                 round((len(tuned) + c["extra"]) * per_batch_s, 1)]
                                for c in m["coverage"]]})
    body["tables"] = tables
    held = records[0]
    record = {**provenance("attention_resolution"), "platform_key": held["platform_key"],
              "versions": held["versions"], "results": body}
    path = write_record(record, Path(args.results))
    for t in tables:
        print(t["title"])
        for row in t["rows"]:
            print("   ", row)
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
