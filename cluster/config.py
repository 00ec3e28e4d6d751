"""The whole deployment's configuration: what ``configs/*.yaml`` holds and flags override.

Scaling is changing ``data_parallel_size``. Each package owns its part (``replicas.config``,
``router.config``); this module composes them and adds the model, server and Ray sections.
"""

from pathlib import Path
from typing import Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from replicas.config import EngineConfig, ReplicaModelConfig, SchedulerConfig
from replicas.kv.capacity import kv_cache_specs, plan_replica_offload
from replicas.model import load_model_info
from router.config import RoutingConfig


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class ModelConfig(ReplicaModelConfig):
    """The replicas' model and KV memory (``replicas.config.ReplicaModelConfig``) and its name
    in the API."""

    served_model_name: str | None = Field(None, description="Name in the API; None: the model.")


class ResponseStoreConfig(_Section):
    """Bounds of the responses ``/v1/responses`` keeps (``cluster.api.responses.store``)."""

    max_responses: int = Field(
        4096, ge=0, description="Most stored responses over all API keys (0: store none)."
    )
    max_bytes: int = Field(
        256 * 2**20, ge=0, description="Most bytes of stored responses over all API keys."
    )
    ttl_s: float = Field(
        3600.0, gt=0, description="Seconds a stored response lives after it was created."
    )


class ServerConfig(_Section):
    host: str = Field("127.0.0.1", description="Address the HTTP server binds.")
    port: int = Field(8000, ge=0, le=65535, description="HTTP port (0 picks a free one).")
    api_key: str | list[str] | None = Field(
        None,
        description="Bearer key (or list of keys) required on every endpoint "
        "but /health (and /metrics when metrics_public); stored responses are kept per key.",
    )
    responses: ResponseStoreConfig = Field(
        default_factory=ResponseStoreConfig, description="Stored responses of /v1/responses."
    )
    metrics_public: bool = Field(True, description="Serve /metrics without the API key.")
    max_request_body_bytes: int = Field(1 * 2**20, ge=1024, description="Largest request body.")
    max_tokens_limit: int | None = Field(None, ge=1, description="Cap on a request's max_tokens.")
    max_waiting_requests: int = Field(
        256, ge=1, description="Requests queued per replica before new ones get HTTP 429."
    )
    max_resumes: int = Field(
        2,
        ge=0,
        description="Times a request whose replica is lost after its first output is resumed "
        "on a live replica from the output already sent (0: it fails with replica_failed).",
    )
    drain_timeout_s: float = Field(
        30.0,
        ge=0,
        description="A scale-in waits this long for the removed replica's running and queued "
        "requests to finish; then its queued ones are routed again elsewhere (its running "
        "ones, bounded by max_tokens, still finish there).",
    )
    warm_start_budget_s: float = Field(
        10.0,
        ge=0,
        description="A replica added to a running deployment loads its node's disk-tier blocks, "
        "then (with the peer tier) its peers' hottest blocks, into its host tier for at most "
        "this long before it takes traffic; with the peer tier, a scale-in's survivor pulls the "
        "removed replica's hottest blocks for at most this long too.",
    )
    disk_write_budget_s: float = Field(
        10.0,
        ge=0,
        description="A replica removed by a scale-in writes its hot blocks to its node's disk "
        "tier for at most this long before it exits.",
    )
    keep_alive_s: float = Field(
        30.0,
        gt=0,
        description="An idle keep-alive connection is closed after this long. Longer than "
        "clients keep theirs (httpx, under the openai client, 5 s), so that no client sends a "
        "request on a connection the server is closing.",
    )
    watchdog_stall_s: float | None = Field(
        2.0,
        gt=0,
        description="An HTTP event loop that does not answer for this long is logged with "
        "every thread's stack and counted in /health; None turns the watchdog off.",
    )

    @field_validator("api_key")
    @classmethod
    def _check_api_keys(cls, value: str | list[str] | None) -> str | list[str] | None:
        keys = [value] if isinstance(value, str) else value or []
        if isinstance(value, list) and not value:
            raise ValueError("api_key: give at least one key, or none (null) for an open server")
        if any(not key for key in keys):
            raise ValueError("api_key: a key must not be empty")
        return value


class RayConfig(_Section):
    address: str | None = Field(
        None, description="Existing cluster to join; None starts an embedded local Ray."
    )
    num_cpus: float | None = Field(
        None, gt=0, description="CPUs of the embedded local Ray; None: every CPU of this machine."
    )
    namespace: str = Field("strata", description="Ray namespace of Strata's actors.")
    cpus_per_replica: float | None = Field(
        None,
        ge=0,
        description="CPUs reserved per replica actor; it computes with one torch thread per "
        "whole CPU (at least one). None: the Ray cluster's available CPUs shared evenly among "
        "the replicas (one left for the HTTP front and router when there are 8 or more), "
        "one per replica on GPUs.",
    )
    gpus_per_replica: float | None = Field(
        None,
        ge=0,
        description="GPUs reserved per replica actor; None: one each when the Ray cluster has "
        "a GPU for every replica and the model's device is auto or cuda, else none.",
    )
    resources_per_replica: dict[str, float] = Field(
        default_factory=dict, description="Custom resources per replica, e.g. {'NPU': 1}."
    )
    placement_strategy: Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"] = Field(
        "PACK", description="How replicas are placed over nodes."
    )
    replica_max_restarts: int = Field(
        -1, ge=-1, description="Ray restarts of a crashed replica (-1: unlimited)."
    )
    scale_out_wait_s: float = Field(
        600.0,
        ge=0,
        allow_inf_nan=False,
        description="A scale-out needing more than the Ray cluster can place now reserves its "
        "placement groups anyway (the demand Ray's autoscaler sees) and waits up to this long "
        "for Ray to place them, on a cluster that can grow (joined by address); past it the "
        "scale-out is refused and changes nothing. 0, or a Ray instance local to this machine "
        "(the embedded one): refused at once.",
    )
    use_for_one_replica: bool = Field(
        False,
        description="Deploy on Ray even with data_parallel_size 1, so that the deployment can "
        "be resized (LLM.scale); otherwise the offline LLM runs one replica in-process. "
        "strata serve always deploys on Ray.",
    )


