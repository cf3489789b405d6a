"""needle_torch.fast.v3: generation with compiled decoding steps is the plain cached generation (tokens exactly, each
step's float32 logits within the float32 budget) on upstream's tiny fixture: left-padded rows, local rings of 8
slots wrapped several times, engram sites, and a second request reusing the compiled graphs."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import convert
from convert.registry import family_named
from needle_torch.fast import v3 as fast_v3
from needle_torch.v3 import SimpleAttentionNetwork
from needle_torch.v3.generate import generate
from tests.torch_threads import torch_threads
from tests.v3 import goldens

F32_REL = goldens.F32_REL  # 1e-5 per step: compiled graphs reorder float32 sums, nothing else
GRAPHS = pytest.mark.xdist_group("torch-v3-compiled")  # the tests share one model's compiled graphs


@pytest.fixture(scope="module")
def model():
    g = goldens.load("needle-v3-tiny")
    cfg = g.config_for("float32")
    sd = convert.flax_to_torch(g.params, cfg)
    net = SimpleAttentionNetwork(cfg, groups=family_named("v3").groups_in(sd, "torch", cfg))
    net.load_state_dict(sd, strict=True)
    with torch_threads(1):
        yield net.eval()


def prompts(model, seed: int) -> torch.Tensor:
    rng = np.random.default_rng(seed)
    batch = np.zeros((3, 20), np.int64)
    for i, n in enumerate((20, 13, 5)):  # left-padded: 5 tokens < window 8 < 13 < 20
        batch[i, 20 - n:] = rng.integers(4, model.config.vocab_size, n)
    return torch.from_numpy(batch)


def step_rel(a: torch.Tensor, ref: torch.Tensor) -> float:
    return max(goldens.rel(a[:, k].numpy(), ref[:, k].numpy()) for k in range(ref.shape[1]))


@GRAPHS
@pytest.mark.slow  # the first test compiles the layer graphs: a minute or two on 2 busy cores
@pytest.mark.parametrize("seed", [0, 1])  # the second request reuses the first one's graphs
def test_compiled_steps_give_the_plain_tokens_and_logits(model, seed):
    tokens = prompts(model, seed)
    ref, ref_logits = generate(model, tokens, 30, eos_token_id=None, return_logits=True)
    out, logits = fast_v3.generate(model, tokens, 30, eos_token_id=None, return_logits=True)
    torch.testing.assert_close(out, ref, rtol=0, atol=0)
    assert step_rel(logits, ref_logits) <= F32_REL


@GRAPHS
def test_compiled_steps_stop_rows_at_eos_as_the_plain_loop(model):
    tokens = prompts(model, 0)
    ref = generate(model, tokens, 30)
    eos = int(ref[0, 3])  # a token the first row makes: that row stops there, the others may not
    torch.testing.assert_close(fast_v3.generate(model, tokens, 30, eos_token_id=eos),
                               generate(model, tokens, 30, eos_token_id=eos), rtol=0, atol=0)
