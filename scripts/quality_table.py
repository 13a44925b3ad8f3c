"""The quality table (issue 4): every variant of the method on SmolLM2-135M, same token budget each.

Tasks: ``domain`` (linux-doc, ``configs/smollm2-linuxdoc.toml``) and ``continual`` (sotu,
``configs/smollm2-sotu.toml``). Every run is evaluated, unmasked, on the held-out split of *both*
corpora. Variants with DP run X = 2 replicas for half the steps, so every variant sees the same number
of training tokens. Results are written after every run (``--out``, JSON), so an interrupted table
keeps what it has; ``--resume`` skips the runs already in the file. ``--render`` writes the Markdown
table and the loss-curve PNG from the JSON.

    python scripts/quality_table.py --out docs/results/quality.json            # the table (~1 h on 2 cores)
    python scripts/quality_table.py --tasks domain --variants m95,m95_mean --steps 60 --out /tmp/q.json
    python scripts/quality_table.py --render docs/results/quality.json

Extra variants for the investigation are defined in ``VARIANTS`` below; ``--extra NAME=k=v,k=v`` adds
one from the command line.
"""

from __future__ import annotations

import argparse
import json
import logging
import platform
import re
import resource
import statistics
import time
from pathlib import Path

import torch

from meshnode.compression.accounting import AXES
from meshnode.config import load_config
from meshnode.data import heldout_batches, prepare_corpus
from meshnode.mesh import MeshTrainer

ROOT = Path(__file__).resolve().parents[1]
TASKS = {"domain": "smollm2-linuxdoc.toml", "continual": "smollm2-sotu.toml"}
EVAL_CONFIGS = {"linuxdoc": "smollm2-linuxdoc.toml", "sotu": "smollm2-sotu.toml"}

# The paper's anchor prior (AP): K = 20, alpha 0.3, tau 1e-3, beta 0.95; the SVD truncated to rank 32.
AP = ["anchor.enabled=true", "anchor.period=20", "spectral.alpha=0.3", "spectral.tau=1e-3", "spectral.beta=0.95",
      "spectral.rank=32"]
# Compressed DP: X = 2 replicas, streaming sync every H = 10 inner steps, PowerSGD rank 16 with 8-bit factors,
# the outer step a plain average (outer lr 1, no momentum: the config default since 2026-12-04, docs/quality.md).
DP = ["dp.enabled=true", "dp.replicas=2", "dp.inner_steps=10", "dp.rank=16", "dp.quantize=true", "dp.fragments=2",
      "dp.outer_lr=1.0", "dp.outer_momentum=0.0"]
# DiLoCo's outer Nesterov step (DESIGN.md; the table's DP rows until 2026-12-04, now the *_diloco rows)
DILOCO = ["dp.outer_lr=0.7", "dp.outer_momentum=0.9"]

# not config keys: the script refreshes every sender's copy of its receiver's gains after each step (mesh only),
# or, as a control of the same size, scales the loaded copy once by 1 +- JITTER (a fixed random sign per channel)
LIVE_GAINS = "bench.live_gains=true"
GAIN_JITTER = "bench.gain_jitter="

# DP pieces for the decomposition: uncompressed pseudo-gradients (every matrix below the rank), and plain averaging
EXACT_DP = ["dp.rank=100000", "dp.quantize=false"]
PLAIN_AVG = ["dp.outer_lr=1.0", "dp.outer_momentum=0.0"]
# the weighted rotated codec at 2 bits both ways, and at 4 bits forward / 1 bit back
ROTQ2_NS = ["mask.codec=rotq", "mask.bits=2", "mask.rotq_weight=norm_std"]
ROTQ4_NS_G1 = ["mask.codec=rotq", "mask.bits=4", "mask.rotq_weight=norm_std", "mask.grad_bits=1"]

# the same 4 sequences per step and replica, as two microbatches of 2 (dp.v_correction needs M >= 2)
MB2 = ["train.batch_size=2", "train.microbatches=2"]
MB4 = ["train.batch_size=1", "train.microbatches=4"]
# X = 4 replicas of 2 sequences each as 2 microbatches of 1: the same 8 sequences per step as X = 2
X4 = ["dp.replicas=4", "train.batch_size=1", "train.microbatches=2"]
# 32 sequences a step: one replica of 8 microbatches of 4; or X = 2 replicas of 4 microbatches of 4, synced every 20
# steps at PowerSGD rank 2 with dp.v_correction
B32 = ["train.batch_size=4", "train.microbatches=8"]
DP_B32 = ["train.batch_size=4", "train.microbatches=4", "dp.inner_steps=20", "dp.rank=2", "dp.v_correction=true"]

REFMAP64_P10 = ["mask.codec=rotq", "mask.bits=1", "mask.reference=both", "mask.reference_map_rank=64",
                "mask.reference_map_period=10"]
