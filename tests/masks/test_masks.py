import pytest
import torch

from multihead import masks
from ref64 import causal_keep, window_keep


def dense(mask, shape=(1, 1, 2, 5), dtype=torch.float32):
    return mask.materialize(shape, device=torch.device("cpu"), dtype=dtype)


def test_causal_pictures_match_the_docstring():
    bottom = dense(masks.causal()).keep.int().tolist()
    top = dense(masks.causal("top_left")).keep.int().tolist()
    assert bottom == [[1, 1, 1, 1, 0], [1, 1, 1, 1, 1]]
    assert top == [[1, 0, 0, 0, 0], [1, 1, 0, 0, 0]]
    assert "1 1 1 1 0" in masks.__doc__ and "1 0 0 0 0" in masks.__doc__


@pytest.mark.parametrize("lq,lk", [(3, 3), (2, 5), (5, 2), (1, 7)])
@pytest.mark.parametrize("align", ["bottom_right", "top_left"])
def test_causal_matches_definition(lq, lk, align):
    got = dense(masks.causal(align), (1, 1, lq, lk)).keep
    assert torch.equal(got, causal_keep(lq, lk, align))


def test_alignments_agree_when_lengths_are_equal():
    a = dense(masks.causal("bottom_right"), (1, 1, 4, 4)).keep
    b = dense(masks.causal("top_left"), (1, 1, 4, 4)).keep
    assert torch.equal(a, b) and torch.equal(a, torch.ones(4, 4).tril().bool())


@pytest.mark.parametrize("left,right", [(0, 0), (1, 0), (2, 1), (None, 0), (1, None), (0, 3)])
@pytest.mark.parametrize("lq,lk", [(4, 4), (3, 6), (6, 3)])
@pytest.mark.parametrize("align", ["bottom_right", "top_left"])
def test_window_matches_definition(left, right, lq, lk, align):
    got = dense(masks.window(left, right, align=align), (1, 1, lq, lk)).keep
    assert torch.equal(got, window_keep(lq, lk, left, right, align))


def test_window_unbounded_left_is_causal():
    assert torch.equal(dense(masks.window(None, 0), (1, 1, 3, 6)).keep, dense(masks.causal(), (1, 1, 3, 6)).keep)


@pytest.mark.parametrize("left,right", [(-1, 0), (0, -2)])
def test_window_rejects_negative_sizes(left, right):
    with pytest.raises(ValueError, match="must be >= 0"):
        masks.window(left, right)


def test_window_rejects_non_int():
    with pytest.raises(TypeError, match="window left must be an int"):
        masks.window(1.5)


def test_bad_alignment():
    with pytest.raises(ValueError, match="align must be one of"):
        masks.causal("middle")


def test_key_padding_broadcasts_over_heads_and_queries():
    kp = torch.tensor([[True, True, False], [True, False, False]])
    t = dense(masks.key_padding(kp), (2, 4, 5, 3))
    assert t.bias is None
    full = t.keep.expand(2, 4, 5, 3)
    assert torch.equal(full[:, 3, 4], kp) and torch.equal(full[1, 0, 0], kp[1])


def test_keep_and_keep_is_logical_and():
    a = torch.tensor([[True, False, True]])
    b = torch.tensor([[True, True, False]])
    t = dense(masks.keep(a) & masks.keep(b), (1, 1, 1, 3))
    assert t.keep.tolist() == [[True, False, False]] and t.bias is None


def test_bias_and_bias_is_sum_and_bias_and_keep_keeps_both():
    b1 = torch.tensor([[0.5, -1.0, 2.0]])
    b2 = torch.tensor([[1.0, 1.0, 1.0]])
    k = torch.tensor([[True, False, True]])
    t = dense(masks.bias(b1) & masks.bias(b2), (1, 1, 1, 3))
    assert torch.equal(t.bias, b1 + b2) and t.keep is None
    t = dense(masks.bias(b1) & masks.keep(k), (1, 1, 1, 3))
    assert torch.equal(t.bias, b1) and torch.equal(t.keep, k)


def test_tensors_compose_with_masks_on_either_side():
    k = torch.tensor([[True, False, True, True, True], [True] * 5])
    left = dense(k & masks.causal())
    right = dense(masks.causal() & k)
    expect = k & causal_keep(2, 5)
    assert torch.equal(left.keep, expect) and torch.equal(right.keep, expect)


def test_as_mask_reads_dtype():
    assert isinstance(masks.as_mask(torch.ones(2, 2, dtype=torch.bool)), masks.Keep)
    assert isinstance(masks.as_mask(torch.zeros(2, 2)), masks.Bias)
    assert masks.as_mask(None) is None


