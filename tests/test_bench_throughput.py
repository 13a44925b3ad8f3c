"""Pure parts of scripts/bench_throughput.py: time scaling, variant configs, windows, the model wiring (no root)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))

import bench_throughput as bt  # noqa: E402
from meshnode import perf  # noqa: E402
from meshnode.config import config_from_dict  # noqa: E402


def test_time_scale_arithmetic():
    # 1 GFLOP on a 10 TFLOP/s GPU at 50 % = 0.2 ms; 50 ms here -> ratio 250 -> 200 Mbit/s becomes 0.8 Mbit/s
    s = bt.time_scale(0.05, 1e9, 200.0, 20.0, gpu_flops=10e12, utilisation=0.5)
    assert s.gpu_s == pytest.approx(2e-4)
    assert s.ratio == pytest.approx(250.0)
    assert s.emulated_mbit == pytest.approx(0.8)
    assert s.gpu_delay_ms_scaled == pytest.approx(5000.0)
    with pytest.raises(ValueError):
        bt.time_scale(0.0, 1e9, 200.0, 20.0)


def test_bench_model_flops_and_toml():
    b = bt.BenchModel()
    cfg = config_from_dict(__import__("tomllib").loads(b.toml()))
    assert cfg.model.stages == b.stages and cfg.model.tiny_layers == b.stages * b.layers_per_stage
    assert cfg.train.microbatches == b.microbatches and cfg.train.batch_size * cfg.data.seq_len == 256
    # the last stage carries the lm_head: more FLOPs than stage 0
    assert b.stage_flops(b.stages - 1) > b.stage_flops(0) > 0


@pytest.mark.parametrize("variant", bt.VARIANTS)
def test_variant_overrides_are_valid_configs(variant):
    b = bt.BenchModel()
    over = bt.variant_overrides(variant, replicas=2, anchor_key="ssh-rsa AAAA test")
    cfg = config_from_dict(__import__("tomllib").loads(b.toml()), over)
    assert cfg.anchor.enabled == (variant in ("m95_ap", "m95_ap_dp"))
    assert cfg.dp.enabled == (variant == "m95_ap_dp")
    assert (cfg.mask.ratio == 0.95) == variant.startswith("m95")
    assert cfg.mask.codec == {"topk": "topk", "int8": "int8"}.get(variant, "rotq" if "rotq" in variant else "mask")
    assert cfg.mask.grad_bits == (1 if variant == "rotq4g1" else 0)
    assert cfg.dp.overlap == (variant == "m95_ap_dp")
    assert cfg.anchor.snapshot == ("dp" if variant == "m95_ap_dp" else "full")  # follows DP where there is DP
    full = bt.variant_overrides(variant, replicas=2, anchor_key="ssh-rsa AAAA test", anchor_snapshot="full")
    assert config_from_dict(__import__("tomllib").loads(b.toml()), full).anchor.snapshot == "full"
    with pytest.raises(ValueError):
        bt.variant_overrides("nope", replicas=2, anchor_key="")


def test_driver_window_skips_warmup():
    recs = [{"step": i, "t": 100.0 + 2 * i, "tokens": 256 * (i + 1), "compute_s": 0.1 * i,
             "bytes": {"pp_fwd": 1000 * i}} for i in range(10)]
    recs.insert(3, {"kind": "tick", "t": 105.0})  # not a step record
    w = bt.driver_window(recs, warmup_s=5.0)
    assert w["t0"] == 106.0 and w["t1"] == 118.0  # first step >= 5 s after the first record
    assert w["tokens"] == 256 * 6 and w["tokens_per_s"] == pytest.approx(256 * 6 / 12)
    assert w["bytes"]["pp_fwd"] == 6000 and w["bytes"]["dp"] == 0
    assert bt.driver_window(recs[:1], 0.0) is None


def test_peer_window_interpolates():
    ticks = [{"t": 0.0, "bytes": {"pp_bwd": 0}, "compute_s": 0.0, "tokens": 0},
             {"t": 10.0, "bytes": {"pp_bwd": 1000}, "compute_s": 2.0, "tokens": 100}]
    w = bt.peer_window(ticks, 2.5, 7.5)
    assert w["bytes"]["pp_bwd"] == pytest.approx(500)
    assert w["compute_s"] == pytest.approx(1.0) and w["tokens"] == pytest.approx(50)
    assert bt.interpolate(ticks, -5, lambda s: s["compute_s"]) == 0.0  # clamped
    assert bt.interpolate(ticks, 50, lambda s: s["compute_s"]) == 2.0


def _sizes(fwd, bwd):
    return bt.WireSizes(fwd, bwd, [1e5, 1e5], [2e4, 2e4], [1e6, 1e6])


def test_predict_variant_comm_bound_dense_is_slower():
    b = bt.BenchModel()
    dense = bt.predict_variant("dense", b, 2, [0.02, 0.02], _sizes(*bt.codec_sizes("dense", b)), 0.7, 20.0)
    m95 = bt.predict_variant("m95", b, 2, [0.02, 0.02], _sizes(*bt.codec_sizes("m95", b)), 0.7, 20.0)
    assert dense.limit in ("uplink", "downlink", "latency")
    assert 10 < m95.tokens_per_s / dense.tokens_per_s < 21  # bounded by H / K = 20 (labels and headers aside)
    ap = bt.predict_variant("m95_ap", b, 2, [0.02, 0.02], _sizes(*bt.codec_sizes("m95", b)), 0.7, 20.0)
    dp = bt.predict_variant("m95_ap_dp", b, 2, [0.02, 0.02], _sizes(*bt.codec_sizes("m95", b)), 0.7, 20.0)
    assert dp.tokens_per_s <= ap.tokens_per_s <= m95.tokens_per_s


def test_codec_sizes_follow_the_codecs():
    b = bt.BenchModel()
    fwd, bwd = bt.codec_sizes("dense", b)
    tokens = b.batch * b.seq_len
    assert bwd == tokens * b.hidden * 2 + 64  # bf16 + header
    assert fwd == bwd + 2 * tokens  # + uint16 labels
    mf, mb = bt.codec_sizes("m95", b)
    assert mb == tokens * round(0.05 * b.hidden) * 2 + 64
    # rotq4g1: the same 4-bit forward as rotq4, the gradient back at 1 bit (+ per-token scales)
    (qf, qb), (gf, gb) = bt.codec_sizes("rotq4", b), bt.codec_sizes("rotq4g1", b)
    assert gf == qf and qf < fwd / 3
    assert tokens * b.hidden / 8 + 64 <= gb < qb / 3


def test_step_barrier_lowers_the_rate():
    costs = [perf.StageCost(0.1, 1e5, 1e5)] * 2
    link = perf.LinkSpec(1e7)
    free = perf.predict_tokens_per_s(costs, perf.SwarmShape(2, 1, 4, 256, microbatches_per_step=4), link)
    bar = perf.predict_tokens_per_s(
        costs, perf.SwarmShape(2, 1, 4, 256, microbatches_per_step=4, step_barrier=True), link)
    assert bar.tokens_per_s < free.tokens_per_s
    # (m - 1) t_max + T_rt = 3 * 0.1 + (0.2 + 0.16) per 4 microbatches
    assert bar.microbatches_per_s == pytest.approx(4 / (3 * 0.1 + 0.2 + 8 * 2e5 / 1e7))


class _FakePeer:
    def __init__(self, name, ns_index, role, stage, recs, traces=()):
        self.name, self.ns_index, self.role, self.stage, self._recs = name, ns_index, role, stage, recs
        self._traces = list(traces)

    def records(self):
        return self._recs

    def traces(self):
        return self._traces


def test_message_timing_pairs_each_call_with_the_serve_that_answered_it():
    calls = [{"kind": "call", "stage": 0, "driver": "d0", "step": s, "mb": m, "t_call": 10.0 * s + m,
              "t_back": 10.0 * s + m + 2.0, "bytes": 100} for s in range(4) for m in range(2)]
    # stage 1 gets each forward 0.5 s after the call and replies 1.25 s after that; a retried attempt of step 1
    # mb 0 that another replica served too late for the call to have used it is ignored
    serves = [{"kind": "serve", "stage": 1, "driver": "d0", "step": c["step"], "mb": c["mb"],
               "t_in": c["t_call"] + 0.5, "t_out": c["t_call"] + 1.75, "bytes": 50} for c in calls]
    stray = {"kind": "serve", "stage": 1, "driver": "d0", "step": 1, "mb": 0, "t_in": 30.0, "t_out": 31.0, "bytes": 0}
    other = {"kind": "call", "stage": 1, "driver": "d0", "step": 1, "mb": 0, "t_call": 10.6, "t_back": 11.5}
    peers = [_FakePeer("driver-0", 1, "driver", 0, [], calls),
             _FakePeer("stage1-0", 0, "fast", 1, [], [*serves[:4], stray, other]),
             _FakePeer("stage1-1", 2, "fast", 1, [], serves[4:])]
    m = bt.message_timing(peers, 10.0, 30.0)  # steps 1 and 2 (t_call 10, 11, 20, 21) and step 3 starts at 30
    assert m["calls"] == 5
    assert (m["fwd"], m["serve"], m["bwd"], m["rtt"]) == pytest.approx((0.5, 1.25, 0.25, 2.0))
    assert bt.message_timing(peers[:1], 0.0, 100.0) == {}  # no serve records: nothing to pair


def test_summarize_counts_wire_bytes_per_peer():
    """Link counters are interpolated over the drivers' window, per peer, and set against the counted bytes."""
    steps = [{"step": i, "t": 10.0 * i, "tokens": 1000 * i, "compute_s": 0.0,
              "bytes": {"pp_fwd": 100 * i}} for i in range(5)]
    ticks = [{"t": 10.0 * i, "bytes": {"pp_bwd": 50 * i}, "compute_s": 0.0, "tokens": 0} for i in range(5)]
    peers = [_FakePeer("driver-0", 1, "driver", 0, steps),
             _FakePeer("stage1-0", 0, "fast", 1, ticks)]
    # peer 1 (the driver) uploads 300 B/s on the wire, peer 0 uploads 150 B/s
    links = [{"t": 5.0 * i, "links": {1: (1500 * i, 0), 0: (750 * i, 10 * i)},
              "tcp": {1: {"out_segs": 10 * i, "retrans_segs": i}, 0: {"out_segs": 4 * i, "retrans_segs": 0}}}
             for i in range(9)]
    out = bt.summarize("dense", peers, bt.BenchModel(), 1, warmup_s=10.0, ready_s=1.0, link_samples=links)
    assert out["window_s"] == pytest.approx(30.0)  # steps 1..4
    assert out["tokens_per_s"] == pytest.approx(100.0)
    d, f = out["peers"]["driver-0"], out["peers"]["stage1-0"]
    assert d["wire_up_bytes"] == pytest.approx(9000) and f["wire_up_bytes"] == pytest.approx(4500)
    assert f["wire_down_bytes"] == pytest.approx(60)
    assert d["wire_up_over_counted"] == pytest.approx(9000 / 300)  # counted: 100 B per step on pp_fwd
    assert out["wire_bytes_per_token"] == pytest.approx(13500 / 3000)
    assert out["wire_over_counted"] == pytest.approx(13500 / 450)
    assert d["tcp_out_segs"] == pytest.approx(60) and d["tcp_retrans_segs"] == pytest.approx(6)
    assert d["tcp_retrans_share"] == pytest.approx(6 / 66) and f["tcp_retrans_share"] == 0.0  # of all segments sent
    assert "wire_bytes_per_token" not in bt.summarize("dense", peers, bt.BenchModel(), 1, 10.0, 1.0)


