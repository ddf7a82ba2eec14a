"""Models written with plain Flax, as users write them, under the ready-made plans: each either
equals the one-device model (loss and every gradient, jphantom.verify within 1e-5) or is refused
with one ConfigError naming the module before anything compiles. None may run and differ."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import jphantom
from jphantom import plans
from jphantom.errors import ConfigError
from jphantom.runtime.mesh import MeshConfig, first_devices
from jphantom.pipeline.runner import PipelineConfig

V, S, H, HEADS = 32, 64, 32, 4  # a byte-level vocabulary smaller than the sequence


class GemmaNorm(nnx.Module):
    """A user's own norm: x / rms(x) * (1 + w)."""

    def __init__(self, width):
        self.scale = nnx.Param(jnp.full((width,), 0.1, jnp.float32))

    def __call__(self, x):
        return x * jax.lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + 1e-6) * (1 + self.scale[...])


class Block(nnx.Module):
    """Meta-style names (wq, wk, wv, wo; w1, w3, w2) and a norm of the user's."""

    def __init__(self, rngs, norm=GemmaNorm):
        self.attention_norm, self.ffn_norm = norm(H), norm(H)
        self.wq, self.wk, self.wv, self.wo = (nnx.Linear(H, H, use_bias=False, rngs=rngs)
                                              for _ in range(4))
        self.w1, self.w3 = (nnx.Linear(H, 2 * H, use_bias=False, rngs=rngs) for _ in range(2))
        self.w2 = nnx.Linear(2 * H, H, use_bias=False, rngs=rngs)

    def __call__(self, x):
        h = self.attention_norm(x)
        q, k, v = self.wq(h), self.wk(h), self.wv(h)
        b, s, _ = q.shape
        q, k, v = (a.reshape(b, s, -1, H // HEADS) for a in (q, k, v))
        x = x + self.wo(jax.nn.dot_product_attention(q, k, v, is_causal=True).reshape(b, s, -1))
        h = self.ffn_norm(x)
        return x + self.w2(jax.nn.silu(self.w1(h)) * self.w3(h))


class ByteLM(nnx.Module):
    def __init__(self, tied=False, names=("tok", "pos")):
        rngs = nnx.Rngs(0)
        self.names = names
        setattr(self, names[0], nnx.Embed(V, H, rngs=rngs))
        setattr(self, names[1], nnx.Embed(S, H, rngs=rngs))
        self.layers = jphantom.nn.Stacked(Block, 2, rngs=rngs)
        self.norm = nnx.RMSNorm(H, rngs=rngs)
        self.tied = tied
        if not tied:
            self.output = nnx.Linear(H, V, use_bias=False, rngs=rngs)

    def __call__(self, tokens):
        tok, pos = getattr(self, self.names[0]), getattr(self, self.names[1])
        h = self.norm(self.layers(tok(tokens) + pos(jnp.arange(tokens.shape[1]))))
        return tok.attend(h) if self.tied else self.output(h)


def loss_fn(model, tokens, targets):
    return optax.softmax_cross_entropy_with_integer_labels(model(tokens), targets).mean()


def _mesh(text):
    mesh = MeshConfig.parse(text)
    return mesh.build(first_devices(mesh.device_count))


TOKENS = np.random.default_rng(0).integers(0, V, (8, S)).astype(np.int32)
NORMS = {"layers.block.attention_norm": None, "layers.block.ffn_norm": None}


@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_a_norm_of_the_users_is_refused_by_name_until_named(sequence_parallel):
    model = ByteLM()
    with pytest.raises(ConfigError, match=r"cannot place layers\.block\.attention_norm "
                                          r"\(GemmaNorm, holding scale\): name it"):
        plans.megatron(model, sequence_parallel=sequence_parallel)


@pytest.mark.parametrize("mesh, sequence_parallel, options", [
    ("data=2,model=4", False, {}),
    ("data=2,model=4", True, {}),
    pytest.param("data=4,model=2", True, {"zero": 3}, marks=pytest.mark.slow),  # test budget
    ("stage=2,model=4", True, {"pipeline": PipelineConfig(microbatches=2)}),
], ids=["tensor", "tensor-sp", "sp-zero3", "sp-pipeline"])
@pytest.mark.slow_cells("sp-pipeline", "tensor-sp")
def test_named_user_norms_and_meta_names_are_exact(mesh, sequence_parallel, options):
    """The user's norms named (per-token: Style('sequence') under SP, 'replicate' without), the
    Meta-style projections found by name, the token table found by the untied head (the position
    table has more rows): every layout equals one device."""
    model = ByteLM()
    style = jphantom.Style("sequence") if sequence_parallel else "replicate"
    plan = plans.megatron(model, sequence_parallel=sequence_parallel,
                          named={"layers.block.*_norm": style})
    assert plan["tok"] == "vocab" and plan["layers.block.wq"] == "column"
    assert plan["layers.block.wo"] == "row" and plan["layers.block.w2"] == "row"
    report = jphantom.verify(model, _mesh(mesh), plan, loss_fn, TOKENS, np.roll(TOKENS, -1, 1),
                             **options)
    assert report.ok, str(report)


def test_an_unnamed_module_under_sequence_parallelism_is_refused_by_parallelize():
    """A plan written by hand that leaves a module holding parameters out cannot run under
    sequence parallelism (the module would see S/p tokens unannounced)."""
    model = ByteLM()
    plan = plans.megatron(model, sequence_parallel=True, named={"layers.block.*_norm":
                                                                jphantom.Style("sequence")})
    del plan["layers.block.ffn_norm"]
    with pytest.raises(ConfigError, match=r"parallelize \(sequence parallelism\) cannot place "
                                          r"layers\.block\.ffn_norm"):
        plans.parallelize(model, {"model": 4}, plan)


def test_the_token_table_is_found_by_use_not_by_size():
    assert plans.vocabulary_table(ByteLM()) == "tok"  # by the head: V = 32 < S = 64
    assert plans.vocabulary_table(ByteLM(tied=True)) == "tok"  # by name, beside "pos"
    assert plans.vocabulary_table(ByteLM(tied=True, names=("a", "b")), vocab="a") == "a"
    with pytest.raises(ConfigError, match="cannot tell which of ByteLM's embeddings"):
        plans.vocabulary_table(ByteLM(tied=True, names=("a", "b")))
    with pytest.raises(ConfigError, match="vocab='c' is not an nnx.Embed"):
        plans.vocabulary_table(ByteLM(), vocab="c")


class FlaxAttentionBlock(nnx.Module):
    """A pre-norm block around Flax's own nnx.MultiHeadAttention (LinearGeneral projections)."""

    def __init__(self, rngs):
        self.ln_1, self.ln_2 = nnx.LayerNorm(H, rngs=rngs), nnx.LayerNorm(H, rngs=rngs)
        self.attn = nnx.MultiHeadAttention(HEADS, H, decode=False, rngs=rngs)
        self.up, self.down = nnx.Linear(H, 2 * H, rngs=rngs), nnx.Linear(2 * H, H, rngs=rngs)

    def __call__(self, x):
        causal = nnx.make_causal_mask(jnp.ones((x.shape[0], S)))  # the whole sequence
        x = x + self.attn(self.ln_1(x), mask=causal)
        return x + self.down(jax.nn.gelu(self.up(self.ln_2(x))))


class FlaxAttentionLM(nnx.Module):
    def __init__(self, mlp_einsum=False):
        rngs = nnx.Rngs(0)
        self.embed = nnx.Embed(V, H, rngs=rngs)
        self.blocks = jphantom.nn.Stacked(FlaxAttentionBlock, 2, rngs=rngs)
        if mlp_einsum:
            self.mlp = nnx.Einsum("bsh,hf->bsf", (H, H), rngs=rngs)
        self.ln_f, self.head = nnx.LayerNorm(H, rngs=rngs), nnx.Linear(H, V, rngs=rngs)

    def __call__(self, tokens):
        h = self.blocks(self.embed(tokens))
        h = self.mlp(h) if hasattr(self, "mlp") else h
        return self.head(self.ln_f(h))


@pytest.mark.parametrize("mesh, sequence_parallel, options", [
    ("data=2,model=4", False, {}), ("data=2,model=2", True, {}),
    ("data=4,model=2", False, {"zero": 3})], ids=["tensor", "tensor-sp", "zero3"])
@pytest.mark.slow_cells("tensor-sp", "zero3")
def test_flax_multi_head_attention_is_tensor_parallel_and_exact(mesh, sequence_parallel,
                                                                options):
    """nnx.MultiHeadAttention's LinearGeneral projections: query, key and value split over their
    heads (ColumnParallelGeneral), out over its input heads (RowParallelGeneral)."""
    model = FlaxAttentionLM()
    plan = plans.megatron(model, sequence_parallel=sequence_parallel)
    assert plan["blocks.block.attn.query"] == "column" and plan["blocks.block.attn.out"] == "row"
    report = jphantom.verify(model, _mesh(mesh), plan, loss_fn, TOKENS, np.roll(TOKENS, -1, 1),
                             **options)
    assert report.ok, str(report)


class EinsumBlock(nnx.Module):
    """Attention and MLP written with nnx.Einsum, heads as their own kernel axis, with biases."""

    def __init__(self, rngs):
        d = H // HEADS
        self.ln_1, self.ln_2 = nnx.LayerNorm(H, rngs=rngs), nnx.LayerNorm(H, rngs=rngs)
        self.q, self.k, self.v = (nnx.Einsum("bsh,hnd->bsnd", (H, HEADS, d), (HEADS, d),
                                             rngs=rngs) for _ in range(3))
        self.o = nnx.Einsum("bsnd,ndh->bsh", (HEADS, d, H), (H,), rngs=rngs)
        self.up = nnx.Einsum("bsh,hf->bsf", (H, 2 * H), (2 * H,), rngs=rngs)
        self.down = nnx.Einsum("bsf,fh->bsh", (2 * H, H), (H,), rngs=rngs)

    def __call__(self, x):
        h = self.ln_1(x)
        attention = jax.nn.dot_product_attention(self.q(h), self.k(h), self.v(h), is_causal=True)
        x = x + self.o(attention)
        return x + self.down(jax.nn.gelu(self.up(self.ln_2(x))))


class EinsumLM(nnx.Module):
    def __init__(self):
        rngs = nnx.Rngs(0)
        self.embed = nnx.Embed(V, H, rngs=rngs)
        self.blocks = jphantom.nn.Stacked(EinsumBlock, 2, rngs=rngs)
        self.ln_f, self.head = nnx.LayerNorm(H, rngs=rngs), nnx.Linear(H, V, rngs=rngs)

    def __call__(self, tokens):
        return self.head(self.ln_f(self.blocks(self.embed(tokens))))


@pytest.mark.parametrize("mesh, sequence_parallel, options", [
    ("data=2,model=4", False, {}), ("data=2,model=2", True, {}),
    ("data=4,model=2", False, {"zero": 3}),
    pytest.param("stage=2,model=2", False, {"pipeline": PipelineConfig(microbatches=2)},
                 marks=pytest.mark.slow)], ids=["tensor", "tensor-sp", "zero3", "pipeline"])
@pytest.mark.slow_cells("tensor-sp", "zero3")
def test_einsum_layers_are_tensor_parallel_and_exact(mesh, sequence_parallel, options):
    """nnx.Einsum: q, k, v and up split along the first kernel axis only their output has (the
    heads, the features), o and down along the first they contract."""
    model = EinsumLM()
    plan = plans.megatron(model, sequence_parallel=sequence_parallel)
    assert plan["blocks.block.q"] == "column" and plan["blocks.block.down"] == "row"
    report = jphantom.verify(model, _mesh(mesh), plan, loss_fn, TOKENS, np.roll(TOKENS, -1, 1),
                             **options)
    assert report.ok, str(report)
    layer = plans.parallelize(EinsumLM(), _mesh(mesh), plan).blocks.block.q
    assert isinstance(layer, jphantom.nn.ColumnParallelEinsum)
    assert jphantom.nn.metadata.axes_of(layer.kernel)[-3:] == (None, "model", None)


# make test: the GSPMD baseline in test_data_parallel.py; a user's einsum layers under the
# explicit step above
@pytest.mark.slow
def test_einsum_gspmd_annotation_is_exact():
    model, mesh = EinsumLM(), _mesh("data=2,model=2")
    plans.annotate(model, mesh, plans.megatron(EinsumLM()))
    assert jphantom.nn.metadata.axes_of(model.blocks.block.o.kernel)[-3:] == ("model", None, None)
    report = jphantom.verify(model, mesh, None, loss_fn, TOKENS, np.roll(TOKENS, -1, 1),
                             spmd="gspmd")
    assert report.ok, str(report)


def test_flax_layers_the_walk_does_not_split_are_refused_by_name():
    """An Einsum whose name says nothing, one with an ellipsis, and phantom on LinearGeneral:
    the walks name them instead of leaving them silently whole."""
    with pytest.raises(ConfigError, match=r"cannot place mlp \(Einsum, holding kernel"):
        plans.megatron(FlaxAttentionLM(mlp_einsum=True))
    model = FlaxAttentionLM(mlp_einsum=True)
    model.mlp = nnx.Einsum("...h,hf->...f", (H, H), rngs=nnx.Rngs(0))
    with pytest.raises(ConfigError, match=r"explicit letters"):
        plans.parallelize(model, _mesh("model=2"), {**plans.megatron(FlaxAttentionLM()),
                                                    "mlp": "column"})
    with pytest.raises(ConfigError, match=r"plans.phantom cannot place blocks\.block\.attn\."):
        plans.phantom(FlaxAttentionLM())


class DropoutBlock(nnx.Module):
    def __init__(self, rngs):
        self.up, self.down = nnx.Linear(H, 2 * H, rngs=rngs), nnx.Linear(2 * H, H, rngs=rngs)
        self.drop = nnx.Dropout(0.3, rngs=rngs)

    def __call__(self, x):
        return x + self.drop(self.down(jax.nn.gelu(self.up(x))))


class DropoutLM(nnx.Module):
    """Dropout on the embedding and after each block's row layer, as GPT-2 places it."""

    def __init__(self, rate=0.3):
        rngs = nnx.Rngs(0)
        self.embed = nnx.Embed(V, H, rngs=rngs)
        self.blocks = jphantom.nn.Stacked(DropoutBlock, 2, rngs=rngs)
        self.drop = nnx.Dropout(rate, rngs=rngs)
        self.head = nnx.Linear(H, V, rngs=rngs)

    def __call__(self, tokens):
        return self.head(self.blocks(self.drop(self.embed(tokens))))


def _dropout_run(mesh, plan=False, steps=2, **options):
    model = DropoutLM()
    mesh = _mesh(mesh)
    if plan:
        jphantom.parallelize(model, mesh, plans.megatron(model))
    step = jphantom.make_train_step(model, mesh, optax.sgd(0.5), loss_fn, donate=False, **options)
    state, losses = step.init(), []
    for _ in range(steps):
        state, loss = step(state, TOKENS, np.roll(TOKENS, -1, 1))
        losses.append(float(loss))
    return losses, step, state


@pytest.mark.slow  # test budget: the masks' split over axes is the fast test below
def test_dropout_trains_deterministically_with_one_mask_per_activation():
    """nnx.Dropout trains: the same seed gives the same run, another seed another; tensor
    parallelism (whose dropouts see the replicated stream) and ZeRO-3 draw the masks data
    parallelism draws, so their runs equal it; the step's evaluation runs without dropout."""
    base, step, state = _dropout_run("data=2")
    assert _dropout_run("data=2")[0] == base
    assert _dropout_run("data=2", dropout_seed=1)[0] != base
    for mesh, plan, options in [("data=2,model=2", True, {}), ("data=2", False, {"zero": 3})]:
        np.testing.assert_allclose(_dropout_run(mesh, plan, **options)[0], base, rtol=1e-5)
    tokens, targets = TOKENS, np.roll(TOKENS, -1, 1)
    no_dropout = jphantom.dense_equivalent(step.model(state))  # nnx.Dropout, deterministic
    assert abs(float(step.loss()(state.params, tokens, targets))
               - float(loss_fn(no_dropout, tokens, targets))) < 1e-5
    assert float(step.loss()(state.params, tokens, targets)) != base[-1]


def test_dropout_under_accumulation_draws_the_same_masks_through_the_gradient_sinks():
    """accumulate=2: each stacked layer's dropout key reaches it through the sinks' scan
    (jphantom.nn.sink, a key among the layer's own slices) as through lax.scan: the same loss
    and parameters after a step as the step without sinks."""
    from jphantom.step.grads import LocalGradients

    def run(sink):
        mesh = _mesh("data=2")
        step = jphantom.make_train_step(DropoutLM(), mesh, optax.sgd(0.5), loss_fn,
                                        donate=False, accumulate=2)
        assert [path for path, _ in step.gradients.sunk] == [("blocks",)]
        if not sink:
            step.gradients.__class__ = type("Unsunk", (LocalGradients,), {"sunk": ()})
        state, loss = step(step.init(), TOKENS, np.roll(TOKENS, -1, 1))
        return float(loss), jax.device_get(state.params)

    (loss, params), (want_loss, want_params) = run(True), run(False)
    assert loss == pytest.approx(want_loss, rel=1e-6)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7),
                 params, want_params)


