"""Every axis with every axis: the composition matrix of docs/strategies.md, walked.

A *feature* is an axis or a step option at its smallest size (``data=2``, ``model=2``, a 2-stage
1F1B pipeline, 2 expert ranks, ZeRO-3, accumulation over 2 micro-batches, float16 with loss
scaling, ...). A *cell* is one feature (the diagonal), two together or one of :data:`TRIPLES`, built through the user's
path (:class:`jphantom.config.RunConfig`, what ``jphantom train`` builds) on a tiny GPT-2 and
either

- ``ok``: its compiled step's loss and every gradient equal the single-device model's (float64
  oracle: :func:`helpers.oracle_loss_and_grads`; float32 to 1e-5, float16/bfloat16 to their
  rounding), or
- ``refused``: construction raises the :class:`~jphantom.errors.ConfigError` whose message
  :data:`RECORD` records, before anything compiles, or
- ``meaningless``: the two features are alternatives (two strategies for one layer, two
  precisions, two ZeRO stages); the cell says why and nothing is built.

The MoE balance loss is not linear in the batch. A step that splits its batch into micro-batches
(``--accumulate``, a pipeline) first sums every MoE layer's router statistics over them (a forward
pass) and gives each micro-batch the whole batch's routing fractions, so the oracle of every cell
is the single-device model on the whole batch.

What each cell does is recorded, not hand-written: ``python tests/strategies/test_composition.py
--write-table`` builds every cell as ``jphantom train`` would (construction only, about 0.2 s a
cell) and records ``ok`` or the ConfigError it raised in :data:`RECORD`, then generates
docs/strategies.md's table from that record. ``make test`` checks that the record names every
cell and that the page shows it, and runs a few cells; ``make test-all`` builds every cell again
(its outcome must be the recorded one) and checks every ``ok`` cell's loss and gradients.
"""

from __future__ import annotations

import itertools
import pathlib
import re
import sys

import numpy as np
import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]

# name -> (flags, mesh axes). Flags are RunConfig's flat names.
FEATURES: dict[str, tuple[dict, dict]] = {
    "data": ({}, {"data": 2}),
    "tensor": ({"strategy": "tensor"}, {"model": 2}),
    "sequence": ({"strategy": "tensor", "sequence_parallel": True}, {"model": 2}),
    "phantom": ({"strategy": "phantom", "ghost_width": 2}, {"model": 2}),
    "pmm3d": ({"strategy": "pmm3d"}, {"x": 2, "y": 1, "z": 1}),
    "gspmd": ({"strategy": "gspmd"}, {"model": 2}),
    "pipeline": ({"schedule": "1f1b", "microbatches": 2}, {"stage": 2}),
    "experts": ({"moe_every": 2, "experts": 4, "capacity_factor": 4.0}, {"expert": 2}),
    "zero-1": ({"zero": 1}, {"data": 2}),
    "zero-3": ({"zero": 3}, {"data": 2}),
    "accumulate": ({"accumulate": 2}, {}),
    "remat": ({"remat": "nothing_saveable"}, {}),
    "float16": ({"precision": "float16"}, {}),
    "bfloat16": ({"precision": "bf16"}, {}),
}
NAMES = tuple(FEATURES)
STRATEGY_OF = {name: flags.get("strategy") for name, (flags, _) in FEATURES.items()}
ALTERNATIVES = [  # pairs that are two answers to one question
    ({"tensor", "sequence"}, "sequence parallelism is an option of tensor parallelism: its row "
                             "is tensor + SP"),
    ({name for name, strategy in STRATEGY_OF.items() if strategy},
     "two strategies for the same layers"),
    ({"float16", "bfloat16"}, "two compute precisions"),
    ({"zero-1", "zero-3"}, "two ZeRO stages"),
]

RECORD = ROOT / "tests" / "fixtures" / "composition.json"
"""Each cell's recorded construction: ``"ok"`` or ``"refused: <the ConfigError>"`` (module
docstring)."""

TINY = dict(model="gpt2", layers=2, hidden=16, heads=2, seq_len=8, vocab=32, batch=8,
            optimizer="sgd", learning_rate=0.1, warmup_steps=0, out=None, progress=False)
LOW_PRECISION = {"float16": 2e-2, "bfloat16": 5e-2}


# Triples the pairs do not vouch for: 3D parallelism, experts beside ZeRO-3 and tensor, the
# accumulated balance loss under GSPMD and SP, float16 loss scaling in an MoE pipeline.
TRIPLES = [("data", "tensor", "pipeline"), ("tensor", "experts", "zero-3"),
           ("sequence", "experts", "accumulate"), ("gspmd", "experts", "accumulate"),
           ("phantom", "pipeline", "zero-1"), ("pipeline", "experts", "float16")]


