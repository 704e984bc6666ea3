from __future__ import annotations

import sys

from server.cli import serve_main

if __name__ == "__main__":
    sys.exit(serve_main(sys.argv[1:]))
