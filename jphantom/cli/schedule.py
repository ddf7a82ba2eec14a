"""``jphantom schedule``: a pipeline schedule's timeline and bubble, simulated beside its
formula and the lock-step executor's figures; pure arithmetic, no device touched."""

from __future__ import annotations

import argparse
import json
import sys

FORMULAS = {"gpipe": "(P-1)/(M+P-1)", "1f1b": "(P-1)/(M+P-1)",
            "interleaved-1f1b": "(P-1)/(P-1+V*M)",
            "zb-h1": "(P-1)(TF+TB-TW)/(M(TF+TB+TW)+(P-1)(TF+TB-TW))",
            "zb-v": "0 when TF=TB=TW (the paper's claim)"}


MAX_SCHEDULE_TASKS = 20_000
"""``jphantom schedule`` refuses more forward tasks (P x M x V) than this: its drawing would be
megabytes of text and its simulation minutes."""


def add_parser(sub) -> None:
    from jphantom.pipeline.schedule import ALL_SCHEDULES

    schedule = sub.add_parser(
        "schedule", help="draw a pipeline schedule and its bubble (no devices, nothing compiled)",
        description="Simulate a pipeline schedule on P stages with M micro-batches and print its "
                    "timeline (one row per stage: Fm / Bm are the forward / backward of "
                    "micro-batch m, '.' is idle time), its bubble fraction (idle time / total "
                    "device time) beside Narayanan et al.'s formula, (P-1)/(M+P-1) for gpipe and 1f1b "
                    "and (P-1)/(P-1+V*M) for interleaved-1f1b, and the micro-batches each stage "
                    "holds in flight (their activations stay in memory until the backward). Then "
                    "the same for the lock-step executor that `jphantom train --mesh stage=P,...` "
                    "compiles: its ticks, bubble and peak in flight. Pure arithmetic: no devices, "
                    "nothing compiled.",
        epilog="Examples: jphantom schedule --schedule 1f1b --stages 4 --microbatches 8 | jphantom "
               "schedule --schedule interleaved-1f1b --stages 4 --microbatches 8 --virtual-stages "
               "2 | jphantom schedule --schedule gpipe --stages 4 --microbatches 16 --json | "
               "jphantom schedule --schedule zb-h1 --stages 4 --microbatches 16")
    schedule.add_argument("--schedule", dest="schedule", default="1f1b",
                          choices=ALL_SCHEDULES,
                          help="gpipe: all forwards, then all backwards; 1f1b: one forward, one "
                               "backward (fewer micro-batches in flight); interleaved-1f1b: "
                               "1f1b over V model chunks per device (smaller bubble); zb-h1 and "
                               "zb-v: zero-bubble schedules, the backward split into B (input "
                               "gradient) and W (weight gradient, filling bubbles), zb-v with "
                               "two chunks per device in a V. Default 1f1b")
    schedule.add_argument("--stages", type=int, default=4, metavar="P",
                          help="pipeline stages (devices along the stage axis; default 4)")
    schedule.add_argument("--microbatches", type=int, default=8, metavar="M",
                          help="micro-batches per step (default 8); interleaved-1f1b needs a "
                               "multiple of P")
    schedule.add_argument("--virtual-stages", type=int, default=1, metavar="V",
                          help="model chunks per device, interleaved-1f1b only (default 1)")
    schedule.add_argument("--backward-cost", type=float, default=2.0, metavar="R",
                          help="a backward's cost in forwards (default 2.0): it stretches the "
                               "timeline and the makespan; the bubble fractions come out the same "
                               "for any value, as Narayanan et al.'s formula says")
    schedule.add_argument("--width", type=int, default=None, metavar="COLUMNS",
                          help="timeline width in characters (default: wide enough for every "
                               "label)")
    schedule.add_argument("--json", action="store_true",
                          help="print JSON (figures and the timeline) instead of text")
    schedule.set_defaults(handler=handle)


