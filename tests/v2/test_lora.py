"""Needle 2 LoRA adapters (convert.v2.lora, needle_torch.v2.peft) against upstream's fixture and PEFT 0.21 itself.

Golden: f32/lora_logits in tests/data/needle-v2-tiny.npz, upstream's `merge_lora` of needle-v2-tiny.lora.pkl into the
fixture checkpoint (params widened to float32) run through upstream's forward (tests/data/README.md). PEFT's side is
PEFT's own code: `PeftModel.from_pretrained`, `get_peft_model`, `save_pretrained`, `merge_and_unload`. Relative
error is max|Δ| / max|ref| over the whole array.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pickle
import re
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.numpy import load_file as load_safetensors
from safetensors.numpy import save_file as save_safetensors
from safetensors.torch import load_file as load_torch
from safetensors.torch import save_file as save_torch

from convert.atomic import OutputExistsError
from convert.errors import CheckpointError
from convert.formats import safetensors_format
from convert.io import read_checkpoint
from convert.trees import flatten_tree, unflatten_tree
from convert.v2 import lora as L
from convert.v2.mapping import rules
from needle_torch.v2 import SimpleAttentionNetwork
from needle_torch.v2 import peft as npeft

peft = pytest.importorskip("peft")

torch.set_float32_matmul_precision("highest")
DATA = Path(__file__).resolve().parents[1] / "data"
FIXTURE = DATA / "needle-v2-tiny.lora.pkl"
# float32: PEFT's unmerged x·Wᵀ + s·(x·Aᵀ)·Bᵀ, PEFT's merged W + s·B·A and upstream's W + s·A·B differ only by
# float32 rounding carried through 5 layers (measured 1.1e-6 to 1.3e-6 against the golden and each other).
REL = 1e-5
Q = "stack/layers/block/self_attn/q_proj/kernel"


def rel(x: np.ndarray, ref: np.ndarray) -> float:
    return float(np.abs(np.asarray(x, np.float64) - ref).max() / np.abs(ref).max())


@pytest.fixture(scope="module")
def ckpt():
    return read_checkpoint(DATA / "needle-v2-tiny.pkl")


@pytest.fixture(scope="module")
def params32(ckpt):
    return unflatten_tree({k: np.asarray(v, np.float32) for k, v in flatten_tree(ckpt.params).items()})


@pytest.fixture(scope="module")
def adapter():
    return L.read_upstream_adapter(FIXTURE)


@pytest.fixture(scope="module")
def golden():
    z = np.load(DATA / "needle-v2-tiny.npz")
    return torch.from_numpy(z["tokens"]).long(), z["f32/lora_logits"].astype(np.float64), z["f32/logits"]


@pytest.fixture(scope="module")
def peft_dir(adapter, ckpt, tmp_path_factory):
    return L.write_peft(adapter, ckpt.config, tmp_path_factory.mktemp("peft") / "adapter")


def torch_model(params, config) -> SimpleAttentionNetwork:
    return SimpleAttentionNetwork.from_flax(params, config)


@torch.no_grad()
def run(model, tokens) -> np.ndarray:
    return model(tokens).numpy()


def only(path: Path) -> list[str]:
    """What a folder holds, hidden leftovers included."""
    return sorted(os.listdir(path))


# ----------------------------------------------------------------------------- upstream's pickle


def test_fixture_adapter_reads(adapter):
    assert set(adapter.targets) == set(L.LORA_TARGETS)
    assert (adapter.rank, adapter.scale, adapter.base, adapter.num_layers, adapter.alpha) == \
        (4, 2.0, "needle-v2-tiny.pkl", 5, 8.0)
    assert adapter.lora[Q]["A"].shape == (5, 64, 4) and adapter.lora[Q]["B"].shape == (5, 4, 64)
    assert L.describe(adapter)["targets"][Q] == {"A": [5, 64, 4], "B": [5, 4, 64], "dtype": "float32"}


def test_targets_are_the_mapping_rules(ckpt):
    """Upstream's five targets and their torch modules are the mapping's own rules (so PEFT keys follow it)."""
    table = {r.flax: r.torch for r in rules(ckpt.config)}
    for t in L.LORA_TARGETS:
        assert table[t].format(i=3) == L.module_name(t, 3) + ".weight"
    assert "mtp_block/self_attn/q_proj/kernel" in table  # the one name PEFT must not reach


def test_upstream_pickle_writer_reproduces_the_fixture(adapter, tmp_path):
    """Upstream's finetune pickled this dict with pickle.dump: our writer gives the very same bytes."""
    out = L.write_upstream_adapter(adapter, tmp_path / "a.pkl")
    assert out.read_bytes() == FIXTURE.read_bytes()
    plain = pickle.loads(out.read_bytes())  # as upstream's `needle build --lora` reads it (stock pickle)
    assert list(plain) == ["lora", "scale", "base", "rank"]
    assert type(plain["scale"]) is float and type(plain["rank"]) is int
    assert all(type(x) is np.ndarray and x.dtype == np.float32 for ab in plain["lora"].values() for x in ab.values())


