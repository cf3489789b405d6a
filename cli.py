"""needle-twin: convert Needle checkpoints between Flax and PyTorch and prove both compute the same function.

Commands stay thin: parsing and printing here, the work in the packages. Library errors
(`NeedleTwinError`) become one red line and exit code 2; exit code 1 means parity failed.
The converter (framework-free) is imported up front; the parity and generation commands import
`parity_tests` (torch and jax) inside the command, so `convert`/`inspect`/`diff` start in a fraction
of a second.
"""

from __future__ import annotations

import functools
import importlib
import importlib.metadata
import inspect
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Optional

import typer

from convert import commands
from convert.errors import NeedleTwinError
from convert.registry import FAMILIES, family_named


def _package_version() -> str:
    try:
        return importlib.metadata.version("needle-twin")
    except importlib.metadata.PackageNotFoundError:  # run from a source tree that was never installed
        return "0+unknown"


__version__ = _package_version()

app = typer.Typer(
    name="needle-twin",
    help="Flax/JAX <-> PyTorch parity and weight conversion for the Needle model family (v1, Needle 2, Needle 3).",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


def fail(message: str, code: int = 2) -> None:
    """Print one red line to stderr and exit."""
    from rich.console import Console

    Console(stderr=True, highlight=False, soft_wrap=True).print(f"[bold red]error:[/] {message}", markup=True)
    raise typer.Exit(code)


def guarded(fn: Callable) -> Callable:
    """Turn the project's errors (and a few user-facing OS errors) into one line and exit 2."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except NeedleTwinError as e:
            fail(str(e))
        except FileNotFoundError as e:
            fail(f"{e.filename or e}: no such file; check the path")
        except IsADirectoryError as e:
            fail(f"{e.filename or e}: is a directory; give a file")
        except PermissionError as e:
            fail(f"{e.filename or e}: permission denied")
        except KeyboardInterrupt:
            fail("interrupted; nothing was written", 130)

    return wrapper


def family_options(command: str) -> Callable:
    """Add the options every family declares for `command` (`Family.<command>_options`) to a command function; it
    receives them as one dict, `family_options`, each None (False for a flag) when not given."""
    declared: dict[str, list] = {}
    for family in FAMILIES.values():
        for option in getattr(family, f"{command}_options"):
            declared.setdefault(option.name, []).append((family, option))

    def parameter(name: str, uses: list) -> inspect.Parameter:
        first = uses[0][1]
        if any(o.type is not first.type for _, o in uses):
            raise TypeError(f"families declare --{name} with different types")  # a declaration bug, not user input
        text = "; ".join(f"{f.title}: {o.help}" + ("" if o.default in (None, False) else f" (default {o.default})")
                         for f, o in uses)
        flag = first.type is bool
        info = typer.Option(first.flag, help=text[0].upper() + text[1:] + ".", min=None if flag else first.min)
        return inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=False if flag else None,
                                 annotation=Annotated[bool if flag else Optional[first.type], info])

    def decorate(fn: Callable) -> Callable:
        signature = inspect.signature(fn, eval_str=True)

        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            return fn(*args, family_options={name: kwargs.pop(name) for name in declared}, **kwargs)

        own = [p for name, p in signature.parameters.items() if name != "family_options"]
        wrapper.__signature__ = signature.replace(parameters=own + [parameter(n, u) for n, u in declared.items()])
        wrapper.__annotations__ = {}  # typer reads the signature's
        return wrapper

    return decorate


def generate_options_of(family, given: dict) -> dict:
    """The `generate` options `family` declares, out of `given`; an error naming any other family's given."""
    mine = {o.name for o in family.generate_options}
    wrong = ["--" + name.replace("_", "-") for name, value in given.items()
             if name not in mine and value not in (None, False)]
    if wrong:
        raise NeedleTwinError(f"{', '.join(wrong)} {'does' if len(wrong) == 1 else 'do'} not apply to "
                              f"{family.title} generation; drop it")
    return {name: given[name] for name in mine}


def family_hook(family, kind: str, key: str) -> Callable | None:
    """A family's own CLI command or twin runner (`Family.commands` / `Family.runners`, "module:name"), imported
    now; None when the family declares none."""
    target = getattr(family, kind).get(key)
    if target is None:
        return None
    module, name = target.split(":")
    return getattr(importlib.import_module(module), name)


def _version(value: bool) -> None:
    if value:
        typer.echo(f"needle-twin {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: Annotated[
        Optional[bool], typer.Option("--version", callback=_version, is_eager=True, help="Show the version and exit.")
    ] = None,
) -> None:
    """Flax/JAX <-> PyTorch parity and weight conversion for the Needle model family (v1, Needle 2, Needle 3)."""


