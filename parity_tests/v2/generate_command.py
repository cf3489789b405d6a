"""What `needle-twin generate` does for Needle 2: render the chat prompt, decode, stream text, show the tool call."""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Mapping
from typing import Any

from convert.errors import GenerationError
from convert.generation import parse_token_ids
from convert.v2 import chat
from parity_tests.adapter import GenerateRequest
from parity_tests.v2.runs import generate_from_checkpoint

MAX_NEW_TOKENS = 96  # upstream's generate_cached default


def generate(checkpoint, request: GenerateRequest, options: Mapping[str, Any]) -> None:
    """options: `system`, `kv_window`, `sink_tools`, `temperature`, `seed`, each None or False when not given."""
    config = checkpoint.config
    tools, system = request.tools, options["system"]
    kv_window, temperature, seed = options["kv_window"] or 0, options["temperature"] or 0.0, options["seed"]
    tok = None if request.tokenizer is None else chat.load_chat_tokenizer(request.tokenizer,
                                                                          vocab_size=config.vocab_size)
    if request.query is not None:
        if tools is not None and tools.lstrip().startswith(("[", "{")):
            # parsed, then written compact by render_prompt: as upstream renders the tools it trained on
            tool_list = json.loads(chat.tools_json(tools))
        else:
            tool_list = None if tools is None else chat.load_tools(tools)
        prompt = chat.prompt_ids(tok, chat.render_prompt(request.query, tool_list, system),
                                 chat.generate_cached_cap(config.max_seq_len))
    else:
        if tools is not None or system is not None:
            raise GenerationError("--tools and --system are rendered into a --query prompt; with --tokens give the "
                                  "whole prompt as ids")
        prompt = parse_token_ids(request.tokens)
    sink = None
    if options["sink_tools"]:
        if not kv_window:
            raise GenerationError("--sink-tools pins positions that --kv-window would hide; give --kv-window W too")
        end = chat.MARKER_IDS[chat.TOOLS_END]
        if end not in prompt:
            raise GenerationError(f"--sink-tools: the prompt has no </tools> (id {end}) to pin up to; render it "
                                  "with --query (and --tools), or drop --sink-tools")
        last = prompt.index(end)
        sink = [i <= last for i in range(len(prompt))]
    if seed is not None and not temperature:
        raise GenerationError("--seed draws samples, but --temperature is 0 (greedy); give --temperature T > 0")

    stream = chat.TextStream(tok) if tok is not None else None

    def emit(token: int) -> None:
        sys.stdout.write(stream.feed(token) if stream is not None else f"{token} ")
        sys.stdout.flush()

    start = time.perf_counter()
    ids = generate_from_checkpoint(checkpoint, prompt, backend=request.backend, dtype=request.dtype,
                                   max_new_tokens=request.max_new_tokens or MAX_NEW_TOKENS, kv_window=kv_window,
                                   sink=sink, temperature=temperature, seed=seed, streamer=emit,
                                   compile=request.compile)
    seconds = time.perf_counter() - start
    if stream is not None:
        sys.stdout.write(stream.finish())
    sys.stdout.write("\n")
    sys.stdout.flush()
    if tok is not None:
        print("ids: " + " ".join(map(str, ids)))
        found = chat.extract_tool_call(stream.text)
        if found.ok:
            calls = [{"name": c.name, "arguments": c.arguments} for c in found.calls]
            print("tool call: " + json.dumps(calls, ensure_ascii=False))
        else:
            sys.stdout.flush()
            print(f"no tool call: {found.reason}", file=sys.stderr)
    sys.stdout.flush()
    note = "; includes jit compilation" if request.backend == "flax" or request.compile else ""
    window = f", kv_window {kv_window}" + (f" with {sum(sink)} sinks" if sink else "") if kv_window else ""
    print(f"{len(ids)} tokens in {seconds:.2f}s ({request.backend}, {request.dtype or config.dtype}, {len(prompt)} "
          f"prompt tokens{window}{note})", file=sys.stderr)