# ----------------------------------------------------------------------------- to PEFT


def test_peft_from_pretrained_matches_upstream(peft_dir, adapter, ckpt, params32, golden):
    tokens, lora_logits, base_logits = golden
    model = torch_model(params32, ckpt.config)
    assert "mtp" in model.groups  # the MTP block's projections exist, so leaving them alone means something
    wrapped = peft.PeftModel.from_pretrained(model, peft_dir)
    adapted = npeft.lora_modules(wrapped)
    assert len(adapted) == 5 * ckpt.config.num_layers
    assert all(n.startswith("base_model.model.stack.layers.") for n in adapted)
    assert not any("mtp" in n for n in adapted)
    got = run(wrapped, tokens)
    merged = run(torch_model(L.merged_params(adapter, params32), ckpt.config), tokens)
    assert rel(base_logits, lora_logits) > 0.1  # the adapter matters (it moves logits by up to 3.1)
    assert rel(got, lora_logits) <= REL
    assert rel(got, merged.astype(np.float64)) <= REL
    assert rel(merged, lora_logits) <= REL
    # the in-memory path builds the same PeftModel: identical arithmetic, identical logits
    np.testing.assert_array_equal(run(npeft.peft_model(torch_model(params32, ckpt.config), adapter), tokens), got)


def test_peft_config_reads_as_peft_means(peft_dir, ckpt, params32):
    cfg = peft.PeftConfig.from_pretrained(peft_dir)
    assert isinstance(cfg, peft.LoraConfig)
    assert (cfg.r, cfg.lora_alpha, cfg.lora_alpha / cfg.r, cfg.bias, cfg.use_dora, cfg.use_rslora, cfg.task_type) \
        == (4, 8, 2.0, "none", False, False, None)
    assert cfg.base_model_name_or_path == "needle-v2-tiny.pkl"
    names = [n for n, _ in torch_model(params32, ckpt.config).named_modules()]
    hit = [n for n in names if peft.tuners.tuners_utils.check_target_module_exists(cfg, n)]
    assert hit == [L.module_name(t, i) for i in range(5) for t in L.LORA_TARGETS]
    files = load_safetensors(peft_dir / L.PEFT_WEIGHTS)
    assert len(files) == 2 * 5 * 5
    np.testing.assert_array_equal(files["base_model.model.stack.layers.2.block.self_attn.k_proj.lora_A.weight"],
                                  L.read_upstream_adapter(FIXTURE).lora[L.LORA_TARGETS[1]]["A"][2].T)


