"""DraftTree: building a batch from host lists validates it; depths and masks per shape."""

from __future__ import annotations

import pytest
import torch

from drafters.tree import DraftTree, ancestor_mask_of, chain, row_shape


def test_batch_from_lists_has_offsets_depths_and_probs():
    trees = [([5, 6, 7], [-1, 0, 0]), ([], []), chain([1, 2])]
    probs = [torch.full((3, 10), 0.1), None, None]
    t = DraftTree.from_lists(trees, probs, vocab_size=10)
    assert t.offsets == (0, 3, 3, 5) and t.sizes() == [3, 0, 2]
    assert t.tokens.tolist() == [5, 6, 7, 1, 2]
    assert t.depths.tolist() == [1, 2, 2, 1, 2]
    assert t.stochastic.tolist() == [True] * 3 + [False] * 2
    assert t.seq(2) == ([1, 2], [-1, 0])


@pytest.mark.parametrize("trees, vocab, message", [
    ([([1, 2], [-1])], None, "one parent per node"),
    ([([1, 2], [-1, 1])], None, "parents must come first"),
    ([([1, 2], [0, -1])], None, "parents must come first"),
    ([([3, 3], [-1, -1])], None, "proposed twice"),
    ([([4, 1, 4], [-1, 0, 0])], None, None),  # the same token under different parents is fine
    ([([1, -2], [-1, 0])], None, "outside the vocabulary"),
    ([([1, 10], [-1, 0])], 10, "outside the vocabulary"),
])
def test_invalid_trees_are_refused(trees, vocab, message):
    if message is None:
        DraftTree.from_lists(trees, vocab_size=vocab)
        return
    with pytest.raises(ValueError, match=message):
        DraftTree.from_lists(trees, vocab_size=vocab)


def test_depths_and_masks_per_shape():
    pars = [-1, 0, 0, 1, -1]
    assert row_shape(pars).offsets == (0, 1, 2, 2, 3, 1)
    mask = ancestor_mask_of(pars)
    assert mask.shape == (6, 6)
    # Node 3 (row 4) sees the root, node 0, node 1 and itself.
    assert mask[4].tolist() == [True, True, True, False, True, False]
    assert mask[5].tolist() == [True, False, False, False, False, True]


@pytest.mark.parametrize("pars", [[], [-1], [-1, 0, 1, 2], [-1, 0, 0, 1, -1]])
def test_row_shape_matches_depths_and_mask(pars):
    shape = row_shape(pars)
    depths = tuple(DraftTree.from_lists([(list(range(len(pars))), pars)]).depths.tolist())
    assert shape.offsets == (0, *depths)
    assert shape.logits_rows == tuple(range(1 + len(pars)))
    assert shape.depth == max(depths, default=0)
    if pars:
        assert shape.mask is ancestor_mask_of(pars)  # the shared cached mask
    else:
        assert shape.mask is None  # a bare root attends causally to its context alone
    assert row_shape(list(pars)) is row_shape(tuple(pars))


def test_row_shape_refuses_a_child_before_its_parent():
    with pytest.raises(ValueError, match="parents must come first"):
        row_shape([1, -1])


def test_host_lists_match_the_tensors():
    trees = [([5, 6, 7], [-1, 0, 0]), ([], []), ([9, 4], [-1, 0])]
    tree = DraftTree.from_lists(trees)
    assert tree.host_lists() == (tree.tokens.tolist(), tree.parents.tolist())
    bare = DraftTree(tree.tokens, tree.parents, tree.depths, tree.offsets)  # no host lists
    assert bare.host_lists() == tree.host_lists()
    assert bare == tree  # the host lists are a cache, not part of the tree's value


def test_repeated_siblings_are_refused_after_a_chain_of_the_same_size():
    DraftTree.from_lists([([1, 2, 3], [-1, 0, 1])])  # a chain: siblings never checked
    with pytest.raises(ValueError, match="proposed twice"):
        DraftTree.from_lists([([1, 1, 3], [-1, -1, 0])])
