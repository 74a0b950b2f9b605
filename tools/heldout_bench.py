"""Held-out shapes: on shapes that are not among the representative shapes (odd token counts, other models'
sizes), the time of the dispatcher's choice, of the op-level winner and of every fixed backend, each over the
per-shape best; geometric mean and worst, per op and mode. Decisions come from the DB as get_kernel sees it
(run `autosel tune` first); every backend is checked against the reference and timed by autosel's own tuner
(three interleaved rounds, nothing dropped, nothing recorded).

    autosel tune --budget-s 20 && python tools/heldout_bench.py --out DIR
    python tools/heldout_bench.py --out DIR --op 'layernorm.*' --mode eager
    python tools/heldout_bench.py --out DIR --shapes set1     # the shapes of docs/BENCHMARKS.md section 2

Shape sets: set1 is the set the nearest-bucket rule and the representative shapes were chosen on (in-sample),
kept to reproduce the published table; set2 (the default) was chosen after them and first run in device call
A; set3 was made after that run; set4 after the representative shapes at the eager crossovers were chosen on sets
2 and 3 (docs/BENCHMARKS.md section 2b); set5 after the Triton rmsnorm's row tiles were chosen on set4's figures
(a kernel since reverted; set5 then judged its warps rule, the vendors' PDL off and the direct Triton launches);
set6 was made in stop 22 before any run of it; set7 in stop 24 before any run of it, to judge the Triton kernels
launched from C; set8 after set7's run, when eager ties were given to the vendors over those kernels; set9 in
stop 25 before any run of it, to judge the norms' launch from C through DLPack and eager ties by measured host time;
set10 after set9's run, which showed the tie rule's factor too lax, and after the other kernels were launched from C;
set11 in stop 26 before any run of it, after rope's launch plan was chosen on probes of set10's rope shapes; set12
after set11's run, which placed rope's representative shapes at 4 / 1 heads and (with the tunes of that call) the
eager tie rule's cut at 1.2; set13 in stop 27 before any run of it, to judge stop 26's final code on a fresh tune of
every op; set14 after set13's run, which placed a gated-activation shape at a narrow row and judged rope's programs
of several tokens; set15 after set14's run, which added a second narrow gated row; set16 in stop 28 before any run
of it, after the gated kernel's tiles were chosen on a probe of other shapes; set17 in stop 29 before any run of
it, after call 29-1's probe chose the gated kernel's tiles of 8 rows, its silu and rope's one head a block (set16's
gated widths 1792, 2368 and 3584 and its rope at 5 / 1 heads were in that probe's sample or call 28-4's); set18 after
set17's run and call 29-2's probe, which gave rope at up to 4 heads one head a block too (its silu width 1536 is a
representative shape's, 4096 x 1536, and its gelu widths are set17's silu widths: one kernel serves both); set19 in
stop 30 before any run of it, after call 30-1's probe chose the gated kernel's flat programs (set17's silu widths
1728 and 3456 were in that probe); set20 after call 30-4 gave the norms' rows in blocks of 8192 8 warps; set21 in
stop 31 before any run of it, after call 31-1 gave fused add + rmsnorm 8 warps there from 300 rows; set22 in stop 32
before any run of it, with decode-sized token counts at widths in blocks of 8192 (where the norms' warps at 1-299
rows were never timed); set23 in stop 33 before any run of it, with two token counts in fused add + rmsnorm's
window of 200-299 rows at widths in blocks of 8192; set24 in stop 33 after call 33-5's probe of the gated kernel's
stores, before any run of it, with the gated activations at input + output of about the L2's size; set25 in stop
34 likewise, before the graph-mode timing that writes each call's inputs first; set26 in stop 35 before any run of
it, with four decode-sized token counts (where eager rmsnorm's winners differed on set25); set27 in stop 36 before
any run of it, with Falcon-7B's widths that are no multiple of 128 (hidden 4544); set28 in stop 38 before any run
of it, with Gemma-2-9B's GEMMs and four token counts of 50-97:

    python tools/heldout_bench.py --out DIR --shapes set28

cpu1 is for a CPU (token counts a CPU serves, no gemm.mm): made before any run of it, when the CPU's representative
shapes were given a 4-token shape each, to judge that on shapes no tune timed:

    AUTOSEL_DB=/tmp/empty.db AUTOSEL_DB_PATH=tuning_db/cpu-x86_64-xeon-2.db AUTOSEL_TUNE=off \
        python tools/heldout_bench.py --out DIR --shapes cpu1 --rounds 5

Writes DIR/heldout.md (the tables) and DIR/heldout.json (every median), each with the command, commit and date.
"""

from __future__ import annotations

import argparse
import datetime
import fnmatch
import json
import math
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

from autosel import platforms, selector, tuning
from autosel.dispatch import BucketTable
from autosel.policy import geomean
from autosel.registry import registry

def _rope(tokens, q_heads, kv_heads):
    return {"tokens": tokens, "q_heads": q_heads, "kv_heads": kv_heads, "head_size": 128, "rotary_dim": 128,
            "is_neox": True}


def _held_out(tokens: tuple[int, ...], *, rmsnorm, fused, silu, gelu, rope, mm) -> dict[str, list[dict]]:
    """A set from ten token counts and two widths per op: the norms at both widths and every count; the other
    ops' first width at the odd-placed counts and their second at the even-placed ones, so each op has as many
    shapes as in set1 and a run costs the same device time."""
    halves = (tokens[1::2], tokens[::2])
    return {
        "layernorm.rmsnorm": [{"tokens": t, "hidden": h} for h in rmsnorm for t in tokens],
        "layernorm.fused_add_rmsnorm": [{"tokens": t, "hidden": h} for h in fused for t in tokens],
        "activation.silu_and_mul": [{"tokens": t, "intermediate": i} for i, ts in zip(silu, halves) for t in ts],
        "activation.gelu_and_mul": [{"tokens": t, "intermediate": i} for i, ts in zip(gelu, halves) for t in ts],
        "embeddings.rope": [_rope(t, q, kv) for (q, kv), ts in zip(rope, halves) for t in ts],
        "gemm.mm": [{"m": m, "n": n, "k": k} for (n, k), ms in zip(mm, halves) for m in ms],
    }