# --- convert commands: convert, inspect, diff ---

_CONFIG_HELP = "JSON config for a checkpoint that carries none (torch .pt, bare safetensors, bare msgpack/Orbax)."


@app.command("convert")
@guarded
def convert_command(
    src: Annotated[str, typer.Argument(
        metavar="SRC", help="Checkpoint to read: upstream .pkl, .safetensors, HF-style or Orbax directory, "
                            "flax .msgpack, torch .pt/.bin (format read from content).")],
    dst: Annotated[str, typer.Argument(
        metavar="DST", help="Output: .safetensors or a directory (torch), .pkl or .msgpack (Flax), "
                            "a directory with --to flax (Orbax).")],
    to: Annotated[Optional[str], typer.Option("--to", help="torch or flax; only needed for a directory DST.")] = None,
    dtype: Annotated[Optional[str], typer.Option("--dtype", help="Cast every weight: float32, bfloat16 or float16 "
                                                                "(default: keep the stored dtype).")] = None,
    force: Annotated[bool, typer.Option("--force", help="Replace DST if it exists.")] = False,
    max_shard_size: Annotated[Optional[str], typer.Option(
        "--max-shard-size", help="Shard a directory DST past this size, e.g. 2GB, 500MB, 1GiB (default 5GB).")] = None,
    config: Annotated[Optional[str], typer.Option("--config", help=_CONFIG_HELP)] = None,
    bits: Annotated[Optional[str], typer.Option(
        "--bits", help="A .cact DST's weight width: 2, 3, 4, 1.58 (ternary) or a bits map such as "
                       "default=2,embedding=4,attn.q_proj=3 (default: the checkpoint's weight_bits, else 4).")] = None,
    tokenizer: Annotated[Optional[str], typer.Option(
        "--tokenizer", help="A .cact DST's SentencePiece tokenizer (.model), stored as its RAW record.")] = None,
    base: Annotated[Optional[str], typer.Option(
        "--base", help="A LoRA adapter SRC's base checkpoint (an adapter is recognised from its content).")] = None,
    merge: Annotated[bool, typer.Option(
        "--merge", help="With an adapter: write the base with the adapter merged (upstream's rule) instead.")] = False,
    allow_untrained: Annotated[bool, typer.Option(
        "--allow-untrained", help="Accept an adapter whose B matrices are all zero (untrained).")] = False,
    layers: Annotated[Optional[int], typer.Option(
        "--layers", help="Write this depth rung of a laddered model (Needle 3: 2..L), as `needle build --layers`.")
    ] = None,
    width: Annotated[Optional[int], typer.Option(
        "--width", help="Write the width half of a laddered model (Needle 3: d_model / 2).")] = None,
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="No progress bar, no summary line.")] = False,
) -> None:
    """Convert a checkpoint between Flax, PyTorch and .cact formats, bit-exact unless --dtype casts (a .cact is
    quantised, and said to be lossy when read)."""
    r = commands.convert(Path(src), Path(dst), to=to, dtype=dtype, force=force, max_shard_size=max_shard_size,
                         config_path=Path(config) if config else None, progress=not quiet, bits=bits,
                         tokenizer=Path(tokenizer) if tokenizer else None, base=Path(base) if base else None,
                         merge=merge, allow_untrained=allow_untrained, layers=layers, width=width)
    if not quiet:
        typer.echo(f"wrote {r.dst} ({r.dst_format}) from {r.src_format}: {r.num_parameters:,} parameters, "
                   f"{r.dtype}, {r.num_bytes / 2**20:,.1f} MiB in {r.seconds:.2f}s")
    for note in r.notes:  # said even with --quiet: a lossy conversion must not pass unnoticed
        typer.echo(f"note: {note}", err=True)


