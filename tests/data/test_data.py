"""Seal et al.'s teacher data: deterministic, split, sharded on demand."""

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jphantom.data import Teacher, TeacherConfig
from jphantom.errors import ConfigError


def test_targets_are_relu_w_relu_x_and_batches_are_reproducible():
    teacher = Teacher(TeacherConfig(width=16, train_size=64, eval_size=8, seed=3))
    x, y = teacher.train_batch(2, 8)
    want = jax.nn.relu(jax.nn.relu(x) @ teacher.weight.T) / 4.0
    np.testing.assert_allclose(y, want, rtol=1e-5)
    again = Teacher(TeacherConfig(width=16, train_size=64, eval_size=8, seed=3)).train_batch(2, 8)
    np.testing.assert_array_equal(x, again[0])
    # Sample identity does not depend on batch size: samples 16..23 are batch 1 of size 16, second half.
    np.testing.assert_array_equal(teacher.train_batch(1, 16)[0][8:], teacher.train_batch(3, 8)[0])


def test_train_and_eval_splits_differ_and_eval_covers_its_split():
    teacher = Teacher(TeacherConfig(width=8, train_size=32, eval_size=10))
    assert not np.allclose(teacher.batch("train", 0, 4)[0], teacher.batch("eval", 0, 4)[0])
    assert sum(x.shape[0] for x, _ in teacher.eval_batches(4)) == 10


def test_batches_can_be_generated_sharded(mesh_of):
    mesh = mesh_of(4)
    sharding = NamedSharding(mesh, P(None, "model"))
    teacher = Teacher(TeacherConfig(width=16))
    x, y = teacher.train_batch(0, 8, sharding)
    assert x.sharding.is_equivalent_to(sharding, 2)
    np.testing.assert_allclose(x, teacher.train_batch(0, 8)[0])


def test_bad_config_is_an_error():
    with pytest.raises(ConfigError, match="train_size=0"):
        TeacherConfig(width=8, train_size=0)
    with pytest.raises(ConfigError, match="split='test'"):
        Teacher(TeacherConfig(width=8)).batch("test", 0, 2)
