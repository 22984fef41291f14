"""The multi-document QA workload: documents with planted facts, and prompts that combine them in new orders.

Documents are real prose, the docstrings of Python's standard library (``inspect.getdoc`` of every public attribute
of a fixed list of modules, in sorted order, so the corpus is the same on every run of one Python version), each with
one planted fact and a question about it; every answer is a 4-digit number. With a random-init model the text would
be noise to the model, so documents are random token ids and quality is not measured.

Two kinds of facts (``FactStyle``):

- ``distinct`` (default): each fact name comes with its own relation ("The Juniper bridge is 4821 meters long.",
  "Professor Maple keeps office number 6031."; 16 relations, so with 32 documents two share each), as in real
  multi-document QA where the question's words point at one document;
- ``same``: every fact is "The access code for the <name> archive is <code>.": the documents of a prompt hold
  near-identical sentences that differ in one name and one number, a stress test of binding a name to its number
  across documents (with a full prefill SmolLM2-135M gets them right as often as the distinct ones).

Every piece is tokenised separately and the prompt is their concatenation, as LMCache's blend benchmark builds it,
so a document's tokens are the same wherever it lands and its cached chunks recur exactly::

    query:   | preamble | sep | document a | sep | document b | ... | sep | question + answer header |
    warm-up: | preamble | sep | document |      (multi-doc-qa, default: each document where a query's first one is)
             | sep | document |                 (multi-doc-qa, ``alone``: each document from position 0)
             | preamble | sep | document 0 | sep | document 1 | ... |     (shuffle: the identity order, once)

Why the preamble by default (LMCache's warm-up prompt has its system prompt too): an instruct model encodes a document
differently inside a chat turn than as bare text at position 0, and a query's first document is then an exact prefix. On
SmolLM2 the two warm-ups gave a 0.15 blend the same planted-fact answers on the same queries and nearly the same KL
(docs/benchmarks.md, "Blend quality on SmolLM2"; measured: docs/design-notes.md#bench-multidoc-workload). The price: a
document's first chunk holds the preamble, so where the document is not first its head (up to a chunk) is a gap to
compute.

The preamble and the question follow the tokenizer's chat template when it has one (SmolLM2-Instruct does).

Pure functions over a tokenizer and a seed; thread-safe.
"""

from __future__ import annotations

import importlib
import inspect
import itertools
import logging
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from kvstore.bench.multidoc_options import FactStyle, check_docs_per_query
from kvstore.errors import ConfigError

__all__ = [
    "Document",
    "Fact",
    "FactStyle",
    "PromptFormat",
    "QuerySpec",
    "TokenIds",
    "docstring_corpus",
    "pick_combinations",
    "pick_derangements",
    "prose_documents",
    "random_documents",
]

logger = logging.getLogger(__name__)

TokenIds = npt.NDArray[np.int64]

CORPUS_MODULES = (
    "argparse", "ast", "asyncio", "base64", "bisect", "calendar", "cmd", "collections", "concurrent.futures",
    "configparser", "contextlib", "copy", "csv", "dataclasses", "datetime", "decimal", "difflib", "email.message",
    "enum", "fractions", "ftplib", "functools", "gettext", "glob", "gzip", "hashlib", "heapq", "hmac", "html.parser",
    "http.client", "imaplib", "inspect", "io", "ipaddress", "itertools", "json", "logging", "lzma", "mailbox",
    "mimetypes", "multiprocessing", "numbers", "operator", "optparse", "os", "pathlib", "pickle", "pprint",
    "queue", "random", "re", "sched", "secrets", "selectors", "shelve", "shlex", "shutil", "smtplib", "socket",
    "sqlite3", "statistics", "string", "struct", "subprocess", "tarfile", "tempfile", "textwrap", "threading",
    "timeit", "tokenize", "traceback", "turtle", "typing", "unittest", "urllib.parse", "urllib.request", "uuid",
    "warnings", "wave", "weakref", "xml.dom.minidom", "zipfile", "zoneinfo",
)  # fmt: skip
"""Standard-library modules whose docstrings make the documents (missing ones are skipped)."""

