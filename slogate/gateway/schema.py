"""The request bodies the gateway accepts, as pydantic models: one definition that both checks
every request (a 400 in the OpenAI shape before it takes a queue slot) and becomes the OpenAPI
schema that clients and the fuzzer (schemathesis) read.

Only the fields the gateway or every engine understands are typed; anything else (vLLM's
`top_k`, `guided_json`, ...) passes through untouched. Types are strict: `"stream": "yes"` or
`"max_tokens": 5.5` is refused here instead of being coerced or failing upstream.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from slogate.gateway.errors import APIError

DAY_MS = 86_400_000.0
Ms = Annotated[float, Field(ge=1, le=DAY_MS)]  # below a millisecond no SLO is meaningful (and 1e-320 / 1000 is 0)
Seconds = Annotated[float, Field(ge=0.001, le=DAY_MS / 1000)]

_INT_FIELDS = ("max_tokens", "max_completion_tokens", "max_output_tokens", "n", "seed", "priority", "top_n", "dimensions")


def _integral(v: Any) -> Any:
    """JSON has one number type: 5.0 is the integer 5 (as JSON Schema says), 5.5 and "5" are not."""
    return int(v) if isinstance(v, float) and v.is_integer() and abs(v) < 2**63 else v


PositiveInt = Annotated[int, Field(ge=1)]


class _Open(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow", allow_inf_nan=False)


class _Closed(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid", allow_inf_nan=False)


class SLOBody(_Closed):
    """A request's own SLO (any field left out is inherited; see docs/reference/slo.md)."""

    kind: Literal["auto", "latency", "deadline", "best_effort"] | None = None
    ttft_ms: Ms | None = None
    tbt_ms: Ms | None = None
    deadline_ms: Ms | None = None
    waiting_ms: Ms | None = None


class WorkflowBody(_Closed):
    id: Annotated[str, Field(min_length=1, max_length=256)]
    stage: Annotated[int, Field(ge=0, le=100_000)] = 0
    deadline_ms: Ms | None = None
    label: Annotated[str, Field(max_length=256)] | None = None
    final: bool = False

    @model_validator(mode="before")
    @classmethod
    def _ints(cls, v: Any) -> Any:
        return {**v, "stage": _integral(v["stage"])} if isinstance(v, dict) and "stage" in v else v


class StreamOptions(_Open):
    include_usage: bool | None = None


class _Routed(_Open):
    """What every request the gateway schedules carries: a model, the OpenAI fields slogate reads,
    and slogate's own deadline / tier fields (removed before the request goes upstream)."""

    model: Annotated[str, Field(min_length=1)]
    user: str | None = None
    service_tier: str | None = None
    slo: SLOBody | None = None
    deadline: Seconds | None = None
    waiting_time: Seconds | None = None
    priority: str | int | None = Field(None, description="a tier name, or vLLM's integer priority (passed upstream)")
    tier: str | None = None
    workflow: WorkflowBody | None = None

    @model_validator(mode="before")
    @classmethod
    def _ints(cls, v: Any) -> Any:
        if isinstance(v, dict) and any(isinstance(v.get(k), float) for k in _INT_FIELDS):
            v = {**v, **{k: _integral(v[k]) for k in _INT_FIELDS if isinstance(v.get(k), float)}}
        return v


class _Common(_Routed):
    """A generated answer (chat, completions, responses)."""

    stream: bool | None = None
    stream_options: StreamOptions | None = None
    max_tokens: PositiveInt | None = None
    max_completion_tokens: PositiveInt | None = None
    temperature: Annotated[float, Field(ge=0)] | None = None
    top_p: Annotated[float, Field(gt=0, le=1)] | None = None
    n: PositiveInt | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    # slogate's latency fields (JITServe's names)
    target_ttft: Seconds | None = None
    target_tft: Seconds | None = None
    target_tbt: Seconds | None = None


class Message(_Open):
    role: Annotated[str, Field(min_length=1)]
    content: str | list[Any] | None = None


class ChatRequest(_Common):
    messages: Annotated[list[Message], Field(min_length=1)]


class CompletionRequest(_Common):
    prompt: str | list[Any]


class ResponsesRequest(_Common):
    input: str | list[Any]
    max_output_tokens: PositiveInt | None = None


class _Pooling(_Routed):
    """Work with no generated answer (embeddings, rerank, score, tokenize): what the engine reads
    passes through; it is never streamed."""

    stream: Literal[False] | None = None


class EmbeddingRequest(_Pooling):
    # OpenAI's forms: a text, texts, one token list, token lists.
    input: str | Annotated[list[str], Field(min_length=1)] | Annotated[list[int], Field(min_length=1)] \
        | Annotated[list[list[int]], Field(min_length=1)]
    encoding_format: Literal["float", "base64"] | None = None
    dimensions: Annotated[int, Field(ge=1, le=16384)] | None = None


class RerankRequest(_Pooling):
    query: str | dict[str, Any]
    documents: Annotated[list[Any], Field(min_length=1)]
    top_n: PositiveInt | None = None


class ScoreRequest(_Pooling):
    """vLLM's /v1/score: `text_1` against `text_2` (each a string or a list of them)."""


class TokenizeRequest(_Pooling):
    """vLLM's /tokenize (`prompt` or `messages`) and /detokenize (`tokens`); `model` may be left
    out when the gateway serves one model."""

    model: Annotated[str, Field(min_length=1)] | None = None  # type: ignore[assignment]