@app.command("inspect")
@guarded
def inspect_command(
    path: Annotated[str, typer.Argument(metavar="PATH", help="Checkpoint file or directory, any supported format.")],
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON instead of text.")] = False,
    config: Annotated[Optional[str], typer.Option("--config", help=_CONFIG_HELP)] = None,
) -> None:
    """Show a checkpoint's format, family, config, metadata and every tensor's name, shape and dtype; lint a .cact.

    Exit code 0, or 1 when a .cact's lint finds problems, 2 on unreadable input."""
    info = commands.inspect(Path(path), Path(config) if config else None)
    if as_json:
        typer.echo(json.dumps(info, indent=2))
        raise typer.Exit(1 if info.get("lint") else 0)
    if info.get("adapter"):
        typer.echo(f"path:       {info['path']}\nformat:     {info['format']} (adapter, {info['family']})")
        typer.echo(f"base:       {info['base']}\nrank:       {info['rank']}, scale {info['scale']:g} "
                   f"(PEFT lora_alpha {info['lora_alpha']:g}), {info['layers']} layers")
        for target, t in info["targets"].items():
            typer.echo(f"  {target:<48} A {tuple(t['A'])}  B {tuple(t['B'])}  {t['dtype']}")
        if info["untrained_targets"]:
            typer.echo(f"untrained:  B is all zero in {', '.join(info['untrained_targets'])}")
        return
    cfg = info["config"]
    typer.echo(f"path:       {info['path']}")
    typer.echo(f"format:     {info['format']}" + (f" ({info['layout']} layout)" if info["layout"] else ""))
    if info["family"]:
        typer.echo(f"family:     {info['family']} ({family_named(info['family']).title})")
    if info["optional_groups"]:
        typer.echo("groups:     " + ", ".join(f"{g} {'present' if on else 'absent'}"
                                             for g, on in info["optional_groups"].items()))
    typer.echo("config:     " + (" ".join(f"{k}={v}" for k, v in cfg.items()) if cfg else "none"))
    if info["unknown_config_keys"]:
        unknown = ", ".join(info["unknown_config_keys"])
        typer.echo(f"            keys upstream no longer knows (kept, unused): {unknown}")
    if info["config_origin"]:
        typer.echo(f"            from {info['config_origin']}")
    for key, value in info["metadata"].items():
        if key != "config":
            typer.echo(f"metadata:   {key} = {value if len(value) <= 100 else value[:97] + '...'}")
    dtypes = ", ".join(f"{k} x{v}" for k, v in info["dtypes"].items())
    typer.echo(f"tensors:    {info['num_tensors']} ({dtypes}), {info['num_parameters']:,} parameters, "
               f"{info['num_bytes'] / 2**20:,.2f} MiB")
    scope = " (names, shapes and dtypes against the config; convert and diff read the values)"
    typer.echo(f"check:      {info['check']}" + (scope if info["check"] == "ok" else ""))
    if "engine_config" in info:
        typer.echo("engine:     " + " ".join(f"{k}={v}" for k, v in info["engine_config"].items()))
        typer.echo(f"            {info['records']} records, bits {info['bits']}, heads "
                   f"{', '.join(info['heads']) or 'none'}, tokenizer {'yes' if info['tokenizer'] else 'no'}")
        for r in info.get("record_table", ()):  # a format that lists its records (Needle 3's .cact)
            typer.echo(f"  #{r['index']:<4} {r['name']:<28} {r['dtype']:<4} {str(tuple(r['shape'])):<18} offset "
                       f"{r['offset']} nbytes {r['nbytes']}" + (f" bits {r['bits']}" if r["dtype"] == "CQ" else ""))
    if "lint" in info:
        typer.echo("lint:       " + ("ok" if not info["lint"] else f"{len(info['lint'])} problem(s)"))
        for problem in info["lint"]:
            typer.echo(f"  - {problem}")
    width = max((len(t["name"]) for t in info["tensors"]), default=0)
    for t in info["tensors"]:
        where = (f"  stacked over {t['stacked']}" if "stacked" in t else f"  layer {t['layer']}" if "layer" in t
                 else "") + (f"  [{t['group']}]" if "group" in t else "")
        typer.echo(f"  {t['name']:<{width}}  {str(tuple(t['shape'])):<22} {t['dtype']}{where}")
    if info.get("lint"):
        raise typer.Exit(1)


