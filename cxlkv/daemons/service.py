"""What a daemon of cxlkv does as a service: its log lines (text or one JSON
object a line, on stderr) and its state reports to systemd (Type=notify)."""
from __future__ import annotations

import json
import logging
import os
import socket
import sys
import time


class _JsonFormatter(logging.Formatter):
    def format(self, record):
        doc = {"ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
               + f".{int(record.msecs):03d}Z", "level": record.levelname.lower(),
               "msg": record.getMessage()}
        doc.update(getattr(record, "fields", {}))
        return json.dumps(doc, default=str)


class _TextFormatter(logging.Formatter):
    def format(self, record):
        f = getattr(record, "fields", {})
        extra = "".join(f" {k}={v}" for k, v in f.items())
        lvl = "" if record.levelno == logging.INFO else f"{record.levelname.lower()}: "
        return f"cxlkv serve: {lvl}{record.getMessage()}{extra}"


def make_logger(log_json: bool, stream=None) -> logging.Logger:
    log = logging.getLogger(f"cxlkv.serve.{id(stream)}")
    log.handlers.clear()
    h = logging.StreamHandler(stream or sys.stderr)
    h.setFormatter(_JsonFormatter() if log_json else _TextFormatter())
    log.addHandler(h)
    log.setLevel(logging.INFO)
    log.propagate = False
    return log


def sd_notify(state: str) -> None:
    """Tell systemd (Type=notify) our state; a no-op outside systemd."""
    addr = os.environ.get("NOTIFY_SOCKET")
    if not addr:
        return
    if addr[0] == "@":
        addr = "\0" + addr[1:]
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
            s.connect(addr)
            s.sendall(state.encode())
    except OSError:
        pass
