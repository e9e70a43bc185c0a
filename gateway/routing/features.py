"""Request body -> named numeric features for the complexity scorer (pure Python, no I/O per call)."""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

DEFAULT_LEXICON_PATH = Path(__file__).parent / "data" / "complexity_lexicons.json"

# Lexicon categories, matched in the final instruction (the "ask"); see docs/complexity.md.
LEXICON_CATEGORIES: tuple[str, ...] = (
    "trivial_task",
    "brevity",
    "greeting",
    "lookup",
    "definition",
    "trivial_code",
    "followup",
    "proof_math",
    "word_problem",
    "reasoning",
    "analysis",
    "planning",
    "long_output",
    "constraint",
    "expert",
    "debugging",
)

FEATURE_NAMES: tuple[str, ...] = (
    "log_tokens",
    "log_ask_tokens",
    "log_pasted_tokens",
    "pasted_share",
    "log_history_tokens",
    "log_system_tokens",
    "user_turns",
    "code_blocks",
    "cjk_share",
    "max_tokens_log2",
    "tools",
    "questions",
    "enumerations",
    "numbers",
    "math_symbols",
    "acronyms",
    "word_length",
    "long_words",
    "requested_words",
    "short_followup",
    *(f"lex_{c}" for c in LEXICON_CATEGORIES),
)

_LETTERS = "0-9a-z\u00c0-\u024f\u0370-\u03ff\u0400-\u04ff"
_WORD_RE = re.compile(f"[{_LETTERS}]+(?:['’\\-][{_LETTERS}]+)*", re.I)
_CJK_RE = re.compile("[\u3040-\u30ff\u3400-\u4dbf\u4e00-\u9fff\uac00-\ud7af]")
_PLAIN_ENTRY_RE = re.compile(f"[{_LETTERS}'’\\- ]+\\*?")
_FENCE_RE = re.compile(r"```.*?(?:```|\Z)", re.S)
# Long quotes: opener -> (closers, least characters between them). A quote ends at the first closer.
_QUOTES: dict[str, tuple[str, int]] = {
    '"': ('"', 60),
    "“": ("”", 60),
    "„": ("“”", 60),
    "«": ("»", 60),
    "「": ("」", 40),
    "『": ("』", 40),
}
# opener -> an opener with no closer among the next `least` characters (bounded lookahead: linear)
_OPENER_RE = {
    kind: re.compile(f"{re.escape(kind)}(?=[^{re.escape(closers)}]{{{least}}})")
    for kind, (closers, least) in _QUOTES.items()
}
_CLOSER_RE = {kind: re.compile(f"[{re.escape(closers)}]") for kind, (closers, _) in _QUOTES.items()}
_PARA_RE = re.compile(r"\n\s*\n")
_MATH_RE = re.compile(r"[²³⁴ⁿ≥≤≠≈∑∏∫√π∞∈∀∃⊂→×÷±^=]|\\(?:frac|sum|int|sqrt)")
# A number starts at the first digit of its run of digits, commas and dots (the lookbehind and the
# possessive quantifiers: what a retry inside the run or a backtrack could find is the same failure;
# without them "1,1,1,..." over 5,000 characters took 2.5 s).
_WORDS_ASKED_RE = re.compile(
    r"(?<![\d,.])[,.]*+(\d[\d,.]*+)\s*+(?:-\s*+)?(words?|wörter|worte|palabras|mots|parole|字|語|pages?|seiten|páginas|minutes?)",
    re.I,
)
_STEM_HEAD = 3  # stems are indexed by their first letters; shorter stems are rejected at load
_MAX_SCAN = 20_000  # characters read for lengths; longer texts are extrapolated from this prefix
_MAX_ASK = 5_000  # characters of the instruction matched against the lexicons
# Characters of a final message split into instruction and pasted material; a longer one is split
# on its head and tail and its middle counts as pasted. Bounds one request's scoring (on the event
# loop) to a few milliseconds however large its body.
_MAX_SPLIT = 100_000
_MAX_ITEMS = 1_000  # messages, content parts or prompts read from one body (its first and last halves)


def _cjk_count(text: str) -> int:
    return 0 if text.isascii() else len(_CJK_RE.findall(text))


def approx_tokens(text: str, length: int | None = None) -> float:
    """Approximate BPE tokens: 1.3 per Latin/Cyrillic word plus one per CJK character.

    `length`: the characters `text` stands for when it is part of a longer text (default: its own).
    """
    head = text[:_MAX_SCAN]
    estimate = 1.3 * len(_WORD_RE.findall(head)) + _cjk_count(head)
    return estimate * (len(text) if length is None else length) / len(head) if head else 0.0