@app.command("diff")
@guarded
def diff_command(
    a: Annotated[str, typer.Argument(metavar="A", help="First checkpoint (any format).")],
    b: Annotated[str, typer.Argument(metavar="B", help="Second checkpoint (any format).")],
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON instead of text.")] = False,
    config_a: Annotated[Optional[str], typer.Option("--config-a", help=_CONFIG_HELP)] = None,
    config_b: Annotated[Optional[str], typer.Option("--config-b", help=_CONFIG_HELP)] = None,
) -> None:
    """Compare two checkpoints in any formats (Flax layout): configs, keys, and max |a-b| per tensor.

    Exit code 0 when identical (same config, bit-identical tensors), 1 when they differ, 2 on bad input.
    """
    r = commands.diff(Path(a), Path(b), Path(config_a) if config_a else None, Path(config_b) if config_b else None)
    if as_json:
        typer.echo(json.dumps(r.to_dict(), indent=2))
    else:
        typer.echo(f"A: {r.a} ({r.format_a})\nB: {r.b} ({r.format_b})")
        for k, (va, vb) in r.config.items():
            typer.echo(f"config {k}: {va!r} vs {vb!r}")
        for name in r.only_a:
            typer.echo(f"only in A: {name}")
        for name in r.only_b:
            typer.echo(f"only in B: {name}")
        differing = [t for t in r.tensors if t.status != "identical"]
        width = max((len(t.name) for t in r.tensors), default=0)
        for t in r.tensors:
            detail = (f"shape {tuple(t.shape_a)} vs {tuple(t.shape_b)}" if t.status == "shape" else
                      "max abs 0" if t.status == "identical" else
                      f"max abs {t.max_abs:.6g}, {t.num_different:,} elements differ"
                      + (f" (layers {', '.join(map(str, t.layers))})" if t.layers else "")
                      + (f", dtype {t.dtype_a} vs {t.dtype_b}" if t.dtype_a != t.dtype_b else ""))
            typer.echo(f"  {t.name:<{width}}  {t.status:<12} {detail}")
        verdict = "checkpoints are identical" if r.identical else "checkpoints differ"
        typer.echo(f"{len(r.tensors)} common tensors: {len(r.tensors) - len(differing)} identical, "
                   f"{len(differing)} differ; {verdict}")
    if not r.identical:
        raise typer.Exit(1)

# --- parity commands: parity, rescore ---

_TOL = "Tolerance overrides"


def _report_console():
    """Rich console for reports: wide enough for the probe table when output is a pipe or a file."""
    from rich.console import Console

    console = Console(highlight=False)
    if not console.is_terminal:
        console = Console(highlight=False, width=160)
    return console


def _overrides(profile, rtol, atol, kl_max, grad_rtol):
    from parity_tests.commands import Overrides

    return Overrides(profile=profile, rtol=rtol, atol=atol, kl_max=kl_max, grad_rtol=grad_rtol)


_QUIET = typer.Option("--quiet", "-q", help="Print only the verdict line.")
_REPORT_FORCE = typer.Option("--force", help="Overwrite existing report files.")
_PROFILE = typer.Option("--profile", help="Tolerance profile by name, e.g. bfloat16-cpu, float32-gpu "
                                          "(default: from --dtype and the devices).", rich_help_panel=_TOL)
_RTOL = typer.Option("--rtol", help="Override the rel L2 and max/max|ref| budgets of every probe.",
                     rich_help_panel=_TOL)
_ATOL = typer.Option("--atol", help="Override the absolute floor of the max-abs budget.", rich_help_panel=_TOL)
_KL = typer.Option("--kl-max", help="Override the worst per-token KL budget of the logits.", rich_help_panel=_TOL)
_GRAD_RTOL = typer.Option("--grad-rtol", help="Override the gradient budgets (rel L2 and max).",
                          rich_help_panel=_TOL)