# set1: the shapes of device calls 1 and 2 (docs/BENCHMARKS.md section 2), kept to reproduce that table. The
# bucket rule and the representative shapes were then chosen on these shapes' figures: they are in-sample.
# Sizes of Qwen2-7B (hidden 3584, intermediate 18944, 28/4 heads), Mistral-Small-24B / Llama-3-style 6144-wide
# layers, Llama-2-7B (intermediate 11008), Qwen2.5-14B (40/8 heads, intermediate 13824).
TOKENS_1 = (1, 3, 24, 100, 300, 1000, 1500, 3000, 6000, 12000)
SET1 = {
    "layernorm.rmsnorm": [{"tokens": t, "hidden": h} for h in (3584, 6144) for t in TOKENS_1],
    "layernorm.fused_add_rmsnorm": [{"tokens": t, "hidden": h} for h in (3584, 6144) for t in TOKENS_1],
    "activation.silu_and_mul": [{"tokens": t, "intermediate": i} for i in (11008, 13824) for t in TOKENS_1[::2]],
    "activation.gelu_and_mul": [{"tokens": t, "intermediate": i} for i in (11008, 13824) for t in TOKENS_1[::2]],
    "embeddings.rope": [_rope(t, q, kv) for q, kv in ((28, 4), (40, 8)) for t in TOKENS_1[::2]],
    "gemm.mm": [{"m": m, "n": n, "k": k} for n, k in ((4608, 3584), (3584, 18944)) for m in (1, 24, 300, 1500, 6000)],
}

# set2: shapes no rule or representative shape was ever chosen on. Token counts that are none of set1's or the
# representative shapes' (their buckets: 2, 4, 8, 32, 64, 256, 1024, 2048, 4096, 8192), and widths of other models:
# hidden 2048 (Qwen3-1.7B), 7168 (DeepSeek-V3), 5120 (Qwen3-32B), 8192 (Llama-3-70B); intermediate 8192
# (Llama-3.2-3B), 25600 (Qwen3-32B), 17408 (Qwen3-14B), 29568 (Qwen2.5-72B); rope 64/8 heads (Llama-3-70B) and
# 16/8 (Qwen3-1.7B); GEMMs of Qwen3-32B: qkv (10240, 5120) and down (5120, 25600). As many shapes per op as set1,
# so the benchmark's device time stays where it was; the two widths of a 5-count op take alternate token counts.
TOKENS_2 = (2, 5, 7, 30, 48, 200, 700, 2500, 5000, 10000)
SET2 = _held_out(TOKENS_2, rmsnorm=(2048, 7168), fused=(5120, 8192), silu=(8192, 25600), gelu=(17408, 29568),
                 rope=((16, 8), (64, 8)), mm=((10240, 5120), (5120, 25600)))

# set3: shapes of no earlier set and no representative shape, made after set2's run: token counts none of set1's
# or set2's (buckets 8, 16, 32, 128, 512, 1024, 2048, 4096, 8192, 16384; five of them from 1024 up, where eager
# rmsnorm's vendors and triton cross over), and widths of other models: hidden 3072 (Llama-3.2-3B), 5120
# (Qwen2.5-14B) for rmsnorm, 2560 (Qwen3-4B) and 4608 (Gemma-2-27B) for fused_add_rmsnorm; intermediate 9728
# (Qwen3-4B) and 20480 (Yi-34B) for silu, 9216 (Gemma-2-2B) and 36864 (Gemma-2-27B) for gelu; rope 24/8 heads
# (Llama-3.2-3B) and 96/8 (Mistral-Large-2); GEMMs of Llama-3.2-3B qkv (5120, 3072) and Yi-34B down (7168, 20480).
# The same count per op as set1 and set2, and the largest shapes about set2's size, so the run costs the same.
TOKENS_3 = (6, 11, 40, 90, 400, 1200, 1800, 3500, 7000, 14000)
SET3 = _held_out(TOKENS_3, rmsnorm=(3072, 5120), fused=(2560, 4608), silu=(9728, 20480), gelu=(9216, 36864),
                 rope=((24, 8), (96, 8)), mm=((5120, 3072), (7168, 20480)))
# set4: shapes of no earlier set and no representative shape, made after set3's run, when the representative
# shapes at the eager crossovers (rmsnorm 4096 x 7168 and 8192 x 5120, gelu 512 x 28672) were chosen on sets 2
# and 3: set4 is what judges them. Token counts none of sets 1-3's (buckets 8, 16, 128, 512, 1024, 2048, 4096,
# 8192, 16384), and widths of other models: hidden 2304 (Gemma-2-2B) and 5376 (Gemma-3-27B) for rmsnorm, 3840
# (Gemma-3-12B) and 12288 (Mistral-Large-2) for fused_add_rmsnorm; intermediate 12288 (Qwen3-8B) and 27648
# (Qwen2.5-32B) for silu, 15360 (Gemma-3-12B) and 21504 (Gemma-3-27B) for gelu; rope 32/4 heads (Qwen3-30B-A3B)
# and 64/4 (Qwen3-235B-A22B); GEMMs of Mistral-NeMo-12B qkv (6144, 5120) and Qwen3-4B gate_up (19456, 2560).
TOKENS_4 = (9, 20, 150, 600, 1100, 2200, 2900, 4500, 9000, 13000)
SET4 = _held_out(TOKENS_4, rmsnorm=(2304, 5376), fused=(3840, 12288), silu=(12288, 27648), gelu=(15360, 21504),
                 rope=((32, 4), (64, 4)), mm=((6144, 5120), (19456, 2560)))
# set5: shapes of no earlier set and no representative shape, made in stop 15 before any run of it, when autosel's
# Triton rmsnorm was made to stop padding a row to the next power of two (row tiles, chosen on set4's 2304 and 5376;
# set5's first run rejected it and it was reverted): set5 judges what came after, none of it chosen on set5 (the warps
# rule, 2.5 ms graph replays, the vendors' PDL off, direct Triton launches; docs/BENCHMARKS.md 2d, 2e). Token counts
# none of sets 1-4's (buckets 4, 16, 64, 256, 1024, 2048, 4096, 8192, 16384), and widths of other models: hidden 2880
# (gpt-oss) and 1536 (Qwen2.5-1.5B) for rmsnorm, 6656 (LLaMA-33B) and 1152 (Gemma-3-1B) for fused_add_rmsnorm;
# intermediate 8960 (Qwen2.5-1.5B) and 18432 (DeepSeek-V3's dense layers) for silu, 6912 (Gemma-3-1B) and 10240
# (Gemma-3-4B) for gelu; rope 12/2 heads (Qwen2.5-1.5B) and 32/32 (Llama-2-7B); GEMMs of Qwen2.5-1.5B gate_up (17920,
# 1536) and Llama-2-13B down (5120, 13824).
TOKENS_5 = (4, 13, 56, 250, 850, 1400, 2000, 3300, 5500, 11000)
SET5 = _held_out(TOKENS_5, rmsnorm=(2880, 1536), fused=(6656, 1152), silu=(8960, 18432), gelu=(6912, 10240),
                 rope=((12, 2), (32, 32)), mm=((17920, 1536), (5120, 13824)))