MODELS: dict[str, type[_Routed]] = {"chat": ChatRequest, "completions": CompletionRequest, "responses": ResponsesRequest,
                                  "embeddings": EmbeddingRequest, "rerank": RerankRequest, "score": ScoreRequest,
                                  "tokenize": TokenizeRequest, "detokenize": TokenizeRequest}
# Kinds whose answer is not generated token by token: deadline or best-effort work, one unit each.
POOLING = frozenset({"embeddings", "rerank", "score", "tokenize", "detokenize"})


_TAGS = {"str", "int", "float", "bool", "list", "dict", "none", "literal"}


def _param(loc: tuple[int | str, ...]) -> str:
    out = ""
    for p in loc:
        out += f"[{p}]" if isinstance(p, int) else (f".{p}" if out else str(p))
    return out


def validate_body(kind: str, body: dict[str, Any]) -> None:
    """400 in the OpenAI shape, naming the first offending field, when the body does not fit."""
    try:
        MODELS[kind].model_validate(body)
        for k in _INT_FIELDS:  # 5.0 → 5 in the body itself, for the SLO resolution and the engine
            v = body.get(k)
            if isinstance(v, float):
                body[k] = int(v)
        wf = body.get("workflow")
        if isinstance(wf, dict) and isinstance(wf.get("stage"), float):
            wf["stage"] = int(wf["stage"])
    except ValidationError as e:
        err = e.errors(include_url=False)[0]
        # Drop pydantic's union-member tags ("str", "list[str]", "function-after[...]") from the path.
        loc = tuple(p for p in err["loc"] if isinstance(p, int) or not (p in _TAGS or "[" in p or "-" in p))
        param = _param(loc) or None
        raise APIError(400, f"{param}: {err['msg']}" if param else err["msg"], param=param) from None


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorBody(BaseModel):
    error: ErrorDetail


_ERR = {"$ref": "#/components/schemas/ErrorBody"}
_ERRORS = {"400": "invalid request", "401": "missing or invalid API key", "403": "key not allowed", "404": "unknown model",
           "413": "body too large", "429": "not admitted in time or rate limited (Retry-After)", "502": "every upstream attempt failed",
           "503": "queue full or no replica (Retry-After)"}
# One server-sent event: `data:` carries an OpenAI chunk (or `[DONE]`, or an `error` object when
# the upstream fails mid-stream).
_SSE_EVENT = {"type": "object", "properties": {"data": {"type": "string"}, "event": {"type": "string"}}}
PATHS = {"chat": "/v1/chat/completions", "completions": "/v1/completions", "responses": "/v1/responses",
         "embeddings": "/v1/embeddings", "rerank": "/v1/rerank", "score": "/v1/score", "tokenize": "/tokenize", "detokenize": "/detokenize"}


def openapi(app: Any) -> dict[str, Any]:
    """FastAPI's schema plus the request bodies and responses above (the routes read raw bodies,
    so FastAPI cannot see them)."""
    from fastapi.openapi.utils import get_openapi

    schema = get_openapi(title="slogate", version="0.1.0", description="SLO-aware OpenAI-compatible gateway", routes=app.routes)
    comps = schema.setdefault("components", {}).setdefault("schemas", {})
    for model in (*MODELS.values(), ErrorBody):
        js = model.model_json_schema(ref_template="#/components/schemas/{model}")
        comps.update(js.pop("$defs", {}))
        comps[model.__name__] = js
    errors = {code: {"description": d, "content": {"application/json": {"schema": _ERR}}} for code, d in _ERRORS.items()}
    for kind, path in PATHS.items():
        op = schema["paths"][path]["post"]
        op["requestBody"] = {"required": True, "content": {"application/json": {"schema": {"$ref": f"#/components/schemas/{MODELS[kind].__name__}"}}}}
        op["responses"] = {"200": {"description": "the answer (JSON), or a stream of server-sent events when `stream` is true",
                                   "content": {"application/json": {"schema": {"type": "object"}},
                                               "text/event-stream": {"schema": _SSE_EVENT}}}, **errors}
    for path, codes in (("/health", ("503",)), ("/health/ready", ("503",)), ("/admin/state", ("401", "403")),
                        ("/v1/models", ("401",)), ("/v1/models/{model}", ("401", "404"))):
        for code in codes:
            schema["paths"][path]["get"]["responses"][code] = {
                "description": "unavailable" if code == "503" else _ERRORS[code],
                "content": {"application/json": {"schema": {"type": "object"} if code == "503" else _ERR}}}
    admin = {"400": "the new config was rejected (the running one stays)", "401": _ERRORS["401"], "403": "no admin key is configured",
             "404": "no backend of that name", "409": "started without a config source to reload from"}
    for path, codes in (("/admin/backends/{name}/drain", ("401", "403", "404")), ("/admin/backends/{name}/undrain", ("401", "403", "404")),
                        ("/admin/reload", ("400", "401", "403", "409"))):
        for code in codes:
            schema["paths"][path]["post"]["responses"][code] = {"description": admin[code], "content": {"application/json": {"schema": _ERR}}}
    for code in ("401", "403", "404"):
        schema["paths"]["/admin/workflows/{wf_id}"]["get"]["responses"][code] = {
            "description": "no such workflow" if code == "404" else admin[code], "content": {"application/json": {"schema": _ERR}}}
    schema["paths"]["/metrics"]["get"]["responses"]["200"]["content"] = {"text/plain": {"schema": {"type": "string"}}}
    return schema
