"""`tokencapture.staging_errors` under its public path.

It holds the staging stores' exceptions; code inside tokencapture imports
`tokencapture.staging_errors` itself.
"""

from tokencapture.staging_errors import *  # noqa: F403
from tokencapture.staging_errors import __all__ as __all__
