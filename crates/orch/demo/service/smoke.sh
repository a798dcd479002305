#!/bin/sh
# smoke.sh PORT: the staging smoke check: /health must answer 200.
python3 -c "import urllib.request; r = urllib.request.urlopen('http://127.0.0.1:$1/health', timeout=2); assert r.status == 200"