def bounded(items: Sequence[Any]) -> Sequence[Any]:
    """`items`, or only its first and last _MAX_ITEMS // 2 when longer: scoring time stays bounded."""
    if len(items) <= _MAX_ITEMS:
        return items
    half = _MAX_ITEMS // 2
    return [*items[:half], *items[-half:]]


def content_text(content: Any) -> str:
    """Message content (str, list of parts, None, junk) -> plain text."""
    if isinstance(content, str):
        return content
    if isinstance(content, Sequence) and not isinstance(content, bytes | bytearray):
        parts = [p.get("text") if isinstance(p, Mapping) else p for p in bounded(content)]
        return "\n".join(p for p in parts if isinstance(p, str))
    return ""


@dataclass(frozen=True)
class RequestText:
    """A request split into the places where length can sit."""

    system: str
    history: str  # every turn before the final user message
    ask: str  # the final instruction, pasted material removed
    pasted: str  # code blocks, long quotes and document-like paragraphs of the final message
    user_turns: int
    code_blocks: int
    pasted_chars: int  # len(pasted), plus the middle of a final message too long to split whole

    @classmethod
    def from_body(cls, body: Mapping[str, Any]) -> RequestText:
        """Split a chat or completions body; missing pieces are empty."""
        messages = body.get("messages") if isinstance(body, Mapping) else None
        if not isinstance(messages, Sequence) or isinstance(messages, str | bytes):
            prompt = body.get("prompt") if isinstance(body, Mapping) else None
            if isinstance(prompt, list):
                prompt = "\n".join(p for p in bounded(prompt) if isinstance(p, str))
            messages = [{"role": "user", "content": prompt if isinstance(prompt, str) else ""}]
        turns = [
            (m.get("role"), content_text(m.get("content")))
            for m in bounded(messages)
            if isinstance(m, Mapping)
        ]
        system = "\n".join(t for r, t in turns if r in ("system", "developer"))
        dialog = [(r, t) for r, t in turns if r not in ("system", "developer")]
        last = max((i for i, (r, _) in enumerate(dialog) if r == "user"), default=len(dialog) - 1)
        final = dialog[last][1] if dialog else ""
        history = "\n".join(t for i, (_, t) in enumerate(dialog) if i != last)
        cut = len(final) - _MAX_SPLIT
        if cut > 0:  # the instruction opens or closes a message: split head and tail, the middle is pasted
            half = _MAX_SPLIT // 2
            ask, pasted, blocks = split_pasted(final[:half] + "\n\n" + final[-half:])
        else:
            ask, pasted, blocks = split_pasted(final)
        user_turns = sum(1 for r, _ in dialog if r == "user")
        pasted_chars = len(pasted) + (cut + 1 if cut > 0 else 0)
        return cls(system, history, ask, pasted, user_turns, blocks, pasted_chars)


def quote_spans(text: str) -> list[tuple[int, int]]:
    """(start, end) of each long quote, left to right, as the regex below would find them.

    `"[^"]{60,}"|“[^”]{60,}”|„[^“”]{60,}[“”]|«[^»]{60,}»|「[^」]{40,}」|『[^』]{40,}』` is quadratic on
    a run of openers without a closer (60 KB of `„` took 10-17 s); this scan is linear: per kind, an
    opener followed by enough non-closers is found in C, and the first closer after it is remembered
    until an opener lies past it, so no character is searched twice for the same kind.
    """
    spans: list[tuple[int, int]] = []
    candidates: dict[str, tuple[int, int]] = {}  # kind -> (opener, closer) of its next quote at >= pos
    closer_at: dict[str, int] = {}  # kind -> first closer after the last opener found
    live = [c for c in _QUOTES if c in text]
    pos = 0
    while live:
        for kind in list(live):
            if kind in candidates and candidates[kind][0] >= pos:
                continue
            least = _QUOTES[kind][1]
            found = _OPENER_RE[kind].search(text, pos)
            end = closer_at.get(kind, -1)
            if found is not None and end <= found.start():  # no remembered closer past this opener
                closer = _CLOSER_RE[kind].search(text, found.start() + least + 1)
                end = closer_at[kind] = closer.start() if closer is not None else -1
            if found is None or end < 0:  # no quote of this kind from here on
                live.remove(kind)
                candidates.pop(kind, None)
            else:
                candidates[kind] = (found.start(), end)
        if not live:
            break
        start, end = min(candidates[k] for k in live)
        spans.append((start, end + 1))
        pos = end + 1
    return spans


