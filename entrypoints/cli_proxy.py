"""``halserve proxy --prefill URL --decode URL``: disaggregated prefill behind one OpenAI endpoint
(``disagg_proxy.py``). Run the prefill servers with a KV connector in role ``kv_producer`` and the
decode servers with the same connector in role ``kv_consumer``."""
from __future__ import annotations

import argparse
from typing import Any


def add_parser(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "proxy", help="disaggregated prefill: one endpoint over prefill and decode servers",
        description="Sends each completion/chat request to a prefill server cut to one token (its KV connector "
        "saves the prompt's K/V), then to a decode server (whose connector loads it) and returns that reply.",
    )
    p.add_argument("--prefill", action="append", required=True, metavar="URL",
                   help="a prefill server (kv_role kv_producer), e.g. http://10.0.0.1:8100; repeat for several")
    p.add_argument("--decode", action="append", required=True, metavar="URL",
                   help="a decode server (kv_role kv_consumer); repeat for several")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--timeout", type=float, default=600.0, help="seconds to wait for a server's reply")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error", "critical"])
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import uvicorn

    from halserve.entrypoints.disagg_proxy import build_proxy_app

    urls = [u.rstrip("/") for u in (*args.prefill, *args.decode)]
    bad = [u for u in urls if not u.startswith(("http://", "https://"))]
    if bad:
        print(f"halserve proxy: error: server URLs must start with http:// or https://: {', '.join(bad)}")
        return 2
    app = build_proxy_app([u.rstrip("/") for u in args.prefill], [u.rstrip("/") for u in args.decode],
                          timeout=args.timeout)
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level)
    return 0
