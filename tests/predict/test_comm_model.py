"""Eq. 26 collective cost model: Table III's Frontier preset, the HLO message-size rule and the fit."""

import math

import numpy as np
import pytest

from jphantom.analysis.hlo import HloCollective
from jphantom.errors import ConfigError
from jphantom.perf.comm_model import (
    FRONTIER,
    CollectiveCost,
    CommModel,
    fit,
    fit_model,
    message_floats,
    rmse_log2_us,
)

F32 = 4


def _f32(name, kind, *dims):
    count = math.prod(dims)
    return HloCollective(name, kind, (("f32", tuple(dims)),), count * F32, "{}")


def _tp_ag_rs(n, batch, p):
    """TP's forward all-gather (result [B, n]) and backward reduce-scatter (result [B, n/p])."""
    return [_f32("ag", "all-gather", batch, n), _f32("rs", "reduce-scatter", batch, n // p)]


def _tp_all_four(n, batch, p):
    """Table II's TP row: AG + RS above, plus broadcast and all-reduce of the whole [B, n]."""
    return _tp_ag_rs(n, batch, p) + [_f32("bc", "broadcast", batch, n), _f32("ar", "all-reduce", batch, n)]


def _phantom(batch, p, k):
    """Phantom's all-gather of g (result [B, p, k], Eq. 11) and reduce-scatter (result [B, k])."""
    return [_f32("ag", "all-gather", batch, p, k), _f32("rs", "reduce-scatter", batch, k)]


def test_frontier_holds_table_iii_exactly():
    table_iii = {
        "broadcast": (35.5, 1.12e-3, 3.20),
        "all-reduce": (33.4, 2.56e-3, 2.58),
        "all-gather": (149.94, 2.07e-3, 3.90),
        "reduce-scatter": (145.52, 2.40e-3, 3.91),
    }
    assert set(FRONTIER.kinds) == set(table_iii)
    for kind, (c1, c2, rmse) in table_iii.items():
        assert FRONTIER.costs[kind] == CollectiveCost(c1=c1, c2=c2, c3=0.0, rmse_log2_us=rmse)
    assert "Table III" in FRONTIER.name
    # Eq. 26 by hand: all-gather of 1024 floats among 8 ranks.
    assert FRONTIER.time_us("all-gather", 1024, 8) == pytest.approx(149.94 * 3 + 2.07e-3 * 1024)


@pytest.mark.parametrize(
    "kind, result_bytes, p, expected_floats",
    [
        ("all-gather", 4 * 1024 * 16384, 8, 1024 * 16384 / 8),  # TP: [B, n] result, Table II (n/p)·B
        ("all-gather", 4 * 1024 * 8 * 16, 8, 1024 * 16),  # phantom: [B, p, k] result, k·B
        ("reduce-scatter", 4 * 1024 * 2048, 8, 1024 * 2048),  # [B, n/p] result is the message
        ("all-reduce", 4 * 1024 * 16384, 8, 1024 * 16384),
        ("broadcast", 4 * 1024 * 16384, 8, 1024 * 16384),
        ("all-reduce", 2 * 1000, 4, 500),  # bf16: m = bytes / 4, not elements
    ],
)
def test_message_floats_is_table_ii_message_from_hlo_result_bytes(kind, result_bytes, p, expected_floats):
    assert message_floats(kind, result_bytes, p) == expected_floats


# Seal et al. digest section 3.4: n = 16384, B = 1024, per layer per iteration, milliseconds.
@pytest.mark.parametrize(
    "p, k, tp_all_four_ms, tp_ag_rs_ms, phantom_ms",
    [(8, 16, 72.2, 10.3, 0.96), (256, 4, 64.9, 2.66, 2.38)],
)
def test_frontier_reproduces_digest_per_layer_times(p, k, tp_all_four_ms, tp_ag_rs_ms, phantom_ms):
    n, batch = 16384, 1024
    assert FRONTIER.step_time_us(_tp_all_four(n, batch, p), p) / 1e3 == pytest.approx(tp_all_four_ms, rel=0.02)
    assert FRONTIER.step_time_us(_tp_ag_rs(n, batch, p), p) / 1e3 == pytest.approx(tp_ag_rs_ms, rel=0.02)
    assert FRONTIER.step_time_us(_phantom(batch, p, k), p) / 1e3 == pytest.approx(phantom_ms, rel=0.02)
    # The closed forms of the digest: 295.46 log2 p + 4.47e-3 (n/p) B and 295.46 log2 p + 4.47e-3 k B.
    assert FRONTIER.step_time_us(_tp_ag_rs(n, batch, p), p) == pytest.approx(
        295.46 * math.log2(p) + 4.47e-3 * (n // p) * batch
    )
    assert FRONTIER.step_time_us(_phantom(batch, p, k), p) == pytest.approx(
        295.46 * math.log2(p) + 4.47e-3 * k * batch
    )


@pytest.mark.parametrize("p", [8, 64])
def test_phantom_beats_tp_ag_rs_exactly_when_ghost_width_below_n_over_p(p):
    """Claim (9) under Eq. 26: beta_PP < beta_TP(AG+RS) iff k < n/p."""
    n, batch = 4096, 32
    tp = FRONTIER.step_time_us(_tp_ag_rs(n, batch, p), p)
    for k in (n // p - 1, n // p, n // p + 1):
        pp = FRONTIER.step_time_us(_phantom(batch, p, k), p)
        assert (pp < tp) == (k < n // p)


def test_step_time_accepts_summarize_rows_with_counts():
    p = 8
    ops = _tp_ag_rs(256, 16, p) * 3
    rows = [
        {"kind": "all-gather", "count": 3, "bytes": 3 * ops[0].bytes},
        {"kind": "reduce-scatter", "count": 3, "bytes": 3 * ops[1].bytes},
    ]
    assert FRONTIER.step_time_us(rows, p) == pytest.approx(FRONTIER.step_time_us(ops, p))
    assert FRONTIER.step_time_us([], p) == 0.0


def test_step_time_counts_each_collective_once_per_execution():
    """An HloCollective inside a loop runs ``count`` times per step (hlo applies trip counts): it costs
    ``count`` latencies and the bandwidth of its ``total_bytes``, as ``count`` separate ops do."""
    import dataclasses

    p = 8
    once = _tp_ag_rs(256, 16, p)
    looped = [dataclasses.replace(op, count=3) for op in once]
    assert looped[0].total_bytes == 3 * once[0].bytes
    assert FRONTIER.step_time_us(looped, p) == pytest.approx(FRONTIER.step_time_us(once * 3, p))
    assert FRONTIER.step_time_us(looped, p) > 2.9 * FRONTIER.step_time_us(once, p)


def _synthetic(cost, noise=0.0, seed=0):
    """Timings of a known Eq. 26 model on the paper's grid: m = 2^2..2^26 floats, p = 2..256."""
    rng = np.random.default_rng(seed)
    samples = []
    for p in (2, 4, 8, 16, 32, 64, 128, 256):
        for m in (2.0**e for e in range(2, 27, 3)):
            t = cost.time_us(m, p) * math.exp(noise * rng.standard_normal())
            samples.append((m, p, t))
    return samples


@pytest.mark.parametrize("relative", [True, False])
def test_fit_recovers_known_constants_exactly_without_noise(relative):
    truth = CollectiveCost(c1=145.52, c2=2.40e-3, c3=7.0)
    got = fit(_synthetic(truth), relative=relative)
    assert got.c1 == pytest.approx(truth.c1, rel=1e-9)
    assert got.c2 == pytest.approx(truth.c2, rel=1e-9)
    assert got.c3 == pytest.approx(truth.c3, rel=1e-6, abs=1e-6)
    assert got.rmse_log2_us == pytest.approx(0.0, abs=1e-9)


def test_fit_recovers_constants_approximately_under_multiplicative_noise():
    truth = CollectiveCost(c1=149.94, c2=2.07e-3, c3=0.0)
    noise = 0.03  # ~3% lognormal jitter
    got = fit(_synthetic(truth, noise=noise, seed=1234))
    assert got.c1 == pytest.approx(truth.c1, rel=0.05)
    assert got.c2 == pytest.approx(truth.c2, rel=0.05)
    assert abs(got.c3) < 0.1 * truth.c1
    # Noise of sigma 0.03 in ln is 0.043 in log2; the fit's log2 RMSE sits near it.
    assert 0.5 * noise / math.log(2) < got.rmse_log2_us < 1.5 * noise / math.log(2)
    assert got.rmse_log2_us == pytest.approx(rmse_log2_us(got, _synthetic(truth, noise=noise, seed=1234)))


def test_fit_model_builds_a_comm_model_per_kind():
    samples = {kind: _synthetic(FRONTIER.costs[kind]) for kind in ("all-gather", "reduce-scatter")}
    model = fit_model(samples, name="synthetic frontier")
    assert model.name == "synthetic frontier"
    assert set(model.kinds) == {"all-gather", "reduce-scatter"}
    assert model.time_us("all-gather", 4096, 16) == pytest.approx(FRONTIER.time_us("all-gather", 4096, 16))


def test_rmse_is_infinite_when_model_predicts_non_positive_time():
    assert rmse_log2_us(CollectiveCost(c1=-10.0, c2=0.0), [(1, 2, 1.0), (2, 4, 1.0), (3, 8, 1.0)]) == math.inf


@pytest.mark.parametrize(
    "call, fragment",
    [
        (lambda: FRONTIER.time_us("all-to-all", 10, 8), "'all-to-all'"),
        (lambda: FRONTIER.time_us("all-gather", -1, 8), "m=-1"),
        (lambda: FRONTIER.time_us("all-gather", 10, 0), "p=0"),
        (lambda: FRONTIER.time_us("all-gather", 10, 2.5), "p=2.5"),
        (lambda: message_floats("gather", 16, 8), "'gather'"),
        (lambda: message_floats("all-gather", -4, 8), "-4"),
        (lambda: FRONTIER.step_time_us([{"kind": "all-gather"}], 8), "'bytes'"),
        (lambda: FRONTIER.step_time_us([{"kind": "all-gather", "bytes": 4, "count": 0}], 8), "count=0"),
        (lambda: CollectiveCost(c1=float("nan"), c2=1.0), "c1=nan"),
        (lambda: CollectiveCost(c1=1.0, c2="fast"), "c2='fast'"),
        (lambda: CollectiveCost(c1=1.0, c2=1.0, rmse_log2_us=-0.1), "rmse_log2_us=-0.1"),
        (lambda: CommModel(costs={}), "non-empty"),
        (lambda: CommModel(costs={"all-gather": (1.0, 2.0)}), "(1.0, 2.0)"),
        (lambda: fit([(1, 2, 3.0), (2, 4, 5.0)]), "got 2"),
        (lambda: fit([(1, 2, 3.0), (2, 4, 0.0), (4, 8, 9.0)]), "time_us=0.0"),
        (lambda: fit([(1, 2, 3.0), (2, 4, -5.0), (4, 8, 9.0)]), "time_us=-5.0"),
        (lambda: fit([(1, 8, 3.0), (2, 8, 5.0), (4, 8, 9.0)]), "distinct p = [8.0]"),
        (lambda: fit([(1, 2)] * 3), "(1, 2)"),
        (lambda: fit_model({"all-gather": [(1, 2, 3.0)]}), "all-gather: fit needs at least 3"),
    ],
)
def test_bad_inputs_raise_config_error_naming_the_value(call, fragment):
    with pytest.raises(ConfigError) as error:
        call()
    assert fragment in str(error.value)


def test_unknown_kind_error_lists_known_kinds():
    with pytest.raises(ConfigError, match="known kinds: .*all-gather.*reduce-scatter"):
        FRONTIER.time_us("collective-permute", 10, 8)