# set6: shapes of no earlier set and no representative shape, made in stop 22 before any run of it, to judge on fresh
# shapes everything since set5's last run (flashinfer's compiled functions called directly, the untimed-backend
# and input-mutation rules). Token counts none of sets 1-5's (buckets 8, 16, 64, 128, 512, 1024, 2048, 4096, 8192,
# 16384), and widths of other models: hidden 960 (SmolLM2-360M) and 6400 (Hunyuan-Large) for rmsnorm, 1024
# (Qwen3-0.6B) and 4544 (Falcon-7B's width) for fused_add_rmsnorm; intermediate 4864 (Qwen2.5-0.5B) and 22016
# (Qwen-7B) for silu, 16384 (Gemma-2B) and 24576 (Gemma-7B) for gelu; rope 14/2 heads (Qwen2.5-0.5B) and 56/8
# (Yi-34B); GEMMs of Qwen2.5-0.5B qkv (1152, 896) and Llama-3-70B down (8192, 28672).
TOKENS_6 = (10, 17, 72, 180, 480, 1300, 2700, 3900, 6500, 15000)
SET6 = _held_out(TOKENS_6, rmsnorm=(960, 6400), fused=(1024, 4544), silu=(4864, 22016), gelu=(16384, 24576),
                 rope=((14, 2), (56, 8)), mm=((1152, 896), (8192, 28672)))
# set7: shapes of no earlier set and no representative shape, made in stop 24 before any run of it, to judge autosel's
# Triton kernels launched from C (docs/H200.md, "Triton's launch in C"), chosen on none of them. Token counts none of
# sets 1-6's (buckets 16, 32, 64, 256, 512, 1024, 2048, 2048, 4096, 8192), and widths none of the op's earlier sets':
# hidden 896 (Qwen2.5-0.5B) and 8192 (Llama-3-70B) for rmsnorm, 2880 (gpt-oss) and 7168 (DeepSeek-V3) for
# fused_add_rmsnorm; intermediate 3072 (Qwen3-0.6B) and 28672 (Llama-3-70B) for silu, 2048 (Gemma-3-270M) and 14336
# (Gemma-2-9B) for gelu; rope 40/10 heads (Phi-4) and 32/16 (Gemma-2-27B); GEMMs of Phi-4 qkv (7680, 5120) and
# TinyLlama down (2048, 5632).
TOKENS_7 = (12, 26, 88, 220, 560, 950, 1700, 2400, 4800, 10500)
SET7 = _held_out(TOKENS_7, rmsnorm=(896, 8192), fused=(2880, 7168), silu=(3072, 28672), gelu=(2048, 14336),
                 rope=((40, 10), (32, 16)), mm=((7680, 5120), (2048, 5632)))
# set8: shapes of no earlier set and no representative shape, made in stop 24 after set7's run, when eager ties were
# given to the vendors over autosel's Triton kernels on set7's figures (set7 is in-sample for that): set8 judges it.
# Token counts none of sets 1-7's, and widths none of the op's earlier sets': hidden 2560 (Qwen3-4B) and 12288
# (Mistral-Large-2) for rmsnorm, 2048 (Llama-3.2-1B) and 5376 (Gemma-3-27B) for fused_add_rmsnorm; intermediate 5632
# (TinyLlama) and 17408 (Qwen3-14B) for silu, 8192 and 12288 for gelu; rope 16/2 heads (Qwen2.5-3B) and 48/8;
# GEMMs of Qwen2.5-3B qkv (2560, 2048) and Qwen3-14B down (5120, 17408).
TOKENS_8 = (14, 36, 110, 330, 680, 1150, 1900, 2800, 5800, 9500)
SET8 = _held_out(TOKENS_8, rmsnorm=(2560, 12288), fused=(2048, 5376), silu=(5632, 17408), gelu=(8192, 12288),
                 rope=((16, 2), (48, 8)), mm=((2560, 2048), (5120, 17408)))
# set9: shapes of no earlier set and no representative shape, made in stop 25 before any run of it, to judge the
# norms' launch from C (through torch's DLPack C exchange API) and eager ties by measured host time, neither chosen on
# it. Token counts none of sets 1-8's, and widths none of the op's earlier sets': hidden 1024 (Qwen3-0.6B) and 4608
# for rmsnorm, 1536 (Qwen2.5-1.5B) and 6400 (Hunyuan-Large) for fused_add_rmsnorm; intermediate 2816 (Qwen1.5-0.5B)
# and 14336 (Llama-3-8B) for silu, 4096 and 18432 for gelu; rope 20/4 and 64/16 heads; GEMMs of Qwen2-7B o_proj
# (3584, 3584) and Llama-3-8B gate_up (28672, 4096).
TOKENS_9 = (21, 46, 130, 390, 830, 1350, 1650, 3200, 6800, 11500)
SET9 = _held_out(TOKENS_9, rmsnorm=(1024, 4608), fused=(1536, 6400), silu=(2816, 14336), gelu=(4096, 18432),
                 rope=((20, 4), (64, 16)), mm=((3584, 3584), (28672, 4096)))
# set10: shapes of no earlier set and no representative shape, made in stop 25 after set9's run, when eager ties were
# made to pass over a launch 1.13x the lightest's on set9's figures and the gated activations and rope were launched
# from C as well (set9 is in-sample for those): set10 judges them. Token counts none of sets 1-9's, and widths none of
# the op's earlier sets': hidden 1792 and 10240 for rmsnorm, 3072 (Llama-3.2-3B) and 16384 (Llama-3.1-405B) for
# fused_add_rmsnorm; intermediate 6144 and 19200 for silu, 5120 and 27648 for gelu; rope 8/1 and 128/8 heads; GEMMs
# of Llama-3.2-3B gate_up (16384, 3072) and Qwen2.5-32B down (5120, 27648).
TOKENS_10 = (23, 52, 170, 450, 900, 1450, 2250, 3700, 7600, 13500)
SET10 = _held_out(TOKENS_10, rmsnorm=(1792, 10240), fused=(3072, 16384), silu=(6144, 19200), gelu=(5120, 27648),
                  rope=((8, 1), (128, 8)), mm=((16384, 3072), (5120, 27648)))