def handle(args: argparse.Namespace) -> int:
    """``jphantom schedule``: the simulator's timeline and bubble of a pipeline schedule, beside
    Narayanan et al.'s formula and the lock-step executor's figures. Pure Python: no device is touched."""
    from jphantom.errors import ConfigError
    from jphantom.pipeline.schedule import (SPLIT_SCHEDULES, lockstep, simulate,
                                            zero_bubble_formula)

    P, M, V = args.stages, args.microbatches, args.virtual_stages
    for flag, value in (("--stages", P), ("--microbatches", M), ("--virtual-stages", V)):
        if value < 1:
            raise ConfigError(f"{flag} {value} must be at least 1")
    if P * M * V > MAX_SCHEDULE_TASKS:
        raise ConfigError(f"--stages {P} x --microbatches {M} x --virtual-stages {V} = "
                          f"{P * M * V:,} forward tasks: simulating and drawing more than "
                          f"{MAX_SCHEDULE_TASKS:,} is not useful here; the bubble is "
                          "(P-1)/(M+P-1) (1F1B, GPipe) or (P-1)/(P-1+V M) (interleaved)")
    split = args.schedule in SPLIT_SCHEDULES
    if split:
        if V != 1:
            raise ConfigError(f"--virtual-stages applies to interleaved-1f1b; {args.schedule} "
                              "places its own chunks (zb-v: two per device)")
        R = args.backward_cost
        formula = zero_bubble_formula(args.schedule, P, M, (1.0, R / 2, R / 2))
    else:
        interleaved = args.schedule == "interleaved-1f1b"
        formula = (P - 1) / (P - 1 + V * M) if interleaved else (P - 1) / (M + P - 1)
    simulation = simulate(args.schedule, P, M, V, backward_cost=args.backward_cost)
    steps = lockstep(args.schedule, P, M, V)
    try:
        timeline = simulation.timeline(args.width)
    except ConfigError as error:  # the API's message, in the flag's name
        raise ConfigError(str(error).replace("timeline width=", "--width ").replace(
            "pass width >=", "give --width >=")) from None
    result = {
        "schedule": args.schedule, "stages": P, "microbatches": M, "virtual_stages": V,
        "backward_cost": args.backward_cost,
        "simulated": {"bubble_fraction": simulation.bubble_fraction,
                      "makespan": simulation.makespan,
                      "peak_in_flight": list(simulation.peak_in_flight)},
        "formula": {"expression": FORMULAS[args.schedule], "bubble_fraction": formula},
        "lockstep": {"ticks": len(steps.ticks), "peak_in_flight": list(steps.peak_in_flight),
                     "cost": steps.cost(args.backward_cost),
                     "bubble_fraction": steps.bubble_fraction(args.backward_cost)},
        "timeline": timeline,
    }
    if args.json:
        json.dump(result, sys.stdout, indent=2)
        print()
        return 0
    chunks = f", {V} virtual stages per device" if V > 1 else ""
    print(f"{args.schedule}: P={P} stages, M={M} micro-batches{chunks}; a backward costs "
          f"{args.backward_cost:g}x a forward. Time in units of one device's forward of one "
          "micro-batch.")
    print("Timeline (simulated; Fm / Bm: forward / backward of micro-batch m"
          + (" (B: input gradient, Wm: weight gradient)" if split else "") + f", . idle; makespan "
          f"{simulation.makespan:g})" + (f"; each micro-batch visits every device {V} times, once "
                                         "per chunk" if V > 1 else "") + ":\n")
    print(timeline)
    peaks = lambda values: " ".join(str(v) for v in values)
    # the label padded to 50 columns, and never fewer than two spaces before its value
    row = lambda label, value: print(f"  {label:<48}  {value}")
    print("\nSimulated (every task starts as soon as its device and inputs are ready):")
    row("bubble fraction", f"{simulation.bubble_fraction:.2%}")
    source = "Qi et al. 2024" if split else "Narayanan et al.'s formula"
    row(f"{source} {FORMULAS[args.schedule]}", f"{formula:.2%}")
    row("peak micro-batches in flight per stage" + (" (chunks)" if V > 1 else ""),
        peaks(simulation.peak_in_flight))
    print("Lock-step SPMD execution (modelled for zb-h1 / zb-v: every slot one F, B or W per "
          "device, ending in the exchange; `jphantom train --schedule` runs them):"
          if split else
          "Lock-step executor (the compiled step: each tick a forward and a backward slot):")
    row("slots (F, B or W each)" if split else "ticks", len(steps.ticks))
    row("bubble fraction", f"{steps.bubble_fraction(args.backward_cost):.2%}")
    row("peak micro-batches in flight per stage" + (" (chunks)" if V > 1 else ""),
        peaks(steps.peak_in_flight))
    return 0
