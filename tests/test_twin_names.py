"""The twins read alike: each Flax file and its torch twin declare the same public top-level names in the same order.

Names one twin has and the other lacks are listed below with the reason; a name added to one side only, a listed
name that is gone, or shared names in another order fail the test.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

# family -> the files each twin package holds for it (needle_flax/<family>/<file>, needle_torch/<family>/<file>)
FAMILIES = {
    "v1": ("model.py", "generate.py"),
    "v2": ("model.py", "lanes.py", "engram.py", "generate.py"),
    "v3": ("model.py", "engram.py", "generate.py", "embed.py", "quant.py", "runner.py"),
}

# (family, file) -> (names only the Flax twin declares, names only the torch twin declares)
ONE_SIDED = {
    ("v1", "model.py"): ((), (
        "dot_product_attention",  # jax.nn.dot_product_attention is the library's; torch writes upstream's out
        "LayerCache", "DecoderCache",  # the Flax twin keeps its cache in flax.linen's "cache" collection
    )),
    ("v1", "generate.py"): (
        ("encode",),  # the Flax loop jits the encoder apart; the torch model's encode is a method
        ("pick",),  # the torch loop's choice as a pure function (compiled with the step)
    ),
    ("v2", "model.py"): (
        ("next_tokens",),  # the Flax twin's shifted-token helper for the MTP head (torch: F.pad inline)
        ("F32_MIN", "FLASH_NEG",  # the masked-logit values jax.nn.dot_product_attention writes
         "write_kv",  # Flax writes the cache with lax.dynamic_update_slice inline (_write_kv)
         "sigmoid", "silu",  # XLA:CPU's bf16 roundings of jax.nn.sigmoid and silu, written out
         "walsh_transform",  # the Walsh product as a function (Flax: inline in HadamardMLP)
         "dot_product_attention",  # upstream's attention written out
         "decode_layer"),  # one lane layer of a cached step, a nested compile region
    ),
    ("v2", "engram.py"): ((), ("MASK32",)),  # torch has no uint32: the hash wraps through a mask
    ("v2", "generate.py"): (
        ("new_cache", "decode_step"),  # the torch twin's are methods of SimpleAttentionNetwork
        ("prefill_in_chunks", "compile_choice"),  # the torch loop's compile choice and chunked prefill
    ),
    ("v3", "model.py"): ((), (
        "F32_MIN", "FLASH_NEG",  # the masked-logit values jax.nn.dot_product_attention writes
        "DEFAULT_HEADS",  # the torch constructor's default head groups (Flax: the tree decides)
    )),
    ("v3", "engram.py"): ((), ("shift_right",)),  # along axis 1 of any rank (Flax imports Needle 2's)
    ("v3", "generate.py"): ((), (
        "F32_MIN", "FLASH_NEG",  # restated from the model file, which imports this one
        "engram_step", "layer_decode", "decode_layers", "step_logits", "decode_positions",  # the step's parts,
    )),  # each a compiled graph in needle_torch.fast.v3 (Flax jits the whole step)
}


def public_names(path: Path) -> list[str]:
    """The public top-level classes, functions and UPPER_CASE constants of a module, in the order declared."""
    names = []
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            names.append(node.name)
        elif isinstance(node, ast.Assign):
            names += [t.id for t in node.targets if isinstance(t, ast.Name) and t.id.isupper()]
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and node.target.id.isupper():
            names.append(node.target.id)
    return [name for name in names if not name.startswith("_")]


PAIRS = [(family, name) for family, files in FAMILIES.items() for name in files]


@pytest.mark.parametrize("family, name", PAIRS, ids=[f"{f}/{n}" for f, n in PAIRS])
def test_each_twin_pair_declares_the_same_names_in_the_same_order(family, name):
    flax = public_names(REPO / "needle_flax" / family / name)
    torch = public_names(REPO / "needle_torch" / family / name)
    only_flax, only_torch = ONE_SIDED.get((family, name), ((), ()))
    assert sorted(set(flax) - set(torch)) == sorted(only_flax), "names only needle_flax declares (list or mirror)"
    assert sorted(set(torch) - set(flax)) == sorted(only_torch), "names only needle_torch declares (list or mirror)"
    shared_flax = [n for n in flax if n in torch]
    shared_torch = [n for n in torch if n in flax]
    assert shared_flax == shared_torch, "the twins declare their shared names in another order"


def test_every_one_sided_entry_names_a_pair_of_a_family():
    assert set(ONE_SIDED) <= set(PAIRS)


SHAPES = re.compile(r"Shapes: (.*?)(?=\n\n|\Z)", re.S)


def glossary(path: Path) -> str | None:
    """The module docstring's "Shapes:" paragraph, whitespace collapsed (None where it has none)."""
    found = SHAPES.search(ast.get_docstring(ast.parse(path.read_text())) or "")
    return " ".join(found.group(1).split()) if found else None


@pytest.mark.parametrize("family, name", PAIRS, ids=[f"{f}/{n}" for f, n in PAIRS])
def test_each_twin_pair_declares_the_same_shape_letters(family, name):
    flax = glossary(REPO / "needle_flax" / family / name)
    torch = glossary(REPO / "needle_torch" / family / name)
    assert flax is not None, "each twin file says what its shape letters mean"
    assert flax == torch, "the twins' shape glossaries differ (one letter, two meanings, or one side only)"


def test_the_glossary_check_sees_a_letter_one_side_lacks(tmp_path):
    a, b = tmp_path / "a.py", tmp_path / "b.py"
    a.write_text('"""X.\n\nShapes: B batch,\nT length.\n"""\n')
    b.write_text('"""X.\n\nShapes: B batch, T length, G sites.\n"""\n')
    assert glossary(a) == "B batch, T length." and glossary(a) != glossary(b)
