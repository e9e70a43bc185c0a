"""The guided-decoding error: a request's constraint is malformed, or the grammar library refuses it."""

from __future__ import annotations

from engine.errors import InvalidRequestError


class GuidedDecodingError(InvalidRequestError):
    """400 invalid_request_error; `param` names the request field (e.g. response_format.json_schema.schema).

    Codes: invalid_json_schema (a schema), invalid_grammar (a regex, choice, grammar or structural
    tag). The message says why: ours for a malformed field, the library's (trimmed) for a refusal.
    """

    code = "invalid_grammar"
