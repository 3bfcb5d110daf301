"""OpenAI request bodies → a validated :class:`ParsedRequest`; every rejection names its field.

Three layers: (1) :func:`parse_json`, the raw body: malformed JSON, nesting deeper than 64
levels, text that is not valid Unicode (a lone surrogate, named by its path:
``messages[0].content``); (2) one pydantic model per body (:class:`CompletionBody`,
:class:`ChatBody`, :class:`TokenizeBody`, :class:`DetokenizeBody`; shared sampling fields in
:class:`SamplingBody`): strict types (a boolean is not an integer, ``"5"`` not a number),
ranges, shapes; ``null`` counts as absent; an error's ``param`` is the field's path
(:func:`param_of`); (3) small checks that need the served model (:class:`ModelContext`): its
name (404), token ids inside the vocabulary, prompt plus ``max_tokens`` within the limit, the
tokenizer and chat template.

Routing fields change where a request runs, never its output: ``cache_salt`` (vLLM's: requests
with different salts never share cached KV) and the affinity hint ``prompt_cache_key``, else
``user`` (:attr:`Job.affinity`; services/router/pairing.py). Fields outside the models:
:class:`_Ignored`'s never change the output (``metadata``, ``store``, ``service_tier``, …,
``stream_options.include_obfuscation``): checked, accepted and logged once per name.
:data:`UNSUPPORTED`'s would change it and are not implemented: accepted only at their neutral
value (``best_of: 1``, ``tool_choice: "none"``, …, or null), else a 400 naming them. Any other field (``suffix``, ``guided_json``, a typo such as
``max_token``) is a 400 naming it, as OpenAI answers: a field we do not know may change the output.
"""

from __future__ import annotations

import json
import logging
import re
import uuid
from dataclasses import dataclass
from typing import Annotated, Any, Callable, Literal, Union

from pydantic import (BaseModel, ConfigDict, Discriminator, Field, Strict, Tag, ValidationError,
                      model_validator)

from engine.model.sampler import MAX_LOGPROBS
from services.protos import common_pb2
from services.router.backend import Job
from services.router.completion import CompletionRequest

logger = logging.getLogger("cpserve.router")

MAX_SEED = 2**63 - 1
MAX_STOP_STRINGS = 16
MAX_N = 16  # samples per prompt: forks of one prefill, sharing the prompt's rows on decode
MAX_PROMPTS = 64  # prompts in one completions request
MAX_CHOICES = MAX_N * 4  # n × prompts
MAX_CACHE_SALT = 256  # characters of cache_salt (the services' limit: services/common/convert.py)
ROLES = ("system", "developer", "user", "assistant")


