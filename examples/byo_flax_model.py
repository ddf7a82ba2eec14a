"""Bring your own Flax model: train it on one device, then under tensor + data parallelism on 8
(simulated) devices with jphantom, and check that the two loss curves agree.

    python examples/byo_flax_model.py            # about a minute on a laptop CPU
"""

import os
import sys

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402

import jphantom  # noqa: E402


# 1. A plain NNX model, written for one device. Two habits make it parallel-ready: reshape heads
#    with -1 and read the sequence length from the projections, not from the block's input.
class Attention(nnx.Module):
    def __init__(self, hidden, heads, rngs):
        self.q, self.k, self.v, self.out = (nnx.Linear(hidden, hidden, rngs=rngs)
                                            for _ in range(4))
        self.head_dim = hidden // heads

    def __call__(self, x):
        q, k, v = self.q(x), self.k(x), self.v(x)
        b, s, _ = q.shape
        q, k, v = (a.reshape(b, s, -1, self.head_dim) for a in (q, k, v))
        scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / self.head_dim ** 0.5
        scores = jnp.where(jnp.tril(jnp.ones((s, s), bool)), scores, -1e30)
        out = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(scores, -1), v)
        return self.out(out.reshape(b, s, -1))


class Block(nnx.Module):
    def __init__(self, hidden, heads, rngs):
        self.ln1, self.ln2 = nnx.LayerNorm(hidden, rngs=rngs), nnx.LayerNorm(hidden, rngs=rngs)
        self.attn = Attention(hidden, heads, rngs)
        self.up, self.down = nnx.Linear(hidden, 4 * hidden, rngs=rngs), nnx.Linear(4 * hidden, hidden, rngs=rngs)

    def __call__(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.down(jax.nn.gelu(self.up(self.ln2(x))))


class TinyLM(nnx.Module):
    def __init__(self, vocab=128, seq=32, hidden=64, heads=4, layers=2, seed=0):
        rngs = nnx.Rngs(seed)
        self.tok, self.pos = nnx.Embed(vocab, hidden, rngs=rngs), nnx.Embed(seq, hidden, rngs=rngs)
        self.blocks = nnx.List([Block(hidden, heads, rngs) for _ in range(layers)])
        self.ln_f, self.head = nnx.LayerNorm(hidden, rngs=rngs), nnx.Linear(hidden, vocab, rngs=rngs)

    def __call__(self, tokens):
        x = self.tok(tokens) + self.pos(jnp.arange(tokens.shape[1]))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


def loss_fn(model, tokens, targets):
    return optax.softmax_cross_entropy_with_integer_labels(model(tokens), targets).mean()


def batches(steps, batch=16, seq=32, vocab=128):
    """A learnable toy stream: each token is the previous one plus one (mod vocab)."""
    rng = np.random.default_rng(0)
    for _ in range(steps):
        start = rng.integers(0, vocab, (batch, 1))
        tokens = (start + np.arange(seq + 1)) % vocab
        yield jnp.asarray(tokens[:, :-1], jnp.int32), jnp.asarray(tokens[:, 1:], jnp.int32)


def train(model, mesh, steps):
    step = jphantom.make_train_step(model, mesh, optax.adam(3e-3), loss_fn)
    state, losses = step.init(), []
    for tokens, targets in batches(steps):
        state, loss = step(state, tokens, targets)
        losses.append(float(loss))
    return losses


def main(steps: int = 20) -> int:
    # 2. One device.
    one = jax.make_mesh((1,), ("data",), devices=jax.devices()[:1])
    single = train(TinyLM(), one, steps)
    # 3. The same model, Megatron tensor parallelism on 4 devices x data parallelism on 2.
    mesh = jax.make_mesh((2, 4), ("data", "model"))
    model = TinyLM()
    jphantom.parallelize(model, mesh, jphantom.plans.megatron(model))
    parallel = train(model, mesh, steps)
    gap = max(abs(a - b) for a, b in zip(single, parallel))
    print(f"loss, one device:      {single[0]:.4f} -> {single[-1]:.4f}")
    print(f"loss, data=2,model=4:  {parallel[0]:.4f} -> {parallel[-1]:.4f}")
    print(f"largest difference over {steps} steps: {gap:.2e}")
    return 0 if gap < 1e-3 else 1


if __name__ == "__main__":
    sys.exit(main(int(sys.argv[1]) if len(sys.argv) > 1 else 20))
