"""Sec. 5.1.2's use of AxoNN's model (Singh's thesis): every ordered factorisation of the GPUs
into a 4D grid, filtered by what the GPT can split and by memory, and ranked by Σ Eq. 5.6
seconds."""

from __future__ import annotations

from jphantom.errors import ConfigError
from jphantom.perf.axonn_model.equations import Grid, predict
from jphantom.perf.axonn_model.memory import PrecisionBytes, pmm3d_memory, precision_of
from jphantom.perf.axonn_model.network import Topology
from jphantom.perf.axonn_model.shapes import GPTShape, gpt_layers
from jphantom.perf.axonn_model.units import GIB, check_count, check_positive


def grid_problems(grid: Grid, shape: GPTShape, batch: int, *, accumulate: int = 1,
                  lm_head: bool = True) -> list[str]:
    """Why ``grid`` cannot run the GPT (empty: it can). The filters (our choices; the paper states
    none, §2's implementer notes):

    - heads % G_x: QKV's outputs split over X by whole heads (attention stays local), and the
      transposed attention output splits its rows the same way;
    - hidden % G_y: LayerNorm and the residual stream split features over Y (§1.4); QKV's and MLP
      up's rows (k = h) over Y;
    - (4 h) % G_x: the MLP's 4h features over X (implied by heads % G_x; checked anyway);
    - each layer's k n / (G_x G_y) % G_z: Ŵ is a flat 1/G_z slice of the (y, x) block (§7.1);
    - vocab % G_x with ``lm_head``: the head's vocabulary over X;
    - batch % (G_data G_z accumulate): tokens split over data and Z must be whole sequences
      (attention needs all of a sequence's tokens: the digest's §6 item 5).
    """
    h, problems = shape.hidden, []
    if shape.heads % grid.x:
        problems.append(f"heads={shape.heads} not divisible by G_x={grid.x}")
    if h % grid.y:
        problems.append(f"hidden={h} not divisible by G_y={grid.y}")
    if shape.mlp_width % grid.x:
        problems.append(f"MLP width {shape.mlp_width} not divisible by G_x={grid.x}")
    if shape.kind.sized and shape.kv_heads % grid.x:
        problems.append(f"kv_heads={shape.kv_heads} not divisible by G_x={grid.x}")
    if lm_head and shape.vocab_size % grid.x:
        problems.append(f"vocab={shape.vocab_size} not divisible by G_x={grid.x}")
    if not problems:
        for layer in gpt_layers(shape, 1, lm_head=lm_head)[-5:]:
            g = grid.transposed() if layer.transposed else grid
            if layer.k % g.y or layer.n % g.x or (layer.k // g.y * layer.n // g.x) % g.z:
                problems.append(f"{layer.name} weight {layer.k}x{layer.n} not divisible into "
                                f"(G_y, G_x, G_z) = ({g.y}, {g.x}, {g.z}) shards")
    if batch % (grid.data * grid.z * accumulate):
        problems.append(f"batch={batch} not divisible by G_data x G_z x accumulate = "
                        f"{grid.data * grid.z * accumulate} (whole sequences per rank)")
    return problems


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def configurations(devices: int, shape: GPTShape | None = None, *, batch: int | None = None,
                   memory_gib: float | None = None, precision: str | PrecisionBytes = "bf16",
                   accumulate: int = 1, flash_attention: bool = True,
                   lm_head: bool = True) -> list[Grid]:
    """Every ordered factorisation devices = G_x G_y G_z G_data (20 for 8 GPUs, 35 for 16, 56 for
    32, 84 for 64: C(a+3, 3) for 2^a), sorted by (G_data, G_z, G_y, G_x). With a ``shape`` and
    ``batch``, only the grids that pass :func:`grid_problems`; with ``memory_gib`` also, only those
    whose :func:`pmm3d_memory` total fits in that many GiB."""
    check_count("devices", devices, 1, "give the number of GPUs, e.g. 32")
    grids = [Grid(x, y, z, devices // (x * y * z))
             for x in _divisors(devices) for y in _divisors(devices // x)
             for z in _divisors(devices // (x * y))]
    grids.sort(key=lambda g: (g.data, g.z, g.y, g.x))
    if shape is None:
        if batch is not None or memory_gib is not None:
            raise ConfigError("batch and memory_gib filter grids against a model: pass shape too")
        return grids
    shape = GPTShape.of(shape)
    if batch is None:
        raise ConfigError("filtering grids against a model needs batch (sequences per step)")
    check_count("batch", batch, 1)
    check_count("accumulate", accumulate, 1)
    grids = [g for g in grids if not grid_problems(g, shape, batch, accumulate=accumulate,
                                                   lm_head=lm_head)]
    if memory_gib is not None:
        limit = check_positive("memory_gib", memory_gib, "give the GiB of one GPU, e.g. 40") * GIB
        grids = [g for g in grids if pmm3d_memory(
            g, shape, batch, precision=precision, accumulate=accumulate,
            flash_attention=flash_attention, lm_head=lm_head)["total"] <= limit]
    return grids


def rank(shape: GPTShape, devices: int, topology: Topology, *, batch: int,
         memory_gib: float | None = None, precision: str | PrecisionBytes = "bf16",
         latency: bool = True, accumulate: int = 1, lm_head: bool = False,
         flash_attention: bool = True) -> list[tuple[Grid, float]]:
    """Sec. 5.1.2's use of the model: every admissible grid with its Σ Eq. 5.6 seconds, fastest
    first (ties by mesh text). ``lm_head=False`` (default) prices the transformer blocks only, as
    the paper's GPT layers; ``latency=False`` is the paper's model exactly."""
    shape = GPTShape.of(shape)
    p = precision_of(precision)
    grids = configurations(devices, shape, batch=batch, memory_gib=memory_gib, precision=p,
                           accumulate=accumulate, flash_attention=flash_attention, lm_head=lm_head)
    out = []
    for grid in grids:
        layers = gpt_layers(shape, batch * shape.seq_len // grid.data, lm_head=lm_head)
        seconds = predict(layers, grid, topology, bytes_per_element=p.element_bytes,
                          latency=latency, microbatches=accumulate)["total"]
        out.append((grid, seconds))
    out.sort(key=lambda item: (item[1], str(item[0])))
    return out
