"""The step-time simulator (jphantom.predict) on hand-built programs with known answers: serial,
overlapped and exposed collectives, loops and nested loops, GEMMs and fused attention by their
FLOPs, in-place and sliced operands by their bytes, groups placed across nodes; and the shipped
device descriptions (every number sourced)."""

from __future__ import annotations

import dataclasses
import math

import pytest

from jphantom.errors import ConfigError
from jphantom.predict import device as described
from jphantom.predict import network as net
from jphantom.predict import predict, simulate

N = 25_000_000  # f32 elements: 100 MB an array

# a device whose numbers make the answers easy: 100 TFLOP/s at 100% efficiency, 1000 GB/s of HBM,
# 100 GB/s links, no latency or launch cost unless a test sets them
PLAIN = {
    "name": "plain", "description": "a device for known answers", "vendor": "nvidia",
    "device_kinds": ["plain"], "compile_target": "",
    "peak_tflops": {"bf16": 100.0, "fp8": 200.0, "f32": 50.0},
    "gemm_efficiency": {"bf16": 1.0, "fp8": 1.0, "f32": 1.0},
    "gemm_shape": {"sm_count": 1, "tile": 1, "k_half": 0},
    "attention_efficiency": {"forward_hd64": 0.5, "forward_hd128": 0.5, "backward_hd64": 0.25,
                             "backward_hd128": 0.25},
    "memory": {"hbm_bytes": 80e9, "hbm_gbps": 1000.0, "stream_efficiency": 1.0},
    "launch": {"kernel_us": 0.0},
    "network": {"gpus_per_node": 8, "intra_node_gbps": 100.0, "intra_node_efficiency": 1.0,
                "intra_latency_us": 0.0, "nics_per_node": 1, "nic_gbps": 10.0,
                "inter_node_efficiency": 1.0, "inter_latency_us": 0.0},
    "power": {"busy_watts": 500.0, "idle_watts": 100.0},
}


def device(**changes):
    data = {k: (dict(v) if isinstance(v, dict) else v) for k, v in PLAIN.items()}
    for key, value in changes.items():
        section, name = key.split("__")
        data[section][name] = value
    sourced = {k: ({n: {"value": x, "source": "assumed", "cite": "test"} for n, x in v.items()}
                   if isinstance(v, dict) else v) for k, v in data.items()}
    return described.parse(sourced, "test")


DEVICE = device()
PLAIN_SOURCED = {k: ({n: {"value": x, "source": "assumed", "cite": "t"} for n, x in v.items()}
                     if isinstance(v, dict) else v) for k, v in PLAIN.items()}
FUSION = f"""
%add_body (p0: f32[{N}], p1: f32[{N}]) -> f32[{N}] {{
  %p0 = f32[{N}]{{0}} parameter(0)
  %p1 = f32[{N}]{{0}} parameter(1)
  ROOT %sum = f32[{N}]{{0}} add(%p0, %p1)
}}
"""
ADD_S = 3 * 4 * N / 1000e9  # two arrays read, one written: 300 MB at 1000 GB/s = 0.3 ms
AR_BYTES = 4 * N  # an all-reduce of one array over 8 GPUs in one node
AR_S = 2 * 7 / 8 * AR_BYTES / 100e9  # the ring: 2 (n-1)/n x bytes / 100 GB/s = 1.75 ms


def module(entry: str, extra: str = "") -> str:
    return f"HloModule test, is_scheduled=true\n{FUSION}{extra}\nENTRY %main () -> f32[{N}] " \
           f"{{\n{entry}\n}}\n"


ARGS = f"""  %a = f32[{N}]{{0}} parameter(0)
  %b = f32[{N}]{{0}} parameter(1)"""
GROUPS = "replica_groups={{0,1,2,3,4,5,6,7}}"


def test_serial_program_adds_compute_and_a_blocking_collective():
    text = module(f"""{ARGS}
  %f = f32[{N}]{{0}} fusion(%a, %b), kind=kLoop, calls=%add_body
  ROOT %ar = f32[{N}]{{0}} all-reduce(%f), channel_id=1, {GROUPS}, to_apply=%add_body""")
    t = simulate(text, DEVICE, devices=8)
    assert t.compute == pytest.approx(ADD_S)
    assert t.comm == pytest.approx(AR_S)
    assert t.exposed == pytest.approx(AR_S)
    assert t.step == pytest.approx(ADD_S + AR_S)


def _async(compute_ops: int) -> str:
    under = "\n".join(f"  %f{i} = f32[{N}]{{0}} fusion(%a, %b), kind=kLoop, calls=%add_body"
                      for i in range(compute_ops))
    return module(f"""{ARGS}
  %s = f32[{N}]{{0}} all-reduce-start(%a), channel_id=1, {GROUPS}, to_apply=%add_body
{under}
  ROOT %d = f32[{N}]{{0}} all-reduce-done(%s)""")


def test_compute_between_start_and_done_hides_the_collective():
    t = simulate(_async(8), DEVICE, devices=8)  # 8 x 0.3 ms of compute over a 1.75 ms collective
    assert t.compute == pytest.approx(8 * ADD_S)
    assert t.exposed == 0
    assert t.hidden == pytest.approx(AR_S)
    assert t.step == pytest.approx(8 * ADD_S)  # overlap ignored would give 8 x 0.3 + 1.75 ms