def test_dropout_masks_split_over_the_axes_the_activation_varies_over():
    """Ranks holding different rows (data) draw different masks; ranks holding the same
    activation (model, over which the input is replicated) draw the same one."""
    from jphantom.nn import dropout

    mesh = _mesh("data=2,model=2")

    def per_rank(x):
        layer = dropout.Dropout(0.5, stream=7)
        dropout.give_keys(layer, jax.random.key(0))
        return jax.lax.pcast(layer(x), ("model",), to="varying")

    y = jax.jit(jax.shard_map(per_rank, mesh=mesh, in_specs=jax.P("data"),
                              out_specs=jax.P("data", "model")))(jnp.ones((4, 8)))
    blocks = np.asarray(y).reshape(2, 2, 2, 2, 4)  # [data, row, model, column]
    kept = blocks != 0
    assert (kept[:, :, 0] == kept[:, :, 1]).all()  # the same mask on both model ranks
    assert (kept[0] != kept[1]).any()  # another on the other data rank
    assert set(np.unique(np.asarray(y))) <= {0.0, 2.0}


def test_dropout_keys_are_values_of_the_model_one_per_stacked_layer_and_no_parameter():
    """The step's keys are step data on the model it merges (jphantom.nn.dropout.StepKey): a
    stacked block's dropout holds one key per layer (the blocks' scan slices them as it slices
    the parameters), each layer's its own; the parameters are the model's alone."""
    from jphantom.nn import dropout
    from jphantom.step.layout import replace_dropout

    model = DropoutLM()
    assert replace_dropout(model) == ["blocks.block.drop", "drop"]
    params = nnx.state(model, nnx.Param)
    dropout.give_keys(model, jax.random.key(0))
    stacked, top = model.blocks.block.drop.key.get_value(), model.drop.key.get_value()
    assert stacked.shape == (2,) and top.shape == ()
    data = jax.random.key_data
    assert not np.array_equal(data(stacked[0]), data(stacked[1]))
    assert jax.tree.structure(nnx.state(model, nnx.Param)) == jax.tree.structure(params)
    assert len(jax.tree.leaves(nnx.state(model, dropout.StepKey))) == 2