def test_the_available_link_takes_idle_traffic_and_retransmissions_off():
    # 1 Mbit/s, 5 % retransmitted, 12.5 kB/s idle traffic (0.1 Mbit/s): 0.95 - 0.1 = 0.85 Mbit/s for the pipeline
    assert bt.available_link_mbit(1.0, 12_500.0, 0.05) == pytest.approx(0.85)
    assert bt.available_link_mbit(1.0) == 1.0
    assert bt.available_link_mbit(1.0, 1e6, 0.0) == pytest.approx(0.05)  # floored, never zero or negative
    # a recorded variant is re-evaluated on what its run left the pipeline, not on the nominal rate
    b = bt.BenchModel()
    fwd, bwd = bt.codec_sizes("dense", b)
    mi = {"compute_s_per_microbatch": [0.02, 0.02], "pp_fwd_bytes": fwd, "pp_bwd_bytes": bwd, "dp_per_sync": 0.0,
          "prior_per_cycle": 0.0, "snapshot_per_cycle": 0.0, "dp_inner_steps": 10, "anchor_period": 10}
    result = {"model": {f: getattr(b, f) for f in b.__dataclass_fields__}, "swarm": {"replicas_per_stage": 2},
              "link": {"rate_mbit_each_way": 0.7, "delay_ms_one_way": 20.0},
              "variants": {"dense": {"model_inputs": dict(mi), "steps_in_window": [5, 5]}}}
    nominal = bt._sim_of(result, "dense", 0.0).tokens_per_s
    result["variants"]["dense"]["model_inputs"]["link_mbit_available"] = 0.35
    assert bt._sim_of(result, "dense", 0.0).tokens_per_s == nominal  # the prediction stays on the nominal link
    halved = bt._sim_of(result, "dense", 0.0, "available").tokens_per_s
    assert halved == pytest.approx(nominal / 2, rel=0.1)  # dense is link-bound: half the link, half the rate


