"""A small HTTP file server for the streaming tests and bench/data/streaming_data.py: Range
requests (Python's http.server ignores them), directory listings that fsspec can glob, and a count
of the body bytes it sent per file, so a test can say exactly what a job fetched. `fail_after`
makes every data request after that many fail with 500 (a storage outage, for the failure tests);
`held`, an Event, makes every data request wait until it is set (storage that stalls). A HEAD
answers the size and an ETag digested from the content, as object stores do."""
import hashlib
import html
import re
import threading
from collections import defaultdict
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Dict, List, Optional, Tuple
from urllib.parse import unquote

RANGE = re.compile(r"bytes=(\d*)-(\d*)$")


class RangeServer:
    """Serves `root` on 127.0.0.1 until `close()`; `url` is its base (no trailing slash)."""

    def __init__(self, root: Path):
        self.root = Path(root)
        self.lock = threading.Lock()
        self.sent: Dict[str, int] = defaultdict(int)
        self.requests: List[Tuple[str, int, int]] = []  # (path, first byte, end) of every body sent
        self.fail_after: Optional[int] = None
        self.held: Optional[threading.Event] = None
        self.lookups = 0  # HEAD requests and directory listings: the start-up's questions about files
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def _file(self) -> Optional[Path]:
                path = (server.root / unquote(self.path.split("?")[0]).lstrip("/")).resolve()
                return path if str(path).startswith(str(server.root.resolve())) and path.exists() else None

            def do_HEAD(self):
                with server.lock:
                    server.lookups += 1
                path = self._file()
                if path is None or path.is_dir():
                    self.send_response(404 if path is None else 200)
                    self.end_headers()
                    return
                self.send_response(200)
                self.send_header("Content-Length", str(path.stat().st_size))
                self.send_header("Accept-Ranges", "bytes")
                self.send_header("ETag", f'"{server.etag(path)}"')
                self.end_headers()

            def do_GET(self):
                path = self._file()
                if path is None:
                    self.send_error(404)
                    return
                if path.is_dir():
                    with server.lock:
                        server.lookups += 1
                    links = "".join(f'<a href="{html.escape(p.name)}">{html.escape(p.name)}</a>\n'
                                    for p in sorted(path.iterdir()))
                    body = f"<html><body>\n{links}</body></html>".encode()
                    self.send_response(200)
                    self.send_header("Content-Type", "text/html")
                    self.send_header("Content-Length", str(len(body)))
                    self.end_headers()
                    self.wfile.write(body)
                    return
                with server.lock:
                    failing = server.fail_after is not None and len(server.requests) >= server.fail_after
                if failing:
                    self.send_error(500, "storage outage (tests/helpers/range_server.py fail_after)")
                    return
                held = server.held
                if held is not None:
                    held.wait()
                size = path.stat().st_size
                start, end, status = 0, size, 200
                match = RANGE.match(self.headers.get("Range", ""))
                if match:
                    first, last = match.groups()
                    if first == "":
                        start, end = max(0, size - int(last)), size
                    else:
                        start, end = int(first), min(size, int(last) + 1 if last else size)
                    status = 206
                with open(path, "rb") as f:
                    f.seek(start)
                    body = f.read(end - start)
                # Counted before the body goes out: a client that has its bytes finds them counted
                # (counted after, a test's snapshot taken as the client moved on could miss them).
                with server.lock:
                    name = str(path.relative_to(server.root.resolve()))
                    server.sent[name] += len(body)
                    server.requests.append((name, start, start + len(body)))
                self.send_response(status)
                self.send_header("Content-Length", str(len(body)))
                self.send_header("Accept-Ranges", "bytes")
                if status == 206:
                    self.send_header("Content-Range", f"bytes {start}-{end - 1}/{size}")
                self.end_headers()
                self.wfile.write(body)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    @staticmethod
    def etag(path: Path) -> str:
        """A digest of the file's bytes, as S3's ETag of a single-part object (an MD5 of the content):
        content rewritten at the same size and mtime gets another (digested at each HEAD, no cache
        that an mtime set back would fool)."""
        return hashlib.md5(path.read_bytes()).hexdigest()

    def reset(self) -> None:
        with self.lock:
            self.sent.clear()
            self.requests.clear()
            self.lookups = 0

    def total(self) -> int:
        with self.lock:
            return sum(self.sent.values())

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


if __name__ == "__main__":  # python tests/helpers/range_server.py DIR: serve DIR (for the benchmark's launched jobs)
    import sys
    import time
    server = RangeServer(Path(sys.argv[1]))
    print(server.url, flush=True)
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        server.close()
