"""Server-side options of the HTTP layer (everything that is not an engine option)."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from .generation_defaults import sampling_defaults
from .openai_protocol import MAX_N

DEFAULT_MAX_UPLOAD_MB = 512
DEFAULT_MAX_REQUEST_BODY_MB = 32


@dataclass(frozen=True)
class ServerSettings:
    """How the API serves one engine.

    * ``model_id``: the id of the base model in ``/v1/models`` and the ``model`` value that
      selects it (any other ``model`` value names an adapter).
    * ``api_key``: when set, inference and read endpoints need ``Authorization: Bearer <key>``
      (the admin key is accepted too).
    * ``admin_key``: when set, every adapter-changing endpoint needs it. When it is unset,
      adapter changes need the API key if one is set, and are open only when neither is set.
    * ``allowed_lora_dirs``: server-side directories ``/v1/load_lora_adapter`` may read from;
      empty (the default) disables loading from server paths altogether.
    * ``max_upload_bytes``: the largest adapter upload (request body, and the uncompressed
      content of an archive); bigger ones get 413.
    * ``max_request_body_bytes``: the largest body of any other request (413).
    * ``max_n``: the most samples per prompt (``n``); ``max_prompt_tokens`` and
      ``max_output_tokens``: the longest prompt and ``max_tokens`` a request may ask (None: the
      model's context length); past them, 400 naming the field.
    * ``max_requests_per_key``: completion requests in flight per API key (``api_key`` and
      ``admin_key`` each; all other requests share one bucket); past it, 429.
    * ``sampling_defaults``: what a request field left out (or null) takes, by vLLM's names
      (temperature, top_p, top_k, min_p, the three penalties, max_tokens); fields not here take
      OpenAI's defaults (``generation_defaults.py``: from the model's generation config).
    """

    model_id: str
    api_key: str | None = None
    admin_key: str | None = None
    allowed_lora_dirs: tuple[str, ...] = field(default_factory=tuple)
    max_upload_bytes: int = DEFAULT_MAX_UPLOAD_MB * 2**20
    max_request_body_bytes: int = DEFAULT_MAX_REQUEST_BODY_MB * 2**20
    max_n: int = 64
    max_prompt_tokens: int | None = None
    max_output_tokens: int | None = None
    max_requests_per_key: int = 512
    sampling_defaults: dict[str, float | int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.model_id:
            raise ValueError("model_id must be a non-empty string")
        for name in ("max_upload_bytes", "max_request_body_bytes", "max_n", "max_requests_per_key"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.max_n > MAX_N:
            raise ValueError(f"max_n must be at most {MAX_N} (the most samples a request may ask), got {self.max_n}")
        for name in ("max_prompt_tokens", "max_output_tokens"):
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise ValueError(f"{name} must be None or positive, got {value}")
        for key_name in ("api_key", "admin_key"):
            value = getattr(self, key_name)
            if value is not None and not value:
                raise ValueError(f"{key_name} must be None or a non-empty string")
        object.__setattr__(self, "sampling_defaults", sampling_defaults(self.sampling_defaults))
        resolved = tuple(os.path.realpath(os.path.expanduser(path)) for path in self.allowed_lora_dirs)
        object.__setattr__(self, "allowed_lora_dirs", resolved)

    @property
    def default_max_tokens(self) -> int | None:
        """A chat completion's ``max_tokens`` when it names none (the model's ``max_new_tokens``;
        None: all that fit)."""
        value = self.sampling_defaults.get("max_tokens")
        return None if value is None else int(value)

    @property
    def adapter_key(self) -> str | None:
        """The key that adapter-changing endpoints require (None: open)."""
        return self.admin_key or self.api_key
