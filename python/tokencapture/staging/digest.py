"""`tokencapture.staging_digest` under its public path.

It holds NeMo Gym's staging digests, computed natively; code inside tokencapture imports
`tokencapture.staging_digest` itself.
"""

from tokencapture.staging_digest import *  # noqa: F403
from tokencapture.staging_digest import __all__ as __all__
