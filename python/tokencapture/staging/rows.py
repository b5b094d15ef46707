"""`tokencapture.staging_rows` under its public path.

It holds what every staging backend shares above the Rust core; code inside tokencapture imports
`tokencapture.staging_rows` itself.
"""

from tokencapture.staging_rows import *  # noqa: F403
from tokencapture.staging_rows import __all__ as __all__
