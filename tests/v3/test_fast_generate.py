"""generate(..., compile=True) (needle_torch.fast.v3: the one-token steps' engram, runs of layers and logits compiled
graphs of the plain pieces, few-row products as multiply-and-sums) is the plain cached generation: tokens exactly,
each step's float32 logits within the float32 budget.

The model is the smallest with both graph kinds, one local and one global layer (random weights, std 0.2, sampled hot
so the fed tokens vary), with left-padded rows, an engram site, conv taps and a local ring of 4 slots that 20 new
tokens wrap several times. One module-wide model, so its graphs compile once (dynamo and inductor: tens of seconds
of CPU); a second request of the same shapes compiles nothing."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch._dynamo.utils import counters

import convert
from convert.v3 import TransformerConfig
from needle_torch.fast.kernels import CompileFallbackWarning
from needle_torch.fast.v3 import run_length
from needle_torch.v3 import SimpleAttentionNetwork
from tests.torch_threads import torch_threads
from tests.v3 import goldens

F32_REL = goldens.F32_REL  # 1e-5 per step: a compiled graph reorders float32 sums, nothing else
G = 20  # new tokens: the local ring (4 slots) wraps five times
pytestmark = pytest.mark.xdist_group("torch-v3-compiled")  # the tests share one model's compiled graphs


@pytest.fixture(scope="module")
def model():
    cfg = TransformerConfig(vocab_size=97, d_model=32, num_heads=4, num_kv_heads=2, num_layers=2, qk_head_dim=8,
                            v_head_dim=12, sliding_window=4, global_layers=(1,), qkv_conv_taps=3, engram_layers=(0,),
                            engram_slots=37, mhc_lanes=2, max_seq_len=40, dtype="float32")
    net = SimpleAttentionNetwork(cfg, groups=())
    net.load_state_dict(convert.flax_to_torch(convert.random_flax_params(cfg, seed=1, std=0.2, groups=()), cfg))
    with torch_threads(1):
        yield net.eval()


def prompts(seed: int) -> torch.Tensor:
    """(3, 12) left-padded: 12, 7 (longer than the window) and 3 tokens."""
    g = torch.Generator().manual_seed(seed)
    batch = torch.zeros(3, 12, dtype=torch.long)
    for i, n in enumerate((12, 7, 3)):
        batch[i, 12 - n:] = torch.randint(4, 97, (n,), generator=g)
    return batch


def step_rel(a: torch.Tensor, ref: torch.Tensor) -> float:
    return max(goldens.rel(a[:, k].numpy(), ref[:, k].numpy()) for k in range(ref.shape[1]))


def graphs() -> int:
    return counters["stats"]["unique_graphs"]  # dynamo's count of graphs it has compiled in this process


def test_compiled_steps_give_the_plain_tokens_and_logits(model):
    kw = dict(eos_token_id=None, return_logits=True, temperature=5.0, seed=3)
    before = graphs()
    for request in (0, 1):
        tokens = prompts(request)
        ref, ref_logits = model.generate(tokens, G, **kw)
        out, logits = model.generate(tokens, G, compile=True, **kw)
        torch.testing.assert_close(out, ref, rtol=0, atol=0)
        assert step_rel(logits, ref_logits) <= F32_REL
        assert len(torch.unique(out)) > 10, "hot sampling should vary the fed tokens"
        if request == 0:
            first = graphs()
    assert 1 <= first - before <= 3, "the engram, one run of both layers, the logits (unless an earlier test made them)"
    assert graphs() == first, "a second request of the same shapes reuses the graphs"


def test_compiled_steps_stop_rows_at_eos_as_the_plain_loop(model):
    tokens = prompts(0)
    free = model.generate(tokens, G, eos_token_id=None)
    eos = int(free[0, 3])  # a token row 0 makes: that row stops there, the others run on or stop where they meet it
    ref = model.generate(tokens, G, eos_token_id=eos)
    assert (ref[0, 4:] == 0).all()
    torch.testing.assert_close(model.generate(tokens, G, eos_token_id=eos, compile=True), ref, rtol=0, atol=0)


@pytest.mark.slow  # a kv window changes both layers' graphs: another ~40 s of compiling
def test_compiled_steps_under_a_kv_window_with_sinks(model):
    """The global layer's sink store (fed by selection, so the step traces as one graph) and the windowed masks."""
    tokens = prompts(0)
    sink = torch.zeros_like(tokens)
    sink[:, 2], sink[0, 0] = 1, 1  # past the window of 6 for most steps; row 0's first prompt token too
    kw = dict(eos_token_id=None, return_logits=True, temperature=5.0, seed=3, kv_window=6, sink=sink.numpy())
    ref, ref_logits = model.generate(tokens, G, **kw)
    with warnings.catch_warnings():
        warnings.simplefilter("error", CompileFallbackWarning)  # compiled, not the eager fallback
        out, logits = model.generate(tokens, G, compile=True, **kw)
    torch.testing.assert_close(out, ref, rtol=0, atol=0)
    assert step_rel(logits, ref_logits) <= F32_REL


def test_layers_run_in_the_shortest_run_of_kinds_that_tiles_the_stack():
    L, G = "local", "global"
    assert run_length([L, L, L, L, G] * 4) == 5  # the default config: one graph, called 4 times a step
    assert run_length([L, G]) == 2
    assert run_length([L] * 6) == 1
    assert run_length([L, L, G] * 3, longest=2) == 1  # a longer period: a graph per layer
    assert run_length([L, G, L, L]) == 4  # the whole stack is a run
    assert run_length([L, G, L, L, L, G]) == 1  # no run of at most 5 tiles it