@pytest.mark.parametrize("dtype", [torch.int64, torch.uint8, torch.int32])
def test_integer_masks_are_refused_with_the_convention(dtype):
    with pytest.raises(TypeError, match="True = this query may attend.*nn.MultiheadAttention"):
        masks.as_mask(torch.ones(2, 2, dtype=dtype))


def test_bias_is_cast_to_query_dtype():
    t = dense(masks.bias(torch.zeros(1, 3, dtype=torch.float64)), (1, 1, 1, 3), dtype=torch.bfloat16)
    assert t.bias.dtype == torch.bfloat16


def test_check_rejects_other_device():
    m = masks.keep(torch.ones(2, 5, dtype=torch.bool, device="meta"))
    with pytest.raises(ValueError, match="is on meta but the query is on cpu"):
        m.check((1, 1, 2, 5), torch.device("cpu"))


def test_check_rejects_non_broadcastable_shape():
    m = masks.keep(torch.ones(3, 5, dtype=torch.bool))
    with pytest.raises(ValueError, match=r"does not broadcast to \(B, H, Lq, Lk\) = \(1, 1, 2, 5\)"):
        m.check((1, 1, 2, 5), torch.device("cpu"))


def test_key_padding_shape_checked():
    m = masks.key_padding(torch.ones(2, 4, dtype=torch.bool))
    with pytest.raises(ValueError, match=r"must be \(B, Lk\) = \(2, 5\)"):
        m.check((2, 1, 3, 5), torch.device("cpu"))
    with pytest.raises(TypeError, match="True for real tokens"):
        masks.key_padding(torch.ones(2, 4))


def test_from_torch_inverts_bool_and_keeps_float():
    blocked = torch.tensor([[False, True], [False, False]])
    t = dense(masks.from_torch(attn_mask=blocked), (1, 1, 2, 2))
    assert torch.equal(t.keep, ~blocked)
    pad = torch.tensor([[False, True]])
    t = dense(masks.from_torch(key_padding_mask=pad), (1, 3, 2, 2))
    assert t.keep.expand(1, 3, 2, 2)[0, 2, 1].tolist() == [True, False]
    f = torch.tensor([[0.0, -1.0], [2.0, 0.0]])
    t = dense(masks.from_torch(attn_mask=f), (1, 1, 2, 2))
    assert torch.equal(t.bias, f) and t.keep is None


def test_from_torch_three_dim_mask_unflattens_heads():
    B, H = 2, 3
    blocked = torch.rand(B * H, 4, 4) > 0.5
    m = masks.from_torch(attn_mask=blocked)
    m.check((B, H, 4, 4), torch.device("cpu"))
    t = dense(m, (B, H, 4, 4))
    assert torch.equal(t.keep, ~blocked.view(B, H, 4, 4))


@pytest.mark.parametrize("make", [
    lambda: masks.causal(), lambda: masks.causal("top_left") & masks.window(3),
    lambda: masks.documents(torch.tensor([[0, 0, 0, 1, 1, 2, 2, 2, 2]])) & masks.causal(),
    lambda: masks.chunked_local(4) & masks.window(2, sinks=1),
])
def test_row_intervals_and_their_cover_agree_with_the_dense_keep(make):
    # what kernels read of the structural parts (flex's block masks, the tiles' states): every
    # key block's seen from the row intervals is any of the dense keep; covered implies all
    # (two intervals that cover a block together leave it partial: a keep mask, never a wrong
    # "full"), and is all where the rows have one interval
    m = make()
    shape = (1, 2, 9, 9)
    keep = m.materialize(shape, device=torch.device("cpu"), dtype=torch.float32).keep.expand(1, 9, 9)[0]
    ivs = m.row_intervals(shape)
    j = torch.arange(9)
    dense = torch.zeros(9, 9, dtype=torch.bool)
    for lo, hi in ivs:
        dense |= (j >= lo[0].unsqueeze(-1)) & (j < hi[0].unsqueeze(-1))
    assert torch.equal(dense, keep)
    k0 = torch.tensor([0, 2, 5, 8])
    k1 = torch.tensor([2, 5, 8, 9])
    seen, covered = masks.interval_cover([(lo.unsqueeze(-1), hi.unsqueeze(-1)) for lo, hi in ivs], k0, k1)
    for b, (a, z) in enumerate(zip(k0.tolist(), k1.tolist())):
        assert torch.equal(seen[0, :, b], keep[:, a:z].any(dim=-1))
        full = keep[:, a:z].all(dim=-1)
        assert not (covered[0, :, b] & ~full).any()
        if len(ivs) == 1:
            assert torch.equal(covered[0, :, b], full)
    for align in ("bottom_right", "top_left"):  # Lq == Lk, and documents with the same ids on both sides
        assert torch.equal(m.row_diagonals(shape, align)[0], torch.arange(9))
    if isinstance(m.parts[0], masks.Documents):  # queries of 2 documents against keys of 3: per document
        docs = masks.documents(torch.tensor([[0, 0, 1, 1]]), torch.tensor([[0, 0, 0, 1, 1, 1]]))
        assert docs.row_diagonals((1, 1, 4, 6), "bottom_right")[0].tolist() == [1, 2, 4, 5]
        assert docs.row_diagonals((1, 1, 4, 6), "top_left")[0].tolist() == [0, 1, 3, 4]


