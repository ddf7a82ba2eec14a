"""``jphantom plan`` on the command line: its flags (read as text, checked by the handler, so
that a bad value is one ``jphantom: error:`` line), the planner run on them, and
``--compile-top`` compiling the best layouts for a target."""

from __future__ import annotations

import dataclasses
import math

from jphantom.errors import ConfigError
from jphantom.perf.axonn_model import GPTShape, Topology
from jphantom.planner import clusters
from jphantom.planner.report import format_plan
from jphantom.planner.result import Ranking
from jphantom.planner.search import DEFAULT_DEVICE_TFLOPS, plan
from jphantom.predict.device import names as device_names


def _parse_int(flag: str, text: str, minimum: int = 1) -> int:
    try:
        value = int(text)
    except (TypeError, ValueError):
        raise ConfigError(f"{flag} {text!r} is not a whole number: give e.g. {flag} "
                          f"{max(minimum, 32)}") from None
    if value < minimum:
        raise ConfigError(f"{flag} {value} must be >= {minimum}")
    return value


def _parse_float(flag: str, text: str, *, zero_ok: bool = False) -> float:
    try:
        value = float(text)
    except (TypeError, ValueError):
        raise ConfigError(f"{flag} {text!r} is not a number") from None
    if not math.isfinite(value) or value < 0 or (value == 0 and not zero_ok):
        raise ConfigError(f"{flag} {text} must be a finite number {'>= 0' if zero_ok else '> 0'}")
    return value


def _shape_of_flags(args) -> GPTShape:
    """The planner's shape of ``--model`` (a registered family that declares a ``plan_shape``)
    at the flags' sizes."""
    from jphantom.config import ModelConfig
    from jphantom.registry import families

    found = families.get(args.model)
    if found.plan_shape is None:
        priced = [f.name for f in families.families().values() if f.plan_shape is not None]
        raise ConfigError(f"--model {found.name}: the planner prices dense decoder blocks "
                          f"({', '.join(priced)}); {found.name} declares no plan_shape")
    sizes = {name: _parse_int(f"--{name.replace('_', '-')}", getattr(args, name))
             for name in ("layers", "hidden", "heads", "seq_len", "vocab")}
    for name in ("intermediate", "kv_heads"):
        value = getattr(args, name)
        if value is not None:
            sizes[name] = _parse_int(f"--{name.replace('_', '-')}", value)
    section = ModelConfig(name=found.name, **{k: v for k, v in sizes.items()
                                              if k in found.accepted})
    return GPTShape.of(found.plan_shape(found.from_flags(section, False)))


def _run(args) -> int:
    import json
    import sys

    shape = _shape_of_flags(args)
    cluster = None if args.cluster is None else clusters.get(args.cluster)
    device = None
    if args.device is not None or args.objective in ("time", "energy") or cluster is not None:
        from jphantom.predict import device as described

        device = described.load(args.device or (cluster.device if cluster else DEFAULT_DEVICE))
    topology = (_cluster_topology(args, cluster) if cluster is not None
                else _topology(args, device))
    memory_gib, memory_source = args.memory_gib, "given"
    if memory_gib is None:  # the named GPU's memory: --device's, else the cluster's node's
        memory_gib, memory_source = _memory_of(args, cluster, device)
    result = plan(
        shape, _parse_int("--devices", args.devices), topology,
        batch=_parse_int("--batch", args.batch),
        memory_gib=None if memory_gib is None else _parse_float("--memory-gib", memory_gib),
        precision=args.precision,
        ghost_width=None if args.ghost_width is None else _parse_int("--ghost-width",
                                                                    args.ghost_width),
        accumulate=_parse_int("--accumulate", args.accumulate), latency=not args.no_latency,
        device_tflops=(None if args.device_tflops is None
                       else _parse_float("--device-tflops", args.device_tflops)),
        flash_attention=not args.attention_scores,
        as_compiled=args.as_compiled or args.compile_top is not None,
        objective=args.objective, device=device, memory_source=memory_source)
    top = _parse_int("--top", args.top)
    if args.compile_top is not None:
        return _compile_top(args, result, _parse_int("--compile-top", args.compile_top),
                            topology.gpus_per_node)
    if args.json:
        json.dump(result.as_dict(top), sys.stdout, indent=2)
        print()
    else:
        print(format_plan(result, top))
    return 0


