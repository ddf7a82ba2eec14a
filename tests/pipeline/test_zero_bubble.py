"""Zero-bubble schedules as data (jphantom.pipeline.schedule): ZB-H1 and ZB-V tables with split
backward (B: input gradient, W: weight gradient), simulated beside the paper's bubble and 1F1B's
memory, and their lock-step time against 1F1B's."""

import pytest

from jphantom.cli import main
from jphantom.errors import ConfigError
from jphantom.pipeline import schedule as S


@pytest.mark.parametrize("stages", [2, 4, 8])
@pytest.mark.parametrize("factor", [1, 2, 4])
@pytest.mark.parametrize("schedule", S.SPLIT_SCHEDULES)
def test_every_task_runs_once_after_its_inputs(schedule, stages, factor):
    M = factor * stages
    sim = S.simulate(schedule, stages, M, backward_cost=2.0)
    chunks = S.chunks_of(schedule, stages)
    seen = {}
    for t in sim.tasks:
        c = S.model_chunk(schedule, stages, t.stage, t.chunk)
        key = (c, t.kind, t.microbatch)
        assert key not in seen
        seen[key] = t
    assert len(seen) == 3 * chunks * stages * M
    last = chunks * stages - 1
    for (c, kind, m), t in seen.items():
        for dep in S._dependencies(c, kind, m, last):
            assert seen[dep].end <= t.start + 1e-9


@pytest.mark.parametrize("stages, factor", [(2, 1), (4, 2), (4, 4), (8, 4)])
def test_zb_h1_has_the_papers_bubble_and_1f1bs_peak_memory(stages, factor):
    """(P - 1)(T_F + T_B - T_W) of idle time per device (a third of 1F1B's with equal costs),
    holding at most P micro-batches on any stage, as 1F1B's first stage does."""
    M = factor * stages
    zb = S.simulate("zb-h1", stages, M, backward_cost=2.0)
    assert zb.bubble_fraction == pytest.approx(
        S.zero_bubble_formula("zb-h1", stages, M, (1.0, 1.0, 1.0)))
    one = S.simulate("1f1b", stages, M, backward_cost=2.0)
    idle = lambda sim: sim.bubble_fraction * sim.makespan
    assert idle(zb) == pytest.approx(idle(one) / 3)
    assert max(zb.peak_in_flight) == max(one.peak_in_flight)


@pytest.mark.parametrize("stages", [2, 4, 8])
def test_zb_v_is_nearly_bubble_free_within_1f1bs_memory(stages):
    M = 4 * stages
    zb = S.simulate("zb-v", stages, M, backward_cost=2.0)
    assert zb.bubble_fraction < 0.05
    # 2P chunk activations, each half a stage's: 1F1B's P micro-batches of whole stages
    assert max(zb.peak_in_flight) <= 2 * stages
    assert {t.stage for t in zb.tasks if t.kind == "F" and S.model_chunk(
        "zb-v", stages, t.stage, t.chunk) == 2 * stages - 1} == {0}  # the loss on device 0


@pytest.mark.parametrize("stages", [4, 8])
def test_lockstep_zb_h1_takes_at_most_0_9_of_lockstep_1f1b_at_m_4p(stages):
    """In one SPMD program a tick lasts as long as its slowest device: 1F1B's tick of a forward
    and a whole backward keeps GPipe's time; ZB-H1's slots of one task each keep its bubble. The
    price: an exchange after about every slot (modelled; the executor runs neither split
    schedule yet)."""
    M = 4 * stages
    one = S.lockstep("1f1b", stages, M)
    zb = S.lockstep("zb-h1", stages, M)
    assert zb.cost() <= 0.9 * one.cost(2.0)
    assert zb.exchanges() > 2 * len(one.ticks)


def test_schedule_command_draws_w_tasks(capsys):
    assert main(["schedule", "--schedule", "zb-h1", "--stages", "4", "--microbatches", "8"]) == 0
    out = capsys.readouterr().out
    assert "W7" in out and "Qi et al. 2024" in out and "11.11%" in out


def test_schedule_command_separates_every_label_from_its_value(capsys):
    """zb-v's formula label is longer than the column: still two spaces before the figure."""
    assert main(["schedule", "--schedule", "zb-v", "--stages", "4", "--microbatches", "8"]) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if "the paper's claim" in x)
    assert "(the paper's claim)  0.00%" in line, line


def test_split_schedules_refuse_bad_values():
    with pytest.raises(ConfigError, match="weight_share"):
        S.simulate("zb-h1", 4, 8, backward_cost=2.0, weight_share=1.0)
    with pytest.raises(ConfigError, match="split-backward"):
        S.simulate("1f1b", 4, 8, weight_share=0.5)
