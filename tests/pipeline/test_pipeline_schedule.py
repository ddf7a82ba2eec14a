"""Pipeline schedules as data: tables, dependencies, bubbles (Narayanan et al. 2021), memory, errors."""

from collections import Counter

import pytest

from jphantom.errors import ConfigError
from jphantom.pipeline import Task, build, simulate

# Narayanan et al. 2021: bubble (P - 1) / (M + P - 1) for GPipe and 1F1B.
PUBLISHED_BUBBLES = [
    (4, 4, 42.9),
    (4, 16, 15.8),
    (4, 64, 4.5),
    (16, 16, 48.4),
    (16, 64, 19.0),
    (16, 256, 5.5),
]

CONFIGS = [
    ("gpipe", 1, 1, 1),
    ("gpipe", 4, 6, 1),
    ("1f1b", 1, 3, 1),
    ("1f1b", 4, 2, 1),
    ("1f1b", 4, 8, 1),
    ("1f1b", 5, 7, 1),
    ("interleaved-1f1b", 2, 4, 2),
    ("interleaved-1f1b", 4, 4, 2),
    ("interleaved-1f1b", 4, 8, 3),
    ("interleaved-1f1b", 3, 6, 1),
]


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("backward_cost", [1.0, 2.0])
@pytest.mark.parametrize("stages,microbatches,percent", PUBLISHED_BUBBLES)
def test_bubble_reproduces_the_published_bubble_table(schedule, backward_cost, stages, microbatches, percent):
    sim = simulate(schedule, stages, microbatches, backward_cost=backward_cost)
    assert sim.bubble_fraction * 100 == pytest.approx(percent, abs=0.1)
    assert sim.bubble_fraction == pytest.approx((stages - 1) / (microbatches + stages - 1))
    assert sim.makespan == pytest.approx((microbatches + stages - 1) * (1 + backward_cost))


@pytest.mark.parametrize("backward_cost", [1.0, 2.0])
@pytest.mark.parametrize("stages,virtual,microbatches", [(2, 2, 4), (4, 2, 8), (4, 3, 8), (4, 2, 16), (8, 4, 16)])
def test_interleaved_bubble(stages, virtual, microbatches, backward_cost):
    sim = simulate("interleaved-1f1b", stages, microbatches, virtual, backward_cost=backward_cost)
    expected = (stages - 1) / (stages - 1 + virtual * microbatches)
    assert sim.bubble_fraction == pytest.approx(expected, abs=1e-9)
    plain = simulate("1f1b", stages, microbatches, backward_cost=backward_cost)
    if virtual > 1:
        assert sim.bubble_fraction < plain.bubble_fraction


@pytest.mark.parametrize("stages,microbatches", [(4, 2), (4, 4), (4, 16), (8, 3), (8, 32)])
def test_in_flight_memory(stages, microbatches):
    one_f_one_b = simulate("1f1b", stages, microbatches).peak_in_flight
    assert one_f_one_b == [min(microbatches, stages - s) for s in range(stages)]
    assert all(peak <= stages - s for s, peak in enumerate(one_f_one_b))
    assert simulate("gpipe", stages, microbatches).peak_in_flight == [microbatches] * stages


def test_gpipe_diagonal():
    stages, microbatches = 4, 5
    table = build("gpipe", stages, microbatches)
    for task in table:
        if task.kind == "F":
            assert task.tick == task.stage + task.microbatch
    last_forward = stages - 1 + microbatches - 1
    assert min(t.tick for t in table if t.kind == "B") == last_forward + 1
    for s in range(stages):
        backwards = sorted((t for t in table if t.stage == s and t.kind == "B"), key=lambda t: t.tick)
        assert [t.microbatch for t in backwards] == list(reversed(range(microbatches)))


def test_1f1b_warmup_then_alternate():
    stages, microbatches = 4, 8
    table = build("1f1b", stages, microbatches)
    for s in range(stages):
        kinds = "".join(t.kind for t in sorted((t for t in table if t.stage == s), key=lambda t: t.tick))
        warmup = stages - s - 1
        steady = microbatches - warmup
        assert kinds == "F" * warmup + "FB" * steady + "B" * warmup