def test_round_trips_are_bit_exact(peft_dir, ckpt, tmp_path):
    pkl = L.write_upstream_adapter(L.read_peft(peft_dir), tmp_path / "a.pkl")
    again = L.write_peft(L.read_upstream_adapter(pkl), ckpt.config, tmp_path / "again")
    for name in (L.PEFT_WEIGHTS, L.PEFT_CONFIG):
        assert (again / name).read_bytes() == (peft_dir / name).read_bytes()
    # pickle -> PEFT -> pickle: the same arrays bit for bit, scale, rank; the base as given
    mid = L.write_peft(L.read_upstream_adapter(FIXTURE), ckpt.config, tmp_path / "mid", base_name="elsewhere.pkl")
    back = L.read_upstream_adapter(L.write_upstream_adapter(L.read_peft(mid), tmp_path / "back.pkl"))
    ref = L.read_upstream_adapter(FIXTURE)
    assert (back.scale, back.rank, back.base) == (ref.scale, ref.rank, "elsewhere.pkl")
    for t in ref.targets:
        for x in "AB":
            assert back.lora[t][x].dtype == np.float32
            assert back.lora[t][x].tobytes() == ref.lora[t][x].tobytes()


@pytest.mark.parametrize("scale, rank", [(2.0, 16), (32 / 3, 3), (0.1 / 7, 7), (1 / 3, 6)])
def test_alpha_gives_back_the_scale(scale, rank):
    """PEFT divides lora_alpha / r: alpha is chosen so that this gives exactly upstream's scale."""
    assert L.peft_alpha(scale, rank) / rank == scale


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_peft_dir(dtype, peft_dir, ckpt, tmp_path):
    """PEFT saves a half-precision model's adapter in its dtype: read as such, widened exactly for upstream."""
    src = tmp_path / "half"
    src.mkdir()
    (src / L.PEFT_CONFIG).write_bytes((peft_dir / L.PEFT_CONFIG).read_bytes())
    half = {k: v.to(dtype) for k, v in load_torch(peft_dir / L.PEFT_WEIGHTS).items()}
    save_torch(half, src / L.PEFT_WEIGHTS, metadata={"format": "pt"})
    adapter = L.read_peft(src)
    assert str(adapter.lora[Q]["A"].dtype) == str(dtype).removeprefix("torch.")
    again = load_torch(L.write_peft(adapter, ckpt.config, tmp_path / "again") / L.PEFT_WEIGHTS)
    assert all(torch.equal(again[k], half[k]) and again[k].dtype == dtype for k in half)
    wide = L.read_upstream_adapter(L.write_upstream_adapter(adapter, tmp_path / "a.pkl"))
    key = L.peft_key(Q, 3, "B")
    np.testing.assert_array_equal(wide.lora[Q]["B"][3], half[key].float().numpy().T)
    assert wide.lora[Q]["B"].dtype == np.float32


def test_trained_in_torch_round_trip(ckpt, params32, tmp_path):
    """A PEFT adapter trained in torch -> our upstream pickle -> upstream's merge == PEFT's merge_and_unload."""
    torch.manual_seed(0)
    model = peft.get_peft_model(torch_model(params32, ckpt.config), npeft.lora_config(rank=4, alpha=8.0))
    assert len(npeft.lora_modules(model)) == 25
    tokens = torch.randint(14, ckpt.config.vocab_size, (2, 10))
    target = torch.zeros_like(tokens, dtype=torch.bool)
    target[:, 5:] = True  # masked CE over the "answer" positions, as upstream's finetune loss
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.2)
    model.train()
    for _ in range(3):
        logits = model(tokens)[:, :-1]
        ce = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1),
                                               reduction="none")
        loss = (ce * target[:, 1:].reshape(-1)).sum() / target[:, 1:].sum()
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.eval()
    model.save_pretrained(tmp_path / "trained")

    ours = L.read_peft(tmp_path / "trained", num_layers=5)
    assert (ours.rank, ours.scale, set(ours.targets)) == (4, 2.0, set(L.LORA_TARGETS))
    live = npeft.adapter_of(model)
    assert all(np.array_equal(live.lora[t][x], ours.lora[t][x]) for t in ours.targets for x in "AB")
    pkl = L.write_upstream_adapter(ours, tmp_path / "trained.pkl", base="needle-v2-tiny.pkl")
    merged = run(torch_model(L.merged_params(L.read_upstream_adapter(pkl), params32), ckpt.config), tokens)
    # PEFT's own tensors survive our PEFT -> pickle -> PEFT bit for bit
    redo = L.write_peft(L.read_upstream_adapter(pkl), ckpt.config, tmp_path / "redo")
    theirs, again = load_safetensors(tmp_path / "trained" / L.PEFT_WEIGHTS), load_safetensors(redo / L.PEFT_WEIGHTS)
    assert sorted(theirs) == sorted(again) and all(theirs[k].tobytes() == again[k].tobytes() for k in theirs)

    unmerged = run(model, tokens)
    reference = run(model.merge_and_unload(), tokens).astype(np.float64)
    assert rel(run(torch_model(params32, ckpt.config), tokens), reference) > 1e-3  # training moved the model
    assert rel(merged, reference) <= REL
    assert rel(unmerged, reference) <= REL


