"""generate(..., compile=True) (needle_torch.fast.v3: the one-token steps' engram, runs of layers and logits compiled
graphs of the plain pieces, few-row products as multiply-and-sums) is the plain cached generation: tokens exactly,
each step's float32 logits within the float32 budget.

The model is the smallest with both graph kinds, one local and one global layer (random weights, std 0.2, sampled hot
so the fed tokens vary), with left-padded rows, an engram site, conv taps and a local ring of 4 slots that 20 new
tokens wrap several times. One module-wide model, so its graphs compile once (dynamo and inductor: tens of seconds
of CPU); a second request of the same shapes compiles nothing."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch._dynamo.utils import counters
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.weak import WeakIdKeyDictionary

import convert
import needle_torch.fast.v3 as fast_v3
from convert.v3 import TransformerConfig
from needle_torch.fast import kernels
from needle_torch.fast.kernels import CompileFallbackWarning
from needle_torch.fast.seam import fast_paths
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


# ----------------------------------------------------------------------------- bf16 products through float32 kernels


class ProductDtypes(TorchDispatchMode):
    """Collects the operand dtype of every product kernel (aten ops named *mm*) called inside it."""

    def __enter__(self):
        self.dtypes = []
        super().__enter__()
        return self.dtypes

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if "mm" in func.__name__:
            self.dtypes.append(args[0].dtype)
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("op", ["matmul", "operator", "bmm", "linear", "einsum", "einsum_list"])
def test_upcast_products_are_bf16_products_through_float32_kernels(upcast, op):
    """Each product of bf16 operands comes out in bf16, equal to the float64 product rounded once. Any float32
    evaluation is within 48·2⁻²⁴·(|a|·|b|) of it (48 terms, each product of bf16 values exact in float32),
    so each element lies between that interval's ends rounded to bf16 (one value for most elements)."""
    g = torch.Generator().manual_seed(0)
    a, b = (torch.randn(3, 5, 48, generator=g).bfloat16(), torch.randn(3, 48, 7, generator=g).bfloat16())
    call = {"matmul": lambda: torch.matmul(a, b), "operator": lambda: a @ b, "bmm": lambda: torch.bmm(a, b),
            "linear": lambda: F.linear(a, b[0].T), "einsum": lambda: torch.einsum("bij,bjk->bik", a, b),
            "einsum_list": lambda: torch.einsum("bij,bjk->bik", [a, b])}[op]
    exact = b[0].double().T if op == "linear" else b.double()
    exact = a.double() @ (exact.T if op == "linear" else exact)
    bound = 48 * 2.0 ** -24 * (a.double().abs() @ (b[0].T.double().abs().T if op == "linear" else b.double().abs()))
    lo, hi = (exact - bound).bfloat16(), (exact + bound).bfloat16()
    with kernels.UpcastProducts(), ProductDtypes() as kernels_ran:
        got = call()
    assert kernels_ran and set(kernels_ran) == {torch.float32}, "the products ran as float32 kernels"
    with ProductDtypes() as plain_ran:
        call()
    assert torch.bfloat16 in plain_ran, "without the mode they are bf16 kernels"
    assert got.dtype == torch.bfloat16 and got.shape == exact.shape
    assert ((lo <= got) & (got <= hi)).all()
    assert (lo == hi).float().mean() > 0.5, "most elements are unambiguous: the check has teeth"


def test_upcast_products_leave_other_calls_alone(monkeypatch):
    """A three-operand einsum (it rounds between its products), float32 operands and a CPU with bf16 units pass
    through unchanged: bit for bit the plain call."""
    g = torch.Generator().manual_seed(1)
    a, b, c = (torch.randn(4, 4, generator=g).bfloat16() for _ in range(3))
    with pytest.MonkeyPatch.context() as m:
        m.setattr(kernels, "_native_bf16", lambda: False)
        with kernels.UpcastProducts():
            three, f32 = torch.einsum("ij,jk,kl->il", a, b, c), a.float() @ b.float()
    torch.testing.assert_close(three, torch.einsum("ij,jk,kl->il", a, b, c), rtol=0, atol=0)
    torch.testing.assert_close(f32, a.float() @ b.float(), rtol=0, atol=0)
    monkeypatch.setattr(kernels, "_native_bf16", lambda: True)
    with kernels.UpcastProducts():
        native = a @ b
    torch.testing.assert_close(native, a @ b, rtol=0, atol=0)