class ScalingConfig(_Section):
    """The autoscaling policy (``cluster.autoscale``), opt-in. Names and meanings follow Ray
    Serve's ``autoscaling_config`` where they mean the same; its target is Strata's own: the
    predicted queueing seconds of a request (``target_queue_s``) in place of Ray Serve's
    ``target_ongoing_requests``."""

    min_replicas: int = Field(1, ge=1, description="Fewest replicas the policy scales in to.")
    max_replicas: int = Field(1, ge=1, description="Most replicas the policy scales out to.")
    target_queue_s: float = Field(
        2.0,
        gt=0,
        description="Predicted seconds a new request queues before its prefill starts, "
        "averaged over the live replicas: above it the policy scales out.",
    )
    downscale_queue_fraction: float = Field(
        0.25,
        ge=0,
        lt=1,
        description="Hysteresis: the policy scales in only while the predicted queueing on one "
        "replica fewer stays under this fraction of target_queue_s.",
    )
    metrics_interval_s: float = Field(
        5.0, gt=0, description="Seconds between two reads of the replicas' stats."
    )
    look_back_period_s: float = Field(
        30.0, gt=0, description="Seconds of stats the predicted queueing is averaged over."
    )
    upscale_delay_s: float = Field(
        30.0,
        ge=0,
        description="Seconds the averaged queueing must stay above target before scaling out.",
    )
    downscale_delay_s: float = Field(
        600.0, ge=0, description="Seconds the replicas must stay idle before scaling in."
    )
    upscaling_factor: float | None = Field(
        None,
        gt=0,
        description="Multiplies each scale-out step (at least one replica); None: 1.",
    )
    downscaling_factor: float | None = Field(
        None,
        gt=0,
        description="Multiplies each scale-in step (at least one replica); None: 1.",
    )
    cooldown_s: float = Field(
        60.0,
        ge=0,
        description="Seconds after a resize completes before the policy decides again.",
    )

    @model_validator(mode="after")
    def _check_bounds(self) -> "ScalingConfig":
        if self.max_replicas < self.min_replicas:
            raise ValueError(
                f"scaling.max_replicas ({self.max_replicas}) must be at least "
                f"scaling.min_replicas ({self.min_replicas})"
            )
        return self


class ClusterConfig(_Section):
    data_parallel_size: int = Field(1, ge=1, description="Number of replicas.")
    model: ModelConfig = Field(default_factory=ModelConfig)
    scheduler: SchedulerConfig = Field(default_factory=SchedulerConfig)
    routing: RoutingConfig = Field(default_factory=RoutingConfig)
    server: ServerConfig = Field(default_factory=ServerConfig)
    ray: RayConfig = Field(default_factory=RayConfig)
    scaling: ScalingConfig | None = Field(
        None, description="Autoscaling between min and max replicas; None: a fixed size."
    )

    @model_validator(mode="after")
    def _sync_routing(self) -> "ClusterConfig":
        enabled = self.scheduler.prefix_cache_config.enabled
        if self.routing.enable_prefix_caching != enabled:
            self.routing = self.routing.model_copy(update={"enable_prefix_caching": enabled})
        return self

    @model_validator(mode="after")
    def _check_scaling(self) -> "ClusterConfig":
        scaling = self.scaling
        if scaling and not scaling.min_replicas <= self.data_parallel_size <= scaling.max_replicas:
            raise ValueError(
                f"data_parallel_size ({self.data_parallel_size}) must lie between "
                f"scaling.min_replicas ({scaling.min_replicas}) and scaling.max_replicas "
                f"({scaling.max_replicas})"
            )
        return self

    @classmethod
    def from_yaml(cls, path: str | Path) -> "ClusterConfig":
        path = Path(path)
        if not path.is_file():
            raise ValueError(f"--config {path}: no such file")
        data = yaml.safe_load(path.read_text()) or {}
        if not isinstance(data, dict):
            raise ValueError(f"--config {path}: expected a mapping at the top level")
        return cls.model_validate(data)

    @property
    def served_model_name(self) -> str:
        return self.model.served_model_name or self.model.model

    def engine_config(self) -> EngineConfig:
        """One replica's engine config, with its share of the host budget. Reads the model's
        config (not its weights) and raises ``ValueError`` if the share holds no block."""
        args, _ = load_model_info(self.model.model, self.model.revision)
        specs = kv_cache_specs(args, self.model.dtype, self.model.kv_cache_dtype)
        block_bytes = sum(s.block_bytes(self.model.block_size) for s in specs.values())
        offload = plan_replica_offload(
            self.scheduler.kv_offload_config, self.data_parallel_size, block_bytes
        )
        return EngineConfig(
            **{name: getattr(self.model, name) for name in ReplicaModelConfig.model_fields},
            scheduler_config=self.scheduler.model_copy(update={"kv_offload_config": offload}),
        )