def test_too_little_compute_under_the_collective_leaves_the_rest_exposed():
    t = simulate(_async(2), DEVICE, devices=8)
    assert t.exposed == pytest.approx(AR_S - 2 * ADD_S)
    assert t.hidden == pytest.approx(2 * ADD_S)
    assert t.step == pytest.approx(AR_S)


def test_collectives_share_one_stream():
    text = module(f"""{ARGS}
  %s1 = f32[{N}]{{0}} all-reduce-start(%a), channel_id=1, {GROUPS}, to_apply=%add_body
  %s2 = f32[{N}]{{0}} all-reduce-start(%b), channel_id=2, {GROUPS}, to_apply=%add_body
  %f = f32[{N}]{{0}} fusion(%a, %b), kind=kLoop, calls=%add_body
  %d1 = f32[{N}]{{0}} all-reduce-done(%s1)
  ROOT %d2 = f32[{N}]{{0}} all-reduce-done(%s2)""")
    t = simulate(text, DEVICE, devices=8)
    assert t.step == pytest.approx(2 * AR_S)  # one after the other, not side by side


LOOP = """
%cond{tag} (c: (s32[], f32[{n}])) -> pred[] {{
  %c = (s32[], f32[{n}]{{0}}) parameter(0)
  %i = s32[] get-tuple-element(%c), index=0
  %limit = s32[] constant({trips})
  ROOT %lt = pred[] compare(%i, %limit), direction=LT
}}

%body{tag} (c: (s32[], f32[{n}])) -> (s32[], f32[{n}]) {{
  %c = (s32[], f32[{n}]{{0}}) parameter(0)
  %i = s32[] get-tuple-element(%c), index=0
  %x = f32[{n}]{{0}} get-tuple-element(%c), index=1
{inner}
  %one = s32[] constant(1)
  %next = s32[] add(%i, %one)
  ROOT %out = (s32[], f32[{n}]{{0}}) tuple(%next, %y)
}}
"""


def _loop(tag: str, trips: int, inner: str) -> str:
    return LOOP.format(tag=tag, n=N, trips=trips, inner=inner)


def _while(tag: str, trips: int, known: bool = True) -> str:
    config = (f', backend_config={{"known_trip_count":{{"n":"{trips}"}}}}' if known else "")
    return (f"  %t{tag} = (s32[], f32[{N}]{{0}}) tuple(%zero, %a)\n"
            f"  %w{tag} = (s32[], f32[{N}]{{0}}) while(%t{tag}), condition=%cond{tag}, "
            f"body=%body{tag}{config}")


SCALAR_ADD_S = 3 * 4 / 1000e9  # the loop counter's add: 12 bytes
CONDITION_S = (4 + 4 + 1) / 1000e9  # the compare: two s32 read, a pred written


@pytest.mark.parametrize("known", [True, False])
def test_a_loop_runs_its_body_trip_count_times(known):
    body = _loop("", 5, f"  %y = f32[{N}]{{0}} fusion(%x, %x), kind=kLoop, calls=%add_body")
    text = module(f"""{ARGS}
  %zero = s32[] constant(0)
{_while('', 5, known)}
  ROOT %r = f32[{N}]{{0}} get-tuple-element(%w), index=1""", body)
    t = simulate(text, DEVICE)
    assert t.compute == pytest.approx(5 * (ADD_S + SCALAR_ADD_S) + 6 * CONDITION_S)
    assert t.step == pytest.approx(t.compute)


def test_nested_loops_multiply_their_trip_counts():
    inner = _loop("_in", 4, f"  %y = f32[{N}]{{0}} fusion(%x, %x), kind=kLoop, calls=%add_body")
    outer = _loop("_out", 3, f"""  %zero = s32[] constant(0)
  %ta = (s32[], f32[{N}]{{0}}) tuple(%zero, %x)
  %win = (s32[], f32[{N}]{{0}}) while(%ta), condition=%cond_in, body=%body_in, backend_config={{"known_trip_count":{{"n":"4"}}}}
  %y = f32[{N}]{{0}} get-tuple-element(%win), index=1""")
    text = module(f"""{ARGS}
  %zero = s32[] constant(0)
{_while('_out', 3)}
  ROOT %r = f32[{N}]{{0}} get-tuple-element(%w_out), index=1""", inner + outer)
    t = simulate(text, DEVICE)
    adds = 3 * 4 * ADD_S
    assert t.flops == 0
    assert t.compute == pytest.approx(adds, rel=1e-6)  # scalar ops are ~1e-11 s
    assert t.ops["y"] == pytest.approx(["memory", 12 * ADD_S, 12, 0.0, ""])  # 12 runs


def test_a_collective_inside_a_loop_overlaps_the_compute_after_its_start():
    body = _loop("", 4, f"""  %s = f32[{N}]{{0}} all-reduce-start(%x), channel_id=1, {GROUPS}, to_apply=%add_body
  %f1 = f32[{N}]{{0}} fusion(%x, %x), kind=kLoop, calls=%add_body
  %f2 = f32[{N}]{{0}} fusion(%f1, %x), kind=kLoop, calls=%add_body
  %y = f32[{N}]{{0}} all-reduce-done(%s)""")
    text = module(f"""{ARGS}
  %zero = s32[] constant(0)
{_while('', 4)}
  ROOT %r = f32[{N}]{{0}} get-tuple-element(%w), index=1""", body)
    t = simulate(text, DEVICE, devices=8)
    assert t.comm == pytest.approx(4 * AR_S)
    assert t.exposed == pytest.approx(4 * (AR_S - 2 * ADD_S), rel=1e-6)
    assert t.hidden == pytest.approx(4 * 2 * ADD_S, rel=1e-6)