def _memory_of(args, cluster, device) -> tuple[str | None, str]:
    """The memory limit (GiB, as text) when ``--memory-gib`` is not given, and where it comes
    from: ``--device``'s HBM when a device is named (and it is not the cluster's own), else the
    cluster's GPU's (Perlmutter's 40 GB part), else none."""
    if args.device is not None and (cluster is None or device.name != cluster.device):
        return (str(device.memory_bytes / 2**30),
                f"{device.name}'s {device.memory_bytes / 1e9:g} GB of HBM, from its description")
    if cluster is not None:
        source = ("the node's figure" if "memory_gib" in cluster.numbers
                  else f"{device.name}'s {device.memory_bytes / 1e9:g} GB of HBM")
        return str(cluster.memory_gib(device)), f"{cluster.name}: {source}"
    return None, "given"


def _topology(args, device) -> Topology:
    """The network without ``--cluster``: ``--device``'s links and NICs, else Perlmutter's
    NVLink table, else one intra-node bandwidth; the network flags override each number."""
    gpus_per_node = _parse_int("--gpus-per-node", args.gpus_per_node or (
        str(int(device["network.gpus_per_node"])) if args.device else "4"))
    inter = _parse_float("--inter-node-gbps", args.inter_node_gbps or (
        str(device["network.nics_per_node"] * device["network.nic_gbps"]
            * device["network.inter_node_efficiency"]) if args.device else "100"))
    latency_us = _parse_float("--latency-us", args.latency_us or (
        str(device["network.inter_latency_us"]) if args.device else "5"), zero_ok=True)
    if args.device and args.intra_node_gbps is None:  # the device's own links
        intra = device["network.intra_node_gbps"] * device["network.intra_node_efficiency"]
        return Topology(gpus_per_node=gpus_per_node, inter_node_gbps=inter,
                        intra_node_gbps=intra, latency_us=latency_us,
                        name=f"{device.name} nodes")
    if args.intra_node_gbps is None and gpus_per_node == 4:
        base = Topology.perlmutter()
        return dataclasses.replace(
            base, inter_node_gbps=inter, latency_us=latency_us,
            name="perlmutter" if (inter, latency_us) == (base.inter_node_gbps, base.latency_us)
            else "perlmutter NVLink table, custom inter-node/latency")
    intra = 300.0 if args.intra_node_gbps is None else _parse_float("--intra-node-gbps",
                                                                    args.intra_node_gbps)
    return Topology(gpus_per_node=gpus_per_node, inter_node_gbps=inter,
                    intra_node_gbps=intra, latency_us=latency_us, name="custom")


def _cluster_topology(args, cluster: clusters.Cluster) -> Topology:
    """``--cluster``'s network (:mod:`jphantom.planner.clusters`), each network flag given
    replacing its number."""
    topology = cluster.topology()
    changes = {}
    if args.gpus_per_node is not None:
        changes["gpus_per_node"] = _parse_int("--gpus-per-node", args.gpus_per_node)
        changes["intra_node_table"] = ()  # the node's table no longer describes it
    if args.inter_node_gbps is not None:
        changes["inter_node_gbps"] = _parse_float("--inter-node-gbps", args.inter_node_gbps)
    if args.intra_node_gbps is not None:
        changes["intra_node_gbps"] = _parse_float("--intra-node-gbps", args.intra_node_gbps)
        changes["intra_node_table"] = ()
    if args.latency_us is not None:
        changes["latency_us"] = _parse_float("--latency-us", args.latency_us, zero_ok=True)
    if changes:
        given = sorted(k for k in changes if k != "intra_node_table")
        changes["name"] = f"{cluster.name}, custom {', '.join(given)}"
    return dataclasses.replace(topology, **changes)


DEFAULT_DEVICE = "a100-sxm"
"""The device ``--objective time|energy`` prices without ``--device``: Perlmutter's A100, the
planner's default machine."""