def test_an_anchor_that_follows_dp_pays_the_log_not_the_weights():
    b = bt.BenchModel()
    full = bt.WireSizes(*bt.codec_sizes("m95", b), [1e5, 1e5], [2e4, 2e4], [1e6, 1e6], dp_log_per_sync=[5e4, 6e4])
    follow = full.anchor_follows_dp(anchor_period=20, dp_inner_steps=10)
    assert follow.snapshot_per_cycle == [1e5, 1.2e5] and follow.dp_per_sync == full.dp_per_sync
    runs = {name: bt.simulate_variant("m95_ap_dp", b, 2, [0.02, 0.02], sz, 0.7, 20.0, anchor_period=20, steps=40)
            for name, sz in (("full", full), ("follow", follow))}
    assert runs["follow"].tokens_per_s > runs["full"].tokens_per_s  # the 2 MB weight fetches are gone


def test_run_background_is_the_fast_peers_unpaid_upload_less_the_anchors_reads():
    """Fast peers' wire upload beyond their counted bytes, per peer and second, less the snapshot bytes the anchor
    read from them (it counts them, they do not), which the event model already sends."""
    mi = {"snapshot_per_cycle": [1000.0, 3000.0], "prior_per_cycle": [500.0, 500.0], "priors": "rpc"}
    peers = {
        "driver-0": {"role": "driver", "bytes_sent": {"pp_fwd": 4000.0}, "wire_up_bytes": 10000.0},
        "stage1-0": {"role": "fast", "bytes_sent": {"pp_bwd": 3000.0, "dp": 1000.0}, "wire_up_bytes": 14000.0},
        # 2 cycles: per cycle 4000 B of snapshots + 2 replicas x 1000 B of priors = 6000 B counted by the anchor
        "anchor": {"role": "anchor", "bytes_sent": {"anchor": 12000.0}, "wire_up_bytes": 9000.0},
    }
    r = {"window_s": 10.0, "model_inputs": mi, "peers": peers}
    # unpaid: 6000 + 10000 = 16000 B, less 2 x 4000 B of snapshots = 8000 B over 2 peers and 10 s
    assert bt.run_background(r, replicas=2) == pytest.approx(400.0)
    dht = {**r, "model_inputs": {**mi, "priors": "dht"}}  # one store per prior: 5000 B a cycle, 2.4 cycles
    assert bt.run_background(dht, replicas=2) == pytest.approx((16000 - 2.4 * 4000) / 20)
    no_anchor = {"window_s": 10.0, "model_inputs": mi, "peers": {k: v for k, v in peers.items() if k != "anchor"}}
    assert bt.run_background(no_anchor, replicas=2) == pytest.approx(800.0)
    assert bt.run_background({"window_s": 10.0, "peers": {"d": {"role": "driver", "bytes_sent": {}}}}, 2) is None
    assert [bt.swarm_kind(v) for v in ("dense", "m95", "m95_ap", "m95_ap_dp")] == ["fast", "fast", "anchor",
                                                                                   "anchor_dp"]