def test_a_gemm_is_priced_by_its_flops_and_an_attention_call_by_its_efficiency():
    m, k, n = 4096, 8192, 2048
    gemm = f"""
%gemm_body (p0: bf16[{m},{k}], p1: bf16[{k},{n}]) -> bf16[{m},{n}] {{
  %p0 = bf16[{m},{k}]{{1,0}} parameter(0)
  %p1 = bf16[{k},{n}]{{1,0}} parameter(1)
  ROOT %dot = bf16[{m},{n}]{{1,0}} dot(%p0, %p1), lhs_contracting_dims={{1}}, rhs_contracting_dims={{0}}
}}
"""
    config = ('{"cudnn_fmha_backend_config":{"mask_type":"CAUSAL","bmm1_dot_dimension_numbers":'
              '{"lhs_contracting_dimensions":["3"],"rhs_contracting_dimensions":["3"],'
              '"lhs_batch_dimensions":["0","2"],"rhs_batch_dimensions":["0","2"]}}}')
    text = f"""HloModule g, is_scheduled=true
{gemm}
ENTRY %main () -> bf16[{m},{n}] {{
  %x = bf16[{m},{k}]{{1,0}} parameter(0)
  %w = bf16[{k},{n}]{{1,0}} parameter(1)
  %q = bf16[2,1024,8,128]{{3,2,1,0}} parameter(2)
  %att = (bf16[2,8,1024,128]{{3,2,1,0}}, f32[2,8,1024]{{2,1,0}}) custom-call(%q, %q, %q), custom_call_target="__cudnn$fmhaSoftmax", backend_config={config}
  %bwd = (bf16[2,1024,8,128]{{3,2,1,0}}) custom-call(%q, %q, %q), custom_call_target="__cudnn$fmhaSoftmaxBackward", backend_config={config}
  ROOT %g = bf16[{m},{n}]{{1,0}} fusion(%x, %w), kind=kCustom, calls=%gemm_body, backend_config={{"fusion_backend_config":{{"kind":"__triton_gemm"}}}}
}}
"""
    t = simulate(text, DEVICE)
    gemm_flops = 2 * m * n * k
    attention = 4 * 2 * 8 * 1024 * 1024 * 128 / 2  # causal forward
    assert t.ops["g"][0] == "gemm" and t.ops["g"][3] == gemm_flops
    assert t.ops["g"][1] == pytest.approx(gemm_flops / 100e12)
    assert t.ops["att"][3] == attention
    assert t.ops["att"][1] == pytest.approx(attention / (0.5 * 100e12))
    assert t.ops["bwd"][3] == 2.5 * attention
    assert t.ops["bwd"][1] == pytest.approx(2.5 * attention / (0.25 * 100e12))
    assert t.flops == gemm_flops + 3.5 * attention


def test_a_pallas_flash_block_is_priced_as_attention_by_its_shapes():
    """jphantom.nn.flash's ring blocks (Triton custom calls named in their op_name) cost their
    attention FLOPs at the attention efficiency, as a cuDNN call of the same shapes does: half
    under a causal mask, 2.5x backward; any other Triton kernel by its bytes."""
    call = ('custom-call(%q, %k, %k), custom_call_target="__gpu$xla.gpu.triton", '
            'metadata={{op_name="jit(step)/shard_map/{}/pallas_call"}}')
    text = f"""HloModule f, is_scheduled=true

ENTRY %main () -> bf16[2,1024,8,128] {{
  %q = bf16[2,1024,8,128]{{3,2,1,0}} parameter(0)
  %k = bf16[2,512,8,128]{{3,2,1,0}} parameter(1)
  %full = (bf16[2,1024,8,128]{{3,2,1,0}}, f32[2,8,1024]{{2,1,0}}) {call.format("ring_block_forward")}
  %diag = (bf16[2,1024,8,128]{{3,2,1,0}}, f32[2,8,1024]{{2,1,0}}) {call.format("cond/branch_0_fun/ring_block_forward_causal")}
  %bwd = (bf16[2,1024,8,128]{{3,2,1,0}}, bf16[2,512,8,128]{{3,2,1,0}}) {call.format("transpose(jvp())/ring_block_backward_causal")}
  %wrapped = (bf16[2,1024,8,128]{{3,2,1,0}}, bf16[2,512,8,128]{{3,2,1,0}}) {call.format("transpose(jvp(ring_block_backward_causal))")}
  ROOT %other = bf16[2,1024,8,128]{{3,2,1,0}} {call.format("some_kernel")}
}}
"""
    t = simulate(text, DEVICE)
    full = 4 * 2 * 8 * 1024 * 512 * 128
    assert t.ops["full"][0] == "attention" and t.ops["full"][3] == full
    assert t.ops["full"][1] == pytest.approx(full / (0.5 * 100e12), rel=1e-3)
    assert t.ops["diag"][3] == full / 2
    assert t.ops["bwd"][3] == 2.5 * full / 2
    assert t.ops["bwd"][1] == pytest.approx(2.5 * full / 2 / (0.25 * 100e12), rel=1e-3)
    # the name inside a transformation's parentheses (jphantom.nn.sink's per-layer jax.vjp)
    assert t.ops["wrapped"][:4] == t.ops["bwd"][:4]
    assert t.ops["other"][0] == "memory" and t.ops["other"][3] == 0


