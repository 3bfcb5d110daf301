"""OpenAI request bodies → a validated :class:`CompletionRequest`; every rejection names its field.

Accepted parameters
-------------------
Both endpoints: ``model`` (optional; must be the served model), ``max_tokens`` (default
``default_max_tokens``, 16), ``temperature`` (default 1.0, as OpenAI; 0 = greedy), ``top_p``,
``top_k`` (vLLM extension; -1 or 0 disable) — the three defaults come from the checkpoint's
generation_config.json where it sets them, ``seed``, ``stop`` (a string, or a list of strings
and/or token ids), ``stop_token_ids`` and ``ignore_eos`` (vLLM extensions), ``stream``,
``stream_options`` (``include_usage``; ``continuous_usage_stats``, vLLM's: every chunk carries the
usage so far), ``return_token_ids`` (vLLM extension), ``user``
(accepted and ignored: it never changes the output).
Sampling: ``n`` (1-16 samples of each prompt; sample j of a seeded request uses ``seed + j``),
``min_tokens``, ``presence_penalty`` / ``frequency_penalty`` (-2..2, over the generated tokens,
as OpenAI), ``repetition_penalty`` (> 0, over prompt and generated tokens, as vLLM),
``logit_bias`` (token id -> -100..100), ``include_stop_str_in_output`` and
``skip_special_tokens`` (vLLM extensions).
``/v1/completions``: ``prompt`` (a string, a list of token ids, or a list of up to 64 of either;
each prompt runs ``n`` times, choices are numbered prompt-major), ``logprobs`` (0-20: the
sampled token's logprob plus the top N), ``echo`` (the prompt is prepended to the text; with
``logprobs`` its tokens carry their prompt logprobs, the first one ``null``).
``/v1/chat/completions``: ``messages`` (roles system, developer, user, assistant; content a
string or a list of ``{"type": "text", "text": ...}`` parts), ``max_completion_tokens``
(same as ``max_tokens``), ``logprobs`` (bool) and ``top_logprobs`` (0-20).

Logprobs are the model's raw log-softmax (before temperature, penalties and bias), as vLLM's
default. Parameters accepted only at their neutral value (anything else is a 400 naming them):
``best_of`` (1), ``suffix`` (null), ``tools`` (empty), ``tool_choice`` ("none"),
``response_format`` (``{"type": "text"}``). Any other field is a 400 "unsupported parameter".

Chat template: messages (text parts joined into one string) go through the checkpoint's chat
template (``tokenizer_config.json`` / ``chat_template.jinja``, or ``--chat-template FILE``) with
the generation prompt added, as transformers' ``apply_chat_template``; a model without one
answers chat with a 400 that says so. A model without a tokenizer answers text prompts and chat
with a 400; token-id prompts still work.
"""

from __future__ import annotations

import json
import math
import re
import uuid
from dataclasses import dataclass
from typing import Any, Callable

from engine.model.sampler import MAX_LOGPROBS
from services.protos import common_pb2
from services.router.backend import Job
from services.router.completion import CompletionRequest

MAX_SEED = 2**63 - 1
MAX_STOP_STRINGS = 16


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
    default_max_tokens: int = 16
    sampling_defaults: tuple[tuple[str, float], ...] = ()  # generation_config.json's temperature/top_p/top_k

    def token_limit(self) -> tuple[int, str]:
        """(prompt + max_tokens limit, what sets it)."""
        cap = self.capacity_tokens()
        if cap is not None and cap < self.max_positions:
            return cap, f"the smallest decode cache ({cap} tokens)"
        return self.max_positions, f"the maximum model length ({self.max_positions} tokens)"


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


# ---- JSON and typed getters --------------------------------------------------------------
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
        raise ApiError(400, f"the request body must be a JSON object, got {_kind(body)}", None, "invalid_json")
    if _SURROGATE_ESCAPE.search(raw):  # only an escape can make a lone surrogate; check the strings
        where = _unencodable(body)
        if where is not None:
            raise invalid(where, "is not valid Unicode text (a lone UTF-16 surrogate)", "invalid_text")
    return body


