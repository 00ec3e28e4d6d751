"""The prefix cache's part of a replica's config (``SchedulerConfig.prefix_cache_config``):
reuse, reservations, and how tenants and sessions share the cache (docs/design.md section 4)."""

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator


class PrefixCacheConfig(BaseModel):
    """Reuse of token-exact prompt prefixes across requests: cached full blocks, then the
    computed tokens of a freed request's last, partial block (dense models)."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, frozen=False)

    enabled: bool = Field(True, description="Reuse cached KV of matching prompt prefixes.")
    reservation_share: float = Field(
        0.0,
        ge=0.0,
        le=1.0,
        description="Share of each cache type's NPU blocks that waiting requests' cached "
        "prefixes may hold (and their host-only blocks be loaded into) before admission, so "
        "running traffic cannot evict them; reservations give way before any preemption. "
        "0 turns reservations off.",
    )
    shared_prefixes: list[str | list[int]] = Field(
        default_factory=list,
        description="Prompt prefixes every cache_salt (tenant) may share, e.g. a system prompt: "
        "text as it appears in the rendered prompt (inside the chat template for a chat), or "
        "token ids. In a prompt starting with one, its full blocks are cached without the "
        "salt, and everything after it stays the tenant's own.",
    )
    batch_tenants: list[str] = Field(
        default_factory=list,
        description="cache_salts (tenants) whose requests are batch unless they name a "
        "service_tier: their cached blocks are evicted before interactive ones.",
    )
    tenant_quotas: dict[str, float] | Literal["auto"] = Field(
        default_factory=dict,
        description="cache_salt (tenant) -> the share of the host tier's blocks (the NPU "
        "tier's without one) it may hold before its blocks are evicted ahead of others'; "
        "shares in (0, 1], at most 1 "
        "together. 'auto': every tenant's share sized from its own miss-ratio curve to "
        "maximise the hits, at least tenant_min_share each.",
    )
    tenant_min_share: float = Field(
        0.05,
        ge=0.0,
        le=1.0,
        description="With tenant_quotas: auto, the share every active tenant is guaranteed "
        "(at most an equal share).",
    )
    interactive_lifetime_s: float = Field(
        300.0,
        gt=0.0,
        description="Seconds an interactive request's use keeps a block out of the batch "
        "class (evicted first) in the NPU and host tiers.",
    )

    @field_validator("tenant_quotas")
    @classmethod
    def _check_quotas(cls, quotas: "dict[str, float] | str") -> "dict[str, float] | str":
        if isinstance(quotas, str):
            return quotas
        bad = [salt for salt, share in quotas.items() if not 0.0 < share <= 1.0]
        if bad:
            raise ValueError(f"tenant_quotas: the share of {bad[0]!r} must be in (0, 1]")
        if sum(quotas.values()) > 1.0 + 1e-9:
            raise ValueError(f"tenant_quotas: the shares add up to {sum(quotas.values()):g} > 1")
        return quotas

    def is_batch(self, cache_salt: str | None, service_tier_batch: bool | None) -> bool:
        """A request's priority class: its ``service_tier``'s, else its tenant's default."""
        if service_tier_batch is not None:
            return service_tier_batch
        return cache_salt is not None and cache_salt in self.batch_tenants

    @property
    def named_tenants(self) -> set[str]:
        """The salts the config names (shown by name in metrics; others by a digest)."""
        quotas = self.tenant_quotas
        return {*(quotas if isinstance(quotas, dict) else ()), *self.batch_tenants}