# set11: made in stop 26 before any run of it, after rope's launch plan (key heads in blocks of their own, 4 warps for
# 8 heads) was chosen on probes at set10's rope head counts. Token counts none of sets 1-10's; widths none of the op's
# earlier sets': hidden 3840 (Gemma-3-12B) and 14848 (Falcon-180B) for rmsnorm, 2304 (Gemma-2-2B) and 18432
# (Nemotron-4-340B) for fused_add_rmsnorm; intermediate 4096 and 13696 (GLM-4-9B) for silu, 6144 and 32768 for gelu;
# rope 4/1 heads (Llama-3-8B at tensor parallel 8) and 32/2 (Llama-3.1-405B at 4); GEMMs of Llama-3.2-1B gate_up
# (16384, 2048) and Qwen2.5-14B o_proj (5120, 5120).
TOKENS_11 = (19, 37, 75, 270, 620, 1250, 2600, 4200, 8700, 14500)
SET11 = _held_out(TOKENS_11, rmsnorm=(3840, 14848), fused=(2304, 18432), silu=(4096, 13696), gelu=(6144, 32768),
                  rope=((4, 1), (32, 2)), mm=((16384, 2048), (5120, 5120)))
# set12: made in stop 26 after set11's run (rope's representative shapes at 4 / 1 heads and the eager tie rule's cut
# at 1.2 were chosen on it and on call 26-2's two tunes), before any run of it. Token counts none of sets 1-11's;
# widths none of the op's earlier sets': hidden 1152 (Gemma-3-1B) and 6656 (LLaMA-33B) for rmsnorm, 896 (Qwen2.5-0.5B)
# and 10240 for fused_add_rmsnorm; intermediate 5504 (Llama-2-7B at tensor parallel 2) and 24576 for silu, 3072 and
# 20480 for gelu; rope 6 / 1 heads (48 / 8 at tensor parallel 8) and 24 / 2 (Mistral-Large at 4); GEMMs of
# Llama-3.2-3B o_proj (3072, 3072) and Qwen2.5-72B gate_up at tensor parallel 8 (7392, 8192).
TOKENS_12 = (15, 33, 95, 310, 740, 1600, 3100, 5300, 9900, 12500)
SET12 = _held_out(TOKENS_12, rmsnorm=(1152, 6656), fused=(896, 10240), silu=(5504, 24576), gelu=(3072, 20480),
                  rope=((6, 1), (24, 2)), mm=((3072, 3072), (7392, 8192)))
# set13: made in stop 27 before any run of it, after a stability pair of the final code of stop 26 (call 27-1); to
# judge that code on a fresh tune of every op (set12's norms ran on the shipped DB). Token counts none of sets 1-12's;
# widths none of the op's earlier sets': hidden 3200 (OpenLLaMA-3B) and 14336 for rmsnorm, 1280 and 9216 for
# fused_add_rmsnorm; intermediate 1408 (DeepSeek-V2-Lite's experts) and 18944 (Qwen2-7B) for silu, 7680 and 26624
# for gelu; rope 2 / 1 heads (Llama-3-8B at tensor parallel 16, where flashinfer led triton in set11's 4 / 1) and
# 80 / 8; GEMMs of Qwen3-4B down (2560, 9728) and Llama-3-8B down (4096, 14336).
TOKENS_13 = (18, 43, 115, 360, 790, 1750, 2950, 4400, 10800, 15500)
SET13 = _held_out(TOKENS_13, rmsnorm=(3200, 14336), fused=(1280, 9216), silu=(1408, 18944), gelu=(7680, 26624),
                  rope=((2, 1), (80, 8)), mm=((2560, 9728), (4096, 14336)))
# set14: made in stop 27 after set13's run, which placed a representative gated-activation shape at a narrow row
# (4096 x 1536) and judged rope's programs of several tokens (chosen on a probe at set13's head counts); before any
# run of it. Token counts none of sets 1-13's; widths none of the op's earlier sets': hidden 1664 and 12800 for
# rmsnorm, 2176 and 11264 for fused_add_rmsnorm; intermediate 768 (Qwen3-30B-A3B's experts) and 11264 for silu, 1536
# and 22528 for gelu; rope 3 / 1 and 16 / 4 heads; GEMMs of (1536, 4096) and Llama-2-7B gate (11008, 4096).
TOKENS_14 = (22, 47, 125, 420, 860, 1550, 3350, 5600, 11200, 14800)
SET14 = _held_out(TOKENS_14, rmsnorm=(1664, 12800), fused=(2176, 11264), silu=(768, 11264), gelu=(1536, 22528),
                  rope=((3, 1), (16, 4)), mm=((1536, 4096), (11008, 4096)))
# set15: made in stop 27 after set14's run, which showed a narrow tuned row (4096 x 1536) sending 768's rows to the
# wrong backend, so 4096 x 768 was timed as well; before any run of it. Narrow gated rows around both: intermediate
# 1024 and 2048 (DeepSeek-V3's experts) for silu, 896 and 1280 for gelu. Token counts none of sets 1-14's; the other
# ops' widths none of their earlier sets': hidden 1408 and 2432 for rmsnorm, 1664 and 4352 for fused_add_rmsnorm; rope
# 1 / 1 and 12 / 4 heads; GEMMs of (2048, 1408) and (1408, 2048).
TOKENS_15 = (25, 53, 140, 470, 980, 1850, 3800, 6200, 11800, 15200)
SET15 = _held_out(TOKENS_15, rmsnorm=(1408, 2432), fused=(1664, 4352), silu=(1024, 2048), gelu=(1280, 896),
                  rope=((1, 1), (12, 4)), mm=((2048, 1408), (1408, 2048)))
# set16: made in stop 28 after the gated kernel's tiles of 16 rows x 128 columns were chosen on call 28-1's probe
# (intermediate 768, 1280, 1408, 1536, 3072 and 14336 at 1, 64, 360, 1750, 4400 and 15200 tokens), before any run of
# it. Token counts none of sets 1-15's, three of them between 360 and 1750, where the tiles begin (512 rows);
# widths none of the op's earlier sets': intermediate 1792 (Llama-3-8B at tensor parallel 8) and 3584 (Llama-3-70B
# at 8) for silu, 1152 and 2368 (Qwen2.5-7B at 8, just past the tiles' 2048) for gelu; hidden 768 and 5760 for
# rmsnorm, 2688 and 7680 for fused_add_rmsnorm; rope 5 / 1 and 8 / 2 heads; GEMMs of (1024, 4096) and (2816, 5120).
TOKENS_16 = (8, 27, 160, 530, 720, 1020, 2050, 4700, 8300, 13900)
SET16 = _held_out(TOKENS_16, rmsnorm=(768, 5760), fused=(2688, 7680), silu=(1792, 3584), gelu=(1152, 2368),
                  rope=((5, 1), (8, 2)), mm=((1024, 4096), (2816, 5120)))