def test_every_kind_declares_its_role():
    """One taxonomy: kernels and explanations read `Mask.role`, never a list of kinds."""
    t = torch.ones(2, 2)
    want = {
        "select": [masks.causal(), masks.window(1), masks.chunked_local(2), masks.documents(torch.tensor([0, 0])),
                   masks.keep(t.bool()), masks.key_padding(torch.ones(1, 2, dtype=torch.bool)),
                   masks.mask_mod(lambda b, h, q, kv: q >= kv), masks.from_torch(t.bool())],
        "add": [masks.bias(t), masks.alibi([0.5]), masks.from_torch(torch.zeros(2, 2, 2))],
        "modify": [masks.softcap(5.0), masks.score_mod(lambda s, b, h, q, kv: s)],
        "denominator": [masks.sink(torch.zeros(1))],
    }
    assert tuple(want) == masks.ROLES
    for role, ms in want.items():
        for m in ms:
            assert [p.role for p in m.parts] == [role], repr(m)


#: multihead.masks' files in import order: each may import only the files before it
PACKAGE_ORDER = ("geometry", "core", "plans", "structural", "tensors", "programmable", "scores", "convert")


def test_the_package_imports_point_one_way_and_never_from_inside_a_function():
    """Issue 23: masks is a package by concept whose imports point one way; nothing in it imports
    inside a function (no lazy import of a module that would import masks back)."""
    import ast
    import pathlib

    folder = pathlib.Path(masks.__file__).parent
    files = {p.stem for p in folder.glob("*.py")} - {"__init__"}
    assert files == set(PACKAGE_ORDER), "a new file in multihead/masks: place it in PACKAGE_ORDER"
    for rank, name in enumerate(PACKAGE_ORDER):
        tree = ast.parse((folder / f"{name}.py").read_text(encoding="utf-8"))
        for node in tree.body:
            if isinstance(node, ast.ImportFrom) and node.level:
                assert node.level == 1 and node.module in PACKAGE_ORDER[:rank], (
                    f"masks/{name}.py imports .{'.' * (node.level - 1)}{node.module}: only {PACKAGE_ORDER[:rank]}")
            elif isinstance(node, ast.ImportFrom):
                assert not (node.module or "").startswith("multihead"), (name, node.module)
        inner = [n for f in ast.walk(tree) if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))
                 for n in ast.walk(f) if isinstance(n, (ast.Import, ast.ImportFrom))]
        assert not inner, f"masks/{name}.py imports inside a function at line {inner[0].lineno}"


def test_materialize_is_the_block_of_the_whole_call():
    """One build path: the dense tensors are the block over every query and key, the keep with
    the axes of the widest selecting part (a causal part alone: (Lq, Lk))."""
    ids = torch.tensor([[0, 0, 1, 1, 1], [0, 1, 1, 1, 1]])
    cases = [masks.causal(), masks.window(1) & masks.key_padding(torch.tensor([[True] * 4 + [False]] * 2)),
             masks.documents(ids) & masks.alibi([0.5, 0.25]) & masks.causal(),
             masks.mask_mod(lambda b, h, q, kv: kv % 2 == 0) & masks.bias(torch.randn(5, 5))]
    cpu = torch.device("cpu")
    for m in cases:
        shape = (2, 2, 5, 5)
        dense = m.materialize(shape, device=cpu, dtype=torch.float64)
        tile = m.block(0, 5, 0, 5, shape, device=cpu, dtype=torch.float64)
        for got, whole in ((dense.keep, tile.keep), (dense.bias, tile.bias)):
            if got is None:
                assert whole is None, repr(m)
                continue
            want = torch.ones(shape, dtype=got.dtype) if whole is None else whole.expand(shape)
            assert torch.equal(got.expand(shape), want), repr(m)
    assert masks.causal().materialize((1, 1, 2, 3), device=cpu, dtype=torch.float32).keep.shape == (2, 3)