def test_the_run_account_charges_the_runs_own_background():
    """``_sim_of(..., "run")`` charges the run's unpaid traffic where ``"busy"`` charges the idle swarm's: more of it
    leaves a link-bound variant less, the same amount gives the same rate."""
    b = bt.BenchModel()
    fwd, bwd = bt.codec_sizes("dense", b)
    mi = {"compute_s_per_microbatch": [0.02, 0.02], "pp_fwd_bytes": fwd, "pp_bwd_bytes": bwd, "dp_per_sync": 0.0,
          "prior_per_cycle": 0.0, "snapshot_per_cycle": 0.0, "dp_inner_steps": 10, "anchor_period": 10,
          "background_bytes_per_s": 20_000.0, "run_background_bytes_per_s": 20_000.0}
    result = {"model": {f: getattr(b, f) for f in b.__dataclass_fields__}, "swarm": {"replicas_per_stage": 2},
              "link": {"rate_mbit_each_way": 0.7, "delay_ms_one_way": 20.0},
              "variants": {"dense": {"model_inputs": mi, "steps_in_window": [5, 5]}}}
    busy = bt._sim_of(result, "dense", 0.0, "busy").tokens_per_s
    assert bt._sim_of(result, "dense", 0.0, "run").tokens_per_s == pytest.approx(busy)
    mi["run_background_bytes_per_s"] = 40_000.0
    assert bt._sim_of(result, "dense", 0.0, "run").tokens_per_s < 0.9 * busy