# set17: made in stop 29 after call 29-1's probe chose the gated kernel's tiles of 8 x 128 wherever a row a program
# idles lanes (200-2500 rows of intermediate 1280, 1792, 2560, 3584 and 4608), its silu of one division, and rope's
# one head a block at head counts that are not a power of two (3, 5, 6, 7, 10, 12 and 20 query heads at 1-14000
# tokens); before any run of it. Token counts none of sets 1-16's or of that probe's, five of them in 200-1200, where
# the tiles begin; widths none of the op's earlier sets' or the probe's: intermediate 1728 and 3456 (Qwen2.5-14B and
# -32B at tensor parallel 8) for silu, 2432 (Qwen3-4B at 4) and 3696 (Qwen2.5-72B at 8) for gelu; rope 10 / 10 heads
# (Llama-2-13B at 4) and 20 / 5 (Phi-3-medium at 2); hidden 2816 and 9216 for rmsnorm, 1792 and 5760 for
# fused_add_rmsnorm; GEMMs of (5120, 1728) and (3456, 5120).
TOKENS_17 = (28, 41, 230, 340, 580, 810, 1180, 2300, 6600, 12200)
SET17 = _held_out(TOKENS_17, rmsnorm=(2816, 9216), fused=(1792, 5760), silu=(1728, 3456), gelu=(2432, 3696),
                  rope=((10, 10), (20, 5)), mm=((5120, 1728), (3456, 5120)))
# set18: made in stop 29 after set17's run and call 29-2's probe at 2-64 heads, which gave rope at up to 4 heads one
# head a block as well; before any run of it. Token counts none of sets 1-17's or of calls 29-1's and 29-2's probes;
# widths none of the op's earlier sets' or the probes': rope 2 / 2 heads (Llama-2-7B at tensor parallel 16) and 4 / 2;
# intermediate 1536 (a representative shape's width, 4096 x 1536) and 2688 for silu, 1728 and 3456 (set17's silu
# widths) for gelu; hidden 2688 and 11264 for rmsnorm, 2432 and 13824 for fused_add_rmsnorm; GEMMs of (4096, 1536)
# and (2304, 9216).
TOKENS_18 = (31, 38, 260, 370, 640, 940, 1060, 2100, 7300, 14200)
SET18 = _held_out(TOKENS_18, rmsnorm=(2688, 11264), fused=(2432, 13824), silu=(1536, 2688), gelu=(1728, 3456),
                  rope=((2, 2), (4, 2)), mm=((4096, 1536), (2304, 9216)))
# set19: made in stop 30 after call 30-1's probe chose the gated kernel's flat programs of 1024 output elements (2048
# for gelu from 6M elements; intermediate 1344, 1728, 2880, 3456, 4096 and 14336 at 64, 1180, 2300 and 12200 tokens),
# before any run of it. Token counts none of sets 1-18's or of that probe's; widths none of the op's earlier sets' or
# the probe's: intermediate 1368 (DeepSeek-V2-Lite at tensor parallel 8) and 7168 for silu, 1920 (Gemma-3-12B at 8)
# and 4608 (Gemma-2-27B at 8) for gelu, both sides of the 6M threshold; rope 7 / 1 heads (Qwen2-7B at 4) and 48 / 4
# (blocks of heads, at a count no probe timed); hidden 1600 and 7680 for rmsnorm, 1920 and 6912 for
# fused_add_rmsnorm; GEMMs of (3840, 2560) and (1600, 6400).
TOKENS_19 = (16, 44, 190, 290, 510, 1030, 1950, 3600, 8100, 13300)
SET19 = _held_out(TOKENS_19, rmsnorm=(1600, 7680), fused=(1920, 6912), silu=(1368, 7168), gelu=(1920, 4608),
                  rope=((7, 1), (48, 4)), mm=((3840, 2560), (1600, 6400)))
# set20: made in stop 30 after call 30-4 (a crossover set at hidden 5120 and 4864, not kept as a set: chosen knowing
# the tune's buckets) and its probe gave a 16-bit norm row in a block of 8192 8 warps from 2048 rows (hidden 5120 at
# 2048-16384 rows, 2560-6144 at 8192); before any run of it. Token counts none of sets 1-19's or of call 30-4's;
# widths none of the op's earlier sets': hidden 4352 and 5632 for rmsnorm, 4480 and 5888 for fused_add_rmsnorm (all
# in blocks of 8192); intermediate 2432 and 5120 for silu, 2560 and 5376 for gelu; rope 6 / 2 and 14 / 1 heads;
# GEMMs of (4352, 1280) and (1280, 4352).
TOKENS_20 = (29, 34, 135, 440, 1120, 2180, 3450, 5150, 9400, 16000)
SET20 = _held_out(TOKENS_20, rmsnorm=(4352, 5632), fused=(4480, 5888), silu=(2432, 5120), gelu=(2560, 5376),
                  rope=((6, 2), (14, 1)), mm=((4352, 1280), (1280, 4352)))
# set21: made in stop 31 after call 31-1's probe gave fused add + rmsnorm 8 warps in a block of 8192 from 300 rows (at
# hidden 4480-8192 and 300-2047 rows), before any run of it. Token counts none of sets 1-20's or of the probe's; widths
# none of the op's earlier sets' or the probe's: hidden 4864 and 6912 for rmsnorm, 5632 and 7424 for
# fused_add_rmsnorm (all in blocks of 8192); intermediate 2880 and 9472 for silu, 2816 and 10752 for gelu; rope
# 12 / 1 and 36 / 4 heads; GEMMs of (2304, 4608) and (6144, 1536).
TOKENS_21 = (39, 61, 163, 355, 770, 1270, 1730, 2650, 6350, 11650)
SET21 = _held_out(TOKENS_21, rmsnorm=(4864, 6912), fused=(5632, 7424), silu=(2880, 9472), gelu=(2816, 10752),
                  rope=((12, 1), (36, 4)), mm=((2304, 4608), (6144, 1536)))
