"""The latency histogram's bucket bounds (a neutral leaf module, imported by both recorders).

`tokencapture.metrics` counts each operation's latency into these buckets, and
`tokencapture._otel` hands the same bounds to OpenTelemetry as the duration histogram's bucket
advice, so the two agree bucket for bucket. A leaf, so neither recorder imports the other's
module for it (`metrics` loads `_otel`, never the reverse). Re-exported as
`tokencapture.metrics.BUCKET_BOUNDS_SECONDS`.
"""

from __future__ import annotations

__all__ = ["BUCKET_BOUNDS_SECONDS"]

BUCKET_BOUNDS_SECONDS: tuple[float, ...] = tuple(16e-6 * 2**i for i in range(21))
"""Upper bounds of the histogram buckets: 16 µs doubling up to ~17 s, then +inf."""