@app.command("parity")
@guarded
@family_options("parity")
def parity_command(
    flax_ckpt: Annotated[Optional[str], typer.Argument(
        metavar="[FLAX_CKPT]", help="Flax/upstream checkpoint of any family (any readable format; the family is read "
                                    "from the file). Omitted: an embedded seeded random model at the published "
                                    "size of --family.")] = None,
    torch_ckpt: Annotated[Optional[str], typer.Option(
        "--torch", help="Check this independently converted torch checkpoint instead of converting in memory.")] = None,
    family: Annotated[Optional[str], typer.Option(
        "--family", help=f"The embedded default model's family when no checkpoint is given: "
                         f"{', '.join(FAMILIES)} (default v3, Needle 3 at upstream's default config, 127.2M).")] = None,
    dtype: Annotated[str, typer.Option("--dtype", help="Compute dtype of both twins: float32, bfloat16, float16.")
                     ] = "float32",
    mode: Annotated[str, typer.Option("--mode", help="propagated: both run end to end (drift budget); isolated: "
                                                     "each torch stage gets the Flax stage's input (local budget).")
                    ] = "propagated",
    batch: Annotated[int, typer.Option("--batch", help="Rows of the random batch.")] = 4,
    seed: Annotated[int, typer.Option("--seed", help="Seed of the random inputs.")] = 0,
    inputs: Annotated[Optional[str], typer.Option(
        "--inputs", help="Token ids: .npy (src), .npz (src, tgt) or .json ({\"src\": rows, \"tgt\": rows}).")] = None,
    tokenizer: Annotated[Optional[str], typer.Option(
        "--tokenizer", help="SentencePiece model: encode --query/--tools in upstream's encoder format.")] = None,
    query: Annotated[Optional[list[str]], typer.Option("--query", help="Query text (repeat for a batch).")] = None,
    tools: Annotated[str, typer.Option("--tools", help="Tool descriptions appended after <tools>.")] = "",
    json_path: Annotated[Optional[str], typer.Option("--json", help="Write the JSON report here.")] = None,
    html_path: Annotated[Optional[str], typer.Option("--html", help="Write a self-contained HTML report here.")
                         ] = None,
    force: Annotated[bool, _REPORT_FORCE] = False,
    torch_device: Annotated[str, typer.Option("--torch-device", help="cpu, cuda, cuda:N or mps.")] = "cpu",
    jax_platform: Annotated[str, typer.Option("--jax-platform", help="cpu, gpu or tpu.")] = "cpu",
    precision: Annotated[str, typer.Option("--precision", help="highest: pin full float32 matmuls in both (no TF32);"
                                                               " default: leave the libraries' defaults.")
                         ] = "highest",
    grads: Annotated[bool, typer.Option("--grads/--no-grads", help="Compare cross-entropy gradients per parameter.")
                     ] = True,
    generate: Annotated[int, typer.Option("--generate", help="Greedy-generate N tokens with both twins and report "
                                                             "the first step that differs (0 = skip).")] = 8,
    suppress_special: Annotated[Optional[bool], typer.Option(
        "--suppress-special/--allow-special", help="Keep greedy generation off the special ids (default: only for the "
                                                   "embedded random model, which would stop at EOS at once).")] = None,
    depth: Annotated[Optional[str], typer.Option(
        "--depth", help="Needle 3: also compare the twins at ladder rung d (exit_depth and subnetwork_only logits, "
                        "and the sliced rung model), or at every rung 2..L with 'all'.")] = None,
    lora: Annotated[Optional[str], typer.Option(
        "--lora", help="Needle 2/3: a LoRA adapter (upstream's file or a PEFT dir) for the checkpoint; compare its A/B "
                       "gradients (Flax: upstream's merge in the loss; torch: PEFT).")] = None,
    quiet: Annotated[bool, _QUIET] = False,
    profile: Annotated[Optional[str], _PROFILE] = None,
    rtol: Annotated[Optional[float], _RTOL] = None,
    atol: Annotated[Optional[float], _ATOL] = None,
    kl_max: Annotated[Optional[float], _KL] = None,
    grad_rtol: Annotated[Optional[float], _GRAD_RTOL] = None,
    family_options: Optional[dict] = None,
) -> None:
    """Prove the torch and Flax twins compute the same function, probe by probe; name where they part.

    Exit code 0 when parity holds, 1 when it fails, 2 on bad input.
    """
    from parity_tests import commands as parity

    if precision not in ("highest", "default"):
        raise NeedleTwinError(f"--precision {precision!r} is not one of highest, default")
    report = parity.parity(parity.ParityRequest(
        flax_ckpt, torch_ckpt=torch_ckpt, family=family, dtype=dtype, mode=mode, batch=batch,
        lengths=family_options or {}, seed=seed, inputs=inputs, tokenizer=tokenizer, queries=tuple(query or ()),
        tools=tools, json_path=json_path, html_path=html_path, force=force, torch_device=torch_device,
        jax_platform=jax_platform, pin_precision=precision == "highest", grads=grads, generate=generate,
        suppress_special=suppress_special, overrides=_overrides(profile, rtol, atol, kl_max, grad_rtol), lora=lora,
        depth=depth))
    _show_report(report, quiet)