# set22: made in stop 32 before any run of it or of that stop's probe. Token counts none of sets 1-21's, four of them
# at or below 210 (decode batches); widths none of the op's earlier sets': hidden 3328 and 7936 for rmsnorm, 4736 and
# 6528 for fused_add_rmsnorm (the last three in blocks of 8192); intermediate 3840 and 11520 for silu, 3200 and 12800
# for gelu; rope 10 / 2 and 60 / 4 heads; GEMMs of (3328, 2048) and (2048, 6656).
TOKENS_22 = (35, 57, 83, 210, 615, 1390, 2330, 4100, 7800, 13700)
SET22 = _held_out(TOKENS_22, rmsnorm=(3328, 7936), fused=(4736, 6528), silu=(3840, 11520), gelu=(3200, 12800),
                  rope=((10, 2), (60, 4)), mm=((3328, 2048), (2048, 6656)))
# set23: made in stop 33 before any run of it or of that stop's probe (call 33-1: fused add + rmsnorm's warps at
# 200-299 rows of hidden 4480-6144). Token counts none of sets 1-22's, two of them in that window (238, 277); widths
# none of the op's earlier sets': hidden 2944 and 9984 for rmsnorm, 4992 and 5504 for fused_add_rmsnorm (both in
# blocks of 8192, neither among the probe's); intermediate 4352 and 10240 for silu, 4864 and 11776 for gelu; rope
# 18 / 2 and 44 / 4 heads; GEMMs of (2944, 3840) and (5376, 2432).
TOKENS_23 = (42, 67, 238, 277, 545, 1075, 1960, 3050, 5650, 10300)
SET23 = _held_out(TOKENS_23, rmsnorm=(2944, 9984), fused=(4992, 5504), silu=(4352, 10240), gelu=(4864, 11776),
                  rope=((18, 2), (44, 4)), mm=((2944, 3840), (5376, 2432)))
# set24: made in stop 33 after call 33-5's probe (the gated kernel's stores at the L2's size), before any run of it.
# Token counts none of sets 1-23's; widths none of the op's earlier sets' or of that probe's, chosen so that the gated
# activations meet input + output of 40-52 MB at one or two token counts each: silu 7040 (1130 tokens: 48 MB) and
# 8704 (835: 44 MB), gelu 12032 (590: 43 MB) and 5248 (1640: 52 MB); hidden 3456 and 7424 for rmsnorm, 3968 and 6272
# for fused_add_rmsnorm; rope 26 / 2 and 52 / 4 heads; GEMMs of (3968, 2944) and (2688, 5376).
TOKENS_24 = (45, 93, 395, 590, 835, 1130, 1640, 2480, 4650, 9150)
SET24 = _held_out(TOKENS_24, rmsnorm=(3456, 7424), fused=(3968, 6272), silu=(7040, 8704), gelu=(12032, 5248),
                  rope=((26, 2), (52, 4)), mm=((3968, 2944), (2688, 5376)))
# set25: made in stop 34 after call 34-4's probe (which graph-mode timing ranks the gated kernels as a model does),
# before any change of the timing or any run of it. Token counts none of sets 1-24's; widths none of the op's earlier
# sets', the gated activations at input + output of about 44 MB at one count each (silu 6400 at 990 tokens: 38 MB,
# 9984 at 705: 42 MB; gelu 7424 at 990: 44 MB, 10496 at 705: 44 MB); hidden 4224 and 8960 for rmsnorm, 3712 and 7040
# for fused_add_rmsnorm; rope 22 / 2 and 30 / 6 heads; GEMMs of (3712, 3200) and (4480, 2816).
TOKENS_25 = (51, 78, 129, 460, 705, 990, 1480, 2720, 5230, 11400)
SET25 = _held_out(TOKENS_25, rmsnorm=(4224, 8960), fused=(3712, 7040), silu=(6400, 9984), gelu=(7424, 10496),
                  rope=((22, 2), (30, 6)), mm=((3712, 3200), (4480, 2816)))
# set26: made in stop 35 before any run of it or of that stop's probe (call 35-1: eager rmsnorm's host time at small
# token counts, where flashinfer led triton on set25). Token counts none of sets 1-25's, four of them at or below
# 145 (decode batches); widths none of the op's earlier sets': hidden 3968 and 6528 for rmsnorm, 3328 and 8960 for
# fused_add_rmsnorm; intermediate 4736 and 13312 for silu, 3840 and 8704 for gelu; rope 9 / 1 and 28 / 2 heads; GEMMs
# of (4224, 2304) and (1792, 7168).
TOKENS_26 = (49, 71, 107, 145, 485, 1210, 1570, 3150, 7100, 12800)
SET26 = _held_out(TOKENS_26, rmsnorm=(3968, 6528), fused=(3328, 8960), silu=(4736, 13312), gelu=(3840, 8704),
                  rope=((9, 1), (28, 2)), mm=((4224, 2304), (1792, 7168)))
# set27: made in stop 36 before any run of it, with gemm.mm's representative shapes at 16 and 32 tokens of 4096 x 4096
# (written in stop 35, judged in the same device call). Token counts none of sets 1-26's, three of them at or below
# 145 (none is left below 50); widths none of the op's earlier sets': Falcon-7B's hidden 4544 (71 x 64, no multiple of
# 128) and 5888 for rmsnorm, 3456 and 7936 for fused_add_rmsnorm; intermediate 3200 and 15360 for silu, 4352 and 13312
# for gelu; rope 24 / 4 and 40 / 4 heads; Falcon-7B's GEMMs qkv (4672, 4544) and down (4544, 18176).
TOKENS_27 = (55, 86, 118, 183, 333, 875, 1340, 2230, 4330, 9660)
SET27 = _held_out(TOKENS_27, rmsnorm=(4544, 5888), fused=(3456, 7936), silu=(3200, 15360), gelu=(4352, 13312),
                  rope=((24, 4), (40, 4)), mm=((4672, 4544), (4544, 18176)))
# set28: made in stop 38 before any run of it, on stop 37's code (gemm.mm timed with its weights read from memory,
# triton's mm configs per token range). Token counts none of sets 1-27's, four of them 50-97 (decode batches; every
# count under 50 but 32 is taken); widths none of the op's earlier sets': rmsnorm 2112 and 10752, fused add + rmsnorm
# 2816 and 9984, silu 5760 and 16384, gelu 3584 and 9728, rope 12 / 3 and 36 / 6 heads, Gemma-2-9B's GEMMs qkv
# (8192, 3584) and down (3584, 14336).
TOKENS_28 = (50, 54, 63, 97, 162, 415, 1015, 2570, 5420, 11950)
SET28 = _held_out(TOKENS_28, rmsnorm=(2112, 10752), fused=(2816, 9984), silu=(5760, 16384), gelu=(3584, 9728),
                  rope=((12, 3), (36, 6)), mm=((8192, 3584), (3584, 14336)))