def split_pasted(text: str) -> tuple[str, str, int]:
    """Final message -> (instruction, pasted material, number of code blocks); linear time."""
    blocks = _FENCE_RE.findall(text)
    rest = _FENCE_RE.sub("\n\n", text)
    spans = quote_spans(rest)
    quotes = [rest[a:b] for a, b in spans]
    if spans:  # each quote becomes one space
        starts, ends = [0, *(e for _, e in spans)], [*(s for s, _ in spans), len(rest)]
        rest = " ".join(rest[a:b] for a, b in zip(starts, ends, strict=True))
    paragraphs = [p.strip() for p in _PARA_RE.split(rest) if p.strip()]
    if len(paragraphs) <= 1:
        return rest.strip(), "\n".join(blocks + quotes), len(blocks)
    first, last = paragraphs[0], paragraphs[-1]
    last_tokens = approx_tokens(last)
    closing_question = last_tokens <= 40 and ("?" in last or "？" in last)
    # an opening instruction introduces what follows ("...:") or asks; otherwise a closing question
    # after three or more paragraphs is the ask and everything before it is the document
    opens = first.endswith((":", "：")) or "?" in first or "？" in first
    if closing_question and len(paragraphs) >= 3 and not opens:
        ask = [last]
    else:
        ask = [first] if approx_tokens(first) <= 80 else []
        # a short closing line without a question counts only when the message opened with the document
        if closing_question or (not ask and 6 < last_tokens <= 40):
            ask.append(last)
        ask = ask or [first]
    pasted = [p for p in paragraphs if p not in ask]
    return "\n\n".join(ask), "\n".join(blocks + quotes + pasted), len(blocks)


class Lexicon:
    """Multilingual cue lists, indexed once: exact words, word stems ("analy*"), phrases, substrings."""

    def __init__(self, categories: Mapping[str, Sequence[str]]) -> None:
        self.categories = tuple(categories)
        self._words: dict[str, list[int]] = {}
        self._stems: dict[str, list[tuple[str, int]]] = {}  # first letters -> (stem, category)
        self._phrases: dict[str, list[tuple[tuple[str, ...], int]]] = {}  # first word -> (rest, category)
        self._substrings: list[tuple[str, int]] = []  # punctuation or Latin script: "o(n", "km/h"
        self._cjk_substrings: list[tuple[str, int]] = []  # looked for only when the text has CJK
        for idx, name in enumerate(self.categories):
            for entry in categories[name]:
                self._add(entry.lower(), idx)

    @classmethod
    def load(cls, path: Path | None = None) -> Lexicon:
        """Read the JSON {category: [entries]} file."""
        data = json.loads((path or DEFAULT_LEXICON_PATH).read_text(encoding="utf-8"))
        return cls({str(k): [str(e) for e in v] for k, v in data.items()})

    def _add(self, entry: str, idx: int) -> None:
        if not _PLAIN_ENTRY_RE.fullmatch(entry):
            target = self._cjk_substrings if _CJK_RE.search(entry) else self._substrings
            target.append((entry, idx))
        elif " " in entry:
            words = tuple(entry.split())
            self._phrases.setdefault(words[0], []).append((words[1:], idx))
        elif entry.endswith("*"):
            if len(entry) <= _STEM_HEAD:
                raise ValueError(f"lexicon stem {entry!r} is shorter than {_STEM_HEAD} letters")
            self._stems.setdefault(entry[:_STEM_HEAD], []).append((entry[:-1], idx))
        else:
            self._words.setdefault(entry, []).append(idx)

    def count(self, text: str, words: Sequence[str] | None = None, has_cjk: bool = True) -> list[int]:
        """Matches per category in lower-cased text (whose lower-cased word tokens may be passed in)."""
        counts = [0] * len(self.categories)
        if words is None:
            words = _WORD_RE.findall(text)
        exact, stems, phrases = self._words, self._stems, self._phrases
        for i, word in enumerate(words):
            for idx in exact.get(word, ()):
                counts[idx] += 1
            for stem, idx in stems.get(word[:_STEM_HEAD], ()):
                if word.startswith(stem):
                    counts[idx] += 1
            for rest, idx in phrases.get(word, ()):
                if tuple(words[i + 1 : i + 1 + len(rest)]) == rest:
                    counts[idx] += 1
        for sub, idx in self._substrings + self._cjk_substrings if has_cjk else self._substrings:
            if sub in text:
                counts[idx] += text.count(sub)
        return counts


def _requested_words(text: str) -> float:
    """Largest explicit output length asked for ("2,000-word", "5 minutes spoken"), in words."""
    best = 0.0
    for num, unit in _WORDS_ASKED_RE.findall(text):
        digits = num.replace(",", "").replace(".", "")
        value = float(digits[:6]) if digits.isdigit() else 0.0
        unit = unit.lower()
        if unit.startswith(("page", "seite", "pági")):
            value *= 400
        elif unit.startswith("minute"):
            value *= 130
        elif unit in ("字", "語"):
            value /= 2.5
        best = max(best, value)
    return best