def _compile_top(args, result: Ranking, k: int, gpus_per_node: int) -> int:
    """``--compile-top K``: compile the K best layouts for the target and re-rank them."""
    import json
    import os
    import sys

    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    from jphantom.costs import aot
    from jphantom.planner.compiled import compile_plan, format_compiled_plan, format_simulated_plan

    devices = result.assumptions["devices"]
    if devices % gpus_per_node:
        raise ConfigError(f"--devices {devices} is not a whole number of nodes of "
                          f"--gpus-per-node {gpus_per_node}")
    target = aot.Target.parse(args.target, nodes=devices // gpus_per_node,
                              gpus_per_node=gpus_per_node)
    predict_on = None
    if result.assumptions["objective"] in ("time", "energy"):
        from jphantom.predict import device as described

        predict_on = (described.load(args.device) if args.device
                      else described.for_target(f"gpu:{target.chip}"))
    aot.require_plugin(target.platform)
    entries = compile_plan(result, k, target, predict_on=predict_on)
    if args.json:
        json.dump({"plan": result.as_dict(k), "target": target.as_dict(),
                   "compiled": entries}, sys.stdout, indent=2)
        print()
        return 0
    print(format_plan(result, k))
    if predict_on is not None:
        print(f"\nThe top {k} layouts that train this model, compiled for {target.name}, "
              f"simulated on {predict_on.name} (jphantom.predict) and re-ranked by simulated "
              f"{'step time' if result.assumptions['objective'] == 'time' else 'J/token'} "
              "(compiled peak fits first); modelled and simulated side by side:\n")
        print(format_simulated_plan(entries))
        from jphantom.predict.validation import error_band

        print(f"GEMM rates: {predict_on.gemm_rates}\n{error_band(predict_on.name, args.precision)}")
        return 0
    print(f"\nThe top {k} layouts that train this model, compiled for {target.name} and "
          "re-ranked (compiled peak fits first, then fewer collective bytes across nodes, then "
          "fewer in all):\n")
    print(format_compiled_plan(entries))
    return 0


def add_parser(subparsers) -> None:
    """Register ``jphantom plan`` on the CLI's subparsers. Numbers are read as text and checked by
    the handler, so a bad value is one ``jphantom: error:`` line (exit status 2)."""
    parser = subparsers.add_parser(
        "plan", help="rank parallel layouts of a GPT on N GPUs by modelled communication "
                     "(Singh's Eqs. 5.1-5.7); nothing runs",
        description="Enumerate every 4D grid (pmm3d: data x z x y x x) and the other layouts "
                    "(Megatron tensor parallelism with and without sequence parallelism, plain "
                    "data parallelism, phantom parallelism, 1F1B pipelines, ZeRO-3) of a GPT on "
                    "--devices GPUs; price each step's collectives with the ring alpha-beta model "
                    "and AxoNN's placement-aware bandwidths (Singh's thesis Eq. 5.7: groups inside a "
                    "node use the intra-node table, groups across nodes share beta_inter); model "
                    "the memory per GPU; print them ranked, best first, with the top choice and "
                    "every assumption. Pure arithmetic: no devices, nothing compiled. Defaults: "
                    "GPT-20B of Singh's thesis Table 5.1 on 32 Perlmutter GPUs.",
        epilog="Examples: jphantom plan --devices 32 --memory-gib 40  (GPT-20B on 8 Perlmutter "
               "nodes) | jphantom plan --layers 38 --hidden 9216 --heads 72 --devices 64 "
               "--memory-gib 40 --top 5  (GPT-40B) | jphantom plan --devices 64 --gpus-per-node 8 "
               "--inter-node-gbps 200 --intra-node-gbps 450 --json  (another machine, as JSON) | "
               "jphantom plan --no-latency  (Singh's model exactly)")
    parser.add_argument("--model", default="transformer",
                        help="the model family to plan: transformer (alias gpt2: GPT-2 blocks), "
                             "llama (grouped-query attention, SwiGLU, untied head), mistral, "
                             "qwen2, qwen3, gemma3 (their Llama blocks; qwen3 and gemma3 with "
                             "tied embeddings), or a registered family with a plan_shape "
                             "(default transformer)")
    parser.add_argument("--intermediate", default=None, metavar="N",
                        help="llama: the SwiGLU width (default 8h/3 rounded up to 32)")
    parser.add_argument("--kv-heads", default=None, metavar="N",
                        help="llama: key/value heads (default --heads)")
    for flag, default, text in (
            ("--layers", "32", "transformer blocks L"), ("--hidden", "7168", "width h"),
            ("--heads", "56", "attention heads"), ("--seq-len", "2048", "sequence length S"),
            ("--vocab", "51200", "vocabulary V (GPT-2's 50257 padded)")):
        parser.add_argument(flag, default=default, metavar="N", help=f"{text} (default {default})")
    parser.add_argument("--batch", default="512", metavar="N",
                        help="sequences per training step (default 512, our choice: Singh's thesis does "
                             "not give its batch)")
    parser.add_argument("--devices", default="32", metavar="N",
                        help="GPUs to plan for (default 32)")
    parser.add_argument("--cluster", default=None, metavar="NAME",
                        help=f"price a known cluster's nodes ({', '.join(clusters.names())}; "
                             "jphantom.planner.clusters, every number cited): its GPUs per node and "
                             "package, Infinity Fabric/NVLink, NICs and latency; --device and "
                             "--memory-gib default to its GPU (frontier: mi250x-gcd, 64 GB); the "
                             "network flags override single numbers (default: none, Perlmutter's "
                             "network as below)")
    _add_network_flags(parser)
    parser.add_argument("--memory-gib", default=None, metavar="GIB",
                        help="GPU memory: layouts whose modelled memory exceeds it rank last, "
                             "marked fits=no (default: --device's HBM when one is named, else "
                             "--cluster's GPU's, else no limit; Perlmutter: 40)")
    parser.add_argument("--precision", default="bf16",
                        help="bf16 (2-byte messages, 16 bytes of state per parameter; default) or "
                             "float32")
    parser.add_argument("--ghost-width", default=None, metavar="K",
                        help="phantom's ghost neurons per rank and token (default hidden / 32)")
    parser.add_argument("--accumulate", default="1", metavar="A",
                        help="gradient-accumulation micro-batches (not pipelines; default 1)")
    _add_objective_flags(parser)
    parser.add_argument("--attention-scores", action="store_true",
                        help="count the S x S attention scores in activation memory (no fused "
                             "attention kernel)")
    parser.add_argument("--top", default="10", metavar="N", help="rows to print (default 10)")
    parser.add_argument("--json", action="store_true",
                        help="print JSON: assumptions, top choice and the top rows")
    parser.add_argument("--as-compiled", action="store_true",
                        help="price what jphantom's compiled step moves (float32 gradient "
                             "reductions, pmm3d's backward weight re-gather, the recompute "
                             "forward's collectives) instead of the papers' formulas alone; "
                             "implied by --compile-top")
    parser.add_argument("--compile-top", default=None, metavar="K",
                        help="compile the K best layouts for --target (GPT-2 blocks of this "
                             "shape, float32 master weights with bf16 compute, per-layer "
                             "checkpointing) and re-rank them by compiled memory fit and "
                             "compiled communication (needs pip install 'jphantom[aot]')")
    parser.add_argument("--target", default="gpu:h100",
                        help="the GPU --compile-top compiles for (default gpu:h100)")
    parser.set_defaults(handler=_run)


