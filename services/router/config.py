"""The router's configuration (the ``router:`` section of a service YAML file)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


class RouterConfig(BaseModel):
    """Frozen; ``port``/``grpc_port`` 0 pick a free port (the handle reports the bound one),
    ``grpc_port: null`` turns the gRPC front off."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    prefill: tuple[str, ...] = Field(min_length=1)  # host:port of each prefill service
    decode: tuple[str, ...] = Field(min_length=1)  # host:port of each decode service
    model: str = "tiny"  # checkpoint directory or "tiny": the router tokenizes and validates with it
    served_model_name: str | None = None  # the name clients send as "model" (default: ``model``)
    host: str = "127.0.0.1"
    port: int = Field(0, ge=0, le=65535)
    grpc_port: int | None = Field(0, ge=0, le=65535)
    api_key: str | None = Field(None, repr=False)  # when set, clients must send "Authorization: Bearer <key>"
    max_retries: int = Field(2, ge=0)  # new pairs tried after a failure before the first token
    request_timeout_s: float = Field(600.0, gt=0)  # whole request, first byte to last token
    rpc_timeout_s: float = Field(5.0, gt=0)  # health, status and abort calls
    health_interval_s: float = Field(2.0, gt=0)  # health and status polling of every service
    default_max_tokens: int = Field(16, ge=1)  # when a request gives no max_tokens

    @property
    def model_name(self) -> str:
        return self.served_model_name or self.model
