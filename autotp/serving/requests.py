"""The API's requests as OpenAI defines them: typed schemas (pydantic, which FastAPI validates a body against) with
OpenAI's names, types and ranges.

A field OpenAI defines and autotp does not serve (``echo``, ``tools``, ``logit_bias``, ...) is accepted only at a value
that asks for nothing (its default: clients send ``echo: false`` or ``tools: []``); any other value is refused
(``unsupported``), rather than ignored.  Fields that only identify the caller (``user``, ``metadata``, ...) are
accepted.  A field OpenAI does not define is refused, as OpenAI refuses it, except vLLM's ``top_k`` and
``ignore_eos``.  Text must be valid Unicode: a lone surrogate (which JSON can spell as ``"\\ud800"``) is refused here,
before a tokenizer sees it.
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field

from autotp.serving.choices import Sampling
from autotp.serving.scheduler import Refused


def whole_unicode(text: str) -> str:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError(f"is not valid Unicode ({exc.reason} at character {exc.start})") from None
    return text


Text = Annotated[str, AfterValidator(whole_unicode)]
Fraction = Annotated[float, Field(ge=0, le=1)]
Penalty = Annotated[float, Field(ge=-2, le=2)]


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class StreamOptions(Strict):
    include_usage: bool | None = None


class SamplingRequest(Strict):
    """The fields completions and chat share."""

    model: Text | None = None
    max_tokens: Annotated[int, Field(ge=0)] | None = None
    temperature: Annotated[float, Field(ge=0, le=2)] | None = None
    top_p: Fraction | None = None
    n: Annotated[int, Field(ge=1, le=128)] | None = None
    stop: Text | Annotated[list[Text], Field(max_length=4)] | None = None
    seed: int | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    user: str | None = None
    top_k: Annotated[int, Field(ge=-1)] | None = None  # vLLM's extension (-1 or 0: off)
    ignore_eos: bool | None = None  # vLLM's extension
    logit_bias: Any = None
    # field -> the values at which it asks for nothing
    UNSUPPORTED: ClassVar[dict] = {"logit_bias": (None, {})}

    def unsupported(self) -> str | None:
        """The first field given at a value autotp cannot serve, if any."""
        return next((name for name, idle in self.UNSUPPORTED.items() if getattr(self, name) not in idle), None)

    def sampling(self, max_tokens: int | None, logprobs: int | None) -> Sampling:
        """The engine's Sampling (Refused names a value autotp does not serve, such as n over 16)."""
        stop = self.stop or ()
        return Sampling(
            max_tokens=max_tokens,
            temperature=_given(self.temperature, 1.0),
            top_p=_given(self.top_p, 1.0),
            top_k=max(0, self.top_k or 0),
            seed=self.seed,
            stop=(stop,) if isinstance(stop, str) else tuple(stop),
            n=_given(self.n, 1),
            logprobs=logprobs,
            ignore_eos=bool(self.ignore_eos),
            presence_penalty=_given(self.presence_penalty, 0.0),
            frequency_penalty=_given(self.frequency_penalty, 0.0),
        )

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


def _given(value, default):
    return default if value is None else value


class CompletionRequest(SamplingRequest):
    """POST /v1/completions.  One prompt a request: a string, or token ids (a list of one of either too)."""

    prompt: Text | list[int] | list[Text] | list[list[int]]
    logprobs: Annotated[int, Field(ge=0, le=20)] | None = None  # OpenAI's limit is 5; vLLM's 20
    echo: Any = None
    best_of: Any = None
    suffix: Any = None
    UNSUPPORTED: ClassVar[dict] = {
        **SamplingRequest.UNSUPPORTED,
        "echo": (None, False),
        "best_of": (None, 1),
        "suffix": (None, ""),
    }

    def one_prompt(self) -> str | list[int]:
        prompt = self.prompt
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]
        if not prompt or (isinstance(prompt, list) and not all(isinstance(t, int) for t in prompt)):
            raise Refused("prompt must be one non-empty string or list of token ids")
        return prompt

    def sampling_for(self, room: int) -> Sampling:
        """Without max_tokens a completion makes 16 tokens (OpenAI's default)."""
        return self.sampling(_given(self.max_tokens, 16), self.logprobs)


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="allow", frozen=True)
    type: str
    text: Text | None = None


class Message(Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Text | list[ContentPart] | None = None
    name: Text | None = None
    tool_calls: Any = None
    tool_call_id: Any = None
    function_call: Any = None
    refusal: Any = None
    audio: Any = None

    def for_template(self, where: str) -> dict:
        """The message as a chat template reads it: role and text (and name)."""
        asked = next((f for f in ("tool_calls", "tool_call_id", "function_call", "audio") if getattr(self, f)), None)
        if asked:
            raise Refused(f"{where}.{asked}: tool calls and audio are not served; send text messages")
        content = self.content or ""
        if isinstance(content, list):
            other = next((i for i, part in enumerate(content) if part.type != "text"), None)
            if other is not None:
                raise Refused(f"{where}.content[{other}] is {content[other].type!r}: only text parts are served")
            content = "".join(part.text or "" for part in content)
        return {"role": self.role, "content": content, **({"name": self.name} if self.name else {})}


class ChatRequest(SamplingRequest):
    """POST /v1/chat/completions: messages through the tokenizer's chat template."""

    messages: Annotated[list[Message], Field(min_length=1)]
    logprobs: bool | None = None
    top_logprobs: Annotated[int, Field(ge=0, le=20)] | None = None
    max_completion_tokens: Annotated[int, Field(ge=0)] | None = None
    # accepted and ignored: they identify the caller or hint at caching, and ask nothing of the reply
    metadata: dict[str, str] | None = None
    parallel_tool_calls: bool | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: str | None = None
    safety_identifier: str | None = None
    # not served: refused at any value but the one that asks for nothing
    audio: Any = None
    function_call: Any = None
    functions: Any = None
    modalities: Any = None
    moderation: Any = None
    prediction: Any = None
    prompt_cache_options: Any = None
    reasoning_effort: Any = None
    response_format: Any = None
    service_tier: Any = None
    store: Any = None
    tool_choice: Any = None
    tools: Any = None
    verbosity: Any = None
    web_search_options: Any = None
    UNSUPPORTED: ClassVar[dict] = {
        **SamplingRequest.UNSUPPORTED,
        "audio": (None,),
        "function_call": (None, "none"),
        "functions": (None, []),
        "modalities": (None, ["text"]),
        "moderation": (None,),
        "prediction": (None,),
        "prompt_cache_options": (None,),
        "reasoning_effort": (None,),
        "response_format": (None, {"type": "text"}),
        "service_tier": (None, "auto", "default"),
        "store": (None, False),
        "tool_choice": (None, "none"),
        "tools": (None, []),
        "verbosity": (None,),
        "web_search_options": (None,),
    }

    def conversation(self) -> list[dict]:
        return [m.for_template(f"messages[{i}]") for i, m in enumerate(self.messages)]

    def sampling_for(self, room: int) -> Sampling:
        """Without max_tokens a chat reply runs to ``room``, the tokens its sequence has left (as OpenAI's does);
        logprobs is a flag, top_logprobs the count."""
        asked = _given(self.max_tokens, self.max_completion_tokens)
        return self.sampling(_given(asked, room), (self.top_logprobs or 0) if self.logprobs else None)