def cells() -> list[tuple[str, ...]]:
    return [(n,) for n in NAMES] + list(itertools.combinations(NAMES, 2)) + TRIPLES


def cell_name(cell) -> str:
    return "+".join(cell)


def meaningless(cell) -> str | None:
    for group, why in ALTERNATIVES:
        if len(cell) == 2 and set(cell) <= group and cell[0] != cell[1]:
            return why
    return None


def flags_of(cell) -> dict:
    flags, mesh = dict(TINY), {}
    for name in cell:
        extra, axes = FEATURES[name]
        flags.update(extra)
        for axis, size in axes.items():
            mesh[axis] = max(mesh.get(axis, 1), size)
    if "experts" in cell:
        flags["layers"] = 4  # two MoE groups: one per stage in a pipeline
    # several devices without a model-parallel feature: Megatron's layers on model=1 (what the
    # error of strategy 'dense' on a mesh asks for)
    strategy = flags.setdefault("strategy", "tensor" if mesh else "dense")
    if strategy in ("tensor", "phantom") and "model" not in mesh:
        mesh["model"] = 1
    order = ("stage", "data", "expert", "model", "x", "y", "z")
    flags["mesh"] = ",".join(f"{a}={mesh[a]}" for a in order if a in mesh) or "data=1"
    if "gspmd" in cell and "pipeline" in cell:  # GSPMD's pipeline is autodiff of its forward
        flags["schedule"] = "gpipe"
    if any(name in cell for name in ("float16", "bfloat16")) and "experts" in cell:
        flags["capacity_factor"] = 4.0
    return flags


def recorded() -> dict[str, str]:
    import json

    return json.loads(RECORD.read_text())


def expected(cell, record=None) -> str:
    why = meaningless(cell)
    return f"meaningless: {why}" if why else (record or recorded())[cell_name(cell)]


def constructed(cell):
    """The cell built as ``jphantom train`` builds it: ``("ok", built)`` or ``("refused",
    message)`` (nothing compiled)."""
    from jphantom.config import RunConfig
    from jphantom.errors import ConfigError

    try:
        return "ok", RunConfig.from_flags(**flags_of(cell)).build()
    except ConfigError as error:
        return "refused", str(error)


def outcome(cell) -> tuple[str, str]:
    """("ok" | "refused" | "wrong", detail) of building and differentiating the cell."""
    import jax

    from helpers import oracle_loss_and_grads

    flags = flags_of(cell)
    got, built = constructed(cell)
    if got == "refused":
        return got, built
    step, program = built.step, built.program
    rng = np.random.default_rng(3)
    shape = (flags["batch"], flags["seq_len"])
    tokens = rng.integers(0, flags["vocab"], shape).astype(np.int32)
    targets = rng.integers(0, flags["vocab"], shape).astype(np.int32)
    state = program.init(step)
    placed = tuple(jax.device_put(a, s) for a, s in zip((tokens, targets), built.shardings))
    loss, grads = jax.jit(step.value_and_grad())(state.params, *placed)
    grads = jax.device_get(step.to_model_order(grads))
    params = jax.device_get(step.to_model_order(state.params))
    want_loss, want = oracle_loss_and_grads(step, params, tokens, targets)
    want_loss, want = float(want_loss), jax.device_get(want)
    precision = next((p for p in LOW_PRECISION if p in cell), None)
    rtol = LOW_PRECISION.get(precision, 1e-5)
    loss_error = abs(float(loss) - want_loss) / abs(want_loss)
    grad_error = _error(grads, want)
    if loss_error <= rtol and grad_error <= rtol:
        return "ok", f"loss {loss_error:.1e}, gradients {grad_error:.1e}"
    return "wrong", f"loss error {loss_error:.2e}, gradient error {grad_error:.2e} (> {rtol})"


def _error(actual, expected) -> float:
    """The largest leaf's max |a - e| over max |e| (a leaf that is zero up to rounding, below
    1e-6 of the tree's largest, against the tree's largest)."""
    import jax

    a_leaves, e_leaves = jax.tree.leaves(actual), jax.tree.leaves(expected)
    largest = max(float(np.max(np.abs(e))) for e in e_leaves)
    return max(float(np.max(np.abs(np.asarray(a, np.float64) - e)))
               / max(float(np.max(np.abs(e))), 1e-6 * largest)
               for a, e in zip(a_leaves, e_leaves))


def check(cell) -> None:
    want = expected(cell)
    if want.startswith("meaningless"):
        return
    got, detail = outcome(cell)
    if want == "ok":
        assert got == "ok", f"{cell_name(cell)}: {got}: {detail}"
    else:
        assert f"{got}: {detail}" == want, (f"{cell_name(cell)}: {got}: {detail}; recorded "
                                            f"{want} (python tests/strategies/test_composition.py "
                                            "--write-table)")