# cpu1: for a CPU, made before any run of it: token counts between and beside the CPU's representative ones (1, 4,
# 16, 64-512), at widths of none of them but fused add + rmsnorm's 5120, sizes a CPU serves; gemm.mm left out (a
# 300-token GEMM of these widths takes seconds a round on two cores).
TOKENS_CPU1 = (2, 3, 5, 6, 7, 10, 24, 40, 96, 300)
SET_CPU1 = {
    "layernorm.rmsnorm": [{"tokens": t, "hidden": h} for h in (3072, 6144) for t in TOKENS_CPU1],
    "layernorm.fused_add_rmsnorm": [{"tokens": t, "hidden": h} for h in (2560, 5120) for t in TOKENS_CPU1],
    "activation.silu_and_mul": [{"tokens": t, "intermediate": i} for i in (4864, 11008) for t in TOKENS_CPU1],
    "activation.gelu_and_mul": [{"tokens": t, "intermediate": i} for i, ts in zip((6144, 9728), (TOKENS_CPU1[1::2],
                                                                                        TOKENS_CPU1[::2])) for t in ts],
    "embeddings.rope": [_rope(t, q, kv) for (q, kv), ts in zip(((16, 4), (40, 8)), (TOKENS_CPU1[1::2],
                                                                                   TOKENS_CPU1[::2])) for t in ts],
}
SETS = {"set1": SET1, "set2": SET2, "set3": SET3, "set4": SET4, "set5": SET5, "set6": SET6, "set7": SET7, "set8": SET8,
        "set9": SET9, "set10": SET10, "set11": SET11, "set12": SET12, "set13": SET13,
        "set14": SET14, "set15": SET15, "set16": SET16, "set17": SET17, "set18": SET18, "set19": SET19,
        "set20": SET20, "set21": SET21, "set22": SET22, "set23": SET23,
        "set24": SET24, "set25": SET25, "set26": SET26, "set27": SET27, "set28": SET28}
# Apart from the GPU's sets, which each hold out from every earlier one: the CPU's hold out from the CPU's shapes.
CPU_SETS = {"cpu1": SET_CPU1}


def table_for(op: str, mode: str) -> BucketTable:
    """What get_kernel dispatches by: its dispatcher's table, or the op-level winner alone."""
    fn = selector.get_kernel(op, mode=mode)
    table = getattr(fn, "table", None)
    return table or BucketTable(op, mode, selector.select_kernel(op, mode=mode).backend.value)


def measure(op: str, mode: str, eligible: list, shapes: list[dict], platform, rounds: int | None = None
            ) -> list[dict]:
    """Every eligible backend's median per shape (None: rejected at that shape), by autosel's tuner, with each
    shape's bucket as the tuner computed it (from the bucket rows of this measurement). rounds: that many
    interleaved rounds with every backend timed in each (on a shared CPU one descheduled round can be 100x the
    others, and the tuner's rule stops timing a backend 1.3x behind after the first round); else the tuner's."""
    from autosel.decisions import parse_bucket
    from autosel.timing import timer_for
    from autosel.tuner import Tuner

    definition = registry.definition(op)
    every_round = {} if rounds is None else {"rounds": rounds, "settled_factor": math.inf}
    tuner = Tuner(timer=timer_for(platform.torch_device, mode), device=platform.torch_device,
                  drop_factor=math.inf, budget_s=1e9, **every_round)
    decision, buckets = tuner.tune_buckets(definition, eligible, reference=tuning.reference_for(definition),
                                           shapes=shapes, mode=mode, platform_key=platform.key, versions={})
    bucket_of_shape = {json.dumps(s.shape, sort_keys=True): list(parse_bucket(row.bucket))
                       for row in buckets for s in row.candidates[0].shapes}
    return [{"shape": shape, "bucket": bucket_of_shape[json.dumps(shape, sort_keys=True)],
             "us": {c.backend: (c.shapes[i].timing.median_us if c.ok and c.shapes[i].timing else None)
                    for c in decision.candidates},
             "rounds_us": {c.backend: list(c.shapes[i].timing.round_medians_us)
                           for c in decision.candidates if c.ok and c.shapes[i].timing}}
            for i, shape in enumerate(shapes)]


def rejected_by_tune(op: str, mode: str, eligible: list, platform) -> dict[str, str]:
    """The backends the stored decision rejected (each failed the check at some representative shape), with the
    reason: autosel never runs them for this op, however they fare at a held-out shape."""
    hit = tuning.database().lookup(tuning.decision_key(op, eligible, platform, mode))
    return {} if hit is None else {c.backend: c.reason or "" for c in hit[0].candidates if c.status == "rejected"}


def summarize(rows: list[dict], table: BucketTable, rejected=()) -> dict[str, tuple[float, float]]:
    """(geometric mean, worst) over the shapes of each strategy's time over the per-shape best, the best among
    the backends the tune did not reject (those in `rejected` are still listed, against that best)."""
    picks: dict[str, list[float]] = {"dispatcher": [], f"op-level ({table.default})": []}
    backends = sorted({b for r in rows for b in r["us"]})
    for row in rows:
        us = row["us"]
        best = min(t for b, t in us.items() if t and b not in rejected)
        chosen = table.route(tuple(row["bucket"]))
        row["dispatcher"], row["best"] = chosen, min((b for b in us if us[b] and b not in rejected), key=us.get)
        picks["dispatcher"].append((us.get(chosen) or math.inf) / best)
        picks[f"op-level ({table.default})"].append((us.get(table.default) or math.inf) / best)
        for b in backends:
            picks.setdefault(b, []).append((us.get(b) or math.inf) / best)
    return {name: (geomean(v) if all(math.isfinite(x) for x in v) else math.inf, max(v)) for name, v in picks.items()}


def _in_round(times: list[float], k: int) -> float:
    """A backend's median in round k; a backend the tuner stopped timing at a shape (over 1.3x the fastest after
    round 1) keeps its last round's median there."""
    return times[min(k, len(times) - 1)]


def per_round(rows: list[dict], other: str) -> list[float]:
    """Per timed round, the geometric mean over the shapes of the dispatcher's time over `other`'s, each from that
    round's medians (_in_round): how far apart the rounds put the two, so a lead smaller than that is not one.
    Empty when either failed at some shape."""
    pairs = [(r["rounds_us"].get(r["dispatcher"]), r["rounds_us"].get(other)) for r in rows]
    if not all(a and b for a, b in pairs):
        return []
    n = max(len(t) for pair in pairs for t in pair)
    return [geomean([_in_round(a, k) / _in_round(b, k) for a, b in pairs]) for k in range(n)]


