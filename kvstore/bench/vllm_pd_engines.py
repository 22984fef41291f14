"""Run a prefill/decode split: a prefill engine and a decode engine (two ``vllm.LLM``s in this process, each with its
own engine-core process), every prompt sent through ``PrefillDecodeProxy``; print one JSON line per prompt,
``{"prefill": RequestResult, "decode": RequestResult}``.

``kvstore bench vllm --prefill-decode`` runs this module as a file, as ``vllm_engine`` is run and for the same reasons
(vLLM's spawned processes re-import the main module; ``-P``), its spec on stdin: ``{"prefill": EngineSpec, "decode":
EngineSpec}`` as JSON; the prompts and ``max_tokens`` are the decode spec's (the prefill engine's requests ask for one
token). Importing it loads nothing beyond the standard library.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from pathlib import Path

__all__ = ["main", "prefill_decode_command"]


def main(argv: Sequence[str]) -> int:
    from kvstore.bench.pd_proxy import PrefillDecodeProxy
    from kvstore.bench.vllm_engine import EngineSpec, generate_one, start_engine, stop_engine, take_stdout

    specs = json.loads(Path(argv[1]).read_text() if len(argv) > 1 else sys.stdin.read())
    prefill_spec, decode_spec = (EngineSpec.from_json(json.dumps(specs[name])) for name in ("prefill", "decode"))
    results = take_stdout()
    prefill, decode = start_engine(prefill_spec), start_engine(decode_spec)
    proxy = PrefillDecodeProxy(
        prefill=lambda prompt, max_tokens: generate_one(prefill, prefill_spec, prompt, max_tokens, None),
        decode=lambda prompt, max_tokens: generate_one(decode, decode_spec, prompt, max_tokens, None),
    )
    for prompt in decode_spec.prompts:
        routed = proxy.complete(prompt, decode_spec.max_tokens)
        line = {"prefill": json.loads(routed.prefill.to_json()), "decode": json.loads(routed.decode.to_json())}
        results.write(json.dumps(line) + "\n")
        results.flush()
    results.close()
    stop_engine(decode)
    stop_engine(prefill)
    return 0


def prefill_decode_command() -> list[str]:
    """The command that runs this driver (its spec on stdin)."""
    return [sys.executable, "-P", str(Path(__file__).resolve())]


if __name__ == "__main__":
    sys.exit(main(sys.argv))