def _show_report(report, quiet: bool) -> None:
    """Terminal table (or just the verdict line), then exit 0 / 1 by the verdict."""
    from parity_tests.report import render_terminal, verdict_line

    console = _report_console()
    if quiet:
        console.print(verdict_line(report))
    else:
        render_terminal(report, console)
    raise typer.Exit(report.exit_code)


@app.command("rescore")
@guarded
def rescore_command(
    report_path: Annotated[str, typer.Argument(metavar="REPORT_JSON", help="A report from `parity --json`.")],
    json_path: Annotated[Optional[str], typer.Option("--json", help="Write the re-scored JSON report here.")] = None,
    html_path: Annotated[Optional[str], typer.Option("--html", help="Write a re-scored HTML report here.")] = None,
    force: Annotated[bool, _REPORT_FORCE] = False,
    quiet: Annotated[bool, _QUIET] = False,
    profile: Annotated[Optional[str], _PROFILE] = None,
    rtol: Annotated[Optional[float], _RTOL] = None,
    atol: Annotated[Optional[float], _ATOL] = None,
    kl_max: Annotated[Optional[float], _KL] = None,
    grad_rtol: Annotated[Optional[float], _GRAD_RTOL] = None,
    max_kld: Annotated[Optional[float], typer.Option("--max-kld", help="A quant report: the KL threshold.")] = None,
    min_top1: Annotated[Optional[float], typer.Option("--min-top1", help="A quant report: the top-1 threshold.")
                        ] = None,
    kld_stat: Annotated[str, typer.Option("--kld-stat", help="A quant report: the KL statistic --max-kld bounds.")
                        ] = "mean",
) -> None:
    """Re-judge a saved parity report (other tolerances) or quant report (other thresholds), running no model.

    Without options a parity report gets its own profile again. Exit code 0 / 1 / 2 as for `parity` and `quant`.
    """
    if _report_schema(report_path) == "needle-twin/quant-report":
        from parity_tests import quant
        from parity_tests.quant_report import render_terminal, verdict_text

        if any(v is not None for v in (profile, rtol, atol, kl_max, grad_rtol)):
            raise NeedleTwinError("--profile, --rtol, --atol, --kl-max and --grad-rtol re-judge parity reports; a "
                                  "quant report takes --max-kld, --min-top1 and --kld-stat")
        report = quant.rescore_file(report_path, json_path=json_path, html_path=html_path, force=force,
                                    max_kld=max_kld, min_top1=min_top1, kld_stat=kld_stat)
        console = _report_console()
        console.print(verdict_text(report)) if quiet else render_terminal(report, console)
        raise typer.Exit(report.exit_code)
    if max_kld is not None or min_top1 is not None:
        raise NeedleTwinError("--max-kld and --min-top1 re-judge quant reports; this is a parity report")
    from parity_tests import commands as parity

    report = parity.rescore(report_path, json_path=json_path, html_path=html_path, force=force,
                            overrides=_overrides(profile, rtol, atol, kl_max, grad_rtol))
    _show_report(report, quiet)


def _report_schema(path: str) -> str | None:
    """The `schema` a saved report names (None when it is not a readable JSON object: the loader says why)."""
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError):
        return None
    return data.get("schema") if isinstance(data, dict) else None


# --- quant command: the float model against a quantised build ---


