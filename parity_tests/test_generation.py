"""The generation section of the parity report: `generation_parity` on the upstream fixture, and on a broken twin."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from convert.v1.config import SPECIAL_IDS
from parity_tests.devices import pinned_precision
from parity_tests.generation import first_diff_step
from parity_tests.inputs import Batch
from parity_tests.twins import build_twins
from parity_tests.v1.adapter import ADAPTER
from parity_tests.v1.runs import generation

SPECIAL = SPECIAL_IDS  # the fixtures' greedy loop never chose ids 0..5
F32_REL = 1e-5  # float32 twins of one function: ~5e-7 seen on these fixtures


@pytest.fixture(scope="module")
def twins_factory(fixture_checkpoint):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a tiny model: on shared cores a second thread only waits for the first
    with pinned_precision():  # restored afterwards
        yield lambda: build_twins(ADAPTER, fixture_checkpoint.config, fixture_checkpoint.params, "float32")
    torch.set_num_threads(threads)


def _batch(golden):
    return Batch({"src": golden["src"], "tgt": golden["tgt"]}, "upstream fixture")


def test_fixture_generation_section_is_identical_within_float32(twins_factory, golden):
    r = generation(twins_factory(), _batch(golden), 11, SPECIAL)
    assert r["first_diff_step"] is None and r["tokens_equal"] and r["rows_equal"] == 3
    assert r["torch_tokens"] == r["flax_tokens"] == golden["f32/greedy_tokens"].tolist()
    assert r["steps_compared"] == 11 and len(r["step_logits_max_rel"]) == 11
    assert r["logits_max_rel"] <= F32_REL
    assert r["flax_cached_vs_recompute_max_rel"] <= F32_REL and r["torch_cached_vs_recompute_max_rel"] <= F32_REL
    assert r["cached_equals_recompute_tokens"]


def test_a_broken_twin_is_caught_at_the_first_step_it_differs(twins_factory, golden):
    twins = twins_factory()
    chosen = int(golden["f32/greedy_tokens"][0, 1])  # row 0's first greedy pick (388)
    with torch.no_grad():
        twins.torch_model.embedding.weight[chosen] *= -1  # its tied output logit flips sign: torch cannot pick it
    r = generation(twins, _batch(golden), 5, SPECIAL)
    assert r["first_diff_step"] == 0 and not r["tokens_equal"]
    assert r["torch_tokens"][0][1] != chosen and r["flax_tokens"][0][1] == chosen
    assert r["steps_compared"] == 1  # later steps saw different inputs: their logits are not comparable
    assert r["logits_max_rel"] > 1e-2
    # each twin still agrees with its own recompute reference: the breakage is in the weights, not the cache
    assert r["flax_cached_vs_recompute_max_rel"] <= F32_REL and r["torch_cached_vs_recompute_max_rel"] <= F32_REL


def test_first_diff_step_pads_the_shorter_run():
    a = np.array([[1, 5, 6, 1], [1, 7, 1, 0]])
    assert first_diff_step(a, a.copy(), pad=0) is None
    assert first_diff_step(a, a[:, :3], pad=0) == 2  # a shorter run emits pad, row 0 chose EOS there
    assert first_diff_step(a[1:], a[1:, :3], pad=0) is None  # row 1 had already stopped: pad == pad
    assert first_diff_step(a, np.array([[1, 5, 9, 1], [1, 7, 1, 0]]), pad=0) == 1
