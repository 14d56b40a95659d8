"""Understanding a request: OpenAI bodies, session keys, prefix block hashes (pure, no I/O)."""

from extproc.request.features import FeatureSettings, RequestFeatures, extract_features
from extproc.request.openai_body import BodyError, OpenAIRequest, parse_request_body
from extproc.request.prefix import block_hashes, model_seed
from extproc.request.session import SessionSource, session_key

__all__ = [
    "BodyError",
    "FeatureSettings",
    "OpenAIRequest",
    "RequestFeatures",
    "SessionSource",
    "block_hashes",
    "extract_features",
    "model_seed",
    "parse_request_body",
    "session_key",
]
