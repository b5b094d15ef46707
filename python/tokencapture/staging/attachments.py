"""`tokencapture.staging_attachments` under its public path.

It holds how every staging backend encodes attachments; code inside tokencapture imports
`tokencapture.staging_attachments` itself.
"""

from tokencapture.staging_attachments import *  # noqa: F403
from tokencapture.staging_attachments import __all__ as __all__