# half a bit per coordinate forward and a quarter back (the twenty-second session's 38.9x row)
TC288_G144 = [*REFMAP64_P10, "mask.reference_code_bits=288", "mask.reference_grad_code_bits=144"]
VARIANTS: dict[str, list[str]] = {
    # the table the issue asks for
    "dense": [],
    "dense_dp": DP,
    "m90": ["mask.ratio=0.9"],
    "m90_ap": ["mask.ratio=0.9", *AP],
    "m95": ["mask.ratio=0.95"],
    "m95_ap": ["mask.ratio=0.95", *AP],
    "m95_ap_dp": ["mask.ratio=0.95", *AP, *DP, "anchor.snapshot=dp"],
    # the same two DP rows with DiLoCo's outer Nesterov step, as the table first ran them
    "dense_dp_diloco": [*DP, *DILOCO],
    "m95_ap_dp_diloco": ["mask.ratio=0.95", *AP, *DP, *DILOCO, "anchor.snapshot=dp"],
    "topk": ["mask.codec=topk", "mask.topk_ratio=0.1"],
    "int8": ["mask.codec=int8"],
    # investigation: what the paper's recipe needs, and what else closes the gap
    # the paper-recipe sweep: every knob moved alone from M95 + AP with K = 10 (so that five priors arrive
    # in 60 steps, not two)
    "m95_ap_k10": ["mask.ratio=0.95", *AP, "anchor.period=10"],
    "m95_ap_alpha0": ["mask.ratio=0.95", *AP, "anchor.period=10", "spectral.alpha=0.0"],
    "m95_ap_alpha1": ["mask.ratio=0.95", *AP, "anchor.period=10", "spectral.alpha=1.0"],
    "m95_ap_tau1e-1": ["mask.ratio=0.95", *AP, "anchor.period=10", "spectral.tau=0.1"],
    "m95_ap_tau1e-5": ["mask.ratio=0.95", *AP, "anchor.period=10", "spectral.tau=1e-5"],
    "m95_ap_beta0.5": ["mask.ratio=0.95", *AP, "anchor.period=10", "spectral.beta=0.5"],
    "m95_ap_zeroinit": ["mask.ratio=0.95", *AP, "anchor.period=10", "spectral.ema_init=zero"],
    "m95_ap_full": ["mask.ratio=0.95", *AP, "anchor.period=10", "spectral.rank=0"],
    "m95_clean10": ["mask.ratio=0.95", *AP, "spectral.mode=clean_every", "spectral.clean_every=10",
                    "anchor.period=10"],
    "m95_clean5": ["mask.ratio=0.95", *AP, "spectral.mode=clean_every", "spectral.clean_every=5",
                   "anchor.period=5"],
    "m95_def": ["mask.ratio=0.95", *AP, "anchor.period=10", "spectral.mode=delayed_ef"],
    "m95_lr3e-5": ["mask.ratio=0.95", "train.lr=3e-5"],
    "m95_bc": ["mask.ratio=0.95", *AP, "spectral.mode=bias_correction", "anchor.period=10"],
    "m95_warm20": ["mask.ratio=0.95", "mask.warmup_steps=20"],
    "m95_rms": ["mask.ratio=0.95", "mask.rescale=rms"],
    "m95_mean": ["mask.ratio=0.95", "mask.fill=mean"],
    "m95_mean_ap": ["mask.ratio=0.95", "mask.fill=mean", *AP],
    "m95_mean_ap_dp": ["mask.ratio=0.95", "mask.fill=mean", *AP, *DP, *DILOCO, "anchor.snapshot=dp"],
    "m90_mean": ["mask.ratio=0.9", "mask.fill=mean"],
    "m75": ["mask.ratio=0.75"],
    # rotated low-bit quantisation (mask.codec = rotq): every channel at 4 / 2 / 1 bits, centred
    "rotq4": ["mask.codec=rotq", "mask.bits=4"],
    "rotq2": ["mask.codec=rotq", "mask.bits=2"],
    "rotq1": ["mask.codec=rotq", "mask.bits=1"],
    "rotq2_dp": ["mask.codec=rotq", "mask.bits=2", *DP, *DILOCO],
    # the same, each channel weighted before the rotation (mask.rotq_weight): by the receiving layer's input norm
    # gains (norm), or by sqrt(gain / channel std) (norm_std)
    "rotq2_norm": ["mask.codec=rotq", "mask.bits=2", "mask.rotq_weight=norm"],
    "rotq4_ns": ["mask.codec=rotq", "mask.bits=4", "mask.rotq_weight=norm_std"],
    "rotq2_ns": ["mask.codec=rotq", "mask.bits=2", "mask.rotq_weight=norm_std"],
    "rotq1_ns": ["mask.codec=rotq", "mask.bits=1", "mask.rotq_weight=norm_std"],
    # where rotq2's gap comes from: the same forward, the gradient back at 4 bits
    "rotq2_ns_g4": ["mask.codec=rotq", "mask.bits=2", "mask.rotq_weight=norm_std", "mask.grad_bits=4"],
    # and the other way: the activation at 4 bits, the gradient at 2 or 1
    "rotq4_ns_g2": ["mask.codec=rotq", "mask.bits=4", "mask.rotq_weight=norm_std", "mask.grad_bits=2"],
    "rotq4_ns_g1": ["mask.codec=rotq", "mask.bits=4", "mask.rotq_weight=norm_std", "mask.grad_bits=1"],
    # the 1-bit gradient weighted by 1 / its channels' rms (every channel the same relative error; eighteenth session)
    "rotq4_ns_g1_gw": [*ROTQ4_NS_G1, "mask.grad_weight=std"],
    "m75_mean": ["mask.ratio=0.75", "mask.fill=mean"],
    # reference coding (mask.reference, twentieth session): each boundary coded as its change from what the frozen
    # pretrained model gives for the same tokens, which both ends compute; the dropped channels / the rounding then
    # cost the change, not the value. "both": the gradient too (against the frozen later stages' gradient)
    "m95_ref": ["mask.ratio=0.95", "mask.reference=both"],
    "m95_reffwd": ["mask.ratio=0.95", "mask.reference=forward"],
    "rotq1_ref": ["mask.codec=rotq", "mask.bits=1", "mask.reference=both"],
    "rotq2_ref": ["mask.codec=rotq", "mask.bits=2", "mask.reference=both"],
    "rotq1_ns_ref": ["mask.codec=rotq", "mask.bits=1", "mask.rotq_weight=norm_std", "mask.reference=both"],
    "rotq1_reffwd": ["mask.codec=rotq", "mask.bits=1", "mask.reference=forward"],
    "m90_reffwd": ["mask.ratio=0.9", "mask.reference=forward"],
    "rotq2_g1_ref": ["mask.codec=rotq", "mask.bits=2", "mask.grad_bits=1", "mask.reference=both"],
    # the residual map (twenty-first session): the sender also predicts the residual from the reference by a rank-64
    # linear map refitted every 20 (10) steps and sent once per fit (2 x 64 x 576 bfloat16 = 147 kB per boundary)
    "rotq1_refmap64": ["mask.codec=rotq", "mask.bits=1", "mask.reference=both", "mask.reference_map_rank=64"],
    "rotq1_refmap64_p10": REFMAP64_P10,
    "rotq2_g1_refmap64": ["mask.codec=rotq", "mask.bits=2", "mask.grad_bits=1", "mask.reference=both",
                          "mask.reference_map_rank=64"],
    # the transform code (twenty-second session): with the map, the activation's residual in a fitted KLT code of
    # R bits per token (R / 576 bits per coordinate) instead of 1-bit rotq; the gradient stays 1-bit rotq
    **{f"rotq1_refmap64_tc{r}_p10": [*REFMAP64_P10, f"mask.reference_code_bits={r}"] for r in (576, 288, 144)},
    # and the gradient going back in a transform code of G bits per token too (fitted by the later stage)
    **{f"rotq1_refmap64_tc{r}_g{g}_p10": [*REFMAP64_P10, f"mask.reference_code_bits={r}",
                                          f"mask.reference_grad_code_bits={g}"]
       for r, g in ((288, 288), (144, 288), (288, 144))},
    # where dense_dp's loss comes from (same tokens; each variant moves one thing from dense towards dense_dp):
    # half as many optimizer steps of twice the batch (what any X = 2 data parallelism does to a fixed budget),
    # the replicas' weights averaged exactly after every step, exactly every H = 10 steps through the DiLoCo
    # outer optimizer, and finally dense_dp itself (the same with PowerSGD rank 16 and 8-bit factors)
    "dense_b8": ["train.batch_size=8"],
    "dense_dp_avg1": [*DP, "dp.inner_steps=1", "dp.fragments=1", *PLAIN_AVG, *EXACT_DP],
    "dense_dp_exact": [*DP, *EXACT_DP, *DILOCO],
    # and the outer optimizer alone: plain averaging every H steps (outer lr 1, no momentum), exact or compressed
    # (PLAIN_AVG is DP's own outer step now; these keys keep the names they were run under)
    "dense_dp_exact_avg": [*DP, *EXACT_DP, *PLAIN_AVG],
    "dense_dp_avg": [*DP, *PLAIN_AVG],
    # rotq's channel weights from the next stage's *trained* input-norm gains (an oracle only the in-process mesh
    # can run: after every step each sender's copy is refreshed from its receiver; the swarm keeps the loaded copy)
    "rotq2_ns_live": [*ROTQ2_NS, LIVE_GAINS],
    "rotq4_ns_g1_live": [*ROTQ4_NS_G1, LIVE_GAINS],
    # the control: the loaded copy off by +-1.8 % per channel from the start (the live gains drifted that far)
    "rotq2_ns_jitter": [*ROTQ2_NS, GAIN_JITTER + "0.018"],
    # the codec that holds dense quality, with the table's compressed DP: the whole system's bytes
    "rotq4_ns_g1_dp": [*ROTQ4_NS_G1, *DP, *DILOCO],
    "rotq4_ns_g1_dpavg": [*ROTQ4_NS_G1, *DP, *PLAIN_AVG],
    # the same with a quarter of DP's bytes: PowerSGD rank 4 instead of 16
    "rotq4_ns_g1_dpavg_r4": [*ROTQ4_NS_G1, *DP, "dp.rank=4"],
    # DP's step size: two AdamW replicas on batch 4, averaged, step less far than one AdamW on batch 8 where the
    # gradient is noise-dominated (each replica's second moment holds batch-4 noise). Amplify the averaged
    # update (outer lr > 1, still no momentum) or scale the replicas' own lr by sqrt(X); dense at the higher lr
    # is the control (a higher lr may help any run, not DP alone)
    "dense_dp_olr1.4": [*DP, "dp.outer_lr=1.41"],
    "dense_dp_olr2": [*DP, "dp.outer_lr=2.0"],
    "dense_dp_lr1.4": [*DP, "train.lr=1.41e-4"],
    "dense_lr1.4": ["train.lr=1.41e-4"],
    # the fairer control for DP's averaging: one AdamW on batch 8 (what two replicas see together) at that lr
    "dense_b8_lr1.4": ["train.batch_size=8", "train.lr=1.41e-4"],
    # DP's moments: each replica's AdamW normalises by its own moments, built from its own batch-4 gradients.
    # Average the replicas' moments at every sync, exactly (mesh only; bf16 bytes on the dp axis). With exact
    # averaging every step, the averaged first moment makes the mean update that of batch-8 momentum (each
    # replica adds only (1 - beta1) of its own gradient): the ceiling of the idea
    "dense_dp_mv": [*DP, "dp.average_moments=true"],
    "dense_dp_avg1_mv": [*DP, "dp.inner_steps=1", "dp.fragments=1", *PLAIN_AVG, *EXACT_DP,
                         "dp.average_moments=true"],
    # ... which left the second moment as the one difference from batch-8 AdamW: each replica's v holds its own
    # batch-4 gradient noise. dp.v_correction estimates that noise from two microbatches of 2 (so the step sees
    # the same 4 sequences per replica, split in two; other sequences than batch 4 x 1 draws, hence the _mb2
    # controls) and takes the excess out of v
    "dense_dp_mb2": [*DP, *MB2],
    "dense_dp_vc": [*DP, *MB2, "dp.v_correction=true"],
    # the same, each replica keeping the progress its rounds did not send (thirty-fourth session)
    "dense_dp_vc_kr": [*DP, *MB2, "dp.v_correction=true", "dp.keep_residual=true"],
    "dense_dp_avg1_mv_vc": [*DP, "dp.inner_steps=1", "dp.fragments=1", *PLAIN_AVG, *EXACT_DP,
                            "dp.average_moments=true", *MB2, "dp.v_correction=true"],
    # is it only a longer step? The same at lr 1.41e-4, against dense_dp_lr1.4 and dense_lr1.4 (twelfth session)
    "dense_dp_vc_lr1.4": [*DP, *MB2, "dp.v_correction=true", "train.lr=1.41e-4"],
    # the whole system (the codec + plain-average DP) with and without it
    "rotq4_ns_g1_dpavg_mb2": [*ROTQ4_NS_G1, *DP, *MB2],
    "rotq4_ns_g1_dpavg_vc": [*ROTQ4_NS_G1, *DP, *MB2, "dp.v_correction=true"],
    # the estimate from four microbatches of one sequence (three degrees of freedom a step instead of one)
    "dense_dp_mb4": [*DP, *MB4],
    "dense_dp_vc_mb4": [*DP, *MB4, "dp.v_correction=true"],
    # X = 4 replicas of 2 sequences each (2 microbatches of 1): the same 8 sequences and 30 steps as X = 2, each
    # replica's second moment holding 4x batch 8's noise instead of 2x; the correction takes it to X = 4
    "dense_dp_x4_mb2": [*DP, *X4],
    "dense_dp_x4_vc": [*DP, *X4, "dp.v_correction=true"],
    # the whole system (the 4/1-bit codec + plain-average DP) at X = 4, with and without it (eighteenth session)
    "rotq4_ns_g1_dpavg_x4_mb2": [*ROTQ4_NS_G1, *DP, *X4],
    "rotq4_ns_g1_dpavg_x4_vc": [*ROTQ4_NS_G1, *DP, *X4, "dp.v_correction=true"],
    # the same with the fits (U, V, the bases) in 8 bits per value instead of bfloat16 (twenty-third session)
    "rotq1_refmap64_tc288_g144_p10_f8": [*TC288_G144, "mask.reference_fit_bits=8"],
    # the activation's code weighted by the boundary's empirical Fisher (the gradients its sender receives)
    "rotq1_refmap64_tc288_g144_p10_fisher": [*TC288_G144, "mask.reference_code_metric=fisher"],
    # both: the Fisher-weighted code with 8-bit fits; and at a quarter bit both ways
    "rotq1_refmap64_tc288_g144_p10_fisher_f8": [*TC288_G144, "mask.reference_code_metric=fisher",
                                                "mask.reference_fit_bits=8"],
    "rotq1_refmap64_tc144_g144_p10_fisher_f8": [*REFMAP64_P10, "mask.reference_code_bits=144",
                                                "mask.reference_grad_code_bits=144",
                                                "mask.reference_code_metric=fisher", "mask.reference_fit_bits=8"],
    # where the headline row's gap comes from (twenty-fourth session): its forward code with a 4-bit gradient, and
    # its gradient code with a 4-bit forward (each fitted at the same period, 8-bit fits)
    "rotq1_refmap64_tc288_g4_p10_fisher_f8": [*REFMAP64_P10, "mask.reference_code_bits=288", "mask.grad_bits=4",
                                              "mask.reference_code_metric=fisher", "mask.reference_fit_bits=8"],
    "rotq4_refmap64_g144_p10_f8": [*REFMAP64_P10, "mask.bits=4", "mask.reference_grad_code_bits=144",
                                   "mask.reference_fit_bits=8"],
    # the headline row with the returning gradient applied only along the directions the code sent
    # (mask.reference_code_grad = project): the sender is not pushed where the next stage never sees it
    "rotq1_refmap64_tc288_g144_p10_fisher_f8_proj": [*TC288_G144, "mask.reference_code_metric=fisher",
                                                     "mask.reference_fit_bits=8", "mask.reference_code_grad=project"],
    # a third more bits forward (two thirds of a bit), for the 150-step run whose gap grew past 1 %
    "rotq1_refmap64_tc384_g144_p10_fisher_f8": [*REFMAP64_P10, "mask.reference_code_bits=384",
                                                "mask.reference_grad_code_bits=144",
                                                "mask.reference_code_metric=fisher", "mask.reference_fit_bits=8"],
    # an eighth of a bit back (twenty-seventh session): the gradient code was cheap to halve before (1 -> 1/2 -> 1/4
    # bit back cost nothing measurable); at 1/8 the boundaries' codes leave ~15 B/token of the 1/40 budget for DP
    "rotq1_refmap64_tc288_g72_p10_fisher_f8": [*REFMAP64_P10, "mask.reference_code_bits=288",
                                               "mask.reference_grad_code_bits=72",
                                               "mask.reference_code_metric=fisher", "mask.reference_fit_bits=8"],
    # the same refitted half as often (every 20 steps) or twice as often (every 5), the first fit still after 10
    # (twenty-ninth session): at scale a fit's bytes per token fall with the period, the warm-up's do not matter; what
    # does a fit's age cost?
    **{f"rotq1_refmap64_tc288_g72_p{p}_first10_fisher_f8": [
        *REFMAP64_P10, f"mask.reference_map_period={p}", "mask.reference_map_first=10", "mask.reference_code_bits=288",
        "mask.reference_grad_code_bits=72", "mask.reference_fit_bits=8", "mask.reference_code_metric=fisher"]
       for p in (5, 20)},
    # the fits in 4 bits per value (thirtieth session): a fit's ~440 kB become ~230 kB, so at the same period the
    # fits cost about half the bytes per token; what does the coarser basis and map cost?
    "rotq1_refmap64_tc288_g72_p10_fisher_f4": [*REFMAP64_P10, "mask.reference_code_bits=288",
                                               "mask.reference_grad_code_bits=72",
                                               "mask.reference_code_metric=fisher", "mask.reference_fit_bits=4"],
    # and with each token's scale in one byte instead of two (mask.token_scale = log8): 96.5 B/token a step without a
    # fit instead of 100.5
    "rotq1_refmap64_tc288_g72_p10_fisher_f4_log8": [*REFMAP64_P10, "mask.reference_code_bits=288",
                                                    "mask.reference_grad_code_bits=72",
                                                    "mask.reference_code_metric=fisher", "mask.reference_fit_bits=4",
                                                    "mask.token_scale=log8"],
    # one-byte token scales alone, the fits in 8 bits (thirty-first session): which of the two cost the row above its
    # +0.25 points?
    "rotq1_refmap64_tc288_g72_p10_fisher_f8_log8": [*REFMAP64_P10, "mask.reference_code_bits=288",
                                                    "mask.reference_grad_code_bits=72",
                                                    "mask.reference_code_metric=fisher", "mask.reference_fit_bits=8",
                                                    "mask.token_scale=log8"],
    # the map in 8 bits, the codes' bases in 4 (mask.reference_basis_bits), whose encoders the sender now fits to the
    # rounded bases, with one-byte token scales (thirty-first session): the bases are most of a fit's bytes, the map's
    # U and V lost most to 4-bit rounding in the offline probe
    "rotq1_refmap64_tc288_g72_p10_fisher_f8_b4_log8": [*REFMAP64_P10, "mask.reference_code_bits=288",
                                                       "mask.reference_grad_code_bits=72",
                                                       "mask.reference_code_metric=fisher",
                                                       "mask.reference_fit_bits=8", "mask.reference_basis_bits=4",
                                                       "mask.token_scale=log8"],
    # and a sixteenth (36 bits a token): where does the gradient code's slack end?
    "rotq1_refmap64_tc288_g36_p10_fisher_f8": [*REFMAP64_P10, "mask.reference_code_bits=288",
                                               "mask.reference_grad_code_bits=36",
                                               "mask.reference_code_metric=fisher", "mask.reference_fit_bits=8"],
    # the whole system with the transform codes (twenty-third session): half a bit forward, a quarter back, and
    # plain-average DP with dp.v_correction (each replica fits its own maps and codes); and with PowerSGD rank 4
    "rotq1_refmap64_tc288_g144_p10_dpavg_vc": [*TC288_G144, *DP, *MB2, "dp.v_correction=true"],
    "rotq1_refmap64_tc288_g144_p10_dpavg_vc_r4": [*TC288_G144, *DP, *MB2, "dp.v_correction=true", "dp.rank=4"],
    # the same with the Fisher-weighted code and 8-bit fits (twenty-fourth session)
    "rotq1_refmap64_tc288_g144_p10_fisher_f8_dpavg_vc_r4": [*TC288_G144, "mask.reference_code_metric=fisher",
                                                            "mask.reference_fit_bits=8", *DP, *MB2,
                                                            "dp.v_correction=true", "dp.rank=4"],
    # At scale (thirty-third session): 8x the table's tokens a step (32 sequences of 256; run with --steps 480 so each
    # row takes 60 steps), where a fit every 10 steps and DP syncs cost 1/8 as much per token. Dense on one replica;
    # DP as X = 2 replicas of 16 sequences (4 microbatches of 4), PowerSGD rank 2 with 8-bit factors every H = 20
    # steps (the twenty-eighth session's arithmetic: ~12 B/token at this batch), plain average, dp.v_correction;
    # and the whole system: the 1/8-bit-back code with 8-bit fits and one-byte scales, with that DP.
    "dense_b32": B32,
    "dense_dp_vc_r2_h20_b32": [*DP, *DP_B32],
    # the same DP uncompressed (every matrix below the rank, float factors): what the interval H = 20 costs alone
    "dense_dp_vc_exact_h20_b32": [*DP, *DP_B32, *EXACT_DP],
    # the same DP bytes spent as rank 1 twice as often (H = 10)
    "dense_dp_vc_r1_h10_b32": [*DP, *DP_B32, "dp.rank=1", "dp.inner_steps=10"],
    # rank 2 every 20 steps, each replica keeping the progress its rounds did not send (dp.keep_residual)
    "dense_dp_vc_r2_h20_kr_b32": [*DP, *DP_B32, "dp.keep_residual=true"],
    # half its DP bytes: rank 1 every 20 steps with keep_residual (what brings the whole system under dense/40)
    "dense_dp_vc_r1_h20_kr_b32": [*DP, *DP_B32, "dp.rank=1", "dp.keep_residual=true"],
    # what syncing more often buys back (forty-first session): the same at H = 10 and H = 5 (2x, 4x the DP bytes)
    "dense_dp_vc_r1_h10_kr_b32": [*DP, *DP_B32, "dp.rank=1", "dp.keep_residual=true", "dp.inner_steps=10"],
    "dense_dp_vc_r1_h5_kr_b32": [*DP, *DP_B32, "dp.rank=1", "dp.keep_residual=true", "dp.inner_steps=5"],
    # the control for those DP rows: one replica alone on its 16 sequences a step (run with --steps 240 for 60 steps;
    # half the tokens): what a DP replica would reach if its syncs brought it nothing
    "dense_b16": ["train.batch_size=4", "train.microbatches=4"],
}
# the codes alone at that batch (thirty-sixth session): do they cost over dense_b32 what they cost at the table's
# batch (+0.8-0.9 %), or the +1.1-1.6 % they cost over the DP rows?
VARIANTS["rotq1_refmap64_tc288_g72_p10_fisher_f8_log8_b32"] = [
    *VARIANTS["rotq1_refmap64_tc288_g72_p10_fisher_f8_log8"], *B32]
