"""The guided-decoding error: a request's constraint is malformed, or the grammar library refuses it."""

from __future__ import annotations

import re

from engine.errors import InvalidRequestError

_MAX_REASON = 400
_SOURCE_LINE = re.compile(r"^\s*(\d+\s*\|.*|\^+)?\s*$")  # llguidance's excerpt lines: "  1 | ...", "  ^"


class GuidedDecodingError(InvalidRequestError):
    """400 invalid_request_error; `param` names the request field (e.g. response_format.json_schema.schema).

    Codes: invalid_json_schema (a schema), invalid_grammar (a regex, choice, grammar or structural
    tag). The message says why: ours for a malformed field, the library's (trimmed) for a refusal.
    """

    code = "invalid_grammar"


def library_refusal(kind: str, param: str | None, message: str, verdict: str) -> GuidedDecodingError:
    """The 400 for a constraint of `kind` that llguidance refused, its reason on one bounded line
    (the grammar excerpts and XML-ish markers of its messages dropped): "the JSON schema <verdict>: ..."."""
    if message.strip().startswith("NoExtensionBias"):  # llguidance's word for a grammar that matches nothing
        message = "no output can satisfy it (a $ref cycle, an empty character class or intersection, ...)"
    lines = [line.strip() for line in message.splitlines() if not _SOURCE_LINE.match(line)]
    reason = " ".join(line for line in lines if not (line.startswith("<") and line.endswith("/>")))
    if len(reason) > _MAX_REASON:
        reason = reason[: _MAX_REASON - 3] + "..."
    schema = kind in ("json_schema", "json_object")
    what = "JSON schema" if schema else kind.replace("_", " ")
    code = "invalid_json_schema" if schema else "invalid_grammar"
    return GuidedDecodingError(f"the {what} {verdict}: {reason}", code=code, param=param)
