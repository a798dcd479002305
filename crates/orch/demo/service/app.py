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
    server = ThreadingHTTPServer(("127.0.0.1", port), Handler)
    # The moment this release starts serving is the deploy's (or rollback's) effect: logged by
    # the service itself, so a deploy script killed after starting it still counts once.
    effect, log = os.environ.get("APP_EFFECT"), os.environ.get("APP_EFFECT_LOG")
    if effect and log:
        with open(log, "a") as f:
            f.write(f"{effect} {ENV} {REVISION}\n")
    server.serve_forever()


if __name__ == "__main__":
    main()
