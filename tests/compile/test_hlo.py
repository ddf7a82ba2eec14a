"""The compiled training step moves exactly the bytes the papers' formulas predict: no more, no less.

Each test compiles forward + backward + SGD update of the FFN's module step (one ``jax.jit`` of
one ``shard_map``, layers under ``lax.scan``), parses every collective out of the optimized HLO,
counting each as many times as its loop runs, and compares the per-device result buffers (kind,
element count, bytes) with the formula written here from the papers (and in the layers'
docstrings), plus the one scalar all-reduce of the MSE loss.
"""

import functools
from collections import defaultdict

import numpy as np
import pytest

from jphantom.analysis import hlo
from jphantom.models.ffn import FFNConfig

from conftest import require_devices
from helpers import compiled_hlo, gradient_step

WIDTH, BATCH, GHOST = 64, 16, 3
F32 = 4


@functools.lru_cache(maxsize=None)
def _ops(strategy, depth, num_shards, ghost_width=None):
    """Every collective of the compiled step on ``model=p`` (and the mesh's axis sizes)."""
    require_devices(num_shards)
    config = FFNConfig(width=WIDTH, depth=depth, ghost_width=ghost_width)
    program, mesh, step, _ = gradient_step(strategy, config, f"model={num_shards}")
    text = compiled_hlo(step, ((BATCH, WIDTH), np.float32), ((BATCH, WIDTH), np.float32))
    return hlo.collectives(text), dict(mesh.shape)


def _buffers(ops):
    """kind -> sorted element counts of every result buffer (once per execution), and kind ->
    total bytes over the step."""
    elements, nbytes = defaultdict(list), defaultdict(int)
    for op in ops:
        for dtype, shape in op.shapes:
            assert dtype == "f32", op
            elements[op.kind] += [int(np.prod(shape))] * op.count
        nbytes[op.kind] += op.bytes * op.count
    return {k: sorted(v) for k, v in elements.items()}, dict(nbytes)


def _expected(formula):
    with_loss = {kind: list(sizes) for kind, sizes in formula.items() if sizes}
    with_loss.setdefault("all-reduce", []).append(1)  # the scalar MSE loss (shape [])
    return {k: sorted(v) for k, v in with_loss.items()}


def _assert_exact(found, formula):
    ops, axes = found
    elements, nbytes = _buffers(ops)
    want = _expected(formula)
    assert elements == want, f"collective buffers {elements} != formula {want}"
    assert nbytes == {kind: F32 * sum(sizes) for kind, sizes in want.items()}
    summary = {row["kind"]: row["bytes"] for row in hlo.summarize(ops)}
    assert summary == nbytes
    assert all(op.mesh_axes(axes) == ("model",) for op in ops)  # model=p mesh


def phantom_formula(depth, num_shards, ghost_width=GHOST, batch=BATCH):
    """Table II of Seal et al. per layer: forward one all-gather of k B from each of p ranks (result
    p k B), backward one reduce-scatter down to k B, at every layer including the first (Gamma_1
    feeds dL/dC_1, Eq. 20)."""
    return {"all-gather": [num_shards * ghost_width * batch] * depth,
            "reduce-scatter": [ghost_width * batch] * depth}


