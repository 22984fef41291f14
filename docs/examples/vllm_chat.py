"""Ask vLLM's OpenAI server (with kvstore's connector) the same chat question twice; print what kvstore served.

docs/vllm.md's quick start runs it against the server it starts::

    .venv-vllm/bin/python docs/examples/vllm_chat.py --port 8000

The prompt is a system message, a document of real prose (the docstrings of Python's standard library, about 1,500
tokens) and a question, sent as text through ``chat.completions``, as most clients send it. The first request is
computed and its KV stored; the second finds it in kvstore (the quick start's server runs with vLLM's own prefix
cache off, so every reused token comes from kvstore) and says so in ``kv_transfer_params``.
"""

from __future__ import annotations

import argparse
import inspect
import json
import sys
import time

import openai


def _document(num_words: int) -> str:
    """Real English: the first docstrings of a few standard-library modules, about ``num_words`` words."""
    import collections
    import dataclasses
    import json as json_module
    import pathlib
    import threading

    words: list[str] = []
    for module in (threading, collections, dataclasses, pathlib, json_module):
        for _, member in inspect.getmembers(module):
            words += (inspect.getdoc(member) or "").split()
            if len(words) >= num_words:
                return " ".join(words[:num_words])
    return " ".join(words)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, default=8000, help="the OpenAI server's port (default: 8000)")
    parser.add_argument("--words", type=int, default=1000, help="the document's length in words (default: 1000)")
    args = parser.parse_args()
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{args.port}/v1", api_key="none", max_retries=0)
    try:
        model = client.models.list().data[0].id
    except openai.APIConnectionError:
        print(f"vllm_chat: no server answers on port {args.port}; start it first (docs/vllm.md)", file=sys.stderr)
        return 1
    messages = [
        {"role": "system", "content": "You answer questions about the document the user gives you."},
        {"role": "user", "content": f"{_document(args.words)}\n\nWhat is this document about?"},
    ]
    for attempt in ("first", "second"):
        started = time.perf_counter()
        response = client.chat.completions.create(model=model, messages=messages, max_tokens=16, temperature=0)
        seconds = time.perf_counter() - started
        served = (response.model_extra or {}).get("kv_transfer_params") or {}
        usage = response.usage
        prompt_tokens = usage.prompt_tokens if usage is not None else 0
        print(f"{attempt} request: {seconds:.2f} s, {prompt_tokens} prompt tokens, kvstore: {json.dumps(served)}")
        print(f"  answer: {response.choices[0].message.content!r}")
        time.sleep(1.0)  # the store acknowledges a save a moment after the request ends
    return 0


if __name__ == "__main__":
    sys.exit(main())