def _kind(v: Any) -> str:
    return {dict: "an object", list: "an array", str: "a string", bool: "a boolean", type(None): "null",
            int: "an integer", float: "a number"}.get(type(v), type(v).__name__)


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _int(body: dict, name: str, default: int | None, lo: int | None = None, hi: int | None = None) -> int | None:
    v = body.get(name)
    if v is None:
        return default
    if not _is_int(v):
        raise invalid(name, f"must be an integer, got {_kind(v)}", "invalid_type")
    if lo is not None and v < lo:
        raise invalid(name, f"must be >= {lo}, got {v}")
    if hi is not None and v > hi:
        raise invalid(name, f"must be <= {hi}, got {v}")
    return v


def _float(body: dict, name: str, default: float) -> float:
    v = body.get(name)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise invalid(name, f"must be a finite number, got {_kind(v)}", "invalid_type")
    return float(v)


def _bool(body: dict, name: str, default: bool = False) -> bool:
    v = body.get(name)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise invalid(name, f"must be a boolean, got {_kind(v)}", "invalid_type")
    return v


# ---- parameter table -----------------------------------------------------------------------
_COMMON = {"model", "max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "stop_token_ids", "ignore_eos",
           "stream", "stream_options", "return_token_ids", "user", "n", "min_tokens", "presence_penalty",
           "frequency_penalty", "repetition_penalty", "logit_bias", "include_stop_str_in_output",
           "skip_special_tokens", "logprobs"}
_COMPLETION = _COMMON | {"prompt", "echo"}
_CHAT = _COMMON | {"messages", "max_completion_tokens", "top_logprobs"}
MAX_N = 16  # choices per request (n × prompts): each is its own generation, with its own rows
MAX_PROMPTS = 64  # prompts in one completions request


# name -> (predicate for the neutral value, how to say it)
_NEUTRAL_COMPLETION: dict[str, tuple[Callable[[Any], bool], str]] = {
    "best_of": (lambda v: _is_int(v) and v == 1, "1 (use n for several samples)"),
    "suffix": (lambda v: False, "null")}
_NEUTRAL_CHAT: dict[str, tuple[Callable[[Any], bool], str]] = {
    "tools": (lambda v: v == [], "empty"),
    "tool_choice": (lambda v: v == "none", '"none"'),
    "response_format": (lambda v: v == {"type": "text"}, '{"type": "text"}')}


def _check_fields(body: dict, accepted: set[str], neutral: dict[str, tuple[Callable[[Any], bool], str]]) -> None:
    for name in body:
        if name in accepted:
            continue
        if name in neutral:
            ok, say = neutral[name]
            if body[name] is None or ok(body[name]):
                continue
            raise ApiError(400, f"{name}: only {say} is supported, got {json.dumps(body[name])}", name,
                           "unsupported_value")
        raise ApiError(400, f"{name}: unsupported parameter", name, "unsupported_parameter")


# ---- the request -----------------------------------------------------------------------------
def _check_model(body: dict, ctx: ModelContext) -> None:
    model = body.get("model")
    if model is None:
        return
    if not isinstance(model, str):
        raise invalid("model", f"must be a string, got {_kind(model)}", "invalid_type")
    if model != ctx.name:
        raise ApiError(404, f"model: the model '{model}' does not exist; this server serves '{ctx.name}'", "model",
                       "model_not_found")


def token_ids(v: list, param: str, vocab_size: int) -> list[int]:
    for t in v:
        if not _is_int(t):
            raise invalid(param, f"token ids must be integers, got {_kind(t)}", "invalid_type")
        if not 0 <= t < vocab_size:
            raise invalid(param, f"token id {t} is outside the vocabulary [0, {vocab_size})", "invalid_token_id")
    return list(v)


def _one_prompt(p: Any, param: str, ctx: ModelContext) -> list[int]:
    if isinstance(p, str):
        ids = encode_text(ctx, p, param)
    elif isinstance(p, list):
        ids = token_ids(p, param, ctx.vocab_size)
    else:
        raise invalid(param, f"must be a string or a list of token ids, got {_kind(p)}", "invalid_type")
    if not ids:
        raise invalid(param, "must not be empty")
    return ids


def _prompt_ids(body: dict, ctx: ModelContext) -> list[list[int]]:
    """The prompts of a completions request: a string, a list of token ids, or a list of either."""
    if "prompt" not in body or body["prompt"] is None:
        raise invalid("prompt", "is required", "missing_required_parameter")
    p = body["prompt"]
    if isinstance(p, list) and p and all(isinstance(x, (str, list)) for x in p):
        if len(p) > MAX_PROMPTS:
            raise invalid("prompt", f"at most {MAX_PROMPTS} prompts per request, got {len(p)}")
        return [_one_prompt(x, f"prompt[{i}]", ctx) for i, x in enumerate(p)]
    return [_one_prompt(p, "prompt", ctx)]