def test_dropout_in_a_pipeline_is_refused_naming_where_it_is():
    with pytest.raises(ConfigError, match=r"blocks\.block\.drop: nnx\.Dropout trains"):
        jphantom.make_train_step(DropoutLM(), _mesh("data=2,stage=2"), optax.sgd(0.1), loss_fn)


class ListLM(nnx.Module):
    """Blocks in an nnx.List, called in a Python loop."""

    def __init__(self):
        rngs = nnx.Rngs(0)
        self.embed = nnx.Embed(V, H, rngs=rngs)
        self.blocks = nnx.List([Block(rngs) for _ in range(2)])
        self.norm, self.output = nnx.RMSNorm(H, rngs=rngs), nnx.Linear(H, V, rngs=rngs)

    def __call__(self, tokens):
        h = self.embed(tokens)
        for block in self.blocks:
            h = block(h)
        return self.output(self.norm(h))


ZERO3_LIST_WARNING = r"the 2 blocks of blocks .*layer by layer"


def test_zero3_on_blocks_in_a_list_says_at_construction_that_it_gathers_them_whole():
    with pytest.warns(jphantom.JPhantomWarning, match=ZERO3_LIST_WARNING):
        jphantom.make_train_step(ListLM(), _mesh("data=4"), optax.sgd(0.1), loss_fn, zero=3)


