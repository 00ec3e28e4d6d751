"""The tuning hint: one log line per cache type reading the miss-ratio curve."""

from replicas.kv.retention.adaptive import ADAPTIVE
from replicas.kv.retention.curve import CAPACITY_FACTORS, ShadowKey
from replicas.kv.retention.fixed import OFF, ON
from replicas.kv.retention.tracker import RetentionStats

NOTABLE_POINTS = 1.0
"""Hit-rate points (of prompt tokens) below which the hint calls a difference negligible."""


def estimated_hit_rates(stats: RetentionStats, num_query_tokens: int) -> dict[ShadowKey, float]:
    """Host hit rate (host-served tokens / prompt tokens) at each point of the curve."""
    if num_query_tokens <= 0:
        return {}
    return {
        key: tokens / num_query_tokens for key, tokens in stats.estimated_host_hit_tokens.items()
    }


_POLICY_NAMES = {OFF: "write-back off", ON: "write-back on", ADAPTIVE: "adaptive retention"}


def tuning_hint(
    cache_type: str,
    stats: RetentionStats,
    num_query_tokens: int,
    policy: str,
) -> str | None:
    """One line for the server log: the curve, and which step of the tuning sequence (write-back
    first, then more host memory, then a higher threshold or less host memory) the traffic
    since start-up supports. ``policy``: the running policy's ``curve_name`` (OFF, ON, ADAPTIVE,
    ...). None before any query."""
    rates = estimated_hit_rates(stats, num_query_tokens)
    current = rates.get(ShadowKey(1.0, policy))
    if current is None:
        return None

    def points(key: ShadowKey) -> float | None:
        rate = rates.get(key)
        return None if rate is None else 100 * (rate - current)

    off, on = points(ShadowKey(1.0, OFF)), points(ShadowKey(1.0, ON))
    more = {f: points(ShadowKey(f, policy)) for f in CAPACITY_FACTORS}
    curve = ", ".join(
        f"{f:g}x {'+' if p >= 0 else ''}{p:.1f}" for f, p in more.items() if p is not None
    )
    parts = [
        f"host tier [{cache_type}] ({_POLICY_NAMES.get(policy, policy)}): host hit rate "
        f"{100 * current:.1f}% of {num_query_tokens} prompt tokens; points of hit rate with "
        f"other host memory: {curve}",
        f"ghost hits: {stats.ghost_hits_dropped} blocks dropped without a host copy, "
        f"{stats.ghost_hits_host_evicted} evicted from host",
    ]
    served = stats.estimated_host_hit_tokens
    if policy == OFF and on is not None and on >= NOTABLE_POINTS:
        now, then = served[ShadowKey(1.0, OFF)], served[ShadowKey(1.0, ON)]
        more_served = f"{100 * (then / now - 1):.0f}% more" if now else f"{then} prompt tokens"
        advice = (
            f"write-back would have served {more_served} from host (+{on:.1f} points): try "
            "--experimental-kv-offload-write-back or --experimental-kv-offload-retention adaptive"
        )
    elif more.get(2.0) is not None and more[2.0] >= NOTABLE_POINTS:
        advice = f"2x host memory would add {more[2.0]:.1f} points of hit rate: raise it"
    elif policy == ON and off is not None and off >= NOTABLE_POINTS:
        advice = (
            f"write-back costs {off:.1f} points (blocks evicted once crowd out reused ones): "
            "turn it off, raise the write-through threshold, or try adaptive retention"
        )
    elif more.get(0.5) is not None and -more[0.5] < NOTABLE_POINTS / 2 and current > 0:
        advice = "half the host memory would serve as much: this traffic needs less"
    else:
        advice = "the current settings fit this traffic"
    return "; ".join([*parts, advice])