@pytest.mark.parametrize("schedule,stages,microbatches,virtual", CONFIGS)
def test_table_is_complete_and_respects_dependencies(schedule, stages, microbatches, virtual):
    table = build(schedule, stages, microbatches, virtual)
    assert all(isinstance(t, Task) for t in table)
    keys = Counter((t.stage, t.chunk, t.microbatch, t.kind) for t in table)
    expected = {
        (s, c, m, k)
        for s in range(stages)
        for c in range(virtual)
        for m in range(microbatches)
        for k in "FB"
    }
    assert set(keys) == expected and all(n == 1 for n in keys.values())
    per_device = Counter(t.stage for t in table)
    assert per_device == {s: 2 * microbatches * virtual for s in range(stages)}
    # one op per tick per device
    assert len({(t.stage, t.tick) for t in table}) == len(table)
    _check_dependencies(
        {(t.chunk * stages + t.stage, t.kind, t.microbatch): (t.tick, t.tick + 1) for t in table},
        stages * virtual,
    )


@pytest.mark.parametrize("schedule,stages,microbatches,virtual", CONFIGS)
def test_simulation_respects_dependencies_and_costs(schedule, stages, microbatches, virtual):
    sim = simulate(schedule, stages, microbatches, virtual, backward_cost=2.0)
    assert len(sim.tasks) == 2 * stages * microbatches * virtual
    for timed in sim.tasks:
        cost = 1.0 if timed.kind == "F" else 2.0
        assert timed.end - timed.start == pytest.approx(cost / virtual)
    for s in range(stages):  # a device runs one task at a time
        spans = sorted((t.start, t.end) for t in sim.tasks if t.stage == s)
        assert all(a_end <= b_start + 1e-12 for (_, a_end), (b_start, _) in zip(spans, spans[1:]))
    _check_dependencies(
        {(t.chunk * stages + t.stage, t.kind, t.microbatch): (t.start, t.end) for t in sim.tasks},
        stages * virtual,
    )
    assert sim.makespan == pytest.approx(max(t.end for t in sim.tasks))
    assert 0.0 <= sim.bubble_fraction < 1.0


def _check_dependencies(times, chunks):
    """F(m) on chunk c after F(m) on c - 1; B(m) on c after B(m) on c + 1 and F(m) on c."""
    eps = 1e-12
    for (c, kind, m), (start, _) in times.items():
        if kind == "F" and c > 0:
            assert start >= times[(c - 1, "F", m)][1] - eps
        if kind == "B":
            assert start >= times[(c, "F", m)][1] - eps
            if c < chunks - 1:
                assert start >= times[(c + 1, "B", m)][1] - eps


def test_timeline_has_one_row_per_stage():
    sim = simulate("1f1b", 4, 6)
    chart = sim.timeline()
    rows = chart.splitlines()
    assert len(rows) == 4
    assert "F0" in rows[0] and "B5" in rows[3] and "." in rows[0]
    fixed = sim.timeline(width=40).splitlines()
    assert len(fixed) == 4 and len({len(r) for r in fixed}) == 1
    assert len(simulate("interleaved-1f1b", 2, 4, 2).timeline().splitlines()) == 2


@pytest.mark.parametrize(
    "args,needle",
    [
        (("zigzag", 4, 4), "zigzag"),
        (("1f1b", 0, 4), "stages=0"),
        (("1f1b", 4, 0), "microbatches=0"),
        (("interleaved-1f1b", 4, 4, 0), "virtual_stages=0"),
        (("gpipe", 4, 4, 2), "virtual_stages=2"),
        (("1f1b", 4, 4, 2), "interleaved-1f1b"),
        (("interleaved-1f1b", 4, 6, 2), "microbatches=6"),
    ],
)
def test_bad_input_raises_config_error(args, needle):
    with pytest.raises(ConfigError, match=needle):
        build(*args)
    with pytest.raises(ConfigError, match=needle):
        simulate(*args)


