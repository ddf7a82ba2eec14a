"""The ``jphantom`` command line. Run ``jphantom --help`` or ``jphantom <command> --help``.

Devices. Every command runs on the machine's accelerators when it has some, and on simulated CPU
devices otherwise: ``--devices N`` simulates N CPU devices (and forces the CPU backend); without it
the choice is made *before* jax starts (jax cannot change its device count afterwards), from
what is visible without starting it (:func:`accelerator_visible`): ``JAX_PLATFORMS`` if set, else
an NVIDIA (``nvidia-smi``) or AMD (``rocm-smi``) tool on the PATH together with an installed jax
plugin for it. No accelerator: :data:`DEFAULT_SIMULATED_DEVICES` (8) CPU devices are simulated.

Errors. A bad value (:class:`jphantom.errors.ConfigError`) or a diverged training run
(:class:`jphantom.errors.TrainingDiverged`) prints one line, ``jphantom: error: ...``, and exits with
status 2 (bad value) or 1 (diverged), without a traceback.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

DEFAULT_SIMULATED_DEVICES = 8
def _strategy_names(model: str | None = "ffn") -> list[str]:
    from jphantom import program

    return list(program.NAMES) if model is None else program.strategies_for(model)


def accelerator_visible(env=None) -> bool:
    """:func:`jphantom.distributed.accelerator_visible` (kept here for the CLI's callers)."""
    from jphantom.distributed import accelerator_visible as visible

    return visible(env)


def _device_count(text: str) -> int:
    from jphantom.mesh import MAX_SIMULATED_DEVICES

    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if not 1 <= value <= MAX_SIMULATED_DEVICES:
        raise argparse.ArgumentTypeError(
            f"{value} simulated devices: give 1 to {MAX_SIMULATED_DEVICES}")
    return value


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} must be >= 1")
    return value


def _add_device_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--devices", type=_device_count, default=None, metavar="N",
        help="simulate N CPU devices (forces the CPU backend). Default: the machine's GPUs if jax "
             f"can use them, else {DEFAULT_SIMULATED_DEVICES} simulated CPU devices.",
    )


def _setup_devices(count: int | None, *, at_least: bool = False) -> None:
    """Must run before anything touches a jax backend (module docstring). ``at_least``: ``count``
    is a minimum (a running jax with more devices is fine), not a request."""
    if count is None and accelerator_visible():
        return
    import jax

    from jphantom.errors import ConfigError
    from jphantom.mesh import simulate_cpu_devices

    explicit = count is not None and not at_least
    count = count if count is not None else DEFAULT_SIMULATED_DEVICES
    try:
        jax.config.update("jax_platforms", "cpu")
        simulate_cpu_devices(count)
    except RuntimeError as error:
        # jax is already running (e.g. called from Python after jax started): keep its devices,
        # unless a count was asked for explicitly and differs.
        if explicit:
            raise ConfigError(str(error).split(". ")[0] + f": cannot simulate {count} devices "
                              "in this process; start a fresh one") from None


# The defaults `inspect` and `compile` give a run where they differ from RunConfig's (`train`'s),
# per model family, in one table: the same flags build the same model and step in both commands
# (compile a GPU's step with `compile`, read the CPU's with `inspect`, and compare). `inspect`
# defaults to the FFN (phantom parallelism's teacher task), `compile` to Llama. Float32
# parameters as `train` has them: --dtype bfloat16 or --precision bf16 for 16-bit runs.
FFN_DEFAULTS = {"width": 4096, "depth": 2, "ghost_width": 16, "dtype": "float32", "batch": 256,
                "optimizer": "sgd", "learning_rate": 0.1, "warmup_steps": 0}
LM_DEFAULTS = {"layers": 4, "hidden": 512, "heads": 8, "seq_len": 256, "vocab": 32000,
               "dtype": "float32", "batch": 64, "ghost_width": 16, "optimizer": "adamw",
               "learning_rate": 3e-4, "warmup_steps": 0}
STEP_DEFAULTS = {"ffn": FFN_DEFAULTS, "lm": LM_DEFAULTS}  # by the family's ``defaults``
INSPECT_MODEL, COMPILE_MODEL = "ffn", "llama"
INSPECT_FLAGS = ("model", "layers", "hidden", "heads", "kv_heads", "intermediate",
                 "sliding_window", "seq_len",
                 "vocab", "width", "depth", "ghost_width", "dtype", "moe_every", "experts", "top_k",
                 "capacity_factor", "dropless", "from_hf", "mesh", "sequence_parallel",
                 "collective_matmul", "dtd",
                 "context_attention", "load_balance",
                 "schedule", "microbatches", "virtual_stages", "zero", "accumulate", "clip_norm",
                 "precision", "remat", "cac", "attention", "batch", "optimizer")


def _inspect(args: argparse.Namespace) -> int:
    _setup_devices(args.devices)
    import jax

    from jphantom.analysis.inspect import format_report, inspect_step
    from jphantom.config import RunConfig
    from jphantom.errors import ConfigError
    from jphantom.mesh import MeshConfig

    settings = _step_settings(args, INSPECT_MODEL)
    if settings.get("dtype") == "float64":
        jax.config.update("jax_enable_x64", True)
    if args.shards is not None:
        if "mesh" in settings and MeshConfig.parse(settings["mesh"]).size("model") != args.shards:
            raise ConfigError(f"--shards {args.shards} disagrees with --mesh {settings['mesh']}: "
                              "give one of them")
        settings.setdefault("mesh", f"model={args.shards}")
    mesh = settings.get("mesh") or f"model={jax.device_count()}"
    configs = []
    for name in dict.fromkeys(args.strategy):  # every run validated before anything compiles
        run = {**settings, "strategy": name, "mesh": mesh, "out": None, "progress": False}
        if not name.startswith("phantom"):
            run.pop("ghost_width", None)
        configs.append(RunConfig.from_flags(**run))
        configs[-1].build()  # its shapes against the mesh, before anything compiles
    reports = []
    for config in configs:
        report = inspect_step(config)
        if args.breakdown and MeshConfig.parse(config.parallel.mesh).size("data") > 1:
            from jphantom.analysis.timing import breakdown

            report["breakdown"] = breakdown(config)
        elif args.breakdown:
            report["notes"].append("--breakdown splits the step into compute and data-parallel "
                                   "communication: this mesh has no data axis (> 1), so there "
                                   "is nothing to break down")
        reports.append(report)
    if args.json:
        json.dump(reports[0] if len(reports) == 1 else reports, sys.stdout, indent=2)
        print()
        return 0
    config = configs[0]
    m = config.model
    shape = (f"width={m.width}, depth={m.depth}" if m.name == "ffn" else
             f"{m.name} L={m.layers}, h={m.hidden}, heads={m.heads}, S={m.seq_len}, V={m.vocab}"
             + (", sequence-parallel" if config.parallel.sequence_parallel else ""))
    staged = next((r["pipeline"] for r in reports if "pipeline" in r), None)
    pipe = "" if staged is None else (
        f" (pipeline: {staged['schedule']}, {staged['stages']} stages, "
        f"{staged['microbatches']} micro-batches, {staged['virtual_stages']} virtual "
        "stage(s) per device)")
    step = "".join((f", ZeRO-{config.step.zero}" if config.step.zero else "",
                    f", {config.step.accumulate} accumulation micro-batches"
                    if config.step.accumulate > 1 else ""))
    names = {"sgd": "SGD", "adam": "Adam", "adamw": "AdamW"}
    print(f"One training step (forward + backward + {names[config.train.optimizer]}{step}), "
          f"{shape}, batch={config.train.batch}, mesh {mesh}{pipe}, {m.dtype}; bytes are per "
          "device, counts per step (loops included); state MB: parameters + gradients + "
          "optimizer state.\n")
    print(format_report(reports))
    for report in reports:
        for note in report["notes"]:
            print(f"note ({report['strategy']}): {note}")
    for report in reports:
        if "breakdown" in report:
            b = report["breakdown"]
            print(f"breakdown {report['strategy']}: t_iter {b['t_iter'] * 1e3:.2f} ms = "
                  f"compute {b['t_compute'] * 1e3:.2f} ms ({b['r_compute']:.1%}) + data "
                  f"communication {b['t_comm'] * 1e3:.2f} ms ({b['r_comm']:.1%}); Eq. 26 "
                  f"(Frontier, modelled): {b['t_comm_eq26_frontier_modelled'] * 1e3:.3f} ms")
    return 0


