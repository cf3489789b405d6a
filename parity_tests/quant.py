"""What every family's quantization report shares: the figures over real positions (KL statistics, same top-1,
RMS Δp, state errors, SQNR), greedy agreement, pinned torch precision, the environment block, and re-scoring a
saved report. The families compute their reports (parity_tests/v2/quant.py, parity_tests/v3/quant.py) with these;
parity_tests/quant_report.py holds, judges and renders them.

Shapes: B batch, T length, V vocab, R real positions.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import math
import platform
import sys
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch

from convert.errors import ConfigError
from parity_tests.devices import DeviceError, torch_device
from parity_tests.inputs import InputError
from parity_tests.metrics import cosine, log_softmax, max_rel, token_kl, topk_agreement
from parity_tests.outputs import check_outputs, write_outputs
from parity_tests.quant_report import QuantReport, Thresholds, load_json, render_html, rescore, to_json

# ----------------------------------------------------------------------------- figures (numpy, float64)


def kld_stats(kl: np.ndarray) -> dict[str, float | None]:
    """mean, standard error (sample std / √R; None for one position), median, 99th and 99.9th percentiles
    (numpy's linear interpolation) and max of per-position KLs."""
    kl = np.asarray(kl, np.float64).ravel()
    n = kl.size
    return {"mean": float(kl.mean()), "stderr": float(kl.std(ddof=1) / math.sqrt(n)) if n > 1 else None,
            "median": float(np.median(kl)), "p99": float(np.percentile(kl, 99)),
            "p999": float(np.percentile(kl, 99.9)), "max": float(kl.max())}


def logit_figures(quant_logits: np.ndarray, float_logits: np.ndarray, real: np.ndarray) -> dict[str, Any]:
    """The distribution figures over real positions: (B, T, V) logits, (B, T) bool real -> kld stats, same_top1,
    top5, rms_dp (RMS of p_quant(top_float) − p_float(top_float)), logits_max_rel."""
    f, q = np.asarray(float_logits)[real], np.asarray(quant_logits)[real]  # (R, V)
    if not len(f):
        raise InputError("no real (non-pad) position to compare; give some real token ids")
    top = np.argmax(f, axis=-1)  # (R,)
    rows = np.arange(len(f))
    p_f, p_q = np.exp(log_softmax(f)[rows, top]), np.exp(log_softmax(q)[rows, top])  # (R,)
    return {"kld": kld_stats(token_kl(q, f)), "same_top1": float(np.mean(np.argmax(q, axis=-1) == top)),
            "top5": topk_agreement(q, f, min(5, f.shape[-1])), "rms_dp": float(np.sqrt(np.mean((p_q - p_f) ** 2))),
            "logits_max_rel": max_rel(q, f)}


def state_error(test: np.ndarray, ref: np.ndarray, real: np.ndarray | None = None) -> dict[str, float]:
    """rel RMS (rms(Δ) / rms(ref)), max|Δ|, cosine, rms(Δ), rms(ref) of a (B, T, ...) state over the real
    positions (all positions when real is None: upstream's `layers/V/*` goldens count every position)."""
    a, b = np.asarray(test, np.float64), np.asarray(ref, np.float64)
    if real is not None:
        a, b = a[real], b[real]
    rms_diff, rms_ref = float(np.sqrt(np.mean((a - b) ** 2))), float(np.sqrt(np.mean(b ** 2)))
    rel = 0.0 if rms_diff == 0 else (rms_diff / rms_ref if rms_ref else math.inf)
    return {"rel_rms": rel, "max_abs": float(np.max(np.abs(a - b))), "cos": cosine(a, b), "rms_diff": rms_diff,
            "rms_ref": rms_ref}


def sqnr_db(w: np.ndarray, q: np.ndarray) -> float | None:
    """10·log10(‖w‖² / ‖w − q‖²) in dB; None when q equals w exactly (infinite SQNR)."""
    w64, q64 = np.asarray(w, np.float64), np.asarray(q, np.float64)
    noise = float(np.sum((w64 - q64) ** 2))
    if noise == 0:
        return None
    signal = float(np.sum(w64 ** 2))
    return 10 * math.log10(signal / noise) if signal else -math.inf


# ----------------------------------------------------------------------------- runs


@contextlib.contextmanager
def pinned_torch() -> Iterator[None]:
    """Full float32 matmuls in torch (no TF32 on a GPU), restored on exit."""
    cuda = torch.backends.cuda.matmul
    saved = torch.get_float32_matmul_precision(), cuda.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.set_float32_matmul_precision("highest")
    cuda.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(saved[0])
        cuda.allow_tf32, torch.backends.cudnn.allow_tf32 = saved[1], saved[2]


def prompt_ends(tokens: np.ndarray, pad_id: int) -> np.ndarray:
    """Per row, one past its last real token (0: no real token); decoding continues from there."""
    real = tokens != pad_id
    last = tokens.shape[1] - np.argmax(real[:, ::-1], axis=1)
    return np.where(real.any(axis=1), last, 0)


@torch.no_grad()
def greedy_decode(logits: Callable[[torch.Tensor], np.ndarray], tokens: np.ndarray, pad_id: int, steps: int,
                  device: torch.device) -> np.ndarray:
    """`steps` greedy tokens (argmax over the whole vocabulary, as upstream) after each row's prompt: a plain
    recompute loop, as upstream's `generate` (the whole buffer through `logits` at every step, tokens (B, W) ->
    float32 numpy (B, W, V); right padding is invisible to real positions under the causal mask). Rows must have a
    prompt (prompt_ends > 0). -> (B, steps) int64."""
    ends = prompt_ends(tokens, pad_id)
    start = int(ends.max())
    buf = np.full((len(tokens), start + steps), pad_id, np.int64)
    buf[:, :start] = tokens[:, :start]
    rows = np.arange(len(tokens))
    out = np.zeros((len(tokens), steps), np.int64)
    for s in range(steps):
        out[:, s] = logits(torch.from_numpy(buf[:, :start + s]).to(device))[rows, ends + s - 1].argmax(-1)
        buf[rows, ends + s] = out[:, s]
    return out


def greedy_figures(float_tokens: np.ndarray, quant_tokens: np.ndarray, rows: np.ndarray) -> dict[str, Any]:
    """Per row the first step where the two models' tokens differ (None: never), and the fraction of all steps
    that agree before each row's first divergence."""
    R, steps = float_tokens.shape
    firsts = []
    for f, q in zip(float_tokens, quant_tokens, strict=True):
        diff = np.flatnonzero(f != q)
        firsts.append(int(diff[0]) if diff.size else None)
    agreed = sum(steps if s is None else s for s in firsts)
    return {"steps": steps, "rows": R, "row_index": rows.tolist(), "first_divergence": firsts,
            "agree_fraction": agreed / (R * steps) if R * steps else 1.0,
            "rows_identical": sum(s is None for s in firsts),
            "float_tokens": float_tokens.tolist(), "quant_tokens": quant_tokens.tolist()}


def environment(dev: torch.device, dtype: str) -> dict[str, Any]:
    try:
        version = importlib.metadata.version("needle-twin")
    except importlib.metadata.PackageNotFoundError:
        version = "unknown"
    return {"device": str(dev), "dtype": dtype, "precision": {
                "pinned": True, "torch_float32_matmul_precision": "highest", "tf32": False},
            "versions": {"python": sys.version.split()[0], "needle-twin": version, "numpy": np.__version__,
                         "torch": torch.__version__},
            "platform": platform.platform(), "machine": platform.machine(), "torch_threads": torch.get_num_threads()}


def quant_device(name: str) -> torch.device:
    """torch_device, its errors naming the quant command's own option (--device)."""
    try:
        return torch_device(name)
    except DeviceError as e:
        raise DeviceError(str(e).replace("--torch-device", "--device")) from None


# ----------------------------------------------------------------------------- a .cact of other weights

# Fraction of a .cact's CQ groups that may differ beyond rounding flips from this checkpoint's CQ before the file is
# taken for another checkpoint's (exit 2): a build of this one differs in none (every fixture: 0), a build of other
# weights in nearly all; between the two the file is this checkpoint's and the report fails (exit 1).
MAX_FOREIGN_GROUPS = 0.5


def refuse_foreign_cact(section: dict[str, Any], path: Any) -> dict[str, Any]:
    """The cq_check section, unless most of the .cact's groups differ from this checkpoint's CQ: refused."""
    if section["groups"] and section["divergent_groups"] > MAX_FOREIGN_GROUPS * section["groups"]:
        raise ConfigError(f"{path}: {section['divergent_groups']} of its {section['groups']} CQ groups differ from "
                          "this checkpoint's CQ beyond rounding flips: it was not exported from this checkpoint (or "
                          "from it with a LoRA adapter: give --lora); give the matching .cact")
    return section


# ----------------------------------------------------------------------------- re-scoring


def rescore_file(report_path: str, *, json_path: str | None = None, html_path: str | None = None,
                 force: bool = False, max_kld: float | None = None, min_top1: float | None = None,
                 kld_stat: str = "mean") -> QuantReport:
    """`needle-twin rescore QUANT_JSON --max-kld X --min-top1 Y`: re-judge a saved report, no model runs."""
    Thresholds(max_kld, min_top1, kld_stat)
    check_outputs((json_path, html_path), force)
    new = rescore(load_json(report_path), max_kld, min_top1, kld_stat)
    write_outputs(new, ((json_path, to_json), (html_path, render_html)), force)
    return new


__all__ = ["MAX_FOREIGN_GROUPS", "environment", "greedy_decode", "greedy_figures", "kld_stats", "logit_figures",
           "pinned_torch", "prompt_ends", "quant_device", "refuse_foreign_cact", "rescore_file", "sqnr_db",
           "state_error"]


def torch_index(family: Any, config: Any) -> dict[str, tuple[str, int | None]]:
    """torch state_dict name -> (Flax path, layer index or None), from the family's mapping rules."""
    table = family.table(config)
    out = {}
    for rule in table.rules:
        n = table.layers(rule)
        for i in range(n) if n is not None else (None,):
            out[rule.torch if i is None else rule.torch.format(i=i)] = (rule.flax, i)
    return out

