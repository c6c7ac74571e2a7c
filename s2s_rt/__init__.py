"""s2s-rt: a self-hosted, OpenAI-Realtime-compatible speech-to-speech server."""

from s2s_rt.config import Config, load_config
from s2s_rt.server import Server

__all__ = ["Config", "Server", "load_config"]
__version__ = "0.1.0"