# ----------------------------------------------------------------------------- bad upstream pickles


def _fixture_dict() -> dict:
    return pickle.loads(FIXTURE.read_bytes())  # our own test file, read with the stock unpickler to edit it


def _edited(edit) -> dict:
    obj = _fixture_dict()
    edit(obj)
    return obj


def _set(obj: dict, target: str, which: str, index: tuple, value: float) -> None:
    obj["lora"][target][which][index] = value


class _Hostile:
    def __reduce__(self):
        return os.system, (f"touch {HOSTILE_MARKER}",)


HOSTILE_MARKER = Path("/tmp/needle-twin-lora-hostile-marker")
K = "stack/layers/block/self_attn/k_proj/kernel"
BAD_PICKLES = {
    "not a dict": ([1, 2], "not a LoRA adapter (the pickle holds a list)"),
    "a checkpoint": ({"format_version": 2, "params": {}}, "this is a model checkpoint, not a LoRA adapter"),
    "missing keys": ({"lora": {}, "scale": 2.0}, "missing key(s) ['base', 'rank']"),
    "no targets": (_edited(lambda o: o.update(lora={})), "the adapter has no targets"),
    "lora not a dict": (_edited(lambda o: o.update(lora=[1])), "'lora' is a list; expected a dict"),
    "mtp target": (_edited(lambda o: o["lora"].update({"mtp_block/self_attn/q_proj/kernel": o["lora"][Q]})),
                   "adapter target 'mtp_block/self_attn/q_proj/kernel' is not one of upstream's LoRA targets"),
    "engram target": (_edited(lambda o: o["lora"].update({"engrams_0/key_proj/kernel": o["lora"][Q]})),
                      "'engrams_0/key_proj/kernel' is not one of upstream's LoRA targets"),
    "A and B disagree": (_edited(lambda o: o["lora"][Q].update(B=o["lora"][Q]["B"][:, :3])),
                         f"{Q} A [5, 64, 4] and B [5, 3, 64] do not chain"),
    "rank field": (_edited(lambda o: o.update(rank=8)), "has rank 4 (A [5, 64, 4], B [5, 4, 64]) but the adapter's "
                                                        "rank is 8"),
    "layers differ": (_edited(lambda o: o["lora"][K].update(A=o["lora"][K]["A"][:4], B=o["lora"][K]["B"][:4])),
                      "has 4 layers, other targets 5"),
    "2-D array": (_edited(lambda o: o["lora"][Q].update(A=o["lora"][Q]["A"][0])), f"{Q} A is float32[64, 4]; "
                                                                                  "expected a 3-D float array"),
    "extra array": (_edited(lambda o: o["lora"][Q].update(C=o["lora"][Q]["A"])), "must hold exactly the arrays"),
    "int array": (_edited(lambda o: o["lora"][Q].update(A=o["lora"][Q]["A"].astype(np.int32))), "A is int32"),
    "NaN in A": (_edited(lambda o: _set(o, Q, "A", (1, 2, 3), np.nan)), f"{Q} A holds NaN or Inf values"),
    "Inf in B": (_edited(lambda o: _set(o, K, "B", (0, 0, 0), np.inf)), f"{K} B holds NaN or Inf values"),
    "scale text": (_edited(lambda o: o.update(scale="2")), "scale is '2'; expected a finite number"),
    "scale NaN": (_edited(lambda o: o.update(scale=float("nan"))), "scale is nan"),
    "rank bool": (_edited(lambda o: o.update(rank=True)), "rank is True; expected a positive integer"),
    "base not text": (_edited(lambda o: o.update(base=3)), "base is of type int"),
    "untrained": (_edited(lambda o: [ab["B"].fill(0) for ab in o["lora"].values()]),
                  "the adapter is untrained: B is all zero in stack/layers/block/self_attn/gate_proj/kernel"),
    "hostile": (_Hostile(), "forbidden global posix.system"),
}