def _step_settings(args: argparse.Namespace, model: str) -> dict:
    """The flat settings of ``inspect``'s or ``compile``'s run: the model's column of
    :data:`STEP_DEFAULTS` (``model`` unless the file or the flags name another), then
    ``--config``'s file, then the flags."""
    import dataclasses

    from jphantom.config import ModelConfig
    from jphantom import families
    from jphantom.errors import ConfigError

    given = _run_settings(args)
    model = given.get("model", model)
    try:
        found = families.get(model)
    except ConfigError:
        return {"model": model, **given}  # refused by name when the run is built
    section = {f.name for f in dataclasses.fields(ModelConfig)}
    defaults = {k: v for k, v in STEP_DEFAULTS[found.defaults].items()
                if k not in section or (k in found.accepted and not (
                    given.get("from_hf") and k in ("layers", "hidden", "heads", "vocab")))}
    return {**defaults, "model": model, **given}


def _shown_defaults(model: str) -> dict:
    """What ``--help`` shows as the defaults of :data:`STEP_DEFAULTS` (per family where they
    differ), with ``model`` the command's default model."""
    shown = {"model": model}
    for flat in dict.fromkeys([*LM_DEFAULTS, *FFN_DEFAULTS]):
        lm, ffn = LM_DEFAULTS.get(flat), FFN_DEFAULTS.get(flat)
        if lm == ffn:
            shown[flat] = lm
        elif ffn is None:
            shown[flat] = f"{lm} for language models"
        elif lm is None:
            shown[flat] = f"{ffn} for the FFN"
        else:
            shown[flat] = f"{lm} for language models, {ffn} for the FFN"
    return shown


def _hlo_paths(text: str | None, strategies: list[str]) -> dict[str, str | None]:
    """``--hlo FILE`` per strategy: FILE itself for one, FILE with ``.STRATEGY`` before its
    suffix for several (``step.hlo`` -> ``step.tensor.hlo``). Refuses, before anything
    compiles, a FILE that is a folder or whose folder cannot be written (or created)."""
    from pathlib import Path

    from jphantom.errors import ConfigError

    if text is None:
        return dict.fromkeys(strategies)
    path = Path(text)
    if path.is_dir():
        raise ConfigError(f"--hlo {text} is a folder: give a file name, e.g. "
                          f"{path / 'step.hlo'}")
    parent = path.parent
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    if not parent.is_dir() or not os.access(parent, os.W_OK | os.X_OK):
        raise ConfigError(f"--hlo {text}: {str(parent)!r} is not a folder this process can write "
                          "in: pick another path")
    if len(strategies) == 1:
        return {strategies[0]: text}
    return {name: str(path.with_name(f"{path.stem}.{name}{path.suffix}")) for name in strategies}


def _compile_for_target(args: argparse.Namespace) -> int:
    """``jphantom compile``: the run's step compiled for a GPU cluster or TPU slice it does not
    have (:mod:`jphantom.aot`)."""
    from jphantom import aot
    from jphantom.config import RunConfig

    target = aot.Target.parse(args.target, nodes=args.nodes, gpus_per_node=args.gpus_per_node,
                              target_config=args.target_config)
    strategies = list(dict.fromkeys(args.strategy))
    hlo = _hlo_paths(args.hlo, strategies)
    aot.require_plugin(target.platform)  # before anything is built
    settings = _step_settings(args, COMPILE_MODEL)
    settings["mesh"] = settings.get("mesh") or aot.default_mesh(target)
    gpu_defaults = target.platform == "gpu" and not args.no_gpu_defaults
    if gpu_defaults:  # XLA reads XLA_FLAGS when the plugin starts: before target.devices()
        from jphantom import gpu_defaults as defaults

        defaults.apply(allocator=False)  # the flags only: nothing is allocated
    devices = target.devices()
    from jphantom.mesh import device_pool

    with device_pool(devices):  # every run validated before anything compiles
        runs = []
        for name in strategies:
            run = {**settings, "strategy": name, "out": None, "progress": False}
            if not name.startswith("phantom"):
                run.pop("ghost_width", None)
            RunConfig.from_flags(**run).build()
            runs.append(run)
    reports = [aot.compile_report(run, target, devices=devices, gpu_defaults=gpu_defaults,
                                  hlo_out=hlo[run["strategy"]]) for run in runs]
    if args.out:
        aot.write_reports(reports, args.out)
    if args.json:
        json.dump(reports[0] if len(reports) == 1 else reports, sys.stdout, indent=2)
        print()
        return 0
    for report in reports:
        print(aot.format_compile_report(report))
        for note in report["notes"]:
            print(f"note: {note}")
        print()
    if args.out:
        print(f"wrote {args.out}/compile.json and {args.out}/compile.png")
    for report in reports:
        if "hlo_file" in report:
            print(f"wrote the optimised HLO of {report['strategy']} to {report['hlo_file']}")
    return 0


