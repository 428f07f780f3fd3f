"""The OpenAI-compatible server (FastAPI + uvicorn). Importing this package is light;
the FastAPI app is built by ``api_server.build_app``."""

__all__ = ["api_server", "errors", "metrics", "protocol"]