FACT_NAMES = (
    "Harbor", "Juniper", "Quartz", "Falcon", "Maple", "Copper", "Willow", "Orchid", "Granite", "Lantern", "Meadow",
    "Saffron", "Thistle", "Cobalt", "Heron", "Marble", "Nutmeg", "Pebble", "Raven", "Sequoia", "Tundra", "Velvet",
    "Walnut", "Zephyr", "Amber", "Birch", "Cedar", "Dune", "Ember", "Fjord", "Glacier", "Hazel",
)  # fmt: skip
SYSTEM_PROMPT = "You are a helpful assistant. Answer the question using only the documents."
SEPARATOR_TEXT = "\n\n"
_MIN_DOCSTRING_CHARS = 200
_FACT_LAST_FRACTION = 0.75  # facts are planted in the first three quarters, never cut off by the truncation


RELATIONS = (
    ("The access code for the {name} archive is {code}.", "What is the access code for the {name} archive?"),
    ("The {name} bridge is {code} meters long.", "How long is the {name} bridge, in meters?"),
    ("The {name} library holds {code} rare manuscripts.", "How many rare manuscripts does the {name} library hold?"),
    ("Professor {name} keeps office number {code}.", "What is Professor {name}'s office number?"),
    ("Ferry {name} carried {code} passengers on its maiden voyage.",
     "How many passengers did ferry {name} carry on its maiden voyage?"),
    ("The summit of Mount {name} stands {code} feet above sea level.",
     "How high is the summit of Mount {name}, in feet?"),
    ("The {name} observatory has catalogued {code} comets.", "How many comets has the {name} observatory catalogued?"),
    ("The {name} vineyard bottled {code} cases of wine last season.",
     "How many cases of wine did the {name} vineyard bottle last season?"),
    ("The PIN of the {name} safe is {code}.", "What is the PIN of the {name} safe?"),
    ("The {name} reservoir holds {code} million litres of water.",
     "How many million litres of water does the {name} reservoir hold?"),
    ("Train {name} runs on track {code}.", "On which track does train {name} run?"),
    ("The {name} tunnel has {code} ventilation fans.", "How many ventilation fans does the {name} tunnel have?"),
    ("The {name} orchard grew {code} apple trees.", "How many apple trees did the {name} orchard grow?"),
    ("Room {code} is where the {name} committee meets.", "In which room does the {name} committee meet?"),
    ("The {name} marathon had {code} runners at the start.",
     "How many runners were at the start of the {name} marathon?"),
    ("Locker {code} belongs to the {name} team.", "Which locker belongs to the {name} team?"),
)  # fmt: skip
"""(fact sentence, question) formats of the ``distinct`` style; the ``same`` style uses the first for every fact."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Fact:
    """A planted fact: a name, its 4-digit code, and the relation sentence and question that state and ask it."""

    name: str
    code: str
    relation: int = 0  # index into RELATIONS

    @property
    def sentence(self) -> str:
        return RELATIONS[self.relation][0].format(name=self.name, code=self.code)

    @property
    def question(self) -> str:
        return "Question: " + RELATIONS[self.relation][1].format(name=self.name)


@dataclass(frozen=True, slots=True, kw_only=True)
class Document:
    """One document's token ids and the fact planted in it (``None`` for random documents)."""

    tokens: TokenIds
    fact: Fact | None


@dataclass(frozen=True, slots=True, kw_only=True)
class QuerySpec:
    """Which documents a query holds, in order, and which of them its question asks about."""

    order: tuple[int, ...]
    asked: int