@pytest.mark.parametrize("case", list(BAD_PICKLES))
def test_bad_upstream_pickle(case, ckpt, tmp_path):
    obj, message = BAD_PICKLES[case]
    src, dst = tmp_path / "bad.pkl", tmp_path / "out"
    src.write_bytes(pickle.dumps(obj, protocol=4))  # our own test data
    HOSTILE_MARKER.unlink(missing_ok=True)
    with pytest.raises(CheckpointError) as e:
        L.write_peft(L.read_upstream_adapter(src), ckpt.config, dst)
    assert message in str(e.value) and "\n" not in str(e.value)
    assert not HOSTILE_MARKER.exists()  # nothing ran
    assert only(tmp_path) == ["bad.pkl"]  # nothing written


@pytest.mark.parametrize("cut, message", [(0, "empty file (0 bytes)"), (1000, "the pickle is truncated"),
                                          (-1, "the pickle is truncated")])
def test_truncated_or_empty_pickle(cut, message, tmp_path):
    (tmp_path / "bad.pkl").write_bytes(FIXTURE.read_bytes()[:cut])
    with pytest.raises(CheckpointError, match=re.escape(message)):
        L.read_upstream_adapter(tmp_path / "bad.pkl")


def test_untrained_adapter_allowed_on_request(tmp_path):
    obj = BAD_PICKLES["untrained"][0]
    (tmp_path / "u.pkl").write_bytes(pickle.dumps(obj, protocol=4))
    adapter = L.read_upstream_adapter(tmp_path / "u.pkl", allow_untrained=True)
    assert L.describe(adapter)["untrained_targets"] == list(obj["lora"])
    assert not L.read_adapter(tmp_path / "u.pkl", allow_untrained=True).lora[Q]["B"].any()


# ----------------------------------------------------------------------------- bad PEFT directories


def _peft_variant(good: Path, dst: Path, config: dict | None = None, tensors=None) -> Path:
    """A copy of a good PEFT dir with its config updated and/or its tensors edited."""
    dst.mkdir()
    cfg = json.loads((good / L.PEFT_CONFIG).read_text())
    cfg.update(config or {})
    (dst / L.PEFT_CONFIG).write_text(json.dumps(cfg))
    arrays = load_safetensors(good / L.PEFT_WEIGHTS)
    if tensors is not None:
        tensors(arrays)
    save_safetensors(arrays, dst / L.PEFT_WEIGHTS)
    return dst


def _peft_name(target: str, layer: int, which: str) -> str:
    return L.peft_key(target, layer, which)


def _drop(layer: int, target: str = K, which: str = "AB"):
    return lambda t: [t.pop(_peft_name(target, layer, x)) for x in which]


def _rank_two(t: dict) -> None:
    t[_peft_name(Q, 2, "A")] = t[_peft_name(Q, 2, "A")][:2]
    t[_peft_name(Q, 2, "B")] = t[_peft_name(Q, 2, "B")][:, :2].copy()


def _add_mtp(t: dict) -> None:
    t["base_model.model.mtp_block.self_attn.q_proj.lora_A.weight"] = t[_peft_name(Q, 0, "A")]
    t["base_model.model.mtp_block.self_attn.q_proj.lora_B.weight"] = t[_peft_name(Q, 0, "B")]


