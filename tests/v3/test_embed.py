"""Needle 3's text embeddings and prompt scores in both twins (needle_{torch,flax}.v3.embed: `embed`, `scores`)
against upstream's heads.

Goldens: tests/data/v3/needle-v3-tiny.text.npz (tools/upstream_goldens.py text_goldens(), command beside it):
upstream's tokenizer on six texts and a rendered prompt, then upstream's forward_embedding, forward_confidence and
forward_router (float32) on `[BOS] + ids`, right-padded.
"""

from __future__ import annotations

import json
from pathlib import Path

import jax
import numpy as np
import pytest
import torch

from convert.errors import TokenizerError
from convert.v3 import chat
from convert.v3.embedding import ROUTER_NAMES, cosine_similarities, prompt_scores
from needle_flax.v3 import embed as flax_embed
from needle_flax.v3 import scores as flax_scores
from needle_torch.v3 import embed as torch_embed
from needle_torch.v3 import scores as torch_scores
from tests.torch_threads import torch_threads
from tests.v3 import goldens
from tests.v3.test_generate import flax_model, torch_model

torch.set_float32_matmul_precision("highest")  # float32 parity: no reduced-precision passes
jax.config.update("jax_default_matmul_precision", "highest")  # as upstream's goldens were made

DATA = Path(__file__).resolve().parents[1] / "data" / "v3"
TEXT = np.load(DATA / "needle-v3-tiny.text.npz")
TEXTS = json.loads(str(TEXT["texts_json"]))
EMBED_ABS = 1e-5  # the acceptance bound for unit vectors in float32 (components ≤ 1)
F32_REL = goldens.F32_REL  # 1e-5 relative (max|Δ| / max|ref|) for the confidence and router outputs
TWINS = ("torch", "flax")


@pytest.fixture(scope="module")
def fx():
    g = goldens.load("needle-v3-tiny")
    cfg = g.config_for("float32")
    with torch_threads(1):
        yield {"torch": torch_model(g.params, cfg), "flax": flax_model(g.params, cfg),
               "tok": chat.load_chat_tokenizer(DATA / "needle-v3-tiny.spm.model", vocab_size=cfg.vocab_size)}


def vectors(fx, twin, texts):
    if twin == "torch":
        return torch_embed(fx["torch"], fx["tok"], texts).numpy()
    model, params = fx["flax"]
    return np.asarray(flax_embed(model, params, fx["tok"], texts))


@pytest.mark.parametrize("twin", TWINS)
def test_embed_is_upstreams_forward_embedding(twin, fx):
    """Every text (plain, non-ASCII, empty, whitespace, a rendered prompt) in one batch, and (torch; in Flax each
    batch shape costs a compilation) one text alone."""
    got = vectors(fx, twin, TEXTS)
    assert got.dtype == np.float32 and got.shape == TEXT["f32/embedding"].shape
    assert np.abs(got - TEXT["f32/embedding"]).max() <= EMBED_ABS
    if twin == "torch":
        alone = vectors(fx, twin, [TEXTS[2]])
        assert np.abs(alone[0] - TEXT["f32/embedding_alone"][2]).max() <= EMBED_ABS
    np.testing.assert_allclose(np.linalg.norm(got, axis=-1), 1.0, atol=1e-5)  # unit vectors: upstream normalises


def test_the_ids_are_upstreams_tokenizer_with_bos(fx):
    from convert.v3.embedding import embedding_ids
    np.testing.assert_array_equal(embedding_ids(fx["tok"], TEXTS, 64), TEXT["tokens"])


def test_cosine_similarities_of_upstreams_vectors():
    v = TEXT["f32/embedding"].astype(np.float64)
    sims = cosine_similarities(v)
    np.testing.assert_allclose(np.diag(sims), 1.0, atol=1e-12)
    np.testing.assert_allclose(sims, v @ v.T, atol=1e-6)  # upstream's vectors are unit length to float32 rounding
    assert sims[0, 1] != sims[0, 2]


@pytest.mark.parametrize("twin", TWINS)
def test_scores_are_upstreams_confidence_and_router(twin, fx):
    """Prompt rows given left-padded (as generate takes them): the heads read each prompt right-padded."""
    tokens, lengths = TEXT["tokens"], TEXT["lengths"]
    left = np.zeros_like(tokens)
    for i, n in enumerate(lengths):
        left[i, tokens.shape[1] - n:] = tokens[i, :n]
    if twin == "torch":
        confidence, router = (t.numpy() for t in torch_scores(fx["torch"], left))
    else:
        confidence, router = (np.asarray(t) for t in flax_scores(*fx["flax"], left))
    assert goldens.rel(confidence, TEXT["f32/confidence"]) <= F32_REL
    assert goldens.rel(router, TEXT["f32/router"]) <= F32_REL
    rows = prompt_scores(confidence, router)
    assert list(rows[0]["router"]) == list(ROUTER_NAMES) and rows[0]["confidence"] == pytest.approx(confidence[0])


@pytest.mark.parametrize("bad, message", [("one text", "list of strings"), ([], "non-empty"), ([3], "not a string")])
def test_bad_texts_name_the_problem(fx, bad, message):
    with pytest.raises(TokenizerError, match=message):
        torch_embed(fx["torch"], fx["tok"], bad)