class PromptFormat:
    """Token ids of the pieces a prompt is assembled from.

    Args:
        preamble: what precedes the documents (system prompt, start of the user turn).
        separator: what precedes each document and the question.
        answer_header: what follows the question (end of the user turn, start of the assistant's).
        encode: text -> token ids for questions; ``None`` for random-token prompts (questions are then random).
    """

    def __init__(
        self, preamble: TokenIds, separator: TokenIds, answer_header: TokenIds, encode: Any | None = None
    ) -> None:
        self.preamble = preamble
        self.separator = separator
        self.answer_header = answer_header
        self._encode = encode

    @classmethod
    def for_tokenizer(cls, tokenizer: Any) -> PromptFormat:
        """The chat template's system + user turn around the documents, or plain text without a template."""

        def encode(text: str) -> TokenIds:
            return np.asarray(tokenizer.encode(text, add_special_tokens=False), dtype=np.int64)

        marker = "\u2063DOCUMENTS\u2063"
        if getattr(tokenizer, "chat_template", None):
            messages = [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": marker}]
            rendered = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
            before, after = str(rendered).split(marker)
        else:
            before, after = SYSTEM_PROMPT + SEPARATOR_TEXT, "\nAnswer:"
        return cls(encode(before), encode(SEPARATOR_TEXT), encode(after), encode)

    @classmethod
    def random(cls, vocab_size: int, rng: np.random.Generator) -> PromptFormat:
        """Random token pieces of realistic lengths (16-token preamble, 2-token separator, 8-token header)."""
        pieces = [rng.integers(0, vocab_size, size, dtype=np.int64) for size in (16, 2, 8)]
        return cls(*pieces)

    def question(self, fact: Fact | None, rng: np.random.Generator, vocab_size: int) -> TokenIds:
        """The question about ``fact`` and the answer header (24 random tokens when there is no fact or text)."""
        if fact is None or self._encode is None:
            return np.concatenate([rng.integers(0, vocab_size, 24, dtype=np.int64), self.answer_header])
        question: TokenIds = self._encode(fact.question)
        return np.concatenate([question, self.answer_header])

    def warm_up_prompt(self, document: Document, *, after_preamble: bool = True) -> TokenIds:
        """What the warm-up round stores for a document: the preamble (unless ``after_preamble`` is off), the
        separator and the document."""
        head = [self.preamble] if after_preamble else []
        return np.concatenate([*head, self.separator, document.tokens])

    def context_prompt(self, documents: Sequence[Document]) -> TokenIds:
        """The preamble and the documents in order (the shuffle test's warm-up: the identity order)."""
        parts = [self.preamble]
        for document in documents:
            parts += [self.separator, document.tokens]
        return np.concatenate(parts)

    def query_prompt(self, documents: Sequence[Document], question: TokenIds) -> TokenIds:
        return np.concatenate([self.context_prompt(documents), self.separator, question])


def docstring_corpus() -> list[str]:
    """Docstrings of ``CORPUS_MODULES``' public attributes, longest-first within each module, deduplicated."""
    seen: set[str] = set()
    corpus: list[str] = []
    for module_name in CORPUS_MODULES:
        try:
            module = importlib.import_module(module_name)
        except ImportError:  # e.g. turtle without tkinter
            continue
        texts = []
        for attribute in sorted(name for name in dir(module) if not name.startswith("_")):
            with warnings.catch_warnings():  # deprecated aliases (typing.io, ...) warn when touched
                warnings.simplefilter("ignore")
                doc = inspect.getdoc(getattr(module, attribute, None))
            if doc and len(doc) >= _MIN_DOCSTRING_CHARS and doc not in seen:
                seen.add(doc)
                texts.append(doc)
        corpus += sorted(texts, key=len, reverse=True)
    return corpus


def _fact_codes(num_documents: int, rng: np.random.Generator) -> list[str]:
    codes = rng.choice(np.arange(1000, 10000), size=num_documents, replace=False)
    return [str(int(code)) for code in codes]


def prose_documents(
    tokenizer: Any, num_documents: int, document_tokens: int, seed: int, style: FactStyle = FactStyle.DISTINCT
) -> list[Document]:
    """``num_documents`` documents of exactly ``document_tokens`` tokens of docstrings, one planted fact each
    (document ``i``'s relation is ``i % len(RELATIONS)`` in the ``distinct`` style).

    Raises:
        ConfigError: more documents than fact names, documents too short for a fact, or a corpus too small.
    """
    if num_documents > len(FACT_NAMES):
        raise ConfigError(f"--num-documents {num_documents}: at most {len(FACT_NAMES)} documents with planted facts")
    rng = np.random.default_rng(seed)
    codes = _fact_codes(num_documents, rng)
    paragraphs = iter(docstring_corpus())
    documents = []
    for index in range(num_documents):
        relation = index % len(RELATIONS) if style is FactStyle.DISTINCT else 0
        fact = Fact(name=FACT_NAMES[index], code=codes[index], relation=relation)
        fact_tokens = len(tokenizer.encode(SEPARATOR_TEXT + fact.sentence, add_special_tokens=False))
        if document_tokens < 4 * fact_tokens:
            raise ConfigError(f"--document-tokens {document_tokens} is too short for a planted fact; use >= 100")
        chosen: list[str] = []
        while len(tokenizer.encode(SEPARATOR_TEXT.join(chosen), add_special_tokens=False)) < document_tokens:
            paragraph = next(paragraphs, None)
            if paragraph is None:
                raise ConfigError(
                    f"the docstring corpus ran out at document {index}: ask for fewer or shorter documents "
                    f"(--num-documents {num_documents} x --document-tokens {document_tokens})"
                )
            chosen.append(paragraph)
        slots = [
            slot for slot in range(len(chosen))
            if len(tokenizer.encode(SEPARATOR_TEXT.join(chosen[:slot]), add_special_tokens=False))
            <= _FACT_LAST_FRACTION * document_tokens
        ]  # fmt: skip
        chosen.insert(int(rng.choice(slots)), fact.sentence)
        ids = tokenizer.encode(SEPARATOR_TEXT.join(chosen), add_special_tokens=False)[:document_tokens]
        documents.append(Document(tokens=np.asarray(ids, dtype=np.int64), fact=fact))
    return documents


def random_documents(vocab_size: int, num_documents: int, document_tokens: int, seed: int) -> list[Document]:
    """Documents of random token ids (for random-init models: text would mean nothing to them)."""
    rng = np.random.default_rng(seed)
    return [
        Document(tokens=rng.integers(0, vocab_size, document_tokens, dtype=np.int64), fact=None)
        for _ in range(num_documents)
    ]


def pick_combinations(num_documents: int, docs_per_query: int, num_queries: int, seed: int) -> list[QuerySpec]:
    """Random ordered selections of ``docs_per_query`` distinct documents, each asking about one of them.

    Raises:
        ConfigError: more documents per query than documents.
    """
    check_docs_per_query(docs_per_query, num_documents)
    rng = np.random.default_rng(seed + 1)
    queries = []
    for _ in range(num_queries):
        order = tuple(int(index) for index in rng.permutation(num_documents)[:docs_per_query])
        queries.append(QuerySpec(order=order, asked=int(rng.choice(order))))
    return queries


def pick_derangements(num_documents: int, num_queries: int, seed: int) -> list[QuerySpec]:
    """Orders of all documents where no document keeps its slot (``order[i] != i``), as LMCache's shuffle test.

    Up to 8 documents every derangement is enumerated and ``num_queries`` are drawn from them (with repetition only
    when there are fewer); beyond that, shuffles are drawn until they are derangements.

    Raises:
        ConfigError: fewer than two documents (no derangement exists).
    """
    if num_documents < 2:
        raise ConfigError(f"--num-documents {num_documents}: a derangement needs at least 2 documents")
    rng = np.random.default_rng(seed + 2)
    if num_documents <= 8:
        every = [
            order for order in itertools.permutations(range(num_documents))
            if all(document != slot for slot, document in enumerate(order))
        ]  # fmt: skip
        picks = rng.choice(len(every), size=num_queries, replace=num_queries > len(every))
        orders = [every[int(pick)] for pick in picks]
    else:
        orders = []
        while len(orders) < num_queries:
            order = tuple(int(index) for index in rng.permutation(num_documents))
            if all(document != slot for slot, document in enumerate(order)):
                orders.append(order)
    return [QuerySpec(order=order, asked=int(rng.choice(order))) for order in orders]