# Compiled against eager bf16 logits, per step: 1.6e-2 relative, four bf16 ulps (2⁻⁸ each). Inductor keeps a fused
# chain's bf16 intermediates in float32 where eager rounds each op; measured 2.9e-3 at most on a 2-core AVX2 EPYC.
BF16_COMPILED_REL = 4 * 2.0 ** -8


@pytest.mark.slow  # a bf16 model compiles its own graphs: ~40 s of CPU
def test_compiled_bf16_steps_with_upcast_products_give_the_plain_tokens(model, upcast):
    """A bf16 model's compiled steps under UpcastProducts (forced here, whatever the CPU): traced without a fallback,
    the plain greedy tokens (every top-2 margin is far above the logits' budget) and logits within the budget."""
    half = SimpleAttentionNetwork(model.config.replace(dtype="bfloat16"), groups=())
    half.load_state_dict(model.state_dict())
    tokens, kw = prompts(0), dict(eos_token_id=None, return_logits=True)
    ref, ref_logits = half.eval().generate(tokens, G, **kw)
    with warnings.catch_warnings():
        warnings.simplefilter("error", CompileFallbackWarning)
        out, logits = half.generate(tokens, G, compile=True, **kw)
    top2 = ref_logits.topk(2, dim=-1).values
    assert (top2[..., 0] - top2[..., 1]).min() > 2 * BF16_COMPILED_REL * ref_logits.abs().max()
    torch.testing.assert_close(out, ref, rtol=0, atol=0)
    assert step_rel(logits, ref_logits) <= BF16_COMPILED_REL


@pytest.mark.skipif(not kernels.onednn_ops(), reason="this torch has no oneDNN (kernels.ONEDNN_OPS)")
def test_compiled_bf16_products_of_many_rows_keep_a_float32_weight(upcast, monkeypatch):
    """Dense at more rows than a multiply-and-sum takes, bf16 on the upcast path, in a compiled graph whose float32
    products take oneDNN: against one kept float32 copy of the weight (not upcast again each call), and the bf16
    product (within a float32 sum's error of the float64 product, as above)."""
    monkeypatch.setattr(kernels, "_onednn_f32", lambda: True)
    monkeypatch.setattr(kernels, "_PACKED", WeakIdKeyDictionary())
    g = torch.Generator().manual_seed(2)
    layer = fast_v3.Dense(48, 40, torch.bfloat16).bfloat16()
    with torch.no_grad():
        layer.weight.copy_(torch.randn(40, 48, generator=g))
    x = torch.randn(16, 48, generator=g).bfloat16()
    with torch.no_grad(), kernels.switched(True):
        step = torch.compile(layer, fullgraph=True, dynamic=False)
        got, again = step(x), step(x)
    (kept,) = [v[3] for v in kernels._PACKED.values()]
    assert kept.dtype == torch.float32 and torch.equal(again, got)
    exact = x.double() @ layer.weight.double().T
    bound = 48 * 2.0 ** -24 * (x.double().abs() @ layer.weight.double().abs().T)
    assert got.dtype == torch.bfloat16
    assert (((exact - bound).bfloat16() <= got) & (got <= (exact + bound).bfloat16())).all()


def test_fast_paths_take_the_upcast_mode_for_a_bf16_model_only(model):
    """seam.fast_paths enters UpcastProducts for Needle 3 computing in bf16, not for a float32 model (nor for bf16
    parameters under a float32 compute dtype: its products run in float32)."""
    assert fast_v3.UPCAST_PRODUCTS
    for plain in (model, copy.deepcopy(model).bfloat16()):
        with fast_paths(plain):
            assert not any(isinstance(m, kernels.UpcastProducts) for m in _modes())
    with fast_paths(SimpleAttentionNetwork(model.config.replace(dtype="bfloat16"))):
        assert any(isinstance(m, kernels.UpcastProducts) for m in _modes())
    assert not any(isinstance(m, kernels.UpcastProducts) for m in _modes())


def _modes() -> list:
    return list(torch.overrides._get_current_function_mode_stack())