@app.command("quant")
@guarded
def quant_command(
    float_ckpt: Annotated[str, typer.Argument(metavar="FLOAT_CKPT", help="The float Needle 2 or 3 checkpoint.")],
    cact: Annotated[Optional[str], typer.Option("--cact", help="A .cact build of it to judge.")] = None,
    bits: Annotated[Optional[str], typer.Option(
        "--bits", help="Or quantise it here: 2, 3, 4, 1.58, or a bits map such as default=2,embedding=4.")] = None,
    inputs: Annotated[Optional[str], typer.Option(
        "--inputs", help="Token ids (.npy, .npz or .json with `tokens`), as `parity --inputs` takes; default: a "
                         "seeded random batch.")] = None,
    lora: Annotated[Optional[str], typer.Option(
        "--lora", help="A LoRA adapter: judge base+adapter, merged before quantising (as `needle build --lora`).")
                    ] = None,
    batch: Annotated[int, typer.Option("--batch", help="Rows of the random batch.")] = 4,
    seq_len: Annotated[int, typer.Option("--seq-len", help="Length of the random batch.")] = 32,
    seed: Annotated[int, typer.Option("--seed", help="Seed of the random batch.")] = 0,
    steps: Annotated[int, typer.Option("--steps", help="Greedy steps both models decode (0 = none).")] = 8,
    depth: Annotated[Optional[str], typer.Option(
        "--depth", help="Needle 3: ladder rungs to judge against the full float model: all, or depths such as 2,4.")
                     ] = None,
    max_kld: Annotated[Optional[float], typer.Option(
        "--max-kld", help="Fail (exit 1) when the KL mean (see --kld-stat) exceeds this.")] = None,
    min_top1: Annotated[Optional[float], typer.Option(
        "--min-top1", help="Fail (exit 1) when the same-top-1 fraction is below this.")] = None,
    kld_stat: Annotated[str, typer.Option(
        "--kld-stat", help="Which KL statistic --max-kld bounds: mean, median, p99, p999 or max.")] = "mean",
    json_path: Annotated[Optional[str], typer.Option("--json", help="Write the JSON report here.")] = None,
    html_path: Annotated[Optional[str], typer.Option("--html", help="Write a self-contained HTML report here.")
                         ] = None,
    force: Annotated[bool, _REPORT_FORCE] = False,
    device: Annotated[str, typer.Option("--device", help="torch device: cpu, cuda, cuda:N or mps.")] = "cpu",
    dtype: Annotated[str, typer.Option("--dtype", help="Compute dtype of both models.")] = "float32",
    quiet: Annotated[bool, _QUIET] = False,
) -> None:
    """Does the quantised build still decide what the float model decided? KL, top-1, greedy agreement, and the
    layers and tensors that cost most (each layer quantised alone; per-tensor SQNR). torch only, no JAX.

    Needle 3: three-way, float / upstream's deploy fake-quant / the .cact as read, with the cost of each deploy
    site and, with --depth, of each ladder rung. Exit code 0, or 1 when a --max-kld / --min-top1 threshold fails,
    2 on bad input."""
    from parity_tests.quant_report import render_terminal, verdict_text

    family = _checkpoint_family(float_ckpt)
    run = family_hook(family, "commands", "quant")
    if run is None:
        having = " and ".join(f.title.split(" (")[0] for f in FAMILIES.values() if "quant" in f.commands)
        raise NeedleTwinError(f"{float_ckpt} is a {family.title} checkpoint; quantization parity is for {having} "
                              "(.cact / CQ): give one of theirs")
    report = run(float_ckpt, cact=cact, bits=bits, inputs=inputs, batch=batch, seq_len=seq_len, seed=seed,
                 steps=steps, depth=depth, lora=lora, json_path=json_path, html_path=html_path, force=force,
                 max_kld=max_kld, min_top1=min_top1, kld_stat=kld_stat, device=device, dtype=dtype)
    console = _report_console()
    console.print(verdict_text(report)) if quiet else render_terminal(report, console)
    raise typer.Exit(report.exit_code)


def _checkpoint_family(path: str):
    """The family a checkpoint file names; an unreadable file raises its own one-line error."""
    from convert.io import open_source, source_family

    if not Path(path).exists():
        raise NeedleTwinError(f"FLOAT_CKPT {path}: no such file")
    return source_family(open_source(path))


# --- generate command ---