class ApiError(Exception):
    """An OpenAI-style error: HTTP ``status`` and the body ``{"error": {...}}``."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 type: str = "invalid_request_error", headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.type = status, message, param, code, type
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def invalid(param: str | None, message: str, code: str = "invalid_value") -> ApiError:
    return ApiError(400, f"{param}: {message}" if param else message, param, code)


@dataclass(frozen=True)
class ModelContext:
    """What validation needs to know about the served model and the cluster."""

    name: str
    tokenizer: Any
    vocab_size: int
    eos_token_ids: tuple[int, ...]
    max_positions: int
    capacity_tokens: Callable[[], int | None]  # smallest decode cache, once known
    default_max_tokens: int | None = None  # for requests without max_tokens (None: up to the context limit)
    sampling_defaults: tuple[tuple[str, float], ...] = ()  # generation_config.json's temperature/top_p/top_k

    def token_limit(self) -> tuple[int, str]:
        """(prompt + max_tokens limit, what sets it)."""
        cap = self.capacity_tokens()
        if cap is not None and cap < self.max_positions:
            return cap, f"the smallest decode cache ({cap} tokens)"
        return self.max_positions, f"the maximum model length ({self.max_positions} tokens)"

    def max_tokens_for(self, num_prompt: int, given: int | None) -> int:
        """A request's max_tokens: as given, else (as vLLM) up to the context limit — capped by
        ``default_max_tokens`` when the router is configured with one."""
        if given is not None:
            return given
        room = max(self.token_limit()[0] - num_prompt, 1)  # a prompt at the limit is refused by check_length
        return room if self.default_max_tokens is None else min(self.default_max_tokens, room)


@dataclass(frozen=True)
class ParsedRequest:
    completions: tuple[CompletionRequest, ...]  # one per choice, in choice order (prompt i, sample j: i·n + j)
    stream: bool
    include_usage: bool
    return_token_ids: bool
    continuous_usage: bool = False  # stream_options.continuous_usage_stats (with include_usage)
    logprobs: int | None = None  # None: no logprobs; N: each token's and the top N (chat: top_logprobs)
    echo: bool = False  # completions: the prompt's text (and, with logprobs, its logprobs) first
    num_prompts: int = 1

    @property
    def completion(self) -> CompletionRequest:
        return self.completions[0]


# ---- 1. the raw body ------------------------------------------------------------------------
MAX_JSON_DEPTH = 64  # deeper request bodies are refused before parsing
_BRACKETS = re.compile(rb'"(?:[^"\\]|\\.)*"|[\[\]{}]')  # strings (skipped) and brackets
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F][0-9a-fA-F]{2}")


def _json_depth(raw: bytes) -> int:
    """The deepest nesting of arrays/objects in ``raw`` (brackets inside strings ignored)."""
    depth = deepest = 0
    for m in _BRACKETS.finditer(raw):
        c = m.group()
        if c in (b"[", b"{"):
            depth += 1
            deepest = max(deepest, depth)
        elif c in (b"]", b"}"):
            depth -= 1
    return deepest


def _unencodable(value: Any, path: str = "") -> str | None:
    """The path of the first string (or key) in ``value`` that is not valid Unicode text (a lone
    surrogate from a ``\\udXXX`` escape), else None."""
    stack = [(value, path)]
    while stack:
        v, where = stack.pop()
        if isinstance(v, str):
            try:
                v.encode("utf-8")
            except UnicodeEncodeError:
                return where or "body"
        elif isinstance(v, dict):
            for k, x in v.items():
                name = k.encode("utf-8", "backslashreplace").decode() if isinstance(k, str) else str(k)
                stack.append((k, where or "body"))
                stack.append((x, f"{where}.{name}" if where else name))  # the path itself stays printable
        elif isinstance(v, list):
            stack.extend((x, f"{where}[{i}]") for i, x in enumerate(v))
    return None


def parse_json(raw: bytes) -> dict[str, Any]:
    """The request body as a dict, or a 400: invalid JSON, nesting deeper than MAX_JSON_DEPTH,
    or text that is not valid Unicode (a lone surrogate), naming where."""
    def no_constants(name: str):
        raise ValueError(f"{name} is not valid JSON")

    if raw.count(b"[") + raw.count(b"{") > MAX_JSON_DEPTH and _json_depth(raw) > MAX_JSON_DEPTH:
        raise ApiError(400, f"the request body nests arrays/objects deeper than {MAX_JSON_DEPTH} levels", None,
                       "invalid_json")
    try:
        body = json.loads(raw, parse_constant=no_constants)
    except (ValueError, UnicodeDecodeError, RecursionError) as e:
        raise ApiError(400, f"the request body is not valid JSON: {e}", None, "invalid_json") from None
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object", None, "invalid_json")
    if _SURROGATE_ESCAPE.search(raw):  # only an escape can make a lone surrogate; check the strings
        where = _unencodable(body)
        if where is not None:
            raise invalid(where, "is not valid Unicode text (a lone UTF-16 surrogate)", "invalid_text")
    return body


# ---- 2. the bodies as pydantic models --------------------------------------------------------
def _tagged(tag_of: Callable[[Any], str | None], what: str, **members: Any) -> Any:
    """A union whose member ``tag_of(value)`` picks (tags, ``<name>``, never reach a param); a
    value no member takes is one error: "must be ``what``"."""
    return Annotated[Union[tuple(Annotated[t, Tag(f"<{name}>")] for name, t in members.items())],
                     Discriminator(tag_of, custom_error_type="invalid_type", custom_error_message=f"must be {what}")]


def _prompt_tag(v: Any) -> str | None:
    if isinstance(v, list):
        return "<batch>" if v and all(isinstance(x, (str, list)) for x in v) else "<ids>"
    return "<text>" if isinstance(v, str) else None


def _parts_tag(v: Any) -> str | None:
    return "<text>" if isinstance(v, str) else "<parts>" if isinstance(v, list) else None


def _stop_tag(v: Any) -> str | None:
    return "<text>" if isinstance(v, str) else "<list>" if isinstance(v, list) else None


TokenIds = Annotated[list[int], Field(min_length=1)]
OnePrompt = _tagged(_prompt_tag, "a string or a list of token ids", text=str, ids=TokenIds)
Prompt = _tagged(_prompt_tag, "a string, a list of token ids, or a list of strings or token-id lists",
                 text=str, ids=TokenIds, batch=Annotated[list[OnePrompt], Field(max_length=MAX_PROMPTS)])
Content = _tagged(_parts_tag, "a string or a list of text parts", text=str, parts=list["TextPart"])
Stop = _tagged(_stop_tag, "a string or a list of strings and token ids", text=str, list=list[Union[str, int]])
Finite = Annotated[float, Field(allow_inf_nan=False)]
LogitBias = dict[Annotated[int, Strict(False)], Annotated[float, Field(ge=-100, le=100)]]  # JSON keys are strings


class _Body(BaseModel):
    """Strict, closed, and ``null`` counts as absent (as OpenAI)."""

    model_config = ConfigDict(strict=True, extra="forbid", frozen=True)

    @model_validator(mode="before")
    @classmethod
    def _nulls_are_absent(cls, v: Any) -> Any:
        return {k: x for k, x in v.items() if x is not None} if isinstance(v, dict) else v


class TextPart(_Body):  # the only content part we take (an error in one names the part)
    type: Literal["text"]
    text: str


class Message(_Body):
    role: Literal[ROLES]
    content: Content

    @property
    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class StreamOptions(_Body):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's: the usage so far on every chunk (with include_usage)
    include_obfuscation: bool | None = None  # ignored: OpenAI's padding field, which we never add


# ---- the two lists: accepted and ignored; refused unless neutral ------------------------------
class _Ignored(_Body):
    """Fields that never change the output: type-checked, accepted, ignored (logged once)."""

    metadata: dict[str, str] | None = None
    store: bool | None = None
    service_tier: str | None = None
    parallel_tool_calls: bool | None = None  # means something only with tools, which are refused
    safety_identifier: str | None = None


IGNORED = frozenset(_Ignored.model_fields) | {"stream_options.include_obfuscation"}

# Output-changing and not implemented: accepted only at one of these values (or null), else a 400.
UNSUPPORTED: dict[str, tuple] = {
    "best_of": (1,), "tools": ([],), "tool_choice": ("none",), "functions": ([],), "function_call": ("none",),
    "response_format": ({"type": "text"},), "modalities": (["text"],), "min_p": (0, 0.0), "use_beam_search": (False,),
    "echo": (False,),  # echo: on chat (vLLM's)
    "add_generation_prompt": (True,), "add_special_tokens": (True,)}  # the last two: vLLM's, /tokenize's


def _strip_neutral(body: dict, model: type[BaseModel]) -> dict:
    """``body`` less the UNSUPPORTED fields at a neutral value (a field the model declares is its own)."""
    out = {}
    for name, value in body.items():
        neutral = UNSUPPORTED.get(name) if name not in model.model_fields else None
        if neutral is not None:
            if value is not None and not any(type(value) is type(n) and value == n for n in neutral):
                raise ApiError(400, f"{name}: not supported; only {' or '.join(map(json.dumps, neutral))} is "
                                    f"accepted, got {json.dumps(value)[:80]}", name, "unsupported_value")
            continue
        out[name] = value
    return out


_logged: set[str] = set()


def _log_ignored(req: BaseModel) -> None:
    names = set(req.model_fields_set) & IGNORED
    if getattr(req, "stream_options", None) and req.stream_options.include_obfuscation is not None:
        names.add("stream_options.include_obfuscation")
    for name in sorted(names - _logged):
        _logged.add(name)
        logger.info("request field %s is accepted and ignored: it does not change the output (logged once)", name)


class SamplingBody(_Ignored):
    """The fields both generation endpoints take."""

    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    temperature: Finite | None = Field(None, ge=0)  # temperature/top_p/top_k: None → generation_config.json's
    top_p: Finite | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1)  # -1 or 0: off
    seed: int | None = Field(None, ge=0, le=MAX_SEED)
    stop: Stop | None = None
    stop_token_ids: list[int] = []
    ignore_eos: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    return_token_ids: bool = False
    n: int = Field(1, ge=1, le=MAX_N)
    min_tokens: int = Field(0, ge=0)
    presence_penalty: Finite = Field(0.0, ge=-2, le=2)
    frequency_penalty: Finite = Field(0.0, ge=-2, le=2)
    repetition_penalty: Finite = Field(1.0, gt=0, le=2)
    logit_bias: LogitBias = {}
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    # routing: where the request runs, never what it outputs
    cache_salt: str = Field("", max_length=MAX_CACHE_SALT)  # "": no salt
    prompt_cache_key: str | None = None  # the affinity hint (else user)
    user: str | None = None

    @property
    def affinity(self) -> str:
        return self.prompt_cache_key or self.user or ""


class CompletionBody(SamplingBody):
    prompt: Prompt
    echo: bool = False
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)


class ChatBody(SamplingBody):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)


class TokenizeBody(_Body):
    model: str | None = None
    prompt: str | None = None
    messages: list[Message] | None = Field(None, min_length=1)


class DetokenizeBody(_Body):
    model: str | None = None
    tokens: list[int]


_INDEXED = {"messages", "<batch>", "<parts>"}  # lists whose items are named by index
_CODES = {"missing": ("missing_required_parameter", "is required"),
          "extra_forbidden": ("unsupported_parameter", "unsupported parameter")}


def param_of(loc: tuple[str | int, ...]) -> str | None:
    """A pydantic error location as the client wrote the field: ``messages[0].content``,
    ``prompt[1]``, ``stream_options.include_usage``. Union tags are dropped; a list of scalars
    (token ids, stop strings), a map (``logit_bias``) and a content part are named whole."""
    path = ""
    for i, part in enumerate(loc):
        if isinstance(part, int):
            if i == 0 or loc[i - 1] not in _INDEXED:
                break
            path += f"[{part}]"
            if loc[i - 1] == "<parts>":
                break
        elif not part.startswith("<"):
            if path in ("logit_bias", "metadata"):
                break
            path += f".{part}" if path else part
    return path or None


def validate(model: type[_Body], body: dict) -> Any:
    """``body`` as ``model``, or a 400 naming the first bad field."""
    try:
        req = model.model_validate(_strip_neutral(body, model))
    except ValidationError as e:
        err = e.errors(include_url=False)[0]
        code, message = _CODES.get(err["type"], (None, None))
        if code is None:
            code = "invalid_type" if err["type"].endswith(("_type", "_parsing")) else "invalid_value"
            message = err["msg"][:1].lower() + err["msg"][1:]
            if err["type"] == "value_error":
                message = str(err["ctx"]["error"])
            if not isinstance(err.get("input"), (dict, list)):
                message += f", got {json.dumps(err['input'])[:80]}"
        raise invalid(param_of(err["loc"]), message, code) from None
    _log_ignored(req)
    return req


# ---- 3. checks that need the model -----------------------------------------------------------
def _check_model(name: str | None, ctx: ModelContext) -> None:
    if name is not None and name != ctx.name:
        raise ApiError(404, f"model: the model '{name}' does not exist; this server serves '{ctx.name}'", "model",
                       "model_not_found")


def token_ids(ids: list[int], param: str, vocab_size: int) -> list[int]:
    bad = next((t for t in ids if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise invalid(param, f"token id {bad} is outside the vocabulary [0, {vocab_size})", "invalid_token_id")
    return list(ids)


def _refuse_provably_long(ctx: ModelContext, text: str, param: str) -> None:
    """A 400 for ``text`` if it is provably at least the context limit in tokens, without
    tokenizing it: from the tokenizer's lower bound (engine/model/tokenizer.py ``min_tokens``:
    its bytes over the most bytes one token covers, where no normalizer can shrink the text)."""
    bound = getattr(ctx.tokenizer, "min_tokens", lambda _t: None)(text)
    limit, why = ctx.token_limit()
    if bound is not None and bound >= limit:
        raise invalid(param, f"the prompt is at least {bound} tokens (its text is too long to tokenize: "
                             f"{len(text)} characters); prompt plus max_tokens may be at most {limit} tokens ({why})",
                      "context_length_exceeded")


def encode_text(ctx: ModelContext, text: str, param: str) -> list[int]:
    """``text``'s ids (BOS included where the tokenizer adds it); a 400 if the model has none,
    or if the text is provably longer than the context (then it is not tokenized at all)."""
    from engine.model.tokenizer import NoTokenizerError

    try:
        _refuse_provably_long(ctx, text, param)
        return ctx.tokenizer.encode(text)
    except NoTokenizerError as e:
        raise invalid(param, str(e), "no_tokenizer") from None


def chat_prompt_ids(messages: list[Message], ctx: ModelContext) -> list[int]:
    """The ids of the conversation rendered with the model's chat template (the rendered text is
    checked against the context before it is tokenized)."""
    from engine.model.tokenizer import NoChatTemplateError, NoTokenizerError

    try:
        text = ctx.tokenizer.render_chat([{"role": m.role, "content": m.text} for m in messages])
    except NoTokenizerError as e:
        raise invalid("messages", str(e), "no_tokenizer") from None
    except NoChatTemplateError as e:
        raise invalid("messages", str(e), "no_chat_template") from None
    except Exception as e:  # the template's own checks (raise_exception), or a template error
        raise invalid("messages", f"the chat template rejected the conversation: {e}", "chat_template_error") from None
    _refuse_provably_long(ctx, text, "messages")
    return ctx.tokenizer.encode_rendered(text)


def check_length(num_prompt: int, max_tokens: int, ctx: ModelContext, prompt_param: str, max_param: str) -> None:
    """Prompt plus max_tokens must fit the model's positions and the smallest decode cache."""
    limit, why = ctx.token_limit()
    if num_prompt >= limit:
        raise invalid(prompt_param, f"the prompt is {num_prompt} tokens; prompt plus max_tokens may be at most "
                                    f"{limit} tokens ({why})", "context_length_exceeded")
    if num_prompt + max_tokens > limit:
        raise invalid(max_param, f"prompt ({num_prompt} tokens) plus max_tokens ({max_tokens}) exceeds {limit} "
                                 f"tokens ({why})", "context_length_exceeded")