def steady_wins(rows: list[dict], fixed: str, rejected=()) -> list[tuple[dict, str, float]]:
    """The shapes where another backend, not rejected by the tune, beat `fixed` in every timed round: (row, that
    backend, its largest time over fixed's in a round), naming per shape the backend whose lead held best (the least
    such ratio). Per-shape winners that differ only inside the rounds' spread are noise, not a place a dispatcher can
    be ahead. Rounds as per_round reads them (_in_round). A shape timed one round only was settled after it: every
    backend but the fastest was over 1.3x behind it there, and the tuner's rule counts that round in each later one
    (a three-round minimum here left set26's 71 x 4224 x 2304, cuBLAS 1.39x behind triton, unreported)."""
    wins = []
    for row in rows:
        timed = {name: times for name, times in row["rounds_us"].items() if times and all(t > 0 for t in times)}
        base = timed.get(fixed)
        if base is None:
            continue
        steady = []
        for name, times in timed.items():
            n = max(len(times), len(base))
            if name == fixed or name in rejected:
                continue
            worst = max(_in_round(times, k) / _in_round(base, k) for k in range(n))
            if worst < 1.0:
                steady.append((worst, name))
        if steady:
            worst, name = min(steady)
            wins.append((row, name, worst))
    return wins


def provenance(argv: list[str] | None) -> dict[str, str]:
    """The command line (with the AUTOSEL_* variables that choose the DB and OMP_NUM_THREADS, the CPU threads), the
    commit (+dirty) and the UTC date."""
    here = Path(__file__).resolve().parent
    try:
        commit = subprocess.run(["git", "describe", "--always", "--dirty", "--abbrev=12"], cwd=here,
                                capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        commit = "unknown (not a git checkout)"
    env = " ".join(f"{k}={shlex.quote(v)}" for k, v in sorted(os.environ.items())
                   if k.startswith("AUTOSEL_") or k == "OMP_NUM_THREADS")
    args = sys.argv[1:] if argv is None else argv
    command = " ".join(filter(None, [env, "python tools/heldout_bench.py", shlex.join(args)]))
    return {"command": command, "commit": commit,
            "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--op", action="append", help="glob of ops (repeatable); default all")
    parser.add_argument("--mode", action="append", choices=("eager", "graph"), help="default: every mode here")
    parser.add_argument("--shapes", choices=sorted(SETS) + sorted(CPU_SETS), default="set2",
                        help="held-out shape set (default set2; set1: the shapes of docs/BENCHMARKS.md section 2; "
                             "set20: out of sample for every rule, representative shape and kernel change so far; "
                             "cpu1: for a CPU)")
    parser.add_argument("--rounds", type=int, help="interleaved rounds, every backend timed in each (default: the "
                                                   "tuner's three, a backend far behind after the first not again)")
    args = parser.parse_args(argv)
    held_out = {**SETS, **CPU_SETS}[args.shapes]
    platform = platforms.current_platform()
    known = [op for op, _ in tuning.contested_ops(platform) if op in held_out]
    for pattern in args.op or ():
        if not any(fnmatch.fnmatchcase(op, pattern) for op in known):
            parser.error(f"no op matches --op {pattern!r}; known ops (several backends here, held-out shapes): "
                         f"{', '.join(known) or 'none'}")
    available = tuning.modes_for(platform)
    if set(args.mode or available) - set(available):  # get_kernel would run the eager decisions, labelled graph
        parser.error(f"--mode graph: this {platform.device.value} machine has no graph mode; it runs "
                     f"{', '.join(available)} mode only")
    args.out.mkdir(parents=True, exist_ok=True)
    made = provenance(argv)
    lines = [f"Command: `{made['command']}`; commit {made['commit']}; {made['date']}.", "",
             f"Platform `{platform.key}`, versions {platform.version_map}; held-out shapes {args.shapes}.", "",
             "Time over the per-shape best: geometric mean, worst (inf: the pick failed a shape's check).", ""]
    results = []
    for op, eligible in tuning.contested_ops(platform, args.op):
        if op not in held_out:  # contested_ops already kept only the ops matching --op
            continue
        for mode in args.mode or available:
            began = time.perf_counter()
            table = table_for(op, mode)
            rows = measure(op, mode, eligible, held_out[op], platform, args.rounds)
            rejected = rejected_by_tune(op, mode, eligible, platform)
            summary = summarize(rows, table, rejected)
            fixed = {k: v for k, v in summary.items()
                     if k != "dispatcher" and not k.startswith("op-level") and k not in rejected}
            best_fixed = min(fixed, key=lambda k: fixed[k][0])
            winners: dict[str, int] = {}
            for r in rows:
                winners[r["best"]] = winners.get(r["best"], 0) + 1
            start = len(lines)
            lines += [f"### {op}, {mode} ({len(rows)} shapes, {time.perf_counter() - began:.0f} s; "
                      f"per-shape winners: {', '.join(f'{b} {n}' for b, n in sorted(winners.items()))}; "
                      f"best fixed backend: {best_fixed})", "", "| pick | geomean | worst |", "|---|---|---|"]
            lines += [f"| {name}{' (rejected by the tune)' if name in rejected else ''} | {g:.3f} | {w:.2f} |"
                      for name, (g, w) in summary.items()] + [""]
            rounds = per_round(rows, best_fixed)
            if rounds:
                lines += [f"- dispatcher over {best_fixed}, geometric mean of each round: "
                          f"{', '.join(f'{r:.3f}' for r in rounds)}", ""]
            steady = steady_wins(rows, best_fixed, rejected)
            lines += [f"- shapes where another backend beat {best_fixed} in every round: {len(steady)}"
                      + "".join(f"; {r['shape']}: {b} at most {w:.3f}x, the dispatcher ran {r['dispatcher']}"
                                for r, b, w in steady), ""]
            lines += [f"- {b}: rejected by the tune, so left out of the per-shape best: {why}" for b, why in
                      rejected.items()] + ([""] if rejected else [])
            results.append({"op": op, "mode": mode, "shapes": args.shapes, "provenance": made, "table": {
                "default": table.default, "winners": [[list(k), v] for k, v in table.winners.items()]},
                "rows": rows, "rejected": rejected, "summary": {k: list(v) for k, v in summary.items()},
                "dispatcher_over_best_fixed_per_round": rounds,
                "steady_wins": [[r["shape"], b, w] for r, b, w in steady]})
            print("\n".join(lines[start:]), flush=True)
            (args.out / "heldout.md").write_text("\n".join(lines) + "\n")
            (args.out / "heldout.json").write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