def test_bad_backward_cost_and_width():
    with pytest.raises(ConfigError, match="backward_cost"):
        simulate("1f1b", 2, 2, backward_cost=0)
    with pytest.raises(ConfigError, match="width"):
        simulate("1f1b", 2, 2).timeline(width=0)
    with pytest.raises(ConfigError, match="width=1 is too narrow to show each task apart"):
        simulate("1f1b", 4, 8).timeline(width=1)  # every stage drawn as |B| before


# --------------------------------------------------------------------------------------------------
# Lock-step tables: what the SPMD executor runs
# --------------------------------------------------------------------------------------------------

from jphantom.pipeline import lockstep  # noqa: E402


@pytest.mark.parametrize("schedule, virtual_stages", [("gpipe", 1), ("1f1b", 1),
                                                      ("interleaved-1f1b", 2),
                                                      ("interleaved-1f1b", 4)])
@pytest.mark.parametrize("stages, microbatches", [(2, 2), (2, 8), (4, 4), (4, 16), (8, 8), (8, 64)])
def test_lockstep_runs_every_task_once_in_dependency_order(schedule, virtual_stages, stages,
                                                           microbatches):
    table = lockstep(schedule, stages, microbatches, virtual_stages)
    P, V = stages, virtual_stages
    last = P * V - 1
    forward, backward = {}, {}
    for t, (forward_slot, backward_slot) in enumerate(table.ticks):
        for s in range(P):
            if forward_slot[s] is not None:
                kind, m, v = forward_slot[s]
                assert kind == "F" and (v * P + s, m) not in forward
                forward[(v * P + s, m)] = t
            if backward_slot[s] is not None:
                kind, m, v = backward_slot[s]
                assert kind == "B" and (v * P + s, m) not in backward
                backward[(v * P + s, m)] = t
    everything = {(c, m) for c in range(P * V) for m in range(microbatches)}
    assert set(forward) == set(backward) == everything
    for (c, m), t in forward.items():
        assert c == 0 or forward[(c - 1, m)] < t  # one hop per tick
        assert backward[(c, m)] >= t  # same tick allowed: the backward slot follows the forward
        assert c == last or backward[(c + 1, m)] < backward[(c, m)]


@pytest.mark.parametrize("backward_cost", [1.0, 2.0])
@pytest.mark.parametrize("stages, microbatches", [(2, 2), (2, 16), (4, 4), (4, 32), (8, 8), (8, 64)])
def test_lockstep_1f1b_costs_gpipe_time_with_bounded_in_flight(stages, microbatches, backward_cost):
    """Lock-step ticks last as long as their slowest stage. GPipe and the executor's 1F1B both
    take (M + P - 1)(t_f + t_b); GPipe holds M micro-batches, 1F1B at most min(M, 2(P - s) - 1)."""
    P, M = stages, microbatches
    ideal = (M + P - 1) * (1 + backward_cost)
    gpipe, onefoneb = lockstep("gpipe", P, M), lockstep("1f1b", P, M)
    assert gpipe.cost(backward_cost) == pytest.approx(ideal)
    assert onefoneb.cost(backward_cost) == pytest.approx(ideal)
    assert onefoneb.bubble_fraction(backward_cost) == pytest.approx((P - 1) / (M + P - 1))
    assert gpipe.peak_in_flight == (M,) * P
    assert onefoneb.peak_in_flight == tuple(min(M, 2 * (P - s) - 1) for s in range(P))


@pytest.mark.parametrize("stages, virtual_stages, microbatches", [(2, 2, 4), (4, 2, 8), (4, 4, 16),
                                                                  (8, 2, 32)])
def test_lockstep_interleaved_reaches_its_ideal_bubble(stages, virtual_stages, microbatches):
    """Megatron's interleaved warm-up already fits lock-step: (M + (P - 1)/V)(t_f + t_b)."""
    P, V, M = stages, virtual_stages, microbatches
    table = lockstep("interleaved-1f1b", P, M, V)
    assert table.cost(2.0) == pytest.approx((M + (P - 1) / V) * 3)
    assert table.bubble_fraction(2.0) == pytest.approx((P - 1) / (P - 1 + V * M))
