"""The prompts of ``kvstore bench vllm --serve``: the multi-document QA benchmark as LMCache's users run it.

Built as LMCache's ``benchmarks/multi_doc_qa/multi_doc_qa.py`` builds them (the shared seed guide): every
part is tokenised on its own and the prompt is the concatenation of the token ids, so a document's tokens are the
same wherever it lands::

    warm-up:  system + sep + document + sep + question                      (each document once, alone)
    query:    system + sep + d1 + sep + d2 + ... + sep + question           (k sampled documents, random order)
    mixed:    a shuffled mix of exact repeats of warm-up prompts (hits), warm-up prompts of documents never sent
              (misses) and new queries (blends), for serving under concurrency

With a ``ChatForm`` the prompts are what a chat client sends instead: text messages, a system message and a user
message holding the documents' text joined by the separator (a blank line, by default) and the question, which the
server's chat template turns into one string and tokenizes whole. A document's tokens then depend on what precedes it
(BPE merges across the joins), and no separator's ids need recur; the prompt's ids are computed here with the same
template, for the store checks and the prompt lengths.

Two corpora: ``synthetic`` is the guide's (``str(i) + " " + " ".join(["hi"] * length)``, cut to the length in
tokens); ``prose`` is disjoint windows of real English (standard-library docstrings, ``prose_prompts``), where the
documents share no chunk and the model's attention is not degenerate.

Pure functions over a tokenizer's ``encode``; no engine imports.
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

from kvstore.bench.multidoc_options import check_docs_per_query
from kvstore.bench.vllm_ttft import prose_prompts
from kvstore.errors import ConfigError

__all__ = [
    "CHAT_SEPARATOR",
    "DEFAULT_QUESTION",
    "DEFAULT_SEPARATOR",
    "DEFAULT_SYSTEM_PROMPT",
    "ChatForm",
    "ChatMessage",
    "Corpus",
    "ServePrompt",
    "ServeWorkload",
    "check_workload_counts",
    "serve_workload",
]

Corpus = Literal["synthetic", "prose"]
Encode = Callable[[str], Sequence[int]]
ChatMessage = tuple[str, str]
"""``(role, content)``."""

DEFAULT_SEPARATOR = " # # "
"""LMCache's ``blend_special_str`` default, the guide's separator."""
DEFAULT_SYSTEM_PROMPT = "You are a helpful assistant."
DEFAULT_QUESTION = "What's up? how are you recently?"
"""The guide's system and query prompts: the same in every request, so what a warm-up cached recurs."""
CHAT_SEPARATOR = "\n\n"
"""Between the documents of a chat prompt: a blank line, as RAG templates join retrieved passages."""


@dataclass(frozen=True, slots=True)
class ChatForm:
    """Prompts sent as chat messages.

    Args:
        decode: a document's token ids as text.
        template: messages as the prompt ids the server makes of them (its chat template, generation prompt added).
    """

    decode: Callable[[Sequence[int]], str]
    template: Callable[[Sequence[ChatMessage]], Sequence[int]]


@dataclass(frozen=True, slots=True, kw_only=True)
class ServePrompt:
    """One request's prompt and what it is by construction.

    Args:
        tokens: the prompt's token ids.
        kind: ``warm_up`` (a document alone), ``query`` (k documents), ``hit`` (an exact repeat of a warm-up prompt),
            ``miss`` (a document never sent before, in the warm-up layout).
        documents: the documents it holds, in order (indexes into the corpus).
        messages: what a chat client sends (``ChatForm``); empty: ``tokens`` are sent as they are.
    """

    tokens: tuple[int, ...]
    kind: Literal["warm_up", "query", "hit", "miss"]
    documents: tuple[int, ...]
    messages: tuple[ChatMessage, ...] = ()


@dataclass(frozen=True, slots=True, kw_only=True)
class ServeWorkload:
    """The rounds' prompts, in the order they are submitted."""

    warm_up: tuple[ServePrompt, ...]
    queries: tuple[ServePrompt, ...]
    mixed: tuple[ServePrompt, ...]