def _output_budget(body: Mapping[str, Any]) -> float:
    """log2(max_tokens / 512) clipped to [-3, 4]; 0 when the request does not say."""
    values = [body.get(k) for k in ("max_tokens", "max_completion_tokens")]
    numbers = [
        float(v) for v in values if isinstance(v, int | float) and not isinstance(v, bool) and 0 < v < 1e12
    ]
    if not numbers:
        return 0.0
    return max(-3.0, min(4.0, math.log2(max(numbers) / 512)))


def _enumerations(text: str) -> int:
    """Distinct numbered items asked for: "(1) ... (2) ...", "1. ...", "①"."""
    found = 0
    for i in range(1, 9):
        n = str(i)
        if (
            f"({n})" in text
            or f"\n{n}." in text
            or f"\n{n})" in text
            or f" {n}) " in text
            or text.startswith(n + ".")
        ):
            found += 1
    return found + sum(text.count(c) for c in "①②③④⑤")


def _shape_features(ask: str, tokens: Sequence[str]) -> dict[str, float]:
    """Surface shape of the instruction: numbers, symbols, acronyms, word length, asked-for output size."""
    latin = [t for t in tokens if not t[0].isdigit()]
    letters = sum(len(t) for t in latin)
    # "GDPR", "R21", "OperationalError", "iPhone": all-caps or mixed-case tokens
    acronyms = sum(1 for t in latin if len(t) > 1 and (t.isupper() or not (t.islower() or t.istitle())))
    return {
        "questions": float(min(ask.count("?") + ask.count("？"), 4)),
        "enumerations": float(min(_enumerations(ask), 6)),
        "numbers": math.log1p(len(tokens) - len(latin)),
        "math_symbols": math.log1p(len(_MATH_RE.findall(ask))),
        "acronyms": math.log1p(acronyms),
        "word_length": max(-2.0, min(3.0, letters / len(latin) - 4.5)) if len(latin) >= 3 else 0.0,
        "long_words": math.log1p(sum(1 for t in latin if len(t) >= 10)),
        "requested_words": max(0.0, min(5.0, math.log2(max(_requested_words(ask), 1.0) / 250))),
    }


class FeatureExtractor:
    """Computes FEATURE_NAMES for a request body."""

    def __init__(self, lexicon: Lexicon) -> None:
        assert set(LEXICON_CATEGORIES) <= set(lexicon.categories), "lexicon file lacks a category"
        self.lexicon = lexicon
        self._order = [lexicon.categories.index(c) for c in LEXICON_CATEGORIES]

    def extract(self, body: Mapping[str, Any]) -> dict[str, float]:
        """Raw feature values, keyed by FEATURE_NAMES."""
        if not isinstance(body, Mapping):
            body = {}
        req = RequestText.from_body(body)
        ask = req.ask[:_MAX_ASK]
        tokens = _WORD_RE.findall(ask)
        cjk = _cjk_count(ask)
        ask_tokens = (1.3 * len(tokens) + cjk) * len(req.ask) / len(ask) if ask else 0.0
        pasted_tokens = approx_tokens(req.pasted, req.pasted_chars)
        history_tokens = approx_tokens(req.history)
        system_tokens = approx_tokens(req.system)
        letters = sum(len(t) for t in tokens)
        tools = body.get("tools")
        feats = {
            "log_tokens": math.log1p(ask_tokens + pasted_tokens + history_tokens + system_tokens),
            "log_ask_tokens": math.log1p(ask_tokens),
            "log_pasted_tokens": math.log1p(pasted_tokens),
            "pasted_share": pasted_tokens / (pasted_tokens + ask_tokens) if pasted_tokens else 0.0,
            "log_history_tokens": math.log1p(history_tokens),
            "log_system_tokens": math.log1p(system_tokens),
            "user_turns": float(min(max(req.user_turns - 1, 0), 5)),
            "code_blocks": float(min(req.code_blocks, 3)),
            "cjk_share": cjk / (cjk + letters) if cjk else 0.0,
            "max_tokens_log2": _output_budget(body),
            "tools": math.log2(1 + len(tools)) if isinstance(tools, list) else 0.0,
            "short_followup": 1.0 if req.history and ask_tokens <= 10 else 0.0,
            **_shape_features(ask, tokens),
        }
        counts = self.lexicon.count(ask.lower(), [t.lower() for t in tokens], has_cjk=cjk > 0)
        for name, idx in zip(LEXICON_CATEGORIES, self._order, strict=True):
            feats[f"lex_{name}"] = math.log1p(counts[idx])
        if ask_tokens > 15:  # "Hi, ..." opening or "and in ..." inside a long request says nothing
            feats["lex_greeting"] = feats["lex_followup"] = 0.0
        return feats