# the same with the first fit after step 2 instead of 10: at this batch the 1-bit warm-up before the first fit
# spans 80 of the table's steps' tokens, and the row was already +1.3 % at step 15
VARIANTS["rotq1_refmap64_tc288_g72_p10_first2_fisher_f8_log8_b32"] = [
    *VARIANTS["rotq1_refmap64_tc288_g72_p10_fisher_f8_log8_b32"], "mask.reference_map_first=2"]
# and with the fits' statistics decayed by 0.7 a step (mask.reference_fit_decay): a fit follows the last ~3 steps
# instead of all 10 since the last one, so the fit in use is younger at the same period and bytes
VARIANTS["rotq1_refmap64_tc288_g72_p10_d7_fisher_f8_log8_b32"] = [
    *VARIANTS["rotq1_refmap64_tc288_g72_p10_fisher_f8_log8_b32"], "mask.reference_fit_decay=0.7"]
VARIANTS["rotq1_refmap64_tc288_g72_p10_first2_d7_fisher_f8_log8_b32"] = [
    *VARIANTS["rotq1_refmap64_tc288_g72_p10_first2_fisher_f8_log8_b32"], "mask.reference_fit_decay=0.7"]
# which code costs at this batch: the forward code with the gradient in 4-bit rotq (no gradient code)
VARIANTS["rotq1_refmap64_tc288_g4_p10_fisher_f8_log8_b32"] = [
    *REFMAP64_P10, "mask.reference_code_bits=288", "mask.grad_bits=4", "mask.reference_code_metric=fisher",
    "mask.reference_fit_bits=8", "mask.token_scale=log8", *B32]
