"""``pprun serve``'s settings, checked once: the server settings (``ServeConfig.validate``), the
bearer token read, the engine's configuration resolved and checked as servable, and the
per-request limits every front end enforces, in one immutable :class:`ServeSettings` made before
any process starts.  The server takes it as it is and checks nothing of it again.

No gRPC, protobuf or HTTP import here: ``pprun serve`` builds it before it loads any of them.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from pprun.config.config import ServeAppConfig, ServeConfig
from pprun.config.validate import ResolvedConfig
from pprun.serve.layout import check_servable, engine_config


class RequestLimitError(ValueError):
    """A request over one of the server's per-request limits (a 400 / INVALID_ARGUMENT);
    ``param`` is the request field it names."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class RequestLimits:
    """What one request may ask of the server, beyond what the engine checks itself (the
    context's room for ``max_tokens``, ``model.max_logprobs``): its choices, their output tokens,
    its stop strings and its chat messages.  Every front end applies the checks that concern it
    (``docs/serving.md`` has the table)."""

    max_model_len: int
    max_unfinished: int
    """Requests the engine's queue holds: ``scheduler.max_num_seqs + serve.max_queued_requests``."""
    max_choices: int
    max_request_output_tokens: int
    max_stop_strings: int
    max_stop_string_chars: int
    max_chat_messages: int
    max_content_parts: int

    @classmethod
    def of(cls, sc: ServeConfig, resolved: ResolvedConfig) -> RequestLimits:
        """The limits of a validated ``serve`` section over the resolved engine configuration."""
        max_model_len = resolved.max_model_len
        output_tokens = sc.max_request_output_tokens
        return cls(
            max_model_len=max_model_len,
            max_unfinished=resolved.cfg.scheduler.max_num_seqs + sc.max_queued_requests,
            max_choices=sc.max_choices,
            # Default: every choice allowed (serve.max_choices) may run to a full context.
            max_request_output_tokens=sc.max_choices * max_model_len if output_tokens is None else output_tokens,
            max_stop_strings=sc.max_stop_strings,
            max_stop_string_chars=sc.max_stop_string_chars,
            max_chat_messages=sc.max_chat_messages,
            max_content_parts=sc.max_content_parts,
        )

    def check_stop(self, stop: object, param: str) -> None:
        """At most ``serve.max_stop_strings`` stop strings of at most ``serve.max_stop_string_chars``
        characters (other mistakes in ``stop`` are SamplingParams' to name)."""
        stops = [stop] if isinstance(stop, str) else stop
        if not isinstance(stops, (list, tuple)):
            return
        if len(stops) > self.max_stop_strings:
            raise RequestLimitError(f"{param} has {len(stops)} stop strings: at most serve.max_stop_strings="
                                    f"{self.max_stop_strings} are taken", param)
        for i, s in enumerate(stops):
            if isinstance(s, str) and len(s) > self.max_stop_string_chars:
                raise RequestLimitError(f"{param}[{i}] has {len(s)} characters: a stop string may have at most "
                                        f"serve.max_stop_string_chars={self.max_stop_string_chars}", param)

    def check_messages(self, messages: object, param: str) -> None:
        """At most ``serve.max_chat_messages`` messages, and ``serve.max_content_parts`` content
        parts over all of them."""
        if not isinstance(messages, (list, tuple)):
            return
        if len(messages) > self.max_chat_messages:
            raise RequestLimitError(f"{param} has {len(messages)} messages: at most serve.max_chat_messages="
                                    f"{self.max_chat_messages} are taken", param)
        num_parts = sum(len(m["content"]) for m in messages
                        if isinstance(m, dict) and isinstance(m.get("content"), list))  # fmt: skip
        if num_parts > self.max_content_parts:
            raise RequestLimitError(f"{param} has {num_parts} content parts: at most serve.max_content_parts="
                                    f"{self.max_content_parts} are taken over all messages", param)

    def check_choices(self, num_prompts: int, n: int) -> None:
        """A request's choices (prompts times ``n``) within ``serve.max_choices`` and the queue."""
        num_choices = num_prompts * n
        most = min(self.max_choices, self.max_unfinished)
        if num_choices > most:
            why = (f"serve.max_choices={self.max_choices}" if most == self.max_choices else
                   f"the queue's {self.max_unfinished} requests (scheduler.max_num_seqs + serve.max_queued_requests)")
            asked = f"n={n}" if num_prompts == 1 else f"{num_prompts} prompts x n={n} = {num_choices} choices"
            raise RequestLimitError(f"{asked} is too many: a request may have at most {most} choices ({why})", "n")

    def check_output_tokens(self, max_tokens_per_choice: list[int], param: str) -> None:
        """The output tokens of all choices (``max_tokens`` each, or what its context leaves)
        within ``serve.max_request_output_tokens``."""
        total = sum(max_tokens_per_choice)
        if total > self.max_request_output_tokens:
            raise RequestLimitError(
                f"the request asks for up to {total} output tokens over its {len(max_tokens_per_choice)} choices "
                f"({param} per choice, times n and prompts): at most serve.max_request_output_tokens="
                f"{self.max_request_output_tokens} are taken", param)


@dataclass(frozen=True)
class ServeSettings:
    """Everything ``pprun serve`` needs, validated: made by :func:`resolve_serve_settings` only."""

    cfg: ServeAppConfig
    """The app's configuration as given."""
    engine: ResolvedConfig
    """The engine's configuration, resolved (the engine takes it as it is)."""
    token: str | None
    """The bearer token every call must carry (``serve.auth_token`` or its file's first line)."""
    exposure_warning: str | None
    """What the server logs about its address when it starts (``pprun.config.exposure``)."""
    model_name: str
    """The name clients use for the model."""
    limits: RequestLimits

    @property
    def serve(self) -> ServeConfig:
        """The ``serve`` section."""
        return self.cfg.serve


def read_token(sc: ServeConfig) -> str | None:
    """The bearer token from ``serve.auth_token`` or the first line of ``serve.auth_token_file``."""
    if sc.auth_token_file is not None:
        token = Path(sc.auth_token_file).expanduser().read_text().strip().splitlines()
        if not token or not token[0].strip():
            raise ValueError(f"serve.auth_token_file={sc.auth_token_file!r} holds no token")
        return token[0].strip()
    return sc.auth_token


def served_model_name(cfg: ServeAppConfig) -> str:
    """The name clients use for the model: ``serve.model_name`` or the model path's last part."""
    return cfg.serve.model_name or Path(str(cfg.model.model)).name


def resolve_serve_settings(cfg: ServeAppConfig, resolved: ResolvedConfig | None = None) -> ServeSettings:
    """Check every ``pprun serve`` setting once, before anything starts: raise ValueError naming
    the first bad one.  ``resolved``: the engine's configuration resolved already; None resolves
    ``cfg``'s here (the run's one validation of it)."""
    from pprun.engine.resolve import resolve_config

    exposure_warning = cfg.serve.validate()
    token = read_token(cfg.serve)  # a bad token file fails before the model loads
    engine = resolve_config(engine_config(cfg)) if resolved is None else resolved
    check_servable(engine)
    return ServeSettings(cfg, engine, token, exposure_warning, served_model_name(cfg),
                         RequestLimits.of(cfg.serve, engine))