def test_sliced_operands_cost_their_slice_and_in_place_updates_their_update():
    layers = 16
    extra = f"""
%slice_body (p0: f32[{layers},{N // layers}], p1: s32[]) -> f32[1,{N // layers}] {{
  %p0 = f32[{layers},{N // layers}]{{1,0}} parameter(0)
  %p1 = s32[] parameter(1)
  %z = s32[] constant(0)
  ROOT %ds = f32[1,{N // layers}]{{1,0}} dynamic-slice(%p0, %p1, %z), dynamic_slice_sizes={{1,{N // layers}}}
}}

%update_body (p0: f32[{layers},{N // layers}], p1: f32[1,{N // layers}], p2: s32[]) -> f32[{layers},{N // layers}] {{
  %p0 = f32[{layers},{N // layers}]{{1,0}} parameter(0)
  %p1 = f32[1,{N // layers}]{{1,0}} parameter(1)
  %p2 = s32[] parameter(2)
  %z = s32[] constant(0)
  ROOT %dus = f32[{layers},{N // layers}]{{1,0}} dynamic-update-slice(%p0, %p1, %p2, %z)
}}
"""
    text = f"""HloModule s, is_scheduled=true
{extra}
ENTRY %main () -> f32[{layers},{N // layers}] {{
  %stack = f32[{layers},{N // layers}]{{1,0}} parameter(0)
  %i = s32[] parameter(1)
  %one = f32[1,{N // layers}]{{1,0}} fusion(%stack, %i), kind=kLoop, calls=%slice_body
  ROOT %back = f32[{layers},{N // layers}]{{1,0}} fusion(%stack, %one, %i), kind=kLoop, calls=%update_body
}}
"""
    t = simulate(text, DEVICE)
    layer = 4 * N // layers
    assert t.ops["one"][1] == pytest.approx((layer + 4 + layer) / 1000e9)  # slice + index + out
    assert t.ops["back"][1] == pytest.approx((layer + 4 + layer) / 1000e9)  # update in, update out
    assert t.nbytes == pytest.approx(2 * (2 * layer + 4))


def test_an_asynchronous_fusion_is_priced_once_as_its_body():
    """XLA:GPU (jax 0.11's, on an H200) runs a scan's dynamic-slice and dynamic-update-slice
    fusions as ``fusion-start`` ... ``fusion-done``: the start costs what the same ``fusion``
    costs (the slice, the update), the done nothing. Priced as plain ops they read the whole
    stacked buffer twice and put the validation set at +200-400% (benchmarks/gpu_predict.py)."""
    layers, width = 16, N // 16
    text = f"""HloModule a, is_scheduled=true

%update_body (p0: f32[{layers},{width}], p1: f32[1,{width}], p2: s32[]) -> f32[{layers},{width}] {{
  %p0 = f32[{layers},{width}]{{1,0}} parameter(0)
  %p1 = f32[1,{width}]{{1,0}} parameter(1)
  %p2 = s32[] parameter(2)
  %z = s32[] constant(0)
  ROOT %dus = f32[{layers},{width}]{{1,0}} dynamic-update-slice(%p0, %p1, %p2, %z)
}}

%slice_body (p0: f32[{layers},{width}], p1: s32[]) -> f32[1,{width}] {{
  %p0 = f32[{layers},{width}]{{1,0}} parameter(0)
  %p1 = s32[] parameter(1)
  %z = s32[] constant(0)
  ROOT %ds = f32[1,{width}]{{1,0}} dynamic-slice(%p0, %p1, %z), dynamic_slice_sizes={{1,{width}}}
}}

ENTRY %main () -> f32[{layers},{width}] {{
  %stack = f32[{layers},{width}]{{1,0}} parameter(0)
  %row = f32[1,{width}]{{1,0}} parameter(1)
  %i = s32[] parameter(2)
  %ss = ((f32[{layers},{width}]{{1,0}}, s32[]), f32[1,{width}]{{1,0}}, u32[]) fusion-start(%stack, %i), kind=kLoop, calls=%slice_body
  %sd = f32[1,{width}]{{1,0}} fusion-done(%ss)
  %us = ((f32[{layers},{width}]{{1,0}}, f32[1,{width}]{{1,0}}, s32[]), f32[{layers},{width}]{{1,0}}, u32[]) fusion-start(%stack, %row, %i), kind=kLoop, calls=%update_body
  ROOT %ud = f32[{layers},{width}]{{1,0}} fusion-done(%us)
}}
"""
    t = simulate(text, DEVICE)
    row = 4 * width
    assert t.ops["ss"][0] == "memory" and t.ops["us"][0] == "memory"
    assert t.ops["ss"][1] == pytest.approx((row + 4 + row) / 1000e9)  # slice + index + out
    assert t.ops["us"][1] == pytest.approx((row + 4 + row) / 1000e9)  # update in, update out
    assert "sd" not in t.ops and "ud" not in t.ops
    assert t.nbytes == pytest.approx(2 * (2 * row + 4))