def _add_network_flags(parser) -> None:
    """The cluster's network: GPUs per node, NICs, NVLink and the per-step latency."""
    parser.add_argument("--gpus-per-node", default=None, metavar="N",
                        help="GPUs per node, G_node (default: --device's, else 4, Perlmutter)")
    parser.add_argument("--inter-node-gbps", default=None, metavar="GB/S",
                        help="beta_inter: GB/s per direction between two nodes, all NICs together "
                             "(default: --device's NICs x their rate x efficiency, else 100 = Perlmutter's 4 "
                             "Slingshot-11 NICs x 25 GB/s)")
    parser.add_argument("--intra-node-gbps", default=None, metavar="GB/S",
                        help="one bandwidth for every collective inside a node (default: with 4 "
                             "GPUs per node Perlmutter's NVLink3 table, 100 GB/s for a pair, 200 "
                             "for 3, 300 for all 4; else 300)")
    parser.add_argument("--latency-us", default=None, metavar="US",
                        help="alpha, microseconds per ring step (default: --device's inter-node latency, "
                             "else 5, assumed)")
    parser.add_argument("--no-latency", action="store_true",
                        help="no alpha terms: Singh's bandwidth-only model exactly")


def _add_objective_flags(parser) -> None:
    """What to rank by, and the GPU that prices compute and energy."""
    parser.add_argument("--device-tflops", default=None, metavar="TF",
                        help="sustained TFLOP/s per GPU, to price compute and a pipeline's "
                             "bubble (default: --device's peak x GEMM efficiency, else "
                             f"{DEFAULT_DEVICE_TFLOPS:g}, the A100's empirical bf16 GEMM peak)")
    parser.add_argument("--objective", default="comm", choices=("comm", "time", "energy",
                                                                "memory"),
                        help="rank by comm (modelled communication + pipeline bubble, Singh's "
                             "model; the default), time (compute + communication + bubble), "
                             "energy (joules per token, Seal et al.'s Eq. 1 with the device's "
                             "busy and idle power; prints the time/energy Pareto front) or "
                             "memory (per GPU)")
    parser.add_argument("--device", default=None, metavar="NAME|FILE",
                        help=f"the GPU (jphantom.predict's descriptions: "
                             f"{', '.join(device_names())}, or a TOML file): its sustained "
                             "GEMM rate, power, GPUs per node, NVLink and NICs price the layouts "
                             "unless the network flags are given (default with --objective "
                             f"time/energy: {DEFAULT_DEVICE})")