Q2 = "stack.layers.2.block.self_attn.q_proj"
BAD_PEFT = {
    "mtp module": ({}, _add_mtp, "tensor 'base_model.model.mtp_block.self_attn.q_proj.lora_A.weight' is outside "
                                 "upstream's LoRA targets"),
    "rank per layer": ({"rank_pattern": {Q2: 2}}, _rank_two, "the rank differs between modules (4 at "),
    "rank vs config": ({}, _rank_two, f"{Q2} has rank 2 in its tensors but adapter_config gives it r = 4"),
    "alpha per layer": ({"alpha_pattern": {Q2: 16}}, None, "the scale lora_alpha / r differs between modules"),
    "DoRA": ({"use_dora": True}, None, "DoRA (use_dora) rescales each weight by a learned magnitude"),
    "bias": ({"bias": "all"}, None, "bias is 'all': PEFT trained the base biases too"),
    "rsLoRA": ({"use_rslora": True}, None, "rsLoRA (use_rslora) scales by lora_alpha / sqrt(r)"),
    "modules_to_save": ({"modules_to_save": ["embedding"]}, None, "modules_to_save holds fully trained copies"),
    "PiSSA": ({"init_lora_weights": "pissa_niter_4"}, None,
              "init_lora_weights='pissa_niter_4' rewrites the base weights"),
    "not LoRA": ({"peft_type": "IA3"}, None, "peft_type is 'IA3'; only LoRA adapters"),
    "missing layer": ({}, _drop(3), f"{K} is adapted in layers [0, 1, 2, 4] but the base has layers 0..4 "
                                    "(missing [3])"),
    "half a pair": ({}, _drop(1, which="B"), "stack.layers.1.block.self_attn.k_proj has lora_A but not both"),
    "NaN": ({}, lambda t: t[_peft_name(Q, 0, "B")].fill(np.nan), f"{Q} B holds NaN or Inf values"),
}


@pytest.mark.parametrize("case", list(BAD_PEFT))
def test_bad_peft_dir(case, peft_dir, tmp_path):
    config, tensors, message = BAD_PEFT[case]
    src = _peft_variant(peft_dir, tmp_path / "src", config, tensors)
    with pytest.raises(CheckpointError) as e:
        L.write_upstream_adapter(L.read_peft(src), tmp_path / "out.pkl")
    assert message in str(e.value) and "\n" not in str(e.value)
    assert only(tmp_path) == ["src"]


def test_missing_last_layer_is_caught_against_the_base(peft_dir, ckpt, tmp_path):
    src = _peft_variant(peft_dir, tmp_path / "src", tensors=lambda t: [_drop(4, tg)(t) for tg in L.LORA_TARGETS])
    with pytest.raises(CheckpointError, match=r"missing \[4\]"):
        L.read_peft(src, num_layers=5)
    short = L.read_peft(src)  # without the base, 4 complete layers look like a 4-layer adapter...
    with pytest.raises(CheckpointError, match="it has 4 layers, the base has 5"):
        L.check_adapter(short, ckpt.params, ckpt.config)  # ...which the base then refuses


