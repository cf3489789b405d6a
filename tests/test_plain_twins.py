"""The torch twins are the definition: their model files import nothing from the speed layer (needle_torch.fast),
which swaps their pieces from outside (needle_torch.fast.seam.fast_paths) and puts every one back afterwards."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch
from torch import nn

from convert.v2.config import TransformerConfig
from needle_torch.fast import kernels, seam
from needle_torch.fast import v2 as fast_v2
from needle_torch.v2 import lanes
from needle_torch.v2 import model as v2_model
from needle_torch.v2.model import HadamardMLP, SimpleAttentionNetwork

REPO = Path(__file__).resolve().parents[1]
PLAIN = sorted([*REPO.glob("needle_torch/v*/model.py"), REPO / "needle_torch/v2/lanes.py",
                REPO / "needle_torch/v2/engram.py", REPO / "needle_torch/layers.py"])


def imported_modules(path: Path) -> set[str]:
    """Every module an `import` or `from ... import` of the file names, at any depth (functions included)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
            names |= {f"{node.module}.{alias.name}" for alias in node.names}
    return names


@pytest.mark.parametrize("path", PLAIN, ids=[str(p.relative_to(REPO)) for p in PLAIN])
def test_plain_files_import_nothing_from_the_speed_layer(path):
    assert path.exists()
    fast = sorted(n for n in imported_modules(path) if n == "needle_torch.fast" or n.startswith("needle_torch.fast."))
    assert fast == [], f"{path.relative_to(REPO)} imports the speed layer: {fast}"


def test_the_import_check_sees_an_import_of_the_speed_layer(tmp_path):
    probe = tmp_path / "probe.py"
    probe.write_text("def f():\n    from needle_torch.fast.kernels import Linear\n")
    assert "needle_torch.fast.kernels" in imported_modules(probe)


def tiny_v2() -> SimpleAttentionNetwork:
    config = TransformerConfig(vocab_size=64, d_model=16, num_heads=2, num_kv_heads=1, attn_dim=16, num_layers=2,
                               mhc_lanes=2, engram_layers=(0,), engram_slots=64, max_seq_len=32)
    return SimpleAttentionNetwork(config).eval()


def test_fast_paths_swaps_the_pieces_in_and_puts_them_back():
    model = tiny_v2()
    plain_attention, plain_sinkhorn = v2_model.dot_product_attention, lanes.sinkhorn
    plain_forward, plain_step = HadamardMLP.forward, SimpleAttentionNetwork.decode_step
    linears = [m for m in model.modules() if type(m) is nn.Linear]
    assert linears
    with seam.fast_paths(model) as forms:
        assert forms is not None and forms.__name__ == "needle_torch.fast.v2"
        assert v2_model.dot_product_attention is not plain_attention and lanes.sinkhorn is not plain_sinkhorn
        assert HadamardMLP.forward is not plain_forward and SimpleAttentionNetwork.decode_step is not plain_step
        assert all(type(m) is kernels.Linear for m in linears) and kernels.enabled()
        state = {k: v.clone() for k, v in model.state_dict().items()}
    assert v2_model.dot_product_attention is plain_attention and lanes.sinkhorn is plain_sinkhorn
    assert HadamardMLP.forward is plain_forward and SimpleAttentionNetwork.decode_step is plain_step
    assert all(type(m) is nn.Linear for m in linears)
    assert state.keys() == model.state_dict().keys()  # the same parameters under either class


def test_fast_paths_restores_after_an_error_and_off_leaves_the_plain_pieces():
    model = tiny_v2()
    plain_attention = v2_model.dot_product_attention
    with pytest.raises(ValueError), seam.fast_paths(model):
        raise ValueError
    assert v2_model.dot_product_attention is plain_attention and kernels.enabled()
    with seam.fast_paths(model, False) as forms:
        assert forms is None and v2_model.dot_product_attention is plain_attention and not kernels.enabled()
        assert all(type(m) is not kernels.Linear for m in model.modules())
    assert kernels.enabled()


def test_fast_and_plain_forward_agree_eagerly():
    """Eagerly on this CPU the fast forms are the plain computations (bf16 upcast aside, float32 here)."""
    torch.manual_seed(0)
    model = tiny_v2()
    tokens = torch.randint(2, 64, (2, 7))
    with torch.no_grad():
        plain = model(tokens)
        with seam.fast_paths(model):
            fast = model(tokens)
    # float32, the same kernels eagerly: only where a fast form reorders a float32 sum could they differ
    assert (fast - plain).abs().max() <= 1e-5


def test_each_registered_piece_switches_off_and_back():
    """seam.without sets each piece's off settings for the block and puts the values before it back."""
    for name, piece in fast_v2.PIECES.items():
        before = [getattr(owner, attr) for owner, attr, _ in piece.off]
        with seam.without(fast_v2.PIECES, [name]):
            assert all(getattr(owner, attr) is value for owner, attr, value in piece.off), name
        assert all(getattr(owner, attr) is b for (owner, attr, _), b in zip(piece.off, before, strict=True)), name


def test_a_piece_switched_off_is_not_swapped_in():
    model = tiny_v2()
    plain_walsh = v2_model.walsh_transform
    with seam.without(fast_v2.PIECES, ["walsh_forms", "linear"]), seam.fast_paths(model):
        assert v2_model.walsh_transform is plain_walsh and lanes.sinkhorn is not fast_v2._PLAIN["sinkhorn"]
        assert not any(type(m) is kernels.Linear for m in model.modules())
    with seam.fast_paths(model):
        assert v2_model.walsh_transform is not plain_walsh
        assert any(type(m) is kernels.Linear for m in model.modules())


def test_every_piece_serves_a_request_the_benchmark_runs():
    tree = ast.parse((REPO / "benchmarks" / "bench_fast_pieces.py").read_text())
    requests = next(node.value for node in tree.body if isinstance(node, ast.Assign)
                    and any(isinstance(t, ast.Name) and t.id == "REQUESTS" for t in node.targets))
    names = {key.value for key in requests.keys}
    assert names and {piece.serves for piece in fast_v2.PIECES.values()} <= names