def t1_formula(depth, num_shards, batch=BATCH):
    """T1: L all-gathers of B n, L-1 reduce-scatters to B n/p (the first layer's would only
    produce dL/dx)."""
    return {"all-gather": [batch * WIDTH] * depth,
            "reduce-scatter": [batch * WIDTH // num_shards] * (depth - 1)}


def megatron_formula(depth, batch=BATCH):
    """Megatron: the entry gather's all-gather of B n, the exit scatter's backward all-gather
    when the depth is even; all-reduces of B n: floor(L/2) g forward, ceil(L/2) - 1 f backward
    (the first f's would only feed dL/dx)."""
    pairs, odd = divmod(depth, 2)
    return {"all-gather": [batch * WIDTH] * (1 + (0 if odd else 1)),
            "all-reduce": [batch * WIDTH] * (pairs + pairs + odd - 1)}


@pytest.mark.parametrize("strategy", ["phantom", "phantom-unfused"])
@pytest.mark.parametrize("depth", [1, 2, 3])
@pytest.mark.parametrize("num_shards", [2, 8])
# make test: p = 2 at depths 1 and 3, p = 8 at depth 2, fused and unfused
@pytest.mark.slow_cells("8-3-phantom", "2-3-phantom-unfused", "8-3-phantom-unfused",
                        "2-1-phantom-unfused", "2-2-phantom", "2-2-phantom-unfused",
                        "8-1-phantom", "8-1-phantom-unfused")
def test_phantom_step_moves_only_k_wide_messages(strategy, num_shards, depth):
    """Per layer: one all-gather of B x p x k and one reduce-scatter back to B x k (Table II), and no
    all-reduce except the scalar loss: parameters are never replicated, so no gradient all-reduce."""
    _assert_exact(_ops(strategy, depth, num_shards, GHOST), phantom_formula(depth, num_shards))


@pytest.mark.parametrize("depth", [1, 2, 3])
@pytest.mark.parametrize("num_shards", [2, 8])
def test_tensor_t1_step_collectives(num_shards, depth):
    """T1: all-gather of the n/p-wide activations into B x n per layer, reduce-scatter of B x n down
    to B x n/p per layer except the input layer (its only output would be dL/dx)."""
    _assert_exact(_ops("tensor-t1", depth, num_shards), t1_formula(depth, num_shards))


@pytest.mark.parametrize("depth, gathers, all_reduces", [(1, 1, 0), (2, 2, 1), (3, 1, 2), (4, 2, 3)])
@pytest.mark.parametrize("num_shards", [2, 8])
def test_tensor_megatron_step_collectives(num_shards, depth, gathers, all_reduces):
    """tensor (Megatron): entry all-gather, one g all-reduce per pair forward, one f all-reduce per
    column layer but the first backward, and the exit scatter's all-gather backward when the depth
    is even."""
    formula = megatron_formula(depth)
    assert formula == {"all-gather": [BATCH * WIDTH] * gathers,
                       "all-reduce": [BATCH * WIDTH] * all_reduces}
    _assert_exact(_ops("tensor", depth, num_shards), formula)


def test_phantom_bytes_are_k_over_block_of_t1_per_collective():
    """Seal et al. Eq. 9: per collective, phantom moves k/(n/p) of T1's bytes."""
    p, depth = 8, 2
    per_op = lambda ops: {r["kind"]: r["bytes"] / r["count"] for r in hlo.summarize(ops)}
    ph = per_op(_ops("phantom", depth, p, GHOST)[0])
    t1 = per_op(_ops("tensor-t1", depth, p)[0])
    ratio = GHOST / (WIDTH / p)
    for kind in ("all-gather", "reduce-scatter"):
        assert ph[kind] == pytest.approx(ratio * t1[kind])


@pytest.mark.parametrize("text, groups, axes", [
    ("mesh['axis_0'=2,'axis_1'=4] {'axis_0'}", [[0, 4], [1, 5], [2, 6], [3, 7]], ("data",)),
    ("mesh['axis_0'=2,'axis_1'=4] {'axis_1'}", [[0, 1, 2, 3], [4, 5, 6, 7]], ("model",)),
    ("mesh['axis_0'=2,'axis_1'=4] {'axis_0','axis_1'}", [list(range(8))], ("data", "model")),
])
def test_gspmd_mesh_replica_groups_are_read_as_iota_lists(text, groups, axes):
    """GSPMD prints replica groups as a mesh and the axes the groups run along;
    hlo.normalise_replica_groups turns that into the iota form hlo reads."""
    iota = hlo.normalise_replica_groups(text)
    assert hlo.replica_group_lists(iota, 8) == groups
    assert hlo.group_axes(iota, {"data": 2, "model": 4}) == axes
    assert hlo.normalise_replica_groups("{{0,1},{2,3}}") == "{{0,1},{2,3}}"


def test_gspmd_mesh_replica_groups_with_device_ids_and_their_attribute():
    """Shardy's partitioner (jax 0.10, a pipeline's vmap over stages) also orders the mesh's
    devices by an iota ``device_ids=([2,2,2]T(1,0,2))`` (mesh position (i, j, k) is device
    4 j + 2 i + k here) and the attribute reader takes it whole, not up to the first comma."""
    attrs = (", channel_id=6, replica_groups=mesh['axis_0'=2,'axis_1'=2,'axis_2'=2], "
             "device_ids=([2,2,2]T(1,0,2)) {'axis_0'}, metadata={op_name=\"x\"}")
    text = hlo.attr_value(attrs, "replica_groups")
    assert text.endswith("{'axis_0'}")
    assert hlo.replica_group_lists(text, 8) == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert hlo.group_axes(text, {"a": 2, "b": 2, "c": 2}) == ("b",)


# --------------------------------------------------------------------------------------------------
# The kernels that matter (hlo.kernels), read from snippets shaped as XLA:GPU prints them (the
# forms an H100 compile of jax 0.10.2 emitted; no compiler needed)
# --------------------------------------------------------------------------------------------------

_BODY = '''
%loop_body (p: (s32[], bf16[4,8])) -> (s32[], bf16[4,8]) {
  %p = (s32[], bf16[4,8]{1,0}) parameter(0)
  %x = bf16[4,8]{1,0} get-tuple-element(%p), index=1
  %q = bf16[2,256,8,64]{3,2,1,0} parameter(1)
  %fmha = (bf16[2,8,256,64]{3,1,2,0}, f32[2,8,256]{2,1,0}, u8[0]{0}) custom-call(%q, %q, %q), custom_call_target="__cudnn$fmhaSoftmax", operand_layout_constraints={bf16[2,256,8,64]{3,2,1,0}, bf16[2,256,8,64]{3,2,1,0}, bf16[2,256,8,64]{3,2,1,0}}, api_version=API_VERSION_STATUS_RETURNING, metadata={op_name="jit(step)/dot_product_attention_fwd"}
  %fmha.bwd = (bf16[2,8,256,64]{3,1,2,0}, bf16[2,8,256,64]{3,1,2,0}, bf16[2,8,256,64]{3,1,2,0}, u8[0]{0}) custom-call(%q, %q, %q), custom_call_target="__cudnn$fmhaSoftmaxBackward", metadata={op_name="jit(step)/dot_product_attention_bwd"}
  %all-gather-start = (bf16[4,8]{1,0}, bf16[16,8]{1,0}) all-gather-start(%x), channel_id=1, replica_groups={{0,1,2,3}}, dimensions={0}, use_global_device_ids=true, backend_config={"operation_queue_id":"0"}
  %gemm_fusion_dot = bf16[4,8]{1,0} fusion(%x, %x), kind=kCustom, calls=%gemm_body, backend_config={"operation_queue_id":"0","fusion_backend_config":{"kind":"__triton_nested_gemm_fusion","block_level_fusion_config":{"num_warps":"2"}}}
  %all-gather-done = bf16[16,8]{1,0} all-gather-done(%all-gather-start)
  %all-reduce-start = bf16[4,8]{1,0} all-reduce-start(%gemm_fusion_dot), channel_id=2, replica_groups={{0,1,2,3}}, to_apply=%add
  %loop_add_fusion = bf16[4,8]{1,0} fusion(%x, %x), kind=kLoop, calls=%add_body
  %all-reduce-done = bf16[4,8]{1,0} all-reduce-done(%all-reduce-start)
  %trivial-start = bf16[4,8]{1,0} all-reduce-start(%x), channel_id=3, replica_groups={{0},{1},{2},{3}}, to_apply=%add
  %gemm_fusion_dot.1 = bf16[4,8]{1,0} fusion(%x, %x), kind=kCustom, calls=%gemm_body, backend_config={"fusion_backend_config":{"kind":"__triton_nested_gemm_fusion"}}
  %trivial-done = bf16[4,8]{1,0} all-reduce-done(%trivial-start)
  %i = s32[] get-tuple-element(%p), index=0
  ROOT %t = (s32[], bf16[4,8]{1,0}) tuple(%i, %all-reduce-done)
}

%gemm_body (a: bf16[4,8], b: bf16[4,8]) -> bf16[4,8] {
  %a = bf16[4,8]{1,0} parameter(0)
  %b = bf16[4,8]{1,0} parameter(1)
  ROOT %dot.1 = bf16[4,8]{1,0} dot(%a, %b), lhs_contracting_dims={1}, rhs_contracting_dims={1}
}

%add_body (a: bf16[4,8], b: bf16[4,8]) -> bf16[4,8] {
  %a.1 = bf16[4,8]{1,0} parameter(0)
  %b.1 = bf16[4,8]{1,0} parameter(1)
  ROOT %sum = bf16[4,8]{1,0} add(%a.1, %b.1)
}

%add (x: bf16[], y: bf16[]) -> bf16[] {
  %x.2 = bf16[] parameter(0)
  %y.2 = bf16[] parameter(1)
  ROOT %z = bf16[] add(%x.2, %y.2)
}

%loop_cond (p: (s32[], bf16[4,8])) -> pred[] {
  %p.1 = (s32[], bf16[4,8]{1,0}) parameter(0)
  %i.1 = s32[] get-tuple-element(%p.1), index=0
  %n = s32[] constant(4)
  ROOT %lt = pred[] compare(%i.1, %n), direction=LT
}
'''

_ENTRY = '''
ENTRY %main (x: bf16[4,8], xq: f8e4m3fn[4,8], sx: f32[]) -> bf16[4,8] {
  %x.0 = bf16[4,8]{1,0} parameter(0)
  %xq.0 = f8e4m3fn[4,8]{1,0} parameter(1)
  %sx.0 = f32[] parameter(2)
  %zero = s32[] constant(0)
  %init = (s32[], bf16[4,8]{1,0}) tuple(%zero, %x.0)
  %loop = (s32[], bf16[4,8]{1,0}) while(%init), condition=%loop_cond, body=%loop_body, backend_config={"known_trip_count":{"n":"4"}}
  %cublas = (bf16[4,8]{1,0}, s8[4194304]{0}) custom-call(%x.0, %x.0), custom_call_target="__cublas$lt$matmul", backend_config={"gemm_backend_config":{"dot_dimension_numbers":{"lhs_contracting_dimensions":["1"],"rhs_contracting_dimensions":["1"]}}}
  %cublas.f8 = (bf16[4,4]{1,0}, s8[4194304]{0}) custom-call(%xq.0, %xq.0, %sx.0, %sx.0), custom_call_target="__cublas$lt$matmul$f8", backend_config={"gemm_backend_config":{"dot_dimension_numbers":{"lhs_contracting_dimensions":["1"],"rhs_contracting_dimensions":["1"]}}}
  %fp8_dot = bf16[4,4]{1,0} fusion(%xq.0, %xq.0), kind=kCustom, calls=%f8_gemm_body, backend_config={"fusion_backend_config":{"kind":"__triton_gemm"}}
  %fp8_upcast = bf16[4,4]{1,0} fusion(%xq.0, %sx.0), kind=kCustom, calls=%upcast_gemm_body, backend_config={"fusion_backend_config":{"kind":"__triton_nested_gemm_fusion"}}
  %pallas = bf16[4,8]{1,0} custom-call(%x.0), custom_call_target="__gpu$xla.gpu.triton", backend_config={"name":"flash_attention"}
  %cp-start = (bf16[4,8]{1,0}, bf16[4,8]{1,0}) collective-permute-start(%x.0), channel_id=4, source_target_pairs={{0,1},{1,2},{2,3},{3,0}}
  %nested = bf16[4,8]{1,0} fusion(%x.0, %x.0), kind=kCustom, calls=%outer_body, backend_config={"fusion_backend_config":{"kind":"__cudnn$fusion"}}
  %cp-done = bf16[4,8]{1,0} collective-permute-done(%cp-start)
  ROOT %out = bf16[4,8]{1,0} get-tuple-element(%loop), index=1
}

%f8_gemm_body (a: f8e4m3fn[4,8], b: f8e4m3fn[4,8]) -> bf16[4,4] {
  %a.3 = f8e4m3fn[4,8]{1,0} parameter(0)
  %b.3 = f8e4m3fn[4,8]{1,0} parameter(1)
  ROOT %dot.3 = bf16[4,4]{1,0} dot(%a.3, %b.3), lhs_contracting_dims={1}, rhs_contracting_dims={1}
}

%upcast_gemm_body (a: f8e4m3fn[4,8], s: f32[]) -> bf16[4,4] {
  %a.4 = f8e4m3fn[4,8]{1,0} parameter(0)
  %s.4 = f32[] parameter(1)
  %wide = bf16[4,8]{1,0} convert(%a.4)
  ROOT %dot.4 = bf16[4,4]{1,0} dot(%wide, %wide), lhs_contracting_dims={1}, rhs_contracting_dims={1}
}

%outer_body (a: bf16[4,8], b: bf16[4,8]) -> bf16[4,8] {
  %a.5 = bf16[4,8]{1,0} parameter(0)
  %b.5 = bf16[4,8]{1,0} parameter(1)
  ROOT %inner = bf16[4,8]{1,0} fusion(%a.5, %b.5), kind=kLoop, calls=%gemm_body
}
'''


def test_kernels_counts_attention_gemms_fp8_and_gemms_under_collectives():
    """Per step (the loop's 4 trips multiplied in): cuDNN's fused attention forward and backward
    by target, each GEMM kernel once by its emitter (a fusion's dot is its kernel, not another
    GEMM; a fusion without a dot is none), FP8 where the multiply reads f8 and "upcast" where a
    fusion reads f8 but widens it first, the Pallas call, and which asynchronous collectives
    (trivial ones left out) have a GEMM scheduled between start and done."""
    found = hlo.kernels(_BODY + _ENTRY)
    assert found["attention"] == {"forward": 4, "backward": 4, "targets": {
        "__cudnn$fmhaSoftmax": 4, "__cudnn$fmhaSoftmaxBackward": 4}}
    assert found["pallas"] == {"__gpu$xla.gpu.triton": 1}
    gemms = found["gemms"]
    assert gemms["by_kind"] == {"triton": 2 * 4 + 2, "cublas_lt": 1, "cublas_lt_f8": 1,
                                "cudnn": 1}
    assert gemms["total"] == 13
    assert (gemms["fp8"], gemms["fp8_upcast"]) == (2, 1)  # the cuBLAS-LT FP8 call, the f8 dot
    # per trip: the all-gather has a GEMM under it, the all-reduce a loop fusion only, the
    # trivial all-reduce (one device per group) does not count; once: the permute has the
    # cuDNN GEMM fusion under it
    assert found["collectives"] == {"asynchronous": 4 + 4 + 1, "with_gemms": 4 + 1,
                                    "gemms_under": 4 + 1}
    line = hlo.format_kernels(found)
    assert line.startswith("cuDNN attention 4 fwd / 4 bwd, FP8 GEMMs 2 (+1 reading FP8")
    assert "GEMMs 13 (triton 10," in line and line.endswith("5 of 9 asynchronous")


def test_collectives_count_the_gemms_under_each_async_pair():
    ops = {c.name: c for c in hlo.collectives(_BODY + _ENTRY)}
    assert (ops["all-gather-done"].overlapped, ops["all-gather-done"].overlapped_gemms) == (1, 1)
    assert (ops["all-reduce-done"].overlapped, ops["all-reduce-done"].overlapped_gemms) == (1, 0)
    assert ops["cp-done"].overlapped_gemms == 1 and ops["cp-done"].count == 1


def test_kernels_of_a_module_without_any():
    """XLA:CPU's step: bare dots are GEMMs (kind ``dot``), no attention call, nothing async."""
    text = '''
ENTRY %main (a: f32[4,8], b: f32[8,2]) -> f32[4,2] {
  %a = f32[4,8]{1,0} parameter(0)
  %b = f32[8,2]{1,0} parameter(1)
  ROOT %d = f32[4,2]{1,0} dot(%a, %b), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}
'''
    found = hlo.kernels(text)
    assert found["gemms"] == {"total": 1, "by_kind": {"dot": 1}, "fp8": 0, "fp8_upcast": 0}
    assert found["attention"]["forward"] == 0 and found["collectives"]["asynchronous"] == 0
    assert hlo.format_kernels(found) == ("cuDNN attention 0 fwd / 0 bwd, FP8 GEMMs 0, GEMMs 1 "
                                         "(dot 1), collectives with GEMMs under them: 0 of 0 "
                                         "asynchronous")


def test_dot_flops_counts_cublas_lt_fp8_calls():
    """``__cublas$lt$matmul$f8`` is a GEMM too. Executions: the loop's two GEMM fusions x 4 trips,
    the nested fusion's dot, the cuBLAS-LT call, its FP8 call, the two f8 fusions' dots; 2 x
    result elements x contracted size each: [4,8] results over 8 (512), [4,4] over 8 (256)."""
    flops, count = hlo.dot_flops(_BODY + _ENTRY)
    assert count == 2 * 4 + 1 + 1 + 1 + 2
    assert flops == (2 * 4 + 1 + 1) * 512 + 3 * 256


def test_operand_after_an_index_comment_is_named():
    """XLA marks every fifth operand of a long list ``/*index=5*/%name``: the name is the rest."""
    from jphantom.analysis.hlo.text import parse_instruction

    line = ("  %t = (s32[], s32[], s32[], s32[], s32[], /*index=5*/s32[]) tuple(%a, %b, %c, %d, "
            "%e, /*index=5*/%f)")
    assert parse_instruction(line).operands == ("a", "b", "c", "d", "e", "f")


_RING = '''
%add_body (a: bf16[4,8], b: bf16[4,8]) -> bf16[4,8] {
  %a.r = bf16[4,8]{1,0} parameter(0)
  %b.r = bf16[4,8]{1,0} parameter(1)
  ROOT %sum.r = bf16[4,8]{1,0} add(%a.r, %b.r)
}

%early (p: (bf16[4,8])) -> bf16[4,8] {
  %p.e = (bf16[4,8]{1,0}) parameter(0)
  %x.e = bf16[4,8]{1,0} get-tuple-element(%p.e), index=0
  ROOT %flash.e = bf16[4,8]{1,0} custom-call(%x.e), custom_call_target="__gpu$xla.gpu.triton", metadata={op_name="jit(step)/ring_block_forward/pallas_call"}
}

%late (p: (bf16[4,8])) -> bf16[4,8] {
  %p.l = (bf16[4,8]{1,0}) parameter(0)
  %x.l = bf16[4,8]{1,0} get-tuple-element(%p.l), index=0
  ROOT %flash.l = bf16[4,8]{1,0} custom-call(%x.l), custom_call_target="__gpu$xla.gpu.triton", metadata={op_name="jit(step)/ring_block_forward/pallas_call"}
}

ENTRY %main (x: bf16[4,8], i: s32[]) -> bf16[4,8] {
  %x = bf16[4,8]{1,0} parameter(0)
  %i = s32[] parameter(1)
  %kv-start = (bf16[4,8]{1,0}, bf16[4,8]{1,0}) collective-permute-start(%x), channel_id=1, source_target_pairs={{0,1},{1,2},{2,3},{3,0},{4,5},{5,6},{6,7},{7,4}}, metadata={op_name="jit(step)/shard_map/ppermute"}
  %t = (bf16[4,8]{1,0}) tuple(%x)
  %block = bf16[4,8]{1,0} conditional(%i, %t, %t), branch_computations={%early, %late}
  %kv-done = bf16[4,8]{1,0} collective-permute-done(%kv-start)
  %dkv-start = (bf16[4,8]{1,0}, bf16[4,8]{1,0}) collective-permute-start(%kv-done), channel_id=2, source_target_pairs={{0,1},{1,2},{2,3},{3,0},{4,5},{5,6},{6,7},{7,4}}, metadata={op_name="jit(step)/shard_map/transpose(jvp())/ppermute"}
  %add = bf16[4,8]{1,0} fusion(%block, %block), kind=kLoop, calls=%add_body
  %dkv-done = bf16[4,8]{1,0} collective-permute-done(%dkv-start)
  %other-start = (bf16[4,8]{1,0}, bf16[4,8]{1,0}) collective-permute-start(%add), channel_id=3, source_target_pairs={{0,4},{4,0}}
  %other-done = bf16[4,8]{1,0} collective-permute-done(%other-start)
  ROOT %out = bf16[4,8]{1,0} fusion(%dkv-done, %other-done), kind=kLoop, calls=%add_body
}
'''


def test_ring_overlap_names_the_attention_kernels_under_each_context_permute():
    """Ring attention's transfers (collective-permutes whose pairs cross ``context`` only): the
    first has a conditional of Pallas flash blocks (``ring_block_forward``) between its start
    and its done, each branch's kernel counted; the backward's (its op_name in a transpose) a
    loop fusion only; the permute over ``data`` is not the ring's. The predictor's ``waits``
    give each collective's exposed seconds, and add up to the exposed total."""
    from jphantom.analysis.context_ring import ring_report
    from jphantom.analysis.hlo.overlap import async_windows, attention_kernel
    from jphantom.predict.device import for_target

    axes = {"data": 2, "context": 4}
    windows = {w.name: w for w in async_windows(_RING, axes=axes)}
    assert windows["kv-start"].axes == ("context",) and windows["other-start"].axes == ("data",)
    assert (windows["kv-start"].attention, windows["kv-start"].kernels) == (2, 2)
    assert windows["kv-start"].under == ("block",) and not windows["kv-start"].backward
    assert windows["dkv-start"].backward and not windows["dkv-start"].overlaps_attention
    assert windows["dkv-start"].kernels == 1
    ring = ring_report(_RING, axes, for_target("gpu:h100"), gpus_per_node=8)
    assert (ring["permutes"], ring["overlapped_with_attention"], ring["synchronous"]) == (2, 1, 0)
    assert ring["forward"] == {"permutes": 1, "overlapped_with_attention": 1}
    assert ring["backward"] == {"permutes": 1, "overlapped_with_attention": 0}
    from jphantom.predict.timeline import simulate

    timeline = simulate(_RING, for_target("gpu:h100"), devices=8)
    assert set(timeline.waits) <= {"kv-start", "dkv-start", "other-start"}
    assert sum(timeline.waits.values()) == pytest.approx(timeline.exposed)
    assert ring["predicted"]["ring_exposed_s"] == pytest.approx(
        timeline.waits.get("kv-start", 0.0) + timeline.waits.get("dkv-start", 0.0))
    assert ring["predicted"]["ring_comm_s"] > 0
    flash = hlo.parse_instruction('%f = bf16[4,8]{1,0} custom-call(%x), custom_call_target='
                                  '"__gpu$xla.gpu.triton", metadata={op_name="a/matmul"}')
    assert not attention_kernel(flash)  # a Pallas kernel that is not attention