def stop_token_set(sampling: common_pb2.Sampling, eos_token_ids: tuple[int, ...]) -> frozenset[int]:
    """The ids that end a stream, by the rule of common.proto (user ids, plus EOS unless ignored)."""
    return frozenset(sampling.stop_token_ids) | (frozenset() if sampling.ignore_eos else frozenset(eos_token_ids))


# ---- the request -------------------------------------------------------------------------------
def _prompts(req: CompletionBody | ChatBody, ctx: ModelContext) -> list[tuple[list[int], str, str | None]]:
    """(ids, param, text as sent for echo) of each prompt."""
    if isinstance(req, ChatBody):
        return [(chat_prompt_ids(req.messages, ctx), "messages", None)]
    batch = _prompt_tag(req.prompt) == "<batch>"
    out = []
    for i, p in enumerate(req.prompt if batch else [req.prompt]):
        param = f"prompt[{i}]" if batch else "prompt"
        ids = encode_text(ctx, p, param) if isinstance(p, str) else token_ids(p, param, ctx.vocab_size)
        if not ids:
            raise invalid(param, "must not be empty")
        out.append((ids, param, p if isinstance(p, str) else None))
    return out


def _max_tokens(req: CompletionBody | ChatBody) -> int | None:
    """max_tokens (or chat's max_completion_tokens) as given; None: not given."""
    alias = getattr(req, "max_completion_tokens", None)
    if None not in (req.max_tokens, alias) and req.max_tokens != alias:
        raise invalid("max_completion_tokens", f"differs from max_tokens ({req.max_tokens} vs {alias})")
    return req.max_tokens or alias