def check_workload_counts(
    *, num_documents: int, document_tokens: int, docs_per_query: int, num_queries: int, num_mixed: int
) -> None:
    """Raise ``ConfigError`` on counts no workload has (``ServeBenchOptions`` checks them before a model loads).

    Raises:
        ConfigError: a document count or length below 1, a negative query or mixed count, or more documents per
            query than documents.
    """
    if num_documents < 1 or document_tokens < 1 or num_queries < 0 or num_mixed < 0:
        raise ConfigError("--documents and --document-tokens must be >= 1, --queries and the mixed count >= 0")
    check_docs_per_query(docs_per_query, num_documents, documents_flag="--documents")


def serve_workload(
    encode: Encode,
    *,
    corpus: Corpus,
    num_documents: int,
    document_tokens: int,
    docs_per_query: int,
    num_queries: int,
    num_mixed: int = 0,
    separator: str = DEFAULT_SEPARATOR,
    system_prompt: str = DEFAULT_SYSTEM_PROMPT,
    question: str = DEFAULT_QUESTION,
    seed: int = 0,
    chat: ChatForm | None = None,
) -> ServeWorkload:
    """The warm-up, query and mixed rounds (see the module docstring).

    ``encode`` must not add special tokens (``lambda text: tokenizer.encode(text, add_special_tokens=False)``): the
    parts are concatenated, and a BOS token inside a prompt would be a token no user sends. The mixed round takes a
    third of its requests from each kind (hits first when it does not divide); its misses are documents beyond
    ``num_documents``, never in a warm-up or a query.

    Raises:
        ConfigError: a count out of range, or a prose corpus too small.
    """
    check_workload_counts(
        num_documents=num_documents,
        document_tokens=document_tokens,
        docs_per_query=docs_per_query,
        num_queries=num_queries,
        num_mixed=num_mixed,
    )
    num_misses = num_mixed // 3
    documents = _documents(encode, corpus, num_documents + num_misses, document_tokens)
    system, sep, ask = (tuple(encode(text)) for text in (system_prompt, separator, question))
    texts = [chat.decode(document).strip() for document in documents] if chat is not None else []

    def parts(indexes: Sequence[int]) -> tuple[tuple[int, ...], tuple[ChatMessage, ...]]:
        if chat is not None:
            user = separator.join([*(texts[index] for index in indexes), question])
            messages = (("system", system_prompt), ("user", user))
            return tuple(chat.template(messages)), messages
        tokens = list(system)
        for index in indexes:
            tokens += sep + documents[index]
        return tuple(tokens + list(sep + ask)), ()

    def prompt(indexes: Sequence[int], kind: Literal["warm_up", "query", "hit", "miss"]) -> ServePrompt:
        tokens, messages = parts(indexes)
        return ServePrompt(tokens=tokens, kind=kind, documents=tuple(indexes), messages=messages)

    rng = random.Random(seed)
    warm_up = tuple(prompt([i], "warm_up") for i in range(num_documents))

    def query() -> ServePrompt:
        return prompt(rng.sample(range(num_documents), docs_per_query), "query")

    queries = tuple(query() for _ in range(num_queries))
    num_blends = num_mixed // 3
    hits = [
        dataclasses.replace(warm_up[i], kind="hit")
        for i in (rng.randrange(num_documents) for _ in range(num_mixed - num_misses - num_blends))
    ]
    misses = [prompt([i], "miss") for i in range(num_documents, num_documents + num_misses)]
    mixed = [*hits, *misses, *(query() for _ in range(num_blends))]
    rng.shuffle(mixed)
    return ServeWorkload(warm_up=warm_up, queries=queries, mixed=tuple(mixed))


def _documents(encode: Encode, corpus: Corpus, count: int, document_tokens: int) -> list[tuple[int, ...]]:
    """``count`` documents of exactly ``document_tokens`` tokens."""
    if corpus == "prose":
        return [tuple(window) for window in prose_prompts(encode, count, document_tokens)]
    if corpus != "synthetic":
        raise ConfigError(f"--corpus {corpus!r}: synthetic or prose")
    documents = []
    for index in range(count):
        # the guide's document, whose words are one token each; cut (or, for a tokenizer that merges them, padded
        # with more of them) to the length asked for
        tokens = list(encode(f"{index} " + " ".join(["hi"] * document_tokens)))
        while len(tokens) < document_tokens:
            tokens += encode(" hi")
        documents.append(tuple(tokens[:document_tokens]))
    return documents
