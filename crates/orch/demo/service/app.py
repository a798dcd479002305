"""A tiny HTTP service that orch's demo drives through its pipeline.

GET /health answers 200 when the service is healthy; GET /revision names the deployed commit.
"""
import json
import os
import sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

REVISION = os.environ.get("APP_REVISION", "dev")
ENV = os.environ.get("APP_ENV", "dev")


def health():
    return 200, {"status": "ok", "env": ENV}


def revision():
    return 200, {"revision": REVISION}


ROUTES = {
    "/health": health,
    "/revision": revision,
}


class Handler(BaseHTTPRequestHandler):
    def do_GET(self):
        route = ROUTES.get(self.path)
        code, body = route() if route else (404, {"error": "not found"})
        data = json.dumps(body).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):
        pass


def main():
    port = int(sys.argv[1])
    ThreadingHTTPServer(("127.0.0.1", port), Handler).serve_forever()


if __name__ == "__main__":
    main()