def _stops(req: CompletionBody | ChatBody, ctx: ModelContext) -> tuple[tuple[str, ...], list[int]]:
    """(stop strings, stop token ids): ``stop`` holds both, ``stop_token_ids`` more ids."""
    stop = [req.stop] if isinstance(req.stop, str) else req.stop or []
    strings = [s for s in stop if isinstance(s, str)]
    if "" in strings or len(strings) > MAX_STOP_STRINGS:
        raise invalid("stop", f"stop strings must be non-empty, at most {MAX_STOP_STRINGS}")
    ids = token_ids([s for s in stop if isinstance(s, int)], "stop", ctx.vocab_size)
    ids += token_ids(req.stop_token_ids, "stop_token_ids", ctx.vocab_size)
    return tuple(dict.fromkeys(strings)), list(dict.fromkeys(ids))


def _logprobs(req: CompletionBody | ChatBody) -> int | None:
    """Top-N per token, or None: completions' ``logprobs`` N; chat's ``logprobs`` + ``top_logprobs``."""
    if isinstance(req, CompletionBody):
        return req.logprobs
    if not req.logprobs and req.top_logprobs is not None:
        raise invalid("top_logprobs", "needs logprobs: true")
    return (req.top_logprobs or 0) if req.logprobs else None


def _sampling(req: CompletionBody | ChatBody, ctx: ModelContext, max_tokens: int, stop_ids: list[int],
              logprobs: int | None) -> common_pb2.Sampling:
    defaults = dict(ctx.sampling_defaults)
    temperature = defaults.get("temperature", 1.0) if req.temperature is None else req.temperature
    top_p = defaults.get("top_p", 1.0) if req.top_p is None else req.top_p
    top_k = int(defaults.get("top_k", 0)) if req.top_k is None else req.top_k
    s = common_pb2.Sampling(max_new_tokens=max_tokens, temperature=temperature, top_p=top_p,
                            top_k=min(max(top_k, 0), ctx.vocab_size), stop_token_ids=stop_ids,
                            ignore_eos=req.ignore_eos, min_tokens=req.min_tokens, logit_bias=req.logit_bias,
                            presence_penalty=req.presence_penalty, frequency_penalty=req.frequency_penalty,
                            repetition_penalty=req.repetition_penalty)
    if logprobs is not None:
        s.logprobs = logprobs
        if getattr(req, "echo", False):
            s.prompt_logprobs = logprobs
    return s


