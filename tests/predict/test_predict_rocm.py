"""The simulator on the program shapes XLA's ROCm compiler writes (jax-rocm7 0.12, gfx90a/gfx942):
GEMMs as ``__triton_nested_gemm_fusion`` fusions whose body slices a layer's weights from the
stacked array, hipBLASLt calls under XLA's shared ``__cublas$lt$matmul`` target (a workspace in
the result tuple), replica groups written ``mesh['model'=8] {'model'}``, an asynchronous
reduce-scatter and a synchronous all-gather (ROCm's scheduler leaves some collectives
synchronous). A hand-written snippet with known answers, then the same on ``mi250x-gcd.toml``; and a group
inside one MI250X package priced on its 4 links."""

from __future__ import annotations

import pytest

from jphantom.errors import ConfigError
from jphantom.predict import device as described
from jphantom.predict import load, simulate

M, K, N = 1024, 512, 1024  # rows, the layer's input width, its output width
GEMM_CONFIG = ('{"operation_queue_id":"0","fusion_backend_config":{"kind":'
               '"__triton_nested_gemm_fusion","block_level_fusion_config":{"num_warps":"4",'
               '"output_tiles":[{"sizes":["32","32"]}],"num_ctas":1,"num_stages":1}}}')
LT_CONFIG = ('{"operation_queue_id":"0","gemm_backend_config":{"alpha_real":1,"beta":0,'
             '"dot_dimension_numbers":{"lhs_contracting_dimensions":["1"],'
             '"rhs_contracting_dimensions":["0"],"lhs_batch_dimensions":[],'
             '"rhs_batch_dimensions":[]},"epilogue":"DEFAULT"}}')
ROCM_HLO = f"""HloModule rocm_step, is_scheduled=true

%add (x: f32[], y: f32[]) -> f32[] {{
  %x = f32[] parameter(0)
  %y = f32[] parameter(1)
  ROOT %s = f32[] add(%x, %y)
}}

%fused_computation.gemm_fusion_dot.1_computation (param_0.1: f32[{M},{K}], param_1.1: f32[2,{N},{K}]) -> f32[{M},{N}] {{
  %param_0.1 = f32[{M},{K}]{{1,0}} parameter(0)
  %param_1.1 = f32[2,{N},{K}]{{2,1,0}} parameter(1)
  %slice.1 = f32[1,{N},{K}]{{2,1,0}} slice(%param_1.1), slice={{[1:2], [0:{N}], [0:{K}]}}
  %bitcast.1 = f32[{N},{K}]{{1,0}} bitcast(%slice.1)
  ROOT %dot.1 = f32[{M},{N}]{{1,0}} dot(%param_0.1, %bitcast.1), lhs_contracting_dims={{1}}, rhs_contracting_dims={{1}}
}}

ENTRY %main (x: f32[{M},{K}], w: f32[2,{N},{K}], v: f32[{N},{N}]) -> f32[{M},{N}] {{
  %x = f32[{M},{K}]{{1,0}} parameter(0)
  %w = f32[2,{N},{K}]{{2,1,0}} parameter(1)
  %v = f32[{N},{N}]{{1,0}} parameter(2)
  %gemm_fusion_dot.1 = f32[{M},{N}]{{1,0}} fusion(%x, %w), kind=kCustom, calls=%fused_computation.gemm_fusion_dot.1_computation, backend_config={GEMM_CONFIG}
  %reduce-scatter-start = ((f32[{M},{N}]{{1,0}}), f32[{M},{N // 8}]{{1,0}}) reduce-scatter-start(%gemm_fusion_dot.1), channel_id=1, replica_groups=mesh['model'=8] {{'model'}}, use_global_device_ids=true, dimensions={{1}}, to_apply=%add
  %reduce-scatter-done = f32[{M},{N // 8}]{{1,0}} reduce-scatter-done(%reduce-scatter-start)
  %all_gather.1 = f32[{M},{N}]{{1,0}} all-gather(%reduce-scatter-done), channel_id=2, replica_groups=mesh['model'=8] {{'model'}}, dimensions={{1}}, use_global_device_ids=true
  %custom-call.1 = (f32[{M},{N}]{{1,0}}, s8[4194304]{{0}}) custom-call(%all_gather.1, %v), custom_call_target="__cublas$lt$matmul", backend_config={LT_CONFIG}
  ROOT %get-tuple-element.1 = f32[{M},{N}]{{1,0}} get-tuple-element(%custom-call.1), index=0
}}
"""

# 50 TFLOP/s f32 at 100%, 1000 GB/s HBM, 100 GB/s links, no latency or launch: easy answers
EASY = {
    "name": "easy", "description": "known answers", "vendor": "amd", "device_kinds": ["easy"],
    "compile_target": "",
    "peak_tflops": {"bf16": 100.0, "fp8": 0.0, "f32": 50.0},
    "gemm_efficiency": {"bf16": 1.0, "fp8": 1.0, "f32": 1.0},
    "gemm_shape": {"sm_count": 1, "tile": 1, "k_half": 0},
    "attention_efficiency": {"forward_hd64": 0.5, "forward_hd128": 0.5, "backward_hd64": 0.5,
                             "backward_hd128": 0.5},
    "memory": {"hbm_bytes": 64e9, "hbm_gbps": 1000.0, "stream_efficiency": 1.0},
    "launch": {"kernel_us": 0.0},
    "network": {"gpus_per_node": 8, "intra_node_gbps": 100.0, "intra_node_efficiency": 1.0,
                "intra_latency_us": 0.0, "nics_per_node": 4, "nic_gbps": 25.0,
                "inter_node_efficiency": 1.0, "inter_latency_us": 0.0},
    "power": {"busy_watts": 560.0, "idle_watts": 90.0},
}