# make test: a representative diagonal; make test-all: every cell
DEFAULT = {("pipeline", "experts")}  # SP + MoE: test_moe_transformer; accumulation: slow


@pytest.mark.parametrize("cell", [
    pytest.param(c, id=cell_name(c), marks=() if c in DEFAULT else pytest.mark.slow)
    for c in cells() if meaningless(c) is None])
@pytest.mark.slow_cells("pipeline+experts")
def test_cell(cell):
    check(cell)


@pytest.mark.slow
@pytest.mark.parametrize("schedule, extra", [
    ("gpipe", {}), ("interleaved-1f1b", {"virtual_stages": 2, "layers": 8, "microbatches": 4})])
def test_moe_pipelines_balance_the_whole_batch_under_every_schedule(schedule, extra, monkeypatch):
    plain = flags_of
    monkeypatch.setitem(globals(), "flags_of",
                        lambda cell: {**plain(cell), "schedule": schedule, **extra})
    got, detail = outcome(("pipeline", "experts"))
    assert got == "ok", detail


# -- the table in docs/strategies.md ---------------------------------------------------------------

BEGIN = "<!-- composition table: generated by `python tests/strategies/test_composition.py --write-table` -->"
END = "<!-- end of composition table -->"
SYMBOL = {"ok": "✓", "refused": "✗", "meaningless": "·"}


def table(record=None) -> str:
    record = record or recorded()
    lines = ["| | " + " | ".join(NAMES) + " |", "|---" * (len(NAMES) + 1) + "|"]
    notes: dict[str, int] = {}
    for a in NAMES:
        row = [f"**{a}**"]
        for b in NAMES:
            cell = (a,) if a == b else tuple(sorted((a, b), key=NAMES.index))
            status = expected(cell, record)
            kind = status.split(":")[0]
            if kind == "ok":
                row.append(SYMBOL["ok"])
                continue
            reason = status.split(": ", 1)[1]
            number = notes.setdefault(f"{SYMBOL[kind]} {reason}", len(notes) + 1)
            row.append(f"{SYMBOL[kind]}{number}")
        lines.append("| " + " | ".join(row) + " |")
    lines.append("")
    lines.extend(f"{number}. {text}" for text, number in notes.items())
    return "\n".join(lines)


def page_section() -> str:
    text = (ROOT / "docs" / "strategies.md").read_text()
    match = re.search(re.escape(BEGIN) + r"\n(.*?)\n" + re.escape(END), text, re.S)
    return match.group(1) if match else ""


def test_the_strategies_page_shows_the_recorded_matrix():
    """The record names exactly the cells (none hand-added or missing) and the page shows it."""
    want = {cell_name(c) for c in cells() if meaningless(c) is None}
    assert set(recorded()) == want, ("tests/fixtures/composition.json is stale: python "
                                     "tests/strategies/test_composition.py --write-table")
    assert page_section() == table(), ("docs/strategies.md's composition table is stale: python "
                                       "tests/strategies/test_composition.py --write-table")


def _write_table() -> None:
    """Build every cell, record what it did (:data:`RECORD`), and generate the page's table."""
    import json

    record = {}
    for cell in cells():
        if meaningless(cell) is None:
            got, built = constructed(cell)
            record[cell_name(cell)] = "ok" if got == "ok" else f"refused: {built}"
    RECORD.write_text(json.dumps(record, indent=1, ensure_ascii=False) + "\n")
    path = ROOT / "docs" / "strategies.md"
    text = path.read_text()
    new = f"{BEGIN}\n{table(record)}\n{END}"
    if BEGIN in text:
        text = re.sub(re.escape(BEGIN) + r".*?" + re.escape(END), lambda _: new, text, flags=re.S)
    else:
        raise SystemExit(f"docs/strategies.md has no line {BEGIN!r}")
    path.write_text(text)


def _survey(only: str | None = None) -> None:
    """Run every cell (or those whose name contains ``only``) and print its outcome."""
    for cell in cells():
        why = meaningless(cell)
        if why or (only and only not in cell_name(cell)):
            continue
        got, detail = outcome(cell)
        print(f"{cell_name(cell):<24} {got:<8} {detail.splitlines()[0][:150]}", flush=True)


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT / "tests"))
    if "--write-table" in sys.argv or "--survey" in sys.argv:
        from jphantom.runtime.mesh import simulate_cpu_devices

        simulate_cpu_devices(8)
        import jax

        jax.config.update("jax_enable_x64", True)
    if "--write-table" in sys.argv:
        _write_table()
    elif "--survey" in sys.argv:
        _survey(sys.argv[sys.argv.index("--survey") + 1] if len(sys.argv) > 2 else None)
    else:
        raise SystemExit("python tests/strategies/test_composition.py --write-table | --survey")