# make test: the warning above; ZeRO-3's exactness on stacked layers: test_zero.py
@pytest.mark.slow
def test_zero3_on_blocks_in_a_list_is_exact():
    with pytest.warns(jphantom.JPhantomWarning, match=ZERO3_LIST_WARNING):
        report = jphantom.verify(ListLM(), _mesh("data=4"), None, loss_fn, TOKENS,
                                 np.roll(TOKENS, -1, 1), zero=3)
    assert report.ok, str(report)


def test_a_fused_qkv_in_hugging_face_layout_is_refused_by_name_until_its_order_is_declared():
    """A fused q/k/v projection split over ranks keeps whole heads only when its outputs run head
    by head; Hugging Face's q | k | v would hand each rank part of q, k and v, silently wrong."""
    from flax import nnx

    from jphantom import plans
    from jphantom.errors import ConfigError

    class Attention(nnx.Module):
        def __init__(self, rngs):
            self.qkv = nnx.Linear(16, 48, rngs=rngs)
            self.out_proj = nnx.Linear(16, 16, rngs=rngs)

    class HeadsFirst(Attention):
        FUSED_QKV_LAYOUT = "heads"

    class Model(nnx.Module):
        def __init__(self, attention, rngs):
            self.embed = nnx.Embed(32, 16, rngs=rngs)
            self.attn = attention(rngs)
            self.head = nnx.Linear(16, 32, rngs=rngs)

    model = Model(Attention, nnx.Rngs(0))
    for make in (plans.megatron, plans.pmm3d, lambda m: plans.phantom(m, 2)):
        with pytest.raises(ConfigError, match=r"attn\.qkv is a fused q/k/v projection.*"
                                              "FUSED_QKV_LAYOUT = 'heads' on Attention"):
            make(model)
    assert plans.megatron(Model(HeadsFirst, nnx.Rngs(0)))["attn.qkv"] == "column"
    named = plans.megatron(model, named={"attn.qkv": "column"})  # the user's own call
    assert named["attn.qkv"] == "column"