def easy_device():
    return described.parse({k: ({n: {"value": x, "source": "assumed", "cite": "test"}
                                 for n, x in v.items()} if isinstance(v, dict) else v)
                            for k, v in EASY.items()}, "test")


def test_rocm_gemms_and_collectives_are_priced_by_their_flops_and_bytes():
    t = simulate(ROCM_HLO, easy_device(), devices=8)
    triton, lt = t.ops["gemm_fusion_dot.1"], t.ops["custom-call.1"]
    assert triton[0] == "gemm" and triton[3] == 2 * M * N * K  # one layer's slice, not both
    assert triton[1] == pytest.approx(2 * M * N * K / 50e12)  # f32: no TF32 on CDNA
    assert lt[0] == "gemm" and lt[3] == 2 * M * N * N  # hipBLASLt, XLA's cuBLAS-LT target
    assert lt[1] == pytest.approx(2 * M * N * N / 50e12)
    wire = 7 * 4 * M * (N // 8)  # the ring: (n - 1) x the result, inside one node
    assert t.ops["reduce-scatter-start"][1] == pytest.approx(wire / 100e9)
    assert t.ops["all_gather.1"][1] == pytest.approx(7 / 8 * 4 * M * N / 100e9)
    # nothing runs under the reduce-scatter and the all-gather blocks: both exposed
    assert t.exposed == pytest.approx(2 * wire / 100e9)
    assert t.step == pytest.approx(t.compute + t.exposed)
    assert t.flops == 2 * M * N * K + 2 * M * N * N
    # bytes: the Triton GEMM reads x and one layer's slice of w and writes its output; the
    # hipBLASLt call reads its two operands and writes its result and workspace
    assert t.nbytes == 4 * (M * K + N * K + M * N) + 4 * (M * N + N * N + M * N) + 4194304


def test_on_the_mi250x_gcd_a_node_ring_runs_on_one_infinity_fabric_link():
    """mi250x-gcd.toml: one 50 GB/s link at 0.8 per ring hop, 1.5 us per step, a 5 us launch;
    f32 GEMMs at the FP32 matrix peak (47.85 TFLOP/s per GCD) times 0.7."""
    gcd = load("mi250x-gcd")
    t = simulate(ROCM_HLO, gcd, devices=8)
    wire = 7 * 4 * M * (N // 8)
    assert t.ops["reduce-scatter-start"][1] == pytest.approx(5e-6 + 7 * 1.5e-6 + wire / 40e9)
    lt = t.ops["custom-call.1"]
    rate = 47.85e12 * 0.7 * gcd.gemm_shape_factor(M * N, N)
    assert lt[1] == pytest.approx(2 * M * N * N / rate + 5e-6)
    across = simulate(ROCM_HLO, gcd, devices=8, node_of=lambda i: i // 2)  # 4 nodes of 2
    assert across.ops["all_gather.1"][1] > t.ops["all_gather.1"][1]  # on the NICs


@pytest.mark.parametrize("groups, gbps", [
    ("{{0,1},{2,3},{4,5},{6,7}}", 200),  # the 2 GCDs of one MI250X: 4 Infinity Fabric links
    ("{{0,2},{1,3},{4,6},{5,7}}", 50),  # GCDs of two packages: one link
])
def test_a_pair_inside_one_mi250x_package_runs_on_its_four_links(groups, gbps):
    nbytes = 4 * M * N
    text = f"""HloModule pairs, is_scheduled=true

%add (x: f32[], y: f32[]) -> f32[] {{
  %x = f32[] parameter(0)
  %y = f32[] parameter(1)
  ROOT %s = f32[] add(%x, %y)
}}

ENTRY %main (x: f32[{M},{N}]) -> f32[{M},{N}] {{
  %x = f32[{M},{N}]{{1,0}} parameter(0)
  ROOT %all-reduce.1 = f32[{M},{N}]{{1,0}} all-reduce(%x), channel_id=1, replica_groups={groups}, use_global_device_ids=true, to_apply=%add
}}
"""
    t = simulate(text, load("mi250x-gcd"), devices=8)
    ring = 2 * 1 / 2 * nbytes / (gbps * 0.8e9) + 2 * 1.5e-6  # 2 (n-1)/n b, 2 (n-1) steps
    assert t.ops["all-reduce.1"][1] == pytest.approx(5e-6 + ring)


@pytest.mark.parametrize("extra, message", [
    ({"gpus_per_package": 2}, "together"),
    ({"gpus_per_package": 3, "in_package_gbps": 200}, "divides gpus_per_node"),
])
def test_package_numbers_come_together_and_divide_the_node(extra, message):
    data = {k: (dict(v) if isinstance(v, dict) else v) for k, v in EASY.items()}
    data["network"] = {**data["network"], **extra}
    sourced = {k: ({n: {"value": x, "source": "assumed", "cite": "test"} for n, x in v.items()}
                   if isinstance(v, dict) else v) for k, v in data.items()}
    with pytest.raises(ConfigError, match=message):
        described.parse(sourced, "bad.toml")
