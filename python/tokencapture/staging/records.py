"""`tokencapture.staging_records` under its public path.

It holds the staging and capture-ledger wire models; code inside tokencapture imports
`tokencapture.staging_records` itself.
"""

from tokencapture.staging_records import *  # noqa: F403
from tokencapture.staging_records import __all__ as __all__