# refitted every 5 steps (the first still after 10): what a fit half as old buys at this batch (5.5 B/token more)
VARIANTS["rotq1_refmap64_tc288_g72_p5_first10_fisher_f8_log8_b32"] = [
    *VARIANTS["rotq1_refmap64_tc288_g72_p10_fisher_f8_log8_b32"], "mask.reference_map_period=5",
    "mask.reference_map_first=10"]
# the codes against a reference that follows training (thirty-seventh session; mask.reference_refresh): every 10
# steps the reference takes the live weights (one replica: the upper bound of following DP's start weights; its
# ``ref`` bytes are a bfloat16 copy of each stage per follower, not what the swarm would pay), each fit 3 steps after
# a refresh (the maps are dropped at it; the codes stay until the fit)
VARIANTS["rotq1_refmap64_tc288_g72_p10_first3_rr10_fisher_f8_log8_b32"] = [
    *VARIANTS["rotq1_refmap64_tc288_g72_p10_fisher_f8_log8_b32"], "mask.reference_map_first=3",
    "mask.reference_refresh=10"]
# the same, each refresh sending only the best rank-1 approximation of each matrix's distance from the live weights
# (mask.reference_refresh_rank; vectors whole): a reference a swarm could afford to follow
VARIANTS["rotq1_refmap64_tc288_g72_p10_first3_rr10r1_fisher_f8_log8_b32"] = [
    *VARIANTS["rotq1_refmap64_tc288_g72_p10_first3_rr10_fisher_f8_log8_b32"], "mask.reference_refresh_rank=1"]
