"""The torch modules' sizes and index types as torch types them, the TT bag's width (the one
asked, as FBTT keeps it), and ``HostEmbeddingBag.prefetch`` on the CPU (a checked no-op, as
``HostTable.prefetch`` with NumPy indices)."""

import warnings

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from xferlib.adapters.torch import (  # noqa: E402
    HostEmbedding, HostEmbeddingBag, TableBatchedTTEmbeddingBag, TTEmbeddingBag)

# ----------------------------------------------------------------------------- TT width


def test_tt_bag_keeps_the_asked_width():
    # It returned rows 200 wide: the width was rounded up to balance its factors (5 x 5 x 8).
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # kept, so nothing to warn about
        bag = TTEmbeddingBag(1_000_000, 128, tt_ranks=[16, 16])
    assert bag.embedding_dim == 128 and bag.tt_q_shapes == [4, 4, 8]
    out = bag(torch.tensor([1, 999_999, 5]), torch.tensor([0, 2, 3]))
    assert out.shape == (2, 128)


@pytest.mark.parametrize("enforce", [False, True])
@pytest.mark.parametrize("dim", [96, 100, 128, 16, 7])
def test_tt_bag_width_whatever_enforce_embedding_dim_says(dim, enforce):
    # FBTT's flag only allows its factorization to round the width up, after which FBTT's own
    # assertion prod(q) == embedding_dim fails: the width is never changed, with or without it
    bag = TTEmbeddingBag(1000, dim, [4, 4], None, None, enforce_embedding_dim=enforce,
                         use_cache=False)
    assert bag.embedding_dim == dim and int(np.prod(bag.tt_q_shapes)) == dim
    assert bag(torch.tensor([0, 999]), torch.tensor([0, 1, 2])).shape == (2, dim)


def test_table_batched_tt_keeps_the_width():
    tables = TableBatchedTTEmbeddingBag(2, 1000, 96, [4, 4], use_cache=False)
    assert tables.embedding_dim == 96
    assert tables(torch.tensor([1, 2]), torch.tensor([0, 1, 2])).shape == (2, 1, 96)


def test_tt_bag_given_q_shapes_must_multiply_to_the_width():
    with pytest.raises(ValueError, match=r"prod\(tt_q_shapes\) = 100 != embedding_dim 96"):
        TTEmbeddingBag(1000, 96, [4, 4], [10, 10, 10], [4, 5, 5], use_cache=False)


# ----------------------------------------------------------------------------- TT sizes


@pytest.mark.parametrize("args, kwargs, message", [
    ((10.7, 4, [2, 2]), {}, "num_embeddings must be an integer, got float 10.7"),
    (("1000", 4, [2, 2]), {}, "num_embeddings must be an integer, got str '1000'"),
    ((1000, 16.0, [2, 2]), {}, "embedding_dim must be an integer, got float 16.0"),
    ((1000, 16, [2, 2.5]), {}, r"tt_ranks must hold integers.*float 2.5 at position 1"),
    ((1000, 16, [2, 2], [10, 10, 10.0]), {}, r"tt_p_shapes must hold integers"),
    ((1000, 16, [2, 2], None, [2, 2, 4.0]), {}, r"tt_q_shapes must hold integers"),
    ((1000, 16, [2, 2]), {"cache_size": 100.5}, "cache_size must be an integer"),
    ((1000, 16, [2, 2]), {"hashtbl_size": 1e4}, "hashtbl_size must be an integer"),
])
def test_tt_bag_refuses_non_integral_sizes(args, kwargs, message):
    with pytest.raises(TypeError, match=message):
        TTEmbeddingBag(*args, **kwargs)


def test_table_batched_tt_refuses_non_integral_table_count():
    with pytest.raises(TypeError, match="num_tables must be an integer, got float 2.0"):
        TableBatchedTTEmbeddingBag(2.0, 100, 8, [3], use_cache=False)


def test_tt_bag_takes_numpy_integer_sizes():
    bag = TTEmbeddingBag(np.int64(1000), np.int32(16), [np.int64(4), 4], use_cache=False)
    assert bag.num_embeddings == 1000 and bag.embedding_dim == 16


@pytest.mark.parametrize("dtype", [torch.int8, torch.uint8, torch.int16, torch.bool,
                                   torch.float32])
def test_tt_bag_refuses_indices_other_than_int32_int64(dtype):
    # int8 / uint8 indices were cast and looked up; torch's bags take int32 and int64 only
    bag = TTEmbeddingBag(1000, 16, [4, 4], use_cache=False)
    before = [c.detach().clone() for c in bag.tt_cores]
    wanted = "must be an integer tensor of dtype int32 or int64"
    with pytest.raises(TypeError, match=f"indices {wanted}.*{dtype}"):
        bag(torch.tensor([1, 2, 3]).to(dtype), torch.tensor([0, 1, 3])).sum().backward()
    with pytest.raises(TypeError, match=f"offsets {wanted}.*{dtype}"):
        bag(torch.tensor([1, 2, 3]), torch.tensor([0, 1, 3]).to(dtype))
    assert all(torch.equal(a, b) for a, b in zip(before, bag.tt_cores))


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_tt_bag_takes_int32_and_int64(dtype):
    bag = TTEmbeddingBag(1000, 16, [4, 4], use_cache=False, seed=0)
    out = bag(torch.tensor([1, 2, 3], dtype=dtype), torch.tensor([0, 1, 3], dtype=dtype))
    assert out.shape == (2, 16)


# ----------------------------------------------------------------------------- host modules


@pytest.mark.parametrize("module", [HostEmbeddingBag, HostEmbedding])
@pytest.mark.parametrize("args, message", [
    ((10.7, 4), "num_embeddings must be an integer, got float 10.7"),
    (("10", 4), "num_embeddings must be an integer, got str '10'"),
    ((10, 4.9), "embedding_dim must be an integer, got float 4.9"),
    ((True, 4), "num_embeddings must be an integer, got bool True"),
])
def test_host_modules_refuse_non_integral_sizes_as_torch(module, args, message):
    with pytest.raises(TypeError):
        torch.nn.EmbeddingBag(*args)  # what torch does with the same sizes
    with pytest.raises(TypeError, match=message):
        module(*args, device="cpu")


def test_host_modules_refuse_non_integral_padding_idx_and_cache_rows():
    with pytest.raises(TypeError, match="padding_idx must be an integer, got float 2.5"):
        HostEmbeddingBag(10, 4, padding_idx=2.5, device="cpu")
    with pytest.raises(TypeError, match="cache_rows must be an integer, got float 8.5"):
        HostEmbeddingBag(10, 4, cache_rows=8.5, device="cpu")


def test_host_modules_take_numpy_integer_sizes():
    bag = HostEmbeddingBag(np.int64(10), np.int32(4), device="cpu")
    assert (bag.num_embeddings, bag.embedding_dim) == (10, 4)


def test_host_bag_prefetch_on_the_cpu_is_a_checked_no_op():
    bag = HostEmbeddingBag(10, 4, optimizer="sgd", device="cpu", seed=0)
    before = bag.table.numpy().copy()
    idx, offsets = torch.tensor([1, 2, 2]), torch.tensor([0, 1])
    assert bag.prefetch(idx, offsets) is None
    np.testing.assert_array_equal(bag.table.numpy(), before)
    assert bag(idx, offsets).shape == (2, 4)
    with pytest.raises(TypeError, match="int32 or int64"):  # checked, as the forward checks it
        bag.prefetch(idx.float(), offsets)