ROLES = ("system", "developer", "user", "assistant")


def encode_text(ctx: ModelContext, text: str, param: str) -> list[int]:
    """``text``'s ids (BOS included where the tokenizer adds it); a 400 if the model has none."""
    from engine.model.tokenizer import NoTokenizerError

    try:
        return ctx.tokenizer.encode(text)
    except NoTokenizerError as e:
        raise invalid(param, str(e), "no_tokenizer") from None


def chat_messages(messages: Any) -> list[dict[str, str]]:
    """Validated messages as the chat template takes them: role and content, text parts joined."""
    if not isinstance(messages, list) or not messages:
        raise invalid("messages", "must be a non-empty list of messages", "invalid_type")
    out = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise invalid(where, f"must be an object, got {_kind(m)}", "invalid_type")
        extra = set(m) - {"role", "content"}
        if extra:
            name = sorted(extra)[0]
            raise ApiError(400, f"{where}.{name}: unsupported parameter", f"{where}.{name}", "unsupported_parameter")
        role = m.get("role")
        if role not in ROLES:
            raise invalid(f"{where}.role", f"must be one of {', '.join(ROLES)}, got {json.dumps(role)}")
        content = m.get("content")
        if isinstance(content, list):
            parts = []
            for j, part in enumerate(content):
                if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)
                        and set(part) == {"type", "text"}):
                    raise invalid(f"{where}.content[{j}]", 'only {"type": "text", "text": "..."} parts are supported',
                                  "unsupported_value")
                parts.append(part["text"])
            content = "".join(parts)
        if not isinstance(content, str):
            raise invalid(f"{where}.content", f"must be a string or a list of text parts, got {_kind(content)}",
                          "invalid_type")
        out.append({"role": role, "content": content})
    return out


def chat_prompt_ids(messages: Any, ctx: ModelContext) -> list[int]:
    """The ids of the conversation rendered with the model's chat template."""
    from engine.model.tokenizer import NoChatTemplateError, NoTokenizerError

    msgs = chat_messages(messages)
    try:
        return ctx.tokenizer.apply_chat_template(msgs)
    except NoTokenizerError as e:
        raise invalid("messages", str(e), "no_tokenizer") from None
    except NoChatTemplateError as e:
        raise invalid("messages", str(e), "no_chat_template") from None
    except Exception as e:  # the template's own checks (raise_exception), or a template error
        raise invalid("messages", f"the chat template rejected the conversation: {e}", "chat_template_error") from None


def _stops(body: dict, ctx: ModelContext) -> tuple[tuple[str, ...], list[int]]:
    strings: list[str] = []
    ids: list[int] = []
    stop = body.get("stop")
    if stop is not None:
        items = [stop] if isinstance(stop, str) else stop
        if not isinstance(items, list):
            raise invalid("stop", f"must be a string or a list of strings and token ids, got {_kind(stop)}",
                          "invalid_type")
        for s in items:
            if isinstance(s, str):
                if not s:
                    raise invalid("stop", "stop strings must not be empty")
                strings.append(s)
            elif _is_int(s):
                ids.extend(token_ids([s], "stop", ctx.vocab_size))
            else:
                raise invalid("stop", f"entries must be strings or token ids, got {_kind(s)}", "invalid_type")
        if len(strings) > MAX_STOP_STRINGS:
            raise invalid("stop", f"at most {MAX_STOP_STRINGS} stop strings, got {len(strings)}")
    extra = body.get("stop_token_ids")
    if extra is not None:
        if not isinstance(extra, list):
            raise invalid("stop_token_ids", f"must be a list of token ids, got {_kind(extra)}", "invalid_type")
        ids.extend(token_ids(extra, "stop_token_ids", ctx.vocab_size))
    return tuple(dict.fromkeys(strings)), list(dict.fromkeys(ids))