# its control: the same fit schedule against the pretrained model
VARIANTS["rotq1_refmap64_tc288_g72_p10_first3_fisher_f8_log8_b32"] = [
    *VARIANTS["rotq1_refmap64_tc288_g72_p10_fisher_f8_log8_b32"], "mask.reference_map_first=3"]
# the same at the table's batch (4 sequences a step; --steps 60)
VARIANTS["rotq1_refmap64_tc288_g72_p10_first3_rr10_fisher_f8_log8"] = [
    *VARIANTS["rotq1_refmap64_tc288_g72_p10_fisher_f8_log8"], "mask.reference_map_first=3",
    "mask.reference_refresh=10"]
# and its control (the pretrained reference, the same fit schedule) and the rank-1 moves, at that batch
VARIANTS["rotq1_refmap64_tc288_g72_p10_first3_fisher_f8_log8"] = [
    *VARIANTS["rotq1_refmap64_tc288_g72_p10_fisher_f8_log8"], "mask.reference_map_first=3"]
VARIANTS["rotq1_refmap64_tc288_g72_p10_first3_rr10r1_fisher_f8_log8"] = [
    *VARIANTS["rotq1_refmap64_tc288_g72_p10_first3_rr10_fisher_f8_log8"], "mask.reference_refresh_rank=1"]
