"""The HTTP layer: an OpenAI-compatible FastAPI app over the engine (see :func:`create_app`)."""

from .app import create_app
from .async_engine import AsyncEngine, EngineDeadError, EngineStepError, RequestAbortedError, RequestStream
from .server_thread import ServerThread
from .settings import ServerSettings

__all__ = [
    "AsyncEngine",
    "EngineDeadError",
    "EngineStepError",
    "RequestAbortedError",
    "RequestStream",
    "ServerSettings",
    "ServerThread",
    "create_app",
]