@app.command("generate")
@guarded
@family_options("generate")
def generate_command(
    ckpt: Annotated[str, typer.Argument(help="Checkpoint to run (any format `needle-twin inspect` reads, .cact too); "
                                             "the family is read from the file.")],
    tokens: Annotated[Optional[str], typer.Option(
        "--tokens", help="The input as token ids, e.g. '2 391 385' (or comma-separated): v1's encoder input; "
                         "Needle 2's and Needle 3's prompt, used as given (upstream's prompts start with BOS, id 2).")
    ] = None,
    query: Annotated[Optional[str], typer.Option("--query", help="Query text (needs --tokenizer).")] = None,
    tools: Annotated[Optional[str], typer.Option(
        "--tools", help="The tools: a JSON list, inline or a .json file (Needle 2, Needle 3), or a JSON string "
                        "(v1). Default [].")] = None,
    tokenizer: Annotated[Optional[str], typer.Option(
        "--tokenizer", help="SentencePiece .model: encodes --query/--tools and decodes the output to text.")] = None,
    backend: Annotated[str, typer.Option("--backend", help="torch (cached KV) or flax (jitted cached loop).")
                       ] = "torch",
    max_new_tokens: Annotated[Optional[int], typer.Option(
        "--max-new-tokens", min=1, help="Stop after this many tokens (default: upstream's, 96 for Needle 2 as "
                                        "generate_cached, 64 for v1).")] = None,
    dtype: Annotated[Optional[str], typer.Option(
        "--dtype", help="Compute dtype: float32, bfloat16, float16 (default: the checkpoint config's).")] = None,
    compile: Annotated[bool, typer.Option(
        "--compile", help="torch: the fast decoding step (compiled on the first call, cached on disk after).")] = False,
    family_options: Optional[dict] = None,
) -> None:
    """Decode with the cached decoder, printing tokens as they come (text too with --tokenizer; Needle 2 and 3 also
    print the tool call they find, Needle 3 the prompt's confidence and router values)."""
    from convert.errors import GenerationError
    from convert.io import read_checkpoint
    from parity_tests.adapter import GenerateRequest
    from parity_tests.families import adapter_named

    if (tokens is None) == (query is None):
        raise GenerationError("give exactly one input: --tokens IDS, or --query TEXT with --tokenizer PATH")
    if query is not None and tokenizer is None:
        raise GenerationError("--query needs --tokenizer PATH (the SentencePiece .model) to become token ids")
    checkpoint = read_checkpoint(ckpt)
    family = checkpoint.family
    options = generate_options_of(family, family_options or {})
    request = GenerateRequest(tokens=tokens, query=query, tools=tools, tokenizer=tokenizer, backend=backend,
                              max_new_tokens=max_new_tokens, dtype=dtype, compile=compile)
    run = family_hook(family, "commands", "generate")
    if run is None:
        adapter_named(family.name).generate(checkpoint, request, options)
    else:
        run(checkpoint, request, options, _runner(family, backend))


def _runner(family, backend: str) -> Callable:
    """The family's twin runner for --backend; an error naming the backends it has."""
    runner = family_hook(family, "runners", backend)
    if runner is None:
        raise NeedleTwinError(f"--backend {backend!r} is unknown for {family.title}; use "
                              f"{' or '.join(family.runners)}")
    return runner


# --- embed command ---


@app.command("embed")
@guarded
def embed_command(
    ckpt: Annotated[str, typer.Argument(help="Checkpoint with an embedding head (Needle 3; .cact too).")],
    texts: Annotated[list[str], typer.Argument(help="The texts, one vector each.")],
    tokenizer: Annotated[str, typer.Option("--tokenizer", help="SentencePiece .model the texts are encoded with.")],
    backend: Annotated[str, typer.Option("--backend", help="torch or flax.")] = "torch",
    dtype: Annotated[Optional[str], typer.Option(
        "--dtype", help="Compute dtype: float32, bfloat16, float16 (default: the checkpoint config's).")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the vectors and similarities as JSON.")] = False,
) -> None:
    """Sentence embeddings: each text's unit vector (upstream's forward_embedding on [BOS] + its ids) and the
    texts' cosine similarities."""
    from convert.generation import EmbedRequest
    from convert.io import read_checkpoint

    checkpoint = read_checkpoint(ckpt)
    family = checkpoint.family
    run = family_hook(family, "commands", "embed")
    if run is None:
        having = [f.title for f in FAMILIES.values() if "embed" in f.commands]
        raise NeedleTwinError(f"{family.title} has no embedding head; `needle-twin embed` runs {', '.join(having)}")
    run(checkpoint, EmbedRequest(texts, tokenizer, backend, dtype, as_json), _runner(family, backend))


def main() -> None:
    app(prog_name="needle-twin")


if __name__ == "__main__":
    sys.exit(main())