VARIANTS["rotq1_refmap64_tc288_g72_p10_fisher_f8_log8_dp_r2_h20_b32"] = [
    *VARIANTS["rotq1_refmap64_tc288_g72_p10_fisher_f8_log8"], *DP, *DP_B32]
VARIANTS["rotq1_refmap64_tc288_g72_p10_fisher_f8_log8_dp_r2_h20_kr_b32"] = [
    *VARIANTS["rotq1_refmap64_tc288_g72_p10_fisher_f8_log8_dp_r2_h20_b32"], "dp.keep_residual=true"]
VARIANTS["rotq1_refmap64_tc288_g72_p10_fisher_f8_log8_dp_r1_h20_kr_b32"] = [
    *VARIANTS["rotq1_refmap64_tc288_g72_p10_fisher_f8_log8_dp_r2_h20_kr_b32"], "dp.rank=1"]
VARIANTS["rotq1_refmap64_tc288_g72_p10_first2_fisher_f8_log8_dp_r1_h20_kr_b32"] = [
    *VARIANTS["rotq1_refmap64_tc288_g72_p10_fisher_f8_log8_dp_r1_h20_kr_b32"], "mask.reference_map_first=2"]
# the whole system with the reference following DP's start weights every 10 steps (the rounds of each stage go to
# the peers of the two others: the ``ref`` axis, twice the dp axis at 3 stages)
VARIANTS["rotq1_refmap64_tc288_g72_p10_first3_rr10_fisher_f8_log8_dp_r1_h20_kr_b32"] = [
    *VARIANTS["rotq1_refmap64_tc288_g72_p10_fisher_f8_log8_dp_r1_h20_kr_b32"], "mask.reference_map_first=3",
    "mask.reference_refresh=10"]
# the whole system with each replica chain's own reference moved every 10 steps by the best rank-1 step of each
# matrix towards that chain's live weights (thirty-ninth session; ~21 B/token on ``ref`` instead of DP's rounds)
VARIANTS["rotq1_refmap64_tc288_g72_p10_first3_rr10r1_fisher_f8_log8_dp_r1_h20_kr_b32"] = [
    *VARIANTS["rotq1_refmap64_tc288_g72_p10_first3_rr10_fisher_f8_log8_dp_r1_h20_kr_b32"],
    "mask.reference_refresh_rank=1"]
# and with a quarter bit forward (36 B/token less)
VARIANTS["rotq1_refmap64_tc144_g72_p10_first3_rr10r1_fisher_f8_log8_dp_r1_h20_kr_b32"] = [
    *VARIANTS["rotq1_refmap64_tc288_g72_p10_first3_rr10r1_fisher_f8_log8_dp_r1_h20_kr_b32"],
    "mask.reference_code_bits=144"]
# with DP each chain's moves reach its own followers, so per token the ref axis doubles at 2 replicas (43 B/token
# in bf16): the quarter bit and int8 factors together (~110 B/token, under dense/40)
VARIANTS["rotq1_refmap64_tc144_g72_p10_first3_rr10r1q8_fisher_f8_log8_dp_r1_h20_kr_b32"] = [
    *VARIANTS["rotq1_refmap64_tc144_g72_p10_first3_rr10r1_fisher_f8_log8_dp_r1_h20_kr_b32"],
    "mask.reference_refresh_bits=8"]
# the rank-1 moves' factors in int8 (mask.reference_refresh_bits = 8; half the ref bytes), at the table's batch
VARIANTS["rotq1_refmap64_tc288_g72_p10_first3_rr10r1q8_fisher_f8_log8"] = [
    *VARIANTS["rotq1_refmap64_tc288_g72_p10_first3_rr10r1_fisher_f8_log8"], "mask.reference_refresh_bits=8"]
# and with a quarter bit forward instead of a half: what pays for those bytes if the moved reference leaves less
VARIANTS["rotq1_refmap64_tc144_g72_p10_first3_rr10_fisher_f8_log8_dp_r1_h20_kr_b32"] = [
    *VARIANTS["rotq1_refmap64_tc288_g72_p10_first3_rr10_fisher_f8_log8_dp_r1_h20_kr_b32"],
    "mask.reference_code_bits=144"]
VARIANTS["rotq1_refmap64_tc144_g72_p10_first3_rr10_fisher_f8_log8_b32"] = [
    *VARIANTS["rotq1_refmap64_tc288_g72_p10_first3_rr10_fisher_f8_log8_b32"], "mask.reference_code_bits=144"]
TABLE = ["dense", "dense_dp", "m90", "m90_ap", "m95", "m95_ap", "m95_ap_dp", "topk", "int8"]

logger = logging.getLogger("quality_table")


def steps_for(cfg_path: Path, overrides: list[str], steps: int, sets: list[str]) -> tuple[int, int]:
    """(optimizer steps, DP replicas) of a variant given ``steps`` of the base config's batch: every variant gets
    the same tokens, so one that takes more sequences per step (DP replicas, a larger batch) runs fewer steps."""
    base, own = load_config(cfg_path, sets), load_config(cfg_path, [*sets, *overrides])
    replicas = own.dp.replicas if own.dp.enabled else 1
    per_step = replicas * own.train.batch_size * own.train.microbatches
    per_step_base = base.train.batch_size * base.train.microbatches
    if per_step % per_step_base:
        raise SystemExit(f"{overrides}: {per_step} sequences per step is not a multiple of the base {per_step_base}")
    return steps // (per_step // per_step_base), replicas


@torch.no_grad()
def refresh_next_gains(trainer: MeshTrainer) -> None:
    """Copy each receiving stage's live first input-norm gains into its sender's ``next_input_gain`` (an oracle:
    in the swarm a sender keeps the gains it loaded)."""
    for row in trainer.workers:
        for sender, receiver in zip(row[:-1], row[1:]):
            sender.module.next_input_gain.copy_(receiver.module.layers[0].input_layernorm.weight)


@torch.no_grad()
def jitter_gains(trainer: MeshTrainer, size: float, seed: int = 1) -> None:
    """Scale every sender's copy of its receiver's gains by 1 +- ``size``: a fixed random sign per channel and
    boundary, the same in every replica."""
    for row in trainer.workers:
        for i, sender in enumerate(row[:-1]):
            gain = sender.module.next_input_gain
            signs = torch.randint(0, 2, gain.shape, generator=torch.Generator().manual_seed(seed + i)) * 2 - 1
            gain.mul_(1 + size * signs.to(gain))