def refuse_long_ids(ids: Any, param: str, ctx: ModelContext) -> None:
    """A token-id prompt (as parsed from JSON) at or over the context limit: a 400 before it is
    validated or copied."""
    if isinstance(ids, (list, tuple)) and ids and isinstance(ids[0], int):
        limit, why = ctx.token_limit()
        if len(ids) >= limit:
            raise invalid(param, f"the prompt is {len(ids)} tokens; prompt plus max_tokens may be at most {limit} "
                                 f"tokens ({why})", "context_length_exceeded")


def _refuse_long_prompts(body: dict, ctx: ModelContext) -> None:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], list):
        for i, p in enumerate(prompt[:MAX_PROMPTS]):
            refuse_long_ids(p, f"prompt[{i}]", ctx)
    else:
        refuse_long_ids(prompt, "prompt", ctx)


def parse_request(body: dict, ctx: ModelContext, chat: bool) -> ParsedRequest:
    """A validated request for /v1/chat/completions (``chat``) or /v1/completions."""
    if not chat and isinstance(body, dict):
        _refuse_long_prompts(body, ctx)
    req = validate(ChatBody if chat else CompletionBody, body)
    _check_model(req.model, ctx)
    prompts = _prompts(req, ctx)
    given = _max_tokens(req)
    if req.n * len(prompts) > MAX_CHOICES:
        raise invalid("n", f"n ({req.n}) times the number of prompts ({len(prompts)}) may be at most {MAX_CHOICES}")
    stop_strings, stop_ids = _stops(req, ctx)
    token_ids(list(req.logit_bias), "logit_bias", ctx.vocab_size)
    logprobs = _logprobs(req)
    opts = req.stream_options
    if opts is not None and not req.stream:
        raise invalid("stream_options", "is only allowed with stream: true")
    usage = opts is not None and opts.include_usage
    jobs = []
    request_id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
    for i, (ids, param, _) in enumerate(prompts):
        max_tokens = ctx.max_tokens_for(len(ids), given)
        check_length(len(ids), max_tokens, ctx, param, "max_tokens")
        if req.min_tokens > max_tokens:
            raise invalid("min_tokens", f"must be <= max_tokens ({max_tokens}), got {req.min_tokens}")
        sampling = _sampling(req, ctx, max_tokens, stop_ids, logprobs)
        if req.seed is not None:
            sampling.seed = req.seed  # sample j of a prompt: seed + j (drawn by the prefill service)
        # the n samples of a prompt are forks of one prefill, sharing its rows on decode
        jobs.append(Job(request_id if i == 0 else f"{request_id}-{i}", tuple(ids), sampling, req.n,
                        cache_salt=req.cache_salt, affinity=req.affinity))
    stop_set = stop_token_set(jobs[0].sampling, ctx.eos_token_ids)
    choices = [CompletionRequest(job, stop_strings, stop_set, i * req.n + j, i, req.include_stop_str_in_output,
                                 req.skip_special_tokens, text, j)
               for i, (job, (_, _, text)) in enumerate(zip(jobs, prompts)) for j in range(req.n)]
    # as vLLM: running usage on every chunk only when usage is asked for at all
    return ParsedRequest(tuple(choices), req.stream, usage, req.return_token_ids,
                         usage and opts.continuous_usage_stats, logprobs, not chat and req.echo, len(prompts))


def parse_tokenize(body: dict, ctx: ModelContext) -> list[int]:
    """``POST /tokenize`` (vLLM's): ``prompt`` (a string) or ``messages`` (through the chat
    template, generation prompt added) → the ids a completion or chat request would prefill."""
    req = validate(TokenizeBody, body)
    _check_model(req.model, ctx)
    if (req.prompt is None) == (req.messages is None):
        raise invalid("prompt", "give exactly one of prompt (a string) and messages", "missing_required_parameter")
    return chat_prompt_ids(req.messages, ctx) if req.messages else encode_text(ctx, req.prompt, "prompt")


def parse_detokenize(body: dict, ctx: ModelContext) -> list[int]:
    """``POST /detokenize`` (vLLM's): ``tokens`` (token ids) → their ids, checked."""
    req = validate(DetokenizeBody, body)
    _check_model(req.model, ctx)
    return token_ids(req.tokens, "tokens", ctx.vocab_size)