def test_an_uninitialised_buffer_costs_nothing_and_a_zero_broadcast_its_write():
    """``AllocateBuffer`` (what XLA's dus_accumulator_zero_init_elimination puts where a scan's
    stacked outputs started from zeros, jphantom.runtime.gpu_defaults) launches no kernel; the
    zero broadcast it replaces writes its bytes."""
    text = module(f"""  %zero = f32[] constant(0)
  %z = f32[{N}]{{0}} broadcast(%zero), dimensions={{}}
  ROOT %e = f32[{N}]{{0}} custom-call(), custom_call_target="AllocateBuffer"
""")
    t = simulate(text, DEVICE)
    assert "e" not in t.ops
    assert t.ops["z"][1] == pytest.approx(4 * N / 1000e9)


def test_groups_across_nodes_are_priced_on_the_nics():
    nodes = device()
    inside = net.GroupPlacement(8, 1)
    across = net.GroupPlacement(8, 8)  # one GPU on each of 8 nodes: one NIC of 10 GB/s each
    network = net.Network.of(nodes)
    b = 1e9
    assert network.seconds("all-gather", b, inside) == pytest.approx(7 / 8 * b / 100e9)
    assert network.seconds("all-gather", b, across) == pytest.approx(7 / 8 * b / (10e9 / 8))
    assert network.seconds("reduce-scatter", b, inside) == pytest.approx(7 * b / 100e9)
    assert network.seconds("collective-permute", b, across) == pytest.approx(b / (10e9 / 8))
    assert network.seconds("all-reduce", b, net.GroupPlacement(1, 1)) == 0
    groups = [[0, 8], [1, 9]]
    assert net.placement(groups, lambda i: i // 8) == net.GroupPlacement(2, 2)
    # with latency, a small all-reduce across many nodes takes NCCL's tree when it is faster
    slow = device(network__inter_latency_us=10.0)
    wide = net.GroupPlacement(64, 64)
    ring = 2 * 63 / 64 * 1e3 / (10e9 / 8) + 2 * 63 * 10e-6
    tree = 2 * math.log2(64) * 10e-6 + 2 * 1e3 / (10e9 / 8)
    assert net.Network.of(slow).seconds("all-reduce", 1e3, wide) == pytest.approx(min(ring, tree))
    assert tree < ring


def test_prediction_reports_throughput_mfu_and_eq1_energy():
    p = predict(_async(2), DEVICE, devices=8, tokens_per_step=8000, model_flops_per_step=1e9,
                peak_memory_bytes=1e9)
    assert p.step_s == pytest.approx(AR_S)
    assert p.tokens_per_second_per_gpu == pytest.approx(8000 / AR_S / 8)
    assert p.mfu == pytest.approx(1e9 / AR_S / 100e12)
    busy, idle = 2 * ADD_S, AR_S - 2 * ADD_S  # Eq. 1: A while computing, B while waiting
    assert p.joules_per_step == pytest.approx(8 * (500 * busy + 100 * idle))
    assert p.joules_per_token == pytest.approx(p.joules_per_step / 8000)
    assert p.fits is True


def test_energy_is_printed_with_its_significant_figures_never_as_zero():
    """A small model's joules per token are micro- or millijoules: printed in that unit, not as
    0.000 J; the plan's tables keep three significant figures below 0.01 J."""
    from jphantom.planner.report import per_token
    from jphantom.predict.report import format_prediction, joules_text

    assert [joules_text(j) for j in (2.5e-5, 0.0729, 12.345, 1234.5, 0.0)] == [
        "25 \u00b5J", "72.9 mJ", "12.3 J", "1,234 J", "0 J"]
    assert [per_token(j) for j in (0.1851, 0.00729, 2.5e-5)] == ["0.1851", "0.00729", "2.5e-05"]
    p = predict(_async(2), DEVICE, devices=8, tokens_per_step=8_000)
    text = format_prediction(p)
    assert f"{joules_text(p.joules_per_token)} per token" in text and "0.000 J" not in text
    assert p.joules_per_token < 1e-3 and "\u00b5J per token" in text


def test_shipped_device_descriptions_cite_every_number():
    shipped = described.names()
    assert {"h100-sxm", "h200", "a100-sxm", "b200", "mi250x-gcd", "mi300x"} <= set(shipped)
    for name in shipped:
        d = described.load(name)
        for section in d.numbers.values():
            for q in section.values():
                assert q.source in described.SOURCES and q.cite.strip()
        assert d.peak_flops("bf16") > 0 and d["power.busy_watts"] > d["power.idle_watts"]
    assert described.for_target("gpu:h100").name == "h100-sxm"
    assert described.for_target("gpu:h200").name == "h200"
    assert described.for_kind("NVIDIA H100 80GB HBM3").name == "h100-sxm"
    h200 = described.load("h200")
    assert h200.numbers["gemm_efficiency"]["bf16"].source == "measured"


def test_every_shipped_description_says_whose_gemm_rates_it_prices_at():
    """The A100 took cuBLAS's rate (0.81) where the H100 and H200 take jax's (0.78, measured on
    an H200); its rate is jax's too, derived (cuBLAS's A100 fraction x jax's / cuBLAS's on GH100)
    and said so, and every description names whose GEMMs its efficiencies measure."""
    for name in described.names():
        assert described.load(name).gemm_rates not in ("", "not stated"), name
    for name in ("a100-sxm", "h100-sxm", "h200"):
        assert described.load(name).gemm_rates.startswith("jax/XLA"), name
    a100 = described.load("a100-sxm").numbers["gemm_efficiency"]["bf16"]
    assert a100.value == round(253.7 / 312 * (774.3 / 797.51), 3) == 0.789
    assert a100.source == "assumed" and "(253.7 / 312) x (774.3 / 797.51)" in a100.cite
    assert described.parse({**PLAIN_SOURCED}, "mine.toml").gemm_rates == "not stated"


def test_a_prediction_prints_its_gemm_rates_and_its_device_s_measured_error(tmp_path):
    from jphantom.predict.report import format_prediction
    from jphantom.predict.validation import RECORD, error_band

    assert RECORD.is_file()  # the source checkout's record
    assert error_band("h200", "bf16") == ("measured error on h200 (predict_validation.json): "
                                          "step time -2.3% (bf16) against NVIDIA H200's "
                                          "measured step")
    assert "over 3 published fp8 runs" in error_band("h100-sxm", "fp8")
    assert "none on record for a100-sxm" in error_band("a100-sxm", "bf16")
    assert "no validation record here" in error_band("h200", "bf16", tmp_path / "none.json")
    p = predict(_async(2), described.load("h200"), devices=8, tokens_per_step=8000)
    text = format_prediction(dataclasses.replace(p, measured_error=error_band("h200", "bf16")))
    assert f"GEMM rates: {described.load('h200').gemm_rates}" in text
    assert "step time -2.3% (bf16)" in text


@pytest.mark.parametrize("bad, message", [
    ({"memory": {"hbm_gbps": {"value": 1.0, "source": "guessed", "cite": "x"}}}, "source"),
    ({"gemm_efficiency": {"bf16": {"value": 1.5, "source": "assumed", "cite": "x"}}},
     "fraction"),
    ({"launch": {}}, "lacks kernel_us"),
    ({"network": {"gpus_per_node": {"value": 0, "source": "assumed", "cite": "x"}}},
     r"bad.toml \[network\] gpus_per_node = 0: a whole number >= 1"),
    ({"network": {"nics_per_node": {"value": 1.5, "source": "assumed", "cite": "x"}}},
     r"\[network\] nics_per_node = 1.5: a whole number"),
    ({"network": {"inter_node_efficiency": {"value": 0, "source": "assumed", "cite": "x"}}},
     r"\[network\] inter_node_efficiency = 0: a fraction"),
    ({"memory": {"hbm_bytes": {"value": 0, "source": "assumed", "cite": "x"}}},
     r"\[memory\] hbm_bytes = 0: must be > 0"),
])
def test_a_bad_description_is_refused_by_name(bad, message):
    data = {k: ({n: {"value": x, "source": "assumed", "cite": "t"} for n, x in v.items()}
                if isinstance(v, dict) else v) for k, v in PLAIN.items()}
    for section, table in bad.items():
        data[section] = {**data[section], **table} if table else {}
    with pytest.raises(ConfigError, match=message):
        described.parse(data, "bad.toml")
    with pytest.raises(ConfigError, match="known devices"):
        described.load("no-such-gpu")


def test_plan_and_compile_predict_refuse_a_description_by_the_same_rule(tmp_path, capsys):
    """gpus_per_node = 0 was accepted by compile --predict and refused by plan blaming a
    --gpus-per-node never given; a folder was "no such file". One validator (device.parse), one
    line naming the file and the field, before anything is compiled."""
    from helpers import exit_code

    text = described._shipped().joinpath("h100-sxm.toml").read_text()
    zero = tmp_path / "zero.toml"
    zero.write_text(text.replace("gpus_per_node = { value = 8,", "gpus_per_node = { value = 0,"))
    line = f"jphantom: error: {zero} [network] gpus_per_node = 0: a whole number >= 1"
    for argv in (["plan", "--objective", "time", "--device", str(zero)],
                 ["compile", "--target", "gpu:h100", "--predict", "--device", str(zero)]):
        assert exit_code(argv) == 2
        assert capsys.readouterr().err.strip().splitlines() == [line]
    assert exit_code(["plan", "--objective", "time", "--device", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"jphantom: error: --device {tmp_path} is a folder: give a device "
                          "description TOML file in it (zero.toml)") and "\n" not in err


def test_fp8_is_not_priced_on_a_device_without_fp8_gemms(capsys):
    """compile --precision fp8 --predict --device a100-sxm priced 30 FP8 GEMMs on a device with
    no FP8 units and said nothing; now one line before anything is compiled."""
    from helpers import exit_code

    a100 = described.load("a100-sxm")
    assert not a100.has_fp8 and described.load("h100-sxm").has_fp8
    a100.check_precision("bf16")
    argv = ["compile", "--target", "gpu:h100", "--precision", "fp8", "--predict"]
    assert exit_code([*argv, "--device", "a100-sxm"]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        "jphantom: error: --precision fp8 on a100-sxm (a100-sxm.toml): it has no FP8 GEMMs "
        "([peak_tflops] fp8 = 0), so the program's FP8 GEMMs have no rate there: predict on a "
        "device with them (b200, h100-sxm, h200, mi300x) or use --precision bf16"]
    described.load("h200").check_precision("fp8")  # a device with FP8 GEMMs prices them


# --------------------------------------------------------------------------------------------------
# the planner's objectives (jphantom plan --objective time|energy|memory)
# --------------------------------------------------------------------------------------------------


def _plan(objective):
    from jphantom.perf import axonn_model as ax
    from jphantom.planner import plan

    shape = ax.GPTShape(layers=4, hidden=256, heads=8, seq_len=128, vocab_size=1024)
    return plan(shape, 16, batch=64, memory_gib=80, objective=objective,
                device=described.load("h100-sxm"))


def test_plan_objectives_rank_by_step_time_joules_and_memory():
    h100 = described.load("h100-sxm")
    timed = _plan("time")
    rate = h100.peak_flops("bf16") * h100["gemm_efficiency.bf16"]
    for row in timed:
        assert row.compute_s == pytest.approx(row.flops_per_device / rate)
        assert row.step_s == pytest.approx(row.compute_s + row.comm_s + row.bubble_s)
        busy, idle = h100["power.busy_watts"], h100["power.idle_watts"]
        joules = 16 * (busy * row.compute_s + idle * (row.comm_s + row.bubble_s))
        assert row.joules_per_token == pytest.approx(joules / (64 * 128))
    fitting = [r for r in timed if r.fits]
    assert [r.step_s for r in fitting] == sorted(r.step_s for r in fitting)
    energy = _plan("energy")
    fitting = [r for r in energy if r.fits]
    assert [r.joules_per_token for r in fitting] == sorted(r.joules_per_token for r in fitting)
    front = energy.pareto()
    assert front and all(r.same_model for r in front)
    for r in front:  # nothing that fits beats a front row on both
        assert not any(o.step_s < r.step_s and o.joules_per_token < r.joules_per_token
                       for o in energy if o.same_model and o.fits)
    memory = [r for r in _plan("memory") if r.fits]
    assert [r.memory["total"] for r in memory] == sorted(r.memory["total"] for r in memory)
    with pytest.raises(ConfigError, match="objective='speed'"):
        _plan("speed")


def test_plan_cli_energy_prints_time_joules_and_the_pareto_front(capsys):
    from helpers import exit_code

    argv = ["plan", "--model", "llama", "--layers", "4", "--hidden", "256", "--heads", "8",
            "--kv-heads", "4", "--seq-len", "128", "--vocab", "1024", "--batch", "64",
            "--devices", "16", "--device", "h100-sxm", "--objective", "energy", "--top", "5"]
    assert exit_code(argv) == 0
    out = capsys.readouterr().out
    assert "step s  J/token" in out and "Pareto front" in out
    assert "2 node(s) x 8" in out and "A = 700 W busy" in out
    assert exit_code(argv[:-6] + ["--objective", "fast"]) == 2
    assert exit_code(argv[:-4] + ["--device", "tpu-v9"]) == 2
    assert "known devices are" in capsys.readouterr().err


def test_compile_predict_refuses_before_compiling(capsys):
    from helpers import exit_code

    assert exit_code(["compile", "--target", "tpu:v5p:2x2x2", "--predict"]) == 2
    assert "--predict prices GPU programs" in capsys.readouterr().err
    assert exit_code(["compile", "--device", "no-such.toml", "--predict"]) == 2
    assert "no such file" in capsys.readouterr().err


def test_a_slice_seen_through_a_bitcast_costs_the_slice():
    layers, width = 8, N // 8
    text = f"""HloModule b, is_scheduled=true

%body (p0: f32[{layers},{width}], p1: s32[]) -> f32[1,{width}] {{
  %p0 = f32[{layers},{width}]{{1,0}} parameter(0)
  %view = f32[{width},{layers}]{{0,1}} bitcast(%p0)
  %p1 = s32[] parameter(1)
  %z = s32[] constant(0)
  %ds = f32[{width},1]{{0,1}} dynamic-slice(%view, %z, %p1), dynamic_slice_sizes={{{width},1}}
  ROOT %out = f32[1,{width}]{{1,0}} bitcast(%ds)
}}

ENTRY %main () -> f32[1,{width}] {{
  %stack = f32[{layers},{width}]{{1,0}} parameter(0)
  %i = s32[] parameter(1)
  ROOT %one = f32[1,{width}]{{1,0}} fusion(%stack, %i), kind=kLoop, calls=%body
}}
"""
    t = simulate(text, DEVICE)
    assert t.nbytes == 4 * width + 4 + 4 * width  # one layer read, the index, one layer written


def test_an_in_place_update_of_a_bitcast_buffer_costs_the_update():
    layers, width = 8, N // 8
    text = f"""HloModule u, is_scheduled=true

%body (p0: f32[1,{width}], p1: s32[], p2: f32[{layers},{width}]) -> f32[{width},{layers}] {{
  %p2 = f32[{layers},{width}]{{1,0}} parameter(2)
  %view = f32[{width},{layers}]{{0,1}} bitcast(%p2)
  %p0 = f32[1,{width}]{{1,0}} parameter(0)
  %col = f32[{width},1]{{0,1}} bitcast(%p0)
  %p1 = s32[] parameter(1)
  %z = s32[] constant(0)
  ROOT %dus = f32[{width},{layers}]{{0,1}} dynamic-update-slice(%view, %col, %z, %p1)
}}

ENTRY %main () -> f32[{width},{layers}] {{
  %stack = f32[{layers},{width}]{{1,0}} parameter(0)
  %row = f32[1,{width}]{{1,0}} parameter(1)
  %i = s32[] parameter(2)
  ROOT %back = f32[{width},{layers}]{{0,1}} fusion(%row, %i, %stack), kind=kLoop, calls=%body
}}
"""
    assert simulate(text, DEVICE).nbytes == 4 * width + 4 + 4 * width  # update in, index, out


def test_the_calibration_gemm_runs_at_the_measured_efficiency_and_small_ones_slower():
    d = device(gemm_shape__sm_count=132, gemm_shape__tile=128, gemm_shape__k_half=256,
               gemm_efficiency__bf16=0.64)
    n = 8192
    flops = 2.0 * n**3
    assert d.gemm_seconds(flops, 0, "bf16", n * n, n) == pytest.approx(flops / (0.64 * 100e12))
    assert d.gemm_shape_factor(n * n, 8192) == pytest.approx(1.0)
    assert d.gemm_shape_factor(n * n, 512) < 0.7  # short K: the tile's fixed costs
    # 133 tiles on 132 SMs: a second wave for one tile, half the device idle in it
    assert d.gemm_shape_factor(133 * 128 * 128, 8192) == pytest.approx(
        (133 / 264) / (4096 / (32 * 132)))


def _branch(name: str, adds: int) -> str:
    chain = "\n".join(f"  %y{i} = f32[{N}]{{0}} fusion(%{'x' if i == 0 else f'y{i - 1}'}, %x), "
                      "kind=kLoop, calls=%add_body" for i in range(adds))
    return (f"\n%{name} (x: f32[{N}]) -> f32[{N}] {{\n  %x = f32[{N}]{{0}} parameter(0)\n"
            f"{chain}\n  ROOT %r = f32[{N}]{{0}} copy(%y{adds - 1})\n}}\n")


@pytest.mark.parametrize("scope, true_share", [("", None), ("taken_in_1_of_4_ticks/", 0.25),
                                               ("taken_in_0_of_19_ticks/", 0.0)])
def test_a_conditional_takes_its_slowest_branch_unless_its_scope_names_how_often(scope,
                                                                                  true_share):
    """A ``conditional`` is priced at its slowest branch; under the pipeline executor's scope
    ``taken_in_<n>_of_<t>_ticks`` (jphantom.pipeline.runner._Step.taken) at its true branch n/t
    of the time and its false branch the rest (lax.cond's branch_computations: false, true)."""
    text = module(f"""{ARGS}
  %p = s32[] parameter(2)
  ROOT %c = f32[{N}]{{0}} conditional(%p, %a, %a), branch_computations={{%no, %yes}}, \
metadata={{op_name="jit(step)/while/body/{scope}cond"}}""", _branch("no", 1) + _branch("yes", 4))
    t = simulate(text, DEVICE)
    copy_s = 2 * 4 * N / 1000e9
    slow, fast = 4 * ADD_S + copy_s, ADD_S + copy_s
    expected = slow if true_share is None else true_share * slow + (1 - true_share) * fast
    assert t.compute == pytest.approx(expected, rel=1e-6)


def test_a_loop_of_at_most_one_trip_runs_its_body_at_its_scope_s_share():
    """A ``while`` of zero or one trips named ``taken_in_<n>_of_<t>_ticks/while`` (the pipeline
    executor's head and embedding: jphantom.pipeline.runner.at_most_once) runs its body in n of
    its loop's t trips: priced at n / t of the body, not once per trip."""
    loop = f"""
%body (s: (s32[], f32[{N}])) -> (s32[], f32[{N}]) {{
  %s = (s32[], f32[{N}]{{0}}) parameter(0)
  %i = s32[] get-tuple-element(%s), index=0
  %x = f32[{N}]{{0}} get-tuple-element(%s), index=1
  %y = f32[{N}]{{0}} fusion(%x, %x), kind=kLoop, calls=%add_body
  ROOT %r = (s32[], f32[{N}]{{0}}) tuple(%i, %y)
}}

%stop (c: (s32[], f32[{N}])) -> pred[] {{
  %c = (s32[], f32[{N}]{{0}}) parameter(0)
  %ci = s32[] get-tuple-element(%c), index=0
  ROOT %lt = pred[] compare(%ci, %ci), direction=LT
}}
"""
    text = module(f"""{ARGS}
  %p = s32[] parameter(2)
  %init = (s32[], f32[{N}]{{0}}) tuple(%p, %a)
  %w = (s32[], f32[{N}]{{0}}) while(%init), condition=%stop, body=%body, \
metadata={{op_name="jit(step)/while/body/on_head_taken_in_1_of_4_ticks/while"}}
  ROOT %out = f32[{N}]{{0}} get-tuple-element(%w), index=1""", loop)
    assert simulate(text, DEVICE).compute == pytest.approx(0.25 * ADD_S, rel=1e-6)