def _max_tokens(body: dict, ctx: ModelContext, chat: bool) -> int:
    names = ["max_tokens"] + (["max_completion_tokens"] if chat else [])
    given = [(n, _int(body, n, None, lo=1)) for n in names]
    given = [(n, v) for n, v in given if v is not None]
    if len(given) == 2 and given[0][1] != given[1][1]:
        raise invalid("max_completion_tokens", f"differs from max_tokens ({given[0][1]} vs {given[1][1]})")
    return given[0][1] if given else ctx.default_max_tokens


def _logit_bias(body: dict, ctx: ModelContext) -> tuple[tuple[int, float], ...]:
    """``logit_bias``: {token id (a JSON key, so a string): bias in [-100, 100]}."""
    v = body.get("logit_bias")
    if v is None:
        return ()
    if not isinstance(v, dict):
        raise invalid("logit_bias", f"must be an object of token id -> bias, got {_kind(v)}", "invalid_type")
    out = {}
    for key, bias in v.items():
        try:
            tok = int(key)
        except ValueError:
            raise invalid("logit_bias", f"keys must be token ids, got {json.dumps(key)}", "invalid_type") from None
        token_ids([tok], "logit_bias", ctx.vocab_size)
        if isinstance(bias, bool) or not isinstance(bias, (int, float)) or not -100 <= bias <= 100:
            raise invalid("logit_bias", f"biases must be numbers in [-100, 100], got {json.dumps(bias)} for {tok}")
        out[tok] = float(bias)
    return tuple(sorted(out.items()))


def _logprobs(body: dict, chat: bool) -> int | None:
    """Top-N alternatives per token, or None for no logprobs. Completions: ``logprobs`` (an
    integer N); chat: ``logprobs`` (a boolean) with ``top_logprobs`` (N, default 0)."""
    if not chat:
        return _int(body, "logprobs", None, lo=0, hi=MAX_LOGPROBS)
    top = _int(body, "top_logprobs", None, lo=0, hi=MAX_LOGPROBS)
    if not _bool(body, "logprobs"):
        if top is not None:
            raise invalid("top_logprobs", "needs logprobs: true")
        return None
    return top or 0