def step_bytes(records: list[dict]) -> list[dict[str, int]]:
    """Bytes sent in each step, per axis (the step records carry the running totals)."""
    out, before = [], dict.fromkeys(AXES, 0)
    for rec in records:
        if "loss" in rec and "bytes" in rec:
            out.append({a: rec["bytes"][a] - before[a] for a in AXES})
            before = {a: rec["bytes"][a] for a in AXES}
    return out


def steady_bytes_per_token(per_step: list[dict[str, int]], tokens_per_step: float) -> dict[str, float]:
    """Bytes per token of the median step of the run's second half, per axis and in total: what a step costs
    when it ships no fit (fits come every few steps) and the warm-up is over, measured, not derived from the
    codes' sizes. Like the fits, DP's syncs (every H steps) fall outside the median: a DP row's periodic costs are
    in its ``bytes_per_token`` only. Empty for a run of no steps."""
    half = per_step[len(per_step) // 2:]
    if not half or tokens_per_step <= 0:
        return {}
    out = {a: statistics.median(s[a] for s in half) / tokens_per_step for a in AXES}
    out["total"] = statistics.median(sum(s.values()) for s in half) / tokens_per_step
    return out


def run_one(task: str, name: str, overrides: list[str], steps: int, args, eval_sets) -> dict:
    cfg_path = ROOT / "configs" / TASKS[task]
    live_gains = LIVE_GAINS in overrides
    jitter = [float(o.removeprefix(GAIN_JITTER)) for o in overrides if o.startswith(GAIN_JITTER)]
    overrides = [o for o in overrides if o != LIVE_GAINS and not o.startswith(GAIN_JITTER)]
    run_steps, replicas = steps_for(cfg_path, overrides, steps, args.set)
    cfg = load_config(cfg_path, [
        *args.set, *overrides, f"train.steps={run_steps}", f"train.eval_every={max(1, run_steps // 4)}",
        f"train.eval_batches={args.eval_batches}",
    ])
    trainer = MeshTrainer(cfg, Path(args.cache_dir))
    if jitter:
        jitter_gains(trainer, jitter[0])
    loaded_gains = [[w.module.next_input_gain.clone() for w in row[:-1]] for row in trainer.workers
                    ] if live_gains else []
    records: list[dict] = []
    t0 = time.perf_counter()

    def on_record(rec: dict) -> None:
        records.append(rec)
        if live_gains and "loss" in rec:
            refresh_next_gains(trainer)
        if "loss" in rec and (rec["step"] + 1) % 10 == 0:  # with the bytes so far: a run that dies leaves them too
            so_far = {a: rec["bytes"][a] / max(1, rec["tokens"]) for a in AXES if rec.get("bytes", {}).get(a)}
            logger.info("%s/%s step %d loss %.4f, B/token so far %s (total %.1f)", task, name, rec["step"] + 1,
                        rec["loss"], {a: round(v, 1) for a, v in so_far.items()}, sum(so_far.values()))
        if "heldout_loss" in rec:  # in the log as it comes: a run that dies still leaves its evaluations
            logger.info("%s/%s held-out loss %.4f at step %d", task, name, rec["heldout_loss"], rec["step"])

    result = trainer.train(metrics=on_record)
    wall = time.perf_counter() - t0
    held = {corpus: trainer.heldout_loss(batches=batches) for corpus, batches in eval_sets.items()}
    final = records[-1]
    per_step = step_bytes(records)
    extra = {}
    if replicas > 1:  # held_out_loss is replica 0's; with dp.keep_residual the replicas differ by their residuals
        extra["heldout_loss_replica1"] = {c: trainer.heldout_loss(1, b) for c, b in eval_sets.items()}
        extra["heldout_loss_mean"] = {c: trainer.heldout_loss_of_mean(b) for c, b in eval_sets.items()}
        logger.info("%s/%s held-out of replica 1 %s, of the replicas' mean %s", task, name,
                    extra["heldout_loss_replica1"], extra["heldout_loss_mean"])
    if live_gains:  # how far the loaded copy would have been from the trained gains (largest relative difference)
        extra["gain_drift_max_rel"] = round(max(
            float(((row[i].module.next_input_gain - loaded_gains[r][i]).abs() / loaded_gains[r][i].abs()).max())
            for r, row in enumerate(trainer.workers) for i in range(len(row) - 1)), 4)
    return {
        **extra, "overrides": overrides, "steps": run_steps, "replicas": replicas, "tokens": result.tokens,
        "heldout_loss": held, "bytes_per_token": final["bytes_per_token"], "wall_s": round(wall, 1),
        # the process's peak resident memory so far (Linux: KiB): what running rows side by side must fit
        "peak_rss_gb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 2),
        "bytes_per_token_steady": {a: round(v, 2) for a, v in
                                   steady_bytes_per_token(per_step, result.tokens / max(1, run_steps)).items()},
        "bytes_per_step": per_step,
        "tokens_per_s": final["tokens_per_s"],
        "loss_curve": [round(r["loss"], 4) for r in records if "loss" in r],
        "eval_curve": [[r["step"], round(r["heldout_loss"], 4)] for r in records
                       if "heldout_loss" in r and not r.get("final")],
    }


def render(path: Path) -> None:
    data = json.loads(path.read_text())
    commands = data.get("commands") or [data.get("command", "")]
    head = "Commands, in order: " if len(commands) > 1 else "Command: "
    lines = [head + ", ".join(f"`{c}`" for c in commands), "",
             f"{data.get('steps')} steps of batch {data.get('batch')} per variant (same tokens for all), "
             f"held-out loss evaluated unmasked on {data.get('eval_batches')} batches of each corpus.", ""]
    if data.get("note"):  # what a merged file holds beside its command's rows
        lines += [data["note"], ""]
    for task, runs in data["tasks"].items():
        before = data.get("before", {}).get(task, {})
        dense = runs.get("dense", {})
        lines += [
            f"### {task}", "",
            "| variant | held-out linux-doc | held-out sotu | vs dense (task corpus) | "
            "pp_fwd | pp_bwd | dp | anchor | ref | total B/token | a step without a fit, B/token | wall s |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        if before:
            lines.append(f"| (no training) | {before['linuxdoc']:.3f} | {before['sotu']:.3f} | | | | | | | | | |")
        own = "linuxdoc" if task == "domain" else "sotu"
        mean_rows = []
        for name, r in runs.items():
            h, b = r["heldout_loss"], r["bytes_per_token"]
            # a row at another batch (``*_b32``) against dense at that batch where the file has it (that dense row
            # itself against the table's dense)
            batch = re.search(r"_b\d+$", name)
            ref = (runs.get(f"dense{batch.group()}") if batch and name != f"dense{batch.group()}" else None) or dense
            rel = f"{(h[own] / ref['heldout_loss'][own] - 1) * 100:+.1f}%" if ref else ""
            steady = f"{r['bytes_per_token_steady']['total']:.1f}" if r.get("bytes_per_token_steady") else ""
            lines.append(
                f"| {name} | {h['linuxdoc']:.3f} | {h['sotu']:.3f} | {rel} | {b['pp_fwd']:.0f} | {b['pp_bwd']:.0f} | "
                f"{b['dp']:.0f} | {b['anchor']:.0f} | {b.get('ref', 0):.0f} | {b['total']:.0f} | {steady} | "
                f"{r['wall_s']:.0f} |"
            )
            if r.get("heldout_loss_mean"):
                mean_rows.append((name, r["heldout_loss_mean"], ref))
        lines.append("")
        if mean_rows:  # DP rows: the table scores replica 0; the replicas' exact average (one closing all-reduce)
            lines += ["Held-out loss of the replicas' exact average (DP rows; the table scores replica 0):", ""]
            for name, m, ref in mean_rows:
                rel = f" ({(m[own] / ref['heldout_loss'][own] - 1) * 100:+.1f}%)" if ref else ""
                lines.append(f"- {name}: linux-doc {m['linuxdoc']:.3f}{rel}, sotu {m['sotu']:.3f}")
            lines.append("")
    md = path.with_suffix(".md")
    md.write_text("\n".join(lines))
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:  # pragma: no cover
        logger.warning("matplotlib missing: no plot")
        return
    tasks = list(data["tasks"])
    fig, axes = plt.subplots(1, len(tasks), figsize=(7 * len(tasks), 4.5), squeeze=False)
    for ax, task in zip(axes[0], tasks):
        for i_run, (name, r) in enumerate(data["tasks"][task].items()):
            curve = r["loss_curve"]
            k = 5
            smooth = [sum(curve[max(0, i - k + 1): i + 1]) / len(curve[max(0, i - k + 1): i + 1])
                      for i in range(len(curve))]
            scale = data["steps"] / r["steps"] if r.get("steps") else r["replicas"]  # tokens per step vs base
            xs = [(i + 1) * scale for i in range(len(curve))]  # x = token budget (dense steps)
            # the colour cycle has 10 entries: later runs are dashed so no two lines look alike
            ax.plot(xs, smooth, label=name, lw=1.2, ls=("-", "--", ":")[min(i_run // 10, 2)])
        ax.set_title(f"{task}: training loss (5-step mean; masked variants see masked inputs)")
        ax.set_xlabel("token budget (base-batch steps)")
        ax.set_ylabel("train loss")
        ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path.with_name(path.stem + "_curves.png"), dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(ROOT / "docs" / "results" / "quality.json"))
    ap.add_argument("--tasks", default="domain,continual")
    ap.add_argument("--variants", default=",".join(TABLE))
    ap.add_argument("--extra", action="append", default=[], help="NAME=key=value,key=value")
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--eval-batches", type=int, default=8)
    ap.add_argument("--set", action="append", default=[], help="override for every run")
    ap.add_argument("--device", default="cpu", help="train.device of every run: cpu | cuda | cuda:N")
    ap.add_argument("--cache-dir", default=str(Path.home() / ".cache" / "meshnode"))
    ap.add_argument("--resume", action="store_true")
    ap.add_argument("--render", metavar="JSON", help="only render the Markdown table and plot of a JSON file")
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    if args.render:
        render(Path(args.render))
        return
    if args.device != "cpu":
        args.set.append(f"train.device={args.device}")
    variants = dict(VARIANTS)
    for extra in args.extra:
        name, _, spec = extra.partition("=")
        variants[name] = [kv for kv in spec.split(",") if kv]
    names = [v for v in args.variants.split(",") if v] + [e.partition("=")[0] for e in args.extra]
    unknown = [n for n in names if n not in variants]
    if unknown:
        raise SystemExit(f"unknown variants: {unknown}")
    out = Path(args.out)
    data = json.loads(out.read_text()) if args.resume and out.is_file() else {}
    command = "python scripts/quality_table.py " + " ".join(
        [f"--tasks {args.tasks}", f"--variants {args.variants}", f"--steps {args.steps}"]
        + ([f"--eval-batches {args.eval_batches}"] if args.eval_batches != 8 else [])
        + [f"--set {s}" for s in args.set] + [f"--extra {e}" for e in args.extra])
    # a resumed file keeps every command that wrote rows into it, in order; "command" is the latest
    commands = data.get("commands") or ([data["command"]] if data.get("command") else [])
    if not commands or commands[-1] != command:
        commands.append(command)
    data.update({
        "command": command, "commands": commands,
        "steps": args.steps, "eval_batches": args.eval_batches, "batch": [4, 256],
        "machine": {"cpu_threads": torch.get_num_threads(), "arch": platform.machine(), "torch": torch.__version__,
                    "device": torch.cuda.get_device_name(args.device) if args.device != "cpu" else "cpu"},
    })
    data.setdefault("tasks", {})
    data.setdefault("before", {})
    data.setdefault("variant_overrides", {})
    # the fixed evaluation sets: held-out windows of both corpora, tokenised with the model's tokenizer
    # under every run's own --set overrides (train.bf16, for one: "before" is evaluated in the runs' precision)
    base = MeshTrainer(load_config(ROOT / "configs" / TASKS["domain"], [
        *args.set, f"train.eval_batches={args.eval_batches}", f"train.device={args.device}"]), Path(args.cache_dir))
    data["machine"]["bf16_autocast"] = base.workers[0][0].bf16  # train.bf16 as resolved here ("auto": measured)
    eval_sets = {}
    for corpus, cfg_name in EVAL_CONFIGS.items():
        c = load_config(ROOT / "configs" / cfg_name)
        prepared = prepare_corpus(c.data, base.tokenizer, Path(args.cache_dir))
        eval_sets[corpus] = heldout_batches(prepared.heldout, c.train.batch_size, args.eval_batches)
    for task in args.tasks.split(","):
        data["before"].setdefault(task, {k: base.heldout_loss(batches=v) for k, v in eval_sets.items()})
        runs = data["tasks"].setdefault(task, {})
        for name in names:
            if args.resume and name in runs:
                continue
            logger.info("== %s / %s: %s", task, name, " ".join(variants[name]))
            runs[name] = run_one(task, name, variants[name], args.steps, args, eval_sets)
            data["variant_overrides"][name] = variants[name]
            logger.info("%s/%s: held-out %s, bytes/token %.1f, %.0f s", task, name, runs[name]["heldout_loss"],
                        runs[name]["bytes_per_token"]["total"], runs[name]["wall_s"])
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_text(json.dumps(data, indent=1))
    render(out)


if __name__ == "__main__":
    main()