_FORMULAS = {"gpipe": "(P-1)/(M+P-1)", "1f1b": "(P-1)/(M+P-1)",
             "interleaved-1f1b": "(P-1)/(P-1+V*M)",
             "zb-h1": "(P-1)(TF+TB-TW)/(M(TF+TB+TW)+(P-1)(TF+TB-TW))",
             "zb-v": "0 when TF=TB=TW (the paper's claim)"}


MAX_SCHEDULE_TASKS = 20_000
"""``jphantom schedule`` refuses more forward tasks (P x M x V) than this: its drawing would be
megabytes of text and its simulation minutes."""


def _schedule(args: argparse.Namespace) -> int:
    """``jphantom schedule``: the simulator's timeline and bubble of a pipeline schedule, beside
    the Day 66 notes' formula and the lock-step executor's figures. Pure Python: no device is touched."""
    from jphantom.errors import ConfigError
    from jphantom.pipeline.schedule import (SPLIT_SCHEDULES, lockstep, lockstep_split, simulate,
                                            simulate_split, zero_bubble_formula)

    P, M, V = args.stages, args.microbatches, args.virtual_stages
    for flag, value in (("--stages", P), ("--microbatches", M), ("--virtual-stages", V)):
        if value < 1:
            raise ConfigError(f"{flag} {value} must be at least 1")
    if args.width is not None and args.width < 1:
        raise ConfigError(f"--width {args.width} must be at least 1 column")
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
        simulation = simulate_split(args.schedule, P, M, backward_cost=R)
        steps = lockstep_split(args.schedule, P, M)
        formula = zero_bubble_formula(args.schedule, P, M, (1.0, R / 2, R / 2))
    else:
        simulation = simulate(args.schedule, P, M, V, backward_cost=args.backward_cost)
        steps = lockstep(args.schedule, P, M, V)
        interleaved = args.schedule == "interleaved-1f1b"
        formula = (P - 1) / (P - 1 + V * M) if interleaved else (P - 1) / (M + P - 1)
    timeline = simulation.timeline(args.width)
    slots = len(steps.slots) if split else len(steps.ticks)
    result = {
        "schedule": args.schedule, "stages": P, "microbatches": M, "virtual_stages": V,
        "backward_cost": args.backward_cost,
        "simulated": {"bubble_fraction": simulation.bubble_fraction,
                      "makespan": simulation.makespan,
                      "peak_in_flight": list(simulation.peak_in_flight)},
        "formula": {"expression": _FORMULAS[args.schedule], "bubble_fraction": formula},
        "lockstep": {"ticks": slots, "peak_in_flight": list(steps.peak_in_flight),
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
    row = lambda label, value: print(f"  {label:<50}{value}")
    print("\nSimulated (every task starts as soon as its device and inputs are ready):")
    row("bubble fraction", f"{simulation.bubble_fraction:.2%}")
    source = "Qi et al. 2024" if split else "the Day 66 notes' formula"
    row(f"{source} {_FORMULAS[args.schedule]}", f"{formula:.2%}")
    row("peak micro-batches in flight per stage" + (" (chunks)" if V > 1 else ""),
        peaks(simulation.peak_in_flight))
    print("Lock-step SPMD execution (modelled for zb-h1 / zb-v: every slot one F, B or W per "
          "device, ending in the exchange; the executor does not run them yet):" if split else
          "Lock-step executor (the compiled step: each tick a forward and a backward slot):")
    row("slots (F, B or W each)" if split else "ticks", slots)
    row("bubble fraction", f"{steps.bubble_fraction(args.backward_cost):.2%}")
    row("peak micro-batches in flight per stage" + (" (chunks)" if V > 1 else ""),
        peaks(steps.peak_in_flight))
    return 0


def _int_list(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of integers") from None
    if not values:
        raise argparse.ArgumentTypeError("empty list")
    repeated = sorted({v for v in values if values.count(v) > 1})
    if repeated:
        raise argparse.ArgumentTypeError(f"{text!r} repeats {repeated}: give each value once")
    return values


def _ghost_widths(text: str):
    return "auto" if text == "auto" else _int_list(text)


def _compare(args: argparse.Namespace) -> int:
    _setup_devices(args.devices)
    from jphantom.compare import (CompareConfig, format_table, gpu_meter_factory,
                                  prepare_output_dir, run_compare, write_outputs)

    config = CompareConfig.from_flags(
        width=args.width, depth=args.depth, shards=args.shards, ghost_widths=args.ghost_width,
        target_loss=args.target_loss, seeds=args.seeds, batch=args.batch,
        learning_rate=args.learning_rate, steps=args.max_steps, eval_every=args.eval_every,
    )
    prepare_output_dir(args.out)  # a bad --out fails before any training
    meter_factory = gpu_meter_factory() if args.energy == "auto" else None
    result = run_compare(config, progress=not args.no_progress, meter_factory=meter_factory)
    print(format_table(result))
    json_path, png_path = write_outputs(result, args.out)
    print(f"\nwrote {json_path} and {png_path}")
    return 0


def _demo(args: argparse.Namespace) -> int:
    """What one step communicates (inspect), then the Table-I comparison with default settings."""
    _setup_devices(args.devices)
    import jax

    from jphantom.analysis.inspect import format_report, inspect_step
    from jphantom.compare import prepare_output_dir
    from jphantom.config import RunConfig

    prepare_output_dir(args.out)
    count = jax.device_count()
    p = max(q for q in (1, 2, 4, 8) if q <= count)
    print(f"== One training step of each strategy, n=1024, L=2, batch 64, p={p}, k=16 ==\n")
    settings = {**FFN_DEFAULTS, "model": "ffn", "width": 1024, "depth": 2, "batch": 64,
                "mesh": f"model={p}", "out": None, "progress": False, "ghost_width": None}
    reports = [inspect_step(RunConfig.from_flags(
        **(settings | {"strategy": name, "ghost_width": 16 if name == "phantom" else None})))
        for name in ("phantom", "tensor-t1", "tensor", "gspmd")]
    print(format_report(reports).split("\n\nPer collective op")[0])
    print("\n== Training to the same target loss (Table I of Seal et al., small scale) ==\n")
    shards = ",".join(str(q) for q in (2, 4, 8) if q <= count) or "1"
    compare_args = build_parser().parse_args(["compare", "--out", args.out, "--shards", shards])
    compare_args.devices = None  # already set up
    return _compare(compare_args)


_TRAIN_HELP = {
    "model": "the model family: ffn (Seal et al.'s teacher task), gpt2 (alias transformer), llama "
             "(Mixtral with --moe-every 1), mistral, qwen2, qwen3, qwen3_moe, gemma3, or a "
             "family registered with jphantom.families.register; the language models on "
             "byte-level text unless --data and --tokenizer say otherwise",
    "strategy": "parallel strategy: " + ", ".join(("dense", "gspmd", "tensor", "tensor-t1",
                                                   "phantom", "phantom-unfused", "pmm3d",
                                                   "pmm3d-regather", "pmm3d-deferred")),
    "mesh": "mesh axes, e.g. data=2,model=4; add stage=P to pipeline the step over P stages "
            "(tensor, phantom, pmm3d; gspmd with --schedule gpipe), e.g. stage=2,data=2,model=2; "
            "expert=G splits MoE experts; pmm3d runs on data, expert, z, y, x, e.g. "
            "data=2,z=2,y=1,x=2 (default model=1 for dense, else model=<all devices>)",
    "schedule": "with a stage axis: the pipeline schedule, gpipe, 1f1b or "
                "interleaved-1f1b (see `jphantom schedule`)",
    "microbatches": "with a stage axis: micro-batches per step on each data rank; batch / data "
                    "must be a multiple (default: the number of stages)",
    "virtual_stages": "with a stage axis and interleaved-1f1b: model chunks per device",
    "zero": "ZeRO stage of the data axis (tensor or phantom, a mesh with data=D): 0 plain data "
            "parallelism, 1 optimizer state, 2 + gradients, 3 + parameters sharded over data "
            "(default 0)",
    "accumulate": "gradient accumulation: micro-batches per step, one gradient reduction per "
                  "step; batch / data must be a multiple (pipelines: use --microbatches; "
                  "default 1)",
    "clip_norm": "clip the gradients to this global norm, computed over all shards (default: no "
                 "clipping)",
    "precision": "mixed precision: float32, bf16 or float16 compute with float32 master weights "
                 "and optimizer state (float16 with loss scaling)",
    "remat": "activation checkpointing per layer: none, nothing_saveable, dots_saveable or "
             "collectives_saveable (keeps collective outputs: a recompute repeats no collective)",
    "attention": "the attention kernel: auto (cuDNN's flash attention on NVIDIA GPUs in bf16 "
                 "or fp16, XLA's path elsewhere; the choice is printed), xla, or cudnn (an "
                 "error where cuDNN cannot run)",
    "sequence_parallel": "transformer under tensor: Megatron sequence parallelism",
    "collective_matmul": "with --sequence-parallel: each all-gather and reduce-scatter over "
                         "the model axis as p-1 ring steps under the GEMMs of the chunks at "
                         "hand (collective matmul; the same bytes)",
    "context_attention": "with a context=C mesh axis (the sequence split over C devices): ring "
                         "(K/V passed around the ring, the default) or all-gather attention",
    "load_balance": "with a context axis: the load-balanced causal layout (rank r holds chunks "
                    "r and 2C-1-r; --no-load-balance: contiguous chunks)",
    "ghost_width": "phantom: k ghost neurons per rank (and token)",
    "moe_every": "transformer: every n-th block is a mixture of experts (0: none; with an "
                 "expert=G mesh axis the experts are split over G ranks)",
    "experts": "MoE: experts E per MoE block", "top_k": "MoE: experts each token visits",
    "capacity_factor": "MoE: each expert takes capacity_factor x T k / E tokens per rank; "
                       "the rest are dropped and counted",
    "dropless": "MoE: no capacity, no dropped tokens (grouped matmuls, ragged all-to-all)",
    "dtd": "MoE under tensor (TED): duplicate token dropping, all-to-all bytes / model axis",
    "cac": "communication-aware checkpointing (Singh's thesis): --remat collectives_saveable",
    "layers": "transformer blocks", "hidden": "transformer width h", "heads": "attention heads",
    "kv_heads": "the Llama family: key/value heads of grouped-query attention (default: heads)",
    "intermediate": "the Llama family: MLP width (qwen3_moe: each expert's; default 8h/3 rounded "
                    "up to a multiple of 32)",
    "sliding_window": "mistral, gemma3: the attention window W (each token attends itself and "
                      "the W-1 before it; gemma3's local layers, default 512)",
    "from_hf": "start from a Hugging Face directory of the --model family (config.json + "
               "model.safetensors; GPT-2, Llama, Mixtral, Mistral, Qwen2, Qwen3, Qwen3-MoE, "
               "Gemma 3; alias --from-gpt2)",
    "save_hf": "save the trained model as a Hugging Face directory (alias --save-gpt2)",
    "target_loss": "stop once the validation loss reaches this (checked at each evaluation)",
    "on_nonfinite": "a non-finite loss: stop (one line naming the newest checkpoint, the last "
                    "good state), skip (the update is dropped and counted; 10 in a row stop the "
                    "run) or rollback (reload the newest checkpoint and skip the batch; needs "
                    "--checkpoint-dir and --save-every) (default stop)",
    "step_timeout": "seconds a step (after the first, which compiles) or an evaluation may take; "
                    "past it every process exits 124 with one line (a stuck rank or collective; "
                    "default: off with one process, with several max(300 s, 50 x the slowest "
                    "step) once two steps ran)",
    "seq_len": "tokens per sequence", "vocab": "vocabulary size (256 for bytes)",
    "data": "what to train on: a text file, a token file (.bin: llm.c's with a header or "
            "nanoGPT's uint16 tokens; `jphantom tokenize` writes them) or a folder of token files "
            "(files named *val* are the validation split) (default: the Python standard library's "
            "sources as bytes)",
    "tokenizer": "the tokenizer text goes through: bpe (the bundled byte-level BPE, 1024 ids), a "
                 "Hugging Face tokenizer.json (or its folder), a .tiktoken file, or a tiktoken "
                 "encoding name already in tiktoken's cache; nothing downloads; --vocab must be "
                 "at least its size (default: none, bytes)",
    "grad_norm": "record the gradients' global norm every step in metrics.jsonl (one more "
                 "reduction per step) (default: on for train)",
    "tensorboard": "also write the per-step metrics as TensorBoard events into OUT/tensorboard "
                   "(needs pip install tensorboardX) (default: off)",
    "width": "FFN width n", "depth": "FFN layers L", "batch": "global batch (sequences or rows)",
    "steps": "optimizer steps", "optimizer": "adamw, adam or sgd",
    "learning_rate": "peak learning rate", "weight_decay": "AdamW weight decay",
    "adam_b2": "Adam's second-moment decay beta2",
    "warmup_steps": "linear warm-up steps",
    "lr_schedule": "learning rate after warm-up: constant or cosine",
    "eval_every": "validate every N steps", "eval_batches": "validation batches per evaluation",
    "seed": "random seed", "dtype": "float32, bfloat16, float16 or float64", "out": "output folder",
    "progress": "show a progress bar",
    "checkpoint_dir": "save Orbax checkpoints (asynchronous, atomic) into this folder",
    "save_every": "with --checkpoint-dir: save every N steps, and at the end (0: only at the end)",
    "keep_checkpoints": "with --checkpoint-dir: keep the newest K checkpoints",
    "resume": "continue from the newest checkpoint in --checkpoint-dir (state, history, data "
              "position), on this run's mesh (tensor and dense-shaped models may change mesh)",
}


def _add_pipeline_flags(parser: argparse.ArgumentParser) -> None:
    """inspect's --schedule, --microbatches, --virtual-stages (only with a stage axis in --mesh)."""
    from jphantom.pipeline.schedule import ALL_SCHEDULES

    parser.add_argument("--schedule", dest="schedule", default="1f1b",
                        choices=ALL_SCHEDULES,
                        help="with stage=P in --mesh: the pipeline schedule (default 1f1b; zb-h1 "
                             "and zb-v split each backward into B and W; see `jphantom schedule`)")
    parser.add_argument("--microbatches", type=_positive_int, default=None, metavar="M",
                        help="with stage=P in --mesh: micro-batches per step; the batch per data "
                             "rank must be a multiple (default: P)")
    parser.add_argument("--virtual-stages", type=_positive_int, default=1, metavar="V",
                        help="with stage=P in --mesh and interleaved-1f1b: model chunks per "
                             "device (default 1)")


def _add_schedule_parser(sub) -> None:
    from jphantom.pipeline.schedule import ALL_SCHEDULES

    schedule = sub.add_parser(
        "schedule", help="draw a pipeline schedule and its bubble (no devices, nothing compiled)",
        description="Simulate a pipeline schedule on P stages with M micro-batches and print its "
                    "timeline (one row per stage: Fm / Bm are the forward / backward of "
                    "micro-batch m, '.' is idle time), its bubble fraction (idle time / total "
                    "device time) beside the Day 66 notes' formula, (P-1)/(M+P-1) for gpipe and 1f1b "
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
                               "two chunks per device in a V (simulated only). Default 1f1b")
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
                               "for any value, as the Day 66 notes' formula says")
    schedule.add_argument("--width", type=int, default=None, metavar="COLUMNS",
                          help="timeline width in characters (default: wide enough for every "
                               "label)")
    schedule.add_argument("--json", action="store_true",
                          help="print JSON (figures and the timeline) instead of text")
    schedule.set_defaults(handler=_schedule)


def _add_tokenize_parser(sub) -> None:
    from jphantom.data.tokens import FORMATS

    tokenize = sub.add_parser(
        "tokenize", help="turn text files into a token file that `train --data` reads",
        description="Read text files (and every file matching --pattern in the folders given), "
                    "turn them into token ids with --tokenizer and write one flat token file: "
                    "llm.c's format (a 256-int32 header, then uint16 tokens, or uint32 for "
                    "vocabularies over 65,536 ids) or nanoGPT's (uint16 tokens, no header). Each "
                    "file is a document, preceded by the tokenizer's end-of-text token when it "
                    "has one. Then train on it: jphantom train --data FILE.bin --vocab V, with V "
                    "at least the tokenizer's size (printed at the end). Nothing is downloaded: "
                    "the tokenizer must be on this machine.",
        epilog="Examples: jphantom tokenize notes.txt --out data/train.bin  (the bundled BPE) | "
               "jphantom tokenize corpus/ --pattern '*.md' --tokenizer gpt2/tokenizer.json "
               "--out data/train.bin | jphantom tokenize held_out/ --out data/val.bin  (a file "
               "whose name contains 'val' is the validation split of `train --data data/`; "
               "without one, train holds out the last 5% of the tokens)")
    tokenize.add_argument("inputs", nargs="+", metavar="INPUT",
                          help="text files, or folders searched recursively for --pattern")
    tokenize.add_argument("--out", required=True, metavar="FILE.bin",
                          help="the token file to write (its folder is created)")
    tokenize.add_argument("--tokenizer", default="bpe",
                          help="bpe (the bundled byte-level BPE, 1024 ids), a Hugging Face "
                               "tokenizer.json or its folder, a .tiktoken file, a tiktoken "
                               "encoding name in tiktoken's cache, or bytes (default bpe)")
    tokenize.add_argument("--pattern", default="*.txt",
                          help="which files of a folder to read, a glob (default *.txt)")
    tokenize.add_argument("--format", choices=FORMATS, default="llm.c",
                          help="llm.c: a header that records the token type and count; "
                               "nanogpt: bare uint16 tokens (default llm.c)")
    tokenize.add_argument("--no-eot", dest="eot", action="store_false",
                          help="do not put the end-of-text token before each file")
    tokenize.add_argument("--no-progress", dest="progress", action="store_false",
                          help="no progress bar")
    tokenize.set_defaults(handler=_tokenize)


def _tokenize(args: argparse.Namespace) -> int:
    """``jphantom tokenize``: text in, one token file out (:func:`jphantom.data.tokens.
    tokenize_files`)."""
    from jphantom.data.tokens import tokenize_files

    done = tokenize_files(args.inputs, args.out, args.tokenizer, pattern=args.pattern,
                          format=args.format, eot=args.eot, progress=args.progress)
    print(f"wrote {done['path']}: {done['tokens']:,} tokens ({done['dtype']}, {done['format']}) "
          f"from {done['files']} file(s), {done['bytes']:,} bytes; tokenizer {done['tokenizer']} "
          f"has {done['vocab_size']} ids: train with --data {done['path']} --vocab "
          f"{done['vocab_size']}" + (f" --tokenizer {done['tokenizer']}"
                                     if done["tokenizer"] != "bytes" else ""))
    return 0


def _add_run_flags(parser: argparse.ArgumentParser, defaults: dict | None = None,
                   only: tuple[str, ...] | None = None) -> None:
    """One flag per setting of :class:`jphantom.config.RunConfig` (flat names; ``--model`` is
    ``model.name``), typed by the sections' annotations; ``defaults`` overrides shown defaults."""
    import dataclasses
    import typing

    from jphantom.config import ALIASES, FLAT, SECTIONS
    from jphantom.pipeline.schedule import ALL_SCHEDULES
    from jphantom.precision import NAMES as PRECISIONS
    from jphantom.remat import POLICIES
    from jphantom.resilience import NONFINITE

    choices = {"schedule": ALL_SCHEDULES, "zero": (0, 1, 2, 3), "precision": PRECISIONS,
               "remat": tuple(POLICIES), "optimizer": ("adamw", "adam", "sgd"),
               "lr_schedule": ("constant", "cosine"),
               "dtype": ("float32", "bfloat16", "float16", "float64"),
               "context_attention": ("ring", "all-gather"),
               "on_nonfinite": NONFINITE,
               "attention": ("auto", "xla", "cudnn")}
    defaults = defaults or {}
    for flat, (section, name) in FLAT.items():
        if only is not None and flat not in only:
            continue
        cls = SECTIONS[section]
        field = next(f for f in dataclasses.fields(cls) if f.name == name)
        kind = typing.get_type_hints(cls)[name]
        base = next((a for a in typing.get_args(kind) if a is not type(None)), kind)
        default = defaults.get(flat, field.default)
        text = _TRAIN_HELP.get(flat, "")
        text += f" (default {default})" if "default" not in text else ""
        flag = "--" + flat.replace("_", "-")
        aliases = [("--" + a.replace("_", "-")) for a, b in ALIASES.items() if b == flat]
        if base is bool:
            parser.add_argument(flag, *aliases, dest=flat, action=argparse.BooleanOptionalAction,
                                default=None, help=text)
            continue
        parser.add_argument(flag, *aliases, dest=flat, type=base if base in (int, float) else str,
                            default=None, choices=choices.get(flat), help=text)


def _run_settings(args: argparse.Namespace, defaults: dict | None = None) -> dict:
    """The flat settings of a run: ``defaults``, then ``--config``'s file, then the flags."""
    from jphantom.config import FLAT, load_toml

    settings = dict(defaults or {})
    if getattr(args, "config", None):
        settings.update(load_toml(args.config))
    for flat in FLAT:
        value = getattr(args, flat, None)
        if value is not None:
            settings[flat] = value
    return settings


def _add_gpu_defaults_flag(parser: argparse.ArgumentParser, what: str) -> None:
    """``--no-gpu-defaults``: leave :mod:`jphantom.gpu_defaults` out (``what`` they do here)."""
    parser.add_argument("--no-gpu-defaults", action="store_true",
                        help=f"do not {what}; without this flag they are used, and what is set "
                             "is reported")


def _add_train_parser(sub) -> None:
    train = sub.add_parser(
        "train", help="train the FFN, GPT-2 or Llama under any strategy and mesh",
        description="Train and write metrics.jsonl, curves.png and results.json into --out. Every "
                    "setting can also come from --config FILE.toml (flat keys as below, with - or "
                    "_, or sections [model], [parallel], [step], [train]: examples/train.toml); "
                    "flags override the file.",
        epilog="Examples: jphantom train  (a 4-layer width-256 GPT-2 on the standard library's "
               "sources) | jphantom train --strategy tensor --mesh data=2,model=4 "
               "--sequence-parallel --devices 8 | jphantom train --model ffn --strategy phantom "
               "--ghost-width 8 --width 256 --mesh model=4 --devices 4 | jphantom train --model "
               "llama --strategy tensor --mesh stage=2,data=2,model=2 --microbatches 4 --schedule "
               "gpipe (a pipeline of 2 stages) | jphantom train --strategy tensor --mesh "
               "data=4,model=2 --zero 3 --accumulate 2 --clip-norm 1.0 (FSDP, 2 micro-batches, "
               "clipping)")
    train.add_argument("--config", metavar="FILE.toml", help="settings from a TOML file")
    _add_run_flags(train)
    _add_device_flag(train)
    _add_gpu_defaults_flag(train, "set jphantom's GPU defaults on NVIDIA GPUs (jphantom."
                                  "gpu_defaults: XLA flags for the latency-hiding scheduler and "
                                  "pipelined collectives, XLA_PYTHON_CLIENT_MEM_FRACTION=0.9) "
                                  "where the environment does not set them")
    train.set_defaults(handler=_train)


TRAIN_DEFAULTS = {"grad_norm": True}  # train's defaults where they differ from RunConfig's


def _train_gpu_defaults() -> None:
    """``train`` on NVIDIA GPUs: :mod:`jphantom.gpu_defaults` into the environment where it does
    not set them, and one line saying what was set (by the first process of a multi-process
    run)."""
    from jphantom import gpu_defaults
    from jphantom.distributed import ENV_PROCESS_ID

    if not gpu_defaults.nvidia_gpu_visible():
        return
    applied = gpu_defaults.apply()
    if os.environ.get(ENV_PROCESS_ID, "0").strip() in ("", "0"):
        print("gpu defaults: " + (" ".join(applied) if applied else
                                  "none set (XLA_FLAGS and the environment set them all)"))


def _train(args: argparse.Namespace) -> int:
    settings = _run_settings(args, TRAIN_DEFAULTS)
    from jphantom import distributed

    devices, at_least = args.devices, False
    if devices is None and not accelerator_visible():
        # On CPU simulate as many devices as the mesh needs (one for dense): fewer simulated devices
        # leave each one more of the host's threads.
        from jphantom.mesh import MeshConfig
        mesh = settings.get("mesh")
        if mesh is not None:
            devices = MeshConfig.parse(mesh).device_count
        elif settings.get("strategy", "dense") == "dense":
            devices = 1
        at_least = True
    if not distributed.is_initialized():  # else the launcher gave every process its devices
        _setup_devices(devices, at_least=at_least)
    import jax

    from jphantom.config import RunConfig
    from jphantom.run import run
    if settings.get("dtype") == "float64":
        jax.config.update("jax_enable_x64", True)
    config = RunConfig.from_flags(**settings)
    config.build()  # every shape against the mesh, before any data is read
    used, available = config.parallel.mesh_config().device_count, jax.device_count()
    if used < available and jax.process_index() == 0:
        print(f"note: mesh {config.parallel.mesh_config()} uses {used} of the {available} "
              f"devices; {available - used} stay idle (give the mesh more ranks to use them)")
    results = run(config)
    if "pipeline" in results:
        pipe = results["pipeline"]
        print(f"pipeline: {pipe['schedule']}, {pipe['stages']} stages, {pipe['microbatches']} "
              f"micro-batches, {pipe['virtual_stages']} virtual stage(s) per device")
    step = results["step"]
    if step != {"zero": 0, "accumulate": 1, "clip_norm": None, "precision": "float32",
                "remat": "none"}:
        print(f"step: ZeRO-{step['zero']}, {step['accumulate']} accumulation micro-batch(es), "
              + ("no clipping" if step["clip_norm"] is None
                 else f"gradients clipped to global norm {step['clip_norm']:g}")
              + f", {step['precision']} compute, remat {step['remat']}")
    if "moe" in results:
        moe = results["moe"]
        active = ("" if moe["active_params"] is None
                  else f", {moe['active_params']:,} active parameters")
        print(f"MoE: every {moe['moe_every']} block(s), {moe['experts']} experts, "
              f"top-{moe['top_k']}{active}; dropped {100 * moe['final_dropped_fraction']:.2f}% "
              "of token-expert assignments")
    if results["interrupted"]:
        from jphantom.resilience import EXIT_STATUS

        where = f" into {config.train.out}" if config.train.out is not None else ""
        saved = results.get("checkpoints", {}).get("steps") or []
        kept = (f"; checkpoint of step {max(saved)} in {config.train.checkpoint_dir} (continue "
                "with --resume)" if saved else "; no checkpoint (give --checkpoint-dir to keep "
                "the state)")
        if jax.process_index() == 0:
            print(f"{results['stopped_by'] or 'interrupted'}: stopped after step "
                  f"{results['steps_done']}, wrote what the run had{where}{kept}",
                  file=sys.stderr)
        return EXIT_STATUS.get(results["stopped_by"], 130)
    print(f"final validation loss {results['final_validation_loss']:.4f}"
          + (f" nats/token; unigram cross-entropy {results['unigram_cross_entropy']:.4f}; "
             f"ratio {results['validation_over_unigram']:.3f}"
             if "unigram_cross_entropy" in results else " (MSE)"))
    if jax.process_index() == 0 and config.train.out is not None:  # process 0 alone writes
        print(f"wrote {config.train.out}/results.json, metrics.jsonl and curves.png")
    return 0


def _verify(args: argparse.Namespace) -> int:
    """``jphantom verify``: :func:`jphantom.exactness.verify_step` of the run the flags describe."""
    settings = _run_settings(args)
    from jphantom.errors import ConfigError
    from jphantom.mesh import MeshConfig

    if not args.tolerance > 0:
        raise ConfigError(f"--tolerance {args.tolerance}: give a positive number, e.g. 1e-5")
    mesh = settings.get("mesh")
    _setup_devices(args.devices if args.devices is not None else
                   (MeshConfig.parse(mesh).device_count if mesh else None), at_least=True)
    import jax
    import numpy as np

    jax.config.update("jax_enable_x64", True)  # the one-device reference in float64
    from jphantom.analysis.compiled import abstract_batch
    from jphantom.config import RunConfig
    from jphantom.exactness import verify_step

    config = RunConfig.from_flags(**{**settings, "out": None, "progress": False})
    built = config.build()
    state = built.program.init(built.step, seed=config.train.seed)
    rng = np.random.default_rng(config.train.seed)
    batch = []
    for struct in abstract_batch(config, built.program, built.step):
        if np.issubdtype(struct.dtype, np.integer):
            batch.append(rng.integers(0, config.family_config().vocab_size, struct.shape
                                      ).astype(struct.dtype))
        else:
            batch.append(rng.standard_normal(struct.shape).astype(struct.dtype))
    report = verify_step(built.step, state.params, *batch, tolerance=args.tolerance)
    if args.json:
        json.dump(report.as_dict(), sys.stdout, indent=2)
        print()
    else:
        print(f"{config.parallel.strategy} on {config.parallel.mesh_config()}: {report}")
    return 0 if report.ok else 1


class _Parser(argparse.ArgumentParser):
    """An argument parser whose errors are one line (the usage is what ``--help`` is for); its
    subcommands' parsers are of this class too."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="jphantom",
        description="Model-parallel FFN training in JAX, measured on communication and energy. "
                    "Phantom parallelism (Seal et al.) against tensor parallelism.",
        epilog="Example: jphantom inspect --strategy phantom --width 4096 --depth 2 "
               "--ghost-width 16 --devices 8 --batch 256",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    names = _strategy_names(None)

    inspect = sub.add_parser(
        "inspect", help="compile one training step and report its collectives, FLOPs, memory",
        epilog="Example: jphantom inspect --model transformer --layers 2 --hidden 64 --heads 4 "
               "--seq-len 32 --batch 8 --strategy tensor --sequence-parallel --mesh data=2,model=4 "
               "--devices 8",
        description="Compile one training step (forward, backward, optimizer update: SGD for "
                    "the FFN, AdamW for GPT-2 and Llama, unless --optimizer) of the FFN, GPT-2 "
                    "or Llama, with the same defaults as `jphantom compile` for the same --model, "
                    "and report, "
                    "from the compiled HLO, every collective (kind, shape, bytes, groups, mesh "
                    "axes, executions per step), FLOPs, parameter count and memory (XLA's, and "
                    "the parameters', gradients' and optimizer state's bytes per device). "
                    "Nothing is trained.",
    )
    inspect.add_argument("--strategy", nargs="+", default=["phantom"], choices=names,
                         help="one or more strategies to compare side by side (default: phantom)")
    inspect.add_argument("--config", metavar="FILE.toml",
                         help="settings from a TOML file (as train's; flags override)")
    _add_run_flags(inspect, _shown_defaults(INSPECT_MODEL), only=INSPECT_FLAGS)
    inspect.add_argument("--shards", type=_positive_int, default=None,
                         help="shorthand for --mesh model=N")
    inspect.add_argument("--breakdown", action="store_true",
                         help="also run the step with and without its data-parallel reductions and "
                              "report Cheng et al.'s compute/communication breakdown (t_iter, "
                              "t_compute, t_comm, shares; Eq. 26's modelled communication)")
    inspect.add_argument("--json", action="store_true", help="print JSON instead of a table")
    _add_device_flag(inspect)
    inspect.set_defaults(handler=_inspect)

    compare = sub.add_parser(
        "compare", help="train TP and phantom to the same target loss (Seal et al. Table I)",
        description="Train the dense model with tensor parallelism (tensor-t1) and phantom models "
                    "with each ghost width on the teacher task, for each shard count, to the same "
                    "held-out MSE; print a Table-I-shaped comparison and write results.json and "
                    "comparison.png. Energy is modelled (Eq. 1) unless measured on a GPU; see "
                    "docs/methodology.md.",
    )
    compare.add_argument("--width", type=_positive_int, default=256,
                         help="layer width n (default 256)")
    compare.add_argument("--depth", type=_positive_int, default=2, help="layers L (default 2)")
    compare.add_argument("--shards", type=_int_list, default=(2, 4, 8),
                         help="comma-separated shard counts p (default 2,4,8)")
    compare.add_argument("--ghost-width", type=_ghost_widths, default=(2, 4, 16),
                         help="comma-separated ghost widths k, or 'auto' (1/8 of Eq. 8's bound per p)")
    compare.add_argument("--target-loss", type=float, default=None,
                         help="held-out MSE to reach (default: chosen so that every run reaches it)")
    compare.add_argument("--seeds", type=_int_list, default=(0, 1, 2), help="default 0,1,2")
    compare.add_argument("--batch", type=_positive_int, default=64)
    compare.add_argument("--learning-rate", type=float, default=2e-3, help="Adam (default 2e-3)")
    compare.add_argument("--max-steps", type=_positive_int, default=300)
    compare.add_argument("--eval-every", type=_positive_int, default=10)
    compare.add_argument("--out", default="out/compare", help="output folder (default out/compare)")
    compare.add_argument("--no-progress", action="store_true", help="no progress bar")
    compare.add_argument("--energy", choices=("auto", "model"), default="auto",
                         help="auto: measure with NVML on NVIDIA GPUs, else model it (Eq. 1); "
                              "model: always the Eq. 1 model (default auto)")
    _add_device_flag(compare)
    compare.set_defaults(handler=_compare)

    target = sub.add_parser(
        "compile", help="compile the training step for H100/A100 nodes or a TPU slice from this "
                        "machine: memory and collectives from XLA",
        description="Build the training step exactly as `train` would (same flags) and compile it "
                    "ahead of time for GPUs or TPUs this machine does not have "
                    "(jax.experimental.topologies): report per device XLA's memory (arguments, "
                    "outputs, temporaries, peak) against the device's memory, every collective "
                    "with its mesh axes, bytes and executions, whether XLA made it asynchronous "
                    "and overlapped it with compute, whether it crosses nodes, model FLOPs and "
                    "XLA's cost analysis. Nothing runs. Needs the GPU compiler (pip install "
                    "'jphantom[aot]') or libtpu (pip install 'jphantom[tpu]').",
        epilog="Examples: jphantom compile --target gpu:h100 --nodes 4 --model llama --layers 2 "
               "--hidden 256 --heads 8 --seq-len 128 --vocab 1024 --batch 64 --strategy tensor "
               "--mesh data=4,model=8 | jphantom compile --target tpu:v5p:2x2x2 --model llama "
               "--mesh data=8 --zero 3 --json")
    target.add_argument("--target", default="gpu:h100",
                        help="gpu:h100, gpu:a100 (SXM, 80 GB) or tpu:CHIP:TOPOLOGY, e.g. "
                             "tpu:v5p:2x2x2 (default gpu:h100)")
    target.add_argument("--nodes", type=_positive_int, default=1,
                        help="GPU nodes (default 1)")
    target.add_argument("--gpus-per-node", type=_positive_int, default=None,
                        help="GPUs per node (default 8)")
    target.add_argument("--target-config", metavar="FILE", default=None,
                        help="your GPU as a stream_executor.GpuTargetConfigProto text file "
                             "(default: the shipped H100 SXM or A100 SXM description)")
    target.add_argument("--strategy", nargs="+", default=["tensor"], choices=names,
                        help="one or more strategies (default tensor)")
    target.add_argument("--config", metavar="FILE.toml",
                        help="settings from a TOML file (as train's; flags override)")
    _add_run_flags(target, _shown_defaults(COMPILE_MODEL), only=INSPECT_FLAGS)
    target.add_argument("--out", default=None, metavar="DIR",
                        help="also write DIR/compile.json and DIR/compile.png")
    target.add_argument("--hlo", default=None, metavar="FILE",
                        help="also write the optimised HLO text of the compiled step to FILE "
                             "(the kernels, fusions and schedule XLA chose); with several "
                             "--strategy values one file each, the strategy's name inserted "
                             "before FILE's suffix (step.hlo -> step.tensor.hlo)")
    _add_gpu_defaults_flag(target, "compile with jphantom's GPU XLA flags (jphantom."
                                   "gpu_defaults: latency-hiding scheduler, pipelined "
                                   "collectives) where XLA_FLAGS does not set them")
    target.add_argument("--json", action="store_true", help="print JSON instead of a table")
    target.set_defaults(handler=_compile_for_target)

    _add_train_parser(sub)
    _add_tokenize_parser(sub)
    _add_schedule_parser(sub)
    from jphantom.plan import add_parser as add_plan_parser

    add_plan_parser(sub)
    from jphantom.launch import add_parser as add_launch_parser

    add_launch_parser(sub)

    verify = sub.add_parser(
        "verify", help="one step of a layout against the one-device model: is it exact?",
        description="Build the run as train would (same flags), take one step's loss and every "
                    "gradient with all its collectives, and compare them with the same "
                    "parameters through the plain model on one device (float64 there): the "
                    "largest relative difference of the loss and of each gradient, the worst "
                    "parameter named. Exit 0 when all are within --tolerance, 1 when not.",
        epilog="Example: jphantom verify --model llama --layers 2 --hidden 64 --heads 4 "
               "--kv-heads 2 --seq-len 32 --batch 8 --strategy tensor --sequence-parallel "
               "--mesh data=2,model=4")
    verify.add_argument("--config", metavar="FILE.toml", help="settings from a TOML file")
    _add_run_flags(verify)
    _add_device_flag(verify)
    verify.add_argument("--tolerance", type=float, default=1e-5,
                        help="largest relative difference called exact (default 1e-5)")
    verify.add_argument("--json", action="store_true", help="print JSON instead of a summary")
    verify.set_defaults(handler=_verify)

    demo = sub.add_parser("demo", help="what `make demo` runs: inspect, then compare",
                          description="Inspect one step of each strategy, then run `compare` with "
                                      "its defaults (on the GPUs, or on 8 simulated CPU devices).")
    demo.add_argument("--out", default="out/compare")
    _add_device_flag(demo)
    demo.set_defaults(handler=_demo)
    return parser


def main(argv: list[str] | None = None) -> int:
    if (sys.argv[1:] if argv is None else argv)[:1] == ["compile"]:
        # before jax loads the CUDA plugin, which logs that this machine has no GPU: known here
        os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    args = build_parser().parse_args(argv)
    from jphantom.errors import ConfigError, TrainingDiverged

    _one_line_warnings()

    if args.command == "train" and not args.no_gpu_defaults and args.devices is None:
        _train_gpu_defaults()  # before jax.distributed or anything else starts jax
    try:
        if args.command != "launch":  # a process started by `jphantom launch`, srun or mpirun
            from jphantom import distributed

            distributed.initialize_from_env()
        return args.handler(args)
    except ConfigError as error:
        print(f"jphantom: error: {_message(error)}", file=sys.stderr)
        return 2
    except TrainingDiverged as error:
        print(f"jphantom: error: training diverged: {_message(error)}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:  # before or after the training loop, which handles its own
        print("jphantom: interrupted", file=sys.stderr)
        return 130


def _one_line_warnings() -> None:
    """jphantom's own warnings on the command line: one line, ``jphantom: warning: ...``, not the
    library file and line they were raised at."""
    import warnings

    from jphantom.errors import JPhantomWarning

    previous = warnings.showwarning
    if getattr(previous, "_jphantom", False):
        return

    def show(message, category, filename, lineno, file=None, line=None):
        if issubclass(category, JPhantomWarning):
            print(f"jphantom: warning: {message}", file=file or sys.stderr)
            return
        previous(message, category, filename, lineno, file, line)

    show._jphantom = True
    warnings.showwarning = show


def _message(error: Exception) -> str:
    """The error's own words on one line (without what jax appends to errors raised while it
    traces: a separator and a note on its filtered traceback)."""
    return str(error).split("\n--------------------")[0].strip()


if __name__ == "__main__":
    sys.exit(main())