def parse_request(body: dict, ctx: ModelContext, chat: bool) -> ParsedRequest:
    """A validated request for /v1/chat/completions (``chat``) or /v1/completions."""
    _check_fields(body, _CHAT if chat else _COMPLETION, _NEUTRAL_CHAT if chat else _NEUTRAL_COMPLETION)
    _check_model(body, ctx)
    if chat:
        if "messages" not in body:
            raise invalid("messages", "is required", "missing_required_parameter")
        prompts = [chat_prompt_ids(body["messages"], ctx)]
        texts: list[str | None] = [None]
    else:
        prompts = _prompt_ids(body, ctx)
        raw = body["prompt"] if isinstance(body["prompt"], list) and isinstance(body["prompt"][0], (str, list)) \
            else [body["prompt"]]
        texts = [x if isinstance(x, str) else None for x in raw]  # for echo: the prompt as it was sent
    max_tokens = _max_tokens(body, ctx, chat)
    defaults = dict(ctx.sampling_defaults)
    temperature = _float(body, "temperature", defaults.get("temperature", 1.0))
    if temperature < 0:
        raise invalid("temperature", f"must be >= 0, got {temperature:g}")
    top_p = _float(body, "top_p", defaults.get("top_p", 1.0))
    if not 0 < top_p <= 1:
        raise invalid("top_p", f"must be in (0, 1], got {top_p:g}")
    top_k = _int(body, "top_k", int(defaults.get("top_k", 0)), lo=-1)
    seed = _int(body, "seed", None, lo=0, hi=MAX_SEED)
    stop, stop_ids = _stops(body, ctx)
    ignore_eos = _bool(body, "ignore_eos")
    n = _int(body, "n", 1, lo=1, hi=MAX_N)
    if n * len(prompts) > MAX_N * 4:
        raise invalid("n", f"n ({n}) times the number of prompts ({len(prompts)}) may be at most {MAX_N * 4}")
    min_tokens = _int(body, "min_tokens", 0, lo=0)
    if min_tokens > max_tokens:
        raise invalid("min_tokens", f"must be <= max_tokens ({max_tokens}), got {min_tokens}")
    penalties = {}
    for name, lo, hi, neutral in (("presence_penalty", -2, 2, 0.0), ("frequency_penalty", -2, 2, 0.0),
                                  ("repetition_penalty", 0, 2, 1.0)):
        penalties[name] = _float(body, name, neutral)
        if not lo <= penalties[name] <= hi or (name == "repetition_penalty" and penalties[name] == 0):
            raise invalid(name, f"must be in {'(' if name == 'repetition_penalty' else '['}{lo}, {hi}], "
                                f"got {penalties[name]:g}")
    logit_bias = _logit_bias(body, ctx)
    logprobs = _logprobs(body, chat)
    echo = False if chat else _bool(body, "echo")
    include_stop = _bool(body, "include_stop_str_in_output")
    skip_special = _bool(body, "skip_special_tokens", True)
    stream = _bool(body, "stream")
    include_usage = continuous_usage = False
    opts = body.get("stream_options")
    if opts is not None:
        if not stream:
            raise invalid("stream_options", "is only allowed with stream: true")
        if not isinstance(opts, dict) or set(opts) - {"include_usage", "continuous_usage_stats"}:
            raise invalid("stream_options", 'must be {"include_usage": true|false, "continuous_usage_stats": '
                                            'true|false}', "invalid_type")
        include_usage = _bool(opts, "include_usage")
        # as vLLM: running usage on every chunk, only when usage is asked for at all
        continuous_usage = include_usage and _bool(opts, "continuous_usage_stats")
    return_token_ids = _bool(body, "return_token_ids")
    user = body.get("user")
    if user is not None and not isinstance(user, str):
        raise invalid("user", f"must be a string, got {_kind(user)}", "invalid_type")

    for i, ids in enumerate(prompts):
        where = "messages" if chat else ("prompt" if len(prompts) == 1 else f"prompt[{i}]")
        check_length(len(ids), max_tokens, ctx, where, "max_tokens")

    request_id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
    choices = []
    for i, ids in enumerate(prompts):
        for j in range(n):
            sampling = common_pb2.Sampling(
                max_new_tokens=max_tokens, temperature=temperature, top_p=top_p,
                top_k=min(max(top_k, 0), ctx.vocab_size), stop_token_ids=stop_ids, ignore_eos=ignore_eos,
                min_tokens=min_tokens, logit_bias=dict(logit_bias), **penalties)
            if seed is not None:
                sampling.seed = (seed + j) % (MAX_SEED + 1)  # sample j of a prompt: seed + j
            if logprobs is not None:
                sampling.logprobs = logprobs
                if echo:
                    sampling.prompt_logprobs = logprobs
            index = i * n + j
            job = Job(request_id if index == 0 else f"{request_id}-{index}", tuple(ids), sampling)
            choices.append(CompletionRequest(job, stop, stop_token_set(sampling, ctx.eos_token_ids), index, i,
                                             include_stop, skip_special, texts[i]))
    return ParsedRequest(tuple(choices), stream, include_usage, return_token_ids, continuous_usage,
                         logprobs, echo, len(prompts))


def parse_tokenize(body: dict, ctx: ModelContext) -> list[int]:
    """``POST /tokenize`` (vLLM's): ``prompt`` (a string) or ``messages`` (through the chat
    template, generation prompt added) → the ids a completion or chat request would prefill."""
    _check_fields(body, {"model", "prompt", "messages"},
                  {"add_generation_prompt": (lambda v: v is True, "true"),
                   "add_special_tokens": (lambda v: v is True, "true")})
    _check_model(body, ctx)
    if ("prompt" in body) == ("messages" in body):
        raise invalid("prompt", "give exactly one of prompt (a string) and messages", "missing_required_parameter")
    if "messages" in body:
        return chat_prompt_ids(body["messages"], ctx)
    if not isinstance(body["prompt"], str):
        raise invalid("prompt", f"must be a string, got {_kind(body['prompt'])}", "invalid_type")
    return encode_text(ctx, body["prompt"], "prompt")


def parse_detokenize(body: dict, ctx: ModelContext) -> list[int]:
    """``POST /detokenize`` (vLLM's): ``tokens`` (token ids) → their ids, checked."""
    _check_fields(body, {"model", "tokens"}, {})
    _check_model(body, ctx)
    tokens = body.get("tokens")
    if not isinstance(tokens, list):
        raise invalid("tokens", f"must be a list of token ids, got {_kind(tokens)}", "invalid_type")
    return token_ids(tokens, "tokens", ctx.vocab_size)


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