def test_peft_dir_without_safetensors(peft_dir, tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    (src / L.PEFT_CONFIG).write_bytes((peft_dir / L.PEFT_CONFIG).read_bytes())
    (src / L.PEFT_PICKLE_WEIGHTS).write_bytes(b"not read")
    with pytest.raises(CheckpointError, match="a torch pickle, not read for safety"):
        L.read_peft(src)
    (src / L.PEFT_CONFIG).write_text("{")
    (src / L.PEFT_WEIGHTS).write_bytes((peft_dir / L.PEFT_WEIGHTS).read_bytes())
    with pytest.raises(CheckpointError, match="adapter_config.json: not readable JSON"):
        L.read_peft(src)
    (src / L.PEFT_CONFIG).write_bytes((peft_dir / L.PEFT_CONFIG).read_bytes())
    (src / L.PEFT_WEIGHTS).write_bytes((peft_dir / L.PEFT_WEIGHTS).read_bytes()[:-8])
    with pytest.raises(CheckpointError, match="truncated safetensors file"):
        L.read_peft(src)


# ----------------------------------------------------------------------------- checks against a base


def test_fixture_fits_its_float16_base(adapter, ckpt):
    L.check_adapter(adapter, ckpt.params, ckpt.config)  # the fp16 overflow check stays quiet on the fixture
    merged = flatten_tree(L.merged_params(adapter, ckpt.params))
    assert merged[Q].dtype == np.float16  # upstream's rule: the sum happens in W's dtype


def _crafted(adapter: L.Adapter, edit) -> L.Adapter:
    lora = {t: {x: a.copy() for x, a in ab.items()} for t, ab in adapter.lora.items()}
    edit(lora)
    return dataclasses.replace(adapter, lora=lora)


def test_float16_overflow(adapter, ckpt, params32):
    def spike(lora):
        lora[Q]["A"][2, 5, 0], lora[Q]["B"][2, 0, 7] = 200.0, 200.0  # scale·A@B ≈ 2·40000 at layer 2, (5, 7)

    big = _crafted(adapter, spike)
    with pytest.raises(CheckpointError) as e:
        L.check_adapter(big, ckpt.params, ckpt.config)
    assert f"merging into the float16 base overflows at {Q}: max|scale·A@B| = 8" in str(e.value)
    assert "over float16's 65504 (upstream issue #53)" in str(e.value)
    L.check_adapter(big, params32, ckpt.config)  # a float32 base holds it


def test_adapter_for_another_base(adapter, ckpt, tmp_path):
    with pytest.raises(CheckpointError, match=r"the adapter is for another base: it has 5 layers, the base has 4"):
        L.write_peft(adapter, dataclasses.replace(ckpt.config, num_layers=4), tmp_path / "x")
    narrow = dataclasses.replace(adapter, lora={Q: {"A": adapter.lora[Q]["A"][:, :32], "B": adapter.lora[Q]["B"]}})
    with pytest.raises(CheckpointError, match=rf"adapter/base shape mismatch at {Q}: the adapter's A @ B is "
                                              r"\[5, 32, 64\], the base's kernel is \[5, 64, 64\]"):
        L.check_adapter(narrow, ckpt.params, ckpt.config)
    params = unflatten_tree({**flatten_tree(ckpt.params), Q: np.zeros((5, 64, 48), np.float16)})
    with pytest.raises(CheckpointError, match=r"the base's kernel is \[5, 64, 48\]"):
        L.merged_params(adapter, params)
    assert only(tmp_path) == []


def test_target_on_all_zero_base_weights(adapter, ckpt):
    params = unflatten_tree({**flatten_tree(ckpt.params), Q: np.zeros((5, 64, 64), np.float16)})
    with pytest.raises(CheckpointError, match=r"targets an all-zero base kernel .*keeps only kernels with max\|W\| "
                                              r"> 1e-6, so this adapter was not trained on this base"):
        L.check_adapter(adapter, params, ckpt.config)


# ----------------------------------------------------------------------------- atomic writers


def test_writers_never_overwrite_without_force(adapter, ckpt, tmp_path):
    pkl = L.write_upstream_adapter(adapter, tmp_path / "a.pkl")
    d = L.write_peft(adapter, ckpt.config, tmp_path / "d")
    with pytest.raises(OutputExistsError):
        L.write_upstream_adapter(adapter, pkl)
    with pytest.raises(OutputExistsError):
        L.write_peft(adapter, ckpt.config, d)
    pkl.write_bytes(b"old")
    L.write_adapter(adapter, ckpt.config, pkl, force=True)
    assert pkl.read_bytes() == FIXTURE.read_bytes()
    assert only(tmp_path) == ["a.pkl", "d"]


def test_peft_dir_replaced_with_force(adapter, ckpt, tmp_path):
    d = L.write_peft(adapter, ckpt.config, tmp_path / "d")
    L.write_peft(adapter, ckpt.config, d, force=True)
    assert L.read_peft(d).lora.keys() == adapter.lora.keys()


def test_failed_write_leaves_nothing(adapter, ckpt, tmp_path, monkeypatch):
    def half(path, view, metadata):
        Path(path).write_bytes(b"partial")
        raise OSError("disk full")

    monkeypatch.setattr(safetensors_format, "write_file", half)
    with pytest.raises(OSError, match="disk full"):
        L.write_peft(adapter, ckpt.config, tmp_path / "d")
    assert only(tmp_path) == []


# ----------------------------------------------------------------------------- late 2.x adapters (2.0.15)


def _late_dict(qat_bits=4, qat_bits_map=None, seed=3) -> dict:
    """The fixture as 2.0.15's finetune pickles it: its four keys, then qat_bits, qat_bits_map and seed."""
    return {**_fixture_dict(), "qat_bits": qat_bits, "qat_bits_map": qat_bits_map, "seed": seed}


@pytest.mark.parametrize("late", [dict(qat_bits=4, qat_bits_map=None, seed=3),
                                  dict(qat_bits=None, qat_bits_map="default=2,embedding=4,attn.q_proj=3", seed=0),
                                  dict(qat_bits=None, qat_bits_map=None, seed=0)])  # --qat-bits none
def test_late_adapter_pickle_reads_and_writes_back_its_bytes(late, tmp_path):
    src = tmp_path / "late.pkl"
    src.write_bytes(pickle.dumps(_late_dict(**late), protocol=4))  # what 2.0.15's pickle.dump writes
    adapter = L.read_upstream_adapter(src)
    assert (adapter.qat_bits, adapter.qat_bits_map, adapter.seed) == tuple(late.values())
    assert {k: L.describe(adapter)[k] for k in late} == late
    out = L.write_upstream_adapter(adapter, tmp_path / "out.pkl")
    assert out.read_bytes() == src.read_bytes()
    assert list(pickle.loads(out.read_bytes())) == [*L.UPSTREAM_KEYS, *L.LATE_KEYS]


def test_early_adapter_has_no_late_fields(adapter):
    assert (adapter.qat_bits, adapter.qat_bits_map, adapter.seed, adapter.late) == (None, None, None, None)
    assert {k: L.describe(adapter)[k] for k in L.LATE_KEYS} == dict.fromkeys(L.LATE_KEYS)


def test_late_fields_survive_peft(ckpt, tmp_path):
    src = tmp_path / "late.pkl"
    src.write_bytes(pickle.dumps(_late_dict(qat_bits=2, seed=11), protocol=4))
    d = L.write_peft(L.read_upstream_adapter(src), ckpt.config, tmp_path / "peft")
    assert peft.PeftConfig.from_pretrained(d).r == 4  # PEFT still reads the directory
    back = L.read_peft(d)
    assert (back.qat_bits, back.qat_bits_map, back.seed) == (2, None, 11)
    assert L.write_upstream_adapter(back, tmp_path / "back.pkl").read_bytes() == src.read_bytes()


@pytest.mark.parametrize("late, message", [
    (dict(qat_bits=5), "qat_bits is 5; expected None or a CQ width 2, 3 or 4"),
    (dict(qat_bits=True), "qat_bits is True"),
    (dict(qat_bits_map="default=9"), "qat_bits_map 'default=9' is not a bits map"),
    (dict(qat_bits_map=4), "qat_bits_map is of type int"),
    (dict(seed="0"), "seed is '0'; expected None or an integer"),
])
def test_bad_late_fields(late, message, ckpt, tmp_path):
    src, dst = tmp_path / "bad.pkl", tmp_path / "out"
    src.write_bytes(pickle.dumps(_late_dict(**late), protocol=4))
    with pytest.raises(CheckpointError) as e:
        L.write_peft(L.read_upstream_adapter(src), ckpt.config, dst)
    assert message in str(e.value) and "\n" not in str(e.value)
    assert only(tmp_path) == ["bad.pkl"]
